//! A storage server that restarts while vdcache keeps running and loses
//! the writes its volatile cache held (no flush covered them): the fault
//! model of issue 43. The images live on a
//! [`VolatileServer`](vdcache_backend::volatile::VolatileServer), each
//! opened through a store that reconnects as the NBD store does (it
//! writes its unflushed record again before serving on). The cache device
//! stays a recording device: it is local, not on the server.
//!
//! Restart points are enumerated like crash points: a fault-free run
//! counts the writes, trims and flushes the server serves, and each chosen
//! point `n` runs the workload again with the server restarting right
//! before its `n`-th such request. Every guest request must then succeed
//! and read what the guest wrote, and after the clean close at the end the
//! images, as the server's disk holds them (recovered by the target, as
//! after a crash, which finds nothing to do), must read exactly what the
//! guest wrote, check clean and, if asked, pass `qemu-img check`.
//!
//! This module owns the restart sweep. It must not relax a check: a
//! restart is invisible to the guest or it is a violation.

use crate::CACHE_DEVICE;
use crate::check::{first_difference, qemu_img_check};
use crate::error::HarnessError;
use crate::harness::{Report, RunConfig, Violation, ViolationKind, create_devices, seeded_order};
use crate::model::GuestHistory;
use crate::target::{CrashTarget, mem_files};
use crate::workload::run_workload;
use std::sync::Arc;
use std::time::Instant;
use vdcache_backend::DEFAULT_UNFLUSHED_LIMIT;
use vdcache_backend::recording::{CrashState, Log, StateKind};
use vdcache_backend::volatile::VolatileServer;
use vdcache_image::{Layer, MemFiles};

/// One run of the workload with the images on a server restarting at
/// `restarts_at`.
struct Ran {
    server: Arc<VolatileServer>,
    log: Arc<Log>,
    /// The image files moved to the server.
    images: Vec<String>,
    /// The guest history, or why the workload could not go on.
    outcome: Result<(GuestHistory, Vec<String>), HarnessError>,
}

fn run_once(
    target: &dyn CrashTarget,
    cfg: &RunConfig,
    restarts_at: Option<u64>,
) -> Result<Ran, HarnessError> {
    let (log, files) = create_devices(target)?;
    let server = VolatileServer::new(restarts_at);
    let mut images: Vec<String> = files
        .names()
        .into_iter()
        .filter(|n| n != CACHE_DEVICE)
        .collect();
    images.sort();
    for name in &images {
        let Some(device) = files.get(name) else {
            continue;
        };
        server.add(name, device.contents());
        let store =
            server
                .store(name, DEFAULT_UNFLUSHED_LIMIT)
                .map_err(|e| HarnessError::Create {
                    target: target.label(),
                    source: e.into(),
                })?;
        files.serve_from(name, store.shared());
    }
    let outcome = run_workload(target, &files, &cfg.workload).map(|r| (r.history, r.live));
    Ok(Ran {
        server,
        log,
        images,
        outcome,
    })
}

/// The restart points to check: every point when the budget allows,
/// else a seeded sample, ascending.
fn plan(requests: u64, cfg: &RunConfig) -> Vec<u64> {
    let mut points = seeded_order(requests, cfg);
    points.truncate(cfg.budget);
    points.sort_unstable();
    points
}

/// The images as the server's disk holds them, with the cache device as
/// the run left it, recovered by the target and checked against the
/// guest's writes.
fn check_disk(
    target: &dyn CrashTarget,
    ran: &Ran,
    guest: &GuestHistory,
    qemu_img: bool,
) -> Vec<ViolationKind> {
    let state = ran.log.snapshot().state(ran.log.len(), StateKind::All);
    let files = mem_files(&state);
    for name in &ran.images {
        if let Some(bytes) = ran.server.durable(name) {
            files.insert(name, bytes);
        }
    }
    match recovered(target, &state, files.clone(), guest) {
        Err(v) => vec![v],
        Ok(names) if qemu_img => {
            let layers: Vec<(String, Vec<u8>)> = names
                .iter()
                .filter_map(|n| files.get(n).map(|s| (n.clone(), s.snapshot())))
                .collect();
            match qemu_img_check(&layers) {
                Ok((Some(0 | 3), _)) => vec![],
                Ok((code, output)) => vec![ViolationKind::QemuImg { code, output }],
                Err(e) => vec![ViolationKind::QemuImg {
                    code: None,
                    output: format!("could not run qemu-img: {e}"),
                }],
            }
        }
        Ok(_) => vec![],
    }
}

/// Recovers the disk from `files`, compares it with the guest's writes,
/// closes it and checks its top image; the names of its layers.
fn recovered(
    target: &dyn CrashTarget,
    state: &CrashState,
    files: Arc<MemFiles>,
    guest: &GuestHistory,
) -> Result<Vec<String>, ViolationKind> {
    let disk = target
        .recover_from(state, files)
        .map_err(|e| ViolationKind::RecoveryFailed(e.to_string()))?;
    let want = guest.model.current();
    if disk.size() != want.len() as u64 {
        return Err(ViolationKind::SizeChanged {
            expected: want.len() as u64,
            found: disk.size(),
        });
    }
    let mut found = vec![0u8; want.len()];
    disk.read(0, &mut found)
        .map_err(|e| ViolationKind::ReadFailed(e.to_string()))?;
    if let Some(at) = first_difference(&found, want) {
        return Err(ViolationKind::Lost { offset: at as u64 });
    }
    disk.close()
        .map_err(|e| ViolationKind::CloseFailed(e.to_string()))?;
    if let Some(Layer::Qcow2(img)) = disk.layers().first() {
        let report = img
            .check()
            .map_err(|e| ViolationKind::CheckFailed(e.to_string()))?;
        if !report.corruptions.is_empty() {
            return Err(ViolationKind::Corruption(report.corruptions));
        }
    }
    Ok(disk.layers().iter().map(|l| l.name().to_string()).collect())
}

/// What went wrong at one restart point (with `qemu-img check` too when
/// `qemu_img`).
fn check_point(
    target: &dyn CrashTarget,
    cfg: &RunConfig,
    point: u64,
    qemu_img: bool,
) -> Result<Vec<ViolationKind>, HarnessError> {
    let ran = run_once(target, cfg, Some(point))?;
    let (guest, live) = match &ran.outcome {
        Ok(done) => done,
        Err(e) => return Ok(vec![ViolationKind::Served(e.to_string())]),
    };
    if !live.is_empty() {
        return Ok(live
            .iter()
            .map(|l| ViolationKind::Served(l.clone()))
            .collect());
    }
    Ok(check_disk(target, &ran, guest, qemu_img))
}

/// Runs the workload of `cfg` on `target` with the images on a storage
/// server that restarts at up to `cfg.budget` points, one run per point
/// (see the module comment). The report's `log_entries` counts the
/// server's requests in the fault-free run, `crash_points` and `states`
/// the points checked. `qemu-img check` runs at every
/// `cfg.qemu_img_every`-th point when `cfg.qemu_img_check`.
pub fn run_restarts(target: &dyn CrashTarget, cfg: &RunConfig) -> Result<Report, HarnessError> {
    if cfg.qemu_img_check && !crate::harness::qemu_img_available() {
        return Err(HarnessError::NoQemuImg);
    }
    let started = Instant::now();
    let label = format!("{} on a restarting storage server", target.label());
    let free = run_once(target, cfg, None)?;
    let (guest, live) = free.outcome?;
    let requests = free.server.requests();
    let mut report = Report {
        target: label.clone(),
        workload_seed: cfg.workload.seed,
        state_seed: cfg.state_seed,
        guest_ops: guest.ops.len(),
        log_entries: requests,
        live,
        ..Report::default()
    };
    let context = format!("of {requests} writes, trims and flushes of a fault-free run");
    for (index, point) in plan(requests, cfg).into_iter().enumerate() {
        let qemu_img = cfg.qemu_img_check && index % cfg.qemu_img_every.max(1) == 0;
        let found = check_point(target, cfg, point, qemu_img)?;
        report.qemu_img_checks += usize::from(qemu_img);
        report.crash_points += 1;
        report.states += 1;
        if found.is_empty() {
            continue;
        }
        report.violating_states += 1;
        for kind in found {
            if report.violations.len() < cfg.max_reported {
                report.violations.push(Violation {
                    target: label.clone(),
                    workload_seed: cfg.workload.seed,
                    state_seed: cfg.state_seed,
                    point,
                    state: StateKind::None,
                    state_desc: format!("server restart before request {point}"),
                    context: context.clone(),
                    kind,
                });
            }
        }
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Sweeps `target`'s restart points ([`run_restarts`]) with `points`
/// points and panics listing every violation; returns the points checked.
/// For tests.
pub fn restarts_clean(target: &dyn CrashTarget, cfg: &RunConfig, points: usize) -> usize {
    let cfg = RunConfig {
        budget: points,
        ..cfg.clone()
    };
    let report = match run_restarts(target, &cfg) {
        Ok(r) => r,
        Err(e) => panic!("restart sweep failed: {e}"),
    };
    eprintln!("{}", report.summary());
    assert!(report.is_clean(), "restart violations:\n{report}");
    report.states
}
