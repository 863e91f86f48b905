//! Write-back under pressure, found by `vdcache soak` (issue 18).
//!
//! The write-back thread copies a batch of dirty blocks to their backend
//! without the cache's lock. A guest write may replace one of those blocks
//! meanwhile (a new dirty copy elsewhere in flash), and eviction may then
//! write that newer copy back and forget it, all before the thread's copy
//! of the older one lands: the backend would end with the older bytes and
//! nothing in flash to correct them. A region holding a newer copy of a
//! block the thread is copying is therefore not evicted until the copy is
//! done.
//!
//! And when flash has no room at all for a moment (every full region is
//! held that way, or pinned by the thread's batch), a write over a dirty
//! block waits for room instead of failing with an I/O error.

use crate::common;

use common::{GatedFiles, Held, disk_through};
use std::sync::Arc;
use vdcache_backend::inject::{Gate, eventually};
use vdcache_backend::{BackendRef, MemBackend};
use vdcache_cache::layout::Layout;
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_image::{ImageFormat, MemFiles, StoreOpener, VirtualDisk};

const BLOCK: u64 = 4096;
const IMAGE: u64 = 64 << 20;
const DEVICE: usize = 16 << 20;
const NAME: &str = "d/disk.raw";
const WRITEBACK: &str = "vdcache-writeback";

struct Rig {
    files: Arc<MemFiles>,
    gate: Arc<Gate>,
    cache: Arc<FlashCache>,
    disk: VirtualDisk,
}

impl Rig {
    /// A write-back cache of 1 MiB regions on 16 MiB that writes back
    /// only when drained, over a raw 64 MiB image.
    fn new() -> Rig {
        Rig::sized(DEVICE, 1 << 20)
    }

    /// The same with another device and region size.
    fn sized(device: usize, region_bytes: u64) -> Rig {
        let files = MemFiles::new();
        files.insert(NAME, vec![0u8; IMAGE as usize]);
        let gate = Arc::new(Gate::default());
        let config = CacheConfig {
            host: Some("test-host".into()),
            region_bytes,
            high_watermark: 1.0,
            low_watermark: 1.0,
            ..CacheConfig::default()
        };
        let device: BackendRef = Arc::new(MemBackend::fixed("cache", device));
        let cache = FlashCache::format(device, config).expect("format");
        let opener = Arc::new(GatedFiles {
            files: files.clone(),
            thread: WRITEBACK,
            held: Held::Writes,
            gate: gate.clone(),
        });
        let disk = disk_through(opener, &cache, NAME, ImageFormat::Raw);
        Rig {
            files,
            gate,
            cache,
            disk,
        }
    }

    fn write(&self, block: u64, version: u8) {
        self.disk
            .write(block * BLOCK, &content(block, version), false)
            .expect("write");
    }

    /// What the image file itself holds (not what the cache serves).
    fn backend(&self, block: u64) -> Vec<u8> {
        let f = self.files.open(NAME, false, None).expect("open image");
        let mut b = vec![0u8; BLOCK as usize];
        f.read_at(&mut b, block * BLOCK).expect("read image");
        b
    }

    fn read(&self, block: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK as usize];
        self.disk.read(block * BLOCK, &mut b).expect("read");
        b
    }

    /// Drains in a thread; returns once the write-back thread is held at
    /// the gate with its first batch.
    fn drain_held(&self) -> std::thread::JoinHandle<()> {
        let cache = self.cache.clone();
        let drain = std::thread::spawn(move || cache.drain().expect("drain"));
        assert!(
            eventually(|| self.gate.held() >= 1),
            "the write-back thread never wrote"
        );
        drain
    }
}

fn content(block: u64, version: u8) -> Vec<u8> {
    let mut b = vec![version; BLOCK as usize];
    b[..8].copy_from_slice(&block.to_le_bytes());
    b
}

/// Blocks written first, all in the first write-back batch.
const FIRST: u64 = 200;
/// Blocks of one write-back batch (the cache's, for lines without filler).
const BATCH: u64 = 4096;
/// Blocks per 1 MiB region.
const REGION_BLOCKS: u64 = 256;

#[test]
fn eviction_never_lets_an_older_copy_land_after_a_newer_one() {
    let rig = Rig::new();
    for b in 0..FIRST {
        rig.write(b, 1);
    }
    let drain = rig.drain_held();
    // While the thread copies version 1 of block 0, the guest writes
    // version 2 of it (into a region none of the batch is in: the one open
    // now is filled first), and then enough other blocks that every region
    // not pinned by the batch is evicted several times over.
    for b in 0..REGION_BLOCKS {
        rig.write(IMAGE / BLOCK - 1 - b, 3);
    }
    rig.write(0, 2);
    let capacity = DEVICE as u64 / BLOCK;
    for b in 0..3 * capacity {
        rig.write(FIRST + b % (IMAGE / BLOCK - FIRST), 3);
    }
    rig.gate.release();
    drain.join().expect("drain thread");
    assert!(!rig.gate.opened_by_timeout());
    assert!(
        rig.read(0) == content(0, 2),
        "block 0 reads version {} after the write-back, not 2",
        rig.read(0)[8]
    );
    assert!(
        rig.backend(0) == content(0, 2),
        "the image holds version {} of block 0 after a drain, not 2",
        rig.backend(0)[8]
    );
}

#[test]
fn a_write_over_a_dirty_block_waits_for_room_instead_of_failing() {
    // Nine regions of 4 MiB, so that 4 in 7 of seven regions' blocks fill
    // one write-back batch.
    let region = 4 << 20;
    let device = (36u64..256)
        .map(|m| m << 20)
        .find(|&d| Layout::compute(d, region).is_ok_and(|l| l.regions == 9))
        .expect("a device of nine regions");
    let rig = Arc::new(Rig::sized(device as usize, region));
    let region_data = u64::from(rig.cache.layout().data_blocks_per_region());
    // Seven of the nine regions filled with dirty blocks (two stay free in
    // reserve), 4 in 7 of them low blocks that make the first write-back
    // batch, the rest high ones: held at the gate, the batch pins all seven.
    let mut low = 0;
    let mut high = Vec::new();
    for i in 0..7 * region_data {
        if i % 7 < 4 {
            rig.write(low, 1);
            low += 1;
        } else {
            high.push(IMAGE / BLOCK - 1 - i);
            rig.write(IMAGE / BLOCK - 1 - i, 1);
        }
    }
    assert!(low <= BATCH);
    let drain = rig.drain_held();
    // The guest rewrites the low blocks: the new copies fill the two free
    // regions, which eviction must pass over, until a rewrite finds no
    // room and waits for the batch's range at the image.
    let rewrites = {
        let rig = rig.clone();
        std::thread::spawn(move || {
            for b in 0..low {
                rig.disk.write(b * BLOCK, &content(b, 2), false)?;
            }
            Ok::<(), vdcache_image::ImageError>(())
        })
    };
    // Then a high block (dirty, not in the batch) is rewritten: with no
    // room it goes to the image, and must still update its block in flash.
    let mut waiting = None;
    for &b in &high {
        let w = {
            let rig = rig.clone();
            std::thread::spawn(move || rig.disk.write(b * BLOCK, &content(b, 3), false))
        };
        assert!(eventually(
            || w.is_finished() || rig.backend(b) == content(b, 3)
        ));
        if rig.backend(b) == content(b, 3) {
            waiting = Some((b, w));
            break;
        }
        w.join().expect("writer").expect("a rewrite with room");
    }
    let Some((b, w)) = waiting else {
        panic!("flash had room for every rewrite: the test does not test");
    };
    rig.gate.release();
    w.join()
        .expect("writer thread")
        .unwrap_or_else(|e| panic!("the rewrite of block {b} failed: {e}"));
    rewrites
        .join()
        .expect("rewrites")
        .expect("rewrites of the batch");
    drain.join().expect("drain thread");
    // That drain ends when it first finds nothing dirty, which may come
    // before the last rewrites: write back what they left in flash.
    rig.cache.drain().expect("final drain");
    assert!(!rig.gate.opened_by_timeout());
    assert!(rig.read(b) == content(b, 3) && rig.backend(b) == content(b, 3));
    for b in 0..low {
        assert!(rig.read(b) == content(b, 2), "block {b}");
        assert!(rig.backend(b) == content(b, 2), "image block {b}");
    }
}
