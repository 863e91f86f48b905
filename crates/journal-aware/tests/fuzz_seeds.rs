//! Seed inputs of the `jbd2` fuzz target (`fuzz/corpus/jbd2`): small
//! journals of each layout built with [`vdcache_jbd2::build::Writer`],
//! checked to parse into the transactions they hold, and compared with the
//! committed files (`VDCACHE_WRITE_FUZZ_SEEDS=1` writes them instead). The
//! bounded fuzz run here feeds mutations of them to the target's entry
//! point.

use proptest::prelude::*;
use std::path::PathBuf;
use vdcache_jbd2::build::Writer;
use vdcache_jbd2::fuzzing::exercise_journal;
use vdcache_jbd2::*;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let layouts = [
        ("v1", 1u8, 0u32),
        ("v2-32bit", 2, FEATURE_REVOKE),
        ("v2-64bit", 2, FEATURE_REVOKE | FEATURE_64BIT),
        ("csum-v2", 2, FEATURE_REVOKE | FEATURE_CSUM_V2),
        (
            "csum-v3-64bit",
            2,
            FEATURE_REVOKE | FEATURE_CSUM_V3 | FEATURE_64BIT,
        ),
    ];
    let mut out = Vec::new();
    for (name, version, incompat) in layouts {
        // A log that starts near the end and wraps, with an escaped copy,
        // a revoke and an unfinished last transaction.
        let mut w = Writer::new(version, 1024, 12, incompat, 8, 41);
        let mut magic = vec![7u8; 1024];
        magic[..4].copy_from_slice(&MAGIC.to_be_bytes());
        w.transaction(&[(100, vec![1; 1024]), (200, magic)], &[], true);
        w.transaction(&[(300, vec![3; 1024])], &[100], true);
        w.transaction(&[(400, vec![4; 1024])], &[], false);
        out.push((format!("gen-{name}"), w.finish()));
    }
    out
}

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/jbd2")
}

#[test]
fn seeds_parse_and_match_the_committed_files() {
    let write = std::env::var_os("VDCACHE_WRITE_FUZZ_SEEDS").is_some();
    for (name, bytes) in seeds() {
        let sb = Superblock::parse(&bytes).unwrap();
        let log = scan(&sb, |n| {
            bytes.get(n as usize * 1024..(n as usize + 1) * 1024)
        })
        .unwrap();
        assert_eq!(log.committed.len(), 2, "{name}");
        assert!(log.uncommitted.is_some(), "{name}");
        let latest: Vec<u64> = log.latest_copies().into_keys().collect();
        assert_eq!(
            latest,
            [200, 300],
            "{name}: 100 is revoked, 400 uncommitted"
        );
        let path = corpus().join(&name);
        if write {
            std::fs::create_dir_all(corpus()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        } else {
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (VDCACHE_WRITE_FUZZ_SEEDS=1 writes it)",
                    path.display()
                )
            });
            assert!(
                committed == bytes,
                "{} differs from what this test builds",
                path.display()
            );
        }
        exercise_journal(&bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Bounded fuzzing: seeds with bytes overwritten, cut or repeated.
    #[test]
    fn mutated_seeds_never_panic(
        which in 0usize..5,
        sets in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..16),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut data = seeds().swap_remove(which).1;
        for (i, b) in &sets {
            let at = i.index(data.len());
            data[at] = *b;
        }
        exercise_journal(&data);
        data.truncate(cut.index(data.len() + 1));
        exercise_journal(&data);
    }
}
