//! The bounded version of the fuzz targets in fuzz/ (the unbounded runs are
//! `scripts/fuzz.sh TARGET MINUTES`): the committed seeds, seeds mutated by
//! proptest and random bytes go through the entry points the targets call,
//! for the trace readers, the server configuration, the NBD server's
//! handshake and requests, the NBD client's replies and the qcow2
//! structure parsers. The image open-and-read target has its own bounded test
//! (crates/image/tests/fuzz_bounded.rs), and so has the vhost-user target
//! (crates/frontend/vhost-user-blk/tests/fuzz_bounded.rs); here only the
//! image seeds are replayed.

use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use vdcache::fuzzing::exercise_config;
use vdcache_backend::nbd::fuzzing::{client_handshake, client_replies};
use vdcache_eval::trace::fuzzing::{exercise_detection, exercise_reader};
use vdcache_eval::trace::{BlkAction, Format, MAX_LINE_BYTES};
use vdcache_image::fuzzing::exercise_image;
use vdcache_nbd_server::fuzzing::{server_handshake, server_requests};
use vdcache_qcow2::fuzzing::exercise_structures;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The committed seeds of `target`, in name order.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read(p).expect("seed"))
        .collect()
}

/// The fuzz targets fuzz/Cargo.toml declares.
fn targets() -> Vec<String> {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz manifest");
    let mut names = Vec::new();
    let mut in_bin = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
        } else if in_bin && let Some(v) = line.strip_prefix("name = ") {
            names.push(v.trim_matches('"').to_string());
        }
    }
    names
}

#[test]
fn every_target_has_a_small_seed_corpus() {
    let names = targets();
    for t in [
        "parse_image",
        "parse_structures",
        "trace_msr",
        "trace_fiu",
        "trace_blkparse",
        "trace_fio",
        "trace_detect",
        "config",
        "nbd_handshake",
        "nbd_request",
        "nbd_reply",
        "jbd2",
        "vhost_user",
    ] {
        assert!(names.iter().any(|n| n == t), "no fuzz target {t}");
    }
    let mut total = 0;
    for t in &names {
        let seeds = corpus(t);
        assert!(!seeds.is_empty(), "fuzz/corpus/{t} has no seeds");
        total += seeds.iter().map(Vec::len).sum::<usize>();
    }
    assert!(total < 1 << 20, "the seed corpora hold {total} bytes");
}

#[test]
fn image_seeds_pass_their_targets() {
    for seed in corpus("parse_image") {
        exercise_image(&seed);
        exercise_structures(&seed);
    }
    for seed in corpus("parse_structures") {
        exercise_structures(&seed);
        exercise_image(&seed);
    }
}

// ---------------------------------------------------------------------------
// Mutations shared by the text targets.

#[derive(Debug, Clone)]
enum Edit {
    Set(prop::sample::Index, u8),
    /// Insert one of the target's tokens.
    Insert(prop::sample::Index, prop::sample::Index),
    Remove(prop::sample::Index, usize),
    /// Repeat a range (a line, part of one) somewhere else.
    Copy(prop::sample::Index, usize, prop::sample::Index),
    Truncate(prop::sample::Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    use prop::sample::Index;
    prop_oneof![
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, t)| Edit::Insert(i, t)),
        (any::<Index>(), 1usize..40).prop_map(|(i, n)| Edit::Remove(i, n)),
        (any::<Index>(), 1usize..80, any::<Index>()).prop_map(|(i, n, to)| Edit::Copy(i, n, to)),
        any::<Index>().prop_map(Edit::Truncate),
    ]
}

/// `seed` with `edits` applied in turn.
fn mutate(seed: &[u8], edits: &[Edit], tokens: &[&[u8]]) -> Vec<u8> {
    let mut data = seed.to_vec();
    for e in edits {
        let len = data.len();
        match e {
            Edit::Set(i, b) if len > 0 => data[i.index(len)] = *b,
            Edit::Insert(i, t) => {
                let at = i.index(len + 1);
                let tok = tokens[t.index(tokens.len())];
                data.splice(at..at, tok.iter().copied());
            }
            Edit::Remove(i, n) if len > 0 => {
                let at = i.index(len);
                data.drain(at..(at + n).min(len));
            }
            Edit::Copy(i, n, to) if len > 0 => {
                let at = i.index(len);
                let piece = data[at..(at + n).min(len)].to_vec();
                let to = to.index(len + 1);
                data.splice(to..to, piece);
            }
            Edit::Truncate(i) => data.truncate(i.index(len + 1)),
            _ => {}
        }
    }
    data
}

// ---------------------------------------------------------------------------
// Trace readers.

/// The fuzz target reading each format.
const TRACE_TARGETS: [(&str, Format); 4] = [
    ("trace_msr", Format::Msr),
    ("trace_fiu", Format::Fiu),
    ("trace_blkparse", Format::Blkparse(BlkAction::Queue)),
    ("trace_fio", Format::Fio),
];

/// Every input through every reader and through detection: a seed of one
/// format is a mutation of the others.
fn exercise_traces(data: &[u8]) {
    for (_, format) in TRACE_TARGETS {
        exercise_reader(format, data);
    }
    exercise_detection(data);
}

/// All trace seeds, read once.
fn trace_seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        TRACE_TARGETS
            .iter()
            .map(|(t, _)| *t)
            .chain(["trace_detect"])
            .flat_map(corpus)
            .collect()
    })
}

/// Pieces of every trace format's syntax.
const TRACE_TOKENS: &[&[u8]] = &[
    b"\n",
    b"\r\n",
    b" ",
    b"\t",
    b",",
    b".",
    b"+",
    b"-",
    b"[",
    b"]",
    b"(",
    b"0",
    b"1",
    b"8",
    b"4096",
    b"65535",
    b"65536",
    b"4095",
    b"1048575",
    b"1048576",
    b"18446744073709551615",
    b"18446744073709551616",
    b"184467440737095516",
    b"36028797018963968",
    b"0.000000001",
    b"1.",
    b".5",
    b"0.1234567890",
    b"8,0",
    b"259,1",
    b"Q",
    b"D",
    b"C",
    b"G",
    b"FWS",
    b"FWFS",
    b"F",
    b"R",
    b"W",
    b"N",
    b"E",
    b"Read",
    b"Write",
    b"[0]",
    b"[-5]",
    b"CPU0 (sda):",
    b"Total (",
    b"Input file",
    b"Timestamp,",
    b"fio version 2 iolog\n",
    b"fio version 3 iolog\n",
    b"/f",
    b"add",
    b"open",
    b"close",
    b"read",
    b"write",
    b"trim",
    b"sync",
    b"datasync",
    b"wait",
    b"00112233445566778899aabbccddeeff",
    b"\xc3\xa9",
    b"\x00",
    b"\x1f\x8b",
    b"\x28\xb5\x2f\xfd",
];

#[test]
fn trace_seeds_pass_every_reader() {
    for (target, format) in TRACE_TARGETS {
        let seeds = corpus(target);
        assert!(seeds.len() >= 3, "{target}: {} seeds", seeds.len());
        for seed in &seeds {
            exercise_reader(format, seed);
        }
    }
    for seed in corpus("trace_detect") {
        exercise_detection(&seed);
    }
    for seed in trace_seeds() {
        exercise_traces(seed);
    }
}

/// Lines over the length cap, which fuzzing with short inputs never makes,
/// before and after the good lines of each format.
#[test]
fn overlong_lines_pass_every_reader() {
    let long = vec![b'7'; MAX_LINE_BYTES + 10];
    for seed in trace_seeds() {
        let mut data = long.clone();
        data.push(b'\n');
        data.extend_from_slice(seed);
        data.extend_from_slice(&long);
        exercise_traces(&data);
    }
}

// ---------------------------------------------------------------------------
// Server configuration.

/// Pieces of TOML and of the configuration's keys and values.
const CONFIG_TOKENS: &[&[u8]] = &[
    b"\n",
    b"[",
    b"]",
    b"[[export]]\n",
    b"[server]\n",
    b"[cache]\n",
    b"[server.tls]\n",
    b" = ",
    b"\"",
    b"'",
    b"'''",
    b"\"\"\"",
    b"#",
    b",",
    b"{",
    b"}",
    b".",
    b"\\",
    b"\\u00e9",
    b"\xc3\xa9",
    b"true",
    b"nan",
    b"-inf",
    b"1e400",
    b"0x10",
    b"1979-05-27T07:32:00Z",
    b"18446744073709551616",
    b"-1",
    b"socket",
    b"tcp",
    b"control",
    b"workers",
    b"cert",
    b"key",
    b"psk",
    b"name",
    b"image",
    b"path",
    b"size",
    b"region_size",
    b"l2_cache_size",
    b"high_watermark",
    b"read_only",
    b"\"1.5G\"",
    b"\"16E\"",
    b"\"0x\"",
    b"\".5k\"",
    b"\"1.0000000000000000001M\"",
    b"\"\"",
];

#[test]
fn config_seeds_pass() {
    let seeds = corpus("config");
    assert!(seeds.len() >= 3, "config: {} seeds", seeds.len());
    for seed in &seeds {
        exercise_config(seed);
    }
}

// ---------------------------------------------------------------------------
// NBD front end and client.

/// Magics, option and command codes, and lengths at their limits: what a
/// byte-level mutation rarely finds by itself.
const NBD_TOKENS: &[&[u8]] = &[
    b"IHAVEOPT",
    b"NBDMAGIC",
    b"\x25\x60\x95\x13",
    b"\x67\x44\x66\x98",
    b"\x66\x8e\x33\xef",
    b"\x00\x03\xe8\x89\x04\x55\x65\xa9",
    b"\x00\x00\x00\x07",
    b"\x00\x00\x00\x0a",
    b"\xff\xff\xff\xff",
    b"\x7f\xff\xff\xff\xff\xff\xff\xff",
    b"\x00\x00\x00\x00",
];

/// A fuzz target's name and its seeds.
type Seeds = (&'static str, Vec<Vec<u8>>);

/// The seeds of the three NBD targets, read once.
fn nbd_seeds() -> &'static [Seeds] {
    static SEEDS: OnceLock<Vec<Seeds>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        ["nbd_handshake", "nbd_request", "nbd_reply"]
            .into_iter()
            .map(|t| (t, corpus(t)))
            .collect()
    })
}

/// `data` through the entry point of `target`, as its fuzz target calls it.
fn exercise_nbd(target: &str, data: &[u8]) {
    match target {
        "nbd_handshake" => {
            let _ = server_handshake(data);
        }
        "nbd_request" => {
            let _ = server_requests(data);
        }
        _ => {
            let _ = client_handshake(data);
            let _ = client_replies(data);
        }
    }
}

// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_traces_pass_every_reader(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..12),
    ) {
        let seeds = trace_seeds();
        exercise_traces(&mutate(&seeds[seed.index(seeds.len())], &edits, TRACE_TOKENS));
    }

    #[test]
    fn random_bytes_pass_every_reader(data in prop::collection::vec(any::<u8>(), 0..2048)) {
        exercise_traces(&data);
    }

    #[test]
    fn mutated_configs_pass(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..8),
    ) {
        static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
        let seeds = SEEDS.get_or_init(|| corpus("config"));
        exercise_config(&mutate(&seeds[seed.index(seeds.len())], &edits, CONFIG_TOKENS));
    }

    #[test]
    fn mutated_structures_pass(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..16),
    ) {
        static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
        let seeds = SEEDS.get_or_init(|| corpus("parse_structures"));
        exercise_structures(&mutate(&seeds[seed.index(seeds.len())], &edits, &[b"\0\0\0\0", b"\xff\xff\xff\xff"]));
    }

    #[test]
    fn mutated_nbd_streams_pass(
        target in any::<prop::sample::Index>(),
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..12),
    ) {
        let (name, seeds) = &nbd_seeds()[target.index(3)];
        let data = mutate(&seeds[seed.index(seeds.len())], &edits, NBD_TOKENS);
        exercise_nbd(name, &data);
    }
}
