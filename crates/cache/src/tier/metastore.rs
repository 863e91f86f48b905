//! Dirty qcow2 metadata by the sector (cow-aware write-back, COWCache
//! section 3.2): an L2 or refcount update is kept as the 512-byte sectors
//! it changed, each copied into the journal buffer, instead of rewriting a
//! whole cached block or table. Reads see the sectors over whatever flash
//! or the backend holds; write-back copies them to the image, coalesced by
//! address, in the qcow2 format unchanged.
//!
//! Invariant: a block with sectors here is absent or clean in flash (a
//! metadata write to a block that is dirty in flash takes the block path
//! instead, and the block path absorbs the sectors of every block it
//! writes), so the sectors always win over flash, and the clean copies
//! they superseded are dropped once they reach the backend. A write that
//! goes straight to the backend over dirty sectors updates them instead of
//! dropping them: until it is durable they are the only flushed copy.
//!
//! This module must not interpret the sectors: qcow2 belongs to the COW
//! layer.

use super::commit::Unsynced;
use super::read::copy_overlap;
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::index::line_key;
use crate::journal::{Entry, META_SECTOR};
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::stats::bump;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use vdcache_contract::WriteSegment;
use vdcache_contract::{IoClass, IoTag, MetaTable};

/// Metadata sector size.
pub(crate) const SECTOR: u64 = META_SECTOR as u64;
/// Pending journal entries older than this are written out.
const JOURNAL_AGE: Duration = Duration::from_secs(1);
/// Sectors per write-back round.
const ROUND_SECTORS: usize = 4096;

/// One sector (`None`: zeros); `seq` changes on every write, so
/// write-back can tell whether what it copied is still the newest.
#[derive(Debug)]
struct Sector {
    data: Option<Box<[u8]>>,
    seq: u64,
    dirty: bool,
}

static ZERO_SECTOR: [u8; META_SECTOR] = [0; META_SECTOR];

/// A sector copied for write-back: (image, offset), seq, bytes.
type Copied = ((u16, u64), u64, Box<[u8]>);

/// The metadata sectors of every image, by (image, byte offset): dirty
/// ones (journaled, not yet on the backend) and clean ones kept after
/// write-back so the tables they belong to need not be fetched again,
/// dropped oldest first beyond a limit.
#[derive(Debug, Default)]
pub(crate) struct MetaStore {
    sectors: BTreeMap<(u16, u64), Sector>,
    dirty: BTreeSet<(u16, u64)>,
    /// Clean sectors by age (seq).
    clean: BTreeMap<u64, (u16, u64)>,
    next_seq: u64,
    dirty_zero: usize,
    clean_zero: usize,
}

/// Limit units of `n` sectors of which `zero` hold zeros: a sector with
/// bytes counts one, a zero sector (no bytes, a short record) 1/128, so a
/// new table costs as much as one sector of bytes.
fn weight(n: usize, zero: usize) -> u64 {
    ((n - zero) + zero / 128) as u64
}

impl MetaStore {
    pub fn dirty_len(&self) -> usize {
        self.dirty.len()
    }

    pub fn has_dirty_of(&self, image: u16) -> bool {
        self.dirty
            .range((image, 0)..=(image, u64::MAX))
            .next()
            .is_some()
    }

    pub fn dirty_weight(&self) -> u64 {
        weight(self.dirty.len(), self.dirty_zero)
    }

    fn clean_weight(&self) -> u64 {
        weight(self.clean.len(), self.clean_zero)
    }

    /// Memory held (sector bytes plus map overhead).
    pub fn memory_bytes(&self) -> u64 {
        let zero = (self.dirty_zero + self.clean_zero) as u64;
        (self.sectors.len() as u64 - zero) * SECTOR + self.sectors.len() as u64 * 64
    }

    /// Stores a dirty sector; all-zero content is kept as a mark.
    pub fn insert(&mut self, image: u16, offset: u64, data: &[u8]) {
        let data = (!data.iter().all(|&b| b == 0)).then(|| Box::<[u8]>::from(data));
        self.insert_dirty(image, offset, data);
    }

    /// Marks `count` sectors from `offset` as dirty zeros.
    pub fn insert_zeros(&mut self, image: u16, offset: u64, count: u64) {
        for i in 0..count {
            self.insert_dirty(image, offset + i * SECTOR, None);
        }
    }

    fn insert_dirty(&mut self, image: u16, offset: u64, data: Option<Box<[u8]>>) {
        self.remove(image, offset);
        self.next_seq += 1;
        self.dirty_zero += usize::from(data.is_none());
        self.dirty.insert((image, offset));
        let seq = self.next_seq;
        self.sectors.insert(
            (image, offset),
            Sector {
                data,
                seq,
                dirty: true,
            },
        );
    }

    pub fn is_dirty(&self, image: u16, offset: u64) -> bool {
        self.dirty.contains(&(image, offset))
    }

    /// Drops a sector; returns whether it was dirty.
    pub fn remove(&mut self, image: u16, offset: u64) -> bool {
        let Some(old) = self.sectors.remove(&(image, offset)) else {
            return false;
        };
        let zero = usize::from(old.data.is_none());
        if old.dirty {
            self.dirty.remove(&(image, offset));
            self.dirty_zero -= zero;
        } else {
            self.clean.remove(&old.seq);
            self.clean_zero -= zero;
        }
        old.dirty
    }

    /// The sector reached the backend as of `seq`: keep it as a clean
    /// copy, dropping the oldest clean ones beyond `limit`. False when it
    /// changed meanwhile.
    fn mark_clean(&mut self, key: (u16, u64), seq: u64, limit: u64) -> bool {
        let Some(s) = self
            .sectors
            .get_mut(&key)
            .filter(|s| s.seq == seq && s.dirty)
        else {
            return false;
        };
        s.dirty = false;
        let zero = usize::from(s.data.is_none());
        self.dirty.remove(&key);
        self.dirty_zero -= zero;
        self.clean.insert(seq, key);
        self.clean_zero += zero;
        while self.clean_weight() > limit {
            let Some((_, (img, off))) = self.clean.pop_first() else {
                break;
            };
            if let Some(old) = self.sectors.remove(&(img, off)) {
                self.clean_zero -= usize::from(old.data.is_none());
            }
        }
        true
    }

    /// Sectors overlapping bytes `[start, end)` of an image.
    pub fn overlapping(
        &self,
        image: u16,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        let lo = start / SECTOR * SECTOR;
        self.sectors
            .range((image, lo)..(image, end.max(lo)))
            .map(|(&(_, off), s)| (off, s.data.as_deref().unwrap_or(&ZERO_SECTOR)))
    }

    /// Whether the store holds every byte of `[start, end)`.
    pub fn covers(&self, image: u16, start: u64, end: u64) -> bool {
        start.is_multiple_of(SECTOR)
            && end.is_multiple_of(SECTOR)
            && end > start
            && self.overlapping(image, start, end).count() as u64 == (end - start) / SECTOR
    }

    /// Every dirty sector, for a checkpoint (`None`: zeros).
    pub fn dirty_sectors(&self) -> impl Iterator<Item = (u16, u64, Option<&[u8]>)> + '_ {
        self.dirty
            .iter()
            .filter_map(|k| self.sectors.get(k).map(|s| (k.0, k.1, s.data.as_deref())))
    }

    /// Images holding dirty sectors, with the end of their highest one.
    pub fn image_ends(&self) -> BTreeMap<u16, u64> {
        let mut out = BTreeMap::new();
        for &(img, off) in &self.dirty {
            let e = out.entry(img).or_insert(0);
            *e = (*e).max(off + SECTOR);
        }
        out
    }

    /// Up to `n` dirty sectors of images `open` accepts, in address
    /// order: key, seq and a copy.
    fn batch(&self, n: usize, open: impl Fn(u16) -> bool) -> Vec<Copied> {
        self.dirty
            .iter()
            .filter(|k| open(k.0))
            .take(n)
            .filter_map(|k| {
                let s = self.sectors.get(k)?;
                let data = s.data.clone().unwrap_or_else(|| ZERO_SECTOR.into());
                Some((*k, s.seq, data))
            })
            .collect()
    }

    fn is_empty(&self) -> bool {
        self.sectors.is_empty()
    }
}

/// Journal entries recording `data` written at `off`: runs of zero
/// sectors as one short entry each, other sectors with their bytes.
pub(crate) fn sector_entries(image: u16, off: u64, data: &[u8]) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    for (i, chunk) in data.chunks(META_SECTOR).enumerate() {
        let at = off + i as u64 * SECTOR;
        if chunk.iter().all(|&b| b == 0) {
            if let Some(Entry::MetaZero {
                offset, sectors, ..
            }) = out.last_mut()
                && *offset + u64::from(*sectors) * SECTOR == at
            {
                *sectors += 1;
                continue;
            }
            out.push(Entry::MetaZero {
                image,
                offset: at,
                sectors: 1,
            });
        } else {
            out.push(Entry::MetaSector {
                image,
                offset: at,
                data: chunk.into(),
            });
        }
    }
    out
}

/// Journal bytes of an entry.
fn entry_bytes(e: &Entry) -> u64 {
    let mut v = Vec::new();
    e.encode(&mut v);
    v.len() as u64
}

/// Copies what the store holds over `buf` (the bytes of `[off, off + len)`).
pub(crate) fn overlay(snapshot: &[(u64, Box<[u8]>)], off: u64, buf: &mut [u8]) {
    for (at, data) in snapshot {
        copy_overlap(data, *at, buf, off);
    }
}

/// Whether a write is of whole sectors of L2 tables or refcount blocks:
/// what cow-aware write-back keeps by the sector (see `routing`).
pub(crate) fn table_sectors(off: u64, len: u64, segments: &[WriteSegment<'_>]) -> bool {
    off.is_multiple_of(SECTOR)
        && len.is_multiple_of(SECTOR)
        && segments.iter().all(|s| {
            matches!(
                s.tag.class,
                IoClass::Metadata(MetaTable::L2 | MetaTable::RefcountBlock)
            )
        })
}

/// Coalesced runs of consecutive sectors of one image: (image, offset,
/// indexes into the batch).
fn sector_runs(batch: &[Copied]) -> Vec<(u16, u64, Vec<usize>)> {
    let mut out: Vec<(u16, u64, Vec<usize>)> = Vec::new();
    for (i, &((img, off), _, _)) in batch.iter().enumerate() {
        match out.last_mut() {
            Some((ri, ro, idx)) if *ri == img && *ro + idx.len() as u64 * SECTOR == off => {
                idx.push(i)
            }
            _ => out.push((img, off, vec![i])),
        }
    }
    out
}

impl FlashCache {
    /// The store's sectors overlapping a range, copied (taken before the
    /// range is read, so a concurrent write-back cannot make it stale).
    pub(crate) fn meta_snapshot(
        &self,
        st: &State,
        id: u16,
        off: u64,
        len: u64,
    ) -> Vec<(u64, Box<[u8]>)> {
        if st.meta.is_empty() {
            return Vec::new();
        }
        st.meta
            .overlapping(id, off, off + len)
            .map(|(at, d)| (at, d.into()))
            .collect()
    }

    /// Serves a read the store holds entirely (a dirty sector the COW
    /// layer evicted from memory and wants back).
    pub(crate) fn read_from_sectors(&self, id: u16, off: u64, buf: &mut [u8]) -> bool {
        let st = self.lock();
        let end = off + buf.len() as u64;
        if st.meta.is_empty() || !st.meta.covers(id, off, end) {
            return false;
        }
        for (at, data) in st.meta.overlapping(id, off, end) {
            copy_overlap(data, at, buf, off);
        }
        true
    }

    /// Keeps a metadata write by the sector. Returns false (nothing done)
    /// when a block of the range is dirty in flash: the block path must
    /// take it.
    pub(crate) fn write_sectors(
        &self,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        tag: IoTag,
    ) -> Result<bool> {
        let data: Vec<u8> = segments
            .iter()
            .flat_map(|s| s.data.iter().copied())
            .collect();
        let end = off + data.len() as u64;
        let mut st = self.lock();
        let dirty_block = (off / BLOCK..end.div_ceil(BLOCK)).any(|b| {
            st.index
                .get(line_key(id, b / LINE_BLOCKS))
                .is_some_and(|l| l.dirty & (1 << (b % LINE_BLOCKS)) != 0)
        });
        if dirty_block {
            return Ok(false);
        }
        let mut journaled = 0;
        for e in sector_entries(id, off, &data) {
            journaled += entry_bytes(&e);
            st.journal.push(&e);
        }
        for (i, chunk) in data.chunks(META_SECTOR).enumerate() {
            st.meta.insert(id, off + i as u64 * SECTOR, chunk);
        }
        let counters = self.stats.disk(tag.disk);
        bump(&counters.meta_flash_bytes_written, journaled);
        st.history.note(id, off, end);
        if let Some(rec) = st.catalog.images.get_mut(id as usize) {
            rec.end = rec.end.max(end);
        }
        st.ledger.uncommitted_dirty = true;
        self.journal_buffer_check(&mut st)?;
        let held = st.meta.dirty_weight();
        let limit = self.layout.meta_store_sectors();
        drop(st);
        if held >= limit || (held > limit / 2 && self.config.inline_background) {
            // Full (or no background thread): write back here.
            while self.meta_writeback_round(held >= limit)? {}
        } else if held > limit / 2 {
            self.wake.notify();
        }
        Ok(true)
    }

    /// Drops the sectors overlapping `[off, off + len)`: a block written
    /// dirty to flash absorbed them, or their space was discarded. Returns
    /// whether any dirty one went; callers commit before a backend sees
    /// the range.
    pub(crate) fn drop_sectors(&self, st: &mut State, id: u16, off: u64, len: u64) -> bool {
        if st.meta.is_empty() {
            return false;
        }
        let hit: Vec<u64> = st
            .meta
            .overlapping(id, off, off + len)
            .map(|(a, _)| a)
            .collect();
        let mut dropped_dirty = false;
        for at in hit {
            if st.meta.remove(id, at) {
                dropped_dirty = true;
                st.journal.push(&Entry::MetaClean {
                    image: id,
                    offset: at,
                });
                st.ledger.uncommitted_dirty = true;
            }
        }
        dropped_dirty
    }

    /// A write of `segments` from `off` that goes to the backend, not
    /// through the store: sectors it overlaps take its bytes and stay,
    /// dirty, so whichever of the two survives a crash holds the flushed
    /// or the new bytes (dropping a dirty sector before the write is
    /// durable would bring back what the backend held before it). Clean
    /// sectors it covers whole are only dropped: they do not outlive a
    /// restart, so nothing needs to be durable first.
    pub(crate) fn absorb_bypassing_write(
        &self,
        st: &mut State,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
    ) {
        if st.meta.is_empty() {
            return;
        }
        let end = off + segments.iter().map(|s| s.data.len() as u64).sum::<u64>();
        let hit: Vec<(u64, Box<[u8]>)> = st
            .meta
            .overlapping(id, off, end)
            .map(|(at, d)| (at, d.into()))
            .collect();
        for (at, mut sector) in hit {
            let whole = at >= off && at + SECTOR <= end;
            if whole && !st.meta.is_dirty(id, at) {
                st.meta.remove(id, at);
                continue;
            }
            let mut seg_at = off;
            for s in segments {
                copy_overlap(s.data, seg_at, &mut sector, at);
                seg_at += s.data.len() as u64;
            }
            for e in sector_entries(id, at, &sector) {
                st.journal.push(&e);
            }
            st.meta.insert(id, at, &sector);
            st.ledger.uncommitted_dirty = true;
        }
    }

    /// Whether the store needs write-back now.
    fn meta_needs_writeback(&self, st: &State, force: bool) -> bool {
        (0..st.catalog.images.len() as u16).any(|id| st.is_open(id) && st.meta.has_dirty_of(id))
            && (force
                || st.dirty.draining()
                || st.meta.dirty_weight() > self.layout.meta_store_sectors() / 2)
    }

    /// Writes one batch of sectors back to their images and syncs them;
    /// true when more work remains.
    pub(crate) fn meta_writeback_round(&self, force: bool) -> Result<bool> {
        let keys: Vec<(u16, u64)> = {
            let st = self.lock();
            if !self.meta_needs_writeback(&st, force) {
                return Ok(false);
            }
            st.meta
                .batch(ROUND_SECTORS, |i| st.is_open(i))
                .into_iter()
                .map(|b| b.0)
                .collect()
        };
        let mut ranges: Vec<(u16, u64, u64)> = Vec::new();
        for &(img, off) in &keys {
            match ranges.last_mut() {
                Some((i, _, e)) if *i == img && *e == off => *e = off + SECTOR,
                _ => ranges.push((img, off, off + SECTOR)),
            }
        }
        // Hold the ranges, then copy what is still there: a write-through
        // of the same bytes either finished (and changed the store) or
        // waits for this copy.
        let _range = self.ranges.lock(&ranges);
        let (batch, targets) = {
            let mut st = self.lock();
            self.commit_before_bypass(&mut st)?;
            let batch: Vec<_> = st
                .meta
                .batch(ROUND_SECTORS, |i| st.is_open(i))
                .into_iter()
                .filter(|(k, _, _)| keys.binary_search(k).is_ok())
                .collect();
            let targets: Vec<Option<(vdcache_backend::BackendRef, vdcache_contract::DiskId)>> = st
                .catalog
                .images
                .iter()
                .map(|r| r.backend.clone().map(|b| (b, r.disk)))
                .collect();
            (batch, targets)
        };
        let runs = sector_runs(&batch);
        let mut synced = std::collections::BTreeSet::new();
        for (img, off, idx) in &runs {
            let Some(Some((backend, disk))) = targets.get(*img as usize) else {
                return Err(CacheError::Config(format!(
                    "metadata of image {img} is dirty in the cache but the image is not open"
                )));
            };
            let bufs: Vec<&[u8]> = idx.iter().map(|&i| &*batch[i].2).collect();
            backend
                .write_vectored_at(&bufs, *off)
                .map_err(CacheError::store("write metadata back to", &**backend))?;
            bump(
                &self.stats.disk(*disk).backend_bytes_written,
                idx.len() as u64 * SECTOR,
            );
            synced.insert(*img);
        }
        for img in &synced {
            if let Some(Some((backend, disk))) = targets.get(*img as usize) {
                backend
                    .flush()
                    .map_err(CacheError::store("sync", &**backend))?;
                bump(&self.stats.disk(*disk).backend_syncs, 1);
            }
        }
        let mut st = self.lock();
        let clean_limit = 2 * self.layout.meta_store_sectors();
        for (key, seq, _) in &batch {
            if !st.meta.mark_clean(*key, *seq, clean_limit) {
                continue;
            }
            let (img, off) = *key;
            // A clean flash copy of the block predates the sector, and
            // the clean sector kept here may be dropped any time.
            let block = off / BLOCK;
            self.unmap_block(
                &mut st,
                line_key(img, block / LINE_BLOCKS),
                (block % LINE_BLOCKS) as usize,
            );
            // A read that fetched the old bytes must not admit them.
            st.history.note(img, off, off + SECTOR);
            st.journal.push(&Entry::MetaClean {
                image: img,
                offset: off,
            });
        }
        self.journal_buffer_check(&mut st)?;
        self.progress.notify_all();
        Ok(self.meta_needs_writeback(&st, force))
    }

    /// After blocks were mapped: writes the summaries of regions that
    /// filled (not only at commits: a workload that never flushes, such as
    /// reads filling the cache, would otherwise keep 8 bytes per cached
    /// block in memory), and the journal buffer when it is full.
    pub(crate) fn journal_buffer_check(&self, st: &mut State) -> Result<()> {
        self.write_summaries(st)?;
        if st.journal.pending_bytes() >= self.config.journal_buffer_bytes {
            self.write_journal_buffer(st)?;
        }
        Ok(())
    }

    /// Writes pending journal entries when the oldest is old enough (from
    /// the write-back thread: the backend syncs this needs run without the
    /// lock, and entries recorded meanwhile wait for the next write).
    pub(crate) fn journal_age_check(&self) -> Result<()> {
        let st = self.lock();
        if st.journal.pending_bytes() == 0 || st.ledger.journal_written.elapsed() < JOURNAL_AGE {
            return Ok(());
        }
        let through = st.journal.pushed();
        let mut st = self.sync_backends_unlocked(st, Unsynced::Described)?;
        st.ledger.journal_written = Instant::now();
        self.append_journal_through(&mut st, through)
    }

    /// Journals the clean copies of write-through data held out of the
    /// journal once they are too many, syncing their backends first
    /// (without the lock: a sync may cross the network).
    pub(crate) fn clean_copies_check(&self) -> Result<()> {
        let st = self.lock();
        if !st.ledger.clean_over_limit() {
            return Ok(());
        }
        let mut st = self.sync_backends_unlocked(st, Unsynced::Indexed)?;
        self.journal_buffer_check(&mut st)
    }

    /// Writes the journal buffer to the metadata zone without a sync (a
    /// guest flush adds the sync): backends holding write-through data the
    /// records describe are synced first.
    fn write_journal_buffer(&self, st: &mut State) -> Result<()> {
        self.sync_backends(st, Unsynced::Described)?;
        st.ledger.journal_written = Instant::now();
        self.append_journal(st)
    }
}
