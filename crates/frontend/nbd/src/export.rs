//! The [`Export`] trait the NBD server serves, its error type, and
//! [`MemExport`], an in-memory disk for tests and examples.
//!
//! Owns: the contract between the protocol layer and a block store (what each
//! call must guarantee, how failures map onto NBD error values).
//! Must not: know about sockets, options or the wire format. The server checks
//! bounds, alignment and read-only state before calling in, so
//! implementations may treat out-of-range calls as bugs (but must still not
//! panic: return [`ExportError::Invalid`]).

use std::io;
use std::sync::{Mutex, MutexGuard};

use thiserror::Error;

use vdcache_nbd_proto::proto;
pub use vdcache_nbd_proto::{BlockSizes, Extent, ZeroFlags};

/// Failure of an export operation; each variant is one NBD error value.
/// The message is sent to clients that negotiated structured replies.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ExportError {
    #[error("I/O error: {0}")]
    Io(String),
    #[error("operation not permitted: {0}")]
    PermissionDenied(String),
    #[error("out of memory: {0}")]
    NoMemory(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no space left: {0}")]
    NoSpace(String),
    #[error("value too large: {0}")]
    Overflow(String),
    #[error("not supported: {0}")]
    NotSupported(String),
    #[error("shutting down: {0}")]
    Shutdown(String),
}

impl ExportError {
    /// The NBD error value (`NBD_EIO` ...).
    pub fn code(&self) -> u32 {
        match self {
            ExportError::Io(_) => proto::EIO,
            ExportError::PermissionDenied(_) => proto::EPERM,
            ExportError::NoMemory(_) => proto::ENOMEM,
            ExportError::Invalid(_) => proto::EINVAL,
            ExportError::NoSpace(_) => proto::ENOSPC,
            ExportError::Overflow(_) => proto::EOVERFLOW,
            ExportError::NotSupported(_) => proto::ENOTSUP,
            ExportError::Shutdown(_) => proto::ESHUTDOWN,
        }
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        match self {
            ExportError::Io(m)
            | ExportError::PermissionDenied(m)
            | ExportError::NoMemory(m)
            | ExportError::Invalid(m)
            | ExportError::NoSpace(m)
            | ExportError::Overflow(m)
            | ExportError::NotSupported(m)
            | ExportError::Shutdown(m) => m,
        }
    }

    /// Builds the error for an NBD error value; unknown values are `EINVAL`
    /// as the spec asks.
    pub fn from_code(code: u32, message: impl Into<String>) -> ExportError {
        let m = message.into();
        match code {
            proto::EPERM => ExportError::PermissionDenied(m),
            proto::EIO => ExportError::Io(m),
            proto::ENOMEM => ExportError::NoMemory(m),
            proto::ENOSPC => ExportError::NoSpace(m),
            proto::EOVERFLOW => ExportError::Overflow(m),
            proto::ENOTSUP => ExportError::NotSupported(m),
            proto::ESHUTDOWN => ExportError::Shutdown(m),
            _ => ExportError::Invalid(m),
        }
    }
}

impl From<io::Error> for ExportError {
    fn from(e: io::Error) -> Self {
        let m = e.to_string();
        if let Some(errno) = e.raw_os_error() {
            let mapped = match errno {
                libc_errno::EPERM | libc_errno::EACCES | libc_errno::EROFS => {
                    Some(ExportError::PermissionDenied(m.clone()))
                }
                libc_errno::ENOMEM => Some(ExportError::NoMemory(m.clone())),
                libc_errno::EINVAL => Some(ExportError::Invalid(m.clone())),
                libc_errno::ENOSPC | libc_errno::EDQUOT | libc_errno::EFBIG => {
                    Some(ExportError::NoSpace(m.clone()))
                }
                libc_errno::EOVERFLOW => Some(ExportError::Overflow(m.clone())),
                libc_errno::EOPNOTSUPP | libc_errno::ENOTTY | libc_errno::ENOSYS => {
                    Some(ExportError::NotSupported(m.clone()))
                }
                libc_errno::ESHUTDOWN => Some(ExportError::Shutdown(m.clone())),
                _ => None,
            };
            if let Some(x) = mapped {
                return x;
            }
            return ExportError::Io(m);
        }
        match e.kind() {
            io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem => {
                ExportError::PermissionDenied(m)
            }
            io::ErrorKind::OutOfMemory => ExportError::NoMemory(m),
            io::ErrorKind::InvalidInput => ExportError::Invalid(m),
            io::ErrorKind::StorageFull
            | io::ErrorKind::QuotaExceeded
            | io::ErrorKind::FileTooLarge => ExportError::NoSpace(m),
            io::ErrorKind::Unsupported => ExportError::NotSupported(m),
            _ => ExportError::Io(m),
        }
    }
}

/// Linux errno values used by the mapping above (kept local so the crate
/// does not need libc for a handful of constants).
mod libc_errno {
    pub const EPERM: i32 = 1;
    pub const ENOMEM: i32 = 12;
    pub const EACCES: i32 = 13;
    pub const EINVAL: i32 = 22;
    pub const EFBIG: i32 = 27;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const ENOTTY: i32 = 25;
    pub const ENOSYS: i32 = 38;
    pub const EOVERFLOW: i32 = 75;
    pub const EOPNOTSUPP: i32 = 95;
    pub const ESHUTDOWN: i32 = 108;
    pub const EDQUOT: i32 = 122;
}

/// A block store served over NBD.
///
/// Called concurrently from several worker threads of several connections.
/// The server has already checked that every range lies inside
/// `0..size()`, that payload lengths respect `block_sizes().maximum` and
/// alignment to `block_sizes().minimum`, and that writes never reach a
/// read-only export.
///
/// Ordering contract: `flush` must make durable every write, trim and
/// write_zeroes that has *returned* before `flush` was called, from any
/// thread (the server replies to a write only after the call returned, so
/// this is exactly the NBD flush rule). With `fua` set, the call must not
/// return before its own data is durable. If `can_multi_conn` is true, the
/// above holds across all connections to the export (one shared cache).
pub trait Export: Send + Sync {
    /// Size in bytes (fixed for the life of a connection).
    fn size(&self) -> u64;
    /// Writes are refused with `EPERM` and the export is advertised read-only.
    fn read_only(&self) -> bool;
    /// Block size constraints advertised to clients.
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes::default()
    }
    /// True when a flush on any connection covers the writes of all connections.
    fn can_multi_conn(&self) -> bool {
        false
    }
    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError>;
    /// Writes `data` at `offset`; durable before returning when `fua`.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError>;
    /// Makes all previously completed writes durable.
    fn flush(&self) -> Result<(), ExportError>;
    /// Hint that the range is unused; contents afterwards are unspecified.
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError>;
    /// Makes the range read as zeroes (see [`ZeroFlags`]).
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ExportError>;
    /// Allocation status of the range starting at `offset`: consecutive
    /// extents with nonzero lengths, covering at least one byte; they may
    /// stop short of `len` (the client asks again) and the last may run past it.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        let _ = offset;
        Ok(vec![Extent {
            length: len,
            hole: false,
            zero: false,
        }])
    }
    /// Prefetch hint; must not change what reads return.
    fn cache(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        let _ = (offset, len);
        Ok(())
    }
}

/// Granularity at which [`MemExport`] tracks allocation.
const PAGE: usize = 4096;

/// An in-memory sparse disk: pages are allocated on first non-zero write and
/// dropped again by trim/write_zeroes, so block status reports real holes.
pub struct MemExport {
    size: u64,
    read_only: bool,
    multi_conn: bool,
    block_sizes: BlockSizes,
    pages: Mutex<Vec<Option<Box<[u8]>>>>,
}

impl MemExport {
    /// A zero-filled writable disk of `size` bytes.
    pub fn new(size: u64) -> MemExport {
        let npages = size.div_ceil(PAGE as u64) as usize;
        let mut v = Vec::new();
        v.resize_with(npages, || None);
        MemExport {
            size,
            read_only: false,
            multi_conn: true,
            block_sizes: BlockSizes::default(),
            pages: Mutex::new(v),
        }
    }

    /// A disk holding `data` (its length is the size).
    pub fn with_data(data: &[u8]) -> MemExport {
        let e = MemExport::new(data.len() as u64);
        // Cannot fail: in range and writable.
        let _ = e.write(0, data, false);
        e
    }

    /// Makes the disk read-only.
    pub fn read_only(mut self, ro: bool) -> MemExport {
        self.read_only = ro;
        self
    }

    /// Overrides the advertised block sizes.
    pub fn block_sizes(mut self, bs: BlockSizes) -> MemExport {
        self.block_sizes = bs;
        self
    }

    /// Overrides whether multi-conn is advertised.
    pub fn multi_conn(mut self, on: bool) -> MemExport {
        self.multi_conn = on;
        self
    }

    /// A copy of the whole contents.
    pub fn contents(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.size as usize];
        let _ = Export::read(self, 0, &mut out);
        out
    }

    /// Number of allocated pages (for tests of trim and zeroing).
    pub fn allocated_pages(&self) -> usize {
        self.lock().iter().filter(|p| p.is_some()).count()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Option<Box<[u8]>>>> {
        self.pages.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ExportError::Invalid(format!(
                "range {offset}+{len} outside the disk of {} bytes",
                self.size
            ))),
        }
    }

    /// Zeroes a range: whole pages are dropped, partial pages are cleared.
    fn zero_range(&self, offset: u64, len: u64) {
        let mut pages = self.lock();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let page = (pos / PAGE as u64) as usize;
            let in_page = (pos % PAGE as u64) as usize;
            let n = ((PAGE - in_page) as u64).min(end - pos) as usize;
            if in_page == 0 && n == PAGE {
                pages[page] = None;
            } else if let Some(p) = pages[page].as_mut() {
                p[in_page..in_page + n].fill(0);
            }
            pos += n as u64;
        }
    }
}

impl Export for MemExport {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn block_sizes(&self) -> BlockSizes {
        self.block_sizes
    }

    fn can_multi_conn(&self) -> bool {
        self.multi_conn
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.check(offset, buf.len() as u64)?;
        let pages = self.lock();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let page = (pos / PAGE as u64) as usize;
            let in_page = (pos % PAGE as u64) as usize;
            let n = (PAGE - in_page).min(buf.len() - done);
            match &pages[page] {
                Some(p) => buf[done..done + n].copy_from_slice(&p[in_page..in_page + n]),
                None => buf[done..done + n].fill(0),
            }
            done += n;
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), ExportError> {
        self.check(offset, data.len() as u64)?;
        if self.read_only {
            return Err(ExportError::PermissionDenied("read-only export".into()));
        }
        let mut pages = self.lock();
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let page = (pos / PAGE as u64) as usize;
            let in_page = (pos % PAGE as u64) as usize;
            let n = (PAGE - in_page).min(data.len() - done);
            let src = &data[done..done + n];
            match pages[page].as_mut() {
                Some(p) => p[in_page..in_page + n].copy_from_slice(src),
                None => {
                    if src.iter().any(|&b| b != 0) {
                        let mut p = vec![0u8; PAGE].into_boxed_slice();
                        p[in_page..in_page + n].copy_from_slice(src);
                        pages[page] = Some(p);
                    }
                }
            }
            done += n;
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<(), ExportError> {
        self.check(offset, len)?;
        if self.read_only {
            return Err(ExportError::PermissionDenied("read-only export".into()));
        }
        self.zero_range(offset, len);
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<(), ExportError> {
        self.check(offset, len)?;
        if self.read_only {
            return Err(ExportError::PermissionDenied("read-only export".into()));
        }
        // Dropping pages is always fast here, so FAST_ZERO always succeeds;
        // NO_HOLE makes no difference to a memory disk's durability.
        self.zero_range(offset, len);
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        self.check(offset, len)?;
        let pages = self.lock();
        let mut out: Vec<Extent> = Vec::new();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let page = (pos / PAGE as u64) as usize;
            let page_end = ((page as u64 + 1) * PAGE as u64).min(self.size);
            let n = page_end.min(end) - pos;
            let hole = pages[page].is_none();
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += n,
                _ => out.push(Extent {
                    length: n,
                    hole,
                    zero: hole,
                }),
            }
            pos += n;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_export_sparse_roundtrip() {
        let e = MemExport::new(3 * PAGE as u64 + 100);
        e.write(10, b"hello", false).unwrap();
        e.write(2 * PAGE as u64 - 2, &[7u8; 8], false).unwrap();
        let mut b = [0u8; 5];
        e.read(10, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert_eq!(e.allocated_pages(), 3);
        let ext = e.block_status(0, e.size()).unwrap();
        assert_eq!(ext.iter().map(|x| x.length).sum::<u64>(), e.size());
        assert!(!ext[0].hole);
        assert!(ext.last().unwrap().hole);
        e.write_zeroes(0, 3 * PAGE as u64, ZeroFlags::default())
            .unwrap();
        assert_eq!(e.allocated_pages(), 0);
        assert!(e.contents().iter().all(|&b| b == 0));
        assert!(e.read(e.size() - 1, &mut [0u8; 2]).is_err());
    }

    #[test]
    fn io_error_mapping() {
        let e: ExportError = io::Error::from_raw_os_error(28).into();
        assert_eq!(e.code(), proto::ENOSPC);
        let e: ExportError = io::Error::from_raw_os_error(13).into();
        assert_eq!(e.code(), proto::EPERM);
        let e: ExportError = io::Error::from_raw_os_error(5).into();
        assert_eq!(e.code(), proto::EIO);
        let e: ExportError = io::Error::new(io::ErrorKind::InvalidInput, "x").into();
        assert_eq!(e.code(), proto::EINVAL);
        assert_eq!(ExportError::from_code(9999, "?").code(), proto::EINVAL);
    }
}
