//! The plain I/O part of the contract: what one request of the COW layer
//! is (its class, the guest cluster it serves, the image and host offset it
//! touches) and the [`HostIo`] trait every layer below implements.
//!
//! Every I/O the COW layer issues is described by its class (guest data,
//! copy-on-write filler, or metadata of a named table), the guest cluster it
//! serves, and its host address (image in the chain and host offset). A
//! cache sits behind [`HostIo`] without touching the COW code.
//!
//! This module must not know qcow2 semantics beyond those tags, and holds no
//! back-channel: those are the named traits of [`crate::partial`] and
//! [`crate::holder`], reached through [`HostIo`]'s accessors.

use crate::address::{GuestCluster, HostOffset};
use crate::error::Result;
use crate::holder::{CopyHolder, HoldsNothing};
use crate::partial::{CowHints, NothingPartial, PartialValidity};
use std::sync::Arc;
use vdcache_backend::BackendRef;

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
    /// vdcache's per-disk metadata journal inside the image.
    Journal,
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
                    MetaTable::Journal => 7,
                }
            }
        }
    }

    pub const COUNT: usize = 11;

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
                MetaTable::Journal => "meta-journal",
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
            IoClass::Metadata(MetaTable::Journal),
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
    /// The guest cluster it serves; `None` for I/O that serves no single
    /// guest cluster.
    pub guest_cluster: Option<GuestCluster>,
    /// The unit (a whole metadata table, host offset and length) this I/O
    /// is part of: a layer may fetch all of it on a miss.
    pub unit: Option<(HostOffset, u32)>,
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

/// The narrow interface: all storage I/O of the COW layer goes through it.
///
/// The back-channels a layer may offer are separate traits; a layer that
/// offers one returns itself from the accessor ([`HostIo::partial`],
/// [`HostIo::hints`], [`HostIo::copies`]). The defaults offer nothing:
/// every cluster wholly valid, no hint wanted, no copy kept.
pub trait HostIo: Send + Sync + std::fmt::Debug {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()>;
    /// Writes segments back to back from `offset` (one request to the store).
    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<()>;
    /// Releases host space that no longer holds anything referenced.
    fn discard(&self, image: &ImageHandle, offset: HostOffset, len: u64, tag: IoTag) -> Result<()>;
    /// Orders (`Barrier`) or makes durable (`Durable`) completed writes to `image`.
    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> Result<()>;

    /// The image's length as the COW layer sees it: a layer that holds
    /// writes the store has not seen yet includes them.
    fn len(&self, image: &ImageHandle) -> Result<u64> {
        Ok(image.backend.len()?)
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
    ) -> Result<()> {
        for &(offset, data) in writes {
            self.write(image, offset, &[WriteSegment { data, tag }])?;
        }
        self.flush(image, FlushKind::Durable)
    }

    /// Partially valid clusters (decoupled copy-on-write), if this layer
    /// keeps them.
    fn partial(&self) -> &dyn PartialValidity {
        &NothingPartial
    }

    /// Where the COW layer's hints about data it will not read again go.
    fn hints(&self) -> &dyn CowHints {
        &NothingPartial
    }

    /// Copies of images this layer keeps across restarts, if it keeps any.
    fn copies(&self) -> &dyn CopyHolder {
        &HoldsNothing
    }
}
