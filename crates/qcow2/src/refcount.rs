//! Refcount table entries and refcount block entries of every width
//! (refcount_order 0..=6, sub-byte widths least significant bit first).

use crate::geometry::{Geometry, HostOffset};
use crate::{FormatError, Result};

/// Decodes a refcount table entry: the host offset of a refcount block.
pub fn decode_table_entry(raw: u64, geometry: &Geometry) -> Result<Option<HostOffset>> {
    if raw & 0x1ff != 0 {
        return Err(FormatError::invalid(
            "refcount table entry",
            format!("{raw:#018x} has reserved bits set"),
        ));
    }
    if !geometry.is_cluster_aligned(raw) {
        return Err(FormatError::invalid(
            "refcount table entry",
            format!("refcount block offset {raw:#x} is not cluster aligned"),
        ));
    }
    Ok((raw != 0).then_some(HostOffset(raw)))
}

/// Reads refcount entry `index` of a refcount block (or a slice of one,
/// with `index` relative to the slice).
pub fn get(block: &[u8], index: u64, order: u32) -> u64 {
    let bits = 1u64 << order;
    if bits >= 8 {
        let width = (bits / 8) as usize;
        let at = index as usize * width;
        block[at..at + width]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    } else {
        let bit = index * bits;
        let byte = block[(bit / 8) as usize];
        let shift = bit % 8;
        (u64::from(byte) >> shift) & ((1 << bits) - 1)
    }
}

/// Writes refcount entry `index`; fails when `value` does not fit.
pub fn set(block: &mut [u8], index: u64, order: u32, value: u64) -> Result<()> {
    let bits = 1u64 << order;
    if bits < 64 && value >> bits != 0 {
        return Err(FormatError::invalid(
            "refcount",
            format!("{value} does not fit in {bits} bits"),
        ));
    }
    if bits >= 8 {
        let width = (bits / 8) as usize;
        let at = index as usize * width;
        let bytes = value.to_be_bytes();
        block[at..at + width].copy_from_slice(&bytes[8 - width..]);
    } else {
        let bit = index * bits;
        let byte = &mut block[(bit / 8) as usize];
        let shift = bit % 8;
        let mask = (((1u16 << bits) - 1) as u8) << shift;
        *byte = (*byte & !mask) | (((value as u8) << shift) & mask);
    }
    Ok(())
}

/// Bytes of a refcount block that hold the entries for `count` clusters,
/// rounded up to whole bytes.
pub fn bytes_for_entries(count: u64, order: u32) -> u64 {
    (count << order).div_ceil(8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn set_then_get_every_order(order in 0u32..=6, idx in 0u64..64, value: u64, other: u64) {
            let mut block = vec![0u8; 512];
            let bits = 1u32 << order;
            let mask = if bits == 64 { u64::MAX } else { (1u64 << bits) - 1 };
            set(&mut block, idx, order, value & mask).unwrap();
            let neighbour = if idx == 0 { 1 } else { idx - 1 };
            set(&mut block, neighbour, order, other & mask).unwrap();
            prop_assert_eq!(get(&block, idx, order), value & mask);
            prop_assert_eq!(get(&block, neighbour, order), other & mask);
        }
    }

    #[test]
    fn sub_byte_layout_is_lsb_first() {
        let mut block = vec![0u8; 2];
        set(&mut block, 0, 0, 1).unwrap();
        set(&mut block, 3, 0, 1).unwrap();
        assert_eq!(block[0], 0b1001);
        set(&mut block, 1, 2, 0xa).unwrap();
        assert_eq!(block[0], 0xa9);
        assert!(set(&mut block, 0, 1, 4).is_err());
    }

    #[test]
    fn table_entries() {
        let g = Geometry::new(16, false, 4).unwrap();
        assert_eq!(
            decode_table_entry(0x20000, &g).unwrap(),
            Some(HostOffset(0x20000))
        );
        assert_eq!(decode_table_entry(0, &g).unwrap(), None);
        assert!(decode_table_entry(0x20001, &g).is_err());
        assert!(decode_table_entry(0x20200, &g).is_err());
    }
}
