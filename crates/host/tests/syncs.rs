//! Syncs of the cache device off the request path (issue 4).
//!
//! Checkpoints are written while the journal goes on: a guest flush does
//! not wait for a checkpoint's syncs, a crash before a started checkpoint
//! lands loses nothing flushed after it started, and a writer that fills
//! the journal ring waits for the checkpoint instead of overwriting what
//! replay needs. A guest flush syncs outside the cache's lock, and flushes
//! arriving during its sync share the next one.

use crate::common;

use common::{GatedFiles, Held, disk_through};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use vdcache_backend::inject::{Gate, HookedBackend, eventually};
use vdcache_backend::recording::{Log, LogOp, RecordingBackend, StateKind};
use vdcache_backend::{BackendRef, MemBackend};
use vdcache_cache::WriteMode;
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_image::{CreateOptions, ImageFormat, MemFiles, VirtualDisk, qcow2_image_bytes};

const BLOCK: u64 = 4096;
const IMAGE: u64 = 8 << 20;
const DEVICE: usize = 16 << 20;
const IMAGE_NAME: &str = "d/disk.raw";
const QCOW2_NAME: &str = "d/disk.qcow2";

fn config(inline: bool, interval: Option<u64>) -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        inline_background: inline,
        checkpoint_interval_bytes: interval,
        // Nothing is written back: the cache alone holds what was written.
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..CacheConfig::default()
    }
}

fn image_files() -> Arc<MemFiles> {
    let files = MemFiles::new();
    files.insert(IMAGE_NAME, vec![0u8; IMAGE as usize]);
    files
}

/// The same image as qcow2: its guest flushes write metadata back first.
fn qcow2_files() -> Arc<MemFiles> {
    let files = MemFiles::new();
    let image =
        qcow2_image_bytes(Path::new(QCOW2_NAME), &CreateOptions::default(), IMAGE).expect("create");
    files.insert(QCOW2_NAME, image);
    files
}

fn disk_on(files: &Arc<MemFiles>, cache: &Arc<FlashCache>) -> VirtualDisk {
    disk_through(files.clone(), cache, IMAGE_NAME, ImageFormat::Raw)
}

fn content(block: u64, round: u64) -> Vec<u8> {
    let v = (block.wrapping_mul(31) ^ round.wrapping_mul(131)) as u8 | 1;
    vec![v; BLOCK as usize]
}

/// Seeded block numbers.
struct Blocks(Xoshiro256PlusPlus);

impl Blocks {
    fn seeded(seed: u64) -> Blocks {
        Blocks(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.random_range(0..IMAGE / BLOCK)
    }
}

/// Writes eight random blocks of round `round`, noting them in `model`.
fn write_round(disk: &VirtualDisk, blocks: &mut Blocks, model: &mut HashMap<u64, u64>, round: u64) {
    for _ in 0..8 {
        let b = blocks.next();
        disk.write(b * BLOCK, &content(b, round), false)
            .expect("write");
        model.insert(b, round);
    }
}

/// Every block of the model reads back as its last write.
fn check(disk: &VirtualDisk, model: &HashMap<u64, u64>, what: &str) {
    let mut buf = vec![0u8; BLOCK as usize];
    for (&block, &round) in model {
        disk.read(block * BLOCK, &mut buf).expect("read");
        assert!(
            buf == content(block, round),
            "{what}: block {block} does not read back its write of round {round}"
        );
    }
}

#[test]
fn flushed_writes_survive_checkpoints_that_never_landed() {
    let log = Log::new();
    let device: BackendRef = Arc::new(RecordingBackend::fixed(&log, "cache", DEVICE));
    let files = image_files();
    let cache = FlashCache::format(device, config(true, Some(16 << 10))).expect("format");
    let disk = disk_on(&files, &cache);
    let mut blocks = Blocks::seeded(0x5eed);
    let mut model = HashMap::new();
    let mut flushes = Vec::new();
    for round in 0..80 {
        write_round(&disk, &mut blocks, &mut model, round);
        let before = log.len();
        disk.flush().expect("flush");
        flushes.push((before, log.len(), model.clone()));
    }
    let layout = *cache.layout();
    let journal = layout.journal_offset..layout.journal_offset + layout.journal_bytes;
    let started = cache.report();
    assert!(
        started.device.checkpoints >= 10,
        "{} checkpoints",
        started.device.checkpoints
    );
    let history = log.snapshot();
    let mut replayer = history.replayer();
    let mut entered = 0;
    for (before, after, model) in flushes {
        // The sync that made the guest flush's journal batch durable: from
        // there on its writes must survive, whatever the checkpoint
        // written around it does.
        let during = &history.entries()[before as usize..after as usize];
        let batch = during
            .iter()
            .rposition(|e| matches!(&e.op, LogOp::Write { offset, .. } if journal.contains(offset)))
            .unwrap_or(0);
        let synced = during[batch..]
            .iter()
            .find(|e| matches!(e.op, LogOp::Flush))
            .expect("a sync after the batch")
            .seq;
        let state = replayer.state(synced + 1, StateKind::All);
        let dev: BackendRef = Arc::new(state.device("cache").expect("device").to_mem_backend());
        let recovered = FlashCache::open(dev, config(true, Some(16 << 10))).expect("recover");
        entered += u32::from(recovered.report().recovery.entered_next_epoch);
        check(&disk_on(&files, &recovered), &model, "after a crash");
    }
    // Most checkpoints were still in flight at the next flush's sync.
    assert!(
        entered >= 5,
        "replay crossed into a newer epoch {entered} times"
    );
}

/// A cache device whose syncs from the thread called `thread` wait at the
/// gate returned with it.
fn gated_device(thread: &'static str) -> (BackendRef, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let held = gate.clone();
    let device =
        HookedBackend::new(Arc::new(MemBackend::fixed("cache", DEVICE))).on_flush(move || {
            if std::thread::current().name() == Some(thread) {
                held.wait();
            }
            Ok(())
        });
    (Arc::new(device), gate)
}

#[test]
fn guest_flushes_do_not_wait_for_a_checkpoint_in_flight() {
    let (device, gate) = gated_device("vdcache-checkpoint");
    let files = image_files();
    let config = config(false, Some(16 << 10));
    let cache = FlashCache::format(device.clone(), config.clone()).expect("format");
    let disk = disk_on(&files, &cache);
    let mut blocks = Blocks::seeded(0xbeef);
    let mut model = HashMap::new();
    // Each round journals about 250 bytes: checkpoints start every ~65
    // rounds, and the first one is stuck at the gate for the whole run.
    for round in 0..400 {
        write_round(&disk, &mut blocks, &mut model, round);
        disk.flush().expect("flush");
    }
    let r = cache.report();
    assert!(gate.held() > 0, "no checkpoint reached the device");
    assert!(
        !gate.opened_by_timeout(),
        "the flushes waited for the checkpoint"
    );
    assert_eq!(
        r.device.checkpoints, 0,
        "a checkpoint landed through a closed gate"
    );
    assert_eq!(r.device.checkpoint_waits, 0);
    gate.release();
    cache.shutdown(true).expect("shutdown");
    assert!(cache.report().device.checkpoints >= 2);
    drop(disk);
    drop(cache);
    let cache = FlashCache::open(device, config).expect("reopen");
    check(&disk_on(&files, &cache), &model, "after a restart");
    assert!(gate.held() >= 1);
}

#[test]
fn a_full_journal_ring_waits_for_the_checkpoint_in_flight() {
    let (device, gate) = gated_device("vdcache-checkpoint");
    let files = image_files();
    let config = config(false, None);
    let cache = FlashCache::format(device.clone(), config.clone()).expect("format");
    let disk = disk_on(&files, &cache);
    let mut blocks = Blocks::seeded(0xf00d);
    let mut model = HashMap::new();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Opens the gate once a writer waits for the stuck checkpoint (or
        // when the writes are over without one, failing the test below).
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) && cache.device_stats().checkpoint_waits == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            gate.release();
        });
        // About 30 bytes of journal per write: the 4 MiB ring is full
        // after some 150,000 writes since the last checkpoint landed.
        for round in 0..250_000 {
            let b = blocks.next();
            disk.write(b * BLOCK, &content(b, round), false)
                .expect("write");
            model.insert(b, round);
        }
        done.store(true, Ordering::SeqCst);
    });
    let r = cache.device_stats();
    assert!(r.checkpoint_waits >= 1, "{r:?}");
    assert!(r.checkpoints >= 1, "{r:?}");
    disk.flush().expect("flush");
    cache.shutdown(true).expect("shutdown");
    drop(disk);
    drop(cache);
    let cache = FlashCache::open(device, config).expect("reopen");
    check(&disk_on(&files, &cache), &model, "after a restart");
}

/// Writes four blocks from `first` with the contents of `round`, then
/// flushes, on a thread called `name`.
fn write_and_flush<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    disk: &'s VirtualDisk,
    name: &str,
    first: u64,
    round: u64,
) -> std::thread::ScopedJoinHandle<'s, ()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(s, move || {
            for b in first..first + 4 {
                disk.write(b * BLOCK, &content(b, round), false)
                    .expect("write");
            }
            disk.flush().expect("flush");
        })
        .expect("spawn")
}

/// Notes what [`write_and_flush`] wrote.
fn note_written(model: &mut HashMap<u64, u64>, first: u64, round: u64) {
    for b in first..first + 4 {
        model.insert(b, round);
    }
}

#[test]
fn guest_flushes_sync_outside_the_locks_and_share_the_next_sync() {
    let (device, gate) = gated_device("first-flush");
    let files = qcow2_files();
    let config = config(false, None);
    let cache = FlashCache::format(device.clone(), config.clone()).expect("format");
    let disk = disk_through(files.clone(), &cache, QCOW2_NAME, ImageFormat::Qcow2);
    let syncs_before = cache.device_stats().syncs;
    let mut model = HashMap::new();
    let (lock_was_free, both_waited) = std::thread::scope(|s| {
        let first = write_and_flush(s, &disk, "first-flush", 0, 1);
        assert!(
            eventually(|| gate.held() > 0),
            "the first flush never synced"
        );
        note_written(&mut model, 0, 1);
        // Its sync is stuck: requests of other threads must still run,
        // allocating clusters too (neither the cache's lock nor the
        // image's metadata lock is held through the sync).
        let mut blocks = Blocks::seeded(0xcafe);
        write_round(&disk, &mut blocks, &mut model, 2);
        check(&disk, &model, "during a sync");
        let lock_was_free = !gate.is_open();
        let joiners = [
            write_and_flush(s, &disk, "joiner-a", 100, 3),
            write_and_flush(s, &disk, "joiner-b", 200, 4),
        ];
        let both_waited = eventually(|| cache.device_stats().sync_waits == 2);
        gate.release();
        for t in joiners.into_iter().chain([first]) {
            t.join().expect("flusher");
        }
        (lock_was_free, both_waited)
    });
    assert!(lock_was_free, "requests waited for another flush's sync");
    assert!(both_waited, "{:?}", cache.device_stats());
    assert_eq!(
        cache.device_stats().syncs - syncs_before,
        2,
        "three flushes: the first one's sync and one shared by the two that waited for it"
    );
    // Nothing written since: a flush costs no sync.
    disk.flush().expect("flush");
    assert_eq!(cache.device_stats().syncs - syncs_before, 2);
    note_written(&mut model, 100, 3);
    note_written(&mut model, 200, 4);
    drop(disk);
    drop(cache);
    // Everything flushed is in the journal: no shutdown, a crash.
    let cache = FlashCache::open(device, config).expect("reopen");
    let disk = disk_through(files.clone(), &cache, QCOW2_NAME, ImageFormat::Qcow2);
    check(&disk, &model, "after a restart");
}

/// Flushers on three threads, each sync of the device taking a millisecond
/// after the point it covers: a flush returns only once a sync that started
/// after its journal batch was written has run, whether it ran that sync
/// itself or shared another's.
#[test]
fn concurrent_flushes_return_only_once_their_writes_are_durable() {
    const THREADS: u64 = 3;
    const ROUNDS: u64 = 40;
    let log = Log::new();
    let recording: BackendRef = Arc::new(RecordingBackend::fixed(&log, "cache", DEVICE));
    let slow_syncs = HookedBackend::new(recording).after_flush(|| {
        std::thread::sleep(Duration::from_millis(1));
        Ok(())
    });
    let files = image_files();
    let config = config(false, None);
    let cache = FlashCache::format(Arc::new(slow_syncs), config.clone()).expect("format");
    let disk = disk_on(&files, &cache);
    let mut returns: Vec<(u64, HashMap<u64, u64>)> = std::thread::scope(|s| {
        let flushers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (disk, log) = (&disk, &log);
                s.spawn(move || {
                    let mut model = HashMap::new();
                    let mut returned = Vec::new();
                    for round in 0..ROUNDS {
                        for i in 0..2 {
                            let b = t * 512 + (round * 7 + i * 3) % 512;
                            disk.write(b * BLOCK, &content(b, round), false)
                                .expect("write");
                            model.insert(b, round);
                        }
                        disk.flush().expect("flush");
                        returned.push((log.len(), model.clone()));
                    }
                    returned
                })
            })
            .collect();
        flushers
            .into_iter()
            .flat_map(|f| f.join().expect("flusher"))
            .collect()
    });
    let stats = cache.device_stats();
    assert!(
        stats.sync_waits > 0,
        "the flushes never overlapped: {stats:?}"
    );
    returns.sort_by_key(|(point, _)| *point);
    let history = log.snapshot();
    let mut replayer = history.replayer();
    for (point, model) in returns {
        // A crash right after the flush returned, keeping only what was
        // synced by then.
        let state = replayer.state(point, StateKind::None);
        let dev: BackendRef = Arc::new(state.device("cache").expect("device").to_mem_backend());
        let recovered = FlashCache::open(dev, config.clone()).expect("recover");
        check(&disk_on(&files, &recovered), &model, "after a crash");
    }
}

/// A write-through cache on a recording device, and a raw disk on it whose
/// backend syncs from the thread called `thread` wait at the returned gate.
fn write_through_rig(
    thread: &'static str,
) -> (
    Arc<Log>,
    CacheConfig,
    Arc<GatedFiles>,
    Arc<FlashCache>,
    Arc<Gate>,
) {
    let gate = Arc::new(Gate::default());
    let opener = Arc::new(GatedFiles {
        files: image_files(),
        thread,
        held: Held::Syncs,
        gate: gate.clone(),
    });
    let mut config = config(false, None);
    config.default_policy.mode = WriteMode::WriteThrough;
    let log = Log::new();
    let device: BackendRef = Arc::new(RecordingBackend::fixed(&log, "cache", DEVICE));
    let cache = FlashCache::format(device, config.clone()).expect("format");
    (log, config, opener, cache, gate)
}

/// Write-through: a guest flush syncs the image's backend without the
/// cache's lock, so requests go on meanwhile. What they write through
/// during that sync is not covered by it: their journal records stay
/// pending rather than cost the flush a second backend sync, and a crash
/// right after the flush keeps only the flushed writes' clean copies.
#[test]
fn write_through_backend_syncs_run_outside_the_lock() {
    let (log, config, opener, cache, gate) = write_through_rig("first-flush");
    let disk = disk_through(opener.clone(), &cache, IMAGE_NAME, ImageFormat::Raw);
    let mut model = HashMap::new();
    let (lock_was_free, flushed_at) = std::thread::scope(|s| {
        let first = write_and_flush(s, &disk, "first-flush", 0, 1);
        assert!(
            eventually(|| gate.held() > 0),
            "the first flush never synced the backend"
        );
        note_written(&mut model, 0, 1);
        write_round(&disk, &mut Blocks::seeded(0xfeed), &mut model, 2);
        check(&disk, &model, "during a backend sync");
        let lock_was_free = !gate.is_open();
        gate.release();
        first.join().expect("flusher");
        (lock_was_free, log.len())
    });
    assert!(lock_was_free, "requests waited for a backend sync");
    assert_eq!(cache.report().total.backend_syncs, 1);
    let state = log.snapshot().state(flushed_at, StateKind::None);
    let dev: BackendRef = Arc::new(state.device("cache").expect("device").to_mem_backend());
    let recovered = FlashCache::open(dev, config).expect("recover");
    assert_eq!(
        recovered.report().cached_bytes,
        4 * BLOCK,
        "a crash kept clean copies of data written through after the backend sync"
    );
    check(
        &disk_through(opener, &recovered, IMAGE_NAME, ImageFormat::Raw),
        &model,
        "after a crash",
    );
    disk.flush().expect("flush");
    assert_eq!(cache.report().total.backend_syncs, 2);
}

/// Write-through: overwriting a cached block drops the clean copy durably
/// before the backend write. That costs a sync of the cache device and no
/// backend sync, even with other data written through and not synced:
/// clean copies of it are journaled only once a backend sync covers it,
/// and overwriting such a copy costs no sync at all.
#[test]
fn write_through_overwrites_sync_only_the_cache_device() {
    let (log, config, opener, cache, _gate) = write_through_rig("nobody");
    let disk = disk_through(opener.clone(), &cache, IMAGE_NAME, ImageFormat::Raw);
    for b in 0..4 {
        disk.write(b * BLOCK, &content(b, 0), false).expect("write");
    }
    disk.flush().expect("flush");
    let mut model = HashMap::from([(0, 0), (1, 0), (2, 0), (3, 0)]);
    let backend_syncs = cache.report().total.backend_syncs;
    let device_syncs = cache.report().device.syncs;
    // Written through, cached and not yet synced.
    for b in [1000, 1001] {
        disk.write(b * BLOCK, &content(b, 0), false).expect("write");
        model.insert(b, 0);
    }
    for b in 0..4 {
        disk.write(b * BLOCK, &content(b, 1), false)
            .expect("overwrite");
        model.insert(b, 1);
    }
    let report = cache.report();
    assert_eq!(
        report.total.backend_syncs, backend_syncs,
        "an overwrite synced the backend"
    );
    assert_eq!(
        report.device.syncs,
        device_syncs + 4,
        "one device sync per overwrite"
    );
    // Overwrites of clean copies never journaled need no sync at all.
    for b in [1000, 1001] {
        disk.write(b * BLOCK, &content(b, 1), false)
            .expect("overwrite");
        model.insert(b, 1);
    }
    assert_eq!(cache.report().device.syncs, device_syncs + 4);
    assert_eq!(cache.report().total.backend_syncs, backend_syncs);
    check(&disk, &model, "after the overwrites");
    // A crash now: the overwritten blocks read from the backend (old or
    // new bytes), the unsynced clean copies are forgotten.
    let state = log.snapshot().state(log.len(), StateKind::None);
    let dev: BackendRef = Arc::new(state.device("cache").expect("device").to_mem_backend());
    let recovered = FlashCache::open(dev, config).expect("recover");
    assert_eq!(
        recovered.report().cached_bytes,
        0,
        "{:?}",
        recovered.report()
    );
    check(
        &disk_through(opener, &recovered, IMAGE_NAME, ImageFormat::Raw),
        &model,
        "after a crash",
    );
}

/// Overwrites block `b` with the contents of round 1, on a thread called
/// `name`.
fn overwrite_on<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    disk: &'s VirtualDisk,
    name: &str,
    b: u64,
) -> std::thread::ScopedJoinHandle<'s, ()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(s, move || {
            disk.write(b * BLOCK, &content(b, 1), false)
                .expect("overwrite");
        })
        .expect("spawn")
}

/// Write-through overwrites arriving while another's cache-device sync
/// runs share the next sync and write one journal batch between them.
#[test]
fn write_through_overwrites_share_one_batch_and_one_sync() {
    let (device, gate) = gated_device("first");
    let mut config = config(false, None);
    config.default_policy.mode = WriteMode::WriteThrough;
    let cache = FlashCache::format(device, config).expect("format");
    let disk = disk_on(&image_files(), &cache);
    // One block per 64 KiB: the disk's writes lock whole clusters.
    let blocks = [0, 16, 32, 48];
    for b in blocks {
        disk.write(b * BLOCK, &content(b, 0), false).expect("write");
    }
    disk.flush().expect("flush");
    let before = cache.device_stats();
    std::thread::scope(|s| {
        let first = overwrite_on(s, &disk, "first", 0);
        assert!(eventually(|| gate.held() > 0), "the overwrite never synced");
        let others = [
            overwrite_on(s, &disk, "second", 16),
            overwrite_on(s, &disk, "third", 32),
        ];
        assert!(
            eventually(|| cache.device_stats().sync_waits - before.sync_waits == 2),
            "{:?}",
            cache.device_stats()
        );
        gate.release();
        for t in others.into_iter().chain([first]) {
            t.join().expect("overwriter");
        }
    });
    let after = cache.device_stats();
    assert_eq!(after.syncs - before.syncs, 2, "{after:?}");
    assert_eq!(
        after.meta_bytes_written - before.meta_bytes_written,
        2 * (4096 + vdcache_cache::seal::SEAL_BYTES as u64),
        "one journal block for the first overwrite, one for the two that waited, and a seal after each sync"
    );
    let model = HashMap::from([(0, 1), (16, 1), (32, 1), (48, 0)]);
    check(&disk, &model, "after the overwrites");
}

/// Write-through without guest flushes: clean copies wait out of the
/// journal for a backend sync, and once 4096 of them wait, the cache syncs
/// the backend itself and journals them (memory stays bounded).
#[test]
fn write_through_clean_copies_wait_for_a_backend_sync_at_most_4096_blocks() {
    const BLOCKS: u64 = 4096;
    let files = MemFiles::new();
    files.insert(IMAGE_NAME, vec![0u8; ((BLOCKS + 16) * BLOCK) as usize]);
    let mut config = config(true, None);
    config.default_policy.mode = WriteMode::WriteThrough;
    let device: BackendRef = Arc::new(MemBackend::fixed("cache", 64 << 20));
    let cache = FlashCache::format(device, config).expect("format");
    let disk = disk_on(&files, &cache);
    let journal = || cache.device_stats().meta_bytes_written;
    let journal_before = journal();
    // Backwards, one block per write: no sequential run bypasses flash.
    for b in (1..BLOCKS).rev() {
        disk.write(b * BLOCK, &content(b, 0), false).expect("write");
    }
    assert_eq!(cache.report().total.backend_syncs, 0);
    assert_eq!(
        journal(),
        journal_before,
        "clean copies journaled before a backend sync"
    );
    disk.write(0, &content(0, 0), false).expect("write");
    assert_eq!(cache.report().total.backend_syncs, 1);
    assert_eq!(cache.report().cached_bytes, BLOCKS * BLOCK);
    assert!(
        journal() > journal_before,
        "the synced clean copies were not journaled"
    );
    let model: HashMap<u64, u64> = (0..BLOCKS).map(|b| (b, 0)).collect();
    check(&disk, &model, "after the sync");
}

/// Write-through without guest flushes, with the write-back thread
/// running: clean copies below the limit wait for the guest's flush, however
/// long, and cost the backend no sync of their own (one a second used to).
#[test]
fn write_through_clean_copies_cost_no_backend_sync_the_guest_did_not_ask_for() {
    const BLOCKS: u64 = 64;
    let files = MemFiles::new();
    files.insert(IMAGE_NAME, vec![0u8; (BLOCKS * BLOCK) as usize]);
    let mut config = config(false, None);
    config.default_policy.mode = WriteMode::WriteThrough;
    let device: BackendRef = Arc::new(MemBackend::fixed("cache", 64 << 20));
    let cache = FlashCache::format(device, config).expect("format");
    let disk = disk_on(&files, &cache);
    for b in (0..BLOCKS).rev() {
        disk.write(b * BLOCK, &content(b, 0), false).expect("write");
    }
    // Long past the second after which held copies used to be synced.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(cache.report().total.backend_syncs, 0);
    assert_eq!(cache.report().unflushed_clean_bytes, BLOCKS * BLOCK);
    disk.flush().expect("flush");
    assert_eq!(cache.report().total.backend_syncs, 1);
    assert_eq!(cache.report().unflushed_clean_bytes, 0);
    assert_eq!(cache.report().cached_bytes, BLOCKS * BLOCK);
    let model: HashMap<u64, u64> = (0..BLOCKS).map(|b| (b, 0)).collect();
    check(&disk, &model, "after the flush");
}

/// A failed sync of the cache device fails every later guest flush too:
/// the pages it could not write may be gone, and a later sync that
/// succeeds would vouch for them.
#[test]
fn a_failed_device_sync_fails_every_later_flush() {
    let failing = Arc::new(AtomicBool::new(false));
    let fail = failing.clone();
    let device = HookedBackend::new(Arc::new(MemBackend::fixed("cache", DEVICE))).on_flush(
        move || match fail.load(Ordering::SeqCst) {
            true => Err(std::io::Error::other("injected sync failure")),
            false => Ok(()),
        },
    );
    let files = image_files();
    let cache = FlashCache::format(Arc::new(device), config(false, None)).expect("format");
    let disk = disk_on(&files, &cache);
    let mut model = HashMap::new();
    write_round(&disk, &mut Blocks::seeded(1), &mut model, 0);
    disk.flush().expect("flush");
    failing.store(true, Ordering::SeqCst);
    write_round(&disk, &mut Blocks::seeded(2), &mut model, 1);
    assert!(
        disk.flush().is_err(),
        "the injected failure was not reported"
    );
    failing.store(false, Ordering::SeqCst);
    write_round(&disk, &mut Blocks::seeded(3), &mut model, 2);
    let err = disk
        .flush()
        .expect_err("a flush after a failed sync succeeded");
    assert!(err.to_string().contains("earlier sync"), "{err}");
}

/// Write-back with a sequential write cutoff: a long run goes to the
/// backend once it reaches the cutoff, even with its requests arriving out of order,
/// and costs no sync of either device until the guest flushes: the dirty
/// blocks written meanwhile (small writes elsewhere, journaled in batches
/// between the writes) do not describe data that went to the backend.
#[test]
fn sequential_runs_bypass_without_syncs() {
    const CHUNK: u64 = 256 << 10;
    const THRESHOLD: u64 = 1 << 20;
    let mut config = config(false, None);
    config.default_policy.sequential_write_cutoff = THRESHOLD;
    config.journal_buffer_bytes = 512;
    for (files, name, format) in [
        (image_files(), IMAGE_NAME, ImageFormat::Raw),
        (qcow2_files(), QCOW2_NAME, ImageFormat::Qcow2),
    ] {
        let device: BackendRef = Arc::new(MemBackend::fixed("cache", DEVICE));
        let cache = FlashCache::format(device, config.clone()).expect("format");
        let disk = disk_through(files, &cache, name, format);
        // A qcow2 image opened writable through the cache is stamped with
        // its cache mark, durably, before any other write (a raw image
        // cannot carry one).
        let at_open = cache.report().total.backend_syncs;
        assert_eq!(
            at_open > 0,
            format == ImageFormat::Qcow2,
            "{at_open} syncs at open"
        );
        let device_at_open = cache.device_stats().syncs;
        let mut model = vec![0u8; IMAGE as usize];
        let mut write = |off: u64, data: Vec<u8>| {
            disk.write(off, &data, false).expect("write");
            model[off as usize..off as usize + data.len()].copy_from_slice(&data);
        };
        let chunks = IMAGE / CHUNK;
        for i in 0..chunks {
            // Neighbours swapped, as two requests in flight may arrive.
            let chunk = i ^ 1;
            write(chunk * CHUNK, vec![chunk as u8 | 1; CHUNK as usize]);
            // A small write far behind the run, into what it bypassed.
            if chunk >= chunks / 2 {
                write(
                    (chunk - chunks / 2) * CHUNK + BLOCK,
                    vec![0xee; BLOCK as usize],
                );
            }
        }
        let report = cache.report();
        let what = format!("{format:?}");
        // In flash: the run's head before it reached the threshold, the
        // small writes, and (qcow2) a table or two.
        assert!(
            report.total.flash_bytes_written <= THRESHOLD + (256 << 10),
            "{what}: {} bytes of a sequential run went to flash",
            report.total.flash_bytes_written
        );
        assert_eq!(
            report.total.backend_syncs - at_open,
            0,
            "{what}: backend synced"
        );
        assert_eq!(
            cache.device_stats().syncs - device_at_open,
            0,
            "{what}: cache device synced"
        );
        assert!(
            cache.device_stats().meta_bytes_written > 0,
            "{what}: no journal batch went out between the writes"
        );
        disk.flush().expect("flush");
        assert_eq!(cache.report().total.backend_syncs - at_open, 1, "{what}");
        let mut all = vec![0u8; IMAGE as usize];
        disk.read(0, &mut all).expect("read");
        let first = all.iter().zip(&model).position(|(a, b)| a != b);
        assert_eq!(first, None, "{what}: the disk differs from the model");
    }
}

/// A sequential run of small writes (a log appended 4 KiB at a time) stays
/// in flash past the cutoff: its writes wait on latency, not bandwidth.
#[test]
fn small_sequential_writes_stay_in_flash() {
    let mut config = config(false, None);
    config.default_policy.sequential_write_cutoff = 1 << 20;
    let device: BackendRef = Arc::new(MemBackend::fixed("cache", DEVICE));
    let cache = FlashCache::format(device, config).expect("format");
    let disk = disk_on(&image_files(), &cache);
    let mut model = HashMap::new();
    // 4 MiB: four times the cutoff.
    let blocks = 1024;
    for b in 0..blocks {
        disk.write(b * BLOCK, &content(b, 1), false).expect("write");
        model.insert(b, 1);
    }
    // (Some of it is written back as regions are reclaimed.)
    assert_eq!(
        cache.report().total.flash_bytes_written,
        blocks * BLOCK,
        "small writes bypassed flash"
    );
    check(&disk, &model, "after the run");
}
