//! Done-when 2 of the foundation: a seeded random workload of thousands of
//! aligned and unaligned writes, zero writes, discards and flushes is run
//! through `vdcache io` on one copy of a chain and through the real
//! `qemu-io` on another. `qemu-img compare` must call them identical and
//! `qemu-img check` must find vdcache's image clean; and vdcache must read
//! what QEMU wrote exactly as QEMU does.

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::path::Path;
use std::process::{Command, Output};

const SIZE: u64 = 8 << 20;

fn tail(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    let start = s.len().saturating_sub(3000);
    s[s.floor_char_boundary(start)..].to_string()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (is qemu-utils installed?)"));
    assert!(
        out.status.success(),
        "{:?} failed: {}\n{}",
        cmd.get_program(),
        tail(&out.stdout),
        tail(&out.stderr)
    );
    out
}

fn vdcache() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vdcache"))
}

fn workload(seed: u64, ops: usize, cluster: u64) -> Vec<String> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let lens = [512, 4096, cluster, 2 * cluster, 3 * cluster / 2 + 512];
    let mut out = Vec::with_capacity(ops);
    while out.len() < ops {
        let (off, len) = if rng.random_bool(0.5) {
            let off = rng.random_range(0..SIZE / 512) * 512;
            (off, lens[rng.random_range(0..lens.len())])
        } else {
            (rng.random_range(0..SIZE), rng.random_range(1..3 * cluster))
        };
        let len = len.min(SIZE - off);
        if len == 0 {
            continue;
        }
        let k: f64 = rng.random();
        out.push(if k < 0.6 {
            format!("write -P {} {off} {len}", rng.random_range(1..255u32))
        } else if k < 0.75 {
            format!("write -z {off} {len}")
        } else if k < 0.9 {
            format!("discard {off} {len}")
        } else {
            "flush".to_string()
        });
    }
    out
}

fn create(dir: &Path, opts: &str, backing: bool) {
    let img = dir.join("a.qcow2");
    if backing {
        let base = dir.join("base.qcow2");
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&base)
            .arg(SIZE.to_string()));
        run(Command::new("qemu-io")
            .args(["-c", &format!("write -P 0x77 0 {SIZE}")])
            .arg(&base));
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o", opts])
            .args(["-b", "base.qcow2", "-F", "qcow2"])
            .arg(&img));
    } else {
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o", opts])
            .arg(&img)
            .arg(SIZE.to_string()));
    }
    std::fs::copy(&img, dir.join("b.qcow2")).expect("copy");
}

fn raw_of(dir: &Path, image: &str, via_vdcache: bool, out: &str) -> Vec<u8> {
    let dst = dir.join(out);
    let mut cmd = if via_vdcache {
        vdcache()
    } else {
        Command::new("qemu-img")
    };
    run(cmd
        .args(["convert", "-O", "raw"])
        .arg(dir.join(image))
        .arg(&dst));
    std::fs::read(&dst).expect("read raw")
}

fn check_case(seed: u64, opts: &str, cluster: u64, backing: bool, extra: &[&str]) {
    let dir = tempfile::tempdir().expect("tempdir");
    create(dir.path(), opts, backing);
    let cmds = workload(seed, 2000, cluster);
    let args: Vec<String> = cmds
        .iter()
        .flat_map(|c| ["-c".to_string(), c.clone()])
        .collect();
    run(vdcache()
        .arg("io")
        .args(extra)
        .args(&args)
        .arg(dir.path().join("a.qcow2")));
    run(Command::new("qemu-io")
        .args(&args)
        .arg(dir.path().join("b.qcow2")));
    let cmp = Command::new("qemu-img")
        .arg("compare")
        .arg(dir.path().join("a.qcow2"))
        .arg(dir.path().join("b.qcow2"))
        .output()
        .expect("qemu-img compare");
    assert!(
        cmp.status.success(),
        "seed {seed} {opts} backing={backing}: images differ: {}",
        String::from_utf8_lossy(&cmp.stdout)
    );
    run(Command::new("qemu-img")
        .arg("check")
        .arg(dir.path().join("a.qcow2")));
    let ours = raw_of(dir.path(), "b.qcow2", true, "b-vdcache.raw");
    let theirs = raw_of(dir.path(), "b.qcow2", false, "b-qemu.raw");
    assert!(
        ours == theirs,
        "seed {seed} {opts}: vdcache reads QEMU's image differently"
    );
}

#[test]
fn v3_default_clusters() {
    check_case(1, "compat=1.1", 65536, false, &[]);
    check_case(2, "compat=1.1", 65536, true, &[]);
}

#[test]
fn v2_images() {
    check_case(3, "compat=0.10", 65536, false, &[]);
    check_case(4, "compat=0.10", 65536, true, &[]);
}

#[test]
fn extended_l2_subclusters() {
    check_case(5, "extended_l2=on,cluster_size=16384", 16384, true, &[]);
    check_case(6, "extended_l2=on", 65536, false, &[]);
}

#[test]
fn small_clusters_wide_refcounts_grow_the_refcount_table() {
    check_case(7, "cluster_size=512,refcount_bits=64", 512, true, &[]);
    check_case(8, "cluster_size=1024,refcount_bits=2", 1024, false, &[]);
}

#[test]
fn lazy_refcounts_and_large_clusters() {
    check_case(9, "lazy_refcounts=on", 65536, true, &[]);
    check_case(10, "cluster_size=2M", 2 << 20, true, &[]);
}

#[test]
fn sector_sized_metadata_slices_under_memory_pressure() {
    let tiny = [
        "--l2-cache-size",
        "1k",
        "--refcount-cache-size",
        "1k",
        "--meta-slice-size",
        "512",
    ];
    check_case(11, "compat=1.1", 65536, true, &tiny);
    check_case(12, "cluster_size=4096,refcount_bits=1", 4096, false, &tiny);
}
