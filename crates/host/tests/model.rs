//! The cache tier under the real COW engine, compared with a byte-array
//! model: every mode, policies that force evictions, and restarts that
//! recover the cache from its device (fast recovery) or write everything
//! back first (full recovery).

use crate::common;

use proptest::prelude::*;
use std::path::Path;
use std::sync::Arc;
use vdcache_backend::{Backend, MemBackend};
use vdcache_cache::{
    Admission, CacheConfig, CowMode, DiskPolicy, FlashCache, Replacement, WriteMode,
};
use vdcache_image::{
    CreateOptions, DiskId, HostIo, ImageFormat, MemFiles, MetaCacheConfig, OpenOptions,
    VirtualDisk, open_chain, qcow2_image_bytes,
};

const SIZE: u64 = 24 << 20;
const CACHE: u64 = 20 << 20;

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: u64,
        len: u64,
        byte: u8,
    },
    Read {
        off: u64,
        len: u64,
    },
    Flush,
    /// Drop everything without a clean stop, then recover the cache.
    Crash,
    /// Clean stop (write back unless keep_dirty) and reopen.
    Restart {
        keep_dirty: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let range = (0..SIZE / 4096, 1..96u64).prop_map(|(b, n)| {
        let off = b * 4096 + (b % 3) * 512;
        (off, (n * 4096 - (n % 2) * 1000).min(SIZE - off))
    });
    prop_oneof![
        6 => (range.clone(), any::<u8>()).prop_map(|((off, len), byte)| Op::Write { off, len, byte }),
        4 => range.prop_map(|(off, len)| Op::Read { off, len }),
        1 => Just(Op::Flush),
        1 => Just(Op::Crash),
        1 => any::<bool>().prop_map(|keep_dirty| Op::Restart { keep_dirty }),
    ]
}

struct Rig {
    files: Arc<MemFiles>,
    device: Arc<MemBackend>,
    config: CacheConfig,
    policy: DiskPolicy,
}

impl Rig {
    fn new(policy: DiskPolicy, replacement: Replacement) -> Rig {
        let files = MemFiles::new();
        let base: Vec<u8> = (0..SIZE).map(|i| (i / 4096 % 251) as u8).collect();
        files.insert("d/base.raw", base);
        let opts = CreateOptions {
            backing: Some(("base.raw".into(), ImageFormat::Raw)),
            ..CreateOptions::default()
        };
        files.insert(
            "d/top.qcow2",
            qcow2_image_bytes(Path::new("top"), &opts, SIZE).expect("create"),
        );
        let config = CacheConfig {
            region_bytes: 1 << 20,
            replacement,
            default_policy: policy,
            host: Some("test-host".into()),
            ..CacheConfig::default()
        };
        Rig {
            files,
            device: Arc::new(MemBackend::new("cache", vec![0; CACHE as usize])),
            config,
            policy,
        }
    }

    fn cache(&self, fresh: bool) -> Arc<FlashCache> {
        let c = common::cache_on(&self.device, &self.config, fresh);
        c.set_policy(DiskId(1), self.policy);
        c
    }

    fn disk(&self, cache: &Arc<FlashCache>) -> VirtualDisk {
        let io: Arc<dyn HostIo> = cache.clone();
        open_chain(
            "d/top.qcow2",
            &OpenOptions {
                opener: self.files.clone(),
                io: Some(io),
                disk: DiskId(1),
                format: Some(ImageFormat::Qcow2),
                cache: self.meta_cache(),
                ..OpenOptions::default()
            },
        )
        .expect("open")
    }

    /// As serve does: cow-aware caches get sector-sized metadata slices
    /// (here few, so dirty sectors are evicted into the cache often).
    fn meta_cache(&self) -> MetaCacheConfig {
        match self.policy.cow {
            CowMode::Stacked => MetaCacheConfig::default(),
            CowMode::CowAware => MetaCacheConfig {
                l2_bytes: 8 << 10,
                refcount_bytes: 4 << 10,
                slice_bytes: Some(512),
            },
        }
    }
}

fn run(policy: DiskPolicy, replacement: Replacement, ops: &[Op]) -> Result<(), TestCaseError> {
    let rig = Rig::new(policy, replacement);
    let mut model: Vec<u8> = (0..SIZE).map(|i| (i / 4096 % 251) as u8).collect();
    let mut flushed = model.clone();
    // Writes since the last flush: after a crash a byte may hold any of them.
    let mut since_flush: Vec<(u64, u64, u8)> = Vec::new();
    let mut cache = rig.cache(true);
    let mut disk = rig.disk(&cache);
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Write { off, len, byte } => {
                disk.write(off, &vec![byte; len as usize], false)
                    .expect("write");
                model[off as usize..(off + len) as usize].fill(byte);
                since_flush.push((off, len, byte));
            }
            Op::Read { off, len } => {
                let mut buf = vec![0u8; len as usize];
                disk.read(off, &mut buf).expect("read");
                prop_assert!(
                    buf == model[off as usize..(off + len) as usize],
                    "op {i}: read {off}+{len} differs"
                );
            }
            Op::Flush => {
                disk.flush().expect("flush");
                flushed.clone_from(&model);
                since_flush.clear();
            }
            Op::Crash => {
                drop(disk);
                drop(cache);
                cache = rig.cache(false);
                disk = rig.disk(&cache);
                // After a crash only flushed data is promised; writes since
                // may or may not have survived. Continue from what is there.
                let mut now = vec![0u8; SIZE as usize];
                disk.read(0, &mut now).expect("read after crash");
                for (k, (&n, &f)) in now.iter().zip(flushed.iter()).enumerate() {
                    let k = k as u64;
                    let written = since_flush
                        .iter()
                        .any(|&(o, l, b)| (o..o + l).contains(&k) && b == n);
                    prop_assert!(
                        n == f || written,
                        "op {i}: byte {k} after crash is {n}: neither flushed {f} nor written since"
                    );
                }
                model = now;
                flushed.clone_from(&model);
                since_flush.clear();
            }
            Op::Restart { keep_dirty } => {
                if !keep_dirty {
                    disk.fill_partial(usize::MAX).expect("fill");
                }
                disk.close().expect("close");
                drop(disk);
                cache.shutdown(keep_dirty).expect("shutdown");
                drop(cache);
                cache = rig.cache(false);
                disk = rig.disk(&cache);
                flushed.clone_from(&model);
                since_flush.clear();
            }
        }
    }
    let filled = disk.fill_partial(usize::MAX).expect("fill");
    prop_assert_eq!(filled.remaining, 0);
    disk.close().expect("close");
    drop(disk);
    cache.shutdown(false).expect("shutdown");
    prop_assert_eq!(cache.report().dirty_bytes, 0);
    drop(cache);
    // The images alone (no cache) now hold everything.
    let plain = open_chain(
        "d/top.qcow2",
        &OpenOptions {
            opener: rig.files.clone(),
            format: Some(ImageFormat::Qcow2),
            ..OpenOptions::default()
        },
    )
    .expect("open without cache");
    let mut all = vec![0u8; SIZE as usize];
    plain.read(0, &mut all).expect("read");
    let first = all.iter().zip(&model).position(|(a, b)| a != b);
    prop_assert!(
        first.is_none(),
        "images without the cache differ from the model at byte {first:?}"
    );
    Ok(())
}

fn policy() -> impl Strategy<Value = DiskPolicy> {
    (
        prop::sample::select(vec![
            WriteMode::WriteBack,
            WriteMode::WriteThrough,
            WriteMode::WriteAround,
        ]),
        prop::sample::select(vec![
            Admission::All,
            Admission::Hot,
            Admission::SequentialBypass,
        ]),
        prop::sample::select(vec![CowMode::Stacked, CowMode::CowAware]),
        prop::sample::select(vec![0, 256 << 10]),
    )
        .prop_map(|(mode, admission, cow, cutoff)| DiskPolicy {
            mode,
            admission,
            sequential_threshold: 256 << 10,
            sequential_write_cutoff: cutoff,
            cow,
            cache_only: false,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn cache_matches_model(
        p in policy(),
        r in prop::sample::select(vec![Replacement::Lru, Replacement::Clock, Replacement::Arc]),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(p, r, &ops)?;
    }
}

#[test]
fn writeback_flush_costs_one_cache_sync_and_no_backend_sync() {
    let rig = Rig::new(DiskPolicy::default(), Replacement::Lru);
    let cache = rig.cache(true);
    let disk = rig.disk(&cache);
    disk.write(0, &[1u8; 65536], false).expect("write");
    disk.flush().expect("flush");
    let before = cache.report().total;
    for i in 0..10u64 {
        disk.write(i * 4096, &[i as u8; 4096], false)
            .expect("write");
        disk.flush().expect("flush");
    }
    let after = cache.report().total;
    assert_eq!(
        after.backend_syncs - before.backend_syncs,
        0,
        "writeback flushes must not sync the backend"
    );
    assert_eq!(after.guest_flushes - before.guest_flushes, 10);
    assert_eq!(after.backend_bytes_written, before.backend_bytes_written);
    let _ = rig.device.len();
}

/// Regression: journal batches left from before a recovery must never be
/// replayed after the next crash (they carry the old checkpoint's epoch).
#[test]
fn writethrough_crash_after_recovery_keeps_flushed_metadata() {
    let p = DiskPolicy {
        mode: WriteMode::WriteThrough,
        admission: Admission::Hot,
        sequential_threshold: 262144,
        sequential_write_cutoff: 0,
        cow: CowMode::Stacked,
        cache_only: false,
    };
    let ops = vec![
        Op::Write {
            off: 0,
            len: 199704,
            byte: 0,
        },
        Op::Restart { keep_dirty: false },
        Op::Write {
            off: 16138752,
            len: 49152,
            byte: 0,
        },
        Op::Write {
            off: 15819264,
            len: 303104,
            byte: 0,
        },
        Op::Flush,
        Op::Crash,
        Op::Write {
            off: 262656,
            len: 3096,
            byte: 0,
        },
        Op::Flush,
        Op::Read {
            off: 262656,
            len: 3096,
        },
        Op::Crash,
    ];
    run(p, Replacement::Lru, &ops).unwrap();
}

/// Writes the whole disk in 64 KiB pieces of `seed`'s pattern (far more
/// than the cache holds, so regions are reclaimed), then reads it back.
fn overwrite_all_and_verify(disk: &VirtualDisk, seed: u8) {
    let piece = |i: u64| vec![seed.wrapping_add(i as u8); 65536];
    for i in 0..SIZE / 65536 {
        disk.write(i * 65536, &piece(i), false).expect("write");
        if i % 32 == 31 {
            disk.flush().expect("flush");
        }
    }
    let mut buf = vec![0u8; 65536];
    for i in 0..SIZE / 65536 {
        disk.read(i * 65536, &mut buf).expect("read");
        assert!(buf == piece(i), "piece {i} of pass {seed} reads back wrong");
    }
}

/// Regions are emptied through their summaries (no per-block reverse map);
/// summaries torn on flash are detected and the index is scanned instead,
/// with no data lost.
#[test]
fn evictions_use_region_summaries_and_survive_torn_ones() {
    let rig = Rig::new(DiskPolicy::default(), Replacement::Lru);
    let cache = rig.cache(true);
    let disk = rig.disk(&cache);
    overwrite_all_and_verify(&disk, 1);
    let r = cache.report();
    assert!(r.regions_emptied_by_summary > 0, "{r:?}");
    assert_eq!(r.regions_emptied_by_scan, 0);

    let layout = *cache.layout();
    for region in 0..layout.regions {
        rig.device
            .write_at(&[0x5a; 4096], layout.summary_offset(region))
            .expect("tear summary");
    }
    overwrite_all_and_verify(&disk, 2);
    let r = cache.report();
    assert!(
        r.regions_emptied_by_scan > 0,
        "torn summaries must be noticed: {r:?}"
    );
}
