//! Copying blocks back to their images: many requests in flight at once
//! (as many as the backend's latency says pay off), neighbours coalesced
//! into one request, and the not yet valid sectors of partially valid
//! clusters filled with bytes the COW layer read from the backing chain,
//! so such a cluster is written once and its filler never enters flash.
//!
//! It only moves bytes and counts them: which blocks to copy, and what a
//! finished copy means for the index, is the caller's business. Foreground
//! backend I/O keeps priority: while a guest waits on a backend, only a
//! quarter of the copy workers run.

use super::FlashCache;
use super::fills::LineFill;
use super::space::{DirtyBlock, Target};
use crate::error::{CacheError, Result};
use crate::layout::BLOCK;
use crate::stats::bump;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest coalesced write (1 MiB).
const MAX_RUN_BLOCKS: usize = 256;

/// One block to copy back.
#[derive(Debug)]
pub(crate) struct Piece {
    pub image: u16,
    /// Byte offset of the block in its image.
    pub pos: u64,
    /// Its copy in flash and the checksum that copy was written with.
    pub flash: Option<(DirtyBlock, u32)>,
    /// The partially valid line whose backing bytes fill the block's not
    /// yet valid sectors. A piece with neither flash copy nor filler
    /// (the line's backing bytes could not be read) is not written.
    pub base: Option<Arc<LineFill>>,
}

/// Runs of pieces, adjacent in one image, written as one request.
fn runs(mut pieces: Vec<Piece>) -> Vec<Vec<Piece>> {
    pieces.sort_unstable_by_key(|p| (p.image, p.pos));
    let mut out: Vec<Vec<Piece>> = Vec::new();
    for p in pieces {
        match out.last_mut() {
            Some(run)
                if run.len() < MAX_RUN_BLOCKS
                    && run
                        .last()
                        .is_some_and(|l| l.image == p.image && l.pos + BLOCK == p.pos) =>
            {
                run.push(p)
            }
            _ => out.push(vec![p]),
        }
    }
    out
}

/// How many copy requests to keep in flight: grows while the backend's
/// latency stays near the lowest seen for requests of the same size,
/// shrinks in proportion when requests queue up behind each other (a
/// gradient limit, as TCP Vegas does for windows).
#[derive(Debug)]
pub(crate) struct DepthLimit {
    limit: f64,
    max: usize,
    /// Per power-of-two request size from 4 KiB, the lowest latency seen,
    /// creeping up slowly so that a backend that became slower for good is
    /// not compared with its past forever.
    floors: [Option<f64>; SIZE_CLASSES],
}

const SIZE_CLASSES: usize = 16;

fn size_class(bytes: usize) -> usize {
    let blocks = (bytes / BLOCK as usize).max(1);
    (blocks.ilog2() as usize).min(SIZE_CLASSES - 1)
}

impl DepthLimit {
    pub(crate) fn new(max: usize) -> DepthLimit {
        let max = max.max(1);
        // Start at the most allowed: a drain may be a couple of rounds
        // long, and a backend's latency shows queueing within one.
        DepthLimit {
            limit: max as f64,
            max,
            floors: [None; SIZE_CLASSES],
        }
    }

    pub(crate) fn current(&self) -> usize {
        (self.limit as usize).clamp(1, self.max)
    }

    /// Adjusts to the (bytes, latency) of the requests of one round.
    pub(crate) fn record(&mut self, samples: &[(usize, Duration)]) {
        if samples.is_empty() {
            return;
        }
        for f in self.floors.iter_mut().flatten() {
            *f *= FLOOR_CREEP;
        }
        let mut sum = 0.0;
        for &(bytes, took) in samples {
            let latency = took.as_secs_f64().max(1e-6);
            let slot = &mut self.floors[size_class(bytes)];
            let floor = slot.map_or(latency, |f| f.min(latency));
            *slot = Some(floor);
            // 1.0 while a request takes no longer than twice its floor;
            // below when requests wait for each other. (Twice: on a busy
            // host a request's latency also holds the time its completion
            // waited for a CPU, which fewer requests would not shorten.)
            sum += (floor * QUEUE_TOLERANCE / latency).min(1.0);
        }
        let gradient = (sum / samples.len() as f64).max(0.5);
        let least = MIN_DEPTH.min(self.max) as f64;
        self.limit = (self.limit * gradient + self.limit.sqrt()).clamp(least, self.max as f64);
    }
}

/// Fewest requests in flight the limit goes down to.
const MIN_DEPTH: usize = 4;
/// How much slower than its floor a request may be before it counts as
/// queued.
const QUEUE_TOLERANCE: f64 = 2.0;
/// Per round, the floors rise by this factor.
const FLOOR_CREEP: f64 = 1.001;

/// A guest request waiting on a backend (write-back yields while any is).
pub(crate) struct Foreground<'a>(Option<&'a AtomicUsize>);

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

thread_local! {
    /// This thread copies for write-back: its backend I/O (reading the
    /// backing chain to fill a cluster goes through the cache's read path)
    /// is not foreground I/O.
    static COPYING: Cell<bool> = const { Cell::new(false) };
}

/// What copying a set of pieces did.
#[derive(Debug, Default)]
pub(crate) struct Copied {
    /// Flash blocks that did not match their checksum: not written.
    pub damaged: Vec<DirtyBlock>,
}

/// Puts back the calling thread's copying mark.
struct Restore(bool);

impl Drop for Restore {
    fn drop(&mut self) {
        COPYING.set(self.0);
    }
}

/// (bytes, latency) of backend requests.
type Timing = Vec<(usize, Duration)>;

impl FlashCache {
    /// Feeds request latencies to the depth limit.
    pub(crate) fn record_latencies(&self, samples: &[(usize, Duration)]) {
        if let Ok(mut d) = self.copy_depth.lock() {
            d.record(samples);
        }
    }

    /// Marks a guest request's backend I/O until the guard drops.
    pub(crate) fn foreground_io(&self) -> Foreground<'_> {
        if COPYING.get() {
            return Foreground(None);
        }
        self.foreground.fetch_add(1, Ordering::Relaxed);
        Foreground(Some(&self.foreground))
    }

    /// Writes the pieces to their images, many requests at once, then
    /// syncs every image written. A flash block that does not verify is
    /// not written (nor anything of its piece): it is returned.
    pub(crate) fn copy_pieces(&self, targets: &[Target], pieces: Vec<Piece>) -> Result<Copied> {
        let runs = runs(pieces);
        let damaged = Mutex::new(Vec::new());
        let timing = Mutex::new(Timing::default());
        self.run_parallel(&runs, |run| {
            let (bad, t) = self.copy_run(targets, run)?;
            let mut d = damaged.lock().unwrap_or_else(|p| p.into_inner());
            d.extend(bad);
            let mut tm = timing.lock().unwrap_or_else(|p| p.into_inner());
            tm.extend(t);
            Ok(())
        })?;
        let t = timing.into_inner().unwrap_or_else(|p| p.into_inner());
        self.record_latencies(&t);
        for (_, backend, disk) in targets {
            backend
                .flush()
                .map_err(CacheError::store("sync", &**backend))?;
            bump(&self.stats.disk(*disk).backend_syncs, 1);
        }
        Ok(Copied {
            damaged: damaged.into_inner().unwrap_or_else(|p| p.into_inner()),
        })
    }

    /// Runs `job` on every item with up to `depth` workers. Workers beyond
    /// a quarter of them pause while foreground I/O waits on a backend.
    pub(crate) fn run_parallel<T: Sync>(
        &self,
        items: &[T],
        job: impl Fn(&T) -> Result<()> + Sync,
    ) -> Result<()> {
        let depth = self.copy_depth.lock().map(|d| d.current()).unwrap_or(1);
        let next = AtomicUsize::new(0);
        let failed: Mutex<Option<CacheError>> = Mutex::new(None);
        let workers = depth.clamp(1, items.len().max(1));
        let priority_share = (workers / 4).max(1);
        let work = |worker: usize| {
            let was = COPYING.replace(true);
            let _restore = Restore(was);
            loop {
                if failed.lock().map(|f| f.is_some()).unwrap_or(true) {
                    return;
                }
                if worker >= priority_share && self.foreground.load(Ordering::Relaxed) > 0 {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { return };
                if let Err(e) = job(item) {
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                    return;
                }
            }
        };
        // Workers carry their caller's name: what runs for the write-back
        // thread is the write-back thread's I/O (to the log, and to tests
        // that hold it).
        let name = std::thread::current()
            .name()
            .unwrap_or("vdcache-copy")
            .to_string();
        std::thread::scope(|s| {
            for w in 1..workers {
                let work = &work;
                if std::thread::Builder::new()
                    .name(name.clone())
                    .spawn_scoped(s, move || work(w))
                    .is_err()
                {
                    // Fewer workers: the others take the items.
                    break;
                }
            }
            work(0);
        });
        match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Copies one run; returns the damaged flash blocks it skipped.
    fn copy_run(&self, targets: &[Target], run: &[Piece]) -> Result<(Vec<DirtyBlock>, Timing)> {
        let Some(first) = run.first() else {
            return Ok((Vec::new(), Timing::default()));
        };
        let (_, backend, disk) = targets
            .iter()
            .find(|(id, _, _)| *id == first.image)
            .ok_or_else(|| CacheError::Corrupt(format!("no store for image {}", first.image)))?;
        let mut timing = Timing::default();
        let mut read_before = None;
        for fill in run.iter().filter_map(|p| p.base.as_ref()) {
            // A line's pieces are adjacent: one pointer compare skips the
            // repeats.
            if read_before.is_some_and(|f| Arc::ptr_eq(f, fill)) {
                continue;
            }
            read_before = Some(fill);
            timing.extend(fill.read()?);
        }
        let mut data = vec![0u8; run.len() * BLOCK as usize];
        let (good, filled) = self.assemble_run(run, &mut data)?;
        let counters = self.stats.disk(*disk);
        let mut damaged = Vec::new();
        let mut start = 0;
        for n in 0..=run.len() {
            if n < run.len() && good[n] {
                continue;
            }
            if n < run.len()
                && let Some((block, _)) = run[n].flash
            {
                damaged.push(block);
            }
            if n > start {
                let bytes = &data[start * BLOCK as usize..n * BLOCK as usize];
                let began = Instant::now();
                backend
                    .write_at(bytes, run[start].pos)
                    .map_err(CacheError::store("write back to", &**backend))?;
                timing.push((bytes.len(), began.elapsed()));
                bump(&counters.backend_bytes_written, bytes.len() as u64);
                bump(&counters.writeback_requests, 1);
            }
            start = n + 1;
        }
        bump(&counters.writeback_filled_bytes, filled);
        for p in run {
            if p.flash.is_some() {
                bump(&counters.flash_bytes_read, BLOCK);
            }
        }
        Ok((damaged, timing))
    }

    /// Fills `data` with the run's bytes: flash copies (adjacent cache
    /// blocks read at once) with backing bytes over the sectors flash
    /// lacks. Returns which pieces are whole (verified, or filled) and how
    /// many backing bytes went in.
    fn assemble_run(&self, run: &[Piece], data: &mut [u8]) -> Result<(Vec<bool>, u64)> {
        let mut good = vec![true; run.len()];
        let mut i = 0;
        while i < run.len() {
            let Some(((_, _, cbn), _)) = run[i].flash else {
                i += 1;
                continue;
            };
            let mut j = i + 1;
            while j < run.len()
                && run[j]
                    .flash
                    .is_some_and(|((_, _, c), _)| c == cbn + (j - i) as u32)
            {
                j += 1;
            }
            self.device
                .read_at(
                    &mut data[i * BLOCK as usize..j * BLOCK as usize],
                    self.layout.block_offset(cbn),
                )
                .map_err(CacheError::device("read block"))?;
            i = j;
        }
        let mut filled = 0;
        for (n, p) in run.iter().enumerate() {
            let block = &mut data[n * BLOCK as usize..(n + 1) * BLOCK as usize];
            if let Some((_, crc)) = p.flash {
                good[n] = crc32c::crc32c(block) == crc;
            }
            let Some(fill) = &p.base else { continue };
            let slot = ((p.pos % crate::layout::LINE) / BLOCK) as usize;
            match fill.copy_base(slot, block) {
                Some(bytes) => filled += bytes,
                // Unfilled, a block with no flash copy holds nothing.
                None => good[n] &= p.flash.is_some(),
            }
        }
        Ok((good, filled))
    }

    /// Dirty blocks as pieces to copy whole from flash.
    pub(crate) fn flash_pieces(blocks: &[DirtyBlock], crcs: &[u32]) -> Vec<Piece> {
        blocks
            .iter()
            .zip(crcs)
            .map(|(&(key, slot, cbn), &crc)| Piece {
                image: crate::index::key_image(key),
                pos: crate::index::key_line(key) * crate::layout::LINE + slot as u64 * BLOCK,
                flash: Some(((key, slot, cbn), crc)),
                base: None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(image: u16, block: u64) -> Piece {
        Piece {
            image,
            pos: block * BLOCK,
            flash: None,
            base: None,
        }
    }

    #[test]
    fn runs_join_neighbours_of_one_image_only() {
        let pieces = vec![
            piece(0, 3),
            piece(0, 1),
            piece(1, 2),
            piece(0, 2),
            piece(0, 5),
        ];
        let lens: Vec<(u16, u64, usize)> = runs(pieces)
            .iter()
            .map(|r| (r[0].image, r[0].pos / BLOCK, r.len()))
            .collect();
        assert_eq!(lens, vec![(0, 1, 3), (0, 5, 1), (1, 2, 1)]);
    }

    #[test]
    fn runs_stop_at_the_largest_request() {
        let pieces = (0..MAX_RUN_BLOCKS as u64 + 3)
            .map(|b| piece(0, b))
            .collect();
        let lens: Vec<usize> = runs(pieces).iter().map(Vec::len).collect();
        assert_eq!(lens, vec![MAX_RUN_BLOCKS, 3]);
    }

    #[test]
    fn depth_grows_to_the_maximum_while_latency_holds() {
        let mut d = DepthLimit::new(64);
        assert_eq!(d.current(), 64);
        for _ in 0..100 {
            // Larger requests take longer without any queueing.
            d.record(&[
                (4096, Duration::from_millis(1)),
                (1 << 20, Duration::from_millis(5)),
            ]);
        }
        assert_eq!(d.current(), 64);
    }

    #[test]
    fn depth_settles_near_the_knee_of_a_saturated_backend() {
        // A backend that serves 8 requests at a time in 1 ms: beyond 8 in
        // flight, each request waits for the ones before it.
        let mut d = DepthLimit::new(64);
        d.record(&[(4096, Duration::from_millis(1))]);
        for _ in 0..200 {
            let inflight = d.current() as f64;
            let latency = (inflight / 8.0).max(1.0);
            d.record(&[(4096, Duration::from_secs_f64(latency / 1000.0))]);
        }
        let settled = d.current();
        assert!(
            (8..=32).contains(&settled),
            "settled at {settled} in flight"
        );
    }
}
