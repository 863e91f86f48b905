//! With dedup on, what a replayed read returns of a block the replay never
//! wrote decides what flash shares: reads with equal content digests on
//! different disks share one cache block, reads with different digests or
//! none (content unknown, so unique to the disk and block) share nothing,
//! in both layouts; never all the blocks as one zero block.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use vdcache_cache::Dedup;
use vdcache_eval::trace::{ContentHash, Format, Op, TraceRecord, WriterOptions, new_writer};
use vdcache_replay::{CacheSize, DiskLayout, ReplayOptions, ReplayReport, RigConfig, replay_file};

const BLOCKS: u64 = 64;

fn digest(family: u8, block: u64) -> ContentHash {
    let mut d = [family; 16];
    d[..8].copy_from_slice(&block.to_le_bytes());
    d
}

/// Disks 0 and 1 read blocks `0..BLOCKS` with equal digests, disk 2 with
/// its own; then each disk reads them again (hits).
fn write_trace(path: &Path, format: Format) {
    let out = BufWriter::new(File::create(path).expect("create"));
    let mut w = new_writer(format, out, &WriterOptions::default());
    let mut t = 0;
    for _ in 0..2 {
        for disk in 0..3u32 {
            for b in 0..BLOCKS {
                let mut r = TraceRecord::new(t, disk, Op::Read, b * 4096, 4096);
                r.content = Some(vec![digest(if disk == 2 { 2 } else { 1 }, b)]);
                w.write_record(&r).expect("write");
                t += 1000;
            }
        }
    }
    w.finish().expect("finish");
}

fn replay(path: &Path, format: Format, layout: DiskLayout, dedup: Dedup) -> ReplayReport {
    let opts = ReplayOptions {
        rig: RigConfig {
            layout,
            dedup,
            ..RigConfig::default()
        },
        cache_size: CacheSize::Bytes(32 << 20),
        snapshot_every_ns: None,
    };
    replay_file(path, Some(format), &opts, &mut |_| {}).expect("replay")
}

#[test]
fn reads_share_blocks_by_their_digests_and_only_then() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fiu = dir.path().join("t.fiu");
    write_trace(&fiu, Format::Fiu);
    let msr = dir.path().join("t.csv");
    write_trace(&msr, Format::Msr);
    for layout in [DiskLayout::Raw, DiskLayout::Qcow2] {
        let r = replay(&fiu, Format::Fiu, layout, Dedup::On);
        let d = r.dedup.expect("dedup figures");
        assert_eq!(r.read_miss_blocks, 3 * BLOCKS, "{layout:?}");
        assert_eq!(r.read_hit_blocks, 3 * BLOCKS, "{layout:?}");
        assert_eq!(d.seeded_blocks, 3 * BLOCKS, "{layout:?}");
        // Disk 1's blocks share disk 0's; disk 2's share nothing.
        assert_eq!(d.blocks_shared, BLOCKS, "{layout:?}: {d:?}");
        let off = replay(&fiu, Format::Fiu, layout, Dedup::Off);
        assert!(off.dedup.is_none());
        assert_eq!(off.read_hit_blocks, r.read_hit_blocks);
        assert!(
            r.flash_data_bytes_written + BLOCKS * 4096 <= off.flash_data_bytes_written,
            "{layout:?}: on {} off {}",
            r.flash_data_bytes_written,
            off.flash_data_bytes_written
        );

        // Without digests the content is unknown, taken as unique: read
        // as zeros, the blocks would all share one.
        let unknown = replay(&msr, Format::Msr, layout, Dedup::On);
        let u = unknown.dedup.expect("dedup figures");
        assert_eq!(u.blocks_shared, 0, "{layout:?}: {u:?}");
        assert_eq!(u.seeded_blocks, 3 * BLOCKS, "{layout:?}");
        // The cached addresses are the same (qcow2 adds its metadata).
        assert_eq!(u.unique_blocks, d.unique_blocks + BLOCKS, "{layout:?}");
        if layout == DiskLayout::Raw {
            assert_eq!(d.unique_blocks, 2 * BLOCKS, "{d:?}");
            assert!((d.ratio - 1.5).abs() < 1e-9, "{d:?}");
            assert!((u.ratio - 1.0).abs() < 1e-9, "{u:?}");
        }
    }
}
