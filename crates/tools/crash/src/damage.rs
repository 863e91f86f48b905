//! Fault model: the cache device's metadata damaged at rest (issue 43).
//! For process-crash states of a [`CacheTarget`]'s run (every write
//! reached the device, as after kill -9), each metadata structure of the
//! cache device ([`vdcache_cache::sites`]: superblock and copy, seal,
//! checkpoint headers and payloads, the first, middle and last journal
//! batch replay reads, the data blocks they name, the whole journal) is
//! damaged in turn, one per check, and the cache is opened as serve opens
//! it. Either recovery refuses the device with a typed error naming the
//! damage ([`CacheError::Damaged`], or [`CacheError::Corrupt`] when no
//! checkpoint verifies), or every guest sector reads a value the guest
//! model allows (flushed data exactly, never stale); a read may fail only
//! if recovery reported damaged blocks.
//!
//! Power-cut states are not swept: the seal that tells a damaged newest
//! batch from a torn one is written after the sync it reports and is not
//! synced itself, so a power cut right after a flush may take it, and the
//! damage of that flush's batch then reads as a torn tail.
//!
//! Crash points are drawn like the sweeps' (seeded by the workload and
//! state seeds), sites enumerated in a fixed order: a run reproduces.
//!
//! This module owns the choice of points and sites, the damage and the
//! verdict. It must not relax the guest model nor count any other error
//! as a refusal.

use crate::cache_target::{CACHE_DEVICE, CacheTarget};
use crate::error::HarnessError;
use crate::harness::{Prepared, RunConfig, prepare};
use crate::model::{GuestHistory, PointView};
use crate::rng::{Draw, Rng, SeedableRng, mix};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vdcache_backend::BackendRef;
use vdcache_backend::recording::{CrashState, StateKind};
use vdcache_cache::sites::{Site, metadata_sites};
use vdcache_cache::{CacheConfig, CacheError};
use vdcache_image::MemFiles;

/// What one damaged state came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Recovery refused the device, naming the damage.
    pub refused: usize,
    /// The cache opened and every sector read an allowed value.
    pub served: usize,
    /// Of those served, the states where recovery reported damaged blocks.
    pub damaged_blocks: usize,
    /// States with a violation.
    pub violating: usize,
}

/// The result of a damaged-metadata sweep.
#[derive(Debug, Clone, Default)]
pub struct DamageReport {
    pub target: String,
    pub workload_seed: u64,
    pub crash_points: usize,
    /// Damaged states checked (points times sites).
    pub states: usize,
    /// By kind of structure damaged.
    pub by_kind: BTreeMap<&'static str, Tally>,
    /// The first violations, each with its point and site.
    pub violations: Vec<String>,
    pub elapsed: Duration,
}

impl DamageReport {
    pub fn is_clean(&self) -> bool {
        self.violating() == 0
    }

    pub fn violating(&self) -> usize {
        self.by_kind.values().map(|t| t.violating).sum()
    }

    /// One line: counts per kind and time.
    pub fn summary(&self) -> String {
        let kinds: Vec<String> = self
            .by_kind
            .iter()
            .map(|(k, t)| format!("{k} {}/{}/{}", t.refused, t.served, t.violating))
            .collect();
        format!(
            "{}: workload seed {:#x}: {} crash points, {} damaged states (refused/served/violating: {}), {:.1}s",
            self.target,
            self.workload_seed,
            self.crash_points,
            self.states,
            kinds.join(", "),
            self.elapsed.as_secs_f64()
        )
    }
}

/// Runs the workload of `cfg` on `target`, then damages each metadata
/// structure of the cache device in the process-crash state of `points`
/// crash points and checks what recovery makes of it.
pub fn sweep_damage(
    target: &CacheTarget,
    cfg: &RunConfig,
    points: usize,
) -> Result<DamageReport, HarnessError> {
    let started = Instant::now();
    let prep = prepare(target, cfg)?;
    let chosen = choose_points(prep.history.len(), points, cfg);
    let mut report = DamageReport {
        target: crate::target::CrashTarget::label(target),
        workload_seed: cfg.workload.seed,
        crash_points: chosen.len(),
        ..DamageReport::default()
    };
    let threads = match cfg.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let per = chosen.len().div_ceil(threads).max(1);
    let checked: Vec<Checked> = std::thread::scope(|s| {
        let handles: Vec<_> = chosen
            .chunks(per)
            .map(|chunk| {
                let prep = &prep;
                s.spawn(move || check_points(target, prep, chunk))
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    for c in checked {
        report.states += 1;
        let t = report.by_kind.entry(c.kind).or_default();
        match c.verdict {
            Verdict::Refused => t.refused += 1,
            Verdict::Served { damaged_blocks } => {
                t.served += 1;
                t.damaged_blocks += usize::from(damaged_blocks);
            }
            Verdict::Violation(why) => {
                t.violating += 1;
                if report.violations.len() < cfg.max_reported {
                    report.violations.push(format!("{}: {why}", c.context));
                }
            }
        }
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// One damaged state's verdict, with where it was.
struct Checked {
    kind: &'static str,
    context: String,
    verdict: Verdict,
}

/// Damages every metadata site of the process-crash state of each point
/// in turn and judges recovery.
fn check_points(target: &CacheTarget, prep: &Prepared, points: &[u64]) -> Vec<Checked> {
    let mut replayer = prep.history.replayer();
    let mut out = Vec::new();
    for &point in points {
        let state = replayer.state(point, StateKind::All);
        let view = prep.guest.view(point);
        let sites = match state.device(CACHE_DEVICE).map(|d| {
            metadata_sites(&vdcache_backend::MemBackend::new(
                CACHE_DEVICE,
                d.data.clone(),
            ))
        }) {
            Some(Ok(sites)) => sites,
            None => Vec::new(),
            Some(Err(e)) => {
                out.push(Checked {
                    kind: "(none)",
                    context: format!("point {point}"),
                    verdict: Verdict::Violation(format!("the cache device cannot be read: {e}")),
                });
                Vec::new()
            }
        };
        for site in sites {
            out.push(Checked {
                kind: site.kind,
                context: format!(
                    "point {point} ({}), {} damaged",
                    prep.guest.describe_point(&view),
                    site.what
                ),
                verdict: check_site(target, &prep.guest, &state, &view, &site),
            });
        }
        replayer.recycle(state);
    }
    out
}

/// `points` crash points in a seeded order, sorted for the replayer.
fn choose_points(log_len: u64, points: usize, cfg: &RunConfig) -> Vec<u64> {
    let mut all: Vec<u64> = (0..=log_len).collect();
    let mut rng = Rng::seed_from_u64(cfg.state_seed ^ mix(cfg.workload.seed ^ 0x00da_3a9e));
    for i in (1..all.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        all.swap(i, j);
    }
    all.truncate(points);
    all.sort_unstable();
    all
}

enum Verdict {
    Refused,
    Served { damaged_blocks: bool },
    Violation(String),
}

/// The state's devices, the cache device damaged at `site`.
fn damaged_files(state: &CrashState, site: &Site) -> Arc<MemFiles> {
    let files = MemFiles::new();
    for d in &state.devices {
        let mut data = d.data.clone();
        if d.name == CACHE_DEVICE {
            site.apply(&mut data);
        }
        files.insert(&d.name, data);
    }
    files
}

fn check_site(
    target: &CacheTarget,
    guest: &GuestHistory,
    state: &CrashState,
    view: &PointView,
    site: &Site,
) -> Verdict {
    let files = damaged_files(state, site);
    let Some(dev) = files.get(CACHE_DEVICE) else {
        return Verdict::Violation("the crash state has no cache device".into());
    };
    let dev: BackendRef = dev;
    let cache = match vdcache_host::open_for_serving(dev, serving_config(&target.config), false) {
        Ok(c) => c,
        Err(CacheError::Damaged { .. } | CacheError::Corrupt(_)) => return Verdict::Refused,
        Err(e) => return Verdict::Violation(format!("recovery failed: {e}")),
    };
    let verdict = read_and_judge(target, guest, view, &files, &cache);
    let _ = cache.shutdown(true);
    verdict
}

/// The target's cache configuration as a restarted server has it.
fn serving_config(config: &CacheConfig) -> CacheConfig {
    CacheConfig {
        salvage: false,
        ..config.clone()
    }
}

/// Reads the whole guest disk through the recovered cache, a block at a
/// time, and judges what it read.
fn read_and_judge(
    target: &CacheTarget,
    guest: &GuestHistory,
    view: &PointView,
    files: &Arc<MemFiles>,
    cache: &Arc<vdcache_cache::FlashCache>,
) -> Verdict {
    const CHUNK: usize = 4096;
    let damaged = cache.report().recovery.damaged_blocks;
    let disk = match target.open_through(files.clone(), cache.clone()) {
        Ok(d) => d,
        // The image's own metadata was in a damaged block: it is refused,
        // naming the loss.
        Err(_) if damaged > 0 => return Verdict::Refused,
        Err(e) => return Verdict::Violation(format!("opening the disk failed: {e}")),
    };
    let size = disk.size() as usize;
    if size as u64 != guest.model.size() {
        return Verdict::Violation(format!("disk size {size} after recovery"));
    }
    let mut found = vec![0u8; size];
    let mut failed = Vec::new();
    // The whole disk at once; a block at a time only when that fails.
    if disk.read(0, &mut found).is_err() {
        for (i, chunk) in found.chunks_mut(CHUNK).enumerate() {
            if disk.read((i * CHUNK) as u64, chunk).is_err() {
                failed.push(i);
            }
        }
    }
    if !failed.is_empty() && damaged == 0 {
        return Verdict::Violation(format!(
            "{} block(s) failed to read (first at guest offset {:#x}) though recovery reported no damage",
            failed.len(),
            failed[0] * CHUNK
        ));
    }
    let sectors_per_chunk = CHUNK / crate::model::SECTOR as usize;
    let readable = |s: usize| failed.binary_search(&(s / sectors_per_chunk)).is_err();
    if let Some(m) = guest.check_readable(&found, view, readable) {
        return Verdict::Violation(format!("data: {m}"));
    }
    Verdict::Served {
        damaged_blocks: damaged > 0,
    }
}
