//! Partially valid clusters (decoupled copy-on-write): the blocks of a
//! freshly allocated delta cluster that hold no data yet, kept in each
//! line's dcow bitmap and journaled, so the COW layer reads them from the
//! base and a crash never makes them look valid. A write makes the
//! 512-byte sectors it covers valid: a block the guest wrote only in part
//! (the edge of an unaligned write) keeps a bitmap of its valid sectors
//! until every sector is written or filled, so such a write needs no read
//! of the base. A discard of a whole block makes it valid again.

use super::{FlashCache, State};
use crate::error::Result;
use crate::index::line_key;
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE, LINE_BLOCKS};
use crate::stats::bump;
use vdcache_contract::{GuestCluster, HostOffset, ImageHandle, IoTag, PartialRange};

/// Granularity of validity inside a partially valid block.
const SECTOR: u64 = 512;
const SECTORS_PER_BLOCK: u64 = BLOCK / SECTOR;

/// Bit mask of the blocks `[first, end)` (line-relative) a range covers.
fn line_masks(off: u64, len: u64) -> Vec<(u64, u16)> {
    let mut out = Vec::new();
    let first = off / BLOCK;
    let end = (off + len) / BLOCK;
    let mut b = first;
    while b < end {
        let line = b / LINE_BLOCKS;
        let line_end = ((line + 1) * LINE_BLOCKS).min(end);
        let lo = (b % LINE_BLOCKS) as u32;
        let n = (line_end - b) as u32;
        let mask = if n >= 16 {
            u16::MAX
        } else {
            (((1u32 << n) - 1) << lo) as u16
        };
        out.push((line, mask));
        b = line_end;
    }
    out
}

/// (block, bitmap of the sectors covered) of the partly covered blocks at
/// the ends of `[off, off+len)`; sectors covered only in part do not count.
fn edge_sectors(off: u64, len: u64) -> Vec<(u64, u8)> {
    let end = off + len;
    let mut blocks = vec![off / BLOCK];
    if end.div_ceil(BLOCK) - 1 != off / BLOCK {
        blocks.push(end.div_ceil(BLOCK) - 1);
    }
    blocks
        .into_iter()
        .filter(|&b| b * BLOCK < off || (b + 1) * BLOCK > end)
        .map(|b| {
            let mut sectors = 0u8;
            for i in 0..SECTORS_PER_BLOCK {
                let (s, e) = (b * BLOCK + i * SECTOR, b * BLOCK + (i + 1) * SECTOR);
                if s >= off && e <= end {
                    sectors |= 1 << i;
                }
            }
            (b, sectors)
        })
        .filter(|&(_, sectors)| sectors != 0)
        .collect()
}

/// Byte ranges (absolute) of the not yet valid sectors of a line whose
/// partially valid bitmap is `mask`, merged, in order.
fn invalid_in_line(st: &State, key: u64, mask: u16) -> Vec<(u64, u64)> {
    let base = crate::index::key_line(key) * LINE;
    let mut out: Vec<(u64, u64)> = Vec::new();
    for slot in 0..LINE_BLOCKS {
        if mask & (1 << slot) == 0 {
            continue;
        }
        let valid = st.index.valid_sectors(key, slot as usize);
        for i in 0..SECTORS_PER_BLOCK {
            if valid & (1 << i) != 0 {
                continue;
            }
            let s = base + slot * BLOCK + i * SECTOR;
            match out.last_mut() {
                Some((_, e)) if *e == s => *e = s + SECTOR,
                _ => out.push((s, s + SECTOR)),
            }
        }
    }
    out
}

/// Records (and journals) the valid sectors of a partially valid block.
fn set_valid_sectors(st: &mut State, key: u64, slot: usize, sectors: u8) {
    if st.index.valid_sectors(key, slot) == sectors {
        return;
    }
    st.index.set_valid_sectors(key, slot, sectors);
    st.journal.push(&Entry::ValidSectors {
        key,
        slot: slot as u8,
        sectors,
    });
    st.ledger.uncommitted_dirty = true;
}

impl FlashCache {
    /// Sets or clears the not-yet-valid bits of the blocks a range touches.
    pub(crate) fn set_invalid_range(
        &self,
        image: &ImageHandle,
        off: u64,
        len: u64,
        invalid: bool,
        tag: IoTag,
    ) -> Result<()> {
        let id = self.image_id(image, tag.disk)?;
        let mut st = self.lock();
        // Blocks touched in part count: marks are by the block (a range the
        // COW layer drops as orphaned may be a few sectors of one).
        let start = off / BLOCK * BLOCK;
        let end = (off + len).div_ceil(BLOCK) * BLOCK;
        for (line, mask) in line_masks(start, end - start) {
            let key = line_key(id, line);
            if invalid {
                // Whatever the cache held for these blocks belongs to an
                // earlier use of the cluster.
                for slot in 0..LINE_BLOCKS as usize {
                    if mask & (1 << slot) != 0 {
                        self.unmap_block(&mut st, key, slot);
                        set_valid_sectors(&mut st, key, slot, 0);
                    }
                }
            }
            let old = st.index.get(key).map_or(0, |l| l.partial);
            let new = if invalid { old | mask } else { old & !mask };
            if new != old {
                // Marking blocks invalid is an allocation for this guest
                // cluster: the line now serves it.
                let guest = if invalid {
                    tag.guest_cluster.map(u64::from)
                } else {
                    None
                };
                st.index.set_partial(key, guest, new);
                st.journal.push(&Entry::Partial {
                    key,
                    mask: new,
                    guest: guest.unwrap_or(u64::MAX),
                });
                st.ledger.uncommitted_dirty = true;
            }
        }
        Ok(())
    }

    /// Makes the sectors `[off, off+len)` covers valid after they were
    /// written: whole blocks leave the bitmap, partly written blocks gain
    /// valid sectors (and leave the bitmap once all are valid).
    pub(crate) fn validate_written(&self, st: &mut State, id: u16, off: u64, len: u64) {
        let first = off.div_ceil(BLOCK) * BLOCK;
        let end = (off + len) / BLOCK * BLOCK;
        let mut whole = Vec::new();
        if first < end {
            whole = line_masks(first, end - first);
        }
        for (block, sectors) in edge_sectors(off, len) {
            let key = line_key(id, block / LINE_BLOCKS);
            let slot = (block % LINE_BLOCKS) as usize;
            if st
                .index
                .get(key)
                .is_none_or(|l| l.partial & (1 << slot) == 0)
            {
                continue;
            }
            let valid = st.index.valid_sectors(key, slot) | sectors;
            if valid == u8::MAX {
                whole.push((block / LINE_BLOCKS, 1 << slot));
            } else {
                set_valid_sectors(st, key, slot, valid);
            }
        }
        for (line, mask) in whole {
            let key = line_key(id, line);
            let Some(l) = st.index.get(key) else { continue };
            if l.partial & mask == 0 {
                continue;
            }
            let new = l.partial & !mask;
            st.index.set_partial(key, None, new);
            st.journal.push(&Entry::Partial {
                key,
                mask: new,
                guest: u64::MAX,
            });
        }
    }

    /// Whether a block holds nothing of the guest's anywhere: partially
    /// valid with no valid sector (its old content is of no use).
    pub(crate) fn holds_nothing(st: &State, id: u16, block: u64) -> bool {
        let key = line_key(id, block / LINE_BLOCKS);
        let slot = (block % LINE_BLOCKS) as usize;
        st.index
            .get(key)
            .is_some_and(|l| l.partial & (1 << slot) != 0 && l.present & (1 << slot) == 0)
            && st.index.valid_sectors(key, slot) == 0
    }

    /// Not yet valid ranges inside `[off, off+len)`.
    pub(crate) fn invalid_ranges_of(
        &self,
        image: &ImageHandle,
        off: u64,
        len: u64,
    ) -> Vec<(u64, u64)> {
        let st = self.lock();
        let Some(id) = st.catalog.id_of(&image.name) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        let end = off + len;
        let mut line = off / LINE;
        while line * LINE < end {
            let key = line_key(id, line);
            if let Some(l) = st.index.get(key).filter(|l| l.partial != 0) {
                for (s, e) in invalid_in_line(&st, key, l.partial) {
                    let (s, e) = (s.max(off), e.min(end));
                    if s >= e {
                        continue;
                    }
                    match out.last_mut() {
                        Some((ls, ll)) if *ls + *ll == s => *ll += e - s,
                        _ => out.push((s, e - s)),
                    }
                }
            }
            line += 1;
        }
        out
    }

    /// Every not yet valid range of an image.
    pub(crate) fn partial_ranges_of(&self, image: &ImageHandle) -> Vec<PartialRange> {
        let st = self.lock();
        let Some(id) = st.catalog.id_of(&image.name) else {
            return Vec::new();
        };
        let mut out: Vec<PartialRange> = Vec::new();
        let mut lines: Vec<(u64, u16, u64)> = st
            .index
            .lines()
            .filter(|l| l.partial != 0 && crate::index::key_image(l.key) == id)
            .map(|l| (crate::index::key_line(l.key), l.partial, u64::from(l.guest)))
            .collect();
        lines.sort_unstable();
        for (line, mask, guest) in lines {
            for (s, e) in invalid_in_line(&st, line_key(id, line), mask) {
                match out.last_mut() {
                    Some(r) if r.offset.0 + r.len == s && r.guest_cluster.0 == guest => {
                        r.len += e - s
                    }
                    _ => out.push(PartialRange {
                        offset: HostOffset(s),
                        len: e - s,
                        guest_cluster: GuestCluster(guest),
                    }),
                }
            }
        }
        out
    }

    /// Drops the clean cached blocks wholly inside a backing image's range
    /// that a write to the delta just masked (COWCache 3.3: the guest reads
    /// its own copy from now on). Only in cow-aware mode, and never for an
    /// image more than one disk reads.
    pub(crate) fn drop_masked(&self, image: &ImageHandle, off: u64, len: u64, tag: IoTag) {
        let mut st = self.lock();
        if st.catalog.policy(tag.disk, self.config.default_policy).cow
            != crate::config::CowMode::CowAware
        {
            return;
        }
        let Some(id) = st.catalog.id_of(&image.name) else {
            return;
        };
        if st
            .catalog
            .images
            .get(id as usize)
            .is_none_or(|r| r.shared_by_disks)
        {
            return;
        }
        let mut dropped = 0;
        for block in off.div_ceil(BLOCK)..(off + len) / BLOCK {
            let key = line_key(id, block / LINE_BLOCKS);
            let slot = (block % LINE_BLOCKS) as usize;
            let clean = st
                .index
                .get(key)
                .is_some_and(|l| l.present & !l.dirty & (1 << slot) != 0);
            if clean && self.unmap_block(&mut st, key, slot) {
                dropped += 1;
            }
        }
        drop(st);
        bump(&self.stats.disk(tag.disk).masked_blocks_dropped, dropped);
    }

    /// Whether the disk's blocks may be left partially valid.
    pub(crate) fn decoupled_for(&self, disk: vdcache_contract::DiskId) -> bool {
        crate::routing::decouples(self.lock().catalog.policy(disk, self.config.default_policy))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_split_by_line() {
        assert_eq!(line_masks(0, LINE), vec![(0, u16::MAX)]);
        assert_eq!(line_masks(BLOCK, 2 * BLOCK), vec![(0, 0b110)]);
        assert_eq!(
            line_masks(LINE - BLOCK, 2 * BLOCK),
            vec![(0, 1 << 15), (1, 1)]
        );
    }
}
