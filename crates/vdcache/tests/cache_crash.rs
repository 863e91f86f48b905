//! Issue 4, done-when 2, with the real server and real clients: `vdcache
//! serve` with a writeback flash cache is killed with SIGKILL while qemu-io
//! writes and flushes; restarted on the same cache (fast recovery) it
//! serves every flushed write; killed again, `vdcache recover --full`
//! leaves an image that `qemu-img check` finds clean and `qemu-img
//! compare` finds equal to the reference. Also: --keep-dirty stops and
//! restarts, a cache device recorded for another host is refused until
//! recovered, and `vdcache stats --json` reports the cache counters (read
//! hits, no backend syncs for guest flushes in writeback mode). Issue 5:
//! partially valid clusters are filled by `vdcache flush --fill` and by the
//! background filler when the disk is idle.

use crate::common;
use crate::serving;

use common::{Scratch, assert_same_bytes, exec, ok};
use serving::{
    CrashWorkload, Streamed, qcow2, qemu_io, serve, serve_config, serve_refused, stats, try_serve,
    uri,
};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

const M: u64 = 1 << 20;

fn cache_args<'a>(cache: &'a str, img: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "--cache",
        cache,
        "--cache-size",
        "256M",
        "--cache-mode",
        "writeback",
    ];
    v.extend_from_slice(extra);
    v.push(img);
    v
}

/// Reads the whole disk through the server.
fn read_all(s: &Scratch, u: &str, name: &str) -> Vec<u8> {
    let p = s.path(name);
    ok(s.qemu_img()
        .args(["convert", "-f", "raw", "-O", "raw", u])
        .arg(&p));
    std::fs::read(&p).expect("read converted disk")
}

fn total(st: &serde_json::Value, key: &str) -> u64 {
    st["cache"]["total"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("stats --json has no cache.total.{key}: {st:#}"))
}

fn check_clean(s: &Scratch, img: &Path) {
    let chk = exec(s.qemu_img().arg("check").arg(img));
    assert!(
        chk.success() && chk.stdout.contains("No errors"),
        "qemu-img check must find the image clean\n{}",
        chk.report()
    );
}

/// QEMU refuses an image whose newest data is still in vdcache's cache,
/// naming vdcache's recovery command.
fn check_refused_as_in_cache(s: &Scratch, img: &Path) {
    let chk = exec(s.qemu_img().arg("check").arg(img));
    assert!(
        !chk.success() && chk.stderr.contains("vdcache recover"),
        "qemu-img must refuse an image whose data is in the cache, naming the recovery\n{}",
        chk.report()
    );
}

/// One crash round in its own files `{tag}.*`: a writeback cache of
/// `cache_size`, SIGKILL after `kill_at` of 40 flushes, fast recovery,
/// more writes and flushes, SIGKILL again, full recovery.
/// `quiet_backend`: the cache is larger than the disk, so re-reads hit and
/// nothing is written back before the full recovery (guest flushes must
/// cost no backend sync).
fn crash_round(
    s: &Scratch,
    tag: &str,
    cache_size: &str,
    seed: u64,
    kill_at: usize,
    quiet_backend: bool,
) {
    let size = 32 * M;
    let img = s.path(&format!("{tag}.qcow2"));
    qcow2(s, &img, size, None);
    let cache = s.path(&format!("{tag}.cache"));
    let (c, i) = (cache.to_str().expect("utf-8"), img.to_str().expect("utf-8"));
    // The idle filler writes to the store when the client pauses (a slow
    // machine makes pauses): with a quiet backend asserted, it is off.
    let extra: &[&str] = if quiet_backend {
        &["--no-idle-fill"]
    } else {
        &[]
    };
    let mut args = cache_args(c, i, extra);
    args[3] = cache_size;
    let sock = s.path(&format!("{tag}.sock"));
    let u = uri(&sock, "");
    let server = serve(s, &sock, &args);

    // 40 groups of 6 writes, each group flushed; SIGKILL once qemu-io has
    // reported the `kill_at`-th flush, while it keeps writing.
    let w = CrashWorkload::generate(seed, size, 40, 6);
    let mut cmd = s.qemu_io();
    cmd.args(["-f", "raw"]);
    for c in w.commands() {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(&u);
    let mut qio = Streamed::spawn(cmd);
    let marker = w.marker();
    assert!(
        qio.wait_for(kill_at, |l| l.trim() == marker),
        "qemu-io ended before flush {kill_at}:\n{}",
        qio.seen.join("\n")
    );
    server.kill9();
    let (_, lines) = qio.finish();
    let flushed = w.confirmed_flushes(&lines);
    assert!(flushed >= kill_at, "{flushed} flushes confirmed");
    eprintln!("{tag}: killed after {flushed} of 40 flushes confirmed");

    // Fast recovery: restart on the same cache; every flushed write reads
    // back, unflushed ones read old or new.
    let server = serve(s, &sock, &args);
    let zeros = vec![0u8; size as usize];
    let recovered = read_all(s, &u, &format!("{tag}.recovered.raw"));
    w.check(
        "the disk served after kill -9 and a restart on the same cache",
        &zeros,
        flushed,
        &recovered,
    );
    // Read again: with a cache larger than the disk, now from flash.
    let before = stats(s, &sock);
    let again = read_all(s, &u, &format!("{tag}.again.raw"));
    assert_same_bytes("a second read of the recovered disk", &recovered, &again);
    let st = stats(s, &sock);
    if quiet_backend {
        assert!(
            total(&st, "read_hit_blocks") > total(&before, "read_hit_blocks"),
            "re-reading the disk must hit the cache: {st:#}"
        );
    }

    // The VM goes on: overwrite some of what it wrote before the crash,
    // flushing as it goes. Guest flushes cost no backend sync in writeback.
    let syncs = total(&st, "backend_syncs");
    let flushes = total(&st, "guest_flushes");
    let mut model = recovered.clone();
    let mut cmds = Vec::new();
    for (n, (off, len, _)) in w.unflushed(0).into_iter().step_by(3).enumerate() {
        let byte = (n % 200 + 30) as u8;
        model[off as usize..(off + len) as usize].fill(byte);
        cmds.push(format!("write -P {byte} {off} {len}"));
        if n % 8 == 7 {
            cmds.push("flush".into());
        }
    }
    cmds.push("flush".into());
    qemu_io(s, "raw", &u, &cmds);
    let st = stats(s, &sock);
    assert!(
        total(&st, "guest_flushes") > flushes,
        "guest flushes are counted: {st:#}"
    );
    if quiet_backend {
        assert_eq!(
            total(&st, "backend_syncs"),
            syncs,
            "a guest flush in writeback mode must not sync the backend: {st:#}"
        );
        assert!(
            st["cache"]["dirty_bytes"].as_u64().unwrap_or(0) > 0,
            "{st:#}"
        );
    }

    // Crash again, after the flush; full recovery writes everything back.
    server.kill9();
    let rec = ok(s
        .vdcache()
        .args(["recover", "--full", "--cache"])
        .arg(&cache));
    // (Under pressure, background write-back may in principle have
    // drained everything already.)
    assert!(
        rec.stdout.contains("written back") && rec.stdout.contains(i)
            || !quiet_backend && rec.stdout.contains("no dirty data"),
        "{}",
        rec.report()
    );
    check_clean(s, &img);
    ok(s.vdcache().arg("check").arg(&img));
    let refp = s.path(&format!("{tag}.reference.raw"));
    std::fs::write(&refp, &model).expect("write reference");
    let cmp = ok(s
        .qemu_img()
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(&img)
        .arg(&refp));
    assert!(
        cmp.stdout.contains("Images are identical"),
        "{}",
        cmp.report()
    );
}

#[test]
fn kill9_in_writeback_then_fast_and_full_recovery() {
    let s = Scratch::new();
    crash_round(&s, "big", "256M", 0xcac4e, 15, true);
    s.finish();
}

/// A cache small enough that write-back (high watermark) and region
/// reclaim run during the workload, so the kill can land in them.
#[test]
fn kill9_under_cache_pressure_then_fast_and_full_recovery() {
    let s = Scratch::new();
    crash_round(&s, "small", "16M", 0x5a11, 25, false);
    s.finish();
}

#[test]
fn keep_dirty_stop_then_restart_and_write_back() {
    let s = Scratch::new();
    let img = s.path("kd.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let cache = s.path("kd.cache");
    let (c, i) = (cache.to_str().expect("utf-8"), img.to_str().expect("utf-8"));
    let sock = s.path("kd.sock");
    let u = uri(&sock, "");

    let server = serve(&s, &sock, &cache_args(c, i, &["--keep-dirty"]));
    // Opening stamped the image's cache mark, durably.
    let at_open = total(&stats(&s, &sock), "backend_syncs");
    assert!(
        at_open > 0,
        "the open synced no store: was the image stamped?"
    );
    qemu_io(
        &s,
        "raw",
        &u,
        &["write -P 0x5a 1M 2M".into(), "flush".into()],
    );
    let st = stats(&s, &sock);
    assert_eq!(total(&st, "backend_syncs"), at_open, "{st:#}");
    let log = server.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    // The image's newest data is in flash: QEMU must not read the file
    // alone, and says what to run.
    check_refused_as_in_cache(&s, &img);

    // Restart (this time writing back on stop): the data is still dirty
    // in flash and reads back from there.
    let server = serve(&s, &sock, &cache_args(c, i, &[]));
    let st = stats(&s, &sock);
    assert!(
        st["cache"]["dirty_bytes"].as_u64().unwrap_or(0) >= 2 * M,
        "--keep-dirty must leave the dirty data in flash: {st:#}"
    );
    qemu_io(&s, "raw", &u, &["read -P 0x5a 1M 2M".into()]);
    let st = stats(&s, &sock);
    assert!(total(&st, "read_hit_blocks") > 0, "{st:#}");
    server.stop_clean();
    check_clean(&s, &img);
    qemu_io(
        &s,
        "qcow2",
        i,
        &["read -P 0x5a 1M 2M".into(), "read -P 0 3M 13M".into()],
    );
    s.finish();
}

/// A cache kept dirty across a stop (or left by a crash) full of one
/// export's dirty blocks: the restart opens the exports one by one, and
/// opening the first (which writes its header through the cache) must not
/// need the second's blocks written back before that one is open (the
/// restart failed: "dirty blocks of vm2.qcow2 cannot be written back: the
/// image is not open").
#[test]
fn a_restart_opens_every_export_while_the_cache_is_full_of_another_ones_dirty_blocks() {
    let s = Scratch::new();
    let base = s.path("base.qcow2");
    qcow2(&s, &base, 128 * M, None);
    for vm in ["vm1", "vm2"] {
        qcow2(
            &s,
            &s.path(&format!("{vm}.qcow2")),
            128 * M,
            Some("base.qcow2"),
        );
    }
    let sock = s.path("two.sock");
    let cfg = s.path("two.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nsocket = {:?}\n[cache]\npath = {:?}\nsize = \"64M\"\nkeep_dirty = true\n\
             [[export]]\nname = \"vm1\"\nimage = {:?}\n[[export]]\nname = \"vm2\"\nimage = {:?}\n",
            sock,
            s.path("two.cache"),
            s.path("vm1.qcow2"),
            s.path("vm2.qcow2")
        ),
    )
    .expect("write config");
    // 1000 writes of 64 KiB at distinct offsets (7919 is prime to 2048).
    let offset = |i: u64| (i * 7919 % 2048) * 64 * 1024;
    let pattern = |i: u64| i % 250 + 1;
    let server = serve_config(&s, &cfg, &sock);
    let mut cmds: Vec<String> = (0..1000)
        .map(|i| format!("write -P {} {} 64k", pattern(i), offset(i)))
        .collect();
    cmds.push("flush".into());
    qemu_io(&s, "raw", &uri(&sock, "vm2"), &cmds);
    let dirty = stats(&s, &sock)["cache"]["dirty_bytes"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        dirty >= 8 * M,
        "the cache must hold vm2's dirty blocks: {dirty}"
    );
    let log = server.stop_clean();
    assert!(log.contains("kept in the cache"), "{log}");

    let server = serve_config(&s, &cfg, &sock);
    let reads: Vec<String> = (0..1000)
        .map(|i| format!("read -P {} {} 64k", pattern(i), offset(i)))
        .collect();
    qemu_io(&s, "raw", &uri(&sock, "vm2"), &reads);
    qemu_io(
        &s,
        "raw",
        &uri(&sock, "vm1"),
        &["write -P 0x77 0 1M".into(), "flush".into()],
    );
    ok(s.vdcache().args(["flush", "--socket"]).arg(&sock));
    server.stop_clean();
    for vm in ["vm1", "vm2"] {
        check_clean(&s, &s.path(&format!("{vm}.qcow2")));
    }
    let vm2 = s.path("vm2.qcow2");
    qemu_io(&s, "qcow2", vm2.to_str().expect("utf-8"), &reads);
    let vm1 = s.path("vm1.qcow2");
    qemu_io(
        &s,
        "qcow2",
        vm1.to_str().expect("utf-8"),
        &["read -P 0x77 0 1M".into()],
    );
    s.finish();
}

/// A copy of the cache file from an earlier time put back after a later
/// session wrote the image back completely: its dirty blocks are older than
/// the image and must not overwrite it. Serving and `recover --full` are
/// refused, naming the cache as the stale one, and the image keeps its
/// newer data.
#[test]
fn a_stale_copy_of_the_cache_is_refused_and_never_overwrites_newer_data() {
    let s = Scratch::new();
    let img = s.path("st.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let cache = s.path("st.cache");
    let (c, i) = (cache.to_str().expect("utf-8"), img.to_str().expect("utf-8"));
    let sock = s.path("st.sock");
    let u = uri(&sock, "");
    let server = serve(&s, &sock, &cache_args(c, i, &[]));
    qemu_io(
        &s,
        "raw",
        &u,
        &["write -P 0xa1 0 64k".into(), "flush".into()],
    );
    server.kill9();
    let stale = s.path("st.cache.copy");
    std::fs::copy(&cache, &stale).expect("copy the cache");
    let server = serve(&s, &sock, &cache_args(c, i, &[]));
    qemu_io(
        &s,
        "raw",
        &u,
        &["write -P 0xb1 0 64k".into(), "flush".into()],
    );
    server.stop_clean();
    std::fs::copy(&stale, &cache).expect("put the old copy back");
    let refused = try_serve(&s, &sock, &cache_args(c, i, &[])).err();
    let log = refused.expect("a stale cache must be refused");
    assert!(log.contains("from an earlier time"), "{log}");
    let out = exec(s.vdcache().args(["recover", "--full", "--cache", c]));
    assert!(
        out.stderr.contains("from an earlier time"),
        "{}",
        out.report()
    );
    check_clean(&s, &img);
    qemu_io(&s, "qcow2", i, &["read -P 0xb1 0 64k".into()]);
    s.finish();
}

/// Another cache moved over the cache path while an image's newest data
/// is in the original: the image is refused saying the cache there is not
/// the one holding its data (not to serve it "with that cache", which is
/// what just failed), and the file is left as it was.
#[test]
fn an_image_whose_cache_file_was_replaced_by_another_cache_says_so() {
    let s = Scratch::new();
    let (img, other) = (s.path("rp.qcow2"), s.path("other.qcow2"));
    qcow2(&s, &img, 16 * M, None);
    qcow2(&s, &other, 16 * M, None);
    let (cache, cache2) = (s.path("rp.cache"), s.path("rp2.cache"));
    let c = cache.to_str().expect("utf-8");
    let (i, o) = (img.to_str().expect("utf-8"), other.to_str().expect("utf-8"));
    let sock = s.path("rp.sock");
    let server = serve(&s, &sock, &cache_args(c, i, &[]));
    qemu_io(
        &s,
        "raw",
        &uri(&sock, ""),
        &["write -P 0x42 0 64k".into(), "flush".into()],
    );
    server.kill9();
    let c2 = cache2.to_str().expect("utf-8");
    serve(&s, &sock, &cache_args(c2, o, &[])).stop_clean();
    std::fs::rename(&cache2, &cache).expect("move the other cache over");
    let log = try_serve(&s, &sock, &cache_args(c, i, &[]))
        .err()
        .expect("refused");
    assert!(
        log.contains("the cache there now is another one")
            && !log.contains("Serve it with that cache"),
        "{log}"
    );
    s.finish();
}

#[test]
fn cache_from_another_host_is_refused_until_recovered() {
    let s = Scratch::new();
    let img = s.path("fh.qcow2");
    qcow2(&s, &img, 16 * M, None);
    let cache = s.path("fh.cache");
    let (c, i) = (cache.to_str().expect("utf-8"), img.to_str().expect("utf-8"));
    let sock = s.path("fh.sock");
    let args = cache_args(c, i, &[]);
    let server = serve(&s, &sock, &args);
    qemu_io(
        &s,
        "raw",
        &uri(&sock, ""),
        &["write -P 0x6b 0 3M".into(), "flush".into()],
    );
    server.kill9();
    let image_before = std::fs::read(&img).expect("read image");

    // Pretend the cache was formatted on another host: rewrite the host
    // recorded in its superblock (with a valid checksum).
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&cache)
        .expect("open cache");
    let mut sb = vec![0u8; 4096];
    f.read_exact(&mut sb).expect("read superblock");
    let mut parsed = vdcache_cache::layout::Superblock::decode(&sb).expect("decode superblock");
    parsed.host = "some-other-hypervisor".into();
    let enc = parsed.encode();
    assert_eq!(enc.len(), 4096);
    f.seek(SeekFrom::Start(0)).expect("seek");
    f.write_all(&enc).expect("write superblock");
    f.sync_all().expect("sync");
    drop(f);

    let log = serve_refused(&s, &sock, &args);
    assert!(
        log.contains("some-other-hypervisor") && log.contains("recover --full"),
        "serving a foreign cache must be refused, naming the owner and the way out:\n{log}"
    );
    assert_same_bytes(
        "the image after a refused serve",
        &image_before,
        &std::fs::read(&img).expect("read image"),
    );

    let rec = ok(s
        .vdcache()
        .args(["recover", "--full", "--cache"])
        .arg(&cache));
    assert!(rec.stdout.contains("written back"), "{}", rec.report());
    check_clean(&s, &img);
    qemu_io(&s, "qcow2", i, &["read -P 0x6b 0 3M".into()]);

    // Recovered: the cache holds no dirty data of the other host any more
    // and this host may use it. (Collected, so both findings are reported.)
    let mut problems = Vec::new();
    match try_serve(&s, &sock, &args) {
        Ok(server) => {
            qemu_io(&s, "raw", &uri(&sock, ""), &["read -P 0x6b 0 3M".into()]);
            server.stop_clean();
            check_clean(&s, &img);
        }
        Err(log) => problems.push(format!(
            "after `vdcache recover --full --cache {c}` succeeded, serve still refuses \
             the cache:\n{log}"
        )),
    }
    // The refusal's advice must name options that exist.
    if log.contains("--force-foreign") {
        let help = ok(s.vdcache().args(["serve", "--help"])).stdout;
        if !help.contains("--force-foreign") {
            problems.push(
                "the refusal suggests `--force-foreign`, but `vdcache serve` has no such \
                 option (not in `vdcache serve --help`)"
                    .into(),
            );
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    s.finish();
}

fn partially_valid(st: &serde_json::Value) -> u64 {
    st["disks"][0]["partially_valid_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("stats --json has no disks[0].partially_valid_bytes: {st:#}"))
}

/// Unaligned 4 KiB writes into fresh clusters `first..first+n` of a delta.
fn unaligned_writes(first: u64, n: u64) -> Vec<String> {
    (first..first + n)
        .map(|c| format!("write -P 0x5a {} 4096", c * 65536 + 512 * (1 + c % 7)))
        .collect()
}

#[test]
fn partially_valid_clusters_are_filled_by_flush_fill_and_when_idle() {
    // Issue 5: decoupled copy-on-write leaves clusters partially valid;
    // `vdcache flush --fill` fills them at once, the background filler
    // when the disk is idle; either way the delta then reads, for qemu
    // alone, what the same writes give without a cache.
    let s = Scratch::new();
    let base = s.path("pv-base.qcow2");
    qcow2(&s, &base, 16 * M, None);
    let b = base.to_str().expect("utf-8");
    qemu_io(&s, "qcow2", b, &["write -P 0x11 0 16M".into()]);
    let (delta, reference) = (s.path("pv-delta.qcow2"), s.path("pv-ref.qcow2"));
    qcow2(&s, &delta, 16 * M, Some(b));
    qcow2(&s, &reference, 16 * M, Some(b));
    let cache = s.path("pv.cache");
    let (c, d) = (
        cache.to_str().expect("utf-8"),
        delta.to_str().expect("utf-8"),
    );
    let sock = s.path("pv.sock");
    let u = uri(&sock, "");
    let compare = |what: &str| {
        let out = exec(
            s.qemu_img()
                .args(["compare", "-f", "qcow2", "-F", "qcow2"])
                .arg(&delta)
                .arg(&reference),
        );
        assert!(out.success(), "{what}: the delta differs\n{}", out.report());
    };

    let server = serve(&s, &sock, &cache_args(c, d, &[]));
    let mut cmds = unaligned_writes(0, 40);
    cmds.push("flush".into());
    qemu_io(&s, "raw", &u, &cmds);
    qemu_io(&s, "qcow2", reference.to_str().expect("utf-8"), &cmds);
    let left = partially_valid(&stats(&s, &sock));
    assert!(left > 0, "decoupled writes left nothing to fill");
    ok(s.vdcache().args(["flush", "--fill", "--socket"]).arg(&sock));
    assert_eq!(partially_valid(&stats(&s, &sock)), 0);
    server.kill9();
    compare("after flush --fill");

    let server = serve(&s, &sock, &cache_args(c, d, &[]));
    let mut cmds = unaligned_writes(100, 20);
    cmds.push("flush".into());
    qemu_io(&s, "raw", &u, &cmds);
    qemu_io(&s, "qcow2", reference.to_str().expect("utf-8"), &cmds);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    while partially_valid(&stats(&s, &sock)) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the background filler left {} bytes unfilled",
            partially_valid(&stats(&s, &sock))
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    ok(s.vdcache().args(["flush", "--socket"]).arg(&sock));
    server.kill9();
    compare("after the background filler");
    s.finish();
}
