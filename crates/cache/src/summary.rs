//! Region summaries: which (line, slot) each data block of a region was
//! written for, so that emptying a region needs no per-block reverse map
//! in memory (4 bytes per cache block, as much as the whole forward map of
//! a dense line). A summary lives in memory while its region fills and is
//! then written to the region's last block(s) (after its data, so the
//! region is still written sequentially); eviction reads it back.
//!
//! A summary is only a hint: every entry is checked against the forward
//! map before use, and a region whose summary is missing, stale (another
//! epoch of the region), torn or incomplete is found by scanning the
//! index instead. Nothing here needs to be durable, so summaries cost no
//! sync.
//!
//! Owns: recording entries, encoding and checking summary blocks.
//! Must not: do I/O or decide what a block's owner is (the index does).

use std::collections::HashMap;

use crate::index::{key_image, key_line};
use crate::layout::BLOCK;

/// Regions smaller than this have no summary (a summary block would take
/// too large a share of them); they are emptied by scanning the index.
pub const MIN_SUMMARY_REGION_BLOCKS: u32 = 64;

/// Epoch (never 0, so a discarded block reads as no summary) and CRC32C
/// of the entries.
const HEADER: usize = 8;
/// No block recorded at this position.
const EMPTY: u64 = u64::MAX;
/// Lines are stored in 44 bits, images in 16, slots in 4.
const LINE_BITS: u32 = 44;

/// Blocks of a region of `blocks_per_region` blocks given to its summary.
pub fn summary_blocks(blocks_per_region: u32) -> u32 {
    if blocks_per_region < MIN_SUMMARY_REGION_BLOCKS {
        return 0;
    }
    let mut s = 1;
    while HEADER as u64 + 8 * u64::from(blocks_per_region - s) > u64::from(s) * BLOCK {
        s += 1;
    }
    s
}

/// One entry: (key, slot) packed into 64 bits, or `None` when the line
/// number does not fit (the region then falls back to a scan).
fn encode_entry(key: u64, slot: usize) -> Option<u64> {
    let line = key_line(key);
    (line < 1 << LINE_BITS).then(|| (u64::from(key_image(key)) << 48) | (line << 4) | slot as u64)
}

/// (key, slot) of an entry.
pub fn decode_entry(e: u64) -> Option<(u64, usize)> {
    (e != EMPTY).then(|| {
        let image = (e >> 48) as u16;
        let line = (e >> 4) & ((1 << LINE_BITS) - 1);
        (crate::index::line_key(image, line), (e & 15) as usize)
    })
}

/// Summaries of regions not yet written out, and the epoch of the summary
/// on flash of every region.
#[derive(Debug)]
pub struct Summaries {
    data_per_region: u32,
    blocks_per_region: u32,
    /// Region -> one entry per data block (EMPTY where nothing was mapped).
    pending: HashMap<u32, Vec<u64>>,
    /// Regions whose pending summary cannot be encoded.
    unencodable: std::collections::HashSet<u32>,
    /// Per region: epoch of the summary on flash (0: none).
    written: Vec<u32>,
}

impl Summaries {
    pub fn new(regions: u32, blocks_per_region: u32) -> Summaries {
        Summaries {
            data_per_region: blocks_per_region - summary_blocks(blocks_per_region),
            blocks_per_region,
            pending: HashMap::new(),
            unencodable: Default::default(),
            written: vec![0; regions as usize],
        }
    }

    /// True when regions of this geometry carry summaries.
    fn enabled(&self) -> bool {
        self.data_per_region < self.blocks_per_region
    }

    /// Records that block `cbn` was first mapped for (key, slot).
    pub fn record(&mut self, cbn: u32, key: u64, slot: usize) {
        if !self.enabled() {
            return;
        }
        let region = cbn / self.blocks_per_region;
        let at = (cbn % self.blocks_per_region) as usize;
        let Some(entry) = encode_entry(key, slot) else {
            self.unencodable.insert(region);
            return;
        };
        let dpr = self.data_per_region as usize;
        let entries = self
            .pending
            .entry(region)
            .or_insert_with(|| vec![EMPTY; dpr]);
        if let Some(e) = entries.get_mut(at) {
            *e = entry;
        }
    }

    /// Regions with a summary waiting to be written.
    pub fn pending_regions(&self) -> Vec<u32> {
        self.pending_ids().collect()
    }

    fn pending_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.pending.keys().copied()
    }

    /// The pending regions `ready` accepts (allocates nothing when none
    /// does: asked after every mapped request).
    pub fn pending_where(&self, ready: impl Fn(u32) -> bool) -> Vec<u32> {
        self.pending_ids().filter(|&r| ready(r)).collect()
    }

    /// The pending entries of a region, if any.
    pub fn pending(&self, region: u32) -> Option<&[u64]> {
        self.pending.get(&region).map(Vec::as_slice)
    }

    /// Takes a region's pending summary as the bytes to write, stamped
    /// with `epoch`; `None` when there is nothing (or nothing encodable).
    pub fn take_encoded(&mut self, region: u32, epoch: u32) -> Option<Vec<u8>> {
        let entries = self.pending.remove(&region)?;
        if self.unencodable.remove(&region) {
            return None;
        }
        let blocks = (self.blocks_per_region - self.data_per_region) as usize;
        let mut out = vec![0u8; blocks * BLOCK as usize];
        out[0..4].copy_from_slice(&epoch.to_le_bytes());
        for (i, e) in entries.iter().enumerate() {
            let at = HEADER + 8 * i;
            out[at..at + 8].copy_from_slice(&e.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out[HEADER..]);
        out[4..8].copy_from_slice(&crc.to_le_bytes());
        Some(out)
    }

    /// Notes that the summary of `region` with `epoch` is on flash.
    pub fn mark_written(&mut self, region: u32, epoch: u32) {
        self.written[region as usize] = epoch;
    }

    /// The epoch of the summary on flash, if any.
    pub fn written_epoch(&self, region: u32) -> Option<u32> {
        Some(self.written[region as usize]).filter(|&e| e != 0)
    }

    /// The region was reclaimed: whatever was recorded for it is void.
    pub fn forget(&mut self, region: u32) {
        self.pending.remove(&region);
        self.unencodable.remove(&region);
        self.written[region as usize] = 0;
    }

    /// Entries of a summary read from flash, if it is intact and of `epoch`.
    pub fn decode(&self, buf: &[u8], epoch: u32) -> Option<Vec<u64>> {
        let word = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(buf.get(at..at + 4)?.try_into().ok()?))
        };
        let count = self.data_per_region as usize;
        if word(0)? != epoch
            || buf.len() < HEADER + 8 * count
            || word(4)? != crc32c::crc32c(&buf[HEADER..])
        {
            return None;
        }
        (0..count)
            .map(|i| {
                let at = HEADER + 8 * i;
                Some(u64::from_le_bytes(buf.get(at..at + 8)?.try_into().ok()?))
            })
            .collect()
    }

    /// Bytes of memory: the pending summaries and the epoch table.
    pub fn memory_bytes(&self) -> u64 {
        let pending: usize = self.pending.values().map(|v| v.capacity() * 8 + 32).sum();
        (pending + self.written.capacity() * 4) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::line_key;

    #[test]
    fn summary_fits_its_blocks() {
        assert_eq!(summary_blocks(1), 0);
        assert_eq!(summary_blocks(512), 1);
        assert_eq!(summary_blocks(1024), 2);
        for bpr in [64, 100, 512, 513, 4096] {
            let s = summary_blocks(bpr);
            assert!(8 + 8 * u64::from(bpr - s) <= u64::from(s) * BLOCK, "{bpr}");
        }
    }

    #[test]
    fn round_trip_and_rejects() {
        let mut s = Summaries::new(4, 512);
        let k = line_key(7, 123_456);
        s.record(512 + 3, k, 9);
        let buf = s.take_encoded(1, 42).unwrap();
        let entries = s.decode(&buf, 42).unwrap();
        assert_eq!(decode_entry(entries[3]), Some((k, 9)));
        assert_eq!(decode_entry(entries[4]), None);
        assert!(s.decode(&buf, 41).is_none(), "other epoch");
        let mut torn = buf.clone();
        torn[100] ^= 1;
        assert!(s.decode(&torn, 42).is_none(), "torn");
        assert!(s.decode(&buf[..10], 42).is_none(), "short");
        // A line beyond 44 bits cannot be summarised.
        s.record(0, line_key(1, 1 << 45), 0);
        assert!(s.take_encoded(0, 1).is_none());
    }
}
