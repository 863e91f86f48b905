//! Per-VM cache shares (`[cache] shares`, issue 23): two exports on one
//! cache, A with a hot set of 30% of it, B scanning twice its size while A
//! is idle (a nightly backup). With shares on, B's scan takes B's own
//! regions back (it reuses nothing) and A's next passes all hit; with
//! shares off, LRU over regions gives A's set to the scan. Counted with
//! vdcache's own per-disk counters over NBD (qemu-io), so exact. Also the
//! share settings: minimums, maximums, weights, their errors, and what
//! `vdcache stats --json` reports.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::serving;

use common::Scratch;
use serving::{qemu_io, serve_config, stats, uri};
use std::path::{Path, PathBuf};

const CACHE: u64 = 64 << 20;
const HOT: u64 = CACHE * 30 / 100 / (1 << 20) * (1 << 20);
const SCAN: u64 = 2 * CACHE;

/// A raw image of `size` bytes of pattern `byte`.
fn image(s: &Scratch, name: &str, size: u64, byte: u8) -> PathBuf {
    let p = s.path(name);
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    qemu_io(
        s,
        "raw",
        p.to_str().unwrap(),
        &[format!("write -P {byte} 0 {size}")],
    );
    p
}

/// A config serving A and B through one cache, `shares` on or off, with
/// `extra` lines in A's export.
fn config(s: &Scratch, shares: bool, extra_a: &str) -> (PathBuf, PathBuf) {
    let a = image(s, "a.img", HOT, 0x61);
    let b = image(s, "b.img", SCAN, 0x62);
    let sock = s.path("vd.sock");
    let cache = s.path("cache.img");
    let _ = std::fs::remove_file(&cache);
    let conf = s.path("serve.toml");
    std::fs::write(
        &conf,
        format!(
            "[server]\nsocket = \"{}\"\n[cache]\npath = \"{}\"\nsize = \"{CACHE}\"\nshares = {shares}\nidle_fill = false\n[[export]]\nname = \"a\"\nimage = \"{}\"\nformat = \"raw\"\n{extra_a}[[export]]\nname = \"b\"\nimage = \"{}\"\nformat = \"raw\"\n",
            sock.display(),
            cache.display(),
            a.display(),
            b.display()
        ),
    )
    .unwrap();
    (conf, sock)
}

/// The disk id of export `name` in a stats report.
fn disk_of(report: &serde_json::Value, name: &str) -> u64 {
    report["disks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["export"] == name)
        .map(|d| d["disk"].as_u64().unwrap())
        .unwrap()
}

/// Export `name`'s entry under `cache.shares` of a stats report.
fn share_of(report: &serde_json::Value, name: &str) -> serde_json::Value {
    let disk = disk_of(report, name);
    report["cache"]["shares"]
        .as_array()
        .expect("shares reported")
        .iter()
        .find(|r| r["disk"].as_u64() == Some(disk))
        .expect("the export has a share")
        .clone()
}

/// (read hit blocks, read miss blocks) of export `name`.
fn counts(report: &serde_json::Value, name: &str) -> (u64, u64) {
    let disk = disk_of(report, name);
    let per_disk = report["cache"]["disks"].as_array().unwrap();
    let s = per_disk
        .iter()
        .find(|p| p[0].as_u64() == Some(disk))
        .map(|p| &p[1])
        .unwrap();
    (
        s["read_hit_blocks"].as_u64().unwrap(),
        s["read_miss_blocks"].as_u64().unwrap(),
    )
}

fn read_all(s: &Scratch, sock: &Path, name: &str, size: u64, byte: u8) {
    let target = uri(sock, name);
    // 1 MiB reads, each checked against the pattern.
    let cmds: Vec<String> = (0..size >> 20)
        .map(|i| format!("read -P {byte} {} 1M", i << 20))
        .collect();
    for chunk in cmds.chunks(64) {
        qemu_io(s, "raw", &target, chunk);
    }
}

/// A warms its set, B scans, A reads its set twice: A's (hits, misses)
/// over those two passes, and the final report.
fn scan_between_passes(shares: bool) -> ((u64, u64), serde_json::Value) {
    let s = Scratch::new();
    let (conf, sock) = config(&s, shares, "");
    let server = serve_config(&s, &conf, &sock);
    read_all(&s, &sock, "a", HOT, 0x61);
    read_all(&s, &sock, "b", SCAN, 0x62);
    let before = counts(&stats(&s, &sock), "a");
    read_all(&s, &sock, "a", HOT, 0x61);
    read_all(&s, &sock, "a", HOT, 0x61);
    let report = stats(&s, &sock);
    let after = counts(&report, "a");
    server.stop_clean();
    s.finish();
    ((after.0 - before.0, after.1 - before.1), report)
}

#[test]
fn shares_keep_a_hot_set_through_another_exports_scan() {
    let blocks = 2 * HOT / 4096;
    let ((hits, misses), report) = scan_between_passes(true);
    assert_eq!(
        (hits, misses),
        (blocks, 0),
        "with shares on, B's scan took A's hot set"
    );
    let shares = report["cache"]["shares"]
        .as_array()
        .expect("shares reported");
    let a_disk = report["disks"][0]["disk"].as_u64().unwrap();
    let a = shares
        .iter()
        .find(|r| r["disk"].as_u64() == Some(a_disk))
        .expect("A has a share");
    assert!(a["bytes"].as_u64().unwrap() >= HOT, "{a}");
    assert!(a["demand"].as_f64().unwrap() > 0.0, "{a}");

    // The same without shares: the scan flushes A's set (so the check
    // above can fail).
    let ((hits, misses), report) = scan_between_passes(false);
    assert!(
        misses >= HOT / 4096 && hits + misses == blocks,
        "without shares A lost nothing ({hits} hits, {misses} misses): the scenario tests nothing"
    );
    assert!(report["cache"]["shares"].is_null());
}

#[test]
fn share_settings_are_checked_and_a_maximum_holds() {
    let s = Scratch::new();
    // Settings without shares on, and nonsense, are refused in words.
    for (shares, extra, word) in [
        (false, "share_min = \"8M\"\n", "shares = true"),
        (true, "share_weight = 0\n", "share_weight"),
        (
            true,
            "share_min = \"32M\"\nshare_max = \"8M\"\n",
            "share_min is above share_max",
        ),
        (true, "share_max = \"lots\"\n", "share_max"),
    ] {
        let (conf, sock) = config(&s, shares, extra);
        let out = common::exec(s.vdcache().arg("serve").arg("--config").arg(&conf));
        assert!(
            !out.success() && out.stderr.contains(word) && !out.stderr.contains("panicked"),
            "{extra}: {}",
            out.report()
        );
        assert!(!sock.exists());
    }
    // A at most 8 MiB: however much it reads, it holds no more flash
    // than that plus its open regions.
    let (conf, sock) = config(&s, true, "share_max = \"8M\"\n");
    let server = serve_config(&s, &conf, &sock);
    read_all(&s, &sock, "b", CACHE / 2, 0x62);
    read_all(&s, &sock, "a", HOT, 0x61);
    read_all(&s, &sock, "b", SCAN, 0x62);
    let report = stats(&s, &sock);
    let a = share_of(&report, "a");
    assert_eq!(a["max_bytes"].as_u64(), Some(8 << 20));
    let region = report["cache"]["region_bytes"].as_u64().unwrap();
    assert!(
        a["bytes"].as_u64().unwrap() <= (8 << 20) + 2 * region,
        "A holds more than its maximum: {a}"
    );
    server.stop_clean();
    s.finish();
}

#[test]
fn shares_change_at_run_time_through_the_control_socket() {
    let s = Scratch::new();
    let (conf, sock) = config(&s, true, "share_weight = 2\n");
    let server = serve_config(&s, &conf, &sock);
    let share = |args: &[&str]| {
        common::exec(
            s.vdcache()
                .arg("share")
                .arg("--socket")
                .arg(&sock)
                .args(args),
        )
    };
    let out = share(&["a", "--max", "16M", "--min", "4M"]);
    assert!(out.success(), "{}", out.report());
    assert!(out.stdout.contains("max 16"), "{}", out.stdout);
    let report = stats(&s, &sock);
    let a = share_of(&report, "a");
    assert_eq!(
        (
            a["min_bytes"].as_u64(),
            a["max_bytes"].as_u64(),
            a["weight"].as_f64()
        ),
        (Some(4 << 20), Some(16 << 20), Some(2.0)),
        "{a}"
    );
    for (args, word) in [
        (vec!["nosuch", "--weight", "1"], "no export 'nosuch'"),
        (vec!["a", "--weight", "0"], "weight"),
        (vec!["a", "--min", "32M"], "min is above max"),
        (vec!["a", "--max", "much"], "max"),
        (vec!["a"], "--min, --max or --weight"),
    ] {
        let out = share(&args);
        assert!(
            !out.success() && out.stderr.contains(word) && !out.stderr.contains("panicked"),
            "{args:?}: {}",
            out.report()
        );
    }
    // A refused change changed nothing.
    let again = stats(&s, &sock);
    let a2 = share_of(&again, "a");
    assert_eq!(a2["min_bytes"], a["min_bytes"]);
    assert_eq!(a2["max_bytes"], a["max_bytes"]);
    server.stop_clean();
    // A server without shares says so.
    let (conf, sock) = config(&s, false, "");
    let server = serve_config(&s, &conf, &sock);
    let out = share(&["a", "--weight", "2"]);
    assert!(
        !out.success() && out.stderr.contains("shares are off"),
        "{}",
        out.report()
    );
    server.stop_clean();
    s.finish();
}
