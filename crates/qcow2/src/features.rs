//! Feature bits of the v3 header, with their names for messages.

/// Incompatible feature bits: an image with an unknown one must not be opened.
pub mod incompatible {
    pub const DIRTY: u64 = 1 << 0;
    pub const CORRUPT: u64 = 1 << 1;
    pub const EXTERNAL_DATA: u64 = 1 << 2;
    pub const COMPRESSION_TYPE: u64 = 1 << 3;
    pub const EXTENDED_L2: u64 = 1 << 4;
    /// vdcache: a flash cache holds data of this image that the file
    /// lacks (see [`crate::cache_mark`]). QEMU refuses such an image, so
    /// nobody reads the stale file alone.
    pub const IN_CACHE: u64 = 1 << 56;
    /// vdcache: the image's metadata journal may hold table updates the
    /// tables lack (see [`crate::meta_journal`]). QEMU refuses such an
    /// image until vdcache applies the journal.
    pub const META_JOURNAL: u64 = 1 << 57;
    pub const KNOWN: u64 =
        DIRTY | CORRUPT | EXTERNAL_DATA | COMPRESSION_TYPE | EXTENDED_L2 | IN_CACHE | META_JOURNAL;
}

/// Compatible feature bits: unknown ones may be ignored.
pub mod compatible {
    pub const LAZY_REFCOUNTS: u64 = 1 << 0;
    pub const KNOWN: u64 = LAZY_REFCOUNTS;
}

/// Autoclear feature bits: a writer that does not maintain one must clear it
/// before its first write.
pub mod autoclear {
    pub const BITMAPS: u64 = 1 << 0;
    pub const RAW_EXTERNAL_DATA: u64 = 1 << 1;
    /// vdcache: the cache named in the cache mark holds no copy of this
    /// file's data that the file contradicts. Any other writer clears it
    /// (as the qcow2 specification asks of unknown autoclear bits).
    pub const CACHE_COHERENT: u64 = 1 << 56;
    pub const KNOWN: u64 = BITMAPS | RAW_EXTERNAL_DATA | CACHE_COHERENT;
}

/// Which of the three feature bitmaps a bit belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureKind {
    Incompatible,
    Compatible,
    Autoclear,
}

impl FeatureKind {
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(FeatureKind::Incompatible),
            1 => Some(FeatureKind::Compatible),
            2 => Some(FeatureKind::Autoclear),
            _ => None,
        }
    }

    pub fn to_byte(self) -> u8 {
        match self {
            FeatureKind::Incompatible => 0,
            FeatureKind::Compatible => 1,
            FeatureKind::Autoclear => 2,
        }
    }
}

/// The names this implementation writes into the feature name table and
/// prints in `info`.
pub const KNOWN_NAMES: &[(FeatureKind, u8, &str)] = &[
    (FeatureKind::Incompatible, 0, "dirty bit"),
    (FeatureKind::Incompatible, 1, "corrupt bit"),
    (FeatureKind::Incompatible, 2, "external data file"),
    (FeatureKind::Incompatible, 3, "compression type"),
    (FeatureKind::Incompatible, 4, "extended L2 entries"),
    // QEMU prints this name (at most 46 bytes) when it refuses the image.
    (
        FeatureKind::Incompatible,
        56,
        "data in vdcache cache; vdcache recover --full",
    ),
    (
        FeatureKind::Incompatible,
        57,
        "vdcache metadata journal; vdcache recover",
    ),
    (FeatureKind::Compatible, 0, "lazy refcounts"),
    (FeatureKind::Autoclear, 0, "bitmaps"),
    (FeatureKind::Autoclear, 1, "raw external data"),
    (FeatureKind::Autoclear, 56, "vdcache cache coherent"),
];

/// The name of a known feature bit, if any.
pub fn known_name(kind: FeatureKind, bit: u8) -> Option<&'static str> {
    KNOWN_NAMES
        .iter()
        .find(|(k, b, _)| *k == kind && *b == bit)
        .map(|(_, _, n)| *n)
}
