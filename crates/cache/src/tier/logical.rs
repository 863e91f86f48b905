//! Journal-aware caching (JCache, paper 002, section III) on the write
//! path. A guest's virtual journal device is cached only (its disk policy
//! says `cache_only`: its blocks live in flash, dirty and held, and reach
//! their file only when flash runs short or an operator writes them out),
//! and what it is written is parsed (`crate::guest_journal`). A later
//! in-place write of a file-system block whose bytes equal its logged copy
//! is mapped onto the cache block already holding that copy (logical
//! caching) instead of being written to flash again: the two addresses
//! then share one block, each with its own dirty state, and the in-place
//! data still reaches its image on write-back.
//!
//! A block is shared only after its bytes were compared with the copy's,
//! byte for byte, and only while the copy's address still maps to that
//! block; a log that lies costs nothing but the comparison.
//!
//! Owns: linking journal devices, feeding their writes to the parser,
//! finding and verifying copies, mapping an in-place block onto one. Must
//! not: share a block whose bytes it did not compare, or keep a region
//! pinned past a request.

use super::write::{Blocks, block_guests, sub_segments};
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::guest_journal::{FS_BLOCK, JournalCounts};
use crate::index::{Cbn, line_key};
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::routing::Keep;
use crate::stats::bump;
use vdcache_contract::{DiskId, IoClass, WriteSegment};

/// Journal parse errors logged as warnings per device; later ones at debug
/// level (they are counted either way).
const WARNED_ERRORS: u64 = 8;

/// A block of an in-place write whose bytes a cache block already holds
/// as a journal copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct JournalCopy {
    /// Block number in the written image.
    pub block: u64,
    /// The journal copy's address (line key, slot) and block.
    pub copy: (u64, usize),
    pub cbn: Cbn,
    pub crc: u32,
}

impl FlashCache {
    /// Links journal device `journal` to data disk `data` (whose top image
    /// has clusters of `1 << data_cluster_bits` bytes): the device's log
    /// is parsed from now on, and in-place writes of `data` may share its
    /// copies. `superblock`: the device's JBD2 superblock block as it is
    /// now (4 KiB), if it has one. An error says why logical caching
    /// cannot use the superblock yet (cache-only logging still holds).
    pub fn link_journal(
        &self,
        journal: DiskId,
        data: DiskId,
        data_cluster_bits: u32,
        superblock: Option<&[u8]>,
    ) -> std::result::Result<(), vdcache_jbd2::Jbd2Error> {
        self.lock()
            .guest_journals
            .link(journal, data, data_cluster_bits, superblock)
    }

    /// What parsing journal device `journal`'s log found so far.
    pub fn journal_counts(&self, journal: DiskId) -> Option<JournalCounts> {
        self.lock().guest_journals.counts(journal)
    }

    /// Feeds a completed write to journal device `disk` (image `id`) to its
    /// parser: whole blocks are parsed, blocks written in part forgotten.
    pub(super) fn observe_journal_write(
        &self,
        disk: DiskId,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
    ) {
        let len: u64 = segments.iter().map(|s| s.data.len() as u64).sum();
        let blocks = Blocks {
            pieces: segments.iter().map(|s| s.data).collect(),
        };
        let (first, end) = (off / BLOCK, (off + len).div_ceil(BLOCK));
        let mut buf = vec![0u8; BLOCK as usize];
        let mut st = self.lock();
        for b in first..end {
            let Ok(at) = u32::try_from(b) else { break };
            let (start, stop) = (b * BLOCK, (b + 1) * BLOCK);
            if start < off || stop > off + len {
                st.guest_journals.forget(disk, at);
                continue;
            }
            let mut filled = 0;
            for piece in blocks.slices((start - off) as usize, (stop - off) as usize) {
                buf[filled..filled + piece.len()].copy_from_slice(piece);
                filled += piece.len();
            }
            if let Err(e) = st.guest_journals.observe(disk, id, at, &buf) {
                let errors = st.guest_journals.counts(disk).map_or(0, |c| c.errors);
                if errors <= WARNED_ERRORS {
                    tracing::warn!(
                        disk = disk.0,
                        "guest journal: {e}; the block is cached without journal awareness"
                    );
                } else {
                    tracing::debug!(disk = disk.0, "guest journal: {e}");
                }
            }
        }
    }

    /// The whole guest-data blocks of a write to data disk `disk` whose
    /// bytes a journal copy in flash holds, compared byte for byte. Empty
    /// for a disk without a journal device.
    pub(super) fn journal_copies(
        &self,
        disk: DiskId,
        off: u64,
        segments: &[WriteSegment<'_>],
    ) -> Result<Vec<JournalCopy>> {
        let candidates = {
            let mut st = self.lock();
            if !st.guest_journals.has_journal(disk) {
                return Ok(Vec::new());
            }
            let found = candidates(&st, disk, off, segments);
            for c in &found {
                let r = st.regions.region_of(c.cbn);
                st.regions.pin(r);
            }
            found
        };
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let verified = self.verify_copies(off, segments, &candidates);
        let mut st = self.lock();
        for c in &candidates {
            let r = st.regions.region_of(c.cbn);
            st.regions.unpin(r);
        }
        drop(st);
        let (verified, read) = verified?;
        let counters = self.stats.disk(disk);
        bump(&counters.flash_bytes_read, read * BLOCK);
        bump(
            &counters.journal_copy_mismatches,
            (candidates.len() - verified.len()) as u64,
        );
        Ok(verified)
    }

    /// The candidates whose bytes equal the write's: checksum first (known
    /// for both), then every byte (the copy read back from flash). Also
    /// how many copies were read.
    fn verify_copies(
        &self,
        off: u64,
        segments: &[WriteSegment<'_>],
        candidates: &[JournalCopy],
    ) -> Result<(Vec<JournalCopy>, u64)> {
        let blocks = Blocks {
            pieces: segments.iter().map(|s| s.data).collect(),
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
            self.device
                .read_at(&mut copy, self.layout.block_offset(c.cbn))
                .map_err(CacheError::device("read journal copy"))?;
            read += 1;
            let mut at = 0;
            let same = blocks.slices(start, end).iter().all(|piece| {
                let eq = copy[at..at + piece.len()] == **piece;
                at += piece.len();
                eq
            });
            if same {
                out.push(*c);
            }
        }
        Ok((out, read))
    }

    /// Maps in-place block `c.block` of image `id` onto its journal copy's
    /// cache block, dirty or clean, if the copy's address still maps to
    /// it (the block is then live, and holds the bytes compared); false
    /// when it no longer does.
    pub(super) fn share_journal_copy(
        &self,
        st: &mut State,
        id: u16,
        c: &JournalCopy,
        guest: u64,
        dirty: bool,
    ) -> bool {
        if st.index.block(c.copy.0, c.copy.1) != Some(c.cbn) {
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

    /// Write-back of a write some of whose blocks share journal copies:
    /// the others are written as usual, those are mapped onto the copies
    /// (or written too, if a copy moved meanwhile). Returns false when
    /// flash has no room for the first piece (nothing was done).
    pub(super) fn write_back_sharing(
        &self,
        image: &vdcache_contract::ImageHandle,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        copies: &[JournalCopy],
    ) -> Result<bool> {
        let len: u64 = segments.iter().map(|s| s.data.len() as u64).sum();
        let shared: Vec<u64> = copies.iter().map(|c| c.block).collect();
        let tag = segments[0].tag;
        let mut wrote_any = false;
        for (s, e) in unshared_ranges(off, off + len, &shared) {
            let part = sub_segments(off, segments, s, e);
            if !self.write_back_chunked(image, id, s, &part, tag)? {
                if !wrote_any {
                    return Ok(false);
                }
                self.write_through(image, id, s, e - s, &part, tag, Keep::Nothing)?;
            }
            wrote_any = true;
        }
        let guests = block_guests(off, segments, off / BLOCK, len.div_ceil(BLOCK));
        let mut moved = Vec::new();
        {
            let mut st = self.lock();
            for c in copies {
                let guest = guests[(c.block - off / BLOCK) as usize];
                if !self.share_journal_copy(&mut st, id, c, guest, true) {
                    moved.push(c.block);
                }
            }
            st.history.note(id, off, off + len);
            self.journal_buffer_check(&mut st)?;
        }
        bump(
            &self.stats.disk(tag.disk).journal_copies_shared,
            (copies.len() - moved.len()) as u64,
        );
        for b in moved {
            let (s, e) = (b * BLOCK, (b + 1) * BLOCK);
            let part = sub_segments(off, segments, s, e);
            if !self.write_back_chunked(image, id, s, &part, tag)? {
                self.write_through(image, id, s, BLOCK, &part, tag, Keep::Nothing)?;
            }
        }
        Ok(true)
    }
}

/// The journal copies the log names for the whole guest-data blocks of a
/// write, with their blocks and checksums (not compared yet).
fn candidates(
    st: &State,
    disk: DiskId,
    off: u64,
    segments: &[WriteSegment<'_>],
) -> Vec<JournalCopy> {
    let mut out = Vec::new();
    let mut at = off;
    for s in segments {
        let end = at + s.data.len() as u64;
        if let (IoClass::GuestData, Some(cluster)) = (s.tag.class, s.tag.guest_cluster) {
            for b in at.div_ceil(BLOCK)..end / BLOCK {
                if let Some(c) = candidate(st, disk, cluster.0, at, b) {
                    out.push(c);
                }
            }
        }
        at = end;
    }
    out
}

/// The journal copy of block `b` of a segment starting at host offset
/// `start` that serves guest cluster `cluster`, if the log names one
/// that flash holds readable.
fn candidate(st: &State, disk: DiskId, cluster: u64, start: u64, b: u64) -> Option<JournalCopy> {
    let journals = &st.guest_journals;
    let fs_block = journals.fs_block(disk, cluster, start, b * BLOCK)?;
    let c = journals.candidate(disk, fs_block)?;
    let j = u64::from(c.journal_block) * u64::from(FS_BLOCK) / BLOCK;
    let copy = (
        line_key(c.image, j / LINE_BLOCKS),
        (j % LINE_BLOCKS) as usize,
    );
    let cbn = st.index.block(copy.0, copy.1)?;
    if st.integrity.unreadable.contains(&(copy.0, copy.1 as u8)) {
        return None;
    }
    let crc = st.integrity.crcs.get(cbn)?;
    Some(JournalCopy {
        block: b,
        copy,
        cbn,
        crc,
    })
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
