//! The open-addressed table both halves of the signature table live in:
//! one tag byte per slot (seven bits of the hash, so a probe touches an
//! entry only when its tag matches) beside an array of entries, linear
//! probing, and any number of slots (not a power of two): it grows to
//! 10/7 of its entries once nine in ten slots are taken, so a table holds
//! 1.1 to 1.4 slots per entry (a power-of-two table at most 7/8 full holds
//! 1.14 to 2.3). Index memory per cached byte is what dedup must keep
//! small (issue 21 aims at 0.35%), and the checksum table has an entry
//! per cached block.
//!
//! There is no removal of one entry: the signature table replaces entries
//! in place and drops stale ones by rebuilding ([`Table::rebuild`]), so no
//! tombstones are needed.
//!
//! Owns: slots and their tags. Must not: know what an entry means; the
//! caller hashes and compares.

/// A tag: the high bit says the slot is taken, seven bits of the hash
/// filter probes.
fn tag(hash: u64) -> u8 {
    0x80 | (hash & 0x7f) as u8
}

const EMPTY: u8 = 0;

/// At most nine slots in ten taken before the table grows.
fn full(len: usize, slots: usize) -> bool {
    len * 10 >= slots * 9
}

/// Slots for `len` entries after a rebuild: seven in ten taken.
fn slots_for(len: usize) -> usize {
    (len * 10 / 7).max(16)
}

#[derive(Debug, Default)]
pub(crate) struct Table<T> {
    tags: Box<[u8]>,
    entries: Box<[T]>,
    len: usize,
}

impl<T: Copy + Default> Table<T> {
    /// The slot a probe for `hash` starts at (the hash's high bits scaled
    /// to the table).
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.tags.len() as u128) >> 64) as usize
    }

    /// The slot after `i`, wrapping.
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.tags.len() { 0 } else { i + 1 }
    }

    /// The slots a probe for `hash` visits, up to the first free one.
    fn probe(&self, hash: u64) -> impl Iterator<Item = usize> + '_ {
        let first = (!self.tags.is_empty()).then(|| self.home(hash));
        std::iter::successors(first, |&i| Some(self.next(i)))
            .take(self.tags.len())
            .take_while(|&i| self.tags[i] != EMPTY)
    }

    /// The slot of the first entry with `hash` that `eq` accepts.
    fn slot(&self, hash: u64, eq: impl Fn(&T) -> bool) -> Option<usize> {
        let t = tag(hash);
        self.probe(hash)
            .find(|&i| self.tags[i] == t && eq(&self.entries[i]))
    }

    pub(crate) fn find(&self, hash: u64, eq: impl Fn(&T) -> bool) -> Option<&T> {
        self.slot(hash, eq).map(|i| &self.entries[i])
    }

    pub(crate) fn find_mut(&mut self, hash: u64, eq: impl Fn(&T) -> bool) -> Option<&mut T> {
        self.slot(hash, eq).map(|i| &mut self.entries[i])
    }

    /// Adds `entry` (the caller found none equal). `rehash` gives each
    /// entry's hash should the table grow, `None` for an entry no longer
    /// wanted. Returns how many entries growing dropped.
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        entry: T,
        rehash: impl Fn(&T) -> Option<u64>,
    ) -> usize {
        let dropped = if full(self.len + 1, self.tags.len()) {
            self.rebuild(1, rehash)
        } else {
            0
        };
        self.place(hash, entry);
        dropped
    }

    /// Puts `entry` in the first free slot from its home (there is one:
    /// the table is never full).
    fn place(&mut self, hash: u64, entry: T) {
        let mut i = self.home(hash);
        while self.tags[i] != EMPTY {
            i = self.next(i);
        }
        self.tags[i] = tag(hash);
        self.entries[i] = entry;
        self.len += 1;
    }

    /// Files every entry again under the hash `rehash` gives it, dropping
    /// those it gives none, in a table sized for the entries kept and
    /// `extra` more. Returns how many were dropped.
    pub(crate) fn rebuild(&mut self, extra: usize, rehash: impl Fn(&T) -> Option<u64>) -> usize {
        let kept: Vec<(u64, T)> = self
            .tags
            .iter()
            .zip(self.entries.iter())
            .filter(|(t, _)| **t != EMPTY)
            .filter_map(|(_, e)| rehash(e).map(|h| (h, *e)))
            .collect();
        let dropped = self.len - kept.len();
        let slots = slots_for(kept.len() + extra);
        self.tags = vec![EMPTY; slots].into_boxed_slice();
        self.entries = vec![T::default(); slots].into_boxed_slice();
        self.len = 0;
        for (h, e) in kept {
            self.place(h, e);
        }
        dropped
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the slots take.
    pub(crate) fn memory_bytes(&self) -> u64 {
        (self.tags.len() * (1 + std::mem::size_of::<T>())) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spread(x: u32) -> u64 {
        u64::from(x).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    #[test]
    fn entries_are_found_by_hash_and_equality_through_growth() {
        let mut t: Table<u32> = Table::default();
        assert_eq!(t.find(spread(1), |_| true), None, "an empty table");
        for x in 0..10_000u32 {
            assert_eq!(t.insert(spread(x), x, |&e| Some(spread(e))), 0);
        }
        assert_eq!(t.len(), 10_000);
        for x in 0..10_000u32 {
            assert_eq!(t.find(spread(x), |&e| e == x), Some(&x));
        }
        assert_eq!(t.find(spread(10_000), |&e| e == 10_000), None);
        // Same hash, other entry: equality decides.
        t.insert(spread(7), 70_000, |&e| Some(spread(e % 70_000)));
        assert_eq!(t.find(spread(7), |&e| e == 70_000), Some(&70_000));
        *t.find_mut(spread(7), |&e| e == 7).unwrap() = 8;
        assert_eq!(t.find(spread(7), |&e| e == 7), None);
    }

    #[test]
    fn a_table_holds_between_one_and_a_half_slots_per_entry() {
        let mut t: Table<u32> = Table::default();
        for x in 0..100_000u32 {
            t.insert(spread(x), x, |&e| Some(spread(e)));
            if x >= 64 {
                let per = t.memory_bytes() as f64 / 5.0 / t.len() as f64;
                assert!((1.0..=1.44).contains(&per), "{per} slots per entry at {x}");
            }
        }
    }

    #[test]
    fn a_rebuild_drops_what_is_no_longer_wanted_and_gives_back_memory() {
        let mut t: Table<u32> = Table::default();
        for x in 0..1000u32 {
            t.insert(spread(x), x, |&e| Some(spread(e)));
        }
        let before = t.memory_bytes();
        assert_eq!(t.rebuild(0, |&e| (e < 100).then(|| spread(e))), 900);
        assert_eq!(t.len(), 100);
        assert!(t.memory_bytes() * 5 < before);
        assert!((0..100).all(|x| t.find(spread(x), |&e| e == x).is_some()));
        assert!((100..1000).all(|x| t.find(spread(x), |&e| e == x).is_none()));
        // Growing drops too, and says how many.
        let mut small: Table<u32> = Table::default();
        let mut dropped = 0;
        for x in 0..15u32 {
            dropped += small.insert(spread(x), x, |&e| (e % 2 == 0).then(|| spread(e)));
        }
        assert_eq!(dropped, 7);
        assert_eq!(small.len(), 8);
    }
}
