//! Writes that bypass a write-back cache (sequential runs past the write
//! cutoff) over blocks that are dirty in flash: the flushed dirty copy
//! is the only current one, so a crash before the bypassing write is
//! durable must still read it (or the new data), never what the backend
//! held before it.

use std::sync::Arc;
use vdcache_backend::BackendRef;
use vdcache_cache::{CacheConfig, DiskPolicy, FlashCache, WriteMode};
use vdcache_crash::{Log, RecordingFiles, StateKind, mem_files};
use vdcache_image::{
    DiskId, HostIo, ImageFormat, OpenOptions, StoreOpener, VirtualDisk, open_chain,
};

const BLOCK: u64 = 4096;
/// Crash states tear writes at this granularity.
const SECTOR: usize = 512;
const IMAGE: &str = "disk.raw";
const IMAGE_BYTES: usize = 4 << 20;
const DEVICE: &str = "cache.dev";
const DEVICE_BYTES: usize = 16 << 20;
/// Writes this long bypass the cache.
const THRESHOLD: u64 = 64 << 10;

fn config() -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        inline_background: true,
        // Nothing is written back: flash alone holds the flushed blocks.
        high_watermark: 1.0,
        low_watermark: 1.0,
        default_policy: DiskPolicy {
            mode: WriteMode::WriteBack,
            sequential_write_cutoff: THRESHOLD,
            ..CacheConfig::default().default_policy
        },
        ..CacheConfig::default()
    }
}

fn open_disk(opener: Arc<dyn StoreOpener>, cache: &Arc<FlashCache>) -> VirtualDisk {
    let io: Arc<dyn HostIo> = cache.clone();
    open_chain(
        IMAGE,
        &OpenOptions {
            opener,
            io: Some(io),
            disk: DiskId(1),
            format: Some(ImageFormat::Raw),
            ..OpenOptions::default()
        },
    )
    .expect("open disk")
}

fn read_range(disk: &VirtualDisk, start: u64, end: u64) -> Vec<u8> {
    let mut buf = vec![0u8; (end - start) as usize];
    disk.read(start, &mut buf).expect("read");
    buf
}

/// Every crash state after each step of: dirty blocks flushed to flash,
/// then overwritten by one bypassing write (whole blocks and, at its
/// ends, parts of blocks), reads the flushed or the new bytes.
#[test]
fn bypassing_writes_never_lose_flushed_dirty_blocks() {
    let log = Log::new();
    let files = RecordingFiles::new(&log);
    files.insert(IMAGE, vec![0u8; IMAGE_BYTES]);
    let device: BackendRef = files.insert_fixed(DEVICE, DEVICE_BYTES);
    let cache = FlashCache::format(device, config()).expect("format");
    let disk = open_disk(files.clone(), &cache);
    // Blocks 16..=20 dirty in flash (written one at a time, backwards, so
    // no run forms), then flushed.
    let flushed = vec![0x11u8; BLOCK as usize];
    for b in (16..=20).rev() {
        disk.write(b * BLOCK, &flushed, false).expect("write");
    }
    disk.flush().expect("flush");
    assert_eq!(cache.report().total.dirty_bytes, 5 * BLOCK);
    // One bypassing write from the middle of block 15 to the middle of
    // block 19, and the crash points around it.
    let start = log.len();
    // Twice the cutoff: the image cuts it at 64 KiB clusters.
    let new = vec![0x22u8; 2 * THRESHOLD as usize];
    let at = 15 * BLOCK + BLOCK / 2;
    disk.write(at, &new, false).expect("bypassing write");
    assert!(
        cache.report().total.backend_bytes_written > 0,
        "the write did not bypass the cache"
    );
    let end = log.len();
    let history = log.snapshot();
    for point in start..=end {
        for kind in [StateKind::None, StateKind::All, StateKind::Random(point)] {
            let state = history.state(point, kind);
            let what = format!("crash at {point} ({kind})");
            let images = mem_files(&state);
            let dev: BackendRef = Arc::new(state.device(DEVICE).expect("device").to_mem_backend());
            let recovered = FlashCache::open(dev, config()).expect("recover");
            let disk = open_disk(images, &recovered);
            let got = read_range(&disk, 15 * BLOCK, 21 * BLOCK);
            for (i, sector) in got.chunks(SECTOR).enumerate() {
                let pos = 15 * BLOCK + (i * SECTOR) as u64;
                let old = if pos >= 16 * BLOCK { 0x11 } else { 0 };
                let new = if pos >= at { 0x22 } else { old };
                assert!(
                    sector.iter().all(|&x| x == old) || sector.iter().all(|&x| x == new),
                    "{what}: the sector at {pos} reads neither its old ({old:#x}) nor its new ({new:#x}) bytes but {:#x}",
                    sector[0]
                );
            }
        }
    }
}
