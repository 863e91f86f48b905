//! Writes that bypass a write-back cache (sequential runs past the write
//! cutoff) over blocks that are dirty in flash, or over dirty metadata
//! sectors the cache holds: the flushed dirty copy is the only current
//! one, so a crash before the bypassing write is durable must still read
//! it (or the new data), never what the backend held before it.

use std::sync::Arc;
use vdcache_backend::BackendRef;
use vdcache_cache::{CacheConfig, DiskPolicy, FlashCache, WriteMode};
use vdcache_crash::{Log, RecordingFiles, StateKind, mem_files, open_raw_through};
use vdcache_image::{
    DiskId, FlushKind, HostIo, IoTag, MetaTable, StoreOpener, VirtualDisk, WriteSegment,
};
use vdcache_qcow2::HostOffset;

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
    open_raw_through(opener, cache, IMAGE).expect("open disk")
}

fn read_range(disk: &VirtualDisk, start: u64, end: u64) -> Vec<u8> {
    let mut buf = vec![0u8; (end - start) as usize];
    disk.read(start, &mut buf).expect("read");
    buf
}

/// A recorded image and cache device, and the disk over them.
struct Setup {
    log: Arc<Log>,
    cache: Arc<FlashCache>,
    disk: VirtualDisk,
}

fn setup() -> Setup {
    let log = Log::new();
    let files = RecordingFiles::new(&log);
    files.insert(IMAGE, vec![0u8; IMAGE_BYTES]);
    let device: BackendRef = files.insert_fixed(DEVICE, DEVICE_BYTES);
    let cache = FlashCache::format(device, config()).expect("format");
    let disk = open_disk(files.clone(), &cache);
    Setup { log, cache, disk }
}

/// A write longer than the cutoff from the middle of block 15 on (the
/// image cuts it at 64 KiB clusters, so its second part bypasses).
const BYPASS_AT: u64 = 15 * BLOCK + BLOCK / 2;
const BYPASS_BYTE: u8 = 0x22;

fn bypassing_write(s: &Setup) {
    let new = vec![BYPASS_BYTE; 2 * THRESHOLD as usize];
    s.disk
        .write(BYPASS_AT, &new, false)
        .expect("bypassing write");
    assert!(
        s.cache.report().total.backend_bytes_written > 0,
        "the write did not bypass the cache"
    );
}

/// Recovers every crash state around the bypassing write (torn or not)
/// and checks each sector of blocks 15..21 reads `flushed(pos)` or the
/// bypassing write's bytes.
fn check_every_crash_state(s: &Setup, flushed: impl Fn(u64) -> u8) {
    let start = s.log.len();
    bypassing_write(s);
    let end = s.log.len();
    let history = s.log.snapshot();
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
                let old = flushed(pos);
                let new = if pos >= BYPASS_AT { BYPASS_BYTE } else { old };
                assert!(
                    sector.iter().all(|&x| x == old) || sector.iter().all(|&x| x == new),
                    "{what}: the sector at {pos} reads neither its old ({old:#x}) nor its new ({new:#x}) bytes but {:#x}",
                    sector[0]
                );
            }
        }
    }
}

/// Dirty blocks flushed to flash, then overwritten by one bypassing
/// write (whole blocks and, at its ends, parts of blocks).
#[test]
fn bypassing_writes_never_lose_flushed_dirty_blocks() {
    let s = setup();
    // Blocks 16..=20 dirty in flash (written one at a time, backwards, so
    // no run forms), then flushed.
    let flushed = vec![0x11u8; BLOCK as usize];
    for b in (16..=20).rev() {
        s.disk.write(b * BLOCK, &flushed, false).expect("write");
    }
    s.disk.flush().expect("flush");
    assert_eq!(s.cache.report().total.dirty_bytes, 5 * BLOCK);
    check_every_crash_state(&s, |pos| if pos >= 16 * BLOCK { 0x11 } else { 0 });
}

/// Dirty L2 sectors the cache holds (journaled, not on the image), then a
/// bypassing guest write over them: what the COW layer does when it
/// reuses a freed table's cluster for data.
#[test]
fn bypassing_writes_never_lose_flushed_metadata_sectors() {
    let s = setup();
    let handle = s.disk.layers()[0].handle().clone();
    let tag = IoTag::meta(MetaTable::L2, DiskId(1));
    // Two sectors at the start of block 16, one in the middle of block 18.
    let sectors = [
        (16 * BLOCK, 2 * SECTOR),
        (18 * BLOCK + 3 * SECTOR as u64, SECTOR),
    ];
    let table = vec![0x33u8; 2 * SECTOR];
    for &(at, len) in &sectors {
        let segment = WriteSegment {
            data: &table[..len],
            tag,
        };
        s.cache
            .write(&handle, HostOffset(at), &[segment])
            .expect("metadata write");
    }
    s.cache.flush(&handle, FlushKind::Durable).expect("flush");
    let report = s.cache.report().total;
    assert_eq!(
        report.backend_bytes_written, 0,
        "the sectors reached the image"
    );
    assert_eq!(report.dirty_bytes, 0, "the sectors took the block path");
    check_every_crash_state(&s, |pos| {
        let in_table = sectors
            .iter()
            .any(|&(at, len)| pos >= at && pos < at + len as u64);
        if in_table { 0x33 } else { 0 }
    });
}
