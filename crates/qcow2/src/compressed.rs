//! Compressed cluster descriptors and their decompression (zlib raw
//! deflate, as QEMU writes it, or zstd).

use crate::geometry::Geometry;
use crate::header::CompressionType;
use crate::{FormatError, Result};

/// Compressed data is addressed in 512-byte sectors.
pub const SECTOR: u64 = 512;

/// Where a compressed cluster's bytes live in the image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressedDescriptor {
    /// Byte offset of the compressed data (not aligned).
    pub offset: u64,
    /// Additional 512-byte sectors beyond the one holding `offset`.
    pub extra_sectors: u64,
}

fn offset_bits(geometry: &Geometry) -> u32 {
    62 - (geometry.cluster_bits() - 8)
}

impl CompressedDescriptor {
    pub fn decode(raw: u64, geometry: &Geometry) -> Result<CompressedDescriptor> {
        let x = offset_bits(geometry);
        let descriptor = raw & ((1u64 << 62) - 1);
        let offset = descriptor & ((1u64 << x) - 1);
        let extra_sectors = descriptor >> x;
        if offset >> 56 != 0 {
            return Err(FormatError::invalid(
                "compressed cluster descriptor",
                format!("host offset {offset:#x} is past 2^56"),
            ));
        }
        Ok(CompressedDescriptor {
            offset,
            extra_sectors,
        })
    }

    pub fn encode(&self, geometry: &Geometry) -> Result<u64> {
        let x = offset_bits(geometry);
        if self.offset >> x != 0 || self.extra_sectors >> (62 - x) != 0 {
            return Err(FormatError::invalid(
                "compressed cluster descriptor",
                format!(
                    "offset {:#x} with {} extra sectors does not fit",
                    self.offset, self.extra_sectors
                ),
            ));
        }
        Ok(crate::entries::COMPRESSED | (self.extra_sectors << x) | self.offset)
    }

    /// The sector-aligned byte range the compressed data may occupy; this is
    /// what reads fetch and what refcounts account for.
    pub fn sector_range(&self) -> (u64, u64) {
        let start = self.offset & !(SECTOR - 1);
        (start, (self.extra_sectors + 1) * SECTOR)
    }

    /// Bytes from `offset` to the end of the last sector.
    pub fn stored_len(&self) -> u64 {
        (self.extra_sectors + 1) * SECTOR - (self.offset & (SECTOR - 1))
    }

    /// Host clusters the compressed data touches (each holds one reference).
    pub fn host_clusters(&self, geometry: &Geometry) -> std::ops::Range<u64> {
        let (start, len) = self.sector_range();
        geometry.clusters_touched(start, len)
    }
}

/// Decompresses `src` (the stored bytes starting at the descriptor's offset)
/// into exactly one cluster `dst`. Trailing bytes in `src` are ignored.
pub fn decompress(kind: CompressionType, src: &[u8], dst: &mut [u8], offset: u64) -> Result<()> {
    let err = |reason: String| FormatError::Decompress { offset, reason };
    match kind {
        CompressionType::Zlib => {
            let mut d = flate2::Decompress::new(false);
            let status = d
                .decompress(src, dst, flate2::FlushDecompress::Finish)
                .map_err(|e| err(e.to_string()))?;
            if (d.total_out() as usize) < dst.len() {
                return Err(err(format!(
                    "produced {} of {} bytes ({status:?})",
                    d.total_out(),
                    dst.len()
                )));
            }
            Ok(())
        }
        CompressionType::Zstd => {
            use std::io::Read;
            let mut dec =
                zstd::stream::read::Decoder::with_buffer(src).map_err(|e| err(e.to_string()))?;
            dec.read_exact(dst).map_err(|e| err(e.to_string()))
        }
    }
}

/// Compresses one cluster; `None` when compression does not save space.
pub fn compress(kind: CompressionType, src: &[u8]) -> Result<Option<Vec<u8>>> {
    let out = match kind {
        CompressionType::Zlib => {
            let mut c =
                flate2::Compress::new_with_window_bits(flate2::Compression::default(), false, 12);
            let mut out = Vec::with_capacity(src.len());
            let status = c
                .compress_vec(src, &mut out, flate2::FlushCompress::Finish)
                .map_err(|e| FormatError::Decompress {
                    offset: 0,
                    reason: e.to_string(),
                })?;
            if status != flate2::Status::StreamEnd {
                return Ok(None);
            }
            out
        }
        CompressionType::Zstd => {
            zstd::bulk::compress(src, 0).map_err(|e| FormatError::Decompress {
                offset: 0,
                reason: e.to_string(),
            })?
        }
    };
    Ok((out.len() < src.len()).then_some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trip_and_range() {
        let g = Geometry::new(16, false, 4).unwrap();
        let d = CompressedDescriptor {
            offset: 0x50123,
            extra_sectors: 3,
        };
        let raw = d.encode(&g).unwrap();
        assert_eq!(CompressedDescriptor::decode(raw, &g).unwrap(), d);
        assert_eq!(d.sector_range(), (0x50000, 2048));
        assert_eq!(d.stored_len(), 2048 - 0x123);
        assert_eq!(d.host_clusters(&g), 5..6);
    }

    #[test]
    fn round_trip_both_algorithms() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i / 100) as u8).collect();
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let mut c = compress(kind, &data).unwrap().unwrap();
            c.extend_from_slice(&[0xff; 300]);
            let mut out = vec![0u8; data.len()];
            decompress(kind, &c, &mut out, 0).unwrap();
            assert_eq!(out, data);
            assert!(decompress(kind, &c[..10], &mut out, 0).is_err());
        }
    }
}
