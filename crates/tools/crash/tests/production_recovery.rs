//! The crash harness's cache target recovers with the production
//! recovery (`vdcache-host`, what `vdcache serve` and `vdcache recover
//! --full` run), not a copy of its own: a deliberate bug switched on in
//! the production full recovery (images that need the cache are left
//! unwritten) makes the same sweep that passes without it report
//! violations.
//!
//! The bug is process-wide while switched on, so this file holds a single
//! test: no other sweep may run beside it.

use vdcache_cache::{Admission, CacheConfig, CowMode, DiskPolicy, Replacement, WriteMode};
use vdcache_crash::{
    Backing, CacheTarget, Qcow2Target, Report, RunConfig, ViolationKind, WorkloadConfig, run,
};
use vdcache_host::testing::{Fault, inject};
use vdcache_image::CreateOptions;

const MIB: u64 = 1 << 20;

fn target() -> CacheTarget {
    let config = CacheConfig {
        region_bytes: 256 << 10,
        replacement: Replacement::Lru,
        default_policy: DiskPolicy {
            mode: WriteMode::WriteBack,
            admission: Admission::All,
            sequential_threshold: 1 << 20,
            sequential_write_cutoff: 0,
            cow: CowMode::Stacked,
            cache_only: false,
        },
        // Nothing is written back during the workload: after a crash the
        // flushed data is in flash only, so full recovery has work to do.
        high_watermark: 1.0,
        low_watermark: 1.0,
        host: Some("crash-host".into()),
        inline_background: true,
        ..CacheConfig::default()
    };
    let images =
        Qcow2Target::new("recovery", 4 * MIB, CreateOptions::default()).with_backing(Backing::Raw);
    CacheTarget::new(images, config, 16 << 20)
}

fn run_config() -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed: 0x5ec0,
            ops: 40,
            max_len: Some(128 << 10),
            ..WorkloadConfig::default()
        },
        budget: 40,
        ..RunConfig::default()
    }
}

fn sweep() -> Report {
    let report = run(&target(), &run_config()).expect("harness");
    eprintln!("{}", report.summary());
    report
}

#[test]
fn a_bug_in_production_full_recovery_fails_the_harness() {
    let correct = sweep();
    assert!(correct.is_clean(), "{correct}");
    assert!(correct.states >= 20, "only {} states", correct.states);

    let bug = inject(Fault::SkipWriteBack);
    let broken = sweep();
    drop(bug);
    assert!(broken.live.is_empty(), "{:?}", broken.live);
    assert!(
        broken.violating_states > 0,
        "recovery that leaves the images unwritten must be caught: {broken}"
    );
    // Caught as a failed recovery: the cache still holds what the images
    // lack (or the images still need the cache), whatever the guest wrote.
    assert!(
        broken
            .violations
            .iter()
            .all(|v| matches!(v.kind, ViolationKind::RecoveryFailed(_))),
        "{broken}"
    );
    assert!(
        broken
            .violations
            .iter()
            .any(|v| v.kind.to_string().contains("after full recovery")),
        "{broken}"
    );

    // Switched off again, the same sweep passes: the violations were the
    // bug's.
    let again = sweep();
    assert!(again.is_clean(), "{again}");
}
