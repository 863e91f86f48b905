//! `vdcache bench`: benchmarks, never tests. `engine` measures 4 KiB
//! random and strided reads and writes through the COW engine on a local
//! file next to `qemu-img bench` on an identical copy, in one run.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::time::Instant;
use vdcache_image::{CreateOptions, OpenOptions, create_qcow2, open_chain};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(clap::Subcommand)]
enum Which {
    /// 4 KiB I/O through the engine next to qemu-img bench.
    Engine(EngineArgs),
}

#[derive(clap::Args)]
struct EngineArgs {
    /// Scratch directory (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Image size in MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Requests per run.
    #[arg(long, default_value_t = 100_000)]
    count: u64,
}

struct Row {
    name: String,
    ours: f64,
    qemu: Option<f64>,
}

fn fill_image(path: &str, size: u64) -> Result<()> {
    let disk = open_chain(path, &OpenOptions::default())?;
    let chunk = vec![0x5a; 1 << 20];
    for off in (0..size).step_by(1 << 20) {
        disk.write(off, &chunk, false)?;
    }
    disk.close()?;
    Ok(())
}

/// Offsets of request `i`: qemu-img bench's rule, `i * step mod size`.
/// A step of an odd number of blocks visits every block in scattered order.
fn offset_of(i: u64, step: u64, size: u64) -> u64 {
    (u128::from(i) * u128::from(step) % u128::from(size)) as u64
}

/// The scattered pattern's step: 40503 blocks of 4 KiB (an odd count).
const SCATTER_STEP: u64 = 40503 * 4096;

fn engine_run(path: &str, size: u64, count: u64, write: bool, step: u64) -> Result<f64> {
    let disk = open_chain(path, &OpenOptions::default())?;
    let mut buf = vec![0xa5u8; 4096];
    let start = Instant::now();
    for i in 0..count {
        let off = offset_of(i, step, size);
        if write {
            disk.write(off, &buf, false)?;
        } else {
            disk.read(off, &mut buf)?;
        }
    }
    disk.flush()?;
    let secs = start.elapsed().as_secs_f64();
    disk.close()?;
    Ok(count as f64 / secs)
}

/// Runs qemu-img bench and returns its own measured IOPS ("Run completed
/// in N seconds"), or `None` when qemu-img is not installed.
fn qemu_bench(path: &str, count: u64, write: bool, step: u64) -> Result<Option<f64>> {
    let mut cmd = std::process::Command::new("qemu-img");
    cmd.args([
        "bench",
        "-f",
        "qcow2",
        "-t",
        "writeback",
        "-d",
        "1",
        "-s",
        "4k",
    ])
    .arg("-S")
    .arg(step.to_string())
    .arg("-c")
    .arg(count.to_string());
    if write {
        cmd.arg("-w");
    }
    let out = match cmd.arg(path).output() {
        Ok(o) => o,
        Err(_) => return Ok(None),
    };
    if !out.status.success() {
        bail!(
            "qemu-img bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let secs: f64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("Run completed in ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .with_context(|| format!("unexpected qemu-img bench output: {text}"))?;
    Ok(Some(count as f64 / secs))
}

fn run_engine(a: EngineArgs) -> Result<u8> {
    let dir = a.dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("vdcache-bench-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let size = a.size_mib << 20;
    let ours = dir.join("engine.qcow2");
    let theirs = dir.join("qemu.qcow2");
    create_qcow2(
        &ours,
        &CreateOptions {
            size: Some(size),
            ..CreateOptions::default()
        },
    )?;
    fill_image(&ours.display().to_string(), size)?;
    std::fs::copy(&ours, &theirs)?;
    let (o, t) = (ours.display().to_string(), theirs.display().to_string());
    let mut rows = Vec::new();
    for (pattern, step) in [
        ("sequential", 4096),
        ("scattered (random order)", SCATTER_STEP),
    ] {
        for (op, write) in [("read", false), ("write", true)] {
            let qemu = qemu_bench(&t, a.count, write, step)?;
            let mine = engine_run(&o, size, a.count, write, step)?;
            rows.push(Row {
                name: format!("4k {pattern} {op}"),
                ours: mine,
                qemu,
            });
        }
    }
    outln!(
        "| workload (QD1, {} requests, {} MiB fully allocated image, page cache) | vdcache engine IOPS | qemu-img bench IOPS | vdcache/qemu |",
        a.count,
        a.size_mib
    );
    outln!("|---|---:|---:|---:|");
    for r in rows {
        match r.qemu {
            Some(q) => outln!(
                "| {} | {:.0} | {:.0} | {:.2} |",
                r.name,
                r.ours,
                q,
                r.ours / q
            ),
            None => outln!(
                "| {} | {:.0} | (qemu-img not installed) | |",
                r.name,
                r.ours
            ),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(0)
}

pub fn run(a: Args) -> Result<u8> {
    match a.which {
        Which::Engine(e) => run_engine(e),
    }
}
