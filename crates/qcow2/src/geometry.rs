//! Address arithmetic of an image: cluster, subcluster, L1/L2 and refcount
//! indices, and the newtyped offsets that keep guest and host addresses apart.

use crate::{FormatError, Result};

/// Smallest cluster size qcow2 allows (512 B).
pub const MIN_CLUSTER_BITS: u32 = 9;
/// Largest cluster size QEMU opens (2 MiB); larger images are refused.
pub const MAX_CLUSTER_BITS: u32 = 21;
/// Extended L2 entries need clusters of at least 16 KiB.
pub const MIN_EXTENDED_L2_CLUSTER_BITS: u32 = 14;
/// Subclusters per cluster on images with extended L2 entries.
pub const SUBCLUSTERS_EXTENDED: u32 = 32;
/// Largest refcount order (64-bit refcounts).
pub const MAX_REFCOUNT_ORDER: u32 = 6;
/// Host offsets must stay below 2^56 (bits 9-55 of a descriptor).
pub const MAX_HOST_OFFSET: u64 = (1 << 56) - 1;

/// A byte offset in the virtual disk the guest sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestOffset(pub u64);

/// A byte offset in an image file (the host side of a mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostOffset(pub u64);

impl HostOffset {
    pub fn checked_add(self, n: u64) -> Option<HostOffset> {
        self.0.checked_add(n).map(HostOffset)
    }
}

/// The shape of one image: every index computation goes through here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    cluster_bits: u32,
    extended_l2: bool,
    refcount_order: u32,
}

impl Geometry {
    /// Validates and builds a geometry.
    pub fn new(cluster_bits: u32, extended_l2: bool, refcount_order: u32) -> Result<Self> {
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(FormatError::invalid(
                "cluster_bits",
                format!(
                    "{cluster_bits} is outside {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS} (512 B to 2 MiB clusters)"
                ),
            ));
        }
        if extended_l2 && cluster_bits < MIN_EXTENDED_L2_CLUSTER_BITS {
            return Err(FormatError::invalid(
                "cluster_bits",
                format!(
                    "{cluster_bits} is too small for extended L2 entries (needs at least {MIN_EXTENDED_L2_CLUSTER_BITS})"
                ),
            ));
        }
        if refcount_order > MAX_REFCOUNT_ORDER {
            return Err(FormatError::invalid(
                "refcount_order",
                format!("{refcount_order} exceeds {MAX_REFCOUNT_ORDER} (64-bit refcounts)"),
            ));
        }
        Ok(Geometry {
            cluster_bits,
            extended_l2,
            refcount_order,
        })
    }

    pub fn cluster_bits(&self) -> u32 {
        self.cluster_bits
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    pub fn extended_l2(&self) -> bool {
        self.extended_l2
    }

    pub fn refcount_order(&self) -> u32 {
        self.refcount_order
    }

    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// Largest refcount value a refcount block entry can hold.
    pub fn max_refcount(&self) -> u64 {
        if self.refcount_order == MAX_REFCOUNT_ORDER {
            u64::MAX
        } else {
            (1u64 << self.refcount_bits()) - 1
        }
    }

    /// Bytes per L2 entry (8, or 16 with extended L2 entries).
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// Entries per L2 table.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_size()
    }

    /// Subclusters per cluster (1 without extended L2).
    pub fn subclusters(&self) -> u32 {
        if self.extended_l2 {
            SUBCLUSTERS_EXTENDED
        } else {
            1
        }
    }

    pub fn subcluster_size(&self) -> u64 {
        self.cluster_size() / u64::from(self.subclusters())
    }

    /// Refcount entries per refcount block.
    pub fn refcount_block_entries(&self) -> u64 {
        self.cluster_size() * 8 / u64::from(self.refcount_bits())
    }

    /// Bytes of guest address space one L2 table maps.
    pub fn bytes_per_l2(&self) -> u64 {
        self.l2_entries() * self.cluster_size()
    }

    /// L1 entries needed for a virtual disk of `size` bytes.
    pub fn l1_entries_for(&self, size: u64) -> u64 {
        size.div_ceil(self.bytes_per_l2())
    }

    pub fn guest_cluster(&self, off: GuestOffset) -> u64 {
        off.0 >> self.cluster_bits
    }

    pub fn offset_in_cluster(&self, off: u64) -> u64 {
        off & (self.cluster_size() - 1)
    }

    pub fn l1_index(&self, guest_cluster: u64) -> u64 {
        guest_cluster / self.l2_entries()
    }

    pub fn l2_index(&self, guest_cluster: u64) -> u64 {
        guest_cluster % self.l2_entries()
    }

    pub fn host_cluster(&self, off: HostOffset) -> u64 {
        off.0 >> self.cluster_bits
    }

    pub fn cluster_offset(&self, cluster: u64) -> u64 {
        cluster << self.cluster_bits
    }

    pub fn is_cluster_aligned(&self, off: u64) -> bool {
        self.offset_in_cluster(off) == 0
    }

    /// (refcount table index, index inside the refcount block) of a host cluster.
    pub fn refcount_indices(&self, host_cluster: u64) -> (u64, u64) {
        let per_block = self.refcount_block_entries();
        (host_cluster / per_block, host_cluster % per_block)
    }

    /// Host clusters that `len` bytes starting at `off` touch.
    pub fn clusters_touched(&self, off: u64, len: u64) -> std::ops::Range<u64> {
        if len == 0 {
            let c = off >> self.cluster_bits;
            return c..c;
        }
        (off >> self.cluster_bits)..((off + len - 1) >> self.cluster_bits) + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_out_of_range_cluster_bits() {
        assert!(Geometry::new(8, false, 4).is_err());
        assert!(Geometry::new(22, false, 4).is_err());
        assert!(Geometry::new(13, true, 4).is_err());
        assert!(Geometry::new(16, false, 7).is_err());
        assert!(Geometry::new(9, false, 0).is_ok());
        assert!(Geometry::new(21, true, 6).is_ok());
    }

    #[test]
    fn indices_for_default_geometry() {
        let g = Geometry::new(16, false, 4).unwrap();
        assert_eq!(g.l2_entries(), 8192);
        assert_eq!(g.refcount_block_entries(), 32768);
        assert_eq!(g.l1_entries_for(1 << 30), 2);
        assert_eq!(g.clusters_touched(65535, 2), 0..2);
        let e = Geometry::new(16, true, 0).unwrap();
        assert_eq!(e.l2_entries(), 4096);
        assert_eq!(e.subcluster_size(), 2048);
        assert_eq!(e.refcount_block_entries(), 65536 * 8);
        assert_eq!(e.max_refcount(), 1);
        assert_eq!(
            Geometry::new(16, false, 6).unwrap().max_refcount(),
            u64::MAX
        );
    }
}
