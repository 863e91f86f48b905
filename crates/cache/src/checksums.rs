//! The CRC-32C of every cached block as it was written to flash, so that
//! whatever reads a block back (a guest read, write-back, a relocation,
//! the completion of a partial write) can tell whether the device still
//! holds those bytes. Kept in memory per region (4 bytes per block of a
//! region that ever held one) and saved in checkpoints; journal records
//! carry the same checksums.
//!
//! Owns: the checksums, and the set of dirty blocks found not to verify
//! ([`Integrity`]). Must not: decide what a block that does not verify
//! means (the tier drops a clean copy and refuses a dirty one).

use crate::index::Cbn;
use std::collections::BTreeSet;

/// What the cache knows about the integrity of the blocks it holds.
#[derive(Debug)]
pub(crate) struct Integrity {
    pub crcs: BlockCrcs,
    /// Dirty blocks (line key, slot) whose flash copy no longer verifies:
    /// the only copy is lost, so they are never served nor written back
    /// until the guest writes them again.
    pub unreadable: BTreeSet<(u64, u8)>,
}

impl Integrity {
    pub(crate) fn new(regions: u32, blocks_per_region: u32) -> Integrity {
        Integrity {
            crcs: BlockCrcs::new(regions, blocks_per_region),
            unreadable: BTreeSet::new(),
        }
    }

    /// Block `slot` of line `key` now holds bytes with checksum `crc` in
    /// `cbn`: a fresh copy, so whatever was lost of it before is not.
    pub(crate) fn wrote(&mut self, cbn: Cbn, key: u64, slot: usize, crc: u32) {
        self.crcs.set(cbn, crc);
        self.unreadable.remove(&(key, slot as u8));
    }

    /// Whether any dirty block of `dirty` (a line's dirty mask) is still
    /// readable.
    pub(crate) fn any_readable(&self, key: u64, dirty: u16) -> bool {
        (0..u16::BITS as u8).any(|s| dirty & (1 << s) != 0 && !self.unreadable.contains(&(key, s)))
    }
}

/// Checksums of the blocks of the data zone, by cache block number.
#[derive(Debug)]
pub(crate) struct BlockCrcs {
    blocks_per_region: u32,
    regions: Vec<Option<Box<[u32]>>>,
}

impl BlockCrcs {
    pub(crate) fn new(regions: u32, blocks_per_region: u32) -> BlockCrcs {
        BlockCrcs {
            blocks_per_region,
            regions: vec![None; regions as usize],
        }
    }

    fn place(&self, cbn: Cbn) -> (usize, usize) {
        (
            (cbn / self.blocks_per_region) as usize,
            (cbn % self.blocks_per_region) as usize,
        )
    }

    /// Records the checksum of what was written to `cbn`.
    pub(crate) fn set(&mut self, cbn: Cbn, crc: u32) {
        let (r, i) = self.place(cbn);
        let bpr = self.blocks_per_region as usize;
        if let Some(region) = self.regions.get_mut(r) {
            region.get_or_insert_with(|| vec![0; bpr].into_boxed_slice())[i] = crc;
        }
    }

    /// The checksum recorded for `cbn` (`None`: nothing was ever recorded
    /// in its region).
    pub(crate) fn get(&self, cbn: Cbn) -> Option<u32> {
        let (r, i) = self.place(cbn);
        self.regions.get(r)?.as_ref().map(|region| region[i])
    }

    /// Memory held.
    pub(crate) fn memory_bytes(&self) -> u64 {
        let per = u64::from(self.blocks_per_region) * 4;
        self.regions.iter().flatten().count() as u64 * per + self.regions.len() as u64 * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_live_per_region_and_cost_only_where_set() {
        let mut c = BlockCrcs::new(4, 512);
        assert_eq!(c.get(600), None);
        let empty = c.memory_bytes();
        c.set(600, 0xdead_beef);
        assert_eq!(c.get(600), Some(0xdead_beef));
        assert_eq!(
            c.get(601),
            Some(0),
            "a region's other blocks read as unset zeros"
        );
        assert_eq!(c.memory_bytes(), empty + 512 * 4);
        c.set(4 * 512, 1);
        assert_eq!(c.get(4 * 512), None, "past the zone: ignored");
    }

    #[test]
    fn a_fresh_copy_makes_a_lost_block_readable_again() {
        let mut i = Integrity::new(2, 512);
        i.unreadable.insert((7, 3));
        assert!(!i.any_readable(7, 1 << 3));
        assert!(i.any_readable(7, (1 << 3) | (1 << 4)));
        i.wrote(10, 7, 3, 0xabcd);
        assert!(i.any_readable(7, 1 << 3));
        assert_eq!(i.crcs.get(10), Some(0xabcd));
    }
}
