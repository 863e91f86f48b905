//! L1 and L2 table entries: decoding with validation of reserved bits, and
//! encoding. Standard and extended L2 entries decode into one [`L2Mapping`]
//! so that the COW layer has a single model of a cluster: either compressed,
//! or a standard cluster whose subclusters (one, or 32 with extended L2) are
//! each allocated, zero, or unallocated.

use crate::compressed::CompressedDescriptor;
use crate::geometry::{Geometry, HostOffset};
use crate::{FormatError, Result};

/// Bit 63 of L1 and L2 entries: the refcount of the referenced cluster is 1.
pub const COPIED: u64 = 1 << 63;
/// Bit 62 of L2 entries: the cluster is compressed.
pub const COMPRESSED: u64 = 1 << 62;
/// Bit 0 of a standard L2 entry (not extended): the cluster reads as zeros.
pub const ZERO: u64 = 1;
/// Bits 9-55: a cluster-aligned host offset.
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L1_RESERVED: u64 = !(OFFSET_MASK | COPIED);
const L2_STANDARD_RESERVED: u64 = 0x3f00_0000_0000_01fe;

/// A decoded L1 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L1Entry {
    /// Host offset of the L2 table, or `None` when unallocated.
    pub l2_offset: Option<HostOffset>,
    pub copied: bool,
}

impl L1Entry {
    pub fn decode(raw: u64, geometry: &Geometry) -> Result<L1Entry> {
        if raw & L1_RESERVED != 0 {
            return Err(FormatError::invalid(
                "L1 entry",
                format!("{raw:#018x} has reserved bits set"),
            ));
        }
        let off = raw & OFFSET_MASK;
        if !geometry.is_cluster_aligned(off) {
            return Err(FormatError::invalid(
                "L1 entry",
                format!("L2 table offset {off:#x} is not cluster aligned"),
            ));
        }
        Ok(L1Entry {
            l2_offset: (off != 0).then_some(HostOffset(off)),
            copied: raw & COPIED != 0,
        })
    }

    pub fn encode(&self) -> u64 {
        match self.l2_offset {
            Some(o) => o.0 | if self.copied { COPIED } else { 0 },
            None => 0,
        }
    }
}

/// How one subcluster (or the whole cluster without extended L2) reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubclusterState {
    /// Read from the backing file (or zeros without one).
    Unallocated,
    /// Reads as zeros.
    Zero,
    /// Data lives at the cluster's host offset.
    Allocated,
}

/// A standard (uncompressed) cluster: host cluster plus per-subcluster state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandardCluster {
    /// The host cluster, if one is assigned (allocated, or preallocated zero).
    pub host: Option<HostOffset>,
    /// Refcount of the host cluster is exactly 1 (in-place writes allowed).
    pub copied: bool,
    /// Bit i set: subcluster i is allocated.
    pub alloc: u32,
    /// Bit i set: subcluster i reads as zeros.
    pub zero: u32,
}

impl StandardCluster {
    pub const UNALLOCATED: StandardCluster = StandardCluster {
        host: None,
        copied: false,
        alloc: 0,
        zero: 0,
    };

    pub fn state(&self, subcluster: u32) -> SubclusterState {
        let bit = 1u32 << subcluster;
        if self.alloc & bit != 0 {
            SubclusterState::Allocated
        } else if self.zero & bit != 0 {
            SubclusterState::Zero
        } else {
            SubclusterState::Unallocated
        }
    }
}

/// What decoding an L2 entry depends on besides its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L2Format {
    pub geometry: Geometry,
    /// Image version: the zero flag exists from version 3.
    pub version: u32,
    /// Guest clusters live in an external data file (host offset = guest offset).
    pub external_data: bool,
}

/// A decoded L2 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2Mapping {
    Standard(StandardCluster),
    Compressed(CompressedDescriptor),
}

/// Mask of the subclusters a cluster has (1 bit, or 32 with extended L2).
pub fn all_subclusters(geometry: &Geometry) -> u32 {
    if geometry.subclusters() == 32 {
        u32::MAX
    } else {
        1
    }
}

impl L2Mapping {
    pub const UNALLOCATED: L2Mapping = L2Mapping::Standard(StandardCluster::UNALLOCATED);

    /// Decodes an entry (`bitmap` is the second word of an extended entry,
    /// 0 otherwise).
    pub fn decode(raw: u64, bitmap: u64, format: &L2Format) -> Result<L2Mapping> {
        let geometry = &format.geometry;
        let version = format.version;
        if raw & COMPRESSED != 0 {
            if geometry.extended_l2() && bitmap != 0 {
                return Err(FormatError::invalid(
                    "L2 entry",
                    format!("compressed cluster {raw:#018x} has a non-zero subcluster bitmap"),
                ));
            }
            if raw & COPIED != 0 {
                return Err(FormatError::invalid(
                    "L2 entry",
                    format!("compressed cluster {raw:#018x} has the COPIED flag set"),
                ));
            }
            return Ok(L2Mapping::Compressed(CompressedDescriptor::decode(
                raw, geometry,
            )?));
        }
        if raw & L2_STANDARD_RESERVED != 0 {
            return Err(FormatError::invalid(
                "L2 entry",
                format!("{raw:#018x} has reserved bits set"),
            ));
        }
        let off = raw & OFFSET_MASK;
        if !geometry.is_cluster_aligned(off) {
            // Using it would read and write across two host clusters.
            return Err(FormatError::invalid(
                "L2 entry",
                format!("{raw:#018x}: host offset {off:#x} is not cluster aligned"),
            ));
        }
        let host = (off != 0).then_some(HostOffset(off));
        let copied = raw & COPIED != 0;
        if geometry.extended_l2() {
            if raw & ZERO != 0 {
                return Err(FormatError::invalid(
                    "L2 entry",
                    format!("{raw:#018x} sets bit 0, which is reserved with extended L2 entries"),
                ));
            }
            let alloc = bitmap as u32;
            let zero = (bitmap >> 32) as u32;
            if alloc & zero != 0 {
                return Err(FormatError::invalid(
                    "L2 subcluster bitmap",
                    format!("{bitmap:#018x} marks subclusters both allocated and zero"),
                ));
            }
            if alloc != 0 && host.is_none() {
                return Err(FormatError::invalid(
                    "L2 subcluster bitmap",
                    format!(
                        "{bitmap:#018x} marks subclusters allocated but the entry has no host offset"
                    ),
                ));
            }
            return Ok(L2Mapping::Standard(StandardCluster {
                host,
                copied,
                alloc,
                zero,
            }));
        }
        let zero_flag = raw & ZERO != 0;
        if zero_flag && version < 3 {
            return Err(FormatError::invalid(
                "L2 entry",
                format!("{raw:#018x} sets the zero flag, which version 2 does not have"),
            ));
        }
        let (alloc, zero) = match (host.is_some(), zero_flag) {
            (_, true) => (0, 1),
            (true, false) => (1, 0),
            (false, false) => (0, 0),
        };
        if copied && host.is_none() && format.external_data {
            // With an external data file, guest cluster 0 maps to host
            // offset 0 and only COPIED tells it from an unallocated entry.
            return Ok(L2Mapping::Standard(StandardCluster {
                host: Some(HostOffset(0)),
                copied,
                alloc: if zero_flag { 0 } else { 1 },
                zero,
            }));
        }
        Ok(L2Mapping::Standard(StandardCluster {
            host,
            copied: copied && host.is_some(),
            alloc,
            zero,
        }))
    }

    /// Encodes back to (entry, bitmap). Fails when the state cannot be
    /// represented (zero subclusters on a version 2 image, partial
    /// subcluster masks without extended L2).
    pub fn encode(&self, format: &L2Format) -> Result<(u64, u64)> {
        let geometry = &format.geometry;
        let version = format.version;
        match self {
            L2Mapping::Compressed(d) => Ok((d.encode(geometry)?, 0)),
            L2Mapping::Standard(s) => {
                let off = s.host.map_or(0, |h| h.0);
                if off & !OFFSET_MASK != 0 {
                    return Err(FormatError::invalid(
                        "L2 entry",
                        format!("host offset {off:#x} cannot be encoded"),
                    ));
                }
                let copied = if s.copied { COPIED } else { 0 };
                if geometry.extended_l2() {
                    let bitmap = u64::from(s.alloc) | (u64::from(s.zero) << 32);
                    return Ok((off | copied, bitmap));
                }
                if s.alloc > 1 || s.zero > 1 || (s.alloc & s.zero) != 0 {
                    return Err(FormatError::invalid(
                        "L2 entry",
                        "subcluster masks without extended L2 entries",
                    ));
                }
                if s.zero != 0 {
                    if version < 3 {
                        return Err(FormatError::unsupported(
                            "L2 entry",
                            "zero clusters need a version 3 image",
                        ));
                    }
                    return Ok((off | copied | ZERO, 0));
                }
                if s.alloc == 0 {
                    // An unallocated entry keeps no host offset.
                    return Ok((0, 0));
                }
                if off == 0 && !format.external_data {
                    return Err(FormatError::invalid(
                        "L2 entry",
                        "allocated cluster at host offset 0",
                    ));
                }
                Ok((off | copied, 0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(ext: bool) -> Geometry {
        Geometry::new(16, ext, 4).unwrap()
    }

    fn f(ext: bool, version: u32) -> L2Format {
        L2Format {
            geometry: g(ext),
            version,
            external_data: false,
        }
    }

    #[test]
    fn l1_entries() {
        let e = L1Entry::decode(0x8000_0000_0005_0000, &g(false)).unwrap();
        assert_eq!(e.l2_offset, Some(HostOffset(0x50000)));
        assert!(e.copied);
        assert_eq!(e.encode(), 0x8000_0000_0005_0000);
        assert!(L1Entry::decode(0x0000_0000_0005_0001, &g(false)).is_err());
        assert!(L1Entry::decode(0x0000_0000_0005_0200, &g(false)).is_err());
        assert!(L1Entry::decode(0x0100_0000_0000_0000, &g(false)).is_err());
    }

    #[test]
    fn standard_entries_round_trip() {
        let fmt = f(false, 3);
        for raw in [
            0u64,
            ZERO,
            0x70000 | COPIED,
            0x70000,
            0x70000 | ZERO | COPIED,
        ] {
            let m = L2Mapping::decode(raw, 0, &fmt).unwrap();
            assert_eq!(m.encode(&fmt).unwrap(), (raw, 0), "{raw:#x}");
        }
        assert!(L2Mapping::decode(ZERO, 0, &f(false, 2)).is_err());
        assert!(L2Mapping::decode(0x70002, 0, &fmt).is_err());
        assert_eq!(
            L2Mapping::decode(COPIED, 0, &fmt).unwrap(),
            L2Mapping::UNALLOCATED
        );
    }

    #[test]
    fn extended_entries_validate_bitmaps() {
        let geo = f(true, 3);
        let m = L2Mapping::decode(0x70000 | COPIED, 0x0000_0002_0000_0001, &geo).unwrap();
        match m {
            L2Mapping::Standard(s) => {
                assert_eq!(s.state(0), SubclusterState::Allocated);
                assert_eq!(s.state(1), SubclusterState::Zero);
                assert_eq!(s.state(2), SubclusterState::Unallocated);
            }
            _ => panic!(),
        }
        assert!(L2Mapping::decode(0x70000, 0x0000_0001_0000_0001, &geo).is_err());
        assert!(L2Mapping::decode(0, 1, &geo).is_err());
        assert!(L2Mapping::decode(ZERO, 0, &geo).is_err());
    }
}
