//! The NBD backend against a real nbdkit storage server that is killed and
//! started again: requests continue on a new connection; a server with a
//! volatile write cache (nbdkit's cache filter in write-back mode, which
//! keeps flushed writes and loses the others when killed) gets every
//! acknowledged write it lost written again before anything else, from
//! any number of writers, with the record bounded by early flushes; an
//! absent server fails requests with a typed "unreachable" error once the
//! reconnect delay has passed; and an export that came back with another
//! size is refused.

#![allow(clippy::unwrap_used)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use vdcache_backend::{Backend, NbdBackend, NbdOptions, RewriteTotals, StoreFault};

/// nbdkit's file plugin serving `file` on `socket`, killed when dropped.
struct Nbdkit(Child);

/// nbdkit's cache filter in write-back mode: writes stay in its cache (a
/// deleted temporary file) until a flush, so a kill loses exactly the
/// unflushed ones, as a server with a volatile write cache does.
const VOLATILE: [&str; 2] = ["--filter=cache", "cache=writeback"];

impl Nbdkit {
    fn start(socket: &Path, file: &Path) -> Nbdkit {
        Self::start_with(socket, file, &[])
    }

    /// With `args`: filters (`--filter=...`) and their parameters.
    fn start_with(socket: &Path, file: &Path, args: &[&str]) -> Nbdkit {
        let (filters, params): (Vec<&str>, Vec<&str>) =
            args.iter().partition(|a| a.starts_with("--"));
        let _ = std::fs::remove_file(socket);
        let child = Command::new("nbdkit")
            .arg("--unix")
            .arg(socket)
            .args(["--foreground", "--exit-with-parent"])
            .args(filters)
            .arg("file")
            .arg(file)
            .args(params)
            .stdin(Stdio::null())
            // Its complaints about the readiness probes are noise.
            .stderr(Stdio::null())
            .spawn()
            .expect("run nbdkit (these tests need it and never skip)");
        let start = Instant::now();
        while UnixStream::connect(socket).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "nbdkit never listened"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Nbdkit(child)
    }

    fn kill9(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn setup(size: u64) -> (tempfile::TempDir, PathBuf, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.img");
    std::fs::File::create(&file).unwrap().set_len(size).unwrap();
    let sock = dir.path().join("s.sock");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    (dir, file, sock, uri)
}

fn opts(secs: u64) -> NbdOptions {
    NbdOptions {
        reconnect_delay: Duration::from_secs(secs),
        ..NbdOptions::default()
    }
}

fn read(b: &NbdBackend, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    b.read_at(&mut buf, offset).unwrap();
    buf
}

#[test]
fn a_server_that_lost_its_unflushed_writes_gets_them_again() {
    let (_dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start_with(&sock, &file, &VOLATILE);
    let b = NbdBackend::connect_with(&uri, opts(30)).unwrap();
    b.write_at(&[0x11; 4096], 0).unwrap();
    b.flush().unwrap();
    // Acknowledged, not flushed (a write and a trim, which this server
    // ignores), then the server dies with its cache.
    b.write_at(&[0x22; 8192], 4096).unwrap();
    b.discard(65536, 4096).unwrap();
    server.kill9();
    assert_eq!(
        std::fs::read(&file).unwrap()[4096..8192],
        [0u8; 4096],
        "nbdkit's cache filter lost the unflushed write"
    );
    let server = Nbdkit::start_with(&sock, &file, &VOLATILE);
    b.write_at(&[0x33; 4096], 12288).unwrap();
    assert_eq!(
        read(&b, 0, 4 * 4096),
        [[0x11u8; 4096], [0x22; 4096], [0x22; 4096], [0x33; 4096]].concat()
    );
    b.flush().unwrap();
    assert_eq!(
        b.rewrites(),
        RewriteTotals {
            reconnects: 1,
            writes: 1,
            bytes: 8192,
            early_flushes: 0
        }
    );
    // Everything was flushed: a second loss loses nothing, rewrites
    // nothing.
    server.kill9();
    let server = Nbdkit::start_with(&sock, &file, &VOLATILE);
    assert_eq!(read(&b, 4096, 4096), [0x22; 4096]);
    assert_eq!((b.rewrites().reconnects, b.rewrites().writes), (2, 1));
    drop(b);
    server.kill9();
    let disk = std::fs::read(&file).unwrap();
    assert_eq!(disk[4096..12288], [0x22; 8192]);
    assert_eq!(disk[12288..16384], [0x33; 4096]);
}

/// Writers on several threads keep writing while the server is killed
/// twice under them: whatever was in flight, acknowledged or being
/// recorded, reaches the server's disk.
#[test]
fn concurrent_writers_lose_nothing_across_restarts() {
    const BLOCKS: u64 = 48;
    const WRITERS: u64 = 4;
    let (_dir, file, sock, uri) = setup(WRITERS * BLOCKS * 4096);
    let mut server = Some(Nbdkit::start_with(&sock, &file, &VOLATILE));
    let b = NbdBackend::connect_with(&uri, opts(30)).unwrap();
    let written = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for w in 0..WRITERS {
            let (b, written) = (&b, &written);
            sc.spawn(move || {
                for i in 0..BLOCKS {
                    let block = w * BLOCKS + i;
                    b.write_at(&[(block % 251 + 1) as u8; 4096], block * 4096)
                        .unwrap();
                    written.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        for kill_after in [WRITERS * BLOCKS / 4, WRITERS * BLOCKS / 2] {
            let start = Instant::now();
            while written.load(Ordering::SeqCst) < kill_after {
                assert!(start.elapsed() < Duration::from_secs(60), "writers stuck");
                std::thread::yield_now();
            }
            server.take().unwrap().kill9();
            server = Some(Nbdkit::start_with(&sock, &file, &VOLATILE));
        }
    });
    b.flush().unwrap();
    server.take().unwrap().kill9();
    let disk = std::fs::read(&file).unwrap();
    for block in 0..WRITERS * BLOCKS {
        let at = (block * 4096) as usize;
        assert!(
            disk[at..at + 4096]
                .iter()
                .all(|&x| x == (block % 251 + 1) as u8),
            "block {block} lost (reconnects {:?})",
            b.rewrites()
        );
    }
    // Two restarts, one reconnection each unless the writers were done
    // before the first one (then the flush found both passed).
    assert!(
        (1..=2).contains(&b.rewrites().reconnects),
        "{:?}",
        b.rewrites()
    );
}

/// A server that comes back refusing the rewrite (read-only here) gets
/// every later request failed, naming why: the store never serves on.
#[test]
fn a_refused_rewrite_fails_every_later_request() {
    let (_dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start_with(&sock, &file, &VOLATILE);
    let b = NbdBackend::connect_with(&uri, opts(30)).unwrap();
    b.write_at(&[0x44; 4096], 0).unwrap();
    server.kill9();
    let _server = Nbdkit::start_with(&sock, &file, &["--readonly"]);
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        let err = b.read_at(&mut buf, 0).unwrap_err();
        assert!(
            matches!(
                StoreFault::find(&err),
                Some(StoreFault::RewriteFailed { .. })
            ),
            "{err}"
        );
        assert!(err.to_string().contains(&uri), "{err}");
        assert!(
            err.to_string().contains("could not be written again"),
            "{err}"
        );
        assert!(StoreFault::is_unreachable(&err), "{err}");
    }
    let err = b.flush().unwrap_err();
    assert!(
        matches!(
            StoreFault::find(&err),
            Some(StoreFault::RewriteFailed { .. })
        ),
        "{err}"
    );
    assert_eq!(b.rewrites().reconnects, 0);
}

/// Past its bound the record is flushed early, so a loss finds nothing to
/// write again.
#[test]
fn past_its_bound_the_record_is_flushed_early() {
    let (_dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start_with(&sock, &file, &VOLATILE);
    let limit = 3 * (4096 + 64);
    let b = NbdBackend::connect_with(
        &uri,
        NbdOptions {
            unflushed_limit: limit,
            ..opts(30)
        },
    )
    .unwrap();
    for i in 0..16u8 {
        b.write_at(&[i + 1; 4096], u64::from(i) * 4096).unwrap();
    }
    server.kill9();
    let _server = Nbdkit::start_with(&sock, &file, &VOLATILE);
    for i in 0..16u8 {
        assert_eq!(read(&b, u64::from(i) * 4096, 4096), [i + 1; 4096]);
    }
    // Every fourth write went past the bound.
    assert_eq!(
        b.rewrites(),
        RewriteTotals {
            reconnects: 1,
            writes: 0,
            bytes: 0,
            early_flushes: 4
        }
    );
}

#[test]
fn absent_server_fails_requests_after_the_delay_and_reconnects_later() {
    let (_dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start(&sock, &file);
    let b = NbdBackend::connect_with(&uri, opts(1)).unwrap();
    b.write_at(&[0x44; 4096], 0).unwrap();
    b.flush().unwrap();
    server.kill9();
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        let err = b.read_at(&mut buf, 0).unwrap_err();
        assert!(StoreFault::is_unreachable(&err), "{err}");
        assert!(err.to_string().contains(&uri), "{err}");
        assert!(err.to_string().contains("unreachable"), "{err}");
    }
    let err = b.write_at(&[1; 4096], 0).unwrap_err();
    assert!(StoreFault::is_unreachable(&err), "{err}");
    // Back: the background reconnection finds it (requests fail until it
    // has; poll, bounded).
    let _server = Nbdkit::start(&sock, &file);
    let start = Instant::now();
    loop {
        match b.read_at(&mut buf, 0) {
            Ok(()) => break,
            Err(e) => {
                assert!(StoreFault::is_unreachable(&e), "{e}");
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "never reconnected"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    assert!(buf.iter().all(|&x| x == 0x44));
    b.flush().unwrap();
}

#[test]
fn an_export_that_changed_size_is_refused() {
    let (dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start(&sock, &file);
    let b = NbdBackend::connect_with(&uri, opts(30)).unwrap();
    server.kill9();
    let other = dir.path().join("other.img");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(2 << 20)
        .unwrap();
    let _server = Nbdkit::start(&sock, &other);
    let mut buf = vec![0u8; 4096];
    let err = b.read_at(&mut buf, 0).unwrap_err();
    match StoreFault::find(&err) {
        Some(StoreFault::ExportChanged { was, now, .. }) => {
            assert_eq!((*was, *now), (1 << 20, 2 << 20));
        }
        other => panic!("{other:?}: {err}"),
    }
    assert!(StoreFault::is_unreachable(&err));
    let err = b.write_at(&[0; 4096], 0).unwrap_err();
    assert!(
        matches!(
            StoreFault::find(&err),
            Some(StoreFault::ExportChanged { .. })
        ),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&other).unwrap(),
        vec![0u8; 2 << 20],
        "nothing was written to the other export"
    );
}
