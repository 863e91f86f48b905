//! Issue 43, items 1 and 9: the file system holding the cache device runs
//! full (every write to the device fails with ENOSPC for a while, as on a
//! sparse cache file whose file system filled up). A flush may succeed only
//! when every write it covers is durable: what a failed flush left
//! unwritten is written by the next one, so after space returns and a
//! flush succeeds, a crash loses nothing acknowledged. Meanwhile reads of
//! data flash does not hold come from the image: a cache that cannot
//! admit a copy must not fail the read.

use crate::common;

use common::disk_through;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use vdcache_backend::inject::HookedBackend;
use vdcache_backend::{BackendRef, MemBackend};
use vdcache_cache::{CacheConfig, FlashCache, WriteMode};
use vdcache_image::{ImageFormat, MemFiles, VirtualDisk, ZeroFlags};

const BLOCK: u64 = 4096;
const IMAGE: u64 = 8 << 20;
const DEVICE: usize = 32 << 20;
const NAME: &str = "vm/disk.raw";

/// Nothing is written back (flash alone holds what was written), and no
/// background threads: every device write comes from the test's calls.
fn config(mode: WriteMode) -> CacheConfig {
    CacheConfig {
        inline_background: true,
        ..common::drain_only_config(mode)
    }
}

fn base_byte(block: u64) -> u8 {
    (block as u8).wrapping_mul(7) | 1
}

/// The image: every block filled with its own non-zero byte.
fn image() -> Vec<u8> {
    let mut image = vec![0u8; IMAGE as usize];
    for (b, chunk) in image.chunks_mut(BLOCK as usize).enumerate() {
        chunk.fill(base_byte(b as u64));
    }
    image
}

/// A cache device whose writes fail with ENOSPC while `full` is set.
struct FillingDevice {
    memory: Arc<MemBackend>,
    full: Arc<AtomicBool>,
}

impl FillingDevice {
    fn new() -> (FillingDevice, BackendRef) {
        let memory = Arc::new(MemBackend::fixed("cache", DEVICE));
        let full = Arc::new(AtomicBool::new(false));
        let flag = full.clone();
        let device = HookedBackend::new(memory.clone()).on_write(move || {
            if flag.load(Ordering::SeqCst) {
                Err(io::Error::from_raw_os_error(28))
            } else {
                Ok(())
            }
        });
        (FillingDevice { memory, full }, Arc::new(device))
    }

    fn set_full(&self, full: bool) {
        self.full.store(full, Ordering::SeqCst);
    }
}

/// The cache on what the device holds now, as a restart after kill -9
/// finds it, with the image as it is now.
fn after_crash(device: &FillingDevice, files: &Arc<MemFiles>, mode: WriteMode) -> VirtualDisk {
    let restarted = MemFiles::new();
    restarted.insert(NAME, files.get(NAME).expect("image").snapshot());
    let dev: BackendRef = Arc::new(MemBackend::new("cache", device.memory.snapshot()));
    let cache = FlashCache::open(dev, config(mode)).expect("the cache reopens");
    disk_through(restarted, &cache, NAME, ImageFormat::Raw)
}

fn read_block(disk: &VirtualDisk, block: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    disk.read(block * BLOCK, &mut buf)
        .unwrap_or_else(|e| panic!("block {block}: {e}"));
    buf
}

/// The write-zeroes the guest was told succeeded while the device was full
/// are covered by the first flush that succeeds, even when the guest does
/// not send them again.
#[test]
fn acknowledged_write_zeroes_reach_flash_with_the_next_successful_flush() {
    for mode in [WriteMode::WriteBack, WriteMode::WriteThrough] {
        acknowledged_write_zeroes_survive(mode);
    }
}

fn acknowledged_write_zeroes_survive(mode: WriteMode) {
    let files = MemFiles::new();
    files.insert(NAME, image());
    let (device, dev) = FillingDevice::new();
    let cache = FlashCache::format(dev, config(mode)).expect("format");
    let disk = disk_through(files.clone(), &cache, NAME, ImageFormat::Raw);
    disk.write(0, &[0xaa; BLOCK as usize], false)
        .expect("write");
    disk.flush().expect("flush");

    let written = |c: &FlashCache| {
        let d = c.device_stats();
        d.data_bytes_written + d.meta_bytes_written
    };
    let before = written(&cache);
    device.set_full(true);
    let mut acknowledged = Vec::new();
    for b in [256u64, 768, 1280, 1792] {
        if disk
            .write_zeroes(b * BLOCK, BLOCK, ZeroFlags::default())
            .is_ok()
        {
            acknowledged.push(b);
        }
    }
    let e = disk.flush().expect_err("the flush while full must fail");
    assert!(
        e.to_string().contains("cache device") && e.to_string().contains("No space left"),
        "the error must name the cache device as full: {e}"
    );
    assert_eq!(
        written(&cache),
        before,
        "{mode:?}: the stats count bytes the full device never took"
    );
    device.set_full(false);
    disk.flush().expect("the next flush, with space back");
    disk.write(4 * BLOCK, &[0xbb; BLOCK as usize], false)
        .expect("a write once space is back");
    disk.flush().expect("and its flush");

    let disk = after_crash(&device, &files, mode);
    for b in acknowledged {
        assert!(
            read_block(&disk, b).iter().all(|&x| x == 0),
            "{mode:?}: block {b}: write-zeroes acknowledged and covered by a successful flush, lost at a crash"
        );
    }
    assert_eq!(read_block(&disk, 0), vec![0xaa; BLOCK as usize]);
    assert_eq!(read_block(&disk, 4), vec![0xbb; BLOCK as usize]);
}

/// Item 9: with the device full, reads of data flash does not hold (never
/// written base data) come from the image; admitting them is skipped.
#[test]
fn reads_fall_back_to_the_image_while_the_device_is_full() {
    for mode in [WriteMode::WriteBack, WriteMode::WriteThrough] {
        let files = MemFiles::new();
        files.insert(NAME, image());
        let (device, dev) = FillingDevice::new();
        let cache = FlashCache::format(dev, config(mode)).expect("format");
        let disk = disk_through(files.clone(), &cache, NAME, ImageFormat::Raw);
        disk.flush().expect("flush");
        device.set_full(true);
        for b in (0..IMAGE / BLOCK).step_by(97) {
            let mut buf = vec![0u8; (4 * BLOCK) as usize];
            let blocks = 4.min(IMAGE / BLOCK - b);
            let buf = &mut buf[..(blocks * BLOCK) as usize];
            disk.read(b * BLOCK, buf).unwrap_or_else(|e| {
                panic!("{mode:?}: read of block {b} with the device full: {e}")
            });
            for (i, chunk) in buf.chunks(BLOCK as usize).enumerate() {
                assert!(
                    chunk.iter().all(|&x| x == base_byte(b + i as u64)),
                    "{mode:?}: block {} reads wrong data",
                    b + i as u64
                );
            }
        }
    }
}
