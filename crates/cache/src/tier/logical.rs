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
//! Owns: linking journal devices, feeding their writes to the parser, and
//! finding an in-place write's journal copies (compared and mapped by
//! `sharing`). Must not: name a copy whose bytes were not compared.

use super::sharing::{SharedCopy, Source};
use super::write::Blocks;
use super::{FlashCache, State};
use crate::error::Result;
use crate::guest_journal::{FS_BLOCK, JournalCounts};
use crate::index::line_key;
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::stats::bump;
use vdcache_contract::{DiskId, IoClass, WriteSegment};

/// Journal parse errors logged as warnings per device; later ones at debug
/// level (they are counted either way).
const WARNED_ERRORS: u64 = 8;

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
    ) -> Result<Vec<SharedCopy>> {
        let candidates = {
            let st = self.lock();
            if !st.guest_journals.has_journal(disk) {
                return Ok(Vec::new());
            }
            candidates(&st, disk, off, segments)
        };
        let pieces: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
        // A journal's log names blocks, it does not vouch for bytes: every
        // byte is compared.
        let (verified, read) = self.compare_copies(off, &pieces, &candidates, true)?;
        let counters = self.stats.disk(disk);
        bump(&counters.flash_bytes_read, read * BLOCK);
        bump(
            &counters.journal_copy_mismatches,
            (candidates.len() - verified.len()) as u64,
        );
        Ok(verified)
    }
}

/// The journal copies the log names for the whole guest-data blocks of a
/// write, with their blocks and checksums (not compared yet).
fn candidates(
    st: &State,
    disk: DiskId,
    off: u64,
    segments: &[WriteSegment<'_>],
) -> Vec<SharedCopy> {
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
fn candidate(st: &State, disk: DiskId, cluster: u64, start: u64, b: u64) -> Option<SharedCopy> {
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
    Some(SharedCopy {
        block: b,
        cbn,
        crc,
        source: Source::Journal { copy },
    })
}
