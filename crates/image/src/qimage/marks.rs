//! vdcache's marks in an image header while a flash cache serves it: the
//! cache mark (image id, generation, cache), the in-cache bit while the
//! cache may hold data the file lacks, and the coherent bit that another
//! writer clears (see `vdcache_qcow2::cache_mark`).
//!
//! Order (what makes them safe): the mark is stamped when the image opens
//! writable through the cache, with the in-cache bit if the cache may
//! keep changes newer than the file; after a write-back cleared the bit,
//! it is made durable again before the next change (a write of the
//! disk's, under its range lock). It is cleared only after the cache
//! wrote everything of the image back, with the whole disk locked
//! against writes. Header bytes go to the store itself
//! (`HostIo::write_durable`), never only into the cache, since they are
//! for readers without it.
//!
//! Must not: decide what the cache holds (the `HostIo` layer answers).

use super::{Locked, Qcow2Image};
use crate::error::{ImageError, Result};
use crate::hostio::{Holder, IoTag, MetaTable};
use crate::identity::{self, ImageIdentity};
use std::sync::atomic::Ordering;
use vdcache_qcow2::Header;
use vdcache_qcow2::HostOffset;
use vdcache_qcow2::cache_mark::{CacheMark, MarkSlots, SLOT_BYTES};
use vdcache_qcow2::features::{self, FeatureKind, autoclear, incompatible};
use vdcache_qcow2::header::{self, FeatureName, field_offset};

/// The feature bits a cache mark sets, whose names the header must carry
/// (QEMU names the in-cache bit when it refuses the image).
const MARK_BITS: [(FeatureKind, u8); 2] = [
    (FeatureKind::Incompatible, 56),
    (FeatureKind::Autoclear, 56),
];

impl Qcow2Image {
    /// Refuses an image whose newest data is in a cache this open does
    /// not go through (unless only inspected).
    pub(crate) fn check_cache_mark(&self, inspect: bool) -> Result<()> {
        let h = self.header();
        if !identity::in_cache(&h) || inspect {
            return Ok(());
        }
        let mark = h.extensions.cache_mark.as_ref().and_then(|m| m.current());
        let holder = self.io.copies().holder();
        if let (Some(m), Some(holder)) = (mark, &holder) {
            if m.cache_id == holder.id {
                return Ok(());
            }
            if m.cache_path == holder.path {
                return Err(ImageError::CacheReplaced {
                    image: self.name().to_string(),
                    cache: holder.path.clone(),
                });
            }
        }
        Err(ImageError::InCache {
            image: self.name().to_string(),
            cache: mark.map_or_else(|| "(unrecorded)".to_string(), |m| m.cache_path.clone()),
        })
    }

    /// Stamps a writable image opened through a cache: a new generation,
    /// this cache's id, the coherent bit, and the in-cache bit if the
    /// cache holds data the file lacks or may keep changes newer than the
    /// file. Durable before any write of the open; the cache then records
    /// the new identity.
    pub(crate) fn stamp_for_holder(&self) -> Result<()> {
        let Some(holder) = self.io.copies().holder() else {
            return Ok(());
        };
        if self.read_only {
            return Ok(());
        }
        let keeps_newer = self.io.copies().keeps_newer(self.disk);
        let mut l = self.lock();
        if l.m.header.version < 3 {
            if keeps_newer {
                return Err(ImageError::Unsupported {
                    image: self.name().to_string(),
                    reason: "a version 2 (compat=0.10) image has no feature bits to mark it as needing the cache, so a write-back cache could leave it silently out of date; upgrade it with `qemu-img amend -o compat=1.1`, or serve it with --cache-mode writethrough".into(),
                });
            }
            return Ok(());
        }
        self.make_room_for_mark(&mut l)?;
        let h = l.m.header.clone();
        let first = self.read_first_cluster()?;
        let at = header::cache_mark_offset(&first, &h)
            .ok()
            .flatten()
            .ok_or_else(|| {
                ImageError::corrupt(self.name(), "the cache mark vanished from the header")
            })?;
        let slots = h.extensions.cache_mark.clone().unwrap_or_default();
        let mark = next_mark(slots.current(), &holder);
        let holds = self
            .io
            .copies()
            .holds_newer(&self.handle)
            .map_err(|e| ImageError::io(self.name(), "ask the cache", e))?;
        let mut bits = h.clone();
        if holds || keeps_newer {
            // Set now, with the stamp, rather than at the first change: an
            // open then costs one sync of the store.
            bits.incompatible_features |= incompatible::IN_CACHE;
        }
        bits.autoclear_features |= autoclear::CACHE_COHERENT;
        // Refcounts may be inconsistent while the session is open (a crash
        // leaves allocations half recorded): the dirty bit says so, and the
        // next open (vdcache's or QEMU's) rebuilds them; a clean close
        // clears it.
        bits.incompatible_features |= incompatible::DIRTY;
        // The new generation goes into the slot the current one does not
        // use, and the bits into the header's first sector: either write
        // alone leaves a valid image, so one sync serves both.
        let slot = mark.encode_slot();
        let fields = feature_fields(&bits);
        self.write_header_durable(&[
            (at + (mark.slot() * SLOT_BYTES) as u64, &slot),
            (field_offset::INCOMPATIBLE_FEATURES, &fields),
        ])?;
        let marked = identity::in_cache(&bits);
        let mut stamped = bits;
        stamped
            .extensions
            .cache_mark
            .get_or_insert_with(MarkSlots::default)
            .set(mark);
        l.m.header = stamped;
        l.m.dirty_on_disk = true;
        drop(l);
        self.marked.store(marked, Ordering::SeqCst);
        self.keeps_newer.store(keeps_newer, Ordering::SeqCst);
        self.stamped.store(true, Ordering::SeqCst);
        let found = ImageIdentity {
            mark: identity::mark_of(&self.header()),
            store: self
                .handle
                .backend
                .identity()
                .map_err(|e| ImageError::io(self.name(), "stat", e))?,
            writable: true,
        };
        self.io
            .copies()
            .attach(&self.handle, self.disk, &found)
            .map_err(|e| ImageError::io(self.name(), "record its identity", e))
    }

    /// Gives the header the cache mark extension and the names of the
    /// mark's feature bits, if it lacks either, by a crash-safe rewrite.
    fn make_room_for_mark(&self, l: &mut Locked<'_>) -> Result<()> {
        let h = &l.m.header;
        let mut wanted = h.extensions.clone();
        name_bits(&mut wanted.feature_names, &MARK_BITS);
        wanted.cache_mark.get_or_insert_with(MarkSlots::default);
        if wanted == h.extensions {
            return Ok(());
        }
        let first = self.read_first_cluster()?;
        let plan = h.rewrite_plan(&first, &wanted).map_err(|e| ImageError::Unsupported {
            image: self.name().to_string(),
            reason: format!(
                "vdcache's cache mark cannot be added to the header ({e}); serve it without a cache, or convert it to a larger cluster size"
            ),
        })?;
        for w in &plan {
            self.write_header_durable(&[(w.offset, &w.bytes)])?;
        }
        let first = self.read_first_cluster()?;
        l.m.header = Header::parse(&first).map_err(|e| ImageError::format(self.name(), e))?;
        Ok(())
    }

    /// The first cluster as the layers below hold it (the file's length
    /// at most).
    pub(crate) fn read_first_cluster(&self) -> Result<Vec<u8>> {
        let len = self
            .io
            .len(&self.handle)
            .map_err(|e| ImageError::io(self.name(), "stat", e))?;
        let mut buf = vec![0u8; self.geometry.cluster_size().min(len) as usize];
        self.io
            .read(
                &self.handle,
                HostOffset(0),
                &mut buf,
                IoTag::meta(MetaTable::Header, self.disk),
            )
            .map_err(|e| ImageError::io(self.name(), "read the header", e))?;
        Ok(buf)
    }

    /// Whether this open stamped the image for a cache below.
    pub(crate) fn is_stamped(&self) -> bool {
        self.stamped.load(Ordering::SeqCst)
    }

    /// Sets the in-cache bit before a change the cache may keep newer than
    /// the file (callers hold the range lock of what they change, so a
    /// [`Self::release_holder`] under the whole disk's lock cannot cross).
    pub(crate) fn ensure_marked(&self) -> Result<()> {
        if self.marked.load(Ordering::SeqCst) || !self.keeps_newer.load(Ordering::SeqCst) {
            return Ok(());
        }
        let mut l = self.lock();
        if self.marked.load(Ordering::SeqCst) {
            return Ok(());
        }
        let v = l.m.header.incompatible_features | incompatible::IN_CACHE;
        self.write_header_durable(&[(field_offset::INCOMPATIBLE_FEATURES, &v.to_be_bytes())])?;
        l.m.header.incompatible_features = v;
        self.marked.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// With no change of the disk in flight: the cache writes everything
    /// of the image back, and the in-cache bit is cleared if it then holds
    /// nothing the file lacks (until the next change sets it again).
    pub(crate) fn release_holder(&self) -> Result<()> {
        if !self.stamped.load(Ordering::SeqCst) {
            return Ok(());
        }
        for handle in [&self.handle, &self.data] {
            self.io
                .copies()
                .write_back_image(handle)
                .map_err(|e| ImageError::io(self.name(), "write back the cache", e))?;
        }
        let mut newer = false;
        for handle in [&self.handle, &self.data] {
            newer |= self
                .io
                .copies()
                .holds_newer(handle)
                .map_err(|e| ImageError::io(self.name(), "ask the cache", e))?;
        }
        let mut l = self.lock();
        let v = l.m.header.incompatible_features;
        if newer || v & incompatible::IN_CACHE == 0 {
            if newer {
                tracing::warn!(
                    image = self.name(),
                    "the cache still holds data of this image that it could not write back; the image stays marked as needing it"
                );
            }
            return Ok(());
        }
        let cleared = v & !incompatible::IN_CACHE;
        self.write_header_durable(&[(
            field_offset::INCOMPATIBLE_FEATURES,
            &cleared.to_be_bytes(),
        )])?;
        l.m.header.incompatible_features = cleared;
        self.marked.store(false, Ordering::SeqCst);
        Ok(())
    }

    pub(crate) fn write_header_durable(&self, writes: &[(u64, &[u8])]) -> Result<()> {
        let writes: Vec<(HostOffset, &[u8])> =
            writes.iter().map(|&(o, b)| (HostOffset(o), b)).collect();
        self.io
            .write_durable(
                &self.handle,
                &writes,
                IoTag::meta(MetaTable::Header, self.disk),
            )
            .map_err(|e| ImageError::io(self.name(), "write the header", e))
    }
}

/// The three feature bitmaps (incompatible, compatible, autoclear), as
/// they lie in the header from byte 72: one write inside its first sector.
fn feature_fields(h: &Header) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&h.incompatible_features.to_be_bytes());
    out[8..16].copy_from_slice(&h.compatible_features.to_be_bytes());
    out[16..].copy_from_slice(&h.autoclear_features.to_be_bytes());
    out
}

/// The mark of this open: the image keeps its id, the generation moves on.
fn next_mark(old: Option<&CacheMark>, holder: &Holder) -> CacheMark {
    CacheMark {
        image_id: old.map_or_else(random_id, |m| m.image_id),
        generation: old.map_or(1, |m| m.generation + 1),
        cache_id: holder.id,
        cache_path: holder.path.clone(),
    }
}

/// Adds the names of `bits` to a feature name table lacking them.
pub(crate) fn name_bits(names: &mut Vec<FeatureName>, bits: &[(FeatureKind, u8)]) {
    for &(kind, bit) in bits {
        if names.iter().any(|f| f.kind == kind && f.bit == bit) {
            continue;
        }
        if let Some(name) = features::known_name(kind, bit) {
            names.push(FeatureName {
                kind,
                bit,
                name: name.to_string(),
            });
        }
    }
}

/// A random 128-bit id from the kernel.
pub(crate) fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if getrandom(&mut id).is_err() {
        // No entropy source: time and process make it unique enough here.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        id = (t ^ (u128::from(std::process::id()) << 96)).to_le_bytes();
    }
    id
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// Makes an image file usable without the cache that held its newest
/// data (a cache that is lost): the in-cache and coherent bits are
/// cleared, whatever the cache held is given up. Refused while the cache
/// the mark names is still there (`cache_present` says whether the cache
/// at the mark's path is the one it names): its data is not lost, and
/// full recovery writes it back. Returns the cache the mark named, or
/// `None` if the image was not marked.
pub fn abandon_cache(
    path: &std::path::Path,
    cache_present: impl FnOnce(&CacheMark) -> bool,
) -> Result<Option<String>> {
    use crate::chain::StoreOpener;
    let name = path.display().to_string();
    let backend =
        crate::chain::LocalFiles.open(&name, true, Some(vdcache_backend::LockMode::Write))?;
    let handle = crate::hostio::ImageHandle {
        name: std::sync::Arc::from(name.as_str()),
        depth: 0,
        backend,
    };
    let header = identity::read_header_direct(&handle)
        .map_err(|e| ImageError::io(&name, "read the header", e))?
        .ok_or_else(|| ImageError::Unsupported {
            image: name.clone(),
            reason: "not a qcow2 image this vdcache can read".into(),
        })?;
    if !identity::in_cache(&header) {
        return Ok(None);
    }
    if let Some(mark) = header
        .extensions
        .cache_mark
        .as_ref()
        .and_then(|m| m.current())
        && cache_present(mark)
    {
        return Err(ImageError::CacheStillThere {
            image: name,
            cache: mark.cache_path.clone(),
        });
    }
    let incompatible = header.incompatible_features & !incompatible::IN_CACHE;
    let autoclear = header.autoclear_features & !autoclear::CACHE_COHERENT;
    let store = &handle.backend;
    let io = |e| ImageError::io(&name, "write the header", e);
    // A mark naming no cache tells the cache, should it come back, that
    // its data of this image was given up (it drops it rather than refuse
    // the image for holding data the file lacks).
    let mut first = vec![0u8; 1 << header.cluster_bits];
    store
        .read_at(&mut first, 0)
        .map_err(|e| ImageError::io(&name, "read the header", e))?;
    if let (Ok(Some(at)), Some(old)) = (
        header::cache_mark_offset(&first, &header),
        header
            .extensions
            .cache_mark
            .as_ref()
            .and_then(|m| m.current()),
    ) {
        let given_up = CacheMark {
            generation: old.generation + 1,
            cache_id: vdcache_qcow2::cache_mark::NO_CACHE,
            ..old.clone()
        };
        store
            .write_at(
                &given_up.encode_slot(),
                at + (given_up.slot() * SLOT_BYTES) as u64,
            )
            .map_err(io)?;
    }
    store
        .write_at(
            &incompatible.to_be_bytes(),
            field_offset::INCOMPATIBLE_FEATURES,
        )
        .map_err(io)?;
    store
        .write_at(&autoclear.to_be_bytes(), field_offset::AUTOCLEAR_FEATURES)
        .map_err(io)?;
    store.flush().map_err(io)?;
    Ok(Some(
        header
            .extensions
            .cache_mark
            .as_ref()
            .and_then(|m| m.current())
            .map_or_else(|| "(unrecorded)".to_string(), |m| m.cache_path.clone()),
    ))
}
