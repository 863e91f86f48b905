//! Index memory through the whole tier (issue 4: at most 0.25% of the
//! cached bytes), for the case that costs the most: random 4 KiB reads
//! promoting one or two blocks per 64 KiB piece of a raw image, and no
//! guest flush, so nothing but the tier itself moves region summaries out
//! of memory.

mod common;

use std::sync::Arc;
use vdcache_backend::MemBackend;
use vdcache_cache::CacheConfig;
use vdcache_image::{DiskId, HostIo, ImageFormat, MemFiles, OpenOptions, open_chain};

const IMAGE: u64 = 512 << 20;
const CACHE: u64 = 128 << 20;
const READS: u64 = 20_000;

#[test]
fn sparse_reads_keep_index_memory_under_a_quarter_percent() {
    let files = MemFiles::new();
    files.insert("d/disk.raw", vec![7u8; IMAGE as usize]);
    let device = Arc::new(MemBackend::new("cache", vec![0; CACHE as usize]));
    let config = CacheConfig {
        host: Some("test-host".into()),
        ..CacheConfig::default()
    };
    let cache = common::cache_on(&device, &config, true);
    let io: Arc<dyn HostIo> = cache.clone();
    let disk = open_chain(
        "d/disk.raw",
        &OpenOptions {
            opener: files.clone(),
            io: Some(io),
            disk: DiskId(1),
            format: Some(ImageFormat::Raw),
            ..OpenOptions::default()
        },
    )
    .expect("open");
    let mut buf = vec![0u8; 4096];
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..READS {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        let block = s.wrapping_mul(0x2545_f491_4f6c_dd1d) % (IMAGE / 4096);
        disk.read(block * 4096, &mut buf).expect("read");
        assert!(buf.iter().all(|&b| b == 7));
    }
    let r = cache.report();
    // Nearly every read was a miss that the cache promoted.
    assert!(
        r.cached_bytes >= READS * 4096 * 9 / 10,
        "{}",
        r.cached_bytes
    );
    assert!(
        r.index_memory_ratio <= 0.0025,
        "index memory {} bytes, {:.5} of {} cached",
        r.index_memory_bytes,
        r.index_memory_ratio,
        r.cached_bytes
    );
}
