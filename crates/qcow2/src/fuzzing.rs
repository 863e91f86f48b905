//! Entry point shared by the `parse_structures` fuzz target (fuzz/) and the
//! bounded fuzz test: arbitrary bytes given to each pure parser of this
//! crate. Any error is a correct outcome; a panic is a finding.

use crate::entries::{L2Format, L2Mapping};
use crate::{Geometry, Header, bitmap, snapshot};

/// Parses `data` as a header, then (after a first byte choosing the
/// geometry and the entry count) as a snapshot table, a bitmap directory and
/// L2 entries, re-encoding every entry that decodes.
pub fn exercise_structures(data: &[u8]) {
    let _ = Header::parse(data);
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(geometry) = Geometry::new(
        9 + u32::from(selector % 13),
        selector & 0x80 != 0,
        u32::from(selector % 7),
    ) else {
        return;
    };
    let count = u32::from(selector);
    let _ = snapshot::parse_table(rest, count, &geometry);
    let _ = bitmap::parse_directory(rest, count, &geometry);
    let format = L2Format {
        geometry,
        version: 3,
        external_data: selector & 0x40 != 0,
    };
    for chunk in rest.chunks_exact(16) {
        let (raw, bitmap) = chunk.split_at(8);
        let raw = u64::from_be_bytes(raw.try_into().unwrap_or_default());
        let bitmap = u64::from_be_bytes(bitmap.try_into().unwrap_or_default());
        if let Ok(m) = L2Mapping::decode(raw, bitmap, &format) {
            let _ = m.encode(&format);
        }
    }
}
