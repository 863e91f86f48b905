//! The command's failing paths, collected in one place: bad options,
//! configuration typos, missing files, unreachable sockets, lock conflicts,
//! ports in use. Each must fail with an error status, say what is wrong
//! in words, each cause once, with no Rust `Debug` form, and name what the
//! issue is about (the option, the key, the path).
//!
//! Every other failing vdcache run of the suite is checked the same way
//! (`common::exec_within` and `serving::try_serve` call
//! `common::assert_messages_read_well`).

use crate::common;
use crate::serving;

use common::{Scratch, exec, message_faults, ok};
use std::net::TcpListener;

/// One failing run: its arguments, what its message must name, and the
/// exit status (1: an error; 2: clap's usage errors).
struct Case {
    args: Vec<String>,
    names: &'static str,
    code: i32,
}

fn case(args: &[&str], names: &'static str) -> Case {
    Case {
        args: args.iter().map(|a| a.to_string()).collect(),
        names,
        code: 1,
    }
}

#[test]
fn failing_paths_say_each_cause_once_in_words() {
    let s = Scratch::new();
    let img = s.path("disk.qcow2");
    let img_s = img.display().to_string();
    ok(s.vdcache().args(["create", &img_s, "64M"]));
    let cache = s.path("flash.cache");
    let cache_s = cache.display().to_string();
    let sock = s.path("srv.sock");
    let sock_s = sock.display().to_string();
    let bad_toml = s.path("typo.toml");
    std::fs::write(&bad_toml, "[server]\nsockett = \"x\"\n").expect("write config");
    let bad_toml_s = bad_toml.display().to_string();
    let not_cache = s.path("notes.txt");
    std::fs::write(&not_cache, vec![b'x'; 32 << 20]).expect("write file");
    let not_cache_s = not_cache.display().to_string();
    let missing = s.path("missing");
    let missing_s = missing.display().to_string();
    let nodir_sock = format!("{missing_s}/s.sock");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_addr = taken.local_addr().expect("addr").to_string();

    // A server holding the image and the cache, for the lock conflicts.
    let held = s.path("held.qcow2");
    let held_s = held.display().to_string();
    ok(s.vdcache().args(["create", &held_s, "64M"]));
    let held_sock = s.path("held.sock");
    let server = serving::serve(
        &s,
        &held_sock,
        &["--cache", &cache_s, "--cache-size", "32M", &held_s],
    );
    let held_sock_s = held_sock.display().to_string();

    let mut cases = vec![
        case(
            &["serve", "--socket", &nodir_sock, &img_s],
            "cannot listen on",
        ),
        case(
            &["serve", "--tcp", "192.0.2.1:1", "--insecure-tcp", &img_s],
            "192.0.2.1:1",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &cache_s,
                "--cache-size",
                "banana",
                &img_s,
            ],
            "--cache-size",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &cache_s,
                "--cache-mode",
                "fast",
                &img_s,
            ],
            "--cache-mode",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &cache_s,
                "--region-size",
                "1q",
                &img_s,
            ],
            "--region-size",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &cache_s,
                "--cache-size",
                "64M",
                "--dedup",
                "maybe",
                &img_s,
            ],
            "--dedup",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &cache_s,
                "--cache-size",
                "64M",
                "--dedup-verify",
                &img_s,
            ],
            "needs dedup on",
        ),
        case(&["serve", "--config", &bad_toml_s], "sockett"),
        case(&["serve", "--config", &missing_s], "cannot read config"),
        case(&["serve", "--socket", &sock_s, &missing_s], "missing"),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &nodir_sock,
                "--cache-size",
                "64M",
                &img_s,
            ],
            "cannot create cache",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--cache",
                &not_cache_s,
                &img_s,
            ],
            "name another path",
        ),
        case(&["serve", "--socket", &sock_s, &held_s], "in use"),
        case(
            &["serve", "--socket", &sock_s, "--cache", &cache_s, &img_s],
            "in use",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--metrics",
                "nonsense",
                &img_s,
            ],
            "metrics",
        ),
        case(
            &[
                "serve",
                "--socket",
                &sock_s,
                "--metrics",
                &taken_addr,
                &img_s,
            ],
            "cannot listen for metrics",
        ),
        case(&["serve", "--socket", &sock_s], "IMAGE"),
        case(
            &["stats", "--socket", &sock_s],
            "cannot reach a vdcache server",
        ),
        case(
            &["stats", "--socket", &held_sock_s, "--watch", "0"],
            "--watch",
        ),
        case(&["stats"], "--socket"),
        case(
            &["flush", "--socket", &sock_s],
            "cannot reach a vdcache server",
        ),
        case(&["recover"], "--full --cache PATH"),
        case(&["recover", "--full", "--cache", &missing_s], "missing"),
        case(&["recover", "--without-cache", &missing_s], "missing"),
        case(&["check", &missing_s], "could not check"),
        case(&["check", "-r", "everything", &img_s], "leaks or all"),
        case(&["check", &held_s], "in use"),
        case(&["info", &missing_s], "missing"),
        case(
            &[
                "create",
                "-f",
                "vmdk",
                &s.path("x.vmdk").display().to_string(),
                "1M",
            ],
            "vmdk",
        ),
        case(
            &[
                "create",
                "-f",
                "raw",
                &s.path("x.raw").display().to_string(),
            ],
            "size",
        ),
        case(&["io", "-c", "frobnicate 0 4k", &img_s], "frobnicate"),
        case(&["io", "-c", "write 0 4k", &held_s], "in use"),
        case(
            &[
                "convert",
                "-O",
                "raw",
                &missing_s,
                &s.path("out.raw").display().to_string(),
            ],
            "missing",
        ),
        case(
            &["man", "/proc/vdcache-no-such-dir"],
            "/proc/vdcache-no-such-dir",
        ),
        case(&["replay", &missing_s], "missing"),
    ];
    // The image of a running server is in use even for create.
    cases.push(case(&["create", &held_s, "1M"], "in use"));
    for (args, names) in [
        (vec!["serve", "--bogus"], "--bogus"),
        (vec!["serve", "--cache-size", "1G", &img_s], "--cache"),
        (vec!["completions", "tcsh"], "tcsh"),
        (
            vec!["stats", "--count", "2", "--socket", &sock_s],
            "--watch",
        ),
        (vec!["-q", "-v", "info", &img_s], "--quiet"),
    ] {
        cases.push(Case {
            args: args.iter().map(|a| a.to_string()).collect(),
            names,
            code: 2,
        });
    }

    let mut failures = Vec::new();
    let mut check = |c: &Case| {
        let out = exec(s.vdcache().args(&c.args));
        let what = format!("vdcache {}", c.args.join(" "));
        if out.code() != Some(c.code) {
            failures.push(format!(
                "{what}: exit {:?}, expected {}\n{}",
                out.code(),
                c.code,
                out.stderr
            ));
            return;
        }
        if out.stderr.contains("panicked") || out.stderr.trim().is_empty() {
            failures.push(format!("{what}: no message or a panic\n{}", out.stderr));
            return;
        }
        // clap's usage errors start with "error:"; check those lines too.
        let as_ours = out.stderr.replace("\nerror: ", "\nvdcache: ");
        let as_ours = as_ours
            .strip_prefix("error: ")
            .map_or(as_ours.clone(), |r| format!("vdcache: {r}"));
        let faults = message_faults(&as_ours);
        if !faults.is_empty() {
            failures.push(format!("{what}: {}\n{}", faults.join("; "), out.stderr));
        }
        if !out.stderr.contains(c.names) {
            failures.push(format!(
                "{what}: does not name '{}'\n{}",
                c.names, out.stderr
            ));
        }
        // One final error line, said once.
        let finals = out
            .stderr
            .lines()
            .filter(|l| l.starts_with("vdcache: "))
            .count();
        if c.code == 1 && finals > 1 {
            failures.push(format!("{what}: {finals} error lines\n{}", out.stderr));
        }
    };
    for c in &cases {
        check(c);
    }
    drop(taken);
    let log = server.stop_clean();
    assert!(log.contains("SIGTERM: stopping"), "{log}");
    assert!(!log.contains("Some("), "{log}");
    // Once the server is gone the cache is free, and its size is fixed.
    check(&case(
        &[
            "serve",
            "--socket",
            &sock_s,
            "--cache",
            &cache_s,
            "--cache-size",
            "64M",
            &img_s,
        ],
        "keeps the size it was created with",
    ));
    let total = cases.len() + 1;
    assert!(
        failures.is_empty(),
        "{} of {} failing paths read badly:\n\n{}",
        failures.len(),
        total,
        failures.join("\n\n")
    );
    // Nothing the refused runs touched was created.
    assert!(!s.path("x.vmdk").exists() && !s.path("out.raw").exists());
    s.finish();
}

/// The detector itself: it must catch what the issue reported.
#[test]
fn the_detector_catches_repeats_and_debug_forms() {
    let repeated = "vdcache: cannot listen on /x/s.sock: cannot listen on /x/s.sock: No such file or directory (os error 2): No such file or directory (os error 2)";
    assert!(!message_faults(repeated).is_empty());
    assert!(!message_faults("vdcache: signal Some(15): stopping").is_empty());
    assert!(!message_faults("vdcache: open failed: Os { code: 2, kind: NotFound }").is_empty());
    assert!(
        message_faults(
            "vdcache: cannot listen on /x/s.sock: No such file or directory (os error 2)"
        )
        .is_empty()
    );
}

/// A server that accepts a control connection and never answers (stopped
/// with SIGSTOP, hung): `stats` gives up after its timeout, saying so; one
/// that hangs up before answering is named as such.
#[test]
fn control_requests_to_a_server_that_does_not_answer_end_with_a_message() {
    use std::os::unix::net::UnixListener;
    let s = Scratch::new();
    let hung = s.path("hung.sock.control");
    let listener = UnixListener::bind(&hung).expect("bind");
    let keep = std::thread::spawn(move || {
        // Hold the first connection open without answering; close the
        // second at once.
        let first = listener.accept().expect("accept");
        drop(listener.accept().expect("accept"));
        drop(first);
    });
    let hung_s = hung.display().to_string();
    let out = exec(
        s.vdcache()
            .args(["stats", "--control", &hung_s, "--timeout", "1"]),
    );
    assert!(!out.success(), "{}", out.report());
    assert!(
        out.stderr.contains("did not answer within 1 s") && out.stderr.contains(&hung_s),
        "{}",
        out.report()
    );
    assert!(message_faults(&out.stderr).is_empty(), "{}", out.report());
    let out = exec(s.vdcache().args(["flush", "--control", &hung_s]));
    assert!(
        !out.success()
            && out
                .stderr
                .contains("closed the connection before answering"),
        "{}",
        out.report()
    );
    let out = exec(
        s.vdcache()
            .args(["stats", "--control", &hung_s, "--timeout=-2"]),
    );
    assert!(
        !out.success() && out.stderr.contains("--timeout"),
        "{}",
        out.report()
    );
    keep.join().expect("listener");
    s.finish();
}
