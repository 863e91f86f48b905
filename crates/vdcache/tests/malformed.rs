//! Done-when 4 of the foundation: malformed images get a clear error that
//! names the problem, a non-zero exit, no panic, and are left unchanged.
//!
//! Each image is made by qemu-img (and written by qemu-io), then patched
//! at the offsets of the qcow2 specification (see `qcow2_patch`). The
//! committed corpus of `malformed_corpus.rs` covers more classes; the cases
//! here check finer points (which clusters still read, exact messages).

use crate::common;
use crate::qcow2_patch;

use common::{Out, Scratch, assert_no_panic, be32, be64, exec, ok, put_be32, put_be64};
use qcow2_patch::{
    INCOMPAT_CORRUPT, INCOMPATIBLE_FEATURES, OUTSIDE, drop_backing_format, l2_of_first_l1,
    names_problem, qemu_rejects,
};
use std::path::{Path, PathBuf};

/// A 4 MiB qcow2 image (64 KiB clusters) with 0x5a in its first 256 KiB.
fn base_image(s: &Scratch, name: &str, opts: &str) -> (PathBuf, Vec<u8>) {
    qcow2_patch::base_image(s, name, opts, "4M", &["write -P 0x5a 0 256k"])
}

/// What `vdcache check` must answer.
#[derive(Clone, Copy, Debug)]
enum CheckWant {
    /// Exactly this exit code.
    Code(i32),
    /// Any exit code but 0 (cannot open: 1, or opened and found corrupt: 2).
    NonZero,
}

fn vd(s: &Scratch, args: &[&str], file: &Path) -> Out {
    let mut c = s.vdcache();
    c.args(args).arg(file);
    let o = exec(&mut c);
    assert_no_panic(&o);
    o
}

fn assert_refused(o: &Out, groups: &[&[&str]]) {
    assert!(
        o.code().is_some_and(|c| c != 0),
        "expected a non-zero exit\n{}",
        o.report()
    );
    assert!(
        !o.stderr.trim().is_empty() && names_problem(&o.stderr, groups),
        "stderr must name the problem (one word of each of {groups:?})\n{}",
        o.report()
    );
}

/// A command that fails after the image opened: qemu-io prints such
/// errors ("read failed: ...") on stdout, so vdcache io may use either.
fn assert_io_failed(o: &Out, groups: &[&[&str]]) {
    assert_eq!(o.code(), Some(1), "expected exit 1\n{}", o.report());
    assert!(
        names_problem(&o.all(), groups),
        "the error must name the problem (one word of each of {groups:?})\n{}",
        o.report()
    );
}

/// vdcache info, info --json, io (read-write and read-only) and convert
/// all refuse `file` naming the problem; check answers `check`; the file
/// is unchanged afterwards.
fn expect_refusal(s: &Scratch, file: &Path, groups: &[&[&str]], check: CheckWant) {
    let before = std::fs::read(file).expect("read image");
    for args in [
        &["info"][..],
        &["info", "--json"][..],
        &["io", "-c", "read 0 4k"][..],
        &["io", "-r", "-c", "read 0 4k"][..],
    ] {
        let o = vd(s, args, file);
        assert_refused(&o, groups);
    }
    let dst = s.path("convert-out.raw");
    let mut c = s.vdcache();
    c.args(["convert", "-O", "raw"]).arg(file).arg(&dst);
    let o = exec(&mut c);
    assert_no_panic(&o);
    assert_refused(&o, groups);
    let _ = std::fs::remove_file(&dst);

    let o = vd(s, &["check"], file);
    match check {
        CheckWant::Code(code) => assert_eq!(
            o.code(),
            Some(code),
            "vdcache check exit code\n{}",
            o.report()
        ),
        CheckWant::NonZero => assert!(
            o.code().is_some_and(|c| c != 0),
            "vdcache check must not call this image clean\n{}",
            o.report()
        ),
    }
    assert!(
        names_problem(&o.all(), groups),
        "vdcache check must name the problem (one word of each of {groups:?})\n{}",
        o.report()
    );
    let after = std::fs::read(file).expect("read image");
    assert!(
        before == after,
        "vdcache changed the malformed image {}",
        file.display()
    );
}

/// Makes `name` from the base image with `patch` applied.
fn patched(s: &Scratch, name: &str, patch: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let (p, mut b) = base_image(s, name, "cluster_size=65536");
    patch(&mut b);
    std::fs::write(&p, &b).expect("write patched image");
    p
}

/// The first 50 bytes of a real image (magic, version, backing fields,
/// cluster_bits and size are there; the rest of the header is not).
#[test]
fn truncated_header() {
    let s = Scratch::new();
    let (p, b) = base_image(&s, "trunc.qcow2", "cluster_size=65536");
    assert_eq!(&b[..4], b"QFI\xfb");
    std::fs::write(&p, &b[..50]).expect("write");
    qemu_rejects(&s, &p);
    expect_refusal(
        &s,
        &p,
        &[&["truncat", "too short", "short header", "header too"]],
        CheckWant::Code(1),
    );
    s.finish();
}

/// A version 3 header whose header_length (104) runs past a 90-byte file.
#[test]
fn truncated_v3_header() {
    let s = Scratch::new();
    let (p, b) = base_image(&s, "trunc3.qcow2", "cluster_size=65536");
    std::fs::write(&p, &b[..90]).expect("write");
    qemu_rejects(&s, &p);
    expect_refusal(
        &s,
        &p,
        &[&["truncat", "too short", "short", "header"]],
        CheckWant::Code(1),
    );
    s.finish();
}

fn cluster_bits(bits: u32) {
    let s = Scratch::new();
    let p = patched(&s, &format!("cb{bits}.qcow2"), |b| put_be32(b, 20, bits));
    qemu_rejects(&s, &p);
    expect_refusal(
        &s,
        &p,
        &[&["cluster_bits", "cluster bits", "cluster size"]],
        CheckWant::Code(1),
    );
    s.finish();
}

#[test]
fn cluster_bits_8() {
    cluster_bits(8);
}

#[test]
fn cluster_bits_22() {
    cluster_bits(22);
}

/// l1_size of 1 Mi entries (8 MiB, within QEMU's 32 MiB limit) in a
/// 576 KiB file: the table runs past the end of the file.
#[test]
fn l1_size_past_eof() {
    let s = Scratch::new();
    let p = patched(&s, "l1eof.qcow2", |b| put_be32(b, 36, 0x10_0000));
    expect_refusal(&s, &p, &[&["l1"], OUTSIDE], CheckWant::NonZero);
    s.finish();
}

#[test]
fn l1_size_huge() {
    let s = Scratch::new();
    let p = patched(&s, "l1huge.qcow2", |b| put_be32(b, 36, 0x7fff_ffff));
    qemu_rejects(&s, &p);
    expect_refusal(&s, &p, &[&["l1"], OUTSIDE], CheckWant::Code(1));
    s.finish();
}

#[test]
fn l1_table_offset_past_eof() {
    let s = Scratch::new();
    let p = patched(&s, "l1off.qcow2", |b| put_be64(b, 40, 1 << 40));
    expect_refusal(&s, &p, &[&["l1"], OUTSIDE], CheckWant::NonZero);
    s.finish();
}

#[test]
fn refcount_table_offset_past_eof() {
    let s = Scratch::new();
    let p = patched(&s, "rtoff.qcow2", |b| put_be64(b, 48, 1 << 40));
    expect_refusal(&s, &p, &[&["refcount"], OUTSIDE], CheckWant::NonZero);
    s.finish();
}

/// An offset so large that offset + table size overflows 64 bits.
#[test]
fn refcount_table_offset_overflowing() {
    let s = Scratch::new();
    let p = patched(&s, "rtovf.qcow2", |b| {
        put_be64(b, 48, 0xffff_ffff_ffff_0000)
    });
    qemu_rejects(&s, &p);
    expect_refusal(
        &s,
        &p,
        &[&["refcount"], &[OUTSIDE, &["invalid", "overflow"]].concat()],
        CheckWant::Code(1),
    );
    s.finish();
}

#[test]
fn refcount_table_offset_unaligned() {
    let s = Scratch::new();
    let p = patched(&s, "rtunal.qcow2", |b| put_be64(b, 48, 0x1_0200));
    qemu_rejects(&s, &p);
    expect_refusal(
        &s,
        &p,
        &[&["refcount"], &["align", "invalid"]],
        CheckWant::Code(1),
    );
    s.finish();
}

#[test]
fn refcount_table_clusters_huge() {
    let s = Scratch::new();
    let p = patched(&s, "rtclus.qcow2", |b| put_be32(b, 56, 0x7fff_ffff));
    qemu_rejects(&s, &p);
    expect_refusal(&s, &p, &[&["refcount"], OUTSIDE], CheckWant::Code(1));
    s.finish();
}

/// An L2 entry pointing past the end of the file: reading that cluster is
/// an error (not garbage, not zeros, not a panic); other clusters still
/// read; check reports corruption (exit 2) as qemu-img check does.
#[test]
fn l2_entry_past_eof() {
    let s = Scratch::new();
    let p = patched(&s, "l2eof.qcow2", |b| {
        let (_, l2) = l2_of_first_l1(b);
        let l2 = l2 as usize;
        // Guest cluster 1 (64 KiB..128 KiB) was written by qemu-io.
        assert_ne!(be64(b, l2 + 8), 0, "guest cluster 1 is allocated");
        put_be64(b, l2 + 8, (1 << 63) | (1 << 32));
    });
    let before = std::fs::read(&p).expect("read");
    let mut q = s.qemu_img();
    q.arg("check").arg(&p);
    let qo = exec(&mut q);
    assert_eq!(qo.code(), Some(2), "qemu-img check\n{}", qo.report());

    let groups: &[&[&str]] = &[OUTSIDE];
    for args in [
        &["io", "-r", "-c", "read 64k 4k"][..],
        &["io", "-r", "-c", "read -P 0x5a 64k 64k"][..],
        &["io", "-c", "read 100k 512"][..],
    ] {
        let o = vd(&s, args, &p);
        assert_io_failed(&o, groups);
    }
    let dst = s.path("l2eof-out.raw");
    let mut c = s.vdcache();
    c.args(["convert", "-O", "raw"]).arg(&p).arg(&dst);
    let o = exec(&mut c);
    assert_no_panic(&o);
    assert_refused(&o, groups);
    let _ = std::fs::remove_file(&dst);

    // The other clusters are intact and must still read.
    let o = vd(
        &s,
        &[
            "io",
            "-r",
            "-c",
            "read -P 0x5a 0 64k",
            "-c",
            "read -P 0x5a 128k 128k",
        ],
        &p,
    );
    assert!(
        o.success(),
        "clusters next to the bad one must still read\n{}",
        o.report()
    );
    // info does not read L2 tables; it may succeed, but must not panic.
    vd(&s, &["info"], &p);

    let o = vd(&s, &["check"], &p);
    assert_eq!(
        o.code(),
        Some(2),
        "vdcache check must report corruption (exit 2) like qemu-img check\n{}",
        o.report()
    );
    assert!(
        names_problem(&o.all(), groups),
        "vdcache check must say what is wrong\n{}",
        o.report()
    );
    // The read-write open found the corruption and marked the image (as
    // QEMU marks an image it finds corrupt): that bit is the only change.
    let mut after = std::fs::read(&p).expect("read");
    let flags = be64(&after, INCOMPATIBLE_FEATURES);
    assert_ne!(flags & INCOMPAT_CORRUPT, 0, "the corrupt bit was not set");
    put_be64(&mut after, INCOMPATIBLE_FEATURES, flags & !INCOMPAT_CORRUPT);
    assert!(
        before == after,
        "vdcache changed the corrupt image beyond its corrupt bit"
    );
    s.finish();
}

/// An L1 entry pointing past the end of the file: the L2 table cannot be
/// read; reads under it fail, check reports corruption.
#[test]
fn l1_entry_past_eof() {
    let s = Scratch::new();
    let p = patched(&s, "l1ent.qcow2", |b| {
        let (l1, _) = l2_of_first_l1(b);
        put_be64(b, l1, (1 << 63) | (1 << 32));
    });
    let mut q = s.qemu_img();
    q.arg("check").arg(&p);
    let qo = exec(&mut q);
    assert_eq!(qo.code(), Some(2), "qemu-img check\n{}", qo.report());
    let groups: &[&[&str]] = &[&["l2"], OUTSIDE];
    let o = vd(&s, &["io", "-r", "-c", "read 0 4k"], &p);
    assert_io_failed(&o, groups);
    let o = vd(&s, &["check"], &p);
    assert_eq!(o.code(), Some(2), "vdcache check\n{}", o.report());
    s.finish();
}

/// a.qcow2 -> b.qcow2 -> a.qcow2.
#[test]
fn backing_chain_loop() {
    let s = Scratch::new();
    let a = s.path("loop-a.qcow2");
    let b = s.path("loop-b.qcow2");
    let mut c = s.qemu_img();
    c.args(["create", "-q", "-f", "qcow2"]).arg(&b).arg("1M");
    ok(&mut c);
    let mut c = s.qemu_img();
    c.args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "loop-b.qcow2",
        "-F",
        "qcow2",
    ])
    .arg(&a);
    ok(&mut c);
    let mut c = s.qemu_img();
    c.args(["rebase", "-u", "-b", "loop-a.qcow2", "-F", "qcow2"])
        .arg(&b);
    ok(&mut c);
    // QEMU refuses the chain too (qemu-img check would spin forever on it,
    // so it is not run here).
    let mut c = s.qemu_img();
    c.args(["info", "--backing-chain"]).arg(&a);
    let o = exec(&mut c);
    assert!(!o.success(), "qemu-img accepted the loop\n{}", o.report());
    let groups: &[&[&str]] = &[&["loop", "cycle", "circular", "recurs", "appears twice"]];
    expect_refusal(&s, &a, groups, CheckWant::Code(1));
    expect_refusal(&s, &b, groups, CheckWant::Code(1));
    s.finish();
}

/// An image that is its own backing file.
#[test]
fn backing_self_loop() {
    let s = Scratch::new();
    let a = s.path("self.qcow2");
    let mut c = s.qemu_img();
    c.args(["create", "-q", "-f", "qcow2"]).arg(&a).arg("1M");
    ok(&mut c);
    let mut c = s.qemu_img();
    c.args(["rebase", "-u", "-b", "self.qcow2", "-F", "qcow2"])
        .arg(&a);
    ok(&mut c);
    expect_refusal(
        &s,
        &a,
        &[&[
            "loop",
            "cycle",
            "circular",
            "recurs",
            "appears twice",
            "itself",
        ]],
        CheckWant::Code(1),
    );
    s.finish();
}

/// A 1 MiB qcow2 overlay `name` over `backing`, made by qemu-img without
/// opening the backing file (`-u`).
fn overlay_unchecked(s: &Scratch, name: &str, backing: &str) -> PathBuf {
    let a = s.path(name);
    let mut c = s.qemu_img();
    c.args([
        "create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F", "qcow2",
    ])
    .arg(&a)
    .arg("1M");
    ok(&mut c);
    a
}

/// qemu-img check exits 1 on an image whose backing file is missing
/// ("Could not open backing file"); vdcache check must too.
#[test]
fn missing_backing_file() {
    let s = Scratch::new();
    let a = overlay_unchecked(&s, "orphan.qcow2", "no-such-base.qcow2");
    let mut q = s.qemu_img();
    q.arg("check").arg(&a);
    let qo = exec(&mut q);
    assert_eq!(qo.code(), Some(1), "qemu-img check\n{}", qo.report());
    expect_refusal(
        &s,
        &a,
        &[
            &["no-such-base.qcow2"],
            &[
                "no such file",
                "not found",
                "cannot open",
                "can't open",
                "could not open",
                "missing",
            ],
        ],
        CheckWant::Code(1),
    );
    s.finish();
}

/// An overlay cut inside its header extensions, before its backing file
/// name: the file is shorter than its first cluster (found by fuzzing; the
/// header parser used to panic slicing the extension area up to the name).
#[test]
fn truncated_before_backing_name() {
    let s = Scratch::new();
    let a = overlay_unchecked(&s, "cut.qcow2", "base.qcow2");
    let b = std::fs::read(&a).expect("read image");
    let name_at = be64(&b, 8) as usize;
    assert!(
        name_at > 112 && be32(&b, 20) == 16,
        "64 KiB clusters, name after the extensions"
    );
    std::fs::write(&a, &b[..name_at - 3]).expect("write");
    // qemu-img info accepts this file (it reads past the end as zeros and
    // shows no backing file at all); vdcache refuses the truncated name.
    expect_refusal(
        &s,
        &a,
        &[&["truncat", "short", "past", "end of"], &["backing"]],
        CheckWant::Code(1),
    );
    s.finish();
}

/// A raw disk whose first bytes are a valid qcow2 header (one that points
/// at a host file) used as a backing file with no recorded format: QEMU
/// would probe it and expose the host file; vdcache must refuse and name it.
fn raw_looks_like_qcow2(compat: &str) {
    let s = Scratch::new();
    let secret = s.path("host-secret.txt");
    let mut content = b"HOST SECRET CONTENT".to_vec();
    content.resize(64 * 1024, 0);
    std::fs::write(&secret, &content).expect("write secret");
    let evil = s.path("evil.raw");
    let mut c = s.qemu_img();
    c.args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "host-secret.txt",
        "-F",
        "raw",
    ])
    .arg(&evil)
    .arg("1M");
    ok(&mut c);
    let delta = s.path("evil-delta.qcow2");
    let mut c = s.qemu_img();
    c.args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("compat={compat}"),
        "-b",
        "evil.raw",
        "-F",
        "raw",
    ])
    .arg(&delta)
    .arg("1M");
    ok(&mut c);

    // With the format recorded as raw, the header bytes are guest data.
    let raw_bytes = std::fs::read(&evil).expect("read evil.raw");
    let dst = s.path("evil-out.raw");
    let mut c = s.vdcache();
    c.args(["convert", "-O", "raw"]).arg(&delta).arg(&dst);
    let o = exec(&mut c);
    assert_no_panic(&o);
    assert!(o.success(), "{}", o.report());
    let got = std::fs::read(&dst).expect("read converted");
    std::fs::remove_file(&dst).expect("remove converted");
    common::assert_same_bytes(
        "delta over evil.raw (-F raw) must read evil.raw's bytes",
        &raw_bytes,
        &got[..raw_bytes.len()],
    );

    // Without a recorded format: refuse to probe.
    let mut b = std::fs::read(&delta).expect("read delta");
    drop_backing_format(&mut b);
    std::fs::write(&delta, &b).expect("write delta");
    let mut c = s.qemu_img();
    c.args(["info", "--output=json"]).arg(&delta);
    let o = ok(&mut c);
    assert!(
        !o.stdout.contains("backing-filename-format"),
        "the backing format extension is still there\n{}",
        o.report()
    );
    let groups: &[&[&str]] = &[&["evil.raw"], &["format", "probe"]];
    for args in [
        &["info"][..],
        &["io", "-c", "read 0 4k"][..],
        &["io", "-r", "-c", "read 0 64"][..],
    ] {
        let o = vd(&s, args, &delta);
        assert_refused(&o, groups);
        assert!(
            !o.all().contains("HOST SECRET"),
            "vdcache exposed the host file through the forged header\n{}",
            o.report()
        );
    }
    let mut c = s.vdcache();
    c.args(["convert", "-O", "raw"]).arg(&delta).arg(&dst);
    let o = exec(&mut c);
    assert_no_panic(&o);
    assert_refused(&o, groups);
    if let Ok(out) = std::fs::read(&dst) {
        assert!(
            !out.windows(11).any(|w| w == b"HOST SECRET"),
            "convert copied the host file through the forged header"
        );
        let _ = std::fs::remove_file(&dst);
    }
    // check needs no backing file; it may pass, but must not panic.
    vd(&s, &["check"], &delta);
    let after = std::fs::read(&delta).expect("read delta");
    assert!(after == b, "vdcache changed the delta");
    s.finish();
}

#[test]
fn raw_backing_looks_like_qcow2_v3_delta() {
    raw_looks_like_qcow2("1.1");
}

#[test]
fn raw_backing_looks_like_qcow2_v2_delta() {
    raw_looks_like_qcow2("0.10");
}

/// Refcounts of clusters past the end of the file describe nothing: QEMU
/// compares only the clusters the file holds, and so does `vdcache check`.
/// Found by fuzzing: counting every cluster the refcount table could
/// describe made a 1-bit-refcount image with a full table take seconds per
/// check, and a larger table hours.
#[test]
fn refcounts_past_the_end_of_the_file_are_not_compared() {
    let s = Scratch::new();
    let (img, mut b) = qcow2_patch::base_image(&s, "tail.qcow2", "refcount_bits=1", "4M", &[]);
    let layout = qcow2_patch::Layout::of(&b);
    let clusters = b.len() / layout.cluster;
    // A cluster far past the end gets refcount 1: with 1-bit refcounts,
    // bit (cluster % 8) of byte (cluster / 8), least significant first.
    let far = clusters + 100;
    b[layout.refcount_block + far / 8] |= 1 << (far % 8);
    std::fs::write(&img, &b).expect("write");
    let mut q = s.qemu_img();
    q.args(["check"]).arg(&img);
    let qemu = exec(&mut q);
    assert_eq!(
        qemu.status.code(),
        Some(0),
        "qemu-img check\n{}",
        qemu.report()
    );
    let o = vd(&s, &["check"], &img);
    assert_eq!(o.status.code(), Some(0), "vdcache check\n{}", o.report());
    assert!(!o.all().contains("Leaked"), "{}", o.report());
    assert_eq!(
        std::fs::read(&img).expect("read"),
        b,
        "check changed the image"
    );
    s.finish();
}

/// The leak check itself: a file left in the child processes' working
/// directory fails the test.
#[test]
fn leak_check_catches_stray_files() {
    let s = Scratch::new();
    std::fs::write(s.root().join("cwd").join("stray.qcow2"), b"x").expect("write");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.finish()));
    assert!(r.is_err(), "finish() must fail when a file is left behind");
}
