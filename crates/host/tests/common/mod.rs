//! Helpers shared by the whole-stack tests of the cache (the COW layer
//! over the flash cache over memory stores).
// Each test file uses its own subset.
#![allow(dead_code)]

use std::sync::Arc;
use vdcache_backend::inject::{Gate, HookedBackend};
use vdcache_backend::{BackendRef, LockMode, MemBackend};
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_image::{
    DiskId, HostIo, ImageFormat, MemFiles, OpenOptions, StoreOpener, VirtualDisk, open_chain,
};

/// A cache on `device`: freshly formatted, or recovered from what the
/// device holds (as a restart after a crash does).
pub fn cache_on(device: &Arc<MemBackend>, config: &CacheConfig, fresh: bool) -> Arc<FlashCache> {
    let dev: BackendRef = device.clone();
    if fresh {
        FlashCache::format(dev, config.clone())
    } else {
        FlashCache::open(dev, config.clone())
    }
    .expect("cache")
}

/// A cache that writes nothing back until a test drains it (1 MiB
/// regions), with disks in `mode` that never bypass flash.
pub fn drain_only_config(mode: vdcache_cache::WriteMode) -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        region_bytes: 1 << 20,
        high_watermark: 1.0,
        low_watermark: 1.0,
        default_policy: vdcache_cache::DiskPolicy {
            mode,
            sequential_write_cutoff: 0,
            ..vdcache_cache::DiskPolicy::default()
        },
        ..CacheConfig::default()
    }
}

/// Disk 1: the image `name` of `opener`, through `cache`.
pub fn disk_through(
    opener: Arc<dyn StoreOpener>,
    cache: &Arc<FlashCache>,
    name: &str,
    format: ImageFormat,
) -> VirtualDisk {
    disk_as(opener, cache, name, format, DiskId(1))
}

/// Disk `disk`: the image `name` of `opener`, through `cache`.
pub fn disk_as(
    opener: Arc<dyn StoreOpener>,
    cache: &Arc<FlashCache>,
    name: &str,
    format: ImageFormat,
    disk: DiskId,
) -> VirtualDisk {
    let io: Arc<dyn HostIo> = cache.clone();
    open_chain(
        name,
        &OpenOptions {
            opener,
            io: Some(io),
            disk,
            format: Some(format),
            ..OpenOptions::default()
        },
    )
    .expect("open disk")
}

/// Which backend calls of a [`GatedFiles`] image wait at its gate.
#[derive(Debug, Clone, Copy)]
pub enum Held {
    Writes,
    Syncs,
}

/// Image files whose writes or syncs, when made by the thread called
/// `thread`, wait at `gate`.
#[derive(Debug)]
pub struct GatedFiles {
    pub files: Arc<MemFiles>,
    pub thread: &'static str,
    pub held: Held,
    pub gate: Arc<Gate>,
}

impl StoreOpener for GatedFiles {
    fn open(
        &self,
        name: &str,
        writable: bool,
        lock: Option<LockMode>,
    ) -> vdcache_image::Result<BackendRef> {
        let (thread, gate) = (self.thread, self.gate.clone());
        let wait = move || {
            if std::thread::current().name() == Some(thread) {
                gate.wait();
            }
            Ok(())
        };
        let inner = HookedBackend::new(self.files.open(name, writable, lock)?);
        Ok(Arc::new(match self.held {
            Held::Writes => inner.on_write(wait),
            Held::Syncs => inner.on_flush(wait),
        }))
    }

    fn canonical(&self, name: &str) -> vdcache_image::Result<String> {
        self.files.canonical(name)
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        self.files.resolve(parent, backing)
    }
}
