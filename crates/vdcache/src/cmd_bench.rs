//! `vdcache bench`: benchmarks, never tests. `engine` measures 4 KiB
//! random and strided reads and writes through the COW engine on a local
//! file next to `qemu-img bench` on an identical copy, in one run.

use anyhow::{Context, Result, bail};
use rand::{RngExt, SeedableRng};
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

fn engine_run(path: &str, size: u64, count: u64, write: bool, random: bool) -> Result<f64> {
    let disk = open_chain(path, &OpenOptions::default())?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let blocks = size / 4096;
    let mut buf = vec![0xa5u8; 4096];
    let start = Instant::now();
    for i in 0..count {
        let block = if random {
            rng.random_range(0..blocks)
        } else {
            i % blocks
        };
        if write {
            disk.write(block * 4096, &buf, false)?;
        } else {
            disk.read(block * 4096, &mut buf)?;
        }
    }
    disk.flush()?;
    let secs = start.elapsed().as_secs_f64();
    disk.close()?;
    Ok(count as f64 / secs)
}

fn qemu_bench(path: &str, count: u64, write: bool) -> Result<Option<f64>> {
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
    .arg("-c")
    .arg(count.to_string());
    if write {
        cmd.arg("-w");
    }
    let start = Instant::now();
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
    Ok(Some(count as f64 / start.elapsed().as_secs_f64()))
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
    for (name, write) in [
        ("4k sequential read (qemu-img bench pattern)", false),
        ("4k sequential write (qemu-img bench pattern)", true),
    ] {
        let qemu = qemu_bench(&t, a.count, write)?;
        let mine = engine_run(&o, size, a.count, write, false)?;
        rows.push(Row {
            name: name.into(),
            ours: mine,
            qemu,
        });
    }
    for (name, write) in [("4k random read", false), ("4k random write", true)] {
        rows.push(Row {
            name: name.into(),
            ours: engine_run(&o, size, a.count, write, true)?,
            qemu: None,
        });
    }
    println!(
        "| workload (QD1, {} requests, {} MiB image) | vdcache engine IOPS | qemu-img bench IOPS | ratio |",
        a.count, a.size_mib
    );
    println!("|---|---:|---:|---:|");
    for r in rows {
        match r.qemu {
            Some(q) => println!(
                "| {} | {:.0} | {:.0} | {:.2} |",
                r.name,
                r.ours,
                q,
                r.ours / q
            ),
            None => println!(
                "| {} | {:.0} | n/a (qemu-img bench has no random mode) | |",
                r.name, r.ours
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
