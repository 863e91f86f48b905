//! Journal-aware caching (issue 22, JCache): a guest journal device is
//! cached only (its blocks never reach its file while the cache holds
//! them, unless written out), and an in-place write whose bytes equal the
//! block's logged copy shares the copy's cache block instead of taking a
//! flash write. Counted exactly: flash bytes, shared blocks, what the
//! stores hold, through write-back, a crash and reclaim.

use crate::common;

use common::{cache_on, disk_as, drain_only_config};
use std::sync::Arc;
use vdcache_backend::MemBackend;
use vdcache_cache::{CacheConfig, DiskPolicy, FlashCache, WriteMode};
use vdcache_image::{DiskId, ImageFormat, MemFiles, VirtualDisk};
use vdcache_jbd2::build::Writer;

const BLOCK: usize = 4096;
const DATA: &str = "d/data.raw";
const JOURNAL: &str = "d/journal.raw";
const DATA_DISK: DiskId = DiskId(1);
const JOURNAL_DISK: DiskId = DiskId(2);
const JOURNAL_BLOCKS: u32 = 256;

fn config(mode: WriteMode) -> CacheConfig {
    drain_only_config(mode)
}

struct Rig {
    files: Arc<MemFiles>,
    device: Arc<MemBackend>,
    cache: Arc<FlashCache>,
    data: VirtualDisk,
    journal: VirtualDisk,
}

impl Rig {
    fn new(mode: WriteMode, cache_mib: usize) -> Rig {
        let files = MemFiles::new();
        files.insert(DATA, vec![0u8; 64 << 20]);
        files.insert(JOURNAL, vec![0u8; JOURNAL_BLOCKS as usize * BLOCK]);
        let device = Arc::new(MemBackend::fixed("cache", cache_mib << 20));
        let cache = cache_on(&device, &config(mode), true);
        Rig::attach(files, device, cache, mode)
    }

    fn attach(
        files: Arc<MemFiles>,
        device: Arc<MemBackend>,
        cache: Arc<FlashCache>,
        mode: WriteMode,
    ) -> Rig {
        cache.set_policy(
            DATA_DISK,
            DiskPolicy {
                mode,
                sequential_write_cutoff: 0,
                ..DiskPolicy::default()
            },
        );
        cache.set_policy(JOURNAL_DISK, DiskPolicy::journal_device());
        let data = disk_as(files.clone(), &cache, DATA, ImageFormat::Raw, DATA_DISK);
        let journal = disk_as(
            files.clone(),
            &cache,
            JOURNAL,
            ImageFormat::Raw,
            JOURNAL_DISK,
        );
        let mut sb = vec![0u8; BLOCK];
        journal.read(0, &mut sb).expect("read superblock");
        let bits = data.cluster_size().trailing_zeros();
        // A fresh journal has no superblock yet: the guest writes one.
        let _ = cache.link_journal(JOURNAL_DISK, DATA_DISK, bits, Some(&sb));
        Rig {
            files,
            device,
            cache,
            data,
            journal,
        }
    }

    /// The cache reopened from its device as a restart after a crash
    /// finds it (nothing shut down).
    fn crash_and_reopen(self, mode: WriteMode) -> Rig {
        let Rig { files, device, .. } = self;
        let cache = cache_on(&device, &config(mode), false);
        Rig::attach(files, device, cache, mode)
    }

    fn stats(&self, disk: DiskId) -> vdcache_cache::DiskStats {
        self.cache
            .report()
            .disks
            .into_iter()
            .find(|(d, _)| *d == disk.0)
            .map(|(_, s)| s)
            .unwrap_or_default()
    }

    fn file(&self, name: &str) -> Vec<u8> {
        self.files.get(name).expect("file").snapshot()
    }
}

/// Blocks of file-system block content: distinct per block and round.
fn content(fs_block: u64, round: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (fs_block as u8).wrapping_mul(31) ^ round ^ (i as u8))
        .collect()
}

/// A journal of `JOURNAL_BLOCKS` blocks (superblock in block 0) logging
/// `targets` in one committed transaction; returns its blocks.
fn journal_image(targets: &[u64], round: u8) -> Vec<u8> {
    let mut w = Writer::new(
        2,
        BLOCK as u32,
        JOURNAL_BLOCKS,
        vdcache_jbd2::FEATURE_CSUM_V3 | vdcache_jbd2::FEATURE_64BIT,
        1,
        1,
    );
    let copies: Vec<(u64, Vec<u8>)> = targets.iter().map(|&t| (t, content(t, round))).collect();
    w.transaction(&copies, &[], true);
    w.finish()
}

/// Writes the journal as the guest's kernel would: superblock, then the
/// log block by block.
fn write_journal(rig: &Rig, image: &[u8], blocks: std::ops::Range<usize>) {
    for b in blocks {
        rig.journal
            .write(
                (b * BLOCK) as u64,
                &image[b * BLOCK..(b + 1) * BLOCK],
                false,
            )
            .expect("journal write");
    }
}

/// The in-place writes (checkpoint) of `targets`, each its own request.
fn checkpoint(rig: &Rig, targets: &[u64], round: u8) {
    for &t in targets {
        rig.data
            .write(t * BLOCK as u64, &content(t, round), false)
            .expect("in-place write");
    }
}

fn read_block(disk: &VirtualDisk, fs_block: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    disk.read(fs_block * BLOCK as u64, &mut b).expect("read");
    b
}

const TARGETS: [u64; 6] = [10, 11, 12, 200, 201, 3000];

#[test]
fn in_place_writes_share_their_journal_copies_and_reach_the_image_on_write_back() {
    let rig = Rig::new(WriteMode::WriteBack, 32);
    let image = journal_image(&TARGETS, 1);
    write_journal(&rig, &image, 0..10);
    let flash_before = rig.stats(DATA_DISK).flash_bytes_written;
    checkpoint(&rig, &TARGETS, 1);
    let s = rig.stats(DATA_DISK);
    assert_eq!(s.journal_copies_shared, TARGETS.len() as u64);
    assert_eq!(
        s.flash_bytes_written, flash_before,
        "no in-place block was written to flash"
    );
    for &t in &TARGETS {
        assert_eq!(read_block(&rig.data, t), content(t, 1), "block {t}");
    }
    // Dirty: the data file does not hold them yet, and the journal file
    // never gets its blocks while the cache holds them.
    assert_ne!(&rig.file(DATA)[10 * BLOCK..11 * BLOCK], &content(10, 1)[..]);
    rig.cache.drain().expect("drain");
    let data = rig.file(DATA);
    for &t in &TARGETS {
        let at = t as usize * BLOCK;
        assert_eq!(
            &data[at..at + BLOCK],
            &content(t, 1)[..],
            "block {t} written back"
        );
    }
    assert!(
        rig.file(JOURNAL).iter().all(|&b| b == 0),
        "a drain leaves the journal in flash (cache-only logging)"
    );
    let report = rig.cache.report();
    assert_eq!(
        report.held_bytes,
        10 * BLOCK as u64,
        "the journal's ten blocks are held"
    );
    // An explicit write-out completes the journal file.
    rig.cache.write_out_held().expect("write out");
    assert_eq!(rig.file(JOURNAL)[..10 * BLOCK], image[..10 * BLOCK]);
    assert_eq!(rig.cache.report().held_bytes, 0);
}

#[test]
fn different_bytes_or_a_journal_rewritten_meanwhile_share_nothing_wrong() {
    let rig = Rig::new(WriteMode::WriteBack, 32);
    let image = journal_image(&TARGETS, 1);
    write_journal(&rig, &image, 0..10);
    // Block 10 is written with other bytes than its logged copy.
    rig.data
        .write(10 * BLOCK as u64, &content(10, 9), false)
        .expect("write");
    let s = rig.stats(DATA_DISK);
    assert_eq!(s.journal_copies_shared, 0);
    assert_eq!(s.journal_copy_mismatches, 1);
    assert_eq!(read_block(&rig.data, 10), content(10, 9));
    // Block 11 shares its copy; then the journal's place is reused by a
    // later transaction with other content: block 11 keeps its bytes.
    checkpoint(&rig, &[11], 1);
    assert_eq!(rig.stats(DATA_DISK).journal_copies_shared, 1);
    let later = journal_image(&[500, 501, 502], 2);
    write_journal(&rig, &later, 0..10);
    assert_eq!(read_block(&rig.data, 11), content(11, 1));
    assert_eq!(read_block(&rig.journal, 3), later[3 * BLOCK..4 * BLOCK]);
    rig.cache.drain().expect("drain");
    let data = rig.file(DATA);
    assert_eq!(&data[11 * BLOCK..12 * BLOCK], &content(11, 1)[..]);
    assert_eq!(&data[10 * BLOCK..11 * BLOCK], &content(10, 9)[..]);
}

#[test]
fn shared_blocks_survive_a_crash_and_count_once_in_their_region() {
    let rig = Rig::new(WriteMode::WriteBack, 32);
    let image = journal_image(&TARGETS, 1);
    write_journal(&rig, &image, 0..10);
    checkpoint(&rig, &TARGETS, 1);
    rig.data.flush().expect("guest flush");
    let before = rig.cache.report();
    rig.cache.audit_regions().expect("before the crash");
    let rig = rig.crash_and_reopen(WriteMode::WriteBack);
    rig.cache.audit_regions().expect("after recovery");
    let after = rig.cache.report();
    assert_eq!(after.cached_bytes, before.cached_bytes);
    assert_eq!(after.dirty_bytes, before.dirty_bytes);
    assert_eq!(
        after.held_bytes,
        10 * BLOCK as u64,
        "the journal device is held again once attached"
    );
    for &t in &TARGETS {
        assert_eq!(read_block(&rig.data, t), content(t, 1), "block {t}");
    }
    assert_eq!(read_block(&rig.journal, 2), image[2 * BLOCK..3 * BLOCK]);
    // Each shared block is live once: dropping both addresses frees it,
    // and the region's count comes back to what it was.
    rig.cache.drain().expect("drain");
    rig.cache.write_out_held().expect("write out");
    rig.cache.audit_regions().expect("after write-back");
    assert_eq!(rig.file(JOURNAL)[..10 * BLOCK], image[..10 * BLOCK]);
    let data = rig.file(DATA);
    for &t in &TARGETS {
        let at = t as usize * BLOCK;
        assert_eq!(&data[at..at + BLOCK], &content(t, 1)[..], "block {t}");
    }
}

#[test]
fn write_through_keeps_the_copy_as_its_clean_block() {
    let rig = Rig::new(WriteMode::WriteThrough, 32);
    let image = journal_image(&TARGETS, 1);
    write_journal(&rig, &image, 0..10);
    assert!(
        rig.file(JOURNAL).iter().all(|&b| b == 0),
        "the journal stays in flash even in write-through mode"
    );
    let flash_before = rig.stats(DATA_DISK).flash_bytes_written;
    checkpoint(&rig, &TARGETS, 1);
    let s = rig.stats(DATA_DISK);
    assert_eq!(s.journal_copies_shared, TARGETS.len() as u64);
    assert_eq!(s.flash_bytes_written, flash_before);
    assert_eq!(s.backend_bytes_written, (TARGETS.len() * BLOCK) as u64);
    let data = rig.file(DATA);
    for &t in &TARGETS {
        let at = t as usize * BLOCK;
        assert_eq!(&data[at..at + BLOCK], &content(t, 1)[..], "written through");
        assert_eq!(read_block(&rig.data, t), content(t, 1));
    }
    assert_eq!(rig.stats(DATA_DISK).read_hit_blocks, TARGETS.len() as u64);
}

#[test]
fn reclaim_moves_held_blocks_instead_of_writing_them_out() {
    // The smallest cache (16 MiB): filling it twice over with other
    // data reclaims the journal's region.
    let rig = Rig::new(WriteMode::WriteBack, 16);
    let image = journal_image(&TARGETS, 1);
    write_journal(&rig, &image, 0..10);
    let chunk = vec![0x5au8; 256 * 1024];
    for i in 0..160u64 {
        let at = (1 << 20) + (i * chunk.len() as u64) % (60 << 20);
        rig.data.write(at, &chunk, false).expect("fill");
        rig.cache.drain().expect("drain");
    }
    assert!(
        rig.cache.report().regions_emptied_by_summary + rig.cache.report().regions_emptied_by_scan
            > 0,
        "regions were reclaimed"
    );
    assert!(
        rig.file(JOURNAL).iter().all(|&b| b == 0),
        "held blocks were moved, not written out"
    );
    assert_eq!(rig.cache.report().held_bytes, 10 * BLOCK as u64);
    rig.cache.audit_regions().expect("regions");
    for b in 0..10 {
        assert_eq!(
            read_block(&rig.journal, b),
            image[b as usize * BLOCK..(b as usize + 1) * BLOCK]
        );
    }
}

#[test]
fn a_journal_taking_most_of_flash_is_written_out_when_space_runs_short() {
    // 16 MiB of cache, a journal of twice that: once held blocks would
    // take more than half of flash, reclaim writes them to their file
    // instead of moving them, so nothing is lost and flash keeps room.
    let files = MemFiles::new();
    files.insert(DATA, vec![0u8; 64 << 20]);
    files.insert(JOURNAL, vec![0u8; 32 << 20]);
    let device = Arc::new(MemBackend::fixed("cache", 16 << 20));
    let cache = cache_on(&device, &config(WriteMode::WriteBack), true);
    let rig = Rig::attach(files, device, cache, WriteMode::WriteBack);
    let blocks = (32 << 20) / BLOCK as u64;
    for b in 0..blocks {
        let value = content(b, 4);
        rig.journal
            .write(b * BLOCK as u64, &value, false)
            .expect("journal write");
    }
    let report = rig.cache.report();
    assert!(
        report.held_bytes <= report.data_bytes / 2 + (4 << 20),
        "held {} of {} bytes of flash",
        report.held_bytes,
        report.data_bytes
    );
    rig.cache.audit_regions().expect("regions");
    let stored = rig.file(JOURNAL);
    let written_out = (0..blocks)
        .filter(|&b| stored[b as usize * BLOCK..(b as usize + 1) * BLOCK] == content(b, 4)[..])
        .count() as u64;
    assert!(
        written_out >= blocks / 3,
        "only {written_out} of {blocks} journal blocks reached their file"
    );
    for b in (0..blocks).step_by(97) {
        assert_eq!(
            read_block(&rig.journal, b),
            content(b, 4),
            "journal block {b}"
        );
    }
}
