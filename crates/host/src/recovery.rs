//! Full recovery of a cache device: every image the cache holds dirty or
//! partially valid data of, or that carries its mark, is opened through
//! the cache and closed, which fills its partially valid clusters from
//! its backing chain, writes every dirty block back and clears its mark;
//! leaked clusters are then repaired, so each image is standalone and
//! `qemu-img check` clean. A device recorded for another host is then
//! formatted for this one (what it still caches may be stale where the
//! images move). What `vdcache recover --full` runs, and the crash harness
//! after every crash.
//!
//! This module owns the order of those steps. It must not replay the
//! cache's journal itself (opening the cache does) nor touch an image
//! other than through the COW layer.

use crate::device::open_device;
use crate::error::{HostError, ImageRecoveryError, Result, chain};
use std::path::Path;
use std::sync::Arc;
use vdcache_backend::BackendRef;
use vdcache_cache::layout::host_identity;
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_image::{ImageHandle, Layer, LocalFiles, OpenOptions, StoreOpener, open_chain};

/// How full recovery runs.
#[derive(Debug, Clone)]
pub struct FullRecovery {
    /// On a damaged device: write back everything that still verifies
    /// and give up the rest (the images affected lose those writes).
    pub salvage: bool,
    /// This host's identity (default: the machine's, as the cache
    /// records it); a device recorded for another is formatted for this
    /// one once its images are standalone.
    pub host: Option<String>,
    /// Opens the images by the names the cache recorded.
    pub opener: Arc<dyn StoreOpener>,
    /// Where the images' backing files may lie besides their own
    /// directory trees and storage servers (`OpenOptions::allow_backing`).
    pub allow_backing: Vec<String>,
}

impl Default for FullRecovery {
    fn default() -> Self {
        FullRecovery {
            salvage: false,
            host: None,
            opener: Arc::new(LocalFiles),
            allow_backing: Vec::new(),
        }
    }
}

/// Full recovery of the cache device at `path`; see [`recover_full`].
pub fn recover_full_at(path: &Path, how: &FullRecovery) -> Result<Vec<String>> {
    recover_full(open_device(path)?, &path.display().to_string(), how)
}

/// Full recovery of the cache on `device` (named `device_name` in
/// messages). Returns the images made standalone; an image that could
/// not be is an error, after the others were done, and leaves the device
/// as it is.
pub fn recover_full(
    device: BackendRef,
    device_name: &str,
    how: &FullRecovery,
) -> Result<Vec<String>> {
    let cfg = CacheConfig {
        force_foreign: true,
        salvage: how.salvage,
        host: how.host.clone(),
        ..CacheConfig::default()
    };
    let cache = FlashCache::open(device.clone(), cfg).map_err(|source| HostError::Cache {
        device: device_name.to_string(),
        source,
    })?;
    let this_host = how.host.clone().unwrap_or_else(host_identity);
    let foreign = cache.superblock().host != this_host;
    let mut done = Vec::new();
    let mut failed = Vec::new();
    let salvaged = cache.salvaged().cloned();
    let mut names = needing_recovery(&cache, &*how.opener);
    // A salvage gave up writes of these: each is made standalone with
    // what verified (its mark cleared), even if the cache lost its record.
    for name in salvaged.iter().flat_map(|a| a.names.iter()) {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    for name in names {
        if deliberately_skipped() {
            continue;
        }
        match make_standalone(&cache, &name, how) {
            Ok(()) => {
                if salvaged.as_ref().is_some_and(|a| a.names.contains(&name)) {
                    tracing::warn!(
                        "{name}: salvaged: standalone with what still verified; the writes the damage touched are lost (check it: vdcache check -r all {name})"
                    );
                }
                done.push(name);
            }
            Err(e) => {
                // Most image errors name the image themselves.
                let why = chain(&e);
                let line = if why.contains(name.as_str()) {
                    why
                } else {
                    format!("{name}: {why}")
                };
                tracing::error!("{line}");
                failed.push(line);
            }
        }
    }
    cache.shutdown(false)?;
    drop(cache);
    for name in &done {
        repair_leaks(name, how)?;
    }
    if !failed.is_empty() {
        return Err(HostError::ImagesLeft {
            count: failed.len(),
            device: device_name.to_string(),
            failures: failed.join("; "),
        });
    }
    if let Some(lost) = salvaged.filter(|a| a.unnamed > 0) {
        return Err(HostError::SalvageLostNames {
            device: device_name.to_string(),
            count: lost.unnamed,
            done,
        });
    }
    if foreign {
        let cfg = CacheConfig {
            host: how.host.clone(),
            ..CacheConfig::default()
        };
        FlashCache::format(device, cfg)?.shutdown(false)?;
        tracing::info!("{device_name} now belongs to this host");
    }
    Ok(done)
}

/// Whether a test switched on the deliberate bug that leaves the images
/// needing the cache unwritten (see [`crate::testing`]).
fn deliberately_skipped() -> bool {
    #[cfg(any(test, feature = "deliberate-bugs"))]
    return crate::testing::active(crate::testing::Fault::SkipWriteBack);
    #[cfg(not(any(test, feature = "deliberate-bugs")))]
    false
}

/// Images the cache holds data of, or that carry its in-cache mark.
fn needing_recovery(cache: &FlashCache, opener: &dyn StoreOpener) -> Vec<String> {
    let holder = cache.superblock().uuid;
    let partial = cache.partial_images();
    cache
        .images()
        .into_iter()
        .filter(|(name, dirty)| {
            *dirty > 0 || partial.contains(name) || marked_by(opener, name, &holder)
        })
        .map(|(name, _)| name)
        .collect()
}

/// Whether the image `name` says the cache `cache_id` holds its newest
/// data.
pub(crate) fn marked_by(opener: &dyn StoreOpener, name: &str, cache_id: &[u8; 16]) -> bool {
    let Ok(backend) = opener.open(name, false, None) else {
        return false;
    };
    let handle = ImageHandle {
        name: Arc::from(name),
        depth: 0,
        backend,
    };
    vdcache_image::identity::needs_cache_of(&handle).is_some_and(|id| id == *cache_id)
}

/// Opens `name` writable through the cache and closes it: the image is
/// then complete in its file and no longer marked.
fn make_standalone(
    cache: &Arc<FlashCache>,
    name: &str,
    how: &FullRecovery,
) -> std::result::Result<(), ImageRecoveryError> {
    let disk = open_chain(
        name,
        &OpenOptions {
            io: Some(cache.clone()),
            opener: how.opener.clone(),
            allow_backing: how.allow_backing.clone(),
            ..OpenOptions::default()
        },
    )
    .map_err(ImageRecoveryError::Open)?;
    disk.close().map_err(ImageRecoveryError::WriteBack)?;
    let left = disk.partially_valid_bytes()?;
    if left > 0 {
        return Err(ImageRecoveryError::Unfilled(left));
    }
    tracing::info!("{name}: written back");
    Ok(())
}

/// Rebuilds the refcounts of a qcow2 image if it leaks clusters after a
/// crash; a corrupt one is an error.
fn repair_leaks(name: &str, how: &FullRecovery) -> Result<()> {
    let disk = open_chain(
        name,
        &OpenOptions {
            no_backing: true,
            opener: how.opener.clone(),
            allow_backing: how.allow_backing.clone(),
            ..OpenOptions::default()
        },
    )?;
    if let Some(Layer::Qcow2(img)) = disk.layers().first() {
        let report = img.check()?;
        if !report.corruptions.is_empty() {
            return Err(HostError::CorruptAfterWriteBack {
                image: name.to_string(),
                corruptions: report.corruptions,
            });
        }
        if !report.leaks.is_empty() {
            tracing::info!("{name}: repairing {} leaked clusters", report.leaks.len());
            img.repair()?;
        }
    }
    disk.close()?;
    Ok(())
}
