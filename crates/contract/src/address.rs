//! Typed addresses that cross the boundary, so a guest cluster is never
//! passed where a host offset or a cache block is meant.
//!
//! [`GuestOffset`] and [`HostOffset`] are the qcow2 format's own address
//! spaces (its geometry maps one onto the other), so they stay defined in
//! `vdcache-qcow2` and are re-exported here: the COW layer, the format and
//! the layers below then share one type each, with no conversions between
//! twins. The addresses only a layer below the COW layer uses (image ids,
//! cache blocks, line keys) are defined here.
//!
//! This module does arithmetic on addresses only; it knows no tables.

pub use vdcache_qcow2::{GuestOffset, HostOffset};

/// A guest cluster number, in units of the top image's cluster size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestCluster(pub u64);

impl GuestCluster {
    /// The cluster holding `offset` for clusters of `1 << cluster_bits` bytes.
    pub fn containing(offset: GuestOffset, cluster_bits: u32) -> GuestCluster {
        GuestCluster(offset.0 >> cluster_bits)
    }
}

impl From<GuestCluster> for u64 {
    fn from(c: GuestCluster) -> u64 {
        c.0
    }
}

/// An image as a layer below the COW layer numbers the images it has seen
/// (the cache's image registry): 16 bits, part of every [`LineKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ImageId(pub u16);

impl From<ImageId> for u16 {
    fn from(id: ImageId) -> u16 {
        id.0
    }
}

impl From<ImageId> for usize {
    fn from(id: ImageId) -> usize {
        usize::from(id.0)
    }
}

/// A block number in a cache device's data zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct CacheBlock(pub u32);

impl CacheBlock {
    /// No block.
    pub const NONE: CacheBlock = CacheBlock(u32::MAX);
}

impl From<CacheBlock> for u32 {
    fn from(b: CacheBlock) -> u32 {
        b.0
    }
}

/// Key of a cache line: image id in the top 16 bits, the line number (a
/// host offset divided by the line size) in the low 48.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LineKey(pub u64);

impl LineKey {
    const LINE_BITS: u32 = 48;
    const LINE_MASK: u64 = (1 << Self::LINE_BITS) - 1;

    /// The key of line `line` of `image` (line numbers beyond 48 bits wrap:
    /// 2^48 lines of 64 KiB cover any host offset qcow2 allows).
    pub fn new(image: ImageId, line: u64) -> LineKey {
        LineKey((u64::from(image.0) << Self::LINE_BITS) | (line & Self::LINE_MASK))
    }

    pub fn image(self) -> ImageId {
        ImageId((self.0 >> Self::LINE_BITS) as u16)
    }

    pub fn line(self) -> u64 {
        self.0 & Self::LINE_MASK
    }
}

impl From<LineKey> for u64 {
    fn from(k: LineKey) -> u64 {
        k.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_keys_pack_image_and_line() {
        let k = LineKey::new(ImageId(0xbeef), 0x1234_5678_9abc);
        assert_eq!(k.0, 0xbeef_1234_5678_9abc);
        assert_eq!(k.image(), ImageId(0xbeef));
        assert_eq!(k.line(), 0x1234_5678_9abc);
        // Bits above 48 of a line number do not leak into the image id.
        assert_eq!(
            LineKey::new(ImageId(1), 1 << 48 | 7),
            LineKey::new(ImageId(1), 7)
        );
    }

    #[test]
    fn guest_cluster_of_an_offset() {
        assert_eq!(
            GuestCluster::containing(GuestOffset(65535), 16),
            GuestCluster(0)
        );
        assert_eq!(
            GuestCluster::containing(GuestOffset(65536), 16),
            GuestCluster(1)
        );
    }
}
