//! The JBD2 parser on journals the real `mkfs.ext4` and kernel wrote,
//! captured here: an ext4 on a loop device with its external journal on a
//! second one, mounted `data=journal`, takes fsynced files, and the
//! journal device's file is copied while the log holds live transactions
//! (once with mkfs's defaults, csum v3 tags and 64-bit block numbers, once
//! without metadata checksums and 64bit: plain 32-bit tags). Every file
//! block maps to a committed copy holding its bytes; then property tests
//! mutate the captured journal and check that the parser never panics and
//! never maps a block to a copy the kernel did not log for it.
//!
//! Needs root and loop devices; without them each test prints why and
//! skips.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::ext4;
use crate::serving;

use common::Scratch;
use ext4::{Loop, Mounted, file_blocks, mkfs};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serving::pattern;
use std::collections::BTreeSet;
use std::io::Write as _;
use vdcache_jbd2::{Superblock, scan};

const BLOCK: usize = 4096;

/// A journal as the kernel left it, and the file blocks it must map.
struct Captured {
    journal: Vec<u8>,
    sb: Superblock,
    /// (file-system block, its content) of every fsynced file block.
    blocks: Vec<(u64, Vec<u8>)>,
}

/// Makes the file system with `features` (mkfs.ext4 -O), writes and
/// fsyncs files, and copies the journal device while mounted.
fn capture(s: &Scratch, features: &str) -> Captured {
    let (data_file, journal_file) = (s.path("fs.img"), s.path("journal.img"));
    std::fs::File::create(&data_file)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    std::fs::File::create(&journal_file)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let jdev = Loop::attach(&journal_file);
    let dev = Loop::attach(&data_file);
    mkfs(
        &["-b", "4096", "-O", &format!("journal_dev,{features}")],
        &jdev.0,
    );
    mkfs(
        &[
            "-b",
            "4096",
            "-O",
            features,
            "-J",
            &format!("device={}", jdev.0),
        ],
        &dev.0,
    );
    let mnt = s.path("mnt");
    let m = Mounted::mount(
        &dev.0,
        &mnt,
        &format!("data=journal,journal_path={}", jdev.0),
    );
    let mut files = Vec::new();
    for i in 0..16u64 {
        let mut data = pattern(32 << 10, 7000 + i);
        if i == 3 {
            data[..4].copy_from_slice(&vdcache_jbd2::MAGIC.to_be_bytes());
        }
        let p = mnt.join(format!("f{i}"));
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        files.push((p, data));
    }
    let mut blocks = Vec::new();
    for (p, data) in &files {
        for (k, b) in file_blocks(p).into_iter().enumerate() {
            blocks.push((b, data[k * BLOCK..(k + 1) * BLOCK].to_vec()));
        }
    }
    // The loop device writes the journal through the file's page cache:
    // what is read now is what the kernel logged.
    let journal = std::fs::read(&journal_file).unwrap();
    m.unmount();
    drop(dev);
    drop(jdev);
    let sb = Superblock::parse(&journal[BLOCK..]).unwrap();
    assert_ne!(sb.start, 0, "the journal holds live transactions");
    Captured {
        journal,
        sb,
        blocks,
    }
}

fn block_of(journal: &[u8], n: u32) -> Option<&[u8]> {
    journal.get(n as usize * BLOCK..(n as usize + 1) * BLOCK)
}

/// Every (target, journal block) the log holds a committed copy of.
fn all_copies(journal: &[u8], sb: &Superblock) -> BTreeSet<(u64, u32)> {
    let log = scan(sb, |n| block_of(journal, n)).unwrap();
    log.committed
        .iter()
        .flat_map(|t| t.copies.iter().map(|c| (c.target, c.journal_block)))
        .collect()
}

/// The captured journal maps every fsynced file block to a copy holding
/// its bytes (unescaped where the kernel escaped it).
fn maps_every_block(c: &Captured) {
    let log = scan(&c.sb, |n| block_of(&c.journal, n)).unwrap();
    assert!(log.bad_copies.is_empty(), "{:?}", log.bad_copies);
    let latest = log.latest_copies();
    let mut escaped = 0;
    for (b, data) in &c.blocks {
        let copy = latest
            .get(b)
            .unwrap_or_else(|| panic!("block {b} has no journal copy"));
        let mut logged = block_of(&c.journal, copy.journal_block).unwrap().to_vec();
        if copy.escaped {
            vdcache_jbd2::unescape(&mut logged);
            escaped += 1;
        }
        assert!(logged == *data, "block {b}: the copy holds other bytes");
    }
    assert_eq!(escaped, 1, "the block starting with the magic was escaped");
}

/// Mutations of the captured log never map a block to anything the
/// kernel did not log for it, and never panic.
fn mutations_never_map_wrongly(c: &Captured, checksummed: bool) {
    let truth = all_copies(&c.journal, &c.sb);
    let used: Vec<u32> = truth.iter().map(|&(_, j)| j).collect();
    let last = used.iter().copied().max().unwrap_or(c.sb.first) + 2;
    let log_bytes = (c.sb.first as usize * BLOCK)..((last as usize + 1) * BLOCK);
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = proptest::collection::vec((log_bytes, 1u8..=255), 1..6);
    runner
        .run(&strategy, |flips| {
            let mut j = c.journal.clone();
            for &(at, x) in &flips {
                j[at] ^= x;
            }
            let Ok(log) = scan(&c.sb, |n| block_of(&j, n)) else {
                return Ok(());
            };
            for t in &log.committed {
                for copy in &t.copies {
                    let at = copy.journal_block as usize * BLOCK;
                    let changed = j[at..at + BLOCK] != c.journal[at..at + BLOCK];
                    if checksummed {
                        // Tags and blocks are checksummed: a mapping is one
                        // the kernel wrote, to bytes it wrote.
                        prop_assert!(truth.contains(&(copy.target, copy.journal_block)));
                        prop_assert!(!changed, "a changed copy was mapped: {copy:?}");
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn journals_the_kernel_wrote_parse_and_survive_mutation() {
    require_fuse_and_loop!();
    let s = Scratch::new();
    let with_csum = capture(&s, "metadata_csum,64bit");
    assert!(with_csum.sb.has(vdcache_jbd2::FEATURE_CSUM_V3));
    assert!(with_csum.sb.has(vdcache_jbd2::FEATURE_64BIT));
    maps_every_block(&with_csum);
    mutations_never_map_wrongly(&with_csum, true);

    let s = Scratch::new();
    let plain = capture(&s, "^metadata_csum,^64bit");
    assert!(!plain.sb.csum_v2_or_v3() && !plain.sb.has(vdcache_jbd2::FEATURE_64BIT));
    maps_every_block(&plain);
    // Without checksums a flipped target is undetectable by design; the
    // parser still must not panic or loop.
    mutations_never_map_wrongly(&plain, false);
}
