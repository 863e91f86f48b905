//! The persistent dirty bitmap directory and bitmap tables. vdcache does
//! not maintain bitmaps; it parses them to account for their clusters (so
//! they stay intact) and to mark them in use when it writes to an image.

use crate::bytes::{Reader, be64_at, pad8};
use crate::entries::OFFSET_MASK;
use crate::geometry::Geometry;
use crate::{FormatError, Result};

/// Bitmap directory entry flag: the bitmap was not saved consistently.
pub const FLAG_IN_USE: u32 = 1 << 0;
/// Bitmap directory entry flag: the bitmap tracks all writes.
pub const FLAG_AUTO: u32 = 1 << 1;
/// Largest bitmap table QEMU accepts, in entries.
pub const MAX_TABLE_ENTRIES: u32 = 1 << 27;

/// One bitmap directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapEntry {
    /// Byte position of this entry inside the directory (for in-place edits).
    pub position: usize,
    pub table_offset: u64,
    pub table_size: u32,
    pub flags: u32,
    pub kind: u8,
    pub granularity_bits: u8,
    pub name: String,
}

/// Parses the bitmap directory.
pub fn parse_directory(buf: &[u8], count: u32, geometry: &Geometry) -> Result<Vec<BitmapEntry>> {
    let mut r = Reader::new(buf, "bitmap directory");
    let mut out = Vec::with_capacity((count as usize).min(buf.len() / 24));
    for _ in 0..count {
        let position = r.pos();
        let table_offset = r.u64()?;
        let table_size = r.u32()?;
        let flags = r.u32()?;
        let kind = r.u8()?;
        let granularity_bits = r.u8()?;
        let name_size = r.u16()?;
        let extra_size = r.u32()?;
        r.take(extra_size as usize)?;
        let name = String::from_utf8_lossy(r.take(name_size as usize)?).into_owned();
        let used = r.pos() - position;
        r.take(pad8(used) - used)?;
        if !geometry.is_cluster_aligned(table_offset) {
            return Err(FormatError::invalid(
                "bitmap table offset",
                format!("bitmap '{name}': {table_offset:#x} is not cluster aligned"),
            ));
        }
        if table_size > MAX_TABLE_ENTRIES {
            return Err(FormatError::invalid(
                "bitmap table size",
                format!("bitmap '{name}': {table_size} entries exceed {MAX_TABLE_ENTRIES}"),
            ));
        }
        out.push(BitmapEntry {
            position,
            table_offset,
            table_size,
            flags,
            kind,
            granularity_bits,
            name,
        });
    }
    Ok(out)
}

/// Host offsets of the data clusters a bitmap table references.
pub fn table_data_clusters(table: &[u8], geometry: &Geometry) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for i in 0..table.len() / 8 {
        let raw = be64_at(table, i);
        let off = raw & OFFSET_MASK;
        if raw & !(OFFSET_MASK | 1) != 0 || (off != 0 && raw & 1 != 0) {
            return Err(FormatError::invalid(
                "bitmap table entry",
                format!("{raw:#018x} has reserved bits set"),
            ));
        }
        if off != 0 {
            if !geometry.is_cluster_aligned(off) {
                return Err(FormatError::invalid(
                    "bitmap table entry",
                    format!("{off:#x} is not cluster aligned"),
                ));
            }
            out.push(off);
        }
    }
    Ok(out)
}

/// Sets the in-use flag of an entry inside the directory bytes.
pub fn mark_in_use(directory: &mut [u8], entry: &BitmapEntry) {
    let at = entry.position + 12;
    let flags = entry.flags | FLAG_IN_USE;
    directory[at..at + 4].copy_from_slice(&flags.to_be_bytes());
}
