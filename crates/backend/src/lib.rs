//! Backends: the storage an image file lives on (a local file or an NBD
//! export, through this crate's NBD client), store names (URI or path),
//! what a store on a storage server keeps to write again after a
//! reconnection (`unflushed`), and the recording, fault-injecting and
//! restarting-server (`volatile`) backends of the tests.
//!
//! A backend is a flat, offset-addressed byte store. It knows nothing about
//! qcow2, classes of I/O or caching; those live above it. Every method may
//! be called from several threads at once.
//!
//! Owns: byte stores, the NBD client, the meaning of a store name, the
//! record of unflushed writes.
//! Must not: depend on a front end (the NBD server included), the COW
//! layer or the cache.

mod file;
pub mod inject;
mod lock;
mod mem;
pub mod nbd;
pub mod recording;
mod sparse;
mod store_name;
#[cfg(any(test, feature = "deliberate-bugs"))]
pub mod testing;
pub mod unflushed;
pub mod volatile;

pub use file::{FileBackend, FileOptions};
pub use lock::{LockError, LockMode};
pub use mem::MemBackend;
pub use nbd::{DEFAULT_RECONNECT_DELAY, NbdBackend, NbdOptions, RewriteTotals, rewrite_totals};
pub use sparse::{HoleFill, SparseStore};
pub use store_name::{StoreName, is_nbd_uri, resolve_backing_name, same_server};
pub use unflushed::DEFAULT_UNFLUSHED_LIMIT;

use std::fmt::Debug;
use std::io;
use std::sync::Arc;

/// A flat byte store holding one image file.
pub trait Backend: Send + Sync + Debug {
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;

    /// True when the store holds no bytes.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Fills `buf` from `offset`; bytes past the end read as zeros.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Writes all of `buf` at `offset`, growing the store if it can.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;

    /// Writes the buffers back to back starting at `offset`.
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let mut at = offset;
        for b in bufs {
            self.write_at(b, at)?;
            at += b.len() as u64;
        }
        Ok(())
    }

    /// Makes every completed write durable.
    ///
    /// Contract for callers: an error means that some write completed
    /// (acknowledged) since the last successful flush may not be durable,
    /// even though it returned Ok. A caller that must not lose data keeps
    /// its copy until a flush after its writes succeeds, and on an error
    /// writes it again and flushes again. A store whose connection to its
    /// storage server dropped (a server that may have lost its volatile
    /// cache) writes again, before it serves anything else, every write
    /// the server acknowledged and no completed flush covered (see
    /// [`unflushed`]), so a flush after a reconnection covers them too; a
    /// store that cannot fails every later request with
    /// [`StoreFault::RewriteFailed`] instead of serving on.
    fn flush(&self) -> io::Result<()>;

    /// Starts writing `[offset, offset + len)` out to stable storage
    /// without waiting for it, so that the next [`Backend::flush`] finds
    /// little left to write. A hint, never a promise: stores without a
    /// page cache ignore it, and a failure shows at the flush.
    fn start_writeback(&self, _offset: u64, _len: u64) {}

    /// Tells the store that a range is no longer needed (it may read back
    /// as anything afterwards, usually zeros). Advisory: errors are ignored
    /// by callers that only reclaim space.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Changes the length (only stores that can grow support growing).
    fn set_len(&self, len: u64) -> io::Result<()>;

    /// Whether writes past the end grow the store. An NBD export cannot grow:
    /// allocation must stay inside [`Backend::len`].
    fn can_grow(&self) -> bool;

    /// A name for messages: the path or URI.
    fn name(&self) -> &str;

    /// What the store says about which file it is (see [`StoreIdentity`]);
    /// all zeros for a store that cannot tell (memory).
    fn identity(&self) -> io::Result<StoreIdentity> {
        Ok(StoreIdentity::default())
    }
}

/// Facts a store reports about itself that tell one file from another
/// that took its place: the inode and its birth time (a file deleted and
/// created again may get the same inode, never the same birth), and the
/// size and change times (which any writer moves). A layer that keeps
/// copies of a store's bytes across restarts compares them; zero means
/// unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreIdentity {
    pub dev: u64,
    pub ino: u64,
    /// Birth time in nanoseconds since the epoch (0 where the file system
    /// does not record it).
    pub birth_ns: u64,
    pub size: u64,
    pub mtime_ns: u64,
    pub ctime_ns: u64,
}

impl StoreIdentity {
    /// The same file, whatever was written to it since.
    pub fn same_file(&self, other: &StoreIdentity) -> bool {
        (self.dev, self.ino, self.birth_ns) == (other.dev, other.ino, other.birth_ns)
    }

    /// The same file, unchanged.
    pub fn same_content(&self, other: &StoreIdentity) -> bool {
        self == other
    }
}

/// Why a store that lives elsewhere (an NBD export) could not do what was
/// asked; carried inside the `io::Error` a backend returns (find it with
/// [`StoreFault::find`]), so layers above can tell an unreachable storage
/// server from a failing disk.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreFault {
    /// No connection could be made for the whole reconnect delay; requests
    /// fail at once (EIO) until a reconnection, tried in the background,
    /// succeeds.
    #[error(
        "{uri}: the storage server is unreachable (no connection for {waited_secs:.1} s; reconnect_delay is {delay_secs:.1} s): {last_error}"
    )]
    Unreachable {
        uri: String,
        waited_secs: f64,
        delay_secs: f64,
        last_error: String,
    },
    /// After a reconnection, the writes the server had acknowledged but
    /// no flush had covered (which it may have lost) could not be written
    /// again: the image may lack them, so the store is never used again.
    #[error(
        "{uri}: after reconnecting, the writes the storage server had acknowledged but not yet flushed could not be written again ({reason}); the image may be missing them, so it is no longer used: check it (qemu-img check) before using it again"
    )]
    RewriteFailed { uri: String, reason: String },
    /// After a reconnection the export is not the one opened (its size
    /// changed): it is not used again.
    #[error(
        "{uri}: after reconnecting, the export is {now} bytes, not the {was} bytes it had when opened; it is not the same image, so it is no longer used"
    )]
    ExportChanged { uri: String, was: u64, now: u64 },
}

impl StoreFault {
    /// The fault inside `e`, if a store put one there.
    pub fn find(e: &io::Error) -> Option<&StoreFault> {
        e.get_ref()?.downcast_ref::<StoreFault>()
    }

    /// Whether `e` says the store could not be reached (its requests
    /// cannot progress until the storage server is back).
    pub fn is_unreachable(e: &io::Error) -> bool {
        StoreFault::find(e).is_some_and(StoreFault::stops_requests)
    }

    /// Whether the store's requests fail at once while this holds (all
    /// faults so far: an unreachable server, a changed export, a failed
    /// rewrite), so that waiting on it would never end.
    pub fn stops_requests(&self) -> bool {
        match self {
            StoreFault::Unreachable { .. }
            | StoreFault::ExportChanged { .. }
            | StoreFault::RewriteFailed { .. } => true,
        }
    }

    /// The fault as an `io::Error` (EIO to a guest: it has no errno).
    pub fn into_io(self) -> io::Error {
        let kind = match self {
            StoreFault::Unreachable { .. } => io::ErrorKind::NotConnected,
            StoreFault::RewriteFailed { .. } => io::ErrorKind::Other,
            StoreFault::ExportChanged { .. } => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, self)
    }
}

/// Shared handle to a backend.
pub type BackendRef = Arc<dyn Backend>;
