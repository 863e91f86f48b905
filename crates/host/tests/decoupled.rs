//! Decoupled copy-on-write by the sector (issue 5, COWCache 3.3): writes
//! into fresh delta clusters over a full base, in cow-aware write-back,
//! read nothing from the base even when they start or end inside a 4 KiB
//! block; the blocks they cover in part keep the sectors written as valid
//! and read the rest from the base, through a crash and fast recovery;
//! filling copies exactly the bytes the guest never wrote, and the image
//! left behind is standalone and checks clean.

use crate::common;
use std::collections::BTreeSet;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use vdcache_backend::inject::HookedBackend;
use vdcache_backend::{BackendRef, LockMode, MemBackend};
use vdcache_cache::{CacheConfig, CowMode, DiskPolicy, FlashCache, WriteMode};
use vdcache_image::{
    CreateOptions, DiskId, HostIo, ImageFormat, MemFiles, MetaCacheConfig, OpenOptions,
    StoreOpener, VirtualDisk, open_chain, qcow2_image_bytes,
};

const SIZE: u64 = 16 << 20;
const CLUSTER: u64 = 64 << 10;
const SECTOR: u64 = 512;

/// The base image: each sector a different byte.
fn base_content() -> Vec<u8> {
    (0..SIZE).map(|i| (i / SECTOR % 251) as u8).collect()
}

struct Rig {
    files: Arc<MemFiles>,
    device: Arc<MemBackend>,
    config: CacheConfig,
}

impl Rig {
    fn new() -> Rig {
        let files = MemFiles::new();
        files.insert("d/base.raw", base_content());
        let opts = CreateOptions {
            backing: Some(("base.raw".into(), ImageFormat::Raw)),
            ..CreateOptions::default()
        };
        for top in ["d/top.qcow2", "d/top2.qcow2"] {
            files.insert(
                top,
                qcow2_image_bytes(Path::new("top"), &opts, SIZE).expect("create"),
            );
        }
        Rig {
            files,
            device: Arc::new(MemBackend::new("cache", vec![0; 32 << 20])),
            config: CacheConfig {
                region_bytes: 1 << 20,
                default_policy: DiskPolicy {
                    cow: CowMode::CowAware,
                    mode: WriteMode::WriteBack,
                    ..DiskPolicy::default()
                },
                host: Some("test-host".into()),
                ..CacheConfig::default()
            },
        }
    }

    fn cache(&self, fresh: bool) -> Arc<FlashCache> {
        common::cache_on(&self.device, &self.config, fresh)
    }

    fn disk(&self, io: Option<Arc<dyn HostIo>>) -> VirtualDisk {
        self.disk_of("d/top.qcow2", DiskId(1), io)
    }

    fn disk_of(&self, top: &str, disk: DiskId, io: Option<Arc<dyn HostIo>>) -> VirtualDisk {
        open_chain(
            top,
            &OpenOptions {
                opener: self.files.clone(),
                io,
                disk,
                format: Some(ImageFormat::Qcow2),
                cache: MetaCacheConfig {
                    slice_bytes: Some(512),
                    ..MetaCacheConfig::default()
                },
                ..OpenOptions::default()
            },
        )
        .expect("open")
    }
}

/// (offset, length) of the writes: unaligned 4 KiB writes starting a few
/// sectors into a block, writes of a few sectors inside one block, one that
/// completes a block an earlier write began, and one not sector aligned.
fn writes() -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for i in 0..40u64 {
        let cluster = (i * 7) % (SIZE / CLUSTER);
        let block = i % 15;
        out.push((
            cluster * CLUSTER + block * 4096 + SECTOR * (1 + i % 7),
            4096,
        ));
    }
    for i in 0..20u64 {
        let cluster = 100 + i;
        out.push((cluster * CLUSTER + 4096 * (i % 16) + 1024, 3 * SECTOR));
    }
    // The rest of the first block of cluster 100.
    out.push((100 * CLUSTER, 1024));
    out.push((100 * CLUSTER + 2560, 4096 - 2560));
    out
}

/// Bytes the writes left for filling: every byte of a touched cluster
/// outside the sectors the guest wrote whole.
fn unwritten_bytes(writes: &[(u64, u64)], unaligned: (u64, u64)) -> u64 {
    let mut sectors = BTreeSet::new();
    let mut clusters = BTreeSet::new();
    let first = (200 * CLUSTER, 4096);
    for &(off, len) in writes.iter().chain([&unaligned, &first]) {
        for s in off / SECTOR..(off + len).div_ceil(SECTOR) {
            sectors.insert(s);
        }
        for c in off / CLUSTER..(off + len).div_ceil(CLUSTER) {
            clusters.insert(c);
        }
    }
    clusters.len() as u64 * CLUSTER - sectors.len() as u64 * SECTOR
}

/// The delta read without the cache holds `model` and checks clean.
fn assert_standalone(rig: &Rig, model: &[u8]) {
    let alone = rig.disk(None);
    assert!(read_all(&alone) == model, "the image alone");
    let vdcache_image::Layer::Qcow2(top) = &alone.layers()[0] else {
        panic!("the delta is qcow2");
    };
    let check = top.check().expect("check");
    assert!(check.is_clean(), "check: {check:?}");
}

fn read_all(disk: &VirtualDisk) -> Vec<u8> {
    let mut got = vec![0u8; SIZE as usize];
    disk.read(0, &mut got).expect("read");
    got
}

#[test]
fn unaligned_writes_into_fresh_clusters_read_nothing_from_the_base() {
    let rig = Rig::new();
    let cache = rig.cache(true);
    let disk = rig.disk(Some(cache.clone()));
    let mut model = base_content();
    let writes = writes();
    // An aligned write first, so the metadata the delta reads once (its
    // first refcount block) is not counted below.
    disk.write(200 * CLUSTER, &[0x11; 4096], false)
        .expect("write");
    model[(200 * CLUSTER) as usize..(200 * CLUSTER + 4096) as usize].fill(0x11);
    let read_before = cache.report().total.backend_bytes_read;
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data = vec![0xa0 + i as u8; len as usize];
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
        disk.write(off, &data, false).expect("write");
    }
    assert_eq!(
        cache.report().total.backend_bytes_read - read_before,
        0,
        "sector-aligned writes into fresh clusters read the base"
    );
    // A write not aligned to sectors reads the base for its edge sectors
    // only (here one sector at each end).
    let unaligned = (150 * CLUSTER + 4096 + 100, 4000);
    let data = vec![0x5a; unaligned.1 as usize];
    model[unaligned.0 as usize..(unaligned.0 + unaligned.1) as usize].copy_from_slice(&data);
    let read_before = cache.report().total.backend_bytes_read;
    disk.write(unaligned.0, &data, false).expect("write");
    let read = cache.report().total.backend_bytes_read - read_before;
    assert!(
        read > 0 && read <= 2 * 4096,
        "an unaligned write read {read} bytes"
    );
    disk.flush().expect("flush");
    assert!(read_all(&disk) == model, "reads before the crash");

    // A crash after the flush: the valid sectors come back with the cache.
    drop(disk);
    drop(cache);
    let cache = rig.cache(false);
    let disk = rig.disk(Some(cache.clone()));
    assert!(read_all(&disk) == model, "reads after fast recovery");

    // Filling copies exactly what the guest never wrote.
    let report = disk.fill_partial(usize::MAX).expect("fill");
    assert_eq!(report.remaining, 0);
    assert_eq!(report.filled_bytes, unwritten_bytes(&writes, unaligned));
    assert!(cache.partial_images().is_empty());
    assert!(read_all(&disk) == model, "reads after filling");
    disk.close().expect("close");
    drop(disk);
    cache.shutdown(false).expect("write back");

    assert_standalone(&rig, &model);
}

fn base_cached(cache: &FlashCache) -> u64 {
    cache
        .report()
        .images
        .iter()
        .filter(|i| i.name.ends_with("base.raw"))
        .map(|i| i.cached_bytes)
        .sum()
}

#[test]
fn a_write_masking_base_blocks_the_guest_read_drops_them() {
    let rig = Rig::new();
    let cache = rig.cache(true);
    let disk = rig.disk(Some(cache.clone()));
    let mut buf = vec![0u8; CLUSTER as usize];
    disk.read(5 * CLUSTER, &mut buf).expect("read");
    let cached = base_cached(&cache);
    assert_eq!(cached, CLUSTER, "the base cluster read is cached");

    // 8 KiB of the guest's own, plus a sector into the next block: two
    // whole base blocks are masked, the third still serves its other
    // sectors.
    disk.write(5 * CLUSTER + 4096, &[7; 8192 + 512], false)
        .expect("write");
    assert_eq!(cache.report().total.masked_blocks_dropped, 2);
    assert_eq!(base_cached(&cache), cached - 8192);
    let mut want = base_content()[(5 * CLUSTER) as usize..(6 * CLUSTER) as usize].to_vec();
    want[4096..4096 + 8192 + 512].fill(7);
    disk.read(5 * CLUSTER, &mut buf).expect("read");
    assert!(buf == want, "the cluster reads back");

    // A base two disks read is left alone: what one masks, the other reads.
    let io: Arc<dyn HostIo> = cache.clone();
    let other = rig.disk_of("d/top2.qcow2", DiskId(2), Some(io));
    other.read(9 * CLUSTER, &mut buf).expect("read");
    disk.read(9 * CLUSTER, &mut buf).expect("read");
    disk.write(9 * CLUSTER, &[8; 4096], false).expect("write");
    assert_eq!(cache.report().total.masked_blocks_dropped, 2);
    other.read(9 * CLUSTER, &mut buf).expect("read");
    assert!(
        buf[..] == base_content()[(9 * CLUSTER) as usize..(10 * CLUSTER) as usize],
        "the other disk still reads the base"
    );
}

/// Issue 25: with the disk's backing chain offered to it, write-back fills
/// partially valid clusters itself as it writes them back: exactly the
/// bytes the guest never wrote come from the base, none of them through
/// flash, and nothing is left for the COW layer to fill.
#[test]
fn write_back_fills_partial_clusters_without_flash() {
    let rig = Rig::new();
    let cache = rig.cache(true);
    let disk = Arc::new(rig.disk(Some(cache.clone())));
    disk.offer_backing_fill();
    let mut model = base_content();
    let writes = writes();
    let unaligned = (150 * CLUSTER + 4096 + 100, 4000);
    let first = [(200 * CLUSTER, 4096)];
    for (i, &(off, len)) in first.iter().chain(&writes).chain([&unaligned]).enumerate() {
        let data = vec![0xa0 + i as u8; len as usize];
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
        disk.write(off, &data, false).expect("write");
    }
    disk.flush().expect("flush");
    assert!(!cache.partial_images().is_empty());
    let before = cache.report();

    cache.drain().expect("drain");
    let after = cache.report();
    assert!(
        cache.partial_images().is_empty(),
        "write-back left partially valid clusters"
    );
    assert_eq!(
        after.total.writeback_filled_bytes - before.total.writeback_filled_bytes,
        unwritten_bytes(&writes, unaligned),
        "filled other bytes than those the guest never wrote"
    );
    assert_eq!(
        after.device.data_bytes_written, before.device.data_bytes_written,
        "the filler went through flash"
    );
    assert!(read_all(&disk) == model, "reads after write-back");
    assert_eq!(disk.fill_partial(usize::MAX).expect("fill").filled_bytes, 0);

    disk.close().expect("close");
    drop(disk);
    cache.shutdown(false).expect("shutdown");
    assert_standalone(&rig, &model);
}

/// A delta with clusters smaller than the cache's 64 KiB line: two fresh
/// clusters of one line serve different guest clusters, and filling them
/// must copy each one's own backing bytes.
#[test]
fn small_clusters_sharing_a_line_fill_from_their_own_guest_clusters() {
    let files = MemFiles::new();
    files.insert("d/base.raw", base_content());
    let opts = CreateOptions {
        backing: Some(("base.raw".into(), ImageFormat::Raw)),
        cluster_size: 32 << 10,
        ..CreateOptions::default()
    };
    files.insert(
        "d/top.qcow2",
        qcow2_image_bytes(Path::new("top"), &opts, SIZE).expect("create"),
    );
    let rig = Rig {
        files,
        ..Rig::new()
    };
    let cache = rig.cache(true);
    let disk = rig.disk(Some(cache.clone()));
    let mut model = base_content();
    // Guest clusters 3 and 40 get host clusters next to each other.
    for (at, byte) in [(3 * (32 << 10) + 4096, 0x61u8), (40 * (32 << 10), 0x62)] {
        disk.write(at, &[byte; 4096], false).expect("write");
        model[at as usize..at as usize + 4096].fill(byte);
    }
    assert!(read_all(&disk) == model, "reads before filling");
    disk.fill_partial(usize::MAX).expect("fill");
    assert!(read_all(&disk) == model, "reads after filling");
    disk.close().expect("close");
    drop(disk);
    cache.shutdown(false).expect("shutdown");
    assert_standalone(&rig, &model);
}

/// Image files that count the bytes read from those named `counted`.
#[derive(Debug)]
struct CountedFiles {
    files: Arc<MemFiles>,
    counted: &'static str,
    read: Arc<AtomicU64>,
}

impl StoreOpener for CountedFiles {
    fn open(
        &self,
        name: &str,
        writable: bool,
        lock: Option<LockMode>,
    ) -> vdcache_image::Result<BackendRef> {
        let inner = self.files.open(name, writable, lock)?;
        if !name.ends_with(self.counted) {
            return Ok(inner);
        }
        let read = self.read.clone();
        Ok(Arc::new(HookedBackend::new(inner).on_read(move |len| {
            read.fetch_add(len as u64, Ordering::Relaxed);
            Ok(())
        })))
    }

    fn canonical(&self, name: &str) -> vdcache_image::Result<String> {
        self.files.canonical(name)
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        self.files.resolve(parent, backing)
    }
}

/// Issue 25: finding the base blocks a write masks takes the base's mapping
/// tables. Hints use only the tables at hand, so writes into fresh delta
/// clusters read nothing of a qcow2 base, not even its L2 tables; a base
/// cluster the guest read (its table loaded then) is still dropped when
/// masked.
#[test]
fn masked_hints_read_no_base_tables() {
    let rig = Rig::new();
    let base_opts = CreateOptions {
        size: Some(SIZE),
        ..CreateOptions::default()
    };
    rig.files.insert(
        "d/qbase.qcow2",
        qcow2_image_bytes(Path::new("qbase"), &base_opts, SIZE).expect("create base"),
    );
    let base = open_chain(
        "d/qbase.qcow2",
        &OpenOptions {
            opener: rig.files.clone(),
            format: Some(ImageFormat::Qcow2),
            ..OpenOptions::default()
        },
    )
    .expect("open base");
    base.write(0, &base_content(), false).expect("fill base");
    base.close().expect("close base");
    drop(base);
    let top_opts = CreateOptions {
        backing: Some(("qbase.qcow2".into(), ImageFormat::Qcow2)),
        ..CreateOptions::default()
    };
    rig.files.insert(
        "d/qtop.qcow2",
        qcow2_image_bytes(Path::new("qtop"), &top_opts, SIZE).expect("create top"),
    );
    let cache = rig.cache(true);
    let base_read = Arc::new(AtomicU64::new(0));
    let disk = open_chain(
        "d/qtop.qcow2",
        &OpenOptions {
            opener: Arc::new(CountedFiles {
                files: rig.files.clone(),
                counted: "qbase.qcow2",
                read: base_read.clone(),
            }),
            io: Some(cache.clone()),
            disk: DiskId(1),
            format: Some(ImageFormat::Qcow2),
            cache: MetaCacheConfig {
                slice_bytes: Some(512),
                ..MetaCacheConfig::default()
            },
            ..OpenOptions::default()
        },
    )
    .expect("open");
    let opened = base_read.load(Ordering::Relaxed);
    for i in 0..32u64 {
        disk.write(i * 7 * CLUSTER, &[2; 4096], false)
            .expect("write");
    }
    assert_eq!(
        base_read.load(Ordering::Relaxed),
        opened,
        "writes into fresh clusters read the base's tables"
    );

    let mut buf = vec![0u8; CLUSTER as usize];
    disk.read(3 * CLUSTER, &mut buf).expect("read");
    assert!(buf[..] == base_content()[(3 * CLUSTER) as usize..(4 * CLUSTER) as usize]);
    disk.write(3 * CLUSTER, &[3; 4096], false).expect("write");
    assert_eq!(cache.report().total.masked_blocks_dropped, 1);
}
