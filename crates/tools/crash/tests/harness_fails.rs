//! The harness must be able to fail: deliberately broken I/O orderings
//! under the engine produce violations (and only after a crash: the live
//! disk still reads correctly), a recovery that loses data is caught,
//! and a reported violation reproduces from its description.

use vdcache_crash::{
    Backing, Breakage, BrokenIo, CrashState, CrashTarget, Qcow2Target, Report, RunConfig,
    ViolationKind, WithRecovery, WorkloadConfig, reproduce, run,
};
use vdcache_image::{CreateOptions, VirtualDisk, ZeroFlags};

const MIB: u64 = 1 << 20;

fn cfg(seed: u64) -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed,
            ..WorkloadConfig::default()
        },
        budget: 200,
        ..RunConfig::default()
    }
}

fn data_violations(r: &Report) -> Vec<String> {
    r.violations
        .iter()
        .filter(|v| matches!(v.kind, ViolationKind::Data(_)))
        .map(|v| v.to_string())
        .collect()
}

#[test]
fn dropped_flushes_lose_flushed_data() {
    let target = Qcow2Target::new("drop-flushes", 4 * MIB, CreateOptions::default())
        .with_io(BrokenIo::factory(Breakage::DropFlushes));
    let report = run(&target, &cfg(7)).expect("run");
    eprintln!("{report}");
    assert!(report.live.is_empty(), "{:?}", report.live);
    assert!(report.violating_states > 0, "{report}");
    let data = data_violations(&report);
    assert!(
        data.iter().any(|v| v.contains("stale")),
        "flushed data must be found lost (stale): {data:#?}"
    );
}

#[test]
fn metadata_before_data_is_caught_and_reproduces() {
    let target = Qcow2Target::new(
        "data-after-metadata",
        4 * MIB,
        CreateOptions {
            cluster_size: 16384,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw)
    .with_io(BrokenIo::factory(Breakage::DataAfterMetadata));
    let c = cfg(11);
    let report = run(&target, &c).expect("run");
    eprintln!("{report}");
    assert!(report.live.is_empty(), "{:?}", report.live);
    // L2 entries that land before their data read garbage, or point past
    // the end of the file (which the repair of the image, dirty since its
    // first change, finds at the next open).
    assert!(report.violating_states > 0, "{report}");
    assert!(
        report.violations.iter().all(|v| matches!(
            v.kind,
            ViolationKind::Data(_)
                | ViolationKind::ReadFailed(_)
                | ViolationKind::Corruption(_)
                | ViolationKind::RecoveryFailed(_)
        )),
        "{report}"
    );
    let first = &report.violations[0];
    let again = reproduce(&target, &c, first.point, first.state).expect("reproduce");
    assert!(
        again
            .iter()
            .any(|v| v.kind.to_string() == first.kind.to_string()),
        "reproducing {first} gave {again:#?}"
    );
}

#[test]
fn dropped_barriers_are_caught() {
    let target = Qcow2Target::new(
        "drop-barriers",
        4 * MIB,
        CreateOptions {
            cluster_size: 16384,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw)
    .with_io(BrokenIo::factory(Breakage::DropBarriers));
    // The windows are narrow (between a data write and the next durable
    // flush): look at more states.
    let mut c = cfg(11);
    c.budget = 600;
    let report = run(&target, &c).expect("run");
    eprintln!("{}", report.summary());
    assert!(report.live.is_empty(), "{:?}", report.live);
    assert!(report.violating_states > 0, "{report}");
}

#[test]
fn the_same_target_without_breakage_passes() {
    let target = Qcow2Target::new(
        "control",
        4 * MIB,
        CreateOptions {
            cluster_size: 16384,
            ..CreateOptions::default()
        },
    )
    .with_backing(Backing::Raw);
    let report = run(&target, &cfg(11)).expect("run");
    eprintln!("{}", report.summary());
    assert!(report.is_clean(), "{report}");
}

#[test]
fn a_recovery_that_loses_data_is_caught() {
    // A custom recovery (the hook the flash cache plugs into) that opens
    // the chain and then wipes the disk: flushed data is lost.
    let inner = Qcow2Target::new("wiping-recovery", 2 * MIB, CreateOptions::default());
    let plain = inner.clone();
    let target = WithRecovery {
        inner,
        recover: move |state: &CrashState| -> Result<VirtualDisk, vdcache_crash::BoxError> {
            let disk = plain.recover(state)?;
            disk.write_zeroes(0, disk.size(), ZeroFlags::default())?;
            Ok(disk)
        },
    };
    let mut c = cfg(3);
    c.budget = 60;
    let report = run(&target, &c).expect("run");
    eprintln!("{}", report.summary());
    assert!(report.violating_states > 0, "{report}");
    assert!(!data_violations(&report).is_empty(), "{report}");
}
