//! vdcache-replay: evaluation that drives the real engine and cache.
//!
//! Where `vdcache-eval` owns the pure tools (trace formats, FTL and cost
//! models, reports), this crate wires them to the real COW layer and flash
//! tier: [`scan`] sizes the disks and the working set, [`rig`] builds the
//! disks and the cache over in-memory stores, [`replay`] drives a trace
//! through them (seeding, with dedup on, what reads of never-written blocks
//! return), [`sweep`] repeats that over cache sizes, policies and dedup, and
//! [`FtlDevice`] watches the cache device's writes and discards through the
//! page-mapped FTL model. It must not re-implement any engine or cache
//! behaviour: every figure it reports comes from the real code.

mod blocks;
mod files;
mod ftl_device;
pub mod meter;
pub mod replay;
pub mod rig;
pub mod scan;
mod seed;
pub mod sweep;

pub use ftl_device::FtlDevice;
pub use replay::{
    CacheSize, DedupFigures, Progress, ReplayError, ReplayOptions, ReplayReport, replay_file,
};
pub use rig::{DiskLayout, RigConfig};
