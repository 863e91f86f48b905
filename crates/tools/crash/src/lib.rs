//! The crash harness: runs a seeded guest workload against a
//! [`vdcache_image::VirtualDisk`] whose storage is recorded
//! ([`vdcache_backend::recording`]), then for many crash points and crash
//! states rebuilds the devices as a crash could have left them, runs the
//! target's recovery, and checks DESIGN.md's invariants: flushed (or FUA)
//! data reads back exactly, unflushed data reads one of the values it had
//! since the last flush (never stale, never garbage), and after a clean
//! close every image checks clean (leaks allowed and counted), optionally
//! with the real `qemu-img check`.
//!
//! What is under test is pluggable through [`CrashTarget`]: the plain
//! qcow2 engine today ([`Qcow2Target`]), the flash cache under it later.
//! A cache target registers its cache device next to the images in
//! `create` ([`RecordingFiles::insert_fixed`]), opens the chain through the
//! cache in `open`, and in `recover` rebuilds the cache from
//! `state.device(name)` before opening the chain through it (or wrap an
//! existing target's recovery with [`WithRecovery`]). A target that
//! recovers from [`mem_files`] also implements `recover_from`, which the
//! harness calls with those stores already built in reused buffers.
//!
//! Fault models beside the crash itself: [`damage`] damages each
//! metadata structure of a cache device in process-crash states and
//! requires a refusal naming the damage or exact reads.
//! Another, a storage server that restarts and loses its
//! volatile cache while the target keeps running, is swept by
//! [`run_restarts`] (module `restart`).
//!
//! Sweeps are deterministic from the workload seed and the state seed; a
//! [`Violation`] prints what [`reproduce`] needs. Longer sweeps: set
//! `VDCACHE_CRASH_STATES` (states per sweep) and `VDCACHE_CRASH_SEEDS`
//! (workload seeds), read by [`state_budget`] and [`seed_count`]; a long
//! sweep runs in shards with `VDCACHE_CRASH_SEED_FIRST` ([`seed_offsets`]).
//!
//! This crate owns workloads, the guest-level model and the checks. It must
//! not reach into the engine or the cache beyond their public APIs, and it
//! must never relax a check to make a target pass.

pub mod broken;
mod buffers;
pub mod cache_target;
mod check;
pub mod damage;
pub mod error;
pub mod harness;
pub mod interrupted;
pub mod model;
pub mod restart;
mod rng;
pub mod target;
pub mod workload;

pub use broken::{Breakage, BrokenIo};
pub use cache_target::{CACHE_DEVICE, CacheTarget, FullDevice, open_raw_disk, open_raw_through};
pub use damage::{DamageReport, sweep_damage};
pub use error::{BoxError, HarnessError};
pub use harness::{
    Report, RunConfig, SEEDS_ENV, STATES_ENV, Violation, ViolationKind, qemu_img_available,
    reproduce, run, seed_count, seed_offsets, state_budget,
};
pub use model::{GuestHistory, GuestModel, GuestOp, GuestOpKind};
pub use restart::{restarts_clean, run_restarts};
pub use target::{
    Backing, CrashTarget, IoFactory, Qcow2Target, RecordingFiles, WithRecovery, mem_files,
};
pub use vdcache_backend::recording::{CrashState, History, Log, RecordingBackend, StateKind};
pub use workload::{WorkloadConfig, WorkloadRun, run_workload};
