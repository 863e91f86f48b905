//! Deduplication (issue 21, DASH): a block whose bytes flash already holds
//! shares that cache block, within a disk and across disks, for writes
//! (write-back and write-through) and for reads promoted from the images;
//! each address keeps its own dirty state. Counted exactly: flash bytes,
//! shared blocks, what the images hold after write-back, through a crash;
//! and with a hasher made to collide, verify mode never serves another
//! block's bytes (while trusting the hash does).

use crate::common;

use common::{cache_on, disk_as, drain_only_config};
use std::sync::Arc;
use vdcache_backend::{Backend, MemBackend};
use vdcache_cache::{Admission, CacheConfig, Dedup, FlashCache, WriteMode};
use vdcache_image::{DiskId, ImageFormat, MemFiles, VirtualDisk};

const BLOCK: usize = 4096;
const IMAGE_BYTES: usize = 16 << 20;

fn config(mode: WriteMode, dedup: Dedup) -> CacheConfig {
    CacheConfig {
        dedup,
        ..drain_only_config(mode)
    }
}

struct Rig {
    files: Arc<MemFiles>,
    device: Arc<MemBackend>,
    cache: Arc<FlashCache>,
    disks: Vec<VirtualDisk>,
    config: CacheConfig,
}

fn name(i: usize) -> String {
    format!("d/clone{i}.raw")
}

impl Rig {
    /// `n` raw images (clones) through one cache, disks 1..=n.
    fn new(n: usize, config: CacheConfig) -> Rig {
        Rig::with_images(n, IMAGE_BYTES, config)
    }

    /// `n` raw images of `bytes` each through one cache, disks 1..=n.
    fn with_images(n: usize, bytes: usize, config: CacheConfig) -> Rig {
        let files = MemFiles::new();
        for i in 0..n {
            files.insert(&name(i), vec![0u8; bytes]);
        }
        let device = Arc::new(MemBackend::fixed("cache", 32 << 20));
        let cache = cache_on(&device, &config, true);
        Rig::attach(files, device, cache, n, config)
    }

    fn attach(
        files: Arc<MemFiles>,
        device: Arc<MemBackend>,
        cache: Arc<FlashCache>,
        n: usize,
        config: CacheConfig,
    ) -> Rig {
        let disks = (0..n)
            .map(|i| {
                disk_as(
                    files.clone(),
                    &cache,
                    &name(i),
                    ImageFormat::Raw,
                    DiskId(i as u32 + 1),
                )
            })
            .collect();
        Rig {
            files,
            device,
            cache,
            disks,
            config,
        }
    }

    /// The cache reopened from its device as after a crash.
    fn crash_and_reopen(self) -> Rig {
        let dedup = self.config.dedup;
        self.crash_and_reopen_with(dedup)
    }

    /// The cache reopened as after a crash, with dedup now `dedup`.
    fn crash_and_reopen_with(self, dedup: Dedup) -> Rig {
        let n = self.disks.len();
        let Rig {
            files,
            device,
            config,
            ..
        } = self;
        let config = CacheConfig { dedup, ..config };
        let cache = cache_on(&device, &config, false);
        Rig::attach(files, device, cache, n, config)
    }

    /// Every disk flushed: what they wrote survives a crash.
    fn flush_all(&self) {
        for d in &self.disks {
            d.flush().expect("flush");
        }
    }

    fn flash_data_written(&self) -> u64 {
        self.cache.report().device.data_bytes_written
    }

    fn shared(&self) -> u64 {
        self.cache.report().total.dedup_blocks_shared
    }

    fn file(&self, i: usize) -> Vec<u8> {
        self.files.get(&name(i)).expect("file").snapshot()
    }
}

/// A block of distinct bytes per `n`.
fn content(n: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (n as u8).wrapping_mul(37) ^ (n >> 8) as u8 ^ (i as u8).wrapping_mul(3))
        .collect()
}

fn read_block(disk: &VirtualDisk, b: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    disk.read(b * BLOCK as u64, &mut buf).expect("read");
    buf
}

fn write_block(disk: &VirtualDisk, b: u64, data: &[u8]) {
    disk.write(b * BLOCK as u64, data, false).expect("write");
}

fn block_of(file: &[u8], b: u64) -> &[u8] {
    &file[b as usize * BLOCK..(b as usize + 1) * BLOCK]
}

#[test]
fn the_same_bytes_at_many_addresses_and_disks_take_one_block_and_reach_every_image() {
    let rig = Rig::new(4, config(WriteMode::WriteBack, Dedup::On));
    let before = rig.flash_data_written();
    // 64 distinct blocks, written by every clone at its own offsets, and
    // twice within the first.
    for (i, d) in rig.disks.iter().enumerate() {
        for n in 0..64u64 {
            write_block(d, 100 + n * 3 + i as u64 * 7, &content(n));
        }
    }
    for n in 0..64u64 {
        write_block(&rig.disks[0], 2000 + n, &content(n));
    }
    let written = rig.flash_data_written() - before;
    // The staging may write a chunk's summary block too; never a copy.
    assert!(
        written < 2 * 64 * BLOCK as u64,
        "{written} bytes for 64 distinct blocks"
    );
    assert_eq!(rig.shared(), 4 * 64, "every repeat shared a block");
    let report = rig.cache.report();
    let dedup = report.dedup.expect("dedup report");
    assert_eq!(dedup.unique_blocks, 64);
    assert!((dedup.ratio - 5.0).abs() < 1e-9, "{}", dedup.ratio);
    rig.cache.audit_regions().expect("regions");
    for (i, d) in rig.disks.iter().enumerate() {
        for n in 0..64u64 {
            assert_eq!(read_block(d, 100 + n * 3 + i as u64 * 7), content(n));
        }
    }
    // A dirty shared block is written back to every dirty address.
    rig.cache.drain().expect("drain");
    for i in 0..4 {
        let f = rig.file(i);
        for n in 0..64u64 {
            assert_eq!(block_of(&f, 100 + n * 3 + i as u64 * 7), &content(n)[..]);
        }
    }
    let f = rig.file(0);
    for n in 0..64u64 {
        assert_eq!(block_of(&f, 2000 + n), &content(n)[..]);
    }
}

/// Blocks fingerprinted (BLAKE3) so far, over every disk.
fn hashed(rig: &Rig) -> u64 {
    rig.cache.report().total.hashed_blocks
}

#[test]
fn only_blocks_whose_checksum_flash_holds_are_fingerprinted() {
    let rig = Rig::new(2, config(WriteMode::WriteBack, Dedup::On));
    for n in 0..64u64 {
        write_block(&rig.disks[0], n, &content(n));
    }
    let counts = |rig: &Rig| rig.cache.report().dedup.expect("dedup").counts;
    assert_eq!(hashed(&rig), 0, "unique blocks cost a lookup, no hash");
    assert_eq!((counts(&rig).lookups, counts(&rig).candidates), (64, 0));
    // The first duplicate of each block fingerprints itself and compares
    // its bytes with the cached block's (read from flash), which learns
    // its fingerprint: no second hash.
    let read = rig.cache.report().total.flash_bytes_read;
    for n in 0..64u64 {
        write_block(&rig.disks[1], 500 + n, &content(n));
    }
    assert_eq!(hashed(&rig), 64);
    assert_eq!(
        rig.cache.report().total.flash_bytes_read - read,
        64 * BLOCK as u64
    );
    let dedup = rig.cache.report().dedup.expect("dedup");
    assert_eq!((dedup.fingerprints, dedup.counts.found), (64, 64));
    // Later duplicates fingerprint only themselves.
    for n in 0..64u64 {
        write_block(&rig.disks[0], 1000 + n, &content(n));
    }
    assert_eq!(hashed(&rig), 128);
    assert_eq!(rig.shared(), 128);
    assert_eq!(counts(&rig).collisions, 0);
    // One write of 8 blocks with the same bytes, all matching one cached
    // block whose fingerprint is not known yet: it is read once, and only
    // the first of the 8 is fingerprinted (the others are compared with
    // it in memory).
    write_block(&rig.disks[1], 3000, &content(99));
    let read = rig.cache.report().total.flash_bytes_read;
    let same: Vec<u8> = (0..8).flat_map(|_| content(99)).collect();
    rig.disks[0]
        .write(4000 * BLOCK as u64, &same, false)
        .expect("write");
    assert_eq!(hashed(&rig), 128 + 1);
    assert_eq!(
        rig.cache.report().total.flash_bytes_read - read,
        BLOCK as u64
    );
    assert_eq!(rig.shared(), 136);
    // Again, now that the block's fingerprint is known: one hash, no read.
    let read = rig.cache.report().total.flash_bytes_read;
    rig.disks[1]
        .write(2000 * BLOCK as u64, &same, false)
        .expect("write");
    assert_eq!(hashed(&rig), 128 + 2);
    assert_eq!(rig.cache.report().total.flash_bytes_read, read);
    assert_eq!(rig.shared(), 144);
    for b in (4000..4008).chain(2000..2008) {
        let disk = &rig.disks[usize::from(b < 4000)];
        assert_eq!(read_block(disk, b), content(99));
    }
    for n in 0..64u64 {
        assert_eq!(read_block(&rig.disks[1], 500 + n), content(n));
        assert_eq!(read_block(&rig.disks[0], 1000 + n), content(n));
    }
}

#[test]
fn overwriting_one_sharer_leaves_the_others_their_bytes() {
    let rig = Rig::new(2, config(WriteMode::WriteBack, Dedup::On));
    write_block(&rig.disks[0], 10, &content(1));
    write_block(&rig.disks[1], 20, &content(1));
    write_block(&rig.disks[0], 30, &content(1));
    assert_eq!(rig.shared(), 2);
    // One sharer overwritten, another discarded, another written back.
    write_block(&rig.disks[0], 10, &content(2));
    rig.disks[0]
        .discard(30 * BLOCK as u64, BLOCK as u64)
        .expect("discard");
    assert_eq!(read_block(&rig.disks[1], 20), content(1));
    assert_eq!(read_block(&rig.disks[0], 10), content(2));
    rig.cache.audit_regions().expect("regions");
    rig.cache.drain().expect("drain");
    assert_eq!(block_of(&rig.file(1), 20), &content(1)[..]);
    assert_eq!(block_of(&rig.file(0), 10), &content(2)[..]);
    // Clean now, still shared: overwriting the clean one keeps the other.
    write_block(&rig.disks[1], 40, &content(2));
    write_block(&rig.disks[0], 10, &content(3));
    assert_eq!(read_block(&rig.disks[1], 40), content(2));
    rig.cache.drain().expect("drain");
    assert_eq!(block_of(&rig.file(1), 40), &content(2)[..]);
    rig.cache.audit_regions().expect("regions");
}

#[test]
fn shared_blocks_survive_a_crash() {
    let rig = Rig::new(3, config(WriteMode::WriteBack, Dedup::On));
    for (i, d) in rig.disks.iter().enumerate() {
        for n in 0..32u64 {
            write_block(d, 50 + n + i as u64 * 100, &content(n));
        }
        d.flush().expect("flush");
    }
    let before = rig.cache.report();
    let rig = rig.crash_and_reopen();
    rig.cache.audit_regions().expect("after recovery");
    let after = rig.cache.report();
    assert_eq!(after.cached_bytes, before.cached_bytes);
    assert_eq!(after.dirty_bytes, before.dirty_bytes);
    assert_eq!(
        after.dedup.expect("dedup").unique_blocks,
        32,
        "still one block per content"
    );
    for (i, d) in rig.disks.iter().enumerate() {
        for n in 0..32u64 {
            assert_eq!(
                read_block(d, 50 + n + i as u64 * 100),
                content(n),
                "disk {i}"
            );
        }
    }
    // The open rebuilt the signature table from the checksums the cache
    // keeps: new writes of the same bytes share the blocks cached before
    // the crash.
    let dedup = rig.cache.report().dedup.expect("dedup");
    assert_eq!((dedup.signatures, dedup.fingerprints), (32, 0));
    let shared = rig.shared();
    let written = rig.flash_data_written();
    for n in 0..32u64 {
        write_block(&rig.disks[0], 3000 + n, &content(n));
    }
    assert_eq!(rig.shared() - shared, 32);
    assert!(rig.flash_data_written() - written < 32 * BLOCK as u64);
    rig.cache.drain().expect("drain");
    for i in 0..3 {
        let f = rig.file(i);
        for n in 0..32u64 {
            assert_eq!(block_of(&f, 50 + n + i as u64 * 100), &content(n)[..]);
        }
    }
    assert_eq!(block_of(&rig.file(0), 3010), &content(10)[..]);
}

#[test]
fn turning_dedup_off_and_on_again_keeps_every_address_right() {
    // An operator restarts with dedup off, then on again: blocks shared
    // before stay shared and right, nothing new is shared while it is
    // off, and once it is on again new writes share the old blocks.
    let rig = Rig::new(2, config(WriteMode::WriteBack, Dedup::On));
    for n in 0..16u64 {
        write_block(&rig.disks[0], n, &content(n));
        write_block(&rig.disks[1], 100 + n, &content(n));
    }
    assert_eq!(rig.shared(), 16);
    rig.flush_all();
    let rig = rig.crash_and_reopen_with(Dedup::Off);
    assert!(rig.cache.report().dedup.is_none());
    assert_eq!(rig.cache.report().total.hashed_blocks, 0);
    for n in 0..16u64 {
        write_block(&rig.disks[0], 200 + n, &content(n));
    }
    assert_eq!(rig.shared(), 0, "nothing shared with dedup off");
    // One sharer overwritten while dedup is off: the other keeps its bytes.
    write_block(&rig.disks[0], 3, &content(77));
    rig.cache.audit_regions().expect("regions");
    rig.flush_all();
    let rig = rig.crash_and_reopen_with(Dedup::On);
    for n in 0..16u64 {
        write_block(&rig.disks[1], 300 + n, &content(n));
    }
    assert_eq!(rig.shared(), 16, "the old blocks are found again");
    for n in 0..16u64 {
        let first = if n == 3 { content(77) } else { content(n) };
        assert_eq!(read_block(&rig.disks[0], n), first);
        for b in [100 + n, 300 + n] {
            assert_eq!(read_block(&rig.disks[1], b), content(n));
        }
        assert_eq!(read_block(&rig.disks[0], 200 + n), content(n));
    }
    rig.cache.audit_regions().expect("regions");
    rig.cache.drain().expect("drain");
    assert_eq!(block_of(&rig.file(0), 3), &content(77)[..]);
    assert_eq!(block_of(&rig.file(1), 303), &content(3)[..]);
}

#[test]
fn write_through_copies_and_promoted_reads_of_equal_bases_share_too() {
    let rig = Rig::new(2, config(WriteMode::WriteThrough, Dedup::On));
    for n in 0..16u64 {
        write_block(&rig.disks[0], n, &content(n));
    }
    let written = rig.flash_data_written();
    for n in 0..16u64 {
        write_block(&rig.disks[1], 500 + n, &content(n));
    }
    assert_eq!(rig.shared(), 16);
    assert!(rig.flash_data_written() - written < 16 * BLOCK as u64);
    assert_eq!(
        block_of(&rig.file(1), 505),
        &content(5)[..],
        "written through"
    );
    // Two images with equal bytes at different names (clones of equal
    // bases): the second one's read misses are promoted by sharing.
    let files = MemFiles::new();
    let mut image = vec![0u8; IMAGE_BYTES];
    for n in 0..16u64 {
        image[n as usize * BLOCK..(n as usize + 1) * BLOCK].copy_from_slice(&content(n + 100));
    }
    files.insert(&name(0), image.clone());
    files.insert(&name(1), image);
    let device = Arc::new(MemBackend::fixed("cache", 32 << 20));
    let cfg = config(WriteMode::WriteBack, Dedup::On);
    let cache = cache_on(&device, &cfg, true);
    let rig = Rig::attach(files, device, cache, 2, cfg);
    let mut buf = vec![0u8; 16 * BLOCK];
    rig.disks[0].read(0, &mut buf).expect("read base 0");
    let promoted = rig.flash_data_written();
    rig.disks[1].read(0, &mut buf).expect("read base 1");
    assert_eq!(&buf[5 * BLOCK..6 * BLOCK], &content(105)[..]);
    assert_eq!(
        rig.shared(),
        16,
        "the second base's blocks shared the first's"
    );
    assert!(rig.flash_data_written() - promoted < 16 * BLOCK as u64);
    assert_eq!(rig.cache.report().total.read_miss_blocks, 32);
    rig.disks[1].read(0, &mut buf).expect("read again");
    assert_eq!(rig.cache.report().total.read_hit_blocks, 16, "now hits");
    rig.cache.audit_regions().expect("regions");
}

/// CRC-32C (Castagnoli, reflected) table, for forging a collision.
fn crc_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
        }
        *e = c;
    }
    t
}

/// Sets the last four bytes of `block` so that its CRC-32C is `want`:
/// the CRC's register is walked back from the wanted value (each table
/// entry's top byte names its index), then the bytes that lead there are
/// computed forward.
fn forge_crc(block: &mut [u8], want: u32) {
    let t = crc_table();
    let n = block.len();
    let mut state = !0u32;
    for &b in &block[..n - 4] {
        state = (state >> 8) ^ t[((state ^ u32::from(b)) & 0xff) as usize];
    }
    let mut target = !want;
    let mut idx = [0u8; 4];
    for k in (0..4).rev() {
        let i = t
            .iter()
            .position(|&e| e >> 24 == target >> 24)
            .expect("a permutation");
        idx[k] = i as u8;
        target = (target ^ t[i]) << 8;
    }
    for (k, &i) in idx.iter().enumerate() {
        let b = (state ^ u32::from(i)) as u8;
        block[n - 4 + k] = b;
        state = (state >> 8) ^ t[i as usize];
    }
    assert_eq!(crc32c::crc32c(block), want, "forged");
}

/// Two different blocks with the same CRC-32C and the same first byte of
/// BLAKE3: what the cache's weak test fingerprint cannot tell apart.
fn colliding_pair() -> (Vec<u8>, Vec<u8>) {
    let a = content(1);
    let weak = |b: &[u8]| blake3::hash(b).as_bytes()[0];
    for salt in 0..100_000u32 {
        let mut b = content(2);
        b[..4].copy_from_slice(&salt.to_le_bytes());
        forge_crc(&mut b, crc32c::crc32c(&a));
        if weak(&b) == weak(&a) {
            return (a, b);
        }
    }
    panic!("no colliding pair found");
}

/// Writes the two colliding blocks through a cache whose fingerprints keep
/// one byte (`weak`) or all 128 bits; returns what the colliding block's
/// address reads, and the collisions the cache counted. The first block
/// is written twice first: its first duplicate is compared byte by byte
/// and teaches the cache its fingerprint, which the colliding block then
/// meets.
fn colliding(dedup: Dedup, weak: bool) -> (Vec<u8>, Vec<u8>, u64) {
    let cfg = CacheConfig {
        test_weak_fingerprints: weak,
        ..config(WriteMode::WriteBack, dedup)
    };
    let (a, b) = colliding_pair();
    let rig = Rig::new(1, cfg);
    write_block(&rig.disks[0], 0, &a);
    write_block(&rig.disks[0], 2, &a);
    write_block(&rig.disks[0], 1, &b);
    assert!(read_block(&rig.disks[0], 2) == a);
    let collisions = rig.cache.report().dedup.map_or(0, |d| d.counts.collisions);
    (read_block(&rig.disks[0], 1), b, collisions)
}

#[test]
fn with_colliding_fingerprints_verify_never_serves_another_blocks_bytes() {
    let (got, want, collisions) = colliding(Dedup::Verify, true);
    assert!(got == want, "verify compared the bytes");
    assert_eq!(collisions, 1, "the collision was found and refused");
    // The same hasher trusted serves the other block's bytes: the test's
    // hasher (and checksum) really collide, which a 128-bit BLAKE3 prefix
    // does not in practice.
    let (got, want, _) = colliding(Dedup::On, true);
    assert!(
        got != want,
        "a trusted colliding fingerprint shares the block"
    );
}

/// A candidate whose fingerprint the cache has not learned is read anyway,
/// so its bytes are compared, not fingerprinted: even a hasher made to
/// collide cannot share it with other bytes.
#[test]
fn a_first_duplicate_is_compared_byte_by_byte() {
    let cfg = CacheConfig {
        test_weak_fingerprints: true,
        ..config(WriteMode::WriteBack, Dedup::On)
    };
    let (a, b) = colliding_pair();
    let rig = Rig::new(1, cfg);
    write_block(&rig.disks[0], 0, &a);
    write_block(&rig.disks[0], 1, &b);
    assert!(read_block(&rig.disks[0], 1) == b);
    let counts = rig.cache.report().dedup.expect("dedup").counts;
    assert_eq!(
        (counts.candidates, counts.found, counts.collisions),
        (1, 0, 1)
    );
}

#[test]
fn an_equal_checksum_alone_never_shares_a_block() {
    // The pair's CRC-32C is equal: the checksum makes the second block a
    // candidate, and the full fingerprint refuses it.
    let (got, want, collisions) = colliding(Dedup::On, false);
    assert!(got == want, "the fingerprints were compared");
    assert_eq!(collisions, 1);
}

#[test]
fn reclaim_keeps_every_address_of_shared_blocks_right() {
    // The smallest cache: filling it with other data reclaims the regions
    // holding the shared blocks (hot ones are moved; a block another of
    // its addresses moved already is followed, not copied again).
    let files = MemFiles::new();
    files.insert(&name(0), vec![0u8; 64 << 20]);
    let cfg = config(WriteMode::WriteBack, Dedup::On);
    let device = Arc::new(MemBackend::fixed("cache", 16 << 20));
    let cache = cache_on(&device, &cfg, true);
    let rig = Rig::attach(files, device, cache, 1, cfg);
    let d = &rig.disks[0];
    for copy in 0..8u64 {
        for n in 0..64u64 {
            write_block(d, copy * 100 + n, &content(n));
        }
    }
    // Read twice: the regions are hot, so reclaim moves their blocks.
    for _ in 0..2 {
        for copy in 0..8u64 {
            for n in 0..64u64 {
                assert!(read_block(d, copy * 100 + n) == content(n));
            }
        }
    }
    let moved_before = rig.flash_data_written();
    for i in 0..96u64 {
        // 64 blocks, each of its own bytes (equal blocks would share one).
        let chunk: Vec<u8> = (0..256 * 1024u64)
            .map(|k| {
                let word = (k / 8 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (i + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
                (word >> (k % 8 * 8)) as u8
            })
            .collect();
        d.write(
            (16 << 20) + i * chunk.len() as u64 % (40 << 20),
            &chunk,
            false,
        )
        .expect("fill");
        rig.cache.drain().expect("drain");
    }
    let r = rig.cache.report();
    assert!(
        r.regions_emptied_by_summary + r.regions_emptied_by_scan > 0,
        "regions were reclaimed"
    );
    assert!(rig.flash_data_written() > moved_before);
    rig.cache.audit_regions().expect("regions");
    for copy in 0..8u64 {
        for n in 0..64u64 {
            assert!(
                read_block(d, copy * 100 + n) == content(n),
                "copy {copy} block {n} reads other bytes"
            );
        }
    }
    rig.cache.drain().expect("drain");
    let f = rig.file(0);
    for copy in 0..8u64 {
        for n in 0..64u64 {
            assert!(block_of(&f, copy * 100 + n) == &content(n)[..]);
        }
    }
}

/// A checkpoint has room for a line per cache block, not for every
/// address that could share one: clones writing one block at 98,304
/// addresses, each in a line of its own, would outgrow it (2.9 MB of lines
/// for a slot of 2.1 MB, formatted for dedup; a checkpoint that does not
/// fit fails writes and opens with "cache device is corrupt"). Sharing stops while one more
/// address could; the rest is written as copies, and every address reads
/// its bytes, before and after a crash (the open writes a checkpoint).
#[test]
fn sharing_stops_before_the_checkpoint_outgrows_its_slot() {
    const IMAGE: usize = 1 << 30;
    let (disks, lines) = (6usize, (IMAGE / (16 * BLOCK)) as u64);
    let rig = Rig::with_images(disks, IMAGE, config(WriteMode::WriteBack, Dedup::On));
    let data = content(7);
    for d in &rig.disks {
        for line in 0..lines {
            write_block(d, line * 16, &data);
        }
    }
    rig.flush_all();
    let dedup = rig.cache.report().dedup.expect("dedup").counts;
    assert!(dedup.no_room > 0, "{dedup:?}");
    assert!(rig.shared() > 1000, "{} shared", rig.shared());
    assert_eq!(rig.shared() + dedup.no_room, dedup.found);
    let every_address_reads_its_bytes = |rig: &Rig| {
        for d in &rig.disks {
            for line in 0..lines {
                assert_eq!(read_block(d, line * 16), data);
            }
        }
    };
    every_address_reads_its_bytes(&rig);
    let rig = rig.crash_and_reopen();
    every_address_reads_its_bytes(&rig);
    rig.cache.drain().expect("drain");
    for i in 0..disks {
        let f = rig.files.get(&name(i)).expect("image");
        let mut buf = vec![0u8; BLOCK];
        for line in 0..lines {
            f.read_at(&mut buf, line * 16 * BLOCK as u64)
                .expect("read image");
            assert_eq!(buf, data, "clone {i}, line {line}");
        }
    }
}

/// One write holding the same block many times (zeros, a fill pattern):
/// the first enters flash, the rest share it; every address reads and
/// writes back its bytes, and overwriting one leaves the others.
#[test]
fn a_write_of_one_repeated_block_enters_flash_once() {
    let rig = Rig::new(1, config(WriteMode::WriteBack, Dedup::On));
    let d = &rig.disks[0];
    let before = rig.flash_data_written();
    let repeated: Vec<u8> = (0..256).flat_map(|_| content(5)).collect();
    d.write(0, &repeated, false).expect("write");
    let written = rig.flash_data_written() - before;
    // The staging may write a chunk's summary block too; never a copy.
    assert!(
        written < 4 * BLOCK as u64,
        "{written} bytes for one distinct block"
    );
    assert_eq!(rig.shared(), 255);
    // Mixed: A B A C B, at blocks 300..305: three enter flash, two share.
    let mixed: Vec<u8> = [6u64, 7, 6, 8, 7]
        .iter()
        .flat_map(|&n| content(n))
        .collect();
    let before = rig.flash_data_written();
    d.write(300 * BLOCK as u64, &mixed, false).expect("write");
    assert_eq!(rig.shared(), 257);
    assert!(rig.flash_data_written() - before < 6 * BLOCK as u64);
    write_block(d, 10, &content(9));
    for b in 0..256u64 {
        let want = if b == 10 { content(9) } else { content(5) };
        assert!(read_block(d, b) == want, "block {b}");
    }
    for (i, n) in [6u64, 7, 6, 8, 7].into_iter().enumerate() {
        assert!(
            read_block(d, 300 + i as u64) == content(n),
            "block {}",
            300 + i
        );
    }
    rig.cache.audit_regions().expect("regions");
    rig.cache.drain().expect("drain");
    let f = rig.file(0);
    for b in 0..256u64 {
        let want = if b == 10 { content(9) } else { content(5) };
        assert!(block_of(&f, b) == &want[..], "image block {b}");
    }
    for (i, n) in [6u64, 7, 6, 8, 7].into_iter().enumerate() {
        assert!(block_of(&f, 300 + i as u64) == &content(n)[..]);
    }
    let rig = rig.crash_and_reopen();
    assert!(read_block(&rig.disks[0], 200) == content(5));
}

/// Bytes the disks' misses and writes put into flash, counted when they
/// are placed (the device counts staged blocks later).
fn promoted(rig: &Rig) -> u64 {
    rig.cache.report().total.flash_bytes_written
}

/// Hot admission in a cache that deduplicates keys misses by content: bytes
/// one clone missed enter flash on another clone's miss of them at any
/// address, and a miss of bytes flash holds shares them, admitted or not.
/// Without dedup a miss is keyed by its address, as before.
#[test]
fn hot_admission_in_a_deduplicating_cache_counts_misses_of_the_same_bytes_by_any_clone() {
    const RUN: u64 = 16;
    let files = MemFiles::new();
    // Clone 1 holds the bytes 200 blocks further on; clones 0 and 2 at 0.
    let mut image = vec![0u8; IMAGE_BYTES];
    let mut moved = vec![0u8; IMAGE_BYTES];
    for n in 0..RUN {
        let (at, there) = (n as usize * BLOCK, (200 + n) as usize * BLOCK);
        image[at..at + BLOCK].copy_from_slice(&content(n + 100));
        moved[there..there + BLOCK].copy_from_slice(&content(n + 100));
    }
    files.insert(&name(0), image.clone());
    files.insert(&name(1), moved);
    files.insert(&name(2), image);
    let device = Arc::new(MemBackend::fixed("cache", 32 << 20));
    let mut cfg = config(WriteMode::WriteBack, Dedup::On);
    cfg.default_policy.admission = Admission::Hot;
    let cache = cache_on(&device, &cfg, true);
    let rig = Rig::attach(files, device, cache, 3, cfg);
    let mut buf = vec![0u8; RUN as usize * BLOCK];
    let read = |disk: usize, at: u64, buf: &mut [u8]| {
        rig.disks[disk].read(at * BLOCK as u64, buf).expect("read");
        for n in 0..RUN as usize {
            assert!(buf[n * BLOCK..(n + 1) * BLOCK] == content(n as u64 + 100)[..]);
        }
    };
    let start = promoted(&rig);
    read(0, 0, &mut buf);
    assert!(
        promoted(&rig) - start < BLOCK as u64,
        "a first miss is not admitted"
    );
    read(1, 200, &mut buf);
    let admitted = promoted(&rig) - start;
    assert!(
        admitted >= RUN * BLOCK as u64,
        "the second miss of the same bytes, by another clone at another address, is admitted: {admitted} bytes"
    );
    assert_eq!(rig.shared(), 0);
    read(2, 0, &mut buf);
    read(0, 0, &mut buf);
    assert_eq!(rig.shared(), 2 * RUN, "later misses share the block");
    assert!(promoted(&rig) - start - admitted < RUN * BLOCK as u64);
    let hits = rig.cache.report().total.read_hit_blocks;
    for disk in [0, 2] {
        read(disk, 0, &mut buf);
    }
    read(1, 200, &mut buf);
    assert_eq!(rig.cache.report().total.read_hit_blocks - hits, 3 * RUN);
    rig.cache.audit_regions().expect("regions");

    // Without dedup the content is unknown: clone 1's miss is its first.
    let files = MemFiles::new();
    for i in 0..2 {
        files.insert(&name(i), vec![7u8; IMAGE_BYTES]);
    }
    let device = Arc::new(MemBackend::fixed("cache", 32 << 20));
    let mut cfg = config(WriteMode::WriteBack, Dedup::Off);
    cfg.default_policy.admission = Admission::Hot;
    let cache = cache_on(&device, &cfg, true);
    let rig = Rig::attach(files, device, cache, 2, cfg);
    let start = promoted(&rig);
    for disk in [0, 1] {
        rig.disks[disk].read(0, &mut buf).expect("read");
    }
    assert!(promoted(&rig) - start < BLOCK as u64);
    rig.disks[1].read(0, &mut buf).expect("read");
    assert!(
        promoted(&rig) - start >= RUN * BLOCK as u64,
        "its own second miss"
    );
}

/// The checkpoint room check admits a share while every free block could
/// still take an address in a line of its own. Blocks that shared a line
/// with a shared block (8 bytes each) and are then replaced by blocks in
/// lines of their own (32 bytes each) still push the map past that room;
/// eviction then frees lines until it fits again: writes go on, and the
/// cache reopens after a crash with every address right.
#[test]
fn eviction_keeps_the_map_within_the_checkpoint_when_shared_lines_outlive_their_neighbours() {
    const IMAGE: usize = 1 << 30;
    const LINES: u64 = (IMAGE / (16 * BLOCK)) as u64;
    let disks = 4usize;
    let rig = Rig::with_images(disks, IMAGE, config(WriteMode::WriteBack, Dedup::On));
    let shared = content(3);
    // Distinct for every n (content() repeats after 256).
    let unique = |n: u64| -> Vec<u8> {
        (0..BLOCK as u64 / 8)
            .flat_map(|w| (n << 20 | w).to_le_bytes())
            .collect()
    };
    let neighbour = |line: u64| unique(line);
    let no_room = |rig: &Rig| rig.cache.report().dedup.expect("dedup").counts.no_room;
    // Lines across the disks: one address sharing a block, one next to it
    // with bytes of its own, until the room check refuses a share.
    let mut lines = 0u64;
    while no_room(&rig) == 0 {
        assert!(lines < disks as u64 * LINES, "sharing never stopped");
        let (d, line) = (
            &rig.disks[(lines % disks as u64) as usize],
            lines / disks as u64,
        );
        write_block(d, line * 16, &shared);
        write_block(d, line * 16 + 1, &neighbour(lines));
        lines += 1;
        if lines.is_multiple_of(64) {
            // Keeps the shared block's region recent, so eviction takes
            // the neighbours.
            assert!(read_block(&rig.disks[0], 0) == shared);
        }
    }
    // Lines of their own, each with new bytes: twice the cache over.
    let alone = |i: u64| unique(1 << 30 | i);
    let own_lines = 2 * rig.cache.report().data_bytes / BLOCK as u64;
    let first_own = lines.div_ceil(disks as u64) + 1;
    let mut fullest = 0;
    for i in 0..own_lines {
        let d = &rig.disks[(i % disks as u64) as usize];
        write_block(d, (first_own + i / disks as u64) * 16, &alone(i));
        if i.is_multiple_of(64) {
            assert!(read_block(&rig.disks[0], 0) == shared);
            let d = rig.cache.report().dedup.expect("dedup");
            fullest = fullest.max(d.checkpoint_map_bytes);
            assert!(
                d.checkpoint_map_bytes <= d.checkpoint_room_bytes,
                "after {i} lines of their own the map takes {} bytes of the checkpoint's {}",
                d.checkpoint_map_bytes,
                d.checkpoint_room_bytes
            );
        }
    }
    let room = rig
        .cache
        .report()
        .dedup
        .expect("dedup")
        .checkpoint_room_bytes;
    assert!(
        fullest > room / 100 * 95,
        "the map never neared the room: {fullest} of {room}"
    );
    rig.flush_all();
    let every_address_reads_its_bytes = |rig: &Rig| {
        for l in 0..lines {
            let (d, line) = (&rig.disks[(l % disks as u64) as usize], l / disks as u64);
            assert!(read_block(d, line * 16) == shared, "line {l}");
            assert!(read_block(d, line * 16 + 1) == neighbour(l), "line {l}");
        }
        for i in (0..own_lines).step_by(7) {
            let d = &rig.disks[(i % disks as u64) as usize];
            assert!(read_block(d, (first_own + i / disks as u64) * 16) == alone(i));
        }
    };
    // Reads now would promote the neighbours back into their lines and
    // shrink the map: crash first.
    let rig = rig.crash_and_reopen();
    every_address_reads_its_bytes(&rig);
}
