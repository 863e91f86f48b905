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
//! Layout (big endian, like every qcow2 field): version u32 (1), reserved
//! u32, image id 16 bytes, generation u64, cache id 16 bytes, cache path
//! length u32, cache path (UTF-8, at most [`MAX_CACHE_PATH`] bytes).
//!
//! Pure format code: no I/O, no policy.

use crate::bytes::Reader;
use crate::{FormatError, Result};

/// Header extension type of the mark ("vdc1").
pub const EXT_CACHE_MARK: u32 = 0x7664_6331;
/// Longest cache path a mark records.
pub const MAX_CACHE_PATH: usize = 1024;
const VERSION: u32 = 1;
const FIXED_BYTES: usize = 4 + 4 + 16 + 8 + 16 + 4;

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
    pub fn encode(&self) -> Vec<u8> {
        let path = truncated_path(&self.cache_path);
        let mut out = Vec::with_capacity(FIXED_BYTES + path.len());
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(&self.image_id);
        out.extend_from_slice(&self.generation.to_be_bytes());
        out.extend_from_slice(&self.cache_id);
        out.extend_from_slice(&(path.len() as u32).to_be_bytes());
        out.extend_from_slice(path.as_bytes());
        out
    }

    pub fn decode(data: &[u8]) -> Result<CacheMark> {
        let mut r = Reader::new(data, "vdcache cache mark extension");
        let version = r.u32()?;
        if version != VERSION {
            return Err(FormatError::unsupported(
                "vdcache cache mark extension",
                format!("version {version} (this vdcache knows version {VERSION})"),
            ));
        }
        let _reserved = r.u32()?;
        let mut image_id = [0u8; 16];
        image_id.copy_from_slice(r.take(16)?);
        let generation = r.u64()?;
        let mut cache_id = [0u8; 16];
        cache_id.copy_from_slice(r.take(16)?);
        let len = r.u32()? as usize;
        if len > MAX_CACHE_PATH {
            return Err(FormatError::invalid(
                "vdcache cache mark extension",
                format!("cache path of {len} bytes exceeds {MAX_CACHE_PATH}"),
            ));
        }
        let cache_path = std::str::from_utf8(r.take(len)?)
            .map_err(|_| {
                FormatError::invalid("vdcache cache mark extension", "cache path is not UTF-8")
            })?
            .to_string();
        Ok(CacheMark {
            image_id,
            generation,
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

    #[test]
    fn round_trips_and_refuses_bad_lengths() {
        let m = CacheMark {
            image_id: [3; 16],
            generation: 42,
            cache_id: [9; 16],
            cache_path: "/ssd/vdcache.cache".into(),
        };
        let bytes = m.encode();
        assert_eq!(CacheMark::decode(&bytes).unwrap(), m);
        let mut long = bytes.clone();
        let at = FIXED_BYTES - 4;
        long[at..at + 4].copy_from_slice(&5000u32.to_be_bytes());
        let e = CacheMark::decode(&long).unwrap_err().to_string();
        assert!(e.contains("exceeds 1024"), "{e}");
        let e = CacheMark::decode(&bytes[..20]).unwrap_err().to_string();
        assert!(e.contains("vdcache cache mark"), "{e}");
        let mut v2 = bytes;
        v2[..4].copy_from_slice(&2u32.to_be_bytes());
        assert!(CacheMark::decode(&v2).is_err());
    }
}
