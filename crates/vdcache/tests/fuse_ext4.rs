//! A real ext4 on a vdcache disk: `vdcache serve` shows a qcow2 delta (over
//! a base, through a flash cache) as a file in a FUSE directory, a loop
//! device over that file takes `mkfs.ext4` and `mount`, and a workload of
//! creates, writes, fsyncs, renames and deletes runs on it. Checked with
//! `e2fsck -fn`, file contents, `qemu-img check`, after a clean stop and
//! after kill -9 of the server in the middle of the workload (the kernel
//! replays ext4's journal on the next mount). The virtual journal device
//! (`journal_size`) serves as ext4's external journal, and what the kernel
//! logs there is parsed with vdcache-jbd2 and compared with the blocks the
//! files occupy.
//!
//! Needs root, /dev/fuse and a loop device; without them each test prints
//! why and skips. Mounts and loop devices are released by guards, also
//! when a test fails.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::ext4;
use crate::serving;

use common::{Scratch, exec, ok};
use ext4::{Loop, Mounted, file_blocks, fsck_clean, mkfs};
use serving::{Proc, pattern, qcow2, serve_config};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const DISK: u64 = 256 << 20;

/// The server's FUSE directory: lazily unmounted when dropped if a dead or
/// live FUSE mount is still on it.
struct FuseDir(PathBuf);

impl Drop for FuseDir {
    fn drop(&mut self) {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let dir = self.0.to_string_lossy();
        if mounts.lines().any(|l| l.split(' ').nth(1) == Some(&dir)) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// A base image, a qcow2 delta over it and a config serving the delta
/// through a flash cache over NBD and FUSE (with a journal device when
/// `journal`).
struct Setup {
    // Dropped first: the mount goes before the scratch directory.
    fuse: FuseDir,
    s: Scratch,
    socket: PathBuf,
    config: PathBuf,
    delta: PathBuf,
}

impl Setup {
    fn new(journal: bool) -> Setup {
        let s = Scratch::new();
        let base = s.path("base.qcow2");
        let delta = s.path("delta.qcow2");
        qcow2(&s, &base, DISK, None);
        qcow2(&s, &delta, DISK, Some(base.to_str().unwrap()));
        let socket = s.path("vd.sock");
        let fuse = s.path("disks");
        let config = s.path("serve.toml");
        let journal_line = if journal {
            "journal_size = \"32M\"\n"
        } else {
            ""
        };
        std::fs::write(
            &config,
            format!(
                "[server]\nsocket = \"{}\"\nfuse = \"{}\"\n[cache]\npath = \"{}\"\nsize = \"192M\"\n[[export]]\nname = \"vm\"\nimage = \"{}\"\n{journal_line}",
                socket.display(),
                fuse.display(),
                s.path("cache.img").display(),
                delta.display()
            ),
        )
        .unwrap();
        Setup {
            s,
            socket,
            config,
            delta,
            fuse: FuseDir(fuse),
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.fuse.0.join(name)
    }

    /// Starts the server and waits until its files are there.
    fn serve(&self) -> Proc {
        let mut p = serve_config(&self.s, &self.config, &self.socket);
        let file = self.file("vm");
        let start = Instant::now();
        while !std::fs::metadata(&file).is_ok_and(|m| m.is_file() && m.len() == DISK) {
            p.assert_alive();
            assert!(
                start.elapsed() < serving::DEADLINE,
                "{} did not appear\n{}",
                file.display(),
                p.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        p
    }

    fn qemu_img_check(&self) {
        let out = exec(
            self.s
                .qemu_img()
                .args(["check", "-f", "qcow2"])
                .arg(&self.delta),
        );
        assert!(out.success(), "qemu-img check\n{}", out.report());
    }
}

/// One step of the file workload.
#[derive(Debug, Clone)]
enum Op {
    Write { path: String, seed: u64, len: usize },
    Rename { from: String, to: String },
    Delete { path: String },
}

impl Op {
    fn touches(&self) -> Vec<&str> {
        match self {
            Op::Write { path, .. } | Op::Delete { path } => vec![path],
            Op::Rename { from, to } => vec![from, to],
        }
    }
}

const DIRS: usize = 4;

/// A deterministic workload of `n` steps (`tag` keeps names of two
/// workloads on one file system apart).
fn plan(n: usize, seed: u64, tag: &str) -> Vec<Op> {
    use rand::{RngExt as _, SeedableRng};
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut live: Vec<String> = Vec::new();
    let mut ops = Vec::new();
    for i in 0..n {
        let r = rng.random_range(0..10);
        let dir = format!("{tag}{}", i % DIRS);
        let op = if r < 7 || live.len() < 4 {
            let path = if r == 0 && !live.is_empty() {
                live[rng.random_range(0..live.len())].clone()
            } else {
                format!("{dir}/f{i}")
            };
            Op::Write {
                path,
                seed: seed * 1_000_000 + i as u64,
                len: rng.random_range(1..48 << 10),
            }
        } else if r < 9 {
            let k = rng.random_range(0..live.len());
            Op::Rename {
                from: live.remove(k),
                to: format!("{dir}/r{i}"),
            }
        } else {
            Op::Delete {
                path: live.remove(rng.random_range(0..live.len())),
            }
        };
        match &op {
            Op::Write { path, .. } if !live.contains(path) => live.push(path.clone()),
            Op::Rename { to, .. } => live.push(to.clone()),
            _ => {}
        }
        ops.push(op);
    }
    ops
}

/// What the files hold after `ops`: path -> (seed, length).
fn model(ops: &[Op]) -> BTreeMap<String, (u64, usize)> {
    let mut m = BTreeMap::new();
    for op in ops {
        match op {
            Op::Write { path, seed, len } => {
                m.insert(path.clone(), (*seed, *len));
            }
            Op::Rename { from, to } => {
                let v = m.remove(from).unwrap();
                m.insert(to.clone(), v);
            }
            Op::Delete { path } => {
                m.remove(path);
            }
        }
    }
    m
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

fn make_dirs(root: &Path, tag: &str) {
    for d in 0..DIRS {
        std::fs::create_dir(root.join(format!("{tag}{d}"))).unwrap();
    }
    fsync_dir(root).unwrap();
}

/// Runs one step and makes it durable (file and directories fsynced).
fn apply(root: &Path, op: &Op) -> std::io::Result<()> {
    let parent = |p: &Path| p.parent().unwrap().to_path_buf();
    match op {
        Op::Write { path, seed, len } => {
            let p = root.join(path);
            let mut f = std::fs::File::create(&p)?;
            f.write_all(&pattern(*len, *seed))?;
            f.sync_all()?;
            fsync_dir(&parent(&p))
        }
        Op::Rename { from, to } => {
            let (a, b) = (root.join(from), root.join(to));
            std::fs::rename(&a, &b)?;
            fsync_dir(&parent(&a))?;
            fsync_dir(&parent(&b))
        }
        Op::Delete { path } => {
            let p = root.join(path);
            std::fs::remove_file(&p)?;
            fsync_dir(&parent(&p))
        }
    }
}

/// Every file of `expect` holds its content; no other file exists under
/// the workload's directories except the paths in `unsure`. Returns how
/// many files were compared.
fn verify(
    root: &Path,
    tag: &str,
    expect: &BTreeMap<String, (u64, usize)>,
    unsure: &[&str],
) -> usize {
    let mut found = BTreeSet::new();
    for d in 0..DIRS {
        for e in std::fs::read_dir(root.join(format!("{tag}{d}"))).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            found.insert(format!("{tag}{d}/{name}"));
        }
    }
    let mut compared = 0;
    for (path, (seed, len)) in expect {
        if unsure.contains(&path.as_str()) {
            continue;
        }
        let got = std::fs::read(root.join(path))
            .unwrap_or_else(|e| panic!("{path}, fsynced before, is gone: {e}"));
        common::assert_same_bytes(path, &pattern(*len, *seed), &got);
        compared += 1;
    }
    for path in &found {
        assert!(
            expect.contains_key(path) || unsure.contains(&path.as_str()),
            "{path} exists but the workload deleted or renamed it"
        );
    }
    compared
}

#[test]
fn ext4_on_a_fuse_disk_survives_a_clean_stop_and_remount() {
    require_fuse_and_loop!();
    let setup = Setup::new(false);
    let server = setup.serve();
    let ops = plan(2000, 1, "w");
    let expect = model(&ops);
    {
        let dev = Loop::attach(&setup.file("vm"));
        mkfs(&["-b", "4096"], &dev.0);
        let mnt = setup.s.path("mnt");
        let m = Mounted::mount(&dev.0, &mnt, "rw");
        make_dirs(&mnt, "w");
        for op in &ops {
            apply(&mnt, op).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        }
        assert_eq!(verify(&mnt, "w", &expect, &[]), expect.len());
        m.unmount();
        fsck_clean(&dev.0, None);
    }
    let log = server.stop_clean();
    assert!(log.contains("disks shown as files"), "{log}");
    setup.qemu_img_check();
    // Again from the images the stop left, through a new server.
    let server = setup.serve();
    {
        let dev = Loop::attach(&setup.file("vm"));
        let mnt = setup.s.path("mnt");
        let m = Mounted::mount(&dev.0, &mnt, "ro");
        assert_eq!(verify(&mnt, "w", &expect, &[]), expect.len());
        m.unmount();
        fsck_clean(&dev.0, None);
    }
    server.stop_clean();
    setup.qemu_img_check();
}

#[test]
fn ext4_on_a_fuse_disk_keeps_every_fsynced_file_across_kill_9() {
    require_fuse_and_loop!();
    kill_9_mid_workload(None);
}

/// The same with ext4's journal on the virtual journal device, data=journal:
/// the kernel replays the external journal (whose blocks went through the
/// cache too) on the next mount.
#[test]
fn ext4_with_an_external_journal_keeps_every_fsynced_file_across_kill_9() {
    require_fuse_and_loop!();
    kill_9_mid_workload(Some("journal"));
}

/// The same with data=ordered: only metadata is logged, file data goes in
/// place before each commit.
#[test]
fn ext4_with_an_ordered_external_journal_keeps_every_fsynced_file_across_kill_9() {
    require_fuse_and_loop!();
    kill_9_mid_workload(Some("ordered"));
}

/// Runs a workload, kills the server with SIGKILL once 1000 steps are
/// durable, restarts it, mounts (journal replay) and checks every step
/// that completed. `external` is the data= mode of an ext4 whose journal is
/// on the virtual journal device; None: an ordinary ext4.
fn kill_9_mid_workload(external: Option<&str>) {
    let setup = Setup::new(external.is_some());
    let server = setup.serve();
    let ops = plan(2000, 2, "k");
    let kill_after = 1000;
    let mnt = setup.s.path("mnt");
    let attach = || {
        let jdev = external.map(|_| Loop::attach(&setup.file("vm-journal")));
        let dev = Loop::attach(&setup.file("vm"));
        let opts = match (external, &jdev) {
            (Some(mode), Some(j)) => format!("data={mode},journal_path={}", j.0),
            _ => "rw".to_string(),
        };
        (jdev, dev, opts)
    };
    let done = {
        let (jdev, dev, opts) = attach();
        match &jdev {
            Some(j) => {
                mkfs(&["-b", "4096", "-O", "journal_dev"], &j.0);
                mkfs(&["-b", "4096", "-J", &format!("device={}", j.0)], &dev.0);
            }
            None => mkfs(&["-b", "4096"], &dev.0),
        }
        let m = Mounted::mount(&dev.0, &mnt, &opts);
        make_dirs(&mnt, "k");
        let (tx, rx) = std::sync::mpsc::channel();
        let writer = {
            let (ops, mnt) = (ops.clone(), mnt.clone());
            std::thread::spawn(move || {
                for (i, op) in ops.iter().enumerate() {
                    if apply(&mnt, op).is_err() {
                        return i;
                    }
                    let _ = tx.send(i + 1);
                }
                ops.len()
            })
        };
        // Kill once `kill_after` steps are durable, while the writer runs.
        while rx.recv().unwrap() < kill_after {}
        let log = server.kill9();
        let done = writer.join().unwrap();
        assert!(
            (kill_after..ops.len()).contains(&done),
            "the workload should fail once the server is gone (done {done})\n{log}"
        );
        drop(m);
        drop(dev);
        drop(jdev);
        done
    };
    // The server cleans up its dead mount itself on restart.
    let server = setup.serve();
    {
        let (jdev, dev, opts) = attach();
        // The kill left ext4 with a journal to replay.
        let header = ok(Command::new("dumpe2fs").arg("-h").arg(&dev.0));
        assert!(
            header.stdout.contains("needs_recovery"),
            "{}",
            header.stdout
        );
        let m = Mounted::mount(&dev.0, &mnt, &opts);
        // Step `done` was under way: its paths may hold either state.
        let unsure = ops[done].touches();
        let compared = verify(&mnt, "k", &model(&ops[..done]), &unsure);
        assert!(
            compared >= model(&ops[..kill_after]).len() - 2,
            "{compared}"
        );
        m.unmount();
        fsck_clean(&dev.0, jdev.as_ref().map(|j| j.0.as_str()));
    }
    server.stop_clean();
    setup.qemu_img_check();
}

/// Writes files of distinct 4 KiB blocks (one starting with the JBD2
/// magic) on the data=journal ext4 mounted at `mnt`, fsyncs them, then
/// parses the journal device as it is now: every block of every file must
/// map to a committed journal copy holding exactly its bytes. Returns the
/// files and the journal's superblock.
fn journal_maps_the_files(
    setup: &Setup,
    mnt: &Path,
) -> (Vec<(PathBuf, Vec<u8>)>, vdcache_jbd2::Superblock) {
    let mut files = Vec::new();
    for i in 0..24u64 {
        let mut data = pattern(16 << 10, 9000 + i);
        if i == 5 {
            // A data block that starts like a journal block is escaped.
            data[..4].copy_from_slice(&vdcache_jbd2::MAGIC.to_be_bytes());
        }
        let p = mnt.join(format!("j{i}"));
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        files.push((p, data));
    }
    fsync_dir(mnt).unwrap();
    let journal = std::fs::read(setup.file("vm-journal")).unwrap();
    // On a journal device (4 KiB blocks) the JBD2 superblock is device
    // block 1, after the device's own ext4 superblock; journal block
    // numbers count from the start of the device (mke2fs sets s_first 2).
    let sb = vdcache_jbd2::Superblock::parse(&journal[4096..]).unwrap();
    assert_eq!((sb.block_size, sb.first, sb.max_len), (4096, 2, 8192));
    assert_ne!(sb.start, 0, "the journal holds live transactions");
    let area = &journal[..];
    let log = vdcache_jbd2::scan(&sb, |n| {
        area.get(n as usize * 4096..(n as usize + 1) * 4096)
    })
    .unwrap();
    assert!(log.bad_copies.is_empty(), "{:?}", log.bad_copies);

    let copies = log.latest_copies();
    let mut escaped = 0;
    for (path, data) in &files {
        let blocks = file_blocks(path);
        assert_eq!(blocks.len(), 4, "{}", path.display());
        for (k, b) in blocks.iter().enumerate() {
            let c = copies
                .get(b)
                .unwrap_or_else(|| panic!("block {b} of {} is not in the journal", path.display()));
            let j = c.journal_block as usize;
            let mut logged = area[j * 4096..(j + 1) * 4096].to_vec();
            if c.escaped {
                vdcache_jbd2::unescape(&mut logged);
                escaped += 1;
            }
            common::assert_same_bytes(
                &format!("journal copy of block {k} of {}", path.display()),
                &data[k * 4096..(k + 1) * 4096],
                &logged,
            );
        }
    }
    assert_eq!(
        escaped, 1,
        "exactly one logged block started with the magic"
    );
    (files, sb)
}

#[test]
fn ext4_with_its_journal_on_the_virtual_journal_device() {
    require_fuse_and_loop!();
    let setup = Setup::new(true);
    let server = setup.serve();
    let mnt = setup.s.path("mnt");
    let jdev = Loop::attach(&setup.file("vm-journal"));
    let dev = Loop::attach(&setup.file("vm"));
    mkfs(&["-b", "4096", "-O", "journal_dev"], &jdev.0);
    mkfs(&["-b", "4096", "-J", &format!("device={}", jdev.0)], &dev.0);
    let opts = |mode: &str| format!("data={mode},journal_path={}", jdev.0);
    // data=journal: file data goes through the journal; what the kernel
    // logged there names the blocks the files occupy.
    let m = Mounted::mount(&dev.0, &mnt, &opts("journal"));
    let (files, sb) = journal_maps_the_files(&setup, &mnt);
    assert_eq!(
        sb.incompat & (vdcache_jbd2::FEATURE_CSUM_V3 | vdcache_jbd2::FEATURE_64BIT),
        vdcache_jbd2::FEATURE_CSUM_V3 | vdcache_jbd2::FEATURE_64BIT,
        "mkfs.ext4's defaults: csum v3 tags with 64-bit block numbers"
    );
    let ops = plan(1500, 3, "e");
    make_dirs(&mnt, "e");
    for op in &ops {
        apply(&mnt, op).unwrap();
    }
    m.unmount();
    // Journal-aware: the kernel's checkpoint writes found their logged
    // copies in flash and shared them; the log parsed without errors.
    let stats = serving::stats(&setup.s, &setup.socket);
    let shared = stats["cache"]["total"]["journal_copies_shared"]
        .as_u64()
        .unwrap();
    assert!(
        shared > 100,
        "in-place blocks sharing journal copies: {shared}"
    );
    let journal = stats["disks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["export"] == "vm-journal")
        .unwrap()["journal"]
        .clone();
    assert!(journal["descriptors"].as_u64().unwrap() > 0, "{journal}");
    assert_eq!(journal["errors"].as_u64(), Some(0), "{journal}");
    assert!(
        stats["cache"]["held_bytes"].as_u64().unwrap() > 0,
        "{stats}"
    );
    fsck_clean(&dev.0, Some(&jdev.0));
    // data=ordered: metadata only in the journal.
    let m = Mounted::mount(&dev.0, &mnt, &opts("ordered"));
    let ops2 = plan(1500, 4, "o");
    make_dirs(&mnt, "o");
    for op in &ops2 {
        apply(&mnt, op).unwrap();
    }
    let (e, o) = (model(&ops), model(&ops2));
    assert_eq!(verify(&mnt, "e", &e, &[]), e.len());
    assert_eq!(verify(&mnt, "o", &o, &[]), o.len());
    for (path, data) in &files {
        common::assert_same_bytes(
            &path.display().to_string(),
            data,
            &std::fs::read(path).unwrap(),
        );
    }
    m.unmount();
    fsck_clean(&dev.0, Some(&jdev.0));
    drop(dev);
    drop(jdev);
    server.stop_clean();
    setup.qemu_img_check();
    // Cache-only logging: a clean stop leaves the journal in flash (its
    // file untouched, a marker saying so); full recovery writes it out.
    let journal_file = setup.s.path("cache.img.journal-vm");
    let marker = setup.s.path("cache.img.journal-vm.in-cache");
    let kept = std::fs::read(&journal_file).unwrap();
    assert_eq!(kept.len(), 32 << 20);
    assert!(kept.iter().all(|&b| b == 0), "the journal never left flash");
    assert!(marker.exists());
    ok(setup
        .s
        .vdcache()
        .args(["recover", "--full", "--cache"])
        .arg(setup.s.path("cache.img")));
    let kept = std::fs::read(&journal_file).unwrap();
    assert!(vdcache_jbd2::Superblock::parse(&kept[4096..]).is_ok());
    assert!(!marker.exists(), "written out: nothing lives only in flash");
}

/// `serve --fuse DIR IMAGE` from the command line, next to an NBD socket:
/// the file and the NBD export are one disk (each sees the other's writes
/// without a flush), and SIGTERM unmounts DIR.
#[test]
fn the_fuse_file_and_the_nbd_export_are_one_disk() {
    require_fuse_and_loop!();
    let setup = Setup::new(false);
    let dir = &setup.fuse.0;
    let mut p = serving::serve(
        &setup.s,
        &setup.socket,
        &[
            "--fuse",
            dir.to_str().unwrap(),
            "--cache",
            setup.s.path("cache.img").to_str().unwrap(),
            "--cache-size",
            "64M",
            "--export-name",
            "vm",
            setup.delta.to_str().unwrap(),
        ],
    );
    let file = dir.join("vm");
    let start = Instant::now();
    while !file.exists() {
        p.assert_alive();
        assert!(start.elapsed() < serving::DEADLINE, "{}", p.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
    let uri = serving::uri(&setup.socket, "vm");
    {
        use std::os::unix::fs::FileExt as _;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&file)
            .unwrap();
        f.write_all_at(&[0xab; 65536], 1 << 20).unwrap();
        serving::qemu_io(&setup.s, "raw", &uri, &["read -P 0xab 1M 64k".into()]);
        serving::qemu_io(&setup.s, "raw", &uri, &["write -P 0xcd 2M 64k".into()]);
    }
    // A fresh open drops what the kernel had cached of the file.
    let mut got = vec![0u8; 65536];
    {
        use std::os::unix::fs::FileExt as _;
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut got, 2 << 20)
            .unwrap();
    }
    assert!(got.iter().all(|&b| b == 0xcd));
    let log = p.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    assert!(
        !file.exists(),
        "{} is still there after the stop",
        file.display()
    );
    setup.qemu_img_check();
}

/// The same with a file system made without metadata_csum and 64bit: the
/// kernel then writes plain tags with 32-bit block numbers.
#[test]
fn a_journal_without_checksums_or_64bit_maps_the_files_too() {
    require_fuse_and_loop!();
    let setup = Setup::new(true);
    let server = setup.serve();
    let mnt = setup.s.path("mnt");
    let jdev = Loop::attach(&setup.file("vm-journal"));
    let dev = Loop::attach(&setup.file("vm"));
    let plain = ["-b", "4096", "-O", "^metadata_csum,^64bit"];
    mkfs(&[&plain[..], &["-O", "journal_dev"]].concat(), &jdev.0);
    mkfs(
        &[&plain[..], &["-J", &format!("device={}", jdev.0)]].concat(),
        &dev.0,
    );
    let m = Mounted::mount(
        &dev.0,
        &mnt,
        &format!("data=journal,journal_path={}", jdev.0),
    );
    let (_, sb) = journal_maps_the_files(&setup, &mnt);
    assert_eq!(
        sb.incompat
            & (vdcache_jbd2::FEATURE_CSUM_V2
                | vdcache_jbd2::FEATURE_CSUM_V3
                | vdcache_jbd2::FEATURE_64BIT),
        0,
        "{sb:?}"
    );
    assert_eq!(sb.tag_bytes(), 8);
    m.unmount();
    fsck_clean(&dev.0, Some(&jdev.0));
    drop(dev);
    drop(jdev);
    server.stop_clean();
    setup.qemu_img_check();
}

/// The journal device's blocks live in the cache until written back: after
/// kill -9, `recover --full` writes them to the journal's file, so the
/// guest's journal is complete without the cache.
#[test]
fn recover_full_writes_the_journal_device_to_its_file() {
    require_fuse_and_loop!();
    let setup = Setup::new(true);
    let server = setup.serve();
    let data = pattern(1 << 20, 77);
    {
        use std::os::unix::fs::FileExt as _;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(setup.file("vm-journal"))
            .unwrap();
        f.write_all_at(&data, 3 << 20).unwrap();
        f.sync_all().unwrap();
    }
    server.kill9();
    let file = setup.s.path("cache.img.journal-vm");
    let at = |bytes: &[u8]| bytes[3 << 20..4 << 20].to_vec();
    assert!(
        at(&std::fs::read(&file).unwrap()) != data,
        "write-back mode: the journal's blocks were only in the cache"
    );
    let out = ok(setup
        .s
        .vdcache()
        .args(["recover", "--full", "--cache"])
        .arg(setup.s.path("cache.img")));
    assert!(
        out.stdout
            .contains(&format!("written back: {}", file.display())),
        "{}",
        out.report()
    );
    common::assert_same_bytes("journal file", &data, &at(&std::fs::read(&file).unwrap()));
}
