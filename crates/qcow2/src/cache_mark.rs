//! vdcache's header extension: who the image is, and which flash cache may
//! hold newer data of it than the file does.
//!
//! The extension travels with the file (QEMU keeps unknown header
//! extensions when it rewrites a header), so it tells apart an image from
//! a file that merely took its name or inode: a new file has no mark or
//! another id, and a restored copy an older generation. Two feature bits
//! go with it (see [`crate::features`]): an incompatible bit while the
//! cache may hold data the file lacks, so QEMU refuses the stale file, and
//! an autoclear bit that any other writer clears, so the cache learns the
//! file changed behind its back.
//!
//! The extension has a fixed size and holds two slots, each with its own
//! checksum; a new generation is written into the slot the current one
//! does not occupy, in place. A write torn by a crash spoils only that
//! slot, and the other still names the image (one generation older).
//!
//! Slot layout (big endian, like every qcow2 field): magic u32,
//! generation u64, image id 16 bytes, cache id 16 bytes, cache path
//! length u16, cache path (UTF-8), zeros, CRC-32C of the slot's other
//! bytes in its last four.
//!
//! Pure format code: no I/O, no policy.

use crate::{FormatError, Result};

/// Header extension type of the mark ("vdc1").
pub const EXT_CACHE_MARK: u32 = 0x7664_6331;
/// Bytes of one slot.
pub const SLOT_BYTES: usize = 512;
/// Bytes of the extension's data: two slots.
pub const EXT_BYTES: usize = 2 * SLOT_BYTES;
const SLOT_MAGIC: u32 = 0x7664_6d31;
const FIXED_BYTES: usize = 4 + 8 + 16 + 16 + 2;
/// Longest cache path a slot records (longer ones are cut: the path is
/// only advice for messages).
pub const MAX_CACHE_PATH: usize = SLOT_BYTES - FIXED_BYTES - 4;

/// The cache id of a mark written when an image was made usable without
/// the cache that held its newest data (`vdcache recover --without-cache`):
/// no cache holds data of it, and what one still holds was given up.
pub const NO_CACHE: [u8; 16] = [0; 16];

/// What vdcache records in an image it serves through a flash cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheMark {
    /// Random, chosen the first time a cache serves the image writable.
    pub image_id: [u8; 16],
    /// Raised each time a cache opens the image writable.
    pub generation: u64,
    /// The cache that serves it (the uuid of its superblock).
    pub cache_id: [u8; 16],
    /// Where that cache lives, for messages that say how to recover.
    pub cache_path: String,
}

impl CacheMark {
    /// Which of the two slots this generation is written to.
    pub fn slot(&self) -> usize {
        (self.generation % 2) as usize
    }

    /// The slot's bytes.
    pub fn encode_slot(&self) -> [u8; SLOT_BYTES] {
        let path = truncated_path(&self.cache_path);
        let mut out = [0u8; SLOT_BYTES];
        out[0..4].copy_from_slice(&SLOT_MAGIC.to_be_bytes());
        out[4..12].copy_from_slice(&self.generation.to_be_bytes());
        out[12..28].copy_from_slice(&self.image_id);
        out[28..44].copy_from_slice(&self.cache_id);
        out[44..46].copy_from_slice(&(path.len() as u16).to_be_bytes());
        out[FIXED_BYTES..FIXED_BYTES + path.len()].copy_from_slice(path.as_bytes());
        let crc = crc32c::crc32c(&out[..SLOT_BYTES - 4]);
        out[SLOT_BYTES - 4..].copy_from_slice(&crc.to_be_bytes());
        out
    }

    /// A slot's mark, or `None` for an empty or torn slot.
    fn decode_slot(slot: &[u8]) -> Option<CacheMark> {
        let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if slot.len() != SLOT_BYTES || be32(&slot[0..4]) != SLOT_MAGIC {
            return None;
        }
        if crc32c::crc32c(&slot[..SLOT_BYTES - 4]) != be32(&slot[SLOT_BYTES - 4..]) {
            return None;
        }
        let mut generation = [0u8; 8];
        generation.copy_from_slice(&slot[4..12]);
        let mut image_id = [0u8; 16];
        image_id.copy_from_slice(&slot[12..28]);
        let mut cache_id = [0u8; 16];
        cache_id.copy_from_slice(&slot[28..44]);
        let len = usize::from(u16::from_be_bytes([slot[44], slot[45]])).min(MAX_CACHE_PATH);
        let cache_path =
            String::from_utf8_lossy(&slot[FIXED_BYTES..FIXED_BYTES + len]).into_owned();
        Some(CacheMark {
            image_id,
            generation: u64::from_be_bytes(generation),
            cache_id,
            cache_path,
        })
    }

    /// The image id as hex, for messages.
    pub fn image_id_hex(&self) -> String {
        hex(&self.image_id)
    }

    /// The cache id as hex, for messages.
    pub fn cache_id_hex(&self) -> String {
        hex(&self.cache_id)
    }
}

/// The extension: two slots, either of which may be empty or torn.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MarkSlots {
    pub slots: [Option<CacheMark>; 2],
}

impl MarkSlots {
    /// Decodes the extension's data; only its length can be wrong (a slot
    /// that does not verify is simply empty).
    pub fn decode(data: &[u8]) -> Result<MarkSlots> {
        if data.len() != EXT_BYTES {
            return Err(FormatError::invalid(
                "vdcache cache mark extension",
                format!("{} bytes (expected {EXT_BYTES})", data.len()),
            ));
        }
        Ok(MarkSlots {
            slots: [
                CacheMark::decode_slot(&data[..SLOT_BYTES]),
                CacheMark::decode_slot(&data[SLOT_BYTES..]),
            ],
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; EXT_BYTES];
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(m) = s {
                out[i * SLOT_BYTES..(i + 1) * SLOT_BYTES].copy_from_slice(&m.encode_slot());
            }
        }
        out
    }

    /// The newest valid mark.
    pub fn current(&self) -> Option<&CacheMark> {
        self.slots.iter().flatten().max_by_key(|m| m.generation)
    }

    /// Records `mark` in its slot.
    pub fn set(&mut self, mark: CacheMark) {
        let slot = mark.slot();
        self.slots[slot] = Some(mark);
    }
}

/// Lower-case hex of an id.
pub fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The longest prefix of `path` within [`MAX_CACHE_PATH`] bytes that ends
/// on a character boundary.
fn truncated_path(path: &str) -> &str {
    let mut end = path.len().min(MAX_CACHE_PATH);
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    &path[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(generation: u64) -> CacheMark {
        CacheMark {
            image_id: [3; 16],
            generation,
            cache_id: [9; 16],
            cache_path: "/ssd/vdcache.cache".into(),
        }
    }

    #[test]
    fn the_newest_valid_slot_wins_and_a_torn_one_is_empty() {
        let mut slots = MarkSlots::default();
        slots.set(mark(4));
        slots.set(mark(5));
        let mut bytes = slots.encode();
        assert_eq!(MarkSlots::decode(&bytes).unwrap().current(), Some(&mark(5)));
        // Generation 5 lives in slot 1: tear it, generation 4 remains.
        bytes[SLOT_BYTES + 100] ^= 1;
        let torn = MarkSlots::decode(&bytes).unwrap();
        assert_eq!(torn.slots[1], None);
        assert_eq!(torn.current(), Some(&mark(4)));
        assert!(MarkSlots::decode(&bytes[..100]).is_err());
        assert_eq!(
            MarkSlots::decode(&[0u8; EXT_BYTES]).unwrap().current(),
            None
        );
    }

    #[test]
    fn long_paths_are_cut_on_a_character_boundary() {
        let mut m = mark(1);
        m.cache_path = "é".repeat(400);
        let slot = m.encode_slot();
        let back = CacheMark::decode_slot(&slot).unwrap();
        assert!(back.cache_path.len() <= MAX_CACHE_PATH);
        assert!(m.cache_path.starts_with(&back.cache_path));
    }
}
