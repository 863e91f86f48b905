//! `vdcache demo`: the main job on a default it makes itself. Creates a
//! base image and a delta over it in a scratch directory, serves the chain
//! through a flash cache (writes copy on write from the base, reads come
//! back from flash), restarts the cache as after a crash, writes everything
//! back, and checks the images with vdcache and, when installed, with
//! qemu-img and qemu-io over NBD.

use crate::serve::export::DiskExport;
use crate::size::human;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vdcache_backend::{FileBackend, FileOptions, LockMode};
use vdcache_cache::{CacheConfig, CowMode, FlashCache};
use vdcache_image::{
    CreateOptions, DiskId, HostIo, ImageFormat, Layer, MetaCacheConfig, OpenOptions, VirtualDisk,
    create_qcow2, open_chain,
};
use vdcache_ownership::OwnedDir;

#[derive(clap::Args)]
pub struct Args {
    /// Directory for the demo files, kept afterwards (by default a fresh
    /// temporary directory, removed at the end).
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

/// The demo's own files: in a directory of the user's, the demo writes
/// only these (and its marker), and only where it finds nothing else.
const DEMO_FILES: [&str; 4] = [BASE, DELTA, CACHE, SOCKET];
const BASE: &str = "base.qcow2";
const DELTA: &str = "delta.qcow2";
const CACHE: &str = "flash.cache";
const SOCKET: &str = "demo.sock";
const MARKER: &str = ".vdcache-demo";

pub fn run(a: Args) -> Result<u8> {
    let keep = a.dir.is_some();
    let dir = match &a.dir {
        Some(d) => OwnedDir::claim(
            d,
            MARKER,
            "This directory holds the files of `vdcache demo`, which may replace them on its next run.\n",
            &DEMO_FILES,
        )
        .context("vdcache demo --dir")?,
        None => OwnedDir::fresh_temp("vdcache-demo")?,
    };
    let result = demo(dir.path());
    let (files, bytes) = dir_size(dir.path());
    if keep || result.is_err() {
        outln!(
            "files kept in {}: {files} files, {} on disk{} (remove them with: {})",
            dir.path().display(),
            human(bytes),
            if result.is_err() {
                ", for a look at what failed"
            } else {
                ""
            },
            removal_command(&dir)
        );
    } else {
        let path = dir.path().to_path_buf();
        match dir.remove_if_created() {
            Ok(_) => outln!(
                "removed the demo's {files} files ({}) from {}; run `vdcache demo --dir DIR` to keep them",
                human(bytes),
                path.display()
            ),
            Err(e) => outln!(
                "could not remove {} ({e}); it holds {} you may delete",
                path.display(),
                human(bytes)
            ),
        }
    }
    result?;
    outln!();
    outln!("Next: serve a disk of your own through a cache and attach a client:");
    outln!("  vdcache create base.qcow2 10G");
    outln!("  vdcache create -b base.qcow2 -F qcow2 vm.qcow2");
    outln!("  vdcache serve --socket vm.sock --cache flash.cache --cache-size 1G vm.qcow2 &");
    outln!("  qemu-io -f raw -c 'read 0 64k' \"nbd+unix:///?socket=$PWD/vm.sock\"");
    outln!("  vdcache stats --socket vm.sock");
    outln!("(README.md, \"Serving a VM's disk\", walks through it, QEMU and libvirt included.)");
    Ok(0)
}

/// How to remove what the demo left: the whole directory if the demo made
/// it, else only its own files.
fn removal_command(dir: &OwnedDir) -> String {
    let quote = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', "'\\''"));
    if dir.created() {
        return format!("rm -r {}", quote(dir.path()));
    }
    let mut names: Vec<String> = DEMO_FILES
        .iter()
        .chain(&[MARKER])
        .map(|f| dir.path().join(f))
        .filter(|p| p.exists())
        .map(|p| quote(&p))
        .collect();
    names.insert(0, "rm".into());
    names.join(" ")
}

/// Files under `dir` and the bytes they take on disk (sparse files count
/// what they hold, not their length).
fn dir_size(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    entries
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .fold((0, 0), |(n, b), m| (n + 1, b + m.blocks() * 512))
}

fn demo(dir: &Path) -> Result<()> {
    let dir = dir.to_path_buf();
    let base = dir.join(BASE);
    let delta = dir.join(DELTA);
    let cache_file = dir.join(CACHE);
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
            backing: Some((BASE.into(), ImageFormat::Qcow2)),
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
    let t = &r.total;
    outln!(
        "   reads: {} of {} 4 KiB blocks came from flash ({:.0}%): the first pass over the 64 MiB found only the blocks just written there and brought the rest in from the images, the second was served from flash",
        t.read_hit_blocks,
        t.read_hit_blocks + t.read_miss_blocks,
        t.read_hit_ratio() * 100.0
    );
    outln!(
        "   dirty: {} ({} blocks) is in flash only, not yet in the delta: the guest's writes and the qcow2 metadata they changed; a clean stop writes it back",
        human(r.dirty_bytes),
        r.dirty_bytes / 4096
    );
    outln!(
        "   flash written: {} of data, {} of journal and checkpoints; the images got {} ({} syncs): with write-back a guest flush is made durable in flash",
        human(r.device.data_bytes_written),
        human(r.device.meta_bytes_written),
        human(t.backend_bytes_written),
        t.backend_syncs
    );
    serve_and_read(&dir, &disk)?;
    outln!("4. restart as after a crash: fast recovery from the cache device");
    drop(disk);
    drop(cache);
    let cache = open_cache(&cache_file, false)?;
    let disk = open_disk(&delta, Some(&cache))?;
    verify(&disk, "after fast recovery")?;
    let r = cache.report();
    outln!(
        "   recovered: {} journal records replayed; {} dirty blocks still in flash, every block reads as before",
        r.recovery.entries_replayed,
        r.dirty_bytes / 4096
    );
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
    outln!(
        "demo passed: every block read back as written, before and after the restart, and both images are consistent"
    );
    Ok(())
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
    let sock = dir.join(SOCKET);
    let export = Arc::new(DiskExport {
        disk: Arc::new(shared_view(disk)?),
        latency: None,
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
