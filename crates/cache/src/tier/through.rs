//! Writes to the backend (write-through, write-around, bypass, and the
//! COW layer's durable header writes): the backend takes the bytes; flash
//! keeps clean copies of whole blocks when the route says so, dirty blocks
//! are updated in flash (their only current copies), and clean copies the
//! write supersedes are forgotten durably before it reaches the backend.
//!
//! It owns the ordering of a write to the backend against the journal and
//! the ledger; it does not decide whether a write goes to the backend
//! (`routing`) nor write dirty data back (`writeback`).

use super::commit::Unsynced;
use super::ledger::UnjournaledClean;
use super::sharing::SharedCopy;
use super::write::{Blocks, block_guests, sub_segments};
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::index::{Cbn, line_key};
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE_BLOCKS};
use crate::region::Stream;
use crate::routing::Keep;
use crate::stats::bump;
use std::time::{Duration, Instant};
use vdcache_contract::WriteSegment;
use vdcache_contract::{ImageHandle, IoClass, IoTag, MetaTable};
use vdcache_qcow2::HostOffset;

/// How long a write over a dirty block waits for flash room before it
/// fails (room short only while the write-back thread copies a batch).
const ROOM_WAIT: Duration = Duration::from_secs(60);

/// Drops the record of a clean copy held out of the journal, if the block
/// is still mapped to it; true if it was.
fn forget_unjournaled(st: &mut State, key: u64, slot: usize) -> bool {
    let current = st.index.block(key, slot);
    st.ledger.forget_clean((key, slot as u8), current)
}

/// Ascending block numbers as runs `[first, end)` of consecutive ones.
fn consecutive_runs(blocks: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some(run) if run.1 == b => run.1 = b + 1,
            _ => runs.push((b, b + 1)),
        }
    }
    runs
}

/// Byte ranges of a write whose blocks may be kept in flash.
fn cacheable_ranges(off: u64, segments: &[WriteSegment<'_>], keep: Keep) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut at = off;
    for s in segments {
        let end = at + s.data.len() as u64;
        let wanted = match keep {
            Keep::Nothing => false,
            Keep::Everything => true,
            Keep::NotFiller => match s.tag.class {
                IoClass::CowFill | IoClass::Metadata(MetaTable::Journal) => false,
                IoClass::Metadata(_) => s.data.iter().any(|&b| b != 0),
                IoClass::GuestData | IoClass::Reclaim => true,
            },
        };
        if wanted {
            match out.last_mut() {
                Some((_, e)) if *e == at => *e = end,
                _ => out.push((at, end)),
            }
        }
        at = end;
    }
    out
}

impl FlashCache {
    /// Write-through and write-around: the backend takes the write; flash
    /// keeps a clean copy of whole blocks (write-through) or drops them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_through(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        len: u64,
        segments: &[WriteSegment<'_>],
        tag: IoTag,
        keep_copy: Keep,
    ) -> Result<()> {
        self.write_through_sharing(image, id, off, len, segments, tag, keep_copy, &[])
    }

    /// [`Self::write_through`] where the clean copies of `shared` blocks
    /// are their journal copies' cache blocks (see `logical`), not new ones.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_through_sharing(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        len: u64,
        segments: &[WriteSegment<'_>],
        tag: IoTag,
        keep_copy: Keep,
        shared: &[SharedCopy],
    ) -> Result<()> {
        let first = off / BLOCK;
        let last = (off + len - 1) / BLOCK;
        let _range = self.ranges.lock(&[(id, first * BLOCK, (last + 1) * BLOCK)]);
        // Blocks dirty in flash are the only current copies: the write
        // goes over them in flash too, and they stay mapped. (Dropping one
        // before the backend write is durable would let a crash bring back
        // what the backend held before it was flushed.)
        let dirty: Vec<u64> = {
            let st = self.lock();
            (first..=last)
                .filter(|&b| {
                    st.index
                        .get(line_key(id, b / LINE_BLOCKS))
                        .is_some_and(|l| l.dirty & (1 << (b % LINE_BLOCKS)) != 0)
                })
                .collect()
        };
        // Clean flash copies the backend write supersedes are forgotten
        // durably first: after a crash the backend may hold the new bytes,
        // and a stale clean copy must never be served instead.
        self.forget_superseded(id, off, segments, first..=last, &dirty)?;
        let bufs: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
        let foreground = self.foreground_io();
        image
            .backend
            .write_vectored_at(&bufs, off)
            .map_err(CacheError::store("write", &*image.backend))?;
        drop(foreground);
        self.clear_lost(id, off, len);
        bump(&self.stats.disk(tag.disk).backend_bytes_written, len);
        let cached = cacheable_ranges(off, segments, keep_copy);
        let whole: Vec<u64> = (first..=last)
            .filter(|&b| {
                dirty.binary_search(&b).is_err()
                    && cached
                        .iter()
                        .any(|&(s, e)| b * BLOCK >= s && (b + 1) * BLOCK <= e)
            })
            .collect();
        let mark = {
            let mut st = self.lock();
            let entries = st.journal.pushed();
            self.validate_written(&mut st, id, off, len);
            let described = st.journal.pushed() != entries;
            st.note_write_through(id, off, off + len, described)
        };
        for (b0, b1) in consecutive_runs(&dirty) {
            let (s, e) = ((b0 * BLOCK).max(off), (b1 * BLOCK).min(off + len));
            let part = sub_segments(off, segments, s, e);
            self.update_dirty(image, id, s, e - s, &part, tag)?;
        }
        if !whole.is_empty() {
            self.keep_clean_copies(id, off, segments, &whole, tag, mark, shared)?;
        }
        Ok(())
    }

    /// Writes bytes to the image's store and syncs it, keeping flash
    /// copies equal to them (a dirty block stays dirty with the new bytes,
    /// clean copies are dropped): header bits for readers without the
    /// cache.
    pub(crate) fn write_to_store(
        &self,
        image: &ImageHandle,
        writes: &[(HostOffset, &[u8])],
        tag: IoTag,
    ) -> Result<()> {
        let id = self.image_id(image, tag.disk)?;
        for &(off, data) in writes.iter().filter(|w| !w.1.is_empty()) {
            let segment = [WriteSegment { data, tag }];
            let len = data.len() as u64;
            self.write_through(image, id, off.0, len, &segment, tag, Keep::Nothing)?;
        }
        self.sync_image(id)
    }

    /// Writes over blocks dirty in flash, in flash (their only current
    /// copies). Flash may have no room for a moment: every full region
    /// pinned by the write-back thread's batch or holding a newer copy of a
    /// block it copies (`State::copying`). Both end without waiting for
    /// this write's range, so the write waits for them (bounded) instead
    /// of failing the guest's request.
    fn update_dirty(
        &self,
        image: &ImageHandle,
        id: u16,
        off: u64,
        len: u64,
        segments: &[WriteSegment<'_>],
        tag: IoTag,
    ) -> Result<()> {
        let deadline = Instant::now() + ROOM_WAIT;
        while !self.write_back(image, id, off, len, segments, tag, &[])? {
            if Instant::now() >= deadline {
                return Err(CacheError::Config(format!(
                    "no flash space to update a dirty block within {ROOM_WAIT:?}"
                )));
            }
            let st = self.lock();
            drop(self.progress.wait_timeout(st, Duration::from_millis(10)));
        }
        Ok(())
    }

    /// Stores clean copies of whole written blocks (write-through), to be
    /// journaled once the backend sync through `mark` ran. Blocks in
    /// `shared` take their journal copy's cache block instead of a new one
    /// (written anew if the copy moved meanwhile).
    #[allow(clippy::too_many_arguments)]
    fn keep_clean_copies(
        &self,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        whole: &[u64],
        tag: IoTag,
        mark: u64,
        shared: &[SharedCopy],
    ) -> Result<()> {
        let blocks = Blocks {
            pieces: segments.iter().map(|s| s.data).collect(),
        };
        let first_block = whole.first().copied().unwrap_or(0);
        let span = whole.last().map_or(0, |l| l - first_block + 1);
        let guests = block_guests(off, segments, first_block, span);
        let unshared: Vec<u64> = {
            let mut st = self.lock();
            let mut rest = Vec::with_capacity(whole.len());
            let mut done = Vec::new();
            for &b in whole {
                let guest = guests[(b - first_block) as usize];
                match shared.iter().find(|c| c.block == b) {
                    Some(c) if self.share_copy(&mut st, id, c, guest, false) => {
                        Self::hold_clean_copy(&mut st, id, b, c.cbn, guest, c.crc, mark);
                        done.push(*c);
                    }
                    _ => rest.push(b),
                }
            }
            drop(st);
            self.count_shared(tag.disk, &done);
            rest
        };
        let whole = &unshared[..];
        if whole.is_empty() {
            return Ok(());
        }
        let runs = {
            let mut st = self.lock();
            self.allocate(&mut st, Stream::Write, tag.disk, whole.len() as u32)?
        };
        let mut placed: Vec<(u64, Cbn)> = Vec::new();
        let mut it = whole.iter();
        for &(cbn0, k) in &runs {
            for j in 0..k {
                if let Some(&b) = it.next() {
                    placed.push((b, cbn0 + j));
                }
            }
        }
        let mut written = Vec::new();
        for &(b, cbn) in &placed {
            let start = (b * BLOCK - off) as usize;
            let slices = blocks.slices(start, start + BLOCK as usize);
            match self
                .device
                .write_vectored_at(&slices, self.layout.block_offset(cbn))
            {
                Ok(()) => written.push((b, cbn, blocks.crc(start, start + BLOCK as usize))),
                Err(_) => break,
            }
        }
        let counters = self.stats.disk(tag.disk);
        bump(&counters.flash_bytes_written, written.len() as u64 * BLOCK);
        if matches!(tag.class, IoClass::Metadata(_)) {
            bump(
                &counters.meta_flash_bytes_written,
                written.len() as u64 * BLOCK,
            );
        }
        let mut st = self.lock();
        self.settle(&mut st, &runs);
        for &(b, cbn) in &placed {
            let Some(&(_, _, crc)) = written.iter().find(|w| w.1 == cbn) else {
                st.regions.release_block(cbn);
                continue;
            };
            let key = line_key(id, b / LINE_BLOCKS);
            let slot = (b % LINE_BLOCKS) as usize;
            let guest = guests[(b - first_block) as usize];
            if let Some((old, r)) = st.map_block(key, guest, slot, cbn, false, crc)
                && st.index.release(old, r)
            {
                st.regions.release_block(old);
            }
            if st.index.get(key).is_none_or(|l| l.dirty == 0) {
                st.dirty.lines.remove(&key);
            }
            Self::hold_clean_copy(&mut st, id, b, cbn, guest, crc, mark);
        }
        self.keep_reserve(&mut st)?;
        if st.ledger.clean_over_limit() {
            if self.config.inline_background {
                drop(st);
                self.clean_copies_check()?;
            } else {
                self.wake.notify();
            }
        }
        Ok(())
    }

    /// Holds the clean copy `cbn` of block `b` of image `id` out of the
    /// journal until the backend sync through `mark` ran.
    fn hold_clean_copy(st: &mut State, id: u16, b: u64, cbn: Cbn, guest: u64, crc: u32, mark: u64) {
        st.ledger.hold_clean(
            (line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as u8),
            UnjournaledClean {
                image: id,
                mark,
                cbn,
                guest,
                crc,
            },
        );
    }

    /// Before a write to the backend: forgets the clean flash copies of
    /// `blocks` (but the `dirty` ones), durably when recovery knew them.
    fn forget_superseded(
        &self,
        id: u16,
        off: u64,
        segments: &[WriteSegment<'_>],
        blocks: std::ops::RangeInclusive<u64>,
        dirty: &[u64],
    ) -> Result<()> {
        let mut st = self.lock();
        self.absorb_bypassing_write(&mut st, id, off, segments);
        // Only metadata points at other data: guest data and filler
        // may reach the backend before dirty blocks are durable.
        if segments
            .iter()
            .any(|s| matches!(s.tag.class, IoClass::Metadata(_)))
        {
            self.commit_before_bypass(&mut st)?;
        }
        let mut dropped = false;
        for b in blocks {
            if dirty.binary_search(&b).is_err() {
                let (key, slot) = (line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as usize);
                // A clean copy never journaled is unknown to recovery:
                // dropping it needs nothing made durable first.
                let journaled = !forget_unjournaled(&mut st, key, slot);
                dropped |= self.unmap_block(&mut st, key, slot) && journaled;
            }
        }
        if dropped {
            // The unmaps must be durable before the backend write; the
            // syncs that take need no lock, and no backend sync but for
            // what the journal describes.
            self.commit_unlocked(st, Unsynced::Described)?;
        }
        Ok(())
    }

    /// The backend now holds the blocks wholly inside `[off, off + len)`:
    /// their lost flash copies no longer matter.
    fn clear_lost(&self, id: u16, off: u64, len: u64) {
        if !self.lock().integrity.unreadable.is_empty() {
            let mut st = self.lock();
            for b in off.div_ceil(BLOCK)..(off + len) / BLOCK {
                let (key, slot) = (line_key(id, b / LINE_BLOCKS), (b % LINE_BLOCKS) as u8);
                if st.integrity.unreadable.remove(&(key, slot)) {
                    st.journal.push(&Entry::Lost {
                        key,
                        slot,
                        lost: false,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    #[test]
    fn runs_of_consecutive_blocks() {
        assert_eq!(consecutive_runs(&[]), vec![]);
        assert_eq!(
            consecutive_runs(&[3, 4, 5, 7, 9, 10]),
            vec![(3, 6), (7, 8), (9, 11)]
        );
    }
}
