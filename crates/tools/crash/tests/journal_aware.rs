//! Journal-aware caching through crashes (issue 22): a guest journal
//! device cached only (cache-only logging) and in-place writes sharing the
//! cache blocks of their journal copies (logical caching), over recorded
//! devices. The steps: a JBD2 transaction logged and flushed, its
//! checkpoint writes shared, a later transaction reusing the journal's
//! places, overwrites of shared blocks, write-back of the data disk and a
//! write-out of the journal, with guest flushes between. At every crash
//! point (nothing, everything, and seeded random subsets of what was in
//! flight landed, writes torn at sector granularity) the recovered cache
//! must read, on both disks, a value each block may hold (the value of its
//! last flushed write, or one written since), count every shared block
//! once in its region, and write back exactly what it reads.

use std::collections::HashMap;
use std::sync::Arc;
use vdcache_backend::BackendRef;
use vdcache_cache::{CacheConfig, DiskPolicy, FlashCache, WriteMode};
use vdcache_crash::{Log, RecordingFiles, StateKind, mem_files, open_raw_disk};
use vdcache_image::{DiskId, StoreOpener, VirtualDisk};
use vdcache_jbd2::build::Writer;

const BLOCK: usize = 4096;
const DATA: &str = "data.raw";
const JOURNAL: &str = "journal.raw";
const DEVICE: &str = "cache.dev";
const DATA_DISK: DiskId = DiskId(1);
const JOURNAL_DISK: DiskId = DiskId(2);
const DATA_BLOCKS: u64 = 64;
const JOURNAL_BLOCKS: u32 = 64;

fn config() -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        inline_background: true,
        journal_buffer_bytes: 512,
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..CacheConfig::default()
    }
}

/// Both disks through `cache`, the journal device held and linked.
fn attach(opener: Arc<dyn StoreOpener>, cache: &Arc<FlashCache>) -> (VirtualDisk, VirtualDisk) {
    cache.set_policy(
        DATA_DISK,
        DiskPolicy {
            mode: WriteMode::WriteBack,
            sequential_write_cutoff: 0,
            ..DiskPolicy::default()
        },
    );
    cache.set_policy(JOURNAL_DISK, DiskPolicy::journal_device());
    let data = open_raw_disk(opener.clone(), cache, DATA, DATA_DISK).expect("open data disk");
    let journal = open_raw_disk(opener, cache, JOURNAL, JOURNAL_DISK).expect("open journal");
    let mut sb = vec![0u8; BLOCK];
    journal.read(0, &mut sb).expect("superblock");
    let bits = data.cluster_size().trailing_zeros();
    let _ = cache.link_journal(JOURNAL_DISK, DATA_DISK, bits, Some(&sb));
    (data, journal)
}

fn content(target: u64, round: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (target as u8).wrapping_mul(29) ^ round.wrapping_mul(7) ^ (i as u8))
        .collect()
}

/// What each block of each disk may read at a crash point: the value of
/// its last write that a completed flush covers, and every value written
/// since. Writes and flushes are numbered in the order the guest issued
/// them (a write that only maps a block onto a shared one writes nothing
/// to any device, so log positions cannot order it).
/// Writes to one block: (op number, value).
type BlockWrites = Vec<(u64, Vec<u8>)>;

#[derive(Default)]
struct Model {
    ops: u64,
    /// (disk, block) → [(op number, value)].
    writes: HashMap<(u32, u64), BlockWrites>,
    /// (op number, log position it completed at) of each flush.
    flushes: Vec<(u64, u64)>,
}

impl Model {
    fn wrote(&mut self, disk: DiskId, block: u64, value: &[u8]) {
        self.ops += 1;
        self.writes
            .entry((disk.0, block))
            .or_default()
            .push((self.ops, value.to_vec()));
    }

    fn flushed(&mut self, at: u64) {
        self.ops += 1;
        self.flushes.push((self.ops, at));
    }

    /// Values block `block` of `disk` may read after a crash at `point`.
    fn allowed(&self, disk: DiskId, block: u64, point: u64) -> Vec<Vec<u8>> {
        let covered = self
            .flushes
            .iter()
            .filter(|&&(_, at)| at <= point)
            .map(|&(op, _)| op)
            .max()
            .unwrap_or(0);
        let writes = self
            .writes
            .get(&(disk.0, block))
            .map_or(&[][..], |w| &w[..]);
        let durable = writes
            .iter()
            .rev()
            .find(|(op, _)| *op < covered)
            .map_or(vec![0u8; BLOCK], |(_, v)| v.clone());
        let mut out = vec![durable];
        out.extend(
            writes
                .iter()
                .filter(|(op, _)| *op > covered)
                .map(|(_, v)| v.clone()),
        );
        out
    }
}

struct Run<'a> {
    log: &'a Log,
    model: Model,
    data: VirtualDisk,
    journal: VirtualDisk,
}

impl Run<'_> {
    fn write(&mut self, disk: DiskId, block: u64, value: &[u8]) {
        let target = if disk == DATA_DISK {
            &self.data
        } else {
            &self.journal
        };
        target
            .write(block * BLOCK as u64, value, false)
            .expect("write");
        self.model.wrote(disk, block, value);
    }

    fn flush(&mut self) {
        self.data.flush().expect("flush data");
        self.journal.flush().expect("flush journal");
        self.model.flushed(self.log.len());
    }

    /// Writes a journal image's blocks `range` as the kernel would.
    fn log_blocks(&mut self, image: &[u8], range: std::ops::Range<u64>) {
        for b in range {
            let at = b as usize * BLOCK;
            self.write(JOURNAL_DISK, b, &image[at..at + BLOCK]);
        }
    }
}

fn journal(targets: &[u64], round: u8, start: u32) -> (Vec<u8>, Vec<u32>) {
    let mut w = Writer::new(
        2,
        BLOCK as u32,
        JOURNAL_BLOCKS,
        vdcache_jbd2::FEATURE_CSUM_V3 | vdcache_jbd2::FEATURE_64BIT,
        start,
        u32::from(round),
    );
    let copies: Vec<(u64, Vec<u8>)> = targets.iter().map(|&t| (t, content(t, round))).collect();
    let placed = w.transaction(&copies, &[], true);
    (w.finish(), placed)
}

#[test]
fn shared_and_held_blocks_read_allowed_values_after_any_crash() {
    let log = Log::new();
    let files = RecordingFiles::new(&log);
    files.insert(DATA, vec![0u8; DATA_BLOCKS as usize * BLOCK]);
    files.insert(JOURNAL, vec![0u8; JOURNAL_BLOCKS as usize * BLOCK]);
    let device: BackendRef = files.insert_fixed(DEVICE, 16 << 20);
    let cache = FlashCache::format(device, config()).expect("format");
    let (data, journal_disk) = attach(files.clone(), &cache);
    let mut run = Run {
        log: &log,
        model: Model::default(),
        data,
        journal: journal_disk,
    };
    let targets = [3u64, 4, 5, 20, 41];
    // Transaction 1, logged and flushed (the guest's commit).
    let (first, _) = journal(&targets, 1, 1);
    run.log_blocks(&first, 0..(targets.len() as u64 + 3));
    run.flush();
    let start = log.len();
    // Checkpoint: the in-place writes share the copies.
    for &t in &targets[..3] {
        run.write(DATA_DISK, t, &content(t, 1));
    }
    run.flush();
    for &t in &targets[3..] {
        run.write(DATA_DISK, t, &content(t, 1));
    }
    // Transaction 2 reuses the journal's places before any flush.
    let (second, _) = journal(&[7, 8], 2, 1);
    run.log_blocks(&second, 1..5);
    // A shared block overwritten with other bytes.
    run.write(DATA_DISK, 4, &content(4, 9));
    run.flush();
    // Write-back of the data disk, then the journal written out.
    cache.drain().expect("drain");
    run.model.flushed(log.len());
    run.write(DATA_DISK, 20, &content(20, 3));
    cache.write_out_held().expect("write out");
    run.model.flushed(log.len());
    let end = log.len();
    let shared = cache
        .report()
        .disks
        .iter()
        .find(|(d, _)| *d == DATA_DISK.0)
        .map_or(0, |(_, s)| s.journal_copies_shared);
    assert_eq!(
        shared,
        targets.len() as u64,
        "every checkpoint write shared its copy"
    );

    let history = log.snapshot();
    let mut checked = 0;
    for point in start..=end {
        let random = (0..6u64).map(|i| StateKind::Random(point.wrapping_mul(0x9e37_79b9) ^ i));
        for kind in [StateKind::None, StateKind::All].into_iter().chain(random) {
            let state = history.state(point, kind);
            let what = format!("crash at {point} ({kind})");
            let dev: BackendRef = Arc::new(state.device(DEVICE).expect("device").to_mem_backend());
            let recovered = FlashCache::open(dev, config()).expect("recover");
            recovered
                .audit_regions()
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let opener = mem_files(&state);
            let (data, journal) = attach(opener.clone(), &recovered);
            let mut seen = HashMap::new();
            for (disk, d, blocks) in [
                (DATA_DISK, &data, DATA_BLOCKS),
                (JOURNAL_DISK, &journal, u64::from(JOURNAL_BLOCKS)),
            ] {
                for b in 0..blocks {
                    let mut got = vec![0u8; BLOCK];
                    d.read(b * BLOCK as u64, &mut got).expect("read");
                    let allowed = run.model.allowed(disk, b, point);
                    assert!(
                        allowed.contains(&got),
                        "{what}: disk {} block {b} reads a value it may not hold: {:?}, allowed {:?}",
                        disk.0,
                        &got[..8],
                        allowed.iter().map(|a| a[..8].to_vec()).collect::<Vec<_>>()
                    );
                    seen.insert((disk.0, b), got);
                }
            }
            // Everything read is what write-back and write-out leave in
            // the images.
            recovered
                .write_out_held()
                .expect("write out after recovery");
            drop((data, journal));
            for (name, disk, blocks) in [
                (DATA, DATA_DISK, DATA_BLOCKS),
                (JOURNAL, JOURNAL_DISK, u64::from(JOURNAL_BLOCKS)),
            ] {
                let image = opener.get(name).expect("image").snapshot();
                for b in 0..blocks {
                    let at = b as usize * BLOCK;
                    assert!(
                        image[at..at + BLOCK] == seen[&(disk.0, b)][..],
                        "{what}: {name} block {b} differs from what the cache read"
                    );
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 8 * (end - start), "{checked} crash states");
}
