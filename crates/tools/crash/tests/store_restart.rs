//! Issue 43, item 4, under the crash harness: the images' storage server
//! restarts while vdcache keeps running and loses every write its volatile
//! cache held (no flush covered it). Restart points are enumerated over the
//! server's requests like crash points; with no cache, with the metadata
//! journal and through a write-through cache, every guest request must go
//! on as if nothing happened and the images after a clean close must hold
//! exactly what the guest wrote and check clean. The mutation "serving on
//! after a reconnect without rewriting" (a deliberate bug in the stores'
//! rewrite) must be caught.
//!
//! The bug is process-wide while switched on, so this file holds a single
//! test: no other sweep may run beside it.

use vdcache_backend::testing::{Fault, inject};
use vdcache_cache::{Admission, CacheConfig, CowMode, DiskPolicy, Replacement, WriteMode};
use vdcache_crash::{
    Backing, CacheTarget, CrashTarget, Qcow2Target, RunConfig, WorkloadConfig, qemu_img_available,
    restarts_clean, run_restarts,
};
use vdcache_image::{CreateOptions, JournalMode, MetaCacheConfig};

const MIB: u64 = 1 << 20;

/// Restart points per configuration (a quarter in debug builds); with the
/// mutation, half as many (enough to catch it).
const POINTS: usize = 24;

fn points() -> usize {
    if cfg!(debug_assertions) {
        POINTS / 4
    } else {
        POINTS
    }
}

fn run_config(seed: u64) -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed,
            ops: 100,
            ..WorkloadConfig::default()
        },
        qemu_img_check: qemu_img_available(),
        qemu_img_every: 8,
        ..RunConfig::default()
    }
}

fn no_cache() -> Qcow2Target {
    Qcow2Target::new("restart", 4 * MIB, CreateOptions::default()).with_backing(Backing::Raw)
}

/// With a small metadata cache, which keeps the journal area (sized by
/// it) small.
fn journaled() -> Qcow2Target {
    Qcow2Target::new("restart-journal", 4 * MIB, CreateOptions::default())
        .with_backing(Backing::Raw)
        .with_journal(JournalMode::Required)
        .with_cache(MetaCacheConfig {
            l2_bytes: 64 << 10,
            refcount_bytes: 16 << 10,
            slice_bytes: None,
        })
}

fn write_through() -> CacheTarget {
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
    CacheTarget::new(no_cache(), config, 16 << 20)
}

#[test]
fn restarts_lose_nothing_and_serving_on_without_rewriting_is_caught() {
    let targets: [(&dyn CrashTarget, u64); 3] = [
        (&no_cache(), 0x4301),
        (&journaled(), 0x4302),
        (&write_through(), 0x4303),
    ];
    for (target, seed) in targets {
        let checked = restarts_clean(target, &run_config(seed), points());
        assert_eq!(checked, points(), "{}", target.label());
    }

    let _bug = inject(Fault::SkipRewrite);
    for (target, seed) in targets {
        let cfg = RunConfig {
            budget: points() / 2,
            ..run_config(seed)
        };
        let report = run_restarts(target, &cfg).expect("harness");
        eprintln!("with the mutation: {}", report.summary());
        assert!(
            report.violating_states > 0,
            "serving on without rewriting went unnoticed: {report}"
        );
    }
}
