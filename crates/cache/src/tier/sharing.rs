//! Mapping an address onto a cache block that already holds its bytes,
//! instead of writing them to flash again: the common part of logical
//! caching (a guest journal's copy, see `logical`) and deduplication (a
//! block with the same fingerprint, see `signatures`). The index's
//! reference counts keep the shared block alive while any address maps to
//! it; each address keeps its own dirty state.
//!
//! A candidate is compared before it is shared (its checksum always; every
//! byte, read back from flash, when the caller asks), and shared only if,
//! under the state lock, its block still holds what it was found holding.
//!
//! Owns: the shared-copy candidates, their comparison and mapping, and a
//! write split around them. Must not: find candidates (the callers do) or
//! map a block whose holder it did not check under the lock.

use super::checkpoint::{ADDRESS_BYTES, lines_bound};
use super::write::{Blocks, block_guests, sub_segments};
use super::{FlashCache, State};
use crate::dedup::Place;
use crate::error::{CacheError, Result};
use crate::index::{Cbn, Index, line_key};
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::region::Regions;
use crate::routing::Keep;
use crate::stats::bump;
use vdcache_contract::WriteSegment;

/// Why a cache block is thought to hold a block's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// It holds the guest journal's copy at (line key, slot).
    Journal { copy: (u64, usize) },
    /// The signature table says so, for its region's epoch.
    Signature { epoch: u32 },
}

/// A whole block of a write (or of a read being promoted) whose bytes a
/// cache block may already hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SharedCopy {
    /// Block number in the image written.
    pub block: u64,
    pub cbn: Cbn,
    /// The checksum the cache block was written with.
    pub crc: u32,
    pub source: Source,
}

impl SharedCopy {
    /// Whether the cache block still holds what it was found holding: the
    /// journal copy's address still maps to it, or it is still referenced
    /// in the same region epoch (so it was not rewritten since).
    pub(super) fn still_holds(&self, st: &State) -> bool {
        match self.source {
            Source::Journal { copy } => st.index.block(copy.0, copy.1) == Some(self.cbn),
            Source::Signature { epoch } => place_holds(
                &st.index,
                &st.regions,
                Place {
                    cbn: self.cbn,
                    epoch,
                },
            ),
        }
    }
}

/// Whether a signature's place still holds the bytes it was recorded for:
/// its block is referenced and its region was not reclaimed since.
pub(super) fn place_holds(index: &Index, regions: &Regions, p: Place) -> bool {
    index.is_referenced(p.cbn) && regions.epoch(regions.region_of(p.cbn)) == p.epoch
}

/// The byte ranges of `[start, end)` outside the blocks in `shared`
/// (ascending).
fn unshared_ranges(start: u64, end: u64, shared: &[u64]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = start;
    for &b in shared {
        if b * BLOCK > at {
            out.push((at, b * BLOCK));
        }
        at = at.max((b + 1) * BLOCK);
    }
    if at < end {
        out.push((at, end));
    }
    out
}

impl FlashCache {
    /// The candidates whose bytes equal the write's (the write's bytes
    /// start at image byte `off`): same checksum, and with `compare` every
    /// byte too (the block read back from flash). Their regions are pinned
    /// while they are read. Also how many blocks were read.
    pub(super) fn compare_copies(
        &self,
        off: u64,
        pieces: &[&[u8]],
        candidates: &[SharedCopy],
        compare: bool,
    ) -> Result<(Vec<SharedCopy>, u64)> {
        if candidates.is_empty() {
            return Ok((Vec::new(), 0));
        }
        self.pin_regions(candidates, true);
        let result = self.compare_pinned(off, pieces, candidates, compare);
        self.pin_regions(candidates, false);
        result
    }

    /// Pins (or unpins) the regions of the candidates' blocks, so none is
    /// reclaimed while its block is read.
    pub(super) fn pin_regions(&self, candidates: &[SharedCopy], pin: bool) {
        if candidates.is_empty() {
            return;
        }
        let mut st = self.lock();
        for c in candidates {
            let r = st.regions.region_of(c.cbn);
            if pin {
                st.regions.pin(r);
            } else {
                st.regions.unpin(r);
            }
        }
    }

    fn compare_pinned(
        &self,
        off: u64,
        pieces: &[&[u8]],
        candidates: &[SharedCopy],
        compare: bool,
    ) -> Result<(Vec<SharedCopy>, u64)> {
        let blocks = Blocks {
            pieces: pieces.to_vec(),
        };
        let mut copy = vec![0u8; BLOCK as usize];
        let mut out = Vec::new();
        let mut read = 0;
        for c in candidates {
            let start = (c.block * BLOCK - off) as usize;
            let end = start + BLOCK as usize;
            if blocks.crc(start, end) != c.crc {
                continue;
            }
            if compare {
                self.device
                    .read_at(&mut copy, self.layout.block_offset(c.cbn))
                    .map_err(CacheError::device("read a block to compare"))?;
                read += 1;
                if !blocks.equals(start, end, &copy) {
                    continue;
                }
            }
            out.push(*c);
        }
        Ok((out, read))
    }

    /// Maps block `c.block` of image `id` onto `c`'s cache block, dirty or
    /// clean, if that block still holds what it was found holding (see
    /// [`SharedCopy::still_holds`]); false when it no longer does.
    pub(super) fn share_copy(
        &self,
        st: &mut State,
        id: u16,
        c: &SharedCopy,
        guest: u64,
        dirty: bool,
    ) -> bool {
        if !c.still_holds(st) {
            return false;
        }
        if !self.room_to_share(st) {
            st.signatures.refused_for_room();
            return false;
        }
        let (key, slot) = (
            line_key(id, c.block / LINE_BLOCKS),
            (c.block % LINE_BLOCKS) as usize,
        );
        if dirty {
            self.record_dirty(st, id, c.block, &[(c.cbn, 1)], &[c.crc], &[guest]);
            self.validate_written(st, id, c.block * BLOCK, BLOCK);
        } else {
            if let Some((old, r)) = st.map_block(key, guest, slot, c.cbn, false, c.crc)
                && st.index.release(old, r)
            {
                st.regions.release_block(old);
            }
            if st.index.get(key).is_none_or(|l| l.dirty == 0) {
                st.dirty.lines.remove(&key);
            }
        }
        true
    }

    /// Whether one more address may share a block. Without sharing the
    /// checkpoint always fits: its slot has room for a line per block.
    /// Addresses sharing blocks could outgrow it, so one more is mapped only
    /// while the checkpoint would still fit if every block no address
    /// references were then filled by an address in a line of its own.
    fn room_to_share(&self, st: &State) -> bool {
        let free = self
            .layout
            .data_blocks()
            .saturating_sub(st.index.referenced_blocks());
        lines_bound(st) + ADDRESS_BYTES * (free + 1) <= self.layout.checkpoint_lines_room()
    }

    /// Counts blocks shared, by what they share.
    pub(super) fn count_shared(&self, disk: vdcache_contract::DiskId, shared: &[SharedCopy]) {
        let counters = self.stats.disk(disk);
        let journal = shared
            .iter()
            .filter(|c| matches!(c.source, Source::Journal { .. }))
            .count() as u64;
        bump(&counters.journal_copies_shared, journal);
        bump(&counters.dedup_blocks_shared, shared.len() as u64 - journal);
    }

    /// Write-back of a write some of whose blocks share copies: those are
    /// mapped onto the copies first (writing the others may reclaim the
    /// copies' regions), then the rest is written as usual, with any block
    /// whose copy moved meanwhile; last, blocks equal to an earlier block
    /// of the write (`inner`) share the block it was just written to.
    /// Returns false, having done nothing, when nothing could be shared and
    /// flash has no room for the first piece.
    pub(super) fn write_back_sharing(
        &self,
        image: &vdcache_contract::ImageHandle,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        copies: &[SharedCopy],
        inner: &[(u64, u64, u32)],
    ) -> Result<bool> {
        let len: u64 = segments.iter().map(|s| s.data.len() as u64).sum();
        let tag = segments[0].tag;
        let guests = block_guests(off, segments, off / BLOCK, len.div_ceil(BLOCK));
        let mut done = Vec::new();
        {
            let mut st = self.lock();
            for c in copies {
                let guest = guests[(c.block - off / BLOCK) as usize];
                if self.share_copy(&mut st, id, c, guest, true) {
                    done.push(*c);
                }
            }
            st.history.note(id, off, off + len);
            self.journal_buffer_check(&mut st)?;
            self.keep_reserve(&mut st)?;
        }
        self.count_shared(tag.disk, &done);
        let mut shared: Vec<u64> = done.iter().map(|c| c.block).collect();
        let mut wrote_any = !shared.is_empty();
        shared.extend(inner.iter().map(|&(b, _, _)| b));
        shared.sort_unstable();
        for (s, e) in unshared_ranges(off, off + len, &shared) {
            let part = sub_segments(off, segments, s, e);
            if !self.write_back_chunked(image, id, s, &part, tag, &[])? {
                if !wrote_any {
                    return Ok(false);
                }
                self.write_through(image, id, s, e - s, &part, tag, Keep::Nothing)?;
            }
            wrote_any = true;
        }
        for b in self.share_inner(id, tag.disk, inner, |b| guests[(b - off / BLOCK) as usize])? {
            let (s, e) = (b * BLOCK, (b + 1) * BLOCK);
            let part = sub_segments(off, segments, s, e);
            if !self.write_back_chunked(image, id, s, &part, tag, &[])? {
                self.write_through(image, id, s, BLOCK, &part, tag, Keep::Nothing)?;
            }
        }
        Ok(true)
    }

    /// Maps each block of `inner` onto the cache block its earlier equal
    /// block was just written to (dirty, as a write); returns those that
    /// could not share (the earlier block did not enter flash, or no room
    /// in the checkpoint), to be written.
    fn share_inner(
        &self,
        id: u16,
        disk: vdcache_contract::DiskId,
        inner: &[(u64, u64, u32)],
        guest: impl Fn(u64) -> u64,
    ) -> Result<Vec<u64>> {
        let mut left = Vec::new();
        let mut done = Vec::new();
        let mut st = self.lock();
        for &(b, a, crc) in inner {
            st.signatures.shared();
            // Only this write wrote `a` (the guest's range lock): mapped in
            // flash, it holds these bytes; written through, it is not mapped.
            let copy = st
                .index
                .block(line_key(id, a / LINE_BLOCKS), (a % LINE_BLOCKS) as usize)
                .filter(|&cbn| st.integrity.crcs.get(cbn) == Some(crc))
                .map(|cbn| SharedCopy {
                    block: b,
                    cbn,
                    crc,
                    source: Source::Signature {
                        epoch: st.regions.epoch(st.regions.region_of(cbn)),
                    },
                });
            match copy {
                Some(c) if self.share_copy(&mut st, id, &c, guest(b), true) => done.push(c),
                _ => left.push(b),
            }
        }
        self.journal_buffer_check(&mut st)?;
        drop(st);
        self.count_shared(disk, &done);
        Ok(left)
    }
}

#[cfg(test)]
mod tests {
    use super::unshared_ranges;

    #[test]
    fn ranges_around_shared_blocks() {
        assert_eq!(unshared_ranges(0, 16384, &[]), vec![(0, 16384)]);
        assert_eq!(
            unshared_ranges(100, 16384, &[1, 2]),
            vec![(100, 4096), (12288, 16384)]
        );
        assert_eq!(unshared_ranges(4096, 12288, &[1, 2]), vec![]);
        assert_eq!(unshared_ranges(0, 8192, &[0]), vec![(4096, 8192)]);
    }
}
