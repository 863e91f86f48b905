//! `vdcache soak`: kill -9 restarts under load, judged by a flush-aware
//! record. See [`driver`] for one run, [`record`] for the rule, [`stamp`]
//! for how a sector names the write it holds, [`writer`] for the load and
//! [`server`] for the child process.

pub mod driver;
pub mod record;
pub mod server;
pub mod stamp;
pub mod writer;
