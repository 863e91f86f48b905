//! The plain qcow2 engine (no cache) under the crash harness: several
//! configurations, each a seeded workload and a budget of crash states,
//! all of which must pass invariants 1-3.
//!
//! Longer sweeps: `VDCACHE_CRASH_STATES=N` (states per configuration and
//! seed) and `VDCACHE_CRASH_SEEDS=M` (workload seeds per configuration).

use vdcache_crash::{
    Backing, CrashTarget, Log, Qcow2Target, RecordingFiles, Report, RunConfig, STATES_ENV,
    WorkloadConfig, qemu_img_available, run_workload, seed_count, state_budget,
};
use vdcache_image::{CreateOptions, MetaCacheConfig};
use vdcache_qcow2::Header;

const MIB: u64 = 1 << 20;

fn tiny_cache(slice: Option<u64>) -> MetaCacheConfig {
    MetaCacheConfig {
        l2_bytes: 4096,
        refcount_bytes: 4096,
        slice_bytes: slice,
    }
}

/// Sweeps `target` with `default_budget` states per seed (a quarter in
/// debug builds); asserts no violation, no leaked cluster after the
/// recovering open and a clean close (a version 3 image is marked dirty
/// before its first change, and repaired when it opens dirty), and, with
/// the default budget, that at least three quarters of it were distinct
/// states.
fn sweep(target: &Qcow2Target, base: RunConfig, default_budget: usize) {
    let leaks = sweep_leaking(target, base, default_budget);
    assert_eq!(leaks, 0, "crash states left leaked clusters after recovery");
}

/// [`sweep`] for an image that cannot be marked dirty (version 2, as QEMU
/// leaves it): leaks are counted, not refused. Returns the states with
/// leaks.
fn sweep_leaking(target: &Qcow2Target, base: RunConfig, default_budget: usize) -> usize {
    let default_budget = if cfg!(debug_assertions) {
        default_budget / 4
    } else {
        default_budget
    };
    let reports =
        vdcache_crash::harness::sweep(target, &base, default_budget).expect("harness run");
    let states: usize = reports.iter().map(|r| r.states).sum();
    for r in &reports {
        eprintln!("{}", r.summary());
    }
    let failures: Vec<&Report> = reports.iter().filter(|r| !r.is_clean()).collect();
    assert!(
        failures.is_empty(),
        "crash violations:\n{}",
        failures.iter().map(|r| r.to_string()).collect::<String>()
    );
    if std::env::var(STATES_ENV).is_err() {
        let seeds = seed_count(1);
        let budget = state_budget(default_budget);
        assert!(
            states * 4 >= budget * seeds * 3,
            "only {states} distinct states for a budget of {budget} x {seeds}"
        );
    }
    reports.iter().map(|r| r.states_with_leaks).sum()
}

fn config(seed: u64) -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed,
            ..WorkloadConfig::default()
        },
        ..RunConfig::default()
    }
}

#[test]
fn clusters_64k() {
    let target = Qcow2Target::new("64k", 8 * MIB, CreateOptions::default());
    let mut cfg = config(0x64);
    if qemu_img_available() {
        cfg.qemu_img_check = true;
        cfg.qemu_img_every = 8;
    } else {
        eprintln!("qemu-img not installed: skipping the qemu-img check part");
    }
    sweep(&target, cfg, 700);
}

#[test]
fn clusters_4k_refcount_bits_64_tiny_cache() {
    let target = Qcow2Target::new(
        "4k-rc64",
        8 * MIB,
        CreateOptions {
            cluster_size: 4096,
            refcount_bits: 64,
            ..CreateOptions::default()
        },
    )
    .with_cache(tiny_cache(Some(512)));
    sweep(&target, config(0x4c), 700);
}

fn table_growth_target() -> (Qcow2Target, RunConfig) {
    // 512-byte clusters with 64-bit refcounts: one refcount table cluster
    // covers 2 MiB of file, so the workload outgrows it.
    let target = Qcow2Target::new(
        "512-rc64-table-growth",
        8 * MIB,
        CreateOptions {
            cluster_size: 512,
            refcount_bits: 64,
            ..CreateOptions::default()
        },
    );
    let mut cfg = config(0x512);
    cfg.workload.max_len = Some(256 * 1024);
    cfg.workload.hot_percent = 10;
    (target, cfg)
}

#[test]
fn refcount_table_growth() {
    let (target, cfg) = table_growth_target();
    // The workload really moves the refcount table.
    let log = Log::new();
    let files = RecordingFiles::new(&log);
    target.create(&files).expect("create");
    let initial =
        Header::parse(&files.get(Qcow2Target::TOP).expect("top").contents()).expect("header");
    let run_ = run_workload(&target, &files, &cfg.workload).expect("workload");
    assert!(run_.live.is_empty(), "{:?}", run_.live);
    let after =
        Header::parse(&files.get(Qcow2Target::TOP).expect("top").contents()).expect("header");
    assert!(
        after.refcount_table_clusters > initial.refcount_table_clusters,
        "refcount table did not grow: {} clusters at {:#x}, file {} bytes",
        after.refcount_table_clusters,
        after.refcount_table_offset,
        files.get(Qcow2Target::TOP).expect("top").contents().len()
    );
    sweep(&target, cfg, 700);
}

#[test]
fn extended_l2_over_raw_backing() {
    let target = Qcow2Target::new(
        "extl2-raw",
        8 * MIB,
        CreateOptions {
            extended_l2: true,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw);
    sweep(&target, config(0xe2), 700);
}

#[test]
fn lazy_refcounts_over_qcow2_backing() {
    let target = Qcow2Target::new(
        "lazy-qcow2",
        8 * MIB,
        CreateOptions {
            cluster_size: 16384,
            lazy_refcounts: true,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Qcow2)
    .with_cache(tiny_cache(None));
    sweep(&target, config(0x1a2), 700);
}

#[test]
fn version2_over_raw_backing() {
    let target = Qcow2Target::new(
        "v2-raw",
        4 * MIB,
        CreateOptions {
            version: 2,
            cluster_size: 4096,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw);
    sweep_leaking(&target, config(0x02), 400);
}

#[test]
fn deferred_copy_on_write_over_qcow2_backing() {
    // Allocating writes acknowledged before their filler is read: a crash
    // may lose them only until a flush, and never leaves a cluster mapped
    // before its data.
    let target = Qcow2Target::new("deferred-qcow2", 8 * MIB, CreateOptions::default())
        .with_backing(Backing::Qcow2)
        .with_deferred_cow();
    sweep(&target, config(0xdc0), 700);
}
