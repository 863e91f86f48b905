//! The image / COW layer: opens qcow2 chains (delta over backing images
//! over raw), maps guest offsets, allocates clusters and keeps refcounts,
//! performs copy-on-write (per subcluster with extended L2 entries),
//! discards and zero writes, and orders metadata writes so that a crash
//! never leaves a flushed write unreadable. It owns the metadata cache.
//!
//! All storage I/O leaves through [`hostio::HostIo`] (the contract of
//! `vdcache-contract`), tagged with its class and addresses, so a cache can
//! sit underneath without this crate knowing.

mod beside;
pub mod chain;
pub mod check;
mod confine;
mod cow;
pub mod create;
mod deferred;
pub mod disk;
pub mod error;
pub mod fuzzing;
pub mod hostio;
pub use vdcache_contract::identity;
pub mod meta_cache;
pub mod qimage;
mod range_lock;

/// The unit of a disk's size, as QEMU counts it: a disk is whole sectors.
pub const SECTOR: u64 = 512;

pub use chain::{
    ImageFormat, JournalMode, LocalFiles, MemFiles, OpenOptions, StoreOpener, Stores, open_chain,
};
pub use check::CheckReport;
pub use create::{CreateOptions, create_qcow2, create_raw, qcow2_image_bytes};
pub use deferred::STREAM_WRITES;
pub use disk::{BlockState, FillReport, Layer, VirtualDisk, ZeroFlags};
pub use error::{ImageError, Result};
pub use hostio::{
    BackingFill, DirectIo, DiskId, FlushKind, Holder, HostError, HostIo, ImageHandle, IoClass,
    IoTag, MetaTable, PartialRange, WriteSegment,
};
pub use identity::{ImageIdentity, MarkIdentity, Verdict};
pub use meta_cache::MetaCacheConfig;
pub use qimage::{Qcow2Image, TableReads, abandon_cache};
