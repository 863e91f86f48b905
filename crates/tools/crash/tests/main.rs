//! vdcache-crash's integration tests, one binary: each module is one of the
//! files beside this one, as its own doc comment says. One binary links
//! once instead of once per file, and its tests share one pool of test
//! threads (`cargo test -p vdcache-crash --test integration <module>::` runs one
//! file's tests).

mod bypass;
mod cache;
mod clean_copies;
mod cow_aware;
mod harness_fails;
mod journal_aware;
mod meta_journal;
mod production_recovery;
mod qcow2_engine;
mod store_restart;
