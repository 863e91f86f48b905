//! The replay's image files: stores in memory, found by name, so that the
//! real chain opener resolves backing names exactly as it does on disk.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use vdcache_backend::{BackendRef, LockMode};
use vdcache_image::{ImageError, StoreOpener};

#[derive(Debug, Default)]
pub struct ReplayFiles {
    stores: Mutex<HashMap<String, BackendRef>>,
}

impl ReplayFiles {
    pub fn new() -> Arc<ReplayFiles> {
        Arc::new(ReplayFiles::default())
    }

    pub fn insert(&self, name: &str, store: BackendRef) {
        self.stores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_string(), store);
    }
}

impl StoreOpener for ReplayFiles {
    fn open(
        &self,
        name: &str,
        _writable: bool,
        _lock: Option<LockMode>,
    ) -> vdcache_image::Result<BackendRef> {
        self.stores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
            .ok_or_else(|| ImageError::Io {
                image: name.to_string(),
                op: "open",
                cause: std::io::Error::from(std::io::ErrorKind::NotFound).into(),
            })
    }

    fn canonical(&self, name: &str) -> vdcache_image::Result<String> {
        Ok(name.to_string())
    }

    /// Names are flat: a backing name is the store's own name.
    fn resolve(&self, _parent: &str, backing: &str) -> String {
        backing.to_string()
    }
}
