//! The open-addressed table both halves of the signature table live in:
//! one tag byte per slot (seven bits of the hash, so a probe touches an
//! entry only when its tag matches) beside an array of entries, linear
//! probing a group of eight slots at a time (their tags compared as one
//! word), and any number of groups (not a power of two): it grows to
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

/// Tags read and compared at once, as the bytes of a `u64`.
const GROUP: usize = 8;
const LOW_BITS: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// The high bit of every byte of `group` that is zero: exact for the
/// lowest such byte; a byte above it may be flagged too (a borrow), so a
/// caller checks each byte it finds.
fn zero_bytes(group: u64) -> u64 {
    group.wrapping_sub(LOW_BITS) & !group & HIGH_BITS
}

/// At most nine slots in ten taken before the table grows.
fn full(len: usize, slots: usize) -> bool {
    len * 10 >= slots * 9
}

/// Slots for `len` entries after a rebuild: seven in ten taken.
fn slots_for(len: usize) -> usize {
    (len * 10 / 7).max(2 * GROUP).next_multiple_of(GROUP)
}

#[derive(Debug, Default)]
pub(crate) struct Table<T> {
    /// A tag per slot, in groups of [`GROUP`] slots.
    tags: Box<[u8]>,
    entries: Box<[T]>,
    len: usize,
}

impl<T: Copy + Default> Table<T> {
    fn slots(&self) -> usize {
        self.entries.len()
    }

    /// The first slot of the group a probe for `hash` starts at (the
    /// hash's high bits scaled to the table).
    fn home(&self, hash: u64) -> usize {
        let groups = (self.slots() / GROUP) as u128;
        ((u128::from(hash) * groups) >> 64) as usize * GROUP
    }

    /// The group after the one at slot `i`, wrapping.
    fn next_group(&self, i: usize) -> usize {
        let j = i + GROUP;
        if j == self.slots() { 0 } else { j }
    }

    /// The tags of the group at slot `i`, byte k for slot i + k.
    fn group(&self, i: usize) -> u64 {
        let mut bytes = [0u8; GROUP];
        bytes.copy_from_slice(&self.tags[i..i + GROUP]);
        u64::from_le_bytes(bytes)
    }

    /// The slot of the first entry with `hash` that `eq` accepts: slots
    /// from its home group on, a group at a time, up to the first free one
    /// (entries fill a group in order and are never removed, so none lies
    /// beyond).
    fn slot(&self, hash: u64, eq: impl Fn(&T) -> bool) -> Option<usize> {
        if self.slots() == 0 {
            return None;
        }
        let t = tag(hash);
        let mut i = self.home(hash);
        for _ in 0..=self.slots() / GROUP {
            let g = self.group(i);
            let free = !g & HIGH_BITS;
            // Only slots before the first free one belong to the probe.
            let before = if free == 0 {
                u64::MAX
            } else {
                (free & free.wrapping_neg()) - 1
            };
            let mut matches = zero_bytes(g ^ (u64::from(t) * LOW_BITS)) & before;
            while matches != 0 {
                let s = i + matches.trailing_zeros() as usize / 8;
                if self.tags[s] == t && eq(&self.entries[s]) {
                    return Some(s);
                }
                matches &= matches - 1;
            }
            if free != 0 {
                return None;
            }
            i = self.next_group(i);
        }
        None
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
        let dropped = if full(self.len + 1, self.slots()) {
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
        loop {
            let free = !self.group(i) & HIGH_BITS;
            if free != 0 {
                let s = i + free.trailing_zeros() as usize / 8;
                self.tags[s] = tag(hash);
                self.entries[s] = entry;
                self.len += 1;
                return;
            }
            i = self.next_group(i);
        }
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

    /// Groups an entry lies past its home group, on average (`hash_of`:
    /// each entry's hash).
    #[cfg(test)]
    pub(crate) fn mean_displacement(&self, hash_of: impl Fn(&T) -> u64) -> f64 {
        let n = self.slots();
        let groups: usize = (0..n)
            .filter(|&i| self.tags[i] != EMPTY)
            .map(|i| (i + n - self.home(hash_of(&self.entries[i]))) % n / GROUP)
            .sum();
        groups as f64 / self.len.max(1) as f64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the slots take.
    pub(crate) fn memory_bytes(&self) -> u64 {
        (self.tags.len() + self.entries.len() * std::mem::size_of::<T>()) as u64
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
                // Groups round the slots up to a multiple of eight.
                let most = 10.0 / 7.0 + GROUP as f64 / t.len() as f64;
                assert!((1.0..=most).contains(&per), "{per} slots per entry at {x}");
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
