//! vdcache-image's integration tests, one binary: each module is one of the
//! files beside this one, as its own doc comment says. One binary links
//! once instead of once per file, and its tests share one pool of test
//! threads (`cargo test -p vdcache-image --test integration <module>::` runs one
//! file's tests).

mod allocation_cost;
mod deferred_cow;
mod flush_unlocked;
mod fuzz_bounded;
mod lazy_refcounts;
mod meta_journal;
mod model;
