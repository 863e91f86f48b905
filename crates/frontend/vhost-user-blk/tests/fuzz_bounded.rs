//! The bounded version of the fuzz target `vhost_user` (the unbounded run
//! is `scripts/fuzz.sh vhost_user MINUTES`): its committed seeds, the same
//! seeds mutated by proptest and random bytes go through the entry point
//! the target calls. The seeds are built here, by a driver's view of the
//! rings and a front end's view of the messages; `fuzz/make-seeds.sh`
//! writes them into fuzz/corpus/vhost_user (VDCACHE_WRITE_SEEDS=1).

use proptest::prelude::*;
use std::path::{Path, PathBuf};
use vdcache_vhost_user_blk::fuzzing::{
    ConnectionInput, Data, Desc, Message, Op, RingBuilder, exercise,
};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};

const TARGET: &str = "vhost_user";

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../fuzz/corpus")
        .join(TARGET)
}

/// A discard or write-zeroes segment: sector, sectors, flags.
fn segment(sector: u64, sectors: u32, flags: u32) -> Vec<u8> {
    let mut s = sector.to_le_bytes().to_vec();
    s.extend_from_slice(&sectors.to_le_bytes());
    s.extend_from_slice(&flags.to_le_bytes());
    s
}

/// The queue seeds: every request type, indirect tables, many requests,
/// and the broken rings of issue 43.
fn queue_seeds() -> Vec<(String, RingBuilder)> {
    let mut out = Vec::new();
    for event_idx in [false, true] {
        let e = if event_idx { "-event-idx" } else { "" };
        let mut b = RingBuilder::new(3, event_idx);
        let f = b.free();
        b.request(f, VIRTIO_BLK_T_OUT, 1, Data::Out(&[0x5a; 512]));
        b.request(f + 0x240, VIRTIO_BLK_T_IN, 1, Data::In(512));
        b.op(Op::Kick);
        out.push((format!("queue-write-read{e}"), b));

        let mut b = RingBuilder::new(4, event_idx);
        let f = b.free();
        b.request(f, VIRTIO_BLK_T_FLUSH, 0, Data::None);
        b.request(f + 0x40, VIRTIO_BLK_T_GET_ID, 0, Data::In(20));
        let two = [segment(0, 8, 0), segment(16, 8, 0)].concat();
        b.request(f + 0x80, VIRTIO_BLK_T_DISCARD, 0, Data::Out(&two));
        b.request(
            f + 0xc0,
            VIRTIO_BLK_T_WRITE_ZEROES,
            0,
            Data::Out(&segment(4, 4, 1)),
        );
        b.op(Op::Kick);
        out.push((format!("queue-flush-id-discard-zeroes{e}"), b));

        let mut b = RingBuilder::new(2, event_idx);
        let f = b.free();
        b.put(f + 0x40, &RingBuilder::header_bytes(VIRTIO_BLK_T_IN, 2));
        b.put(f + 0x50, &[0xff]);
        b.post_indirect(
            f,
            &[
                Desc {
                    addr: f + 0x40,
                    len: 16,
                    write: false,
                },
                Desc {
                    addr: f + 0x60,
                    len: 1024,
                    write: true,
                },
                Desc {
                    addr: f + 0x50,
                    len: 1,
                    write: true,
                },
            ],
        );
        b.op(Op::Kick);
        out.push((format!("queue-indirect{e}"), b));

        let mut b = RingBuilder::new(4, event_idx);
        let f = b.free();
        b.request(f, VIRTIO_BLK_T_IN, 0, Data::In(512));
        b.request(f + 0x240, VIRTIO_BLK_T_IN, 8, Data::In(512));
        b.set_avail_idx(1);
        let idx = b.avail_idx_at();
        b.op(Op::Kick)
            .op(Op::Poke {
                at: idx,
                value: 40000,
            })
            .op(Op::Kick)
            .op(Op::Restart)
            .op(Op::Poke { at: idx, value: 2 })
            .op(Op::Kick);
        out.push((format!("queue-broken-index{e}"), b));
    }
    let mut b = RingBuilder::new(3, true);
    b.make_available(300);
    b.op(Op::Kick);
    out.push(("queue-head-past-the-queue".into(), b));
    out
}

fn connection_seeds() -> Vec<(String, ConnectionInput)> {
    let mut b = RingBuilder::new(3, true);
    let f = b.free();
    b.request(f, VIRTIO_BLK_T_OUT, 1, Data::Out(&[0x5a; 512]));
    b.request(f + 0x240, VIRTIO_BLK_T_IN, 1, Data::In(512));
    let good = ConnectionInput::negotiated(&b);
    b.set_avail_idx(40000);
    let broken = ConnectionInput::negotiated(&b);
    let mut garbage = good.clone();
    garbage.messages.insert(
        3,
        Message::Send {
            request: 9,
            flags: 5,
            size: 1 << 20,
            payload: vec![0xff; 40],
        },
    );
    vec![
        ("connection-read-write".into(), good),
        ("connection-broken-index".into(), broken),
        ("connection-bad-size".into(), garbage),
    ]
}

/// Every seed, by file name.
fn seeds() -> Vec<(String, Vec<u8>)> {
    let queues = queue_seeds()
        .into_iter()
        .map(|(n, b)| (n, b.input.encode()));
    let connections = connection_seeds().into_iter().map(|(n, c)| (n, c.encode()));
    queues.chain(connections).collect()
}

#[test]
fn the_committed_seeds_are_the_built_ones_and_pass() {
    let dir = corpus_dir();
    if std::env::var_os("VDCACHE_WRITE_SEEDS").is_some() {
        std::fs::create_dir_all(&dir).expect("mkdir corpus");
        for (name, bytes) in seeds() {
            std::fs::write(dir.join(name), bytes).expect("write seed");
        }
    }
    for (name, bytes) in seeds() {
        let committed = std::fs::read(dir.join(&name))
            .unwrap_or_else(|e| panic!("fuzz/corpus/{TARGET}/{name}: {e} (fuzz/make-seeds.sh)"));
        assert!(
            committed == bytes,
            "fuzz/corpus/{TARGET}/{name} is stale (fuzz/make-seeds.sh)"
        );
    }
    for entry in std::fs::read_dir(&dir).expect("corpus") {
        let bytes = std::fs::read(entry.expect("entry").path()).expect("seed");
        if let Some(run) = exercise(&bytes) {
            assert_eq!(run.taken_while_stopped, 0);
        }
    }
}

#[test]
fn the_queue_seeds_serve_what_they_post() {
    for (name, b) in queue_seeds() {
        let run = exercise(&b.input.encode()).expect("a queue seed sets its queue up");
        assert!(run.taken > 0, "{name} took nothing");
        let broken = name.contains("broken") || name.contains("past");
        assert_eq!(run.stopped, name.contains("past"), "{name}");
        assert!(broken || run.totals.errors == 0, "{name}: {:?}", run.totals);
    }
}

fn seed_list() -> &'static [Vec<u8>] {
    static SEEDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(|| seeds().into_iter().map(|(_, b)| b).collect())
}

/// `seed` with bytes overwritten at `edits` (index, value).
fn mutate(seed: &[u8], edits: &[(prop::sample::Index, u8)]) -> Vec<u8> {
    let mut data = seed.to_vec();
    for (i, v) in edits {
        if !data.is_empty() {
            let at = i.index(data.len());
            data[at] = *v;
        }
    }
    data
}

fn check(data: &[u8]) {
    if let Some(run) = exercise(data) {
        assert_eq!(run.taken_while_stopped, 0, "a stopped queue took requests");
    }
}

proptest! {
    // A connection input starts a server (threads, a socket): a few
    // hundred of them take seconds.
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn mutated_seeds_pass(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..12),
        cut in any::<prop::sample::Index>(),
    ) {
        let seeds = seed_list();
        let mut data = mutate(&seeds[seed.index(seeds.len())], &edits);
        if cut.index(8) == 0 {
            data.truncate(cut.index(data.len() + 1));
        }
        check(&data);
    }

    #[test]
    fn random_bytes_pass(data in prop::collection::vec(any::<u8>(), 0..600)) {
        check(&data);
    }
}
