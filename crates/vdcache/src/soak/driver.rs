//! One soak run of one cache mode: a base image with data and a delta over
//! it (made by qemu-img), `vdcache serve` on the delta through a flash
//! cache (or none, mode `nocache`), and cycles of load, SIGKILL, restart
//! on the same cache and images, and a read of the whole disk judged by the record; then a clean
//! stop (SIGTERM), `qemu-img check` of both images and a read of the delta
//! by qemu-img alone, judged by the record too.
//!
//! Kills come at random moments of four kinds: while the writers run,
//! right after a flush was sent, after the writers went quiet (background
//! write-back may still run), and while the restarted server recovers.
//!
//! Owns the scratch directory, the cycles and the report. Must not relax
//! the record's rule: a violation is reported with the sector, what it
//! held and what it was allowed to hold, and the scratch directory is
//! kept for a reproducer.

use super::record::{Held, Record};
use super::server::{Server, ServerSpec, log_tail};
use super::stamp::{SECTOR, fill};
use super::writer::{Counts, Geometry, Shared, writer};
use anyhow::{Context, Result, bail};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;
use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use vdcache_backend::nbd::NbdClient;

/// The delta's cluster size (trims zero whole clusters of it).
const CLUSTER: u64 = 64 << 10;
/// The base image has data in about half of these chunks.
const BASE_CHUNK: u64 = 256 << 10;
/// Violations printed ...
const SHOWN: usize = 20;
/// ... and of those, printed with the cycle's requests on their sector.
const EXPLAINED: usize = 3;
/// Unit of the verification reads.
const READ_CHUNK: u64 = 1 << 20;

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub dir: PathBuf,
    pub vdcache: PathBuf,
    pub cycles: u64,
    pub seconds_per_cycle: f64,
    pub seed: u64,
    pub size: u64,
    pub cache_size: u64,
    pub threads: usize,
    pub connections: usize,
    pub flush_every: u32,
    pub extended_l2: bool,
    pub serve_args: Vec<String>,
    pub server_verbose: bool,
    /// Corrupt two durable sectors behind the record's back after the
    /// first restart: the run must report exactly those two.
    pub inject_fault: bool,
    pub progress: bool,
}

/// How the server was killed, by kind.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Kills {
    /// While the writers ran.
    pub busy: u64,
    /// Right after a flush was sent.
    pub mid_flush: u64,
    /// After the writers stopped.
    pub idle: u64,
    /// A second kill while the restarted server recovered.
    pub during_restart: u64,
    /// Kills (of any kind) with a flush in flight.
    pub with_flush_in_flight: u64,
}

impl Kills {
    pub fn total(&self) -> u64 {
        self.busy + self.mid_flush + self.idle + self.during_restart
    }

    pub fn add(&mut self, o: &Kills) {
        self.busy += o.busy;
        self.mid_flush += o.mid_flush;
        self.idle += o.idle;
        self.during_restart += o.during_restart;
        self.with_flush_in_flight += o.with_flush_in_flight;
    }
}

/// What one mode's run did and found.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ModeReport {
    pub mode: String,
    pub dir: PathBuf,
    pub server_command: String,
    pub cycles: u64,
    pub kills: Kills,
    pub counts: Counts,
    /// Sectors read back and judged after the restarts.
    pub sectors_verified: u64,
    /// Of those, sectors that had unflushed versions at the kill ...
    pub sectors_with_unflushed: u64,
    /// ... and those that held one of them (the rest held the durable one).
    pub sectors_newer: u64,
    pub violations: u64,
    pub first_violations: Vec<String>,
    pub injected_faults: u64,
    /// `qemu-img check` of the delta after the clean stop.
    pub leaked_clusters: u64,
    pub image_corrupt: bool,
    /// Sectors of the delta, read by qemu-img after the clean stop, that
    /// matched the record exactly.
    pub final_sectors_matched: u64,
    /// The clean stop and the checks after it ran (not after a violation).
    pub final_checked: bool,
    pub seconds: f64,
}

impl ModeReport {
    /// A lost or damaged write, or an image `qemu-img check` does not pass
    /// cleanly after the clean stop (leaks included: a clean stop leaves
    /// the images as qemu-img check wants them, crashes or not, since an
    /// image is marked dirty, or journaled, before its metadata changes).
    pub fn failed(&self) -> bool {
        self.violations > 0 || self.image_corrupt || self.leaked_clusters > 0
    }
}

/// When and how a cycle's server dies.
#[derive(Debug, Clone, Copy)]
enum Kill {
    Busy(Duration),
    MidFlush(Duration, Duration),
    Idle(Duration, Duration),
    DuringRestart(Duration, Duration),
    /// No kill: the writers stop after this long.
    Not(Duration),
}

fn pick_kill(rng: &mut Xoshiro256PlusPlus, secs: f64) -> Kill {
    let d = |rng: &mut Xoshiro256PlusPlus, max: f64| {
        Duration::from_secs_f64(rng.random_range(0.0..max))
    };
    let busy = d(rng, secs);
    match rng.random_range(0..100u32) {
        0..45 => Kill::Busy(busy),
        45..70 => Kill::MidFlush(
            d(rng, secs),
            Duration::from_micros(rng.random_range(0..400)),
        ),
        70..85 => Kill::Idle(busy, d(rng, 0.3)),
        _ => Kill::DuringRestart(busy, d(rng, 0.04)),
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn qemu_img(dir: &Path, args: &[&std::ffi::OsStr]) -> Result<std::process::Output> {
    Command::new("qemu-img")
        .args(args)
        .current_dir(dir)
        .output()
        .context("cannot run qemu-img (install qemu-utils)")
}

fn qemu_img_ok(dir: &Path, args: &[&std::ffi::OsStr]) -> Result<()> {
    let out = qemu_img(dir, args)?;
    if !out.status.success() {
        bail!(
            "qemu-img {:?} failed: {}{}",
            args,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A 64-bit digest of a file (to show the base was never written).
fn digest(path: &Path) -> Result<u64> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut h = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h);
        }
        for w in buf[..n].chunks(8) {
            let mut a = [0u8; 8];
            a[..w.len()].copy_from_slice(w);
            h = mix(h ^ u64::from_le_bytes(a));
        }
    }
}

struct Files {
    base: PathBuf,
    delta: PathBuf,
    cache: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

/// Writes the base (stamped data in about half of its 256 KiB chunks)
/// and the delta over it; returns which chunks have base data.
fn make_images(
    cfg: &Config,
    dir: &Path,
    key: u64,
    rng: &mut Xoshiro256PlusPlus,
) -> Result<(Files, Vec<bool>)> {
    let files = Files {
        base: dir.join("base.qcow2"),
        delta: dir.join("delta.qcow2"),
        cache: dir.join("flash.cache"),
        socket: dir.join("nbd.sock"),
        log: dir.join("server.log"),
    };
    if files.delta.exists() || files.cache.exists() {
        bail!(
            "{} already holds a soak's files: give another --dir",
            dir.display()
        );
    }
    let chunks = cfg.size.div_ceil(BASE_CHUNK);
    let has_base: Vec<bool> = (0..chunks).map(|_| rng.random_bool(0.5)).collect();
    let raw = dir.join("base.raw");
    {
        let f = File::create(&raw).with_context(|| format!("cannot create {}", raw.display()))?;
        f.set_len(cfg.size)?;
        let mut buf = vec![0u8; BASE_CHUNK as usize];
        for (i, &b) in has_base.iter().enumerate() {
            let off = i as u64 * BASE_CHUNK;
            let n = BASE_CHUNK.min(cfg.size - off);
            if b {
                fill(&mut buf[..n as usize], off / SECTOR, 0, key);
                std::os::unix::fs::FileExt::write_all_at(&f, &buf[..n as usize], off)?;
            }
        }
        f.sync_all()?;
    }
    qemu_img_ok(
        dir,
        &[
            "convert".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "raw".as_ref(),
            "-O".as_ref(),
            "qcow2".as_ref(),
            raw.as_os_str(),
            files.base.as_os_str(),
        ],
    )?;
    std::fs::remove_file(&raw)?;
    let opts = format!(
        "cluster_size={CLUSTER},extended_l2={}",
        if cfg.extended_l2 { "on" } else { "off" }
    );
    qemu_img_ok(
        dir,
        &[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-o".as_ref(),
            opts.as_ref(),
            "-b".as_ref(),
            "base.qcow2".as_ref(),
            "-F".as_ref(),
            "qcow2".as_ref(),
            files.delta.as_os_str(),
        ],
    )?;
    Ok((files, has_base))
}

fn uri(socket: &Path) -> String {
    format!("nbd+unix:///?socket={}", socket.display())
}

/// Sleeps `d`, or less if the writers stopped (a failure).
fn nap(shared: &Shared, d: Duration) {
    let end = Instant::now() + d;
    while !shared.stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= end {
            return;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(5)));
    }
}

struct Cycle<'a> {
    cfg: &'a Config,
    shared: &'a Shared,
    spec: &'a ServerSpec,
    g: Geometry,
    kills: Kills,
}

impl Cycle<'_> {
    /// Runs the writers against `server` until `kill` says; returns with
    /// the server killed (unless `kill` is [`Kill::Not`]) and the
    /// writers stopped.
    fn load(&mut self, server: &mut Server, kill: Kill, seed: u64) -> Result<()> {
        let shared = self.shared;
        shared.stop.store(false, Ordering::SeqCst);
        shared.killed.store(false, Ordering::SeqCst);
        let u = uri(&self.spec.socket);
        let clients = (0..self.cfg.connections)
            .map(|_| NbdClient::connect(&u).with_context(|| format!("connecting to {u}")))
            .collect::<Result<Vec<_>>>()?;
        let running = AtomicUsize::new(self.cfg.threads);
        let outcome = std::thread::scope(|sc| -> Result<()> {
            let handles: Vec<_> = (0..self.cfg.threads)
                .map(|i| {
                    let (client, running, g) = (&clients[i % clients.len()], &running, self.g);
                    sc.spawn(move || {
                        writer(shared, client, g, mix(seed ^ i as u64));
                        running.fetch_sub(1, Ordering::SeqCst);
                    })
                })
                .collect();
            let r = self.drive(server, kill, &running);
            shared.stop.store(true, Ordering::SeqCst);
            for h in handles {
                if h.join().is_err() {
                    bail!("a writer thread panicked");
                }
            }
            r
        });
        drop(clients);
        outcome?;
        if let Some(f) = shared.failure() {
            let died = server
                .exited()
                .map(|s| format!(" (the server died, {s}, though the soak did not kill it)"))
                .unwrap_or_default();
            bail!(
                "a request failed while the server was up{died}: {f}\nend of the server log {}:\n{}",
                self.spec.log.display(),
                log_tail(&self.spec.log)
            );
        }
        Ok(())
    }

    fn drive(&mut self, server: &mut Server, kill: Kill, running: &AtomicUsize) -> Result<()> {
        let shared = self.shared;
        match kill {
            Kill::Busy(d) | Kill::DuringRestart(d, _) => nap(shared, d),
            Kill::MidFlush(d, after) => {
                nap(shared, d);
                let until = Instant::now() + Duration::from_secs(2);
                while shared.flushes_in_flight.load(Ordering::SeqCst) == 0
                    && !shared.stop.load(Ordering::SeqCst)
                    && Instant::now() < until
                {
                    std::thread::yield_now();
                }
                let spin = Instant::now() + after;
                while Instant::now() < spin {
                    std::hint::spin_loop();
                }
            }
            Kill::Idle(d, quiet) => {
                nap(shared, d);
                shared.stop.store(true, Ordering::SeqCst);
                let until = Instant::now() + Duration::from_secs(120);
                while running.load(Ordering::SeqCst) > 0 {
                    if Instant::now() > until {
                        bail!("the writers did not finish within 120 s: is the server hung?");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(quiet);
            }
            Kill::Not(d) => {
                nap(shared, d);
                return Ok(());
            }
        }
        if shared.failure().is_some() {
            return Ok(());
        }
        if shared.flushes_in_flight.load(Ordering::SeqCst) > 0 {
            self.kills.with_flush_in_flight += 1;
        }
        shared.killed.store(true, Ordering::SeqCst);
        shared.lock().record.note(format!("kill -9 ({kill:?})"));
        server.kill9()?;
        match kill {
            // A kill during the restart that follows is counted there.
            Kill::Busy(_) | Kill::DuringRestart(..) => self.kills.busy += 1,
            Kill::MidFlush(..) => self.kills.mid_flush += 1,
            Kill::Idle(..) => self.kills.idle += 1,
            Kill::Not(_) => {}
        }
        Ok(())
    }
}

/// What one read of the whole disk found.
#[derive(Default)]
struct Verified {
    sectors: u64,
    with_unflushed: u64,
    newer: u64,
    violations: u64,
    shown: Vec<String>,
}

impl Verified {
    fn judge(&mut self, shared: &Shared, first: u64, data: &[u8]) {
        let mut st = shared.lock();
        for (i, sector) in data.chunks_exact(SECTOR as usize).enumerate() {
            let s = first + i as u64;
            let had_later = !st.record.allowed(s).1.is_empty();
            self.sectors += 1;
            self.with_unflushed += u64::from(had_later);
            match st.record.check(s, sector) {
                Ok(Held::Newer) => self.newer += 1,
                Ok(Held::Durable) => {}
                Err(v) => {
                    self.violations += 1;
                    if self.shown.len() < EXPLAINED {
                        self.shown.push(format!("{v}; {}", st.record.explain(s)));
                    } else if self.shown.len() < SHOWN {
                        self.shown.push(v.to_string());
                    }
                }
            }
        }
    }
}

/// Reads the whole disk through the server (several readers) and judges
/// every sector, then flushes (what the server holds now is what the
/// record allows from now on).
fn verify(shared: &Shared, socket: &Path, size: u64, readers: usize) -> Result<Verified> {
    let u = uri(socket);
    let client = NbdClient::connect(&u).with_context(|| format!("connecting to {u}"))?;
    if client.size() != size {
        bail!("the export has {} bytes, not {size}", client.size());
    }
    let next = AtomicU64::new(0);
    let parts = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..readers.max(1))
            .map(|_| {
                sc.spawn(|| -> Result<Verified> {
                    let mut v = Verified::default();
                    let mut buf = vec![0u8; READ_CHUNK as usize];
                    loop {
                        let off = next.fetch_add(1, Ordering::SeqCst) * READ_CHUNK;
                        if off >= size {
                            return Ok(v);
                        }
                        let n = READ_CHUNK.min(size - off) as usize;
                        client
                            .read_at(off, &mut buf[..n])
                            .with_context(|| format!("reading {n} bytes at {off:#x}"))?;
                        v.judge(shared, off / SECTOR, &buf[..n]);
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a reader panicked")))
            .collect::<Vec<_>>()
    });
    let mut all = Verified::default();
    for p in parts {
        let p = p?;
        all.sectors += p.sectors;
        all.with_unflushed += p.with_unflushed;
        all.newer += p.newer;
        all.violations += p.violations;
        for s in p.shown {
            if all.shown.len() < SHOWN {
                all.shown.push(s);
            }
        }
    }
    client.flush().context("flush after the verification")?;
    client.disconnect().context("disconnecting")?;
    Ok(all)
}

/// Overwrites two sectors whose only allowed content is a soak write's
/// data, without telling the record: one with zeros (lost data), one with
/// a version never written (stale or foreign data). None while fewer than
/// two such sectors exist.
fn inject_fault(shared: &Shared, socket: &Path) -> Result<Option<Vec<u64>>> {
    let (sectors, never, key) = {
        let st = shared.lock();
        let s: Vec<u64> = st.record.durable_data_sectors().take(2).collect();
        (s, st.record.writes() + 1_000_000, st.record.key())
    };
    if sectors.len() < 2 {
        return Ok(None);
    }
    let client = NbdClient::connect(&uri(socket))?;
    client.write_at(sectors[0] * SECTOR, &[0u8; SECTOR as usize], true)?;
    let mut b = vec![0u8; SECTOR as usize];
    fill(&mut b, sectors[1], never, key);
    client.write_at(sectors[1] * SECTOR, &b, true)?;
    client.disconnect()?;
    Ok(Some(sectors))
}

/// Runs `cfg.cycles` kill -9 cycles in cache mode `mode`, in
/// `cfg.dir/mode`.
pub fn run_mode(cfg: &Config, mode: &str, index: u64) -> Result<ModeReport> {
    let started = Instant::now();
    let dir = cfg.dir.join(mode);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(mix(cfg.seed ^ mix(index)));
    let key = rng.random::<u64>();
    let (files, has_base) = make_images(cfg, &dir, key, &mut rng)?;
    let base_digest = digest(&files.base)?;
    let sectors = cfg.size / SECTOR;
    let chunk_sectors = BASE_CHUNK / SECTOR;
    let record = Record::new(sectors, key, |s| has_base[(s / chunk_sectors) as usize]);
    let shared = Shared::new(record);
    let mut args: Vec<OsString> = Vec::new();
    if cfg.server_verbose {
        args.push("-v".into());
    }
    args.extend([
        "serve".into(),
        "--socket".into(),
        files.socket.clone().into(),
    ]);
    if mode != "nocache" {
        args.extend(["--cache".into(), files.cache.clone().into()]);
        args.extend(["--cache-size".into(), cfg.cache_size.to_string().into()]);
        args.extend(["--cache-mode".into(), mode.into()]);
    }
    args.extend(cfg.serve_args.iter().map(OsString::from));
    args.push(files.delta.clone().into());
    let spec = ServerSpec {
        vdcache: cfg.vdcache.clone(),
        args,
        socket: files.socket.clone(),
        log: files.log.clone(),
    };
    let mut report = ModeReport {
        mode: mode.to_string(),
        dir: dir.clone(),
        server_command: spec.command_line(),
        ..ModeReport::default()
    };
    let mut cycle = Cycle {
        cfg,
        shared: &shared,
        spec: &spec,
        g: Geometry {
            sectors,
            cluster_sectors: CLUSTER / SECTOR,
            flush_every: cfg.flush_every,
        },
        kills: Kills::default(),
    };
    let mut server = spec.start("first start")?;
    for n in 1..=cfg.cycles {
        let kill = pick_kill(&mut rng, cfg.seconds_per_cycle);
        let before = shared.lock().counts.clone();
        cycle.load(&mut server, kill, rng.random())?;
        if let Kill::DuringRestart(_, after) = kill {
            shared
                .lock()
                .record
                .note(format!("restart, killed again after {after:?}"));
            let mut s = spec.spawn(&format!("restart after cycle {n}, killed after {after:?}"))?;
            std::thread::sleep(after);
            s.kill9()?;
            cycle.kills.during_restart += 1;
        }
        server = spec.start(&format!("restart after cycle {n} ({kill:?})"))?;
        shared.lock().record.note("restarted".into());
        if cfg.inject_fault
            && report.injected_faults == 0
            && let Some(s) = inject_fault(&shared, &files.socket)?
        {
            report.injected_faults = s.len() as u64;
            eprintln!("soak: --inject-fault overwrote sectors {s:?} behind the record's back");
        }
        let v = verify(&shared, &files.socket, cfg.size, cfg.threads)?;
        report.cycles = n;
        report.sectors_verified += v.sectors;
        report.sectors_with_unflushed += v.with_unflushed;
        report.sectors_newer += v.newer;
        report.violations += v.violations;
        report.first_violations.extend(v.shown);
        if cfg.progress {
            let c = shared.lock().counts.clone();
            eprintln!(
                "soak {mode} cycle {n}/{}: {kill:?}; {} writes, {} flushes, {} unanswered; \
                 {} sectors had unflushed versions, {} held one; violations {}",
                cfg.cycles,
                c.writes - before.writes,
                c.flushes - before.flushes,
                c.unanswered - before.unanswered,
                v.with_unflushed,
                v.newer,
                v.violations
            );
        }
        shared.lock().record.start_cycle();
        if v.violations > 0 {
            server.kill9()?;
            report.kills = cycle.kills.clone();
            report.counts = shared.lock().counts.clone();
            report.seconds = started.elapsed().as_secs_f64();
            return Ok(report);
        }
    }
    if cfg.inject_fault && report.injected_faults == 0 {
        bail!("--inject-fault: no two sectors held durable data after any restart");
    }
    // The last load ends in a clean stop, unflushed: SIGTERM must flush.
    cycle.load(
        &mut server,
        Kill::Not(Duration::from_secs_f64(cfg.seconds_per_cycle)),
        rng.random(),
    )?;
    server.terminate()?;
    report.kills = cycle.kills.clone();
    {
        let mut st = shared.lock();
        let f = st.record.flush_point();
        st.record.flushed(f);
        if !st.record.settled() {
            bail!("internal: versions still in flight after the clean stop");
        }
        report.counts = st.counts.clone();
    }
    final_check(cfg, &dir, &files, &shared, &mut report)?;
    if digest(&files.base)? != base_digest {
        bail!(
            "the read-only base image {} was modified",
            files.base.display()
        );
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// After the clean stop: `qemu-img check` of both images, and the delta
/// read by qemu-img alone must match the record exactly.
fn final_check(
    cfg: &Config,
    dir: &Path,
    files: &Files,
    shared: &Shared,
    report: &mut ModeReport,
) -> Result<()> {
    for img in [&files.delta, &files.base] {
        let out = qemu_img(dir, &["check".as_ref(), img.as_os_str()])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        match out.status.code() {
            Some(0) => {}
            Some(3) => {
                report.leaked_clusters += text
                    .lines()
                    .find_map(|l| l.strip_suffix(" leaked clusters were found on the image."))
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .unwrap_or(1);
            }
            Some(2) => {
                report.image_corrupt = true;
                report
                    .first_violations
                    .push(format!("qemu-img check {}: {text}", img.display()));
            }
            _ => bail!(
                "qemu-img check {} could not check: {text}{}",
                img.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }
    let raw = dir.join("final.raw");
    qemu_img_ok(
        dir,
        &[
            "convert".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-O".as_ref(),
            "raw".as_ref(),
            files.delta.as_os_str(),
            raw.as_os_str(),
        ],
    )?;
    let mut f = File::open(&raw).with_context(|| format!("cannot open {}", raw.display()))?;
    if f.metadata()?.len() != cfg.size {
        bail!(
            "qemu-img read {} bytes, not {}",
            f.metadata()?.len(),
            cfg.size
        );
    }
    let mut v = Verified::default();
    let mut buf = vec![0u8; READ_CHUNK as usize];
    let mut off = 0;
    while off < cfg.size {
        let n = READ_CHUNK.min(cfg.size - off) as usize;
        f.read_exact(&mut buf[..n])?;
        v.judge(shared, off / SECTOR, &buf[..n]);
        off += n as u64;
    }
    drop(f);
    std::fs::remove_file(&raw)?;
    report.final_sectors_matched = v.sectors - v.violations;
    report.final_checked = true;
    report.violations += v.violations;
    report.first_violations.extend(
        v.shown
            .into_iter()
            .map(|s| format!("after the clean stop: {s}")),
    );
    Ok(())
}

/// Prints one mode's report for people.
pub fn print_report(out: &mut impl Write, r: &ModeReport) -> std::io::Result<()> {
    let k = &r.kills;
    let c = &r.counts;
    writeln!(
        out,
        "soak {} ({:.0} s): {}",
        r.mode, r.seconds, r.server_command
    )?;
    writeln!(
        out,
        "  cycles {}; kill -9: {} ({} busy, {} mid-flush, {} idle, {} during restart; {} with a flush in flight)",
        r.cycles,
        k.total(),
        k.busy,
        k.mid_flush,
        k.idle,
        k.during_restart,
        k.with_flush_in_flight
    )?;
    writeln!(
        out,
        "  writes {} ({} FUA, {} bytes), write-zeroes {}, trims {}, flushes {}, requests cut off by kills {}",
        c.writes, c.fua_writes, c.bytes_written, c.write_zeroes, c.trims, c.flushes, c.unanswered
    )?;
    writeln!(
        out,
        "  sectors verified {} ({} had unflushed versions at a kill, {} held one)",
        r.sectors_verified, r.sectors_with_unflushed, r.sectors_newer
    )?;
    if r.final_checked {
        writeln!(
            out,
            "  after the clean stop: {} sectors matched, qemu-img check: {}",
            r.final_sectors_matched,
            if r.image_corrupt {
                "CORRUPT".to_string()
            } else if r.leaked_clusters > 0 {
                format!("{} leaked clusters", r.leaked_clusters)
            } else {
                "clean".to_string()
            }
        )?;
    } else {
        writeln!(out, "  stopped after cycle {}: no clean stop", r.cycles)?;
    }
    writeln!(out, "  violations {}", r.violations)?;
    for v in &r.first_violations {
        writeln!(out, "    {v}")?;
    }
    if r.failed() {
        writeln!(
            out,
            "  files kept in {}; server log {}; serve them again with: {}",
            r.dir.display(),
            r.dir.join("server.log").display(),
            r.server_command
        )?;
    }
    Ok(())
}
