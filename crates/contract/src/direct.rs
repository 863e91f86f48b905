//! The reference layer with nothing in between: [`DirectIo`] forwards
//! every request to the image's store and counts what passes
//! ([`IoCounters`]), so benchmarks and tests measure the COW layer's own
//! I/O at the interface.
//!
//! It must stay a pass-through: no caching, no reordering, no policy; it
//! offers none of the back-channels (the [`HostIo`] defaults).

use crate::address::HostOffset;
use crate::error::Result;
use crate::io::{FlushKind, HostIo, ImageHandle, IoClass, IoTag, WriteSegment};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes and requests per class, and syncs: what a benchmark or a test
/// counts at the interface.
#[derive(Debug, Default)]
pub struct IoCounters {
    read_bytes: [AtomicU64; IoClass::COUNT],
    read_ops: [AtomicU64; IoClass::COUNT],
    write_bytes: [AtomicU64; IoClass::COUNT],
    write_ops: [AtomicU64; IoClass::COUNT],
    flushes: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IoCountersSnapshot {
    pub read_bytes: [u64; IoClass::COUNT],
    pub read_ops: [u64; IoClass::COUNT],
    pub write_bytes: [u64; IoClass::COUNT],
    pub write_ops: [u64; IoClass::COUNT],
    pub flushes: u64,
}

impl IoCountersSnapshot {
    pub fn read(&self, class: IoClass) -> u64 {
        self.read_bytes[class.index()]
    }
    pub fn written(&self, class: IoClass) -> u64 {
        self.write_bytes[class.index()]
    }
    pub fn total_written(&self) -> u64 {
        self.write_bytes.iter().sum()
    }
    pub fn total_read(&self) -> u64 {
        self.read_bytes.iter().sum()
    }
    pub fn metadata_written(&self) -> u64 {
        IoClass::all()
            .filter(|c| matches!(c, IoClass::Metadata(_)))
            .map(|c| self.written(c))
            .sum()
    }
}

impl IoCounters {
    pub fn count_read(&self, class: IoClass, bytes: u64) {
        self.read_bytes[class.index()].fetch_add(bytes, Ordering::Relaxed);
        self.read_ops[class.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_write(&self, segments: &[WriteSegment<'_>]) {
        for s in segments {
            self.write_bytes[s.tag.class.index()].fetch_add(s.data.len() as u64, Ordering::Relaxed);
        }
        if let Some(first) = segments.first() {
            self.write_ops[first.tag.class.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn count_flush(&self) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> IoCountersSnapshot {
        let load = |a: &[AtomicU64; IoClass::COUNT]| {
            let mut out = [0u64; IoClass::COUNT];
            for (o, v) in out.iter_mut().zip(a) {
                *o = v.load(Ordering::Relaxed);
            }
            out
        };
        IoCountersSnapshot {
            read_bytes: load(&self.read_bytes),
            read_ops: load(&self.read_ops),
            write_bytes: load(&self.write_bytes),
            write_ops: load(&self.write_ops),
            flushes: self.flushes.load(Ordering::Relaxed),
        }
    }
}

/// Forwards every I/O to the image's backend, counting it.
#[derive(Debug, Default)]
pub struct DirectIo {
    pub counters: IoCounters,
}

impl DirectIo {
    pub fn new() -> Arc<DirectIo> {
        Arc::new(DirectIo::default())
    }
}

impl HostIo for DirectIo {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()> {
        self.counters.count_read(tag.class, buf.len() as u64);
        Ok(image.backend.read_at(buf, offset.0)?)
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<()> {
        self.counters.count_write(segments);
        match segments {
            [one] => image.backend.write_at(one.data, offset.0)?,
            _ => {
                let bufs: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
                image.backend.write_vectored_at(&bufs, offset.0)?
            }
        }
        Ok(())
    }

    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        _tag: IoTag,
    ) -> Result<()> {
        Ok(image.backend.discard(offset.0, len)?)
    }

    fn flush(&self, image: &ImageHandle, _kind: FlushKind) -> Result<()> {
        self.counters.count_flush();
        Ok(image.backend.flush()?)
    }
}
