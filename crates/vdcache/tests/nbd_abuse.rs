//! Issue 3, done-when 3, end to end against `vdcache serve`: protocol abuse
//! over raw sockets (bad magic, unknown option, oversized lengths, reads
//! past the end, unknown command, clients vanishing mid-request, thousands
//! of connections opening and closing) gets the protocol's error replies
//! or a closed connection, while a long-lived connection of our own and a
//! loop of qemu-io runs keep writing and verifying their data. The server
//! must stay up, stop cleanly, and leave a clean image.
//!
//! The protocol constants are written out here from the NBD spec rather
//! than taken from the nbd crate, so the server is checked by an
//! independent encoder.

use crate::common;
use crate::serving;

use common::{Scratch, ok};
use serving::{pattern, qcow2, qemu_io, serve, stats, uri};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const SIZE: u64 = 16 << 20;

const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
const FLAG_C_NO_ZEROES: u32 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const EINVAL: u32 = 22;

/// A raw NBD client (simple replies only).
struct Conn {
    s: UnixStream,
    cookie: u64,
}

impl Conn {
    /// Connects and completes the greeting (fixed newstyle, no zeroes).
    fn open(path: &Path) -> Conn {
        let mut s = UnixStream::connect(path).expect("connect");
        // A safety net against a hung test only; no decision waits on time.
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut g = [0u8; 18];
        s.read_exact(&mut g).expect("greeting");
        assert_eq!(
            u64::from_be_bytes(g[0..8].try_into().expect("8")),
            NBD_MAGIC
        );
        assert_eq!(
            u64::from_be_bytes(g[8..16].try_into().expect("8")),
            IHAVEOPT
        );
        assert_eq!(g[17] & 1, 1, "fixed newstyle");
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
            .expect("client flags");
        Conn { s, cookie: 0 }
    }

    /// A connection in the transmission phase of the default export.
    fn session(path: &Path) -> Conn {
        let mut c = Conn::open(path);
        let (size, _) = c.go("").expect("NBD_OPT_GO");
        assert_eq!(size, SIZE);
        c
    }

    fn send_opt(&mut self, opt: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).expect("send option");
    }

    fn opt_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("option reply");
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().expect("8")),
            OPT_REPLY_MAGIC
        );
        let len = u32::from_be_bytes(h[16..20].try_into().expect("4"));
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).expect("option reply data");
        (
            u32::from_be_bytes(h[8..12].try_into().expect("4")),
            u32::from_be_bytes(h[12..16].try_into().expect("4")),
            d,
        )
    }

    /// NBD_OPT_GO: Ok((size, transmission flags)) or Err(reply type).
    fn go(&mut self, name: &str) -> Result<(u64, u16), u32> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        self.send_opt(OPT_GO, &d);
        let mut export = None;
        loop {
            let (opt, rep, d) = self.opt_reply();
            assert_eq!(opt, OPT_GO);
            match rep {
                REP_INFO if d.len() >= 12 && d[0..2] == [0, 0] => {
                    export = Some((
                        u64::from_be_bytes(d[2..10].try_into().expect("8")),
                        u16::from_be_bytes(d[10..12].try_into().expect("2")),
                    ))
                }
                REP_INFO => {}
                REP_ACK => return Ok(export.expect("NBD_INFO_EXPORT before the ACK")),
                err => return Err(err),
            }
        }
    }

    fn request(&mut self, flags: u16, kind: u16, offset: u64, length: u32, payload: &[u8]) -> u64 {
        self.cookie += 1;
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&self.cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&length.to_be_bytes());
        b.extend_from_slice(payload);
        self.s.write_all(&b).expect("send request");
        self.cookie
    }

    /// A simple reply: (error, cookie).
    fn reply(&mut self) -> (u32, u64) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).expect("reply");
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().expect("4")),
            SIMPLE_REPLY_MAGIC
        );
        (
            u32::from_be_bytes(h[4..8].try_into().expect("4")),
            u64::from_be_bytes(h[8..16].try_into().expect("8")),
        )
    }

    /// Sends `kind` and expects an error reply with `errno`.
    fn expect_error(&mut self, kind: u16, offset: u64, length: u32, errno: u32) {
        let c = self.request(0, kind, offset, length, &[]);
        assert_eq!(
            self.reply(),
            (errno, c),
            "command {kind} offset {offset} length {length}"
        );
    }

    fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        let c = self.request(0, CMD_READ, offset, len as u32, &[]);
        assert_eq!(self.reply(), (0, c), "read {offset}+{len}");
        let mut b = vec![0u8; len];
        self.s.read_exact(&mut b).expect("read payload");
        b
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let c = self.request(0, CMD_WRITE, offset, data.len() as u32, data);
        assert_eq!(self.reply(), (0, c), "write {offset}+{}", data.len());
    }

    fn flush(&mut self) {
        let c = self.request(0, CMD_FLUSH, 0, 0, &[]);
        assert_eq!(self.reply(), (0, c), "flush");
    }

    /// True when the server closes the connection (EOF or reset); any
    /// bytes it sends first are skipped.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// Our long-lived connection: owns [2M, 2.25M), rewrites and verifies it.
struct Keeper {
    c: Conn,
    round: u64,
    data: Vec<u8>,
}

const KEEPER_OFF: u64 = 2 << 20;

impl Keeper {
    fn new(path: &Path) -> Keeper {
        let mut k = Keeper {
            c: Conn::session(path),
            round: 0,
            data: Vec::new(),
        };
        k.step("start");
        k
    }

    /// Verifies what it wrote last, then writes something new.
    fn step(&mut self, after: &str) {
        if !self.data.is_empty() {
            let got = self.c.read(KEEPER_OFF, self.data.len());
            assert!(
                got == self.data,
                "the long-lived connection's data changed after: {after}"
            );
        }
        self.round += 1;
        self.data = pattern(256 << 10, self.round);
        self.c.write(KEEPER_OFF, &self.data);
        self.c.flush();
    }
}

/// Sets the flag when dropped (also while unwinding).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Opens and closes connections in four ways, `n` times.
fn churn(path: &Path, n: usize, salt: usize) {
    for i in 0..n {
        match (i + salt) % 4 {
            // Connect and hang up at once.
            0 => drop(UnixStream::connect(path).expect("connect")),
            // Greeting only.
            1 => drop(Conn::open(path)),
            // Full session, a read, orderly NBD_CMD_DISC.
            2 => {
                let mut c = Conn::session(path);
                let b = c.read(12 << 20, 512);
                assert!(b.iter().all(|&x| x == 0));
                c.request(0, CMD_DISC, 0, 0, &[]);
                assert!(c.closed(), "the server closes after NBD_CMD_DISC");
            }
            // Full session, then vanish without NBD_CMD_DISC.
            _ => drop(Conn::session(path)),
        }
    }
}

#[test]
fn protocol_abuse_never_disturbs_other_connections() {
    let s = Scratch::new();
    let img = s.path("abused.qcow2");
    qcow2(&s, &img, SIZE, None);
    let sock = s.path("abuse.sock");
    let mut server = serve(&s, &sock, &[img.to_str().expect("utf-8")]);
    let p = sock.as_path();
    let u = uri(&sock, "");
    let stop = AtomicBool::new(false);

    std::thread::scope(|scope| {
        // qemu-io, connecting again and again, writes and verifies [1M, 2M).
        let verifier = scope.spawn(|| {
            let mut rounds = 0u32;
            while !stop.load(Ordering::SeqCst) || rounds < 3 {
                let byte = rounds % 250 + 1;
                let before = if rounds == 0 {
                    0
                } else {
                    (rounds - 1) % 250 + 1
                };
                qemu_io(
                    &s,
                    "raw",
                    &u,
                    &[
                        format!("read -P {before} 1M 1M"),
                        format!("write -P {byte} 1M 1M"),
                        format!("read -P {byte} 1M 1M"),
                    ],
                );
                rounds += 1;
            }
            rounds
        });
        // If an assertion below fails, the verifier must still stop, or
        // the scope would wait for it forever.
        let _stop_on_panic = StopOnDrop(&stop);
        let mut keeper = Keeper::new(p);

        // Bad option magic: the server hangs up.
        let mut c = Conn::open(p);
        c.s.write_all(&[0xaa; 16]).expect("send");
        assert!(c.closed(), "bad option magic must end the connection");
        keeper.step("bad option magic");

        // Unknown option: NBD_REP_ERR_UNSUP, and the session goes on;
        // a missing export: NBD_REP_ERR_UNKNOWN.
        let mut c = Conn::open(p);
        c.send_opt(99, &[1, 2, 3, 4, 5]);
        let (opt, rep, _) = c.opt_reply();
        assert_eq!((opt, rep), (99, REP_ERR_UNSUP));
        assert_eq!(c.go("no-such-export"), Err(REP_ERR_UNKNOWN));
        assert_eq!(c.go("").expect("GO after errors").0, SIZE);
        assert_eq!(c.read(0, 512), vec![0u8; 512]);
        drop(c);
        keeper.step("unknown option");

        // Oversized option length: dropped without being read.
        let mut c = Conn::open(p);
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&u32::MAX.to_be_bytes());
        c.s.write_all(&b).expect("send");
        assert!(c.closed(), "a 4 GiB option must end the connection");
        keeper.step("oversized option");

        // Transmission: error replies, then the connection is still in sync.
        let mut c = Conn::session(p);
        c.expect_error(99, 0, 0, EINVAL);
        c.expect_error(CMD_READ, SIZE - 100, 4096, EINVAL);
        c.expect_error(CMD_READ, SIZE, 1, EINVAL);
        c.expect_error(CMD_READ, u64::MAX - 10, 4096, EINVAL);
        c.expect_error(CMD_READ, 0, 64 << 20, EINVAL);
        c.write(5 << 20, b"still in sync");
        assert_eq!(c.read(5 << 20, 13), b"still in sync");
        drop(c);
        keeper.step("unknown command and reads past the end");

        // Oversized write: the payload cannot be skipped safely; hang up.
        let mut c = Conn::session(p);
        c.request(0, CMD_WRITE, 0, 64 << 20, &[0x55; 4096]);
        assert!(c.closed(), "a 64 MiB write must end the connection");
        keeper.step("oversized write");

        // Bad request magic.
        let mut c = Conn::session(p);
        c.s.write_all(&[0x55; 28]).expect("send");
        assert!(c.closed(), "bad request magic must end the connection");
        keeper.step("bad request magic");

        // Vanishing mid-request: half a write payload (into [8M, 8M+64K),
        // which nobody writes and must stay zero), a big read whose reply
        // nobody reads, half an option.
        let mut c = Conn::session(p);
        c.request(0, CMD_WRITE, 8 << 20, 65536, &[0x77; 1000]);
        drop(c);
        let mut c = Conn::session(p);
        for i in 0..8 {
            c.request(0, CMD_READ, i << 20, 1 << 20, &[]);
        }
        drop(c);
        let mut c = Conn::open(p);
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&100u32.to_be_bytes());
        b.extend_from_slice(&[0u8; 10]);
        c.s.write_all(&b).expect("send");
        drop(c);
        keeper.step("clients vanishing mid-request");

        // Thousands of connections opening and closing, two at a time.
        std::thread::scope(|inner| {
            let a = inner.spawn(|| churn(p, 1000, 0));
            let b = inner.spawn(|| churn(p, 1000, 1));
            a.join().expect("churn thread");
            b.join().expect("churn thread");
        });
        keeper.step("2000 connections opening and closing");

        stop.store(true, Ordering::SeqCst);
        let rounds = verifier.join().expect("the qemu-io verifier failed");
        assert!(rounds >= 3);
        server.assert_alive();
        keeper.step("the end");
    });

    qemu_io(
        &s,
        "raw",
        &u,
        &[
            "read -P 0 8M 64K".into(),
            "read -P 0 0 1M".into(),
            "read -P 0 3M 2M".into(),
        ],
    );
    let st = stats(&s, &sock);
    let accepted = st["connections_accepted"].as_u64().expect("counter");
    assert!(accepted >= 2000, "connections_accepted {accepted}");
    let log = server.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    ok(s.qemu_img().arg("check").arg(&img));
    s.finish();
}

/// Reads until the server closes the connection; false if it sends
/// anything but its greeting (18 bytes) first or the read fails otherwise.
fn closed_after_greeting(s: &mut UnixStream) -> bool {
    let mut got = Vec::new();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return got.len() <= 18,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn idle_connections_cannot_lock_out_real_clients() {
    // Issue 18: 260 idle connections used to fill the 256-connection
    // limit and keep every real client out.
    let s = Scratch::new();
    let img = s.path("idle.qcow2");
    qcow2(&s, &img, SIZE, None);
    let sock = s.path("idle.sock");
    let server = serve(&s, &sock, &[img.to_str().expect("utf-8")]);
    let u = uri(&sock, "");
    let idle: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(&sock).expect("connect"))
        .collect();
    let out = ok(s.cmd("nbdinfo").arg("--size").arg(&u));
    assert_eq!(out.stdout.trim(), SIZE.to_string());
    qemu_io(
        &s,
        "raw",
        &u,
        &["write -P 7 0 64K".into(), "read -P 7 0 64K".into()],
    );
    let st = stats(&s, &sock);
    let counter = |k: &str| st[k].as_u64().unwrap_or_else(|| panic!("{k} in {st}"));
    assert_eq!(counter("connections_refused"), 0);
    // 64 handshakes at most (the default): the oldest idle ones made room
    // (or, on a very slow machine, timed out first).
    assert!(
        counter("connections_evicted") + counter("handshake_timeouts") >= 300 - 64,
        "{st}"
    );
    assert!(counter("connections_in_handshake") <= 64, "{st}");
    drop(idle);
    let log = server.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    s.finish();
}

#[test]
fn plaintext_tcp_is_warned_about_saying_who_can_reach_it() {
    let s = Scratch::new();
    let img = s.path("tcp.qcow2");
    qcow2(&s, &img, SIZE, None);
    let img = img.to_str().expect("utf-8");
    for (i, (addr, who)) in [
        ("0.0.0.0:0", "crosses the network in plaintext"),
        ("127.0.0.1:0", "every local user"),
    ]
    .into_iter()
    .enumerate()
    {
        let sock = s.path(&format!("tcp{i}.sock"));
        let server = serve(&s, &sock, &[img, "--tcp", addr, "--insecure-tcp"]);
        let log = server.stop_clean();
        assert!(log.contains("listening on tcp"), "{log}");
        assert!(
            log.contains("without TLS") && log.contains(who),
            "--tcp {addr}, log:\n{log}"
        );
    }
    s.finish();
}

#[test]
fn the_handshake_deadline_comes_from_the_config_file() {
    let s = Scratch::new();
    let img = s.path("deadline.qcow2");
    qcow2(&s, &img, SIZE, None);
    let sock = s.path("deadline.sock");
    let cfg = s.path("deadline.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nsocket = \"{}\"\nhandshake_timeout = 1\nmax_handshakes = 8\n\
             max_buffered = \"16M\"\n\n[[export]]\nname = \"\"\nimage = \"{}\"\n",
            sock.display(),
            img.display()
        ),
    )
    .expect("write config");
    let server = serving::serve_config(&s, &cfg, &sock);
    // Greeted, then closed once a second has passed without a handshake
    // (the safety-net read timeout of 60 s is far away).
    let mut c = Conn::open(&sock);
    assert!(closed_after_greeting(&mut c.s));
    assert_eq!(stats(&s, &sock)["handshake_timeouts"].as_u64(), Some(1));
    // A real client is not concerned.
    qemu_io(&s, "raw", &uri(&sock, ""), &["read -P 0 0 4K".into()]);
    server.stop_clean();
    s.finish();
}
