//! Deduplication on the write and read paths (DASH, paper 001, section
//! III-B): each whole data block about to enter flash (a guest write, its
//! copy-on-write filler, a read being promoted) is fingerprinted; one whose
//! fingerprint the signature table knows, for a block still holding those
//! bytes, shares that block (`sharing`) instead of being written; the
//! others are written and remembered. Every disk of the cache shares one
//! table, so clones dedup against each other, base images included.
//!
//! The fingerprint is computed before the write is acknowledged: the
//! decision whether flash is written needs it. With `Dedup::Verify` a
//! candidate's bytes are read back and compared before sharing.
//!
//! Owns: fingerprinting (timed), the lookups and the remembering. Must not:
//! share a block itself (`sharing` does, under the lock) or fingerprint
//! metadata (tables change in place, sector by sector).

use super::sharing::{SharedCopy, Source, place_holds};
use super::{FlashCache, State};
use crate::config::Dedup;
use crate::dedup::{Fingerprint, Place, fingerprint};
use crate::error::Result;
use crate::index::{Cbn, line_key};
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::stats::bump;
use std::time::Instant;
use vdcache_contract::{DiskId, IoClass, WriteSegment};

/// A block about to enter flash, by its number in the image, and its
/// fingerprint.
pub(super) type Fingerprinted = (u64, Fingerprint);

/// Whether a write segment carries data dedup considers.
fn is_data(class: IoClass) -> bool {
    matches!(class, IoClass::GuestData | IoClass::CowFill)
}

impl FlashCache {
    /// Whether this cache deduplicates.
    pub(super) fn dedups(&self) -> bool {
        self.config.dedup.enabled()
    }

    pub(super) fn fingerprint_of(&self, pieces: &[&[u8]]) -> Fingerprint {
        let mut fp = fingerprint(pieces);
        if self.config.test_weak_fingerprints {
            fp[1..].fill(0);
        }
        fp
    }

    /// Fingerprints of the whole data blocks among `pieces` (the bytes of
    /// image blocks from byte `off`; `data(i)` says whether the block at
    /// byte `i` of them is data), counted and timed for `disk`.
    fn fingerprint_blocks(
        &self,
        disk: DiskId,
        off: u64,
        pieces: &[&[u8]],
        data: impl Fn(u64, u64) -> bool,
    ) -> Vec<Fingerprinted> {
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        let blocks = super::write::Blocks {
            pieces: pieces.to_vec(),
        };
        let started = Instant::now();
        let out: Vec<Fingerprinted> = (off.div_ceil(BLOCK)..(off + len) / BLOCK)
            .filter(|&b| data(b * BLOCK, (b + 1) * BLOCK))
            .map(|b| {
                let start = (b * BLOCK - off) as usize;
                let slices = blocks.slices(start, start + BLOCK as usize);
                (b, self.fingerprint_of(&slices))
            })
            .collect();
        let counters = self.stats.disk(disk);
        bump(&counters.hash_nanos, started.elapsed().as_nanos() as u64);
        bump(&counters.hashed_blocks, out.len() as u64);
        out
    }

    /// Fingerprints of the whole data blocks of a write.
    pub(super) fn write_fingerprints(
        &self,
        disk: DiskId,
        off: u64,
        segments: &[WriteSegment<'_>],
    ) -> Vec<Fingerprinted> {
        let mut spans: Vec<(u64, u64, bool)> = Vec::with_capacity(segments.len());
        let mut at = off;
        for s in segments {
            let end = at + s.data.len() as u64;
            spans.push((at, end, is_data(s.tag.class)));
            at = end;
        }
        let pieces: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
        self.fingerprint_blocks(disk, off, &pieces, |start, end| {
            spans
                .iter()
                .filter(|&&(s, e, _)| s < end && start < e)
                .all(|&(_, _, data)| data)
        })
    }

    /// The blocks among `fps` (of bytes `pieces` from image byte `off`)
    /// that a cache block already holds, per the signature table (and, in
    /// verify mode, a byte comparison); `taken`: blocks already shared
    /// otherwise.
    pub(super) fn dedup_copies(
        &self,
        disk: DiskId,
        off: u64,
        pieces: &[&[u8]],
        fps: &[Fingerprinted],
        taken: &[u64],
    ) -> Result<Vec<SharedCopy>> {
        if fps.is_empty() {
            return Ok(Vec::new());
        }
        let candidates: Vec<SharedCopy> = {
            let mut st = self.lock();
            fps.iter()
                .filter(|(b, _)| !taken.contains(b))
                .filter_map(|&(block, fp)| known_copy(&mut st, block, &fp))
                .collect()
        };
        let compare = self.config.dedup == Dedup::Verify;
        let (found, read) = self.compare_copies(off, pieces, &candidates, compare)?;
        bump(&self.stats.disk(disk).flash_bytes_read, read * BLOCK);
        if found.len() < candidates.len() {
            let mut st = self.lock();
            for _ in found.len()..candidates.len() {
                st.signatures.collided();
            }
        }
        Ok(found)
    }

    /// After blocks `fps` of image `id` entered flash (written, promoted or
    /// shared): their cache blocks hold those fingerprints.
    pub(super) fn remember_signatures(&self, id: u16, fps: &[Fingerprinted]) {
        if fps.is_empty() {
            return;
        }
        let mut st = self.lock();
        for &(b, fp) in fps {
            if let Some(cbn) = st
                .index
                .block(line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as usize)
            {
                note_signature(&mut st, fp, cbn);
            }
        }
        sweep_signatures(&mut st);
    }

    /// Fingerprints of blocks read from the backend (`data` from block
    /// `first` of the image), for a promotion.
    pub(super) fn read_fingerprints(
        &self,
        disk: DiskId,
        first: u64,
        data: &[u8],
    ) -> Vec<Fingerprinted> {
        if !self.dedups() {
            return Vec::new();
        }
        self.fingerprint_blocks(disk, first * BLOCK, &[data], |_, _| true)
    }
}

/// Blocks `first..` of an image were just placed, in order, in `runs`
/// (first cache block, count): their cache blocks hold the fingerprints
/// among `fps` (sorted by block) that fall in that range. Saves looking
/// the blocks up again after the write.
pub(super) fn remember_placed(
    st: &mut State,
    first: u64,
    runs: &[(Cbn, u32)],
    fps: &[Fingerprinted],
) {
    let placed: u64 = runs.iter().map(|r| u64::from(r.1)).sum();
    let from = fps.partition_point(|&(b, _)| b < first);
    let mut noted = false;
    let mut run = runs.iter();
    let mut run_start = first;
    let mut current = run.next();
    for &(b, fp) in fps[from..].iter().take_while(|&&(b, _)| b < first + placed) {
        while let Some(&(cbn0, k)) = current {
            if b < run_start + u64::from(k) {
                note_signature(st, fp, cbn0 + (b - run_start) as u32);
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

/// Records that cache block `cbn` (referenced, in its region's current
/// epoch) holds the bytes of `fp`.
fn note_signature(st: &mut State, fp: Fingerprint, cbn: Cbn) {
    let epoch = st.regions.epoch(st.regions.region_of(cbn));
    st.signatures.remember(fp, Place { cbn, epoch });
}

/// Drops stale entries once they could outnumber the live ones.
fn sweep_signatures(st: &mut State) {
    let live = st.index.referenced_blocks();
    let State {
        signatures,
        index,
        regions,
        ..
    } = st;
    signatures.sweep_if_over(live, |p| place_holds(index, regions, p));
}

/// The block holding `fp`'s bytes, if the table knows a live one, as a
/// candidate for block `block`.
fn known_copy(st: &mut State, block: u64, fp: &Fingerprint) -> Option<SharedCopy> {
    let State {
        signatures,
        index,
        regions,
        integrity,
        ..
    } = st;
    let place = signatures.find(fp, |p| place_holds(index, regions, p))?;
    let crc = integrity.crcs.get(place.cbn)?;
    Some(SharedCopy {
        block,
        cbn: place.cbn,
        crc,
        source: Source::Signature { epoch: place.epoch },
    })
}

impl FlashCache {
    /// After an open, the signature table knows nothing of the blocks
    /// flash already holds: a background thread reads them region by
    /// region (each pinned while read), and remembers the fingerprint of
    /// every referenced block that still verifies. Until it is done, a
    /// block it has not reached yet is simply not shared.
    pub(super) fn start_signature_scan(cache: &std::sync::Arc<FlashCache>) {
        if !cache.dedups() || cache.lock().index.present_blocks() == 0 {
            return;
        }
        let weak = std::sync::Arc::downgrade(cache);
        let spawned = std::thread::Builder::new()
            .name("vdcache-dedup-scan".into())
            .spawn(move || {
                let started = Instant::now();
                let mut blocks = 0u64;
                let regions = match weak.upgrade() {
                    Some(c) => c.layout.regions,
                    None => return,
                };
                for region in 0..regions {
                    let Some(cache) = weak.upgrade() else { return };
                    if cache.stop.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    match cache.scan_region_signatures(region) {
                        Ok(n) => blocks += n,
                        Err(e) => {
                            tracing::warn!("dedup: rebuilding the signature table stopped: {e}");
                            return;
                        }
                    }
                }
                tracing::info!(
                    "dedup: signature table rebuilt from {blocks} cached blocks in {:.1} s",
                    started.elapsed().as_secs_f64()
                );
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "dedup: cannot start the signature scan ({e}); blocks cached before this start are not shared"
            );
        }
    }

    /// Fingerprints the referenced blocks of `region`; returns how many it
    /// remembered.
    fn scan_region_signatures(&self, region: u32) -> Result<u64> {
        let first = region * self.layout.blocks_per_region();
        let (blocks, epoch) = {
            let mut st = self.lock();
            let blocks: Vec<(u32, u32)> = (first..first + self.layout.data_blocks_per_region())
                .filter(|&cbn| st.index.is_referenced(cbn))
                .filter_map(|cbn| Some((cbn, st.integrity.crcs.get(cbn)?)))
                .collect();
            if blocks.is_empty() {
                return Ok(0);
            }
            st.regions.pin(region);
            (blocks, st.regions.epoch(region))
        };
        let mut found = Vec::with_capacity(blocks.len());
        let mut buf = vec![0u8; BLOCK as usize];
        let mut failed = None;
        for &(cbn, crc) in &blocks {
            if let Err(e) = self.device.read_at(&mut buf, self.layout.block_offset(cbn)) {
                failed = Some(e);
                break;
            }
            if crc32c::crc32c(&buf) == crc {
                found.push((cbn, self.fingerprint_of(&[&buf])));
            }
        }
        let mut st = self.lock();
        st.regions.unpin(region);
        if let Some(e) = failed {
            return Err(crate::error::CacheError::device("read a cached block")(e));
        }
        if st.regions.epoch(region) != epoch {
            return Ok(0);
        }
        let mut n = 0;
        for (cbn, fp) in found {
            if st.index.is_referenced(cbn) {
                st.signatures.remember(fp, Place { cbn, epoch });
                n += 1;
            }
        }
        Ok(n)
    }
}
