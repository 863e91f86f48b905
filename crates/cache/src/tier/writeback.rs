//! Background write-back: when more than the high watermark of the data
//! zone is dirty (or someone drains the cache), dirty blocks are copied to
//! their images (see `copyback`: many at once, coalesced, partially valid
//! clusters filled on the way), the images synced, and the blocks marked
//! clean, until the low watermark is reached. The regions reclaimed next
//! go first, so reclaiming space seldom waits for a backend; guest writes
//! slow down gradually when write-back cannot keep up.

use super::space::DirtyBlock;
use super::{FlashCache, fills};
use crate::error::{CacheError, Result};
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE, LINE_BLOCKS};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;
use vdcache_backend::StoreFault;

/// Blocks per write-back batch (16 MiB), filler included: enough requests
/// to keep a deep queue busy between the batch's backend syncs.
const BATCH_COST: usize = 4096;
/// Regions reclaimed next whose dirty blocks are copied first.
const VICTIM_LOOKAHEAD: usize = 8;

/// Longest pause of a throttled write per 4 KiB block...
const THROTTLE_PER_BLOCK: Duration = Duration::from_millis(4);
/// ...and per request.
const THROTTLE_MAX: Duration = Duration::from_millis(100);

/// How long a write of `blocks` pauses after it left `dirty` of the cache
/// dirty. Nothing up to halfway between the high watermark and full; then
/// a pause growing with the square of the way to 95% full, so a guest
/// writing faster than write-back drains slows gradually to the drain's
/// pace instead of running into a full cache (where every write would
/// wait for a region's write-back).
pub(crate) fn throttle(dirty: f64, high: f64, blocks: u64) -> Option<Duration> {
    let start = high + (1.0 - high) / 2.0;
    let full = 1.0 - (1.0 - high) / 10.0;
    if dirty <= start || full <= start {
        return None;
    }
    let x = ((dirty - start) / (full - start)).min(1.0);
    Some((THROTTLE_PER_BLOCK.mul_f64(x * x) * blocks.max(1) as u32).min(THROTTLE_MAX))
}

/// A wake-up signal for the write-back thread, and what its failed rounds
/// tell a drain.
#[derive(Debug, Default)]
pub(crate) struct Wakeup {
    /// Leaf locks (see the lock order in the tier's module doc).
    pending: Mutex<bool>,
    cv: Condvar,
    failures: Mutex<Failures>,
    /// Drains begun so far: a new one makes a thread that backed off
    /// after failures retry at once and at short intervals again.
    drains: std::sync::atomic::AtomicU64,
}

/// Failed write-back rounds so far, whether the last one failed because
/// a storage server stayed unreachable, and what it said.
#[derive(Debug, Default)]
struct Failures {
    rounds: u64,
    unreachable: Option<StoreFault>,
    last: String,
}

/// Failed rounds after which a drain gives up (about 4 s of retries at
/// the thread's growing pauses): a full file system or a failing store
/// does not heal by itself, and a flush or a stop must answer.
const DRAIN_GIVE_UP_ROUNDS: u64 = 3;

impl Wakeup {
    fn record_failure(&self, e: &CacheError) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        f.rounds += 1;
        f.unreachable = e.unreachable_store().cloned();
        f.last = e.to_string();
    }

    /// The error a drain that began after `seen` failed rounds gives up
    /// with, once enough rounds failed since.
    fn give_up_since(&self, seen: u64) -> Option<CacheError> {
        let f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let failed = f.rounds.saturating_sub(seen);
        (failed >= DRAIN_GIVE_UP_ROUNDS).then(|| CacheError::WriteBackFailing {
            rounds: failed,
            last: f.last.clone(),
        })
    }

    fn failed_rounds(&self) -> u64 {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rounds
    }

    /// The unreachable store that made the last round fail, if a round
    /// failed since `seen` rounds had.
    fn unreachable_since(&self, seen: u64) -> Option<StoreFault> {
        let f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        (f.rounds > seen).then(|| f.unreachable.clone()).flatten()
    }

    /// A drain begins: retry now, and soon again if that fails.
    fn drain_begins(&self) {
        self.drains.fetch_add(1, Ordering::SeqCst);
        self.notify();
    }

    pub(crate) fn notify(&self) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Waits for a notification or the timeout.
    fn wait(&self, timeout: Duration) {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if !*p {
            p = self
                .cv
                .wait_timeout(p, timeout)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        *p = false;
    }
}

pub(super) fn start(cache: &Arc<FlashCache>) {
    let wake = cache.wake.clone();
    FlashCache::spawn_background(cache, "vdcache-writeback", &cache.thread, move |weak| {
        run(weak, wake)
    });
}

fn run(weak: Weak<FlashCache>, wake: Arc<Wakeup>) {
    let mut cursor = 0u64;
    // Consecutive failed rounds: a backend that keeps failing is retried
    // at growing intervals (0.5 s doubling to 8 s; a drain wakes it and
    // starts over, so it gives up within seconds).
    let mut failed = 0u32;
    let mut drains = wake.drains.load(Ordering::SeqCst);
    loop {
        let now = wake.drains.load(Ordering::SeqCst);
        if now != drains {
            drains = now;
            failed = 0;
        }
        // Hold the cache only while working: when its last user drops it,
        // the device is closed at once and this thread ends at its next wake.
        let idle = {
            let Some(cache) = weak.upgrade() else { return };
            if cache.stop.load(Ordering::SeqCst) {
                return;
            }
            if let Err(e) = cache.clean_copies_check() {
                tracing::error!("journaling clean copies failed: {e}");
            }
            let round = cache
                .writeback_round(&mut cursor, true)
                .and_then(|data| Ok(cache.meta_writeback_round(false)? || data));
            match round {
                Ok(true) => {
                    failed = 0;
                    false
                }
                Ok(false) => {
                    failed = 0;
                    if let Err(e) = cache.journal_age_check() {
                        tracing::error!("writing the journal failed: {e}");
                    }
                    true
                }
                Err(e) => {
                    failed = failed.saturating_add(1);
                    tracing::error!("write-back failed (the blocks stay dirty; retrying): {e}");
                    // Under the state lock, so a drain between its check
                    // and its wait cannot miss it.
                    let _st = cache.lock();
                    wake.record_failure(&e);
                    cache.progress.notify_all();
                    true
                }
            }
        };
        if idle {
            let pause = 500u64 << failed.saturating_sub(1).min(4);
            wake.wait(Duration::from_millis(pause));
        }
    }
}

impl FlashCache {
    /// Inline write-back: called by a writer after it crossed the high
    /// watermark, when there is no background thread, and by a drain when
    /// the thread has stopped.
    pub(crate) fn writeback_inline(&self) -> Result<()> {
        let mut cursor = 0;
        while self.writeback_round(&mut cursor, false)? {}
        while self.meta_writeback_round(false)? {}
        Ok(())
    }

    fn needs_writeback(&self, dirty: u64, drain: bool, busy: bool) -> bool {
        let ratio = dirty as f64 / self.layout.cacheable_blocks() as f64;
        dirty > 0
            && (drain
                || ratio > self.config.low_watermark
                    && (busy || ratio > self.config.high_watermark))
    }

    /// Writes back one batch; true when more work remains. With `fill`,
    /// partially valid clusters of disks that offered their backing chain
    /// are completed on the way (never inline in a writer: the chain's
    /// reader may need locks the writer holds).
    fn writeback_round(&self, cursor: &mut u64, fill: bool) -> Result<bool> {
        let (collected, fills) = {
            let mut st = self.lock();
            let dirty = if st.dirty.writing_out_held() {
                st.index.dirty_blocks()
            } else {
                st.index.writeback_dirty_blocks()
            };
            if !self.needs_writeback(dirty, st.dirty.draining(), st.dirty.writeback_busy) {
                st.dirty.writeback_busy = false;
                self.progress.notify_all();
                return Ok(false);
            }
            st.dirty.writeback_busy = true;
            let from = *cursor;
            let batch = self.collect(&mut st, cursor);
            if batch.is_empty() {
                // A pass from the start that found nothing to write: what
                // is dirty cannot be written (images not open, blocks lost).
                if from == 0 {
                    *cursor = 0;
                    st.dirty.writeback_busy = false;
                    self.progress.notify_all();
                    return Ok(false);
                }
                *cursor = 0;
                return Ok(true);
            }
            let lines = if fill {
                fills::partial_lines(&st, &batch)
            } else {
                Vec::new()
            };
            (batch, lines)
        };
        // Hold the image ranges so no write-through or discard of the same
        // bytes interleaves with this copy; then keep only blocks that are
        // still dirty in the same place.
        let mut ranges: Vec<(u16, u64, u64)> = collected
            .iter()
            .map(|&(key, slot, _)| {
                let at = crate::index::key_line(key) * LINE + slot as u64 * BLOCK;
                (crate::index::key_image(key), at, at + BLOCK)
            })
            .collect();
        ranges.extend(fills.iter().map(|f| f.range()));
        let _range = self.ranges.lock(&ranges);
        let (batch, fills, targets, pieces) = {
            let mut st = self.lock();
            self.commit_before_bypass(&mut st)?;
            let batch: Vec<DirtyBlock> = collected
                .into_iter()
                .filter(|&(key, slot, cbn)| {
                    st.index
                        .get(key)
                        .is_some_and(|l| l.dirty & (1 << slot) != 0 && l.cbn(slot) == cbn)
                })
                .collect();
            let fills: Vec<_> = fills.into_iter().filter(|f| f.unchanged(&st)).collect();
            for &(key, slot, cbn) in &batch {
                let r = st.regions.region_of(cbn);
                st.regions.pin(r);
                st.dirty.copying.insert((key, slot as u8));
            }
            let targets = self.backends_of(&st, &batch);
            let crcs = super::space::expected_crcs(&st, &batch);
            let pieces = fills::pieces(&batch, &crcs, &fills);
            (batch, fills, targets, pieces)
        };
        tracing::debug!(
            blocks = batch.len(),
            fills = fills.len(),
            pieces = pieces.len(),
            depth = self.copy_depth.lock().map(|d| d.current()).unwrap_or(0),
            "writing back a batch"
        );
        let copied = targets.and_then(|t| self.copy_pieces(&t, pieces));
        let mut st = self.lock();
        for &(key, slot, cbn) in &batch {
            let r = st.regions.region_of(cbn);
            st.regions.unpin(r);
            st.dirty.copying.remove(&(key, slot as u8));
        }
        let damaged = copied?.damaged;
        for &(key, slot, cbn) in &batch {
            if damaged.contains(&(key, slot, cbn)) {
                if st.index.block(key, slot) == Some(cbn) {
                    self.lose_block(&mut st, key, slot);
                }
                continue;
            }
            if st.index.mark_clean(key, slot, cbn) {
                st.journal.push(&Entry::Clean {
                    key,
                    slot: slot as u8,
                    cbn,
                });
            }
            if st.index.get(key).is_none_or(|l| l.dirty == 0) {
                st.dirty.lines.remove(&key);
            }
        }
        for f in &fills {
            if f.was_read() && !damaged.iter().any(|&(key, _, _)| key == f.key) {
                self.complete_fill(&mut st, f);
            }
        }
        self.journal_buffer_check(&mut st)?;
        self.progress.notify_all();
        Ok(true)
    }

    /// Writes every dirty block back and makes the result durable: what
    /// `vdcache flush` and a clean stop do.
    ///
    /// Gives up with [`CacheError::Unreachable`] when a write-back round
    /// fails because a storage server stayed away for its whole reconnect
    /// delay (its requests then fail at once): waiting longer would make a
    /// stop hang for as long as the server is gone. Other failures (a
    /// flush reporting writes that a dropped connection may have lost) are
    /// retried a few times, then given up with
    /// [`CacheError::WriteBackFailing`] (a full file system does not heal
    /// by itself). Either way the dirty data stays in the cache.
    pub fn drain(&self) -> Result<()> {
        self.drain_with(false)
    }

    /// [`Self::drain`], and held images' blocks written out too (a guest
    /// journal device's, which only lives in flash): what `recover --full`
    /// and an operator's `vdcache flush` do. They stay cached, clean, until
    /// written again.
    pub fn write_out_held(&self) -> Result<()> {
        self.drain_with(true)
    }

    fn drain_with(&self, held: bool) -> Result<()> {
        let mut st = self.lock();
        st.dirty.drain_requests += 1;
        st.dirty.held_requests += u64::from(held);
        let result = self.drain_locked(st);
        let mut st = self.lock();
        st.dirty.drain_requests -= 1;
        st.dirty.held_requests -= u64::from(held);
        drop(st);
        result
    }

    fn drain_locked<'a>(&'a self, mut st: std::sync::MutexGuard<'a, super::State>) -> Result<()> {
        let seen = self.wake.failed_rounds();
        self.wake.drain_begins();
        while st.open_dirty() {
            if self.thread.lock().map(|t| t.is_none()).unwrap_or(true) {
                // No write-back thread (stopped): do it here.
                drop(st);
                let result = self.writeback_inline();
                st = self.lock();
                if let Err(e) = result {
                    return Err(match e.unreachable_store() {
                        Some(fault) => CacheError::Unreachable {
                            fault: fault.clone(),
                        },
                        None => e,
                    });
                }
                break;
            }
            if let Some(fault) = self.wake.unreachable_since(seen) {
                return Err(CacheError::Unreachable { fault });
            }
            if let Some(e) = self.wake.give_up_since(seen) {
                return Err(e);
            }
            let (guard, timeout) = self
                .progress
                .wait_timeout(st, Duration::from_secs(5))
                .unwrap_or_else(|p| p.into_inner());
            st = guard;
            if timeout.timed_out() && st.open_dirty() {
                tracing::info!(
                    dirty_blocks = st.index.dirty_blocks(),
                    dirty_sectors = st.meta.dirty_len(),
                    "still writing back"
                );
            }
        }
        self.commit(&mut st)
    }
}

impl FlashCache {
    /// The next lines to write back, as their writable dirty blocks: first
    /// those of the regions reclaimed next (so reclaiming them writes
    /// nothing back under the state lock; not when draining), then the
    /// rest in address order from the cursor. Whole lines, so a partially valid cluster is filled
    /// and written in one piece; at most [`BATCH_COST`], a line to fill
    /// counting as many blocks as its filler.
    fn collect(&self, st: &mut super::State, cursor: &mut u64) -> Vec<DirtyBlock> {
        let mut keys: BTreeSet<u64> = BTreeSet::new();
        let mut cost = 0;
        // A drain writes everything: address order coalesces best.
        let lookahead = if st.dirty.draining() {
            0
        } else {
            VICTIM_LOOKAHEAD
        };
        for region in st.regions.next_victims(lookahead) {
            let (refs, _) = self.region_refs(st, region);
            for (key, _, _) in refs {
                if cost < BATCH_COST && !keys.contains(&key) && writable_line(st, key) {
                    keys.insert(key);
                    cost += line_cost(st, key);
                }
            }
            if cost >= BATCH_COST {
                break;
            }
        }
        if keys.is_empty() {
            let from_cursor: Vec<u64> = st
                .dirty
                .lines
                .range(*cursor..)
                .filter(|&&k| st.is_open(crate::index::key_image(k)))
                .take(BATCH_COST)
                .copied()
                .collect();
            for key in from_cursor {
                *cursor = key + 1;
                if writable_line(st, key) {
                    keys.insert(key);
                    cost += line_cost(st, key);
                }
                if cost >= BATCH_COST {
                    break;
                }
            }
        }
        let mut out = Vec::new();
        for key in keys {
            if let Some(l) = st.index.get(key) {
                for slot in 0..LINE_BLOCKS as usize {
                    if l.dirty & (1 << slot) != 0
                        && !st.integrity.unreadable.contains(&(key, slot as u8))
                    {
                        out.push((key, slot, l.cbn(slot)));
                    }
                }
            }
        }
        out
    }
}

/// Whether line `key` has dirty blocks write-back may copy now.
fn writable_line(st: &super::State, key: u64) -> bool {
    let image = crate::index::key_image(key);
    st.dirty.lines.contains(&key)
        && st.is_open(image)
        && st.writes_back(image)
        && st.has_writable_dirty(key)
}

/// What writing a line back costs, in blocks.
fn line_cost(st: &super::State, key: u64) -> usize {
    st.index.get(key).map_or(0, |l| {
        if l.partial != 0 {
            LINE_BLOCKS as usize
        } else {
            l.dirty.count_ones() as usize
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_starts_halfway_to_full_and_grows() {
        assert_eq!(throttle(0.6, 0.5, 1), None);
        assert_eq!(throttle(0.75, 0.5, 1), None);
        let a = throttle(0.8, 0.5, 1).unwrap_or_default();
        let b = throttle(0.9, 0.5, 1).unwrap_or_default();
        let c = throttle(0.99, 0.5, 1).unwrap_or_default();
        assert!(Duration::ZERO < a && a < b && b < c, "{a:?} {b:?} {c:?}");
        assert_eq!(c, THROTTLE_PER_BLOCK);
        assert_eq!(throttle(0.99, 0.5, 1000), Some(THROTTLE_MAX));
        assert_eq!(throttle(1.0, 1.0, 1), None);
    }
}
