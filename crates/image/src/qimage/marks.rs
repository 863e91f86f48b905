//! vdcache's marks in an image header while a flash cache serves it: the
//! cache mark (image id, generation, cache), the in-cache bit while the
//! cache may hold data the file lacks, and the coherent bit that another
//! writer clears (see `vdcache_qcow2::cache_mark`).
//!
//! Order (what makes them safe): the in-cache bit is durable in the file
//! before the first write the cache may keep newer than the file, and it
//! is cleared only after the cache wrote everything of the image back.
//! Header bytes go to the store itself (`HostIo::write_durable`), never
//! only into the cache, since they are for readers without it.
//!
//! Must not: decide what the cache holds (the `HostIo` layer answers).

use super::Qcow2Image;
use crate::error::{ImageError, Result};
use crate::hostio::{Holder, IoTag, MetaTable};
use crate::identity::{self, ImageIdentity};
use std::sync::atomic::Ordering;
use vdcache_qcow2::HostOffset;
use vdcache_qcow2::cache_mark::CacheMark;
use vdcache_qcow2::features::{self, FeatureKind, autoclear, incompatible};
use vdcache_qcow2::header::{FeatureName, field_offset};

/// The feature bits a cache mark sets, whose names the header must carry
/// (QEMU names the in-cache bit when it refuses the image).
const MARK_BITS: [(FeatureKind, u8); 2] = [(FeatureKind::Incompatible, 56), (FeatureKind::Autoclear, 56)];

impl Qcow2Image {
    /// Refuses an image whose newest data is in a cache this open does
    /// not go through (unless only inspected).
    pub(crate) fn check_cache_mark(&self, inspect: bool) -> Result<()> {
        let h = self.header();
        if !identity::in_cache(&h) || inspect {
            return Ok(());
        }
        let mark = h.extensions.cache_mark.as_ref();
        let holder = self.io.holder();
        if let (Some(m), Some(holder)) = (mark, &holder)
            && m.cache_id == holder.id
        {
            return Ok(());
        }
        Err(ImageError::InCache {
            image: self.name().to_string(),
            cache: mark.map_or_else(|| "(unrecorded)".to_string(), |m| m.cache_path.clone()),
        })
    }

    /// Stamps a writable image opened through a cache: a new generation,
    /// this cache's id, the coherent bit, and the in-cache bit when the
    /// cache may keep the image's data newer than the file. Durable before
    /// any write of the open; the cache then records the new identity.
    pub(crate) fn stamp_for_holder(&self) -> Result<()> {
        let Some(holder) = self.io.holder() else {
            return Ok(());
        };
        if self.read_only {
            return Ok(());
        }
        let mut l = self.lock();
        let mut h = l.m.header.clone();
        if h.version < 3 {
            if self.io.keeps_newer(self.disk) {
                return Err(ImageError::Unsupported {
                    image: self.name().to_string(),
                    reason: "a version 2 (compat=0.10) image has no feature bits to mark it as needing the cache, so a write-back cache could leave it silently out of date; upgrade it with `qemu-img amend -o compat=1.1`, or serve it with --cache-mode writethrough".into(),
                });
            }
            return Ok(());
        }
        h.extensions.cache_mark = Some(next_mark(h.extensions.cache_mark.as_ref(), &holder));
        let holds = self
            .io
            .holds_newer(&self.handle)
            .map_err(|e| ImageError::io(self.name(), "ask the cache", e))?;
        if self.io.keeps_newer(self.disk) || holds {
            h.incompatible_features |= incompatible::IN_CACHE;
        }
        h.autoclear_features |= autoclear::CACHE_COHERENT;
        name_mark_bits(&mut h.extensions.feature_names);
        let bytes = h.encode().map_err(|e| ImageError::Unsupported {
            image: self.name().to_string(),
            reason: format!(
                "vdcache's cache mark does not fit in the header cluster ({e}); serve it without a cache, or convert it to a larger cluster size"
            ),
        })?;
        self.write_header_durable(0, &bytes)?;
        l.m.header = h;
        drop(l);
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
            .attach(&self.handle, self.disk, &found)
            .map_err(|e| ImageError::io(self.name(), "record its identity", e))
    }

    /// After a close wrote everything back: clears the in-cache bit when
    /// the cache holds nothing of the image the file lacks.
    pub(crate) fn release_holder(&self) -> Result<()> {
        if !self.stamped.load(Ordering::SeqCst) {
            return Ok(());
        }
        for handle in [&self.handle, &self.data] {
            self.io
                .write_back_image(handle)
                .map_err(|e| ImageError::io(self.name(), "write back the cache", e))?;
        }
        let mut newer = false;
        for handle in [&self.handle, &self.data] {
            newer |= self
                .io
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
        self.write_header_durable(field_offset::INCOMPATIBLE_FEATURES, &cleared.to_be_bytes())?;
        l.m.header.incompatible_features = cleared;
        Ok(())
    }

    fn write_header_durable(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.io
            .write_durable(
                &self.handle,
                HostOffset(offset),
                bytes,
                IoTag::meta(MetaTable::Header, self.disk),
            )
            .map_err(|e| ImageError::io(self.name(), "write the header", e))
    }
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

/// Adds the names of the mark's bits to a feature name table lacking them.
fn name_mark_bits(names: &mut Vec<FeatureName>) {
    for (kind, bit) in MARK_BITS {
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
fn random_id() -> [u8; 16] {
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
/// cleared, whatever the cache held is given up. Returns the cache the
/// mark named, or `None` if the image was not marked.
pub fn abandon_cache(path: &std::path::Path) -> Result<Option<String>> {
    use vdcache_backend::{FileBackend, FileOptions, LockMode};
    let name = path.display().to_string();
    let backend = FileBackend::open(
        path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: false,
        },
    )?;
    let handle = crate::hostio::ImageHandle {
        name: std::sync::Arc::from(name.as_str()),
        depth: 0,
        backend: std::sync::Arc::new(backend),
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
    let incompatible = header.incompatible_features & !incompatible::IN_CACHE;
    let autoclear = header.autoclear_features & !autoclear::CACHE_COHERENT;
    let store = &handle.backend;
    let io = |e| ImageError::io(&name, "write the header", e);
    store
        .write_at(&incompatible.to_be_bytes(), field_offset::INCOMPATIBLE_FEATURES)
        .map_err(io)?;
    store
        .write_at(&autoclear.to_be_bytes(), field_offset::AUTOCLEAR_FEATURES)
        .map_err(io)?;
    store.flush().map_err(io)?;
    Ok(Some(header.extensions.cache_mark.map_or_else(
        || "(unrecorded)".to_string(),
        |m| m.cache_path,
    )))
}
