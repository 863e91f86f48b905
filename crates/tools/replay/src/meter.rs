//! What replay charges a device for: every I/O that reaches a store is
//! counted (bytes, syncs) and priced by the device's cost model, so a
//! request's modelled latency is the sum of the service times of the I/Os
//! it caused, in order (open loop: no queueing, no overlap). It must not
//! change what the I/O does.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use vdcache_backend::{Backend, BackendRef};
use vdcache_eval::Op;
use vdcache_eval::cost::{DeviceModel, DeviceProfile};

/// Counters and cost model of one device (all stores on it share one).
#[derive(Debug)]
pub struct Meter {
    model: Mutex<DeviceModel>,
    pending_ns: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    syncs: AtomicU64,
}

/// A copy of a meter's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MeterCounts {
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    pub busy_ns: u64,
}

impl Meter {
    pub fn new(profile: DeviceProfile) -> Arc<Meter> {
        Arc::new(Meter {
            model: Mutex::new(DeviceModel::new(profile)),
            pending_ns: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
        })
    }

    pub fn profile(&self) -> DeviceProfile {
        self.model().profile
    }

    fn model(&self) -> std::sync::MutexGuard<'_, DeviceModel> {
        // A model is a head position and a sum: nothing a panic can tear.
        self.model.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn charge(&self, op: Op, offset: u64, len: u64) {
        let ns = self.model().service(op, offset, len);
        self.pending_ns.fetch_add(ns, Ordering::Relaxed);
        let counter = match op {
            Op::Read => &self.bytes_read,
            Op::Write => &self.bytes_written,
            Op::Flush => {
                self.syncs.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Op::Discard => return,
        };
        counter.fetch_add(len, Ordering::Relaxed);
    }

    /// Service time charged since the last call.
    pub fn take_pending_ns(&self) -> u64 {
        self.pending_ns.swap(0, Ordering::Relaxed)
    }

    pub fn counts(&self) -> MeterCounts {
        MeterCounts {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            busy_ns: self.model().busy_ns(),
        }
    }
}

/// A store whose I/O is charged to a [`Meter`].
#[derive(Debug)]
pub struct MeteredStore {
    inner: BackendRef,
    meter: Arc<Meter>,
}

impl MeteredStore {
    pub fn new(inner: BackendRef, meter: &Arc<Meter>) -> Arc<MeteredStore> {
        Arc::new(MeteredStore {
            inner,
            meter: meter.clone(),
        })
    }
}

impl Backend for MeteredStore {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.meter.charge(Op::Read, offset, buf.len() as u64);
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.meter.charge(Op::Write, offset, buf.len() as u64);
        self.inner.write_at(buf, offset)
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.meter.charge(Op::Write, offset, len);
        self.inner.write_vectored_at(bufs, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.meter.charge(Op::Flush, 0, 0);
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.meter.charge(Op::Discard, offset, len);
        self.inner.discard(offset, len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn can_grow(&self) -> bool {
        self.inner.can_grow()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }
}
