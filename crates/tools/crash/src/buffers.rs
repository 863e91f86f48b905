//! Buffers a sweep worker reuses from one crash state to the next: the
//! stores recovery runs on, the closed images' bytes, whole-disk reads.
//! Each is megabytes, and a fresh allocation of that size is returned to
//! the system when freed and page-faulted in again on the next state, at
//! several times the cost of the copy into it: with fresh buffers that was
//! most of a state's time.
//!
//! This module only hands buffers out and takes them back; what they hold
//! is the caller's business, and a buffer it cannot get back (a store
//! something still holds) is simply allocated afresh next time.

use std::sync::Arc;
use vdcache_backend::MemBackend;
use vdcache_backend::recording::CrashState;
use vdcache_image::MemFiles;

/// Free buffers, any sizes.
#[derive(Debug, Default)]
pub(crate) struct Buffers {
    free: Vec<Vec<u8>>,
}

impl Buffers {
    /// A buffer of at least `len` bytes' capacity, holding whatever it
    /// held: the smallest free one that fits, else the largest (grown by
    /// the caller once).
    fn take(&mut self, len: usize) -> Vec<u8> {
        let fits = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity());
        let pick = fits.or_else(|| {
            self.free
                .iter()
                .enumerate()
                .max_by_key(|(_, b)| b.capacity())
        });
        pick.map(|(i, _)| i)
            .map_or_else(Vec::new, |i| self.free.swap_remove(i))
    }

    /// A buffer of `len` bytes for a read that fills all of them (a
    /// backend's `read_at`): the bytes it held are left in place (only
    /// growth is zeroed), since zeroing megabytes first cost as much as
    /// the read.
    pub(crate) fn for_overwrite(&mut self, len: usize) -> Vec<u8> {
        let mut buf = self.take(len);
        buf.resize(len, 0);
        buf
    }

    /// A copy of `bytes`.
    pub(crate) fn copy_of(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut buf = self.take(bytes.len());
        buf.clear();
        buf.extend_from_slice(bytes);
        buf
    }

    /// Takes a buffer back for later use.
    pub(crate) fn give(&mut self, buf: Vec<u8>) {
        if buf.capacity() > 0 {
            self.free.push(buf);
        }
    }

    /// In-memory stores holding `state`'s devices: what
    /// [`crate::mem_files`] returns, in reused buffers.
    pub(crate) fn mem_files(&mut self, state: &CrashState) -> Arc<MemFiles> {
        let files = MemFiles::new();
        for d in &state.devices {
            files.insert(&d.name, self.copy_of(&d.data));
        }
        files
    }

    /// Takes back the buffers of `files`' stores `names` once nothing but
    /// `files` holds them (the disks opened on them are dropped).
    pub(crate) fn reclaim<'a>(
        &mut self,
        files: Arc<MemFiles>,
        names: impl IntoIterator<Item = &'a str>,
    ) {
        let stores: Vec<Arc<MemBackend>> = names.into_iter().filter_map(|n| files.get(n)).collect();
        drop(files);
        for store in stores {
            if let Ok(store) = Arc::try_unwrap(store) {
                self.give(store.into_data());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_copied_and_stores_are_reclaimed() {
        let mut bufs = Buffers::default();
        let mut a = bufs.for_overwrite(100);
        a.fill(7);
        bufs.give(a);
        // Reused: a copy holds exactly what it copied.
        let b = bufs.copy_of(&[1; 50]);
        assert_eq!(b, vec![1; 50]);
        assert!(b.capacity() >= 100);
        bufs.give(b);
        let files = MemFiles::new();
        files.insert("x", bufs.copy_of(&[1, 2, 3]));
        assert!(bufs.free.is_empty());
        let held = files.get("x");
        // Still held elsewhere: not taken back.
        bufs.reclaim(files.clone(), ["x"]);
        assert!(bufs.free.is_empty());
        drop(held);
        bufs.reclaim(files, ["x", "missing"]);
        assert_eq!(bufs.free.len(), 1);
    }
}
