//! The file operations of a mounted FUSE export, against a raw image whose
//! bytes the test reads directly afterwards: read, write, fsync, fallocate
//! (punch hole and zero range read back as zeros, preallocation changes
//! nothing, other modes are refused), a fixed size (truncate, writes past
//! the end and growing fallocate are refused), read-only exports, names.
//!
//! Needs root and /dev/fuse; without them it prints why and skips.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use vdcache_fuse_server::{FuseError, FuseExport, FuseServer};
use vdcache_image::{ImageFormat, OpenOptions as DiskOptions, VirtualDisk, open_chain};

const SIZE: u64 = 1 << 20;

fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .err()
        .map(|e| format!("/dev/fuse cannot be opened: {e}"))
}

fn raw_disk(path: &std::path::Path, read_only: bool) -> Arc<VirtualDisk> {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(SIZE).unwrap();
    let opts = DiskOptions {
        format: Some(ImageFormat::Raw),
        read_only,
        ..DiskOptions::default()
    };
    Arc::new(open_chain(path.to_str().unwrap(), &opts).unwrap())
}

fn fallocate(f: &std::fs::File, mode: i32, off: u64, len: u64) -> Result<(), i32> {
    // SAFETY: the descriptor is open for the call's duration; fallocate
    // reads no memory of ours.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

#[test]
fn file_operations_map_onto_the_disk() {
    if let Some(why) = unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (img, ro_img) = (dir.path().join("a.raw"), dir.path().join("ro.raw"));
    let mnt = dir.path().join("mnt");
    let server = FuseServer::mount(
        &mnt,
        vec![
            FuseExport {
                name: "a".into(),
                disk: raw_disk(&img, false),
            },
            FuseExport {
                name: "ro".into(),
                disk: raw_disk(&ro_img, true),
            },
        ],
    )
    .unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["a", "ro"]);
    assert_eq!(std::fs::metadata(mnt.join("a")).unwrap().len(), SIZE);
    let requests = server.requests();
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "listing and stat are no disk requests"
    );
    let mut expect = vec![0u8; SIZE as usize];
    {
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(mnt.join("a"))
            .unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8 + 1).collect();
        f.seek(SeekFrom::Start(1000)).unwrap();
        f.write_all(&data).unwrap();
        expect[1000..301_000].copy_from_slice(&data);
        f.sync_all().unwrap();
        // Holes and zeroed ranges read back as zeros, unaligned too.
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            5000,
            70_000,
        )
        .unwrap();
        expect[5000..75_000].fill(0);
        fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 100_001, 3).unwrap();
        expect[100_001..100_004].fill(0);
        // Preallocation inside the file changes nothing.
        fallocate(&f, 0, 0, SIZE).unwrap();
        // A punched hole past the end is cut at the end.
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            290_000,
            SIZE,
        )
        .unwrap();
        expect[290_000..].fill(0);
        assert_eq!(
            fallocate(&f, 0, SIZE - 10, 20),
            Err(libc::ENOSPC),
            "growing"
        );
        assert_eq!(
            fallocate(&f, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096),
            Err(libc::EOPNOTSUPP)
        );
        f.sync_all().unwrap();
        let mut got = Vec::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_end(&mut got).unwrap();
        assert!(got == expect, "the file reads back what was written");
        // The size is fixed.
        assert_eq!(
            f.set_len(SIZE / 2).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
        f.seek(SeekFrom::Start(SIZE - 2)).unwrap();
        assert_eq!(
            f.write_all(&[1, 2, 3, 4]).unwrap_err().raw_os_error(),
            Some(libc::ENOSPC)
        );
        assert_eq!(std::fs::metadata(mnt.join("a")).unwrap().len(), SIZE);
    }
    // Seen by the server's idle detection: at least the fallocates and
    // syncs above, one request each.
    assert!(requests.load(std::sync::atomic::Ordering::Relaxed) >= 8);
    let err = OpenOptions::new()
        .write(true)
        .open(mnt.join("ro"))
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert_eq!(
        std::fs::read(mnt.join("ro")).unwrap(),
        vec![0u8; SIZE as usize]
    );
    server.unmount().unwrap();
    // Unmounted, and the image holds exactly what the file showed.
    assert!(!mnt.join("a").exists());
    assert!(std::fs::read(&img).unwrap() == expect);
}

#[test]
fn names_that_cannot_be_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let disk = || raw_disk(&dir.path().join("x.raw"), true);
    for (names, want) in [
        (vec!["a/b"], "holds '/'"),
        (vec![".."], "are taken"),
        (
            vec!["", "default"],
            "exports '' and 'default' would both be the file 'default'",
        ),
    ] {
        let exports = names
            .iter()
            .map(|n| FuseExport {
                name: n.to_string(),
                disk: disk(),
            })
            .collect();
        let err = FuseServer::mount(&dir.path().join("mnt"), exports)
            .err()
            .unwrap();
        assert!(matches!(
            err,
            FuseError::BadName { .. } | FuseError::SameFile { .. }
        ));
        assert!(err.to_string().contains(want), "{err}");
    }
    // Nothing was mounted or created.
    assert!(!dir.path().join("mnt").exists());
}
