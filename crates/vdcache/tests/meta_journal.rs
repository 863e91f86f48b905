//! Issue 20 with the real QEMU tools: the per-disk metadata journal.
//! A server killed with -9 leaves an image that QEMU refuses, naming the
//! feature; `vdcache recover` applies the journal, after which `qemu-img
//! check` is clean and `qemu-img compare` finds it equal to a reference
//! written by qemu-io alone. A guest flush through a writethrough cache
//! costs exactly one backend sync with the journal, and more without it.

#![allow(clippy::unwrap_used)]

mod common;
mod serving;

use common::{Scratch, exec, ok};
use serving::{qcow2, qemu_io, serve, stats, uri};

const M: u64 = 1 << 20;

/// Allocating writes, each flushed, then overwrites of the newest
/// clusters (full mode) and an unflushed tail.
fn workload() -> Vec<String> {
    let mut cmds = Vec::new();
    for i in 0..24u64 {
        let off = (i * 7 % 48) * 65536 + (i % 4) * 4096;
        cmds.push(format!("write -P {} {off} 4096", 0x30 + i));
        cmds.push("flush".into());
        if i % 5 == 4 {
            cmds.push(format!("write -P {} {off} 512", 0x80 + i));
            cmds.push(format!("write -z {} 8192", off + 65536 * 50));
            cmds.push("flush".into());
        }
    }
    cmds
}

#[test]
fn qemu_refuses_a_journaled_image_until_vdcache_recover_applies_it() {
    let s = Scratch::new();
    let base = s.path("base.qcow2");
    qcow2(&s, &base, 8 * M, None);
    ok(s.qemu_io().args(["-c", "write -P 0x5a 0 8M"]).arg(&base));
    let delta = s.path("delta.qcow2");
    let reference = s.path("reference.qcow2");
    for img in [&delta, &reference] {
        qcow2(&s, img, 8 * M, Some("base.qcow2"));
    }
    let sock = s.path("nbd.sock");
    let server = serve(
        &s,
        &sock,
        &["--metadata-journal", "on", delta.to_str().unwrap()],
    );
    let cmds = workload();
    qemu_io(&s, "raw", &uri(&sock, ""), &cmds);
    qemu_io(&s, "qcow2", reference.to_str().unwrap(), &cmds);
    server.kill9();

    let refused = exec(s.qemu_img().arg("check").arg(&delta));
    assert!(
        !refused.success() && refused.stderr.contains("vdcache metadata journal"),
        "QEMU must refuse a journaled image, naming the feature\n{}",
        refused.report()
    );
    let recovered = ok(s.vdcache().arg("recover").arg(&delta));
    assert!(
        recovered.stdout.contains("applied"),
        "{}",
        recovered.report()
    );
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
    ok(s.qemu_img().arg("compare").arg(&reference).arg(&delta));
    let again = ok(s.vdcache().arg("recover").arg(&delta));
    assert!(
        again.stdout.contains("nothing was changed"),
        "{}",
        again.report()
    );
}

#[test]
fn a_clean_stop_leaves_no_journal_behind() {
    let s = Scratch::new();
    let delta = s.path("delta.qcow2");
    qcow2(&s, &delta, 8 * M, None);
    let sock = s.path("nbd.sock");
    let server = serve(
        &s,
        &sock,
        &["--metadata-journal", "on", delta.to_str().unwrap()],
    );
    qemu_io(&s, "raw", &uri(&sock, ""), &workload());
    server.stop_clean();
    let info = ok(s.qemu_img().args(["info", "--output=json"]).arg(&delta));
    assert!(!info.stdout.contains("journal"), "{}", info.report());
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
}

/// Backend syncs and guest flushes a writethrough server counted while
/// qemu-io ran `cmds`.
fn syncs_per_flush(journal: &str) -> (u64, u64) {
    let s = Scratch::new();
    let base = s.path("base.qcow2");
    qcow2(&s, &base, 8 * M, None);
    ok(s.qemu_io().args(["-c", "write -P 0x5a 0 8M"]).arg(&base));
    let delta = s.path("delta.qcow2");
    qcow2(&s, &delta, 8 * M, Some("base.qcow2"));
    let sock = s.path("nbd.sock");
    let cache = s.path("flash.cache");
    let server = serve(
        &s,
        &sock,
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "64M",
            "--cache-mode",
            "writethrough",
            "--metadata-journal",
            journal,
            delta.to_str().unwrap(),
        ],
    );
    let before = stats(&s, &sock);
    let cmds: Vec<String> = (0..20u64)
        .flat_map(|i| [format!("write -P 7 {} 4096", i * 3 * 65536), "flush".into()])
        .collect();
    qemu_io(&s, "raw", &uri(&sock, ""), &cmds);
    let after = stats(&s, &sock);
    server.stop_clean();
    let count = |st: &serde_json::Value, key: &str| st["cache"]["total"][key].as_u64().unwrap();
    (
        count(&after, "backend_syncs") - count(&before, "backend_syncs"),
        count(&after, "guest_flushes") - count(&before, "guest_flushes"),
    )
}

#[test]
fn a_guest_flush_costs_one_backend_sync_with_the_journal() {
    let (syncs, flushes) = syncs_per_flush("on");
    assert!(flushes >= 20, "{flushes} guest flushes counted");
    assert!(
        syncs <= flushes,
        "journal on: {syncs} backend syncs for {flushes} guest flushes"
    );
    let (syncs_off, flushes_off) = syncs_per_flush("off");
    assert!(
        syncs_off > flushes_off,
        "journal off must cost more than one sync per flush ({syncs_off} for {flushes_off}), or this test proves nothing"
    );
}
