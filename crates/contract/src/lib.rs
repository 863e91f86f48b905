//! The contract between the COW layer (`vdcache-image`) and whatever lies
//! under it (the flash cache `vdcache-cache`, or the stores directly).
//!
//! It is the vocabulary both sides speak, and nothing else:
//! - [`HostIo`]: the plain I/O the COW layer issues (read, write, discard,
//!   flush), each request tagged with its class and addresses;
//! - the back-channels a layer below may offer, each a named trait reached
//!   through an accessor of [`HostIo`] whose default offers nothing:
//!   [`PartialValidity`] (decoupled copy-on-write: clusters kept partially
//!   valid, filled from the backing chain later), [`CowHints`] (what the
//!   COW layer knows will not be read again) and [`CopyHolder`] (a layer
//!   that keeps copies of images across restarts, possibly newer than the
//!   store);
//! - typed addresses ([`GuestOffset`], [`GuestCluster`], [`HostOffset`],
//!   [`ImageId`], [`CacheBlock`], [`LineKey`]) and the typed error
//!   ([`HostError`]) that crosses the boundary;
//! - which image a store holds ([`identity`]), as both sides must agree on
//!   it before a layer below serves a copy it kept.
//!
//! It must not contain policy (what to cache, when to write back, how to
//! order metadata) nor an I/O engine: [`DirectIo`] only forwards to the
//! image's store and counts, as the reference "nothing in between" layer.
//! Neither side's types appear here; a new front end or a new layer below
//! depends on this crate, never on the other side.

pub mod address;
pub mod direct;
pub mod error;
pub mod holder;
pub mod identity;
pub mod io;
pub mod partial;

pub use address::{CacheBlock, GuestCluster, GuestOffset, HostOffset, ImageId, LineKey};
pub use direct::{DirectIo, IoCounters, IoCountersSnapshot};
pub use error::{HostError, Result};
pub use holder::{CopyHolder, Holder, HoldsNothing};
pub use identity::{ImageIdentity, MarkIdentity, Verdict};
pub use io::{DiskId, FlushKind, HostIo, ImageHandle, IoClass, IoTag, MetaTable, WriteSegment};
pub use partial::{
    BackingFill, CowHints, DCOW_BLOCK, DCOW_SECTOR, NothingPartial, PartialRange, PartialValidity,
};
