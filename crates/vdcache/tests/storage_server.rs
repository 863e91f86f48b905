//! Issue 3, done-when 4: a chain whose files live behind an nbdkit storage
//! server (file plugin exporting a directory) is served by `vdcache serve`
//! through its NBD client backend: reads and writes match a reference, a
//! full export gives ENOSPC (not corruption), and a server killed with
//! SIGKILL in the middle of a workload leaves a delta that `qemu-img check
//! -r all` repairs with every flushed write intact.

use crate::common;
use crate::serving;

use common::{Scratch, assert_same_bytes, exec, ok};
use serving::{CrashWorkload, Streamed, nbdkit, qcow2, qemu_io, raw_of, serve, storage_dir, uri};

const M: u64 = 1 << 20;

#[test]
fn chain_behind_nbdkit_serves_correctly_and_reports_a_full_export() {
    let s = Scratch::new();
    let size = 16 * M;
    let dir = storage_dir(&s, size);
    let ksock = s.path("storage.sock");
    let _storage = nbdkit(&s, &ksock, &dir);

    // delta.qcow2 names its backing file by URI; small.qcow2 by a relative
    // name that vdcache resolves to an export of the same storage server.
    let delta = dir.join("delta.qcow2");
    qcow2(&s, &delta, size, Some(&uri(&ksock, "base.qcow2")));
    ok(s.cmd("truncate").args(["-s", "40M"]).arg(&delta));
    let small = dir.join("small.qcow2");
    ok(s.qemu_img()
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
        ])
        .arg(&small)
        .arg(size.to_string()));
    // Room for the metadata and a few data clusters only.
    ok(s.cmd("truncate").args(["-s", "640K"]).arg(&small));

    let refp = s.path("ref.raw");
    raw_of(
        &s,
        "qcow2",
        dir.join("base.qcow2").to_str().expect("utf-8"),
        &refp,
    );

    let vsock = s.path("vd.sock");
    let server = serve(&s, &vsock, &[&uri(&ksock, "delta.qcow2")]);
    let u = uri(&vsock, "");
    let cmds: Vec<String> = [
        "read -P 0x11 0 6M",
        "read -P 0 6M 4M",
        "read -P 0x22 10M 2M",
        "write -P 0x33 5M 2M",
        "write -P 0x44 10485860 70000",
        "write -z 11M 4096",
        "write -P 0x55 15M 1M",
        "flush",
        "read -P 0x11 0 5M",
        "read -P 0x33 5M 2M",
        "read -P 0x22 10M 100",
        "read -P 0x44 10485860 70000",
        "read -P 0 11M 4096",
        "read -P 0x22 11538432 1044480",
        "read -P 0x55 15M 1M",
    ]
    .map(String::from)
    .to_vec();
    qemu_io(&s, "raw", &u, &cmds);
    qemu_io(&s, "raw", refp.to_str().expect("utf-8"), &cmds);
    let cmp = ok(s
        .qemu_img()
        .args(["compare", "-f", "raw", "-F", "raw", &u])
        .arg(&refp));
    assert!(
        cmp.stdout.contains("Images are identical"),
        "{}",
        cmp.report()
    );

    // A full export: ENOSPC to the client, earlier data intact, no
    // corruption.
    let fsock = s.path("full.sock");
    let full = serve(&s, &fsock, &[&uri(&ksock, "small.qcow2")]);
    let fu = uri(&fsock, "");
    qemu_io(
        &s,
        "raw",
        &fu,
        &["write -P 0x66 0 64K".into(), "flush".into()],
    );
    let w = exec(
        s.qemu_io()
            .args(["-f", "raw", "-c", "write -P 0x77 4M 4M"])
            .arg(&fu),
    );
    assert!(
        w.all().contains("No space left on device"),
        "a write past the export's end must fail with ENOSPC\n{}",
        w.report()
    );
    qemu_io(
        &s,
        "raw",
        &fu,
        &[
            "read -P 0x66 0 64K".into(),
            "read -P 0x11 64K 4032K".into(),
            "write -P 0x67 0 4K".into(),
            "read -P 0x67 0 4K".into(),
        ],
    );
    let log = full.stop_clean();
    eprintln!("full export server log:\n{log}");
    let chk = exec(s.qemu_img().arg("check").arg(&small));
    assert!(
        matches!(chk.code(), Some(0 | 3)) && !chk.all().contains("ERROR"),
        "a full export must leave at most leaked clusters, never corruption\n{}\n--- server log ---\n{log}",
        chk.report()
    );
    qemu_io(
        &s,
        "qcow2",
        small.to_str().expect("utf-8"),
        &["read -P 0x67 0 4K".into(), "read -P 0x66 4K 60K".into()],
    );
    assert_eq!(
        std::fs::metadata(&small).expect("stat").len(),
        640 << 10,
        "the export's file did not grow"
    );

    server.stop_clean();
    ok(s.qemu_img().arg("check").arg(&delta));
    let cmp = ok(s
        .qemu_img()
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(&delta)
        .arg(&refp));
    assert!(
        cmp.stdout.contains("Images are identical"),
        "{}",
        cmp.report()
    );
    s.finish();
}

#[test]
fn sigkill_mid_workload_loses_nothing_flushed() {
    let s = Scratch::new();
    let size = 16 * M;
    let dir = storage_dir(&s, size);
    let base_raw = raw_of(
        &s,
        "qcow2",
        dir.join("base.qcow2").to_str().expect("utf-8"),
        &s.path("base.raw"),
    );
    let delta = dir.join("delta.qcow2");
    qcow2(&s, &delta, size, Some("base.qcow2"));
    ok(s.cmd("truncate").args(["-s", "64M"]).arg(&delta));
    let ksock = s.path("storage.sock");
    let storage = nbdkit(&s, &ksock, &dir);
    let vsock = s.path("vd.sock");
    let server = serve(&s, &vsock, &[&uri(&ksock, "delta.qcow2")]);

    // 40 groups of 6 writes, each group flushed; the server is killed once
    // qemu-io has reported the 12th flush, while it keeps writing.
    let w = CrashWorkload::generate(0xc0ffee, size, 40, 6);
    let mut cmd = s.qemu_io();
    cmd.args(["-f", "raw"]);
    for c in w.commands() {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(uri(&vsock, ""));
    let mut qio = Streamed::spawn(cmd);
    let marker = w.marker();
    assert!(
        qio.wait_for(12, |l| l.trim() == marker),
        "qemu-io ended before its 12th flush:\n{}",
        qio.seen.join("\n")
    );
    server.kill9();
    let (_, lines) = qio.finish();
    let flushed = w.confirmed_flushes(&lines);
    assert!(
        flushed >= 12,
        "{flushed} flushes confirmed:\n{}",
        lines.join("\n")
    );
    let writes = lines.iter().filter(|l| l.starts_with("wrote ")).count();
    eprintln!("killed after {flushed} of 40 flushes confirmed, {writes} of 246 writes reported");
    drop(storage);

    // The metadata journal (on by default without a cache) left the
    // newest tables in the journal: QEMU refuses the image, naming the
    // recovery, until vdcache applies it.
    let refused = exec(s.qemu_img().arg("check").arg(&delta));
    assert!(
        !refused.success() && refused.stderr.contains("vdcache recover"),
        "{}",
        refused.report()
    );
    ok(s.vdcache().arg("recover").arg(&delta));
    // Repair, then the delta must be clean and hold every flushed write.
    let rep = exec(s.qemu_img().args(["check", "-r", "all"]).arg(&delta));
    assert!(
        rep.success(),
        "qemu-img check -r all could not repair the delta\n{}",
        rep.report()
    );
    let chk = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(chk.stdout.contains("No errors"), "{}", chk.report());
    let after = raw_of(
        &s,
        "qcow2",
        delta.to_str().expect("utf-8"),
        &s.path("after.raw"),
    );
    w.check(
        "the delta after SIGKILL and qemu-img check -r all",
        &base_raw,
        flushed,
        &after,
    );
    assert_same_bytes(
        "the base image",
        &base_raw,
        &raw_of(
            &s,
            "qcow2",
            dir.join("base.qcow2").to_str().expect("utf-8"),
            &s.path("base2.raw"),
        ),
    );
    s.finish();
}
