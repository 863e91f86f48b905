//! The durability ledger: which images hold write-through data their
//! backend has not synced yet, which of them pending journal entries
//! depend on, and which clean copies of write-through data are held out
//! of the journal until a backend sync covers them.
//!
//! It owns only that bookkeeping and the rules over it: an entry that
//! describes data on a backend is journaled only after that backend synced
//! through the data's mark; a mark is cleared only by a sync that covered
//! it. It does not sync anything, touch the index, the journal or the
//! device: callers sync backends (without the state lock) and journal what
//! [`Ledger::synced`] hands back, if the index still maps it.

use crate::index::Cbn;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

/// The fewest clean copies held out of the journal before their backends
/// are synced for them (16 MiB of 4 KiB blocks).
pub(crate) const MIN_UNJOURNALED_LIMIT: usize = 4096;

/// Clean copies a cache of `cacheable_blocks` holds out of the journal
/// before it syncs their backends itself: a sixteenth of its blocks (about
/// 56 bytes of memory each, so 0.09% of the cache's size), at least
/// [`MIN_UNJOURNALED_LIMIT`]. Until then only a guest flush's sync covers
/// them: a backend sync costs the storage as much as a guest's, and a
/// crash loses nothing but these copies (reads go to the backend).
pub(crate) fn unjournaled_limit(cacheable_blocks: u64) -> usize {
    usize::try_from(cacheable_blocks / 16)
        .unwrap_or(usize::MAX)
        .max(MIN_UNJOURNALED_LIMIT)
}

/// A clean copy of write-through data waiting for its backend sync before
/// it is journaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnjournaledClean {
    pub image: u16,
    /// The write's mark: a sync through it covers the data.
    pub mark: u64,
    pub cbn: Cbn,
    pub guest: u64,
    pub crc: u32,
}

/// Which images with unsynced write-through data to sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsynced {
    /// All: a guest flush makes everything durable.
    All,
    /// Those the journal describes: before a batch.
    Described,
    /// Those the index describes (the journal's, and those of clean copies
    /// not journaled yet): before a checkpoint, which records the index.
    Indexed,
}

/// A block position: (line key, slot).
pub(crate) type At = (u64, u8);

#[derive(Debug)]
pub(crate) struct Ledger {
    /// Images with write-through data not yet synced on the backend, each
    /// with the mark (write number) of the last such write. Marks are
    /// numbered across images and never reused, so an unchanged mark
    /// proves nothing was written through since.
    unsynced: BTreeMap<u16, u64>,
    /// Of those, images that pending journal entries (or the next
    /// checkpoint) describe data of: sectors made valid, clean copies
    /// promoted or relocated while the image had unsynced data. The
    /// entries must not reach flash before the backend has the data; a
    /// journal batch syncs these backends only, a guest flush all of them.
    /// Each with the mark of the last such write.
    journal_deps: BTreeMap<u16, u64>,
    /// Clean copies of write-through data, mapped in the index but held
    /// out of the journal until a backend sync covers their data (then
    /// journaled, if still mapped). Recorded at once they would make every
    /// journal batch, and every commit an overwrite of a cached block waits
    /// for, sync the backend first. A crash forgets them: reads go to the
    /// backend, which holds the same bytes or older ones.
    unjournaled_clean: HashMap<At, UnjournaledClean>,
    /// Held clean copies beyond which their backends are synced for them.
    unjournaled_limit: usize,
    /// Dirty blocks were recorded since the last commit: before anything
    /// bypasses the log to a backend, they must be durable (the log keeps
    /// the COW layer's write order only for what goes through it).
    pub uncommitted_dirty: bool,
    /// When the journal buffer was last written out (metadata write-back
    /// writes it out when it has waited too long).
    pub journal_written: Instant,
}

impl Ledger {
    /// An empty ledger holding up to `unjournaled_limit` clean copies out
    /// of the journal (see [`unjournaled_limit`]).
    pub(crate) fn new(unjournaled_limit: usize) -> Self {
        Ledger {
            unsynced: BTreeMap::new(),
            journal_deps: BTreeMap::new(),
            unjournaled_clean: HashMap::new(),
            unjournaled_limit,
            uncommitted_dirty: false,
            journal_written: Instant::now(),
        }
    }

    /// A write through to image `id`'s backend, numbered `mark`, is not
    /// synced there yet; `described`: journal entries describe its data.
    pub(crate) fn wrote_through(&mut self, id: u16, mark: u64, described: bool) {
        self.unsynced.insert(id, mark);
        if described {
            self.journal_deps.insert(id, mark);
        }
    }

    /// Before journaling a clean copy of image `id` read from its backend
    /// (a promotion, a relocation): the backend may not have synced what
    /// it returned, so the record waits for the sync as well.
    pub(crate) fn clean_copy_needs_sync(&mut self, id: u16) {
        if let Some(&mark) = self.unsynced.get(&id) {
            self.journal_deps.insert(id, mark);
        }
    }

    /// The mark of image `id`'s last write not synced on its backend.
    pub(crate) fn unsynced_mark(&self, id: u16) -> Option<u64> {
        self.unsynced.get(&id).copied()
    }

    /// Whether pending journal entries wait for a backend sync.
    pub(crate) fn has_journal_deps(&self) -> bool {
        !self.journal_deps.is_empty()
    }

    /// The images `which` asks to sync (not all may have an open store).
    pub(crate) fn to_sync(&self, which: Unsynced) -> BTreeSet<u16> {
        match which {
            Unsynced::All => self.unsynced.keys().copied().collect(),
            Unsynced::Described => self.journal_deps.keys().copied().collect(),
            Unsynced::Indexed => self
                .journal_deps
                .keys()
                .copied()
                .chain(self.unjournaled_clean.values().map(|c| c.image))
                .collect(),
        }
    }

    /// Image `id`'s backend synced everything written through up to
    /// `mark`: it stays marked only if written through since. Returns the
    /// clean copies the sync covered, in the order written, for the caller
    /// to journal those the index still maps.
    pub(crate) fn synced(&mut self, id: u16, mark: u64) -> Vec<(At, UnjournaledClean)> {
        if self.unsynced.get(&id) == Some(&mark) {
            self.unsynced.remove(&id);
        }
        if self.journal_deps.get(&id).is_some_and(|&d| d <= mark) {
            self.journal_deps.remove(&id);
        }
        let mut ready: Vec<(At, UnjournaledClean)> = Vec::new();
        self.unjournaled_clean.retain(|&at, c| {
            if c.image == id && c.mark <= mark {
                ready.push((at, *c));
                false
            } else {
                true
            }
        });
        // In the order written, so the journal reads like the index grew.
        ready.sort_unstable_by_key(|(_, c)| c.mark);
        ready
    }

    /// After every open store synced: what is left has no store to sync,
    /// and its clean copies are never journaled.
    pub(crate) fn forget_all(&mut self) {
        self.unsynced.clear();
        self.journal_deps.clear();
        self.unjournaled_clean.clear();
    }

    /// Holds a clean copy out of the journal until a sync covers it.
    pub(crate) fn hold_clean(&mut self, at: At, copy: UnjournaledClean) {
        self.unjournaled_clean.insert(at, copy);
    }

    /// Drops the held clean copy at `at` if it still is the block `current`
    /// (what the index maps there); true if it was.
    pub(crate) fn forget_clean(&mut self, at: At, current: Option<Cbn>) -> bool {
        let held = self
            .unjournaled_clean
            .get(&at)
            .is_some_and(|c| current == Some(c.cbn));
        if held {
            self.unjournaled_clean.remove(&at);
        }
        held
    }

    /// Clean copies held out of the journal.
    pub(crate) fn held_clean(&self) -> usize {
        self.unjournaled_clean.len()
    }

    /// Whether so many clean copies are held that their backends must be
    /// synced for them, without waiting for a guest flush.
    pub(crate) fn clean_over_limit(&self) -> bool {
        self.held_clean() >= self.unjournaled_limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(image: u16, mark: u64, cbn: Cbn) -> UnjournaledClean {
        UnjournaledClean {
            image,
            mark,
            cbn,
            guest: 0,
            crc: 0,
        }
    }

    #[test]
    fn a_sync_clears_only_the_mark_it_covered() {
        let mut l = Ledger::new(MIN_UNJOURNALED_LIMIT);
        l.wrote_through(1, 5, false);
        l.wrote_through(1, 7, false);
        // A sync that started at mark 5 does not cover the write at 7.
        assert!(l.synced(1, 5).is_empty());
        assert_eq!(l.unsynced_mark(1), Some(7));
        assert_eq!(l.to_sync(Unsynced::All), BTreeSet::from([1]));
        l.synced(1, 7);
        assert_eq!(l.unsynced_mark(1), None);
        assert!(l.to_sync(Unsynced::All).is_empty());
    }

    #[test]
    fn only_described_writes_make_journal_deps() {
        let mut l = Ledger::new(MIN_UNJOURNALED_LIMIT);
        l.wrote_through(1, 1, false);
        l.wrote_through(2, 2, true);
        assert!(l.has_journal_deps());
        assert_eq!(l.to_sync(Unsynced::Described), BTreeSet::from([2]));
        assert_eq!(l.to_sync(Unsynced::All), BTreeSet::from([1, 2]));
        l.synced(2, 2);
        assert!(!l.has_journal_deps());
        assert_eq!(l.to_sync(Unsynced::All), BTreeSet::from([1]));
    }

    #[test]
    fn a_clean_copy_depends_on_its_images_last_unsynced_write() {
        let mut l = Ledger::new(MIN_UNJOURNALED_LIMIT);
        // Nothing unsynced: a copy read from the backend needs no sync.
        l.clean_copy_needs_sync(3);
        assert!(!l.has_journal_deps());
        l.wrote_through(3, 9, false);
        l.clean_copy_needs_sync(3);
        assert_eq!(l.to_sync(Unsynced::Described), BTreeSet::from([3]));
        // A dependency stays until a sync reaches its mark.
        l.synced(3, 8);
        assert!(l.has_journal_deps());
        l.synced(3, 9);
        assert!(!l.has_journal_deps());
    }

    #[test]
    fn held_copies_come_back_in_write_order_once_covered() {
        let mut l = Ledger::new(MIN_UNJOURNALED_LIMIT);
        l.wrote_through(1, 4, false);
        l.hold_clean((10, 0), copy(1, 4, 40));
        l.hold_clean((10, 1), copy(1, 2, 20));
        l.hold_clean((11, 0), copy(1, 6, 60));
        l.hold_clean((12, 0), copy(2, 1, 10));
        assert_eq!(l.to_sync(Unsynced::Indexed), BTreeSet::from([1, 2]));
        assert_eq!(l.to_sync(Unsynced::Described), BTreeSet::new());
        let ready = l.synced(1, 4);
        let got: Vec<(At, u64)> = ready.iter().map(|&(at, c)| (at, c.mark)).collect();
        assert_eq!(got, vec![((10, 1), 2), ((10, 0), 4)]);
        assert_eq!(l.held_clean(), 2);
        assert_eq!(l.to_sync(Unsynced::Indexed), BTreeSet::from([1, 2]));
    }

    #[test]
    fn a_held_copy_is_forgotten_only_while_the_index_maps_it() {
        let mut l = Ledger::new(MIN_UNJOURNALED_LIMIT);
        l.hold_clean((1, 2), copy(0, 1, 7));
        assert!(!l.forget_clean((1, 2), Some(8)));
        assert!(!l.forget_clean((1, 2), None));
        assert_eq!(l.held_clean(), 1);
        assert!(l.forget_clean((1, 2), Some(7)));
        assert_eq!(l.held_clean(), 0);
        assert!(!l.forget_clean((1, 2), Some(7)));
    }

    #[test]
    fn held_copies_are_due_only_when_the_limit_is_reached() {
        let mut l = Ledger::new(3);
        for i in 0..2 {
            l.hold_clean((i, 0), copy(0, 1, i as Cbn));
            assert!(!l.clean_over_limit(), "{} held", i + 1);
        }
        l.hold_clean((2, 0), copy(0, 1, 2));
        assert!(l.clean_over_limit());
        assert!(l.forget_clean((2, 0), Some(2)));
        assert!(!l.clean_over_limit());
    }

    #[test]
    fn the_limit_is_a_sixteenth_of_the_cache_and_never_small() {
        assert_eq!(unjournaled_limit(0), MIN_UNJOURNALED_LIMIT);
        assert_eq!(unjournaled_limit(16 * 4096), MIN_UNJOURNALED_LIMIT);
        assert_eq!(unjournaled_limit(1 << 20), 65536);
    }

    #[test]
    fn forget_all_empties_every_record() {
        let mut l = Ledger::new(MIN_UNJOURNALED_LIMIT);
        l.wrote_through(1, 1, true);
        l.hold_clean((0, 0), copy(1, 1, 1));
        l.forget_all();
        assert!(l.to_sync(Unsynced::Indexed).is_empty());
        assert!(l.to_sync(Unsynced::All).is_empty());
        assert_eq!(l.held_clean(), 0);
    }
}
