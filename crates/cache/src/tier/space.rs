//! Allocating cache blocks and reclaiming regions: the victim region's
//! dirty blocks are written back, hot clean blocks may be re-inserted,
//! the rest are dropped; the region is reused only after the journal
//! records that emptied it are durable, and its space is discarded. A
//! region holding a newer copy of a block the write-back thread is still
//! copying an older copy of is not a victim until that copy landed.

use tracing::{debug, warn};

use super::checkpoint::lines_bound;
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::index::Cbn;
use crate::journal::Entry;
use crate::layout::BLOCK;
use crate::region::Stream;
use crate::summary::decode_entry;

/// A dirty block to copy to its backend: (line key, slot, block).
pub(crate) type DirtyBlock = (u64, usize, Cbn);

/// Cache block `cbn` in its region's current epoch.
fn place_of(st: &State, cbn: Cbn) -> crate::dedup::Place {
    crate::dedup::Place {
        cbn,
        epoch: st.regions.epoch(st.regions.region_of(cbn)),
    }
}

/// The fingerprint learned for what block `cbn` holds now.
fn fingerprint_at(st: &State, cbn: Cbn) -> Option<crate::dedup::Fingerprint> {
    st.signatures.fingerprint(place_of(st, cbn))
}

/// Blocks a reclaim moved: the old cache block to the new one, and the
/// checksum of the bytes moved.
type Moves = std::collections::HashMap<Cbn, (Cbn, u32)>;

/// Where an image's blocks go back to: (image id, store, disk to bill).
pub(crate) type Target = (u16, vdcache_backend::BackendRef, vdcache_contract::DiskId);

/// Regions emptied so far, by where their references were found: a
/// summary is cheap, a scan of the whole index is not (reported in stats).
#[derive(Debug, Default)]
pub(crate) struct ReclaimCounts {
    pub by_summary: u64,
    pub by_scan: u64,
}

/// What came of moving a block within flash.
enum Moved {
    Yes,
    /// Its copy no longer verifies (the device damaged it).
    Damaged,
    /// No free space in the promotion stream.
    NoRoom,
}

/// Where a region's references were found.
pub(crate) enum RefsFrom {
    /// It held nothing live.
    Nothing,
    /// Its summary.
    Summary,
    /// A scan of the whole index.
    Scan,
}

impl FlashCache {
    /// Allocates up to `n` blocks in `stream`, reclaiming regions only when
    /// none is free (the reserve is refilled by [`Self::keep_reserve`]). Returns the runs obtained (fewer blocks than asked when no
    /// region can be reclaimed, e.g. all are in use by in-flight I/O).
    /// The runs' regions stay pinned until [`Self::settle`] or
    /// [`Self::give_back`]: blocks allocated but not yet mapped must not be
    /// reclaimed under the writer.
    pub(crate) fn allocate(
        &self,
        st: &mut State,
        stream: Stream,
        disk: vdcache_contract::DiskId,
        n: u32,
    ) -> Result<Vec<(Cbn, u32)>> {
        let owner = st.shares.tenant_of(disk.0);
        let mut out = Vec::new();
        let mut left = n;
        while left > 0 {
            match st.regions.allocate_for(stream, owner, left) {
                Some((c, k)) => {
                    let r = st.regions.region_of(c);
                    st.regions.pin(r);
                    out.push((c, k));
                    left -= k;
                }
                None => {
                    if !self.evict_one(st)? {
                        break;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Tops the free regions up to the reserve once a request's blocks are
    /// mapped. Evicting after the request, not before, lets an overwrite
    /// reclaim the region its own old copy emptied instead of a live one:
    /// the cache then holds exactly as many live blocks as an LRU of the
    /// same capacity would (see the replay crate's LRU test).
    pub(crate) fn keep_reserve(&self, st: &mut State) -> Result<()> {
        // Regions left empty by overwrites count as free: reclaiming them
        // costs no live block.
        let reserve = self.config.reserve_regions;
        // Counting empty regions scans them all: only when free runs short.
        while st.regions.free_regions() < reserve
            && st.regions.free_regions() + st.regions.empty_full_regions() < reserve
        {
            if !self.evict_one(st)? {
                break;
            }
        }
        // Sharing stops while the checkpoint could outgrow its room, but
        // addresses leaving lines that stay behind and blocks refilled in
        // new lines can still push it over: evict until it fits again.
        let room = self.layout.checkpoint_lines_room();
        for _ in 0..self.layout.regions {
            if lines_bound(st) <= room || !self.evict_one(st)? {
                break;
            }
        }
        Ok(())
    }

    /// Returns allocated blocks unused (the data was not written).
    pub(crate) fn give_back(&self, st: &mut State, runs: &[(Cbn, u32)]) {
        for &(c, k) in runs {
            for cbn in c..c + k {
                st.regions.release_block(cbn);
            }
        }
        self.settle(st, runs);
    }

    /// Unpins the regions of allocated runs once their blocks are mapped.
    pub(crate) fn settle(&self, st: &mut State, runs: &[(Cbn, u32)]) {
        for &(c, _) in runs {
            let r = st.regions.region_of(c);
            st.regions.unpin(r);
        }
    }

    /// Reclaims one region; false when none can be reclaimed. A region
    /// holding a newer dirty copy of a block the write-back thread is
    /// copying is passed over until that copy landed (see
    /// `State::copying`).
    pub(crate) fn evict_one(&self, st: &mut State) -> Result<bool> {
        let mut passed = Vec::new();
        let chosen = loop {
            let Some(v) = st
                .regions
                .choose_victim_among(st.index.extra_refs(), Some(&st.shares))
            else {
                break None;
            };
            let refs = self.region_refs(st, v);
            if !self.holds_block_being_copied(st, &refs.0)
                && !Self::holds_dirty_block_of_closed_image(st, &refs.0)
            {
                break Some((v, refs));
            }
            // Pinned, the policy chooses among the others.
            st.regions.pin(v);
            passed.push(v);
        };
        for r in passed {
            st.regions.unpin(r);
        }
        let Some((victim, (refs, from))) = chosen else {
            return Ok(false);
        };
        match from {
            RefsFrom::Summary => st.reclaimed.by_summary += 1,
            RefsFrom::Scan => st.reclaimed.by_scan += 1,
            RefsFrom::Nothing => {}
        }
        st.regions.pin(victim);
        let result = self.empty_region(st, victim, refs);
        st.regions.unpin(victim);
        result?;
        // The unmaps must be durable before anything overwrites the region.
        self.commit(st)?;
        let off = self.layout.region_offset(victim);
        // Discarding is advisory: a device without TRIM keeps the bytes.
        let _ = self.device.discard(off, self.layout.region_bytes);
        st.regions.reset(victim);
        st.index.summaries().forget(victim);
        Ok(true)
    }

    /// Whether any of a region's `refs` is a dirty block of a (line, slot)
    /// the write-back thread is copying an older copy of.
    fn holds_block_being_copied(&self, st: &State, refs: &[DirtyBlock]) -> bool {
        refs.iter().any(|&(key, slot, _)| {
            st.dirty.is_copying(key, slot)
                && st
                    .index
                    .get(key)
                    .is_some_and(|l| l.dirty & (1 << slot) != 0)
        })
    }

    /// Whether any of a region's `refs` is a dirty block of an image not
    /// open (yet: a server opening its exports one by one, a cache kept
    /// dirty across a restart): it cannot be written back, so the region
    /// cannot be emptied before that image opens.
    fn holds_dirty_block_of_closed_image(st: &State, refs: &[DirtyBlock]) -> bool {
        refs.iter().any(|&(key, slot, _)| {
            let image = crate::index::key_image(key);
            st.catalog
                .images
                .get(image as usize)
                .is_some_and(|r| r.backend.is_none())
                && st
                    .index
                    .get(key)
                    .is_some_and(|l| l.dirty & (1 << slot) != 0)
        })
    }

    /// Every (key, slot, block) referencing a block of `region`: from its
    /// summary when that accounts for every live block, else (no summary,
    /// a stale or torn one, an unfinished one after a crash) from a scan
    /// of the whole index.
    pub(crate) fn region_refs(&self, st: &mut State, region: u32) -> (Vec<DirtyBlock>, RefsFrom) {
        let live = st.regions.live_blocks(region);
        if live == 0 {
            return (Vec::new(), RefsFrom::Nothing);
        }
        if let Some(entries) = self.summary_entries(st, region) {
            let start = region * self.layout.blocks_per_region();
            let mut refs: Vec<DirtyBlock> = Vec::new();
            let mut blocks = 0u32;
            for (i, &e) in entries.iter().enumerate() {
                let cbn = start + i as u32;
                let before = refs.len();
                if let Some((key, slot)) = decode_entry(e)
                    && st.index.block(key, slot) == Some(cbn)
                {
                    refs.push((key, slot, cbn));
                }
                for (key, slot) in st.index.other_references(cbn) {
                    if !refs[before..].contains(&(key, slot, cbn)) {
                        refs.push((key, slot, cbn));
                    }
                }
                blocks += u32::from(refs.len() > before);
            }
            if blocks == live {
                return (refs, RefsFrom::Summary);
            }
            debug!(
                region,
                blocks, live, "region summary incomplete; scanning the index"
            );
        }
        let mut refs = Vec::new();
        for l in st.index.lines() {
            for (slot, cbn) in l.blocks() {
                if self.layout.region_of(cbn) == region {
                    refs.push((l.key, slot, cbn));
                }
            }
        }
        (refs, RefsFrom::Scan)
    }

    /// A region's summary entries: still in memory, or read back from
    /// flash when the one there is of the region's current filling.
    fn summary_entries(&self, st: &mut State, region: u32) -> Option<Vec<u64>> {
        if let Some(p) = st.index.summaries().pending(region) {
            return Some(p.to_vec());
        }
        let epoch = st.regions.epoch(region);
        if st.index.summaries().written_epoch(region) != Some(epoch) {
            return None;
        }
        let blocks = self.layout.blocks_per_region() - self.layout.data_blocks_per_region();
        let mut buf = vec![0u8; (u64::from(blocks) * BLOCK) as usize];
        if let Err(e) = self
            .device
            .read_at(&mut buf, self.layout.summary_offset(region))
        {
            warn!(
                region,
                "cannot read the region summary ({e}); scanning the index"
            );
            return None;
        }
        st.index.summaries().decode(&buf, epoch)
    }

    /// Writes the summaries of regions that filled since the last commit.
    /// They are hints, checked on use, so they need no sync.
    pub(crate) fn write_summaries(&self, st: &mut State) -> Result<()> {
        let regions = &st.regions;
        let ready = st
            .index
            .summaries()
            .pending_where(|r| regions.is_settled_full(r));
        for region in ready {
            let epoch = st.regions.epoch(region);
            let Some(buf) = st.index.summaries().take_encoded(region, epoch) else {
                continue;
            };
            self.device
                .write_at(&buf, self.layout.summary_offset(region))
                .map_err(CacheError::device("write region summary"))?;
            st.index.summaries().mark_written(region, epoch);
        }
        Ok(())
    }

    fn empty_region(&self, st: &mut State, victim: u32, refs: Vec<DirtyBlock>) -> Result<()> {
        let budget =
            crate::reinsertion::policy(self.config.relocate_hot).budget(&st.regions, victim);
        let mut dirty: Vec<DirtyBlock> = Vec::new();
        let mut relocate: Vec<DirtyBlock> = Vec::new();
        let mut held: Vec<DirtyBlock> = Vec::new();
        let mut keys = Vec::new();
        for (key, slot, cbn) in refs {
            keys.push(key);
            let is_dirty = st
                .index
                .get(key)
                .is_some_and(|l| l.dirty & (1 << slot) != 0);
            if is_dirty && st.index.is_held(crate::index::key_image(key)) {
                held.push((key, slot, cbn));
            } else if is_dirty {
                dirty.push((key, slot, cbn));
            } else if (relocate.len() as u32) < budget {
                relocate.push((key, slot, cbn));
            } else {
                self.unmap_block(st, key, slot);
            }
        }
        // Held blocks live only in flash: moved, while flash has room
        // for them, else written out like any dirty block.
        let mut moved = Moves::new();
        dirty.extend(self.relocate_held(st, &held, &mut moved)?);
        if !dirty.is_empty() {
            self.commit_before_bypass(st)?;
            let backends = self.backends_of(st, &dirty)?;
            let crcs = expected_crcs(st, &dirty);
            let damaged = self
                .copy_pieces(&backends, Self::flash_pieces(&dirty, &crcs))?
                .damaged;
            for &(key, slot, cbn) in &dirty {
                if damaged.contains(&(key, slot, cbn)) {
                    // Its content is lost: the region goes, the loss stays
                    // (reads of the block fail until it is written again).
                    self.lose_block(st, key, slot);
                } else if st.index.mark_clean(key, slot, cbn) {
                    st.journal.push(&Entry::Clean {
                        key,
                        slot: slot as u8,
                        cbn,
                    });
                }
                self.unmap_block(st, key, slot);
            }
        }
        self.relocate(st, &relocate, &mut moved)?;
        st.regions.remember_evicted(victim, keys.into_iter());
        Ok(())
    }

    /// Copies hot clean blocks into the promotion stream (only into space
    /// that is already free: relocation never triggers another eviction).
    fn relocate(&self, st: &mut State, blocks: &[DirtyBlock], moved: &mut Moves) -> Result<()> {
        for &(key, slot, cbn) in blocks {
            match self.move_block(st, (key, slot, cbn), false, moved)? {
                Moved::Yes => st
                    .ledger
                    .clean_copy_needs_sync(crate::index::key_image(key)),
                // The device damaged this clean copy: drop it, the image
                // still has the bytes.
                Moved::Damaged => {
                    tracing::warn!(cbn, "a clean cache block does not verify: dropped");
                    self.unmap_block(st, key, slot);
                }
                Moved::NoRoom => {
                    self.unmap_block(st, key, slot);
                }
            }
        }
        Ok(())
    }

    /// Moves held dirty blocks (see [`crate::index::Index::set_held`]) into
    /// the promotion stream, as long as held blocks take at most half of
    /// flash and free space takes them; returns those that must be written
    /// out instead.
    fn relocate_held(
        &self,
        st: &mut State,
        blocks: &[DirtyBlock],
        moved: &mut Moves,
    ) -> Result<Vec<DirtyBlock>> {
        let mut out = Vec::new();
        for &(key, slot, cbn) in blocks {
            if st.index.held_dirty_blocks() * 2 > self.layout.cacheable_blocks() {
                out.push((key, slot, cbn));
                continue;
            }
            match self.move_block(st, (key, slot, cbn), true, moved)? {
                Moved::Yes => {}
                Moved::Damaged => {
                    // Its content is lost: the region goes, the loss stays.
                    self.lose_block(st, key, slot);
                    self.unmap_block(st, key, slot);
                }
                Moved::NoRoom => out.push((key, slot, cbn)),
            }
        }
        Ok(out)
    }

    /// Copies block `cbn` of (line `key`, `slot`) into free space of the
    /// promotion stream and maps the slot there, `dirty` or clean. Another
    /// address of a shared block (dedup, a journal copy) that moved it
    /// already in this reclaim (`moved`) follows it: flash keeps one copy.
    fn move_block(
        &self,
        st: &mut State,
        (key, slot, cbn): DirtyBlock,
        dirty: bool,
        moved: &mut Moves,
    ) -> Result<Moved> {
        let earlier = moved.get(&cbn).copied();
        let follows = earlier.is_some();
        let (dst, crc) = match earlier {
            Some(to) => to,
            None => {
                let mut buf = vec![0u8; BLOCK as usize];
                self.device
                    .read_at(&mut buf, self.layout.block_offset(cbn))
                    .map_err(CacheError::device("read block"))?;
                let crc = crc32c::crc32c(&buf);
                if st.integrity.crcs.get(cbn) != Some(crc) {
                    return Ok(Moved::Damaged);
                }
                let victim = st.regions.region_of(cbn);
                let owner = st.regions.owner(victim);
                let Some((dst, 1)) = st.regions.allocate_for(Stream::Promote, owner, 1) else {
                    return Ok(Moved::NoRoom);
                };
                self.device
                    .write_at(&buf, self.layout.block_offset(dst))
                    .map_err(CacheError::device("write block"))?;
                moved.insert(cbn, (dst, crc));
                (dst, crc)
            }
        };
        let guest = st.index.get(key).map_or(u64::MAX, |l| u64::from(l.guest));
        // Learned before the source may be freed below.
        let known = self.dedups().then(|| fingerprint_at(st, cbn)).flatten();
        if let Some((old, r)) = st.map_block(key, guest, slot, dst, dirty, crc)
            && st.index.release(old, r)
        {
            st.regions.release_block(old);
        }
        if self.dedups() && !follows {
            super::signatures::note_signature(st, crc, dst);
            if let Some(fp) = known {
                let at = place_of(st, dst);
                st.signatures.learn(at, fp);
            }
        }
        st.journal.push(&Entry::Map {
            key,
            slot: slot as u8,
            cbn: dst,
            guest,
            dirty,
            crc,
        });
        Ok(Moved::Yes)
    }

    /// The stores of the images the blocks belong to.
    pub(crate) fn backends_of(&self, st: &State, blocks: &[DirtyBlock]) -> Result<Vec<Target>> {
        let mut out: Vec<Target> = Vec::new();
        for &(key, _, _) in blocks {
            let id = crate::index::key_image(key);
            if out.iter().any(|(i, _, _)| *i == id) {
                continue;
            }
            let rec = st
                .catalog
                .images
                .get(id as usize)
                .ok_or_else(|| CacheError::Corrupt(format!("block of unknown image {id}")))?;
            let backend = rec.backend.clone().ok_or_else(|| {
                CacheError::Config(format!(
                    "dirty blocks of {} cannot be written back: the image is not open (run recover --full)",
                    rec.name
                ))
            })?;
            out.push((id, backend, rec.disk));
        }
        Ok(out)
    }

    /// Dirty block `slot` of line `key` no longer verifies in flash: its
    /// only copy is lost. It becomes unreadable (reads fail rather than
    /// return what the image holds, which is older), or, when salvaging,
    /// is given up (the image's older bytes are what remains).
    pub(crate) fn lose_block(&self, st: &mut State, key: u64, slot: usize) {
        let image = crate::index::key_image(key);
        let name = st
            .catalog
            .images
            .get(image as usize)
            .map_or("?", |r| r.name.as_str());
        let offset = crate::index::key_line(key) * crate::layout::LINE + slot as u64 * BLOCK;
        if self.config.salvage {
            tracing::error!(
                image = name,
                offset,
                "salvage: a damaged dirty block is given up; the image keeps its older bytes there"
            );
            self.unmap_block(st, key, slot);
        } else {
            tracing::error!(
                image = name,
                offset,
                "a dirty cache block no longer verifies: its data is lost and reads of it fail"
            );
            st.integrity.unreadable.insert((key, slot as u8));
            st.journal.push(&Entry::Lost {
                key,
                slot: slot as u8,
                lost: true,
            });
        }
    }
}

/// The checksums the blocks were written with, in the same order.
pub(crate) fn expected_crcs(st: &State, blocks: &[DirtyBlock]) -> Vec<u32> {
    blocks
        .iter()
        .map(|&(_, _, cbn)| st.integrity.crcs.get(cbn).unwrap_or(0))
        .collect()
}
