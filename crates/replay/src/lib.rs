//! vdcache-replay: evaluation that drives the real engine and cache.
//!
//! Where `vdcache-eval` owns the pure tools (trace formats, FTL and cost
//! models, reports), this crate wires them to the real COW layer and flash
//! tier: [`FtlDevice`] watches a cache device's write and discard stream
//! through the page-mapped FTL model. It must not re-implement any engine
//! or cache behaviour: every figure it reports comes from the real code.

mod ftl_device;

pub use ftl_device::FtlDevice;
