//! Issue 18: what a new user did to vdcache in an hour, each as a test
//! that failed before the fix. Creating over an image in use; an image
//! deleted and created again under the cache's feet; output into a closed
//! pipe; a cache file that failed to be created, or given another size; a
//! crash that left the newest data in the cache while QEMU would read the
//! stale file; a cache whose superblock was destroyed; a cache holding
//! dirty data of an image the server does not serve; a start refused
//! halfway; a check of an image being served.

use crate::common;
use crate::serving;

use common::{Scratch, assert_no_panic, exec, ok};
use serving::{Proc, qcow2, qemu_io, serve, serve_refused, stats, try_serve, try_start, uri};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

const M: u64 = 1 << 20;

fn sha(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn cache_args<'a>(cache: &'a str, img: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--cache", cache, "--cache-size", "64M"];
    v.extend_from_slice(extra);
    v.push(img);
    v
}

/// A qcow2 image served through a write-back cache in a scratch
/// directory: `tag.qcow2`, `tag.cache`, `tag.sock`.
struct Rig {
    s: Scratch,
    img: PathBuf,
    cache: PathBuf,
    sock: PathBuf,
}

impl Rig {
    fn new(tag: &str, backing: Option<&str>) -> Rig {
        let s = Scratch::new();
        let img = s.path(&format!("{tag}.qcow2"));
        qcow2(&s, &img, 16 * M, backing);
        let (cache, sock) = (
            s.path(&format!("{tag}.cache")),
            s.path(&format!("{tag}.sock")),
        );
        Rig {
            s,
            img,
            cache,
            sock,
        }
    }

    fn i(&self) -> &str {
        self.img.to_str().expect("utf-8")
    }

    fn c(&self) -> &str {
        self.cache.to_str().expect("utf-8")
    }

    fn args(&self) -> Vec<&str> {
        cache_args(self.c(), self.i(), &[])
    }

    fn serve(&self) -> Proc {
        serve(&self.s, &self.sock, &self.args())
    }

    fn refused(&self) -> String {
        serve_refused(&self.s, &self.sock, &self.args())
    }

    /// qemu-io commands over NBD.
    fn nbd_io(&self, cmds: &[&str]) {
        let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
        qemu_io(&self.s, "raw", &uri(&self.sock, ""), &cmds);
    }

    /// Writes and flushes through a server, then kills it with -9: the
    /// data stays dirty in the cache.
    fn crash_after(&self, write: &str) {
        let server = self.serve();
        self.nbd_io(&[write, "flush"]);
        server.kill9();
    }

    /// The image deleted and created again, with `write` (qemu-io) in it.
    fn recreate(&self, write: &str) {
        std::fs::remove_file(&self.img).expect("rm");
        qcow2(&self.s, &self.img, 16 * M, None);
        qemu_io(&self.s, "qcow2", self.i(), &[write.into()]);
    }
}

#[test]
fn create_refuses_an_image_in_use_and_changes_nothing() {
    let s = Scratch::new();
    let img = s.path("d2.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let sock = s.path("d2.sock");
    let server = serve(&s, &sock, &[img.to_str().expect("utf-8")]);
    let before = sha(&img);
    for args in [vec!["create", "-f", "qcow2"], vec!["create", "-f", "raw"]] {
        let out = exec(s.vdcache().args(&args).arg(&img).arg("1G"));
        assert_no_panic(&out);
        assert!(
            !out.success() && out.stderr.contains("in use"),
            "creating over an image a server holds must fail naming the lock\n{}",
            out.report()
        );
        assert_eq!(sha(&img), before, "the image in use was changed");
    }
    // convert into it is refused the same way.
    let src = s.path("src.qcow2");
    qcow2(&s, &src, 16 * M, None);
    let out = exec(
        s.vdcache()
            .args(["convert", "-O", "qcow2"])
            .arg(&src)
            .arg(&img),
    );
    assert!(
        !out.success() && out.stderr.contains("in use"),
        "{}",
        out.report()
    );
    assert_eq!(sha(&img), before);
    server.stop_clean();
    // Once the server is gone, creating works (as qemu-img create does).
    ok(s.vdcache()
        .args(["create", "-f", "qcow2"])
        .arg(&img)
        .arg("1G"));
    s.finish();
}

/// `vdcache check` of an image a server holds says it is in use (as
/// qemu-img check does), not that its data is in a cache it is served with.
#[test]
fn check_of_an_image_being_served_says_it_is_in_use() {
    let r = Rig::new("k", None);
    let server = r.serve();
    r.nbd_io(&["write -P 0x11 0 1M", "flush"]);
    for repair in [&[][..], &["-r", "leaks"][..]] {
        let out = exec(r.s.vdcache().arg("check").args(repair).arg(&r.img));
        assert!(
            out.code() == Some(1) && out.stderr.contains("in use"),
            "{}",
            out.report()
        );
    }
    server.stop_clean();
    ok(r.s.vdcache().arg("check").arg(&r.img));
    r.s.finish();
}

/// kill -9 with dirty data in the cache, the image deleted and created
/// again (the file system may hand it the same inode), new data written
/// without the cache: the cache must not serve or write back the old
/// image's blocks over the new one.
#[test]
fn an_image_created_again_under_the_cache_is_never_served_its_old_data() {
    let r = Rig::new("r", None);
    let server = r.serve();
    r.nbd_io(&["write -P 0x11 0 4M", "flush"]);
    let dirty = stats(&r.s, &r.sock)["cache"]["dirty_bytes"].as_u64();
    assert!(
        dirty.unwrap_or(0) > 0,
        "the test needs dirty data in the cache"
    );
    server.kill9();

    r.recreate("write -P 0x22 0 1M");
    let new_image = sha(&r.img);
    // Dirty data of the old image: refused, in words, with what to do.
    let log = r.refused();
    assert!(
        log.contains("is not the image") && log.contains("recover"),
        "the refusal must say what happened and what to do\n{log}"
    );
    assert!(
        !log.contains("ImageIdentity") && !log.contains("{ "),
        "no struct dumps in messages\n{log}"
    );
    assert_eq!(sha(&r.img), new_image, "the new image was changed");

    // Give the old data up (the cache goes), and the new image serves its
    // own content.
    std::fs::remove_file(&r.cache).expect("rm cache");
    let server = r.serve();
    r.nbd_io(&["read -P 0x22 0 1M", "read -P 0 1M 3M"]);
    server.stop_clean();
    r.s.finish();
}

/// The same without dirty data: the old image's clean copies are dropped
/// and the new file's bytes are read. The new file has the old one's size
/// (the same clusters written), so only a real identity tells them apart.
#[test]
fn clean_copies_of_a_replaced_image_are_dropped() {
    let r = Rig::new("cl", None);
    let server = r.serve();
    r.nbd_io(&["write -P 0x33 0 2M", "flush"]);
    r.nbd_io(&["read -P 0x33 0 2M"]);
    server.stop_clean();
    let old_len = std::fs::metadata(&r.img).expect("stat").len();
    r.recreate("write -P 0x44 0 2M");
    assert_eq!(std::fs::metadata(&r.img).expect("stat").len(), old_len);
    let server = r.serve();
    r.nbd_io(&["read -P 0x44 0 2M"]);
    server.stop_clean();
    r.s.finish();
}

/// A copy of the image from before the last session (a backup restored)
/// carries an older generation: the cache's clean copies of later writes
/// are not served over it.
#[test]
fn a_restored_backup_is_told_apart_by_its_generation() {
    let r = Rig::new("b", None);
    let server = r.serve();
    r.nbd_io(&["write -P 0x55 0 1M", "flush"]);
    server.stop_clean();
    let backup = sha(&r.img);
    let server = r.serve();
    r.nbd_io(&["write -P 0x66 0 1M", "flush"]);
    r.nbd_io(&["read -P 0x66 0 1M"]);
    server.stop_clean();
    std::fs::write(&r.img, &backup).expect("restore the backup");
    let server = r.serve();
    r.nbd_io(&["read -P 0x55 0 1M"]);
    server.stop_clean();
    r.s.finish();
}

#[test]
fn output_into_a_closed_pipe_or_stdout_does_not_panic() {
    let s = Scratch::new();
    let img = s.path("p.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let base = s.path("pb.qcow2");
    qcow2(&s, &base, 16 * M, None);
    let delta = s.path("pd.qcow2");
    qcow2(&s, &delta, 16 * M, Some(base.to_str().expect("utf-8")));
    for args in [vec!["info"], vec!["check"], vec!["info", "--json"]] {
        // A reader that has gone before the first line (`| head -0`):
        // deterministic, unlike a reader racing the writer.
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = s
            .vdcache()
            .args(&args)
            .arg(&delta)
            .stdout(writer)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && out.status.code() != Some(101),
            "vdcache {args:?} into a closed pipe: {stderr}"
        );
        // A device that refuses every write (opened for writing: a
        // read-only descriptor would be taken for a closed stdout).
        let out = s
            .vdcache()
            .args(&args)
            .arg(&delta)
            .stdout(Stdio::from(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .expect("/dev/full"),
            ))
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && out.status.code() != Some(101),
            "vdcache {args:?} into a full device: {stderr}"
        );
    }
    s.finish();
}

#[test]
fn a_cache_file_is_created_whole_or_not_at_all_and_keeps_its_size() {
    let s = Scratch::new();
    let img = s.path("c.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let i = img.to_str().expect("utf-8");
    let cache = s.path("b.cache");
    let c = cache.to_str().expect("utf-8");
    let sock = s.path("c.sock");
    let log = serve_refused(&s, &sock, &["--cache", c, "--cache-size", "1K", i]);
    assert!(log.contains("minimum"), "{log}");
    assert!(
        !cache.exists(),
        "a failed creation left {}",
        cache.display()
    );
    let leftovers: Vec<_> = std::fs::read_dir(s.root())
        .expect("ls")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("b.cache"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");

    let server = serve(&s, &sock, &["--cache", c, "--cache-size", "100M", i]);
    server.stop_clean();
    assert_eq!(std::fs::metadata(&cache).expect("cache").len(), 100 * M);
    let before = sha(&cache);
    let log = serve_refused(&s, &sock, &["--cache", c, "--cache-size", "200M", i]);
    assert!(
        log.contains("104857600") && log.contains("209715200"),
        "the size mismatch must be an error naming both sizes\n{log}"
    );
    assert_eq!(sha(&cache), before, "the refused start changed the cache");
    // Without --cache-size the existing cache is used as it is.
    let server = serve(&s, &sock, &["--cache", c, i]);
    server.stop_clean();
    // Options that need a cache are refused without one.
    for opt in [
        ["--cache-mode", "writeback"],
        ["--cache-size", "64M"],
        ["--admission", "hot"],
    ] {
        let out = exec(
            s.vdcache()
                .arg("serve")
                .arg("--socket")
                .arg(&sock)
                .args(opt)
                .arg(i),
        );
        assert_no_panic(&out);
        assert!(
            !out.success() && out.stderr.contains("--cache"),
            "{opt:?} without --cache must be refused\n{}",
            out.report()
        );
    }
    s.finish();
}

/// A file that is not a cache is never formatted without being asked.
#[test]
fn a_file_that_is_not_a_cache_is_not_formatted() {
    let s = Scratch::new();
    let img = s.path("n.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let other = s.path("other.qcow2");
    qcow2(&s, &other, 64 * M, None);
    let before = sha(&other);
    let sock = s.path("n.sock");
    let log = serve_refused(
        &s,
        &sock,
        &[
            "--cache",
            other.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
        ],
    );
    assert!(log.contains("nothing was changed"), "{log}");
    assert_eq!(sha(&other), before);
    s.finish();
}

/// After a crash with dirty data in flash, the image alone is stale: QEMU
/// and vdcache refuse it (naming the recovery), info says so, and full
/// recovery makes it whole and usable again.
#[test]
fn an_image_whose_data_is_in_the_cache_is_refused_until_recovered() {
    let s = Scratch::new();
    let base = s.path("base.qcow2");
    qcow2(&s, &base, 16 * M, None);
    let b = base.to_str().expect("utf-8");
    qemu_io(&s, "qcow2", b, &["write -P 0x11 0 16M".into()]);
    let r = Rig {
        img: s.path("m.qcow2"),
        cache: s.path("m.cache"),
        sock: s.path("m.sock"),
        s,
    };
    qcow2(&r.s, &r.img, 16 * M, Some(b));
    r.crash_after("write -P 0x22 0 1M");

    let out = exec(r.s.qemu_img().arg("check").arg(&r.img));
    assert!(
        !out.success() && out.stderr.contains("vdcache recover --full"),
        "qemu-img must refuse the stale image naming the recovery\n{}",
        out.report()
    );
    let out = exec(r.s.qemu_io().args(["-c", "read 0 512"]).arg(&r.img));
    assert!(
        !out.success() || out.all().contains("Unsupported"),
        "{}",
        out.report()
    );
    let out = exec(r.s.vdcache().arg("check").arg(&r.img));
    assert!(
        out.code() == Some(1) && out.stderr.contains(r.c()) && out.stderr.contains("recover"),
        "vdcache check must refuse naming the cache\n{}",
        out.report()
    );
    let out = ok(r.s.vdcache().arg("info").arg(&r.img));
    assert!(out.stdout.contains("NEEDS ITS CACHE"), "{}", out.report());
    let out = exec(r.s.vdcache().args(["io", "-c", "read 0 512"]).arg(&r.img));
    assert!(!out.success(), "vdcache io must refuse\n{}", out.report());
    // Served through a new cache: refused, and the new cache file is gone.
    let other = r.s.path("other.cache");
    let o = other.to_str().expect("utf-8");
    let log = serve_refused(&r.s, &r.sock, &cache_args(o, r.i(), &[]));
    assert!(
        log.contains(r.c()),
        "the refusal must name the cache\n{log}"
    );
    assert!(!other.exists(), "a refused start left its new cache behind");

    ok(r.s.vdcache().args(["recover", "--full", "--cache", r.c()]));
    let out = ok(r.s.qemu_img().arg("check").arg(&r.img));
    assert!(out.stdout.contains("No errors"), "{}", out.report());
    let reads = ["read -P 0x22 0 1M".into(), "read -P 0x11 1M 15M".into()];
    qemu_io(&r.s, "qcow2", r.i(), &reads);
    r.s.finish();
}

/// A start that fails on its second export undoes what the first did: that
/// image is released from the cache (QEMU opens it, no mark left set) and
/// the cache file this start created is removed.
#[test]
fn a_refused_start_releases_the_exports_it_opened() {
    let r = Rig::new("u", None);
    let config = r.s.path("u.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = {sock:?}\n[cache]\npath = {cache:?}\nsize = \"64M\"\nmode = \"writeback\"\n\
             [[export]]\nname = \"a\"\nimage = {img:?}\n\
             [[export]]\nname = \"b\"\nimage = {missing:?}\n",
            sock = r.sock,
            cache = r.cache,
            img = r.img,
            missing = r.s.path("missing.qcow2"),
        ),
    )
    .expect("config");
    let mut cmd = r.s.vdcache();
    cmd.arg("serve").arg("--config").arg(&config);
    let Err((status, log)) = try_start(&r.s, cmd, &r.sock) else {
        panic!("a server with a missing image started");
    };
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("missing.qcow2"), "{log}");
    assert!(
        !r.cache.exists(),
        "a refused start left its new cache behind"
    );
    let out = ok(r.s.qemu_img().arg("check").arg(&r.img));
    assert!(out.stdout.contains("No errors"), "{}", out.report());
    qemu_io(&r.s, "qcow2", r.i(), &["write -P 0x33 0 64k".into()]);
    r.s.finish();
}

/// `vdcache recover --without-cache` makes an image usable whose cache is
/// lost, saying so.
#[test]
fn an_image_whose_cache_is_lost_can_be_given_up() {
    let r = Rig::new("l", None);
    r.crash_after("write -P 0x22 0 1M");
    std::fs::remove_file(&r.cache).expect("lose the cache");
    let out = ok(r.s.vdcache().args(["recover", "--without-cache", r.i()]));
    assert!(out.stdout.contains("lost"), "{}", out.report());
    ok(r.s.qemu_img().arg("check").arg(&r.img));
    r.s.finish();
}

/// A zeroed superblock: restored from its copy (never formatted again,
/// even with --cache-size given), and the dirty data behind it served.
/// (A device without either copy is refused: tests/faults.rs of the cache.)
#[test]
fn a_cache_whose_superblock_was_zeroed_is_restored_not_reformatted() {
    let r = Rig::new("z", None);
    r.crash_after("write -P 0x22 0 1M");
    let original = sha(&r.cache);
    let mut bytes = original.clone();
    bytes[..4096].fill(0);
    std::fs::write(&r.cache, &bytes).expect("zero the superblock");
    let server = r.serve();
    r.nbd_io(&["read -P 0x22 0 1M"]);
    let log = server.stop_clean();
    assert!(log.contains("restored from its copy"), "{log}");
    // The superblock's half of its block (the other half holds the seal,
    // rewritten at every sync).
    assert_eq!(
        sha(&r.cache)[..2048],
        original[..2048],
        "the superblock was not restored"
    );
    r.s.finish();
}

/// A cache holding dirty data of an image this server does not serve:
/// a warning at start, that data left alone, and a stop that ends.
#[test]
fn dirty_data_of_an_image_not_served_is_named_and_does_not_block_the_stop() {
    let a = Rig::new("a", None);
    let b = a.s.path("b.qcow2");
    qcow2(&a.s, &b, 16 * M, None);
    a.crash_after("write -P 0x77 0 1M");

    let other = cache_args(a.c(), b.to_str().expect("utf-8"), &[]);
    let server = match try_serve(&a.s, &a.sock, &other) {
        Ok(p) => p,
        Err(log) => panic!("serving another image on the cache failed\n{log}"),
    };
    let started = Instant::now();
    let log = server.stop_clean();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the stop took {:?}",
        started.elapsed()
    );
    assert!(
        log.contains(a.i()) && log.contains("not served"),
        "the start must name the image whose dirty data stays in the cache\n{log}"
    );
    // The data is still there for its own image.
    let server = a.serve();
    a.nbd_io(&["read -P 0x77 0 1M"]);
    server.stop_clean();
    a.s.finish();
}

/// An image replaced under a running server (another file moved over its
/// path): the server goes on with the file it opened, and says so once,
/// naming the path, instead of letting guests' writes vanish silently.
#[test]
fn an_image_replaced_while_served_is_named_in_a_warning() {
    let r = Rig::new("moved", None);
    let server = r.serve();
    r.nbd_io(&["write -P 0x21 0 64k", "flush"]);
    let other = r.s.path("other.qcow2");
    qcow2(&r.s, &other, 16 * M, None);
    std::fs::rename(&other, &r.img).expect("mv");
    let warning = format!("{} was replaced or removed while being served", r.i());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.log_text().contains(&warning) {
        assert!(
            Instant::now() < deadline,
            "no warning: {}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Still the file it opened: the guest reads what it wrote.
    r.nbd_io(&["read -P 0x21 0 64k", "write -P 0x22 64k 64k", "flush"]);
    std::thread::sleep(Duration::from_secs(6));
    let log = server.stop_clean();
    assert_eq!(log.matches(&warning).count(), 1, "{log}");
    r.s.finish();
}
