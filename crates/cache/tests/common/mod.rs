//! Helpers shared by the cache tier's integration tests.

use std::sync::Arc;
use vdcache_backend::{BackendRef, MemBackend};
use vdcache_cache::{CacheConfig, FlashCache};

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
