//! The internal snapshot table: parsed so that snapshots are listed and
//! their clusters are accounted for (and so never overwritten), and encoded
//! back unchanged.

use crate::bytes::{Reader, pad8};
use crate::geometry::Geometry;
use crate::header::MAX_L1_BYTES;
use crate::{FormatError, Result};

/// QEMU's limit on a snapshot's extra data.
pub const MAX_EXTRA_DATA: u32 = 1024;

/// One internal snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub l1_table_offset: u64,
    pub l1_size: u32,
    pub id: String,
    pub name: String,
    pub date_sec: u32,
    pub date_nsec: u32,
    pub vm_clock_nsec: u64,
    pub vm_state_size: u64,
    /// Virtual disk size when the snapshot was taken, if recorded.
    pub disk_size: Option<u64>,
    /// Extra data exactly as stored (including the fields decoded above).
    pub extra: Vec<u8>,
}

/// Parses `count` snapshot entries from `buf` (the snapshot table).
/// Returns the snapshots and the table's length in bytes.
pub fn parse_table(buf: &[u8], count: u32, geometry: &Geometry) -> Result<(Vec<Snapshot>, usize)> {
    let mut r = Reader::new(buf, "snapshot table");
    // Each entry takes at least 40 bytes, so the count is bounded by buf.
    let mut out = Vec::with_capacity((count as usize).min(buf.len() / 40));
    for i in 0..count {
        let start = r.pos();
        let l1_table_offset = r.u64()?;
        let l1_size = r.u32()?;
        let id_len = r.u16()?;
        let name_len = r.u16()?;
        let date_sec = r.u32()?;
        let date_nsec = r.u32()?;
        let vm_clock_nsec = r.u64()?;
        let vm_state_size32 = r.u32()?;
        let extra_size = r.u32()?;
        if extra_size > MAX_EXTRA_DATA {
            return Err(FormatError::invalid(
                "snapshot extra_data_size",
                format!("snapshot {i}: {extra_size} bytes exceed {MAX_EXTRA_DATA}"),
            ));
        }
        let extra = r.take(extra_size as usize)?.to_vec();
        let id = String::from_utf8_lossy(r.take(id_len as usize)?).into_owned();
        let name = String::from_utf8_lossy(r.take(name_len as usize)?).into_owned();
        let used = r.pos() - start;
        let pad = pad8(used) - used;
        if i + 1 == count {
            // QEMU writes the table unpadded: the last entry's padding may
            // lie past the end of the file.
            r.take(pad.min(buf.len() - r.pos()))?;
        } else {
            r.take(pad)?;
        }
        if !geometry.is_cluster_aligned(l1_table_offset) {
            return Err(FormatError::invalid(
                "snapshot l1_table_offset",
                format!("snapshot {i} ('{name}'): {l1_table_offset:#x} is not cluster aligned"),
            ));
        }
        if u64::from(l1_size) * 8 > MAX_L1_BYTES {
            return Err(FormatError::invalid(
                "snapshot l1_size",
                format!("snapshot {i} ('{name}'): {l1_size} entries exceed the 32 MiB L1 limit"),
            ));
        }
        let mut er = Reader::new(&extra, "snapshot extra data");
        let vm_state_size = er.u64().unwrap_or(u64::from(vm_state_size32));
        let disk_size = er.u64().ok();
        out.push(Snapshot {
            l1_table_offset,
            l1_size,
            id,
            name,
            date_sec,
            date_nsec,
            vm_clock_nsec,
            vm_state_size,
            disk_size,
            extra,
        });
    }
    Ok((out, r.pos()))
}

/// Bytes one entry needs at most before padding: used by callers to bound
/// how much of the file they read for `count` entries.
pub fn max_table_bytes(count: u32) -> u64 {
    u64::from(count) * (40 + u64::from(MAX_EXTRA_DATA) + 2 * 65535 + 8)
}

/// Encodes snapshot entries back into a table.
pub fn encode_table(snapshots: &[Snapshot]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in snapshots {
        let start = out.len();
        out.extend_from_slice(&s.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&s.l1_size.to_be_bytes());
        out.extend_from_slice(&(s.id.len() as u16).to_be_bytes());
        out.extend_from_slice(&(s.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&s.date_sec.to_be_bytes());
        out.extend_from_slice(&s.date_nsec.to_be_bytes());
        out.extend_from_slice(&s.vm_clock_nsec.to_be_bytes());
        out.extend_from_slice(&(s.vm_state_size.min(u64::from(u32::MAX)) as u32).to_be_bytes());
        out.extend_from_slice(&(s.extra.len() as u32).to_be_bytes());
        out.extend_from_slice(&s.extra);
        out.extend_from_slice(s.id.as_bytes());
        out.extend_from_slice(s.name.as_bytes());
        let used = out.len() - start;
        out.resize(start + pad8(used), 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let g = Geometry::new(16, false, 4).unwrap();
        let mut extra = Vec::new();
        extra.extend_from_slice(&0u64.to_be_bytes());
        extra.extend_from_slice(&(1u64 << 30).to_be_bytes());
        let s = Snapshot {
            l1_table_offset: 0x90000,
            l1_size: 2,
            id: "1".into(),
            name: "before-upgrade".into(),
            date_sec: 1,
            date_nsec: 2,
            vm_clock_nsec: 3,
            vm_state_size: 0,
            disk_size: Some(1 << 30),
            extra,
        };
        let bytes = encode_table(&[s.clone(), s.clone()]);
        let (back, len) = parse_table(&bytes, 2, &g).unwrap();
        assert_eq!(back, vec![s.clone(), s]);
        assert_eq!(len, bytes.len());
        assert!(parse_table(&bytes[..50], 2, &g).is_err());
    }
}
