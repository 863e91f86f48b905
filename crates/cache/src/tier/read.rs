//! Reads: blocks present in flash are read from flash (runs of contiguous
//! blocks in one request); the rest from the backend, aligned to whole
//! blocks, and admitted into the promotion stream when the admission
//! policy says so and no write overtook the read.

use super::metastore::overlay;
use super::sharing::SharedCopy;
use super::signatures::Checksummed;
use super::{FlashCache, State};
use crate::config::DiskPolicy;
use crate::error::{CacheError, Result};
use crate::index::{Cbn, line_key};
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::region::Stream;
use crate::stats::{DiskCounters, bump};
use std::sync::atomic::Ordering;
use vdcache_contract::{HostOffset, ImageHandle, IoClass, IoTag};

/// Copies the part of `data` (starting at byte `data_at` of the image)
/// that overlaps the request `[req_at, req_at + buf.len())` into `buf`.
pub(crate) fn copy_overlap(data: &[u8], data_at: u64, buf: &mut [u8], req_at: u64) {
    let start = data_at.max(req_at);
    let end = (data_at + data.len() as u64).min(req_at + buf.len() as u64);
    if start >= end {
        return;
    }
    buf[(start - req_at) as usize..(end - req_at) as usize]
        .copy_from_slice(&data[(start - data_at) as usize..(end - data_at) as usize]);
}

/// Consecutive runs of `(block, cbn)` pairs where both numbers advance by one.
pub(crate) fn runs(pairs: &[(u64, Cbn)]) -> Vec<&[(u64, Cbn)]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=pairs.len() {
        let breaks = i == pairs.len()
            || pairs[i].0 != pairs[i - 1].0 + 1
            || pairs[i].1 != pairs[i - 1].1 + 1;
        if breaks {
            out.push(&pairs[start..i]);
            start = i;
        }
    }
    out
}

/// The blocks of a run read from flash whose bytes do not match their
/// checksums.
fn unverified(run: &[(u64, Cbn)], crcs: &[u32], bytes: &[u8]) -> Vec<(u64, Cbn)> {
    run.iter()
        .zip(crcs)
        .zip(bytes.chunks(BLOCK as usize))
        .filter(|((_, crc), data)| crc32c::crc32c(data) != **crc)
        .map(|((hit, _), _)| *hit)
        .collect()
}

/// Whether block `block` of image `id` lost its only copy (see
/// `State::unreadable`).
/// Cached blocks between two runs of missing blocks that one backend
/// read fetches along with them (64 KiB: less than a round trip costs).
const MERGE_GAP_BLOCKS: u64 = 16;

/// The runs `[start, end)` of the sorted blocks `misses`, grouped where
/// the gap between runs is at most [`MERGE_GAP_BLOCKS`].
fn miss_groups(misses: &[u64]) -> Vec<Vec<(u64, u64)>> {
    let mut groups: Vec<Vec<(u64, u64)>> = Vec::new();
    for &b in misses {
        let end = groups.last().and_then(|g| g.last()).map(|r| r.1);
        match (end, groups.last_mut()) {
            (Some(end), Some(g)) if b == end => {
                if let Some(r) = g.last_mut() {
                    r.1 = b + 1;
                }
            }
            (Some(end), Some(g)) if b > end && b - end <= MERGE_GAP_BLOCKS => g.push((b, b + 1)),
            _ => groups.push(vec![(b, b + 1)]),
        }
    }
    groups
}

pub(crate) fn is_unreadable(st: &State, id: u16, block: u64) -> bool {
    !st.integrity.unreadable.is_empty()
        && st.integrity.unreadable.contains(&(
            line_key(id, block / LINE_BLOCKS),
            (block % LINE_BLOCKS) as u8,
        ))
}

/// The error of a read of a dirty block whose flash copy the device
/// damaged: its newest content is lost.
pub(crate) fn unreadable_block(st: &State, id: u16, block: u64) -> CacheError {
    let name = st
        .catalog
        .images
        .get(id as usize)
        .map_or("?", |r| r.name.as_str());
    let e = CacheError::Unreadable {
        image: name.to_string(),
        offset: block * BLOCK,
    };
    tracing::error!("{e}");
    e
}

impl FlashCache {
    pub(crate) fn read_blocks(
        &self,
        image: &ImageHandle,
        off: u64,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let id = self.image_id(image, tag.disk)?;
        let counters = self.stats.disk(tag.disk);
        let guest = tag.class == IoClass::GuestData;
        if guest {
            bump(&counters.guest_reads, 1);
            bump(&counters.guest_read_bytes, buf.len() as u64);
        }
        if self.read_from_sectors(id, off, buf) {
            return Ok(());
        }
        let first = off / BLOCK;
        let last = (off + buf.len() as u64 - 1) / BLOCK;
        let mut hits: Vec<(u64, Cbn)> = Vec::new();
        let mut expected: Vec<u32> = Vec::new();
        let mut misses: Vec<u64> = Vec::new();
        let (read_seq, policy, sectors) = {
            let mut st = self.lock();
            if let Some(b) = (first..=last).find(|&b| is_unreadable(&st, id, b)) {
                return Err(unreadable_block(&st, id, b));
            }
            for b in first..=last {
                let key = line_key(id, b / LINE_BLOCKS);
                let slot = (b % LINE_BLOCKS) as usize;
                match st.index.block(key, slot) {
                    Some(cbn) => {
                        let r = st.regions.region_of(cbn);
                        st.regions.pin(r);
                        st.regions.touch(r);
                        let owner = st.regions.owner(r);
                        st.shares.hit(owner);
                        hits.push((b, cbn));
                        expected.push(st.integrity.crcs.get(cbn).unwrap_or(0));
                    }
                    None => {
                        st.regions.note_miss(key);
                        misses.push(b);
                    }
                }
            }
            let policy = st.catalog.policy(tag.disk, self.config.default_policy);
            if !misses.is_empty() {
                self.widen_to_table(&st, id, policy, tag, &mut misses);
            }
            (
                st.history.seq(),
                policy,
                self.meta_snapshot(&st, id, off, buf.len() as u64),
            )
        };
        let hit_blocks = hits.len() as u64;
        bump(&counters.all_hit_blocks, hit_blocks);
        bump(&counters.all_miss_blocks, misses.len() as u64);
        if guest {
            bump(&counters.read_hit_blocks, hit_blocks);
            bump(&counters.read_miss_blocks, misses.len() as u64);
        }
        let flash = self.read_hits(&hits, &expected, off, buf);
        {
            let mut st = self.lock();
            for &(_, cbn) in &hits {
                let r = st.regions.region_of(cbn);
                st.regions.unpin(r);
            }
        }
        bump(&counters.flash_bytes_read, hit_blocks * BLOCK);
        if matches!(tag.class, IoClass::Metadata(_)) {
            bump(&counters.meta_flash_bytes_read, hit_blocks * BLOCK);
        }
        let damaged = flash?;
        if !damaged.is_empty() {
            let refetch = self.drop_damaged(id, &damaged)?;
            self.read_misses(image, &refetch, off, buf, &counters)?;
        }
        if !misses.is_empty() {
            let fetched = self.read_misses(image, &misses, off, buf, &counters)?;
            // Copy-on-write filler has no locality of its own.
            let cow_aware = policy.cow == crate::config::CowMode::CowAware;
            if !(cow_aware && tag.class == IoClass::CowFill)
                && let Err(e) = self.promote(id, tag, policy, read_seq, fetched)
            {
                self.promotion_failed(&counters, &image.name, &e);
            }
        }
        overlay(&sectors, off, buf);
        Ok(())
    }

    /// A cow-aware metadata miss fetches the rest of its table too (the
    /// blocks flash lacks), so the table is read from the backend once and
    /// cached in flash; the COW layer keeps only the sector it wanted.
    fn widen_to_table(
        &self,
        st: &State,
        id: u16,
        policy: DiskPolicy,
        tag: IoTag,
        misses: &mut Vec<u64>,
    ) {
        let Some((HostOffset(start), len)) = tag.unit else {
            return;
        };
        if policy.cow != crate::config::CowMode::CowAware
            || !matches!(tag.class, IoClass::Metadata(_))
        {
            return;
        }
        for b in start / BLOCK..(start + u64::from(len)).div_ceil(BLOCK) {
            let key = line_key(id, b / LINE_BLOCKS);
            if st.index.block(key, (b % LINE_BLOCKS) as usize).is_none()
                && !st.meta.covers(id, b * BLOCK, (b + 1) * BLOCK)
            {
                misses.push(b);
            }
        }
        misses.sort_unstable();
        misses.dedup();
    }

    /// Reads the hit blocks from flash into `buf`, checking each against
    /// its checksum; returns the (block, cbn) of those that do not verify.
    fn read_hits(
        &self,
        hits: &[(u64, Cbn)],
        expected: &[u32],
        off: u64,
        buf: &mut [u8],
    ) -> Result<Vec<(u64, Cbn)>> {
        let mut damaged = Vec::new();
        let mut done = 0;
        for run in runs(hits) {
            let at = run[0].0 * BLOCK;
            let len = run.len() as u64 * BLOCK;
            let dev_off = self.layout.block_offset(run[0].1);
            let crcs = &expected[done..done + run.len()];
            done += run.len();
            if at >= off && at + len <= off + buf.len() as u64 {
                let dst = &mut buf[(at - off) as usize..(at - off + len) as usize];
                self.device
                    .read_at(dst, dev_off)
                    .map_err(CacheError::device("read block"))?;
                damaged.extend(unverified(run, crcs, dst));
            } else {
                let mut tmp = vec![0u8; len as usize];
                self.device
                    .read_at(&mut tmp, dev_off)
                    .map_err(CacheError::device("read block"))?;
                damaged.extend(unverified(run, crcs, &tmp));
                copy_overlap(&tmp, at, buf, off);
            }
        }
        Ok(damaged)
    }

    /// Blocks read from flash that do not verify: a clean copy is dropped
    /// (returned, to be read from the image instead), a dirty one (the
    /// only copy) is kept unreadable and the read fails.
    pub(crate) fn drop_damaged(&self, id: u16, damaged: &[(u64, Cbn)]) -> Result<Vec<u64>> {
        let mut st = self.lock();
        let mut refetch = Vec::new();
        for &(b, cbn) in damaged {
            let key = line_key(id, b / LINE_BLOCKS);
            let slot = (b % LINE_BLOCKS) as usize;
            if st.index.block(key, slot) != Some(cbn) {
                // Replaced meanwhile: the read raced a write, as any read may.
                continue;
            }
            let dirty = st
                .index
                .get(key)
                .is_some_and(|l| l.dirty & (1 << slot) != 0);
            if dirty {
                self.lose_block(&mut st, key, slot);
                if !self.config.salvage {
                    return Err(unreadable_block(&st, id, b));
                }
                refetch.push(b);
                continue;
            }
            tracing::warn!(
                image = st
                    .catalog
                    .images
                    .get(id as usize)
                    .map_or("?", |r| r.name.as_str()),
                offset = b * BLOCK,
                "a clean cache block does not verify (the device damaged it): dropped, read from the image"
            );
            self.unmap_block(&mut st, key, slot);
            refetch.push(b);
        }
        Ok(refetch)
    }

    /// Reads missing blocks from the backend in runs; returns the whole
    /// blocks read, for admission. Runs separated by a few cached blocks
    /// are read with one backend request (its cached blocks' bytes are
    /// dropped): a backend round trip costs far more than the bytes.
    fn read_misses(
        &self,
        image: &ImageHandle,
        misses: &[u64],
        off: u64,
        buf: &mut [u8],
        counters: &crate::stats::DiskCounters,
    ) -> Result<Vec<(u64, Vec<u8>)>> {
        let mut out = Vec::new();
        for group in miss_groups(misses) {
            let (first, end) = (group[0].0, group[group.len() - 1].1);
            let at = first * BLOCK;
            let len = (end - first) * BLOCK;
            let mut data = vec![0u8; len as usize];
            let foreground = self.foreground_io();
            image
                .backend
                .read_at(&mut data, at)
                .map_err(CacheError::device("read backend"))?;
            drop(foreground);
            bump(&counters.backend_bytes_read, len);
            // Only the missing runs reach the guest's buffer: the cached
            // blocks between them were served from flash, and the backend
            // may hold older bytes for them.
            for &(s, e) in &group {
                let part = &data[((s - first) * BLOCK) as usize..((e - first) * BLOCK) as usize];
                copy_overlap(part, s * BLOCK, buf, off);
            }
            if let [(s, _)] = group[..] {
                // One run (the usual case): its buffer is the promotion's.
                out.push((s, data));
                continue;
            }
            for &(s, e) in &group {
                let part = &data[((s - first) * BLOCK) as usize..((e - first) * BLOCK) as usize];
                out.push((s, part.to_vec()));
            }
        }
        Ok(out)
    }

    /// Which of blocks `first..first + n` (a run read from the backend)
    /// the disk's policy admits, as runs `[start, end)`. A cache that
    /// deduplicates asks block by block with each block's checksum
    /// (`sums`), so a policy can key misses by content; other caches ask
    /// once for the run.
    fn admitted_runs(
        &self,
        policy: DiskPolicy,
        tag: IoTag,
        first: u64,
        n: u64,
        sums: &[Checksummed],
    ) -> Vec<(u64, u64)> {
        let miss = |first_block, blocks, content| crate::admission::ReadMiss {
            disk: tag.disk.0,
            first_block,
            blocks,
            sequential_threshold: policy.sequential_threshold,
            content,
        };
        let mut st = self.lock();
        let admission = st.admission.policy(policy.admission);
        if sums.is_empty() {
            return if admission.admits(&miss(first, n, None)) {
                vec![(first, first + n)]
            } else {
                Vec::new()
            };
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut sums = sums.iter().peekable();
        for b in first..first + n {
            let content = sums.next_if(|s| s.0 == b).map(|s| s.1);
            if !admission.admits(&miss(b, 1, content)) {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.1 == b => run.1 = b + 1,
                _ => runs.push((b, b + 1)),
            }
        }
        runs
    }

    /// A read's blocks could not be admitted: the read has its bytes from
    /// the image, so it succeeds; the failure is counted, and logged at
    /// the 1st, 2nd, 4th, 8th... time (a full device fails every one).
    fn promotion_failed(&self, counters: &DiskCounters, image: &str, e: &CacheError) {
        let n = counters.promotions_failed.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(
                image,
                failures = n,
                "caching a read failed ({e}); reads are served from the image meanwhile"
            );
        }
    }

    /// Admits blocks read from the backend, unless a write to them
    /// completed since the read started (its data would be newer). With
    /// dedup, a block whose bytes flash already holds shares that block.
    fn promote(
        &self,
        id: u16,
        tag: IoTag,
        policy: DiskPolicy,
        read_seq: u64,
        fetched: Vec<(u64, Vec<u8>)>,
    ) -> Result<()> {
        for (first, data) in fetched {
            let n = data.len() as u64 / BLOCK;
            let sums = if matches!(tag.class, IoClass::Metadata(_)) {
                Vec::new()
            } else {
                self.read_checksums(first, &data)
            };
            let table = tag.unit.is_some()
                && policy.cow == crate::config::CowMode::CowAware
                && matches!(tag.class, IoClass::Metadata(_));
            let admitted = if table {
                vec![(first, first + n)]
            } else {
                self.admitted_runs(policy, tag, first, n, &sums)
            };
            // Sharing a block flash holds writes nothing, so it needs no
            // admission.
            let copies = self.dedup_copies(tag.disk, first * BLOCK, &[&data], &sums, &[])?;
            if admitted.is_empty() && copies.is_empty() {
                continue;
            }
            // A write to these blocks still on its way to the backend is
            // not in the history yet, and the backend bytes this read got
            // may predate it: wait for it, so the staleness check sees it.
            // (Guest reads and writes of a block never overlap, but a
            // metadata journal's checkpoint writes guest data outside the
            // guest's range locks.)
            let _range = self
                .ranges
                .lock(&[(id, first * BLOCK, (first + n) * BLOCK)]);
            let shared = self.promote_shared(id, tag, read_seq, &copies);
            for (start, end) in admitted {
                let mut at = start;
                for c in shared
                    .iter()
                    .copied()
                    .filter(|c| (start..end).contains(c))
                    .chain([end])
                {
                    if c > at {
                        let (from, to) = ((at - first) as usize, (c - first) as usize);
                        let part = &data[from * BLOCK as usize..to * BLOCK as usize];
                        let known = sums.get(from..to).unwrap_or_default();
                        self.promote_run(id, tag, read_seq, at, part, known)?;
                    }
                    at = c + 1;
                }
            }
            self.remember_signatures(id, &sums);
        }
        Ok(())
    }

    /// Whether block `block` of image `id` must not be promoted: a write
    /// to it completed since the read (`read_seq`) or it is cached already.
    fn promotion_stale(st: &State, id: u16, read_seq: u64, block: u64) -> bool {
        st.history
            .written_since(read_seq, id, block * BLOCK, (block + 1) * BLOCK)
            || st
                .index
                .block(
                    line_key(id, block / LINE_BLOCKS),
                    (block % LINE_BLOCKS) as usize,
                )
                .is_some()
    }

    /// A promoted block mapped clean: journaled once its backend is synced.
    fn journal_promoted(st: &mut State, id: u16, block: u64, cbn: Cbn, guest: u64, crc: u32) {
        st.ledger.clean_copy_needs_sync(id);
        st.journal.push(&Entry::Map {
            key: line_key(id, block / LINE_BLOCKS),
            slot: (block % LINE_BLOCKS) as u8,
            cbn,
            guest,
            dirty: false,
            crc,
        });
    }

    /// Promotes blocks whose bytes flash already holds by sharing them;
    /// returns the blocks done that way (or not to be promoted at all), in
    /// order. One whose copy moved meanwhile is left to be written.
    fn promote_shared(
        &self,
        id: u16,
        tag: IoTag,
        read_seq: u64,
        copies: &[SharedCopy],
    ) -> Vec<u64> {
        if copies.is_empty() {
            return Vec::new();
        }
        let guest = tag.guest_cluster.map_or(u64::MAX, u64::from);
        let mut done = Vec::new();
        let mut handled = Vec::new();
        let mut st = self.lock();
        for c in copies {
            if Self::promotion_stale(&st, id, read_seq, c.block) {
                handled.push(c.block);
            } else if self.share_copy(&mut st, id, c, guest, false) {
                Self::journal_promoted(&mut st, id, c.block, c.cbn, guest, c.crc);
                done.push(*c);
                handled.push(c.block);
            }
        }
        drop(st);
        self.count_shared(tag.disk, &done);
        handled
    }

    /// Admits `data`, blocks from `first` of image `id`, into the
    /// promotion stream; `known`: the blocks' checksums when dedup has
    /// computed them already (empty otherwise).
    fn promote_run(
        &self,
        id: u16,
        tag: IoTag,
        read_seq: u64,
        first: u64,
        data: &[u8],
        known: &[Checksummed],
    ) -> Result<()> {
        let counters = self.stats.disk(tag.disk);
        let n = data.len() as u64 / BLOCK;
        let runs = {
            let mut st = self.lock();
            self.allocate(&mut st, Stream::Promote, tag.disk, n as u32)?
        };
        let mut done = 0u64;
        let mut written = Vec::new();
        let mut failed = None;
        for &(cbn, k) in &runs {
            let part = &data[(done * BLOCK) as usize..((done + u64::from(k)) * BLOCK) as usize];
            if let Err(e) = self.device.write_at(part, self.layout.block_offset(cbn)) {
                failed = Some(e);
                break;
            }
            written.push((first + done, cbn, k));
            done += u64::from(k);
        }
        bump(&counters.flash_bytes_written, done * BLOCK);
        if matches!(tag.class, IoClass::Metadata(_)) {
            bump(&counters.meta_flash_bytes_written, done * BLOCK);
        }
        // Checksums before the lock: the state lock is held for the
        // index only.
        let crcs: Vec<u32> =
            if known.len() as u64 == n && known.first().is_some_and(|&(b, _)| b == first) {
                known.iter().map(|&(_, crc)| crc).collect()
            } else {
                data[..(done * BLOCK) as usize]
                    .chunks(BLOCK as usize)
                    .map(crc32c::crc32c)
                    .collect()
            };
        let mut st = self.lock();
        if let Some(e) = failed {
            self.give_back(&mut st, &runs);
            return Err(CacheError::device("write block")(e));
        }
        self.settle(&mut st, &runs);
        let guest = tag.guest_cluster.map_or(u64::MAX, u64::from);
        for (block0, cbn0, k) in written {
            for i in 0..u64::from(k) {
                let block = block0 + i;
                let cbn = cbn0 + i as u32;
                if Self::promotion_stale(&st, id, read_seq, block) {
                    st.regions.release_block(cbn);
                    continue;
                }
                let crc = crcs[(block - first) as usize];
                st.map_block(
                    line_key(id, block / LINE_BLOCKS),
                    guest,
                    (block % LINE_BLOCKS) as usize,
                    cbn,
                    false,
                    crc,
                );
                Self::journal_promoted(&mut st, id, block, cbn, guest, crc);
            }
        }
        // Only now that the blocks are mapped: before, their regions
        // would look empty to the eviction.
        self.keep_reserve(&mut st)?;
        self.journal_buffer_check(&mut st)
    }
}

#[cfg(test)]
mod tests {
    use super::miss_groups;

    #[test]
    fn miss_runs_close_together_are_read_together() {
        assert!(miss_groups(&[]).is_empty());
        assert_eq!(miss_groups(&[3, 4, 5]), vec![vec![(3, 6)]]);
        // A gap of 16 cached blocks joins; 17 splits.
        assert_eq!(
            miss_groups(&[0, 1, 18, 19, 37]),
            vec![vec![(0, 2), (18, 20)], vec![(37, 38)]]
        );
    }
}
