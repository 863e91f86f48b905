//! The COW layer's side of the contract with the layers below it: every
//! storage I/O of this crate leaves through [`HostIo`], tagged with its
//! class and addresses. The contract itself (and the back-channels a layer
//! may offer) lives in `vdcache-contract`; this module only names it for
//! the COW layer's code and users, and must not add to it.

pub use vdcache_contract::{
    BackingFill, CopyHolder, CowHints, DCOW_BLOCK, DCOW_SECTOR, DirectIo, DiskId, FlushKind,
    GuestCluster, Holder, HostError, HostIo, ImageHandle, IoClass, IoCounters, IoCountersSnapshot,
    IoTag, MetaTable, PartialRange, PartialValidity, WriteSegment,
};
