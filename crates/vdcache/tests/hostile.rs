//! Hostile input (issue 43): an image whose header names a host file as
//! its backing file, TCP without TLS, clients that hold the metrics
//! endpoint open, traces with absurd sizes and offsets, and configuration
//! sizes past any sane bound. Each is refused (or survived) with a message
//! naming what is wrong, and nothing is served or created.

use crate::common;
use crate::serving;

use common::{Out, Scratch, exec, exec_within, ok};
use serving::{serve, serve_config, serve_refused, try_serve};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// A host file every test machine has, readable by anyone.
const HOST_FILE: &str = "/etc/passwd";

/// A 1 MiB qcow2 image whose header names `backing` (format `fmt`) without
/// qemu-img opening it, as a tenant could upload it.
fn overlay(s: &Scratch, name: &str, backing: &str, fmt: &str) -> String {
    let p = s.path(name);
    ok(s.qemu_img()
        .args([
            "create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F", fmt,
        ])
        .arg(&p)
        .arg("1M"));
    p.display().to_string()
}

/// Fails unless `out` is a refusal whose message holds every word.
fn refused(out: &Out, words: &[&str]) {
    assert!(!out.success(), "should have been refused\n{}", out.report());
    for w in words {
        assert!(
            out.stderr.contains(w),
            "no '{w}' in the refusal\n{}",
            out.report()
        );
    }
}

#[test]
fn a_backing_file_outside_the_top_images_tree_is_refused_by_every_command() {
    let s = Scratch::new();
    let evil = overlay(&s, "evil.qcow2", HOST_FILE, "raw");
    let why = [HOST_FILE, "evil.qcow2", "--allow-backing /etc"];
    refused(&exec(s.vdcache().args(["info", &evil])), &why);
    refused(&exec(s.vdcache().args(["check", &evil])), &why);
    refused(
        &exec(s.vdcache().args(["io", "-r", "-c", "read 0 512", &evil])),
        &why,
    );
    let out = s.path("out.raw");
    refused(
        &exec(s.vdcache().args(["convert", "-O", "raw", &evil]).arg(&out)),
        &why,
    );
    assert!(!out.exists(), "convert made its output before refusing");
    // A symlink beside the image leads to the host file too.
    std::os::unix::fs::symlink(HOST_FILE, s.path("link.raw")).expect("symlink");
    let linked = overlay(&s, "linked.qcow2", "link.raw", "raw");
    refused(
        &exec(s.vdcache().args(["info", &linked])),
        &["'link.raw'", HOST_FILE],
    );
    // So does a name that climbs out of the image's directory.
    std::fs::create_dir(s.path("vm")).expect("mkdir");
    let climbing = overlay(&s, "vm/up.qcow2", "../evil.qcow2", "qcow2");
    refused(
        &exec(s.vdcache().args(["info", &climbing])),
        &["'../evil.qcow2'", "--allow-backing"],
    );

    // The server refuses before it listens or creates anything.
    let sock = s.path("evil.sock");
    let cache = s.path("evil.cache");
    let log = serve_refused(
        &s,
        &sock,
        &[
            "--cache",
            cache.to_str().expect("utf-8"),
            "--cache-size",
            "32M",
            &evil,
        ],
    );
    for w in why {
        assert!(log.contains(w), "no '{w}' in\n{log}");
    }
    assert!(
        !sock.exists() && !cache.exists(),
        "a refused start left files"
    );
    let config = s.path("evil.toml");
    let toml = |storage: &str| {
        format!(
            "{storage}[server]\nsocket = \"{}\"\n[[export]]\nname = \"vm\"\nimage = \"{evil}\"\n",
            sock.display()
        )
    };
    std::fs::write(&config, toml("")).expect("write config");
    let mut c = s.vdcache();
    c.arg("serve").arg("--config").arg(&config);
    refused(&exec(&mut c), &["export 'vm'", HOST_FILE, "allow_backing"]);

    // Allowed by name, the chain opens: its backing file is the host file.
    let copy = s.path("copy.raw");
    ok(s.vdcache()
        .args(["convert", "--allow-backing", "/etc", "-O", "raw", &evil])
        .arg(&copy));
    let host = std::fs::read(HOST_FILE).expect("read the host file");
    let got = std::fs::read(&copy).expect("read the copy");
    assert_eq!(
        &got[..host.len().min(got.len())],
        &host[..host.len().min(got.len())]
    );
    ok(s.vdcache().args(["info", "--allow-backing", "/etc", &evil]));
    serve(&s, &sock, &["--allow-backing", "/etc", &evil]).stop_clean();
    std::fs::write(&config, toml("[storage]\nallow_backing = [\"/etc\"]\n")).expect("config");
    serve_config(&s, &config, &sock).stop_clean();
    s.finish();
}

#[test]
fn an_external_data_file_outside_the_top_images_tree_is_refused() {
    let s = Scratch::new();
    let img = s.path("data.qcow2");
    let data = s.path("data.raw");
    ok(s.qemu_img()
        .args(["create", "-q", "-f", "qcow2", "-o"])
        .arg(format!("data_file={}", data.display()))
        .arg(&img)
        .arg("1M"));
    ok(s.vdcache().arg("info").arg(&img));
    // The data file moves elsewhere; a symlink where it was leads there.
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let moved = elsewhere.path().join("moved.raw");
    std::fs::copy(&data, &moved).expect("copy");
    std::fs::remove_file(&data).expect("rm");
    std::os::unix::fs::symlink(&moved, &data).expect("symlink");
    refused(
        &exec(s.vdcache().arg("info").arg(&img)),
        &["external data file", "--allow-backing"],
    );
    ok(s.vdcache()
        .arg("info")
        .arg("--allow-backing")
        .arg(elsewhere.path())
        .arg(&img));
    drop(elsewhere);
    s.finish();
}

#[test]
fn chains_within_the_top_images_tree_still_open() {
    let s = Scratch::new();
    std::fs::create_dir(s.path("bases")).expect("mkdir");
    let base = s.path("bases/base.qcow2");
    serving::qcow2(&s, &base, 1 << 20, None);
    let top = overlay(&s, "top.qcow2", "bases/base.qcow2", "qcow2");
    ok(s.vdcache().args(["check", &top]));
    // An absolute name inside the tree is as good as a relative one.
    let abs = overlay(&s, "abs.qcow2", base.to_str().expect("utf-8"), "qcow2");
    ok(s.vdcache().args(["io", "-c", "write -P 7 0 4k", &abs]));
    s.finish();
}

#[test]
fn tcp_without_tls_is_refused_unless_asked_for_and_then_logged() {
    let s = Scratch::new();
    let img = s.path("tcp.qcow2");
    serving::qcow2(&s, &img, 1 << 20, None);
    let img = img.to_str().expect("utf-8");
    let sock = s.path("tcp.sock");
    let log = serve_refused(&s, &sock, &["--tcp", "127.0.0.1:0", img]);
    assert!(
        log.contains("without TLS") && log.contains("--insecure-tcp"),
        "{log}"
    );
    assert!(!sock.exists(), "a refused start left its socket");
    let config = s.path("tcp.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\ntcp = \"127.0.0.1:0\"\n[[export]]\nname = \"\"\nimage = \"{img}\"\n",
            sock.display()
        ),
    )
    .expect("write config");
    let mut c = s.vdcache();
    c.arg("serve").arg("--config").arg(&config);
    refused(&exec(&mut c), &["insecure_tcp = true"]);
    let server = try_serve(&s, &sock, &["--tcp", "127.0.0.1:0", "--insecure-tcp", img])
        .expect("serves with --insecure-tcp");
    let log = server.stop_clean();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("without TLS")).collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains("--insecure-tcp"),
        "{log}"
    );
    s.finish();
}

/// The metrics endpoint's address, from the server's log.
fn metrics_address(log: &str) -> String {
    log.lines()
        .find_map(|l| l.split("metrics on http://").nth(1))
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics address in the log:\n{log}"))
        .to_string()
}

/// GET /metrics; the status line of the reply ("" when the connection
/// closed without one).
fn scrape(addr: &str) -> String {
    let mut c = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    c.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let _ = write!(c, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut reply = String::new();
    let _ = c.read_to_string(&mut reply);
    reply.lines().next().unwrap_or("").to_string()
}

#[test]
fn slow_metrics_clients_keep_no_scrape_out() {
    let s = Scratch::new();
    let img = s.path("m.qcow2");
    serving::qcow2(&s, &img, 1 << 20, None);
    let sock = s.path("m.sock");
    let server = serve(
        &s,
        &sock,
        &["--metrics", "127.0.0.1:0", img.to_str().expect("utf-8")],
    );
    let addr = metrics_address(&server.log_text());
    // More slow clients than the endpoint serves at once, each holding a
    // connection with a request it never finishes.
    let slow: Vec<TcpStream> = (0..40)
        .map(|_| {
            let mut c = TcpStream::connect(&addr).expect("connect");
            let _ = c.write_all(b"G");
            c
        })
        .collect();
    let answered = (0..3)
        .filter(|_| scrape(&addr) == "HTTP/1.1 200 OK")
        .count();
    assert_eq!(answered, 3, "scrapes answered while slow clients hold on");
    drop(slow);

    // A request trickled a byte at a time is cut off at its deadline, not
    // answered however long it takes.
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: slow\r\n\r\n");
    let mut c = TcpStream::connect(&addr).expect("connect");
    let started = Instant::now();
    for b in request.bytes() {
        if c.write_all(&[b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
        assert!(started.elapsed() < serving::DEADLINE, "trickling hung");
    }
    c.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut reply = String::new();
    let _ = c.read_to_string(&mut reply);
    assert!(
        !reply.starts_with("HTTP/1.1 200"),
        "a request trickled over {:?} was answered",
        started.elapsed()
    );
    assert_eq!(scrape(&addr), "HTTP/1.1 200 OK");
    server.stop_clean();
    s.finish();
}

/// `vdcache replay` of an MSR trace of `lines`: refused within a bound,
/// naming the line.
fn replay_refused(s: &Scratch, name: &str, lines: &[String], line: usize, words: &[&str]) {
    let trace = s.path(name);
    std::fs::write(&trace, lines.join("\n") + "\n").expect("write trace");
    let mut c = s.vdcache();
    c.args(["replay", "--format", "msr", "--json"]).arg(&trace);
    let out = exec_within(&mut c, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}"));
    let mut all = words.to_vec();
    let at = format!("line {line}:");
    all.push(&at);
    refused(&out, &all);
    assert_eq!(out.code(), Some(1), "{}", out.report());
}

#[test]
fn replay_refuses_absurd_sizes_offsets_and_disk_counts_naming_the_line() {
    let s = Scratch::new();
    let fine = "0,h,0,Write,0,4096,0".to_string();
    replay_refused(
        &s,
        "huge.csv",
        &[fine.clone(), "0,h,0,Write,0,18446744073709551615,0".into()],
        2,
        &["18446744073709551615 bytes", "64 MiB"],
    );
    replay_refused(
        &s,
        "tib.csv",
        &[
            fine.clone(),
            fine.clone(),
            "0,h,0,Write,0,1099511627776,0".into(),
        ],
        3,
        &["1099511627776 bytes", "64 MiB"],
    );
    replay_refused(
        &s,
        "far.csv",
        &[fine.clone(), "0,h,0,Read,17592186040320,8192,0".into()],
        2,
        &["offset 17592186040320", "16 TiB"],
    );
    let disks: Vec<String> = (0..1025)
        .map(|d| format!("0,h,{d},Write,0,4096,0"))
        .collect();
    replay_refused(&s, "disks.csv", &disks, 1025, &["disk 1024", "1024 disks"]);
    // Refused traces leave nothing behind.
    s.finish();
}

/// `vdcache serve --config` of `text`: refused, naming every word, and
/// leaving no file beside the cache.
fn config_refused(s: &Scratch, dir: &Path, text: &str, words: &[&str]) {
    let config = dir.join("c.toml");
    std::fs::write(&config, text).expect("write config");
    let mut c = s.vdcache();
    c.arg("serve").arg("--config").arg(&config);
    refused(&exec(&mut c), words);
    let mut left: Vec<String> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect();
    left.sort();
    assert_eq!(left, ["c.toml", "d.qcow2"], "a refused start left files");
}

#[test]
fn absurd_sizes_in_a_config_are_named_with_their_limit_and_create_nothing() {
    let s = Scratch::new();
    let dir = s.path("conf");
    std::fs::create_dir(&dir).expect("mkdir");
    let img = dir.join("d.qcow2");
    serving::qcow2(&s, &img, 1 << 20, None);
    let head = format!(
        "[server]\nsocket = \"{}\"\n[cache]\npath = \"{}\"\n",
        dir.join("d.sock").display(),
        dir.join("cache.img").display()
    );
    let export = format!("[[export]]\nname = \"a\"\nimage = \"{}\"\n", img.display());
    config_refused(
        &s,
        &dir,
        &format!("{head}size = \"18446744073709551615\"\n{export}"),
        &["[cache] size", "1 PiB"],
    );
    config_refused(
        &s,
        &dir,
        &format!("{head}size = \"32M\"\n{export}journal_size = \"1P\"\n"),
        &["export 'a'", "journal_size", "1 TiB"],
    );
    config_refused(
        &s,
        &dir,
        &format!("{head}size = \"32M\"\n{export}l2_cache_size = \"18446744073709551615\"\n"),
        &["export 'a': l2_cache_size", "64 GiB"],
    );
    // On the command line too (it aborted allocating for it up front).
    let out = exec(
        s.vdcache()
            .args(["io", "--refcount-cache-size", "8E", "-c", "read 0 64k"])
            .arg(&img),
    );
    refused(&out, &["--refcount-cache-size 8E", "64 GiB"]);
    s.finish();
}
