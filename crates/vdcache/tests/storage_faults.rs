//! Issue 25, storage server faults: images on an nbdkit storage server,
//! served by `vdcache serve` through a write-back flash cache.
//!
//! - The storage server is killed (SIGKILL) in the middle of a write-back
//!   and started again: vdcache reconnects, the write-back finishes, and a
//!   clean stop leaves every image with exactly what was written.
//! - The storage server is gone for good: SIGTERM still ends vdcache, which
//!   keeps the dirty data in the cache and says so; the images stay marked
//!   as needing the cache; a later start with the server back writes
//!   everything, and a clean stop leaves the images complete.

use crate::common;
use crate::serving;

use common::{Scratch, exec, ok};
use serving::{
    Streamed, nbdkit_with, qcow2, qemu_io, raw_of, serve_config, stats, storage_dir, uri,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const M: u64 = 1 << 20;

/// Every write-back request waits this long on the storage server, so a
/// write-back of tens of MiB lasts seconds: long enough to kill the server
/// in its middle.
const SLOW_WRITES: [&str; 2] = ["--filter=delay", "wdelay=100ms"];

/// The writes of the test, through vdcache, to the delta (full clusters
/// over base data, a cluster written only in part, which the stop must
/// fill from the base) ...
fn delta_writes() -> Vec<String> {
    [
        "write -P 0x5a 0 12M",
        "write -P 0x6b 10551296 4096",
        "write -P 0x7c 13M 512",
        "flush",
    ]
    .map(String::from)
    .to_vec()
}

/// ... and to the plain image.
fn plain_writes() -> Vec<String> {
    ["write -P 0x3c 0 24M", "write -P 0x4d 30M 2M", "flush"]
        .map(String::from)
        .to_vec()
}

/// The storage directory: base.qcow2 (from [`storage_dir`]), delta.qcow2
/// over it by a relative name (another export of the same server), and a
/// plain image with no backing file; files with room to grow, as an NBD
/// export cannot.
fn images(s: &Scratch) -> PathBuf {
    let dir = storage_dir(s, 16 * M);
    let delta = dir.join("delta.qcow2");
    qcow2(s, &delta, 16 * M, Some("base.qcow2"));
    qcow2(s, &dir.join("plain.qcow2"), 32 * M, None);
    for f in ["delta.qcow2", "plain.qcow2"] {
        ok(s.cmd("truncate").args(["-s", "64M"]).arg(dir.join(f)));
    }
    dir
}

/// What the images must hold at the end: the writes applied by qemu-io to
/// raw copies (the delta's starting from the base's content).
fn references(s: &Scratch, dir: &Path) -> (PathBuf, PathBuf) {
    let delta_ref = s.path("delta-ref.raw");
    raw_of(
        s,
        "qcow2",
        dir.join("base.qcow2").to_str().expect("utf-8"),
        &delta_ref,
    );
    qemu_io(
        s,
        "raw",
        delta_ref.to_str().expect("utf-8"),
        &delta_writes(),
    );
    let plain_ref = s.path("plain-ref.raw");
    ok(s.qemu_img()
        .args(["create", "-q", "-f", "raw"])
        .arg(&plain_ref)
        .arg((32 * M).to_string()));
    qemu_io(
        s,
        "raw",
        plain_ref.to_str().expect("utf-8"),
        &plain_writes(),
    );
    (delta_ref, plain_ref)
}

/// A server configuration: both images from the storage server, through a
/// write-back cache that keeps every write in flash (no sequential
/// bypass), plus `extra` lines (e.g. a `[storage]` section).
fn config(s: &Scratch, ksock: &Path, vsock: &Path, extra: &str) -> PathBuf {
    let text = format!(
        "{extra}\n[server]\nsocket = \"{}\"\n[cache]\npath = \"{}\"\nsize = \"256M\"\nmode = \"writeback\"\nsequential_write_cutoff = \"0\"\n\
         [[export]]\nname = \"delta\"\nimage = \"{}\"\n[[export]]\nname = \"plain\"\nimage = \"{}\"\n",
        vsock.display(),
        s.path("flash.cache").display(),
        uri(ksock, "delta.qcow2"),
        uri(ksock, "plain.qcow2"),
    );
    let path = s.path("vdcache.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// Writes the test's data through the server and checks it is dirty in
/// the cache, not yet on the storage server.
fn write_through_vdcache(s: &Scratch, vsock: &Path) -> u64 {
    qemu_io(s, "raw", &uri(vsock, "delta"), &delta_writes());
    qemu_io(s, "raw", &uri(vsock, "plain"), &plain_writes());
    let dirty = stats(s, vsock)["cache"]["dirty_bytes"]
        .as_u64()
        .expect("dirty_bytes");
    assert!(
        dirty >= 36 * M,
        "the writes should be dirty in the cache, {dirty} bytes are"
    );
    dirty
}

/// After a clean stop: both images pass `qemu-img check`, no longer need
/// the cache, and hold exactly the reference contents.
fn assert_complete(s: &Scratch, dir: &Path, delta_ref: &Path, plain_ref: &Path, log: &str) {
    for (image, reference) in [("delta.qcow2", delta_ref), ("plain.qcow2", plain_ref)] {
        let path = dir.join(image);
        let chk = exec(s.qemu_img().arg("check").arg(&path));
        assert!(
            chk.success() && chk.stdout.contains("No errors"),
            "{image} must be clean\n{}\n--- vdcache log ---\n{log}",
            chk.report()
        );
        let cmp = exec(
            s.qemu_img()
                .args(["compare", "-f", "qcow2", "-F", "raw"])
                .arg(&path)
                .arg(reference),
        );
        assert!(
            cmp.success() && cmp.stdout.contains("Images are identical"),
            "{image} must hold exactly what was written\n{}\n--- vdcache log ---\n{log}",
            cmp.report()
        );
    }
}

fn backend_written(s: &Scratch, vsock: &Path) -> u64 {
    stats(s, vsock)["cache"]["total"]["backend_bytes_written"]
        .as_u64()
        .expect("backend_bytes_written")
}

#[test]
fn storage_server_killed_mid_writeback_and_restarted() {
    let s = Scratch::new();
    let dir = images(&s);
    let (delta_ref, plain_ref) = references(&s, &dir);
    let ksock = s.path("storage.sock");
    let storage = nbdkit_with(&s, &ksock, &dir, &SLOW_WRITES);
    let vsock = s.path("vd.sock");
    // The default reconnect delay: a restart takes well under it.
    let server = serve_config(&s, &config(&s, &ksock, &vsock, ""), &vsock);
    write_through_vdcache(&s, &vsock);

    let before = backend_written(&s, &vsock);
    let mut flush = s.vdcache();
    flush.args(["flush", "--socket"]).arg(&vsock);
    let flush = Streamed::spawn(flush);
    // Kill the storage server once write-back has written some data, with
    // more still dirty.
    let start = Instant::now();
    let dirty_at_kill = loop {
        let st = stats(&s, &vsock);
        let written = st["cache"]["total"]["backend_bytes_written"]
            .as_u64()
            .expect("written");
        let dirty = st["cache"]["dirty_bytes"].as_u64().expect("dirty");
        if written > before {
            break dirty;
        }
        assert!(
            start.elapsed() < serving::DEADLINE,
            "write-back never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    storage.kill9();
    assert!(
        dirty_at_kill > 0,
        "the storage server must die in the middle of the write-back"
    );
    let storage = nbdkit_with(&s, &ksock, &dir, &SLOW_WRITES);

    // vdcache reconnects and the flush finishes (bounded: on a vdcache
    // that does not reconnect it never would).
    let (st, lines) = flush.finish();
    assert!(
        st.success(),
        "vdcache flush failed after the storage server came back ({st}):\n{}\n--- vdcache log ---\n{}",
        lines.join("\n"),
        server.log_text()
    );
    let dirty = stats(&s, &vsock)["cache"]["dirty_bytes"].as_u64();
    assert_eq!(dirty, Some(0), "{}", server.log_text());
    let log = server.stop_clean();
    assert!(
        log.contains("reconnected to the storage server"),
        "the log must say vdcache reconnected:\n{log}"
    );
    drop(storage);
    assert_complete(&s, &dir, &delta_ref, &plain_ref, &log);
    s.finish();
}

#[test]
fn storage_server_gone_for_good_then_back() {
    let s = Scratch::new();
    let dir = images(&s);
    let (delta_ref, plain_ref) = references(&s, &dir);
    let ksock = s.path("storage.sock");
    let storage = nbdkit_with(&s, &ksock, &dir, &[]);
    let vsock = s.path("vd.sock");
    let cfg = config(&s, &ksock, &vsock, "[storage]\nreconnect_delay = 2");
    let server = serve_config(&s, &cfg, &vsock);
    write_through_vdcache(&s, &vsock);

    storage.kill9();
    // SIGTERM ends vdcache although nothing can be written back (the
    // wait is bounded by serving::DEADLINE, generous, not a timing claim).
    let (st, log) = server.terminate();
    assert_eq!(
        st.code(),
        Some(1),
        "a stop that could not complete the images exits 1\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    eprintln!("--- vdcache log of the stop without a storage server ---\n{log}");
    assert!(
        log.contains("stopped with dirty data kept in the cache")
            && log.contains("the storage server could not be reached")
            && log.contains("writes it back once the storage is reachable"),
        "the log must say the dirty data stays in the cache:\n{log}"
    );
    for image in ["delta.qcow2", "plain.qcow2"] {
        let path = dir.join(image);
        let info = ok(s.vdcache().arg("info").arg(&path));
        assert!(
            info.stdout.contains("NEEDS ITS CACHE"),
            "{image} must be marked as needing the cache\n{}",
            info.report()
        );
        let q = exec(s.qemu_img().args(["info", "-U"]).arg(&path));
        assert!(
            !q.success()
                && q.all()
                    .contains("Unsupported qcow2 feature(s): data in vdcache cache"),
            "QEMU must refuse {image} without its cache\n{}",
            q.report()
        );
    }

    // The server is back: a start with the same cache, then a clean stop,
    // writes everything.
    let storage = nbdkit_with(&s, &ksock, &dir, &[]);
    let server = serve_config(&s, &cfg, &vsock);
    let log = server.stop_clean();
    drop(storage);
    assert_complete(&s, &dir, &delta_ref, &plain_ref, &log);
    let info = ok(s.vdcache().arg("info").arg(dir.join("delta.qcow2")));
    assert!(
        !info.stdout.contains("NEEDS ITS CACHE"),
        "{}",
        info.report()
    );
    s.finish();
}
