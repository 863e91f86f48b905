//! Write staging for the data zone. Blocks written into a region are
//! gathered in memory a chunk (up to 256 KiB) at a time and the chunk goes
//! to the device in one write once every block of it has arrived, instead
//! of one small write per request: on a device file each write call walks
//! the page cache and the file system's block reservation per call, and an
//! SSD prefers large writes anyway. Reads of staged blocks are served from
//! memory.
//!
//! Everything staged is written out before a sync, so a sync means what it
//! did without staging, and before any write outside the data zone
//! (journal, checkpoints, superblock), so a journal record on the device
//! never names a block that is only in memory (replay would stop there).
//!
//! A complete chunk is written by the staging thread, off the request
//! path (without background threads, by the writer that completed it). A
//! chunk it fails to write stays staged, and the next sync retries it and
//! reports the error.
//!
//! This layer must not reorder writes to the same block: a block arriving
//! for a chunk that is being written out waits until that write is done.

use crate::layout::BLOCK;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use vdcache_backend::{Backend, BackendRef};

/// Largest chunk: 64 blocks, one bit each.
const MAX_CHUNK_BLOCKS: u64 = 64;
/// Chunk buffers kept for reuse.
const SPARE_BUFFERS: usize = 8;

struct Chunk {
    buf: Arc<Vec<u8>>,
    /// Blocks held here and not yet on the device.
    staged: u64,
    /// Blocks already on the device (written out early).
    done: u64,
    /// Being written out: takes no blocks until that write is done.
    writing: bool,
}

#[derive(Default)]
struct Chunks {
    /// By chunk number (data-zone offset / chunk size).
    map: HashMap<u64, Chunk>,
    spare: Vec<Vec<u8>>,
    /// Complete chunks for the staging thread.
    queue: VecDeque<u64>,
    stop: bool,
}

/// A device whose data-zone writes are staged in chunks.
pub struct StagedDevice {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    inner: BackendRef,
    data_offset: u64,
    chunk_bytes: u64,
    full: u64,
    /// The staging thread runs (it writes complete chunks).
    background: AtomicBool,
    /// Chunks in `chunks.map`, readable without its lock: reads skip the
    /// lock while nothing is staged (a read-mostly cache, most of the time).
    staged_chunks: AtomicUsize,
    /// A leaf lock: device I/O runs under the cache's state lock, so this
    /// is taken after it and takes nothing else.
    chunks: Mutex<Chunks>,
    written_out: Condvar,
    queued: Condvar,
}

impl std::fmt::Debug for StagedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedDevice")
            .field("device", &self.shared.inner.name())
            .field("chunk_bytes", &self.shared.chunk_bytes)
            .finish()
    }
}

/// Runs of set bits of `mask`, as (first, count).
fn runs(mut mask: u64) -> impl Iterator<Item = (u64, u64)> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let first = u64::from(mask.trailing_zeros());
        let count = u64::from((mask >> first).trailing_ones());
        mask &= !(((1u128 << count) - 1) as u64) << first;
        Some((first, count))
    })
}

/// Bits `first..first + count`.
fn bits(first: u64, count: u64) -> u64 {
    (((1u128 << count) - 1) << first) as u64
}

impl StagedDevice {
    /// Stages writes into a data zone starting at `data_offset` (a multiple
    /// of `region_bytes`) in chunks that divide `region_bytes`; complete
    /// chunks are written by a thread when `background`.
    pub fn new(
        inner: BackendRef,
        data_offset: u64,
        region_bytes: u64,
        background: bool,
    ) -> StagedDevice {
        let region_blocks = (region_bytes / BLOCK).max(1);
        let chunk_blocks = (1u64 << region_blocks.trailing_zeros()).min(MAX_CHUNK_BLOCKS);
        let shared = Arc::new(Shared {
            inner,
            data_offset,
            chunk_bytes: chunk_blocks * BLOCK,
            full: bits(0, chunk_blocks),
            background: AtomicBool::new(false),
            staged_chunks: AtomicUsize::new(0),
            chunks: Mutex::default(),
            written_out: Condvar::new(),
            queued: Condvar::new(),
        });
        let thread = background
            .then(|| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name("vdcache-staging".into())
                    .spawn(move || s.run())
                    .map_err(|e| tracing::warn!("no staging thread ({e}); writers write chunks"))
                    .ok()
            })
            .flatten();
        shared.background.store(thread.is_some(), Ordering::SeqCst);
        StagedDevice { shared, thread }
    }
}

impl Drop for StagedDevice {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.queued.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    /// The staging thread: writes complete chunks until stopped and idle.
    fn run(&self) {
        loop {
            let mut g = self.lock();
            let n = loop {
                if let Some(n) = g.queue.pop_front() {
                    break n;
                }
                if g.stop {
                    return;
                }
                g = self.queued.wait(g).unwrap_or_else(|p| p.into_inner());
            };
            let Some((mask, buf)) = g.map.get(&n).map(|c| (c.staged, c.buf.clone())) else {
                continue;
            };
            drop(g);
            let result = self.write_runs(n, mask, &buf);
            drop(buf);
            if let Err(e) = &result {
                tracing::warn!("writing staged blocks failed (the next sync retries): {e}");
            }
            self.finish(n, mask, result.is_ok(), true);
        }
    }

    /// Makes the chunk count visible to lock-free readers (before the
    /// lock is released, so a read ordered after a write sees it).
    fn publish(&self, chunks: &Chunks) {
        self.staged_chunks.store(chunks.map.len(), Ordering::SeqCst);
    }

    fn lock(&self) -> MutexGuard<'_, Chunks> {
        self.chunks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Chunks>) -> MutexGuard<'a, Chunks> {
        self.written_out.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// Device offset of chunk `n`.
    fn chunk_offset(&self, n: u64) -> u64 {
        self.data_offset + n * self.chunk_bytes
    }

    /// Whether chunk `n` overlaps bytes `[start, end)` of the device.
    fn overlaps(&self, n: u64, start: u64, end: u64) -> bool {
        let s = self.chunk_offset(n);
        s < end && start < s + self.chunk_bytes
    }

    fn stageable(&self, offset: u64, len: u64) -> bool {
        offset >= self.data_offset && offset.is_multiple_of(BLOCK) && len.is_multiple_of(BLOCK)
    }

    /// Copies `len` bytes of the gathered buffers, from byte `from` on,
    /// into `out`.
    fn gather(bufs: &[&[u8]], mut from: usize, out: &mut [u8]) {
        let mut at = 0;
        for b in bufs {
            if at == out.len() {
                break;
            }
            if from >= b.len() {
                from -= b.len();
                continue;
            }
            let n = (b.len() - from).min(out.len() - at);
            out[at..at + n].copy_from_slice(&b[from..from + n]);
            at += n;
            from = 0;
        }
    }

    fn stage(&self, bufs: &[&[u8]], offset: u64, len: u64) -> io::Result<()> {
        let mut complete = Vec::new();
        let mut g = self.lock();
        let mut pos = offset;
        while pos < offset + len {
            let n = (pos - self.data_offset) / self.chunk_bytes;
            let start = self.chunk_offset(n);
            let end = (start + self.chunk_bytes).min(offset + len);
            let first = (pos - start) / BLOCK;
            let count = (end - pos) / BLOCK;
            while g.map.get(&n).is_some_and(|c| c.writing) {
                g = self.wait(g);
            }
            let chunks = &mut *g;
            let chunk = chunks.map.entry(n).or_insert_with(|| Chunk {
                buf: Arc::new(
                    chunks
                        .spare
                        .pop()
                        .unwrap_or_else(|| vec![0; self.chunk_bytes as usize]),
                ),
                staged: 0,
                done: 0,
                writing: false,
            });
            let Some(buf) = Arc::get_mut(&mut chunk.buf) else {
                self.publish(chunks);
                return Err(io::Error::other(
                    "staged chunk is shared while not written out",
                ));
            };
            let at = (first * BLOCK) as usize;
            Self::gather(
                bufs,
                (pos - offset) as usize,
                &mut buf[at..at + (count * BLOCK) as usize],
            );
            chunk.staged |= bits(first, count);
            if chunk.staged | chunk.done == self.full {
                chunk.writing = true;
                if self.background.load(Ordering::Relaxed) {
                    chunks.queue.push_back(n);
                } else {
                    complete.push((n, chunk.staged, chunk.buf.clone()));
                }
            }
            pos = end;
        }
        let queued = !g.queue.is_empty();
        self.publish(&g);
        drop(g);
        if queued {
            self.queued.notify_one();
        }
        for (n, staged, buf) in complete {
            let result = self.write_runs(n, staged, &buf);
            drop(buf);
            self.finish(n, staged, result.is_ok(), true);
            result?;
        }
        Ok(())
    }

    /// Writes the `mask` blocks of chunk `n` from `buf` to the device, and
    /// starts writing them out of its page cache: a device file's page
    /// cache would otherwise hold every chunk until the next sync, which
    /// then writes them all while a guest request waits for it.
    fn write_runs(&self, n: u64, mask: u64, buf: &[u8]) -> io::Result<()> {
        for (first, count) in runs(mask) {
            let at = (first * BLOCK) as usize;
            self.inner.write_at(
                &buf[at..at + (count * BLOCK) as usize],
                self.chunk_offset(n) + first * BLOCK,
            )?;
        }
        self.inner
            .start_writeback(self.chunk_offset(n), self.chunk_bytes);
        Ok(())
    }

    /// After chunk `n`'s `mask` blocks were written out (or failed to be).
    fn finish(&self, n: u64, mask: u64, ok: bool, whole: bool) {
        let mut g = self.lock();
        let chunks = &mut *g;
        if let Some(chunk) = chunks.map.get_mut(&n) {
            chunk.writing = false;
            if ok {
                chunk.staged &= !mask;
                chunk.done |= mask;
            }
            if ok
                && (whole || chunk.done == self.full)
                && let Some(c) = chunks.map.remove(&n)
                && let Ok(buf) = Arc::try_unwrap(c.buf)
                && chunks.spare.len() < SPARE_BUFFERS
            {
                chunks.spare.push(buf);
            }
        }
        self.publish(&g);
        drop(g);
        self.written_out.notify_all();
    }

    /// Writes every staged block of chunks overlapping `[offset, end)` (all
    /// chunks when `None`) to the device.
    fn write_out(&self, range: Option<(u64, u64)>) -> io::Result<()> {
        let overlaps = |n: u64| range.is_none_or(|(start, end)| self.overlaps(n, start, end));
        let mut jobs = Vec::new();
        let mut g = self.lock();
        loop {
            if !g.map.iter().any(|(&n, c)| c.writing && overlaps(n)) {
                break;
            }
            g = self.wait(g);
        }
        for (&n, chunk) in g.map.iter_mut() {
            if chunk.staged != 0 && overlaps(n) {
                chunk.writing = true;
                jobs.push((n, chunk.staged, chunk.buf.clone()));
            }
        }
        drop(g);
        let mut result = Ok(());
        for (n, mask, buf) in jobs {
            let r = if result.is_ok() {
                self.write_runs(n, mask, &buf)
            } else {
                Ok(())
            };
            drop(buf);
            self.finish(n, mask, result.is_ok() && r.is_ok(), false);
            if result.is_ok() {
                result = r;
            }
        }
        result
    }

    /// Copies staged bytes of `[offset, offset + buf.len())` into `buf`;
    /// returns the byte ranges (relative to `offset`) it did not cover.
    fn read_staged(&self, buf: &mut [u8], offset: u64) -> Vec<(usize, usize)> {
        let end = offset + buf.len() as u64;
        let mut uncovered = Vec::new();
        let mut last = 0usize;
        let g = self.lock();
        let mut block = offset.max(self.data_offset) / BLOCK * BLOCK;
        while block < end {
            let n = (block - self.data_offset) / self.chunk_bytes;
            let slot = (block - self.chunk_offset(n)) / BLOCK;
            let from = block.max(offset);
            let to = (block + BLOCK).min(end);
            if let Some(c) = g.map.get(&n).filter(|c| c.staged & (1 << slot) != 0) {
                let src = (slot * BLOCK + (from - block)) as usize;
                let dst = (from - offset) as usize;
                let len = (to - from) as usize;
                buf[dst..dst + len].copy_from_slice(&c.buf[src..src + len]);
                if dst > last {
                    uncovered.push((last, dst));
                }
                last = dst + len;
            }
            block += BLOCK;
        }
        if last < buf.len() {
            uncovered.push((last, buf.len()));
        }
        uncovered
    }
}

/// The device operations, staging-aware.
impl Shared {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        if self.staged_chunks.load(Ordering::SeqCst) == 0 || end <= self.data_offset {
            return self.inner.read_at(buf, offset);
        }
        // Staged blocks first: a block not staged now is on the device
        // (it leaves staging only once written there).
        for (from, to) in self.read_staged(buf, offset) {
            self.inner
                .read_at(&mut buf[from..to], offset + from as u64)?;
        }
        Ok(())
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        if self.stageable(offset, len) {
            return self.stage(bufs, offset, len);
        }
        if offset < self.data_offset {
            // Journal, checkpoints, superblock: what they record must be
            // on the device first.
            self.write_out(None)?;
        } else {
            self.write_out(Some((offset, offset + len)))?;
        }
        self.inner.write_vectored_at(bufs, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.write_out(None)?;
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let mut g = self.lock();
        loop {
            let busy = g
                .map
                .iter()
                .any(|(&n, c)| c.writing && self.overlaps(n, offset, end));
            if !busy {
                break;
            }
            g = self.wait(g);
        }
        let keys: Vec<u64> = g
            .map
            .keys()
            .copied()
            .filter(|&n| self.overlaps(n, offset, end))
            .collect();
        for n in keys {
            let s = self.chunk_offset(n);
            let first = offset.saturating_sub(s).div_ceil(BLOCK);
            let last = ((end - s).min(self.chunk_bytes)) / BLOCK;
            if let Some(c) = g.map.get_mut(&n)
                && last > first
            {
                c.staged &= !bits(first, last - first);
                c.done &= !bits(first, last - first);
                if c.staged == 0 && c.done == 0 {
                    g.map.remove(&n);
                }
            }
        }
        self.publish(&g);
        drop(g);
        self.inner.discard(offset, len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.write_out(None)?;
        self.inner.set_len(len)
    }
}

impl Backend for StagedDevice {
    fn len(&self) -> io::Result<u64> {
        self.shared.inner.len()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.shared.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.shared.write_vectored_at(&[buf], offset)
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        self.shared.write_vectored_at(bufs, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.shared.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.shared.discard(offset, len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.shared.set_len(len)
    }

    fn can_grow(&self) -> bool {
        self.shared.inner.can_grow()
    }

    fn name(&self) -> &str {
        self.shared.inner.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdcache_backend::MemBackend;
    use vdcache_backend::inject::HookedBackend;

    const DATA: u64 = 64 * BLOCK;

    fn staged(region_bytes: u64) -> (Arc<MemBackend>, StagedDevice) {
        let mem = Arc::new(MemBackend::new(
            "dev",
            vec![0; (DATA + 8 * region_bytes) as usize],
        ));
        let dev = StagedDevice::new(mem.clone(), DATA, region_bytes, false);
        (mem, dev)
    }

    fn block(v: u8) -> Vec<u8> {
        vec![v; BLOCK as usize]
    }

    fn read(d: &dyn Backend, offset: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        d.read_at(&mut b, offset).expect("read");
        b
    }

    #[test]
    fn runs_and_bits() {
        assert_eq!(runs(0b1110_0110).collect::<Vec<_>>(), vec![(1, 2), (5, 3)]);
        assert_eq!(runs(u64::MAX).collect::<Vec<_>>(), vec![(0, 64)]);
        assert_eq!(bits(0, 64), u64::MAX);
        assert_eq!(bits(62, 2), 3 << 62);
    }

    #[test]
    fn a_chunk_goes_out_in_one_write_when_complete() {
        let (mem, dev) = staged(1 << 20);
        assert_eq!(dev.shared.chunk_bytes, 256 << 10);
        for i in (0..64u64).rev() {
            dev.write_at(&block(i as u8 + 1), DATA + i * BLOCK)
                .expect("write");
            if i > 0 {
                // Nothing reached the device; reads see the staged bytes.
                assert_eq!(read(&*mem, DATA + i * BLOCK, 4096), block(0));
                assert_eq!(
                    read(&dev, DATA + i * BLOCK + 100, 10),
                    vec![i as u8 + 1; 10]
                );
            }
        }
        assert!(dev.shared.lock().map.is_empty());
        for i in 0..64u64 {
            assert_eq!(read(&*mem, DATA + i * BLOCK, 4096), block(i as u8 + 1));
        }
    }

    #[test]
    fn a_sync_or_a_metadata_write_writes_out_what_is_staged() {
        let (mem, dev) = staged(1 << 20);
        dev.write_vectored_at(&[&block(7), &block(8)], DATA + 3 * BLOCK)
            .expect("write");
        // A read across staged and unstaged bytes.
        let r = read(&dev, DATA + 2 * BLOCK + 4000, 4096 * 2 + 96);
        assert_eq!(&r[..96], &[0u8; 96][..]);
        assert!(r[96..96 + 4096].iter().all(|&b| b == 7));
        assert!(r[96 + 4096..].iter().all(|&b| b == 8));
        dev.write_at(&[1u8; 512], 0).expect("journal write");
        assert_eq!(read(&*mem, DATA + 3 * BLOCK, 4096), block(7));
        // The rest of the chunk still completes it, without rewriting.
        dev.write_at(&block(9), DATA + 5 * BLOCK).expect("write");
        dev.flush().expect("flush");
        assert_eq!(read(&*mem, DATA + 5 * BLOCK, 4096), block(9));
        let c = dev.shared.lock();
        let chunk = c.map.get(&0).expect("chunk");
        assert_eq!(chunk.staged, 0);
        assert_eq!(chunk.done, 0b11_1000);
    }

    #[test]
    fn a_discard_drops_staged_blocks() {
        let (mem, dev) = staged(64 << 10);
        assert_eq!(dev.shared.chunk_bytes, 64 << 10);
        dev.write_at(&block(5), DATA).expect("write");
        dev.discard(DATA, 64 << 10).expect("discard");
        dev.flush().expect("flush");
        assert_eq!(read(&*mem, DATA, 4096), block(0));
        assert!(dev.shared.lock().map.is_empty());
    }

    #[test]
    fn odd_region_sizes_stage_single_blocks() {
        let (mem, dev) = staged(3 * BLOCK);
        assert_eq!(dev.shared.chunk_bytes, BLOCK);
        dev.write_at(&block(4), DATA + BLOCK).expect("write");
        assert_eq!(read(&*mem, DATA + BLOCK, 4096), block(4));
    }

    #[test]
    fn the_staging_thread_writes_complete_chunks() {
        let mem = Arc::new(MemBackend::new("dev", vec![0; (DATA + (1 << 20)) as usize]));
        let dev = StagedDevice::new(mem.clone(), DATA, 256 << 10, true);
        let all: Vec<u8> = (0..64u64).flat_map(|i| block(i as u8 + 1)).collect();
        dev.write_at(&all[..63 * 4096], DATA).expect("write");
        dev.write_at(&all[63 * 4096..], DATA + 63 * BLOCK)
            .expect("write");
        // Readable while the thread writes it, and on the device after it.
        assert_eq!(read(&dev, DATA, all.len()), all);
        drop(dev);
        assert_eq!(read(&*mem, DATA, all.len()), all);
    }

    #[test]
    fn each_chunk_written_out_is_handed_to_the_page_cache_writeback() {
        let started = Arc::new(Mutex::new(Vec::new()));
        let log = started.clone();
        let mem = Arc::new(MemBackend::fixed("dev", (DATA + (1 << 20)) as usize));
        let hooked = HookedBackend::new(mem).on_start_writeback(move |offset, len| {
            log.lock().expect("log").push((offset, len));
        });
        let dev = StagedDevice::new(Arc::new(hooked), DATA, 64 << 10, false);
        let all: Vec<u8> = (0..32u64).flat_map(|i| block(i as u8 + 1)).collect();
        // Two whole chunks of 16 blocks, written out as they complete.
        dev.write_at(&all, DATA).expect("write");
        let chunks = vec![(DATA, 64 << 10), (DATA + (64 << 10), 64 << 10)];
        assert_eq!(*started.lock().expect("log"), chunks);
        // A part of a chunk waits for the sync, which writes it out too.
        dev.write_at(&block(9), DATA + (128 << 10)).expect("write");
        assert_eq!(started.lock().expect("log").len(), 2);
        dev.flush().expect("flush");
        assert_eq!(started.lock().expect("log").len(), 3);
    }

    #[test]
    fn a_chunk_that_failed_to_write_stays_staged_and_the_sync_reports_it() {
        let mem = Arc::new(MemBackend::fixed("dev", (DATA + (1 << 20)) as usize));
        let failing = Arc::new(AtomicBool::new(true));
        let fail = failing.clone();
        let flaky =
            HookedBackend::new(mem.clone()).on_write(move || match fail.load(Ordering::SeqCst) {
                true => Err(io::Error::other("injected write failure")),
                false => Ok(()),
            });
        let dev = StagedDevice::new(Arc::new(flaky), DATA, 64 << 10, true);
        let all: Vec<u8> = (0..16u64).flat_map(|i| block(i as u8 + 1)).collect();
        dev.write_at(&all, DATA).expect("staging a chunk succeeds");
        // The thread's write fails; the sync retries it and reports it.
        assert!(dev.flush().is_err());
        assert_eq!(read(&dev, DATA, all.len()), all);
        failing.store(false, Ordering::SeqCst);
        dev.flush().expect("the retried write succeeds");
        assert_eq!(read(&*mem, DATA, all.len()), all);
    }
}
