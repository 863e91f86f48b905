//! A cache device seen through a flash translation layer: every write and
//! discard that reaches the device also drives a page-mapped FTL model, so
//! the SSD-internal write amplification of the cache's own write stream can
//! be measured (SVD section IV.C). Reads and flushes pass straight through.

use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use vdcache_backend::{Backend, BackendRef};
use vdcache_eval::ftl::{Ftl, FtlConfig, FtlError, FtlStats};

/// A backend that forwards to `inner` and feeds an [`Ftl`] model.
#[derive(Debug)]
pub struct FtlDevice {
    inner: BackendRef,
    ftl: Mutex<Ftl>,
}

impl FtlDevice {
    /// Wraps `inner`; the model's logical capacity is `cfg.logical_bytes`
    /// (normally the device length).
    pub fn new(inner: BackendRef, cfg: FtlConfig) -> Result<Arc<FtlDevice>, FtlError> {
        Ok(Arc::new(FtlDevice {
            inner,
            ftl: Mutex::new(Ftl::new(cfg)?),
        }))
    }

    /// The model's counters so far.
    pub fn stats(&self) -> FtlStats {
        self.model().stats()
    }

    fn model(&self) -> MutexGuard<'_, Ftl> {
        // The model holds no invariant a panicking holder could break
        // halfway that matters for a measurement; keep counting.
        self.ftl.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn to_io(e: FtlError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

impl Backend for FtlDevice {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)?;
        self.model().write(offset, buf.len() as u64).map_err(to_io)
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        self.inner.write_vectored_at(bufs, offset)?;
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.model().write(offset, len).map_err(to_io)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)?;
        self.model().discard(offset, len).map_err(to_io)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn can_grow(&self) -> bool {
        false
    }

    fn name(&self) -> &str {
        self.inner.name()
    }
}
