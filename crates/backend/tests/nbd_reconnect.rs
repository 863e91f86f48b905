//! The NBD backend against a real nbdkit storage server that is killed and
//! started again: requests continue on a new connection, a flush after a
//! connection dropped with acknowledged unflushed writes fails exactly
//! once, an absent server fails requests with a typed "unreachable" error
//! once the reconnect delay has passed, and an export that came back with
//! another size is refused.

#![allow(clippy::unwrap_used)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vdcache_backend::{Backend, NbdBackend, NbdOptions, StoreFault};

/// nbdkit's file plugin serving `file` on `socket`, killed when dropped.
struct Nbdkit(Child);

impl Nbdkit {
    fn start(socket: &Path, file: &Path) -> Nbdkit {
        let _ = std::fs::remove_file(socket);
        let child = Command::new("nbdkit")
            .arg("--unix")
            .arg(socket)
            .args(["--foreground", "--exit-with-parent", "file"])
            .arg(file)
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
    }
}

#[test]
fn restart_is_survived_and_lost_writes_fail_one_flush() {
    let (_dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start(&sock, &file);
    let b = NbdBackend::connect_with(&uri, opts(30)).unwrap();
    b.write_at(&[0x11; 4096], 0).unwrap();
    b.flush().unwrap();
    // Acknowledged, not flushed, then the server dies.
    b.write_at(&[0x22; 4096], 4096).unwrap();
    server.kill9();
    let server = Nbdkit::start(&sock, &file);
    b.write_at(&[0x33; 4096], 8192).unwrap();
    let mut buf = vec![0u8; 3 * 4096];
    b.read_at(&mut buf, 0).unwrap();
    assert!(buf[..4096].iter().all(|&x| x == 0x11));
    assert!(buf[8192..].iter().all(|&x| x == 0x33));
    let err = b.flush().unwrap_err();
    assert!(
        matches!(
            StoreFault::find(&err),
            Some(StoreFault::WritesMayBeLost { .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains(&uri), "{err}");
    // Reported once: the caller rewrote, the next flush succeeds.
    b.write_at(&[0x22; 4096], 4096).unwrap();
    b.flush().unwrap();
    b.flush().unwrap();

    // A connection that dropped after a flush covered its writes loses
    // nothing: no flush fails.
    server.kill9();
    let _server = Nbdkit::start(&sock, &file);
    b.read_at(&mut buf, 0).unwrap();
    assert!(buf[4096..8192].iter().all(|&x| x == 0x22));
    b.flush().unwrap();
    drop(b);
}

/// A writer whose acknowledged writes were lost learns it from its own
/// next flush, even when another thread's flush took the first report.
#[test]
fn the_writer_of_lost_writes_is_told_even_if_another_flush_was_first() {
    let (_dir, file, sock, uri) = setup(1 << 20);
    let server = Nbdkit::start(&sock, &file);
    let b = NbdBackend::connect_with(&uri, opts(30)).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| b.write_at(&[0x55; 4096], 0).unwrap())
            .join()
            .unwrap();
    });
    let writer = std::sync::Barrier::new(2);
    let other = std::sync::Barrier::new(2);
    // Outlives the scope: the writer flushes after the main thread is done.
    let mut restarted = None;
    std::thread::scope(|sc| {
        sc.spawn(|| {
            b.write_at(&[0x66; 4096], 4096).unwrap();
            writer.wait(); // written, not flushed
            other.wait(); // the server died and another flush reported it
            let err = b.flush().unwrap_err();
            assert!(
                matches!(
                    StoreFault::find(&err),
                    Some(StoreFault::WritesMayBeLost { .. })
                ),
                "{err}"
            );
            b.write_at(&[0x66; 4096], 4096).unwrap();
            b.flush().unwrap();
        });
        writer.wait();
        server.kill9();
        restarted = Some(Nbdkit::start(&sock, &file));
        let err = b.flush().unwrap_err();
        assert!(
            matches!(
                StoreFault::find(&err),
                Some(StoreFault::WritesMayBeLost { .. })
            ),
            "{err}"
        );
        b.flush().unwrap();
        other.wait();
    });
    b.flush().unwrap();
    let mut buf = vec![0u8; 8192];
    b.read_at(&mut buf, 0).unwrap();
    assert!(buf[4096..].iter().all(|&x| x == 0x66));
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
