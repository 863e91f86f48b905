//! `vdcache trace-gen` and `vdcache replay` end to end: generated traces in
//! every format replay to the same figures, `--json` carries the documented
//! keys with consistent values, a sweep writes its table, JSON and plots,
//! dedup on a clone storm shares blocks and writes less flash (alone and
//! swept against dedup off), and bad input is refused with a message
//! naming what is wrong.

use std::path::Path;
use std::process::{Command, Output};

fn vdcache(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vdcache"))
        .args(args)
        .output()
        .expect("run vdcache")
}

fn ok(args: &[&str]) -> String {
    let out = vdcache(args);
    assert!(
        out.status.success(),
        "vdcache {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Piped: no progress bar.
    assert!(!String::from_utf8_lossy(&out.stderr).contains("ETA"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn err(args: &[&str]) -> String {
    let out = vdcache(args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "vdcache {args:?} did not fail cleanly"
    );
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!e.contains("panicked"), "vdcache {args:?} panicked: {e}");
    e
}

fn generate(dir: &Path, name: &str, format: &str) -> String {
    let path = dir.join(name).display().to_string();
    ok(&[
        "trace-gen",
        "--class",
        "oltp",
        "--format",
        format,
        "--requests",
        "20000",
        "--working-set",
        "32M",
        "--seed",
        "3",
        &path,
    ]);
    path
}

/// A small clone storm in FIU format (content digests on every line).
fn generate_clones(dir: &Path) -> String {
    let path = dir.join("clones.fiu").display().to_string();
    ok(&[
        "trace-gen",
        "--class",
        "clone-storm",
        "--format",
        "fiu",
        "--requests",
        "12000",
        "--working-set",
        "8M",
        "--disks",
        "6",
        "--seed",
        "5",
        &path,
    ]);
    path
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).expect("JSON output")
}

#[test]
fn json_report_has_the_documented_keys_and_consistent_counts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = generate(dir.path(), "t.csv.zst", "msr");
    let r = json(&ok(&[
        "replay",
        &trace,
        "--json",
        "--cache-size-pct-of-wss",
        "30",
        "--layout",
        "qcow2",
    ]));
    for key in [
        "read_hit_ratio",
        "write_hit_ratio",
        "flash_bytes_written",
        "backend_bytes_read",
        "backend_bytes_written",
        "meta_hit_ratio",
        "latency",
        "index_memory_bytes",
        "ftl_write_amplification",
    ] {
        assert!(r.get(key).is_some(), "no {key} in {r}");
    }
    let num = |k: &str| {
        r[k].as_f64()
            .unwrap_or_else(|| panic!("{k} is not a number"))
    };
    let hits = num("read_hit_blocks");
    let misses = num("read_miss_blocks");
    assert!(hits > 0.0 && misses > 0.0, "{r}");
    // serde_json parses floats to within an ulp, not exactly.
    let ratio = num("read_hit_ratio");
    assert!((ratio - hits / (hits + misses)).abs() < 1e-12, "{ratio}");
    assert!(num("flash_bytes_written") > 0.0);
    assert!(num("backend_bytes_read") > 0.0);
    assert_eq!(r["layout"], "qcow2");
    assert_eq!(
        num("records"),
        num("reads") + num("writes") + num("flushes") + num("discards")
    );
}

#[test]
fn every_format_replays_to_the_same_hits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut seen = Vec::new();
    for (name, format) in [
        ("t.csv", "msr"),
        ("t.fiu.gz", "fiu"),
        ("t.blk", "blkparse"),
        ("t.iolog", "fio"),
    ] {
        let trace = generate(dir.path(), name, format);
        let r = json(&ok(&["replay", &trace, "--json", "--cache-size", "8M"]));
        seen.push((
            format,
            r["read_hit_blocks"].clone(),
            r["read_miss_blocks"].clone(),
        ));
    }
    let first = (&seen[0].1, &seen[0].2);
    let n = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    for s in &seen {
        if s.0 == "fiu" {
            // FIU has one line per 4 KiB block: a request's blocks arrive
            // one by one, which may reorder recency inside a request.
            assert_eq!(n(&s.1) + n(&s.2), n(first.0) + n(first.1), "{seen:?}");
            assert!(
                (n(&s.1) - n(first.0)).abs() <= n(first.0) / 100.0,
                "{seen:?}"
            );
        } else {
            assert_eq!((&s.1, &s.2), first, "{} differs from msr: {seen:?}", s.0);
        }
    }
}

#[test]
fn sweep_writes_table_json_and_plots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = generate(dir.path(), "t.csv", "msr");
    let out = dir.path().join("sweep");
    let text = ok(&[
        "replay",
        &trace,
        "--sweep",
        "--sweep-sizes",
        "20,60",
        "--sweep-policies",
        "lru,arc",
        "--out",
        &out.display().to_string(),
    ]);
    assert!(text.contains("| lru"), "{text}");
    for f in [
        "sweep.md",
        "sweep.json",
        "hit_ratio.svg",
        "hit_ratio.png",
        "flash_written.svg",
        "flash_written.png",
        "traffic.svg",
        "traffic.png",
    ] {
        let len = std::fs::metadata(out.join(f)).map(|m| m.len()).unwrap_or(0);
        assert!(len > 100, "{f} missing or empty");
    }
    let rows = json(&std::fs::read_to_string(out.join("sweep.json")).expect("json"));
    let rows = rows.as_array().expect("array");
    assert_eq!(rows.len(), 4);
    // A bigger LRU cache never hits less (LRU is a stack algorithm).
    let lru: Vec<f64> = rows
        .iter()
        .filter(|r| r["policy"] == "lru")
        .filter_map(|r| r["read_hit_ratio"].as_f64())
        .collect();
    assert!(lru.len() == 2 && lru[1] >= lru[0], "{lru:?}");
}

#[test]
fn bad_input_is_refused_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "128166372003061629,hm,0,Read,8192,4096,100\n128166372003061630,hm,0,Jump,0,4096,1\n",
    )
    .expect("write");
    let bad = bad.display().to_string();
    let e = err(&["replay", &bad, "--format", "msr"]);
    assert!(e.contains("line 2"), "{e}");
    let trace = generate(dir.path(), "t.csv", "msr");
    assert!(err(&["replay", &trace, "--policy", "fifo"]).contains("fifo"));
    assert!(err(&["replay", &trace, "--cache-size", "12q"]).contains("--cache-size"));
    assert!(err(&["replay", &trace, "--snapshot-every", "1h"]).contains("qcow2"));
    assert!(err(&["replay", &trace, "--region-size", "1000"]).contains("region"));
    assert!(err(&["replay", "/nonexistent/trace.csv"]).contains("/nonexistent/trace.csv"));
    let e = err(&["trace-gen", "--class", "nosuch", "x.csv"]);
    assert!(e.contains("nosuch") && e.contains("clone-storm"), "{e}");
    let e = err(&["replay", &trace, "--dedup", "maybe"]);
    assert!(e.contains("--dedup") && e.contains("maybe"), "{e}");
    assert!(err(&["replay", &trace, "--dedup-verify"]).contains("--dedup on"));
    let e = err(&["replay", &trace, "--sweep", "--sweep-dedup", "off,yes"]);
    assert!(e.contains("--sweep-dedup") && e.contains("yes"), "{e}");
    let e = err(&[
        "trace-gen",
        "--class",
        "oltp",
        "--update-ratio",
        "0.5",
        "x.csv",
    ]);
    assert!(e.contains("clone-storm"), "{e}");
    // What a replay cannot do as asked is refused, not changed silently.
    let e = err(&["replay", &trace, "--cache-size", "0", "--dedup", "on"]);
    assert!(e.contains("--dedup on needs a cache"), "{e}");
    for (option, value) in [("--sweep-sizes", "10"), ("--sweep-admission", "hot")] {
        let usage = Command::new(env!("CARGO_BIN_EXE_vdcache"))
            .args(["replay", &trace, option, value])
            .output()
            .expect("run vdcache");
        let e = String::from_utf8_lossy(&usage.stderr);
        assert!(
            usage.status.code() == Some(2) && e.contains("--sweep"),
            "{option}: {e}"
        );
    }
    let e = err(&["replay", &trace, "--sweep", "--sweep-sizes", "1e9"]);
    assert!(
        e.contains("--sweep-sizes") && e.contains("1000000000"),
        "{e}"
    );
    for (option, value) in [("--requests", "0"), ("--disks", "4294967296")] {
        let out = Command::new(env!("CARGO_BIN_EXE_vdcache"))
            .args(["trace-gen", option, value, "x.csv"])
            .current_dir(dir.path())
            .output()
            .expect("run vdcache");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(2) && e.contains(option), "{e}");
    }
    assert!(!dir.path().join("x.csv").exists());
    // A trace is written under a temporary name and renamed when whole.
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A cache asked for below the smallest one the replay builds runs at
/// that size, and the run says so.
#[test]
fn a_cache_too_small_to_build_is_named_in_a_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = generate(dir.path(), "t.csv", "msr");
    let out = Command::new(env!("CARGO_BIN_EXE_vdcache"))
        .args(["replay", &trace, "--cache-size", "1M"])
        .output()
        .expect("run vdcache");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the cache asked for (1 MiB) is below the smallest cache"),
        "{stderr}"
    );
}

fn num(r: &serde_json::Value, path: &[&str]) -> f64 {
    let mut v = r;
    for k in path {
        v = &v[*k];
    }
    v.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {r}"))
}

#[test]
fn dedup_on_a_clone_storm_shares_blocks_and_writes_less_flash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = generate_clones(dir.path());
    let replay = |extra: &[&str]| {
        let mut args = vec!["replay", &trace, "--json", "--cache-size-pct-of-wss", "25"];
        args.extend_from_slice(extra);
        json(&ok(&args))
    };
    let off = replay(&["--dedup", "off"]);
    let on = replay(&["--dedup", "on"]);
    assert_eq!(off["dedup_mode"], "off");
    assert!(off["dedup"].is_null(), "dedup off reports dedup: {off}");
    assert_eq!(on["dedup_mode"], "on");
    // The same trace, the same requests.
    for k in ["records", "reads", "writes", "read_bytes", "write_bytes"] {
        assert_eq!(off[k], on[k], "{k}");
    }
    let ratio = num(&on, &["dedup", "ratio"]);
    assert!(ratio > 1.5, "dedup ratio {ratio}");
    let shared = num(&on, &["dedup", "blocks_shared"]);
    assert!(shared > 1000.0, "{shared} blocks shared");
    assert_eq!(num(&on, &["dedup", "flash_bytes_saved"]), shared * 4096.0);
    assert!(num(&on, &["dedup", "hashed_blocks"]) >= shared);
    assert!(num(&on, &["dedup", "hash_ns_per_block"]) > 0.0);
    let (flash_off, flash_on) = (
        num(&off, &["flash_data_bytes_written"]),
        num(&on, &["flash_data_bytes_written"]),
    );
    assert!(
        flash_on < 0.75 * flash_off,
        "dedup on wrote {flash_on} data bytes to flash, off {flash_off}"
    );
    assert!(num(&on, &["flash_bytes_written"]) < num(&off, &["flash_bytes_written"]));
    // More addresses fit: the hit ratio does not drop.
    assert!(num(&on, &["read_hit_ratio"]) >= num(&off, &["read_hit_ratio"]));
    // The default is off; verify shares what on shares (no collisions).
    let default = replay(&[]);
    assert!(default["dedup"].is_null());
    assert_eq!(default["flash_bytes_written"], off["flash_bytes_written"]);
    let verify = replay(&["--dedup", "on", "--dedup-verify"]);
    assert_eq!(verify["dedup_mode"], "verify");
    assert_eq!(
        verify["dedup"]["blocks_shared"],
        on["dedup"]["blocks_shared"]
    );
    assert_eq!(num(&verify, &["dedup", "counts", "collisions"]), 0.0);
    // Human output names the figures.
    let text = ok(&[
        "replay",
        &trace,
        "--dedup",
        "on",
        "--cache-size-pct-of-wss",
        "25",
    ]);
    assert!(text.contains("dedup           ratio"), "{text}");
}

/// A sweep of a small clone storm with `args`, its table on stdout and its
/// files in `out`.
struct CloneSweep {
    _dir: tempfile::TempDir,
    trace: String,
    out: std::path::PathBuf,
    text: String,
}

impl CloneSweep {
    fn run(args: &[&str]) -> CloneSweep {
        let dir = tempfile::tempdir().expect("tempdir");
        let trace = generate_clones(dir.path());
        let out = dir.path().join("sweep");
        let out_arg = out.display().to_string();
        let mut all = vec!["replay", trace.as_str(), "--sweep"];
        all.extend_from_slice(args);
        all.extend(["--out", out_arg.as_str()]);
        let text = ok(&all);
        CloneSweep {
            _dir: dir,
            trace,
            out,
            text,
        }
    }
}

/// `--sweep-admission`: each configuration once per admission policy, named
/// in the table, the JSON and the plots. With dedup, hot admission keys
/// misses by content, so the clones' misses of the same bytes promote them
/// and the bytes read once stay out of flash.
#[test]
fn sweep_compares_admission_policies() {
    let sweep = CloneSweep::run(&[
        "--sweep-sizes",
        "10",
        "--sweep-policies",
        "d-lru",
        "--sweep-dedup",
        "on",
        "--sweep-admission",
        "all,hot",
    ]);
    let (trace, out, text) = (&sweep.trace, &sweep.out, &sweep.text);
    let admission_column: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("| d-lru"))
        .filter_map(|l| l.split('|').map(str::trim).nth(3))
        .collect();
    assert_eq!(admission_column, ["all", "hot"], "{text}");
    let rows = json(&std::fs::read_to_string(out.join("sweep.json")).expect("json"));
    let rows = rows.as_array().expect("array");
    assert_eq!(rows.len(), 2);
    let (all, hot) = (&rows[0], &rows[1]);
    assert_eq!(
        (all["admission"].as_str(), hot["admission"].as_str()),
        (Some("all"), Some("hot"))
    );
    assert!(
        num(hot, &["flash_data_bytes_written"]) < num(all, &["flash_data_bytes_written"]),
        "{all} {hot}"
    );
    assert!(num(hot, &["dedup", "blocks_shared"]) > 0.0, "{hot}");
    let svg = std::fs::read_to_string(out.join("hit_ratio.svg")).expect("svg");
    assert!(svg.contains("d-lru+dedup/hot"), "the plot names the series");
    let e = err(&["replay", trace, "--sweep", "--sweep-admission", "all,maybe"]);
    assert!(
        e.contains("--sweep-admission") && e.contains("maybe"),
        "{e}"
    );
}

#[test]
fn sweep_compares_dedup_off_and_on_across_cache_sizes() {
    let sweep = CloneSweep::run(&[
        "--sweep-sizes",
        "10,50",
        "--sweep-policies",
        "lru",
        "--sweep-dedup",
        "off,on",
    ]);
    let (out, text) = (&sweep.out, &sweep.text);
    let table: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("| lru"))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    let dedup_column: Vec<&str> = table.iter().map(|cells| cells[2]).collect();
    assert_eq!(dedup_column, ["off", "off", "on", "on"], "{text}");
    let rows = json(&std::fs::read_to_string(out.join("sweep.json")).expect("json"));
    let rows = rows.as_array().expect("array");
    assert_eq!(rows.len(), 4);
    let modes: Vec<&str> = rows
        .iter()
        .filter_map(|r| r["dedup_mode"].as_str())
        .collect();
    assert_eq!(modes, ["off", "off", "on", "on"]);
    for (off, on) in [(&rows[0], &rows[2]), (&rows[1], &rows[3])] {
        assert_eq!(
            off["cache_percent_of_working_set"],
            on["cache_percent_of_working_set"]
        );
        assert!(off["dedup"].is_null());
        assert!(num(on, &["dedup", "ratio"]) > 1.0);
        assert!(
            num(on, &["flash_bytes_written"]) < num(off, &["flash_bytes_written"]),
            "{off} {on}"
        );
    }
    let md = std::fs::read_to_string(out.join("sweep.md")).expect("md");
    assert!(
        md.contains("dedup ratio") && md.contains("flash saved MiB"),
        "{md}"
    );
    let svg = std::fs::read_to_string(out.join("hit_ratio.svg")).expect("svg");
    assert!(svg.contains("lru+dedup"), "the plot names the dedup series");
}

#[test]
fn snapshots_start_new_deltas_and_report_intervals() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = generate(dir.path(), "t.csv", "msr");
    let r = json(&ok(&[
        "replay",
        &trace,
        "--json",
        "--layout",
        "qcow2",
        "--snapshot-every",
        "500ms",
        "--cache-size",
        "8M",
    ]));
    let intervals = r["intervals"].as_array().expect("intervals");
    assert!(intervals.len() >= 2, "{intervals:?}");
    let total: f64 = intervals
        .iter()
        .filter_map(|i| i["requests"].as_f64())
        .sum();
    assert_eq!(Some(total), r["records"].as_f64());
}
