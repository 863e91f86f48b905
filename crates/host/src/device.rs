//! Opening a cache device for serving: a missing cache file created and
//! formatted whole or not at all, an existing one checked against the
//! size asked for, then opened (fast recovery) or, when it holds nothing,
//! formatted. What the daemon does at start, and the crash harness after
//! every crash.
//!
//! This module decides only how a device becomes a serving cache. It
//! must not open images (that is the caller's or [`crate::recovery`]'s).

use crate::error::{HostError, Result};
use std::path::Path;
use std::sync::Arc;
use vdcache_backend::{Backend, BackendRef, FileBackend, FileOptions, LockMode};
use vdcache_cache::{CacheConfig, CacheError, FlashCache};

/// Opens `device` as a serving cache: its index recovered (fast
/// recovery), or formatted when it holds nothing or only what a format cut
/// short left. A device that holds something but no cache is refused
/// unless `format_anyway`, which formats it whatever it holds.
pub fn open_for_serving(
    device: BackendRef,
    cfg: CacheConfig,
    format_anyway: bool,
) -> std::result::Result<Arc<FlashCache>, CacheError> {
    if format_anyway {
        FlashCache::format(device, cfg)
    } else {
        FlashCache::open_or_format(device, cfg)
    }
}

/// Opens the cache device at `path` for serving, or creates and formats a
/// cache file there.
///
/// A new file is built under a temporary name and renamed into place only
/// once formatted, so a failure (a size below the minimum, a full disk)
/// leaves nothing behind. An existing cache keeps the size it was created
/// with: `size` must then match it or be absent. A device that holds
/// something but no cache is refused unless `format_anyway`. Returns the
/// cache and whether this call created its file.
pub fn open_cache_file(
    path: &Path,
    size: Option<u64>,
    cfg: CacheConfig,
    format_anyway: bool,
) -> Result<(Arc<FlashCache>, bool)> {
    let created = !path.exists();
    if created {
        let size = size.ok_or_else(|| HostError::NoSizeToCreate(path.to_path_buf()))?;
        create_cache_file(path, size, cfg.clone())?;
        tracing::debug!("created cache file {} ({size} bytes)", path.display());
    }
    let opened = (|| {
        let device = open_device(path)?;
        check_requested_size(path, &*device, size)?;
        open_for_serving(device, cfg, format_anyway).map_err(|source| HostError::Cache {
            device: path.display().to_string(),
            source,
        })
    })();
    if opened.is_err() && created {
        remove_created_cache(path);
    }
    Ok((opened?, created))
}

/// Removes a cache file this run created, once what it was for failed: a
/// refused start leaves no new file behind.
pub fn remove_created_cache(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        tracing::warn!("cannot remove the new cache {}: {e}", path.display());
    }
}

/// An existing cache file must be the size asked for, if one was asked
/// for: a size that does not apply is an error, never silently ignored.
fn check_requested_size(path: &Path, device: &dyn Backend, size: Option<u64>) -> Result<()> {
    let Some(want) = size else { return Ok(()) };
    let is_file = std::fs::metadata(path)
        .map(|m| m.file_type().is_file())
        .unwrap_or(false);
    if !is_file {
        return Err(HostError::NotAFile(path.to_path_buf()));
    }
    let have = device.len().map_err(|source| HostError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    if have != want {
        return Err(HostError::SizeMismatch {
            path: path.to_path_buf(),
            have,
            want,
        });
    }
    Ok(())
}

/// Creates a formatted cache file of `size` bytes at `path`, complete or
/// not at all.
fn create_cache_file(path: &Path, size: u64, cfg: CacheConfig) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| HostError::NoFileName(path.to_path_buf()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".creating.{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let built = (|| -> Result<()> {
        let create = |source| HostError::Create {
            path: path.to_path_buf(),
            source,
        };
        let f = std::fs::File::create_new(&tmp).map_err(create)?;
        f.set_len(size).map_err(|source| HostError::Resize {
            path: path.to_path_buf(),
            size,
            source,
        })?;
        drop(f);
        let format = |source| HostError::Format {
            path: path.to_path_buf(),
            source,
        };
        let cache = FlashCache::format(open_device(&tmp)?, cfg).map_err(format)?;
        cache.shutdown(false).map_err(format)?;
        drop(cache);
        vdcache_backend::publish_new_file(&tmp, path).map_err(|source| HostError::Publish {
            path: path.to_path_buf(),
            source,
        })
    })();
    if built.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    built
}

/// Opens a cache device by its absolute path, locked for writing: images
/// record where their cache lives, for the advice their error messages
/// give.
pub fn open_device(path: &Path) -> Result<BackendRef> {
    let path = std::fs::canonicalize(path).map_err(|e| HostError::Open {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    let device = FileBackend::open(
        &path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: false,
        },
    )
    .map_err(|e| HostError::Open {
        path: path.clone(),
        source: e.into(),
    })?;
    Ok(Arc::new(device))
}
