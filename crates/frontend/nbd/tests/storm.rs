//! 2000 connections opening and closing (some mid-handshake, some
//! mid-request) while another connection keeps writing and verifying its
//! data; afterwards no connection, thread or file descriptor is left over.
//! Alone in its test binary because it counts the process's threads and fds.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::*;
use vdcache_backend::nbd::NbdClient;
use vdcache_nbd_proto::proto::*;
use vdcache_nbd_server::{Limits, MemExport, Server};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// One short-lived client doing something rude, chosen by `i`.
fn cycle(path: &std::path::Path, i: usize) {
    let Ok(mut s) = UnixStream::connect(path) else {
        return;
    };
    let mut g = [0u8; 18];
    match i % 5 {
        0 => {} // connect and vanish
        1 => {
            let _ = s.read_exact(&mut g);
        }
        2 => {
            // Greeting, then half an option.
            let _ = s.read_exact(&mut g);
            let _ = s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
            let _ = s.write_all(&IHAVEOPT.to_be_bytes());
        }
        _ => {
            // Full handshake, then a truncated write or a garbage request.
            let _ = s.read_exact(&mut g);
            let _ = s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
            let mut o = IHAVEOPT.to_be_bytes().to_vec();
            o.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
            o.extend_from_slice(&0u32.to_be_bytes());
            let _ = s.write_all(&o);
            let mut r = [0u8; 10];
            if s.read_exact(&mut r).is_ok() {
                let req = Request {
                    flags: 0,
                    kind: if i % 5 == 3 { CMD_WRITE } else { 77 },
                    cookie: i as u64,
                    offset: 0,
                    length: 4096,
                };
                let _ = s.write_all(&req.encode());
                let _ = s.write_all(&[0u8; 100]);
            }
        }
    }
}

#[test]
fn connection_storm_leaves_nothing_behind() {
    let disk = Arc::new(MemExport::new(64 << 20));
    let t = TestServer::start_with(Server::builder().export("", disk).limits(Limits {
        max_connections: 64,
        ..Default::default()
    }));
    let base_threads = threads();
    let base_fds = fds();

    let stop = AtomicBool::new(false);
    let verified = AtomicU64::new(0);
    let uri = t.uri("");
    std::thread::scope(|sc| {
        let verifier = sc.spawn(|| {
            let c = NbdClient::connect(&uri).unwrap();
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) || round < 20 {
                let off = (round % 256) * 65536;
                let d = pattern(65536, round);
                c.write_at(off, &d, false).unwrap();
                let mut b = vec![0u8; 65536];
                c.read_at(off, &mut b).unwrap();
                assert!(b == d, "round {round}: data mismatch");
                round += 1;
                verified.store(round, Ordering::Relaxed);
            }
        });
        let workers: Vec<_> = (0..4)
            .map(|w| {
                let p = t.socket.clone();
                sc.spawn(move || {
                    for i in (w..2000).step_by(4) {
                        cycle(&p, i);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        verifier.join().unwrap();
    });
    assert!(verified.load(Ordering::Relaxed) >= 20);
    let st = t.server.stats();
    assert!(
        st.accepted + st.refused >= 2001,
        "{} + {}",
        st.accepted,
        st.refused
    );
    eventually("connections closed", || t.server.connection_count() == 0);
    eventually("threads gone", || threads() <= base_threads);
    eventually("fds closed", || fds() <= base_fds);
    // And the server still works.
    let c = NbdClient::connect(&uri).unwrap();
    c.flush().unwrap();
}
