//! Write payload buffers kept for reuse by every connection of a server.
//!
//! A fresh buffer per write costs an allocation, zeroing it before the
//! socket read fills it, and for large writes page faults on memory the
//! allocator just gave back to the kernel: for 1 MiB writes that is more
//! CPU than the copy from the socket. A reused buffer stays initialized.
//!
//! Owns: spare buffers, at most [`MAX_SPARE_BYTES`] of them. Must not:
//! hand one buffer to two requests, or keep more than that bound.

use std::ops::Deref;
use std::sync::Mutex;

/// Spare capacity kept across all connections.
pub(crate) const MAX_SPARE_BYTES: usize = 16 << 20;

/// A write's payload: the first `len` bytes of a reusable buffer.
#[derive(Debug, Default)]
pub(crate) struct Payload {
    buf: Vec<u8>,
    len: usize,
}

impl Payload {
    /// The bytes a socket read fills.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl Deref for Payload {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Spare buffers, each fully initialized, with their total capacity.
#[derive(Debug, Default)]
pub(crate) struct PayloadPool {
    spare: Mutex<(Vec<Vec<u8>>, usize)>,
}

impl PayloadPool {
    /// A payload of `len` bytes (their content is whatever the buffer
    /// held: the caller overwrites all of them).
    pub(crate) fn take(&self, len: usize) -> Payload {
        let reused = {
            let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
            let (bufs, bytes) = &mut *spare;
            // The smallest buffer that fits, else the largest one.
            let pick = bufs
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len)
                .min_by_key(|(_, b)| b.len())
                .or_else(|| bufs.iter().enumerate().max_by_key(|(_, b)| b.len()))
                .map(|(i, _)| i);
            pick.map(|i| {
                let b = bufs.swap_remove(i);
                *bytes -= b.capacity();
                b
            })
        };
        let mut buf = reused.unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        Payload { buf, len }
    }

    /// Keeps a payload's buffer for a later write, if the bound allows.
    pub(crate) fn give_back(&self, payload: Payload) {
        let cap = payload.buf.capacity();
        if cap == 0 {
            return;
        }
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let (bufs, bytes) = &mut *spare;
        if *bytes + cap <= MAX_SPARE_BYTES {
            *bytes += cap;
            bufs.push(payload.buf);
        }
    }

    /// Bytes of spare capacity held.
    #[cfg(test)]
    fn spare_bytes(&self) -> usize {
        self.spare.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_never_shared() {
        let pool = PayloadPool::default();
        let mut a = pool.take(4096);
        a.as_mut_slice().fill(7);
        let a_ptr = a.as_ptr();
        let b = pool.take(4096);
        assert_ne!(a_ptr, b.as_ptr(), "two payloads in flight share a buffer");
        pool.give_back(a);
        let c = pool.take(1024);
        assert_eq!(c.as_ptr(), a_ptr, "a spare buffer was not reused");
        assert_eq!(c.len(), 1024);
        pool.give_back(c);
        // Taken again at full length: its bytes are still initialized.
        let d = pool.take(4096);
        assert_eq!(d.as_ptr(), a_ptr);
        assert_eq!(d.len(), 4096);
        drop(b);
    }

    #[test]
    fn the_smallest_fitting_buffer_is_taken() {
        let pool = PayloadPool::default();
        let big = pool.take(1 << 20);
        let small = pool.take(4096);
        let (big_ptr, small_ptr) = (big.as_ptr(), small.as_ptr());
        pool.give_back(big);
        pool.give_back(small);
        assert_eq!(pool.take(4096).as_ptr(), small_ptr);
        assert_eq!(pool.take(4096).as_ptr(), big_ptr);
    }

    #[test]
    fn spare_capacity_is_bounded() {
        let pool = PayloadPool::default();
        let held: Vec<Payload> = (0..MAX_SPARE_BYTES / (1 << 20) + 4)
            .map(|_| pool.take(1 << 20))
            .collect();
        for p in held {
            pool.give_back(p);
        }
        assert!(pool.spare_bytes() <= MAX_SPARE_BYTES);
        assert!(pool.spare_bytes() >= MAX_SPARE_BYTES - (1 << 20));
    }
}
