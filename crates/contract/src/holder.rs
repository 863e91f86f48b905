//! The back-channel of a layer that keeps copies of images across restarts
//! (a write-back flash cache): who it is, which image file a copy belongs
//! to, and whether it holds data the store lacks.
//!
//! This module defines the questions and the "holds nothing" answers; it
//! must not decide when to write back (the layer's policy) nor how an
//! image records its holder (the COW layer's header marks).

use crate::error::Result;
use crate::identity::ImageIdentity;
use crate::io::{DiskId, ImageHandle};

/// A layer below the COW layer that may hold an image's newest data (a
/// write-back flash cache), as an image's cache mark names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The layer's own id (a cache's superblock uuid).
    pub id: [u8; 16],
    /// Where it lives, for messages that tell how to recover.
    pub path: String,
}

/// A layer that keeps copies of images. Every method has the "holds
/// nothing" answer as its default.
pub trait CopyHolder: Send + Sync {
    /// The layer's identity, when it keeps copies of images across
    /// restarts (see [`Holder`]).
    fn holder(&self) -> Option<Holder> {
        None
    }

    /// Binds `image` to the identity found in its store (read past this
    /// layer), before the layer serves any copy it kept of it: copies of
    /// another file under the same name are dropped, and an error says why
    /// when they cannot be (data the file lacks).
    fn attach(&self, _image: &ImageHandle, _disk: DiskId, _identity: &ImageIdentity) -> Result<()> {
        Ok(())
    }

    /// Whether writes of `disk` may be held newer than the store
    /// (write-back).
    fn keeps_newer(&self, _disk: DiskId) -> bool {
        false
    }

    /// Whether the layer holds data of `image` that the store lacks.
    fn holds_newer(&self, _image: &ImageHandle) -> Result<bool> {
        Ok(false)
    }

    /// Writes everything of `image` the store lacks back to it, durably
    /// (partially valid blocks excepted: filling them needs the chain).
    fn write_back_image(&self, _image: &ImageHandle) -> Result<()> {
        Ok(())
    }
}

/// Plain I/O: no copies kept.
#[derive(Debug, Clone, Copy, Default)]
pub struct HoldsNothing;

impl CopyHolder for HoldsNothing {}
