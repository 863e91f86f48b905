//! Issue 20 with the real QEMU tools: the per-disk metadata journal.
//! A server killed with -9 leaves an image that QEMU refuses, naming the
//! feature; `vdcache recover` applies the journal, after which `qemu-img
//! check` is clean and `qemu-img compare` finds it equal to a reference
//! written by qemu-io alone. Through a writethrough cache the journal
//! survives kill -9 the same way; with a writeback cache it is refused,
//! and `auto` (the default) turns it on where it helps. A stream of copy-on-write writes is
//! acknowledged before its filler is copied (deferred copy-on-write), and
//! what a flush covered survives kill -9, a flush sent on another NBD
//! connection too.

#![allow(clippy::unwrap_used)]

use crate::common;
use crate::serving;

use common::{Scratch, exec, ok};
use serving::{nbdkit_with, qcow2, qemu_io, qemu_io_opts, serve, stats, uri};

const M: u64 = 1 << 20;

/// Allocating writes, each flushed, then overwrites of the newest
/// clusters (full mode) and an unflushed tail.
fn workload() -> Vec<String> {
    let mut cmds = Vec::new();
    for i in 0..24u64 {
        let off = (i * 7 % 48) * 65536 + (i % 4) * 4096;
        cmds.push(format!("write -P {} {off} 4096", 0x30 + i));
        cmds.push("flush".into());
        if i % 5 == 4 {
            cmds.push(format!("write -P {} {off} 512", 0x80 + i));
            cmds.push(format!("write -z {} 8192", off + 65536 * 50));
            cmds.push("flush".into());
        }
    }
    cmds
}

/// A full 8 MiB base and an empty delta over it.
fn delta_over_full_base(s: &Scratch, name: &str) -> std::path::PathBuf {
    let base = s.path("base.qcow2");
    if !base.exists() {
        qcow2(s, &base, 8 * M, None);
        ok(s.qemu_io().args(["-c", "write -P 0x5a 0 8M"]).arg(&base));
    }
    let delta = s.path(name);
    qcow2(s, &delta, 8 * M, Some("base.qcow2"));
    delta
}

#[test]
fn qemu_refuses_a_journaled_image_until_vdcache_recover_applies_it() {
    let s = Scratch::new();
    let delta = delta_over_full_base(&s, "delta.qcow2");
    let reference = delta_over_full_base(&s, "reference.qcow2");
    let sock = s.path("nbd.sock");
    let server = serve(
        &s,
        &sock,
        &["--metadata-journal", "on", delta.to_str().unwrap()],
    );
    let cmds = workload();
    qemu_io(&s, "raw", &uri(&sock, ""), &cmds);
    qemu_io(&s, "qcow2", reference.to_str().unwrap(), &cmds);
    server.kill9();

    let refused = exec(s.qemu_img().arg("check").arg(&delta));
    assert!(
        !refused.success() && refused.stderr.contains("vdcache metadata journal"),
        "QEMU must refuse a journaled image, naming the feature\n{}",
        refused.report()
    );
    let recovered = ok(s.vdcache().arg("recover").arg(&delta));
    assert!(
        recovered.stdout.contains("applied"),
        "{}",
        recovered.report()
    );
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
    ok(s.qemu_img().arg("compare").arg(&reference).arg(&delta));
    let again = ok(s.vdcache().arg("recover").arg(&delta));
    assert!(
        again.stdout.contains("nothing was changed"),
        "{}",
        again.report()
    );
}

#[test]
fn a_clean_stop_leaves_no_journal_behind() {
    let s = Scratch::new();
    let delta = s.path("delta.qcow2");
    qcow2(&s, &delta, 8 * M, None);
    let sock = s.path("nbd.sock");
    let server = serve(
        &s,
        &sock,
        &["--metadata-journal", "on", delta.to_str().unwrap()],
    );
    qemu_io(&s, "raw", &uri(&sock, ""), &workload());
    let st = stats(&s, &sock);
    let records = st["disks"][0]["metadata_journal"]["records"].as_u64();
    assert!(records.is_some_and(|r| r > 0), "{st:#}");
    server.stop_clean();
    let info = ok(s.qemu_img().args(["info", "--output=json"]).arg(&delta));
    assert!(!info.stdout.contains("journal"), "{}", info.report());
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
}

#[test]
fn the_journal_serves_through_a_writethrough_cache_and_is_refused_with_writeback() {
    let s = Scratch::new();
    let delta = delta_over_full_base(&s, "delta.qcow2");
    let reference = delta_over_full_base(&s, "reference.qcow2");
    let sock = s.path("nbd.sock");
    let cache = s.path("flash.cache");
    let cached = |mode: &str, journal: &str| {
        vec![
            "--cache".to_string(),
            cache.to_str().unwrap().to_string(),
            "--cache-size".into(),
            "64M".into(),
            "--cache-mode".into(),
            mode.into(),
            "--metadata-journal".into(),
            journal.into(),
            delta.to_str().unwrap().to_string(),
        ]
    };
    let writeback = cached("writeback", "on");
    let writeback: Vec<&str> = writeback.iter().map(String::as_str).collect();
    let refused = serving::serve_refused(&s, &sock, &writeback);
    assert!(
        refused.contains("needs no journal with a writeback cache"),
        "{refused}"
    );
    // `auto` journals a writethrough disk; `off` does not.
    for (journal, on) in [("auto", true), ("off", false)] {
        let args = cached("writethrough", journal);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = serve(&s, &sock, &args);
        let st = stats(&s, &sock);
        assert_eq!(
            st["disks"][0]["metadata_journal"].is_object(),
            on,
            "{journal}: {st:#}"
        );
        server.stop_clean();
    }

    let on = cached("writethrough", "on");
    let on: Vec<&str> = on.iter().map(String::as_str).collect();
    let server = serve(&s, &sock, &on);
    let cmds = workload();
    qemu_io(&s, "raw", &uri(&sock, ""), &cmds);
    qemu_io(&s, "qcow2", reference.to_str().unwrap(), &cmds);
    let st = stats(&s, &sock);
    let records = st["disks"][0]["metadata_journal"]["records"].as_u64();
    assert!(records.is_some_and(|r| r > 0), "{st:#}");
    server.kill9();
    // The next serve through the same cache replays the journal, and what
    // it serves equals qemu-io's own image.
    let server = serve(&s, &sock, &on);
    let got = s.path("got.raw");
    ok(s.qemu_img()
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(uri(&sock, ""))
        .arg(&got));
    server.stop_clean();
    ok(s.qemu_img()
        .args(["compare", "-f", "raw", "-F", "qcow2"])
        .arg(&got)
        .arg(&reference));
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
}

/// Adaptive preallocation is opt-in: asked for, the journaled disk's file
/// grows ahead of its allocations while served and is cut back to its last
/// cluster in use by a clean stop; not asked for, it never grows ahead.
/// Where it would do nothing (no journal, or a flash cache) it is refused.
#[test]
fn preallocation_is_opt_in_and_trimmed_by_a_clean_stop() {
    let s = Scratch::new();
    let sock = s.path("nbd.sock");
    let delta = s.path("delta.qcow2");
    let writes: Vec<String> = (0..16u64)
        .map(|i| format!("write -P 7 {} 65536", i * 65536))
        .chain(["flush".to_string()])
        .collect();
    let grown_ahead = |prealloc: bool| {
        qcow2(&s, &delta, 64 * M, None);
        let image = delta.to_str().unwrap();
        let mut args = vec!["--metadata-journal", "on", image];
        if prealloc {
            args.insert(0, "--preallocate");
        }
        let server = serve(&s, &sock, &args);
        qemu_io(&s, "raw", &uri(&sock, ""), &writes);
        let served_len = std::fs::metadata(&delta).unwrap().len();
        server.stop_clean();
        let stopped_len = std::fs::metadata(&delta).unwrap().len();
        let chk = ok(s.qemu_img().arg("check").arg(&delta));
        assert!(chk.stdout.contains("No errors"), "{}", chk.report());
        (served_len, stopped_len)
    };
    let (served, stopped) = grown_ahead(true);
    assert!(
        served >= stopped + M,
        "asked for, zeros go at least 1 MiB ahead while serving: {served} then {stopped}"
    );
    let (served, stopped) = grown_ahead(false);
    assert!(
        served < stopped + M,
        "not asked for, nothing is written ahead: {served} then {stopped}"
    );

    let image = delta.to_str().unwrap();
    let refused = serving::serve_refused(
        &s,
        &sock,
        &["--preallocate", "--metadata-journal", "off", image],
    );
    assert!(
        refused.contains("preallocate needs the metadata journal"),
        "{refused}"
    );
    let cache = s.path("flash.cache");
    let refused = serving::serve_refused(
        &s,
        &sock,
        &[
            "--preallocate",
            "--metadata-journal",
            "on",
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "64M",
            "--cache-mode",
            "writethrough",
            image,
        ],
    );
    assert!(
        refused.contains("preallocate does nothing through a flash cache"),
        "{refused}"
    );
}

/// 4 KiB writes into distinct clusters of a delta over a full base, at
/// offsets inside the clusters (so each copies on write).
fn cow_stream() -> Vec<String> {
    (0..120u64)
        .map(|i| {
            format!(
                "write -P {} {} 4096",
                1 + i % 200,
                i * 65536 + (i % 15) * 4096
            )
        })
        .collect()
}

/// Served without a cache and through a writethrough cache (with and
/// without the journal), a stream of copy-on-write writes is deferred
/// once 64 writes came without a flush (`deferred_cow_writes` counts
/// them), reads back at once, and after its flush survives kill -9: the
/// image then checks clean and holds every write.
#[test]
fn deferred_copy_on_write_keeps_what_a_flush_covered_through_kill_9() {
    let s = Scratch::new();
    let writes = cow_stream();
    let reads: Vec<String> = writes
        .iter()
        .map(|c| c.replacen("write -P", "read -P", 1))
        .collect();
    let mut session = writes.clone();
    session.extend(reads.iter().cloned());
    session.push("flush".into());
    let cache = s.path("flash.cache");
    let modes: [(&str, &[&str]); 3] = [
        ("nocache-journal", &["--metadata-journal", "on"]),
        (
            "writethrough",
            &[
                "--cache-size",
                "64M",
                "--cache-mode",
                "writethrough",
                "--metadata-journal",
                "off",
            ],
        ),
        (
            "writethrough-journal",
            &[
                "--cache-size",
                "64M",
                "--cache-mode",
                "writethrough",
                "--metadata-journal",
                "on",
            ],
        ),
    ];
    for (name, opts) in modes {
        let delta = delta_over_full_base(&s, &format!("{name}.qcow2"));
        let sock = s.path(&format!("{name}.sock"));
        let mut args: Vec<&str> = opts.to_vec();
        if name.starts_with("writethrough") {
            args.extend(["--cache", cache.to_str().unwrap()]);
        }
        args.push(delta.to_str().unwrap());
        let server = serve(&s, &sock, &args);
        // Writeback: qemu-io sends no flush of its own after each write.
        qemu_io_opts(
            &s,
            &["-f", "raw", "-t", "writeback"],
            &uri(&sock, ""),
            &session,
        );
        let st = stats(&s, &sock);
        let deferred = st["disks"][0]["deferred_cow_writes"].as_u64();
        assert_eq!(deferred, Some(120 - 63), "{name}: {st:#}");
        server.kill9();
        if name.ends_with("journal") {
            ok(s.vdcache().arg("recover").arg(&delta));
        }
        if name.starts_with("writethrough") {
            // The next serve through the cache recovers the image.
            serve(&s, &sock, &args).stop_clean();
        }
        let chk = ok(s.qemu_img().arg("check").arg(&delta));
        assert!(chk.stdout.contains("No errors"), "{name}: {}", chk.report());
        qemu_io_opts(&s, &["-f", "qcow2", "-r"], delta.to_str().unwrap(), &reads);
    }
}

/// A flush waits for the deferred writes of every connection, not only
/// its own: behind a storage server with 2 ms per request (so the
/// deferred copies are still running), one NBD connection writes a stream
/// of copy-on-write writes (57 deferred) and never flushes, another
/// connection flushes, and after kill -9 the image checks clean and holds
/// every write of the first.
#[test]
fn a_flush_on_another_connection_covers_deferred_copy_on_write() {
    use vdcache_backend::nbd::NbdClient;
    let s = Scratch::new();
    let dir = s.path("storage");
    std::fs::create_dir(&dir).unwrap();
    let base = dir.join("base.qcow2");
    qcow2(&s, &base, 8 * M, None);
    ok(s.qemu_io().args(["-c", "write -P 0x5a 0 8M"]).arg(&base));
    let delta = dir.join("delta.qcow2");
    qcow2(&s, &delta, 8 * M, Some("base.qcow2"));
    // An NBD export cannot grow: room for every cluster.
    ok(s.cmd("truncate").args(["-s", "16M"]).arg(&delta));
    let ksock = s.path("storage.sock");
    let _storage = nbdkit_with(
        &s,
        &ksock,
        &dir,
        &["--filter=delay", "rdelay=2ms", "wdelay=2ms"],
    );
    let sock = s.path("nbd.sock");
    let image = uri(&ksock, "delta.qcow2");
    let server = serve(&s, &sock, &["--metadata-journal", "off", &image]);
    let writer = NbdClient::connect(&uri(&sock, "")).unwrap();
    let flusher = NbdClient::connect(&uri(&sock, "")).unwrap();
    let writes: Vec<(u64, u8)> = (0..120u64)
        .map(|i| (i * 65536 + (i % 15) * 4096, (1 + i % 200) as u8))
        .collect();
    for &(off, byte) in &writes {
        writer.write_at(off, &[byte; 4096], false).unwrap();
    }
    flusher.flush().unwrap();
    let st = stats(&s, &sock);
    assert_eq!(
        st["disks"][0]["deferred_cow_writes"].as_u64(),
        Some(120 - 63),
        "{st:#}"
    );
    server.kill9();
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
    let reads: Vec<String> = writes
        .iter()
        .map(|(off, byte)| format!("read -P {byte} {off} 4096"))
        .collect();
    qemu_io_opts(&s, &["-f", "qcow2", "-r"], delta.to_str().unwrap(), &reads);
}
