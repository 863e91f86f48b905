//! Opening a cache device for serving: a missing cache file created and
//! formatted whole or not at all, an existing one checked against the
//! size asked for, then opened (fast recovery) or, when it holds nothing,
//! formatted. What the daemon does at start, and the crash harness after
//! every crash.
//!
//! This module decides only how a device becomes a serving cache. It
//! must not open images (that is the caller's or [`crate::recovery`]'s).

use crate::error::{HostError, Result};
use std::path::Path;
use std::sync::Arc;
use vdcache_backend::{Backend, BackendRef, FileBackend, FileOptions, LockMode};
use vdcache_cache::{CacheConfig, CacheError, DeviceContent, FlashCache};

/// Opens `device` as a serving cache: its index recovered (fast
/// recovery), or formatted when it holds nothing or only what a format cut
/// short left. A device that holds something but no cache is refused
/// unless `format_anyway`, which formats a cache without dirty data, or a
/// damaged one, in its place (see [`FlashCache::format_over`]; what else a
/// device may hold to be formatted is [`check_formattable`]'s to say).
pub fn open_for_serving(
    device: BackendRef,
    cfg: CacheConfig,
    format_anyway: bool,
) -> std::result::Result<Arc<FlashCache>, CacheError> {
    if format_anyway {
        FlashCache::format_over(device, cfg)
    } else {
        FlashCache::open_or_format(device, cfg)
    }
}

/// Refuses to format what vdcache cannot recognise as its own: a qcow2
/// image or a file system anywhere, and on a regular file anything but a
/// cache (whole or damaged) or zeros. A block device that holds something
/// else is the operator's to give (as `mkfs` takes one).
pub fn check_formattable(path: &Path, device: &dyn Backend) -> Result<()> {
    let refuse = |what: &str| HostError::FormatRefused {
        path: path.to_path_buf(),
        what: what.to_string(),
    };
    let mut head = vec![0u8; 4096];
    device
        .read_at(&mut head, 0)
        .map_err(|source| HostError::Stat {
            path: path.to_path_buf(),
            source,
        })?;
    if head.starts_with(b"QFI\xfb") {
        return Err(refuse("a qcow2 image"));
    }
    if head[EXT_MAGIC_AT..EXT_MAGIC_AT + 2] == [0x53, 0xef] {
        return Err(refuse("an ext2/3/4 file system"));
    }
    let content = FlashCache::probe_content(device).map_err(|source| HostError::Cache {
        device: path.display().to_string(),
        source,
    })?;
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    if content == DeviceContent::Other && regular {
        return Err(refuse(
            "data that is not a vdcache cache (vdcache formats a regular file only when it is one of its caches)",
        ));
    }
    Ok(())
}

/// What a user may do about a device that holds something but no cache.
fn formatting_hint(path: &Path, device: &dyn Backend) -> &'static str {
    if check_formattable(path, device).is_err() {
        return "name another path for the cache";
    }
    match FlashCache::probe_content(device) {
        Ok(DeviceContent::DamagedCache) => {
            "if what it held is not needed, --format-cache formats it over (images that needed it stay marked as needing it)"
        }
        _ => "if what it holds is not needed, --format-cache formats it",
    }
}

/// Where an ext2/3/4 superblock keeps its magic number.
const EXT_MAGIC_AT: usize = 1024 + 56;

/// Opens the cache device at `path` for serving, or creates and formats a
/// cache file there.
///
/// A new file is built under a temporary name and renamed into place only
/// once formatted, so a failure (a size below the minimum, a full disk)
/// leaves nothing behind. An existing cache keeps the size it was created
/// with: `size` must then match it or be absent. A device that holds
/// something but no cache is refused unless `format_anyway`. Returns the
/// cache and whether this call created its file.
pub fn open_cache_file(
    path: &Path,
    size: Option<u64>,
    cfg: CacheConfig,
    format_anyway: bool,
) -> Result<(Arc<FlashCache>, bool)> {
    let created = std::fs::symlink_metadata(path).is_err();
    if created {
        let size = size.ok_or_else(|| HostError::NoSizeToCreate(path.to_path_buf()))?;
        create_cache_file(path, size, cfg.clone())?;
        tracing::debug!("created cache file {} ({size} bytes)", path.display());
    }
    let opened = (|| {
        let device = open_device(path)?;
        check_requested_size(path, &*device, size)?;
        if format_anyway {
            check_formattable(path, &*device)?;
        }
        open_for_serving(device.clone(), cfg, format_anyway).map_err(|source| match source {
            CacheError::NotBlank { what, .. } => HostError::NotACache {
                path: path.to_path_buf(),
                what,
                hint: formatting_hint(path, &*device),
            },
            source => HostError::Cache {
                device: path.display().to_string(),
                source,
            },
        })
    })();
    if opened.is_err() && created {
        remove_created_cache(path);
    }
    Ok((opened?, created))
}

/// Removes a cache file this run created, once what it was for failed: a
/// refused start leaves no new file behind.
pub fn remove_created_cache(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        tracing::warn!("cannot remove the new cache {}: {e}", path.display());
    }
}

/// An existing cache file must be the size asked for, if one was asked
/// for: a size that does not apply is an error, never silently ignored.
fn check_requested_size(path: &Path, device: &dyn Backend, size: Option<u64>) -> Result<()> {
    let Some(want) = size else { return Ok(()) };
    let is_file = std::fs::metadata(path)
        .map(|m| m.file_type().is_file())
        .unwrap_or(false);
    if !is_file {
        return Err(HostError::NotAFile(path.to_path_buf()));
    }
    let have = device.len().map_err(|source| HostError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    if have != want {
        return Err(HostError::SizeMismatch {
            path: path.to_path_buf(),
            have,
            want,
        });
    }
    Ok(())
}

/// Creates a formatted cache file of `size` bytes at `path`, complete or
/// not at all.
fn create_cache_file(path: &Path, size: u64, cfg: CacheConfig) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| HostError::NoFileName(path.to_path_buf()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".creating.{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let built = (|| -> Result<()> {
        let create = |source| HostError::Create {
            path: path.to_path_buf(),
            source,
        };
        let f = std::fs::File::create_new(&tmp).map_err(create)?;
        allocate(&f, size).map_err(|source| HostError::Resize {
            path: path.to_path_buf(),
            size,
            free: free_space(&tmp),
            source,
        })?;
        drop(f);
        let format = |source| HostError::Format {
            path: path.to_path_buf(),
            source,
        };
        let cache = FlashCache::format(open_device(&tmp)?, cfg).map_err(format)?;
        cache.shutdown(false).map_err(format)?;
        drop(cache);
        vdcache_ownership::publish_new_file(&tmp, path).map_err(|source| HostError::Publish {
            path: path.to_path_buf(),
            source,
        })
    })();
    if built.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    built
}

/// Sizes a new cache file with its blocks allocated, so a cache that does
/// not fit its file system is refused now rather than failing writes
/// later (a file system that cannot allocate ahead gets a sparse file).
fn allocate(f: &std::fs::File, size: u64) -> std::io::Result<()> {
    match rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), 0, size) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::OPNOTSUPP) => {
            tracing::warn!(
                "the file system cannot allocate the cache file ahead: it is created sparse, and a write may find the file system full later"
            );
            f.set_len(size)
        }
        Err(e) => Err(e.into()),
    }
}

/// Bytes free for unprivileged users on the file system holding `path`.
fn free_space(path: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(path).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Opens a cache device by its absolute path, locked for writing: images
/// record where their cache lives, for the advice their error messages
/// give. A cache file keeps its space when regions are discarded.
pub fn open_device(path: &Path) -> Result<BackendRef> {
    let path = std::fs::canonicalize(path).map_err(|e| HostError::Open {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    let device = FileBackend::open(
        &path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: false,
        },
    )
    .map_err(|e| HostError::Open {
        path: path.clone(),
        source: e.into(),
    })?;
    Ok(Arc::new(device.keeping_space()))
}

/// Makes `image` usable without the cache that held its newest data, as
/// `vdcache recover --without-cache` asks: refused while the cache its
/// mark names is still at its path (that data is not lost: full recovery
/// writes it back). Returns the cache the mark named, or `None` if the
/// image needed none.
pub fn abandon_cache(image: &Path) -> Result<Option<String>> {
    Ok(vdcache_image::abandon_cache(image, |mark| {
        cache_at(Path::new(&mark.cache_path)).is_some_and(|uuid| uuid == mark.cache_id)
    })?)
}

/// Of `images` (local files), those marked as needing the cache at
/// `cache`: what to name when that cache is refused as damaged (the
/// damage may have taken the cache's own record of them).
pub fn images_needing_cache(cache: &Path, images: &[&str]) -> Vec<String> {
    let Some(id) = cache_at(cache) else {
        return Vec::new();
    };
    images
        .iter()
        .filter(|name| crate::recovery::marked_by(&vdcache_image::LocalFiles, name, &id))
        .map(|name| name.to_string())
        .collect()
}

/// The id of the cache at `path`, if a cache is there (read only, without
/// a lock: a server may hold it).
fn cache_at(path: &Path) -> Option<[u8; 16]> {
    let device = FileBackend::open(
        path,
        FileOptions {
            read_only: true,
            lock: None,
            create: false,
        },
    )
    .ok()?;
    vdcache_cache::layout::Superblock::peek(&device).map(|sb| sb.uuid)
}
