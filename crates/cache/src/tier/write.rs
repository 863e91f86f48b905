//! Writes and discards. Write-back appends whole blocks to the write
//! stream (partial blocks are completed from their current content first)
//! and records them dirty; write-through writes the backend and keeps a
//! clean copy; write-around writes the backend and drops cached copies.
//! A block that is dirty in flash is never bypassed: the backend does not
//! hold its current content, so a write over it also goes over it in flash.
//! Where a write goes is `routing`'s decision; writes to the backend are
//! `through`'s.

use super::metastore::{overlay, table_sectors};
use super::sharing::SharedCopy;
use super::signatures::{Checksummed, remember_placed};
use super::{FlashCache, State};
use crate::admission::Run;
use crate::error::{CacheError, Result};
use crate::index::{Cbn, line_key};
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::region::Stream;
use crate::routing::{Keep, Route, WriteClass, route};
use crate::stats::bump;
use vdcache_contract::{ImageHandle, IoClass, IoTag, WriteSegment};

/// The bytes of a block range: old content around the written segments.
pub(super) struct Blocks<'a> {
    pub(super) pieces: Vec<&'a [u8]>,
}

impl<'a> Blocks<'a> {
    /// Slices covering bytes `[start, end)` of the range.
    pub(super) fn slices(&self, start: usize, end: usize) -> Vec<&'a [u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        for p in &self.pieces {
            let (ps, pe) = (at, at + p.len());
            let (s, e) = (start.max(ps), end.min(pe));
            if s < e {
                out.push(&p[s - ps..e - ps]);
            }
            at = pe;
        }
        out
    }

    /// Whether bytes `[start, end)` of the range are `bytes`.
    pub(super) fn equals(&self, start: usize, end: usize, bytes: &[u8]) -> bool {
        let mut at = 0;
        bytes.len() == end - start
            && self.slices(start, end).iter().all(|piece| {
                let eq = bytes[at..at + piece.len()] == **piece;
                at += piece.len();
                eq
            })
    }

    pub(super) fn crc(&self, start: usize, end: usize) -> u32 {
        self.slices(start, end)
            .iter()
            .fold(0, |c, s| crc32c::crc32c_append(c, s))
    }
}

/// The guest's sequential write run a write of guest data continues
/// (none for a write without guest data).
fn observe_write_run(
    st: &mut State,
    tag: IoTag,
    segments: &[WriteSegment<'_>],
    len: u64,
) -> Option<Run> {
    let mut clusters = segments
        .iter()
        .filter(|s| s.tag.class == IoClass::GuestData)
        .filter_map(|s| s.tag.guest_cluster.map(u64::from));
    let first = clusters.next()?;
    let (low, high) = clusters.fold((first, first), |(l, h), c| (l.min(c), h.max(c)));
    Some(
        st.write_streams
            .observe(tag.disk.0, low, high - low + 1, len),
    )
}

/// Whether a write's disk is a guest's journal device, or has one.
#[derive(Debug, Clone, Copy)]
struct JournalRole {
    is_journal: bool,
    /// And the write carries guest data that may equal a journal copy.
    has_journal: bool,
}

/// What a write is made of, for [`route`].
fn write_class(
    off: u64,
    len: u64,
    segments: &[WriteSegment<'_>],
    mostly_cached: bool,
) -> WriteClass {
    WriteClass {
        filler_only: segments.iter().all(|s| s.tag.class == IoClass::CowFill),
        table_sectors: table_sectors(off, len, segments),
        mostly_cached,
    }
}

/// Whether at least half the blocks of `[off, off + len)` of image `id`
/// are cached (clean or dirty).
fn mostly_cached(st: &State, id: u16, off: u64, len: u64) -> bool {
    let (first, end) = (off / BLOCK, (off + len).div_ceil(BLOCK));
    let cached = (first..end)
        .filter(|&b| {
            st.index
                .block(line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as usize)
                .is_some()
        })
        .count() as u64;
    2 * cached >= end - first
}

/// The guest cluster each block of `[first_block, first_block + n)` serves:
/// that of the segment holding the block's middle byte (or the nearest).
pub(super) fn block_guests(
    off: u64,
    segments: &[WriteSegment<'_>],
    first_block: u64,
    n: u64,
) -> Vec<u64> {
    let mut spans: Vec<(u64, u64, u64)> = Vec::with_capacity(segments.len());
    let mut at = off;
    for s in segments {
        let end = at + s.data.len() as u64;
        spans.push((at, end, s.tag.guest_cluster.map_or(u64::MAX, u64::from)));
        at = end;
    }
    (first_block..first_block + n)
        .map(|b| {
            let mid = b * BLOCK + BLOCK / 2;
            spans
                .iter()
                .min_by_key(|&&(s, e, _)| {
                    if mid < s {
                        s - mid
                    } else {
                        mid.saturating_sub(e - 1)
                    }
                })
                .map_or(u64::MAX, |&(_, _, g)| g)
        })
        .collect()
}

/// The parts of `segments` (starting at byte `off`) inside `[start, end)`.
pub(super) fn sub_segments<'a>(
    off: u64,
    segments: &[WriteSegment<'a>],
    start: u64,
    end: u64,
) -> Vec<WriteSegment<'a>> {
    let mut out = Vec::new();
    let mut at = off;
    for s in segments {
        let s_end = at + s.data.len() as u64;
        let (a, b) = (start.max(at), end.min(s_end));
        if a < b {
            out.push(WriteSegment {
                data: &s.data[(a - at) as usize..(b - at) as usize],
                tag: s.tag,
            });
        }
        at = s_end;
    }
    out
}

/// The blocks a write's guest data touches.
fn guest_blocks(off: u64, segments: &[WriteSegment<'_>]) -> Vec<u64> {
    let mut blocks: Vec<u64> = Vec::new();
    let mut at = off;
    for s in segments {
        let end = at + s.data.len() as u64;
        if s.tag.class == IoClass::GuestData && end > at {
            blocks.extend(at / BLOCK..end.div_ceil(BLOCK));
        }
        at = end;
    }
    blocks.dedup();
    blocks
}

/// Counts the guest's blocks of a write that flash already held.
fn count_write_hits(st: &State, id: u16, blocks: &[u64], counters: &crate::stats::DiskCounters) {
    if blocks.is_empty() {
        return;
    }
    let hits = blocks
        .iter()
        .filter(|&&b| {
            st.index
                .block(line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as usize)
                .is_some()
        })
        .count() as u64;
    bump(&counters.write_hit_blocks, hits);
    bump(&counters.write_miss_blocks, blocks.len() as u64 - hits);
}

fn total_len(segments: &[WriteSegment<'_>]) -> u64 {
    segments.iter().map(|s| s.data.len() as u64).sum()
}

impl FlashCache {
    pub(crate) fn write_blocks(
        &self,
        image: &ImageHandle,
        off: u64,
        segments: &[WriteSegment<'_>],
    ) -> Result<()> {
        let len = total_len(segments);
        let Some(first_seg) = segments.first() else {
            return Ok(());
        };
        if len == 0 {
            return Ok(());
        }
        let tag = first_seg.tag;
        let id = self.image_id(image, tag.disk)?;
        let counters = self.stats.disk(tag.disk);
        let guest_bytes: u64 = segments
            .iter()
            .filter(|s| s.tag.class == IoClass::GuestData)
            .map(|s| s.data.len() as u64)
            .sum();
        let guest_blocks = if guest_bytes > 0 {
            bump(&counters.guest_writes, 1);
            bump(&counters.guest_write_bytes, guest_bytes);
            guest_blocks(off, segments)
        } else {
            Vec::new()
        };
        // One lock for the hit count, the policy, the run detector and the
        // journal links: every write takes it.
        let (policy, run, journal, cached) = {
            let mut st = self.lock();
            count_write_hits(&st, id, &guest_blocks, &counters);
            let policy = st.catalog.policy(tag.disk, self.config.default_policy);
            let run = if policy.sequential_write_cutoff > 0 {
                observe_write_run(&mut st, tag, segments, len)
            } else {
                None
            };
            // Only a write that would bypass flash needs the count.
            let cached = crate::routing::long_run(policy, run) && mostly_cached(&st, id, off, len);
            let journal = &st.guest_journals;
            let role = JournalRole {
                is_journal: journal.is_journal(tag.disk),
                has_journal: guest_bytes > 0 && journal.has_journal(tag.disk),
            };
            (policy, run, role, cached)
        };
        let route = route(policy, write_class(off, len, segments, cached), run);
        // Blocks entering flash may share a block that holds their bytes.
        let enters_flash = matches!(
            route,
            Route::WriteBack { sectors: false } | Route::WriteThrough(_)
        );
        let mut copies = if enters_flash && journal.has_journal {
            self.journal_copies(tag.disk, off, segments)?
        } else {
            Vec::new()
        };
        let sums = if enters_flash && self.dedups() {
            Self::write_checksums(off, segments)
        } else {
            Vec::new()
        };
        let mut inner = Vec::new();
        if !sums.is_empty() {
            let taken: Vec<u64> = copies.iter().map(|c| c.block).collect();
            let pieces: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
            copies.extend(self.dedup_copies(tag.disk, off, &pieces, &sums, &taken)?);
            copies.sort_unstable_by_key(|c| c.block);
            if route == (Route::WriteBack { sectors: false }) {
                inner = Self::inner_duplicates(off, &pieces, &sums, &copies);
            }
        }
        self.write_routed(image, id, off, segments, route, &copies, &inner, &sums)?;
        // A plain write-back remembers the signatures of what it placed
        // under its own lock; other routes' blocks are looked up here.
        if !copies.is_empty() || !inner.is_empty() || route != (Route::WriteBack { sectors: false })
        {
            self.remember_signatures(id, &sums);
        }
        if journal.is_journal {
            self.observe_journal_write(tag.disk, id, off, segments);
        }
        Ok(())
    }

    /// Writes where `route` says; `copies`: blocks whose bytes a cache
    /// block already holds (a journal copy or a dedup match, see `sharing`);
    /// `inner`: blocks equal to an earlier block of the write (see
    /// `inner_duplicates`); `sums`: the checksums of its whole data blocks,
    /// which a plain write-back remembers as it places them.
    #[allow(clippy::too_many_arguments)]
    fn write_routed(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        route: Route,
        copies: &[SharedCopy],
        inner: &[(u64, u64, u32)],
        sums: &[Checksummed],
    ) -> Result<()> {
        let len = total_len(segments);
        let tag = segments[0].tag;
        match route {
            Route::WriteBack { sectors } => {
                if sectors && self.write_sectors(id, off, segments, tag)? {
                    return Ok(());
                }
                let done = if copies.is_empty() && inner.is_empty() {
                    self.write_back_chunked(image, id, off, segments, tag, sums)?
                } else {
                    self.write_back_sharing(image, id, off, segments, copies, inner)?
                };
                if done {
                    return Ok(());
                }
                // No room in flash: fall back to writing through.
                self.write_through(image, id, off, len, segments, tag, Keep::Nothing)
            }
            Route::Bypass | Route::WriteAround => {
                self.write_through(image, id, off, len, segments, tag, Keep::Nothing)
            }
            Route::WriteThrough(keep) => {
                self.write_through_sharing(image, id, off, len, segments, tag, keep, copies)
            }
        }
    }

    /// The current content of one block: from flash when cached, else from
    /// the backend.
    fn block_content(
        &self,
        image: &ImageHandle,
        id: u16,
        block: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let key = line_key(id, block / LINE_BLOCKS);
        let slot = (block % LINE_BLOCKS) as usize;
        let (cached, sectors) = {
            let mut st = self.lock();
            if super::read::is_unreadable(&st, id, block) {
                return Err(super::read::unreadable_block(&st, id, block));
            }
            let c = st.index.block(key, slot);
            if let Some(cbn) = c {
                let r = st.regions.region_of(cbn);
                st.regions.pin(r);
            }
            let expected = c.and_then(|cbn| st.integrity.crcs.get(cbn));
            (
                c.zip(expected),
                self.meta_snapshot(&st, id, block * BLOCK, BLOCK),
            )
        };
        let result = match cached {
            Some((cbn, _)) => self
                .device
                .read_at(out, self.layout.block_offset(cbn))
                .map_err(CacheError::device("read block")),
            None => image
                .backend
                .read_at(out, block * BLOCK)
                .map_err(CacheError::device("read backend")),
        };
        if let Some((cbn, _)) = cached {
            let mut st = self.lock();
            let r = st.regions.region_of(cbn);
            st.regions.unpin(r);
        }
        result?;
        if let Some((cbn, crc)) = cached
            && crc32c::crc32c(out) != crc
        {
            // The device damaged the copy: a clean one is dropped and the
            // image read instead; a dirty one fails.
            self.drop_damaged(id, &[(block, cbn)])?;
            return self.block_content(image, id, block, out);
        }
        overlay(&sectors, block * BLOCK, out);
        Ok(())
    }

    /// Old content of a block a write covers in part; none (zeros) for a
    /// partially valid block the guest has not written yet, so the edge
    /// of an unaligned write into a fresh delta cluster reads nothing.
    fn edge_content(&self, image: &ImageHandle, id: u16, block: u64, out: &mut [u8]) -> Result<()> {
        if Self::holds_nothing(&self.lock(), id, block) {
            out.fill(0);
            return Ok(());
        }
        self.block_content(image, id, block, out)
    }

    /// Old content of the partial head and tail blocks of a write.
    fn edges(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        len: u64,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let first = off / BLOCK;
        let last = (off + len - 1) / BLOCK;
        let end = off + len;
        let mut head = Vec::new();
        let mut tail = Vec::new();
        if !off.is_multiple_of(BLOCK) || (first == last && !end.is_multiple_of(BLOCK)) {
            let mut b = vec![0u8; BLOCK as usize];
            self.edge_content(image, id, first, &mut b)?;
            if first == last {
                tail = b[(end % BLOCK) as usize..].to_vec();
                if end.is_multiple_of(BLOCK) {
                    tail.clear();
                }
            }
            b.truncate((off % BLOCK) as usize);
            head = b;
        }
        if !end.is_multiple_of(BLOCK) && first != last {
            let mut b = vec![0u8; BLOCK as usize];
            self.edge_content(image, id, last, &mut b)?;
            tail = b[(end % BLOCK) as usize..].to_vec();
        }
        Ok((head, tail))
    }

    /// Write-back in pieces of at most the free-region reserve: each piece
    /// frees the old copies it supersedes before the next needs room, so a
    /// large overwrite of cached blocks evicts nothing it does not replace.
    /// Returns false (nothing done) when flash has no room for the first
    /// piece; a later piece without room is written through.
    pub(super) fn write_back_chunked(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        tag: IoTag,
        sums: &[Checksummed],
    ) -> Result<bool> {
        let piece = (self.config.reserve_regions.max(1) as u64) * self.layout.region_bytes;
        let end = off + total_len(segments);
        let mut at = off;
        while at < end {
            let next = ((at / piece + 1) * piece).min(end);
            let part = sub_segments(off, segments, at, next);
            if !self.write_back(image, id, at, next - at, &part, tag, sums)? {
                if at == off {
                    return Ok(false);
                }
                self.write_through(image, id, at, next - at, &part, tag, Keep::Nothing)?;
            }
            at = next;
        }
        Ok(true)
    }

    /// Write-back: whole blocks appended to the write stream, recorded
    /// dirty, and the checksums among `sums` of those placed remembered.
    /// Returns false (nothing done) when flash has no room.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_back(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        len: u64,
        segments: &[WriteSegment<'_>],
        tag: IoTag,
        sums: &[Checksummed],
    ) -> Result<bool> {
        let (head, tail) = self.edges(image, id, off, len)?;
        let mut pieces: Vec<&[u8]> = vec![&head];
        pieces.extend(segments.iter().map(|s| s.data));
        pieces.push(&tail);
        let blocks = Blocks { pieces };
        let first = off / BLOCK;
        let n = (head.len() as u64 + len + tail.len() as u64) / BLOCK;
        let runs = {
            let mut st = self.lock();
            let runs = self.allocate(&mut st, Stream::Write, tag.disk, n as u32)?;
            let got: u64 = runs.iter().map(|r| u64::from(r.1)).sum();
            if got < n {
                self.give_back(&mut st, &runs);
                return Ok(false);
            }
            runs
        };
        // Dedup checksummed the write's whole blocks already.
        let crcs: Vec<u32> = (0..n as usize)
            .map(
                |i| match sums.binary_search_by_key(&(first + i as u64), |s| s.0) {
                    Ok(k) => sums[k].1,
                    Err(_) => blocks.crc(i * BLOCK as usize, (i + 1) * BLOCK as usize),
                },
            )
            .collect();
        let guests = block_guests(off, segments, first, n);
        if self.config.test_index_before_data {
            let mut st = self.lock();
            self.record_dirty(&mut st, id, first, &runs, &crcs, &guests);
            self.validate_written(&mut st, id, off, len);
            self.commit(&mut st)?;
        }
        let mut done = 0usize;
        for &(cbn, k) in &runs {
            let end = done + k as usize;
            let slices = blocks.slices(done * BLOCK as usize, end * BLOCK as usize);
            if let Err(e) = self
                .device
                .write_vectored_at(&slices, self.layout.block_offset(cbn))
            {
                let mut st = self.lock();
                self.give_back(&mut st, &runs);
                return Err(CacheError::device("write block")(e));
            }
            done = end;
        }
        let counters = self.stats.disk(tag.disk);
        bump(&counters.flash_bytes_written, n * BLOCK);
        if matches!(tag.class, IoClass::Metadata(_)) {
            bump(&counters.meta_flash_bytes_written, n * BLOCK);
        }
        let mut st = self.lock();
        if !self.config.test_index_before_data {
            self.record_dirty(&mut st, id, first, &runs, &crcs, &guests);
            // Only now are the written sectors valid: in the journal the
            // new bitmaps must follow the records of the data, or a log cut
            // between them would leave sectors marked valid that hold
            // nothing.
            self.validate_written(&mut st, id, off, len);
        }
        remember_placed(&mut st, first, &runs, sums);
        self.settle(&mut st, &runs);
        st.history.note(id, off, off + len);
        self.keep_reserve(&mut st)?;
        self.journal_buffer_check(&mut st)?;
        let dirty =
            st.index.writeback_dirty_blocks() as f64 / self.layout.cacheable_blocks() as f64;
        if dirty > self.config.high_watermark {
            drop(st);
            if self.config.inline_background {
                self.writeback_inline()?;
            } else {
                self.wake.notify();
                // Only guest data: a metadata write may hold the COW
                // layer's table lock, which every guest request needs.
                let pause = super::writeback::throttle(dirty, self.config.high_watermark, n)
                    .filter(|_| tag.class == IoClass::GuestData);
                if let Some(pause) = pause {
                    std::thread::sleep(pause);
                }
            }
        }
        Ok(true)
    }

    /// Maps freshly written blocks dirty and journals them; `guests`
    /// holds the guest cluster each block serves.
    pub(super) fn record_dirty(
        &self,
        st: &mut State,
        id: u16,
        first: u64,
        runs: &[(Cbn, u32)],
        crcs: &[u32],
        guests: &[u64],
    ) {
        let blocks: u64 = runs.iter().map(|r| u64::from(r.1)).sum();
        // The blocks absorbed the sectors (edges were read through them).
        self.drop_sectors(st, id, first * BLOCK, blocks * BLOCK);
        let mut i = 0usize;
        for &(cbn0, k) in runs {
            for j in 0..k {
                let block = first + i as u64;
                let cbn = cbn0 + j;
                let key = line_key(id, block / LINE_BLOCKS);
                let slot = (block % LINE_BLOCKS) as usize;
                let guest = guests[i];
                if let Some((old, r)) = st.map_block(key, guest, slot, cbn, true, crcs[i])
                    && st.index.release(old, r)
                {
                    st.regions.release_block(old);
                }
                st.dirty.lines.insert(key);
                st.journal.push(&Entry::Map {
                    key,
                    slot: slot as u8,
                    cbn,
                    guest,
                    dirty: true,
                    crc: crcs[i],
                });
                if let Some(rec) = st.catalog.images.get_mut(id as usize) {
                    rec.end = rec.end.max((block + 1) * BLOCK);
                }
                st.ledger.uncommitted_dirty = true;
                i += 1;
            }
        }
    }

    /// Drops cached blocks wholly inside the range and passes the discard on.
    pub(crate) fn discard_blocks(
        &self,
        image: &ImageHandle,
        off: u64,
        len: u64,
        tag: IoTag,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let id = self.image_id(image, tag.disk)?;
        let first = off.div_ceil(BLOCK);
        let end = (off + len) / BLOCK;
        let _range = self.ranges.lock(&[(id, off, off + len)]);
        {
            let mut st = self.lock();
            for b in first..end {
                self.unmap_block(
                    &mut st,
                    line_key(id, b / LINE_BLOCKS),
                    (b % LINE_BLOCKS) as usize,
                );
            }
            st.history.note(id, off, off + len);
            // Sectors of discarded metadata must not come back over what
            // the space holds next.
            if self.drop_sectors(&mut st, id, off, len) {
                self.commit_before_bypass(&mut st)?;
            }
        }
        // Advisory: a store that cannot discard keeps its bytes.
        let _ = image.backend.discard(off, len);
        Ok(())
    }
}
