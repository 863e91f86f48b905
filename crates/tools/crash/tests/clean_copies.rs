//! Clean flash copies of data the backend has not synced yet: a journal
//! record of one must never become durable before the data it describes,
//! or a crash leaves flash serving bytes the backend lost (and serving
//! the backend's bytes once the copy is evicted). Write-through keeps
//! clean copies of what it writes, and a read miss promotes what a
//! partial-block write left on the backend; overwrites of cached blocks
//! commit the journal while both are pending. After every crash a
//! write-through cache must read exactly what its image holds.

use std::sync::Arc;
use vdcache_backend::BackendRef;
use vdcache_cache::{CacheConfig, DiskPolicy, FlashCache, WriteMode};
use vdcache_crash::{Log, RecordingFiles, StateKind, mem_files, open_raw_through};
use vdcache_image::{StoreOpener, VirtualDisk};

const BLOCK: u64 = 4096;
const IMAGE: &str = "disk.raw";
const IMAGE_BLOCKS: u64 = 64;
const DEVICE: &str = "cache.dev";
const DEVICE_BYTES: usize = 16 << 20;

fn config() -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        inline_background: true,
        // Batches reach flash between the commits, not only with them.
        journal_buffer_bytes: 512,
        default_policy: DiskPolicy {
            mode: WriteMode::WriteThrough,
            ..CacheConfig::default().default_policy
        },
        ..CacheConfig::default()
    }
}

fn open_disk(opener: Arc<dyn StoreOpener>, cache: &Arc<FlashCache>) -> VirtualDisk {
    open_raw_through(opener, cache, IMAGE).expect("open disk")
}

fn block(fill: u8) -> Vec<u8> {
    vec![fill; BLOCK as usize]
}

#[test]
fn a_write_through_cache_reads_what_its_image_holds_after_any_crash() {
    let log = Log::new();
    let files = RecordingFiles::new(&log);
    files.insert(IMAGE, vec![0u8; (IMAGE_BLOCKS * BLOCK) as usize]);
    let device: BackendRef = files.insert_fixed(DEVICE, DEVICE_BYTES);
    let cache = FlashCache::format(device, config()).expect("format");
    let disk = open_disk(files.clone(), &cache);
    // Blocks 0..8 cached, clean and synced.
    for b in 0..8 {
        disk.write(b * BLOCK, &block(0x10 + b as u8), false)
            .expect("write");
    }
    disk.flush().expect("flush");
    let start = log.len();
    // Unsynced from here on: new clean copies (blocks 20..24), a partial
    // write read back and promoted (block 40), and overwrites of cached
    // blocks, each committing the journal before its backend write.
    for b in 20..24 {
        disk.write(b * BLOCK, &block(0x20 + b as u8), false)
            .expect("write");
    }
    disk.write(40 * BLOCK + 512, &[0x40; 1024], false)
        .expect("partial write");
    let mut buf = block(0);
    disk.read(40 * BLOCK, &mut buf).expect("read back");
    for b in [2u64, 5, 21] {
        disk.write(b * BLOCK, &block(0x50 + b as u8), false)
            .expect("overwrite");
    }
    let end = log.len();
    let history = log.snapshot();
    for point in start..=end {
        for kind in [StateKind::None, StateKind::All, StateKind::Random(point)] {
            let state = history.state(point, kind);
            let what = format!("crash at {point} ({kind})");
            let image = state.device(IMAGE).expect("image state").data.clone();
            let dev: BackendRef = Arc::new(state.device(DEVICE).expect("device").to_mem_backend());
            let recovered = FlashCache::open(dev, config()).expect("recover");
            let disk = open_disk(mem_files(&state), &recovered);
            let mut got = vec![0u8; image.len()];
            disk.read(0, &mut got).expect("read");
            for (b, (cached, held)) in got
                .chunks(BLOCK as usize)
                .zip(image.chunks(BLOCK as usize))
                .enumerate()
            {
                assert!(
                    cached == held,
                    "{what}: block {b} reads {:#x} through the cache but the image holds {:#x}",
                    cached[0].max(cached[600]),
                    held[0].max(held[600])
                );
            }
        }
    }
}
