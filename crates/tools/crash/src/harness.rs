//! Running a crash sweep: set up the target, run the workload on recorded
//! devices, choose crash points and states within a budget (seeded, so a
//! report reproduces), check them in parallel and report violations with
//! everything needed to replay one ([`reproduce`]).
//!
//! This module owns planning, parallelism and reporting. The crash model
//! lives in `vdcache_backend::recording`, the guest rule in `model`, the
//! per-state steps in `check`; this module must not add or relax rules.

use crate::buffers::Buffers;
use crate::check::{self, CheckOptions};
use crate::error::HarnessError;
use crate::model::{DataMismatch, GuestHistory};
use crate::rng::{Draw, Rng, SeedableRng, mix};
use crate::target::{CrashTarget, RecordingFiles};
use crate::workload::{WorkloadConfig, run_workload};
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vdcache_backend::recording::{History, Log, StateKind};

/// Environment variable: crash states per sweep (overrides the default
/// budget in tests and the CLI).
pub const STATES_ENV: &str = "VDCACHE_CRASH_STATES";
/// Environment variable: number of workload seeds per configuration.
pub const SEEDS_ENV: &str = "VDCACHE_CRASH_SEEDS";
/// Environment variable: the first workload seed (an offset from each
/// configuration's own), so that a long sweep can run in shards: seeds
/// `[first, first + VDCACHE_CRASH_SEEDS)`.
pub const SEED_FIRST_ENV: &str = "VDCACHE_CRASH_SEED_FIRST";

/// The crash-state budget: `VDCACHE_CRASH_STATES` when set, else `default`.
pub fn state_budget(default: usize) -> usize {
    env_usize(STATES_ENV).unwrap_or(default)
}

/// Workload seeds to sweep: `VDCACHE_CRASH_SEEDS` when set, else `default`.
pub fn seed_count(default: usize) -> usize {
    env_usize(SEEDS_ENV).unwrap_or(default)
}

/// Offsets of the workload seeds to sweep: `VDCACHE_CRASH_SEED_FIRST`
/// (default 0) and the `count` after it.
pub fn seed_offsets(count: usize) -> std::ops::Range<u64> {
    let first = env_usize(SEED_FIRST_ENV).unwrap_or(0) as u64;
    first..first + count as u64
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Whether a `qemu-img` binary can be run.
pub fn qemu_img_available() -> bool {
    std::process::Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// How a sweep runs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub workload: WorkloadConfig,
    /// Crash states to check (approximately: duplicates are skipped and
    /// points with nothing in flight have one state).
    pub budget: usize,
    /// Random states per chosen crash point besides "all" and "none"
    /// (raised when the budget allows more than every point needs).
    pub random_per_point: usize,
    /// Seeds crash-point sampling and the random states.
    pub state_seed: u64,
    /// Worker threads; 0 uses every available core.
    pub threads: usize,
    /// Reopen the closed images without the target and compare.
    pub reopen_check: bool,
    /// Also run the real `qemu-img check` (exit 0 or 3 required).
    pub qemu_img_check: bool,
    /// With `qemu_img_check`, check every n-th state (1 = all).
    pub qemu_img_every: usize,
    /// Violations kept in detail in the report (all are counted).
    pub max_reported: usize,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            workload: WorkloadConfig::default(),
            budget: 500,
            random_per_point: 2,
            state_seed: 0x5eed,
            threads: 0,
            reopen_check: true,
            qemu_img_check: false,
            qemu_img_every: 1,
            max_reported: 20,
        }
    }
}

/// What is wrong with one crash state.
#[derive(Debug, Clone)]
pub enum ViolationKind {
    /// Recovery (opening through the target) failed.
    RecoveryFailed(String),
    SizeChanged {
        expected: u64,
        found: u64,
    },
    ReadFailed(String),
    /// Invariants 1/2: a sector reads a value it may not hold.
    Data(DataMismatch),
    CloseFailed(String),
    CheckFailed(String),
    /// Invariant 3: the check found corruption after a clean close.
    Corruption(Vec<String>),
    ReopenFailed(String),
    /// The closed images read differently from what recovery read.
    ReopenDiffers {
        offset: u64,
    },
    /// `qemu-img check` exited with something other than 0 or 3.
    QemuImg {
        code: Option<i32>,
        output: String,
    },
    /// While its storage server restarted, the disk failed a guest
    /// request or read what the guest had not written.
    Served(String),
    /// After a clean close, the images read differently from what the
    /// guest wrote.
    Lost {
        offset: u64,
    },
}

impl fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ViolationKind::RecoveryFailed(e) => write!(f, "recovery failed: {e}"),
            ViolationKind::SizeChanged { expected, found } => {
                write!(f, "disk size {found} after recovery, expected {expected}")
            }
            ViolationKind::ReadFailed(e) => write!(f, "reading the recovered disk failed: {e}"),
            ViolationKind::Data(m) => write!(f, "data: {m}"),
            ViolationKind::CloseFailed(e) => write!(f, "clean close after recovery failed: {e}"),
            ViolationKind::CheckFailed(e) => write!(f, "image check could not run: {e}"),
            ViolationKind::Corruption(c) => {
                write!(f, "corruption after a clean close: {}", c.join("; "))
            }
            ViolationKind::ReopenFailed(e) => write!(f, "reopening the closed images failed: {e}"),
            ViolationKind::ReopenDiffers { offset } => write!(
                f,
                "after close and reopen the disk reads differently from right after recovery, first at guest offset {offset:#x}"
            ),
            ViolationKind::QemuImg { code, output } => {
                write!(f, "qemu-img check exit {code:?}: {}", output.trim())
            }
            ViolationKind::Served(e) => {
                write!(f, "while the storage server restarted: {e}")
            }
            ViolationKind::Lost { offset } => write!(
                f,
                "after a clean close the images read differently from what the guest wrote, first at guest offset {offset:#x}"
            ),
        }
    }
}

/// One violation, with what reproduces it.
#[derive(Debug, Clone)]
pub struct Violation {
    pub target: String,
    pub workload_seed: u64,
    pub state_seed: u64,
    pub point: u64,
    pub state: StateKind,
    /// Crash point, state and per-device landing counts.
    pub state_desc: String,
    /// Where the crash falls in the guest history.
    pub context: String,
    pub kind: ViolationKind,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: workload seed {:#x}, {} ({}): {} [reproduce: vdcache_crash::reproduce(target, &cfg with workload.seed={:#x}, {}, StateKind::parse(\"{}\"))]",
            self.target,
            self.workload_seed,
            self.state_desc,
            self.context,
            self.kind,
            self.workload_seed,
            self.point,
            self.state
        )
    }
}

/// The result of a sweep.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub target: String,
    pub workload_seed: u64,
    pub state_seed: u64,
    pub guest_ops: usize,
    /// Recorded device operations (crash points are 0..=log_entries).
    pub log_entries: u64,
    /// Distinct crash points tested.
    pub crash_points: usize,
    /// Distinct crash states checked.
    pub states: usize,
    /// Generated states skipped because an identical one was checked at
    /// the same point.
    pub duplicates: usize,
    /// The first `max_reported` violations, in crash-point order.
    pub violations: Vec<Violation>,
    /// States with at least one violation.
    pub violating_states: usize,
    /// The live disk disagreed with the model (no crash involved).
    pub live: Vec<String>,
    pub states_with_leaks: usize,
    pub leaked_clusters: usize,
    pub qemu_img_checks: usize,
    pub elapsed: Duration,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.violating_states == 0 && self.live.is_empty()
    }

    /// One line: counts and time.
    pub fn summary(&self) -> String {
        format!(
            "{}: workload seed {:#x}: {} guest ops, {} device ops, {} crash points, {} states ({} duplicates skipped), {} violating, {} with leaks ({} leaked clusters), {} qemu-img checks, {:.1}s",
            self.target,
            self.workload_seed,
            self.guest_ops,
            self.log_entries,
            self.crash_points,
            self.states,
            self.duplicates,
            self.violating_states,
            self.states_with_leaks,
            self.leaked_clusters,
            self.qemu_img_checks,
            self.elapsed.as_secs_f64()
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.summary())?;
        for l in &self.live {
            writeln!(f, "  live: {l}")?;
        }
        for v in &self.violations {
            writeln!(f, "  {v}")?;
        }
        if self.violating_states > self.violations.len() {
            writeln!(
                f,
                "  ... and {} more violating states",
                self.violating_states - self.violations.len()
            )?;
        }
        Ok(())
    }
}

/// A workload run on recorded devices: the guest's history, the devices'
/// log, and what the live disk disagreed with the model about.
pub(crate) struct Prepared {
    pub(crate) guest: GuestHistory,
    pub(crate) history: History,
    pub(crate) live: Vec<String>,
}

/// A new log and `target`'s devices created on it.
pub(crate) fn create_devices(
    target: &dyn CrashTarget,
) -> Result<(Arc<Log>, Arc<RecordingFiles>), HarnessError> {
    let log = Log::new();
    let files = RecordingFiles::new(&log);
    target
        .create(&files)
        .map_err(|source| HarnessError::Create {
            target: target.label(),
            source,
        })?;
    Ok((log, files))
}

pub(crate) fn prepare(target: &dyn CrashTarget, cfg: &RunConfig) -> Result<Prepared, HarnessError> {
    let (log, files) = create_devices(target)?;
    let ran = run_workload(target, &files, &cfg.workload)?;
    Ok(Prepared {
        guest: ran.history,
        history: log.snapshot(),
        live: ran.live,
    })
}

/// `0..points` in the order the state seed and workload seed of `cfg`
/// shuffle them: the order in which points are sampled.
pub(crate) fn seeded_order(points: u64, cfg: &RunConfig) -> Vec<u64> {
    let mut order: Vec<u64> = (0..points).collect();
    let mut rng = Rng::seed_from_u64(cfg.state_seed ^ mix(cfg.workload.seed));
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// Chooses (point, kind) pairs: points in a seeded random order until the
/// budget is spent, sorted by point for the replayer.
fn plan(history: &History, cfg: &RunConfig) -> Vec<(u64, StateKind)> {
    let points = history.len() + 1;
    let random = cfg
        .random_per_point
        .max((cfg.budget as u64 / points).saturating_sub(2) as usize);
    let order = seeded_order(points, cfg);
    let seed = mix(cfg.state_seed ^ cfg.workload.seed.rotate_left(32));
    let mut jobs = Vec::new();
    for p in order {
        if jobs.len() >= cfg.budget {
            break;
        }
        jobs.extend(
            history
                .kinds_at(p, random, seed)
                .into_iter()
                .map(|k| (p, k)),
        );
    }
    jobs.sort_by_key(|&(p, _)| p);
    jobs
}

struct Checked {
    point: u64,
    violations: Vec<Violation>,
    leaks: usize,
    qemu: bool,
}

fn worker(
    target: &dyn CrashTarget,
    prep: &Prepared,
    cfg: &RunConfig,
    label: &str,
    jobs: &[(usize, (u64, StateKind))],
) -> (Vec<Checked>, usize) {
    let mut replayer = prep.history.replayer();
    let mut bufs = Buffers::default();
    let mut seen: HashSet<u128> = HashSet::new();
    let mut seen_point = u64::MAX;
    let mut out = Vec::new();
    let mut duplicates = 0;
    for &(index, (point, kind)) in jobs {
        let state = replayer.state(point, kind);
        if point != seen_point {
            seen.clear();
            seen_point = point;
        }
        if !seen.insert(state.fingerprint()) {
            duplicates += 1;
            replayer.recycle(state);
            continue;
        }
        let view = prep.guest.view(point);
        let opts = CheckOptions {
            reopen: cfg.reopen_check,
            qemu_img: cfg.qemu_img_check && index % cfg.qemu_img_every.max(1) == 0,
        };
        let outcome = check::check_state(target, &prep.guest, &state, &view, opts, &mut bufs);
        let context = prep.guest.describe_point(&view);
        let state_desc = state.describe();
        replayer.recycle(state);
        out.push(Checked {
            point,
            violations: outcome
                .violations
                .into_iter()
                .map(|kind_| Violation {
                    target: label.to_string(),
                    workload_seed: cfg.workload.seed,
                    state_seed: cfg.state_seed,
                    point,
                    state: kind,
                    state_desc: state_desc.clone(),
                    context: context.clone(),
                    kind: kind_,
                })
                .collect(),
            leaks: outcome.leaks,
            qemu: outcome.qemu_checked,
        });
    }
    (out, duplicates)
}

/// Runs the workload of `cfg` on `target`, then checks crash states
/// within the budget.
pub fn run(target: &dyn CrashTarget, cfg: &RunConfig) -> Result<Report, HarnessError> {
    if cfg.qemu_img_check && !qemu_img_available() {
        return Err(HarnessError::NoQemuImg);
    }
    let started = Instant::now();
    let label = target.label();
    let prep = prepare(target, cfg)?;
    let jobs: Vec<(usize, (u64, StateKind))> =
        plan(&prep.history, cfg).into_iter().enumerate().collect();
    let threads = match cfg.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // Contiguous runs of points per worker keep replay incremental; cut at
    // point boundaries so duplicate detection stays per point.
    let per = jobs.len().div_ceil(threads).max(1);
    let mut chunks: Vec<&[(usize, (u64, StateKind))]> = Vec::new();
    let mut rest = &jobs[..];
    while !rest.is_empty() {
        let mut cut = per.min(rest.len());
        while cut < rest.len() && rest[cut].1.0 == rest[cut - 1].1.0 {
            cut += 1;
        }
        let (a, b) = rest.split_at(cut);
        chunks.push(a);
        rest = b;
    }
    let results: Vec<(Vec<Checked>, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|chunk| {
                let (prep, label) = (&prep, &label);
                s.spawn(move || worker(target, prep, cfg, label, chunk))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut report = Report {
        target: label,
        workload_seed: cfg.workload.seed,
        state_seed: cfg.state_seed,
        guest_ops: prep.guest.ops.len(),
        log_entries: prep.history.len(),
        live: prep.live,
        ..Report::default()
    };
    let mut points = HashSet::new();
    for (checked, dups) in results {
        report.duplicates += dups;
        for c in checked {
            points.insert(c.point);
            report.states += 1;
            if c.leaks > 0 {
                report.states_with_leaks += 1;
                report.leaked_clusters += c.leaks;
            }
            report.qemu_img_checks += usize::from(c.qemu);
            if !c.violations.is_empty() {
                report.violating_states += 1;
                for v in c.violations {
                    if report.violations.len() < cfg.max_reported {
                        report.violations.push(v);
                    }
                }
            }
        }
    }
    report.crash_points = points.len();
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Replays one crash state of a sweep (same target and `cfg`, in
/// particular the same workload seed) and returns its violations.
pub fn reproduce(
    target: &dyn CrashTarget,
    cfg: &RunConfig,
    point: u64,
    kind: StateKind,
) -> Result<Vec<Violation>, HarnessError> {
    if cfg.qemu_img_check && !qemu_img_available() {
        return Err(HarnessError::NoQemuImg);
    }
    let prep = prepare(target, cfg)?;
    let (checked, _) = worker(target, &prep, cfg, &target.label(), &[(0, (point, kind))]);
    Ok(checked.into_iter().flat_map(|c| c.violations).collect())
}

/// Runs `target` once per workload seed (`VDCACHE_CRASH_SEEDS`, default 1)
/// with `budget` states each (`VDCACHE_CRASH_STATES` overrides) and returns
/// every report: what the tests and the long-sweep command share.
pub fn sweep(
    target: &dyn CrashTarget,
    base: &RunConfig,
    budget: usize,
) -> Result<Vec<Report>, HarnessError> {
    let budget = state_budget(budget);
    let mut reports = Vec::new();
    for s in seed_offsets(seed_count(1)) {
        let mut cfg = base.clone();
        cfg.budget = budget;
        cfg.workload.seed = base.workload.seed + s;
        reports.push(run(target, &cfg)?);
    }
    Ok(reports)
}

/// A test's state budget: `release` in optimised builds, a fifth in debug
/// builds (which run the same code several times slower).
pub fn test_budget(release: usize) -> usize {
    if cfg!(debug_assertions) {
        release / 5
    } else {
        release
    }
}

/// Sweeps `target` with [`test_budget`]`(states)` and panics listing every
/// violation found; returns the number of states explored. For tests.
pub fn sweep_clean(target: &dyn CrashTarget, base: &RunConfig, states: usize) -> usize {
    let reports = match sweep(target, base, test_budget(states)) {
        Ok(r) => r,
        Err(e) => panic!("crash harness failed: {e}"),
    };
    for r in &reports {
        eprintln!("{}", r.summary());
    }
    let bad: Vec<&Report> = reports.iter().filter(|r| !r.is_clean()).collect();
    assert!(
        bad.is_empty(),
        "crash violations:\n{}",
        bad.iter().map(|r| r.to_string()).collect::<String>()
    );
    reports.iter().map(|r| r.states).sum()
}
