//! A local file (or block device) accessed with positional I/O.

use crate::Backend;
use crate::lock::{self, LockMode};
use rustix::fs::FallocateFlags;
use std::fs::{File, OpenOptions};
use std::io;
use std::io::IoSlice;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// How to open a file backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct FileOptions {
    pub read_only: bool,
    /// Take QEMU-compatible image locks (none when `None`).
    pub lock: Option<LockMode>,
    pub create: bool,
}

/// An image file.
#[derive(Debug)]
pub struct FileBackend {
    file: File,
    name: String,
    /// A regular file grows on writes past its end; a block device does
    /// not. Fixed at open: asking the kernel costs a statx per allocation.
    growable: bool,
    /// A discard gives the blocks back and allocates them again (see
    /// [`FileBackend::keeping_space`]).
    keep_space: bool,
}

impl FileBackend {
    pub fn open(path: &Path, opts: FileOptions) -> Result<FileBackend, crate::LockError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .create(opts.create && !opts.read_only)
            .truncate(false)
            .open(path)
            .map_err(|e| crate::LockError::Io {
                path: path.display().to_string(),
                cause: e,
            })?;
        let name = path.display().to_string();
        if let Some(mode) = opts.lock {
            lock::acquire(&file, mode, &name)?;
        }
        let growable = file
            .metadata()
            .map(|m| m.file_type().is_file())
            .unwrap_or(false);
        Ok(FileBackend {
            file,
            name,
            growable,
            keep_space: false,
        })
    }

    /// A file whose space stays reserved (a cache file, allocated whole
    /// when created): a discard still frees its blocks, so the file
    /// system may trim them, but allocates them again at once, so no
    /// other file can take the space and a later write never finds the
    /// file system full.
    pub fn keeping_space(mut self) -> FileBackend {
        self.keep_space = self.growable;
        self
    }
}

impl Backend for FileBackend {
    fn len(&self) -> io::Result<u64> {
        let meta = self.file.metadata()?;
        if meta.file_type().is_file() {
            return Ok(meta.len());
        }
        // A block device reports its size through seek.
        rustix::fs::seek(&self.file, rustix::fs::SeekFrom::End(0)).map_err(io::Error::from)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    return Ok(());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let mut slices: Vec<IoSlice<'_>> = bufs
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| IoSlice::new(b))
            .collect();
        let mut at = offset;
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let n = match rustix::io::pwritev(&self.file, rest, at) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            at += n as u64;
            IoSlice::advance_slices(&mut rest, n);
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        rustix::fs::fdatasync(&self.file).map_err(io::Error::from)
    }

    fn start_writeback(&self, offset: u64, len: u64) {
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: sync_file_range takes a descriptor and three integers
        // and touches no memory of ours; the descriptor is `self.file`'s,
        // open for as long as `self` is borrowed. Its result is only a
        // hint's (a failed write-out shows at the next fdatasync).
        let _ = unsafe {
            libc::sync_file_range(
                self.file.as_raw_fd(),
                offset,
                len,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        rustix::fs::fallocate(
            &self.file,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .map_err(io::Error::from)?;
        if self.keep_space {
            rustix::fs::fallocate(&self.file, FallocateFlags::KEEP_SIZE, offset, len)
                .map_err(io::Error::from)?;
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn can_grow(&self) -> bool {
        self.growable
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn identity(&self) -> io::Result<crate::StoreIdentity> {
        use rustix::fs::{AtFlags, StatxFlags, StatxTimestamp};
        let ns = |t: StatxTimestamp| {
            u64::try_from(t.tv_sec)
                .unwrap_or(0)
                .saturating_mul(1_000_000_000)
                .saturating_add(u64::from(t.tv_nsec))
        };
        let st = rustix::fs::statx(
            &self.file,
            "",
            AtFlags::EMPTY_PATH,
            StatxFlags::BASIC_STATS | StatxFlags::BTIME,
        )
        .map_err(io::Error::from)?;
        let birth_ns = if st.stx_mask & StatxFlags::BTIME.bits() != 0 {
            ns(st.stx_btime)
        } else {
            0
        };
        Ok(crate::StoreIdentity {
            dev: (u64::from(st.stx_dev_major) << 32) | u64::from(st.stx_dev_minor),
            ino: st.stx_ino,
            birth_ns,
            size: self.len()?,
            mtime_ns: ns(st.stx_mtime),
            ctime_ns: ns(st.stx_ctime),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_past_end_as_zeros_and_writes_vectored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let b = FileBackend::open(
            &path,
            FileOptions {
                create: true,
                ..Default::default()
            },
        )
        .unwrap();
        b.write_vectored_at(&[b"ab", b"", b"cd"], 10).unwrap();
        assert_eq!(b.len().unwrap(), 14);
        let mut buf = [1u8; 8];
        b.read_at(&mut buf, 10).unwrap();
        assert_eq!(&buf, b"abcd\0\0\0\0");
        b.discard(0, 4096).unwrap();
        b.flush().unwrap();
    }
}
