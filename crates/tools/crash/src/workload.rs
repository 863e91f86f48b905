//! The seeded guest workload: aligned and unaligned writes, zero writes
//! (with and without unmap), discards, flushes, FUA, reads, reopens and a
//! final close, concentrated on a hot region so that data is overwritten,
//! copied on write and freed. Every op records where it sits in the device
//! log and what the guest disk reads afterwards (the model).
//!
//! This module owns generating and running the workload. It must not
//! look at devices or judge crash states; it does check that the live disk
//! reads what the model says (a bug without any crash).

use crate::error::HarnessError;
use crate::model::{GuestHistory, GuestModel, GuestOp, GuestOpKind, SECTOR};
use rand::Rng as _;

use crate::rng::{Draw, Rng, SeedableRng};
use crate::target::{CrashTarget, RecordingFiles};
use std::sync::Arc;
use vdcache_image::{VirtualDisk, ZeroFlags};

/// How the workload is generated.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub seed: u64,
    /// Guest ops, not counting the final close.
    pub ops: usize,
    /// Percentage of writes and zero writes sent with FUA.
    pub fua_percent: u64,
    pub zero_writes: bool,
    pub discards: bool,
    pub reopens: bool,
    /// End with a clean close (crash points inside it are tested too).
    pub close_at_end: bool,
    /// Percentage of ops aimed at the hot first quarter of the disk.
    pub hot_percent: u64,
    /// Longest write; `None` is three clusters (at least 4 KiB).
    pub max_len: Option<u64>,
    /// When non-zero, writes are made of 4 KiB guest blocks drawn from this
    /// many patterns, so the same bytes land at many addresses (for a
    /// deduplicating cache); zero: every write's bytes are its own.
    pub duplicate_patterns: u32,
    /// Times an op that fails is tried again before the run fails: for
    /// targets whose storage fails for a while (a full file system), as a
    /// guest retries a failed request. An op counts once it succeeded;
    /// crash points during its failed tries find it in flight. Zero: the
    /// first failure fails the run.
    pub retries: u32,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            seed: 1,
            ops: 150,
            fua_percent: 10,
            zero_writes: true,
            discards: true,
            reopens: true,
            close_at_end: true,
            hot_percent: 70,
            max_len: None,
            duplicate_patterns: 0,
            retries: 0,
        }
    }
}

/// Runs `attempt` until it succeeds, at most `retries` times more.
fn retrying<T, E>(retries: u32, mut attempt: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let mut left = retries;
    loop {
        match attempt() {
            Err(_) if left > 0 => left -= 1,
            done => return done,
        }
    }
}

/// The result of running a workload.
#[derive(Debug)]
pub struct WorkloadRun {
    pub history: GuestHistory,
    /// Mismatches of the live disk against the model (no crash involved).
    pub live: Vec<String>,
}

struct Planned {
    kind: GuestOpKind,
    offset: u64,
    len: u64,
    fua: bool,
}

/// Pattern block `k` of the workload seeded `seed`: 4 KiB of its own.
fn pattern_block(seed: u64, k: u32) -> Vec<u8> {
    let mut b = vec![0u8; PATTERN_BLOCK as usize];
    Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15 ^ u64::from(k)).fill_bytes(&mut b);
    b
}

const PATTERN_BLOCK: u64 = 4096;

/// Fills `data` (written at guest offset `off`) block by block, each
/// 4 KiB-aligned guest block from a pattern drawn with `rng`, so equal
/// blocks land at many addresses.
fn fill_from_patterns(rng: &mut Rng, cfg: &WorkloadConfig, off: u64, data: &mut [u8]) {
    let end = off + data.len() as u64;
    let mut b = off / PATTERN_BLOCK;
    while b * PATTERN_BLOCK < end {
        let block = pattern_block(
            cfg.seed,
            rng.below(u64::from(cfg.duplicate_patterns)) as u32,
        );
        let (s, e) = (
            (b * PATTERN_BLOCK).max(off),
            ((b + 1) * PATTERN_BLOCK).min(end),
        );
        let from = (s - b * PATTERN_BLOCK) as usize;
        data[(s - off) as usize..(e - off) as usize]
            .copy_from_slice(&block[from..from + (e - s) as usize]);
        b += 1;
    }
}

fn plan(rng: &mut Rng, cfg: &WorkloadConfig, size: u64, cluster: u64) -> Planned {
    let hot = (size / 4).max(4 * cluster).min(size);
    let span = if rng.chance(cfg.hot_percent) {
        hot
    } else {
        size
    };
    let max_len = cfg
        .max_len
        .unwrap_or((3 * cluster).clamp(4096, 1 << 20))
        .clamp(SECTOR, size);
    let roll = rng.below(100);
    let mut kind = match roll {
        0..=59 => GuestOpKind::Write,
        60..=71 => GuestOpKind::WriteZeroes {
            may_unmap: rng.chance(50),
        },
        72..=80 => GuestOpKind::Discard,
        81..=86 => GuestOpKind::Read,
        87..=97 => GuestOpKind::Flush,
        _ => GuestOpKind::Reopen,
    };
    if (!cfg.zero_writes && matches!(kind, GuestOpKind::WriteZeroes { .. }))
        || (!cfg.discards && kind == GuestOpKind::Discard)
        || (!cfg.reopens && kind == GuestOpKind::Reopen)
    {
        kind = GuestOpKind::Write;
    }
    let (offset, len) = match rng.below(4) {
        // Sector aligned, a few sectors.
        0 => {
            let off = rng.below(span / SECTOR) * SECTOR;
            (off, rng.range(1, 16) * SECTOR)
        }
        // Cluster aligned, whole clusters.
        1 => {
            let off = rng.below(span / cluster) * cluster;
            (off, rng.range(1, 3) * cluster)
        }
        // Anything.
        2 => (rng.below(span), rng.range(1, max_len)),
        // Sector aligned, up to the maximum length.
        _ => {
            let off = rng.below(span / SECTOR) * SECTOR;
            (off, rng.range(1, max_len / SECTOR) * SECTOR)
        }
    };
    let offset = offset.min(size - 1);
    let len = len.min(size - offset).max(1);
    let fua = matches!(kind, GuestOpKind::Write | GuestOpKind::WriteZeroes { .. })
        && rng.chance(cfg.fua_percent);
    Planned {
        kind,
        offset,
        len,
        fua,
    }
}

fn read_all(disk: &VirtualDisk) -> vdcache_image::Result<Vec<u8>> {
    let mut buf = vec![0u8; disk.size() as usize];
    disk.read(0, &mut buf)?;
    Ok(buf)
}

/// Runs the workload of `cfg` on `target`'s disk over `files` (whose
/// devices `target` created).
pub fn run_workload(
    target: &dyn CrashTarget,
    files: &Arc<RecordingFiles>,
    cfg: &WorkloadConfig,
) -> Result<WorkloadRun, HarnessError> {
    let label = target.label();
    let open = |files: &Arc<RecordingFiles>| {
        target.open(files).map_err(|source| HarnessError::Open {
            target: label.clone(),
            source,
        })
    };
    let mut disk = open(files)?;
    let size = disk.size();
    let cluster = disk.cluster_size().max(SECTOR);
    let fail = |op: usize, desc: String, source| HarnessError::Workload {
        target: label.clone(),
        seed: cfg.seed,
        op,
        desc,
        source: Box::new(source),
    };
    let initial = read_all(&disk).map_err(|e| fail(0, "initial read".into(), e))?;
    let mut model = GuestModel::new(initial);
    let mut ops: Vec<GuestOp> = Vec::new();
    let mut live = Vec::new();
    let mut rng = Rng::seed_from_u64(cfg.seed);
    let log = files.log().clone();
    let total = cfg.ops + usize::from(cfg.close_at_end);
    let compare = |disk: &VirtualDisk, model: &GuestModel, live: &mut Vec<String>| {
        let all = read_all(disk).map_err(|e| fail(cfg.ops, "final read".into(), e))?;
        if all == model.current() {
            return Ok(());
        }
        if let Some(d) = all.iter().zip(model.current()).position(|(a, b)| a != b) {
            live.push(format!(
                "workload seed {:#x}: after the workload the live disk differs from the model at guest offset {d:#x}",
                cfg.seed
            ));
        }
        Ok::<(), HarnessError>(())
    };
    for i in 0..total {
        if i == cfg.ops {
            // The live disk must read exactly what the model says.
            compare(&disk, &model, &mut live)?;
        }
        let p = if i == cfg.ops {
            Planned {
                kind: GuestOpKind::Close,
                offset: 0,
                len: 0,
                fua: false,
            }
        } else {
            plan(&mut rng, cfg, size, cluster)
        };
        let mut op = GuestOp {
            kind: p.kind,
            offset: p.offset,
            len: p.len,
            fua: p.fua,
            start: log.len(),
            end: 0,
        };
        let desc = op.to_string();
        let (off, len) = (p.offset, p.len);
        match p.kind {
            GuestOpKind::Write => {
                let mut data = vec![0u8; len as usize];
                let mut op_rng =
                    Rng::seed_from_u64(cfg.seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
                if cfg.duplicate_patterns == 0 {
                    op_rng.fill_bytes(&mut data);
                } else {
                    fill_from_patterns(&mut op_rng, cfg, off, &mut data);
                }
                retrying(cfg.retries, || disk.write(off, &data, p.fua))
                    .map_err(|e| fail(i, desc.clone(), e))?;
                model.apply(i, off, &data);
            }
            GuestOpKind::WriteZeroes { may_unmap } => {
                let flags = ZeroFlags {
                    may_unmap,
                    fua: p.fua,
                };
                retrying(cfg.retries, || disk.write_zeroes(off, len, flags))
                    .map_err(|e| fail(i, desc.clone(), e))?;
                model.apply(i, off, &vec![0u8; len as usize]);
            }
            GuestOpKind::Discard => {
                retrying(cfg.retries, || disk.discard(off, len))
                    .map_err(|e| fail(i, desc.clone(), e))?;
                // What a discard leaves is the target's business (zeros
                // or the old bytes, per sector); learn it by reading.
                let a = off / SECTOR * SECTOR;
                let b = (off + len).div_ceil(SECTOR) * SECTOR;
                let b = b.min(size);
                let mut now = vec![0u8; (b - a) as usize];
                retrying(cfg.retries, || disk.read(a, &mut now))
                    .map_err(|e| fail(i, format!("read after {desc}"), e))?;
                for (n, (got, old)) in now
                    .chunks(SECTOR as usize)
                    .zip(model.current()[a as usize..b as usize].chunks(SECTOR as usize))
                    .enumerate()
                {
                    let s_off = a + n as u64 * SECTOR;
                    let inside = s_off >= off && s_off + got.len() as u64 <= off + len;
                    let zero = got.iter().all(|&x| x == 0);
                    if got != old && !(inside && zero) {
                        live.push(format!(
                            "workload seed {:#x} op #{i} {desc}: guest sector {s_off:#x} reads neither its old bytes nor zeros afterwards",
                            cfg.seed
                        ));
                        break;
                    }
                }
                model.apply(i, a, &now);
            }
            GuestOpKind::Read => {
                let mut buf = vec![0u8; len as usize];
                retrying(cfg.retries, || disk.read(off, &mut buf))
                    .map_err(|e| fail(i, desc.clone(), e))?;
                let want = &model.current()[off as usize..(off + len) as usize];
                if let Some(d) = buf.iter().zip(want).position(|(a, b)| a != b) {
                    live.push(format!(
                        "workload seed {:#x} op #{i} {desc}: live read differs from the model at guest offset {:#x}",
                        cfg.seed,
                        off + d as u64
                    ));
                }
            }
            GuestOpKind::Flush => {
                retrying(cfg.retries, || disk.flush()).map_err(|e| fail(i, desc.clone(), e))?
            }
            GuestOpKind::Reopen => {
                retrying(cfg.retries, || disk.close()).map_err(|e| fail(i, desc.clone(), e))?;
                drop(disk);
                disk = retrying(cfg.retries, || open(files))?;
            }
            GuestOpKind::Close => {
                retrying(cfg.retries, || disk.close()).map_err(|e| fail(i, desc.clone(), e))?
            }
        }
        op.end = log.len();
        ops.push(op);
    }
    if !cfg.close_at_end {
        compare(&disk, &model, &mut live)?;
    }
    drop(disk);
    Ok(WorkloadRun {
        history: GuestHistory::new(ops, model),
        live,
    })
}
