//! Done-when 1 of the foundation: images that qemu-img made and qemu-io
//! wrote read back byte-identical through vdcache.
//!
//! A covering matrix rather than the full cross product: every cluster size
//! (512 B, 4 KiB, 16 KiB, 64 KiB, 2 MiB), both compat levels, every
//! refcount width (1..64 bits), extended L2 on and off, zlib and zstd
//! compressed images from `qemu-img convert -c`, chains of 1 to 4 images
//! ending in raw or qcow2, and internal snapshots. For each image:
//! `vdcache convert -O raw` equals `qemu-img convert -O raw` byte for byte,
//! `vdcache io -r -c "read -P ..."` verifies uniform runs picked from QEMU's
//! output (and fails on a wrong pattern), `vdcache info --json` agrees with
//! `qemu-img info --output=json --backing-chain`, and `vdcache check` and
//! `qemu-img check` both exit 0.

use crate::common;

use common::{Scratch, assert_no_panic, assert_same_bytes, exec, ok};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde_json::Value;
use std::path::{Path, PathBuf};

const K: u64 = 1024;
const M: u64 = 1024 * 1024;

/// How a qcow2 layer is created.
#[derive(Clone, Copy)]
struct Opts {
    cluster: u64,
    compat: &'static str,
    refcount_bits: u32,
    extended_l2: bool,
    lazy: bool,
}

impl Opts {
    const fn new(
        cluster: u64,
        compat: &'static str,
        refcount_bits: u32,
        extended_l2: bool,
    ) -> Self {
        Opts {
            cluster,
            compat,
            refcount_bits,
            extended_l2,
            lazy: false,
        }
    }

    fn string(&self) -> String {
        let mut s = format!(
            "cluster_size={},compat={},refcount_bits={},extended_l2={}",
            self.cluster,
            self.compat,
            self.refcount_bits,
            if self.extended_l2 { "on" } else { "off" }
        );
        if self.lazy {
            s.push_str(",lazy_refcounts=on");
        }
        s
    }

    fn subcluster(&self) -> u64 {
        if self.extended_l2 {
            self.cluster / 32
        } else {
            self.cluster
        }
    }
}

/// qemu-io commands that cross cluster and subcluster boundaries, aligned
/// and not, with pattern writes, zero writes (with and without unmap) and
/// discards, followed by `random_ops` seeded random operations.
fn workload(seed: u64, size: u64, cluster: u64, sub: u64, random_ops: usize) -> Vec<String> {
    let c = cluster;
    let s = sub;
    let p = |k: u64| 1 + (seed.wrapping_mul(37).wrapping_add(k * 11)) % 254;
    let fixed: Vec<(&str, u64, u64)> = vec![
        ("w0", c - 7, 14),
        ("w1", 3 * c + 100, 2 * c + 333),
        ("w2", s - 1, 2),
        ("w3", 5 * c + 2 * s + 5, 3 * s),
        ("w4", size / 2 + 4097, (size / 4).min(4 * c + 1234)),
        ("w5", 7 * c + s, s),
        ("z", 3 * c + 612, c),
        ("zu", 4 * c, c),
        ("z", size / 2 + 4097 + c, 2 * s + 3),
        ("d", size / 2 + 2 * c, c),
        ("d", 3 * c + 50, 200),
        ("w6", size - 1000, 1000),
        ("zu", 7 * c, s),
    ];
    let mut out = Vec::new();
    let mut push = |kind: &str, off: u64, len: u64, k: u64| {
        if off >= size || len == 0 {
            return;
        }
        let len = len.min(size - off);
        out.push(match kind {
            "z" => format!("write -z {off} {len}"),
            "zu" => format!("write -z -u {off} {len}"),
            "d" => format!("discard {off} {len}"),
            _ => format!("write -P 0x{:02x} {off} {len}", p(k)),
        });
    };
    for (k, (kind, off, len)) in fixed.into_iter().enumerate() {
        push(kind, off, len, k as u64);
    }
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for k in 0..random_ops {
        let (off, len) = if rng.random_bool(0.4) {
            let off = rng.random_range(0..size / s) * s;
            (off, s * rng.random_range(1..4u64))
        } else {
            (rng.random_range(0..size), rng.random_range(1..3 * c))
        };
        let r: f64 = rng.random();
        let kind = if r < 0.65 {
            "w"
        } else if r < 0.78 {
            "z"
        } else if r < 0.88 {
            "zu"
        } else {
            "d"
        };
        push(kind, off, len, 100 + k as u64);
    }
    out
}

fn qemu_io_write(s: &Scratch, img: &Path, fmt: &str, cmds: &[String]) {
    let mut c = s.qemu_io();
    c.args(["-f", fmt]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(img);
    ok(&mut c);
}

fn create_qcow2(s: &Scratch, img: &Path, o: &Opts, size: u64, backing: Option<(&str, &str)>) {
    let mut c = s.qemu_img();
    c.args(["create", "-q", "-f", "qcow2", "-o", &o.string()]);
    if let Some((b, f)) = backing {
        c.args(["-b", b, "-F", f]);
    }
    c.arg(img).arg(size.to_string());
    ok(&mut c);
}

fn raw_via(s: &Scratch, img: &Path, vdcache: bool, out: &str) -> Vec<u8> {
    let dst = s.path(out);
    let mut c = if vdcache { s.vdcache() } else { s.qemu_img() };
    c.args(["convert", "-O", "raw"]).arg(img).arg(&dst);
    let o = exec(&mut c);
    if vdcache {
        assert_no_panic(&o);
    }
    assert!(o.success(), "convert failed\n{}", o.report());
    let data = std::fs::read(&dst).expect("read converted raw");
    std::fs::remove_file(&dst).expect("remove converted raw");
    data
}

/// Uniform runs (offset, length, byte) of `data`, a few interesting ones.
fn pick_runs(data: &[u8], cluster: u64) -> Vec<(u64, u64, u8)> {
    let mut runs = Vec::new();
    let mut i = 0usize;
    while i < data.len() {
        let b = data[i];
        let mut j = i + 1;
        while j < data.len() && data[j] == b {
            j += 1;
        }
        runs.push((i as u64, (j - i) as u64, b));
        i = j;
    }
    let mut picked: Vec<(u64, u64, u8)> = Vec::new();
    let mut add = |r: Option<&(u64, u64, u8)>| {
        if let Some(&r) = r
            && !picked.contains(&r)
        {
            picked.push(r);
        }
    };
    add(runs.iter().filter(|r| r.2 != 0).max_by_key(|r| r.1));
    add(runs.iter().filter(|r| r.2 == 0).max_by_key(|r| r.1));
    add(runs
        .iter()
        .find(|r| r.2 != 0 && r.0 % 512 != 0 && r.0 / cluster != (r.0 + r.1 - 1) / cluster));
    add(runs
        .iter()
        .find(|r| r.2 != 0 && r.1 < 512 && r.0 % 512 != 0));
    add(runs.iter().filter(|r| r.2 == 0 && r.1 < cluster).nth(1));
    add(runs.last());
    picked
}

/// `vdcache io -r` verifies the picked runs, and fails on a wrong pattern.
fn verify_reads(s: &Scratch, img: &Path, expected: &[u8], cluster: u64) {
    let runs = pick_runs(expected, cluster);
    let mut c = s.vdcache();
    c.arg("io").arg("-r");
    for (off, len, b) in &runs {
        c.args(["-c", &format!("read -P 0x{b:02x} {off} {len}")]);
    }
    c.arg(img);
    let o = exec(&mut c);
    assert_no_panic(&o);
    assert!(
        o.success() && !o.all().contains("verification failed"),
        "vdcache io read -P over runs of qemu-img's output failed\n{}",
        o.report()
    );
    let (off, len, b) = runs[0];
    let mut c = s.vdcache();
    c.args([
        "io",
        "-r",
        "-c",
        &format!("read -P 0x{:02x} {off} {len}", b ^ 0xff),
    ])
    .arg(img);
    let o = exec(&mut c);
    assert_no_panic(&o);
    assert_eq!(
        o.code(),
        Some(1),
        "a wrong read -P pattern must fail with exit 1\n{}",
        o.report()
    );
    assert!(
        o.all().contains("Pattern verification failed"),
        "{}",
        o.report()
    );
}

fn json(o: &common::Out) -> Value {
    serde_json::from_str(&o.stdout)
        .unwrap_or_else(|e| panic!("bad JSON from {}: {e}\n{}", o.desc, o.report()))
}

fn specific<'a>(layer: &'a Value, key: &str) -> Option<&'a Value> {
    let fs = layer.get("format-specific")?;
    fs.get("data")
        .and_then(|d| d.get(key))
        .or_else(|| fs.get(key))
}

/// `vdcache info --json` against `qemu-img info --output=json --backing-chain`.
fn compare_info(s: &Scratch, img: &Path) {
    let mut q = s.qemu_img();
    q.args(["info", "--output=json", "--backing-chain", "-U"])
        .arg(img);
    let q = json(&ok(&mut q));
    let q = q
        .as_array()
        .expect("qemu-img info --backing-chain gives an array");
    let mut v = s.vdcache();
    v.args(["info", "--json"]).arg(img);
    let vo = exec(&mut v);
    assert_no_panic(&vo);
    assert!(vo.success(), "{}", vo.report());
    let v = json(&vo);
    let mut vl = vec![v.clone()];
    if let Some(chain) = v.get("backing-chain").and_then(Value::as_array) {
        vl.extend(chain.iter().cloned());
    }
    assert_eq!(
        vl.len(),
        q.len(),
        "chain length: vdcache info shows {} layers, qemu-img {} for {}",
        vl.len(),
        q.len(),
        img.display()
    );
    for (depth, (ql, vl)) in q.iter().zip(&vl).enumerate() {
        for key in ["virtual-size", "cluster-size", "backing-filename", "format"] {
            assert_eq!(
                vl.get(key),
                ql.get(key),
                "info field '{key}' of layer {depth} of {}: vdcache vs qemu-img\nvdcache: {vl}",
                img.display()
            );
        }
        if let Some(data) = ql
            .get("format-specific")
            .and_then(|f| f.get("data"))
            .and_then(Value::as_object)
        {
            for key in [
                "compat",
                "compression-type",
                "refcount-bits",
                "extended-l2",
                "lazy-refcounts",
                "corrupt",
            ] {
                if let Some(want) = data.get(key) {
                    assert_eq!(
                        specific(vl, key),
                        Some(want),
                        "info format-specific '{key}' of layer {depth} of {}",
                        img.display()
                    );
                }
            }
        }
    }
}

/// Both checkers call the image clean.
fn both_check_clean(s: &Scratch, img: &Path) {
    let mut q = s.qemu_img();
    q.arg("check").arg(img);
    let qo = exec(&mut q);
    assert_eq!(qo.code(), Some(0), "qemu-img check\n{}", qo.report());
    let mut v = s.vdcache();
    v.arg("check").arg(img);
    let vo = exec(&mut v);
    assert_no_panic(&vo);
    assert_eq!(
        vo.code(),
        Some(0),
        "vdcache check disagrees with qemu-img check (exit 0)\n{}",
        vo.report()
    );
}

/// Everything vdcache must agree with QEMU on for one image (the top of a
/// chain); `qcow2_layers` are checked with both checkers.
fn verify(s: &Scratch, img: &Path, cluster: u64, qcow2_layers: &[&Path]) -> Vec<u8> {
    let want = raw_via(s, img, false, "ref-qemu.raw");
    let got = raw_via(s, img, true, "out-vdcache.raw");
    assert_same_bytes(
        &format!(
            "vdcache convert -O raw {} vs qemu-img convert -O raw",
            img.display()
        ),
        &want,
        &got,
    );
    verify_reads(s, img, &want, cluster);
    compare_info(s, img);
    for l in qcow2_layers {
        both_check_clean(s, l);
    }
    want
}

fn single(name: &str, o: Opts, size: u64, seed: u64) {
    let s = Scratch::new();
    let img = s.path(&format!("{name}.qcow2"));
    create_qcow2(&s, &img, &o, size, None);
    let cmds = workload(seed, size, o.cluster, o.subcluster(), 60);
    qemu_io_write(&s, &img, "qcow2", &cmds);
    verify(&s, &img, o.cluster, &[&img]);
    s.finish();
}

#[test]
fn c512_compat11_refcount1() {
    single("c512-v3-rb1", Opts::new(512, "1.1", 1, false), 4 * M, 1);
}

#[test]
fn c512_compat010() {
    single("c512-v2", Opts::new(512, "0.10", 16, false), 4 * M, 2);
}

#[test]
fn c4k_compat11_refcount2_lazy() {
    let mut o = Opts::new(4 * K, "1.1", 2, false);
    o.lazy = true;
    single("c4k-v3-rb2-lazy", o, 8 * M, 3);
}

#[test]
fn c4k_compat010() {
    single("c4k-v2", Opts::new(4 * K, "0.10", 16, false), 8 * M, 4);
}

#[test]
fn c16k_extended_l2_refcount64() {
    single(
        "c16k-el2-rb64",
        Opts::new(16 * K, "1.1", 64, true),
        8 * M,
        5,
    );
}

#[test]
fn c64k_compat11_refcount4() {
    single("c64k-v3-rb4", Opts::new(64 * K, "1.1", 4, false), 8 * M, 6);
}

#[test]
fn c64k_extended_l2_refcount8() {
    single("c64k-el2-rb8", Opts::new(64 * K, "1.1", 8, true), 8 * M, 7);
}

#[test]
fn c64k_compat010() {
    single("c64k-v2", Opts::new(64 * K, "0.10", 16, false), 8 * M, 8);
}

#[test]
fn c2m_extended_l2_refcount32() {
    single("c2m-el2-rb32", Opts::new(2 * M, "1.1", 32, true), 16 * M, 9);
}

#[test]
fn c2m_compat010() {
    single("c2m-v2", Opts::new(2 * M, "0.10", 16, false), 16 * M, 10);
}

#[test]
fn c2m_compat11_refcount64() {
    single(
        "c2m-v3-rb64",
        Opts::new(2 * M, "1.1", 64, false),
        16 * M,
        11,
    );
}

/// Compressible, incompressible, zero and single-byte stretches.
fn mixed_content(size: u64, seed: u64) -> Vec<u8> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut v = Vec::with_capacity(size as usize);
    let mut n = 0u64;
    while (v.len() as u64) < size {
        let len = (rng.random_range(1..40u64) * 1536).min(size - v.len() as u64) as usize;
        match rng.random_range(0..5u32) {
            0 => v.resize(v.len() + len, 0),
            1 => {
                let line = format!("vdcache compressible line {n} ");
                v.extend(line.bytes().cycle().take(len));
            }
            2 => v.extend((0..len).map(|_| rng.random::<u8>())),
            3 => {
                let b = rng.random_range(1..=255u8);
                v.resize(v.len() + len, b)
            }
            _ => {
                v.extend((0..len / 2).map(|_| rng.random::<u8>()));
                v.resize(v.len() + (len - len / 2), 0)
            }
        }
        n += 1;
    }
    v
}

fn compressed(name: &str, opts: &str, cluster: u64, seed: u64) {
    let s = Scratch::new();
    let size = 8 * M;
    let src = s.path(&format!("{name}-src.raw"));
    let content = mixed_content(size, seed);
    std::fs::write(&src, &content).expect("write source");
    let img = s.path(&format!("{name}.qcow2"));
    let mut c = s.qemu_img();
    c.args(["convert", "-c", "-f", "raw", "-O", "qcow2", "-o", opts])
        .arg(&src)
        .arg(&img);
    ok(&mut c);
    let got = verify(&s, &img, cluster, &[&img]);
    assert_same_bytes("compressed image vs its source", &content, &got);
    // Partial overwrites of compressed clusters: QEMU decompresses, merges
    // and writes a normal cluster; the rest stays compressed.
    let sub = if opts.contains("extended_l2=on") {
        cluster / 32
    } else {
        cluster
    };
    qemu_io_write(
        &s,
        &img,
        "qcow2",
        &workload(seed + 1, size, cluster, sub, 25),
    );
    verify(&s, &img, cluster, &[&img]);
    s.finish();
}

#[test]
fn compressed_zlib_64k() {
    compressed("zlib-64k", "compression_type=zlib", 64 * K, 21);
}

#[test]
fn compressed_zlib_512_compat010() {
    compressed(
        "zlib-512-v2",
        "compression_type=zlib,cluster_size=512,compat=0.10",
        512,
        22,
    );
}

#[test]
fn compressed_zstd_4k_refcount2() {
    compressed(
        "zstd-4k-rb2",
        "compression_type=zstd,cluster_size=4096,refcount_bits=2",
        4 * K,
        23,
    );
}

#[test]
fn compressed_zstd_extended_l2_64k() {
    compressed(
        "zstd-64k-el2",
        "compression_type=zstd,extended_l2=on",
        64 * K,
        24,
    );
}

#[test]
fn compressed_zstd_2m() {
    compressed(
        "zstd-2m",
        "compression_type=zstd,cluster_size=2M",
        2 * M,
        25,
    );
}

/// One layer of a chain: a raw base or a qcow2 image over the previous.
enum Layer {
    Raw {
        name: &'static str,
        size: u64,
    },
    Qcow2 {
        name: &'static str,
        size: u64,
        opts: Opts,
        /// The backing name as recorded in the header (relative to this image).
        backing_name: Option<&'static str>,
    },
}

/// Builds the chain bottom-up, writing every level with qemu-io in its own
/// places, and verifies every prefix of the chain (1..=n images).
fn chain(layers: &[Layer], seed: u64) {
    let s = Scratch::new();
    let mut built: Vec<(PathBuf, &'static str, u64)> = Vec::new(); // path, format, cluster
    let mut qcow2s: Vec<PathBuf> = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let seed = seed * 100 + i as u64;
        match l {
            Layer::Raw { name, size } => {
                let p = s.path(name);
                if let Some(d) = p.parent() {
                    std::fs::create_dir_all(d).expect("mkdir");
                }
                let mut c = s.qemu_img();
                c.args(["create", "-q", "-f", "raw"])
                    .arg(&p)
                    .arg(size.to_string());
                ok(&mut c);
                qemu_io_write(&s, &p, "raw", &workload(seed, *size, 64 * K, 64 * K, 30));
                built.push((p, "raw", 64 * K));
            }
            Layer::Qcow2 {
                name,
                size,
                opts,
                backing_name,
            } => {
                let p = s.path(name);
                if let Some(d) = p.parent() {
                    std::fs::create_dir_all(d).expect("mkdir");
                }
                let backing = match (backing_name, built.last()) {
                    (Some(b), Some((_, fmt, _))) => Some((*b, *fmt)),
                    (None, None) => None,
                    _ => panic!("layer {i}: backing name and chain disagree"),
                };
                create_qcow2(&s, &p, opts, *size, backing);
                qemu_io_write(
                    &s,
                    &p,
                    "qcow2",
                    &workload(seed, *size, opts.cluster, opts.subcluster(), 40),
                );
                qcow2s.push(p.clone());
                built.push((p, "qcow2", opts.cluster));
            }
        }
    }
    for (p, _, cluster) in &built {
        let this: Vec<&Path> = qcow2s
            .iter()
            .filter(|q| *q == p)
            .map(PathBuf::as_path)
            .collect();
        verify(&s, p, *cluster, &this);
    }
    s.finish();
}

#[test]
fn chain2_qcow2_over_raw() {
    chain(
        &[
            Layer::Raw {
                name: "c2-base.raw",
                size: 8 * M,
            },
            Layer::Qcow2 {
                name: "c2-top.qcow2",
                size: 8 * M,
                opts: Opts::new(64 * K, "1.1", 16, false),
                backing_name: Some("c2-base.raw"),
            },
        ],
        31,
    );
}

/// A raw base smaller than the images above it, a v2 middle image in a
/// subdirectory (its backing name is relative to that subdirectory), and
/// an extended-L2 top.
#[test]
fn chain3_mixed_over_short_raw_in_subdir() {
    chain(
        &[
            Layer::Raw {
                name: "c3-sub/c3-base.raw",
                size: 3 * M + 512 * 3,
            },
            Layer::Qcow2 {
                name: "c3-sub/c3-mid.qcow2",
                size: 6 * M,
                opts: Opts::new(4 * K, "0.10", 16, false),
                backing_name: Some("c3-base.raw"),
            },
            Layer::Qcow2 {
                name: "c3-top.qcow2",
                size: 8 * M,
                opts: Opts::new(64 * K, "1.1", 8, true),
                backing_name: Some("c3-sub/c3-mid.qcow2"),
            },
        ],
        32,
    );
}

/// Four qcow2 images, every one different.
#[test]
fn chain4_all_qcow2() {
    chain(
        &[
            Layer::Qcow2 {
                name: "c4-l0.qcow2",
                size: 8 * M,
                opts: Opts::new(512, "1.1", 16, false),
                backing_name: None,
            },
            Layer::Qcow2 {
                name: "c4-l1.qcow2",
                size: 8 * M,
                opts: Opts::new(64 * K, "0.10", 16, false),
                backing_name: Some("c4-l0.qcow2"),
            },
            Layer::Qcow2 {
                name: "c4-l2.qcow2",
                size: 8 * M,
                opts: Opts::new(16 * K, "1.1", 2, true),
                backing_name: Some("c4-l1.qcow2"),
            },
            Layer::Qcow2 {
                name: "c4-l3.qcow2",
                size: 12 * M,
                opts: Opts::new(4 * K, "1.1", 32, false),
                backing_name: Some("c4-l2.qcow2"),
            },
        ],
        33,
    );
}

/// Four images ending in raw, with 2 MiB and 512 B clusters in the middle.
#[test]
fn chain4_over_raw() {
    chain(
        &[
            Layer::Raw {
                name: "c4r-base.raw",
                size: 8 * M,
            },
            Layer::Qcow2 {
                name: "c4r-l1.qcow2",
                size: 8 * M,
                opts: Opts::new(2 * M, "1.1", 1, true),
                backing_name: Some("c4r-base.raw"),
            },
            Layer::Qcow2 {
                name: "c4r-l2.qcow2",
                size: 8 * M,
                opts: Opts::new(512, "1.1", 4, false),
                backing_name: Some("c4r-l1.qcow2"),
            },
            Layer::Qcow2 {
                name: "c4r-l3.qcow2",
                size: 8 * M,
                opts: Opts::new(32 * K, "1.1", 64, true),
                backing_name: Some("c4r-l2.qcow2"),
            },
        ],
        34,
    );
}

/// A compressed (zstd) base under a delta.
#[test]
fn chain2_over_compressed_base() {
    let s = Scratch::new();
    let size = 8 * M;
    let src = s.path("cz-src.raw");
    std::fs::write(&src, mixed_content(size, 41)).expect("write source");
    let base = s.path("cz-base.qcow2");
    let mut c = s.qemu_img();
    c.args([
        "convert",
        "-c",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "compression_type=zstd,cluster_size=16k",
    ])
    .arg(&src)
    .arg(&base);
    ok(&mut c);
    let top = s.path("cz-top.qcow2");
    let o = Opts::new(64 * K, "1.1", 16, true);
    create_qcow2(&s, &top, &o, size, Some(("cz-base.qcow2", "qcow2")));
    qemu_io_write(&s, &top, "qcow2", &workload(42, size, 64 * K, 2 * K, 40));
    verify(&s, &top, 64 * K, &[&base, &top]);
    s.finish();
}

/// Internal snapshots: vdcache reads and writes the active layer and keeps
/// every snapshot intact.
fn snapshots(name: &str, o: Opts, snaps: &[&str], seed: u64) {
    let s = Scratch::new();
    let size = 8 * M;
    let img = s.path(&format!("{name}.qcow2"));
    create_qcow2(&s, &img, &o, size, None);
    let mut saved: Vec<(&str, Vec<u8>)> = Vec::new();
    for (i, snap) in snaps.iter().enumerate() {
        let cmds = workload(seed + i as u64, size, o.cluster, o.subcluster(), 40);
        qemu_io_write(&s, &img, "qcow2", &cmds);
        let before = raw_via(&s, &img, false, "before-snap.raw");
        let mut c = s.qemu_img();
        c.args(["snapshot", "-c", snap]).arg(&img);
        ok(&mut c);
        saved.push((snap, before));
    }
    // QEMU writes more after the last snapshot (COW of shared clusters).
    let more = workload(seed + 50, size, o.cluster, o.subcluster(), 40);
    qemu_io_write(&s, &img, "qcow2", &more);
    verify(&s, &img, o.cluster, &[&img]);

    // vdcache info lists the snapshots qemu-img lists.
    let mut v = s.vdcache();
    v.args(["info", "--json"]).arg(&img);
    let vo = exec(&mut v);
    assert_no_panic(&vo);
    let vj = json(&vo);
    let names: Vec<&str> = vj
        .get("snapshots")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|x| x["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, snaps, "vdcache info snapshot names\n{}", vo.report());

    // The same writes through vdcache (on the image) and qemu-io (on a copy).
    let twin = s.path(&format!("{name}-twin.qcow2"));
    std::fs::copy(&img, &twin).expect("copy image");
    let cmds = workload(seed + 77, size, o.cluster, o.subcluster(), 60);
    let mut c = s.vdcache();
    c.arg("io");
    for cmd in &cmds {
        c.args(["-c", cmd]);
    }
    c.arg(&img);
    let vo = exec(&mut c);
    assert_no_panic(&vo);
    assert!(
        vo.success(),
        "vdcache io writes on an image with snapshots\n{}",
        vo.report()
    );
    qemu_io_write(&s, &twin, "qcow2", &cmds);

    let mut q = s.qemu_img();
    q.arg("check").arg(&img);
    let qo = exec(&mut q);
    assert_eq!(
        qo.code(),
        Some(0),
        "qemu-img check after vdcache wrote to an image with snapshots\n{}",
        qo.report()
    );
    let want = raw_via(&s, &twin, false, "twin.raw");
    let got = raw_via(&s, &img, false, "after.raw");
    assert_same_bytes(
        "active layer after vdcache io vs after qemu-io (both read by qemu-img)",
        &want,
        &got,
    );
    verify(&s, &img, o.cluster, &[&img]);

    let mut q = s.qemu_img();
    q.args(["snapshot", "-l"]).arg(&img);
    let qo = ok(&mut q);
    for (snap, old) in &saved {
        assert!(
            qo.stdout.contains(snap),
            "snapshot {snap} is gone\n{}",
            qo.report()
        );
        let dst = s.path("snap-out.raw");
        let mut c = s.qemu_img();
        c.args([
            "convert",
            "-l",
            &format!("snapshot.name={snap}"),
            "-O",
            "raw",
        ])
        .arg(&img)
        .arg(&dst);
        ok(&mut c);
        let data = std::fs::read(&dst).expect("read snapshot raw");
        std::fs::remove_file(&dst).expect("remove snapshot raw");
        assert_same_bytes(
            &format!("snapshot {snap} after vdcache wrote to the active layer"),
            old,
            &data,
        );
    }
    s.finish();
}

#[test]
fn snapshot_c64k_compat11() {
    snapshots(
        "snap-64k",
        Opts::new(64 * K, "1.1", 16, false),
        &["snap1"],
        51,
    );
}

#[test]
fn snapshot_c4k_compat010() {
    snapshots(
        "snap-4k-v2",
        Opts::new(4 * K, "0.10", 16, false),
        &["snap1"],
        52,
    );
}

#[test]
fn snapshots_two_c32k_extended_l2_refcount4() {
    snapshots(
        "snap-32k-el2",
        Opts::new(32 * K, "1.1", 4, true),
        &["snap1", "snap2"],
        53,
    );
}
