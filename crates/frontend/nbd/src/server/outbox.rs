//! Replies encoded on one thread and not yet written to the socket.
//!
//! Each thread that answers requests (a connection's reading thread, its
//! workers) encodes replies into its own outbox, reading data straight
//! into it, and writes the outbox out in one call. The bytes past what is
//! in use stay allocated and initialized between replies, so a read lands
//! in place without a fresh buffer to allocate and zero, and a burst of
//! replies held back by the reading thread leaves in one write without
//! being copied again.
//!
//! Owns: the byte layout of pending replies. Must not: know the protocol
//! (callers encode) or touch the socket (callers write [`Outbox::pending`]).

use std::cell::RefCell;

/// Bytes an outbox keeps allocated after it was written out; a larger
/// one (a big read) is freed. A burst of 32 replies to 4 KiB reads fits;
/// a connection's threads (its reader, 16 workers by default) keep at
/// most 2.2 MiB between them.
const KEEP: usize = 128 << 10;

#[derive(Debug, Default)]
pub(super) struct Outbox {
    bytes: Vec<u8>,
    used: usize,
}

thread_local! {
    static OUTBOX: RefCell<Outbox> = RefCell::new(Outbox::default());
}

impl Outbox {
    /// Runs `f` on this thread's outbox.
    pub(super) fn with<R>(f: impl FnOnce(&mut Outbox) -> R) -> R {
        OUTBOX.with_borrow_mut(f)
    }

    /// Bytes waiting to be written.
    pub(super) fn pending(&self) -> &[u8] {
        &self.bytes[..self.used]
    }

    pub(super) fn len(&self) -> usize {
        self.used
    }

    pub(super) fn push(&mut self, b: &[u8]) {
        self.grow(b.len()).copy_from_slice(b);
    }

    /// Appends `n` bytes and returns them to be filled (their content is
    /// unspecified until then).
    pub(super) fn grow(&mut self, n: usize) -> &mut [u8] {
        let start = self.used;
        let end = start + n;
        if end > self.bytes.len() {
            self.bytes.resize(end, 0);
        }
        self.used = end;
        &mut self.bytes[start..end]
    }

    /// Drops everything appended after `len` (a reply that failed halfway).
    pub(super) fn truncate(&mut self, len: usize) {
        self.used = self.used.min(len);
    }

    /// Forgets the pending bytes once written, keeping the memory for the
    /// next piece of a streamed reply (at most one piece, `payload_chunk`).
    pub(super) fn sent(&mut self) {
        self.used = 0;
    }

    /// Forgets the pending bytes once written (or undeliverable).
    pub(super) fn clear(&mut self) {
        self.used = 0;
        if self.bytes.len() > KEEP {
            // Shrinking would copy; the next big reply allocates afresh.
            self.bytes = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{KEEP, Outbox};

    #[test]
    fn replies_append_in_order_and_a_failed_one_is_dropped() {
        let mut o = Outbox::default();
        o.push(b"first");
        let mark = o.len();
        o.push(b"half a reply");
        o.truncate(mark);
        o.grow(3).copy_from_slice(b"abc");
        assert_eq!(o.pending(), b"firstabc");
        o.clear();
        assert_eq!(o.pending(), b"");
        // Reused space holds leftovers until it is filled again.
        o.grow(2).copy_from_slice(b"xy");
        assert_eq!(o.pending(), b"xy");
    }

    #[test]
    fn a_big_reply_does_not_keep_its_memory() {
        let mut o = Outbox::default();
        o.grow(4 * KEEP);
        o.clear();
        assert_eq!(o.bytes.capacity(), 0);
        assert_eq!(o.pending(), b"");
    }
}
