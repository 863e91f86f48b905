//! Issue 42: a careless user, each case as it was tried (a path that is
//! not vdcache's given where vdcache writes or removes, a full file
//! system, a closed pipe, the wrong recovery), as a test that failed
//! before the fix. vdcache creates, replaces or deletes only what it can
//! recognise as its own, checks before it writes, and answers within
//! seconds when the storage under it is full.

use crate::common;
use crate::serving;

use common::{Out, Scratch, assert_no_panic, exec, exec_within, ok};
use serving::{Proc, qcow2, qemu_io, serve, serve_refused, stats, uri};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const M: u64 = 1 << 20;

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn arg(p: &Path) -> &str {
    p.to_str().expect("utf-8")
}

/// A failed command: no panic, exit status 1, its message containing
/// every one of `words`.
fn refused(out: &Out, words: &[&str]) {
    assert_no_panic(out);
    assert_eq!(out.code(), Some(1), "{}", out.report());
    for w in words {
        assert!(out.stderr.contains(w), "expected '{w}'\n{}", out.report());
    }
}

/// An empty qcow2 image of 16 MiB named `name` in the scratch directory.
fn image(s: &Scratch, name: &str) -> PathBuf {
    let p = s.path(name);
    qcow2(s, &p, 16 * M, None);
    p
}

/// A base of 16 MiB at `base` with `data` written (qemu-io), and a delta
/// `top` over it.
fn chain(s: &Scratch, base: &Path, data: Option<&str>, top: &Path) {
    qcow2(s, base, 16 * M, None);
    if let Some(d) = data {
        qemu_io(s, "qcow2", arg(base), &[d.into()]);
    }
    qcow2(s, top, 16 * M, Some(arg(base)));
}

/// A tmpfs of `mib` MiB mounted at `dir` (root only, as the suite runs),
/// unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: PathBuf, mib: u64) -> Tmpfs {
        std::fs::create_dir_all(&dir).expect("mkdir");
        ok(Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={mib}m"))
            .arg("tmpfs")
            .arg(&dir));
        Tmpfs(dir)
    }

    fn resize(&self, mib: u64) {
        ok(Command::new("mount")
            .arg("-o")
            .arg(format!("remount,size={mib}m"))
            .arg(&self.0));
    }

    /// Fills what is left with a file named `name`.
    fn fill(&self, name: &str) {
        let out = exec(
            Command::new("dd")
                .args(["if=/dev/zero", "bs=64k"])
                .arg(format!("of={}", self.0.join(name).display())),
        );
        assert!(out.stderr.contains("No space left"), "{}", out.report());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A control or vhost-user socket path that names a file: refused before
/// anything is touched, the file intact (they were deleted: `--control
/// z.qcow2 z.qcow2` removed the image at the stop, and a refused start had
/// already removed `SOCKET.control`).
#[test]
fn socket_paths_never_delete_a_file() {
    let s = Scratch::new();
    let z = image(&s, "z.qcow2");
    let before = bytes(&z);
    let out = exec(
        s.vdcache()
            .args(["serve", "--socket"])
            .arg(s.path("s1.sock"))
            .arg("--control")
            .arg(&z)
            .arg(&z),
    );
    refused(&out, &["z.qcow2"]);
    assert_eq!(bytes(&z), before, "the image was changed");

    let control = s.path("vm2.sock.control");
    std::fs::write(&control, b"important").expect("write");
    let sock = s.path("vm2.sock");
    std::fs::write(&sock, b"x").expect("write");
    let log = serve_refused(&s, &sock, &[arg(&z)]);
    assert!(log.contains("not a socket"), "{log}");
    assert_eq!(bytes(&control), b"important", "SOCKET.control was deleted");

    let notes = s.path("notes.vhost");
    std::fs::write(&notes, b"notes").expect("write");
    let log = serve_refused(
        &s,
        &s.path("vm3.sock"),
        &["--vhost-user-blk", arg(&notes), arg(&z)],
    );
    assert!(log.contains("not a socket"), "{log}");
    assert_eq!(bytes(&notes), b"notes", "the vhost-user path was deleted");
    assert!(!s.path("vm3.sock").exists() && !s.path("vm3.sock.control").exists());
    s.finish();
}

/// Sockets replaced by someone else's files while the server runs: the
/// stop leaves those files alone, and a stale socket (a kill -9) is
/// replaced at the next start.
#[test]
fn a_stop_removes_only_its_own_sockets() {
    let s = Scratch::new();
    let img = image(&s, "d.qcow2");
    let (sock, vhost) = (s.path("d.sock"), s.path("d.vhost"));
    let control = s.path("d.sock.control");
    let server = serve(&s, &sock, &["--vhost-user-blk", arg(&vhost), arg(&img)]);
    for p in [&sock, &control, &vhost] {
        std::fs::remove_file(p).expect("rm");
        std::fs::write(p, b"not the server's").expect("write");
    }
    server.stop_clean();
    for p in [&sock, &control, &vhost] {
        assert_eq!(bytes(p), b"not the server's", "{} was removed", p.display());
        std::fs::remove_file(p).expect("rm");
    }
    let server = serve(&s, &sock, &["--vhost-user-blk", arg(&vhost), arg(&img)]);
    server.kill9();
    let server = serve(&s, &sock, &["--vhost-user-blk", arg(&vhost), arg(&img)]);
    server.stop_clean();
    for p in [&sock, &control, &vhost] {
        assert!(!p.exists(), "{} outlived the stop", p.display());
    }
    s.finish();
}

/// `--format-cache` formatted the image or its backing file as a cache
/// (and only then failed on the image lock). It formats only a cache.
#[test]
fn format_cache_formats_only_caches() {
    let s = Scratch::new();
    let (big, bigd) = (s.path("big.qcow2"), s.path("bigd.qcow2"));
    chain(&s, &big, Some("write -P 0x11 0 1M"), &bigd);
    let other = image(&s, "other.qcow2");
    let notes = s.path("notes.txt");
    std::fs::write(&notes, b"notes").expect("write");
    let files = [&big, &bigd, &other, &notes];
    let before: Vec<Vec<u8>> = files.iter().map(|f| bytes(f)).collect();
    let sock = s.path("f.sock");
    for (cache, image, why) in [
        (&big, &bigd, "chain"),
        (&big, &big, "same file"),
        (&other, &bigd, "qcow2 image"),
        (&notes, &bigd, "not a vdcache cache"),
    ] {
        let log = serve_refused(
            &s,
            &sock,
            &["--cache", arg(cache), "--format-cache", arg(image)],
        );
        assert!(log.contains(why), "{why}:\n{log}");
        let log = serve_refused(&s, &sock, &["--cache", arg(cache), arg(image)]);
        assert!(
            !log.contains("--format-cache"),
            "advice to format what is not a cache:\n{log}"
        );
    }
    for (f, b) in files.iter().zip(&before) {
        assert_eq!(&bytes(f), b, "{} was changed", f.display());
    }
    // A cache holding dirty data is refused too; a clean one is formatted.
    let cache = s.path("c.cache");
    let server = serve(
        &s,
        &sock,
        &["--cache", arg(&cache), "--cache-size", "32M", arg(&bigd)],
    );
    qemu_io(
        &s,
        "raw",
        &uri(&sock, ""),
        &["write -P 0x22 0 1M".into(), "flush".into()],
    );
    server.kill9();
    let log = serve_refused(
        &s,
        &sock,
        &["--cache", arg(&cache), "--format-cache", arg(&bigd)],
    );
    assert!(log.contains("recover --full"), "{log}");
    let server = serve(&s, &sock, &["--cache", arg(&cache), arg(&bigd)]);
    qemu_io(&s, "raw", &uri(&sock, ""), &["read -P 0x22 0 1M".into()]);
    server.stop_clean();
    let server = serve(
        &s,
        &sock,
        &["--cache", arg(&cache), "--format-cache", arg(&bigd)],
    );
    server.stop_clean();
    qemu_io(&s, "qcow2", arg(&bigd), &["read -P 0x22 0 1M".into()]);
    s.finish();
}

/// A second server on an image in use is refused before it makes a cache
/// file (it made and left 64 MiB); a journal file that cannot take its
/// size is not left behind.
#[test]
fn a_refused_start_makes_nothing() {
    let s = Scratch::new();
    let img = image(&s, "d.qcow2");
    let server = serve(&s, &s.path("a.sock"), &[arg(&img)]);
    let cache = s.path("second.cache");
    let log = serve_refused(
        &s,
        &s.path("b.sock"),
        &["--cache", arg(&cache), "--cache-size", "64M", arg(&img)],
    );
    assert!(log.contains("in use"), "{log}");
    assert!(!cache.exists(), "a refused start made its cache file");
    server.stop_clean();
    let config = s.path("j.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\n[cache]\npath = \"{}\"\nsize = \"32M\"\n[[export]]\nname = \"a\"\nimage = \"{}\"\njournal_size = \"1P\"\n",
            s.path("c.sock").display(),
            cache.display(),
            img.display()
        ),
    )
    .expect("write config");
    let out = exec(s.vdcache().args(["serve", "--config"]).arg(&config));
    refused(&out, &["journal_size"]);
    let left: Vec<String> = std::fs::read_dir(s.root())
        .expect("ls")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("journal") || n.ends_with(".cache"))
        .collect();
    assert!(left.is_empty(), "a refused start left {left:?}");
    s.finish();
}

/// `vdcache demo --dir DIR` wrote its base.qcow2 over the user's (a copy
/// of the README walkthrough) and said "rm -r ." when DIR was `.`.
#[test]
fn demo_writes_only_into_a_directory_of_its_own() {
    let s = Scratch::new();
    let walk = s.path("walk");
    std::fs::create_dir(&walk).expect("mkdir");
    chain(&s, &walk.join("base.qcow2"), None, &walk.join("vm1.qcow2"));
    let before = bytes(&walk.join("base.qcow2"));
    let out = exec(s.vdcache().args(["demo", "--dir"]).arg(&walk));
    refused(&out, &["vm1.qcow2"]);
    assert_eq!(bytes(&walk.join("base.qcow2")), before);
    // An empty directory of the user's: used, and the advice names files.
    let mine = s.path("mine");
    std::fs::create_dir(&mine).expect("mkdir");
    let out = ok(s.vdcache().args(["demo", "--dir", "."]).current_dir(&mine));
    assert!(
        out.stdout.contains("rm './base.qcow2'") && !out.stdout.contains("rm -r ."),
        "{}",
        out.report()
    );
    // Its own directory again: fine; with a file of the user's in it: not.
    ok(s.vdcache().args(["demo", "--dir"]).arg(&mine));
    std::fs::write(mine.join("notes"), b"mine").expect("write");
    refused(
        &exec(s.vdcache().args(["demo", "--dir"]).arg(&mine)),
        &["notes"],
    );
    s.finish();
}

/// `trace-gen OUT` renamed a file over OUT: a link was replaced (as root,
/// /dev/stdout became a 3.9 MB file), and a file of the user's was
/// overwritten.
#[test]
fn trace_gen_writes_through_links_and_devices_and_keeps_files() {
    let s = Scratch::new();
    let trace_gen = |out: &Path, extra: &[&str]| {
        exec(
            s.vdcache()
                .args(["trace-gen", "--requests", "1000"])
                .args(extra)
                .arg(out),
        )
    };
    let null = s.path("null-link");
    std::os::unix::fs::symlink("/dev/null", &null).expect("symlink");
    ok(s.vdcache()
        .args(["trace-gen", "--requests", "1000"])
        .arg(&null));
    assert!(std::fs::symlink_metadata(&null).expect("stat").is_symlink());
    let mine = s.path("mine.csv");
    std::fs::write(&mine, b"my notes\n").expect("write");
    refused(&trace_gen(&mine, &[]), &["--force"]);
    assert_eq!(bytes(&mine), b"my notes\n");
    let link = s.path("link.csv");
    std::os::unix::fs::symlink(&mine, &link).expect("symlink");
    assert!(trace_gen(&link, &["--force"]).success());
    assert!(std::fs::symlink_metadata(&link).expect("stat").is_symlink());
    let written = std::fs::read_to_string(&mine).expect("read");
    assert!(
        written.lines().count() > 900 && !written.contains("my notes"),
        "{written}"
    );
    // Into a closed pipe: it fails, saying so.
    let out = exec(Command::new("sh").arg("-c").arg(format!(
        "'{}' trace-gen --requests 100000 /dev/stdout | head -1 >/dev/null",
        env!("CARGO_BIN_EXE_vdcache")
    )));
    assert!(out.stderr.contains("Broken pipe"), "{}", out.report());
    s.finish();
}

/// A size between sectors: vdcache said 1000 B where QEMU sees the image
/// as 512, and what vdcache wrote past 512 QEMU could not read.
#[test]
fn sizes_between_sectors_agree_with_qemu() {
    let s = Scratch::new();
    let odd = s.path("odd.qcow2");
    ok(s.vdcache().arg("create").arg(&odd).arg("1000"));
    let info = ok(s.qemu_img().args(["info"]).arg(&odd));
    assert!(info.stdout.contains("(1024 bytes)"), "{}", info.report());
    ok(s.vdcache()
        .args(["io", "-c", "write -P 0x5 0 1000"])
        .arg(&odd));
    qemu_io(&s, "qcow2", arg(&odd), &["read -P 0x5 0 1000".into()]);
    let raw = s.path("odd.raw");
    ok(s.vdcache()
        .args(["convert", "-O", "raw"])
        .arg(&odd)
        .arg(&raw));
    assert_eq!(bytes(&raw).len(), 1024);
    // A raw file of 1000 bytes is a 1024-byte disk to QEMU; a qcow2 header
    // saying 1000 is a 512-byte one.
    let short = s.path("short.raw");
    std::fs::write(&short, [7u8; 1000]).expect("write");
    let hdr = s.path("hdr.qcow2");
    qcow2(&s, &hdr, 1024, None);
    let mut h = bytes(&hdr);
    h[24..32].copy_from_slice(&1000u64.to_be_bytes());
    std::fs::write(&hdr, h).expect("write");
    for (img, fmt, want) in [(&short, "raw", 1024), (&hdr, "qcow2", 512)] {
        let q = ok(s
            .qemu_img()
            .args(["info", "--output=json", "-f", fmt])
            .arg(img));
        let v = ok(s.vdcache().args(["info", "--json", "-f", fmt]).arg(img));
        for out in [&q, &v] {
            let j: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
            assert_eq!(j["virtual-size"], want, "{}", out.report());
        }
    }
    s.finish();
}

/// `recover --without-cache` gave up flushed data while the cache was
/// there and intact; once the cache really was given up and came back,
/// `serve` and `recover --full` sent the user to each other.
#[test]
fn recover_without_cache_keeps_an_intact_cache_and_never_loops() {
    let s = Scratch::new();
    let (base, img) = (s.path("base.qcow2"), s.path("w1.qcow2"));
    chain(&s, &base, None, &img);
    let (cache, sock) = (s.path("w.cache"), s.path("w.sock"));
    let crash_with = |pattern: &str| {
        let server = serve(
            &s,
            &sock,
            &["--cache", arg(&cache), "--cache-size", "32M", arg(&img)],
        );
        qemu_io(
            &s,
            "raw",
            &uri(&sock, ""),
            &[format!("write -P {pattern} 0 1M"), "flush".into()],
        );
        server.kill9();
    };
    crash_with("0xab");
    let out = exec(s.vdcache().args(["recover", "--without-cache"]).arg(&img));
    refused(&out, &["still there", "recover --full"]);
    ok(s.vdcache()
        .args(["recover", "--full", "--cache"])
        .arg(&cache));
    qemu_io(&s, "qcow2", arg(&img), &["read -P 0xab 0 1M".into()]);

    crash_with("0xcd");
    let away = s.path("w.cache.away");
    std::fs::rename(&cache, &away).expect("mv");
    ok(s.vdcache().args(["recover", "--without-cache"]).arg(&img));
    std::fs::rename(&away, &cache).expect("mv");
    // The cache's data of the image was given up: both commands work.
    ok(s.vdcache()
        .args(["recover", "--full", "--cache"])
        .arg(&cache));
    let server = serve(&s, &sock, &["--cache", arg(&cache), arg(&img)]);
    qemu_io(&s, "raw", &uri(&sock, ""), &["read -P 0xab 0 1M".into()]);
    server.stop_clean();
    ok(s.qemu_img().arg("check").arg(&img));
    s.finish();
}

/// A cache bigger than its file system was made sparse and accepted; the
/// image's file system full made `flush` hang for minutes and the stop
/// loop (a second SIGTERM ignored), blaming the cache device.
#[test]
fn full_file_systems_are_errors_within_seconds() {
    let s = Scratch::new();
    let img = s.path("d.qcow2");
    qcow2(&s, &img, 64 * M, None);
    let small = Tmpfs::mount(s.path("small"), 20);
    let cache = small.0.join("c.cache");
    let log = serve_refused(
        &s,
        &s.path("a.sock"),
        &["--cache", arg(&cache), "--cache-size", "64M", arg(&img)],
    );
    assert!(
        log.contains("free") && log.contains("--cache-size"),
        "{log}"
    );
    assert!(!cache.exists());

    let images = Tmpfs::mount(s.path("images"), 24);
    let full = images.0.join("full.qcow2");
    qcow2(&s, &full, 64 * M, None);
    let (cache, sock) = (s.path("w.cache"), s.path("w.sock"));
    let server = serve(
        &s,
        &sock,
        &["--cache", arg(&cache), "--cache-size", "64M", arg(&full)],
    );
    qemu_io(
        &s,
        "raw",
        &uri(&sock, ""),
        &[
            "write -P 0x7 0 2M".into(),
            "write -P 0x8 8M 2M".into(),
            "flush".into(),
        ],
    );
    images.fill("filler");
    let started = Instant::now();
    let out = exec_within(
        s.vdcache().args(["flush", "--socket"]).arg(&sock),
        Duration::from_secs(60),
    )
    .expect("flush must answer");
    refused(&out, &["full.qcow2", "is full"]);
    assert!(!out.stderr.contains("cache device"), "{}", out.report());
    let (status, log) = server.terminate();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "flush and stop took {:?}",
        started.elapsed()
    );
    assert!(!status.success() && log.contains("stays"), "{log}");
    // Room again: the next start writes the data back.
    std::fs::remove_file(images.0.join("filler")).expect("rm");
    images.resize(64);
    let server = serve(&s, &sock, &["--cache", arg(&cache), arg(&full)]);
    server.stop_clean();
    qemu_io(
        &s,
        "qcow2",
        arg(&full),
        &["read -P 0x7 0 2M".into(), "read -P 0x8 8M 2M".into()],
    );
    drop(images);
    drop(small);
    s.finish();
}

/// Output that cannot be written fails the command: `stats --watch | head
/// -1` ran for ever, and `info`, `check`, `stats` and `completions` into
/// /dev/full exited 0.
#[test]
fn output_that_cannot_be_written_fails_the_command() {
    let s = Scratch::new();
    let img = image(&s, "d.qcow2");
    let sock = s.path("d.sock");
    let server: Proc = serve(&s, &sock, &[arg(&img)]);
    for args in [
        format!("info -U '{}'", img.display()),
        format!("check -U '{}'", img.display()),
        "completions bash".to_string(),
        format!("stats --socket '{}'", sock.display()),
        format!("stats --watch 1 --socket '{}'", sock.display()),
    ] {
        let out = exec_within(
            Command::new("sh").arg("-c").arg(format!(
                "'{}' {args} > /dev/full",
                env!("CARGO_BIN_EXE_vdcache")
            )),
            Duration::from_secs(30),
        )
        .expect("a command writing into /dev/full must end");
        refused(&out, &["standard output"]);
    }
    let out = exec_within(
        Command::new("sh").arg("-c").arg(format!(
            "'{}' stats --watch 1 --socket '{}' | head -1",
            env!("CARGO_BIN_EXE_vdcache"),
            sock.display()
        )),
        Duration::from_secs(30),
    )
    .expect("stats --watch | head -1 must end");
    assert!(out.success(), "{}", out.report());
    server.stop_clean();
    s.finish();
}

/// A trace from a pipe was read once by the scan and found empty by the
/// replay: "0 records", exit 0.
#[test]
fn replay_reads_a_trace_from_a_pipe() {
    let s = Scratch::new();
    let trace = s.path("t.csv");
    ok(s.vdcache()
        .args(["trace-gen", "--requests", "500"])
        .arg(&trace));
    let out = ok(Command::new("sh").arg("-c").arg(format!(
        "cat '{}' | TMPDIR='{}' '{}' replay /dev/stdin --format msr --json",
        trace.display(),
        s.root().join("tmp").display(),
        env!("CARGO_BIN_EXE_vdcache")
    )));
    let report: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    let lines = std::fs::read_to_string(&trace)
        .expect("read")
        .lines()
        .count();
    assert!(lines > 400);
    assert_eq!(report["records"], lines, "{}", out.report());
    s.finish();
}

/// The messages of issue 42, each naming what is wrong.
#[test]
fn messages_name_what_is_wrong() {
    let s = Scratch::new();
    let img = image(&s, "d.qcow2");
    let sock = s.path("d.sock");
    refused(
        &exec(s.vdcache().args(["create", "x.qcow2", "--", "-1G"])),
        &["negative"],
    );
    refused(
        &exec(s.vdcache().args(["serve", "--tcp", "0.0.0.0"]).arg(&img)),
        &["--tcp", "port"],
    );
    refused(
        &exec(
            s.vdcache()
                .args(["serve", "--workers", "0", "--socket"])
                .arg(&sock)
                .arg(&img),
        ),
        &["--workers"],
    );
    let help = ok(s.vdcache().args(["serve", "--help"]));
    assert!(
        help.stdout.contains("top image of a qcow2 chain"),
        "{}",
        help.report()
    );
    // One image named by two writable exports: named as such, not as
    // "another process".
    let config = s.path("two.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\n[[export]]\nname = \"a\"\nimage = \"{i}\"\n[[export]]\nname = \"b\"\nimage = \"{i}\"\n",
            sock.display(),
            i = img.display()
        ),
    )
    .expect("write");
    let out = exec(s.vdcache().args(["serve", "--config"]).arg(&config));
    refused(&out, &["same file"]);
    assert!(!out.stderr.contains("another process"), "{}", out.report());
    // A served image: info and check name -U; the log names the mode; a
    // cache removed underneath is named.
    let cache = s.path("d.cache");
    let mut server = serve(
        &s,
        &sock,
        &[
            "--cache",
            arg(&cache),
            "--cache-size",
            "32M",
            "--cache-mode",
            "writethrough",
            arg(&img),
        ],
    );
    for cmd in ["info", "check"] {
        refused(&exec(s.vdcache().arg(cmd).arg(&img)), &["in use", "-U"]);
    }
    assert!(
        server
            .log_text()
            .contains("through the cache (writethrough)")
    );
    std::fs::remove_file(&cache).expect("rm cache");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.log_text().contains("was replaced or removed") {
        assert!(Instant::now() < deadline, "{}", server.log_text());
        server.assert_alive();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        server.log_text().contains("the cache:"),
        "{}",
        server.log_text()
    );
    server.stop_clean();
    s.finish();
}

/// The per-disk metadata journal is what a user gets: a flush without a
/// cache or through a writethrough cache costs one store sync. It was off
/// unless asked for.
#[test]
fn the_metadata_journal_is_on_by_default_where_it_helps() {
    let s = Scratch::new();
    let img = image(&s, "d.qcow2");
    let sock = s.path("d.sock");
    let cache = s.path("d.cache");
    for (extra, journaled) in [
        (vec![], true),
        (
            vec![
                "--cache",
                arg(&cache),
                "--cache-size",
                "32M",
                "--cache-mode",
                "writethrough",
            ],
            true,
        ),
        (
            vec!["--cache", arg(&cache), "--cache-mode", "writeback"],
            false,
        ),
        (vec!["--metadata-journal", "off"], false),
    ] {
        let mut args = extra.clone();
        args.push(arg(&img));
        let server = serve(&s, &sock, &args);
        qemu_io(
            &s,
            "raw",
            &uri(&sock, ""),
            &["write -P 0x1 0 64k".into(), "flush".into()],
        );
        let st = stats(&s, &sock);
        assert_eq!(
            st["disks"][0]["metadata_journal"].is_object(),
            journaled,
            "{extra:?}: {}",
            st["disks"][0]
        );
        server.stop_clean();
    }
    ok(s.qemu_img().arg("check").arg(&img));
    s.finish();
}
