//! The qcow2 engine with its per-disk metadata journal (paper 003) under
//! the crash harness: table updates logged out of place, one sync per
//! guest flush, checkpoints, full-mode writes over data the newest record
//! checksums, adaptive preallocation, eager records (a flush after every
//! write), deferred copy-on-write, and the same through a writethrough
//! flash cache (deferring copy-on-write, as serving does). Every crash
//! state must pass invariants 1-3 after recovery replays the journal (in
//! three configurations after a first recovery was killed part way). Two deliberate mutations of the journal's ordering
//! must be caught.
//!
//! Longer sweeps: `VDCACHE_CRASH_STATES=N`, `VDCACHE_CRASH_SEEDS=M` (the
//! README's journal soak), in shards with `VDCACHE_CRASH_SEED_FIRST=F`.

use vdcache_cache::{Admission, CacheConfig, CowMode, DiskPolicy, Replacement, WriteMode};
use vdcache_crash::harness::sweep_clean;
use vdcache_crash::{
    Backing, Breakage, BrokenIo, CacheTarget, Qcow2Target, RunConfig, SEEDS_ENV, STATES_ENV,
    WorkloadConfig, qemu_img_available, run, seed_count, seed_offsets, state_budget,
};
use vdcache_image::{CreateOptions, JournalMode, MetaCacheConfig};

const MIB: u64 = 1 << 20;
/// States per workload seed in a release run; two seeds for each of six
/// engine configurations make 5,400 states per CI run (the README's
/// long sweep runs many more).
const BUDGET: usize = 450;
const SEEDS: u64 = 2;
/// Distinct states each configuration must reach (some of a budget are
/// duplicates).
const MIN_STATES: usize = 700;

fn run_config(seed: u64) -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed,
            ..WorkloadConfig::default()
        },
        qemu_img_check: qemu_img_available(),
        qemu_img_every: 60,
        ..RunConfig::default()
    }
}

/// Sweeps `SEEDS` workloads (or `VDCACHE_CRASH_SEEDS`) and asserts no
/// violation and, with the default budget, that at least `MIN_STATES`
/// distinct states were checked.
fn sweep(target: &Qcow2Target, first_seed: u64) {
    sweep_workloads(target, first_seed, SEEDS, WorkloadConfig::default());
}

/// [`sweep`] over `default_seeds` workloads like `workload` (its seed
/// aside), needing `MIN_STATES` per `SEEDS` of them.
fn sweep_workloads(
    target: &Qcow2Target,
    first_seed: u64,
    default_seeds: u64,
    workload: WorkloadConfig,
) {
    let budget = if cfg!(debug_assertions) {
        BUDGET / 8
    } else {
        BUDGET
    };
    // A long sweep may run in shards (`VDCACHE_CRASH_SEED_FIRST`).
    let seeds: Vec<u64> = if std::env::var(SEEDS_ENV).is_ok() {
        seed_offsets(seed_count(1))
            .map(|s| first_seed + s)
            .collect()
    } else {
        (first_seed..first_seed + default_seeds).collect()
    };
    let mut states = 0;
    for &seed in &seeds {
        let cfg = RunConfig {
            budget: state_budget(budget),
            workload: WorkloadConfig {
                seed,
                ..workload.clone()
            },
            ..run_config(seed)
        };
        let report = run(target, &cfg).expect("harness run");
        eprintln!("{}", report.summary());
        assert!(report.is_clean(), "crash violations:\n{report}");
        // A crash with the journal on is repaired at the next open, and
        // the area is named before its refcounts are durable (and freed
        // before it is unnamed): no crash state leaks a cluster.
        assert_eq!(report.states_with_leaks, 0, "leaks:\n{report}");
        states += report.states;
    }
    if std::env::var(STATES_ENV).is_err() && !cfg!(debug_assertions) {
        let needed = MIN_STATES * seeds.len() / SEEDS as usize;
        assert!(
            states >= needed,
            "only {states} distinct states over {} seeds",
            seeds.len()
        );
    }
}

/// A small metadata cache keeps the journal area (sized by it) small.
fn small_cache(slice: Option<u64>) -> MetaCacheConfig {
    MetaCacheConfig {
        l2_bytes: 64 << 10,
        refcount_bytes: 16 << 10,
        slice_bytes: slice,
    }
}

fn journaled(label: &str, create: CreateOptions) -> Qcow2Target {
    Qcow2Target::new(label, 8 * MIB, create)
        .with_journal(JournalMode::Required)
        .with_cache(small_cache(None))
}

#[test]
fn journal_over_a_qcow2_base() {
    // Each recovery is first killed after a few changes: replaying a held
    // write can change bytes the record checksums, and the next recovery
    // must still take the same record.
    sweep(
        &journaled("journal", CreateOptions::default())
            .with_backing(Backing::Qcow2)
            .with_interrupted_recovery(),
        0x100,
    );
}

#[test]
fn journal_with_a_tiny_metadata_cache_evicting_dirty_slices() {
    let target = journaled(
        "journal-evicting",
        CreateOptions {
            cluster_size: 16384,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw)
    .with_cache(MetaCacheConfig {
        l2_bytes: 4096,
        refcount_bytes: 4096,
        slice_bytes: Some(512),
    });
    sweep(&target, 0x110);
}

#[test]
fn journal_with_extended_l2_subclusters() {
    let target = journaled(
        "journal-subclusters",
        CreateOptions {
            extended_l2: true,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw)
    .with_interrupted_recovery();
    sweep(&target, 0x120);
}

#[test]
fn journal_without_backing_file() {
    sweep(
        &journaled("journal-standalone", CreateOptions::default()),
        0x130,
    );
}

#[test]
fn journal_with_deferred_copy_on_write() {
    // Allocating writes completed by the disk's workers: their pieces and
    // L2 entries join whichever interval is open when they finish.
    sweep(
        &journaled("journal-deferred", CreateOptions::default())
            .with_backing(Backing::Qcow2)
            .with_deferred_cow()
            .with_interrupted_recovery(),
        0x160,
    );
}

#[test]
fn journal_with_a_flush_after_each_write() {
    // Every write sent with FUA: one write per interval, so writes take
    // the eager path (their record written beside their data, the flush
    // only syncing), mixed with zero writes, discards and reopens that
    // make a flush write its own record over an eager one.
    let workload = WorkloadConfig {
        fua_percent: 100,
        ..WorkloadConfig::default()
    };
    sweep_workloads(
        &journaled("journal-eager", CreateOptions::default())
            .with_backing(Backing::Qcow2)
            .with_interrupted_recovery(),
        0x150,
        2,
        workload,
    );
}

#[test]
fn journal_through_a_writethrough_cache() {
    let images = journaled("journal-wt", CreateOptions::default())
        .with_backing(Backing::Raw)
        .with_deferred_cow();
    let config = CacheConfig {
        region_bytes: 256 << 10,
        replacement: Replacement::Lru,
        default_policy: DiskPolicy {
            mode: WriteMode::WriteThrough,
            admission: Admission::All,
            sequential_threshold: 1 << 20,
            sequential_write_cutoff: 0,
            cow: CowMode::CowAware,
            cache_only: false,
        },
        host: Some("crash-host".into()),
        inline_background: true,
        ..CacheConfig::default()
    };
    let target = CacheTarget::new(images, config, 16 << 20);
    let budget = if cfg!(debug_assertions) { 60 } else { 300 };
    sweep_clean(&target, &run_config(0x140), budget);
    // Every write with FUA: eager records through the cache.
    let eager = RunConfig {
        workload: WorkloadConfig {
            seed: 0x141,
            fua_percent: 100,
            ..WorkloadConfig::default()
        },
        ..run_config(0x141)
    };
    sweep_clean(&target, &eager, budget * 3 / 5);
}

/// Runs workloads `seeds` through the mutation: the live disk must read
/// right, and some crash state of some workload must lose or garble data.
/// (A workload may not happen to expose a mutation: whether a table
/// written early matters depends on what the later records cover.)
fn mutation_is_caught(breakage: Breakage, seeds: &[u64]) {
    // Small slices: records then differ in what they cover, so a table
    // written early is not always overwritten by an older record's copy.
    let target = Qcow2Target::new("journal-mutation", 8 * MIB, CreateOptions::default())
        .with_journal(JournalMode::Required)
        .with_backing(Backing::Raw)
        .with_cache(MetaCacheConfig {
            l2_bytes: 4096,
            refcount_bytes: 4096,
            slice_bytes: Some(512),
        })
        .with_io(BrokenIo::factory(breakage));
    let mut violating = 0;
    for &seed in seeds {
        let report = run(
            &target,
            &RunConfig {
                workload: WorkloadConfig {
                    seed,
                    ..WorkloadConfig::default()
                },
                budget: 800,
                ..RunConfig::default()
            },
        )
        .expect("run");
        eprintln!("{report}");
        assert!(
            report.live.is_empty(),
            "the live disk must still read right: {:?}",
            report.live
        );
        violating += report.violating_states;
    }
    assert!(
        violating > 0,
        "{breakage:?} must leave crash states that lose or garble data (workloads {seeds:x?})"
    );
}

#[test]
fn a_journal_that_skips_its_sync_is_caught() {
    mutation_is_caught(Breakage::SkipJournalSync, &[0x21]);
}

#[test]
fn tables_written_before_their_record_is_durable_are_caught() {
    mutation_is_caught(Breakage::TablesBeforeRecord, &[0x22, 0x23, 0x24]);
}
