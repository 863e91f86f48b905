//! The flash cache tier: a log-structured cache device shared by every disk
//! a server serves, sitting under the COW layer's narrow I/O interface
//! (`vdcache_contract::HostIo`). Layout follows SVD (paper 004, section III):
//! superblock, two checkpoint slots, a journal ring, and a data zone of
//! erase-block-sized regions filled append-only and reclaimed whole. The
//! index is COWCache's virtual cache map (paper 000, section 4.1).
//!
//! The tier sees each I/O's class and addresses but never interprets qcow2;
//! what to admit for which class is a policy decided above it.

pub mod admission;
mod checksums;
pub mod config;
pub mod dedup;
pub mod error;
pub mod group_sync;
mod guest_journal;
pub mod index;
pub mod journal;
pub mod layout;
pub mod region;
mod reinsertion;
mod replacement;
mod routing;
pub mod seal;
pub mod shares;
pub mod sites;
pub mod staging;
pub mod stats;
pub mod summary;
mod tier;

pub use config::{Admission, CacheConfig, CowMode, Dedup, DiskPolicy, WriteMode};
pub use error::{CacheError, Result};
pub use guest_journal::JournalCounts;
pub use region::Replacement;
pub use stats::{DeviceStats, DiskStats};
pub use tier::{
    Affected, CacheReport, DedupReport, DeviceContent, FlashCache, ImageReport, RecoveryReport,
    ShareReport,
};
