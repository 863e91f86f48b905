//! Opening a cache file for serving and full recovery of an empty cache,
//! through the public API: the exact messages the command line prints
//! (an error and its causes, as `vdcache-host::error::chain` joins them),
//! and nothing left behind by a refused start.

use vdcache_cache::CacheConfig;
use vdcache_host::error::chain;
use vdcache_host::{FullRecovery, HostError, open_cache_file, recover_full_at};

const MIB: u64 = 1 << 20;

fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_missing_cache_without_a_size_is_refused_and_nothing_is_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cache.img");
    let e = open_cache_file(&path, None, CacheConfig::default(), false).expect_err("no size");
    assert!(matches!(e, HostError::NoSizeToCreate(_)), "{e:?}");
    assert_eq!(
        chain(&e),
        format!(
            "cache {} does not exist; give its size (--cache-size) to create it",
            path.display()
        )
    );
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn a_cache_file_is_created_once_and_keeps_its_size() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cache.img");
    let (cache, created) =
        open_cache_file(&path, Some(64 * MIB), CacheConfig::default(), false).expect("create");
    assert!(created);
    cache.shutdown(false).expect("shutdown");
    drop(cache);
    assert_eq!(entries(dir.path()), ["cache.img"]);
    assert_eq!(std::fs::metadata(&path).expect("stat").len(), 64 * MIB);

    let e = open_cache_file(&path, Some(32 * MIB), CacheConfig::default(), false)
        .expect_err("other size");
    assert_eq!(
        chain(&e),
        format!(
            "cache {} is {} bytes, but its size was given as {} bytes; a cache keeps the size it was created with (omit --cache-size to use it, or remove the file to create a new cache; `vdcache recover --full` writes its dirty data back first)",
            path.display(),
            64 * MIB,
            32 * MIB
        )
    );
    let (cache, created) =
        open_cache_file(&path, None, CacheConfig::default(), false).expect("reopen");
    assert!(!created);
    cache.shutdown(false).expect("shutdown");
}

#[test]
fn a_cache_too_small_to_format_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cache.img");
    let e = open_cache_file(&path, Some(4096), CacheConfig::default(), false).expect_err("tiny");
    assert!(matches!(e, HostError::Format { .. }), "{e:?}");
    assert!(
        chain(&e).starts_with(&format!("cannot format cache {}: ", path.display())),
        "{}",
        chain(&e)
    );
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

#[test]
fn a_file_holding_something_else_is_refused_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    let content = vec![0x5a_u8; 16 * MIB as usize];
    std::fs::write(&path, &content).expect("write");
    let e = open_cache_file(&path, None, CacheConfig::default(), false).expect_err("not blank");
    assert_eq!(
        chain(&e),
        format!(
            "cache {}: it has no vdcache superblock but holds data that is not a vdcache cache; nothing was changed: name another path for the cache",
            path.display(),
        )
    );
    // Nor with --format-cache: a regular file that is not a cache is not
    // vdcache's to format.
    let e = open_cache_file(&path, None, CacheConfig::default(), true).expect_err("not ours");
    assert!(matches!(e, HostError::FormatRefused { .. }), "{e:?}");
    assert!(std::fs::read(&path).expect("read") == content);
    // A qcow2 image, whatever else it holds.
    let mut image = content.clone();
    image[..4].copy_from_slice(b"QFI\xfb");
    std::fs::write(&path, &image).expect("write");
    let e = open_cache_file(&path, None, CacheConfig::default(), true).expect_err("an image");
    assert!(chain(&e).contains("a qcow2 image"), "{}", chain(&e));
    assert!(std::fs::read(&path).expect("read") == image);
}

/// A new, clean, closed cache of 64 MiB at `path`.
fn clean_cache(path: &std::path::Path) {
    let (cache, _) =
        open_cache_file(path, Some(64 * MIB), CacheConfig::default(), false).expect("create");
    cache.shutdown(false).expect("shutdown");
}

#[test]
fn format_cache_formats_a_cache_only_without_dirty_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cache.img");
    clean_cache(&path);
    // A clean cache is formatted again (a new id).
    let id = |p: &std::path::Path| std::fs::read(p).expect("read")[16..32].to_vec();
    let before = id(&path);
    let (cache, created) =
        open_cache_file(&path, None, CacheConfig::default(), true).expect("format a clean cache");
    assert!(!created);
    cache.shutdown(false).expect("shutdown");
    drop(cache);
    assert_ne!(id(&path), before, "not formatted");
}

#[test]
fn full_recovery_of_an_empty_cache_writes_nothing_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cache.img");
    clean_cache(&path);
    let done = recover_full_at(&path, &FullRecovery::default()).expect("recover");
    assert!(done.is_empty(), "{done:?}");
    let missing = dir.path().join("absent.img");
    let e = recover_full_at(&missing, &FullRecovery::default()).expect_err("absent");
    assert_eq!(
        chain(&e),
        format!(
            "cannot open cache {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
}
