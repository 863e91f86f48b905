//! Deduplication on the write and read paths (DASH, paper 001, section
//! III-B): each whole data block about to enter flash (a guest write, its
//! copy-on-write filler, a read being promoted) is looked up by its
//! checksum. A block the table knows a live block for is a candidate: it is
//! fingerprinted and compared with that block's fingerprint (learned by
//! reading the block the first time it is a candidate), or with
//! `Dedup::Verify` compared byte by byte, and if equal shares that block
//! (`sharing`) instead of being written. Every block written is remembered
//! by its checksum. Every disk of the cache shares one table, so clones
//! dedup against each other, base images included.
//!
//! So only a candidate costs a fingerprint before the write is
//! acknowledged (the decision whether flash is written needs it); a unique
//! block costs a checksum the cache computes anyway, and a lookup.
//!
//! Owns: the lookups, fingerprinting (timed) and remembering. Must not:
//! share a block itself (`sharing` does, under the lock) or look at
//! metadata (tables change in place, sector by sector).

use super::sharing::{SharedCopy, Source, place_holds};
use super::write::Blocks;
use super::{FlashCache, State};
use crate::checksums::BlockCrcs;
use crate::config::Dedup;
use crate::dedup::{Fingerprint, Place, fingerprint};
use crate::error::{CacheError, Result};
use crate::index::{Cbn, Index, line_key};
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::stats::bump;
use std::time::Instant;
use vdcache_contract::{DiskId, IoClass, WriteSegment};

/// A block about to enter flash, by its number in the image, and its
/// CRC-32C.
pub(super) type Checksummed = (u64, u32);

/// A candidate, and the fingerprint its block is known to have.
type Candidate = (SharedCopy, Option<Fingerprint>);

/// What comparing candidates found: those equal, fingerprints learned on
/// the way, and how many blocks were read.
#[derive(Default)]
struct Compared {
    found: Vec<SharedCopy>,
    learned: Vec<(Place, Fingerprint)>,
    read: u64,
}

/// Whether a write segment carries data dedup considers.
fn is_data(class: IoClass) -> bool {
    matches!(class, IoClass::GuestData | IoClass::CowFill)
}

impl FlashCache {
    /// Whether this cache deduplicates.
    pub(super) fn dedups(&self) -> bool {
        self.config.dedup.enabled()
    }

    /// The fingerprint of a block's bytes, timed and counted for `disk`.
    fn fingerprint_of(&self, disk: DiskId, pieces: &[&[u8]]) -> Fingerprint {
        let started = Instant::now();
        let mut fp = fingerprint(pieces);
        if self.config.test_weak_fingerprints {
            fp[1..].fill(0);
        }
        let counters = self.stats.disk(disk);
        bump(&counters.hash_nanos, started.elapsed().as_nanos() as u64);
        bump(&counters.hashed_blocks, 1);
        fp
    }

    /// Checksums of the whole data blocks among `pieces` (the bytes of
    /// image blocks from byte `off`; `data(i)` says whether the block at
    /// byte `i` of them is data).
    fn block_checksums(
        off: u64,
        pieces: &[&[u8]],
        data: impl Fn(u64, u64) -> bool,
    ) -> Vec<Checksummed> {
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        let blocks = Blocks {
            pieces: pieces.to_vec(),
        };
        (off.div_ceil(BLOCK)..(off + len) / BLOCK)
            .filter(|&b| data(b * BLOCK, (b + 1) * BLOCK))
            .map(|b| {
                let start = (b * BLOCK - off) as usize;
                (b, blocks.crc(start, start + BLOCK as usize))
            })
            .collect()
    }

    /// Checksums of the whole data blocks of a write.
    pub(super) fn write_checksums(off: u64, segments: &[WriteSegment<'_>]) -> Vec<Checksummed> {
        let mut spans: Vec<(u64, u64, bool)> = Vec::with_capacity(segments.len());
        let mut at = off;
        for s in segments {
            let end = at + s.data.len() as u64;
            spans.push((at, end, is_data(s.tag.class)));
            at = end;
        }
        let pieces: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
        Self::block_checksums(off, &pieces, |start, end| {
            spans
                .iter()
                .filter(|&&(s, e, _)| s < end && start < e)
                .all(|&(_, _, data)| data)
        })
    }

    /// Checksums of blocks read from the backend (`data` from block
    /// `first` of the image), for a promotion.
    pub(super) fn read_checksums(&self, first: u64, data: &[u8]) -> Vec<Checksummed> {
        if !self.dedups() {
            return Vec::new();
        }
        Self::block_checksums(first * BLOCK, &[data], |_, _| true)
    }

    /// The blocks among `sums` (of bytes `pieces` from image byte `off`)
    /// that a cache block already holds: candidates by checksum whose
    /// fingerprints (or, verifying, bytes) are equal; `taken`: blocks
    /// already shared otherwise.
    pub(super) fn dedup_copies(
        &self,
        disk: DiskId,
        off: u64,
        pieces: &[&[u8]],
        sums: &[Checksummed],
        taken: &[u64],
    ) -> Result<Vec<SharedCopy>> {
        if sums.is_empty() {
            return Ok(Vec::new());
        }
        let candidates: Vec<Candidate> = {
            let mut st = self.lock();
            sums.iter()
                .filter(|(b, _)| !taken.contains(b))
                .filter_map(|&(block, crc)| known_copy(&mut st, block, crc))
                .collect()
        };
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let copies: Vec<SharedCopy> = candidates.iter().map(|c| c.0).collect();
        let Compared {
            found,
            learned,
            read,
        } = if self.config.dedup == Dedup::Verify {
            let (found, read) = self.compare_copies(off, pieces, &copies, true)?;
            Compared {
                found,
                learned: Vec::new(),
                read,
            }
        } else {
            // Only a block whose fingerprint is not known yet is read.
            let unknown: Vec<SharedCopy> = candidates
                .iter()
                .filter(|c| c.1.is_none())
                .map(|c| c.0)
                .collect();
            self.pin_regions(&unknown, true);
            let result = self.compare_fingerprints(disk, off, pieces, &candidates);
            self.pin_regions(&unknown, false);
            result?
        };
        bump(&self.stats.disk(disk).flash_bytes_read, read * BLOCK);
        let mut st = self.lock();
        for &(place, fp) in &learned {
            st.signatures.learn(place, fp);
        }
        for _ in 0..found.len() {
            st.signatures.shared();
        }
        for _ in found.len()..candidates.len() {
            st.signatures.collided();
        }
        Ok(found)
    }

    /// The candidates (their regions pinned) whose block's fingerprint
    /// equals the write's block's; a block whose fingerprint is not known
    /// yet is read and compared byte by byte, and if equal learns the
    /// write's block's fingerprint (returned, to be learned). Also how many
    /// blocks were read.
    fn compare_fingerprints(
        &self,
        disk: DiskId,
        off: u64,
        pieces: &[&[u8]],
        candidates: &[Candidate],
    ) -> Result<Compared> {
        let blocks = Blocks {
            pieces: pieces.to_vec(),
        };
        // Only a candidate whose fingerprint is not known reads its block.
        let mut buf = Vec::new();
        let mut out = Compared::default();
        // Cache blocks found equal to a block of this write, and where in
        // the write that block is.
        let mut found_at: Vec<(Cbn, usize)> = Vec::new();
        for (c, known) in candidates {
            let start = (c.block * BLOCK - off) as usize;
            let end = start + BLOCK as usize;
            // A later block matching the same cache block is compared in
            // memory with the earlier one: no second fingerprint.
            if let Some(&(_, earlier)) = found_at.iter().find(|(cbn, _)| *cbn == c.cbn) {
                if blocks.equals(
                    start,
                    end,
                    &blocks.slices(earlier, earlier + BLOCK as usize).concat(),
                ) {
                    out.found.push(*c);
                }
                continue;
            }
            let new = self.fingerprint_of(disk, &blocks.slices(start, end));
            // A block several of the write's blocks match is read once.
            let learned_here = out
                .learned
                .iter()
                .find(|(p, _)| p.cbn == c.cbn)
                .map(|&(_, fp)| fp);
            let old = match known.or(learned_here) {
                Some(fp) => fp,
                None => {
                    buf.resize(BLOCK as usize, 0);
                    self.device
                        .read_at(&mut buf, self.layout.block_offset(c.cbn))
                        .map_err(CacheError::device("read a block to fingerprint"))?;
                    out.read += 1;
                    // A block the device damaged is not shared.
                    if crc32c::crc32c(&buf) != c.crc {
                        continue;
                    }
                    let Source::Signature { epoch } = c.source else {
                        continue;
                    };
                    // The block is read anyway: comparing its bytes is
                    // exact and cheaper than fingerprinting them, and equal
                    // bytes have the write's block's fingerprint.
                    if !blocks.equals(start, end, &buf) {
                        continue;
                    }
                    out.learned.push((Place { cbn: c.cbn, epoch }, new));
                    new
                }
            };
            if new == old {
                out.found.push(*c);
                // A one-block write (the common case) keeps no list.
                if candidates.len() > 1 {
                    found_at.push((c.cbn, start));
                }
            }
        }
        Ok(out)
    }

    /// Blocks of one write whose bytes an earlier block of the same write
    /// has (same checksum, then every byte compared: both are in memory),
    /// leaving out those a copy in flash already covers: (block, the
    /// earlier block, checksum). A write of one repeated block (zeros, a
    /// pattern) then enters flash once.
    pub(super) fn inner_duplicates(
        off: u64,
        pieces: &[&[u8]],
        sums: &[Checksummed],
        copies: &[SharedCopy],
    ) -> Vec<(u64, u64, u32)> {
        if sums.len() < 2 {
            return Vec::new();
        }
        let blocks = Blocks {
            pieces: pieces.to_vec(),
        };
        let bytes_of = |b: u64| {
            let start = (b * BLOCK - off) as usize;
            blocks.slices(start, start + BLOCK as usize).concat()
        };
        let mut by_crc: Vec<(u32, u64)> = sums
            .iter()
            .filter(|(b, _)| !copies.iter().any(|c| c.block == *b))
            .map(|&(b, crc)| (crc, b))
            .collect();
        by_crc.sort_unstable();
        let mut out = Vec::new();
        for group in by_crc.chunk_by(|x, y| x.0 == y.0).filter(|g| g.len() > 1) {
            let mut firsts: Vec<(u64, Vec<u8>)> = Vec::new();
            for &(crc, b) in group {
                let bytes = bytes_of(b);
                match firsts.iter().find(|(_, f)| *f == bytes) {
                    Some(&(a, _)) => out.push((b, a, crc)),
                    None => firsts.push((b, bytes)),
                }
            }
        }
        out
    }

    /// After blocks `sums` of image `id` entered flash (written, promoted
    /// or shared): their cache blocks hold those checksums.
    pub(super) fn remember_signatures(&self, id: u16, sums: &[Checksummed]) {
        if sums.is_empty() {
            return;
        }
        let mut st = self.lock();
        for &(b, crc) in sums {
            if let Some(cbn) = st
                .index
                .block(line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as usize)
            {
                note_signature(&mut st, crc, cbn);
            }
        }
        sweep_signatures(&mut st);
    }
}

/// Blocks `first..` of an image were just placed, in order, in `runs`
/// (first cache block, count): their cache blocks hold the checksums among
/// `sums` (sorted by block) that fall in that range. Saves looking the
/// blocks up again after the write.
pub(super) fn remember_placed(
    st: &mut State,
    first: u64,
    runs: &[(Cbn, u32)],
    sums: &[Checksummed],
) {
    let placed: u64 = runs.iter().map(|r| u64::from(r.1)).sum();
    let from = sums.partition_point(|&(b, _)| b < first);
    let mut noted = false;
    let mut run = runs.iter();
    let mut run_start = first;
    let mut current = run.next();
    for &(b, crc) in sums[from..]
        .iter()
        .take_while(|&&(b, _)| b < first + placed)
    {
        while let Some(&(cbn0, k)) = current {
            if b < run_start + u64::from(k) {
                note_signature(st, crc, cbn0 + (b - run_start) as u32);
                noted = true;
                break;
            }
            run_start += u64::from(k);
            current = run.next();
        }
    }
    if noted {
        sweep_signatures(st);
    }
}

/// The checksum each referenced cache block carries.
fn carried<'a>(index: &'a Index, crcs: &'a BlockCrcs) -> impl Fn(Cbn) -> Option<u32> + 'a {
    |cbn| index.is_referenced(cbn).then(|| crcs.get(cbn)).flatten()
}

/// Records that cache block `cbn` was written with checksum `crc`.
pub(super) fn note_signature(st: &mut State, crc: u32, cbn: Cbn) {
    let State {
        signatures,
        index,
        integrity,
        ..
    } = st;
    signatures.remember(crc, cbn, carried(index, &integrity.crcs));
}

/// Drops stale entries once they could outnumber the live ones.
fn sweep_signatures(st: &mut State) {
    let live = st.index.referenced_blocks();
    let State {
        signatures,
        index,
        regions,
        integrity,
        ..
    } = st;
    signatures.sweep_if_over(live, carried(index, &integrity.crcs), |p| {
        place_holds(index, regions, p)
    });
}

/// A block carrying `crc`, as a candidate for block `block`, with its
/// fingerprint if learned.
fn known_copy(st: &mut State, block: u64, crc: u32) -> Option<Candidate> {
    let State {
        signatures,
        index,
        regions,
        integrity,
        ..
    } = st;
    let cbn = signatures.find(crc, carried(index, &integrity.crcs))?;
    let epoch = regions.epoch(regions.region_of(cbn));
    let copy = SharedCopy {
        block,
        cbn,
        crc,
        source: Source::Signature { epoch },
    };
    Some((copy, signatures.fingerprint(Place { cbn, epoch })))
}

impl FlashCache {
    /// After an open the signature table is empty: every referenced block
    /// is remembered by the checksum the cache keeps for it (no I/O; their
    /// fingerprints are learned again when they are candidates).
    pub(super) fn rebuild_signatures(&self) {
        if !self.dedups() {
            return;
        }
        let mut st = self.lock();
        let per_region = self.layout.blocks_per_region();
        let mut blocks = 0u64;
        for region in 0..self.layout.regions {
            let first = region * per_region;
            for cbn in first..first + self.layout.data_blocks_per_region() {
                if !st.index.is_referenced(cbn) {
                    continue;
                }
                if let Some(crc) = st.integrity.crcs.get(cbn) {
                    note_signature(&mut st, crc, cbn);
                    blocks += 1;
                }
            }
        }
        if blocks > 0 {
            tracing::info!("dedup: signature table rebuilt from {blocks} cached blocks");
        }
    }
}
