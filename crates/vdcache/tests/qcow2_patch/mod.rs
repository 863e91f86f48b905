//! Making malformed qcow2 images: real images made by qemu-img (and written
//! by qemu-io), then patched with std::fs at the offsets of the qcow2
//! specification (all fields big endian). Used by the on-the-fly cases of
//! `malformed.rs` and by the corpus generator of `malformed_corpus.rs`.
//!
//! Also the words an error must use to say what is wrong. This module only
//! builds and inspects files in a test's scratch directory; it runs no
//! vdcache command.
//!
//! Header fields (offsets in the file): backing_file_offset 8,
//! backing_file_size 16, cluster_bits 20, size 24, crypt_method 32,
//! l1_size 36, l1_table_offset 40, refcount_table_offset 48,
//! refcount_table_clusters 56, nb_snapshots 60, snapshots_offset 64; v3:
//! incompatible_features 72, compatible 80, autoclear 88, refcount_order 96,
//! header_length 100, compression_type 104; extensions after header_length.

#![allow(dead_code)]

use crate::common::{Scratch, be32, be64, exec, ok, put_be32};
use std::path::{Path, PathBuf};

pub const BACKING_FILE_OFFSET: usize = 8;
pub const BACKING_FILE_SIZE: usize = 16;
pub const CLUSTER_BITS: usize = 20;
pub const SIZE: usize = 24;
pub const CRYPT_METHOD: usize = 32;
pub const L1_SIZE: usize = 36;
pub const L1_TABLE_OFFSET: usize = 40;
pub const REFCOUNT_TABLE_OFFSET: usize = 48;
pub const REFCOUNT_TABLE_CLUSTERS: usize = 56;
pub const NB_SNAPSHOTS: usize = 60;
pub const SNAPSHOTS_OFFSET: usize = 64;
pub const INCOMPATIBLE_FEATURES: usize = 72;
pub const AUTOCLEAR_FEATURES: usize = 88;
pub const REFCOUNT_ORDER: usize = 96;
pub const HEADER_LENGTH: usize = 100;
pub const COMPRESSION_TYPE: usize = 104;

/// Incompatible feature bits.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_EXTERNAL_DATA: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;

/// Header extension magics.
pub const EXT_BACKING_FORMAT: u32 = 0xE279_2ACA;
pub const EXT_BITMAPS: u32 = 0x2385_2875;

/// L1/L2 entry bits.
pub const COPIED: u64 = 1 << 63;
pub const COMPRESSED: u64 = 1 << 62;
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// Words that say an offset or size lies outside the file / a limit.
pub const OUTSIDE: &[&str] = &[
    "past",
    "beyond",
    "end of",
    "eof",
    "exceed",
    "outside",
    "bounds",
    "too large",
    "too big",
    "limit",
];

/// Every group must match (case-insensitively) at least one of its words.
pub fn names_problem(text: &str, groups: &[&[&str]]) -> bool {
    let t = text.to_lowercase();
    groups
        .iter()
        .all(|g| g.iter().any(|w| t.contains(&w.to_lowercase())))
}

/// `qemu-img create -f qcow2 -o OPTS PATH SIZE`, then each qemu-io
/// command (e.g. `write -P 0x5a 0 256k`) on it; returns the path and bytes.
pub fn base_image(
    s: &Scratch,
    name: &str,
    opts: &str,
    size: &str,
    writes: &[&str],
) -> (PathBuf, Vec<u8>) {
    let p = s.path(name);
    let mut c = s.qemu_img();
    c.args(["create", "-q", "-f", "qcow2", "-o", opts])
        .arg(&p)
        .arg(size);
    ok(&mut c);
    if !writes.is_empty() {
        let mut c = s.qemu_io();
        for w in writes {
            c.arg("-c").arg(w);
        }
        c.arg(&p);
        ok(&mut c);
    }
    let b = std::fs::read(&p).expect("read image");
    (p, b)
}

/// qemu-img itself must reject the image (so the patch really breaks it).
pub fn qemu_rejects(s: &Scratch, file: &Path) {
    let mut c = s.qemu_img();
    c.arg("info").arg(file);
    let o = exec(&mut c);
    assert!(
        !o.success(),
        "qemu-img accepted the supposedly malformed image\n{}",
        o.report()
    );
}

/// The offset of the L2 table that L1 entry 0 points to.
pub fn l2_of_first_l1(b: &[u8]) -> (usize, u64) {
    let l1 = be64(b, L1_TABLE_OFFSET) as usize;
    let e = be64(b, l1);
    (l1, e & OFFSET_MASK)
}

/// Where the metadata of an unpatched image lies (byte offsets).
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub cluster: usize,
    pub header_length: usize,
    pub l1: usize,
    pub l1_size: usize,
    pub refcount_table: usize,
    /// The refcount block of host clusters 0.. (refcount table entry 0).
    pub refcount_block: usize,
    /// The L2 table of L1 entry 0.
    pub l2: usize,
    /// The host cluster of guest cluster 0 (0 if it is not allocated).
    pub data0: usize,
    pub snapshots: usize,
    pub file_len: usize,
}

impl Layout {
    pub fn of(b: &[u8]) -> Layout {
        let version = be32(b, 4);
        let l1 = be64(b, L1_TABLE_OFFSET) as usize;
        let refcount_table = be64(b, REFCOUNT_TABLE_OFFSET) as usize;
        let (_, l2) = l2_of_first_l1(b);
        let l2 = l2 as usize;
        Layout {
            cluster: 1 << be32(b, CLUSTER_BITS),
            header_length: if version >= 3 {
                be32(b, HEADER_LENGTH) as usize
            } else {
                72
            },
            l1,
            l1_size: be32(b, L1_SIZE) as usize,
            refcount_table,
            refcount_block: (be64(b, refcount_table) & OFFSET_MASK) as usize,
            l2,
            data0: if l2 == 0 {
                0
            } else {
                (be64(b, l2) & OFFSET_MASK) as usize
            },
            snapshots: be64(b, SNAPSHOTS_OFFSET) as usize,
            file_len: b.len(),
        }
    }
}

/// The header extensions of `b`: (offset of the extension's magic, magic,
/// length), up to and without the end marker.
pub fn extensions(b: &[u8]) -> Vec<(usize, u32, usize)> {
    let mut off = Layout::of(b).header_length;
    let mut out = Vec::new();
    loop {
        let magic = be32(b, off);
        let len = be32(b, off + 4) as usize;
        if magic == 0 {
            return out;
        }
        out.push((off, magic, len));
        off += 8 + len.div_ceil(8) * 8;
    }
}

/// The offset of the data of extension `magic` (panics if absent).
pub fn extension_data(b: &[u8], magic: u32) -> usize {
    extensions(b)
        .into_iter()
        .find(|e| e.1 == magic)
        .map(|e| e.0 + 8)
        .unwrap_or_else(|| panic!("no header extension {magic:#010x}"))
}

/// Removes the backing format header extension (0xE2792ACA) by turning it
/// into the end-of-extensions marker.
pub fn drop_backing_format(b: &mut [u8]) {
    let off = extension_data(b, EXT_BACKING_FORMAT) - 8;
    put_be32(b, off, 0);
}
