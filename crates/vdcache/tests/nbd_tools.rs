//! Issue 3, done-when 1 and 2: the real NBD clients against `vdcache
//! serve`. qemu-io, qemu-img (info, compare, convert to and from the URI,
//! bench), nbdinfo (with --map), nbdcopy and fio's nbd engine with
//! --verify, on a qcow2 image and on a chain; named exports from a TOML
//! config; a second server on the same image refused; and a seeded random
//! read/write/trim/zero/flush workload over NBD that leaves, after SIGTERM,
//! an image `qemu-img check` passes and `qemu-img compare` finds identical
//! to a raw file that received the same operations from qemu-io.

use crate::common;
use crate::serving;

use common::{Scratch, assert_same_bytes, exec, ok};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serving::{
    pattern, qcow2, qcow2_dirty_bit, qemu_io, qemu_io_opts, serve, serve_config, serve_refused, uri,
};
use std::path::Path;

const M: u64 = 1 << 20;
const K: u64 = 1 << 10;
const CLUSTER: u64 = 64 * K;

/// `qemu-img compare -f raw -F FMT A B` must say identical.
fn identical(s: &Scratch, a: &str, a_fmt: &str, b: &Path) {
    let out = ok(s
        .qemu_img()
        .args(["compare", "-f", a_fmt, "-F", "raw", a])
        .arg(b));
    assert!(
        out.stdout.contains("Images are identical"),
        "{}",
        out.report()
    );
}

/// One row of `nbdinfo --map`: (offset, length, type).
fn map(s: &Scratch, u: &str) -> Vec<(u64, u64, u32, String)> {
    let out = ok(s.cmd("nbdinfo").arg("--map").arg(u));
    out.stdout
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 4, "bad nbdinfo --map line {l:?}");
            (
                f[0].parse().expect("offset"),
                f[1].parse().expect("length"),
                f[2].parse().expect("type"),
                f[3].to_string(),
            )
        })
        .collect()
}

/// Asserts that the map covers [0, size) without gaps and that each byte
/// is "data" (type 0) exactly when `data(offset)` says so; other bytes
/// must be "hole,zero" (type 3).
fn check_map(rows: &[(u64, u64, u32, String)], size: u64, data: impl Fn(u64) -> bool) {
    let mut pos = 0;
    for (off, len, kind, desc) in rows {
        assert_eq!(*off, pos, "map has a gap or overlap at {pos}: {rows:?}");
        let mut c = *off;
        while c < off + len {
            let want = if data(c) {
                (0, "data")
            } else {
                (3, "hole,zero")
            };
            assert_eq!(
                (*kind, desc.as_str()),
                want,
                "nbdinfo --map at offset {c} (row {off}+{len}); rows: {rows:?}"
            );
            c += CLUSTER;
        }
        pos = off + len;
    }
    assert_eq!(pos, size, "map does not cover the disk: {rows:?}");
}

fn fio_verify(s: &Scratch, u: &str, offset: u64, size: u64) {
    let dir = s.root().join("fio");
    std::fs::create_dir_all(&dir).expect("mkdir fio");
    let out = exec(
        std::process::Command::new("fio")
            .current_dir(&dir)
            .env("TMPDIR", s.root().join("tmp"))
            .args([
                "--name=nbdverify",
                "--ioengine=nbd",
                &format!("--uri={u}"),
                "--rw=randwrite",
                "--bs=4k",
                &format!("--offset={offset}"),
                &format!("--size={size}"),
                "--iodepth=8",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
                "--output-format=json",
            ]),
    );
    assert!(out.success(), "fio failed\n{}", out.report());
    let json_start = out.stdout.find('{').expect("fio JSON output");
    let v: serde_json::Value =
        serde_json::from_str(&out.stdout[json_start..]).expect("fio JSON output");
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{}", out.report());
    assert_eq!(job["write"]["io_bytes"], size, "fio wrote everything");
    assert_eq!(
        job["read"]["io_bytes"], size,
        "fio verified everything it wrote (read it back)"
    );
}

#[test]
fn real_tools_against_a_qcow2_image() {
    let s = Scratch::new();
    let size = 32 * M;
    let img = s.path("disk.qcow2");
    qcow2(&s, &img, size, None);
    let sock = s.path("nbd.sock");
    let server = serve(&s, &sock, &[img.to_str().expect("utf-8")]);
    let u = uri(&sock, "");

    // qemu-io: aligned and unaligned writes, verified reads; the same
    // commands on a raw reference.
    let cmds: Vec<String> = [
        "write -P 0xa1 1M 512K",
        "write -P 0xb2 4M 64K",
        "write -P 0xc3 6000000 12345",
        "write -P 0xd4 10M 256K",
        "discard 10M 128K",
        "write -z 4M 4K",
        "read -P 0xa1 1M 512K",
        "read -P 0 4M 4K",
        "read -P 0xb2 4100K 60K",
        "read -P 0xc3 6000000 12345",
        "read -P 0 5999999 1",
        "read -P 0 10M 128K",
        "read -P 0xd4 10368K 128K",
        "flush",
    ]
    .map(String::from)
    .to_vec();
    qemu_io(&s, "raw", &u, &cmds);
    let refp = s.path("ref.raw");
    ok(s.qemu_img()
        .args(["create", "-q", "-f", "raw"])
        .arg(&refp)
        .arg(size.to_string()));
    qemu_io(&s, "raw", refp.to_str().expect("utf-8"), &cmds);

    // qemu-img info of the URI.
    let info = ok(s.qemu_img().args(["info", &u]));
    assert!(
        info.stdout
            .contains(&format!("virtual size: 32 MiB ({size} bytes)")),
        "{}",
        info.report()
    );

    // nbdinfo and nbdinfo --map: written clusters are data, the rest (and
    // the discarded clusters) hole,zero.
    let info = ok(s.cmd("nbdinfo").arg(&u)).stdout;
    for want in [
        &format!("export-size: {size}")[..],
        "base:allocation",
        "can_flush: true",
        "can_fua: true",
        "can_trim: true",
        "can_zero: true",
        "is_read_only: false",
    ] {
        assert!(info.contains(want), "nbdinfo lacks {want:?}:\n{info}");
    }
    let data = |c: u64| {
        (M..M + 512 * K).contains(&c)
            || c == 4 * M
            || c == 6000000 / CLUSTER * CLUSTER
            || (10 * M + 128 * K..10 * M + 256 * K).contains(&c)
    };
    check_map(&map(&s, &u), size, data);

    // qemu-img compare, with a negative control.
    identical(&s, &u, "raw", &refp);
    let bad = s.path("bad.raw");
    std::fs::copy(&refp, &bad).expect("copy");
    qemu_io(
        &s,
        "raw",
        bad.to_str().expect("utf-8"),
        &["write -P 1 20M 1".into()],
    );
    let diff = exec(
        s.qemu_img()
            .args(["compare", "-f", "raw", "-F", "raw", &u])
            .arg(&bad),
    );
    assert_eq!(
        diff.code(),
        Some(1),
        "compare must see the difference\n{}",
        diff.report()
    );
    assert!(
        diff.stdout.contains("Content mismatch at offset 20971520"),
        "{}",
        diff.report()
    );

    // qemu-img convert from the URI to a file.
    let out = s.path("out.raw");
    ok(s.qemu_img()
        .args(["convert", "-f", "raw", "-O", "raw", &u])
        .arg(&out));
    assert_same_bytes(
        "convert from the URI",
        &std::fs::read(&refp).expect("read ref"),
        &std::fs::read(&out).expect("read out"),
    );

    // qemu-img convert from a file to the URI (-n: the target exists);
    // half the source is zero, so zero writes over old data are exercised.
    let mut src = pattern((size / 2) as usize, 7);
    src.resize(size as usize, 0);
    let srcp = s.path("src.raw");
    std::fs::write(&srcp, &src).expect("write src");
    ok(s.qemu_img()
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&srcp)
        .arg(&u));
    identical(&s, &u, "raw", &srcp);

    // nbdcopy into the export and back out.
    let inp = s.path("in.raw");
    let mut data_in = pattern((size - 3 * M) as usize, 9);
    data_in.extend(std::iter::repeat_n(0u8, M as usize));
    data_in.extend(pattern(2 * M as usize, 10));
    std::fs::write(&inp, &data_in).expect("write in");
    ok(s.cmd("nbdcopy").arg(&inp).arg(&u));
    let back = s.path("back.raw");
    ok(s.cmd("nbdcopy").arg(&u).arg(&back));
    assert_same_bytes(
        "nbdcopy out of the export",
        &data_in,
        &std::fs::read(&back).expect("read back"),
    );

    // qemu-img bench: reads, then pattern writes with flushes, verified.
    let b = ok(s
        .qemu_img()
        .args(["bench", "-f", "raw", "-c", "2000", "-d", "8", &u]));
    assert!(b.stdout.contains("Run completed"), "{}", b.report());
    let b = ok(s.qemu_img().args([
        "bench",
        "-f",
        "raw",
        "-w",
        "-c",
        "256",
        "-d",
        "16",
        "-s",
        "4096",
        "-S",
        "4096",
        "-o",
        "16M",
        "--pattern=0x5c",
        "--flush-interval=64",
        &u,
    ]));
    assert!(b.stdout.contains("Run completed"), "{}", b.report());
    qemu_io(
        &s,
        "raw",
        &u,
        &["read -P 0x5c 16M 1M".into(), "read -P 0 29M 1M".into()],
    );

    // fio's nbd engine: random writes, then every block verified.
    fio_verify(&s, &u, 20 * M, 8 * M);

    // A second server on the same image is refused, clearly.
    let log = serve_refused(&s, &s.path("second.sock"), &[img.to_str().expect("utf-8")]);
    assert!(
        log.contains("in use") && log.contains("lock"),
        "second server's refusal should say the image is locked/in use:\n{log}"
    );

    // The first server is unaffected; a clean stop leaves a clean image.
    qemu_io(&s, "raw", &u, &["read -P 0x5c 16M 1M".into()]);
    let log = server.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    assert!(!sock.exists(), "the socket is removed on a clean stop");
    ok(s.qemu_img().arg("check").arg(&img));
    assert!(
        !qcow2_dirty_bit(&img),
        "dirty bit left set after a clean stop"
    );
    qemu_io(
        &s,
        "qcow2",
        img.to_str().expect("utf-8"),
        &["read -P 0x5c 16M 1M".into()],
    );
    s.finish();
}

#[test]
fn real_tools_against_a_chain() {
    let s = Scratch::new();
    let size = 32 * M;
    let base = s.path("base.qcow2");
    qcow2(&s, &base, size, None);
    let bs = base.to_str().expect("utf-8");
    qemu_io(
        &s,
        "qcow2",
        bs,
        &["write -P 0x11 0 8M".into(), "write -P 0x22 12M 4M".into()],
    );
    let base_before = std::fs::read(&base).expect("read base");
    let delta = s.path("delta.qcow2");
    qcow2(&s, &delta, size, Some(bs));
    let refp = s.path("ref.raw");
    ok(s.qemu_img()
        .args(["convert", "-f", "qcow2", "-O", "raw", bs])
        .arg(&refp));

    let sock = s.path("chain.sock");
    let server = serve(&s, &sock, &["-f", "qcow2", delta.to_str().expect("utf-8")]);
    let u = uri(&sock, "");
    let cmds: Vec<String> = [
        "read -P 0x11 0 8M",
        "read -P 0 8M 4M",
        "read -P 0x22 12M 4M",
        "read -P 0 16M 16M",
        "write -P 0x33 7340132 1M",
        "write -z 13M 66536",
        "write -P 0x44 30M 100",
        "read -P 0x11 0 7340132",
        "read -P 0x33 7340132 1M",
        "read -P 0 8388708 3000000",
        "read -P 0 13M 66536",
        "read -P 0x22 13698024 100",
        "flush",
    ]
    .map(String::from)
    .to_vec();
    qemu_io(&s, "raw", &u, &cmds);
    qemu_io(&s, "raw", refp.to_str().expect("utf-8"), &cmds);
    identical(&s, &u, "raw", &refp);

    // Clusters allocated anywhere in the chain are data; the rest holes.
    let rows = map(&s, &u);
    let mut pos = 0;
    for (off, len, kind, _) in &rows {
        assert_eq!(*off, pos, "{rows:?}");
        pos = off + len;
        let end = off + len;
        if *off < 8 * M {
            assert_eq!(
                *kind & 1,
                0,
                "base data at {off} must not be a hole: {rows:?}"
            );
        }
        if *off >= 16 * M && end <= 30 * M {
            assert_eq!(*kind, 3, "untouched clusters are hole,zero: {rows:?}");
        }
    }
    assert_eq!(pos, size);
    assert!(
        rows.iter()
            .any(|(o, l, k, _)| *k == 0 && *o <= 30 * M && o + l > 30 * M),
        "the write at 30M is data: {rows:?}"
    );

    let out = s.path("out.raw");
    ok(s.cmd("nbdcopy").arg(&u).arg(&out));
    assert_same_bytes(
        "nbdcopy of the chain",
        &std::fs::read(&refp).expect("read ref"),
        &std::fs::read(&out).expect("read out"),
    );
    let out2 = s.path("out2.raw");
    ok(s.qemu_img()
        .args(["convert", "-f", "raw", "-O", "raw", &u])
        .arg(&out2));
    assert_same_bytes(
        "convert of the chain",
        &std::fs::read(&refp).expect("read ref"),
        &std::fs::read(&out2).expect("read out2"),
    );
    fio_verify(&s, &u, 4 * M, 4 * M);

    // Neither layer may be opened by a second server.
    let log = serve_refused(
        &s,
        &s.path("second.sock"),
        &[delta.to_str().expect("utf-8")],
    );
    assert!(log.contains("lock"), "{log}");

    server.stop_clean();
    ok(s.qemu_img().arg("check").arg(&delta));
    assert!(!qcow2_dirty_bit(&delta));
    assert_same_bytes(
        "the base image (read-only in the chain)",
        &base_before,
        &std::fs::read(&base).expect("read base"),
    );
    // The delta holds everything but fio's random data, which only the
    // served chain can tell; compare the parts the reference knows.
    let after = s.path("after.raw");
    ok(s.qemu_img()
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&delta)
        .arg(&after));
    let after = std::fs::read(&after).expect("read after");
    let want = std::fs::read(&refp).expect("read ref");
    assert_same_bytes(
        "delta after stop [0,4M)",
        &want[..(4 * M) as usize],
        &after[..(4 * M) as usize],
    );
    assert_same_bytes(
        "delta after stop [8M,32M)",
        &want[(8 * M) as usize..],
        &after[(8 * M) as usize..],
    );
    s.finish();
}

#[test]
fn named_exports_from_a_config_file() {
    let s = Scratch::new();
    let a = s.path("vm1.qcow2");
    let b = s.path("golden.qcow2");
    qcow2(&s, &a, 16 * M, None);
    qcow2(&s, &b, 8 * M, None);
    qemu_io(
        &s,
        "qcow2",
        b.to_str().expect("utf-8"),
        &["write -P 0x66 0 8M".into()],
    );
    let sock = s.path("cfg.sock");
    let cfg = s.path("vdcache.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nsocket = \"{}\"\n\n[[export]]\nname = \"vm1\"\nimage = \"{}\"\n\n\
             [[export]]\nname = \"golden\"\nimage = \"{}\"\nread_only = true\n\
             description = \"the golden image\"\n",
            sock.display(),
            a.display(),
            b.display()
        ),
    )
    .expect("write config");
    let server = serve_config(&s, &cfg, &sock);

    let list = ok(s.cmd("nbdinfo").arg("--list").arg(uri(&sock, ""))).stdout;
    assert!(list.contains("export=\"vm1\""), "{list}");
    assert!(list.contains("export=\"golden\""), "{list}");
    assert!(list.contains("the golden image"), "{list}");
    assert!(list.contains("export-size: 16777216"), "{list}");
    assert!(list.contains("export-size: 8388608"), "{list}");
    let golden = ok(s.cmd("nbdinfo").arg(uri(&sock, "golden"))).stdout;
    assert!(golden.contains("is_read_only: true"), "{golden}");

    qemu_io(
        &s,
        "raw",
        &uri(&sock, "vm1"),
        &["write -P 0x77 1M 1M".into(), "read -P 0x77 1M 1M".into()],
    );
    qemu_io_opts(
        &s,
        &["-r", "-f", "raw"],
        &uri(&sock, "golden"),
        &["read -P 0x66 0 8M".into()],
    );
    // Opening the read-only export for writing is refused (QEMU checks the
    // export's read-only flag), and so is opening a missing export.
    let w = exec(
        s.qemu_io()
            .args(["-f", "raw", "-c", "write -P 1 0 4k"])
            .arg(uri(&sock, "golden")),
    );
    assert!(
        !w.success() && w.all().contains("Permission denied"),
        "{}",
        w.report()
    );
    let w = exec(
        s.qemu_io()
            .args(["-f", "raw", "-c", "read 0 4k"])
            .arg(uri(&sock, "nope")),
    );
    assert!(
        !w.success(),
        "a missing export must not open\n{}",
        w.report()
    );
    // The default export "" is not configured here.
    let w = exec(s.cmd("nbdinfo").arg(uri(&sock, "")));
    assert!(!w.success(), "{}", w.report());

    server.stop_clean();
    ok(s.qemu_img().arg("check").arg(&a));
    ok(s.qemu_img().arg("check").arg(&b));
    qemu_io(
        &s,
        "qcow2",
        a.to_str().expect("utf-8"),
        &["read -P 0x77 1M 1M".into()],
    );
    qemu_io(
        &s,
        "qcow2",
        b.to_str().expect("utf-8"),
        &["read -P 0x66 0 8M".into()],
    );
    s.finish();
}

/// TLS with a pre-shared key (qemu's `keys.psk` format): qemu-img and
/// qemu-io through a `tls-creds-psk` object, nbdcopy through a libnbd URI;
/// plain clients and wrong keys are refused; a malformed key file or a
/// config naming both a certificate and a key file stops the server before
/// it listens, with the reason.
#[test]
fn tls_with_a_pre_shared_key() {
    let s = Scratch::new();
    let img = s.path("vm.qcow2");
    qcow2(&s, &img, 8 * M, None);
    let keys = s.path("keys.psk");
    std::fs::write(
        &keys,
        "alice:5b7d1c2e3f405162738495a6b7c8d9eaf00112233445566778899aabbccddeef\n",
    )
    .expect("write keys");
    let sock = s.path("psk.sock");
    let server = serve(
        &s,
        &sock,
        &[
            "--tls-psk",
            keys.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
        ],
    );
    let creds = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        s.root().display()
    );
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},tls-creds=tls0",
        sock.display()
    );
    ok(s.qemu_io()
        .args(["--object", &creds, "--image-opts"])
        .args(["-c", "write -P 0x3c 1M 2M", "-c", "flush"])
        .arg(&opts));
    let info = ok(s
        .qemu_img()
        .args(["info", "--object", &creds, "--image-opts"])
        .arg(&opts))
    .stdout;
    assert!(info.contains("8 MiB"), "{info}");
    let tls_uri = format!(
        "nbds+unix://alice@/?socket={}&tls-psk-file={}",
        sock.display(),
        keys.display()
    );
    let copy = s.path("copy.raw");
    ok(s.cmd("nbdcopy").arg(&tls_uri).arg(&copy));
    let data = std::fs::read(&copy).expect("read copy");
    assert_same_bytes(
        "1M..3M after nbdcopy",
        &[0x3c; 2 << 20],
        &data[M as usize..3 * M as usize],
    );

    // Without TLS, or with a wrong key, nothing is served.
    let plain = exec(s.cmd("nbdinfo").arg(uri(&sock, "")));
    assert!(!plain.success(), "{}", plain.report());
    let wrong = s.path("wrong.psk");
    std::fs::write(
        &wrong,
        "alice:00000000000000000000000000000000000000000000000000000000000000ff\n",
    )
    .expect("write keys");
    let w = exec(s.cmd("nbdinfo").arg(format!(
        "nbds+unix://alice@/?socket={}&tls-psk-file={}",
        sock.display(),
        wrong.display()
    )));
    assert!(!w.success(), "{}", w.report());
    server.stop_clean();
    ok(s.qemu_img().arg("check").arg(&img));

    // Bad key files and contradictory settings are refused up front.
    let bad = s.path("bad.psk");
    std::fs::write(&bad, "alice:0011\nbob 0022\n").expect("write keys");
    let why = serve_refused(
        &s,
        &s.path("bad.sock"),
        &[
            "--tls-psk",
            bad.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
        ],
    );
    assert!(why.contains("line 2"), "{why}");
    let cfg = s.path("both.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nsocket = \"{}\"\n[server.tls]\ncert = \"c.pem\"\nkey = \"k.pem\"\npsk = \"{}\"\n\n\
             [[export]]\nname = \"\"\nimage = \"{}\"\n",
            s.path("both.sock").display(),
            keys.display(),
            img.display()
        ),
    )
    .expect("write config");
    let out = exec(s.vdcache().arg("serve").arg("--config").arg(&cfg));
    assert!(
        !out.success() && out.all().contains("not both"),
        "{}",
        out.report()
    );
    s.finish();
}

/// A seeded workload: (commands for the server, commands for the raw
/// reference). Discards are whole clusters, which vdcache deallocates so
/// they read as zeros; the reference gets `write -z` for them (a raw
/// file's punch-hole is not guaranteed by every file system). Reads are
/// verified with -P against a model wherever the range is uniform.
fn workload(seed: u64, size: u64, n: usize) -> (Vec<String>, Vec<String>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut model = vec![0u8; size as usize];
    let (mut srv, mut refc) = (Vec::new(), Vec::new());
    let range = |rng: &mut Xoshiro256PlusPlus| -> (u64, u64) {
        let (off, len) = if rng.random_bool(0.5) {
            let len =
                [512, 4096, CLUSTER, 2 * CLUSTER, 3 * CLUSTER / 2 + 512][rng.random_range(0..5)];
            (rng.random_range(0..size / 512) * 512, len)
        } else {
            (rng.random_range(0..size), rng.random_range(1..3 * CLUSTER))
        };
        let len = len.min(size - off).max(1);
        (off.min(size - len), len)
    };
    while srv.len() < n {
        let k: f64 = rng.random();
        if k < 0.40 {
            let (off, len) = range(&mut rng);
            let p = rng.random_range(1..=255u8);
            model[off as usize..(off + len) as usize].fill(p);
            let c = format!("write -P {p} {off} {len}");
            srv.push(c.clone());
            refc.push(c);
        } else if k < 0.52 {
            let (off, len) = range(&mut rng);
            model[off as usize..(off + len) as usize].fill(0);
            let c = format!("write -z {off} {len}");
            srv.push(c.clone());
            refc.push(c);
        } else if k < 0.62 {
            let clusters = size / CLUSTER;
            let first = rng.random_range(0..clusters);
            let count = rng.random_range(1..=4).min(clusters - first);
            let (off, len) = (first * CLUSTER, count * CLUSTER);
            model[off as usize..(off + len) as usize].fill(0);
            srv.push(format!("discard {off} {len}"));
            refc.push(format!("write -z {off} {len}"));
        } else if k < 0.92 {
            let (off, len) = range(&mut rng);
            let r = &model[off as usize..(off + len) as usize];
            let c = if r.iter().all(|&b| b == r[0]) {
                format!("read -P {} {off} {len}", r[0])
            } else {
                format!("read {off} {len}")
            };
            srv.push(c.clone());
            refc.push(c);
        } else {
            srv.push("flush".into());
            refc.push("flush".into());
        }
    }
    (srv, refc)
}

#[test]
fn seeded_workload_over_nbd_matches_a_raw_reference() {
    let s = Scratch::new();
    let size = 16 * M;
    for seed in [3u64, 0x5eed] {
        let img = s.path(&format!("w{seed}.qcow2"));
        qcow2(&s, &img, size, None);
        let refp = s.path(&format!("w{seed}.raw"));
        ok(s.qemu_img()
            .args(["create", "-q", "-f", "raw"])
            .arg(&refp)
            .arg(size.to_string()));
        let (srv, refc) = workload(seed, size, 300);
        assert!(
            srv.iter().filter(|c| c.starts_with("read -P")).count() > 30,
            "the workload verifies reads"
        );
        let sock = s.path(&format!("w{seed}.sock"));
        let server = serve(&s, &sock, &[img.to_str().expect("utf-8")]);
        let u = uri(&sock, "");
        // Half through one connection, half through another.
        qemu_io(&s, "raw", &u, &srv[..150]);
        qemu_io(&s, "raw", &u, &srv[150..]);
        qemu_io(&s, "raw", refp.to_str().expect("utf-8"), &refc);
        identical(&s, &u, "raw", &refp);
        let log = server.stop_clean();
        assert!(log.contains("stopped cleanly"), "{log}");

        let check = ok(s.qemu_img().arg("check").arg(&img));
        assert!(check.stdout.contains("No errors"), "{}", check.report());
        assert!(!qcow2_dirty_bit(&img), "seed {seed}: dirty bit left set");
        let out = ok(s
            .qemu_img()
            .args(["compare", "-f", "qcow2", "-F", "raw"])
            .arg(&img)
            .arg(&refp));
        assert!(
            out.stdout.contains("Images are identical"),
            "seed {seed}\n{}",
            out.report()
        );
    }
    s.finish();
}
