//! Deduplication (DASH, paper 001, section III; CacheDedup): the signature
//! table beside the address map. Each 4 KiB block that enters flash is
//! fingerprinted (BLAKE3); the table maps a fingerprint to the cache block
//! holding those bytes, so a later block with the same content is mapped
//! onto that block (the index's reference counts do the rest) instead of
//! written to flash again.
//!
//! An entry names its block together with the epoch of the block's
//! region: a region is only appended to and reclaimed whole, so a block
//! holds one content per epoch, and an entry whose region was reclaimed
//! since (or whose block nobody references any more) is stale and never
//! used. Stale entries are dropped on lookup and swept when they could
//! outnumber the live ones; there is no reverse map from blocks.
//!
//! Owns: fingerprints, the signature table, its counters. Must not: do
//! I/O, change the index, or decide alone that a block may be shared (the
//! caller says whether an entry's block is still the one it names, and may
//! compare bytes first).

use crate::index::Cbn;
use hashbrown::HashTable;

/// The first 128 bits of a block's BLAKE3 digest. Two different blocks
/// share it with probability 2^-128 per pair: for 2^32 cached blocks, about
/// 2^-65 that any pair in the cache does (see docs/dedup.md).
pub type Fingerprint = [u8; 16];

/// The fingerprint of bytes given in pieces (a block's bytes may span write
/// segments).
pub fn fingerprint(pieces: &[&[u8]]) -> Fingerprint {
    let mut h = blake3::Hasher::new();
    for p in pieces {
        h.update(p);
    }
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&h.finalize().as_bytes()[..16]);
    fp
}

/// Where a fingerprint's bytes are: a cache block, in its region's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub cbn: Cbn,
    pub epoch: u32,
}

/// What the table did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DedupCounts {
    /// Blocks looked up (fingerprinted before entering flash).
    pub lookups: u64,
    /// Lookups that found a live block with those bytes.
    pub found: u64,
    /// Entries dropped because their block was reclaimed or freed.
    pub stale: u64,
    /// Candidates whose bytes differed when compared (verify mode): a
    /// fingerprint collision, or a test hasher's.
    pub collisions: u64,
}

/// The signature table.
#[derive(Debug, Default)]
pub struct Signatures {
    table: HashTable<(Fingerprint, Place)>,
    counts: DedupCounts,
}

/// The table's hash of a fingerprint: its first bytes, already uniform.
fn hash(fp: &Fingerprint) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&fp[..8]);
    u64::from_le_bytes(b)
}

impl Signatures {
    /// The live place of `fp`: `live(place)` says whether the place still
    /// holds the bytes it was recorded for. A stale entry is dropped.
    pub fn find(&mut self, fp: &Fingerprint, live: impl Fn(Place) -> bool) -> Option<Place> {
        self.counts.lookups += 1;
        let entry = self.table.find_entry(hash(fp), |(k, _)| k == fp).ok()?;
        let place = entry.get().1;
        if live(place) {
            self.counts.found += 1;
            return Some(place);
        }
        entry.remove();
        self.counts.stale += 1;
        None
    }

    /// Records that `place` holds the bytes of `fp` (a newer place
    /// replaces an older one).
    pub fn remember(&mut self, fp: Fingerprint, place: Place) {
        match self.table.find_mut(hash(&fp), |(k, _)| *k == fp) {
            Some(e) => e.1 = place,
            None => {
                self.table
                    .insert_unique(hash(&fp), (fp, place), |(k, _)| hash(k));
            }
        }
    }

    /// Drops every stale entry once there are a quarter more entries than
    /// the cache's distinct live blocks (each holds one content, so at most
    /// that many entries are live), and gives back the memory they held.
    /// A sweep costs the table's size, once per that many insertions.
    pub fn sweep_if_over(&mut self, live_blocks: u64, live: impl Fn(Place) -> bool) {
        let bound = live_blocks + live_blocks / 4 + 1024;
        if (self.table.len() as u64) <= bound {
            return;
        }
        let before = self.table.len();
        self.table.retain(|(_, p)| live(*p));
        self.counts.stale += (before - self.table.len()) as u64;
        if self.table.len() < self.table.capacity() / 2 {
            self.table.shrink_to_fit(|(k, _)| hash(k));
        }
    }

    /// A candidate's bytes turned out to differ from the block's.
    pub fn collided(&mut self) {
        self.counts.collisions += 1;
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn counts(&self) -> DedupCounts {
        self.counts
    }

    /// Bytes of memory the table holds.
    pub fn memory_bytes(&self) -> u64 {
        (self.table.capacity() * (std::mem::size_of::<(Fingerprint, Place)>() + 1)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(n: u8) -> Fingerprint {
        fingerprint(&[&[n; 4096]])
    }

    #[test]
    fn fingerprints_cover_every_piece_and_byte() {
        let block = vec![7u8; 4096];
        assert_eq!(
            fingerprint(&[&block]),
            fingerprint(&[&block[..100], &block[100..]])
        );
        let mut other = block.clone();
        other[4095] = 8;
        assert_ne!(fingerprint(&[&block]), fingerprint(&[&other]));
    }

    #[test]
    fn a_live_place_is_found_and_a_stale_one_dropped() {
        let mut s = Signatures::default();
        let p = Place { cbn: 40, epoch: 3 };
        s.remember(fp(1), p);
        assert_eq!(s.find(&fp(1), |x| x == p), Some(p));
        assert_eq!(s.find(&fp(2), |_| true), None, "never recorded");
        // The region was reclaimed since: its epoch moved on.
        assert_eq!(s.find(&fp(1), |x| x.epoch == 4), None);
        assert_eq!(s.len(), 0, "the stale entry is gone");
        let c = s.counts();
        assert_eq!((c.lookups, c.found, c.stale), (3, 1, 1));
    }

    #[test]
    fn a_newer_place_replaces_the_older_and_sweeps_keep_live_ones() {
        let mut s = Signatures::default();
        s.remember(fp(1), Place { cbn: 1, epoch: 1 });
        s.remember(fp(1), Place { cbn: 9, epoch: 2 });
        assert_eq!(s.len(), 1);
        assert_eq!(s.find(&fp(1), |_| true).map(|p| p.cbn), Some(9));
        for n in 0..=255u8 {
            s.remember(
                fp(n),
                Place {
                    cbn: u32::from(n),
                    epoch: 1,
                },
            );
        }
        // Under the bound: nothing swept.
        s.sweep_if_over(200, |p| p.cbn < 10);
        assert_eq!(s.len(), 256);
        // Over it (with a small cache): only live places stay, and the
        // memory of the others is given back.
        let mut big = Signatures::default();
        for n in 0..3000u32 {
            big.remember(fingerprint(&[&n.to_le_bytes()]), Place { cbn: n, epoch: 1 });
        }
        let full = big.memory_bytes();
        big.sweep_if_over(100, |p| p.cbn < 10);
        assert_eq!(big.len(), 10);
        assert!(
            big.memory_bytes() * 10 < full,
            "{} of {full}",
            big.memory_bytes()
        );
    }
}
