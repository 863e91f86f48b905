//! Property test: random operations on a chain in memory, compared after
//! every read with a plain byte-array model of the guest disk; at the end
//! the image is closed, reopened, compared whole and checked for leaks and
//! corruption. Some chains leave every allocating write they can to the
//! disk's workers (deferred copy-on-write), from the first write on.

use proptest::prelude::*;
use std::path::Path;
use std::sync::Arc;
use vdcache_image::{
    CreateOptions, ImageFormat, Layer, MemFiles, MetaCacheConfig, OpenOptions, VirtualDisk,
    ZeroFlags, open_chain, qcow2_image_bytes,
};

const SIZE: u64 = 1 << 20;

#[derive(Debug, Clone)]
struct Config {
    cluster_size: u64,
    version: u32,
    refcount_bits: u32,
    extended_l2: bool,
    backing: bool,
    slice: Option<u64>,
    tiny_cache: bool,
    lazy: bool,
    deferred: bool,
}

#[derive(Debug, Clone)]
enum Op {
    Write { off: u64, len: u64, byte: u8 },
    Zero { off: u64, len: u64, unmap: bool },
    Discard { off: u64, len: u64 },
    Read { off: u64, len: u64 },
    Flush,
    Reopen,
}

fn config() -> impl Strategy<Value = Config> {
    (
        prop::sample::select(vec![512u64, 4096, 16384, 65536]),
        prop::bool::ANY,
        prop::sample::select(vec![1u32, 2, 8, 16, 64]),
        prop::bool::ANY,
        prop::bool::ANY,
        prop::option::of(prop::sample::select(vec![512u64, 4096])),
        prop::bool::ANY,
        prop::bool::ANY,
        prop::bool::ANY,
    )
        .prop_map(|(cs, v3, rb, ext, backing, slice, tiny, lazy, deferred)| {
            let version = if v3 { 3 } else { 2 };
            Config {
                cluster_size: cs,
                version,
                refcount_bits: if version == 2 { 16 } else { rb },
                extended_l2: v3 && ext && cs >= 16384,
                backing,
                slice,
                tiny_cache: tiny,
                lazy: v3 && lazy,
                deferred: backing && deferred,
            }
        })
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        (0..SIZE, 1..70_000u64),
        (
            (0..SIZE / 512),
            prop::sample::select(vec![512u64, 2048, 4096, 65536, 131072])
        )
            .prop_map(|(s, l)| (s * 512, l)),
    ]
    .prop_map(|(off, len)| (off, len.min(SIZE - off).max(1)))
    .prop_filter("inside the disk", |(off, len)| off + len <= SIZE)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (range(), any::<u8>()).prop_map(|((off, len), byte)| Op::Write { off, len, byte }),
        2 => (range(), any::<bool>()).prop_map(|((off, len), unmap)| Op::Zero { off, len, unmap }),
        2 => range().prop_map(|(off, len)| Op::Discard { off, len }),
        3 => range().prop_map(|(off, len)| Op::Read { off, len }),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
    ]
}

fn open(files: &Arc<MemFiles>, c: &Config) -> Arc<VirtualDisk> {
    let cache = if c.tiny_cache {
        MetaCacheConfig {
            l2_bytes: 1024,
            refcount_bytes: 1024,
            slice_bytes: c.slice,
        }
    } else {
        MetaCacheConfig {
            slice_bytes: c.slice,
            ..MetaCacheConfig::default()
        }
    };
    let disk = Arc::new(
        open_chain(
            "dir/top.qcow2",
            &OpenOptions {
                cache,
                format: Some(ImageFormat::Qcow2),
                opener: files.clone(),
                ..OpenOptions::default()
            },
        )
        .expect("open"),
    );
    if c.deferred {
        disk.defer_cow_writes(0);
    }
    disk
}

fn setup(c: &Config) -> (Arc<MemFiles>, Vec<u8>) {
    let files = MemFiles::new();
    let mut model = vec![0u8; SIZE as usize];
    let mut opts = CreateOptions {
        size: Some(SIZE),
        cluster_size: c.cluster_size,
        version: c.version,
        refcount_bits: c.refcount_bits,
        extended_l2: c.extended_l2,
        lazy_refcounts: c.lazy,
        ..CreateOptions::default()
    };
    if c.backing {
        for (i, b) in model.iter_mut().enumerate() {
            *b = (i / 4096 % 200) as u8 + 1;
        }
        // A raw base, partly smaller than the delta: the tail reads zeros.
        model[(SIZE - 65536) as usize..].fill(0);
        files.insert("dir/base.raw", model[..(SIZE - 65536) as usize].to_vec());
        opts.backing = Some(("base.raw".into(), ImageFormat::Raw));
    }
    let bytes = qcow2_image_bytes(Path::new("top"), &opts, SIZE).expect("create");
    files.insert("dir/top.qcow2", bytes);
    (files, model)
}

/// What a discard does to the model: whole clusters read as zeros, unless
/// a version 2 image has a backing file (then nothing changes).
fn discard_model(model: &mut [u8], c: &Config, off: u64, len: u64) {
    if c.version == 2 && c.backing {
        return;
    }
    let cs = c.cluster_size;
    let first = off.div_ceil(cs) * cs;
    let end = (off + len) / cs * cs;
    if first < end {
        model[first as usize..end as usize].fill(0);
    }
}

fn run(c: &Config, ops: &[Op]) -> Result<(), TestCaseError> {
    let (files, mut model) = setup(c);
    let mut disk = open(&files, c);
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Write { off, len, byte } => {
                disk.write(off, &vec![byte; len as usize], false)
                    .expect("write");
                model[off as usize..(off + len) as usize].fill(byte);
            }
            Op::Zero { off, len, unmap } => {
                disk.write_zeroes(
                    off,
                    len,
                    ZeroFlags {
                        may_unmap: unmap,
                        fua: false,
                    },
                )
                .expect("zero");
                model[off as usize..(off + len) as usize].fill(0);
            }
            Op::Discard { off, len } => {
                disk.discard(off, len).expect("discard");
                discard_model(&mut model, c, off, len);
            }
            Op::Read { off, len } => {
                let mut buf = vec![0u8; len as usize];
                disk.read(off, &mut buf).expect("read");
                prop_assert!(
                    buf == model[off as usize..(off + len) as usize],
                    "op {i}: read {off}+{len} differs"
                );
            }
            Op::Flush => disk.flush().expect("flush"),
            Op::Reopen => {
                disk.close().expect("close");
                disk = open(&files, c);
            }
        }
    }
    disk.close().expect("close");
    let disk = open(&files, c);
    let mut all = vec![0u8; SIZE as usize];
    disk.read(0, &mut all).expect("read all");
    let first_diff = all.iter().zip(&model).position(|(a, b)| a != b);
    prop_assert!(
        first_diff.is_none(),
        "after reopen, first difference at {first_diff:?}"
    );
    let Layer::Qcow2(img) = &disk.layers()[0] else {
        unreachable!()
    };
    let report = img.check().expect("check");
    prop_assert!(
        report.is_clean(),
        "check: {:?} {:?}",
        report.corruptions,
        report.leaks
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]
    #[test]
    fn engine_matches_model(c in config(), ops in prop::collection::vec(op(), 1..50)) {
        run(&c, &ops)?;
    }
}
