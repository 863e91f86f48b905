//! The partially-valid-range back-channel (decoupled copy-on-write, paper
//! 000 section 3.3) and the COW layer's hints to the layer below.
//!
//! A layer that keeps clusters partially valid lets the COW layer skip the
//! filler of an allocating write: the cluster's untouched blocks are marked
//! not yet valid, read from the backing chain meanwhile, and filled later
//! (by the COW layer, or by the layer itself through [`BackingFill`]).
//! Plain I/O keeps every cluster wholly valid: [`NothingPartial`].
//!
//! This module defines the questions and their "nothing partial" answers;
//! it must not decide when a cluster is kept partial (a policy of the layer
//! below) nor how the chain is read (the COW layer's).

use crate::address::{GuestCluster, HostOffset};
use crate::error::Result;
use crate::io::{DiskId, ImageHandle, IoTag};
use std::sync::Weak;

/// Granularity of the not yet valid marks of partially valid clusters
/// (decoupled copy-on-write).
pub const DCOW_BLOCK: u64 = 4096;
/// Granularity of validity inside a marked block: a write makes the
/// sectors it covers whole valid.
pub const DCOW_SECTOR: u64 = 512;

/// A range of an image that is not yet valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialRange {
    pub offset: HostOffset,
    pub len: u64,
    /// The guest cluster the range was allocated for (as tagged).
    pub guest_cluster: GuestCluster,
}

/// What the backing chain holds under a partially valid cluster of a top
/// image: the bytes its not yet valid parts stand for. Implemented by the
/// COW layer for the layer below, which calls it from its write-back
/// without holding any lock of its own.
pub trait BackingFill: Send + Sync {
    /// Fills `buf` with the backing chain's bytes under the top image's
    /// host range `[host, host+buf.len())`, recorded as serving
    /// `guest_cluster`. False (nothing read) when the range does not serve
    /// that guest cluster now (an orphaned record, a cluster reused): the
    /// caller then leaves the range as it is.
    fn backing_bytes(
        &self,
        host: HostOffset,
        guest_cluster: GuestCluster,
        buf: &mut [u8],
    ) -> Result<bool>;
}

/// A layer that keeps clusters partially valid. Every method has the
/// "nothing partial" answer as its default.
pub trait PartialValidity: Send + Sync {
    /// Whether this layer keeps clusters partially valid for `disk`: the
    /// COW layer may then skip the filler of an allocating write and mark
    /// the cluster's untouched blocks invalid instead.
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
    ) -> Result<()> {
        Ok(())
    }

    /// The not yet valid ranges inside `[offset, offset+len)`, as
    /// `(start, end)` host offsets.
    fn invalid_ranges(
        &self,
        _image: &ImageHandle,
        _offset: HostOffset,
        _len: u64,
    ) -> Result<Vec<(u64, u64)>> {
        Ok(Vec::new())
    }

    /// Every not yet valid range of an image, with the guest cluster it
    /// serves (for filling them from the backing chain).
    fn partial_ranges(&self, _image: &ImageHandle) -> Result<Vec<PartialRange>> {
        Ok(Vec::new())
    }

    /// Lets the layer fill the not yet valid parts of `image`'s partially
    /// valid clusters itself while it writes their valid parts back (the
    /// backing chain read once, the cluster written once). The layer keeps
    /// only the weak reference: a closed disk fills nothing.
    fn set_backing_fill(&self, _image: &ImageHandle, _fill: Weak<dyn BackingFill>) {}
}

/// What the COW layer knows about data it will not read again, for a layer
/// that keeps copies of backing images.
pub trait CowHints: Send + Sync {
    /// Whether this layer wants [`CowHints::forget`] hints for `disk`.
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
    ) -> Result<()> {
        Ok(())
    }
}

/// Plain I/O: every cluster wholly valid, no hint wanted.
#[derive(Debug, Clone, Copy, Default)]
pub struct NothingPartial;

impl PartialValidity for NothingPartial {}
impl CowHints for NothingPartial {}
