//! The generator of the malformed corpus (tests/data/malformed): every image
//! starts as a real image made by qemu-img / qemu-io, and is then patched at
//! the offsets of the qcow2 specification. What each image should make
//! vdcache do is in MANIFEST.toml next to the images, not here.
//!
//! Regenerate (after a change here) with
//! `cargo test --release -p vdcache --test integration -- --ignored regenerate_corpus`;
//! it rewrites the images and SHA256SUMS. This module writes only into the
//! directory it is given.

use crate::common::{Scratch, be64, ok, put_be32, put_be64};
use crate::qcow2_patch::*;
use std::path::{Path, PathBuf};

/// All images use 2 KiB clusters (so each is a few clusters: 6 for the
/// plain base) and a 4 MiB disk (L1 has 8 entries, each L2 maps 512 KiB).
const OPTS: &str = "cluster_size=2048";
const DISK: &str = "4M";
/// Guest cluster 0 holds 0x5a; everything else is unallocated.
const WRITE: &str = "write -P 0x5a 0 2k";

/// The real image a case starts from.
#[derive(Clone, Copy)]
enum Base {
    /// Header 0, refcount table 0x800, refcount block 0x1000, L1 0x1800,
    /// L2 0x2000, guest cluster 0 at 0x2800.
    Plain,
    /// Plain plus one internal snapshot (`qemu-img snapshot -c s1`), then
    /// guest cluster 1 written (so the snapshot table is not at the end of
    /// the file).
    Snapshot,
    /// Guest cluster 0 written compressed (`write -c`).
    Compressed,
    /// Plain plus a persistent dirty bitmap (`qemu-img bitmap --add`).
    Bitmap,
    /// Plain plus one internal snapshot, nothing after it: the snapshot
    /// table ends the file, unpadded (as QEMU writes it). Only a control.
    SnapshotAtEnd,
    /// No data, backing file NAME of format FMT (`create -u -b NAME -F FMT`).
    Backing(&'static str, &'static str),
}

type Patch = fn(&mut Vec<u8>, &Layout);

/// One image: its file name, its base and the patch applied to it.
struct Case {
    file: &'static str,
    base: Base,
    patch: Patch,
}

const fn case(file: &'static str, base: Base, patch: Patch) -> Case {
    Case { file, base, patch }
}

fn incompat(b: &mut [u8], bits: u64) {
    let v = be64(b, INCOMPATIBLE_FEATURES) | bits;
    put_be64(b, INCOMPATIBLE_FEATURES, v);
}

/// Writes an unknown header extension (magic 0x0bad0e11) claiming `len`
/// bytes where the extension area starts.
fn bad_extension(b: &mut [u8], l: &Layout, len: u32) {
    assert!(
        extensions(b).is_empty(),
        "the plain base has no header extension"
    );
    put_be32(b, l.header_length, 0x0bad_0e11);
    put_be32(b, l.header_length + 4, len);
}

/// The first snapshot table entry: l1_table_offset +0, l1_size +8,
/// id_str_size +12, name_size +14, ..., extra_data_size +36.
fn snapshot_entry(l: &Layout) -> usize {
    assert_ne!(l.snapshots, 0, "the base has a snapshot table");
    l.snapshots
}

const CASES: &[Case] = &[
    // cluster_bits out of range (QEMU: 9..=21).
    case("cluster_bits_8.qcow2", Base::Plain, |b, _| {
        put_be32(b, CLUSTER_BITS, 8)
    }),
    case("cluster_bits_22.qcow2", Base::Plain, |b, _| {
        put_be32(b, CLUSTER_BITS, 22)
    }),
    case("cluster_bits_64.qcow2", Base::Plain, |b, _| {
        put_be32(b, CLUSTER_BITS, 64)
    }),
    // Oversized or undersized L1 table, virtual size overflow.
    case("l1_size_huge.qcow2", Base::Plain, |b, _| {
        put_be32(b, L1_SIZE, 0x7fff_ffff)
    }),
    case("l1_size_past_eof.qcow2", Base::Plain, |b, _| {
        put_be32(b, L1_SIZE, 0x4_0000)
    }),
    case("l1_size_too_small.qcow2", Base::Plain, |b, _| {
        put_be32(b, L1_SIZE, 4)
    }),
    case("size_overflows_l1.qcow2", Base::Plain, |b, _| {
        put_be64(b, SIZE, 0xffff_ffff_ffff_fe00)
    }),
    // L1 table offset past the end, unaligned, into the header, on other metadata.
    case("l1_offset_past_eof.qcow2", Base::Plain, |b, _| {
        put_be64(b, L1_TABLE_OFFSET, 1 << 40)
    }),
    case("l1_offset_unaligned.qcow2", Base::Plain, |b, l| {
        put_be64(b, L1_TABLE_OFFSET, l.l1 as u64 + 0x200)
    }),
    case("l1_offset_into_header.qcow2", Base::Plain, |b, _| {
        put_be64(b, L1_TABLE_OFFSET, 0)
    }),
    case("l1_table_on_refcount_table.qcow2", Base::Plain, |b, l| {
        put_be64(b, L1_TABLE_OFFSET, l.refcount_table as u64)
    }),
    // Refcount table: past the end, overflowing, unaligned, into the
    // header, oversized, overlapping the L1 table.
    case("refcount_table_past_eof.qcow2", Base::Plain, |b, _| {
        put_be64(b, REFCOUNT_TABLE_OFFSET, 1 << 40)
    }),
    case(
        "refcount_table_offset_overflow.qcow2",
        Base::Plain,
        |b, _| put_be64(b, REFCOUNT_TABLE_OFFSET, 0xffff_ffff_ffff_f800),
    ),
    case("refcount_table_unaligned.qcow2", Base::Plain, |b, l| {
        put_be64(b, REFCOUNT_TABLE_OFFSET, l.refcount_table as u64 + 0x200)
    }),
    case("refcount_table_into_header.qcow2", Base::Plain, |b, _| {
        put_be64(b, REFCOUNT_TABLE_OFFSET, 0)
    }),
    case("refcount_table_clusters_huge.qcow2", Base::Plain, |b, _| {
        put_be32(b, REFCOUNT_TABLE_CLUSTERS, 0x7fff_ffff)
    }),
    case("refcount_table_over_l1.qcow2", Base::Plain, |b, l| {
        // Grow the table over the refcount block and the L1 table.
        assert!(l.refcount_table < l.refcount_block && l.refcount_block < l.l1);
        let clusters = (l.l1 + l.cluster - l.refcount_table) / l.cluster;
        put_be32(b, REFCOUNT_TABLE_CLUSTERS, clusters as u32)
    }),
    case("refcount_order_7.qcow2", Base::Plain, |b, _| {
        put_be32(b, REFCOUNT_ORDER, 7)
    }),
    // Header length and header extensions.
    case("header_length_short.qcow2", Base::Plain, |b, _| {
        put_be32(b, HEADER_LENGTH, 96)
    }),
    case("header_length_past_cluster.qcow2", Base::Plain, |b, l| {
        put_be32(b, HEADER_LENGTH, 2 * l.cluster as u32)
    }),
    case("extension_length_huge.qcow2", Base::Plain, |b, l| {
        bad_extension(b, l, 0xffff_ff00)
    }),
    case("extension_length_loops.qcow2", Base::Plain, |b, l| {
        // 8 + 0xfffffff8 wraps a 32-bit offset back onto this extension.
        bad_extension(b, l, 0xffff_fff8)
    }),
    case("extension_past_cluster.qcow2", Base::Plain, |b, l| {
        let len = l.cluster - l.header_length - 8 + 8;
        bad_extension(b, l, len as u32)
    }),
    // Backing file names.
    case(
        "backing_name_too_long.qcow2",
        Base::Backing("base.qcow2", "qcow2"),
        |b, _| {
            let off = be64(b, BACKING_FILE_OFFSET) as usize;
            assert!(off + 1024 < 2048);
            put_be32(b, BACKING_FILE_SIZE, 1024)
        },
    ),
    case(
        "backing_name_past_cluster.qcow2",
        Base::Backing("base.qcow2", "qcow2"),
        |b, l| put_be64(b, BACKING_FILE_OFFSET, l.cluster as u64 - 4),
    ),
    case(
        "backing_json.qcow2",
        Base::Backing(
            r#"json:{"file":{"driver":"file","filename":"/etc/passwd"}}"#,
            "raw",
        ),
        |_, _| {},
    ),
    // Compression.
    case("compression_type_unknown.qcow2", Base::Plain, |b, _| {
        b[COMPRESSION_TYPE] = 2;
        incompat(b, INCOMPAT_COMPRESSION)
    }),
    case("compression_type_without_bit.qcow2", Base::Plain, |b, _| {
        b[COMPRESSION_TYPE] = 1
    }),
    case("compressed_past_eof.qcow2", Base::Compressed, |b, l| {
        // Keep the sector count, move the data 1 TiB away.
        let e = be64(b, l.l2);
        assert_ne!(e & COMPRESSED, 0, "guest cluster 0 is compressed");
        let offset_bits = 62 - (l.cluster.trailing_zeros() - 8);
        let keep = e & !((1u64 << offset_bits) - 1);
        put_be64(b, l.l2, keep | (1 << 40))
    }),
    case(
        "compressed_size_past_eof.qcow2",
        Base::Compressed,
        |b, l| {
            // Start 512 bytes before the end of the file, claim the largest
            // sector count.
            let offset_bits = 62 - (l.cluster.trailing_zeros() - 8);
            let sectors = (1u64 << (62 - offset_bits)) - 1;
            let off = (l.file_len - 512) as u64;
            put_be64(b, l.l2, COMPRESSED | (sectors << offset_bits) | off)
        },
    ),
    // Feature bits.
    case(
        "external_data_without_extension.qcow2",
        Base::Plain,
        |b, _| incompat(b, INCOMPAT_EXTERNAL_DATA),
    ),
    case("extended_l2_small_clusters.qcow2", Base::Plain, |b, _| {
        incompat(b, INCOMPAT_EXTENDED_L2)
    }),
    case("crypt_method_aes.qcow2", Base::Plain, |b, _| {
        put_be32(b, CRYPT_METHOD, 1)
    }),
    // Snapshot table.
    case("snapshot_count_huge.qcow2", Base::Snapshot, |b, _| {
        put_be32(b, NB_SNAPSHOTS, 0x10_0001)
    }),
    case("snapshot_table_past_eof.qcow2", Base::Snapshot, |b, _| {
        put_be64(b, SNAPSHOTS_OFFSET, 1 << 40)
    }),
    case("snapshot_table_on_l1.qcow2", Base::Snapshot, |b, l| {
        put_be64(b, SNAPSHOTS_OFFSET, l.l1 as u64)
    }),
    case("snapshot_l1_size_huge.qcow2", Base::Snapshot, |b, l| {
        put_be32(b, snapshot_entry(l) + 8, 0x7fff_ffff)
    }),
    case("snapshot_l1_past_eof.qcow2", Base::Snapshot, |b, l| {
        put_be64(b, snapshot_entry(l), 1 << 40)
    }),
    case("snapshot_extra_data_huge.qcow2", Base::Snapshot, |b, l| {
        put_be32(b, snapshot_entry(l) + 36, 0xffff_fff0)
    }),
    // Bitmaps.
    case("bitmap_directory_past_eof.qcow2", Base::Bitmap, |b, _| {
        // nb_bitmaps +0, reserved +4, directory_size +8, directory_offset +16.
        let d = extension_data(b, EXT_BITMAPS);
        put_be64(b, d + 16, 1 << 40)
    }),
    // L2 entries on metadata, unaligned, past the end.
    case("l2_entry_on_l1.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | l.l1 as u64)
    }),
    case("l2_entry_into_header.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | 0x200)
    }),
    case("l2_entry_on_refcount_table.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | l.refcount_table as u64)
    }),
    case("l2_entry_on_refcount_block.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | l.refcount_block as u64)
    }),
    case("l2_entry_on_own_l2.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | l.l2 as u64)
    }),
    case("l2_entry_unaligned.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | (l.data0 as u64 + 0x200))
    }),
    case("l2_entry_past_eof.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l2, COPIED | 1 << 32)
    }),
    // L1 entries on metadata, into the header, past the end, shared.
    case("l1_entry_on_l1.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l1, COPIED | l.l1 as u64)
    }),
    case("l1_entry_into_header.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l1, COPIED | 0x200)
    }),
    case("l1_entry_copied_offset_zero.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l1 + 8, COPIED)
    }),
    case("l1_entry_on_refcount_table.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l1, COPIED | l.refcount_table as u64)
    }),
    case("l1_entry_past_eof.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.l1, COPIED | 1 << 32)
    }),
    case("l1_entries_share_l2.qcow2", Base::Plain, |b, l| {
        let e = be64(b, l.l1);
        put_be64(b, l.l1 + 8, e)
    }),
    // Refcount table entries (refcount blocks) on metadata, zero, past the end.
    case("refcount_block_on_l1.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.refcount_table, l.l1 as u64)
    }),
    case("refcount_block_offset_zero.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.refcount_table, 0)
    }),
    case("refcount_block_into_header.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.refcount_table, 0x200)
    }),
    case("refcount_block_past_eof.qcow2", Base::Plain, |b, l| {
        put_be64(b, l.refcount_table, 1 << 40)
    }),
];

/// The file names of every image the generator makes (including the
/// backing-loop images, which are made by qemu-img alone).
pub fn names() -> Vec<&'static str> {
    let mut v: Vec<&str> = CASES.iter().map(|c| c.file).collect();
    v.extend(LOOPS);
    v.sort_unstable();
    v
}

const LOOPS: [&str; 3] = [
    "backing_loop_a.qcow2",
    "backing_loop_b.qcow2",
    "backing_self_loop.qcow2",
];

/// `qemu-img create -u -b BACKING -F FMT` (the backing file need not exist).
fn with_backing(s: &Scratch, name: &str, backing: &str, fmt: &str) -> (PathBuf, Vec<u8>) {
    let p = s.path(name);
    let mut c = s.qemu_img();
    c.args(["create", "-q", "-f", "qcow2", "-o", OPTS, "-u"])
        .args(["-b", backing, "-F", fmt])
        .arg(&p)
        .arg(DISK);
    ok(&mut c);
    let b = std::fs::read(&p).expect("read image");
    (p, b)
}

fn make_base(s: &Scratch, name: &str, base: Base) -> Vec<u8> {
    let (p, b) = match base {
        Base::Plain | Base::Snapshot | Base::SnapshotAtEnd | Base::Bitmap => {
            base_image(s, name, OPTS, DISK, &[WRITE])
        }
        Base::Compressed => base_image(s, name, OPTS, DISK, &["write -c -P 0x5a 0 2k"]),
        Base::Backing(backing, fmt) => with_backing(s, name, backing, fmt),
    };
    let extra: &[&str] = match base {
        Base::Snapshot | Base::SnapshotAtEnd => &["snapshot", "-c", "s1"],
        Base::Bitmap => &["bitmap", "--add"],
        _ => return b,
    };
    let mut c = s.qemu_img();
    c.args(extra).arg(&p);
    if matches!(base, Base::Bitmap) {
        c.arg("b0");
    }
    ok(&mut c);
    if matches!(base, Base::Snapshot) {
        let mut c = s.qemu_io();
        c.args(["-c", "write -P 0x77 2k 2k"]).arg(&p);
        ok(&mut c);
    }
    let mut b = std::fs::read(&p).expect("read image");
    if matches!(base, Base::Snapshot | Base::SnapshotAtEnd) {
        // The snapshot's date (date_sec +16, date_nsec +20) would make
        // every regeneration differ.
        let entry = be64(&b, SNAPSHOTS_OFFSET) as usize;
        b[entry + 16..entry + 24].fill(0);
    }
    b
}

/// a -> b -> a, and an image that is its own backing file.
fn make_loops(s: &Scratch, out: &Path) {
    let [a, b, me] = LOOPS;
    for (file, backing) in [(a, b), (b, a), (me, me)] {
        let (_, bytes) = with_backing(s, file, backing, "qcow2");
        std::fs::write(out.join(file), bytes).expect("write loop image");
    }
}

/// Makes every image into `out` (which must exist).
pub fn generate(s: &Scratch, out: &Path) {
    for c in CASES {
        let mut b = make_base(s, c.file, c.base);
        let layout = Layout::of(&b);
        let before = b.clone();
        (c.patch)(&mut b, &layout);
        assert!(
            b != before || matches!(c.base, Base::Backing(..)),
            "{}: the patch changed nothing",
            c.file
        );
        std::fs::write(out.join(c.file), &b).expect("write image");
    }
    make_loops(s, out);
}

/// Makes the unpatched bases into `out` (controls); returns their names.
pub fn generate_bases(s: &Scratch, out: &Path) -> Vec<&'static str> {
    let bases = [
        ("base_plain.qcow2", Base::Plain),
        ("base_snapshot.qcow2", Base::Snapshot),
        ("base_snapshot_at_end.qcow2", Base::SnapshotAtEnd),
        ("base_compressed.qcow2", Base::Compressed),
        ("base_bitmap.qcow2", Base::Bitmap),
    ];
    for (name, base) in bases {
        let b = make_base(s, name, base);
        std::fs::write(out.join(name), b).expect("write base");
    }
    bases.iter().map(|b| b.0).collect()
}
