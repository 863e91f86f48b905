//! vdcache-host's integration tests, one binary: each module is one of the
//! files beside this one, as its own doc comment says. One binary links
//! once instead of once per file, and its tests share one pool of test
//! threads (`cargo test -p vdcache-host --test integration <module>::` runs one
//! file's tests).

mod common;

mod decoupled;
mod dedup;
mod device;
mod faults;
mod full_device;
mod index_memory;
mod journal_aware;
mod metadata;
mod model;
mod syncs;
mod writeback_parallel;
mod writeback_race;
