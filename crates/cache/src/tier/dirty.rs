//! The write-back queue: which lines hold dirty blocks (in write-back
//! order), which dirty blocks the write-back thread is copying to their
//! backends without the lock, and who waits for the queue to empty.
//!
//! It owns the bookkeeping only: it never reads flash, writes a backend or
//! changes the index (the write-back thread, eviction and recovery do, and
//! tell it).

use std::collections::{BTreeSet, HashSet};

#[derive(Debug, Default)]
pub(crate) struct DirtySet {
    /// Lines holding dirty blocks, by line key (an image's lines in offset
    /// order, so write-back runs are sequential on the backend).
    pub lines: BTreeSet<u64>,
    /// Dirty blocks (line key, slot) whose copies the write-back thread is
    /// writing to their backends without the lock. A newer copy of one of
    /// them must not be written back meanwhile (eviction would): the
    /// older bytes could land after it, and nothing would correct them.
    pub copying: HashSet<(u64, u8)>,
    /// The write-back thread is between collecting and completing a batch.
    pub writeback_busy: bool,
    /// How many callers wait for every dirty block to be written back.
    pub drain_requests: u64,
    /// How many of them want held blocks written out too (see
    /// [`crate::index::Index::set_held`]).
    pub held_requests: u64,
}

impl DirtySet {
    /// Whether the write-back thread is copying an older copy of block
    /// `slot` of line `key` right now.
    pub(crate) fn is_copying(&self, key: u64, slot: usize) -> bool {
        !self.copying.is_empty() && self.copying.contains(&(key, slot as u8))
    }

    /// Whether anyone waits for the queue to empty.
    pub(crate) fn draining(&self) -> bool {
        self.drain_requests > 0
    }

    /// Whether held images' dirty blocks are to be written out now.
    pub(crate) fn writing_out_held(&self) -> bool {
        self.held_requests > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copying_is_per_block_and_draining_counts_waiters() {
        let mut d = DirtySet::default();
        assert!(!d.is_copying(5, 2));
        d.copying.insert((5, 2));
        assert!(d.is_copying(5, 2));
        assert!(!d.is_copying(5, 3), "another slot of the same line");
        assert!(!d.draining());
        d.drain_requests += 2;
        d.drain_requests -= 1;
        assert!(d.draining(), "one waiter left");
    }
}
