//! The flash cache under the crash harness (issue 4): write-back,
//! write-through, write-around and a mixed configuration with background
//! write-back, all on a cache small enough that regions are reclaimed
//! during the workload, with guest reopens that also restart the cache.
//! Every crash state's fast recovery must read what full recovery leaves
//! in the images, and both must satisfy the invariants. A cache that
//! persists index records before their data must be caught.

use vdcache_cache::{Admission, CacheConfig, CowMode, DiskPolicy, Replacement, WriteMode};
use vdcache_crash::harness::{sweep, sweep_clean, test_budget as budget};
use vdcache_crash::{
    Backing, CacheTarget, FullDevice, Qcow2Target, RunConfig, WorkloadConfig, sweep_damage,
};
use vdcache_image::CreateOptions;

const MIB: u64 = 1 << 20;
/// The smallest cache device: about 9 MiB of data zone (36 regions of
/// 256 KiB) for a 12 MiB disk, so regions are reclaimed during the run.
const DEVICE: usize = 16 << 20;

fn cache_config(mode: WriteMode, admission: Admission, replacement: Replacement) -> CacheConfig {
    CacheConfig {
        region_bytes: 256 << 10,
        replacement,
        default_policy: DiskPolicy {
            mode,
            admission,
            sequential_threshold: 1 << 20,
            // The mixed test bypasses sequential writes.
            sequential_write_cutoff: 0,
            cow: CowMode::Stacked,
            cache_only: false,
        },
        // Write-back only when a region is reclaimed or on a drain; the
        // mixed test lowers the watermarks. Write-back runs in the writing
        // thread, so each recorded log is reproducible.
        high_watermark: 1.0,
        low_watermark: 1.0,
        host: Some("crash-host".into()),
        inline_background: true,
        // Checkpoints start every few flushes and land a commit later,
        // so crashes find the journal running ahead of one.
        checkpoint_interval_bytes: Some(4 << 10),
        // Batches go out between flushes too, and checkpoints start there.
        journal_buffer_bytes: 2 << 10,
        ..CacheConfig::default()
    }
}

fn target(label: &str, config: CacheConfig) -> CacheTarget {
    let images =
        Qcow2Target::new(label, 12 * MIB, CreateOptions::default()).with_backing(Backing::Raw);
    CacheTarget::new(images, config, DEVICE)
}

fn run_config(seed: u64) -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            seed,
            ops: 160,
            max_len: Some(512 << 10),
            hot_percent: 40,
            ..WorkloadConfig::default()
        },
        ..RunConfig::default()
    }
}

/// Sweeps and asserts zero violations; returns the number of states.
fn clean(t: &CacheTarget, seed: u64, states: usize) -> usize {
    sweep_clean(t, &run_config(seed), states)
}

#[test]
fn writeback_with_evictions_and_restarts() {
    let t = target(
        "wb",
        cache_config(WriteMode::WriteBack, Admission::All, Replacement::Lru),
    );
    let n = clean(&t, 0xcb1, 400);
    assert!(n >= budget(400) / 2, "only {n} distinct states");
}

#[test]
fn writethrough_clock() {
    let t = target(
        "wt",
        cache_config(WriteMode::WriteThrough, Admission::All, Replacement::Clock),
    );
    clean(&t, 0xcb2, 300);
}

#[test]
fn writearound_hot_admission() {
    let t = target(
        "wa",
        cache_config(WriteMode::WriteAround, Admission::Hot, Replacement::Lru),
    );
    clean(&t, 0xcb3, 200);
}

#[test]
fn mixed_background_writeback_arc() {
    let mut c = cache_config(
        WriteMode::WriteBack,
        Admission::SequentialBypass,
        Replacement::Arc,
    );
    c.default_policy.sequential_write_cutoff = 1 << 20;
    c.high_watermark = 0.1;
    c.low_watermark = 0.05;
    let t = target("mixed", c);
    clean(&t, 0xcb4, 350);
}

#[test]
fn index_before_data_is_caught() {
    let mut c = cache_config(WriteMode::WriteBack, Admission::All, Replacement::Lru);
    c.test_index_before_data = true;
    let t = target("broken", c);
    let reports = sweep(&t, &run_config(0xbad), budget(400)).expect("harness");
    let violations: usize = reports.iter().map(|r| r.violations.len()).sum();
    assert!(
        violations > 0,
        "persisting the index before the data must produce violations"
    );
}

/// Deduplication (issue 21): the workload's blocks come from 24 patterns,
/// so most writes land on blocks flash already holds and share them, also
/// across evictions, write-back and restarts. Every state must read, at
/// every address, a value it may hold: never another address's bytes nor
/// a freed block's. Two seeds, one with verify, 800 states in all.
#[test]
fn dedup_shared_blocks_through_crashes() {
    for (seed, dedup) in [
        (0xd1, vdcache_cache::Dedup::On),
        (0xd2, vdcache_cache::Dedup::Verify),
    ] {
        let mut c = cache_config(WriteMode::WriteBack, Admission::All, Replacement::Lru);
        c.dedup = dedup;
        c.high_watermark = 0.3;
        c.low_watermark = 0.1;
        let t = target("dedup", c);
        let mut run = run_config(seed);
        run.workload.duplicate_patterns = 24;
        let n = sweep_clean(&t, &run, 400);
        assert!(n >= budget(400) / 2, "only {n} distinct states");
        let shared = t.live_report().map_or(0, |r| r.total.dedup_blocks_shared);
        assert!(shared > 100, "the workload shared only {shared} blocks");
    }
}

/// A write-back cache whose device fills up for a while (issue 43, item
/// 1): in each run, `CALLS` consecutive write calls to the device fail with
/// ENOSPC, the window placed at `WINDOWS` points spread over a run's
/// writes; the guest retries what failed. Every flush that succeeds must
/// cover every write before it, whatever failed meanwhile.
const WINDOWS: u64 = 5;
const CALLS: u64 = 4;

fn full_device_sweeps(config: &CacheConfig, states: usize) -> usize {
    let mut run = run_config(0xf0);
    run.workload.retries = 2 * CALLS as u32;
    // No reopens, and checkpoints only when half the journal is used: what
    // a failed commit left out stays out until the final close, unless a
    // later commit writes it.
    run.workload.reopens = false;
    run.workload.ops = 100;
    let config = &CacheConfig {
        checkpoint_interval_bytes: None,
        ..config.clone()
    };
    let reference = target("full", config.clone());
    sweep_clean(&reference, &run, states);
    let writes = reference.device_writes();
    assert!(writes > 4 * WINDOWS, "the run wrote only {writes} times");
    let mut violations = 0;
    for w in 1..=WINDOWS {
        let first = writes * w / (WINDOWS + 1);
        let t = target("full", config.clone()).with_full_device(FullDevice {
            first,
            calls: CALLS,
        });
        let reports = sweep(&t, &run, budget(states)).expect("harness");
        violations += reports.iter().map(|r| r.violations.len()).sum::<usize>();
    }
    violations
}

#[test]
fn a_device_that_fills_up_for_a_while_loses_no_flushed_write() {
    for mode in [WriteMode::WriteBack, WriteMode::WriteThrough] {
        let c = cache_config(mode, Admission::All, Replacement::Lru);
        assert_eq!(full_device_sweeps(&c, 40), 0, "{mode:?}");
    }
}

#[test]
fn a_flush_trusted_after_a_failed_journal_write_is_caught() {
    let mut c = cache_config(WriteMode::WriteBack, Admission::All, Replacement::Lru);
    c.test_forget_failed_batches = true;
    assert!(
        full_device_sweeps(&c, 40) > 0,
        "forgetting a failed journal batch's entries must produce violations"
    );
}

/// A write-back cache whose checkpoints land every `interval` bytes of
/// journal: after a restart, the checkpoint written at the open stays the
/// newest (two epochs past the one before) until then.
fn damage_target(label: &str, interval: u64) -> CacheTarget {
    let mut c = cache_config(WriteMode::WriteBack, Admission::All, Replacement::Lru);
    c.checkpoint_interval_bytes = Some(interval);
    target(label, c)
}

/// Issue 43: damaged cache metadata. In process-crash states of a
/// write-back run, each metadata structure of the cache device is damaged
/// in turn (superblock and copy, seal, checkpoint headers and payloads,
/// the first, middle and last journal batch, the data blocks they name,
/// the whole journal): recovery refuses the device naming the damage, or
/// every flushed sector reads back exactly (never stale).
#[test]
fn damaged_metadata_is_refused_or_reads_exactly() {
    let t = damage_target("damage", 256 << 10);
    let points = vdcache_crash::state_budget(budget(6));
    let r = sweep_damage(&t, &run_config(0xda1), points).expect("harness");
    eprintln!("{}", r.summary());
    assert!(r.is_clean(), "{}\n{}", r.summary(), r.violations.join("\n"));
    let kind = |k: &str| r.by_kind.get(k).copied().unwrap_or_default();
    // What a copy repairs is never refused.
    for repaired in ["superblock", "superblock copy", "seal"] {
        assert_eq!(kind(repaired).refused, 0, "{}", r.summary());
    }
    // Damage to what was flushed is refused, not dropped as a torn tail.
    for refused in ["checkpoint header", "journal batch", "journal"] {
        assert!(kind(refused).refused > 0, "{}", r.summary());
    }
    assert!(kind("data block").damaged_blocks > 0, "{}", r.summary());
}

/// The mutation "opening past a bad checkpoint": recovery that ignores
/// the word of the seal and the journal about newer checkpoints opens an
/// older one, and the damaged-metadata sweep must catch it.
#[test]
fn opening_past_a_bad_checkpoint_is_caught() {
    let mut t = damage_target("broken", 4 << 20);
    t.config.test_open_past_bad_checkpoint = true;
    let r = sweep_damage(&t, &run_config(0xda1), budget(6)).expect("harness");
    eprintln!("{}", r.summary());
    assert!(
        r.violating() > 0,
        "opening past a bad checkpoint must produce violations: {}",
        r.summary()
    );
}
