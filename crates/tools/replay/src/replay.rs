//! Replaying a trace through a [`Rig`]: each record becomes a read, write,
//! discard or flush of the real virtual disk; the report gathers the
//! cache's own counters, the stores' meters and the FTL model. It must not
//! count anything the engine or cache does not really do. With dedup on,
//! reads of blocks the replay never wrote are seeded first (`seed`).

use crate::rig::{DiskLayout, Rig, RigConfig, RigError};
use crate::scan::{TraceScan, beyond_bounds, refused, scan_trace};
use crate::seed::{Seeder, stamp_block};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;
use thiserror::Error;
use vdcache_cache::DiskStats;
use vdcache_cache::dedup::DedupCounts;
use vdcache_eval::cost::{LatencyHistogram, LatencySummary};
use vdcache_eval::trace::CONTENT_BLOCK;
use vdcache_eval::{Format, Op, TraceError, TraceRecord, open_trace};

#[derive(Debug, Error)]
pub enum ReplayError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Rig(#[from] RigError),
    #[error("record {record}: {op} of {len} bytes at {offset} on disk {disk}: {source}")]
    Request {
        record: u64,
        op: Op,
        offset: u64,
        len: u64,
        disk: u32,
        source: vdcache_image::ImageError,
    },
    #[error("the trace has no read or write requests")]
    Empty,
    #[error(
        "the trace changed while it was replayed: {scanned} records when it was scanned, {replayed} when replayed (a trace is read twice; give a file that stays as it is)"
    )]
    Changed { scanned: u64, replayed: u64 },
}

/// How big the cache is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheSize {
    Bytes(u64),
    /// Percent of the trace's working set.
    PercentOfWorkingSet(f64),
}

/// What to replay and how.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub rig: RigConfig,
    pub cache_size: CacheSize,
    /// Trace time between snapshots (qcow2 layout); `None` never.
    pub snapshot_every_ns: Option<u64>,
}

/// Progress, for a bar.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// Counters at a snapshot boundary (or the end): what happened since the
/// previous one.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Interval {
    pub trace_seconds: f64,
    pub requests: u64,
    pub flash_bytes_written: u64,
    pub backend_bytes_written: u64,
    pub read_hit_ratio: f64,
}

/// What deduplication did in a replay (the cache's own figures).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct DedupFigures {
    /// Cached addresses per distinct cache block they map to, at the end
    /// (1.0: nothing shared).
    pub ratio: f64,
    /// Distinct cache blocks the cached addresses map to, at the end.
    pub unique_blocks: u64,
    /// 4 KiB blocks (written, or read and promoted) mapped onto a block
    /// already in flash instead of written to it, over the replay.
    pub blocks_shared: u64,
    /// `blocks_shared` x 4 KiB: the flash data writes dedup spared.
    pub flash_bytes_saved: u64,
    /// Blocks fingerprinted (BLAKE3: candidates and the blocks they were
    /// compared with), and the mean time per block in ns:
    /// wall clock on this machine, the one figure that differs between
    /// two runs of the same replay.
    pub hashed_blocks: u64,
    pub hash_ns_per_block: f64,
    /// Checksums in the signature table at the end, and its memory
    /// (part of `index_memory_bytes`).
    pub signatures: u64,
    pub table_memory_bytes: u64,
    /// Signature-table lookups, candidates, hits, stale entries dropped,
    /// and collisions over the replay.
    pub counts: DedupCounts,
    /// Blocks of reads the replay seeded with the trace's content before
    /// reading them (never written by the replay; see `seed`).
    pub seeded_blocks: u64,
}

/// Everything a replay reports; `--json` prints it as is.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplayReport {
    pub trace: String,
    pub format: String,
    pub layout: DiskLayout,
    pub policy: &'static str,
    pub admission: &'static str,
    pub cache_mode: &'static str,
    pub cow: &'static str,
    pub cache_bytes: u64,
    /// The size asked for, as percent of the working set (when so given).
    pub cache_percent_of_working_set: Option<f64>,
    pub region_bytes: u64,
    /// 4 KiB blocks the cache holds when full.
    pub cache_capacity_blocks: u64,
    pub disks: usize,
    pub records: u64,
    pub reads: u64,
    pub writes: u64,
    pub discards: u64,
    pub flushes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub working_set_bytes: u64,
    /// Guest-read 4 KiB blocks served from flash / all guest-read blocks
    /// that reached the cache.
    pub read_hit_ratio: f64,
    /// Guest-written 4 KiB blocks already in flash / all written blocks.
    pub write_hit_ratio: f64,
    pub read_hit_blocks: u64,
    pub read_miss_blocks: u64,
    /// Bytes the cache wrote to its device (data zone and metadata zone).
    pub flash_bytes_written: u64,
    pub flash_data_bytes_written: u64,
    pub flash_meta_bytes_written: u64,
    pub flash_bytes_read: u64,
    /// Bytes read from and written to the image stores (the slow tier).
    pub backend_bytes_read: u64,
    pub backend_bytes_written: u64,
    pub backend_syncs: u64,
    pub dirty_bytes_at_end: u64,
    /// L2 hit ratio of the COW layer's metadata cache (qcow2 layout).
    pub meta_hit_ratio: Option<f64>,
    pub latency: LatencySummary,
    pub read_latency: LatencySummary,
    pub write_latency: LatencySummary,
    pub flash_profile: &'static str,
    pub backend_profile: &'static str,
    pub index_memory_bytes: u64,
    /// See `CacheReport`: the part sized by the device, and the rest as a
    /// fraction of the cached bytes.
    pub index_memory_fixed_bytes: u64,
    pub index_memory_ratio: f64,
    pub ftl_erases: u64,
    pub ftl_write_amplification: Option<f64>,
    /// Deduplication: off, on or verify.
    pub dedup_mode: &'static str,
    /// Dedup's figures; `None` (null) when dedup is off.
    pub dedup: Option<DedupFigures>,
    pub intervals: Vec<Interval>,
    pub elapsed_seconds: f64,
}

/// Scans, then replays `path`. `progress` is called now and then.
pub fn replay_file(
    path: &Path,
    format: Option<Format>,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ReplayReport, ReplayError> {
    let scan = scan_trace(path, format)?;
    replay_scanned(path, format, &scan, opts, progress)
}

/// Replays `path` whose scan is already known (a sweep scans once).
pub fn replay_scanned(
    path: &Path,
    format: Option<Format>,
    scan: &TraceScan,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ReplayReport, ReplayError> {
    let working_set = scan.working_set_bytes();
    if working_set == 0 {
        return Err(ReplayError::Empty);
    }
    let mut rig_config = opts.rig.clone();
    rig_config.cache_bytes = match opts.cache_size {
        CacheSize::Bytes(b) => b,
        CacheSize::PercentOfWorkingSet(p) => {
            let bytes = (working_set as f64 * p / 100.0) as u64;
            bytes.div_ceil(CONTENT_BLOCK) * CONTENT_BLOCK
        }
    };
    let sizes: BTreeMap<u32, u64> = scan.disks.iter().map(|(&n, d)| (n, d.end)).collect();
    let mut rig = Rig::new(rig_config, &sizes)?;
    let mut reader = open_trace(path, format)?;
    let format_name = reader.format().to_string();
    let started = Instant::now();
    let mut run = Run {
        seeder: (rig.cache.is_some() && rig.config.dedup.enabled()).then(Seeder::default),
        ..Run::default()
    };
    let mut next_snapshot: Option<u64> = None;
    progress(Progress {
        done: 0,
        total: scan.records,
    });
    let mut i = 0usize;
    while let Some(rec) = reader.next() {
        let rec = rec?;
        // The scan refused such a record; one here means the file changed.
        if let Some(why) = beyond_bounds(&rec) {
            return Err(refused(reader.line(), why).into());
        }
        if let Some(every) = opts.snapshot_every_ns.filter(|&e| e > 0) {
            let due = *next_snapshot.get_or_insert(rec.time_ns.saturating_add(every));
            if rec.time_ns >= due {
                run.close_interval(&rig, rec.time_ns);
                rig.snapshot()?;
                next_snapshot = Some(due.saturating_add(every).max(rec.time_ns + 1));
            }
        }
        run.apply(&rig, i as u64, &rec)?;
        if i % 4096 == 4095 {
            progress(Progress {
                done: i as u64 + 1,
                total: scan.records,
            });
        }
        i += 1;
    }
    progress(Progress {
        done: scan.records,
        total: scan.records,
    });
    if run.records != scan.records {
        return Err(ReplayError::Changed {
            scanned: scan.records,
            replayed: run.records,
        });
    }
    run.close_interval(&rig, run.last_time_ns);
    let mut report = run.report(&rig, path, format_name, scan, started);
    if let CacheSize::PercentOfWorkingSet(p) = opts.cache_size {
        report.cache_percent_of_working_set = Some(p);
    }
    rig.close()?;
    Ok(report)
}

/// Counters of the replay loop itself.
#[derive(Default)]
struct Run {
    records: u64,
    reads: u64,
    writes: u64,
    discards: u64,
    flushes: u64,
    read_bytes: u64,
    write_bytes: u64,
    all: LatencyHistogram,
    read: LatencyHistogram,
    write: LatencyHistogram,
    buf: Vec<u8>,
    first_time_ns: Option<u64>,
    last_time_ns: u64,
    intervals: Vec<Interval>,
    /// Counters at the start of the current interval.
    mark: (u64, u64, u64, DiskStats),
    /// With dedup: seeds reads of blocks the replay never wrote.
    seeder: Option<Seeder>,
}

impl Run {
    fn apply(&mut self, rig: &Rig, index: u64, rec: &TraceRecord) -> Result<(), ReplayError> {
        self.records += 1;
        self.first_time_ns.get_or_insert(rec.time_ns);
        self.last_time_ns = rec.time_ns;
        let Some(disk) = rig.disk(rec.disk) else {
            return Ok(());
        };
        // The disk is at least as big as the scan saw, rounded up.
        let len = rec.len.min(disk.size().saturating_sub(rec.offset));
        let fail = |source| ReplayError::Request {
            record: index + 1,
            op: rec.op,
            offset: rec.offset,
            len: rec.len,
            disk: rec.disk,
            source,
        };
        match rec.op {
            Op::Read | Op::Write if len == 0 => return Ok(()),
            Op::Read => {
                self.reads += 1;
                self.read_bytes += len;
                if let Some(s) = &mut self.seeder {
                    s.before_read(rig, rec, len)?;
                }
                self.buf.resize(len as usize, 0);
                disk.read(rec.offset, &mut self.buf).map_err(fail)?;
            }
            Op::Write => {
                self.writes += 1;
                self.write_bytes += len;
                if let Some(s) = &mut self.seeder {
                    s.written(rec.disk, rec.offset, len);
                }
                fill_content(&mut self.buf, rec, len, index);
                disk.write(rec.offset, &self.buf, false).map_err(fail)?;
            }
            Op::Discard => {
                self.discards += 1;
                if let Some(s) = &mut self.seeder {
                    s.written(rec.disk, rec.offset, len);
                }
                if len > 0 {
                    disk.discard(rec.offset, len).map_err(fail)?;
                }
            }
            Op::Flush => {
                self.flushes += 1;
                disk.flush().map_err(fail)?;
            }
        }
        let ns = rig.flash_meter.take_pending_ns() + rig.backend_meter.take_pending_ns();
        match rec.op {
            Op::Read => self.read.record(ns),
            Op::Write => self.write.record(ns),
            _ => {}
        }
        if matches!(rec.op, Op::Read | Op::Write) {
            self.all.record(ns);
        }
        Ok(())
    }

    fn close_interval(&mut self, rig: &Rig, now_ns: u64) {
        let stats = cache_totals(rig);
        let flash = flash_written(rig);
        let backend = rig.backend_meter.counts().bytes_written;
        let (requests0, flash0, backend0, stats0) = self.mark;
        let hits = stats.read_hit_blocks - stats0.read_hit_blocks;
        let misses = stats.read_miss_blocks - stats0.read_miss_blocks;
        self.intervals.push(Interval {
            trace_seconds: now_ns.saturating_sub(self.first_time_ns.unwrap_or(now_ns)) as f64 / 1e9,
            requests: self.records - requests0,
            flash_bytes_written: flash - flash0,
            backend_bytes_written: backend - backend0,
            read_hit_ratio: ratio(hits, misses),
        });
        self.mark = (self.records, flash, backend, stats);
    }

    fn report(
        &mut self,
        rig: &Rig,
        path: &Path,
        format: String,
        scan: &TraceScan,
        started: Instant,
    ) -> ReplayReport {
        let cfg = &rig.config;
        let stats = cache_totals(rig);
        let cache_report = rig.cache.as_ref().map(|c| c.cache.report());
        let device = cache_report.as_ref().map(|r| r.device).unwrap_or_default();
        let ftl = rig.cache.as_ref().map(|c| c.ftl.stats());
        let backend = rig.backend_meter.counts();
        let dedup = cache_report
            .as_ref()
            .and_then(|r| r.dedup.as_ref())
            .map(|d| DedupFigures {
                ratio: d.ratio,
                unique_blocks: d.unique_blocks,
                blocks_shared: stats.dedup_blocks_shared,
                flash_bytes_saved: stats.dedup_blocks_shared * CONTENT_BLOCK,
                hashed_blocks: stats.hashed_blocks,
                hash_ns_per_block: if stats.hashed_blocks == 0 {
                    0.0
                } else {
                    stats.hash_nanos as f64 / stats.hashed_blocks as f64
                },
                signatures: d.signatures,
                table_memory_bytes: d.table_memory_bytes,
                counts: d.counts,
                seeded_blocks: self.seeder.as_ref().map_or(0, |s| s.seeded_blocks),
            });
        let (l2_hits, l2_misses) = rig
            .disks()
            .filter_map(|d| d.meta_stats())
            .fold((0, 0), |(h, m), s| (h + s.l2.hits, m + s.l2.misses));
        ReplayReport {
            trace: path.display().to_string(),
            format,
            layout: cfg.layout,
            policy: cfg.replacement.name(),
            admission: cfg.policy.admission.name(),
            cache_mode: cfg.policy.mode.name(),
            cow: cfg.policy.cow.name(),
            cache_bytes: cfg.cache_bytes,
            cache_percent_of_working_set: None,
            region_bytes: cfg.region_bytes,
            cache_capacity_blocks: rig.cache.as_ref().map_or(0, |c| c.capacity_blocks),
            disks: scan.disks.len(),
            records: self.records,
            reads: self.reads,
            writes: self.writes,
            discards: self.discards,
            flushes: self.flushes,
            read_bytes: self.read_bytes,
            write_bytes: self.write_bytes,
            working_set_bytes: scan.working_set_bytes(),
            read_hit_ratio: stats.read_hit_ratio(),
            write_hit_ratio: stats.write_hit_ratio(),
            read_hit_blocks: stats.read_hit_blocks,
            read_miss_blocks: stats.read_miss_blocks,
            flash_bytes_written: device.data_bytes_written + device.meta_bytes_written,
            flash_data_bytes_written: device.data_bytes_written,
            flash_meta_bytes_written: device.meta_bytes_written,
            flash_bytes_read: device.bytes_read,
            backend_bytes_read: backend.bytes_read,
            backend_bytes_written: backend.bytes_written,
            backend_syncs: backend.syncs,
            dirty_bytes_at_end: cache_report.as_ref().map_or(0, |r| r.dirty_bytes),
            meta_hit_ratio: (cfg.layout == DiskLayout::Qcow2).then(|| ratio(l2_hits, l2_misses)),
            latency: self.all.summary(),
            read_latency: self.read.summary(),
            write_latency: self.write.summary(),
            flash_profile: cfg.flash.name,
            backend_profile: cfg.backend.name,
            index_memory_bytes: cache_report.as_ref().map_or(0, |r| r.index_memory_bytes),
            index_memory_fixed_bytes: cache_report
                .as_ref()
                .map_or(0, |r| r.index_memory_fixed_bytes),
            index_memory_ratio: cache_report.as_ref().map_or(0.0, |r| r.index_memory_ratio),
            ftl_erases: ftl.map_or(0, |f| f.erases),
            ftl_write_amplification: ftl.and_then(|f| f.write_amplification),
            dedup_mode: if rig.cache.is_some() {
                cfg.dedup.name()
            } else {
                "off"
            },
            dedup,
            intervals: std::mem::take(&mut self.intervals),
            elapsed_seconds: started.elapsed().as_secs_f64(),
        }
    }
}

fn ratio(hits: u64, misses: u64) -> f64 {
    if hits + misses == 0 {
        0.0
    } else {
        hits as f64 / (hits + misses) as f64
    }
}

fn cache_totals(rig: &Rig) -> DiskStats {
    rig.cache
        .as_ref()
        .map(|c| c.cache.report().total)
        .unwrap_or_default()
}

fn flash_written(rig: &Rig) -> u64 {
    rig.cache.as_ref().map_or(0, |c| {
        let d = c.cache.report().device;
        d.data_bytes_written + d.meta_bytes_written
    })
}

/// The bytes a write carries: the trace's content digests when it has
/// them (so equal digests are equal blocks), else bytes unique to the
/// record and block.
fn fill_content(buf: &mut Vec<u8>, rec: &TraceRecord, len: u64, index: u64) {
    buf.clear();
    buf.resize(len as usize, 0);
    for (i, block) in buf.chunks_mut(CONTENT_BLOCK as usize).enumerate() {
        let stamp: [u8; 16] = match rec.content.as_ref().and_then(|c| c.get(i)) {
            Some(hash) => *hash,
            None => {
                let mut s = [0u8; 16];
                s[..8].copy_from_slice(&(rec.offset / CONTENT_BLOCK + i as u64).to_le_bytes());
                s[8..].copy_from_slice(&index.to_le_bytes());
                s
            }
        };
        stamp_block(block, &stamp);
    }
}
