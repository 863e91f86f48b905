//! Deduplication (DASH, paper 001, section III; CacheDedup): the signature
//! table beside the address map. A block that enters flash is first known
//! by its CRC-32C, which the cache computes for every block anyway; the
//! table maps a checksum to the cache block last written with it. Only a
//! block whose checksum the table knows, for a block that still holds
//! bytes with that checksum, is fingerprinted (BLAKE3) and compared with
//! that block's fingerprint, learned the first time the block is a
//! candidate and kept beside the table. So a unique block costs a lookup
//! and no hash, and a duplicate is mapped onto the block holding its bytes
//! (the index's reference counts do the rest) instead of written again.
//!
//! A learned fingerprint names its block together with the epoch of the
//! block's region: a region is only appended to and reclaimed whole, so a
//! block holds one content per epoch, and a fingerprint learned in an
//! older epoch is never used. A checksum entry needs no epoch: the caller
//! checks that its block still carries that checksum, and the fingerprint
//! decides. Stale entries are dropped on lookup and swept when they could
//! outnumber the live ones; there is no reverse map from blocks.
//!
//! Owns: fingerprints, the signature table, its counters. Must not: do
//! I/O, change the index, or decide alone that a block may be shared (the
//! caller says whether an entry's block is still the one it names, and
//! compares fingerprints or bytes).

use crate::index::Cbn;
use hashbrown::{HashMap, HashTable};

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

/// A cache block in its region's epoch: the bytes it held then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub cbn: Cbn,
    pub epoch: u32,
}

/// What the table did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DedupCounts {
    /// Blocks looked up (by checksum, before entering flash).
    pub lookups: u64,
    /// Lookups that found a live block with the same checksum: only these
    /// are fingerprinted (or, verifying, compared byte by byte).
    pub candidates: u64,
    /// Candidates whose bytes turned out equal: shared.
    pub found: u64,
    /// Entries dropped because their block was rewritten or freed.
    pub stale: u64,
    /// Candidates whose bytes differed: a checksum collision (about one
    /// pair in 2^32), or a fingerprint collision a test hasher forces.
    pub collisions: u64,
}

/// The signature table.
#[derive(Debug, Default)]
pub struct Signatures {
    /// Checksum to the cache block last written with it.
    by_crc: HashTable<(u32, Cbn)>,
    /// Fingerprints learned for blocks that were candidates.
    learned: HashMap<Cbn, (u32, Fingerprint)>,
    counts: DedupCounts,
}

/// The table's hash of a checksum: spread over all 64 bits (the table
/// picks buckets with the low bits and filters probes with the high ones).
fn hash(crc: u32) -> u64 {
    u64::from(crc).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Signatures {
    /// The block last recorded for checksum `crc`, if `live(cbn)` says it
    /// still holds bytes with that checksum (else the entry is dropped).
    pub fn find(&mut self, crc: u32, live: impl Fn(Cbn) -> bool) -> Option<Cbn> {
        self.counts.lookups += 1;
        let entry = self.by_crc.find_entry(hash(crc), |e| e.0 == crc).ok()?;
        let cbn = entry.get().1;
        if live(cbn) {
            self.counts.candidates += 1;
            return Some(cbn);
        }
        entry.remove();
        self.counts.stale += 1;
        None
    }

    /// Records that block `cbn` was written with checksum `crc` (it
    /// replaces the block recorded before).
    pub fn remember(&mut self, crc: u32, cbn: Cbn) {
        match self.by_crc.find_mut(hash(crc), |e| e.0 == crc) {
            Some(e) => e.1 = cbn,
            None => {
                self.by_crc
                    .insert_unique(hash(crc), (crc, cbn), |e| hash(e.0));
            }
        }
    }

    /// The fingerprint learned for `place`'s bytes, if it was learned in
    /// that epoch.
    pub fn fingerprint(&self, place: Place) -> Option<Fingerprint> {
        self.learned
            .get(&place.cbn)
            .filter(|(epoch, _)| *epoch == place.epoch)
            .map(|(_, fp)| *fp)
    }

    /// `place` holds bytes whose fingerprint is `fp`.
    pub fn learn(&mut self, place: Place, fp: Fingerprint) {
        self.learned.insert(place.cbn, (place.epoch, fp));
    }

    /// Drops every stale entry once there are a quarter more entries than
    /// the cache's distinct live blocks (each holds one content, so at most
    /// that many entries are live), and gives back the memory they held.
    /// A sweep costs the table's size, once per that many insertions.
    pub fn sweep_if_over(
        &mut self,
        live_blocks: u64,
        live: impl Fn(u32, Cbn) -> bool,
        holds: impl Fn(Place) -> bool,
    ) {
        let bound = live_blocks + live_blocks / 4 + 1024;
        if (self.by_crc.len() as u64) > bound {
            let before = self.by_crc.len();
            self.by_crc.retain(|e| live(e.0, e.1));
            self.counts.stale += (before - self.by_crc.len()) as u64;
            if self.by_crc.len() < self.by_crc.capacity() / 2 {
                self.by_crc.shrink_to_fit(|e| hash(e.0));
            }
        }
        if (self.learned.len() as u64) > bound {
            self.learned
                .retain(|&cbn, &mut (epoch, _)| holds(Place { cbn, epoch }));
            self.learned.shrink_to_fit();
        }
    }

    /// A candidate's bytes turned out equal to the block's.
    pub fn shared(&mut self) {
        self.counts.found += 1;
    }

    /// A candidate's bytes turned out to differ from the block's.
    pub fn collided(&mut self) {
        self.counts.collisions += 1;
    }

    /// Checksums in the table.
    pub fn len(&self) -> usize {
        self.by_crc.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_crc.is_empty()
    }

    /// Fingerprints learned.
    pub fn learned(&self) -> usize {
        self.learned.len()
    }

    pub fn counts(&self) -> DedupCounts {
        self.counts
    }

    /// Bytes of memory the table holds (a control byte per slot).
    pub fn memory_bytes(&self) -> u64 {
        let by_crc = self.by_crc.capacity() * (std::mem::size_of::<(u32, Cbn)>() + 1);
        let learned =
            self.learned.capacity() * (std::mem::size_of::<(Cbn, (u32, Fingerprint))>() + 1);
        (by_crc + learned) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_live_block_is_found_and_a_stale_one_dropped() {
        let mut s = Signatures::default();
        s.remember(0xabcd, 40);
        assert_eq!(s.find(0xabcd, |c| c == 40), Some(40));
        assert_eq!(s.find(0x1234, |_| true), None, "never recorded");
        // The block was rewritten or freed since.
        assert_eq!(s.find(0xabcd, |_| false), None);
        assert_eq!(s.len(), 0, "the stale entry is gone");
        let c = s.counts();
        assert_eq!((c.lookups, c.candidates, c.stale), (3, 1, 1));
    }

    #[test]
    fn a_fingerprint_counts_only_in_the_epoch_it_was_learned() {
        let mut s = Signatures::default();
        let fp = fingerprint(&[&[1u8; 4096]]);
        s.learn(Place { cbn: 7, epoch: 2 }, fp);
        assert_eq!(s.fingerprint(Place { cbn: 7, epoch: 2 }), Some(fp));
        assert_eq!(
            s.fingerprint(Place { cbn: 7, epoch: 3 }),
            None,
            "reclaimed since"
        );
        assert_eq!(s.fingerprint(Place { cbn: 8, epoch: 2 }), None);
    }

    #[test]
    fn a_newer_block_replaces_the_older_and_sweeps_keep_live_ones() {
        let mut s = Signatures::default();
        s.remember(5, 1);
        s.remember(5, 9);
        assert_eq!(s.len(), 1);
        assert_eq!(s.find(5, |_| true), Some(9));
        for n in 0..256u32 {
            s.remember(n, n);
        }
        // Under the bound: nothing swept.
        s.sweep_if_over(200, |_, cbn| cbn < 10, |_| false);
        assert_eq!(s.len(), 256);
        // Over it (with a small cache): only live entries stay, and the
        // memory of the others is given back.
        let mut big = Signatures::default();
        for n in 0..3000u32 {
            big.remember(n.wrapping_mul(2_654_435_761), n);
            big.learn(Place { cbn: n, epoch: 1 }, [0; 16]);
        }
        let full = big.memory_bytes();
        big.sweep_if_over(100, |_, cbn| cbn < 10, |p| p.cbn < 20);
        assert_eq!((big.len(), big.learned()), (10, 20));
        assert!(
            big.memory_bytes() * 10 < full,
            "{} of {full}",
            big.memory_bytes()
        );
    }
}
