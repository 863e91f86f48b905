//! The vdcache crate's integration tests, one binary: each module is one
//! of the files beside this one (a capability or an issue's done-when
//! items, as its own doc comment says); the shared helpers are the
//! directories. One binary links once instead of once per file, and its
//! tests share one pool of test threads (`cargo test --test integration
//! <module>::` runs one file's tests).

mod common;
mod serving;
#[macro_use]
mod ext4;
mod malformed_gen;
mod qcow2_patch;

mod cache_crash;
mod careless;
mod cli_messages;
mod create_defaults;
mod damaged_cache;
mod demo;
mod fuse_ext4;
mod fuzz_bounded;
mod hardening;
mod hostile;
mod jbd2_kernel;
mod journal_device;
mod malformed;
mod malformed_corpus;
mod meta_journal;
mod nbd_abuse;
mod nbd_tools;
mod observability;
mod operator;
mod qemu_images;
mod qemu_io_workload;
mod read_merge;
mod readme;
mod replay_cli;
mod shares;
mod soak;
mod storage_faults;
mod storage_server;
mod store_restart;
mod vhost_user_guest;
mod vm_boot;
