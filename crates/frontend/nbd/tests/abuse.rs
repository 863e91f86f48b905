//! Protocol abuse over raw sockets: every misbehaviour gets the error reply
//! or the disconnect the spec asks for, and never disturbs the server or
//! other connections. Also: connection cap, graceful shutdown, socket file
//! handling.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use vdcache_backend::nbd::NbdClient;
use vdcache_nbd_proto::proto::*;
use vdcache_nbd_server::{
    Export, ExportError, Limits, MemExport, Server, ServerError, TlsServerConfig, ZeroFlags,
};

const SIZE: u64 = 8 << 20;

/// A TCP connection to `server` from the local address `from` (another
/// loopback address is another client).
fn tcp_from(from: &str, server: SocketAddr) -> TcpStream {
    use rustix::net::{AddressFamily, SocketType};
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    let local = SocketAddr::new(from.parse().unwrap(), 0);
    rustix::net::bind(&fd, &local).unwrap();
    rustix::net::connect(&fd, &server).unwrap();
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

fn connect(path: &Path) -> UnixStream {
    let s = UnixStream::connect(path).expect("connect");
    // Only a safety net against a hung test: nothing here waits on time.
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// Reads the greeting and answers fixed newstyle + no zeroes.
fn greet(s: &mut (impl Read + Write)) {
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    assert_eq!(be64(&g[0..8]), NBD_MAGIC);
    assert_eq!(be64(&g[8..16]), IHAVEOPT);
    assert_eq!(be16(&g[16..18]) & FLAG_FIXED_NEWSTYLE, FLAG_FIXED_NEWSTYLE);
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
}

fn send_opt(s: &mut impl Write, opt: u32, data: &[u8]) {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
}

fn opt_reply(s: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(be64(&h[0..8]), REPLY_MAGIC);
    let mut d = vec![0u8; be32(&h[16..20]) as usize];
    s.read_exact(&mut d).unwrap();
    (be32(&h[8..12]), be32(&h[12..16]), d)
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

/// NBD_OPT_GO; returns (size, flags).
fn go(s: &mut (impl Read + Write), name: &str) -> (u64, u16) {
    send_opt(s, OPT_GO, &go_data(name));
    let mut sf = None;
    loop {
        let (opt, rep, d) = opt_reply(s);
        assert_eq!(opt, OPT_GO);
        match rep {
            REP_INFO if be16(&d) == INFO_EXPORT => sf = Some((be64(&d[2..10]), be16(&d[10..12]))),
            REP_INFO => {}
            REP_ACK => return sf.expect("NBD_INFO_EXPORT"),
            other => panic!("GO failed: {}", reply_name(other)),
        }
    }
}

fn structured(s: &mut (impl Read + Write)) {
    send_opt(s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(opt_reply(s).1, REP_ACK);
}

/// A connection in the transmission phase.
fn session(path: &Path, name: &str, sr: bool) -> UnixStream {
    let mut s = connect(path);
    greet(&mut s);
    if sr {
        structured(&mut s);
    }
    go(&mut s, name);
    s
}

fn request(
    s: &mut impl Write,
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    length: u32,
    payload: &[u8],
) {
    let mut b = request_bytes(flags, kind, cookie, offset, length);
    b.extend_from_slice(payload);
    s.write_all(&b).unwrap();
}

/// Reads a simple reply header: (error, cookie).
fn simple(s: &mut impl Read) -> (u32, u64) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(be32(&h[0..4]), SIMPLE_REPLY_MAGIC);
    (be32(&h[4..8]), be64(&h[8..16]))
}

/// Reads one structured chunk: (flags, type, cookie, payload).
fn chunk(s: &mut UnixStream) -> (u16, u16, u64, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(be32(&h[0..4]), STRUCTURED_REPLY_MAGIC);
    let mut d = vec![0u8; be32(&h[16..20]) as usize];
    s.read_exact(&mut d).unwrap();
    (be16(&h[4..6]), be16(&h[6..8]), be64(&h[8..16]), d)
}

/// True when the server closed the connection (EOF or reset).
fn closed(s: &mut impl Read) -> bool {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(e) => panic!("unexpected read error {e}"),
        }
    }
}

/// A fresh connection still gets full service.
fn still_serves(path: &Path) {
    let c = NbdClient::connect(&format!("nbd+unix:///?socket={}", path.display())).unwrap();
    let d = pattern(4096, 77);
    c.write_at(SIZE - 4096, &d, true).unwrap();
    let mut b = vec![0u8; 4096];
    c.read_at(SIZE - 4096, &mut b).unwrap();
    assert!(b == d);
}

fn server_with(limits: Limits) -> TestServer {
    let b = Server::builder()
        .export("", Arc::new(MemExport::new(SIZE)))
        .export("ro", Arc::new(MemExport::new(SIZE).read_only(true)))
        .limits(limits);
    TestServer::start_with(b)
}

#[test]
fn handshake_abuse() {
    let t = server_with(Limits {
        max_options: 16,
        ..Default::default()
    });
    let p = &t.socket;

    // Bad option magic.
    let mut s = connect(p);
    greet(&mut s);
    s.write_all(&[0xAAu8; 16]).unwrap();
    assert!(closed(&mut s));

    // Not fixed newstyle (oldstyle-era client), and unknown client flags.
    for flags in [0u32, FLAG_C_FIXED_NEWSTYLE | 1 << 7] {
        let mut s = connect(p);
        let mut g = [0u8; 18];
        s.read_exact(&mut g).unwrap();
        s.write_all(&flags.to_be_bytes()).unwrap();
        assert!(closed(&mut s), "flags {flags:#x} accepted");
    }

    // Unknown and malformed options get errors; the session goes on.
    let mut s = connect(p);
    greet(&mut s);
    send_opt(&mut s, 99, &[1, 2, 3, 4, 5]);
    assert_eq!(
        opt_reply(&mut s),
        (99, REP_ERR_UNSUP, b"option not supported".to_vec())
    );
    send_opt(&mut s, OPT_STARTTLS, &[]);
    assert_eq!(opt_reply(&mut s).1, REP_ERR_UNSUP);
    send_opt(&mut s, OPT_GO, &[0, 0, 0, 9, b'x']);
    assert_eq!(opt_reply(&mut s).1, REP_ERR_INVALID);
    send_opt(&mut s, OPT_INFO, &go_data("nope"));
    assert_eq!(opt_reply(&mut s).1, REP_ERR_UNKNOWN);
    send_opt(&mut s, OPT_LIST, &[1]);
    assert_eq!(opt_reply(&mut s).1, REP_ERR_INVALID);
    let mut meta = go_data("");
    meta.truncate(4);
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
    send_opt(&mut s, OPT_SET_META_CONTEXT, &meta);
    assert_eq!(
        opt_reply(&mut s).1,
        REP_ERR_INVALID,
        "meta context before structured replies"
    );
    structured(&mut s);
    // Query length pointing past the option data.
    let mut bad_meta = meta.clone();
    bad_meta[8..12].copy_from_slice(&1000u32.to_be_bytes());
    send_opt(&mut s, OPT_SET_META_CONTEXT, &bad_meta);
    assert_eq!(opt_reply(&mut s).1, REP_ERR_INVALID);
    send_opt(&mut s, OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (_, rep, d) = opt_reply(&mut s);
        if rep == REP_ACK {
            break;
        }
        assert_eq!(rep, REP_SERVER);
        names.push(String::from_utf8(d[4..4 + be32(&d) as usize].to_vec()).unwrap());
    }
    assert_eq!(names, vec!["".to_string(), "ro".to_string()]);
    let (size, flags) = go(&mut s, "ro");
    assert_eq!(size, SIZE);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_ne!(flags & TFLAG_SEND_DF, 0);
    drop(s);

    // Option length far above the limit: dropped without reading it.
    let mut s = connect(p);
    greet(&mut s);
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&u32::MAX.to_be_bytes());
    s.write_all(&b).unwrap();
    assert!(closed(&mut s));

    // Too many options.
    let mut s = connect(p);
    greet(&mut s);
    let mut answered = 0;
    for _ in 0..17 {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&99u32.to_be_bytes());
        b.extend_from_slice(&0u32.to_be_bytes());
        // The server may already have hung up on the 17th.
        let _ = s.write_all(&b);
        let mut h = [0u8; 20];
        if s.read_exact(&mut h).is_err() {
            break;
        }
        let mut d = vec![0u8; be32(&h[16..20]) as usize];
        s.read_exact(&mut d).unwrap();
        answered += 1;
    }
    assert_eq!(answered, 16);

    // EXPORT_NAME for a missing export can only be answered by closing.
    let mut s = connect(p);
    greet(&mut s);
    send_opt(&mut s, OPT_EXPORT_NAME, b"missing");
    assert!(closed(&mut s));

    // EXPORT_NAME success (no zeroes negotiated: exactly 10 bytes).
    let mut s = connect(p);
    greet(&mut s);
    send_opt(&mut s, OPT_EXPORT_NAME, b"");
    let mut b = [0u8; 10];
    s.read_exact(&mut b).unwrap();
    assert_eq!(be64(&b), SIZE);
    request(&mut s, 0, CMD_FLUSH, 5, 0, 0, &[]);
    assert_eq!(simple(&mut s), (0, 5));
    drop(s);

    // ABORT is acknowledged, then the server closes.
    let mut s = connect(p);
    greet(&mut s);
    send_opt(&mut s, OPT_ABORT, &[]);
    assert_eq!(opt_reply(&mut s).1, REP_ACK);
    assert!(closed(&mut s));

    // Vanishing in the middle of an option.
    let mut s = connect(p);
    greet(&mut s);
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&100u32.to_be_bytes());
    b.extend_from_slice(&[0u8; 10]);
    s.write_all(&b).unwrap();
    drop(s);

    still_serves(p);
}

#[test]
fn transmission_abuse() {
    let t = server_with(Limits::default());
    let p = &t.socket;

    for sr in [false, true] {
        let mut s = session(p, "", sr);
        // Expects an error reply (simple, or an error chunk) with `code`.
        let expect_err = |s: &mut UnixStream, cookie: u64, code: u32| {
            if sr {
                let (flags, kind, c, d) = chunk(s);
                assert_eq!(
                    (flags & REPLY_FLAG_DONE, kind, c),
                    (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie)
                );
                assert_eq!(be32(&d), code, "{}", String::from_utf8_lossy(&d[6..]));
            } else {
                assert_eq!(simple(s), (code, cookie));
            }
        };
        request(&mut s, 0, 99, 1, 0, 0, &[]);
        expect_err(&mut s, 1, EINVAL);
        request(&mut s, 0, CMD_READ, 2, SIZE - 100, 4096, &[]);
        expect_err(&mut s, 2, EINVAL);
        request(&mut s, 0, CMD_READ, 3, u64::MAX - 10, 4096, &[]);
        expect_err(&mut s, 3, EINVAL);
        request(&mut s, 0, CMD_WRITE, 4, SIZE - 100, 4096, &[7u8; 4096]);
        expect_err(&mut s, 4, ENOSPC);
        request(&mut s, 0, CMD_READ, 5, 0, 64 << 20, &[]);
        expect_err(&mut s, 5, EINVAL);
        request(&mut s, CMD_FLAG_NO_HOLE, CMD_READ, 6, 0, 512, &[]);
        expect_err(&mut s, 6, EINVAL);
        request(&mut s, 0, CMD_BLOCK_STATUS, 7, 0, 512, &[]);
        expect_err(&mut s, 7, EINVAL);
        request(&mut s, 0, CMD_TRIM, 8, SIZE, 1, &[]);
        expect_err(&mut s, 8, EINVAL);
        request(&mut s, 0, CMD_WRITE_ZEROES, 9, SIZE - 1, 2, &[]);
        expect_err(&mut s, 9, ENOSPC);
        request(&mut s, 1 << 9, CMD_FLUSH, 10, 0, 0, &[]);
        expect_err(&mut s, 10, EINVAL);
        // Still in sync after all that: a good write and read.
        request(&mut s, CMD_FLAG_FUA, CMD_WRITE, 11, 4096, 8, b"abcdefgh");
        assert_eq!(simple(&mut s), (0, 11));
        request(&mut s, 0, CMD_READ, 12, 4096, 8, &[]);
        if sr {
            let (flags, kind, c, d) = chunk(&mut s);
            assert_eq!(
                (flags, kind, c),
                (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 12)
            );
            assert_eq!(be64(&d), 4096);
            assert_eq!(&d[8..], b"abcdefgh");
        } else {
            assert_eq!(simple(&mut s), (0, 12));
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"abcdefgh");
        }
        // DISC with a request in flight: the reply still comes, then EOF.
        request(&mut s, 0, CMD_FLUSH, 13, 0, 0, &[]);
        request(&mut s, 0, CMD_DISC, 14, 0, 0, &[]);
        assert_eq!(simple(&mut s), (0, 13));
        assert!(closed(&mut s));
    }

    // Read-only export: writes get EPERM.
    let mut s = session(p, "ro", false);
    request(&mut s, 0, CMD_WRITE, 1, 0, 4, b"nope");
    assert_eq!(simple(&mut s), (EPERM, 1));
    request(&mut s, 0, CMD_TRIM, 2, 0, 4096, &[]);
    assert_eq!(simple(&mut s), (EPERM, 2));
    drop(s);

    // Oversized write payload: hard disconnect, others unaffected.
    let mut s = session(p, "", false);
    request(&mut s, 0, CMD_WRITE, 1, 0, (64 << 20) as u32, &[0u8; 1024]);
    assert!(closed(&mut s));

    // Bad request magic: that connection ends.
    let mut other = session(p, "", true);
    let mut s = session(p, "", false);
    s.write_all(&[0x55u8; 28]).unwrap();
    assert!(closed(&mut s));
    request(&mut other, 0, CMD_FLUSH, 1, 0, 0, &[]);
    assert_eq!(simple(&mut other), (0, 1));

    // Client vanishing mid-request (header and half a payload).
    let mut s = session(p, "", false);
    request(&mut s, 0, CMD_WRITE, 1, 0, 65536, &[1u8; 1000]);
    drop(s);

    // Many requests pipelined before reading any reply (64 MiB of reads):
    // the server applies back-pressure but never deadlocks or drops replies.
    let n = 64u64;
    let mut s = session(p, "", false);
    for i in 0..n {
        request(&mut s, 0, CMD_READ, 1000 + i, (i % 8) << 20, 1 << 20, &[]);
    }
    let mut seen = std::collections::HashSet::new();
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..n {
        let (e, c) = simple(&mut s);
        assert_eq!(e, 0);
        s.read_exact(&mut buf).unwrap();
        assert!(seen.insert(c));
    }
    drop(s);
    other
        .write_all(
            &Request {
                flags: 0,
                kind: CMD_DISC,
                cookie: 0,
                offset: 0,
                length: 0,
            }
            .encode(),
        )
        .unwrap();
    assert!(closed(&mut other));

    still_serves(p);
    eventually("all connections closed", || {
        t.server.connection_count() == 0
    });
}

#[test]
fn a_burst_of_requests_ending_in_disc_gets_every_reply() {
    // Replies to requests whose successors already arrived are held for
    // one write; a disconnect right behind them must not lose them.
    let disk = Arc::new(MemExport::new(SIZE));
    let data = pattern(64 * 4096, 5);
    disk.write(0, &data, false).unwrap();
    let t = TestServer::start(vec![("", disk as Arc<dyn Export>)]);
    let mut s = session(&t.socket, "", false);
    let n = 64u64;
    let mut burst = Vec::new();
    for i in 0..n {
        let r = Request {
            flags: 0,
            kind: CMD_READ,
            cookie: 500 + i,
            offset: i * 4096,
            length: 4096,
        };
        burst.extend_from_slice(&r.encode());
    }
    let disc = Request {
        flags: 0,
        kind: CMD_DISC,
        cookie: 0,
        offset: 0,
        length: 0,
    };
    burst.extend_from_slice(&disc.encode());
    s.write_all(&burst).unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut buf = vec![0u8; 4096];
    for _ in 0..n {
        let (e, c) = simple(&mut s);
        assert_eq!(e, 0);
        s.read_exact(&mut buf).unwrap();
        let i = c - 500;
        assert!(i < n && seen.insert(c), "cookie {c}");
        assert!(buf[..] == data[(i * 4096) as usize..((i + 1) * 4096) as usize]);
    }
    assert!(closed(&mut s));
}

#[test]
fn structured_reads_use_holes_and_block_status_honours_req_one() {
    let disk = Arc::new(MemExport::new(SIZE));
    disk.write(1 << 20, &[3u8; 8192], false).unwrap();
    let t = TestServer::start(vec![("", disk.clone() as Arc<dyn Export>)]);
    let mut s = connect(&t.socket);
    greet(&mut s);
    structured(&mut s);
    let mut meta = vec![0u8; 4];
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
    send_opt(&mut s, OPT_SET_META_CONTEXT, &meta);
    let (_, rep, d) = opt_reply(&mut s);
    assert_eq!(rep, REP_META_CONTEXT);
    let id = be32(&d);
    assert_eq!(&d[4..], META_BASE_ALLOCATION.as_bytes());
    assert_eq!(opt_reply(&mut s).1, REP_ACK);
    go(&mut s, "");

    // Read 2 MiB: hole, data, hole.
    request(&mut s, 0, CMD_READ, 1, 0, 2 << 20, &[]);
    let mut got = Vec::new();
    loop {
        let (flags, kind, c, d) = chunk(&mut s);
        assert_eq!(c, 1);
        match kind {
            REPLY_TYPE_OFFSET_HOLE => got.push((be64(&d), u64::from(be32(&d[8..])), true)),
            REPLY_TYPE_OFFSET_DATA => {
                assert!(d[8..].iter().all(|&b| b == 3));
                got.push((be64(&d), (d.len() - 8) as u64, false));
            }
            k => panic!("chunk type {k}"),
        }
        if flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    assert_eq!(
        got,
        vec![
            (0, 1 << 20, true),
            (1 << 20, 8192, false),
            ((1 << 20) + 8192, (1 << 20) - 8192, true)
        ]
    );

    // DF: one data chunk.
    request(&mut s, CMD_FLAG_DF, CMD_READ, 2, 0, 2 << 20, &[]);
    let (flags, kind, _, d) = chunk(&mut s);
    assert_eq!(
        (flags, kind, d.len()),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, (2 << 20) + 8)
    );

    // Block status, whole and REQ_ONE.
    request(&mut s, 0, CMD_BLOCK_STATUS, 3, 0, 2 << 20, &[]);
    let (flags, kind, _, d) = chunk(&mut s);
    assert_eq!(
        (flags, kind, be32(&d)),
        (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, id)
    );
    let ext: Vec<(u32, u32)> = d[4..].chunks(8).map(|c| (be32(c), be32(&c[4..]))).collect();
    assert_eq!(ext[..2], [(1 << 20, 3), (8192, 0)]);
    request(
        &mut s,
        CMD_FLAG_REQ_ONE,
        CMD_BLOCK_STATUS,
        4,
        4096,
        512,
        &[],
    );
    let (_, _, _, d) = chunk(&mut s);
    assert_eq!(d.len(), 12);
    assert_eq!((be32(&d[4..]), be32(&d[8..])), (512, 3));

    // WRITE_ZEROES with FAST_ZERO and NO_HOLE; zero-length requests.
    request(
        &mut s,
        CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE,
        CMD_WRITE_ZEROES,
        5,
        1 << 20,
        4096,
        &[],
    );
    assert_eq!(simple(&mut s), (0, 5));
    request(&mut s, 0, CMD_READ, 6, 100, 0, &[]);
    assert_eq!(chunk(&mut s).1, REPLY_TYPE_NONE);
    request(&mut s, 0, CMD_CACHE, 7, 0, 4096, &[]);
    assert_eq!(simple(&mut s), (0, 7));
    assert_eq!(disk.contents()[1 << 20], 0);
}

#[test]
fn connection_cap_refuses_extra_clients() {
    let t = server_with(Limits {
        max_connections: 3,
        ..Default::default()
    });
    let held: Vec<UnixStream> = (0..3).map(|_| session(&t.socket, "", false)).collect();
    let mut extra = connect(&t.socket);
    assert!(closed(&mut extra), "connection over the cap was served");
    assert_eq!(t.server.stats().refused, 1);
    drop(held);
    eventually("slots freed", || t.server.connection_count() == 0);
    still_serves(&t.socket);
}

#[test]
fn tls_required_before_any_option() {
    let pki = tempfile::tempdir().unwrap();
    make_pki(pki.path());
    let b = Server::builder()
        .export("", Arc::new(MemExport::new(SIZE)))
        .tls(TlsServerConfig::from_x509_dir(pki.path(), false).unwrap());
    let t = TestServer::start_with(b);
    let mut s = connect(&t.socket);
    greet(&mut s);
    for opt in [OPT_LIST, OPT_GO, OPT_STRUCTURED_REPLY, 99] {
        send_opt(&mut s, opt, &go_data(""));
        assert_eq!(
            opt_reply(&mut s).1,
            REP_ERR_TLS_REQD,
            "{}",
            option_name(opt)
        );
    }
    send_opt(&mut s, OPT_STARTTLS, &[1]);
    assert_eq!(opt_reply(&mut s).1, REP_ERR_INVALID);
    send_opt(&mut s, OPT_EXPORT_NAME, b"");
    assert!(closed(&mut s));
    // A failed TLS handshake (garbage instead of a ClientHello) ends only
    // that connection.
    let mut s = connect(&t.socket);
    greet(&mut s);
    send_opt(&mut s, OPT_STARTTLS, &[]);
    assert_eq!(opt_reply(&mut s).1, REP_ACK);
    s.write_all(&[0x16, 3, 1, 0, 5, 1, 2, 3, 4, 5]).unwrap();
    assert!(closed(&mut s));
}

#[test]
fn shutdown_finishes_in_flight_requests() {
    let disk = Arc::new(Gated::new(MemExport::new(SIZE), false));
    let t = TestServer::start(vec![("", disk.clone() as Arc<dyn Export>)]);
    let uri = t.uri("");
    let c = NbdClient::connect(&uri).unwrap();
    let idle = session(&t.socket, "", false);
    std::thread::scope(|sc| {
        let writer = sc.spawn(|| c.write_at(0, b"in flight", false));
        disk.wait_entered(1);
        let handle = t.server.shutdown_handle();
        let stopper = sc.spawn(move || handle.shutdown());
        disk.open();
        stopper.join().unwrap();
        writer
            .join()
            .unwrap()
            .expect("in-flight write must complete");
    });
    assert_eq!(&disk.mem.contents()[..9], b"in flight");
    assert_eq!(t.server.connection_count(), 0);
    assert!(!t.socket.exists(), "socket file left behind");
    assert!(UnixStream::connect(&t.socket).is_err());
    drop(idle);
    // Requests after shutdown fail cleanly.
    assert!(c.flush().is_err());
    assert!(matches!(
        t.server.listen_unix(&t.socket),
        Err(ServerError::ShuttingDown)
    ));
}

#[test]
fn unix_socket_file_handling() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    // A stale socket (nothing listening) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let a = Server::builder()
        .export("", Arc::new(MemExport::new(SIZE)))
        .build()
        .unwrap();
    a.listen_unix(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    still_serves(&path);
    // A live one is not.
    let b = Server::builder()
        .export("", Arc::new(MemExport::new(SIZE)))
        .build()
        .unwrap();
    assert!(matches!(
        b.listen_unix(&path),
        Err(ServerError::AddressInUse { .. })
    ));
    still_serves(&path);
    // Nor is a regular file.
    let file = dir.path().join("regular");
    std::fs::write(&file, b"keep me").unwrap();
    assert!(b.listen_unix(&file).is_err());
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    drop(a);
    assert!(!path.exists());
    // Builder validation.
    assert!(Server::builder().build().is_err());
    assert!(
        Server::builder()
            .export("x", Arc::new(MemExport::new(1)))
            .export("x", Arc::new(MemExport::new(1)))
            .build()
            .is_err()
    );
}

/// An export that cannot zero natively, has no trim, and fails every read
/// that touches `bad`.
struct NoZero(MemExport, std::ops::Range<u64>);

impl Export for NoZero {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, o: u64, b: &mut [u8]) -> Result<(), ExportError> {
        if o < self.1.end && o + b.len() as u64 > self.1.start {
            return Err(ExportError::Io("bad sector".into()));
        }
        self.0.read(o, b)
    }
    fn write(&self, o: u64, d: &[u8], f: bool) -> Result<(), ExportError> {
        self.0.write(o, d, f)
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
        Err(ExportError::NotSupported("no trim".into()))
    }
    fn write_zeroes(&self, _: u64, _: u64, _: ZeroFlags) -> Result<(), ExportError> {
        Err(ExportError::NotSupported("no zeroing".into()))
    }
}

#[test]
fn unsupported_zeroing_falls_back_and_fast_zero_fails_fast() {
    let disk = Arc::new(NoZero(MemExport::with_data(&vec![0xeeu8; 4 << 20]), 0..0));
    let b = Server::builder().export("", disk.clone());
    let server = b.build().unwrap();
    // Served over a socketpair, no listener.
    let (a, mut s) = UnixStream::pair().unwrap();
    server.serve_unix_stream(a).unwrap();
    greet(&mut s);
    go(&mut s, "");
    request(
        &mut s,
        CMD_FLAG_FAST_ZERO,
        CMD_WRITE_ZEROES,
        1,
        0,
        4096,
        &[],
    );
    assert_eq!(simple(&mut s), (ENOTSUP, 1));
    assert_eq!(
        disk.0.contents()[0],
        0xee,
        "a failed fast zero changed data"
    );
    request(&mut s, CMD_FLAG_FUA, CMD_WRITE_ZEROES, 2, 0, 3 << 20, &[]);
    assert_eq!(simple(&mut s), (0, 2));
    assert!(disk.0.contents()[..3 << 20].iter().all(|&b| b == 0));
    // Trim is a hint: unsupported still succeeds.
    request(&mut s, 0, CMD_TRIM, 3, 0, 4096, &[]);
    assert_eq!(simple(&mut s), (0, 3));
    drop(s);
    server.shutdown();
}

#[test]
fn a_failed_read_in_a_burst_gets_an_error_and_the_other_replies_stay_whole() {
    // Replies in a burst are held and written together; a read that fails
    // after its reply was begun must leave nothing of it behind.
    let data = pattern(64 << 10, 9);
    let disk = Arc::new(NoZero(MemExport::with_data(&data), 20 << 10..24 << 10));
    let t = TestServer::start(vec![("", disk as Arc<dyn Export>)]);
    for structured_replies in [false, true] {
        let mut s = session(&t.socket, "", structured_replies);
        // (offset, length, fails)
        let reads = [
            (0u64, 4096u32, false),
            (16 << 10, 16 << 10, true),
            (4096, 8192, false),
            (20 << 10, 512, true),
            (32 << 10, 32 << 10, false),
        ];
        let mut burst = Vec::new();
        for (i, &(offset, length, _)) in reads.iter().enumerate() {
            let r = Request {
                flags: 0,
                kind: CMD_READ,
                cookie: i as u64,
                offset,
                length,
            };
            burst.extend_from_slice(&r.encode());
        }
        s.write_all(&burst).unwrap();
        let mut answered = std::collections::HashSet::new();
        for _ in 0..reads.len() {
            let (cookie, error, got) = if structured_replies {
                let (flags, kind, cookie, payload) = chunk(&mut s);
                assert_eq!(
                    flags & REPLY_FLAG_DONE,
                    REPLY_FLAG_DONE,
                    "one chunk per reply"
                );
                match kind {
                    REPLY_TYPE_OFFSET_DATA => (cookie, 0, payload[8..].to_vec()),
                    REPLY_TYPE_ERROR => (cookie, be32(&payload[0..4]), Vec::new()),
                    k => panic!("chunk type {k}"),
                }
            } else {
                let (error, cookie) = simple(&mut s);
                let (_, length, _) = reads[cookie as usize];
                let mut got = vec![0u8; if error == 0 { length as usize } else { 0 }];
                s.read_exact(&mut got).unwrap();
                (cookie, error, got)
            };
            assert!(answered.insert(cookie), "cookie {cookie} answered twice");
            let (offset, length, fails) = reads[cookie as usize];
            if fails {
                assert_eq!(error, EIO, "cookie {cookie}");
            } else {
                assert_eq!(error, 0, "cookie {cookie}");
                let at = offset as usize;
                assert!(got == data[at..at + length as usize], "cookie {cookie}");
            }
        }
    }
}

#[test]
fn idle_connections_cannot_lock_out_real_clients() {
    // TLS required, default limits, no handshake deadline: only the limits
    // keep room for real clients here.
    let pki = tempfile::tempdir().unwrap();
    make_pki(pki.path());
    let b = Server::builder()
        .export("", Arc::new(MemExport::new(SIZE)))
        .tls(TlsServerConfig::from_x509_dir(pki.path(), false).unwrap())
        .limits(Limits {
            handshake_timeout: None,
            ..Default::default()
        });
    let t = TestServer::start_with(b);
    let max_handshakes = Limits::default().max_handshakes as u64;
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        t.socket.display(),
        pki.path().display()
    );
    let idle: Vec<UnixStream> = (0..300).map(|_| connect(&t.socket)).collect();
    let c = NbdClient::connect(&uri).expect("a real client gets in past 300 idle connections");
    let d = pattern(65536, 3);
    c.write_at(4096, &d, true).unwrap();
    let mut b = vec![0u8; d.len()];
    c.read_at(4096, &mut b).unwrap();
    assert!(b == d);
    // Connections are accepted in order: all 300 were before the client.
    let st = t.server.stats();
    assert_eq!(st.refused, 0);
    assert_eq!(st.evicted, 300 + 1 - max_handshakes);
    assert_eq!(st.handshakes, max_handshakes - 1);

    // Connections past their handshake are never evicted for newcomers.
    // (100 more: 400 idle sockets stay under a default limit of 1024 fds.)
    let more: Vec<UnixStream> = (0..100).map(|_| connect(&t.socket)).collect();
    let c2 = NbdClient::connect(&uri).expect("another real client");
    c.read_at(4096, &mut b).unwrap();
    assert!(b == d);
    c2.read_at(4096, &mut b).unwrap();
    assert!(b == d);
    let st = t.server.stats();
    assert_eq!(st.evicted, 400 + 1 - max_handshakes);
    assert_eq!((st.refused, st.handshake_timeouts), (0, 0));
    drop((idle, more));
}

#[test]
fn a_handshake_has_a_deadline_however_slowly_its_bytes_trickle_in() {
    // A short deadline so the test is quick; nothing waits for it to pass
    // except the server.
    let t = server_with(Limits {
        handshake_timeout: Some(Duration::from_secs(1)),
        ..Default::default()
    });
    // Past its handshake before the others connect: the deadline is not
    // its concern.
    let mut served = session(&t.socket, "", false);
    let mut idle = connect(&t.socket);
    let mut slow = connect(&t.socket);
    greet(&mut slow);
    // One option, a byte every 100 ms: each read gets a byte long before
    // a per-read timeout, but the whole takes 22 s.
    let mut option = IHAVEOPT.to_be_bytes().to_vec();
    option.extend_from_slice(&OPT_INFO.to_be_bytes());
    option.extend_from_slice(&200u32.to_be_bytes());
    option.extend_from_slice(&[0u8; 200]);
    let total = option.len();
    let mut w = slow.try_clone().unwrap();
    let trickler = std::thread::spawn(move || {
        let mut sent = 0;
        for b in option {
            if w.write_all(&[b]).is_err() {
                break;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        sent
    });
    assert!(closed(&mut slow));
    let sent = trickler.join().unwrap();
    assert!(
        sent < total,
        "the server waited for all {total} trickled bytes of the option"
    );
    assert!(closed(&mut idle), "an idle connection stayed open");
    let st = t.server.stats();
    assert_eq!((st.handshake_timeouts, st.evicted, st.refused), (2, 0, 0));
    request(&mut served, 0, CMD_FLUSH, 9, 0, 0, &[]);
    assert_eq!(simple(&mut served), (0, 9));
    still_serves(&t.socket);
}

#[test]
fn per_client_limits_keep_room_for_other_clients() {
    // TCP clients are IP addresses: 127.0.0.1 and 127.0.0.2 are two.
    let server = Server::builder()
        .export("", Arc::new(MemExport::new(SIZE)))
        .limits(Limits {
            max_connections_per_ip: 4,
            max_connections_per_uid: 2,
            handshake_timeout: None,
            ..Default::default()
        })
        .build()
        .unwrap();
    let addr = server.listen_tcp("127.0.0.1:0").unwrap();
    let tcp_session = |from: &str| {
        let mut s = tcp_from(from, addr);
        greet(&mut s);
        go(&mut s, "");
        s
    };
    let mut a: Vec<TcpStream> = (0..3).map(|_| tcp_session("127.0.0.1")).collect();
    let mut a_idle = tcp_from("127.0.0.1", addr);
    // The client's fifth connection evicts its own handshake in progress.
    a.push(tcp_session("127.0.0.1"));
    assert!(closed(&mut a_idle), "the client's idle handshake was kept");
    // Four served connections: the fifth is closed at once.
    let mut a_extra = tcp_from("127.0.0.1", addr);
    assert!(
        closed(&mut a_extra),
        "a fifth connection from one IP was served"
    );
    // Another client is not concerned.
    let mut b = tcp_session("127.0.0.2");
    request(&mut b, 0, CMD_FLUSH, 1, 0, 0, &[]);
    assert_eq!(simple(&mut b), (0, 1));
    for (i, s) in a.iter_mut().enumerate() {
        request(s, 0, CMD_FLUSH, i as u64, 0, 0, &[]);
        assert_eq!(simple(s), (0, i as u64));
    }
    let st = server.stats();
    assert_eq!((st.evicted, st.refused), (1, 1));

    // Unix socket clients are uids (here one: ours).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    server.listen_unix(&path).unwrap();
    let held: Vec<UnixStream> = (0..2).map(|_| session(&path, "", false)).collect();
    let mut extra = connect(&path);
    assert!(
        closed(&mut extra),
        "a third connection from one uid was served"
    );
    assert_eq!(server.stats().refused, 2);
    drop(held);
}

/// Limits under which every read or write over 64 KiB is streamed.
fn streaming() -> Limits {
    Limits {
        payload_chunk: 64 << 10,
        max_buffered_bytes: 64 << 10,
        ..Default::default()
    }
}

/// Reads the chunks of one structured read reply into `buf` (at
/// `offset`): (data chunks, hole chunks, error value if any).
fn structured_read(
    s: &mut UnixStream,
    cookie: u64,
    offset: u64,
    buf: &mut [u8],
) -> (usize, usize, Option<u32>) {
    let (mut data, mut holes, mut error) = (0, 0, None);
    loop {
        let (flags, kind, c, d) = chunk(s);
        assert_eq!(c, cookie);
        match kind {
            REPLY_TYPE_OFFSET_DATA => {
                let at = (be64(&d) - offset) as usize;
                buf[at..at + d.len() - 8].copy_from_slice(&d[8..]);
                data += 1;
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let at = (be64(&d) - offset) as usize;
                buf[at..at + be32(&d[8..]) as usize].fill(0);
                holes += 1;
            }
            REPLY_TYPE_ERROR => error = Some(be32(&d)),
            k => panic!("chunk type {k}"),
        }
        if flags & REPLY_FLAG_DONE != 0 {
            return (data, holes, error);
        }
    }
}

#[test]
fn streamed_payloads_arrive_whole_and_in_order() {
    let disk = Arc::new(MemExport::new(SIZE));
    let data = pattern(300 << 10, 41);
    disk.write(0, &data, false).unwrap();
    disk.write(1 << 20, &data, false).unwrap();
    let t = TestServer::start_with(
        Server::builder()
            .export("", disk.clone() as Arc<dyn Export>)
            .export(
                "bad",
                Arc::new(NoZero(MemExport::with_data(&data), 128 << 10..132 << 10)),
            )
            .limits(streaming()),
    );
    let mut expect = vec![0u8; 2 << 20];
    expect[..data.len()].copy_from_slice(&data);
    expect[1 << 20..(1 << 20) + data.len()].copy_from_slice(&data);

    // Structured, no DF: data in pieces of at most 64 KiB, holes whole.
    let mut s = connect(&t.socket);
    greet(&mut s);
    structured(&mut s);
    go(&mut s, "");
    let mut got = vec![0xeeu8; 2 << 20];
    request(&mut s, 0, CMD_READ, 1, 0, 2 << 20, &[]);
    let (chunks, holes, error) = structured_read(&mut s, 1, 0, &mut got);
    assert!(got == expect);
    assert_eq!((chunks, holes, error), (10, 2, None));
    // DF: one data chunk however large.
    let mut got = vec![0xeeu8; 2 << 20];
    request(&mut s, CMD_FLAG_DF, CMD_READ, 2, 0, 2 << 20, &[]);
    assert_eq!(structured_read(&mut s, 2, 0, &mut got), (1, 0, None));
    assert!(got == expect);
    // A streamed write, read back.
    let new = pattern(200 << 10, 42);
    request(
        &mut s,
        CMD_FLAG_FUA,
        CMD_WRITE,
        3,
        4096,
        new.len() as u32,
        &new,
    );
    assert_eq!(simple(&mut s), (0, 3));
    assert!(disk.contents()[4096..4096 + new.len()] == new[..]);
    drop(s);

    // Simple replies: the header, then all the data.
    let mut s = session(&t.socket, "", false);
    request(&mut s, 0, CMD_READ, 4, 0, 2 << 20, &[]);
    assert_eq!(simple(&mut s), (0, 4));
    let mut got = vec![0u8; 2 << 20];
    s.read_exact(&mut got).unwrap();
    expect[4096..4096 + new.len()].copy_from_slice(&new);
    assert!(got == expect);
    drop(s);

    // A read failing in its first piece gets an error reply; in a later
    // piece, a structured reply ends with an error chunk after the data
    // already sent, and a simple one (which cannot report it) with the
    // connection.
    let mut s = session(&t.socket, "bad", false);
    request(&mut s, 0, CMD_READ, 5, 100 << 10, 200 << 10, &[]);
    assert_eq!(simple(&mut s), (EIO, 5));
    request(&mut s, 0, CMD_READ, 6, 0, 256 << 10, &[]);
    assert_eq!(simple(&mut s), (0, 6));
    let mut head = vec![0u8; 128 << 10];
    s.read_exact(&mut head).unwrap();
    assert!(head[..] == data[..128 << 10]);
    assert!(closed(&mut s));
    let mut s = session(&t.socket, "bad", true);
    let mut got = vec![0u8; 256 << 10];
    request(&mut s, 0, CMD_READ, 7, 0, 256 << 10, &[]);
    assert_eq!(structured_read(&mut s, 7, 0, &mut got), (2, 0, Some(EIO)));
    assert!(got[..128 << 10] == data[..128 << 10]);
    request(&mut s, 0, CMD_FLUSH, 8, 0, 0, &[]);
    assert_eq!(simple(&mut s), (0, 8));
    // A read gives its bytes back right after its reply left.
    eventually("buffered payloads given back", || {
        t.server.stats().buffered_bytes == 0
    });
}
