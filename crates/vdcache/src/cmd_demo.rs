//! `vdcache demo`: the main job on a default it makes itself. Creates a
//! base image and a delta over it in a scratch directory, writes a pattern
//! through the chain (copy-on-write from the base), reads everything back
//! and verifies it, and checks the images (with qemu-img too, if present).

use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use vdcache_image::{CreateOptions, ImageFormat, Layer, OpenOptions, create_qcow2, open_chain};

#[derive(clap::Args)]
pub struct Args {
    /// Directory for the demo images (a fresh temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

fn pattern(offset: u64) -> u8 {
    (offset / 4096 % 251) as u8
}

pub fn run(a: Args) -> Result<u8> {
    let dir = match a.dir {
        Some(d) => d,
        None => std::env::temp_dir().join(format!("vdcache-demo-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let base = dir.join("base.qcow2");
    let delta = dir.join("delta.qcow2");
    let size: u64 = 64 << 20;
    println!(
        "1. creating base {} (64 MiB) and filling it",
        base.display()
    );
    create_qcow2(
        &base,
        &CreateOptions {
            size: Some(size),
            ..CreateOptions::default()
        },
    )?;
    {
        let disk = open_chain(&base.display().to_string(), &OpenOptions::default())?;
        let chunk: Vec<u8> = (0..1u64 << 20).map(pattern).collect();
        for off in (0..size).step_by(1 << 20) {
            disk.write(off, &chunk, false)?;
        }
        disk.close()?;
    }
    println!("2. creating delta {} over it", delta.display());
    create_qcow2(
        &delta,
        &CreateOptions {
            backing: Some(("base.qcow2".into(), ImageFormat::Qcow2)),
            ..CreateOptions::default()
        },
    )?;
    let disk = open_chain(&delta.display().to_string(), &OpenOptions::default())?;
    println!("3. writing 4 KiB into every 1 MiB of the delta (each write copies on write)");
    for off in (0..size).step_by(1 << 20) {
        disk.write(off + 8192, &[0xee; 4096], false)?;
    }
    disk.flush()?;
    println!("4. reading all 64 MiB back through the chain and verifying");
    let mut buf = vec![0u8; 1 << 20];
    for off in (0..size).step_by(1 << 20) {
        disk.read(off, &mut buf)?;
        for (i, &b) in buf.iter().enumerate() {
            let want = if (8192..12288).contains(&i) {
                0xee
            } else {
                pattern(i as u64)
            };
            if b != want {
                bail!(
                    "mismatch at guest offset {}: read {b:#x}, expected {want:#x}",
                    off + i as u64
                );
            }
        }
    }
    let io = disk.io().clone();
    disk.close()?;
    drop(disk);
    let _ = io;
    println!("5. checking both images");
    for img in [&delta, &base] {
        let d = open_chain(
            &img.display().to_string(),
            &OpenOptions {
                read_only: true,
                no_backing: true,
                ..OpenOptions::default()
            },
        )?;
        if let Layer::Qcow2(q) = &d.layers()[0] {
            let r = q.check()?;
            if !r.is_clean() {
                bail!("{}: {:?} {:?}", img.display(), r.corruptions, r.leaks);
            }
        }
        match std::process::Command::new("qemu-img")
            .arg("check")
            .arg(img)
            .output()
        {
            Ok(o) if o.status.success() => println!("   qemu-img check {}: clean", img.display()),
            Ok(o) => bail!(
                "qemu-img check {} failed: {}",
                img.display(),
                String::from_utf8_lossy(&o.stdout)
            ),
            Err(_) => println!("   (qemu-img not installed; vdcache's own check passed)"),
        }
    }
    println!("demo passed: images are in {}", dir.display());
    Ok(0)
}
