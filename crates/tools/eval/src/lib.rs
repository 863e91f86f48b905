//! vdcache-eval: the pure parts of the evaluation toolbox (issue 6).
//!
//! This crate owns everything about evaluation that needs neither the COW
//! layer nor the cache: reading and writing block traces ([`trace`]),
//! generating synthetic workloads ([`workload`]; not `gen`, a reserved
//! keyword in edition 2024), a page-mapped FTL model for
//! flash erases and write amplification ([`ftl`]), a device cost model and a
//! latency histogram ([`cost`]), and Markdown/JSON/SVG/PNG output
//! ([`report`]).
//!
//! It must not depend on the engine crates (image, backend, cache): the
//! replayer that drives the real engine lives elsewhere and consumes the types
//! defined here ([`trace::TraceRecord`], [`ftl::Ftl`], [`cost::DeviceModel`],
//! [`cost::LatencyHistogram`], the [`report`] helpers).

pub mod cost;
pub mod ftl;
pub mod report;
pub mod trace;
pub mod workload;

pub use trace::{Format, Op, TraceError, TraceRecord, open_trace};
