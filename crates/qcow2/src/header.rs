//! The image header (v2 and v3), its extensions and the backing file name:
//! parsing with validation of every field, and encoding back to bytes.
//!
//! Unknown extensions and unknown additional header fields are kept verbatim
//! so that rewriting a header never loses what another program stored there.

use crate::bytes::{Reader, pad8};
use crate::cache_mark::{EXT_CACHE_MARK, MarkSlots};
use crate::features::{self, FeatureKind, autoclear, compatible, incompatible};
use crate::geometry::{Geometry, MAX_CLUSTER_BITS, MIN_CLUSTER_BITS};
use crate::meta_journal::{EXT_META_JOURNAL, JournalExtension};
use crate::{FormatError, Result};

pub const MAGIC: u32 = 0x5146_49fb;
pub const V2_HEADER_LENGTH: u32 = 72;
pub const V3_MIN_HEADER_LENGTH: u32 = 104;
/// The v3 header length this implementation writes (compression_type + padding).
pub const V3_HEADER_LENGTH: u32 = 112;
/// QEMU's limit on the backing file name.
pub const MAX_BACKING_NAME: u32 = 1023;
/// QEMU's limit on the L1 table (32 MiB).
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// QEMU's limit on the refcount table (8 MiB).
pub const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 << 20;
/// QEMU's limit on the number of internal snapshots.
pub const MAX_SNAPSHOTS: u32 = 65536;

pub const EXT_END: u32 = 0;
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
pub const EXT_FEATURE_NAMES: u32 = 0x6803_f857;
pub const EXT_BITMAPS: u32 = 0x2385_2875;
pub const EXT_CRYPTO: u32 = 0x0537_be77;
pub const EXT_DATA_FILE: u32 = 0x4441_5441;

/// Offsets of header fields that are updated in place.
pub mod field_offset {
    pub const L1_SIZE: u64 = 36;
    pub const L1_TABLE_OFFSET: u64 = 40;
    pub const REFCOUNT_TABLE_OFFSET: u64 = 48;
    pub const INCOMPATIBLE_FEATURES: u64 = 72;
    pub const AUTOCLEAR_FEATURES: u64 = 88;
}

/// How compressed clusters are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompressionType {
    #[default]
    Zlib,
    Zstd,
}

impl CompressionType {
    pub fn name(self) -> &'static str {
        match self {
            CompressionType::Zlib => "zlib",
            CompressionType::Zstd => "zstd",
        }
    }
}

/// One entry of the feature name table extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureName {
    pub kind: FeatureKind,
    pub bit: u8,
    pub name: String,
}

/// The bitmaps extension (the directory itself is parsed by [`crate::bitmap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapsExtension {
    pub nb_bitmaps: u32,
    pub directory_size: u64,
    pub directory_offset: u64,
}

/// Header extensions, known ones decoded and unknown ones kept as bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extensions {
    pub backing_format: Option<String>,
    pub feature_names: Vec<FeatureName>,
    pub bitmaps: Option<BitmapsExtension>,
    pub external_data_file: Option<String>,
    /// Full disk encryption header pointer (offset, length).
    pub crypto: Option<(u64, u64)>,
    /// vdcache's identity of the image and the cache serving it.
    pub cache_mark: Option<MarkSlots>,
    /// Where vdcache's metadata journal lies (see [`crate::meta_journal`]).
    pub meta_journal: Option<JournalExtension>,
    pub unknown: Vec<(u32, Vec<u8>)>,
}

/// A parsed and validated image header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub backing_file_offset: u64,
    pub backing_file_size: u32,
    pub cluster_bits: u32,
    pub size: u64,
    pub crypt_method: u32,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible_features: u64,
    pub compatible_features: u64,
    pub autoclear_features: u64,
    pub refcount_order: u32,
    pub header_length: u32,
    pub compression_type: CompressionType,
    /// Additional header fields past compression_type that this
    /// implementation does not know; preserved on rewrite.
    pub unknown_fields: Vec<u8>,
    pub extensions: Extensions,
    pub backing_file: Option<String>,
}

/// Reads just enough of the header to learn the cluster size, so that a
/// caller knows how many bytes [`Header::parse`] needs (one cluster).
pub fn peek_cluster_bits(buf: &[u8]) -> Result<u32> {
    let mut r = Reader::new(buf, "header");
    let magic = r.u32()?;
    if magic != MAGIC {
        return Err(FormatError::BadMagic { found: magic });
    }
    let version = r.u32()?;
    check_version(version)?;
    let mut r = Reader::at(buf, 20, "header");
    let bits = r.u32()?;
    check_cluster_bits(bits)?;
    Ok(bits)
}

fn check_version(version: u32) -> Result<()> {
    if version == 2 || version == 3 {
        Ok(())
    } else {
        Err(FormatError::unsupported(
            "version",
            format!("{version} (only versions 2 and 3 exist)"),
        ))
    }
}

fn check_cluster_bits(bits: u32) -> Result<()> {
    if (MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&bits) {
        Ok(())
    } else {
        Err(FormatError::invalid(
            "cluster_bits",
            format!(
                "{bits} is outside {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS} (512 B to 2 MiB clusters)"
            ),
        ))
    }
}

fn check_aligned(field: &'static str, value: u64, cluster_size: u64) -> Result<()> {
    if !value.is_multiple_of(cluster_size) {
        return Err(FormatError::invalid(
            field,
            format!("{value:#x} is not aligned to the cluster size {cluster_size}"),
        ));
    }
    Ok(())
}

impl Header {
    /// Parses and validates the header from the first cluster of the image
    /// (or the whole file when it is shorter than a cluster).
    pub fn parse(buf: &[u8]) -> Result<Header> {
        let cluster_bits = peek_cluster_bits(buf)?;
        let cluster_size = 1u64 << cluster_bits;
        let buf = &buf[..buf.len().min(cluster_size as usize)];
        let mut r = Reader::new(buf, "header");
        let _magic = r.u32()?;
        let version = r.u32()?;
        let backing_file_offset = r.u64()?;
        let backing_file_size = r.u32()?;
        let _cluster_bits = r.u32()?;
        let size = r.u64()?;
        let crypt_method = r.u32()?;
        let l1_size = r.u32()?;
        let l1_table_offset = r.u64()?;
        let refcount_table_offset = r.u64()?;
        let refcount_table_clusters = r.u32()?;
        let nb_snapshots = r.u32()?;
        let snapshots_offset = r.u64()?;
        let mut h = Header {
            version,
            backing_file_offset,
            backing_file_size,
            cluster_bits,
            size,
            crypt_method,
            l1_size,
            l1_table_offset,
            refcount_table_offset,
            refcount_table_clusters,
            nb_snapshots,
            snapshots_offset,
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V2_HEADER_LENGTH,
            compression_type: CompressionType::Zlib,
            unknown_fields: Vec::new(),
            extensions: Extensions::default(),
            backing_file: None,
        };
        if version >= 3 {
            h.incompatible_features = r.u64()?;
            h.compatible_features = r.u64()?;
            h.autoclear_features = r.u64()?;
            h.refcount_order = r.u32()?;
            h.header_length = r.u32()?;
            h.check_header_length(cluster_size)?;
            if h.header_length > V3_MIN_HEADER_LENGTH {
                let known_end = 105usize;
                let end = h.header_length as usize;
                if end > buf.len() {
                    return Err(FormatError::Truncated {
                        what: "header",
                        need: end as u64,
                        have: buf.len() as u64,
                    });
                }
                h.compression_type = decode_compression_type(buf[104], h.incompatible_features)?;
                h.unknown_fields = buf[known_end..end].to_vec();
            } else if h.incompatible_features & incompatible::COMPRESSION_TYPE != 0 {
                return Err(FormatError::invalid(
                    "compression_type",
                    "the compression type feature bit is set but the header has no compression_type field",
                ));
            }
        }
        h.validate_fields(cluster_size)?;
        h.extensions = parse_extensions(buf, &h)?;
        h.backing_file = h.parse_backing_name(buf)?;
        h.check_features()?;
        Ok(h)
    }

    fn check_header_length(&self, cluster_size: u64) -> Result<()> {
        let len = u64::from(self.header_length);
        if len < u64::from(V3_MIN_HEADER_LENGTH) || len % 8 != 0 || len > cluster_size {
            return Err(FormatError::invalid(
                "header_length",
                format!(
                    "{len} (must be a multiple of 8, at least {V3_MIN_HEADER_LENGTH} and at most the cluster size)"
                ),
            ));
        }
        Ok(())
    }

    fn validate_fields(&self, cluster_size: u64) -> Result<()> {
        if self.crypt_method != 0 {
            return Err(FormatError::unsupported(
                "crypt_method",
                format!("{} (encrypted images are not supported)", self.crypt_method),
            ));
        }
        let geometry = self.geometry()?;
        if self.backing_file_offset != 0 {
            if self.backing_file_size > MAX_BACKING_NAME {
                return Err(FormatError::invalid(
                    "backing_file_size",
                    format!(
                        "{} exceeds {MAX_BACKING_NAME} bytes",
                        self.backing_file_size
                    ),
                ));
            }
            let end = self
                .backing_file_offset
                .checked_add(u64::from(self.backing_file_size));
            if end.is_none_or(|e| e > cluster_size) {
                return Err(FormatError::invalid(
                    "backing_file_offset",
                    format!(
                        "name at {:#x} (+{} bytes) lies outside the first cluster",
                        self.backing_file_offset, self.backing_file_size
                    ),
                ));
            }
        }
        if u64::from(self.l1_size) * 8 > MAX_L1_BYTES {
            return Err(FormatError::invalid(
                "l1_size",
                format!("{} entries exceed the 32 MiB L1 limit", self.l1_size),
            ));
        }
        let needed = geometry.l1_entries_for(self.size);
        if u64::from(self.l1_size) < needed {
            return Err(FormatError::invalid(
                "l1_size",
                format!(
                    "{} entries cannot map a virtual size of {} bytes (needs {needed})",
                    self.l1_size, self.size
                ),
            ));
        }
        if self.l1_size > 0 {
            check_aligned("l1_table_offset", self.l1_table_offset, cluster_size)?;
            if self.l1_table_offset == 0 {
                return Err(FormatError::invalid(
                    "l1_table_offset",
                    "0 overlaps the header",
                ));
            }
        }
        check_aligned(
            "refcount_table_offset",
            self.refcount_table_offset,
            cluster_size,
        )?;
        if self.refcount_table_offset == 0 {
            return Err(FormatError::invalid(
                "refcount_table_offset",
                "0 overlaps the header",
            ));
        }
        if self.refcount_table_clusters == 0 {
            return Err(FormatError::invalid(
                "refcount_table_clusters",
                "0 (the refcount table must have at least one cluster)",
            ));
        }
        if u64::from(self.refcount_table_clusters) * cluster_size > MAX_REFCOUNT_TABLE_BYTES {
            return Err(FormatError::invalid(
                "refcount_table_clusters",
                format!(
                    "{} clusters exceed the 8 MiB refcount table limit",
                    self.refcount_table_clusters
                ),
            ));
        }
        if self.nb_snapshots > MAX_SNAPSHOTS {
            return Err(FormatError::invalid(
                "nb_snapshots",
                format!("{} exceeds {MAX_SNAPSHOTS}", self.nb_snapshots),
            ));
        }
        if self.nb_snapshots > 0 {
            check_aligned("snapshots_offset", self.snapshots_offset, cluster_size)?;
        }
        if self.version == 2 && self.refcount_order != 4 {
            return Err(FormatError::invalid(
                "refcount_order",
                "version 2 images use 16-bit refcounts",
            ));
        }
        Ok(())
    }

    fn check_features(&self) -> Result<()> {
        let unknown = self.incompatible_features & !incompatible::KNOWN;
        if unknown != 0 {
            let names: Vec<String> = (0..64u8)
                .filter(|b| unknown & (1u64 << b) != 0)
                .map(|b| {
                    self.extensions
                        .feature_names
                        .iter()
                        .find(|f| f.kind == FeatureKind::Incompatible && f.bit == b)
                        .map(|f| format!("'{}' (bit {b})", f.name))
                        .unwrap_or_else(|| format!("unnamed bit {b}"))
                })
                .collect();
            return Err(FormatError::UnknownIncompatibleFeatures(names.join(", ")));
        }
        if self.version == 2 && self.incompatible_features != 0 {
            return Err(FormatError::invalid(
                "incompatible_features",
                "version 2 images have no feature bits",
            ));
        }
        let external = self.has_external_data_file();
        if self.extensions.external_data_file.is_some() && !external {
            return Err(FormatError::invalid(
                "external data file extension",
                "present although the external data file feature bit is clear",
            ));
        }
        if self.autoclear_features & autoclear::RAW_EXTERNAL_DATA != 0 && !external {
            return Err(FormatError::invalid(
                "autoclear_features",
                "raw external data bit is set without an external data file",
            ));
        }
        if external
            && self.backing_file.is_some()
            && self.autoclear_features & autoclear::RAW_EXTERNAL_DATA != 0
        {
            return Err(FormatError::invalid(
                "backing_file_offset",
                "a backing file cannot be combined with raw external data",
            ));
        }
        if external && self.nb_snapshots > 0 {
            return Err(FormatError::invalid(
                "nb_snapshots",
                "internal snapshots are not allowed with an external data file",
            ));
        }
        if self.extensions.bitmaps.is_none() && self.autoclear_features & autoclear::BITMAPS != 0 {
            // The spec calls this an error; QEMU clears the bit. Treat the
            // bitmaps as absent, as QEMU does, rather than refuse the image.
        }
        Ok(())
    }

    fn parse_backing_name(&self, buf: &[u8]) -> Result<Option<String>> {
        if self.backing_file_offset == 0 {
            return Ok(None);
        }
        let start = self.backing_file_offset as usize;
        let mut r = Reader::at(buf, start, "backing file name");
        let raw = r.take(self.backing_file_size as usize)?;
        let name = std::str::from_utf8(raw)
            .map_err(|_| FormatError::invalid("backing file name", "not valid UTF-8"))?;
        if name.is_empty() {
            return Err(FormatError::invalid(
                "backing_file_size",
                "0 (empty backing file name)",
            ));
        }
        if name.contains('\0') {
            return Err(FormatError::invalid(
                "backing file name",
                "contains a NUL byte",
            ));
        }
        Ok(Some(name.to_string()))
    }

    /// The image's geometry (validated).
    pub fn geometry(&self) -> Result<Geometry> {
        Geometry::new(
            self.cluster_bits,
            self.has_extended_l2(),
            self.refcount_order,
        )
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    pub fn is_dirty(&self) -> bool {
        self.incompatible_features & incompatible::DIRTY != 0
    }

    pub fn is_corrupt(&self) -> bool {
        self.incompatible_features & incompatible::CORRUPT != 0
    }

    pub fn has_external_data_file(&self) -> bool {
        self.incompatible_features & incompatible::EXTERNAL_DATA != 0
    }

    pub fn has_extended_l2(&self) -> bool {
        self.incompatible_features & incompatible::EXTENDED_L2 != 0
    }

    pub fn has_lazy_refcounts(&self) -> bool {
        self.compatible_features & compatible::LAZY_REFCOUNTS != 0
    }

    /// Bytes the refcount table occupies.
    pub fn refcount_table_bytes(&self) -> u64 {
        u64::from(self.refcount_table_clusters) << self.cluster_bits
    }

    /// The first two of the tables the header places (header, active L1,
    /// refcount table, snapshot table, bitmap directory) that share a
    /// cluster: writing one would destroy the other, and reading one
    /// through the other yields nonsense.
    pub fn table_overlap(&self) -> Option<String> {
        let cs = self.cluster_size();
        let mut tables: Vec<(&str, u64, u64)> = vec![("header", 0, cs)];
        if self.l1_size > 0 {
            tables.push((
                "active L1 table",
                self.l1_table_offset,
                u64::from(self.l1_size) * 8,
            ));
        }
        tables.push((
            "refcount table",
            self.refcount_table_offset,
            self.refcount_table_bytes(),
        ));
        if self.nb_snapshots > 0 {
            tables.push((
                "snapshot table",
                self.snapshots_offset,
                u64::from(self.nb_snapshots) * 40,
            ));
        }
        if let Some(b) = self.extensions.bitmaps {
            tables.push(("bitmap directory", b.directory_offset, b.directory_size));
        }
        let clusters = |off: u64, len: u64| {
            let first = off / cs;
            (
                first,
                off.saturating_add(len.max(1)).div_ceil(cs).max(first + 1),
            )
        };
        for (i, &(a, ao, al)) in tables.iter().enumerate() {
            for &(b, bo, bl) in &tables[i + 1..] {
                let ((a0, a1), (b0, b1)) = (clusters(ao, al), clusters(bo, bl));
                if a0 < b1 && b0 < a1 {
                    return Some(format!(
                        "the {b} at {bo:#x} overlaps the {a} at {ao:#x} (metadata overlap)"
                    ));
                }
            }
        }
        None
    }

    /// Checks that the tables the header points to lie inside a file of
    /// `file_len` bytes, so no table read is sized by a bogus field, and
    /// that no two of them overlap.
    pub fn validate_against_file(&self, file_len: u64) -> Result<()> {
        if let Some(overlap) = self.table_overlap() {
            return Err(FormatError::invalid("table offsets", overlap));
        }
        let within = |field: &'static str, off: u64, len: u64| -> Result<()> {
            match off.checked_add(len) {
                Some(end) if end <= file_len => Ok(()),
                _ => Err(FormatError::invalid(
                    field,
                    format!(
                        "table at {off:#x} (+{len} bytes) extends past the end of the file ({file_len} bytes)"
                    ),
                )),
            }
        };
        within(
            "l1_table_offset",
            self.l1_table_offset,
            u64::from(self.l1_size) * 8,
        )?;
        within(
            "refcount_table_offset",
            self.refcount_table_offset,
            self.refcount_table_bytes(),
        )?;
        if self.nb_snapshots > 0 {
            // Each snapshot entry is at least 40 bytes.
            within(
                "snapshots_offset",
                self.snapshots_offset,
                u64::from(self.nb_snapshots) * 40,
            )?;
        }
        if let Some(b) = self.extensions.bitmaps {
            within(
                "bitmap_directory_offset",
                b.directory_offset,
                b.directory_size,
            )?;
        }
        Ok(())
    }

    /// Feature names for display: every set bit of every bitmap.
    pub fn feature_list(&self) -> Vec<(FeatureKind, u8, String)> {
        let mut out = Vec::new();
        for (kind, bits) in [
            (FeatureKind::Incompatible, self.incompatible_features),
            (FeatureKind::Compatible, self.compatible_features),
            (FeatureKind::Autoclear, self.autoclear_features),
        ] {
            for bit in 0..64u8 {
                if bits & (1u64 << bit) == 0 {
                    continue;
                }
                let name = features::known_name(kind, bit)
                    .map(str::to_string)
                    .or_else(|| {
                        self.extensions
                            .feature_names
                            .iter()
                            .find(|f| f.kind == kind && f.bit == bit)
                            .map(|f| f.name.clone())
                    })
                    .unwrap_or_else(|| format!("unknown bit {bit}"));
                out.push((kind, bit, name));
            }
        }
        out
    }

    /// Encodes header, extensions and backing file name into one cluster.
    /// The backing file name offset and size are recomputed.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let cluster_size = self.cluster_size() as usize;
        let mut out = Vec::with_capacity(cluster_size.min(64 << 10));
        let header_length = if self.version >= 3 {
            (V3_MIN_HEADER_LENGTH as usize + 1 + self.unknown_fields.len())
                .max(V3_HEADER_LENGTH as usize)
        } else {
            V2_HEADER_LENGTH as usize
        };
        let header_length = pad8(header_length);
        out.resize(header_length, 0);
        let exts = encode_extensions(&self.extensions)?;
        let backing = self.backing_file.as_deref().unwrap_or("");
        if backing.len() > MAX_BACKING_NAME as usize {
            return Err(FormatError::invalid(
                "backing file name",
                format!("{} bytes exceed {MAX_BACKING_NAME}", backing.len()),
            ));
        }
        let backing_offset = header_length + exts.len();
        let total = backing_offset + backing.len();
        if total > cluster_size {
            return Err(FormatError::invalid(
                "header",
                format!(
                    "header, extensions and backing name need {total} bytes, more than one cluster ({cluster_size})"
                ),
            ));
        }
        let put32 =
            |o: &mut Vec<u8>, at: usize, v: u32| o[at..at + 4].copy_from_slice(&v.to_be_bytes());
        let put64 =
            |o: &mut Vec<u8>, at: usize, v: u64| o[at..at + 8].copy_from_slice(&v.to_be_bytes());
        put32(&mut out, 0, MAGIC);
        put32(&mut out, 4, self.version);
        if self.backing_file.is_some() {
            put64(&mut out, 8, backing_offset as u64);
            put32(&mut out, 16, backing.len() as u32);
        }
        put32(&mut out, 20, self.cluster_bits);
        put64(&mut out, 24, self.size);
        put32(&mut out, 32, self.crypt_method);
        put32(&mut out, 36, self.l1_size);
        put64(&mut out, 40, self.l1_table_offset);
        put64(&mut out, 48, self.refcount_table_offset);
        put32(&mut out, 56, self.refcount_table_clusters);
        put32(&mut out, 60, self.nb_snapshots);
        put64(&mut out, 64, self.snapshots_offset);
        if self.version >= 3 {
            put64(&mut out, 72, self.incompatible_features);
            put64(&mut out, 80, self.compatible_features);
            put64(&mut out, 88, self.autoclear_features);
            put32(&mut out, 96, self.refcount_order);
            put32(&mut out, 100, header_length as u32);
            out[104] = match self.compression_type {
                CompressionType::Zlib => 0,
                CompressionType::Zstd => 1,
            };
            out[105..105 + self.unknown_fields.len()].copy_from_slice(&self.unknown_fields);
        }
        out.extend_from_slice(&exts);
        out.extend_from_slice(backing.as_bytes());
        Ok(out)
    }
}

fn decode_compression_type(byte: u8, incompatible_features: u64) -> Result<CompressionType> {
    let bit = incompatible_features & incompatible::COMPRESSION_TYPE != 0;
    match (byte, bit) {
        (0, false) => Ok(CompressionType::Zlib),
        (1, true) => Ok(CompressionType::Zstd),
        (0, true) => Err(FormatError::invalid(
            "compression_type",
            "0 (zlib) although the compression type feature bit is set",
        )),
        (b, false) => Err(FormatError::invalid(
            "compression_type",
            format!("{b} although the compression type feature bit is clear"),
        )),
        (b, true) => Err(FormatError::unsupported(
            "compression_type",
            format!("{b} (known: 0 zlib, 1 zstd)"),
        )),
    }
}

fn parse_string_ext(data: &[u8], field: &'static str) -> Result<String> {
    let s =
        std::str::from_utf8(data).map_err(|_| FormatError::invalid(field, "not valid UTF-8"))?;
    if s.contains('\0') {
        return Err(FormatError::invalid(field, "contains a NUL byte"));
    }
    Ok(s.to_string())
}

/// Walks the header extensions of the first cluster `buf`, handing each
/// one's type, the offset of its 8-byte header and its data to `visit`.
/// Returns the offset where the walk ended (the end marker, or the end of
/// the area when there is none).
fn walk_extensions(
    buf: &[u8],
    h: &Header,
    mut visit: impl FnMut(u32, usize, &[u8]) -> Result<()>,
) -> Result<usize> {
    let start = h.header_length as usize;
    let end = if h.backing_file_offset != 0 {
        h.backing_file_offset as usize
    } else {
        buf.len()
    };
    if start > end {
        return Err(FormatError::invalid(
            "backing_file_offset",
            format!("{end:#x} lies inside the header"),
        ));
    }
    // A buffer shorter than the first cluster (a short file) may end before
    // the backing file name; the extensions end with it, and the name is
    // then reported as truncated by `parse_backing_name`.
    let area = &buf[..end.min(buf.len())];
    let mut r = Reader::at(area, start, "header extensions");
    let mut seen: Vec<u32> = Vec::new();
    loop {
        if r.pos() + 8 > area.len() {
            // No end marker before the area ends: tolerated, as QEMU does.
            return Ok(r.pos());
        }
        let at = r.pos();
        let kind = r.u32()?;
        let len = r.u32()? as usize;
        if kind == EXT_END {
            return Ok(at);
        }
        let data = r.take(len).map_err(|_| {
            FormatError::invalid(
                "header extension length",
                format!(
                    "extension {kind:#010x} claims {len} bytes, past the end of the extension area"
                ),
            )
        })?;
        let padded = pad8(len) - len;
        if r.pos() + padded <= area.len() {
            r.take(padded)?;
        } else {
            r.take(area.len() - r.pos())?;
        }
        if kind != 0 && seen.contains(&kind) && is_known_ext(kind) {
            return Err(FormatError::invalid(
                "header extensions",
                format!("extension {kind:#010x} appears twice"),
            ));
        }
        seen.push(kind);
        visit(kind, at, data)?;
    }
}

fn parse_extensions(buf: &[u8], h: &Header) -> Result<Extensions> {
    let mut ext = Extensions::default();
    walk_extensions(buf, h, |kind, _, data| {
        match kind {
            EXT_BACKING_FORMAT => {
                ext.backing_format = Some(parse_string_ext(data, "backing format extension")?)
            }
            EXT_DATA_FILE => {
                ext.external_data_file =
                    Some(parse_string_ext(data, "external data file extension")?)
            }
            EXT_FEATURE_NAMES => ext.feature_names = parse_feature_names(data)?,
            EXT_BITMAPS => ext.bitmaps = Some(parse_bitmaps_ext(data, h)?),
            EXT_CRYPTO => {
                let mut c = Reader::new(data, "crypto header extension");
                ext.crypto = Some((c.u64()?, c.u64()?));
            }
            EXT_CACHE_MARK => ext.cache_mark = Some(MarkSlots::decode(data)?),
            EXT_META_JOURNAL => ext.meta_journal = Some(JournalExtension::decode(data)?),
            _ => ext.unknown.push((kind, data.to_vec())),
        }
        Ok(())
    })?;
    Ok(ext)
}

/// One write of a crash-safe header change (see [`Header::rewrite_plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderWrite {
    pub offset: u64,
    pub bytes: Vec<u8>,
}

/// Offset in the first cluster of the cache mark's data, if it has one.
pub fn cache_mark_offset(buf: &[u8], h: &Header) -> Result<Option<u64>> {
    let mut found = None;
    walk_extensions(buf, h, |kind, at, _| {
        if kind == EXT_CACHE_MARK {
            found = Some(at as u64 + 8);
        }
        Ok(())
    })?;
    Ok(found)
}

impl Header {
    /// Writes that give the image whose first cluster is `buf` (parsed as
    /// `self`) the extensions `new`, such that a crash at any point, with
    /// any sectors of a write in flight landed or not, leaves an image
    /// that reads as the old header or the new: the new extension area
    /// and backing file name go where the current header does not look
    /// (the bytes after everything it uses, or those its header length
    /// skips as unknown header fields), then one write of the header's
    /// first 112 bytes, within one sector, switches to them. Each write
    /// must be durable before the next. Version 3 images only.
    pub fn rewrite_plan(&self, buf: &[u8], new: &Extensions) -> Result<Vec<HeaderWrite>> {
        if self.version < 3 {
            return Err(FormatError::unsupported(
                "version",
                "2 (the header of a version 2 image cannot be extended)",
            ));
        }
        let cluster_size = self.cluster_size() as usize;
        let name = self.backing_file.as_deref().unwrap_or("").as_bytes();
        let mut area = encode_extensions(new)?;
        let name_at = area.len();
        area.extend_from_slice(name);
        let fields = V3_HEADER_LENGTH as usize;
        let old_start = self.header_length as usize;
        let mut used_end = walk_extensions(buf, self, |_, _, _| Ok(()))? + 8;
        if self.backing_file_offset != 0 {
            used_end =
                used_end.max(self.backing_file_offset as usize + self.backing_file_size as usize);
        }
        let start = if old_start >= fields + area.len() {
            fields
        } else {
            pad8(used_end)
        };
        if start + area.len() > cluster_size {
            return Err(FormatError::invalid(
                "header",
                format!(
                    "no room in the first cluster ({cluster_size} bytes) for a new extension area of {} bytes",
                    area.len()
                ),
            ));
        }
        let mut image = buf[..buf.len().min(cluster_size)].to_vec();
        image.resize(image.len().max(start + area.len()), 0);
        image[start..start + area.len()].copy_from_slice(&area);
        image[100..104].copy_from_slice(&(start as u32).to_be_bytes());
        if self.backing_file.is_some() {
            image[8..16].copy_from_slice(&((start + name_at) as u64).to_be_bytes());
        }
        let check = Header::parse(&image)?;
        if check.extensions != *new || check.backing_file != self.backing_file {
            return Err(FormatError::invalid(
                "header",
                "a rewritten header would not read back as intended",
            ));
        }
        Ok(vec![
            HeaderWrite {
                offset: start as u64,
                bytes: area,
            },
            HeaderWrite {
                offset: 0,
                bytes: image[..fields].to_vec(),
            },
        ])
    }
}

fn is_known_ext(kind: u32) -> bool {
    matches!(
        kind,
        EXT_BACKING_FORMAT
            | EXT_FEATURE_NAMES
            | EXT_BITMAPS
            | EXT_CRYPTO
            | EXT_DATA_FILE
            | EXT_CACHE_MARK
            | EXT_META_JOURNAL
    )
}

fn parse_feature_names(data: &[u8]) -> Result<Vec<FeatureName>> {
    if !data.len().is_multiple_of(48) {
        return Err(FormatError::invalid(
            "feature name table",
            format!("length {} is not a multiple of 48", data.len()),
        ));
    }
    let mut out = Vec::with_capacity(data.len() / 48);
    for entry in data.chunks_exact(48) {
        let Some(kind) = FeatureKind::from_byte(entry[0]) else {
            // Unknown feature bitmaps are informational only; skip them.
            continue;
        };
        if entry[1] > 63 {
            return Err(FormatError::invalid(
                "feature name table",
                format!("bit number {} is past 63", entry[1]),
            ));
        }
        let raw = &entry[2..48];
        let len = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        out.push(FeatureName {
            kind,
            bit: entry[1],
            name: String::from_utf8_lossy(&raw[..len]).into_owned(),
        });
    }
    Ok(out)
}

fn parse_bitmaps_ext(data: &[u8], h: &Header) -> Result<BitmapsExtension> {
    let mut r = Reader::new(data, "bitmaps extension");
    let nb_bitmaps = r.u32()?;
    let reserved = r.u32()?;
    let directory_size = r.u64()?;
    let directory_offset = r.u64()?;
    if reserved != 0 {
        return Err(FormatError::invalid(
            "bitmaps extension",
            "reserved field is not zero",
        ));
    }
    if nb_bitmaps == 0 || nb_bitmaps > 65535 {
        return Err(FormatError::invalid(
            "bitmaps extension",
            format!("nb_bitmaps {nb_bitmaps} is outside 1..=65535"),
        ));
    }
    if directory_size > 64 << 20 {
        return Err(FormatError::invalid(
            "bitmaps extension",
            format!("bitmap directory size {directory_size} exceeds 64 MiB"),
        ));
    }
    check_aligned(
        "bitmap_directory_offset",
        directory_offset,
        h.cluster_size(),
    )?;
    Ok(BitmapsExtension {
        nb_bitmaps,
        directory_size,
        directory_offset,
    })
}

fn push_ext(out: &mut Vec<u8>, kind: u32, data: &[u8]) {
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(pad8(out.len()), 0);
}

fn encode_extensions(ext: &Extensions) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    if let Some(f) = &ext.backing_format {
        push_ext(&mut out, EXT_BACKING_FORMAT, f.as_bytes());
    }
    if let Some(f) = &ext.external_data_file {
        push_ext(&mut out, EXT_DATA_FILE, f.as_bytes());
    }
    if let Some((off, len)) = ext.crypto {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&off.to_be_bytes());
        d.extend_from_slice(&len.to_be_bytes());
        push_ext(&mut out, EXT_CRYPTO, &d);
    }
    if let Some(b) = ext.bitmaps {
        let mut d = Vec::with_capacity(24);
        d.extend_from_slice(&b.nb_bitmaps.to_be_bytes());
        d.extend_from_slice(&0u32.to_be_bytes());
        d.extend_from_slice(&b.directory_size.to_be_bytes());
        d.extend_from_slice(&b.directory_offset.to_be_bytes());
        push_ext(&mut out, EXT_BITMAPS, &d);
    }
    if !ext.feature_names.is_empty() {
        let mut d = Vec::with_capacity(ext.feature_names.len() * 48);
        for f in &ext.feature_names {
            let mut e = [0u8; 48];
            e[0] = f.kind.to_byte();
            e[1] = f.bit;
            let n = f.name.as_bytes();
            let l = n.len().min(46);
            e[2..2 + l].copy_from_slice(&n[..l]);
            d.extend_from_slice(&e);
        }
        push_ext(&mut out, EXT_FEATURE_NAMES, &d);
    }
    if let Some(m) = &ext.cache_mark {
        push_ext(&mut out, EXT_CACHE_MARK, &m.encode());
    }
    if let Some(j) = &ext.meta_journal {
        push_ext(&mut out, EXT_META_JOURNAL, &j.encode());
    }
    for (kind, data) in &ext.unknown {
        push_ext(&mut out, *kind, data);
    }
    out.extend_from_slice(&[0u8; 8]);
    Ok(out)
}

/// The feature name table this implementation writes into new images.
pub fn default_feature_names() -> Vec<FeatureName> {
    features::KNOWN_NAMES
        .iter()
        .map(|(kind, bit, name)| FeatureName {
            kind: *kind,
            bit: *bit,
            name: (*name).to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(version: u32) -> Header {
        Header {
            version,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits: 16,
            size: 1 << 30,
            crypt_method: 0,
            l1_size: 2,
            l1_table_offset: 0x30000,
            refcount_table_offset: 0x10000,
            refcount_table_clusters: 1,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: if version == 3 {
                V3_HEADER_LENGTH
            } else {
                V2_HEADER_LENGTH
            },
            compression_type: CompressionType::Zlib,
            unknown_fields: if version == 3 { vec![0; 7] } else { vec![] },
            extensions: Extensions::default(),
            backing_file: None,
        }
    }

    #[test]
    fn v3_round_trip_with_extensions() {
        let mut h = sample(3);
        h.backing_file = Some("base.qcow2".into());
        h.extensions.backing_format = Some("qcow2".into());
        h.extensions.feature_names = default_feature_names();
        h.extensions.unknown.push((0x1234_5678, vec![1, 2, 3]));
        let bytes = h.encode().unwrap();
        let mut back = Header::parse(&bytes).unwrap();
        assert_eq!(back.backing_file.as_deref(), Some("base.qcow2"));
        back.backing_file_offset = 0;
        back.backing_file_size = 0;
        assert_eq!(back.extensions, h.extensions);
        assert_eq!(back.size, h.size);
        assert_eq!(back.header_length, V3_HEADER_LENGTH);
    }

    #[test]
    fn v2_round_trip() {
        let h = sample(2);
        let back = Header::parse(&h.encode().unwrap()).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn rejects_bad_fields_by_name() {
        let field_of = |h: &Header| match Header::parse(&h.encode().unwrap()) {
            Err(FormatError::Invalid { field, .. })
            | Err(FormatError::Unsupported { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        };
        let mut h = sample(3);
        h.l1_size = 1;
        assert_eq!(field_of(&h), "l1_size");
        let mut h = sample(3);
        h.l1_table_offset = 0x30001;
        assert_eq!(field_of(&h), "l1_table_offset");
        let mut h = sample(3);
        h.crypt_method = 1;
        assert_eq!(field_of(&h), "crypt_method");
        let mut h = sample(3);
        h.refcount_order = 7;
        assert_eq!(field_of(&h), "refcount_order");
        let mut h = sample(3);
        h.refcount_table_clusters = 0;
        assert_eq!(field_of(&h), "refcount_table_clusters");
    }

    #[test]
    fn rejects_unknown_incompatible_bits_with_their_name() {
        let mut h = sample(3);
        h.incompatible_features = 1 << 9;
        h.extensions.feature_names.push(FeatureName {
            kind: FeatureKind::Incompatible,
            bit: 9,
            name: "time travel".into(),
        });
        match Header::parse(&h.encode().unwrap()) {
            Err(FormatError::UnknownIncompatibleFeatures(s)) => {
                assert!(s.contains("time travel"), "{s}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rejects_bad_magic_and_truncation() {
        assert!(matches!(
            Header::parse(b"QFI"),
            Err(FormatError::Truncated { .. })
        ));
        assert!(matches!(
            Header::parse(&[0u8; 512]),
            Err(FormatError::BadMagic { .. })
        ));
        let bytes = sample(3).encode().unwrap();
        assert!(matches!(
            Header::parse(&bytes[..90]),
            Err(FormatError::Truncated { .. })
        ));
    }

    /// A file shorter than its first cluster (found by fuzzing
    /// parse_structures): the backing file name, which lies past its end,
    /// is reported as truncated; slicing the extension area up to it used
    /// to panic.
    #[test]
    fn backing_name_past_a_short_buffer_is_truncation() {
        let mut h = sample(3);
        h.backing_file = Some("base.qcow2".into());
        let bytes = h.encode().unwrap();
        let name_at = bytes.windows(10).position(|w| w == b"base.qcow2").unwrap();
        for len in [name_at - 8, name_at - 1, name_at, name_at + 3] {
            match Header::parse(&bytes[..len]) {
                Err(FormatError::Truncated { what, .. }) => {
                    assert_eq!(what, "backing file name")
                }
                other => panic!("{len} bytes: {other:?}"),
            }
        }
    }

    #[test]
    fn header_length_past_the_buffer_is_truncation() {
        let bytes = sample(3).encode().unwrap();
        assert!(matches!(
            Header::parse(&bytes[..104]),
            Err(FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn cluster_bits_8_and_22_are_rejected() {
        for bits in [8u32, 22] {
            let mut bytes = sample(3).encode().unwrap();
            bytes[20..24].copy_from_slice(&bits.to_be_bytes());
            match Header::parse(&bytes) {
                Err(FormatError::Invalid { field, .. }) => assert_eq!(field, "cluster_bits"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn validates_tables_against_file_length() {
        let h = sample(3);
        assert!(h.validate_against_file(0x40000).is_ok());
        match h.validate_against_file(0x30008) {
            Err(FormatError::Invalid { field, .. }) => assert_eq!(field, "l1_table_offset"),
            other => panic!("{other:?}"),
        }
    }
}
