//! Creating empty qcow2 images with the options qemu-img create takes:
//! cluster size, version (compat), refcount width, extended L2 entries,
//! lazy refcounts, compression type, and a backing file with its format.

use crate::chain::{ImageFormat, OpenOptions, open_chain};
use crate::error::{ImageError, Result};
use std::path::Path;
use vdcache_backend::{Backend, FileBackend, FileOptions, LockMode};
use vdcache_qcow2::Header;
use vdcache_qcow2::features::{compatible, incompatible};
use vdcache_qcow2::header::{self, CompressionType, Extensions};
use vdcache_qcow2::refcount;

/// What to create.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// Virtual size; `None` takes the backing file's size.
    pub size: Option<u64>,
    pub cluster_size: u64,
    /// 2 (compat=0.10) or 3 (compat=1.1).
    pub version: u32,
    pub refcount_bits: u32,
    pub extended_l2: bool,
    pub lazy_refcounts: bool,
    pub compression: CompressionType,
    /// Backing file name as stored in the header, and its format.
    pub backing: Option<(String, ImageFormat)>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            size: None,
            cluster_size: 65536,
            version: 3,
            refcount_bits: 16,
            extended_l2: false,
            lazy_refcounts: false,
            compression: CompressionType::Zlib,
            backing: None,
        }
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> ImageError {
    ImageError::Unsupported {
        image: path.display().to_string(),
        reason: reason.into(),
    }
}

impl CreateOptions {
    fn validate(&self, path: &Path) -> Result<(u32, u32)> {
        if !self.cluster_size.is_power_of_two() || !(512..=2 << 20).contains(&self.cluster_size) {
            return Err(invalid(
                path,
                format!(
                    "cluster_size {} must be a power of two from 512 to 2M",
                    self.cluster_size
                ),
            ));
        }
        let cluster_bits = self.cluster_size.trailing_zeros();
        if !self.refcount_bits.is_power_of_two() || self.refcount_bits > 64 {
            return Err(invalid(
                path,
                format!(
                    "refcount_bits {} must be a power of two up to 64",
                    self.refcount_bits
                ),
            ));
        }
        let order = self.refcount_bits.trailing_zeros();
        if self.version == 2 {
            if self.refcount_bits != 16 {
                return Err(invalid(path, "compat=0.10 images need refcount_bits=16"));
            }
            if self.extended_l2 || self.lazy_refcounts || self.compression != CompressionType::Zlib
            {
                return Err(invalid(
                    path,
                    "extended_l2, lazy_refcounts and zstd compression need compat=1.1",
                ));
            }
        } else if self.version != 3 {
            return Err(invalid(path, format!("unknown version {}", self.version)));
        }
        if self.extended_l2 && self.cluster_size < 16384 {
            return Err(invalid(
                path,
                "extended_l2 needs a cluster size of at least 16k",
            ));
        }
        Ok((cluster_bits, order))
    }
}

/// Places header, refcount table, refcount blocks and L1 table so that the
/// refcount blocks cover all of them. Returns (table clusters, blocks, L1
/// clusters).
fn layout(cluster_size: u64, order: u32, l1_entries: u64) -> (u64, u64, u64) {
    let per_block = (cluster_size * 8) >> order;
    let l1_clusters = (l1_entries * 8).div_ceil(cluster_size);
    let mut table = 1;
    let mut blocks = 1;
    loop {
        let total = 1 + table + blocks + l1_clusters;
        let need_blocks = total.div_ceil(per_block);
        let need_table = (need_blocks * 8).div_ceil(cluster_size);
        if need_blocks <= blocks && need_table <= table {
            return (table, blocks, l1_clusters);
        }
        blocks = blocks.max(need_blocks);
        table = table.max(need_table);
    }
}

/// Creates a qcow2 image at `path` (refusing to overwrite nothing: an
/// existing file is replaced, as qemu-img does).
pub fn create_qcow2(path: &Path, opts: &CreateOptions) -> Result<()> {
    let size = match (opts.size, &opts.backing) {
        (Some(s), _) => whole_sectors(path, s)?,
        (None, Some((name, fmt))) => backing_size(path, name, *fmt)?,
        (None, None) => {
            return Err(invalid(
                path,
                "a size is needed when there is no backing file",
            ));
        }
    };
    let image = qcow2_image_bytes(path, opts, size)?;
    write_new_file(path, &image)
}

/// The bytes of a new, empty qcow2 image of `size` bytes (`path` only
/// names it in errors).
pub fn qcow2_image_bytes(path: &Path, opts: &CreateOptions, size: u64) -> Result<Vec<u8>> {
    let (cluster_bits, order) = opts.validate(path)?;
    let cs = opts.cluster_size;
    let entry = if opts.extended_l2 { 16 } else { 8 };
    let l1_entries = size.div_ceil((cs / entry) * cs);
    if l1_entries * 8 > header::MAX_L1_BYTES {
        return Err(invalid(
            path,
            format!("size {size} needs an L1 table larger than 32 MiB"),
        ));
    }
    let (table, blocks, l1_clusters) = layout(cs, order, l1_entries);
    let total = 1 + table + blocks + l1_clusters;
    let mut incompat = 0;
    if opts.extended_l2 {
        incompat |= incompatible::EXTENDED_L2;
    }
    if opts.compression == CompressionType::Zstd {
        incompat |= incompatible::COMPRESSION_TYPE;
    }
    let h = Header {
        version: opts.version,
        backing_file_offset: 0,
        backing_file_size: 0,
        cluster_bits,
        size,
        crypt_method: 0,
        l1_size: l1_entries as u32,
        l1_table_offset: if l1_entries > 0 {
            (1 + table + blocks) * cs
        } else {
            0
        },
        refcount_table_offset: cs,
        refcount_table_clusters: table as u32,
        nb_snapshots: 0,
        snapshots_offset: 0,
        incompatible_features: incompat,
        compatible_features: if opts.lazy_refcounts {
            compatible::LAZY_REFCOUNTS
        } else {
            0
        },
        autoclear_features: 0,
        refcount_order: order,
        header_length: if opts.version >= 3 {
            header::V3_HEADER_LENGTH
        } else {
            header::V2_HEADER_LENGTH
        },
        compression_type: opts.compression,
        unknown_fields: Vec::new(),
        extensions: Extensions {
            backing_format: opts.backing.as_ref().map(|(_, f)| f.name().to_string()),
            feature_names: if opts.version >= 3 {
                header::default_feature_names()
            } else {
                Vec::new()
            },
            ..Extensions::default()
        },
        backing_file: opts.backing.as_ref().map(|(n, _)| n.clone()),
    };
    // Like QEMU, leave the feature name table out when it does not fit in
    // the first cluster (small clusters with a backing file name).
    let first = match h.encode() {
        Ok(b) => b,
        Err(_) => {
            let mut h = h;
            h.extensions.feature_names.clear();
            h.encode()
                .map_err(|e| ImageError::format(&path.display().to_string(), e))?
        }
    };
    let mut image = vec![0u8; (total * cs) as usize];
    image[..first.len()].copy_from_slice(&first);
    let per_block = (cs * 8) >> order;
    for b in 0..blocks {
        let at = (cs + b * 8) as usize;
        image[at..at + 8].copy_from_slice(&((1 + table + b) * cs).to_be_bytes());
    }
    for c in 0..total {
        let block = (1 + table + c / per_block) * cs;
        let slice = &mut image[block as usize..(block + cs) as usize];
        refcount::set(slice, c % per_block, order, 1)
            .map_err(|e| ImageError::format(&path.display().to_string(), e))?;
    }
    Ok(image)
}

fn backing_size(path: &Path, name: &str, fmt: ImageFormat) -> Result<u64> {
    let resolved = if Path::new(name).is_absolute() {
        name.to_string()
    } else {
        path.parent()
            .unwrap_or_else(|| Path::new("."))
            .join(name)
            .display()
            .to_string()
    };
    let disk = open_chain(
        &resolved,
        &OpenOptions {
            read_only: true,
            format: Some(fmt),
            force_share: true,
            ..OpenOptions::default()
        },
    )?;
    Ok(disk.size())
}

/// Opens `path` for a new image the way qemu-img create does: created if
/// missing, but never truncated before QEMU's write lock is held, so an
/// image in use (by a VM, qemu-nbd or a vdcache server) is refused, not
/// overwritten.
fn open_for_create(path: &Path) -> Result<FileBackend> {
    let backend = FileBackend::open(
        path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: true,
        },
    )?;
    backend
        .set_len(0)
        .map_err(|e| ImageError::io(&path.display().to_string(), "truncate", e))?;
    Ok(backend)
}

fn write_new_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.display().to_string();
    let f = open_for_create(path)?;
    f.write_at(bytes, 0)
        .map_err(|e| ImageError::io(&name, "write", e))?;
    f.flush().map_err(|e| ImageError::io(&name, "sync", e))
}

/// A size asked for, rounded up to whole sectors as qemu-img rounds it
/// (QEMU sees a disk as whole sectors; a size between them would be read
/// differently by each).
fn whole_sectors(path: &Path, size: u64) -> Result<u64> {
    size.checked_next_multiple_of(crate::SECTOR)
        .ok_or_else(|| invalid(path, format!("size {size} is too large")))
}

/// Creates a raw image of `size` bytes (sparse), rounded up to whole
/// sectors; returns the size made.
pub fn create_raw(path: &Path, size: u64) -> Result<u64> {
    let size = whole_sectors(path, size)?;
    let name = path.display().to_string();
    let f = open_for_create(path)?;
    f.set_len(size)
        .map_err(|e| ImageError::io(&name, "resize", e))?;
    f.flush().map_err(|e| ImageError::io(&name, "sync", e))?;
    Ok(size)
}
