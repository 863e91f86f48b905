//! Which image a store holds, as a layer that keeps copies of its bytes
//! across restarts (the flash cache) must know it: a file deleted and
//! created again under the same name (even on the same inode), truncated,
//! or replaced by a copy is not the image the copies belong to.
//!
//! Two kinds of evidence, strongest first: vdcache's cache mark in a qcow2
//! header (a random image id and a generation raised at every writable
//! open through a cache; see `vdcache_qcow2::cache_mark`), and what the
//! store reports of its file (inode, birth time, size, change times).
//!
//! This module decides whether two identities are the same image; it does
//! no I/O beyond reading a header it is handed a store for.

use crate::io::ImageHandle;
use vdcache_backend::StoreIdentity;
use vdcache_qcow2::features::{autoclear, incompatible};
use vdcache_qcow2::{Header, header};

/// The cache mark of an image as found in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MarkIdentity {
    pub image_id: [u8; 16],
    pub generation: u64,
    /// The cache that stamped it.
    pub cache_id: [u8; 16],
    /// The autoclear bit is still set: no other writer opened the image
    /// since that cache last did.
    pub coherent: bool,
}

/// Everything that tells an image's file apart from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImageIdentity {
    pub mark: Option<MarkIdentity>,
    pub store: StoreIdentity,
    /// Opened for writing through the layer: its own writes then move the
    /// store's size and times, so only the file's inode and birth count.
    pub writable: bool,
}

/// How an identity found now relates to the one recorded earlier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The same image, as recorded.
    Same,
    /// The same image, stamped since by the cache comparing (the record
    /// should take the new identity).
    Advanced,
    /// Not the recorded image; the reason, in words.
    Different(String),
    /// The recorded image, made usable without this cache since (`vdcache
    /// recover --without-cache`): whatever the cache holds of it was given
    /// up by the operator.
    Abandoned,
}

impl ImageIdentity {
    /// Compares `self` (found now) with `recorded`, from the point of view
    /// of the cache `cache_id`.
    pub fn compare(&self, recorded: &ImageIdentity, cache_id: &[u8; 16]) -> Verdict {
        match (&self.mark, &recorded.mark) {
            (Some(found), Some(rec)) => compare_marks(found, rec, cache_id),
            (None, Some(_)) => Verdict::Different(
                "the file no longer carries vdcache's cache mark (it was replaced or rewritten)"
                    .into(),
            ),
            (Some(found), None)
                if found.cache_id == *cache_id
                    && found.coherent
                    && self.store.same_file(&recorded.store) =>
            {
                Verdict::Advanced
            }
            _ => self.compare_stores(recorded),
        }
    }

    fn compare_stores(&self, recorded: &ImageIdentity) -> Verdict {
        let (a, b) = (&self.store, &recorded.store);
        if !a.same_file(b) {
            return Verdict::Different(format!(
                "it is another file (inode {} born at {} ns, recorded inode {} born at {} ns)",
                a.ino, a.birth_ns, b.ino, b.birth_ns
            ));
        }
        if !(self.writable || recorded.writable || a.same_content(b)) {
            return Verdict::Different(format!(
                "it was changed (size {} modified at {} ns, recorded size {} modified at {} ns)",
                a.size, a.mtime_ns, b.size, b.mtime_ns
            ));
        }
        Verdict::Same
    }
}

fn compare_marks(found: &MarkIdentity, rec: &MarkIdentity, cache_id: &[u8; 16]) -> Verdict {
    if found.image_id != rec.image_id {
        return Verdict::Different(format!(
            "it is another image (id {}, recorded {})",
            vdcache_qcow2::cache_mark::hex(&found.image_id),
            vdcache_qcow2::cache_mark::hex(&rec.image_id)
        ));
    }
    if found.cache_id == vdcache_qcow2::cache_mark::NO_CACHE {
        return Verdict::Abandoned;
    }
    if found.cache_id != *cache_id {
        return Verdict::Different("another vdcache cache served it since this one did".into());
    }
    if !found.coherent {
        return Verdict::Different(
            "another program (QEMU, `vdcache recover --full`, or vdcache without this cache) wrote to it since".into(),
        );
    }
    if found.generation == rec.generation {
        Verdict::Same
    } else if found.generation == rec.generation + 1 {
        // Stamped durably just before a crash took the record with it.
        Verdict::Advanced
    } else {
        Verdict::Different(format!(
            "it is a copy from another time (generation {}, recorded {}), perhaps restored from a backup",
            found.generation, rec.generation
        ))
    }
}

/// The mark and in-cache state of a parsed header.
pub fn mark_of(h: &Header) -> Option<MarkIdentity> {
    let m = h.extensions.cache_mark.as_ref()?.current()?;
    Some(MarkIdentity {
        image_id: m.image_id,
        generation: m.generation,
        cache_id: m.cache_id,
        coherent: h.autoclear_features & autoclear::CACHE_COHERENT != 0,
    })
}

/// Whether a header says a cache holds data its file lacks.
pub fn in_cache(h: &Header) -> bool {
    h.incompatible_features & incompatible::IN_CACHE != 0
}

/// Reads the identity of an image straight from its store, bypassing every
/// layer that may hold copies (those copies are what the identity decides
/// about). A store that is not a readable qcow2 image has no mark.
pub fn read_identity(handle: &ImageHandle, writable: bool) -> std::io::Result<ImageIdentity> {
    let store = handle.backend.identity()?;
    Ok(ImageIdentity {
        mark: read_header_direct(handle)?.as_ref().and_then(mark_of),
        store,
        writable,
    })
}

/// The cache an image file says holds its newest data, if it says so.
pub fn needs_cache_of(handle: &ImageHandle) -> Option<[u8; 16]> {
    let h = read_header_direct(handle).ok()??;
    let id = h.extensions.cache_mark.as_ref()?.current()?.cache_id;
    in_cache(&h).then_some(id)
}

/// The header as the store holds it, if it parses as qcow2.
pub fn read_header_direct(handle: &ImageHandle) -> std::io::Result<Option<Header>> {
    let b = &handle.backend;
    let len = b.len()?;
    let mut prefix = [0u8; 128];
    if len < prefix.len() as u64 {
        return Ok(None);
    }
    b.read_at(&mut prefix, 0)?;
    let Ok(bits) = header::peek_cluster_bits(&prefix) else {
        return Ok(None);
    };
    let mut first = vec![0u8; (1u64 << bits).min(len) as usize];
    b.read_at(&mut first, 0)?;
    Ok(Header::parse(&first).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CACHE: [u8; 16] = [7; 16];

    fn marked(id: u8, generation: u64, coherent: bool) -> ImageIdentity {
        ImageIdentity {
            mark: Some(MarkIdentity {
                image_id: [id; 16],
                generation,
                cache_id: CACHE,
                coherent,
            }),
            store: StoreIdentity {
                dev: 1,
                ino: 2,
                birth_ns: 3,
                size: 100,
                mtime_ns: 4,
                ctime_ns: 5,
            },
            writable: true,
        }
    }

    #[test]
    fn marks_decide_and_tell_why() {
        let rec = marked(1, 5, true);
        assert_eq!(marked(1, 5, true).compare(&rec, &CACHE), Verdict::Same);
        assert_eq!(marked(1, 6, true).compare(&rec, &CACHE), Verdict::Advanced);
        let why = |v: Verdict| match v {
            Verdict::Different(r) => r,
            other => panic!("expected a difference, got {other:?}"),
        };
        assert!(why(marked(1, 4, true).compare(&rec, &CACHE)).contains("backup"));
        assert!(why(marked(2, 5, true).compare(&rec, &CACHE)).contains("another image"));
        assert!(why(marked(1, 5, false).compare(&rec, &CACHE)).contains("wrote to it"));
        assert!(why(marked(1, 5, true).compare(&rec, &[8; 16])).contains("another vdcache"));
        let mut plain = rec;
        plain.mark = None;
        assert!(why(plain.compare(&rec, &CACHE)).contains("no longer carries"));
    }

    #[test]
    fn stores_decide_without_marks() {
        let mut rec = marked(1, 5, true);
        rec.mark = None;
        rec.writable = false;
        let mut found = rec;
        assert_eq!(found.compare(&rec, &CACHE), Verdict::Same);
        // A read-only file that changed is another image's content.
        found.store.mtime_ns += 1;
        assert!(matches!(found.compare(&rec, &CACHE), Verdict::Different(_)));
        // Written through the cache itself: size and times move.
        found.writable = true;
        assert_eq!(found.compare(&rec, &CACHE), Verdict::Same);
        // Deleted and created again on the same inode: another birth.
        found.store.birth_ns += 1;
        assert!(matches!(found.compare(&rec, &CACHE), Verdict::Different(_)));
        // First stamped by this cache: the record adopts the mark.
        let stamped = marked(9, 1, true);
        assert_eq!(stamped.compare(&rec, &CACHE), Verdict::Advanced);
    }
}
