//! vdcache-fuse-server: the FUSE front end. Each served disk appears as one
//! regular file in a directory, so the host's own tools can use it: a loop
//! device over the file takes a real `mkfs.ext4` and `mount`, `qemu-img`
//! and `dd` read and write it.
//!
//! Owns: the mount (made with mount(2) by the pure-Rust `fuser` crate, no
//! libfuse and no fusermount helper, hence root only), the mapping of file
//! operations onto [`VirtualDisk`] (read, write, fsync = flush, fallocate
//! punch-hole and zero-range = zero writes that may or may not unmap), and
//! the unmount on stop.
//!
//! Must not: hold a second path to the storage (it calls the very
//! `VirtualDisk` the NBD front end calls, the COW layer over the cache), or
//! let a file change size (a disk's size is fixed).

mod fs;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use vdcache_image::VirtualDisk;

pub use fs::{file_name, to_errno};

/// One disk to show as a file.
pub struct FuseExport {
    /// The export's name; the file is called [`file_name`] of it.
    pub name: String,
    pub disk: Arc<VirtualDisk>,
}

/// Why the front end could not start or stop.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("export '{name}' cannot be a file name in a FUSE directory: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("exports '{first}' and '{second}' would both be the file '{file}'")]
    SameFile {
        first: String,
        second: String,
        file: String,
    },
    #[error("cannot prepare the FUSE directory {dir}: {cause}")]
    Dir { dir: PathBuf, cause: std::io::Error },
    #[error("cannot mount FUSE on {dir} (needs root and /dev/fuse): {cause}")]
    Mount { dir: PathBuf, cause: std::io::Error },
    #[error(
        "FUSE directory {dir} is still in use ({cause}); it was detached lazily: close what holds its files (a loop device: losetup -d) before stopping the server"
    )]
    Busy { dir: PathBuf, cause: std::io::Error },
}

/// Whether `dir` is a FUSE mount whose server is gone: the kernel answers
/// statfs on it with ENOTCONN (a live server answers).
fn dead_fuse_mount(dir: &Path) -> bool {
    matches!(rustix::fs::statfs(dir), Err(e) if e == rustix::io::Errno::NOTCONN)
}

/// Worker threads reading FUSE requests: a loop device queues several.
const THREADS: usize = 4;

/// A mounted FUSE directory; unmounted by [`FuseServer::unmount`] (or, as a
/// last resort, when dropped).
pub struct FuseServer {
    dir: PathBuf,
    session: Option<fuser::BackgroundSession>,
    requests: Arc<std::sync::atomic::AtomicU64>,
}

impl FuseServer {
    /// Mounts `dir` (created if missing) showing one file per export. A
    /// dead FUSE mount left on `dir` by a server that was killed is
    /// detached first.
    pub fn mount(dir: &Path, exports: Vec<FuseExport>) -> Result<FuseServer, FuseError> {
        let fs = fs::DiskFs::new(exports)?;
        let requests = fs.requests();
        let dir_err = |cause| FuseError::Dir {
            dir: dir.to_path_buf(),
            cause,
        };
        if dead_fuse_mount(dir) {
            tracing::warn!(
                "{} is a FUSE mount whose server is gone (killed?): detaching it",
                dir.display()
            );
            rustix::mount::unmount(dir, rustix::mount::UnmountFlags::DETACH)
                .map_err(|e| dir_err(e.into()))?;
        }
        match std::fs::metadata(dir) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                tracing::warn!(
                    "{} is a FUSE mount whose server is gone (killed?): detaching it",
                    dir.display()
                );
                rustix::mount::unmount(dir, rustix::mount::UnmountFlags::DETACH)
                    .map_err(|e| dir_err(e.into()))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(dir).map_err(dir_err)?;
            }
            Err(e) => return Err(dir_err(e)),
            Ok(m) if !m.is_dir() => {
                return Err(dir_err(std::io::Error::new(
                    std::io::ErrorKind::NotADirectory,
                    "not a directory",
                )));
            }
            Ok(_) => {}
        }
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName("vdcache".into()),
            fuser::MountOption::Subtype("vdcache".into()),
            fuser::MountOption::DefaultPermissions,
        ];
        config.n_threads = Some(THREADS);
        let session = fuser::spawn_mount(fs, dir, &config).map_err(|cause| FuseError::Mount {
            dir: dir.to_path_buf(),
            cause,
        })?;
        Ok(FuseServer {
            dir: dir.to_path_buf(),
            session: Some(session),
            requests,
        })
    }

    /// A counter of the disk requests (reads, writes, syncs, fallocates)
    /// served so far: what tells a busy mount from an idle one.
    pub fn requests(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.requests.clone()
    }

    /// The mounted directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Unmounts and waits for the request threads to end. If something
    /// still holds a file (a loop device, a process), the directory is
    /// detached lazily and [`FuseError::Busy`] says so.
    pub fn unmount(mut self) -> Result<(), FuseError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), FuseError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(cause) => {
                if let Err(e) =
                    rustix::mount::unmount(&self.dir, rustix::mount::UnmountFlags::DETACH)
                {
                    tracing::error!("detaching {}: {e}", self.dir.display());
                }
                Err(FuseError::Busy {
                    dir: self.dir.clone(),
                    cause,
                })
            }
        }
    }
}

impl Drop for FuseServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!("{e}");
        }
    }
}
