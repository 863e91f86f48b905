//! Sparse lines of the virtual cache map. A line holding only a few cached
//! blocks would cost far more as a full [`super::Line`] (24 bytes, a block
//! array and a hash table slot: about 1% of one cached 4 KiB block). Here
//! each cached block of such a line is one 7-byte word of an open-addressed
//! table that stores only what the word's position does not already say:
//! the line key is mixed by a bijection to `h`, the home position is
//! `h * homes / 2^40` (so homes follow the order of `h`), and the word keeps
//! only the low bits of `h`, as many as one home's share of the key space
//! needs to tell its keys apart (quotient hashing). Words stay in Robin
//! Hood order, so every block of a line sits in one run after its home, a
//! lookup stops at the first word closer to its own home than the probe
//! is, and the words are sorted by `h`: a resize is one pass. The table is
//! kept 72-86% full: 8.1-9.7 bytes per cached block, under 0.25% of the
//! cached bytes, with inserts walking a few dozen words at most on average.
//!
//! The table knows nothing of reference counts, partially valid blocks or
//! guest cluster numbers: lines that need any of those are full lines. It
//! never decides which form a line takes and never does I/O.

use super::{Cbn, key_image, key_line, line_key};

/// Most blocks a sparse line holds: from eight blocks on a full line costs
/// less than 0.24% of them (a full line of seven, with the owner number its
/// block array keeps, costs about 0.26%).
pub const SPARSE_MAX: usize = 7;

/// Line keys the table can hold: image ids below 2^10 and lines below 2^30
/// (host offsets below 64 TiB). Others are always full lines.
const IMAGE_BITS: u32 = 10;
const LINE_BITS: u32 = 30;
const KEY_BITS: u32 = IMAGE_BITS + LINE_BITS;
const KEY_MASK: u64 = (1 << KEY_BITS) - 1;

/// Farthest a word may sit from its home (stored plus one: 0 is empty).
const MAX_DISP: usize = 62;
const DISP_BITS: u32 = 6;
const SLOT_BITS: u32 = 4;

/// Bytes per word, and the bits they hold.
const WORD_BYTES: usize = 7;
const WORD_MASK: u64 = (1 << (8 * WORD_BYTES)) - 1;

/// Fill limits in percent: grow above 86% to 75%, shrink below 72% to 80%.
/// Below 72% a word would cost 9.7 bytes per block; above 86% inserts walk
/// far (linear probing) and more blocks miss their home by too much. A
/// resize moves every block, so growth takes a wide step.
const GROW_AT: u64 = 86;
const GROW_TO: u64 = 75;
const SHRINK_AT: u64 = 72;
const SHRINK_TO: u64 = 80;

/// The mixing bijection on [`KEY_BITS`]-bit keys: odd multipliers are
/// invertible modulo a power of two, and `x ^ (x >> 20)` undoes itself on
/// 40 bits.
const MIX_A: u64 = 0x9E37_79B9_7F4A_7C15 & KEY_MASK;
const MIX_B: u64 = 0xC2B2_AE3D_27D4_EB4F & KEY_MASK;
const MIX_SHIFT: u32 = KEY_BITS / 2;

/// The inverse of an odd number modulo 2^64 (Newton's iteration doubles the
/// correct low bits each step, from 3).
const fn inverse(a: u64) -> u64 {
    let mut x = a;
    let mut i = 0;
    while i < 6 {
        x = x.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(x)));
        i += 1;
    }
    x
}

const UNMIX_A: u64 = inverse(MIX_A);
const UNMIX_B: u64 = inverse(MIX_B);

fn mix(x: u64) -> u64 {
    let x = x.wrapping_mul(MIX_A) & KEY_MASK;
    let x = x ^ (x >> MIX_SHIFT);
    let x = x.wrapping_mul(MIX_B) & KEY_MASK;
    x ^ (x >> MIX_SHIFT)
}

fn unmix(x: u64) -> u64 {
    let x = x ^ (x >> MIX_SHIFT);
    let x = x.wrapping_mul(UNMIX_B) & KEY_MASK;
    let x = x ^ (x >> MIX_SHIFT);
    x.wrapping_mul(UNMIX_A) & KEY_MASK
}

/// Whether a line key is in the table's key space.
pub fn fits(key: u64) -> bool {
    u64::from(key_image(key)) < 1 << IMAGE_BITS && key_line(key) < 1 << LINE_BITS
}

fn pack(key: u64) -> u64 {
    (u64::from(key_image(key)) << LINE_BITS) | key_line(key)
}

fn unpack(packed: u64) -> u64 {
    line_key(
        (packed >> LINE_BITS) as u16,
        packed & ((1 << LINE_BITS) - 1),
    )
}

/// What [`SparseTable::upsert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upsert {
    /// The slot was present: its old block and whether it was dirty.
    Replaced(Cbn, bool),
    Added,
    Refused,
}

/// One cached block of a sparse line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub key: u64,
    pub slot: usize,
    pub cbn: Cbn,
    pub dirty: bool,
}

/// Every block of one sparse line, in slot order.
#[derive(Debug, Clone, Copy)]
pub struct SparseLine {
    pub key: u64,
    pub present: u16,
    pub dirty: u16,
    /// Block numbers of the present slots, in slot order.
    pub cbns: [Cbn; SPARSE_MAX],
}

impl SparseLine {
    fn empty(key: u64) -> SparseLine {
        SparseLine {
            key,
            present: 0,
            dirty: 0,
            cbns: [0; SPARSE_MAX],
        }
    }

    /// Adds a block (any order); slots beyond [`SPARSE_MAX`] are ignored.
    fn add(&mut self, slot: usize, cbn: Cbn, dirty: bool) {
        let n = self.present.count_ones() as usize;
        if n == SPARSE_MAX {
            return;
        }
        let rank = (self.present & ((1u16 << slot) - 1)).count_ones() as usize;
        self.cbns.copy_within(rank..n, rank + 1);
        self.cbns[rank] = cbn;
        self.present |= 1 << slot;
        if dirty {
            self.dirty |= 1 << slot;
        }
    }
}

/// Field positions of a word: block number, dirty bit, slot, displacement
/// plus one, tag: the low bits of the mixed key (low to high).
#[derive(Debug, Clone, Copy)]
struct Fields {
    cbn_bits: u32,
}

impl Fields {
    fn cbn(self, w: u64) -> Cbn {
        (w & ((1 << self.cbn_bits) - 1)) as Cbn
    }
    fn dirty(self, w: u64) -> bool {
        w >> self.cbn_bits & 1 != 0
    }
    fn slot(self, w: u64) -> usize {
        (w >> (self.cbn_bits + 1) & ((1 << SLOT_BITS) - 1)) as usize
    }
    /// Distance from home (the word must not be empty).
    fn disp(self, w: u64) -> usize {
        (w >> (self.cbn_bits + 1 + SLOT_BITS) & ((1 << DISP_BITS) - 1)) as usize - 1
    }
    fn tag(self, w: u64) -> u64 {
        w >> (self.cbn_bits + 1 + SLOT_BITS + DISP_BITS)
    }
    fn with_disp(self, w: u64, disp: usize) -> u64 {
        let at = self.cbn_bits + 1 + SLOT_BITS;
        (w & !(((1 << DISP_BITS) - 1) << at)) | ((disp as u64 + 1) << at)
    }
    fn with_tag(self, w: u64, tag: u64) -> u64 {
        let at = self.cbn_bits + 1 + SLOT_BITS + DISP_BITS;
        (w & ((1 << at) - 1)) | (tag << at)
    }
    fn with_dirty(self, w: u64, dirty: bool) -> u64 {
        (w & !(1 << self.cbn_bits)) | (u64::from(dirty) << self.cbn_bits)
    }
    fn with_cbn(self, w: u64, cbn: Cbn) -> u64 {
        (w & !((1 << self.cbn_bits) - 1)) | u64::from(cbn)
    }
    fn word(self, tag: u64, e: &Entry, disp: usize) -> u64 {
        let at = self.cbn_bits + 1 + SLOT_BITS + DISP_BITS;
        (tag << at)
            | ((disp as u64 + 1) << (self.cbn_bits + 1 + SLOT_BITS))
            | ((e.slot as u64) << (self.cbn_bits + 1))
            | (u64::from(e.dirty) << self.cbn_bits)
            | u64::from(e.cbn)
    }
    /// Bits the tag may use.
    fn tag_room(self) -> u32 {
        8 * WORD_BYTES as u32 - (self.cbn_bits + 1 + SLOT_BITS + DISP_BITS)
    }
}

/// Words of [`WORD_BYTES`] bytes, packed (8-byte words would cost as much
/// memory as running the table a seventh emptier). One spare byte at the
/// end lets every word load as a little-endian u64.
struct Words {
    bytes: Vec<u8>,
}

impl Words {
    fn new(len: usize) -> Words {
        Words {
            bytes: vec![0; len * WORD_BYTES + 1],
        }
    }

    fn len(&self) -> usize {
        self.bytes.len() / WORD_BYTES
    }

    fn get(&self, p: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.bytes[p * WORD_BYTES..p * WORD_BYTES + 8]);
        u64::from_le_bytes(b) & WORD_MASK
    }

    /// Sets word `p` (its own bytes only: a wider read-modify-write would
    /// overlap the previous word's store and stall the walks that shift
    /// words one by one).
    fn set(&mut self, p: usize, w: u64) {
        debug_assert!(w <= WORD_MASK);
        let at = p * WORD_BYTES;
        self.bytes[at..at + WORD_BYTES].copy_from_slice(&w.to_le_bytes()[..WORD_BYTES]);
    }

    fn bytes(&self) -> usize {
        self.bytes.capacity()
    }
}

/// Tag bits that tell apart the mixed keys of one home out of `homes`: a
/// home's share of the key space is at most `ceil(2^40 / homes)` keys
/// long, and no two keys that close have the same low bits.
fn tag_bits_for(homes: u64) -> u32 {
    64 - ((1u64 << KEY_BITS).div_ceil(homes) - 1).leading_zeros()
}

/// The home of a mixed key among `homes`.
fn home_for(h: u64, homes: u64) -> usize {
    ((u128::from(h) * u128::from(homes)) >> KEY_BITS) as usize
}

/// The smallest mixed key whose home is `home`.
fn first_of_home(home: usize, homes: u64) -> u64 {
    // home * 2^40 / homes, rounded up, in 64-bit steps where they suffice:
    // 2^40 = q * homes + r, and home * r < homes^2.
    let (q, r) = ((1u64 << KEY_BITS) / homes, (1u64 << KEY_BITS) % homes);
    let rest = match (home as u64).checked_mul(r) {
        Some(x) => x.div_ceil(homes),
        None => (u128::from(home as u64) * u128::from(r)).div_ceil(u128::from(homes)) as u64,
    };
    home as u64 * q + rest
}

/// The table.
pub struct SparseTable {
    /// `homes` home positions plus room to run past the last one; the last
    /// word is always empty, so a backward shift always stops.
    words: Words,
    homes: u64,
    /// The fewest homes whose tags still fit a word.
    min_homes: u64,
    fields: Fields,
    tag_mask: u64,
    entries: u64,
    lines: u64,
}

impl SparseTable {
    /// A table for a cache of `data_blocks` blocks (block numbers below it).
    pub fn new(data_blocks: u64) -> SparseTable {
        let cbn_bits = 64 - data_blocks.saturating_sub(1).max(1).leading_zeros();
        let fields = Fields { cbn_bits };
        let mut min_homes = 64u64;
        while tag_bits_for(min_homes) > fields.tag_room() {
            min_homes *= 2;
        }
        SparseTable {
            words: Words::new(min_homes as usize + MAX_DISP + 1),
            homes: min_homes,
            min_homes,
            fields,
            tag_mask: (1 << tag_bits_for(min_homes)) - 1,
            entries: 0,
            lines: 0,
        }
    }

    fn home_of(&self, key: u64) -> (usize, u64) {
        let h = mix(pack(key));
        (home_for(h, self.homes), h & self.tag_mask)
    }

    /// The mixed key of the word at `pos`.
    fn mixed_at(&self, pos: usize, w: u64) -> u64 {
        let first = first_of_home(pos - self.fields.disp(w), self.homes);
        first + (self.fields.tag(w).wrapping_sub(first) & self.tag_mask)
    }

    fn key_at(&self, pos: usize, w: u64) -> u64 {
        unpack(unmix(self.mixed_at(pos, w)))
    }

    /// Positions of the words whose home is `home` and tag `tag`.
    fn run(&self, home: usize, tag: u64) -> impl Iterator<Item = usize> + '_ {
        let f = self.fields;
        (0..=MAX_DISP)
            .map(move |d| (home + d, d))
            .map(move |(p, d)| (p, d, self.words.get(p)))
            .take_while(move |&(_, d, w)| w != 0 && f.disp(w) >= d)
            .filter(move |&(_, d, w)| f.disp(w) == d && f.tag(w) == tag)
            .map(|(p, _, _)| p)
    }

    fn position(&self, key: u64, slot: usize) -> Option<usize> {
        let (home, tag) = self.home_of(key);
        self.run(home, tag)
            .find(|&p| self.fields.slot(self.words.get(p)) == slot)
    }

    /// The block of (key, slot) and whether it is dirty.
    pub fn get(&self, key: u64, slot: usize) -> Option<(Cbn, bool)> {
        let w = self.words.get(self.position(key, slot)?);
        Some((self.fields.cbn(w), self.fields.dirty(w)))
    }

    /// Every block of a line (none: `present == 0`).
    pub fn line(&self, key: u64) -> SparseLine {
        let (home, tag) = self.home_of(key);
        let mut line = SparseLine::empty(key);
        for p in self.run(home, tag) {
            let w = self.words.get(p);
            line.add(
                self.fields.slot(w),
                self.fields.cbn(w),
                self.fields.dirty(w),
            );
        }
        line
    }

    /// Marks (key, slot) clean if it maps to `cbn` and is dirty; false
    /// otherwise (nothing changed).
    pub fn mark_clean(&mut self, key: u64, slot: usize, cbn: Cbn) -> bool {
        let f = self.fields;
        match self.position(key, slot) {
            Some(p) if f.cbn(self.words.get(p)) == cbn && f.dirty(self.words.get(p)) => {
                self.words.set(p, f.with_dirty(self.words.get(p), false));
                true
            }
            _ => false,
        }
    }

    /// Where a new word with home `home` would end up shifting others: the
    /// displacement each carried word reaches stays within [`MAX_DISP`].
    fn has_room(&self, home: usize) -> bool {
        let mut carried = 0;
        for p in home..self.words.len() {
            if carried > MAX_DISP {
                return false;
            }
            let w = self.words.get(p);
            if w == 0 {
                return true;
            }
            carried = carried.min(self.fields.disp(w)) + 1;
        }
        false
    }

    /// Adds a block that is not in the table; false (nothing changed) when
    /// the table is too full (rebuild it first) or the block does not fit
    /// near its home: the caller keeps the line as a full line.
    pub fn insert(&mut self, e: &Entry) -> bool {
        debug_assert!(self.position(e.key, e.slot).is_none());
        if !self.storable(e) {
            return false;
        }
        let (home, tag) = self.home_of(e.key);
        let new_line = self.run(home, tag).next().is_none();
        self.put(e, home, tag, new_line)
    }

    /// Maps (key, slot) to a block in one walk of the line's run: replaces
    /// the block when the slot is present, adds it when the line has fewer
    /// than `max_blocks` blocks and it fits, refuses otherwise (nothing
    /// changed: the caller makes the line full).
    pub fn upsert(&mut self, e: &Entry, max_blocks: usize) -> Upsert {
        if !self.storable(e) {
            return Upsert::Refused;
        }
        let (home, tag) = self.home_of(e.key);
        let f = self.fields;
        let (mut blocks, mut present) = (0, None);
        for p in self.run(home, tag) {
            if f.slot(self.words.get(p)) == e.slot {
                present = Some(p);
                break;
            }
            blocks += 1;
        }
        if let Some(p) = present {
            let w = self.words.get(p);
            self.words
                .set(p, f.with_dirty(f.with_cbn(w, e.cbn), e.dirty));
            return Upsert::Replaced(f.cbn(w), f.dirty(w));
        }
        if blocks >= max_blocks || !self.put(e, home, tag, blocks == 0) {
            return Upsert::Refused;
        }
        Upsert::Added
    }

    fn storable(&self, e: &Entry) -> bool {
        fits(e.key) && u64::from(e.cbn) >> self.fields.cbn_bits == 0 && !self.too_full()
    }

    /// Places a new word at or after `home`, shifting later-homed words
    /// (Robin Hood); false (nothing changed) when a word would end up too
    /// far from its home.
    fn put(&mut self, e: &Entry, home: usize, tag: u64, new_line: bool) -> bool {
        if !self.has_room(home) {
            return false;
        }
        self.lines += u64::from(new_line);
        let f = self.fields;
        let (mut carried, mut disp) = (f.word(tag, e, 0), 0);
        for p in home.. {
            let w = self.words.get(p);
            if w == 0 {
                self.words.set(p, f.with_disp(carried, disp));
                break;
            }
            if f.disp(w) < disp {
                self.words.set(p, f.with_disp(carried, disp));
                (carried, disp) = (w, f.disp(w));
            }
            disp += 1;
        }
        self.entries += 1;
        true
    }

    /// Removes (key, slot); returns its block and whether it was dirty.
    pub fn remove(&mut self, key: u64, slot: usize) -> Option<(Cbn, bool)> {
        let p = self.position(key, slot)?;
        let f = self.fields;
        let w = self.words.get(p);
        let mut at = p;
        loop {
            let next = self.words.get(at + 1);
            if next == 0 || f.disp(next) == 0 {
                self.words.set(at, 0);
                break;
            }
            self.words.set(at, f.with_disp(next, f.disp(next) - 1));
            at += 1;
        }
        self.entries -= 1;
        let (home, tag) = self.home_of(key);
        if self.run(home, tag).next().is_none() {
            self.lines -= 1;
        }
        Some((f.cbn(w), f.dirty(w)))
    }

    /// Removes every block of a line.
    pub fn take_line(&mut self, key: u64) -> Vec<Entry> {
        let line = self.line(key);
        let mut out = Vec::with_capacity(line.present.count_ones() as usize);
        for slot in 0..16 {
            if line.present & (1 << slot) != 0
                && let Some((cbn, dirty)) = self.remove(key, slot)
            {
                out.push(Entry {
                    key,
                    slot,
                    cbn,
                    dirty,
                });
            }
        }
        out
    }

    fn too_full(&self) -> bool {
        (self.entries + 1) * 100 > self.homes * GROW_AT
    }

    /// The home count the table should have now, when it is too full or
    /// too empty.
    pub fn wanted_homes(&self) -> Option<u64> {
        let to = if self.too_full() {
            GROW_TO
        } else if self.homes > self.min_homes && self.entries * 100 < self.homes * SHRINK_AT {
            SHRINK_TO
        } else {
            return None;
        };
        Some(
            (self.entries * 100)
                .div_ceil(to)
                .max(self.entries + 1)
                .max(self.min_homes),
        )
    }

    /// Moves every block into a table of `homes` homes; returns the blocks
    /// that did not fit (the caller makes their lines full lines). Words
    /// are in order of their home, and homes follow the mixed keys: sorting
    /// each home's few words by key gives every word in key order, and
    /// placing them in that order is the Robin Hood layout of the new size.
    pub fn rebuild(&mut self, homes: u64) -> Vec<Entry> {
        let mut sorted: Vec<(u64, u64)> = Vec::with_capacity(self.entries as usize);
        let mut home_start = (usize::MAX, 0);
        for p in 0..self.words.len() {
            let w = self.words.get(p);
            if w == 0 {
                continue;
            }
            let home = p - self.fields.disp(w);
            if home != home_start.0 {
                sorted[home_start.1..].sort_unstable_by_key(|e| e.0);
                home_start = (home, sorted.len());
            }
            sorted.push((self.mixed_at(p, w), w));
        }
        sorted[home_start.1..].sort_unstable_by_key(|e| e.0);
        self.homes = homes.max(self.min_homes);
        self.tag_mask = (1 << tag_bits_for(self.homes)) - 1;
        self.words = Words::new(self.homes as usize + MAX_DISP + 1);
        let (f, mut next, mut last) = (self.fields, 0, None);
        let mut left = Vec::new();
        self.entries = 0;
        self.lines = 0;
        for (h, w) in sorted {
            let home = home_for(h, self.homes);
            let at = home.max(next);
            if at - home > MAX_DISP {
                left.push(Entry {
                    key: unpack(unmix(h)),
                    slot: f.slot(w),
                    cbn: f.cbn(w),
                    dirty: f.dirty(w),
                });
                continue;
            }
            self.words
                .set(at, f.with_tag(f.with_disp(w, at - home), h & self.tag_mask));
            next = at + 1;
            self.entries += 1;
            if last != Some(h) {
                self.lines += 1;
                last = Some(h);
            }
        }
        left
    }

    /// Every sparse line (for checkpoints and scans).
    pub fn lines(&self) -> impl Iterator<Item = SparseLine> + '_ {
        let f = self.fields;
        (0..self.words.len())
            .map(move |p| (p, self.words.get(p)))
            .filter(move |&(p, w)| w != 0 && self.first_of_line(p, w))
            .map(move |(p, w)| {
                let home = p - f.disp(w);
                let key = self.key_at(p, w);
                let mut line = SparseLine::empty(key);
                for q in self.run(home, f.tag(w)) {
                    let x = self.words.get(q);
                    line.add(f.slot(x), f.cbn(x), f.dirty(x));
                }
                line
            })
    }

    /// Whether the word at `p` is the first of its line's run.
    fn first_of_line(&self, p: usize, w: u64) -> bool {
        let home = p - self.fields.disp(w);
        self.run(home, self.fields.tag(w)).next() == Some(p)
    }

    pub fn line_count(&self) -> u64 {
        self.lines
    }

    pub fn bytes(&self) -> usize {
        self.words.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn mixing_is_a_bijection_on_the_key_space() {
        assert_eq!(MIX_A.wrapping_mul(UNMIX_A), 1);
        assert_eq!(MIX_B.wrapping_mul(UNMIX_B), 1);
        use rand::{Rng, SeedableRng};
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0x0123_4567_89ab_cdef);
        for k in [0, 1, 2, KEY_MASK - 1, KEY_MASK]
            .into_iter()
            .chain((0..10_000).map(|_| rng.next_u64() & KEY_MASK))
        {
            assert!(mix(k) <= KEY_MASK);
            assert_eq!(unmix(mix(k)), k);
        }
        assert!(fits(line_key(1023, (1 << 30) - 1)));
        assert!(!fits(line_key(1024, 0)));
        assert!(!fits(line_key(0, 1 << 30)));
    }

    /// Each home's first mixed key, computed in 64-bit steps, is the one a
    /// 128-bit division gives, and the homes change exactly there.
    #[test]
    fn homes_split_the_key_space_in_order() {
        for homes in [64u64, 1000, 4097, 1 << 20, (1 << 33) + 7] {
            for home in [1usize, 2, 63, (homes / 3) as usize, (homes - 1) as usize] {
                let first = first_of_home(home, homes);
                let exact = (u128::from(home as u64) << KEY_BITS).div_ceil(u128::from(homes));
                assert_eq!(u128::from(first), exact, "{homes}/{home}");
                assert_eq!(home_for(first, homes), home);
                assert_eq!(home_for(first - 1, homes), home - 1);
            }
        }
    }

    type Model = BTreeMap<(u64, usize), (Cbn, bool)>;

    fn check(t: &SparseTable, model: &Model) {
        for (&(key, slot), &v) in model {
            assert_eq!(t.get(key, slot), Some(v), "{key:#x}/{slot}");
        }
        let mut lines: BTreeMap<u64, SparseLine> = BTreeMap::new();
        for (&(key, slot), &(cbn, dirty)) in model {
            lines
                .entry(key)
                .or_insert_with(|| SparseLine::empty(key))
                .add(slot, cbn, dirty);
        }
        assert_eq!(t.line_count(), lines.len() as u64);
        let mut seen = 0;
        for l in t.lines() {
            let m = lines.get(&l.key).expect("a line the model has");
            assert_eq!((l.present, l.dirty), (m.present, m.dirty));
            assert_eq!(l.cbns, m.cbns);
            seen += 1;
        }
        assert_eq!(seen, lines.len());
    }

    /// Random inserts, replacements and removals against a map, through
    /// growth and shrinking; blocks a rebuild cannot place leave the table
    /// (the index makes their lines full).
    #[test]
    fn matches_a_map_through_growth_and_shrinking() {
        let mut t = SparseTable::new(1 << 16);
        let mut model = Model::new();
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
        let mut rnd = move |n: u64| rng.random_range(0..n);
        let mut next_cbn = 0;
        let rebuild = |t: &mut SparseTable, model: &mut Model| {
            if let Some(h) = t.wanted_homes() {
                for e in t.rebuild(h) {
                    model.remove(&(e.key, e.slot));
                }
            }
        };
        for step in 0..60_000u64 {
            let key = line_key(rnd(3) as u16, rnd(12_000) << 20);
            // At most SPARSE_MAX slots per line, spread over the line.
            let slot = rnd(SPARSE_MAX as u64) as usize * 2;
            let growing = step < 30_000;
            if growing || rnd(4) == 0 {
                let e = Entry {
                    key,
                    slot,
                    cbn: next_cbn % (1 << 16),
                    dirty: rnd(2) == 0,
                };
                next_cbn += 1;
                rebuild(&mut t, &mut model);
                let before = model.get(&(key, slot)).copied();
                match t.upsert(&e, SPARSE_MAX) {
                    Upsert::Replaced(c, d) => assert_eq!(Some((c, d)), before),
                    Upsert::Added => assert_eq!(before, None),
                    Upsert::Refused => {
                        assert_eq!(before, None);
                        continue;
                    }
                }
                model.insert((key, slot), (e.cbn, e.dirty));
            } else if let Some((&(k, s), _)) = model.range((key, 0)..).next() {
                assert_eq!(t.remove(k, s), model.remove(&(k, s)));
                rebuild(&mut t, &mut model);
            }
            if step % 5_000 == 0 {
                check(&t, &model);
            }
        }
        check(&t, &model);
        // Drained, the table is back at its smallest.
        while let Some((&(k, s), &v)) = model.iter().next() {
            assert_eq!(t.remove(k, s), Some(v));
            model.remove(&(k, s));
            rebuild(&mut t, &mut model);
        }
        check(&t, &model);
        assert_eq!(t.homes, t.min_homes);
    }

    /// Blocks that fit are never refused below the fill limit, and a
    /// refused insert changes nothing.
    #[test]
    fn refuses_only_when_full_or_out_of_reach() {
        let mut t = SparseTable::new(1 << 12);
        let homes = t.homes;
        let mut placed = 0u64;
        for i in 0..homes {
            let e = Entry {
                key: line_key(0, i),
                slot: 0,
                cbn: (i % (1 << 12)) as Cbn,
                dirty: false,
            };
            if t.insert(&e) {
                placed += 1;
            }
        }
        assert_eq!(placed, homes * GROW_AT / 100);
        let before = t.words.bytes.clone();
        assert!(!t.insert(&Entry {
            key: line_key(1, 0),
            slot: 0,
            cbn: 1,
            dirty: false,
        }));
        assert_eq!(t.words.bytes, before);
        assert!(!t.insert(&Entry {
            key: line_key(1024, 0),
            slot: 0,
            cbn: 1,
            dirty: false,
        }));
    }
}
