//! The CRC-32C of every cached block as it was written to flash, so that
//! whatever reads a block back (a guest read, write-back, a relocation,
//! the completion of a partial write) can tell whether the device still
//! holds those bytes. Kept in memory per region (4 bytes per block of a
//! region that ever held one) and saved in checkpoints; journal records
//! carry the same checksums.
//!
//! Owns: the checksums. Must not: decide what a block that does not
//! verify means (the tier drops a clean copy and refuses a dirty one).

use crate::index::Cbn;

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
}
