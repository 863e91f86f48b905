//! `vdcache soak`: hours of kill -9 restarts of `vdcache serve` under a
//! flushing write load, each restart judged by a flush-aware record
//! (every write acknowledged before the last completed flush, or with FUA,
//! must read back; later ones may or may not). Argument checking and the
//! summary only; the run itself is in `crate::soak`.
//!
//! Exit status: 0 no violation, 2 a violation (lost or corrupted data, a
//! corrupt image), 1 the soak could not run (setup, a server that failed
//! to start or stop, a request refused while the server was up).

use crate::size::parse_size;
use crate::soak::driver::{Config, Kills, ModeReport, print_report, run_mode};
use crate::soak::writer::Counts;
use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// Cache modes, and `nocache`: the image served without flash.
const MODES: [&str; 4] = ["writeback", "writethrough", "writearound", "nocache"];

#[derive(clap::Args)]
pub struct Args {
    /// Kill -9 restarts per cache mode.
    #[arg(long, default_value_t = 100)]
    cycles: u64,
    /// Longest load before a kill (each cycle picks a random moment in it).
    #[arg(long, default_value_t = 2.0)]
    seconds_per_cycle: f64,
    /// Seed of every random choice (default: from the clock; printed). The
    /// timing of threads and kills still varies: a run does not repeat exactly.
    #[arg(long)]
    seed: Option<u64>,
    /// Cache modes to run, one after the other, each on its own images
    /// (`nocache`: served without a flash cache).
    #[arg(long, value_delimiter = ',', default_value = "writeback,writethrough")]
    modes: Vec<String>,
    /// Virtual disk size (a multiple of 64 KiB).
    #[arg(long, default_value = "128M")]
    size: String,
    /// Flash cache size (smaller than the disk, so write-back evicts).
    #[arg(long, default_value = "48M")]
    cache_size: String,
    /// Writer threads (one request in flight each).
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// NBD connections the writers share (flushes on one cover all).
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Mean requests of one writer per flush, the flush included (at least
    /// 2; 2 is a flush after about every write).
    #[arg(long, default_value_t = 16)]
    flush_every: u32,
    /// Create the delta with extended L2 entries (subclusters).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    extended_l2: String,
    /// Extra argument for `vdcache serve` (repeat; e.g. --serve-arg=--cow --serve-arg=stacked).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
    /// Scratch directory (default: a new one in the temp directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the scratch files after a passing run (a failing run always
    /// keeps them).
    #[arg(long)]
    keep: bool,
    /// The vdcache binary to serve with (default: this one).
    #[arg(long)]
    vdcache: Option<PathBuf>,
    /// Run the servers with -v (their logs grow large).
    #[arg(long)]
    server_verbose: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// No line per cycle.
    #[arg(long, short)]
    quiet: bool,
    /// Test of the checker: after the first restart, overwrite two durable
    /// sectors behind its back; the run must report exactly those two.
    #[arg(long, hide = true)]
    inject_fault: bool,
}

impl Args {
    fn config(&self) -> Result<Config> {
        let size = parse_size(&self.size).context("--size")?;
        let cache_size = parse_size(&self.cache_size).context("--cache-size")?;
        if size < 1 << 20 || !size.is_multiple_of(64 << 10) {
            bail!(
                "--size {} must be at least 1M and a multiple of 64K",
                self.size
            );
        }
        if self.cycles == 0 {
            bail!("--cycles must be at least 1");
        }
        if !(self.seconds_per_cycle.is_finite() && self.seconds_per_cycle > 0.0) {
            bail!(
                "--seconds-per-cycle {} must be a positive number",
                self.seconds_per_cycle
            );
        }
        if self.threads == 0 || self.connections == 0 || self.connections > self.threads {
            bail!("--threads must be at least 1 and --connections between 1 and --threads");
        }
        if self.flush_every < 2 {
            bail!("--flush-every must be at least 2 (1 would send nothing but flushes)");
        }
        for (i, m) in self.modes.iter().enumerate() {
            if !MODES.contains(&m.as_str()) {
                bail!(
                    "unknown cache mode '{m}' in --modes (use {})",
                    MODES.join(", ")
                );
            }
            if self.modes[..i].contains(m) {
                bail!("cache mode '{m}' given twice in --modes");
            }
        }
        let vdcache = match &self.vdcache {
            Some(p) => p.clone(),
            None => std::env::current_exe().context("finding the vdcache binary")?,
        };
        if !vdcache.is_file() {
            bail!("--vdcache {}: no such file", vdcache.display());
        }
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        Ok(Config {
            dir: self.dir.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("vdcache-soak-{}", std::process::id()))
            }),
            vdcache,
            cycles: self.cycles,
            seconds_per_cycle: self.seconds_per_cycle,
            seed,
            size,
            cache_size,
            threads: self.threads,
            connections: self.connections,
            flush_every: self.flush_every,
            extended_l2: self.extended_l2 == "on",
            serve_args: self.serve_args.clone(),
            server_verbose: self.server_verbose,
            inject_fault: self.inject_fault,
            progress: !self.quiet,
        })
    }
}

pub fn run(a: Args) -> Result<u8> {
    let cfg = a.config()?;
    let made_dir = !cfg.dir.exists();
    std::fs::create_dir_all(&cfg.dir)
        .with_context(|| format!("cannot create {}", cfg.dir.display()))?;
    eprintln!(
        "soak: seed {}, {} cycles per mode ({}), scratch {}",
        cfg.seed,
        cfg.cycles,
        a.modes.join(", "),
        cfg.dir.display()
    );
    let mut reports: Vec<ModeReport> = Vec::new();
    for (i, mode) in a.modes.iter().enumerate() {
        let r = run_mode(&cfg, mode, i as u64).with_context(|| {
            format!(
                "soak {mode} (seed {}; files kept in {})",
                cfg.seed,
                cfg.dir.display()
            )
        })?;
        let failed = r.failed();
        reports.push(r);
        if failed {
            break;
        }
    }
    let failed = reports.iter().any(ModeReport::failed);
    let mut counts = Counts::default();
    let mut kills = Kills::default();
    for r in &reports {
        counts.add(&r.counts);
        kills.add(&r.kills);
    }
    let violations: u64 = reports.iter().map(|r| r.violations).sum();
    let mut out = std::io::stdout().lock();
    if a.json {
        let v = serde_json::json!({
            "seed": cfg.seed,
            "modes": reports,
            "kills": kills.total(),
            "counts": counts,
            "violations": violations,
            "passed": !failed,
        });
        serde_json::to_writer_pretty(&mut out, &v)?;
        use std::io::Write;
        writeln!(out)?;
    } else {
        for r in &reports {
            print_report(&mut out, r)?;
        }
        use std::io::Write;
        writeln!(
            out,
            "soak total: seed {}, {} kill -9, {} writes, {} flushes, violations {}",
            cfg.seed,
            kills.total(),
            counts.writes,
            counts.flushes,
            violations
        )?;
    }
    if failed || a.keep {
        eprintln!("soak: files kept in {}", cfg.dir.display());
    } else {
        for r in &reports {
            std::fs::remove_dir_all(&r.dir)
                .with_context(|| format!("cannot remove {}", r.dir.display()))?;
        }
        if made_dir {
            std::fs::remove_dir(&cfg.dir)
                .with_context(|| format!("cannot remove {}", cfg.dir.display()))?;
        }
    }
    Ok(if failed { 2 } else { 0 })
}
