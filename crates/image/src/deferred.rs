//! Deferred copy-on-write, for serving without a cache and in the cache's
//! write-through mode (where the cache never holds dirty data, so the
//! decoupled copy-on-write of write-back is out). A small allocating write
//! into a cluster the backing chain supplies is acknowledged once its new
//! host cluster is allocated; reading the filler, writing the cluster and
//! pointing the L2 entry at it happen on worker threads, with a copy of
//! the guest's bytes. The guest no longer waits for two round trips to the
//! store (read the filler, then write), and the store sees the same
//! requests as from an inline copy-on-write.
//!
//! Until its worker is done a cluster is pending: reads and writes of it
//! wait ([`DeferredFills::wait_clusters`]), and a flush waits for every
//! write acknowledged before it ([`DeferredFills::wait_acknowledged`]), so
//! a flush still makes every completed write durable (DESIGN invariant 1)
//! and a failed one fails the flush. A crash before then loses only writes
//! no flush covered, exactly as an inline copy-on-write does: its bytes
//! are unreachable until the L2 entry is written, which only a flush
//! orders. The new cluster is then at worst leaked (refcounted,
//! unreferenced), which recovery repairs.
//!
//! Deferral is for streams of writes: a guest that flushes after every
//! few writes would wait for the worker at its flush anyway, so only a disk
//! whose flush interval holds at least [`STREAM_WRITES`] writes defers
//! (a test may ask for fewer).
//!
//! This module owns the pending set, the queue and the workers; it plans
//! and writes nothing itself (`cow` does).

use crate::error::{ImageError, Result};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};

/// Deferred writes queued or running at most; an allocating write beyond
/// waits for one to finish (bounds the memory held, 64 KiB a write, and
/// the store's queue).
const MAX_PENDING: usize = 64;
/// Worker threads at most: each write is two round trips to the store, so
/// about this many run at once.
const MAX_WORKERS: usize = 32;
/// Writes in a flush interval (this one or the last) from which a serving
/// disk defers allocating writes.
pub const STREAM_WRITES: u64 = 64;

/// What a worker runs: the rest of one allocating write.
pub(crate) trait FillJob: Send + 'static {
    /// The guest cluster that stays pending until the job is done.
    fn cluster(&self) -> u64;
}

/// Runs a job against the disk it came from.
pub(crate) trait FillRunner<J: FillJob>: Send + Sync + 'static {
    fn run_fill(&self, job: J) -> Result<()>;
}

struct Queued<J> {
    seq: u64,
    job: J,
}

struct State<J> {
    /// Pending guest clusters and the sequence number of their fill.
    pending: BTreeMap<u64, u64>,
    jobs: VecDeque<Queued<J>>,
    next_seq: u64,
    workers: usize,
    idle: usize,
    /// Idle workers told to wake that have not taken a job yet (they
    /// still count in `idle`).
    woken: usize,
    closed: bool,
    /// Threads waiting in [`DeferredFills::wait_done`]: a finished fill
    /// wakes them (a wake-up is a system call, so none when nobody waits).
    waiters: usize,
    /// What the first write that failed said: every flush reports it from
    /// then on (an acknowledged write was lost; reporting it to one flush
    /// only could tell another connection's flush instead of the
    /// guest's).
    failure: Option<String>,
}

/// The pending fills of one disk.
pub(crate) struct DeferredFills<J: FillJob, R: FillRunner<J>> {
    state: Mutex<State<J>>,
    /// Signalled when a fill finishes (waiters for clusters, flushes and
    /// slots).
    done: Condvar,
    /// Signalled, once per job, when a job is queued (idle workers).
    queued: Condvar,
    /// Set once deferral is turned on ([`Self::enable`]).
    runner: OnceLock<Weak<R>>,
    /// Writes in a flush interval from which writes are deferred.
    stream_writes: AtomicU64,
    /// `pending.len()`, read without the lock on every request.
    pending_count: AtomicUsize,
    interval_writes: AtomicU64,
    last_interval_writes: AtomicU64,
    /// Fills deferred since the disk was opened.
    deferred: AtomicU64,
}

impl<J: FillJob, R: FillRunner<J>> std::fmt::Debug for DeferredFills<J, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredFills")
            .field("pending", &self.pending_count.load(Ordering::Relaxed))
            .field("deferred", &self.deferred.load(Ordering::Relaxed))
            .finish()
    }
}

impl<J: FillJob, R: FillRunner<J>> Default for DeferredFills<J, R> {
    fn default() -> Self {
        DeferredFills {
            state: Mutex::new(State {
                pending: BTreeMap::new(),
                jobs: VecDeque::new(),
                next_seq: 0,
                workers: 0,
                idle: 0,
                woken: 0,
                closed: false,
                waiters: 0,
                failure: None,
            }),
            done: Condvar::new(),
            queued: Condvar::new(),
            runner: OnceLock::new(),
            stream_writes: AtomicU64::new(STREAM_WRITES),
            pending_count: AtomicUsize::new(0),
            interval_writes: AtomicU64::new(0),
            last_interval_writes: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
        }
    }
}

impl<J: FillJob, R: FillRunner<J>> DeferredFills<J, R> {
    fn lock(&self) -> MutexGuard<'_, State<J>> {
        // Nothing is left half done under this lock by a panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a fill to finish.
    fn wait_done<'a>(&self, mut g: MutexGuard<'a, State<J>>) -> MutexGuard<'a, State<J>> {
        g.waiters += 1;
        let mut g = self.done.wait(g).unwrap_or_else(|p| p.into_inner());
        g.waiters -= 1;
        g
    }

    /// Turns deferral on from `stream_writes` writes in a flush interval;
    /// the workers run jobs against `runner` while it lives.
    pub(crate) fn enable(&self, runner: Weak<R>, stream_writes: u64) {
        self.stream_writes.store(stream_writes, Ordering::Relaxed);
        let _ = self.runner.set(runner);
    }

    /// Counts a guest write for the stream test.
    pub(crate) fn note_write(&self) {
        self.interval_writes.fetch_add(1, Ordering::Relaxed);
    }

    /// A flush ended the interval.
    fn note_flush(&self) {
        let n = self.interval_writes.swap(0, Ordering::Relaxed);
        self.last_interval_writes.store(n, Ordering::Relaxed);
    }

    /// Whether the next allocating write should defer its fill.
    pub(crate) fn wants_deferral(&self) -> bool {
        self.runner.get().is_some()
            && self
                .interval_writes
                .load(Ordering::Relaxed)
                .max(self.last_interval_writes.load(Ordering::Relaxed))
                >= self.stream_writes.load(Ordering::Relaxed)
    }

    /// Fills deferred since the disk was opened.
    pub(crate) fn deferred(&self) -> u64 {
        self.deferred.load(Ordering::Relaxed)
    }

    /// Marks `cluster` pending (waiting for a slot first) and returns the
    /// fill's sequence number. The caller holds the cluster's range lock,
    /// so nothing else has it pending.
    pub(crate) fn reserve(&self, cluster: u64) -> u64 {
        let mut g = self.lock();
        while g.pending.len() >= MAX_PENDING {
            g = self.wait_done(g);
        }
        let seq = g.next_seq;
        g.next_seq += 1;
        g.pending.insert(cluster, seq);
        self.pending_count.store(g.pending.len(), Ordering::SeqCst);
        seq
    }

    /// A reserved fill will not happen (its write failed before it was
    /// queued).
    pub(crate) fn cancel(&self, cluster: u64) {
        let mut g = self.lock();
        self.remove(&mut g, cluster);
    }

    fn remove(&self, g: &mut State<J>, cluster: u64) {
        g.pending.remove(&cluster);
        self.pending_count.store(g.pending.len(), Ordering::SeqCst);
        if g.waiters > 0 {
            self.done.notify_all();
        }
    }

    /// Queues a reserved fill, starting a worker if none is idle.
    pub(crate) fn submit(self: &Arc<Self>, seq: u64, job: J) -> Result<()> {
        let Some(runner) = self.runner.get().cloned() else {
            return Err(ImageError::corrupt("deferred write", "deferral is off"));
        };
        let mut g = self.lock();
        g.jobs.push_back(Queued { seq, job });
        self.deferred.fetch_add(1, Ordering::Relaxed);
        if g.idle > g.woken {
            g.woken += 1;
            self.queued.notify_one();
        } else if g.workers < MAX_WORKERS {
            let (queue, for_worker) = (self.clone(), runner.clone());
            let started = std::thread::Builder::new()
                .name("cow-fill".into())
                .spawn(move || queue.work(for_worker));
            match started {
                Ok(_) => g.workers += 1,
                // Without a new thread the busy workers take it in turn;
                // with none at all, the job runs here.
                Err(_) if g.workers > 0 => {}
                Err(e) => {
                    let Some(Queued { seq, job }) = g.jobs.pop_back() else {
                        return Ok(());
                    };
                    drop(g);
                    tracing::debug!("no thread for a deferred write ({e}): writing inline");
                    self.run(&runner, seq, job);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// A worker: runs queued jobs until the queue closes or the disk is
    /// gone.
    fn work(&self, runner: Weak<R>) {
        loop {
            let mut g = self.lock();
            let queued = loop {
                if let Some(q) = g.jobs.pop_front() {
                    break Some(q);
                }
                if g.closed {
                    break None;
                }
                g.idle += 1;
                g = self.queued.wait(g).unwrap_or_else(|p| p.into_inner());
                g.idle -= 1;
                g.woken = g.woken.saturating_sub(1);
            };
            let Some(Queued { seq, job }) = queued else {
                g.workers -= 1;
                return;
            };
            drop(g);
            self.run(&runner, seq, job);
        }
    }

    /// Runs a job and ends its cluster's pending state; a failure is kept
    /// for the next flush to report.
    fn run(&self, runner: &Weak<R>, seq: u64, job: J) {
        let cluster = job.cluster();
        let result = match runner.upgrade() {
            // A panic must not leave the cluster pending for ever (every
            // request of it, every flush and the close would wait).
            Some(r) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.run_fill(job)))
                .unwrap_or_else(|_| {
                    Err(ImageError::corrupt("deferred write", "its worker panicked"))
                }),
            None => Err(ImageError::corrupt("deferred write", "the disk is closed")),
        };
        let mut g = self.lock();
        if let Err(e) = result {
            tracing::error!(
                cluster,
                seq,
                "deferred copy-on-write failed: {e}; every flush fails until the disk is closed"
            );
            g.failure.get_or_insert(e.to_string());
        }
        self.remove(&mut g, cluster);
    }

    /// Waits until no cluster of `first..end` holds a write reserved
    /// before this call (under the range lock, no later one can be).
    pub(crate) fn wait_clusters(&self, first: u64, end: u64) {
        if self.pending_count.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut g = self.lock();
        let upto = g.next_seq;
        while g.pending.range(first..end).any(|(_, &s)| s < upto) {
            g = self.wait_done(g);
        }
    }

    /// Waits for every write reserved so far (a flush makes every write
    /// acknowledged before it durable); returns the error to report if a
    /// deferred write was ever lost.
    pub(crate) fn wait_acknowledged(&self) -> Option<ImageError> {
        let mut g = self.lock();
        let upto = g.next_seq;
        while g.pending.values().any(|&s| s < upto) {
            g = self.wait_done(g);
        }
        self.note_flush();
        g.failure
            .clone()
            .map(|cause| ImageError::DeferredWriteLost { cause })
    }

    /// Lets idle workers go; no job is queued after this.
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        self.queued.notify_all();
    }
}
