//! With one-block regions, LRU replacement and every block admitted, the
//! real cache is an LRU cache of 4 KiB blocks: replay's read hit ratio must
//! equal, exactly, that of a textbook LRU written here over the same
//! generated traces.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use vdcache_cache::{Admission, DiskPolicy, Replacement, WriteMode};
use vdcache_eval::trace::{CONTENT_BLOCK, WriterOptions};
use vdcache_eval::workload::{WorkloadClass, WorkloadSpec, write_workload};
use vdcache_eval::{Format, Op, open_trace};
use vdcache_replay::{CacheSize, DiskLayout, ReplayOptions, RigConfig, replay_file};

/// A block: (trace disk, 4 KiB block number).
type Key = (u32, u64);

/// A textbook LRU: a map from block to its last-use stamp, and the stamps
/// in order. Using a block makes it most recent, inserting it first when
/// absent, evicting the least recent block when the cache is full. A read
/// looks all its blocks up when it arrives, then uses its hits, then its
/// misses; a write uses its blocks in address order.
struct Lru {
    capacity: usize,
    stamp_of: HashMap<(u32, u64), u64>,
    by_stamp: BTreeMap<u64, (u32, u64)>,
    clock: u64,
}

impl Lru {
    fn touch(&mut self, key: (u32, u64)) {
        if let Some(old) = self.stamp_of.remove(&key) {
            self.by_stamp.remove(&old);
        } else if self.stamp_of.len() == self.capacity
            && let Some((_, victim)) = self.by_stamp.pop_first()
        {
            self.stamp_of.remove(&victim);
        }
        self.clock += 1;
        self.stamp_of.insert(key, self.clock);
        self.by_stamp.insert(self.clock, key);
    }

    fn forget(&mut self, key: (u32, u64)) {
        if let Some(s) = self.stamp_of.remove(&key) {
            self.by_stamp.remove(&s);
        }
    }
}

/// Read hits and misses of a textbook LRU of `capacity` blocks.
fn textbook_lru(trace: &Path, capacity: usize) -> (u64, u64) {
    let mut lru = Lru {
        capacity,
        stamp_of: HashMap::new(),
        by_stamp: BTreeMap::new(),
        clock: 0,
    };
    let (mut hits, mut misses) = (0, 0);
    for rec in open_trace(trace, Some(Format::Msr)).expect("open") {
        let rec = rec.expect("record");
        let blocks: Vec<(u32, u64)> = rec.blocks(CONTENT_BLOCK).map(|b| (rec.disk, b)).collect();
        match rec.op {
            Op::Read => {
                let (hit, miss): (Vec<Key>, Vec<Key>) =
                    blocks.iter().partition(|&k| lru.stamp_of.contains_key(k));
                hits += hit.len() as u64;
                misses += miss.len() as u64;
                for k in hit.into_iter().chain(miss) {
                    lru.touch(k);
                }
            }
            Op::Write => {
                for k in blocks {
                    lru.touch(k);
                }
            }
            Op::Discard => {
                // Only blocks wholly inside the range are dropped.
                for &(d, b) in &blocks {
                    if b * CONTENT_BLOCK >= rec.offset && (b + 1) * CONTENT_BLOCK <= rec.end() {
                        lru.forget((d, b));
                    }
                }
            }
            Op::Flush => {}
        }
    }
    (hits, misses)
}

fn check(class: WorkloadClass, requests: u64, working_set: u64, cache: u64, seed: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("trace.csv");
    let mut spec = WorkloadSpec::new(class);
    spec.requests = requests;
    spec.working_set_bytes = working_set;
    spec.seed = seed;
    if class == WorkloadClass::BootStorm {
        spec.disks = 3;
    }
    if class == WorkloadClass::Oltp {
        spec.zipf_theta = 0.6;
    }
    let out = BufWriter::new(File::create(&trace).expect("create"));
    write_workload(&spec, Format::Msr, &WriterOptions::default(), out).expect("generate");

    let opts = ReplayOptions {
        rig: RigConfig {
            layout: DiskLayout::Raw,
            region_bytes: 4096,
            replacement: Replacement::Lru,
            policy: DiskPolicy {
                mode: WriteMode::WriteBack,
                admission: Admission::All,
                // Every write enters flash, as in the model.
                sequential_write_cutoff: 0,
                ..DiskPolicy::default()
            },
            ..RigConfig::default()
        },
        cache_size: CacheSize::Bytes(cache),
        snapshot_every_ns: None,
    };
    let report = replay_file(&trace, Some(Format::Msr), &opts, &mut |_| {}).expect("replay");
    let capacity = report.cache_capacity_blocks as usize;
    // The cache holds what was asked for, give or take the smallest
    // device's data zone and the free-region reserve.
    assert!(
        capacity as u64 * CONTENT_BLOCK >= cache - 2 * CONTENT_BLOCK,
        "capacity {capacity} blocks for a {cache}-byte cache"
    );
    let (hits, misses) = textbook_lru(&trace, capacity);
    eprintln!(
        "{class:?}: capacity {capacity} blocks, replay {}/{} hit, LRU {hits}/{} hit",
        report.read_hit_blocks,
        report.read_hit_blocks + report.read_miss_blocks,
        hits + misses
    );
    // Both evict: otherwise equality says nothing about replacement.
    assert!(
        misses > capacity as u64 && hits > 0,
        "the trace does not exercise replacement: {hits} hits, {misses} misses"
    );
    assert_eq!(
        (report.read_hit_blocks, report.read_miss_blocks),
        (hits, misses),
        "replay and textbook LRU disagree"
    );
    let lru_ratio = hits as f64 / (hits + misses) as f64;
    assert_eq!(report.read_hit_ratio, lru_ratio);
}

#[test]
fn oltp_hit_ratio_equals_textbook_lru() {
    check(WorkloadClass::Oltp, 30_000, 48 << 20, 24 << 20, 7);
}

#[test]
fn boot_storm_of_three_disks_hit_ratio_equals_textbook_lru() {
    check(WorkloadClass::BootStorm, 20_000, 32 << 20, 20 << 20, 11);
}

#[test]
fn file_server_with_discards_hit_ratio_equals_textbook_lru() {
    check(WorkloadClass::FileServer, 20_000, 64 << 20, 24 << 20, 5);
}
