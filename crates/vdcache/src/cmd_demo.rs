//! `vdcache demo`: the main job on a default it makes itself. Creates a
//! base image and a delta over it in a scratch directory, serves the chain
//! through a flash cache (writes copy on write from the base, reads come
//! back from flash), restarts the cache as after a crash, writes everything
//! back, and checks the images with vdcache and, when installed, with
//! qemu-img and qemu-io over NBD.

use crate::serve::export::DiskExport;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vdcache_backend::{FileBackend, FileOptions, LockMode};
use vdcache_cache::{CacheConfig, CowMode, FlashCache};
use vdcache_image::{
    CreateOptions, DiskId, HostIo, ImageFormat, Layer, MetaCacheConfig, OpenOptions, VirtualDisk,
    create_qcow2, open_chain,
};

#[derive(clap::Args)]
pub struct Args {
    /// Directory for the demo files (a fresh temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

const SIZE: u64 = 64 << 20;
const STEP: u64 = 1 << 20;

fn base_byte(offset: u64) -> u8 {
    (offset / 4096 % 251) as u8
}

fn expected(offset_in_step: usize, step_start: u64) -> u8 {
    if (8192..12288).contains(&offset_in_step) {
        0xee
    } else {
        base_byte(step_start + offset_in_step as u64)
    }
}

fn open_cache(path: &Path, fresh: bool) -> Result<Arc<FlashCache>> {
    if fresh {
        std::fs::File::create(path)?.set_len(128 << 20)?;
    }
    let dev = FileBackend::open(
        path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: false,
        },
    )?;
    let cfg = CacheConfig::default();
    let cache = if fresh {
        FlashCache::format(Arc::new(dev), cfg)?
    } else {
        FlashCache::open(Arc::new(dev), cfg)?
    };
    Ok(cache)
}

fn open_disk(delta: &Path, cache: Option<&Arc<FlashCache>>) -> Result<VirtualDisk> {
    let io = cache.map(|c| c.clone() as Arc<dyn HostIo>);
    Ok(open_chain(
        &delta.display().to_string(),
        &OpenOptions {
            io,
            disk: DiskId(1),
            // The cache's default mode is cow-aware: sector-sized metadata.
            cache: MetaCacheConfig::with_slice_bytes(CowMode::CowAware.meta_slice_bytes()),
            ..OpenOptions::default()
        },
    )?)
}

fn verify(disk: &VirtualDisk, what: &str) -> Result<()> {
    let mut buf = vec![0u8; STEP as usize];
    for off in (0..SIZE).step_by(STEP as usize) {
        disk.read(off, &mut buf)?;
        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != expected(i, off)) {
            bail!(
                "{what}: guest offset {} reads {:#04x}, expected {:#04x}",
                off + i as u64,
                buf[i],
                expected(i, off)
            );
        }
    }
    Ok(())
}

pub fn run(a: Args) -> Result<u8> {
    let dir = a.dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("vdcache-demo-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let base = dir.join("base.qcow2");
    let delta = dir.join("delta.qcow2");
    let cache_file = dir.join("flash.cache");
    outln!("1. base image {} (64 MiB of data)", base.display());
    create_qcow2(
        &base,
        &CreateOptions {
            size: Some(SIZE),
            ..CreateOptions::default()
        },
    )?;
    {
        let disk = open_chain(&base.display().to_string(), &OpenOptions::default())?;
        for off in (0..SIZE).step_by(STEP as usize) {
            let chunk: Vec<u8> = (off..off + STEP).map(base_byte).collect();
            disk.write(off, &chunk, false)?;
        }
        disk.close()?;
    }
    outln!(
        "2. delta {} over it, a 128 MiB flash cache {}",
        delta.display(),
        cache_file.display()
    );
    create_qcow2(
        &delta,
        &CreateOptions {
            backing: Some(("base.qcow2".into(), ImageFormat::Qcow2)),
            ..CreateOptions::default()
        },
    )?;
    let cache = open_cache(&cache_file, true)?;
    let disk = open_disk(&delta, Some(&cache))?;
    outln!("3. 4 KiB guest writes into every MiB (copy on write), flushed: write-back to flash");
    for off in (0..SIZE).step_by(STEP as usize) {
        disk.write(off + 8192, &[0xee; 4096], false)?;
    }
    disk.flush()?;
    verify(&disk, "first read")?;
    verify(&disk, "second read")?;
    let r = cache.report();
    outln!(
        "   read hits {} of {} blocks, {} bytes dirty in flash, {} backend syncs",
        r.total.read_hit_blocks,
        r.total.read_hit_blocks + r.total.read_miss_blocks,
        r.dirty_bytes,
        r.total.backend_syncs
    );
    serve_and_read(&dir, &disk)?;
    outln!("4. restart as after a crash: fast recovery from the cache device");
    drop(disk);
    drop(cache);
    let cache = open_cache(&cache_file, false)?;
    let disk = open_disk(&delta, Some(&cache))?;
    verify(&disk, "after fast recovery")?;
    outln!(
        "5. clean stop: partially valid clusters filled from the base, every dirty block written back, images standalone"
    );
    // As `vdcache serve` does on a clean stop: decoupled copy-on-write left
    // the rest of each written cluster in the base only.
    let fill = disk.fill_partial(usize::MAX)?;
    if fill.remaining > 0 {
        bail!("{} partially valid ranges were not filled", fill.remaining);
    }
    disk.close()?;
    drop(disk);
    cache.shutdown(false)?;
    drop(cache);
    verify(&open_disk(&delta, None)?, "images without the cache")?;
    check_images(&[&delta, &base])?;
    outln!("demo passed: files are in {}", dir.display());
    Ok(0)
}

/// Serves the disk over NBD in-process and reads it with qemu-io.
fn serve_and_read(dir: &Path, disk: &VirtualDisk) -> Result<()> {
    let Ok(probe) = std::process::Command::new("qemu-io")
        .arg("--version")
        .output()
    else {
        outln!("   (qemu-io not installed: skipping the NBD read)");
        return Ok(());
    };
    if !probe.status.success() {
        return Ok(());
    }
    let sock = dir.join("demo.sock");
    let export = Arc::new(DiskExport {
        disk: Arc::new(shared_view(disk)?),
    });
    let server = vdcache_nbd_server::Server::builder()
        .export("", export)
        .build()?;
    server.listen_unix(&sock)?;
    let out = std::process::Command::new("qemu-io")
        .args([
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0xee 8192 4096",
            "-c",
            "read -P 1 4096 4096",
        ])
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .output()?;
    server.shutdown();
    if !out.status.success() || String::from_utf8_lossy(&out.stdout).contains("failed") {
        bail!("qemu-io over NBD: {}", String::from_utf8_lossy(&out.stdout));
    }
    outln!("   qemu-io read the served disk over NBD: patterns verified");
    Ok(())
}

/// A second, read-only VirtualDisk over the same cache and files.
fn shared_view(disk: &VirtualDisk) -> Result<VirtualDisk> {
    let Some(top) = disk.layers().first() else {
        bail!("empty chain");
    };
    Ok(open_chain(
        top.name(),
        &OpenOptions {
            read_only: true,
            force_share: true,
            io: Some(disk.io().clone()),
            disk: DiskId(1),
            ..OpenOptions::default()
        },
    )?)
}

fn check_images(images: &[&Path]) -> Result<()> {
    for img in images {
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
            Ok(o) if o.status.success() => outln!("   qemu-img check {}: clean", img.display()),
            Ok(o) => bail!(
                "qemu-img check {} failed: {}",
                img.display(),
                String::from_utf8_lossy(&o.stdout)
            ),
            Err(_) => outln!(
                "   vdcache check {}: clean (qemu-img not installed)",
                img.display()
            ),
        }
    }
    Ok(())
}
