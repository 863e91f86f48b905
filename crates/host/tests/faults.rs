//! Issue 18, done-when 5: faults injected into a cache device at rest
//! (after a crash, before the restart): bit flips in a dirty block, a
//! clean block, a journal batch, a checkpoint and the superblock, and a
//! truncated device. Every fault is repaired (the superblock from its
//! copy, a clean block from its image) or reported naming the images it
//! affects (the device refused unchanged, or the one lost block failing
//! its reads and never written back), and nothing flushed is silently
//! lost or served stale.

use crate::common;

use common::disk_through;
use std::sync::Arc;
use vdcache_backend::{BackendRef, MemBackend};
use vdcache_cache::{CacheConfig, CacheError, FlashCache};
use vdcache_image::{ImageFormat, MemFiles, VirtualDisk};

const BLOCK: u64 = 4096;
const IMAGE: u64 = 4 << 20;
const DEVICE: usize = 32 << 20;
const NAME: &str = "vm/disk.raw";
/// Blocks written (and flushed) through the cache; the rest of the image
/// holds round 0, which reads admit into the cache as clean copies.
const WRITTEN: u64 = 64;
const BATCH_MAGIC: [u8; 4] = 0x5644_4a52u32.to_le_bytes();
const CHECKPOINT_MAGIC: [u8; 4] = 0x5644_434bu32.to_le_bytes();

fn config(checkpoint_interval: Option<u64>) -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        inline_background: true,
        checkpoint_interval_bytes: checkpoint_interval,
        // Nothing is written back: flash alone holds what was written.
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..CacheConfig::default()
    }
}

/// The content of `block` in write round `round`: tagged, so its place on
/// the device can be found and its version told apart.
fn content(block: u64, round: u8) -> Vec<u8> {
    let mut b = vec![round.wrapping_mul(37) ^ block as u8; BLOCK as usize];
    b[..16].copy_from_slice(b"vdcache-faults\0\0");
    b[16..24].copy_from_slice(&block.to_le_bytes());
    b[24] = round;
    b
}

/// A device and an image after a crash: rounds of writes, each flushed,
/// and a read that admitted clean copies of blocks written before.
struct Crashed {
    device: Vec<u8>,
    image: Vec<u8>,
    /// The flushed round of each written block.
    rounds: Vec<u8>,
}

fn open_disk(files: &Arc<MemFiles>, cache: &Arc<FlashCache>) -> VirtualDisk {
    disk_through(files.clone(), cache, NAME, ImageFormat::Raw)
}

fn crashed(checkpoint_interval: Option<u64>) -> Crashed {
    let mut image = vec![0u8; IMAGE as usize];
    for b in 0..IMAGE / BLOCK {
        image[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize].copy_from_slice(&content(b, 0));
    }
    let files = MemFiles::new();
    let store = files.insert(NAME, image);
    let device = Arc::new(MemBackend::fixed("cache", DEVICE));
    let dev: BackendRef = device.clone();
    let cache = FlashCache::format(dev, config(checkpoint_interval)).expect("format");
    let disk = open_disk(&files, &cache);
    let mut rounds = vec![0u8; WRITTEN as usize];
    for round in 1..=6u8 {
        for b in (0..WRITTEN).filter(|b| (b + u64::from(round)) % 3 != 0) {
            disk.write(b * BLOCK, &content(b, round), false)
                .expect("write");
            rounds[b as usize] = round;
        }
        disk.flush().expect("flush");
    }
    // Clean copies: blocks the cache never wrote, read (and admitted).
    let mut buf = vec![0u8; (16 * BLOCK) as usize];
    disk.read(WRITTEN * BLOCK, &mut buf).expect("read");
    disk.flush().expect("flush");
    Crashed {
        device: device.snapshot(),
        image: store.snapshot(),
        rounds,
    }
}

/// Opens the cache a crashed device holds (with `salvage` as asked).
fn reopen(
    device: Vec<u8>,
    image: &[u8],
    salvage: bool,
) -> (
    Result<Arc<FlashCache>, CacheError>,
    Arc<MemBackend>,
    Arc<MemFiles>,
) {
    let files = MemFiles::new();
    files.insert(NAME, image.to_vec());
    let dev = Arc::new(MemBackend::new("cache", device));
    let backend: BackendRef = dev.clone();
    let cfg = CacheConfig {
        salvage,
        ..config(None)
    };
    (FlashCache::open(backend, cfg), dev, files)
}

/// Every written block reads its flushed round, except `lost` (whose read
/// must fail naming the image), and the blocks past them read round 0.
fn check_reads(disk: &VirtualDisk, c: &Crashed, lost: Option<u64>) {
    let mut buf = vec![0u8; BLOCK as usize];
    for b in 0..WRITTEN + 16 {
        let want = if b < WRITTEN { c.rounds[b as usize] } else { 0 };
        match disk.read(b * BLOCK, &mut buf) {
            Ok(()) => {
                assert_ne!(
                    Some(b),
                    lost,
                    "block {b}: a lost block read without an error"
                );
                assert!(
                    buf == content(b, want),
                    "block {b} reads round {} (byte 24), not its flushed round {want}",
                    buf[24]
                );
            }
            Err(e) => {
                assert_eq!(Some(b), lost, "block {b} failed to read: {e}");
                let text = e.to_string();
                assert!(
                    text.contains(NAME) && text.contains("lost"),
                    "the error must name the image and the loss: {text}"
                );
            }
        }
    }
}

/// Device offsets where a block's content of one round lies.
fn places(device: &[u8], block: u64, round: u8) -> Vec<usize> {
    let want = content(block, round);
    (0..device.len() / BLOCK as usize)
        .map(|i| i * BLOCK as usize)
        .filter(|&at| device[at..at + BLOCK as usize] == want[..])
        .collect()
}

/// Offsets (in the device) of journal batch frames, with their sequence.
fn batches(device: &[u8]) -> Vec<(usize, u64)> {
    let mut out: Vec<(usize, u64)> = (0..device.len() / BLOCK as usize)
        .map(|i| i * BLOCK as usize)
        .filter(|&at| device[at..at + 4] == BATCH_MAGIC)
        .map(|at| {
            let mut seq = [0u8; 8];
            seq.copy_from_slice(&device[at + 12..at + 20]);
            (at, u64::from_le_bytes(seq))
        })
        .collect();
    out.sort_by_key(|&(_, seq)| seq);
    out
}

#[test]
fn a_damaged_superblock_is_restored_from_its_copy() {
    let c = crashed(None);
    for damage in [
        |d: &mut Vec<u8>| d[100] ^= 0x10,
        |d: &mut Vec<u8>| d[..4096].fill(0),
    ] {
        let mut device = c.device.clone();
        damage(&mut device);
        let (cache, dev, files) = reopen(device, &c.image, false);
        let cache = cache.expect("a damaged superblock must be repaired from its copy");
        // The superblock's half of its block; the seal (the other half)
        // is written anew by the open.
        assert_eq!(
            dev.snapshot()[..2048],
            c.device[..2048],
            "the superblock was not written again"
        );
        check_reads(&open_disk(&files, &cache), &c, None);
    }
}

#[test]
fn a_device_without_either_superblock_is_refused_never_formatted() {
    let c = crashed(None);
    let mut device = c.device.clone();
    let probe = MemBackend::new("probe", c.device.clone());
    let copy = {
        let cache = FlashCache::open(Arc::new(probe), config(None)).expect("open");
        cache.layout().backup_superblock_offset() as usize
    };
    device[..4096].fill(0);
    device[copy..copy + 4096].fill(0);
    let dev = Arc::new(MemBackend::new("cache", device.clone()));
    let backend: BackendRef = dev.clone();
    let e = FlashCache::open_or_format(backend, config(None)).expect_err("formatted a cache");
    assert!(matches!(e, CacheError::NotBlank { .. }), "{e}");
    assert!(e.to_string().contains("refusing to format"), "{e}");
    assert!(dev.snapshot() == device, "the refused device was changed");
}

#[test]
fn a_damaged_journal_batch_is_told_from_a_torn_tail_and_reported() {
    let c = crashed(None);
    let frames = batches(&c.device);
    assert!(
        frames.len() >= 4,
        "the workload wrote {} batches",
        frames.len()
    );
    // A batch in the middle: later ones record it synced.
    let (at, seq) = frames[frames.len() / 2];
    let mut device = c.device.clone();
    device[at + 56 + 3] ^= 0x01;
    let (cache, dev, _) = reopen(device.clone(), &c.image, false);
    let e = cache.expect_err("a damaged journal batch was taken for a torn tail");
    let text = e.to_string();
    assert!(
        matches!(e, CacheError::Damaged { .. })
            && text.contains(&format!("batch {seq}"))
            && text.contains(NAME),
        "the refusal must name the batch and the image: {text}"
    );
    assert!(dev.snapshot() == device, "the refused device was changed");
    // The last batch was flushed: no later batch records it, the seal
    // does (issue 43, item 3).
    let (last, seq) = *frames.last().expect("a batch");
    let mut device = c.device.clone();
    device[last + 56 + 3] ^= 0x01;
    let (cache, _, _) = reopen(device, &c.image, false);
    let e = cache.expect_err("a damaged flushed batch was taken for a torn tail");
    assert!(
        matches!(e, CacheError::Damaged { .. }) && e.to_string().contains(&format!("batch {seq}")),
        "{e}"
    );
    // Salvaging opens what verifies.
    let mut device = c.device.clone();
    device[at + 56 + 3] ^= 0x01;
    let (cache, _, _) = reopen(device, &c.image, true);
    let cache = cache.expect("salvage opens a damaged journal");
    assert!(cache.report().recovery.salvaged);
}

#[test]
fn a_damaged_checkpoint_is_reported_when_its_journal_is_gone() {
    let c = crashed(Some(16 << 10));
    let probe = MemBackend::new("probe", c.device.clone());
    let (slot0, slot1) = {
        let cache = FlashCache::open(Arc::new(probe), config(None)).expect("open");
        let l = cache.layout();
        (l.slot_offset(0) as usize, l.slot_offset(1) as usize)
    };
    let generation = |at: usize| {
        let mut g = [0u8; 8];
        g.copy_from_slice(&c.device[at + 12..at + 20]);
        (c.device[at..at + 4] == CHECKPOINT_MAGIC).then(|| u64::from_le_bytes(g))
    };
    let newest = match (generation(slot0), generation(slot1)) {
        (Some(a), Some(b)) if a > b => slot0,
        (Some(_), Some(_)) => slot1,
        other => panic!("the workload left checkpoints {other:?}"),
    };
    let mut device = c.device.clone();
    device[newest + 64 + 10] ^= 0x01;
    let (cache, dev, _) = reopen(device.clone(), &c.image, false);
    let e = cache.expect_err("an older checkpoint was used silently");
    assert!(
        matches!(e, CacheError::Damaged { .. }) && e.to_string().contains("checkpoint"),
        "{e}"
    );
    assert!(dev.snapshot() == device, "the refused device was changed");
}

#[test]
fn a_damaged_dirty_block_fails_its_reads_and_is_never_written_back() {
    let c = crashed(None);
    let victim = 10;
    let round = c.rounds[victim as usize];
    let at = places(&c.device, victim, round);
    assert_eq!(
        at.len(),
        1,
        "the flushed copy of block {victim} is in one place"
    );
    let mut device = c.device.clone();
    device[at[0] + 2000] ^= 0x40;
    let (cache, dev, files) = reopen(device, &c.image, false);
    let cache = cache.expect("open");
    let disk = open_disk(&files, &cache);
    check_reads(&disk, &c, Some(victim));
    cache
        .drain()
        .expect("a drain must end despite the lost block");
    let store = files.get(NAME).expect("image").snapshot();
    let at = (victim * BLOCK) as usize;
    assert!(
        store[at..at + BLOCK as usize] == content(victim, 0)[..],
        "the image must keep its older bytes, never the damaged ones"
    );
    assert_eq!(cache.report().unreadable_blocks, 1);
    // Still lost after a clean restart, until written again.
    cache.shutdown(true).expect("shutdown");
    drop(disk);
    drop(cache);
    let (cache, _, files) = reopen(dev.snapshot(), &store, false);
    let cache = cache.expect("reopen");
    let disk = open_disk(&files, &cache);
    check_reads(&disk, &c, Some(victim));
    disk.write(victim * BLOCK, &content(victim, 9), false)
        .expect("write");
    let mut buf = vec![0u8; BLOCK as usize];
    disk.read(victim * BLOCK, &mut buf)
        .expect("the block was written again");
    assert!(buf == content(victim, 9));
    assert_eq!(cache.report().unreadable_blocks, 0);
}

#[test]
fn a_damaged_clean_block_is_read_from_its_image() {
    let c = crashed(None);
    let victim = WRITTEN + 3;
    let at = places(&c.device, victim, 0);
    assert_eq!(at.len(), 1, "the read admitted block {victim}");
    let mut device = c.device.clone();
    device[at[0] + 100] ^= 0x02;
    let (cache, _, files) = reopen(device, &c.image, false);
    let cache = cache.expect("open");
    check_reads(&open_disk(&files, &cache), &c, None);
    assert_eq!(cache.report().unreadable_blocks, 0);
}

#[test]
fn a_truncated_device_is_refused() {
    let c = crashed(None);
    let mut device = c.device.clone();
    device.truncate(DEVICE / 2);
    let (cache, _, _) = reopen(device, &c.image, false);
    let e = cache.expect_err("a truncated device opened");
    assert!(e.to_string().contains("truncated"), "{e}");
}

/// Offsets of the journal and of the checkpoint slots of a device.
fn metadata_places(device: &[u8]) -> (std::ops::Range<usize>, [usize; 2]) {
    let probe = MemBackend::new("probe", device.to_vec());
    let sb = vdcache_cache::layout::Superblock::peek(&probe).expect("a superblock");
    let l = sb.layout;
    (
        l.journal_offset as usize..(l.journal_offset + l.journal_bytes) as usize,
        [l.slot_offset(0) as usize, l.slot_offset(1) as usize],
    )
}

/// The slot holding the newest checkpoint frame of a device.
fn newest_slot(device: &[u8]) -> usize {
    let (_, slots) = metadata_places(device);
    let generation = |at: usize| {
        let mut g = [0u8; 8];
        g.copy_from_slice(&device[at + 12..at + 20]);
        (device[at..at + 4] == CHECKPOINT_MAGIC).then(|| u64::from_le_bytes(g))
    };
    match (generation(slots[0]), generation(slots[1])) {
        (Some(a), Some(b)) if a > b => slots[0],
        (_, Some(_)) => slots[1],
        (Some(_), None) => slots[0],
        other => panic!("no checkpoint: {other:?}"),
    }
}

/// Issue 43, item 2: after a restart (whose checkpoint is two
/// generations past the one it loaded) and more flushed writes, the
/// newest checkpoint's header is damaged: the older checkpoint's journal
/// is gone, and only batches of a later epoch (and the seal) say a newer
/// checkpoint was durable. The device is refused, never opened as it was
/// before the restart.
#[test]
fn a_damaged_checkpoint_epochs_ahead_is_reported() {
    let mut c = crashed(None);
    let (cache, dev, files) = reopen(c.device.clone(), &c.image, false);
    let cache = cache.expect("restart");
    let disk = open_disk(&files, &cache);
    for b in 0..WRITTEN / 2 {
        disk.write(b * BLOCK, &content(b, 7), false).expect("write");
        c.rounds[b as usize] = 7;
    }
    disk.flush().expect("flush");
    // Crash: nothing more is written.
    let device = dev.snapshot();
    drop(disk);
    drop(cache);
    let newest = newest_slot(&device);
    let mut damaged = device.clone();
    damaged[newest + 3] ^= 0x01;
    let (cache, dev, _) = reopen(damaged.clone(), &c.image, false);
    let e = cache.expect_err("an older checkpoint was used silently");
    assert!(
        matches!(e, CacheError::Damaged { .. }) && e.to_string().contains("checkpoint"),
        "{e}"
    );
    assert!(dev.snapshot() == damaged, "the refused device was changed");
}

/// Issue 43, item 2: a zeroed journal after flushed writes is damage,
/// not a cache with nothing to replay.
#[test]
fn a_zeroed_journal_is_reported() {
    let c = crashed(None);
    let (journal, _) = metadata_places(&c.device);
    let mut device = c.device.clone();
    device[journal].fill(0);
    let (cache, _, _) = reopen(device, &c.image, false);
    let e = cache.expect_err("a zeroed journal opened");
    assert!(
        matches!(e, CacheError::Damaged { .. }) && e.to_string().contains("does not verify"),
        "{e}"
    );
}

/// Issue 43, item 3: a batch written after the last flush and never
/// synced is a torn tail: damaged, it is dropped silently, and every
/// flushed block still reads its round.
#[test]
fn a_damaged_unflushed_tail_is_dropped_silently() {
    let c = crashed(None);
    let (cache, dev, files) = reopen(c.device.clone(), &c.image, false);
    let cache = cache.expect("restart");
    let disk = open_disk(&files, &cache);
    // Entries past the journal buffer (64 KiB): a batch goes out before
    // any flush.
    for n in 0..3000u64 {
        let b = n % WRITTEN;
        disk.write(b * BLOCK, &content(b, 8), false).expect("write");
    }
    let device = dev.snapshot();
    drop(disk);
    drop(cache);
    let probe = MemBackend::new("probe", device.clone());
    let tail = vdcache_cache::sites::metadata_sites(&probe)
        .expect("sites")
        .into_iter()
        .find(|s| s.kind == "journal batch" && s.what.contains("last"))
        .expect("a batch went out without a flush");
    let mut damaged = device;
    tail.apply(&mut damaged);
    let (cache, _, files) = reopen(damaged, &c.image, false);
    let cache = cache.expect("a torn tail must recover");
    assert!(!cache.report().recovery.salvaged);
    let disk = open_disk(&files, &cache);
    let mut buf = vec![0u8; BLOCK as usize];
    for b in 0..WRITTEN {
        disk.read(b * BLOCK, &mut buf).expect("read");
        assert!(
            buf == content(b, c.rounds[b as usize]) || buf == content(b, 8),
            "block {b} reads round {}, neither its flushed round {} nor the unflushed 8",
            buf[24],
            c.rounds[b as usize]
        );
    }
}

/// Issue 43, message: a salvage whose damage took the record naming an
/// image (the first batch registered it) cannot make that image
/// standalone, and fails saying so instead of exiting as if done.
#[test]
fn a_salvage_that_lost_an_image_name_fails_saying_what_still_needs_the_cache() {
    let c = crashed(None);
    let first = *batches(&c.device).first().expect("a batch");
    let mut device = c.device.clone();
    device[first.0 + 56 + 3] ^= 0x01;
    let files = MemFiles::new();
    files.insert(NAME, c.image.clone());
    let dev: BackendRef = Arc::new(MemBackend::new("cache", device));
    let how = vdcache_host::FullRecovery {
        salvage: true,
        host: Some("test-host".into()),
        opener: files,
        allow_backing: Vec::new(),
    };
    let e = vdcache_host::recover_full(dev, "cache", &how).expect_err("a lost name was ignored");
    assert!(
        matches!(
            e,
            vdcache_host::HostError::SalvageLostNames { count: 1, .. }
        ) && e.to_string().contains("still marked as needing this cache"),
        "{e}"
    );
}

/// Issue 43, item 3: one byte flipped in a data block the last flushed
/// batch names. No later batch records that batch as synced, the seal
/// does: the block is damage (its reads fail), never the torn end of the
/// log that would roll back the rest of the batch.
#[test]
fn a_damaged_block_of_the_last_flushed_batch_loses_only_that_block() {
    let mut c = crashed(None);
    let (cache, dev, files) = reopen(c.device.clone(), &c.image, false);
    let cache = cache.expect("restart");
    let disk = open_disk(&files, &cache);
    for b in 0..WRITTEN {
        disk.write(b * BLOCK, &content(b, 7), false).expect("write");
        c.rounds[b as usize] = 7;
    }
    disk.flush().expect("flush");
    let device = dev.snapshot();
    drop(disk);
    drop(cache);
    let victim = WRITTEN / 2;
    let at = places(&device, victim, 7);
    assert_eq!(at.len(), 1, "block {victim} is in one place");
    let mut damaged = device;
    damaged[at[0] + 300] ^= 0x04;
    let (cache, _, files) = reopen(damaged, &c.image, false);
    let cache = cache.expect("a damaged block is not a damaged journal");
    assert_eq!(cache.report().recovery.damaged_blocks, 1);
    assert!(!cache.report().recovery.stopped_at_torn_block);
    check_reads(&open_disk(&files, &cache), &c, Some(victim));
}
