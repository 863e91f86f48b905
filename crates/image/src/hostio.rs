//! The one narrow interface through which the COW layer reaches storage.
//!
//! Every I/O the COW layer issues is described by its class (guest data,
//! copy-on-write filler, or metadata of a named table), the guest cluster it
//! serves, and its host address (image in the chain and host offset). A
//! cache sits behind [`HostIo`] without touching the COW code; the default
//! [`DirectIo`] forwards to the image's backend and counts what passes.
//!
//! This module must not know qcow2 semantics beyond those tags.

use crate::identity::ImageIdentity;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use vdcache_backend::BackendRef;
use vdcache_qcow2::HostOffset;

/// Which qcow2 table a metadata I/O touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaTable {
    Header,
    L1,
    L2,
    RefcountTable,
    RefcountBlock,
    SnapshotTable,
    Bitmap,
}

/// What an I/O carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoClass {
    /// Bytes the guest wrote or reads.
    GuestData,
    /// Bytes copied from the backing chain (or zeros) to complete a cluster
    /// the guest wrote only part of.
    CowFill,
    /// qcow2 metadata.
    Metadata(MetaTable),
    /// Space handed back after a cluster was freed.
    Reclaim,
}

impl IoClass {
    /// A dense index for per-class counters.
    pub fn index(self) -> usize {
        match self {
            IoClass::GuestData => 0,
            IoClass::CowFill => 1,
            IoClass::Reclaim => 2,
            IoClass::Metadata(t) => {
                3 + match t {
                    MetaTable::Header => 0,
                    MetaTable::L1 => 1,
                    MetaTable::L2 => 2,
                    MetaTable::RefcountTable => 3,
                    MetaTable::RefcountBlock => 4,
                    MetaTable::SnapshotTable => 5,
                    MetaTable::Bitmap => 6,
                }
            }
        }
    }

    pub const COUNT: usize = 10;

    pub fn name(self) -> &'static str {
        match self {
            IoClass::GuestData => "guest-data",
            IoClass::CowFill => "cow-fill",
            IoClass::Reclaim => "reclaim",
            IoClass::Metadata(t) => match t {
                MetaTable::Header => "meta-header",
                MetaTable::L1 => "meta-l1",
                MetaTable::L2 => "meta-l2",
                MetaTable::RefcountTable => "meta-refcount-table",
                MetaTable::RefcountBlock => "meta-refcount-block",
                MetaTable::SnapshotTable => "meta-snapshot-table",
                MetaTable::Bitmap => "meta-bitmap",
            },
        }
    }

    pub fn all() -> impl Iterator<Item = IoClass> {
        [
            IoClass::GuestData,
            IoClass::CowFill,
            IoClass::Reclaim,
            IoClass::Metadata(MetaTable::Header),
            IoClass::Metadata(MetaTable::L1),
            IoClass::Metadata(MetaTable::L2),
            IoClass::Metadata(MetaTable::RefcountTable),
            IoClass::Metadata(MetaTable::RefcountBlock),
            IoClass::Metadata(MetaTable::SnapshotTable),
            IoClass::Metadata(MetaTable::Bitmap),
        ]
        .into_iter()
    }
}

/// Identifies a virtual disk (one chain served to one guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DiskId(pub u32);

/// The guest side of an I/O: which disk and which guest cluster it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IoTag {
    pub class: IoClass,
    pub disk: DiskId,
    /// Guest cluster number (in units of the top image's cluster size);
    /// `None` for I/O that serves no single guest cluster.
    pub guest_cluster: Option<u64>,
    /// The unit (a whole metadata table, host offset and length) this I/O
    /// is part of: a layer may fetch all of it on a miss.
    pub unit: Option<(u64, u32)>,
}

impl IoTag {
    pub fn meta(table: MetaTable, disk: DiskId) -> IoTag {
        IoTag {
            class: IoClass::Metadata(table),
            disk,
            guest_cluster: None,
            unit: None,
        }
    }
}

/// Granularity of the not yet valid marks of partially valid clusters
/// (decoupled copy-on-write).
pub const DCOW_BLOCK: u64 = 4096;
/// Granularity of validity inside a marked block: a write makes the
/// sectors it covers whole valid.
pub const DCOW_SECTOR: u64 = 512;

/// An image file in a chain, as the layers below the COW layer see it.
#[derive(Debug, Clone)]
pub struct ImageHandle {
    /// Stable name (canonical path or URI); a cache keys on it.
    pub name: Arc<str>,
    /// Position in the chain: 0 is the top (writable) image.
    pub depth: u32,
    pub backend: BackendRef,
}

/// One piece of a write: bytes and what they are.
#[derive(Debug, Clone, Copy)]
pub struct WriteSegment<'a> {
    pub data: &'a [u8],
    pub tag: IoTag,
}

/// Why the COW layer flushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushKind {
    /// An ordering point between metadata writes: writes before it must be
    /// durable no later than writes after it. A layer that keeps its own
    /// ordered log may satisfy this without syncing.
    Barrier,
    /// The guest's flush (or a close): every completed write must be
    /// durable on return.
    Durable,
}

/// A layer below the COW layer that may hold an image's newest data (a
/// write-back flash cache), as an image's cache mark names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The layer's own id (a cache's superblock uuid).
    pub id: [u8; 16],
    /// Where it lives, for messages that tell how to recover.
    pub path: String,
}

/// What the backing chain holds under a partially valid cluster of a top
/// image: the bytes its not yet valid parts stand for. Implemented by the
/// COW layer for the layer below, which calls it from its write-back
/// without holding any lock of its own.
pub trait BackingFill: Send + Sync {
    /// Fills `buf` with the backing chain's bytes under the top image's
    /// host range `[host, host+buf.len())`, recorded as serving guest
    /// cluster `guest_cluster`. False (nothing read) when the range does
    /// not serve that guest cluster now (an orphaned record, a cluster
    /// reused): the caller then leaves the range as it is.
    fn backing_bytes(
        &self,
        host: HostOffset,
        guest_cluster: u64,
        buf: &mut [u8],
    ) -> io::Result<bool>;
}

/// The narrow interface: all storage I/O of the COW layer goes through it.
pub trait HostIo: Send + Sync + std::fmt::Debug {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> io::Result<()>;
    /// Writes segments back to back from `offset` (one request to the store).
    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> io::Result<()>;
    /// Releases host space that no longer holds anything referenced.
    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        tag: IoTag,
    ) -> io::Result<()>;
    /// Orders (`Barrier`) or makes durable (`Durable`) completed writes to `image`.
    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> io::Result<()>;

    /// The image's length as the COW layer sees it: a layer that holds
    /// writes the store has not seen yet includes them.
    fn len(&self, image: &ImageHandle) -> io::Result<u64> {
        image.backend.len()
    }

    /// Whether this layer keeps clusters partially valid for `disk`
    /// (decoupled copy-on-write, paper 000 section 3.3): the COW layer may
    /// then skip the filler of an allocating write and mark the cluster's
    /// untouched blocks invalid instead.
    fn decoupled_cow(&self, _disk: DiskId) -> bool {
        false
    }

    /// Marks `[offset, offset+len)` (whole [`DCOW_BLOCK`]s) of an image as
    /// not yet valid (`invalid`: read it from the backing chain) or valid.
    /// The record is durable no later than any later write of the layer.
    /// A later write makes the [`DCOW_SECTOR`]s it wholly covers valid (a
    /// sector it covers in part stays as it was: callers write whole
    /// sectors into marked blocks).
    fn set_invalid(
        &self,
        _image: &ImageHandle,
        _offset: HostOffset,
        _len: u64,
        _invalid: bool,
        _tag: IoTag,
    ) -> io::Result<()> {
        Ok(())
    }

    /// The not yet valid ranges inside `[offset, offset+len)`.
    fn invalid_ranges(
        &self,
        _image: &ImageHandle,
        _offset: HostOffset,
        _len: u64,
    ) -> io::Result<Vec<(u64, u64)>> {
        Ok(Vec::new())
    }

    /// Every not yet valid range of an image, with the guest cluster it
    /// serves (for filling them from the backing chain).
    fn partial_ranges(&self, _image: &ImageHandle) -> io::Result<Vec<PartialRange>> {
        Ok(Vec::new())
    }

    /// Lets the layer fill the not yet valid parts of `image`'s partially
    /// valid clusters itself while it writes their valid parts back (the
    /// backing chain read once, the cluster written once). The layer keeps
    /// only the weak reference: a closed disk fills nothing.
    fn set_backing_fill(&self, _image: &ImageHandle, _fill: std::sync::Weak<dyn BackingFill>) {}

    /// The layer's identity, when it keeps copies of images across
    /// restarts (see [`Holder`]).
    fn holder(&self) -> Option<Holder> {
        None
    }

    /// Binds `image` to the identity found in its store (read past this
    /// layer), before the layer serves any copy it kept of it: copies of
    /// another file under the same name are dropped, and an error says why
    /// when they cannot be (data the file lacks).
    fn attach(
        &self,
        _image: &ImageHandle,
        _disk: DiskId,
        _identity: &ImageIdentity,
    ) -> io::Result<()> {
        Ok(())
    }

    /// Whether writes of `disk` may be held newer than the store
    /// (write-back).
    fn keeps_newer(&self, _disk: DiskId) -> bool {
        false
    }

    /// Whether the layer holds data of `image` that the store lacks.
    fn holds_newer(&self, _image: &ImageHandle) -> io::Result<bool> {
        Ok(false)
    }

    /// Writes everything of `image` the store lacks back to it, durably
    /// (partially valid blocks excepted: filling them needs the chain).
    fn write_back_image(&self, _image: &ImageHandle) -> io::Result<()> {
        Ok(())
    }

    /// Writes `data` to the store itself and makes it durable, keeping any
    /// copy this layer holds equal to it: for header bits that a program
    /// reading the file without this layer must see.
    ///
    /// The writes may land in any order (each must be safe on its own);
    /// all of them are durable on return.
    fn write_durable(
        &self,
        image: &ImageHandle,
        writes: &[(HostOffset, &[u8])],
        tag: IoTag,
    ) -> io::Result<()> {
        for &(offset, data) in writes {
            self.write(image, offset, &[WriteSegment { data, tag }])?;
        }
        self.flush(image, FlushKind::Durable)
    }

    /// Whether this layer wants [`HostIo::forget`] hints for `disk`.
    fn wants_masked_hints(&self, _disk: DiskId) -> bool {
        false
    }

    /// A hint: cached copies of this range of a backing image will not be
    /// read again through `tag.disk` (a write to the top image masked them).
    fn forget(
        &self,
        _image: &ImageHandle,
        _offset: HostOffset,
        _len: u64,
        _tag: IoTag,
    ) -> io::Result<()> {
        Ok(())
    }
}

/// A range of an image that is not yet valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialRange {
    pub offset: u64,
    pub len: u64,
    /// Guest cluster number the range was allocated for (as tagged).
    pub guest_cluster: u64,
}

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
    ) -> io::Result<()> {
        self.counters.count_read(tag.class, buf.len() as u64);
        image.backend.read_at(buf, offset.0)
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> io::Result<()> {
        self.counters.count_write(segments);
        match segments {
            [one] => image.backend.write_at(one.data, offset.0),
            _ => {
                let bufs: Vec<&[u8]> = segments.iter().map(|s| s.data).collect();
                image.backend.write_vectored_at(&bufs, offset.0)
            }
        }
    }

    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        _tag: IoTag,
    ) -> io::Result<()> {
        image.backend.discard(offset.0, len)
    }

    fn flush(&self, image: &ImageHandle, _kind: FlushKind) -> io::Result<()> {
        self.counters.count_flush();
        image.backend.flush()
    }
}
