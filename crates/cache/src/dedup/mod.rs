//! Deduplication (DASH, paper 001, section III; CacheDedup): the signature
//! table beside the address map. A block that enters flash is first known
//! by its CRC-32C, which the cache computes for every block anyway and
//! keeps per cache block; the table finds a cache block by the checksum it
//! carries (an entry is just the block's number). Only a
//! block whose checksum the table knows, for a block that still holds
//! bytes with that checksum, is fingerprinted (BLAKE3) and compared with
//! that block's fingerprint, learned the first time the block is a
//! candidate (its bytes, read then, are compared, and equal bytes give it
//! the new block's fingerprint) and kept beside the table. So a unique block costs a lookup
//! and no hash, and a duplicate is mapped onto the block holding its bytes
//! (the index's reference counts do the rest) instead of written again.
//!
//! A learned fingerprint names its block together with the epoch of the
//! block's region: a region is only appended to and reclaimed whole, so a
//! block holds one content per epoch, and a fingerprint learned in an
//! older epoch is never used. A checksum entry needs no epoch: the caller
//! says which checksum a block carries now, and the fingerprint decides.
//! An entry whose block was freed or rewritten is simply not found; such
//! entries are swept when they could outnumber the live ones. There is no
//! reverse map from blocks.
//!
//! Owns: fingerprints, the signature table, its counters. Must not: do
//! I/O, change the index, or decide alone that a block may be shared (the
//! caller says whether an entry's block is still the one it names, and
//! compares fingerprints or bytes).

mod table;

use crate::index::Cbn;
use table::Table;

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// Entries swept because their block was rewritten or freed.
    pub stale: u64,
    /// Candidates whose bytes differed: a checksum collision (about one
    /// pair in 2^32), or a fingerprint collision a test hasher forces.
    pub collisions: u64,
    /// Blocks not shared (a copy was written instead) because one more
    /// address could have outgrown the checkpoint's room for the map.
    pub no_room: u64,
}

/// A fingerprint learned for a block in its region's epoch.
#[derive(Debug, Clone, Copy, Default)]
struct Learned {
    place: Place,
    fp: Fingerprint,
}

/// The signature table.
#[derive(Debug, Default)]
pub struct Signatures {
    /// Cache blocks, found by the checksum they carry.
    by_crc: Table<Cbn>,
    /// Fingerprints learned for blocks that were candidates, by block.
    learned: Table<Learned>,
    counts: DedupCounts,
}

/// The tables' hash of a checksum or a block number: every bit of the
/// key spread over all 64 (SplitMix64's finalizer; a table picks the group
/// with the high bits and tags with the low ones). One multiplication
/// alone left whole ranges of groups empty for keys with a pattern.
fn hash(key: u32) -> u64 {
    let mut x = u64::from(key);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Signatures {
    /// A cache block carrying checksum `crc` (`crc_of(cbn)`: the checksum
    /// a referenced block carries, none for a free one), the one last
    /// recorded for it.
    pub fn find(&mut self, crc: u32, crc_of: impl Fn(Cbn) -> Option<u32>) -> Option<Cbn> {
        self.counts.lookups += 1;
        let cbn = *self.by_crc.find(hash(crc), |&c| crc_of(c) == Some(crc))?;
        self.counts.candidates += 1;
        Some(cbn)
    }

    /// Records that block `cbn` was written with checksum `crc` (it
    /// replaces the block found for that checksum before).
    pub fn remember(&mut self, crc: u32, cbn: Cbn, crc_of: impl Fn(Cbn) -> Option<u32>) {
        match self.by_crc.find_mut(hash(crc), |&c| crc_of(c) == Some(crc)) {
            Some(e) => *e = cbn,
            None => {
                // Growing files every entry under what its block carries
                // now, and drops those of freed blocks.
                let rehash = |&c: &Cbn| crc_of(c).map(hash);
                self.counts.stale += self.by_crc.insert(hash(crc), cbn, rehash) as u64;
            }
        }
    }

    /// The fingerprint learned for `place`'s bytes, if it was learned in
    /// that epoch.
    pub fn fingerprint(&self, place: Place) -> Option<Fingerprint> {
        self.learned
            .find(hash(place.cbn), |l| l.place.cbn == place.cbn)
            .filter(|l| l.place.epoch == place.epoch)
            .map(|l| l.fp)
    }

    /// `place` holds bytes whose fingerprint is `fp`.
    pub fn learn(&mut self, place: Place, fp: Fingerprint) {
        let learned = Learned { place, fp };
        match self
            .learned
            .find_mut(hash(place.cbn), |l| l.place.cbn == place.cbn)
        {
            Some(l) => *l = learned,
            None => {
                // Growing keeps them all: a sweep decides which still hold.
                let rehash = |l: &Learned| Some(hash(l.place.cbn));
                self.learned.insert(hash(place.cbn), learned, rehash);
            }
        }
    }

    /// Drops every stale entry once there are a quarter more entries than
    /// the cache's distinct live blocks (each holds one content, so at most
    /// that many entries are live), and gives back the memory they held.
    /// The checksum table is rebuilt from its live blocks (an entry whose
    /// block was rewritten sits where its old checksum led). A sweep costs
    /// the table's size, once per that many insertions.
    pub fn sweep_if_over(
        &mut self,
        live_blocks: u64,
        crc_of: impl Fn(Cbn) -> Option<u32>,
        holds: impl Fn(Place) -> bool,
    ) {
        let bound = live_blocks + live_blocks / 4 + 1024;
        if (self.by_crc.len() as u64) > bound {
            let stale = self.by_crc.rebuild(0, |&c| crc_of(c).map(hash));
            self.counts.stale += stale as u64;
        }
        if (self.learned.len() as u64) > bound {
            let stale = self
                .learned
                .rebuild(0, |l| holds(l.place).then(|| hash(l.place.cbn)));
            self.counts.stale += stale as u64;
        }
    }

    /// A candidate's bytes turned out equal to the block's.
    pub fn shared(&mut self) {
        self.counts.found += 1;
    }

    /// A block was not shared for want of checkpoint room.
    pub fn refused_for_room(&mut self) {
        self.counts.no_room += 1;
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
        self.by_crc.len() == 0
    }

    /// Fingerprints learned.
    pub fn learned(&self) -> usize {
        self.learned.len()
    }

    pub fn counts(&self) -> DedupCounts {
        self.counts
    }

    /// Bytes of memory the table holds.
    pub fn memory_bytes(&self) -> u64 {
        self.by_crc.memory_bytes() + self.learned.memory_bytes()
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

    /// What each block carries: block n carries checksum `crcs[n]`.
    fn carried(crcs: &[Option<u32>]) -> impl Fn(Cbn) -> Option<u32> + '_ {
        |cbn| crcs.get(cbn as usize).copied().flatten()
    }

    #[test]
    fn a_block_is_found_only_while_it_carries_the_checksum() {
        let mut s = Signatures::default();
        let mut crcs = vec![None; 64];
        crcs[40] = Some(0xabcd);
        s.remember(0xabcd, 40, carried(&crcs));
        assert_eq!(s.find(0xabcd, carried(&crcs)), Some(40));
        assert_eq!(s.find(0x1234, carried(&crcs)), None, "never recorded");
        // The block was rewritten since: not found, and swept later.
        crcs[40] = Some(0x5555);
        assert_eq!(s.find(0xabcd, carried(&crcs)), None);
        let c = s.counts();
        assert_eq!((c.lookups, c.candidates), (3, 1));
        // A sweep (over the bound) files the rewritten block under what it
        // carries now and drops the freed ones.
        let mut crcs: Vec<Option<u32>> = (0..2000).map(Some).collect();
        let mut s = Signatures::default();
        for n in 0..2000u32 {
            s.remember(n, n, carried(&crcs));
        }
        crcs[5] = Some(0x5555_0000);
        crcs[6] = None;
        assert_eq!(s.find(0x5555_0000, carried(&crcs)), None, "filed under 5");
        s.sweep_if_over(0, carried(&crcs), |_| true);
        assert_eq!((s.len(), s.counts().stale), (1999, 1));
        assert_eq!(s.find(0x5555_0000, carried(&crcs)), Some(5));
        assert_eq!(s.find(6, carried(&crcs)), None);
    }

    /// Keys with a pattern (here a multiplicative sequence, as a single
    /// multiplicative hash would be) still fall evenly over the groups.
    #[test]
    fn patterned_keys_do_not_cluster() {
        let mut t: Table<u32> = Table::default();
        let key =
            |k: u32| (u64::from(k).wrapping_mul(0x2545_f491_4f6c_dd1d)).rotate_left(17) as u32;
        for k in 0..100_000u32 {
            t.insert(hash(key(k)), k, |&e| Some(hash(key(e))));
        }
        let displaced = t.mean_displacement(|&e| hash(key(e)));
        assert!(displaced < 0.25, "{displaced} groups from home on average");
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
        let mut crcs: Vec<Option<u32>> = (0..3000).map(Some).collect();
        crcs[9] = Some(1);
        s.remember(1, 1, carried(&crcs));
        s.remember(1, 9, carried(&crcs));
        assert_eq!(s.len(), 1);
        assert_eq!(s.find(1, carried(&crcs)), Some(9));
        // Under the bound: nothing swept.
        let mut small = Signatures::default();
        for n in 0..256u32 {
            small.remember(n, n, carried(&crcs));
        }
        crcs[100..256].fill(None);
        small.sweep_if_over(200, carried(&crcs), |_| false);
        assert_eq!(small.len(), 256);
        // Over it (with a small cache): only live entries stay, and the
        // memory of the others is given back.
        let mut crcs: Vec<Option<u32>> = (0..3000).map(Some).collect();
        let mut big = Signatures::default();
        for n in 0..3000u32 {
            big.remember(n, n, carried(&crcs));
            big.learn(Place { cbn: n, epoch: 1 }, [0; 16]);
        }
        let full = big.memory_bytes();
        crcs[10..].fill(None);
        big.sweep_if_over(100, carried(&crcs), |p| p.cbn < 20);
        assert_eq!((big.len(), big.learned()), (10, 20));
        assert!(
            big.memory_bytes() * 10 < full,
            "{} of {full}",
            big.memory_bytes()
        );
    }
}
