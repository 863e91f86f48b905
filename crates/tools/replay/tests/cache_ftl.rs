//! The cache device's own write stream is flash-friendly: under a random
//! 4 KiB write workload that cycles the cache many times over, a
//! page-mapped FTL model fed with every write and discard the cache issues
//! sees write amplification of at most 1.1, while the same guest writes
//! placed in place (a block's home fixed by its address) amplify far more.

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::path::Path;
use std::sync::Arc;
use vdcache_backend::{BackendRef, MemBackend};
use vdcache_cache::{CacheConfig, CowMode, DiskPolicy, FlashCache};
use vdcache_eval::ftl::{Ftl, FtlConfig};
use vdcache_image::{
    CreateOptions, DiskId, HostIo, ImageFormat, MemFiles, MetaCacheConfig, OpenOptions, open_chain,
    qcow2_image_bytes,
};
use vdcache_replay::FtlDevice;

const DISK: u64 = 512 << 20;
const CACHE: u64 = 64 << 20;
const REGION: u64 = 2 << 20;
const WRITES: u64 = 60_000;

fn ftl_config() -> FtlConfig {
    FtlConfig::new(CACHE, 4096, REGION, 0.07)
}

/// A fixed, seeded sequence of block numbers.
fn blocks(seed: u64, n: u64, range: u64) -> impl Iterator<Item = u64> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    (0..n).map(move |_| rng.random_range(0..range))
}

#[test]
fn log_structured_cache_keeps_flash_write_amplification_near_one() {
    let files = MemFiles::new();
    files.insert(
        "d/disk.qcow2",
        qcow2_image_bytes(Path::new("disk"), &CreateOptions::default(), DISK).expect("create"),
    );
    let mem: BackendRef = Arc::new(MemBackend::new("cache", vec![0; CACHE as usize]));
    let device = FtlDevice::new(mem, ftl_config()).expect("ftl");
    let config = CacheConfig {
        region_bytes: REGION,
        inline_background: true,
        host: Some("test-host".into()),
        default_policy: DiskPolicy::default(),
        ..CacheConfig::default()
    };
    let dev: BackendRef = device.clone();
    let cache = FlashCache::format(dev, config).expect("cache");
    let io: Arc<dyn HostIo> = cache.clone();
    let disk = open_chain(
        "d/disk.qcow2",
        &OpenOptions {
            opener: files.clone(),
            io: Some(io),
            disk: DiskId(1),
            format: Some(ImageFormat::Qcow2),
            cache: MetaCacheConfig::with_slice_bytes(CowMode::CowAware.meta_slice_bytes()),
            ..OpenOptions::default()
        },
    )
    .expect("open");
    let mut buf = vec![0u8; 4096];
    for (i, block) in blocks(0x9e37_79b9_7f4a_7c15, WRITES, DISK / 4096).enumerate() {
        buf.fill(i as u8);
        disk.write(block * 4096, &buf, false).expect("write");
        if i % 64 == 63 {
            disk.flush().expect("flush");
        }
    }
    disk.close().expect("close");
    drop(disk);
    let data_zone = cache.report().data_bytes;
    cache.shutdown(false).expect("shutdown");

    let stats = device.stats();
    let guest_bytes = WRITES * 4096;
    let host_bytes = stats.host_pages_written * 4096;
    // The cache must really have cycled its data zone several times over,
    // or the figure below says nothing.
    assert!(
        host_bytes > 4 * data_zone,
        "cache device saw only {host_bytes} bytes of writes for {guest_bytes} guest bytes"
    );
    let wa = stats.write_amplification.expect("writes seen");
    eprintln!("log-structured cache: {stats:?}");
    assert!(wa <= 1.1, "write amplification {wa} > 1.1: {stats:?}");

    // The same guest writes, each at a fixed home in the device.
    let mut in_place = Ftl::new(ftl_config()).expect("ftl");
    for block in blocks(0x9e37_79b9_7f4a_7c15, WRITES, DISK / 4096) {
        in_place
            .write(block * 4096 % CACHE, 4096)
            .expect("in-place write");
    }
    let in_place = in_place.stats();
    eprintln!("in-place cache: {in_place:?}");
    let in_place_wa = in_place.write_amplification.expect("writes seen");
    assert!(
        in_place_wa > 2.0 * wa,
        "in-place write amplification {in_place_wa} is not far above {wa}"
    );
}
