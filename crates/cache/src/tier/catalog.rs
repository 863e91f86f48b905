//! The image catalog: registering the images the cache serves, binding
//! each to the identity of the file under its name, and refusing a file
//! that is not the one cached (when the cache holds newer data of it).
//!
//! It owns the image records, their names, the disks' policies and the
//! COW layer's backing-chain readers ([`Catalog`]), and the journal records
//! that name images; it drops a replaced file's cached blocks through the
//! index's own unmapping, and never touches regions, the ledger or the
//! journal's other records itself.

use super::{FlashCache, State};
use crate::config::DiskPolicy;
use crate::error::{CacheError, Result};
use crate::group_sync::GroupSync;
use crate::journal::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use vdcache_backend::BackendRef;
use vdcache_contract::{BackingFill, DiskId, ImageHandle, ImageIdentity, Verdict};

/// Everything the cache knows about the images and disks it serves; image
/// ids are indices into `images` and are never reused while the cache
/// lives (journal records and line keys name them).
#[derive(Default)]
pub(crate) struct Catalog {
    pub images: Vec<ImageRecord>,
    pub by_name: HashMap<String, u16>,
    /// Per disk, the policy it was opened with (others use the default).
    pub policies: HashMap<u32, DiskPolicy>,
    /// Per image, the COW layer's reader of its backing chain, with which
    /// write-back fills partially valid clusters (see `fills`).
    pub fillers: HashMap<u16, Weak<dyn BackingFill>>,
}

impl Catalog {
    /// The id of the image named `name`, if the cache has seen it.
    pub(crate) fn id_of(&self, name: &str) -> Option<u16> {
        self.by_name.get(name).copied()
    }

    /// The policy of `disk`, or `default` if it was opened without one.
    pub(crate) fn policy(&self, disk: DiskId, default: DiskPolicy) -> DiskPolicy {
        self.policies.get(&disk.0).copied().unwrap_or(default)
    }
}

/// An image the cache has seen.
#[derive(Debug, Clone)]
pub(crate) struct ImageRecord {
    pub name: String,
    pub identity: ImageIdentity,
    /// Open store of the image (absent for images known only from the
    /// journal until a disk opens them).
    pub backend: Option<BackendRef>,
    pub disk: DiskId,
    /// More than one disk reads this image (a shared base): what one disk
    /// masks, another may still read.
    pub shared_by_disks: bool,
    /// End of the highest block written through the cache: the image is
    /// at least this long even before write-back extends the file.
    pub end: u64,
    /// Syncs of the backend for write-through data, shared by the flushes
    /// that need one at the same time (numbered by the ledger's marks).
    pub backend_syncs: Arc<GroupSync>,
}

/// What the store of an image that nobody attached says about itself
/// (tests and tools that hand the cache image handles directly).
fn store_identity_of(image: &ImageHandle) -> ImageIdentity {
    ImageIdentity {
        mark: None,
        store: image.backend.identity().unwrap_or_default(),
        writable: image.depth == 0,
    }
}

/// Whether the image's header says a cache holds data its file lacks
/// (true when the header cannot be read: nothing to conclude from).
fn stamped_as_in_cache(image: &ImageHandle) -> bool {
    match vdcache_contract::identity::read_header_direct(image) {
        Ok(Some(h)) => vdcache_contract::identity::in_cache(&h),
        _ => true,
    }
}

impl FlashCache {
    /// The id of an image, registering it on first sight. An image the
    /// COW layer attached (see [`FlashCache::attach_image`]) was checked
    /// then; any other is checked against what its store says.
    pub(crate) fn image_id(&self, image: &ImageHandle, disk: DiskId) -> Result<u16> {
        {
            let mut st = self.lock();
            if let Some(id) = st.catalog.id_of(&image.name) {
                let rec = &mut st.catalog.images[id as usize];
                if rec.backend.is_some() {
                    if rec.disk != disk {
                        rec.shared_by_disks = true;
                    }
                    rec.disk = disk;
                    return Ok(id);
                }
            }
        }
        self.attach_image(image, disk, &store_identity_of(image))
    }

    /// Binds `image` to the identity the COW layer found in its store.
    /// Blocks the cache holds of another file under the same name are
    /// dropped; if some of them hold data that file lacked, the image is
    /// refused instead, naming what happened.
    /// A disk whose policy makes the cache its home (`cache_only`) gets its
    /// image held (see [`crate::index::Index::set_held`]).
    pub(crate) fn attach_image(
        &self,
        image: &ImageHandle,
        disk: DiskId,
        found: &ImageIdentity,
    ) -> Result<u16> {
        let id = self.bind_image(image, disk, found)?;
        let mut st = self.lock();
        let held = st
            .catalog
            .policy(disk, self.config.default_policy)
            .cache_only;
        st.index.set_held(id, held);
        Ok(id)
    }

    fn bind_image(&self, image: &ImageHandle, disk: DiskId, found: &ImageIdentity) -> Result<u16> {
        let mut st = self.lock();
        let Some(id) = st.catalog.id_of(&image.name) else {
            return self.register_image(&mut st, image, disk, found);
        };
        let rec = &mut st.catalog.images[id as usize];
        match found.compare(&rec.identity, &self.sb.uuid) {
            Verdict::Same => {}
            Verdict::Advanced => {
                // Stamped by this cache at an open whose record a crash
                // took: the stamp then marked the file as needing the cache
                // for any data the cache held. A file complete without it
                // while the cache holds its dirty data was written back by
                // a later session: this cache is a copy from before that.
                if !stamped_as_in_cache(image) && self.holds_newer_of(&st, id) {
                    return Err(CacheError::StaleCache);
                }
                let rec = &mut st.catalog.images[id as usize];
                rec.identity = *found;
                let name = rec.name.clone();
                st.journal.push(&Entry::Image {
                    id,
                    name,
                    identity: *found,
                });
            }
            Verdict::Different(reason) => {
                let name = rec.name.clone();
                drop(st);
                if self.holds_newer_of(&self.lock(), id) {
                    return Err(CacheError::WrongImage {
                        name,
                        reason,
                        cache: self.device.name().to_string(),
                    });
                }
                tracing::warn!(image = %name, %reason, "image changed since it was cached; dropping its cached blocks");
                return self.forget_image(id, name, image, disk, found);
            }
            Verdict::Abandoned => {
                let name = rec.name.clone();
                drop(st);
                tracing::warn!(
                    image = %name,
                    "the image was made usable without this cache (`vdcache recover --without-cache`): what the cache still held of it is given up"
                );
                return self.forget_image(id, name, image, disk, found);
            }
        }
        let rec = &mut st.catalog.images[id as usize];
        if rec.backend.is_some() && rec.disk != disk {
            rec.shared_by_disks = true;
        }
        rec.backend = Some(image.backend.clone());
        rec.disk = disk;
        Ok(id)
    }

    fn register_image(
        &self,
        st: &mut State,
        image: &ImageHandle,
        disk: DiskId,
        identity: &ImageIdentity,
    ) -> Result<u16> {
        let id = u16::try_from(st.catalog.images.len())
            .map_err(|_| CacheError::Config("more than 65535 images share one cache".into()))?;
        st.catalog.images.push(ImageRecord {
            name: image.name.to_string(),
            identity: *identity,
            backend: Some(image.backend.clone()),
            disk,
            shared_by_disks: false,
            end: 0,
            backend_syncs: Arc::default(),
        });
        st.catalog.by_name.insert(image.name.to_string(), id);
        st.journal.push(&Entry::Image {
            id,
            name: image.name.to_string(),
            identity: *identity,
        });
        Ok(id)
    }

    /// Forgets everything the cache holds of image `id` (dirty blocks,
    /// metadata sectors and lost blocks included: the caller decided they
    /// are not wanted) and binds the name to the file found now.
    fn forget_image(
        &self,
        id: u16,
        name: String,
        image: &ImageHandle,
        disk: DiskId,
        found: &ImageIdentity,
    ) -> Result<u16> {
        let mut st = self.lock();
        self.drop_sectors(&mut st, id, 0, u64::MAX);
        let lost: Vec<(u64, u8)> = st
            .integrity
            .unreadable
            .iter()
            .copied()
            .filter(|&(key, _)| crate::index::key_image(key) == id)
            .collect();
        for (key, slot) in lost {
            st.integrity.unreadable.remove(&(key, slot));
            st.journal.push(&Entry::Lost {
                key,
                slot,
                lost: false,
            });
        }
        let lines: Vec<u64> = st
            .index
            .lines()
            .filter(|l| crate::index::key_image(l.key) == id)
            .map(|l| l.key)
            .collect();
        for key in lines {
            for slot in 0..crate::layout::LINE_BLOCKS as usize {
                self.unmap_block(&mut st, key, slot);
            }
        }
        let rec = &mut st.catalog.images[id as usize];
        rec.identity = *found;
        rec.backend = Some(image.backend.clone());
        rec.disk = disk;
        st.journal.push(&Entry::Image {
            id,
            name,
            identity: *found,
        });
        Ok(id)
    }

    /// Whether the cache holds data of image `id` that its file lacks:
    /// dirty blocks, partially valid clusters, dirty metadata sectors.
    pub(crate) fn holds_newer_of(&self, st: &State, id: u16) -> bool {
        let keys = crate::index::line_key(id, 0)..=crate::index::line_key(id, u64::MAX);
        st.dirty.lines.range(keys.clone()).next().is_some()
            || st
                .integrity
                .unreadable
                .range((*keys.start(), 0)..=(*keys.end(), u8::MAX))
                .next()
                .is_some()
            || st.meta.has_dirty_of(id)
            || st
                .index
                .lines()
                .any(|l| l.partial != 0 && crate::index::key_image(l.key) == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WriteMode;

    #[test]
    fn names_find_ids_and_disks_without_a_policy_take_the_default() {
        let mut c = Catalog::default();
        assert_eq!(c.id_of("a.qcow2"), None);
        c.by_name.insert("a.qcow2".into(), 0);
        c.by_name.insert("b.qcow2".into(), 1);
        assert_eq!(c.id_of("b.qcow2"), Some(1));
        let default = DiskPolicy::default();
        let own = DiskPolicy {
            mode: WriteMode::WriteThrough,
            ..DiskPolicy::default()
        };
        c.policies.insert(7, own);
        assert_eq!(c.policy(DiskId(7), default), own);
        assert_eq!(c.policy(DiskId(8), default), default);
    }
}
