//! Property tests: journals written by [`vdcache_jbd2::build::Writer`] in
//! every layout (v1, v2, 32/64-bit, csum v2/v3, both block sizes, logs that
//! wrap, sequences that wrap) parse back to exactly what was written, and
//! a corrupted checksummed journal is an error or a smaller log, never a
//! mapping to a block that does not hold that content.

use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use vdcache_jbd2::build::Writer;
use vdcache_jbd2::fuzzing::exercise_journal;
use vdcache_jbd2::*;

#[derive(Debug, Clone)]
struct Tx {
    copies: Vec<(u64, u8)>,
    revokes: Vec<u64>,
}

#[derive(Debug, Clone)]
struct Case {
    version: u8,
    incompat: u32,
    block_size: u32,
    sequence: u32,
    slack: u32,
    start_frac: u32,
    txs: Vec<Tx>,
    last_uncommitted: bool,
    magic_first: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let layout = prop_oneof![
        Just((1u8, 0u32)),
        Just((2, 0)),
        Just((2, FEATURE_REVOKE | FEATURE_64BIT)),
        Just((2, FEATURE_REVOKE | FEATURE_CSUM_V2)),
        Just((2, FEATURE_REVOKE | FEATURE_CSUM_V2 | FEATURE_64BIT)),
        Just((2, FEATURE_REVOKE | FEATURE_CSUM_V3)),
        Just((2, FEATURE_REVOKE | FEATURE_CSUM_V3 | FEATURE_64BIT)),
    ];
    let tx = (
        prop::collection::vec((0u64..40, any::<u8>()), 1..90),
        prop::collection::vec(0u64..40, 0..6),
    )
        .prop_map(|(copies, revokes)| Tx { copies, revokes });
    (
        layout,
        prop_oneof![Just(1024u32), Just(4096)],
        prop_oneof![any::<u32>(), Just(u32::MAX - 1)],
        1u32..6,
        0u32..100,
        prop::collection::vec(tx, 1..5),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |((version, incompat), block_size, sequence, slack, start_frac, txs, last, magic)| {
                Case {
                    version,
                    incompat,
                    block_size,
                    sequence,
                    slack,
                    start_frac,
                    txs,
                    last_uncommitted: last,
                    magic_first: magic,
                }
            },
        )
}

/// A file-system block number in the layout's range.
fn target(case: &Case, b: u64) -> u64 {
    if case.incompat & FEATURE_64BIT != 0 {
        b | (b % 3) << 33
    } else {
        b * 1000
    }
}

fn content(case: &Case, t: u64, fill: u8, first: bool) -> Vec<u8> {
    let mut d = vec![fill; case.block_size as usize];
    d[4..12].copy_from_slice(&t.to_le_bytes());
    if first && case.magic_first {
        d[..4].copy_from_slice(&MAGIC.to_be_bytes());
    }
    d
}

struct Built {
    image: Vec<u8>,
    /// (target, journal block) -> content of every copy written.
    placed: BTreeMap<(u64, u32), Vec<u8>>,
    /// Committed transactions: per transaction, its copies in order.
    committed: Vec<Vec<(u64, u32)>>,
    revokes: Vec<Vec<u64>>,
}

fn build(case: &Case) -> Built {
    // Size the journal from a dry run so the log fits with some slack.
    let write = |w: &mut Writer| {
        let mut placed = BTreeMap::new();
        let mut committed = Vec::new();
        let mut revokes = Vec::new();
        for (i, tx) in case.txs.iter().enumerate() {
            let copies: Vec<(u64, Vec<u8>)> = tx
                .copies
                .iter()
                .enumerate()
                .map(|(j, &(b, fill))| {
                    let t = target(case, b);
                    (t, content(case, t, fill, j == 0))
                })
                .collect();
            let revs: Vec<u64> = tx.revokes.iter().map(|&b| target(case, b)).collect();
            let commit = !(case.last_uncommitted && i + 1 == case.txs.len());
            let at = w.transaction(&copies, &revs, commit);
            let pairs: Vec<(u64, u32)> = copies.iter().map(|c| c.0).zip(at).collect();
            for ((t, j), (_, d)) in pairs.iter().zip(&copies) {
                placed.insert((*t, *j), d.clone());
            }
            if commit {
                committed.push(pairs);
                revokes.push(revs);
            }
        }
        (placed, committed, revokes)
    };
    let mut dry = Writer::new(case.version, case.block_size, 100_000, case.incompat, 1, 0);
    write(&mut dry);
    let used = dry.position() - 1;
    let max_len = 1 + used + case.slack;
    let start = 1 + case.start_frac * (max_len - 1) / 100;
    let mut w = Writer::new(
        case.version,
        case.block_size,
        max_len,
        case.incompat,
        start,
        case.sequence,
    );
    let (placed, committed, revokes) = write(&mut w);
    Built {
        image: w.finish(),
        placed,
        committed,
        revokes,
    }
}

fn blocks<'a>(image: &'a [u8], bs: u32) -> impl Fn(u32) -> Option<&'a [u8]> {
    move |n| image.get(n as usize * bs as usize..(n as usize + 1) * bs as usize)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn written_journals_parse_back_exactly(case in case()) {
        let b = build(&case);
        let sb = Superblock::parse(&b.image).unwrap();
        prop_assert_eq!(sb.sequence, case.sequence);
        let log = scan(&sb, blocks(&b.image, sb.block_size)).unwrap();
        prop_assert!(log.bad_copies.is_empty());
        prop_assert_eq!(log.committed.len(), b.committed.len());
        for (i, (t, want)) in log.committed.iter().zip(&b.committed).enumerate() {
            prop_assert_eq!(t.sequence, case.sequence.wrapping_add(i as u32));
            let got: Vec<(u64, u32)> = t.copies.iter().map(|c| (c.target, c.journal_block)).collect();
            prop_assert_eq!(&got, want);
            prop_assert_eq!(&t.revoked, &b.revokes[i]);
        }
        prop_assert_eq!(log.uncommitted.is_some(), case.last_uncommitted);
        prop_assert_eq!(
            log.next_sequence,
            case.sequence.wrapping_add(b.committed.len() as u32)
        );
        // The newest unrevoked copy of each block, and its content.
        let mut model: BTreeMap<u64, u32> = BTreeMap::new();
        for (i, tx) in b.committed.iter().enumerate() {
            for &(t, j) in tx {
                model.insert(t, j);
            }
            for r in &b.revokes[i] {
                let later = b.committed[..=i].iter().flatten().any(|&(t, _)| t == *r);
                if later {
                    // A revoke cancels copies of its own and older transactions.
                    model.remove(r);
                }
            }
        }
        let latest: BTreeMap<u64, u32> = log
            .latest_copies()
            .into_iter()
            .map(|(t, c)| (t, c.journal_block))
            .collect();
        prop_assert_eq!(&latest, &model);
        for c in log.latest_copies().values() {
            let mut data = blocks(&b.image, sb.block_size)(c.journal_block).unwrap().to_vec();
            if c.escaped {
                unescape(&mut data);
            }
            prop_assert_eq!(&data, &b.placed[&(c.target, c.journal_block)]);
        }
        exercise_journal(&b.image);
    }

    #[test]
    fn corrupt_checksummed_journals_never_map_wrongly(
        case in case(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
    ) {
        let mut case = case;
        case.version = 2;
        case.incompat |= FEATURE_CSUM_V3;
        case.incompat &= !FEATURE_CSUM_V2;
        let b = build(&case);
        let mut image = b.image.clone();
        for (i, x) in &flips {
            let at = i.index(image.len());
            image[at] ^= x;
        }
        let Ok(sb) = Superblock::parse(&image) else { return Ok(()) };
        let Ok(log) = scan(&sb, blocks(&image, sb.block_size)) else { return Ok(()) };
        let written: BTreeSet<(u64, u32)> = b.placed.keys().copied().collect();
        for t in &log.committed {
            for c in &t.copies {
                prop_assert!(written.contains(&(c.target, c.journal_block)), "{c:?} was never written");
                let mut data = blocks(&image, sb.block_size)(c.journal_block).unwrap().to_vec();
                if c.escaped {
                    unescape(&mut data);
                }
                prop_assert_eq!(&data, &b.placed[&(c.target, c.journal_block)]);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..5000)) {
        exercise_journal(&data);
    }
}

/// Each malformed piece is a typed error naming it.
#[test]
fn malformed_blocks_are_errors() {
    let w = Writer::new(2, 1024, 8, FEATURE_CSUM_V3, 1, 7);
    let image = w.finish();
    let mut sb_bytes = image[..1024].to_vec();
    assert!(Superblock::parse(&sb_bytes).is_ok());
    sb_bytes[0xC..0x10].copy_from_slice(&1000u32.to_be_bytes());
    assert!(
        matches!(Superblock::parse(&sb_bytes), Err(Jbd2Error::Superblock(m)) if m.contains("block size"))
    );
    let mut bad_sum = image[..1024].to_vec();
    bad_sum[0x18] ^= 1;
    assert!(matches!(
        Superblock::parse(&bad_sum),
        Err(Jbd2Error::Checksum {
            block: 0,
            what: "superblock",
            ..
        })
    ));
    assert!(matches!(
        Superblock::parse(&image[..100]),
        Err(Jbd2Error::Superblock(_))
    ));
    let sb = Superblock::parse(&image).unwrap();
    // A descriptor whose tail checksum is wrong.
    let mut d = vec![0u8; 1024];
    d[..4].copy_from_slice(&MAGIC.to_be_bytes());
    d[4..8].copy_from_slice(&DESCRIPTOR.to_be_bytes());
    assert!(matches!(
        parse_descriptor(&sb, 3, &d),
        Err(Jbd2Error::Checksum {
            block: 3,
            what: "descriptor",
            ..
        })
    ));
    // A revoke count that runs past the block.
    let plain = Superblock {
        incompat: 0,
        ..sb.clone()
    };
    let mut r = d.clone();
    r[12..16].copy_from_slice(&5000u32.to_be_bytes());
    assert!(matches!(
        parse_revoke(&plain, 4, &r),
        Err(Jbd2Error::Block { block: 4, .. })
    ));
    // A block handed in short.
    assert!(matches!(
        parse_descriptor(&plain, 5, &d[..512]),
        Err(Jbd2Error::Block { block: 5, .. })
    ));
    // A scan whose block cannot be read.
    let live = Superblock { start: 1, ..sb };
    assert_eq!(scan(&live, |_| None), Err(Jbd2Error::Missing(1)));
}
