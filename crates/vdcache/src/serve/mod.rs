//! `vdcache serve` and its companions (`stats`, `flush`, `recover`): the
//! daemon that exports disks over NBD through the shared flash cache.

pub use vdcache::config;
pub mod access;
pub mod control;
pub mod daemon;
pub mod export;
pub mod metrics;
pub mod preflight;
pub mod run;
