//! `vdcache replay`: drive a block trace through the real COW layer and
//! flash cache in-process, and `vdcache trace-gen`: write a synthetic
//! trace of a workload class. Argument parsing, progress and printing only;
//! the replay itself lives in vdcache-replay.

use crate::size::parse_size;
use anyhow::{Context, Result, bail};
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use vdcache_cache::{Admission, CowMode, Dedup, DiskPolicy, Replacement, WriteMode};
use vdcache_eval::Format;
use vdcache_eval::cost::DeviceProfile;
use vdcache_eval::trace::WriterOptions;
use vdcache_eval::workload::{WorkloadClass, WorkloadSpec, write_workload};
use vdcache_replay::sweep::{DEFAULT_PERCENTS, SweepOptions, sweep, sweep_table, write_sweep};
use vdcache_replay::{CacheSize, DiskLayout, ReplayOptions, ReplayReport, RigConfig, replay_file};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace file (.gz and .zst are read directly).
    trace: PathBuf,
    /// Trace format: msr, fiu, blkparse, fio (default: detected).
    #[arg(long)]
    format: Option<String>,
    /// raw: each trace disk is a plain block device; qcow2: a delta over a
    /// full base image.
    #[arg(long, default_value = "raw")]
    layout: String,
    /// Cached data capacity (default 10% of the working set).
    #[arg(long, value_name = "SIZE", conflicts_with = "cache_size_pct_of_wss")]
    cache_size: Option<String>,
    /// Cached data capacity as percent of the trace's working set.
    #[arg(long, value_name = "P")]
    cache_size_pct_of_wss: Option<f64>,
    /// Region (erase block) size of the cache.
    #[arg(long, default_value = "2M", value_name = "SIZE")]
    region_size: String,
    /// Replacement policy: lru, clock, arc.
    #[arg(long, default_value = "lru")]
    policy: String,
    /// Admission: all, hot, sequential-bypass.
    #[arg(long, default_value = "all")]
    admission: String,
    /// Guest sequential write runs reaching this size bypass flash (0:
    /// never).
    #[arg(long, default_value = "4M", value_name = "SIZE")]
    sequential_write_cutoff: String,
    /// writeback, writethrough, writearound.
    #[arg(long, default_value = "writeback")]
    cache_mode: String,
    /// stacked or cow-aware (qcow2 layout).
    #[arg(long, default_value = "cow-aware")]
    cow: String,
    /// qcow2 layout: take an external snapshot (a new delta) every
    /// DURATION of trace time (e.g. 1d, 6h, 30m, 90s).
    #[arg(long, value_name = "DURATION")]
    snapshot_every: Option<String>,
    /// Cost model of the cache device: nvme, sata-ssd, hdd, network.
    #[arg(long, default_value = "nvme")]
    flash_profile: String,
    /// Cost model of the image storage: network, hdd, sata-ssd, nvme.
    #[arg(long, default_value = "network")]
    backend_profile: String,
    /// Memory for L2 slices of each qcow2 disk (default 4M).
    #[arg(long, value_name = "SIZE")]
    l2_cache_size: Option<String>,
    /// on: blocks entering flash that it already holds (in any disk) share
    /// that block instead of being written again; off (default).
    #[arg(long, value_name = "on|off")]
    dedup: Option<String>,
    /// With dedup on, compare every byte before sharing a block (one flash
    /// read per shared block) instead of trusting the fingerprint.
    #[arg(long)]
    dedup_verify: bool,
    /// Print one JSON object (an array with --sweep).
    #[arg(long)]
    json: bool,
    /// Replay at several cache sizes and policies; write table, JSON and plots.
    #[arg(long)]
    sweep: bool,
    /// --sweep: cache sizes in percent of the working set.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "P,P,...",
        requires = "sweep"
    )]
    sweep_sizes: Option<Vec<f64>>,
    /// --sweep: policies.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lru,clock,arc",
        requires = "sweep"
    )]
    sweep_policies: Vec<String>,
    /// --sweep: dedup modes each policy runs with, e.g. off,on (default:
    /// the --dedup mode); --dedup-verify makes "on" verify.
    #[arg(long, value_delimiter = ',', value_name = "off,on", requires = "sweep")]
    sweep_dedup: Option<Vec<String>>,
    /// --sweep: admission policies each policy and dedup mode runs with,
    /// e.g. all,hot (default: the --admission policy).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "all,hot",
        requires = "sweep"
    )]
    sweep_admission: Option<Vec<String>>,
    /// --sweep: output directory.
    #[arg(long, default_value = "results/replay")]
    out: PathBuf,
}

/// Parses "90s", "30m", "6h", "1d", "500ms" (a bare number is seconds).
fn parse_duration_ns(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .with_context(|| format!("invalid duration '{s}' (e.g. 1d, 6h, 30m, 90s)"))?;
    let scale = match unit {
        "ms" => 1e6,
        "" | "s" => 1e9,
        "m" | "min" => 60e9,
        "h" => 3600e9,
        "d" => 86400e9,
        _ => bail!("invalid duration '{s}': unknown unit '{unit}' (ms, s, m, h, d)"),
    };
    let ns = value * scale;
    if !(1.0..1.8e19).contains(&ns) {
        bail!("duration '{s}' is out of range");
    }
    Ok(ns as u64)
}

/// `value` of option `option` as dedup on (true) or off (false).
fn on_off(option: &str, value: &str) -> Result<bool> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => bail!("{option}: '{other}' is not on or off"),
    }
}

/// The dedup modes `--dedup`, `--dedup-verify` and `--sweep-dedup` ask for:
/// the single replay's, and the sweep's (empty: the single one).
fn dedup_modes(a: &Args) -> Result<(Dedup, Vec<Dedup>)> {
    let mode = |on: bool| match (on, a.dedup_verify) {
        (false, _) => Dedup::Off,
        (true, false) => Dedup::On,
        (true, true) => Dedup::Verify,
    };
    let single = match a.dedup.as_deref() {
        Some(v) => on_off("--dedup", v)?,
        None => false,
    };
    let swept = a
        .sweep_dedup
        .iter()
        .flatten()
        .map(|v| on_off("--sweep-dedup", v.trim()))
        .collect::<Result<Vec<bool>>>()?;
    if a.dedup_verify && !single && !swept.contains(&true) {
        bail!("--dedup-verify needs --dedup on (or --sweep-dedup with on)");
    }
    Ok((mode(single), swept.into_iter().map(mode).collect()))
}

fn options(a: &Args) -> Result<(Option<Format>, ReplayOptions)> {
    let format = a
        .format
        .as_deref()
        .map(str::parse::<Format>)
        .transpose()
        .map_err(anyhow::Error::msg)
        .context("--format")?;
    let policy = DiskPolicy {
        mode: a.cache_mode.parse::<WriteMode>().context("--cache-mode")?,
        admission: a.admission.parse::<Admission>().context("--admission")?,
        sequential_write_cutoff: parse_size(&a.sequential_write_cutoff)
            .context("--sequential-write-cutoff")?,
        cow: a.cow.parse::<CowMode>().context("--cow")?,
        ..DiskPolicy::default()
    };
    let rig = RigConfig {
        layout: a
            .layout
            .parse::<DiskLayout>()
            .map_err(anyhow::Error::msg)
            .context("--layout")?,
        region_bytes: parse_size(&a.region_size).context("--region-size")?,
        replacement: a
            .policy
            .parse::<Replacement>()
            .map_err(anyhow::Error::msg)
            .context("--policy")?,
        policy,
        l2_cache_bytes: a
            .l2_cache_size
            .as_deref()
            .map(|s| vdcache::config::parse_meta_cache_size("--l2-cache-size", s))
            .transpose()?,
        flash: a
            .flash_profile
            .parse::<DeviceProfile>()
            .map_err(anyhow::Error::msg)
            .context("--flash-profile")?,
        backend: a
            .backend_profile
            .parse::<DeviceProfile>()
            .map_err(anyhow::Error::msg)
            .context("--backend-profile")?,
        dedup: dedup_modes(a)?.0,
        ..RigConfig::default()
    };
    let cache_size = match (&a.cache_size, a.cache_size_pct_of_wss) {
        (Some(s), _) => CacheSize::Bytes(parse_size(s).context("--cache-size")?),
        (None, Some(p)) if p > 0.0 && p.is_finite() => CacheSize::PercentOfWorkingSet(p),
        (None, Some(p)) => bail!("--cache-size-pct-of-wss {p}: must be a positive number"),
        (None, None) => CacheSize::PercentOfWorkingSet(10.0),
    };
    if matches!(cache_size, CacheSize::Bytes(0)) && rig.dedup != Dedup::Off {
        bail!("--dedup on needs a cache, but --cache-size is 0 (no cache)");
    }
    let snapshot_every_ns = a
        .snapshot_every
        .as_deref()
        .map(parse_duration_ns)
        .transpose()
        .context("--snapshot-every")?;
    if snapshot_every_ns.is_some() && rig.layout != DiskLayout::Qcow2 {
        bail!("--snapshot-every needs --layout qcow2 (a raw disk has no snapshots)");
    }
    Ok((
        format,
        ReplayOptions {
            rig,
            cache_size,
            snapshot_every_ns,
        },
    ))
}

/// A progress bar on a terminal; nothing when stderr is piped.
fn progress_bar(label: &str) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(0);
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {pos}/{len} records, {per_sec}, ETA {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(label.to_string());
    Some(bar)
}

/// Largest cache size a sweep takes, in percent of the working set.
const MAX_PERCENT: f64 = 10_000.0;

/// Warns when a run's cache is much larger than asked for: below the
/// smallest cache device, the replay uses that one.
fn note_grown_cache(r: &ReplayReport, asked: &CacheSize) {
    let want = match (r.cache_percent_of_working_set, asked) {
        (Some(p), _) | (None, &CacheSize::PercentOfWorkingSet(p)) => {
            (r.working_set_bytes as f64 * p / 100.0) as u64
        }
        (None, CacheSize::Bytes(b)) => *b,
    };
    if want > 0 && r.cache_bytes > want + want / 10 + r.region_bytes {
        tracing::warn!(
            "the cache asked for ({}) is below the smallest cache the replay builds: it ran with {}",
            crate::size::human(want),
            crate::size::human(r.cache_bytes)
        );
    }
}

/// A trace is read twice (scanned, then replayed): a pipe or device
/// (`/dev/stdin`) is first copied to a temporary file, removed when the
/// returned guard drops.
fn rereadable(path: &Path) -> Result<Option<tempfile::TempPath>> {
    let meta = std::fs::metadata(path).with_context(|| format!("trace {}", path.display()))?;
    if meta.is_file() {
        return Ok(None);
    }
    let mut input = File::open(path).with_context(|| format!("trace {}", path.display()))?;
    let mut copy = tempfile::Builder::new()
        .prefix(".vdcache-trace-")
        .tempfile()
        .context("a temporary copy of the trace")?;
    let bytes = std::io::copy(&mut input, copy.as_file_mut()).with_context(|| {
        format!(
            "copying trace {} to {}",
            path.display(),
            copy.path().display()
        )
    })?;
    tracing::info!(
        "trace {} is not a regular file: {bytes} bytes copied to a temporary file to be read twice",
        path.display()
    );
    Ok(Some(copy.into_temp_path()))
}

pub fn run(a: Args) -> Result<u8> {
    let (format, opts) = options(&a)?;
    let copy = rereadable(&a.trace)?;
    let trace = copy.as_deref().unwrap_or(&a.trace);
    if a.sweep {
        return run_sweep(&a, trace, format, opts);
    }
    let bar = progress_bar("replay");
    let report = replay_file(trace, format, &opts, &mut |p| {
        if let Some(b) = &bar {
            b.set_length(p.total);
            b.set_position(p.done);
        }
    })
    .with_context(|| format!("replay {}", a.trace.display()))?;
    let mut report = report;
    report.trace = a.trace.display().to_string();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    note_grown_cache(&report, &opts.cache_size);
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_human(&report);
    }
    Ok(0)
}

fn run_sweep(a: &Args, trace: &Path, format: Option<Format>, base: ReplayOptions) -> Result<u8> {
    let policies = a
        .sweep_policies
        .iter()
        .map(|p| p.parse::<Replacement>().map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()
        .context("--sweep-policies")?;
    let percents = a
        .sweep_sizes
        .clone()
        .unwrap_or_else(|| DEFAULT_PERCENTS.to_vec());
    if let Some(bad) = percents.iter().find(|p| !(**p > 0.0 && p.is_finite())) {
        bail!("--sweep-sizes: {bad} is not a positive percentage");
    }
    if let Some(big) = percents.iter().find(|p| **p > MAX_PERCENT) {
        bail!(
            "--sweep-sizes: {big} is more than {MAX_PERCENT} (a cache {} times the working set)",
            MAX_PERCENT / 100.0
        );
    }
    let opts = SweepOptions {
        base,
        percents,
        policies,
        dedups: dedup_modes(a)?.1,
        admissions: a
            .sweep_admission
            .iter()
            .flatten()
            .map(|v| v.trim().parse::<Admission>().map_err(anyhow::Error::msg))
            .collect::<Result<Vec<_>>>()
            .context("--sweep-admission")?,
    };
    let bar = progress_bar("sweep");
    let reports = sweep(trace, format, &opts, &mut |p| {
        if let Some(b) = &bar {
            b.set_message(format!("run {}/{}", p.run + 1, p.runs));
            b.set_length(p.inner.total);
            b.set_position(p.inner.done);
        }
    })
    .with_context(|| format!("sweep {}", a.trace.display()))?;
    let mut reports = reports;
    for r in &mut reports {
        r.trace = a.trace.display().to_string();
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    for r in &reports {
        note_grown_cache(r, &opts.base.cache_size);
    }
    let files = write_sweep(&a.out, &reports)
        .with_context(|| format!("writing results to {}", a.out.display()))?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        out!("{}", sweep_table(&reports));
        for f in files {
            outln!("wrote {}", f.display());
        }
    }
    Ok(0)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / f64::from(1 << 20))
}

fn print_human(r: &ReplayReport) {
    let guest = r.read_bytes + r.write_bytes;
    let per_guest = |b: u64| {
        if guest == 0 {
            0.0
        } else {
            b as f64 / guest as f64
        }
    };
    outln!(
        "trace {} ({}, {} records, {} disks, working set {})",
        r.trace,
        r.format,
        r.records,
        r.disks,
        mib(r.working_set_bytes)
    );
    outln!(
        "cache {} ({} blocks), regions {}, {} / {} / {} / {}, dedup {}, layout {}",
        mib(r.cache_bytes),
        r.cache_capacity_blocks,
        mib(r.region_bytes),
        r.policy,
        r.admission,
        r.cache_mode,
        r.cow,
        r.dedup_mode,
        r.layout.name()
    );
    outln!(
        "requests        {} reads ({}), {} writes ({}), {} discards, {} flushes",
        r.reads,
        mib(r.read_bytes),
        r.writes,
        mib(r.write_bytes),
        r.discards,
        r.flushes
    );
    outln!("read hit ratio  {:.4}", r.read_hit_ratio);
    outln!("write hit ratio {:.4}", r.write_hit_ratio);
    outln!(
        "flash written   {} ({:.3} per guest byte; data {}, metadata {})",
        mib(r.flash_bytes_written),
        per_guest(r.flash_bytes_written),
        mib(r.flash_data_bytes_written),
        mib(r.flash_meta_bytes_written)
    );
    outln!(
        "backend         read {} ({:.3}/guest byte), written {} ({:.3}/guest byte), {} syncs",
        mib(r.backend_bytes_read),
        per_guest(r.backend_bytes_read),
        mib(r.backend_bytes_written),
        per_guest(r.backend_bytes_written),
        r.backend_syncs
    );
    if let Some(d) = &r.dedup {
        outln!(
            "dedup           ratio {:.3} ({} distinct blocks), {} blocks shared ({} of flash writes saved), BLAKE3 {:.0} ns/block over {} blocks",
            d.ratio,
            d.unique_blocks,
            d.blocks_shared,
            mib(d.flash_bytes_saved),
            d.hash_ns_per_block,
            d.hashed_blocks
        );
    }
    if let Some(m) = r.meta_hit_ratio {
        outln!("L2 hit ratio    {m:.4}");
    }
    outln!(
        "latency         mean {:.1} us, p99 {:.1} us (model: flash {}, backend {})",
        r.latency.mean_ns / 1000.0,
        r.latency.p99_ns as f64 / 1000.0,
        r.flash_profile,
        r.backend_profile
    );
    outln!(
        "index memory    {} bytes ({} fixed for the device, the rest {:.3}% of cached bytes)",
        r.index_memory_bytes,
        r.index_memory_fixed_bytes,
        r.index_memory_ratio * 100.0
    );
    if let Some(wa) = r.ftl_write_amplification {
        outln!(
            "flash wear      {} erases, write amplification {wa:.3}",
            r.ftl_erases
        );
    }
    if r.dirty_bytes_at_end > 0 {
        outln!(
            "left dirty      {} in flash at the end",
            mib(r.dirty_bytes_at_end)
        );
    }
    outln!("elapsed         {:.1} s", r.elapsed_seconds);
}

#[derive(clap::Args, Debug)]
pub struct GenArgs {
    /// Output file; .gz or .zst compresses.
    out: PathBuf,
    /// Workload class: boot-storm, oltp, file-server, clone-storm.
    #[arg(long, default_value = "oltp")]
    class: String,
    /// Output format: msr, fiu, blkparse, fio.
    #[arg(long, default_value = "msr")]
    format: String,
    /// Requests to write (at least 1).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    requests: u64,
    /// Working set per disk.
    #[arg(long, value_name = "SIZE")]
    working_set: Option<String>,
    /// Fraction of data requests that are reads.
    #[arg(long)]
    read_ratio: Option<f64>,
    /// Zipf exponent of popularity (0 = uniform).
    #[arg(long)]
    zipf: Option<f64>,
    /// Fraction of blocks with duplicate content (FIU).
    #[arg(long)]
    dup_ratio: Option<f64>,
    /// Clone storm: fraction of writes that apply the updates every VM
    /// applies (the rest are private data).
    #[arg(long)]
    update_ratio: Option<f64>,
    /// Disks (boot storm, clone storm: cloned VMs), 1 to 65536.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    disks: Option<u32>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Replace OUT if it exists and holds something (a pipe or a device,
    /// such as /dev/stdout, is always written as it is).
    #[arg(long)]
    force: bool,
}

pub fn generate(a: GenArgs) -> Result<u8> {
    let class: WorkloadClass = a
        .class
        .parse()
        .map_err(anyhow::Error::msg)
        .context("--class")?;
    let format: Format = a
        .format
        .parse()
        .map_err(anyhow::Error::msg)
        .context("--format")?;
    let mut spec = WorkloadSpec::new(class);
    spec.requests = a.requests;
    spec.seed = a.seed;
    if let Some(w) = &a.working_set {
        spec.working_set_bytes = parse_size(w).context("--working-set")?;
    }
    if let Some(r) = a.read_ratio {
        spec.read_ratio = r;
    }
    if let Some(z) = a.zipf {
        spec.zipf_theta = z;
    }
    if let Some(d) = a.dup_ratio {
        spec.dup_ratio = d;
    }
    if let Some(u) = a.update_ratio {
        if class != WorkloadClass::CloneStorm {
            bail!("--update-ratio is for --class clone-storm");
        }
        spec.update_ratio = u;
    }
    if let Some(d) = a.disks {
        spec.disks = d;
    }
    spec.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    // A file appears under its name only once complete (an interrupted
    // run leaves no truncated trace); a pipe or device is written as the
    // trace is made.
    let mut output = vdcache_ownership::Output::create(&a.out, a.force)?;
    let name = a.out.display().to_string();
    let generate = |w: &mut dyn Write| {
        write_workload(&spec, format, &WriterOptions::default(), BufWriter::new(w))
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", a.out.display()))
    };
    let summary = if name.ends_with(".gz") {
        let mut enc = flate2::write::GzEncoder::new(&mut output, flate2::Compression::fast());
        let s = generate(&mut enc)?;
        enc.finish()?;
        s
    } else if name.ends_with(".zst") {
        let mut enc = zstd::stream::write::Encoder::new(&mut output, 3)?;
        let s = generate(&mut enc)?;
        enc.finish()?;
        s
    } else {
        generate(&mut output)?
    };
    output
        .commit()
        .with_context(|| format!("writing {}", a.out.display()))?;
    errln!(
        "wrote {} requests to {} ({}{} the format cannot express were skipped)",
        summary.written,
        a.out.display(),
        if format == Format::Fiu {
            "one FIU line per 4 KiB block of each; "
        } else {
            ""
        },
        summary.skipped
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::parse_duration_ns;

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ns("90s").ok(), Some(90_000_000_000));
        assert_eq!(parse_duration_ns("1d").ok(), Some(86_400_000_000_000));
        assert_eq!(parse_duration_ns("1.5h").ok(), Some(5_400_000_000_000));
        assert_eq!(parse_duration_ns("250ms").ok(), Some(250_000_000));
        for bad in ["", "x", "5y", "-1s", "0s"] {
            assert!(parse_duration_ns(bad).is_err(), "{bad} accepted");
        }
    }
}
