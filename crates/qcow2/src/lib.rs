//! The qcow2 on-disk format: parsing, validation and encoding of every
//! structure an image holds (header and extensions, L1/L2 entries, refcount
//! blocks, compressed cluster descriptors, snapshot table, bitmap directory).
//!
//! This crate is pure: it never performs I/O and never decides policy. Every
//! value read from an image is validated before it is used, a malformed
//! structure yields a [`FormatError`] that names the offending field, and no
//! allocation is sized by a field that has not been checked against a limit.

pub mod bitmap;
pub mod cache_mark;
pub mod compressed;
pub mod entries;
pub mod error;
pub mod features;
pub mod fuzzing;
pub mod geometry;
pub mod header;
pub mod meta_journal;
pub mod refcount;
pub mod snapshot;

pub mod bytes;

pub use error::FormatError;
pub use geometry::{Geometry, GuestOffset, HostOffset};
pub use header::Header;

/// Result type of every parser in this crate.
pub type Result<T> = std::result::Result<T, FormatError>;
