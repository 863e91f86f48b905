//! Arbitrary bytes fed to each pure parser of the qcow2 format crate.
#![no_main]

use vdcache_qcow2::entries::{L2Format, L2Mapping};
use vdcache_qcow2::{Geometry, Header, bitmap, snapshot};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = Header::parse(data);
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(geometry) = Geometry::new(9 + u32::from(selector % 13), selector & 0x80 != 0, u32::from(selector % 7)) else {
        return;
    };
    let count = u32::from(selector);
    let _ = snapshot::parse_table(rest, count, &geometry);
    let _ = bitmap::parse_directory(rest, count, &geometry);
    let format = L2Format { geometry, version: 3, external_data: selector & 0x40 != 0 };
    for chunk in rest.chunks_exact(16) {
        let raw = u64::from_be_bytes(chunk[..8].try_into().unwrap_or_default());
        let bitmap = u64::from_be_bytes(chunk[8..].try_into().unwrap_or_default());
        if let Ok(m) = L2Mapping::decode(raw, bitmap, &format) {
            let _ = m.encode(&format);
        }
    }
});
