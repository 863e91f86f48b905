//! Backends: the storage an image file lives on (a local file or an NBD
//! export), and the recording and fault-injecting backends of the tests.
//!
//! A backend is a flat, offset-addressed byte store. It knows nothing about
//! qcow2, classes of I/O or caching; those live above it. Every method may
//! be called from several threads at once.

mod file;
pub mod inject;
mod lock;
mod mem;
mod nbd;
pub mod recording;
mod sparse;

pub use file::{FileBackend, FileOptions, publish_new_file};
pub use lock::{LockError, LockMode};
pub use mem::MemBackend;
pub use nbd::{NbdBackend, is_nbd_uri};
pub use sparse::{HoleFill, SparseStore};

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
    fn flush(&self) -> io::Result<()>;

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

/// Shared handle to a backend.
pub type BackendRef = Arc<dyn Backend>;
