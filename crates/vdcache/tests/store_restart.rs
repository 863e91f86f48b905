//! Issue 43, item 4: a storage server that loses its volatile write cache.
//! The image lives on nbdkit with its cache filter in write-back mode,
//! which keeps flushed writes and loses the others when killed (as
//! `vdcache-backend`'s `nbd_reconnect` test checks); its backing file on a second, plain nbdkit (the cache
//! filter keeps one cache for all exports of a server, so it serves one
//! file). A guest (qemu-io in write-back mode, so nothing is sent with
//! FUA) writes and flushes through `vdcache serve` while the image's server
//! is killed with SIGKILL and started again six times. Without a cache,
//! with the metadata journal and through a write-through cache: every guest
//! request succeeds, vdcache logs and counts what it wrote again, and after
//! a clean stop the image holds exactly what the guest wrote and
//! `qemu-img check` finds no error.

use crate::common;
use crate::serving;

use common::{Scratch, assert_same_bytes, ok};
use serving::{
    CrashWorkload, Op, Proc, Streamed, nbdkit, qcow2, raw_of, serve, stats, storage_dir, uri,
};
use std::path::Path;

const M: u64 = 1 << 20;

/// How often the image's storage server is killed during the workload.
const RESTARTS: usize = 6;

/// nbdkit serving the one file `file` (export name "") on `socket`
/// through its cache filter in write-back mode: a server with a volatile
/// write cache. Each start logs to a new file.
fn volatile_nbdkit(s: &Scratch, socket: &Path, file: &Path, start: usize) -> Proc {
    let _ = std::fs::remove_file(socket);
    let mut cmd = s.cmd("nbdkit");
    cmd.arg("--unix")
        .arg(socket)
        .args([
            "--foreground",
            "--exit-with-parent",
            "--filter=cache",
            "file",
        ])
        .arg(format!("file={}", file.display()))
        .arg("cache=writeback");
    let mut p = Proc::spawn(cmd, socket, s.root().join(format!("volatile.{start}.log")));
    p.wait_ready();
    p
}

/// What the guest wrote: `base` with every write of `w` applied.
fn everything(w: &CrashWorkload, base: &[u8]) -> Vec<u8> {
    let mut m = base.to_vec();
    for op in &w.ops {
        if let Op::Write { off, len, byte } = *op {
            m[off as usize..(off + len) as usize].fill(byte);
        }
    }
    m
}

/// Runs the workload through `vdcache serve ARGS` (`args` of the test's
/// scratch directory) over the volatile server, killing it [`RESTARTS`]
/// times, and checks the image.
fn restarts_lose_nothing(mode: &str, args: impl Fn(&Scratch) -> Vec<String>) {
    let s = Scratch::new();
    let size = 16 * M;
    let dir = storage_dir(&s, size);
    let base = raw_of(
        &s,
        "qcow2",
        dir.join("base.qcow2").to_str().expect("utf-8"),
        &s.path("base.raw"),
    );
    let bsock = s.path("base.sock");
    let _base_server = nbdkit(&s, &bsock, &dir);
    let delta = s.path("delta.qcow2");
    qcow2(&s, &delta, size, Some(&uri(&bsock, "base.qcow2")));
    // An export cannot grow: room for the guest's clusters and metadata.
    ok(s.cmd("truncate").args(["-s", "64M"]).arg(&delta));
    let ksock = s.path("storage.sock");
    let mut storage = Some(volatile_nbdkit(&s, &ksock, &delta, 0));
    let vsock = s.path("vd.sock");
    let image = uri(&ksock, "");
    let extra = args(&s);
    // The base lives on a server of its own, which the chain may reach
    // only when allowed.
    let base_server = uri(&bsock, "");
    let mut serve_args = vec![image.as_str(), "--allow-backing", base_server.as_str()];
    serve_args.extend(extra.iter().map(String::as_str));
    let server = serve(&s, &vsock, &serve_args);

    // 30 groups of 8 writes, each group flushed; the server is killed
    // after every 35th write reported (qemu-io's output line-buffered, so
    // it is at most one command ahead): in the middle of a group, with
    // writes acknowledged and not flushed, and before the last group.
    let w = CrashWorkload::generate(0x43_0004, size, 30, 8);
    let mut cmd = s.cmd("stdbuf");
    cmd.args(["-oL", "qemu-io", "-f", "raw", "-t", "writeback"]);
    for c in w.commands() {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(uri(&vsock, ""));
    let mut qio = Streamed::spawn(cmd);
    for k in 1..=RESTARTS {
        assert!(
            qio.wait_for(35 * k, |l| l.starts_with("wrote ")),
            "{mode}: qemu-io ended early:\n{}",
            qio.seen.join("\n")
        );
        storage.take().expect("running").kill9();
        storage = Some(volatile_nbdkit(&s, &ksock, &delta, k));
    }
    let (status, lines) = qio.finish();
    let storage_stats = stats(&s, &vsock)["storage"].clone();
    let log = server.stop_clean();
    // The stop flushed everything: nothing is left in the volatile cache.
    storage.take().expect("running").kill9();

    // First what the image holds: exactly what the guest wrote, clean.
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{mode}: {}", chk.report());
    let after = raw_of(
        &s,
        "qcow2",
        delta.to_str().expect("utf-8"),
        &s.path("after.raw"),
    );
    assert_same_bytes(
        &format!("{mode}: the image after {RESTARTS} storage server restarts"),
        &everything(&w, &base),
        &after,
    );
    // No guest request saw the restarts.
    let failed: Vec<&String> = lines
        .iter()
        .filter(|l| {
            let l = l.to_lowercase();
            l.contains("fail") || l.contains("error")
        })
        .collect();
    assert!(
        status.success() && failed.is_empty(),
        "{mode}: a guest request failed across the restarts (qemu-io {status}): {failed:?}; its last lines: {:?}",
        &lines[lines.len().saturating_sub(4)..]
    );
    assert_eq!(w.confirmed_flushes(&lines), 30, "{mode}");
    // The image's store reconnects when it is next used after a restart
    // (at most once per restart; the base's never), and wrote again what
    // the kills caught unflushed; one log line per reconnection (the
    // stop's own included).
    let reconnects = storage_stats["reconnects"].as_u64().unwrap_or(0);
    assert!(
        (1..=RESTARTS as u64).contains(&reconnects)
            && storage_stats["rewritten_writes"]
                .as_u64()
                .is_some_and(|n| n > 0),
        "{mode}: {storage_stats}"
    );
    let logged = log
        .matches("reconnected to the storage server after")
        .count() as u64;
    assert!(
        (reconnects..=RESTARTS as u64).contains(&logged) && log.contains("not yet flushed"),
        "{mode}: {reconnects} reconnections counted, {logged} logged:\n{log}"
    );
    s.finish();
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

#[test]
fn no_cache_loses_nothing_when_the_storage_server_restarts() {
    restarts_lose_nothing("no cache", |_| strings(&["--metadata-journal", "off"]));
}

#[test]
fn the_metadata_journal_loses_nothing_when_the_storage_server_restarts() {
    restarts_lose_nothing("metadata journal", |_| {
        strings(&["--metadata-journal", "on"])
    });
}

#[test]
fn a_write_through_cache_loses_nothing_when_the_storage_server_restarts() {
    restarts_lose_nothing("write-through", |s| {
        let cache = s.path("cache.img");
        strings(&[
            "--cache",
            cache.to_str().expect("utf-8"),
            "--cache-size",
            "32M",
            "--cache-mode",
            "writethrough",
        ])
    });
}
