//! The cow-aware cache under the crash harness (issue 5): decoupled
//! copy-on-write (new clusters left partially valid, reads routed to the
//! backing file, fills later) and metadata kept and journaled by the
//! 512-byte sector, in write-back with evictions, restarts and metadata
//! write-back forced by a small store, with a journal buffer small enough
//! to be written between flushes; and write-through, where filler is never
//! admitted. After every crash, full recovery must leave no partially
//! valid cluster and images that check clean and read what fast recovery
//! read.

use vdcache_cache::{Admission, CacheConfig, CowMode, DiskPolicy, Replacement, WriteMode};
use vdcache_crash::harness::{sweep_clean, test_budget as budget};
use vdcache_crash::{Backing, CacheTarget, Qcow2Target, RunConfig, WorkloadConfig};
use vdcache_image::{CreateOptions, MetaCacheConfig};

const MIB: u64 = 1 << 20;
/// The smallest cache device: regions are reclaimed during the run, and
/// its metadata store (512 sectors) fills and is written back.
const DEVICE: usize = 16 << 20;

fn cache_config(mode: WriteMode) -> CacheConfig {
    CacheConfig {
        region_bytes: 256 << 10,
        replacement: Replacement::Lru,
        default_policy: DiskPolicy {
            mode,
            admission: Admission::All,
            sequential_threshold: 1 << 20,
            sequential_write_cutoff: 1 << 20,
            cow: CowMode::CowAware,
            cache_only: false,
        },
        high_watermark: 1.0,
        low_watermark: 1.0,
        host: Some("crash-host".into()),
        inline_background: true,
        // Checkpoints start every few flushes and land a commit later,
        // so crashes find the journal running ahead of one.
        checkpoint_interval_bytes: Some(4 << 10),
        ..CacheConfig::default()
    }
}

/// Sector-sized metadata slices, few of them: every workload evicts dirty
/// L2 and refcount sectors into the cache.
fn sector_slices() -> MetaCacheConfig {
    MetaCacheConfig {
        l2_bytes: 8 << 10,
        refcount_bytes: 4 << 10,
        slice_bytes: Some(512),
    }
}

fn target(label: &str, config: CacheConfig) -> CacheTarget {
    let images = Qcow2Target::new(label, 12 * MIB, CreateOptions::default())
        .with_backing(Backing::Raw)
        .with_cache(sector_slices());
    CacheTarget::new(images, config, DEVICE)
}

fn run_config(seed: u64) -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed,
            ops: 160,
            max_len: Some(256 << 10),
            hot_percent: 40,
            ..WorkloadConfig::default()
        },
        // The real qemu-img checks the images full recovery leaves.
        qemu_img_check: vdcache_crash::harness::qemu_img_available(),
        qemu_img_every: 10,
        ..RunConfig::default()
    }
}

/// Sweeps and asserts zero violations; returns the number of states.
fn clean(t: &CacheTarget, seed: u64, states: usize) -> usize {
    sweep_clean(t, &run_config(seed), states)
}

#[test]
fn decoupled_cow_and_sector_metadata_in_writeback() {
    let t = target("cow-wb", cache_config(WriteMode::WriteBack));
    let n = clean(&t, 0xc0a1, 450);
    assert!(n >= budget(450) / 2, "only {n} distinct states");
}

#[test]
fn journal_buffer_written_between_flushes() {
    let mut c = cache_config(WriteMode::WriteBack);
    c.journal_buffer_bytes = 4 << 10;
    c.high_watermark = 0.1;
    c.low_watermark = 0.05;
    let t = target("cow-wb-journal", c);
    let n = clean(&t, 0xc0a2, 400);
    assert!(n >= budget(400) / 2, "only {n} distinct states");
}

#[test]
fn writethrough_never_admits_filler() {
    let t = target("cow-wt", cache_config(WriteMode::WriteThrough));
    let n = clean(&t, 0xc0a3, 300);
    assert!(n >= budget(300) / 2, "only {n} distinct states");
}
