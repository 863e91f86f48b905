//! Seed inputs of the NBD fuzz targets (`fuzz/corpus/nbd_*`): built here
//! from the protocol's encoders, checked to do what they are meant to
//! through the fuzzing entry points (a handshake that reaches the
//! transmission phase, replies that complete their requests), and
//! compared with the committed files. `VDCACHE_WRITE_FUZZ_SEEDS=1` writes
//! the files instead.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use common::request_bytes;
use std::path::PathBuf;

use vdcache_backend::nbd::fuzzing::{self as client_fuzzing, PENDING};
use vdcache_nbd_proto::proto::*;
use vdcache_nbd_server::fuzzing;

fn corpus(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../fuzz/corpus")
        .join(target)
}

/// Writes (with `VDCACHE_WRITE_FUZZ_SEEDS=1`) or checks the seed files.
fn keep(target: &str, seeds: &[(&str, Vec<u8>)]) {
    let dir = corpus(target);
    let write = std::env::var_os("VDCACHE_WRITE_FUZZ_SEEDS").is_some();
    for (name, bytes) in seeds {
        let path = dir.join(name);
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, bytes).unwrap();
        } else {
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (VDCACHE_WRITE_FUZZ_SEEDS=1 writes it)",
                    path.display()
                )
            });
            assert!(
                committed == *bytes,
                "{} differs from what this test builds",
                path.display()
            );
        }
    }
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

fn string32(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u32).to_be_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = string32(name);
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = string32(name);
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&string32(q));
    }
    d
}

fn write_request_bytes(cookie: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut b = request_bytes(0, CMD_WRITE, cookie, offset, data.len() as u32);
    b.extend_from_slice(data);
    b
}

fn disc() -> Vec<u8> {
    request_bytes(0, CMD_DISC, 0, 0, 0)
}

fn client_flags() -> Vec<u8> {
    (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec()
}

#[test]
fn handshake_seeds() {
    // What qemu and libnbd send: structured replies, base:allocation, GO
    // asking for block sizes; then a few requests.
    let mut modern = client_flags();
    modern.extend(option(OPT_STRUCTURED_REPLY, &[]));
    modern.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_data("", &[META_BASE_ALLOCATION]),
    ));
    modern.extend(option(OPT_GO, &go_data("", &[INFO_BLOCK_SIZE])));
    modern.extend(write_request_bytes(1, 0, &[0xab; 512]));
    modern.extend(request_bytes(0, CMD_READ, 2, 0, 8192));
    modern.extend(request_bytes(0, CMD_BLOCK_STATUS, 3, 0, 65536));
    modern.extend(disc());
    // The oldest fixed newstyle clients: EXPORT_NAME, zeroes kept.
    let mut old = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    old.extend(option(OPT_EXPORT_NAME, b""));
    old.extend(request_bytes(0, CMD_FLUSH, 1, 0, 0));
    old.extend(disc());
    // What nbdinfo --list does, and everything else the server answers.
    let mut list = client_flags();
    list.extend(option(OPT_LIST, &[]));
    list.extend(option(
        OPT_INFO,
        &go_data("ro", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]),
    ));
    list.extend(option(OPT_STRUCTURED_REPLY, &[]));
    list.extend(option(OPT_LIST_META_CONTEXT, &meta_data("", &[])));
    list.extend(option(99, &[1, 2, 3]));
    list.extend(option(OPT_ABORT, &[]));
    // A TLS client's first option.
    let mut tls = client_flags();
    tls.extend(option(OPT_STARTTLS, &[]));
    tls.extend([0x16, 3, 1, 0, 4, 1, 0, 0, 0]);

    let run = fuzzing::server_handshake(&modern);
    assert!(run.transmission);
    let run = fuzzing::server_handshake(&old);
    assert!(run.transmission);
    // EXPORT_NAME without NO_ZEROES: 8 + 2 + 124 bytes, then the reply.
    assert_eq!(run.sent.len(), 18 + 134 + 16);
    let run = fuzzing::server_handshake(&list);
    assert!(!run.transmission);
    assert!(run.sent.windows(4).any(|w| w == b"fuzz"), "description");
    assert!(!fuzzing::server_handshake(&tls).transmission);
    keep(
        "nbd_handshake",
        &[
            ("modern", modern),
            ("export-name", old),
            ("list-info-abort", list),
            ("starttls", tls),
        ],
    );
}

#[test]
fn request_seeds() {
    let size = fuzzing::EXPORT_SIZE;
    // Simple replies, read-write export: every command, errors included.
    let mut simple = vec![0u8];
    simple.extend(write_request_bytes(1, 4096, &[0x5a; 4096]));
    simple.extend(request_bytes(CMD_FLAG_FUA, CMD_READ, 2, 4096, 4096));
    simple.extend(request_bytes(0, CMD_FLUSH, 3, 0, 0));
    simple.extend(request_bytes(0, CMD_TRIM, 4, 0, 4096));
    simple.extend(request_bytes(
        CMD_FLAG_NO_HOLE,
        CMD_WRITE_ZEROES,
        5,
        8192,
        4096,
    ));
    simple.extend(request_bytes(0, CMD_CACHE, 6, 0, 4096));
    simple.extend(request_bytes(0, CMD_READ, 7, size - 100, 4096));
    simple.extend(request_bytes(0, 99, 8, 0, 0));
    simple.extend(request_bytes(0, CMD_READ, 9, 0, 16384));
    simple.extend(disc());
    // Structured replies and base:allocation: streamed writes and reads
    // (over the fuzzing server's 4 KiB chunk), holes, DF, block status.
    let mut structured = vec![3u8];
    structured.extend(write_request_bytes(1, 16384, &[0x77; 8192]));
    structured.extend(request_bytes(0, CMD_READ, 2, 0, 32768));
    structured.extend(request_bytes(CMD_FLAG_DF, CMD_READ, 3, 16384, 8192));
    structured.extend(request_bytes(0, CMD_BLOCK_STATUS, 4, 0, size as u32));
    structured.extend(request_bytes(
        CMD_FLAG_REQ_ONE,
        CMD_BLOCK_STATUS,
        5,
        4096,
        512,
    ));
    structured.extend(request_bytes(
        CMD_FLAG_FAST_ZERO,
        CMD_WRITE_ZEROES,
        6,
        0,
        4096,
    ));
    structured.extend(disc());
    // 512-byte blocks: aligned and unaligned requests.
    let mut aligned = vec![2u8 << 2];
    aligned.extend(write_request_bytes(1, 512, &[1; 512]));
    aligned.extend(request_bytes(0, CMD_READ, 2, 100, 512));
    aligned.extend(request_bytes(0, CMD_READ, 3, 512, 512));
    aligned.extend(disc());
    // Read-only export.
    let mut ro = vec![1u8 << 2];
    ro.extend(write_request_bytes(1, 0, &[2; 16]));
    ro.extend(request_bytes(0, CMD_TRIM, 2, 0, 4096));
    ro.extend(request_bytes(0, CMD_READ, 3, 0, 16));
    ro.extend(disc());

    let run = fuzzing::server_requests(&simple);
    // Replies: 2 with data (4096, 16384 bytes), 10 headers of 16 bytes
    // minus the disconnect's.
    assert_eq!(run.sent.len(), 9 * 16 + 4096 + 16384);
    assert!(run.sent.windows(8).any(|w| w == [0x5a; 8]));
    for seed in [&structured, &aligned, &ro] {
        let run = fuzzing::server_requests(seed);
        assert!(run.transmission && !run.sent.is_empty());
    }
    keep(
        "nbd_request",
        &[
            ("simple", simple),
            ("structured", structured),
            ("aligned-512", aligned),
            ("read-only", ro),
        ],
    );
}

fn chunk(flags: u16, kind: u16, cookie: u64, payload: &[u8]) -> Vec<u8> {
    let mut b = chunk_header(cookie, flags, kind, payload.len() as u32).to_vec();
    b.extend_from_slice(payload);
    b
}

#[test]
fn reply_seeds() {
    assert_eq!(PENDING[0], (CMD_READ, 0, 512));
    assert_eq!(PENDING[1], (CMD_READ, 4096, 65536));
    assert_eq!(PENDING[2].0, CMD_BLOCK_STATUS);
    // Simple replies: data for cookie 1, success for 4, EIO for 5.
    let mut simple = vec![0u8];
    simple.extend(simple_reply(1, 0));
    simple.extend([0x11; 512]);
    simple.extend(simple_reply(4, 0));
    simple.extend(simple_reply(5, EIO));
    // Structured: a data chunk, a hole and data chunks in pieces, block
    // status, an error chunk, NONE.
    let mut structured = vec![1u8];
    let mut data = 0u64.to_be_bytes().to_vec();
    data.extend([0x22; 512]);
    structured.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 1, &data));
    let mut hole = 4096u64.to_be_bytes().to_vec();
    hole.extend(65024u32.to_be_bytes());
    structured.extend(chunk(0, REPLY_TYPE_OFFSET_HOLE, 2, &hole));
    let mut data = (4096u64 + 65024).to_be_bytes().to_vec();
    data.extend([0x33; 512]);
    structured.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 2, &data));
    let mut bs = 1u32.to_be_bytes().to_vec();
    for (len, flags) in [(65536u32, STATE_HOLE | STATE_ZERO), (4096, 0)] {
        bs.extend(len.to_be_bytes());
        bs.extend(flags.to_be_bytes());
    }
    structured.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 3, &bs));
    let mut err = EIO.to_be_bytes().to_vec();
    err.extend(3u16.to_be_bytes());
    err.extend(b"bad");
    structured.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6, &err));
    structured.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 5, &[]));
    // The server's side of a modern handshake (read by the client's
    // handshake; as replies it is garbage, which is fine too).
    let mut handshake = NBD_MAGIC.to_be_bytes().to_vec();
    handshake.extend(IHAVEOPT.to_be_bytes());
    handshake.extend((FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    handshake.extend(option_reply_header(OPT_STRUCTURED_REPLY, REP_ACK, 0));
    let mut ctx = 1u32.to_be_bytes().to_vec();
    ctx.extend(META_BASE_ALLOCATION.as_bytes());
    handshake.extend(option_reply_header(
        OPT_SET_META_CONTEXT,
        REP_META_CONTEXT,
        ctx.len() as u32,
    ));
    handshake.extend(&ctx);
    handshake.extend(option_reply_header(OPT_SET_META_CONTEXT, REP_ACK, 0));
    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
    info.extend((1u64 << 30).to_be_bytes());
    info.extend((TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).to_be_bytes());
    handshake.extend(option_reply_header(OPT_GO, REP_INFO, info.len() as u32));
    handshake.extend(&info);
    let mut bsz = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for v in [1u32, 4096, 32 << 20] {
        bsz.extend(v.to_be_bytes());
    }
    handshake.extend(option_reply_header(OPT_GO, REP_INFO, bsz.len() as u32));
    handshake.extend(&bsz);
    handshake.extend(option_reply_header(OPT_GO, REP_ACK, 0));

    let r = client_fuzzing::client_replies(&simple);
    assert_eq!(r.stream, Ok(()));
    assert_eq!(r.results[0].as_ref().unwrap(), &vec![0x11; 512]);
    assert!(r.results[3].is_ok());
    assert!(r.results[4].is_err());
    let r = client_fuzzing::client_replies(&structured);
    assert_eq!(r.stream, Ok(()));
    assert_eq!(r.results[0].as_ref().unwrap(), &vec![0x22; 512]);
    let read2 = r.results[1].as_ref().unwrap();
    assert!(read2[..65024].iter().all(|&b| b == 0));
    assert!(read2[65024..].iter().all(|&b| b == 0x33));
    assert_eq!(r.results[2].as_ref().unwrap().len(), 16, "two extents");
    assert!(r.results[4].is_ok());
    assert!(r.results[5].is_err());
    assert_eq!(
        client_fuzzing::client_handshake(&handshake).unwrap(),
        (1 << 30, TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH)
    );
    keep(
        "nbd_reply",
        &[
            ("simple", simple),
            ("structured", structured),
            ("handshake", handshake),
        ],
    );
}
