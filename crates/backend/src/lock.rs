//! Image locking compatible with QEMU's: open file description (OFD) locks
//! on single bytes, 100+n meaning "holds permission n" and 200+n meaning
//! "does not let others take permission n". A vdcache server and QEMU
//! (qemu-img, qemu-io, qemu-nbd, a VM) thereby refuse to write one image at
//! the same time.

use std::fs::File;
use std::os::fd::AsRawFd;

const PERM_BASE: i64 = 100;
const SHARED_BASE: i64 = 200;
const PERM_CONSISTENT_READ: u32 = 0;
const PERM_WRITE: u32 = 1;
const PERM_WRITE_UNCHANGED: u32 = 2;
const PERM_RESIZE: u32 = 3;
const PERMS: u32 = 4;
const PERM_NAMES: [&str; PERMS as usize] =
    ["consistent read", "write", "write unchanged", "resize"];

/// What the opener is going to do with the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// Reads; others may read but not write.
    Read,
    /// Reads and writes; others may only read.
    Write,
}

/// Why an image could not be opened or locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("cannot open {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error(
        "{path} is in use: failed to get the '{perm}' lock (another process, such as a VM, qemu-nbd or another vdcache, has it open)"
    )]
    Conflict { path: String, perm: &'static str },
}

fn mask(bits: &[u32]) -> u32 {
    bits.iter().fold(0, |m, b| m | (1 << b))
}

/// Permissions used and permissions shared for a mode.
fn perms(mode: LockMode) -> (u32, u32) {
    match mode {
        LockMode::Read => (
            mask(&[PERM_CONSISTENT_READ]),
            mask(&[PERM_CONSISTENT_READ, PERM_WRITE_UNCHANGED, PERM_RESIZE]),
        ),
        LockMode::Write => (
            mask(&[
                PERM_CONSISTENT_READ,
                PERM_WRITE,
                PERM_WRITE_UNCHANGED,
                PERM_RESIZE,
            ]),
            mask(&[PERM_CONSISTENT_READ, PERM_WRITE_UNCHANGED]),
        ),
    }
}

fn flock(kind: libc::c_short, byte: i64) -> libc::flock {
    // SAFETY: libc::flock is a plain C struct of integers; all-zero is a
    // valid value for every field, and the fields that matter are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    fl.l_pid = 0;
    fl
}

fn fcntl_lock(file: &File, cmd: libc::c_int, fl: &mut libc::flock) -> std::io::Result<()> {
    // SAFETY: the descriptor is owned by `file`, which outlives the call;
    // `fl` is a valid, exclusively borrowed flock structure, which is the
    // argument F_OFD_SETLK and F_OFD_GETLK expect and may write into.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), cmd, fl as *mut libc::flock) };
    if r == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Another open file description holds a lock on `byte`.
fn held_elsewhere(file: &File, byte: i64) -> std::io::Result<bool> {
    let mut fl = flock(libc::F_WRLCK as libc::c_short, byte);
    fcntl_lock(file, libc::F_OFD_GETLK, &mut fl)?;
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Takes the lock bytes for `mode` on `file`, then checks that nobody else
/// holds a conflicting one. The locks last as long as the file is open.
pub(crate) fn acquire(file: &File, mode: LockMode, path: &str) -> Result<(), LockError> {
    let io_err = |cause| LockError::Io {
        path: path.to_string(),
        cause,
    };
    let (used, shared) = perms(mode);
    for p in 0..PERMS {
        if used & (1 << p) != 0 {
            fcntl_lock(
                file,
                libc::F_OFD_SETLK,
                &mut flock(libc::F_RDLCK as libc::c_short, PERM_BASE + i64::from(p)),
            )
            .map_err(io_err)?;
        }
        if shared & (1 << p) == 0 {
            fcntl_lock(
                file,
                libc::F_OFD_SETLK,
                &mut flock(libc::F_RDLCK as libc::c_short, SHARED_BASE + i64::from(p)),
            )
            .map_err(io_err)?;
        }
    }
    for p in 0..PERMS {
        let conflict = (used & (1 << p) != 0
            && held_elsewhere(file, SHARED_BASE + i64::from(p)).map_err(io_err)?)
            || (shared & (1 << p) == 0
                && held_elsewhere(file, PERM_BASE + i64::from(p)).map_err(io_err)?);
        if conflict {
            return Err(LockError::Conflict {
                path: path.to_string(),
                perm: PERM_NAMES[p as usize],
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FileBackend, FileOptions};

    #[test]
    fn second_writer_is_refused_readers_coexist() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, [0u8; 512]).unwrap();
        let w = |mode| FileOptions {
            read_only: mode == LockMode::Read,
            lock: Some(mode),
            create: false,
        };
        let r1 = FileBackend::open(&path, w(LockMode::Read)).unwrap();
        let _r2 = FileBackend::open(&path, w(LockMode::Read)).unwrap();
        assert!(matches!(
            FileBackend::open(&path, w(LockMode::Write)),
            Err(LockError::Conflict { .. })
        ));
        drop(r1);
        drop(_r2);
        let _w1 = FileBackend::open(&path, w(LockMode::Write)).unwrap();
        assert!(matches!(
            FileBackend::open(&path, w(LockMode::Write)),
            Err(LockError::Conflict { .. })
        ));
        assert!(matches!(
            FileBackend::open(&path, w(LockMode::Read)),
            Err(LockError::Conflict { .. })
        ));
    }
}
