//! The virtio-blk device a guest sees over vhost-user: its features, its
//! configuration space and its queues, each served by a worker thread of
//! its own that pops requests, carries them out (`request`) and returns
//! them to the used ring.
//!
//! Owns: feature negotiation, the config space bytes, the guest memory
//! table of the current connection, and the per-queue loop (notification
//! suppression with EVENT_IDX). Must not: keep guest memory across
//! connections (a reconnecting QEMU sends a new table), let a request
//! error stop a queue (the guest gets IOERR and the queue goes on), or
//! loop on a ring the guest broke (`ring` stops that queue alone).

use crate::failure_log::FailureLog;
use crate::inflight::{InOrder, Job, Pool};
use crate::request::{self, BlockDevice, Kind, MAX_SEGMENTS, SECTOR};
use crate::ring::{self, RingFault, Stops};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

/// Requests of one queue carried out at once (worker threads per queue).
pub const WORKERS_PER_QUEUE: usize = 8;
/// How long stopping a queue waits for its requests in flight.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Descriptors per queue (QEMU's default queue size for vhost-user-blk is
/// 128; the guest may ask for fewer).
const QUEUE_SIZE: usize = 1024;
/// Data segments per request the guest may use (the queue size, less the
/// header and status descriptors).
const SEG_MAX: u32 = 128 - 2;

/// Counts of what the guest asked, for the server's stats.
#[derive(Debug, Default)]
pub struct Counters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub errors: AtomicU64,
}

impl Counters {
    /// A snapshot of the counters.
    pub fn totals(&self) -> crate::Totals {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        crate::Totals {
            reads: get(&self.reads),
            writes: get(&self.writes),
            read_bytes: get(&self.read_bytes),
            written_bytes: get(&self.written_bytes),
            flushes: get(&self.flushes),
            discards: get(&self.discards),
            errors: get(&self.errors),
        }
    }

    /// Requests of any kind, failed ones included.
    pub fn total(&self) -> u64 {
        [
            &self.reads,
            &self.writes,
            &self.flushes,
            &self.discards,
            &self.errors,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }

    fn count(&self, kind: &Kind) {
        let bump = |c: &AtomicU64, n: u64| {
            c.fetch_add(n, Ordering::Relaxed);
        };
        match *kind {
            Kind::Read(n) => {
                bump(&self.reads, 1);
                bump(&self.read_bytes, n);
            }
            Kind::Write(n) => {
                bump(&self.writes, 1);
                bump(&self.written_bytes, n);
            }
            Kind::Flush => bump(&self.flushes, 1),
            Kind::Discard | Kind::WriteZeroes => bump(&self.discards, 1),
            Kind::GetId => {}
        }
    }
}

/// One vhost-user-blk device (shared by the connection's threads).
pub struct Device {
    name: String,
    disk: Arc<dyn BlockDevice + Send + Sync>,
    queues: usize,
    event_idx: AtomicBool,
    mem: Mutex<Option<GuestMemoryAtomic<GuestMemoryMmap>>>,
    pub(crate) counters: Arc<Counters>,
    in_order: InOrder,
    /// Queues stopped for a ring the guest broke.
    pub(crate) stops: Stops,
    failures: FailureLog,
    workers_per_queue: usize,
    /// The connection is ending: queue loops return to their thread's
    /// event loop (which ends it) even while the guest keeps posting.
    closing: AtomicBool,
    /// The exit events' consumer ends handed to the library, which never
    /// closes them (see `exit_event`).
    exit_consumers: Mutex<Vec<RawFd>>,
    /// The current connection's workers (started by its first request).
    pool: Mutex<Option<Pool>>,
}

/// The backend the vhost-user library drives: a handle on the device.
#[derive(Clone)]
pub struct Backend(pub(crate) Arc<Device>);

impl Device {
    /// A device of `queues` queues, each carrying out up to
    /// `workers_per_queue` requests at once.
    pub fn new(
        name: String,
        disk: Arc<dyn BlockDevice + Send + Sync>,
        queues: usize,
        workers_per_queue: usize,
        counters: Arc<Counters>,
    ) -> Device {
        let queues = queues.max(1);
        Device {
            name,
            disk,
            queues,
            event_idx: AtomicBool::new(false),
            mem: Mutex::new(None),
            counters,
            in_order: InOrder::new(queues),
            stops: Stops::new(queues),
            failures: FailureLog::default(),
            workers_per_queue: workers_per_queue.max(1),
            closing: AtomicBool::new(false),
            exit_consumers: Mutex::new(Vec::new()),
            pool: Mutex::new(None),
        }
    }

    /// A new connection: its queues start numbering afresh, and none is
    /// stopped.
    pub fn start_connection(&self) {
        self.in_order.reset();
        self.stops.restart_all();
        self.closing.store(false, Ordering::SeqCst);
    }

    /// The connection ended (or is being shut): no queue loop takes
    /// another request, so that its thread can be joined.
    pub fn end_connection(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    /// Closes the exit events handed to the library for a daemon that is
    /// gone: each connection would leak one per queue thread otherwise,
    /// until vdcache could open no file at all.
    pub fn close_exit_events(&self) {
        let fds = std::mem::take(
            &mut *self
                .exit_consumers
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for fd in fds {
            // SAFETY: `fd` is the consumer end of an eventfd `exit_event`
            // made and gave to vhost-user-backend 0.24 (pinned in
            // Cargo.toml), whose VringEpollHandler::new takes it with
            // `into_raw_fd()`, adds it to the handler's epoll and never
            // closes it. The caller has dropped the daemon those handlers
            // belonged to, after its connection thread ended: the
            // handlers' threads are joined and their epolls closed, so no
            // one holds the fd, and this is its one close.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }

    fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// After a connection ended (its queue threads joined): lets every
    /// request handed to a worker finish, and joins the workers.
    pub fn finish_requests(&self) {
        let pool = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(pool);
    }

    /// Carries out one popped request on a worker and publishes its
    /// completion in order.
    fn run_job(&self, job: Job) {
        let head = job.chain.head_index();
        let (len, outcome) = request::serve(&*self.disk, job.chain);
        match outcome {
            Ok(kind) => self.counters.count(&kind),
            Err(e) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                self.failures.note(&self.name, &e);
            }
        }
        match self
            .in_order
            .complete(job.queue, job.seq, head, len, &job.vring)
        {
            Ok(false) => {}
            Ok(true) => {
                let event_idx = self.event_idx.load(Ordering::Relaxed);
                let notify = !event_idx || job.vring.needs_notification().unwrap_or(true);
                if notify && let Err(e) = job.vring.signal_used_queue() {
                    tracing::warn!(export = %self.name, "vhost-user-blk: cannot notify the guest: {e}");
                }
            }
            Err(e) => self.stop_queue(job.queue, job.epoch, &RingFault::used(&job.vring, e)),
        }
    }

    /// Waits until every request taken from `queue` was completed (false:
    /// not within the time a stop waits).
    pub(crate) fn wait_idle(&self, queue: usize) -> bool {
        self.in_order.wait_idle(queue, STOP_WAIT)
    }

    /// Stops `queue` for `fault` (unless restarted since `epoch`), with
    /// one log line.
    fn stop_queue(&self, queue: usize, epoch: u64, fault: &RingFault) {
        if self.stops.stop(queue, epoch) {
            tracing::error!(
                export = %self.name,
                "vhost-user-blk: queue {queue} stopped until the guest resets the device: {fault}"
            );
        }
    }

    /// virtio-blk's configuration space (virtio 1.2, 5.2.4), little endian.
    pub fn config_space(&self) -> Vec<u8> {
        let mut c = vec![0u8; 60];
        let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &(self.disk.size() / SECTOR).to_le_bytes()); // capacity
        put(12, &SEG_MAX.to_le_bytes()); // seg_max
        put(20, &4096u32.to_le_bytes()); // blk_size
        put(34, &(self.queues as u16).to_le_bytes()); // num_queues
        let max_sectors = (u32::MAX / 512) & !7;
        put(36, &max_sectors.to_le_bytes()); // max_discard_sectors
        put(40, &MAX_SEGMENTS.to_le_bytes()); // max_discard_seg
        put(44, &8u32.to_le_bytes()); // discard_sector_alignment (4 KiB)
        put(48, &max_sectors.to_le_bytes()); // max_write_zeroes_sectors
        put(52, &MAX_SEGMENTS.to_le_bytes()); // max_write_zeroes_seg
        put(56, &[1]); // write_zeroes_may_unmap
        c
    }

    /// Pops every request queued on `vring` and hands each to a worker; a
    /// broken ring stops the queue (see `ring`), a stopped queue's kick is
    /// dropped.
    fn serve_queue(
        self: &Arc<Self>,
        queue: usize,
        vring: &VringRwLock,
        mem: &GuestMemoryAtomic<GuestMemoryMmap>,
    ) -> io::Result<()> {
        let Some(epoch) = self.stops.serving(queue) else {
            return Ok(());
        };
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.is_none() {
            let device = self.clone();
            let serve: Arc<dyn Fn(Job) + Send + Sync> = Arc::new(move |job| device.run_job(job));
            *pool = Some(Pool::start(self.workers_per_queue * self.queues, serve)?);
        }
        let Some(pool) = pool.as_ref() else {
            return Ok(());
        };
        if let Err(fault) = self.hand_out(queue, epoch, vring, mem, pool) {
            self.stop_queue(queue, epoch, &fault);
        }
        Ok(())
    }

    fn hand_out(
        &self,
        queue: usize,
        epoch: u64,
        vring: &VringRwLock,
        mem: &GuestMemoryAtomic<GuestMemoryMmap>,
        pool: &Pool,
    ) -> Result<(), RingFault> {
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        // The ring said more requests were available after the last pass.
        let mut promised = false;
        while !self.closing() {
            if event_idx {
                vring
                    .disable_notification()
                    .map_err(|e| RingFault::used(vring, e))?;
            }
            let mut taken = 0u64;
            while !self.closing()
                && let Some(chain) = ring::pop(vring, mem)?
            {
                taken += 1;
                let job = Job {
                    queue,
                    epoch,
                    seq: self.in_order.next_seq(queue),
                    chain,
                    vring: vring.clone(),
                };
                if let Err(job) = pool.submit(job) {
                    // The pool closed under us (the connection is ending):
                    // serve it here rather than lose it.
                    self.run_job(*job);
                }
            }
            if promised && taken == 0 {
                // Never loop on a promise no pass keeps: either the front
                // end stopped the queue meanwhile or the guest plays with
                // the index.
                return if ring::started(vring) {
                    Err(RingFault::Unsteady)
                } else {
                    Ok(())
                };
            }
            // With EVENT_IDX, requests queued while notifications were off
            // are served before waiting for a kick again.
            if !event_idx {
                return Ok(());
            }
            promised = vring
                .enable_notification()
                .map_err(|e| RingFault::used(vring, e))?;
            if !promised {
                return Ok(());
            }
        }
        Ok(())
    }
}

impl VhostUserBackend for Backend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        self.0.queues
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        let mut f = 1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_FLUSH
            | 1 << VIRTIO_BLK_F_MQ
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.0.disk.read_only() {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ
    }

    fn set_event_idx(&self, enabled: bool) {
        self.0.event_idx.store(enabled, Ordering::Relaxed);
    }

    /// RESET_DEVICE: no queue stays stopped.
    fn reset_device(&self) {
        self.0.stops.restart_all();
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = self.0.config_space();
        let start = (offset as usize).min(space.len());
        let end = start.saturating_add(size as usize).min(space.len());
        let mut out = space[start..end].to_vec();
        out.resize(size as usize, 0);
        out
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> io::Result<()> {
        *self.0.mem.lock().unwrap_or_else(PoisonError::into_inner) = Some(mem);
        Ok(())
    }

    /// One worker thread per queue: queues are served in parallel.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.0.queues).map(|q| 1u64 << q).collect()
    }

    /// The library keeps the notifier (and closes it) but leaks the
    /// consumer: its fd is noted here and closed by `close_exit_events`.
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK) {
            Ok(pair) => {
                self.0
                    .exit_consumers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(pair.0.as_raw_fd());
                Some(pair)
            }
            Err(e) => {
                tracing::error!("vhost-user-blk: cannot make an exit event: {e}");
                None
            }
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event {evset:?}")));
        }
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Err(io::Error::other(format!("no queue {device_event}")));
        };
        let mem = self
            .0
            .mem
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(mem) = mem else {
            return Err(io::Error::other(
                "a queue was kicked before the memory table came",
            ));
        };
        // One queue per thread (see `queues_per_thread`): the thread's
        // number is the queue's.
        self.0.serve_queue(thread_id, vring, &mem)
    }

    /// QEMU reads the queue's index next: every request popped is
    /// published first. The front end configures the queue afresh after
    /// this (a guest's device reset does this), so a queue stopped for a
    /// broken ring is served again.
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if !self.0.wait_idle(queue_index as usize) {
            tracing::error!(
                export = %self.0.name,
                "vhost-user-blk: queue {queue_index} still has requests in flight after {STOP_WAIT:?}"
            );
        }
        self.0.stops.restart(queue_index as usize);
        Ok(())
    }
}
