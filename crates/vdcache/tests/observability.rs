//! What an operator sees of a running server: the Prometheus endpoint
//! (scraped and parsed with a real text-format parser), `vdcache stats`
//! (per-export rows, `--watch`), the Grafana dashboard in contrib/ (valid
//! JSON naming only metrics the endpoint serves), the log lines at each
//! verbosity, the example host config, man pages and completions.

use crate::common;
use crate::serving;

use common::{Scratch, exec, ok};
use serving::{serve, uri};
use std::collections::BTreeSet;
use std::io::Seek;
use std::io::{Read, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// A 16 MiB base with data in its first 4 MiB and a delta over it.
fn chain(s: &Scratch) -> (String, String) {
    let base = s.path("base.qcow2").display().to_string();
    let delta = s.path("delta.qcow2").display().to_string();
    ok(s.vdcache().args(["create", &base, "16M"]));
    ok(s.vdcache().args(["io", "-c", "write -P 0x11 0 4M", &base]));
    ok(s.vdcache()
        .args(["create", "-b", "base.qcow2", "-F", "qcow2", &delta]));
    (base, delta)
}

fn qemu_io(s: &Scratch, sock: &Path, cmds: &[&str]) {
    let mut c = s.qemu_io();
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = ok(c.arg(uri(sock, "")));
    assert!(!out.stdout.contains("failed"), "{}", out.report());
}

/// Waits (bounded) until the server's log has a line containing `what`;
/// returns that line.
fn log_line(log: &Path, what: &str) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains(what)) {
            return l.to_string();
        }
        assert!(
            start.elapsed() < serving::DEADLINE,
            "the server never logged '{what}'\n{text}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// GET http://addr/path; returns (status line, content type, body).
fn http_get(addr: &str, path: &str) -> (String, String, String) {
    let mut c = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    c.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut text = String::new();
    c.read_to_string(&mut text).expect("read reply");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP reply");
    let status = head.lines().next().unwrap_or("").to_string();
    let kind = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .unwrap_or("")
        .to_string();
    (status, kind, body.to_string())
}

/// The names of the series in a Prometheus text exposition.
fn series_names(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or("").to_string())
        .collect()
}

fn sample<'a>(
    scrape: &'a prometheus_parse::Scrape,
    name: &str,
    labels: &[(&str, &str)],
) -> &'a prometheus_parse::Sample {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"))
}

fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    match &sample(scrape, name, labels).value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => *v,
        other => panic!("{name} is not a plain value: {other:?}"),
    }
}

fn histogram_count(scrape: &prometheus_parse::Scrape, export: &str, op: &str) -> f64 {
    match &sample(
        scrape,
        "vdcache_request_duration_seconds",
        &[("export", export), ("op", op)],
    )
    .value
    {
        prometheus_parse::Value::Histogram(buckets) => {
            buckets.last().map(|b| b.count).unwrap_or(0.0)
        }
        other => panic!("the latency of {op} is not a histogram: {other:?}"),
    }
}

/// The value of column `header` (10 wide, right-aligned under it) in the
/// row of `export` of `vdcache stats`' table.
fn column(text: &str, export: &str, header: &str) -> String {
    let head = text
        .lines()
        .find(|l| l.starts_with("EXPORT"))
        .unwrap_or_else(|| panic!("no table:\n{text}"));
    let end = head.find(header).expect("a column") + header.len();
    let row = text
        .lines()
        .find(|l| l.starts_with(&format!("{export} ")))
        .unwrap_or_else(|| panic!("no row for {export}:\n{text}"));
    // Its columns are 10 wide.
    row.get(end.saturating_sub(10)..end)
        .unwrap_or("")
        .trim()
        .to_string()
}

#[test]
fn metrics_stats_and_dashboard_agree() {
    let s = Scratch::new();
    let (_base, delta) = chain(&s);
    let sock = s.path("vm.sock");
    let cache = s.path("flash.cache").display().to_string();
    let server = serve(
        &s,
        &sock,
        &[
            "--cache",
            &cache,
            "--cache-size",
            "64M",
            "--metrics",
            "127.0.0.1:0",
            "--export-name",
            "vm1",
            &delta,
        ],
    );
    let line = log_line(&server.log, "metrics on http://");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.strip_suffix("/metrics"))
        .expect("the metrics address in the log")
        .to_string();
    let vm = format!("nbd+unix:///vm1?socket={}", sock.display());
    // One 1 MiB write, two 1 MiB reads of the base's data, one flush.
    for cmds in [
        vec!["write -P 0xab 8M 1M", "flush"],
        vec!["read -P 0x11 0 1M"],
        vec!["read -P 0x11 0 1M"],
    ] {
        let mut c = s.qemu_io();
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        let out = ok(c.arg(&vm));
        assert!(!out.stdout.contains("failed"), "{}", out.report());
    }

    let (status, kind, body) = http_get(&addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("a valid Prometheus text exposition");
    let e = [("export", "vm1")];
    assert_eq!(
        value(&scrape, "vdcache_export_written_bytes_total", &e),
        MIB as f64
    );
    assert_eq!(
        value(&scrape, "vdcache_export_read_bytes_total", &e),
        (2 * MIB) as f64
    );
    assert_eq!(value(&scrape, "vdcache_export_errors_total", &e), 0.0);
    assert_eq!(histogram_count(&scrape, "vm1", "write"), 1.0);
    assert_eq!(histogram_count(&scrape, "vm1", "read"), 2.0);
    assert!(histogram_count(&scrape, "vm1", "flush") >= 1.0);
    // The cache saw the two reads: 512 blocks of 4 KiB, the second 256 hits.
    let hits = value(&scrape, "vdcache_cache_read_hit_blocks_total", &e);
    let misses = value(&scrape, "vdcache_cache_read_miss_blocks_total", &e);
    assert_eq!(hits + misses, 512.0, "hits {hits} misses {misses}");
    assert!(hits >= 256.0, "the second read must hit: {hits}");
    assert_eq!(
        value(&scrape, "vdcache_cache_guest_written_bytes_total", &e),
        MIB as f64
    );
    assert_eq!(
        value(&scrape, "vdcache_cache_data_bytes", &[]) as u64 % 4096,
        0
    );
    let dirty = value(&scrape, "vdcache_cache_dirty_bytes", &[]);
    assert!(
        dirty >= MIB as f64,
        "write-back: the write is dirty in flash ({dirty})"
    );
    assert_eq!(
        value(&scrape, "vdcache_cache_export_dirty_bytes", &e),
        dirty
    );
    let (status, _, _) = http_get(&addr, "/nothing");
    assert_eq!(status, "HTTP/1.1 404 Not Found");

    // vdcache stats: the same figures, one row per export; --json agrees.
    let sock_s = sock.display().to_string();
    let text = ok(s.vdcache().args(["stats", "--socket", &sock_s])).stdout;
    let row = text
        .lines()
        .find(|l| l.starts_with("vm1 "))
        .unwrap_or_else(|| panic!("no row for export vm1:\n{text}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[0], "vm1");
    assert_eq!(cols[1], "0", "no connection is open: {row}");
    assert_eq!(&cols[3..7], ["2", "MiB", "1", "MiB"], "{row}");
    assert_eq!(column(&text, "vm1", "SAVED"), "-", "no dedup: {text}");
    assert!(
        text.contains("EXPORT") && text.contains("HIT: 4 KiB blocks"),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_str(
        &ok(s.vdcache().args(["stats", "--json", "--socket", &sock_s])).stdout,
    )
    .expect("stats --json");
    assert_eq!(json["exports"][0]["bytes_written"], MIB);
    assert_eq!(
        json["cache"]["total"]["read_hit_blocks"].as_f64(),
        Some(hits)
    );
    let watched = ok(s.vdcache().args([
        "stats", "--socket", &sock_s, "--watch", "0.1", "--count", "3",
    ]))
    .stdout;
    assert_eq!(watched.matches("vdcache stats of").count(), 3, "{watched}");
    assert_eq!(
        watched.lines().filter(|l| l.starts_with("vm1 ")).count(),
        3,
        "{watched}"
    );

    // The dashboard: valid JSON whose queries name only served metrics.
    let served = series_names(&body);
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("contrib/grafana-dashboard.json")).expect("dashboard"),
    )
    .expect("the Grafana dashboard is valid JSON");
    let mut exprs = Vec::new();
    collect_exprs(&dash, &mut exprs);
    let panels = dash["panels"].as_array().map_or(0, Vec::len);
    assert!(
        panels >= 8 && exprs.len() >= panels,
        "{panels} panels, {} queries",
        exprs.len()
    );
    let mut named = BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("vdcache_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            named.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    let unknown: Vec<&String> = named.iter().filter(|n| !served.contains(*n)).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard names metrics the endpoint does not serve: {unknown:?}\nserved: {served:?}"
    );
    assert!(named.len() >= 12, "{named:?}");

    let log = server.stop_clean();
    assert!(
        log.contains("stopped cleanly:") && log.contains("written back from the cache"),
        "{log}"
    );
    s.finish();
}

/// Every "expr" string in a dashboard, however deep.
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn serve_logs_the_cache_at_info_and_nothing_when_quiet() {
    let s = Scratch::new();
    let (_base, delta) = chain(&s);
    let cache = s.path("flash.cache").display().to_string();
    let sock = s.path("vm.sock");

    // Default verbosity: the cache formatted, the export, the stop.
    let server = serve(
        &s,
        &sock,
        &["--cache", &cache, "--cache-size", "64M", &delta],
    );
    qemu_io(&s, &sock, &["write -P 0xcd 0 1M", "flush"]);
    let log = server.stop_clean();
    for said in [
        "formatted (new cache file of 64 MiB)",
        "writeback cow-aware",
        "serving the default export:",
        "SIGTERM: stopping",
        "stopped cleanly:",
        "written back from the cache, the images are complete without it",
    ] {
        assert!(log.contains(said), "the log does not say '{said}':\n{log}");
    }
    assert!(
        !log.contains("\u{1b}["),
        "colours in a log that is not a terminal:\n{log}"
    );

    // A crash, then a restart: fast recovery with the dirty blocks counted.
    let server = serve(&s, &sock, &["--cache", &cache, &delta]);
    qemu_io(&s, &sock, &["write -P 0xef 0 1M", "flush"]);
    server.kill9();
    let server = serve(&s, &sock, &["--cache", &cache, &delta]);
    let log = server.stop_clean();
    let line = log
        .lines()
        .find(|l| l.contains("fast-recovered ("))
        .unwrap_or_else(|| panic!("no fast recovery line:\n{log}"));
    let dirty: u64 = line
        .split(" with ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no dirty block count in: {line}"));
    assert!(dirty >= 256, "1 MiB was dirty in flash: {line}");

    // -q: nothing at all on a clean run, also with I/O and a stop.
    let server = serve(&s, &sock, &["-q", "--cache", &cache, &delta]);
    qemu_io(
        &s,
        &sock,
        &["write -P 0x12 0 64k", "read -P 0x12 0 64k", "flush"],
    );
    let log = server.stop_clean();
    assert_eq!(log, "", "-q printed something on a clean run");

    // RUST_LOG wins over the flags; --log-format json gives JSON lines.
    let mut cmd = s.vdcache();
    cmd.args(["serve", "--log-format", "json", "--socket"])
        .arg(&sock)
        .args(["--cache", &cache, &delta])
        .env("RUST_LOG", "vdcache=info");
    let log_path = s.root().join("json.log");
    let mut p = serving::Proc::spawn(cmd, &sock, log_path);
    p.wait_ready();
    let log = p.stop_clean();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|v| v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("reopened clean"))),
        "{log}"
    );
    assert!(lines.iter().all(|v| v["level"] == "INFO"), "{log}");

    // A failure ends a JSON log with a JSON line too.
    let out = s
        .vdcache()
        .args(["--log-format", "json", "serve", "--socket"])
        .arg(s.root().join("never.sock"))
        .arg(s.root().join("missing.qcow2"))
        .output()
        .expect("run vdcache");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let last = lines.last().expect("an error line");
    assert_eq!(last["level"], "ERROR", "{err}");
    assert!(
        last["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("missing.qcow2")),
        "{err}"
    );

    // A cache device from another host is refused, saying what to do.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&cache)
        .expect("open cache");
    let mut sb = vec![0u8; 4096];
    f.read_exact(&mut sb).expect("read superblock");
    let mut parsed = vdcache_cache::layout::Superblock::decode(&sb).expect("decode superblock");
    parsed.host = "another-hypervisor".into();
    f.seek(SeekFrom::Start(0)).expect("seek");
    f.write_all(&parsed.encode()).expect("write superblock");
    drop(f);
    let log = serving::serve_refused(&s, &sock, &["--cache", &cache, &delta]);
    assert!(
        log.contains("belongs to host 'another-hypervisor'")
            && log.contains("vdcache recover --full"),
        "{log}"
    );
    s.finish();
}

#[test]
fn example_config_man_pages_and_completions() {
    let text =
        std::fs::read_to_string(repo_file("contrib/vdcache.toml")).expect("contrib/vdcache.toml");
    let cfg = vdcache::config::ServerConfig::parse(&text).expect("the example config is valid");
    assert_eq!(cfg.exports.len(), 2);
    assert_eq!(cfg.server.metrics.as_deref(), Some("127.0.0.1:9187"));
    // Every key it shows commented out is a key vdcache knows: uncommented
    // one at a time (each section's keys in that section), it still parses.
    let lines: Vec<&str> = text.lines().collect();
    let mut checked = 0;
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.strip_prefix("# ") else {
            continue;
        };
        let Some((key, _)) = rest.split_once(" = ") else {
            continue;
        };
        if key.contains(' ') || rest.starts_with('[') {
            continue;
        }
        // [server.tls] keys need their table; cert and key go together.
        if ["psk", "cert", "key"].contains(&key) {
            continue;
        }
        let mut edited = lines.clone();
        edited[i] = rest;
        // A journal device's settings need the device (journal_size).
        if key.starts_with("journal_") && key != "journal_size" {
            let size = lines
                .iter()
                .position(|l| l.starts_with("# journal_size = "))
                .expect("the example shows journal_size");
            edited[size] = &lines[size][2..];
        }
        // TCP without TLS needs its insecurity said.
        let insecure;
        if key == "tcp" {
            let at = lines
                .iter()
                .position(|l| l.starts_with("# insecure_tcp = "))
                .expect("the example shows insecure_tcp");
            insecure = lines[at][2..].replace("false", "true");
            edited[at] = &insecure;
        }
        // Share settings need shares on.
        let shares_on;
        if key.starts_with("share_") {
            let at = lines
                .iter()
                .position(|l| l.starts_with("# shares = "))
                .expect("the example shows shares");
            shares_on = lines[at][2..].replace("false", "true");
            edited[at] = &shares_on;
        }
        let value = edited.join("\n");
        vdcache::config::ServerConfig::parse(&value).unwrap_or_else(|e| {
            panic!(
                "uncommenting line {} ({rest}) breaks the example: {e}",
                i + 1
            )
        });
        checked += 1;
    }
    assert!(checked >= 25, "only {checked} commented keys checked");

    let s = Scratch::new();
    let man = s.path("man");
    let out = ok(s.vdcache().arg("man").arg(&man));
    assert!(out.stdout.contains("man pages"), "{}", out.stdout);
    let serve_page = std::fs::read_to_string(man.join("vdcache-serve.1")).expect("vdcache-serve.1");
    for opt in ["cache\\-size", "metrics", "keep\\-dirty"] {
        assert!(serve_page.contains(opt), "vdcache-serve.1 lacks {opt}");
    }
    assert!(man.join("vdcache.1").exists() && man.join("vdcache-stats.1").exists());
    for shell in ["bash", "zsh", "fish"] {
        let out = ok(s.vdcache().args(["completions", shell]));
        assert!(
            out.stdout.contains("serve") && out.stdout.contains("--cache-size"),
            "{shell}"
        );
    }
    let out = exec(
        s.cmd("bash")
            .args(["-n", "-c"])
            .arg(ok(s.vdcache().args(["completions", "bash"])).stdout),
    );
    assert!(
        out.success(),
        "the bash completion is not valid bash\n{}",
        out.report()
    );
    s.finish();
}

/// The demo explains its figures, says what to run next, and removes the
/// files it made in the temporary directory, saying how big they were.
#[test]
fn demo_explains_and_cleans_up() {
    let s = Scratch::new();
    let out = ok(s.vdcache().arg("demo"));
    for said in [
        "came from flash",
        "is in flash only, not yet in the delta",
        "journal records replayed",
        "removed the demo's 3 files (",
        "Next:",
        "vdcache serve --socket",
    ] {
        assert!(
            out.stdout.contains(said),
            "the demo does not say '{said}':\n{}",
            out.stdout
        );
    }
    assert!(!out.stdout.contains("Some("), "{}", out.stdout);
    // Scratch::finish fails if anything is left in the demo's TMPDIR.
    s.finish();
}

/// Two exports of one server with dedup on, written the same 1 MiB of one
/// repeated block by qemu-io over NBD (255 blocks share within the first
/// write, 256 across exports): `vdcache stats` says how much is shared
/// (and the share of flash the cached addresses take, not their sum), and
/// overwriting one sharer leaves the other's bytes.
#[test]
fn stats_show_what_dedup_shares_between_exports() {
    let s = Scratch::new();
    for vm in ["a", "b"] {
        ok(s.vdcache().args([
            "create",
            &s.path(&format!("{vm}.qcow2")).display().to_string(),
            "64M",
        ]));
    }
    let sock = s.path("dd.sock");
    let cfg = s.path("dd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nsocket = {:?}\n[cache]\npath = {:?}\nsize = \"64M\"\ndedup = \"on\"\n\
             [[export]]\nname = \"a\"\nimage = {:?}\n[[export]]\nname = \"b\"\nimage = {:?}\n",
            sock,
            s.path("dd.cache"),
            s.path("a.qcow2"),
            s.path("b.qcow2")
        ),
    )
    .expect("write config");
    let server = serving::serve_config(&s, &cfg, &sock);
    let qio = |export: &str, cmds: &[&str]| {
        let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
        serving::qemu_io(&s, "raw", &uri(&sock, export), &cmds)
    };
    qio("a", &["write -P 0x3c 0 1M", "flush"]);
    qio("b", &["write -P 0x3c 8M 1M", "flush"]);
    let st = serving::stats(&s, &sock);
    assert_eq!(st["cache"]["total"]["dedup_blocks_shared"], 511, "{st:#}");
    let text = ok(s.vdcache().args(["stats", "--socket"]).arg(&sock)).stdout;
    assert!(
        text.contains("dedup on: ")
            && text.contains("511 blocks shared (1.996 MiB of flash writes saved)"),
        "{text}"
    );
    assert!(text.contains("cached in "), "{text}");
    // Per export: a's 1 MiB of one pattern shared 255 of its own blocks,
    // b's all 256 of a's.
    assert_eq!(column(&text, "a", "SAVED"), "1020 KiB", "{text}");
    assert_eq!(column(&text, "b", "SAVED"), "1 MiB", "{text}");
    // 256 addresses of each export's image, 16 to a line: the map's
    // room in the checkpoint, as a share used.
    let dedup = &st["cache"]["dedup"];
    let (map, room) = (
        dedup["checkpoint_map_bytes"].as_u64().expect("map bytes"),
        dedup["checkpoint_room_bytes"].as_u64().expect("room bytes"),
    );
    assert!(map >= 2 * 16 * (24 + 16 * 8) && map < room, "{dedup:#}");
    let used = format!(
        "checkpoint room {:.1}% used",
        map as f64 * 100.0 / room as f64
    );
    assert!(text.contains(&used), "{used}: {text}");
    qio("a", &["write -P 0x5d 0 64k", "flush"]);
    qio("b", &["read -P 0x3c 8M 1M"]);
    qio("a", &["read -P 0x5d 0 64k", "read -P 0x3c 64k 960k"]);
    server.stop_clean();
    s.finish();
}
