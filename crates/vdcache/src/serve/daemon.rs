//! Building a server's disks from its configuration: the shared cache
//! (created, recovered or formatted), one VirtualDisk per export with its
//! own policy, and an orderly stop that leaves every image clean.

use super::config::{CacheSection, ExportConfig, ServerConfig};
use crate::size::parse_size;
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::sync::Arc;
use vdcache_backend::{FileBackend, FileOptions, LockMode};
use vdcache_cache::{CacheConfig, CowMode, DiskPolicy, FlashCache};
use vdcache_image::{
    DiskId, HostIo, ImageFormat, LocalFiles, MetaCacheConfig, OpenOptions, StoreOpener,
    VirtualDisk, open_chain,
};

/// One served disk.
pub struct Disk {
    pub config: ExportConfig,
    pub id: DiskId,
    pub disk: Arc<VirtualDisk>,
}

/// Everything a running server holds.
pub struct Daemon {
    pub cache: Option<Arc<FlashCache>>,
    pub disks: Vec<Disk>,
    pub keep_dirty: bool,
}

/// Cache settings from a `[cache]` section.
pub fn cache_config(c: &CacheSection) -> Result<CacheConfig> {
    let mut cfg = CacheConfig::default();
    if let Some(r) = &c.region_size {
        cfg.region_bytes = parse_size(r).context("[cache] region_size")?;
    }
    if let Some(p) = &c.replacement {
        cfg.replacement = p
            .parse()
            .map_err(|e: String| anyhow::anyhow!("[cache] replacement: {e}"))?;
    }
    if let Some(m) = &c.mode {
        cfg.default_policy.mode = m.parse().context("[cache] mode")?;
    }
    if let Some(a) = &c.admission {
        cfg.default_policy.admission = a.parse().context("[cache] admission")?;
    }
    if let Some(s) = &c.sequential_write_cutoff {
        cfg.default_policy.sequential_write_cutoff =
            parse_size(s).context("[cache] sequential_write_cutoff")?;
    }
    if let Some(c) = &c.cow {
        cfg.default_policy.cow = c.parse().context("[cache] cow")?;
    }
    if let Some(h) = c.high_watermark {
        cfg.high_watermark = h;
    }
    if let Some(l) = c.low_watermark {
        cfg.low_watermark = l;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Opens (or creates and formats) the cache device.
pub fn open_cache(c: &CacheSection, cfg: CacheConfig) -> Result<Arc<FlashCache>> {
    let path = &c.path;
    if !path.exists() {
        let size = c
            .size
            .as_deref()
            .map(parse_size)
            .transpose()?
            .with_context(|| {
                format!(
                    "cache {} does not exist; give its size (--cache-size) to create it",
                    path.display()
                )
            })?;
        let f = std::fs::File::create(path)
            .with_context(|| format!("cannot create cache {}", path.display()))?;
        f.set_len(size)
            .with_context(|| format!("cannot size cache {}", path.display()))?;
        tracing::info!("created cache file {} ({size} bytes)", path.display());
    }
    let device = FileBackend::open(
        path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: false,
        },
    )
    .with_context(|| format!("cannot open cache {}", path.display()))?;
    let cache = FlashCache::open_or_format(Arc::new(device), cfg)
        .with_context(|| format!("cache {}", path.display()))?;
    Ok(cache)
}

/// Metadata cache of an export: whole tables for the stacked baseline;
/// sectors (COWCache's fine-grained metadata) when the cache is cow-aware.
fn meta_cache(e: &ExportConfig, cow: Option<CowMode>) -> Result<MetaCacheConfig> {
    let mut m = cow.map_or_else(MetaCacheConfig::default, CowMode::meta_cache);
    if let Some(s) = &e.l2_cache_size {
        m.l2_bytes = parse_size(s)?;
    }
    if let Some(s) = &e.refcount_cache_size {
        m.refcount_bytes = parse_size(s)?;
    }
    if let Some(s) = &e.meta_slice_size {
        m.slice_bytes = Some(parse_size(s)?);
    }
    Ok(m)
}

fn disk_policy(e: &ExportConfig, default: DiskPolicy) -> Result<DiskPolicy> {
    let mut p = default;
    if let Some(m) = &e.cache_mode {
        p.mode = m
            .parse()
            .with_context(|| format!("export '{}': cache_mode", e.name))?;
    }
    if let Some(a) = &e.admission {
        p.admission = a
            .parse()
            .with_context(|| format!("export '{}': admission", e.name))?;
    }
    if let Some(s) = &e.sequential_write_cutoff {
        p.sequential_write_cutoff = parse_size(s)
            .with_context(|| format!("export '{}': sequential_write_cutoff", e.name))?;
    }
    if let Some(c) = &e.cow {
        p.cow = c
            .parse()
            .with_context(|| format!("export '{}': cow", e.name))?;
    }
    Ok(p)
}

impl Daemon {
    /// Opens the cache and every export's chain.
    pub fn build(cfg: &ServerConfig) -> Result<Daemon> {
        let (cache, keep_dirty) = match &cfg.cache {
            Some(c) => {
                let cc = cache_config(c)?;
                (Some(open_cache(c, cc)?), c.keep_dirty.unwrap_or(false))
            }
            None => (None, false),
        };
        let mut disks = Vec::new();
        for (i, e) in cfg.exports.iter().enumerate() {
            let id = DiskId(i as u32 + 1);
            let (io, cow): (Option<Arc<dyn HostIo>>, Option<CowMode>) = match (&cache, e.no_cache) {
                (Some(c), false) => {
                    let policy = disk_policy(e, c.config().default_policy)?;
                    c.set_policy(id, policy);
                    (Some(c.clone()), Some(policy.cow))
                }
                _ => (None, None),
            };
            let format = match e.format.as_deref() {
                Some(f) => Some(
                    ImageFormat::parse(f)
                        .with_context(|| format!("export '{}': unknown format '{f}'", e.name))?,
                ),
                None => None,
            };
            let disk = open_chain(
                &e.image,
                &OpenOptions {
                    read_only: e.read_only,
                    format,
                    cache: meta_cache(e, cow)?,
                    disk: id,
                    io,
                    ..OpenOptions::default()
                },
            )
            .with_context(|| format!("export '{}'", e.name))?;
            disks.push(Disk {
                config: e.clone(),
                id,
                disk: Arc::new(disk),
            });
        }
        Ok(Daemon {
            cache,
            disks,
            keep_dirty,
        })
    }

    /// Closes every disk (flushing it and clearing its dirty bit), then the
    /// cache: written back unless `keep_dirty`, checkpointed either way.
    pub fn stop(&self) -> Result<()> {
        let mut first_error = None;
        for d in &self.disks {
            if !self.keep_dirty
                && let Err(e) = d.disk.fill_partial(usize::MAX)
            {
                tracing::error!("filling export '{}': {e}", d.config.name);
                first_error.get_or_insert(anyhow::anyhow!("export '{}': {e}", d.config.name));
            }
            if let Err(e) = d.disk.close() {
                tracing::error!("closing export '{}': {e}", d.config.name);
                first_error.get_or_insert(anyhow::anyhow!("export '{}': {e}", d.config.name));
            }
        }
        if let Some(c) = &self.cache {
            c.shutdown(self.keep_dirty).context("stopping the cache")?;
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn open_device(path: &Path) -> Result<vdcache_backend::BackendRef> {
    let device = FileBackend::open(
        path,
        FileOptions {
            read_only: false,
            lock: Some(LockMode::Write),
            create: false,
        },
    )
    .with_context(|| format!("cannot open cache {}", path.display()))?;
    Ok(Arc::new(device))
}

/// Full recovery of a cache device: fills partially valid clusters from
/// their backing chains, writes every dirty block back to its image, then
/// repairs leaked clusters so each image is standalone and `qemu-img
/// check` clean. A device recorded for another host is then formatted for
/// this one (what it still caches may be stale where the images move).
/// Returns the images written.
pub fn recover_full(cache_path: &Path) -> Result<Vec<String>> {
    let cfg = CacheConfig {
        force_foreign: true,
        ..CacheConfig::default()
    };
    let cache = FlashCache::open(open_device(cache_path)?, cfg.clone())
        .with_context(|| format!("cache {}", cache_path.display()))?;
    let foreign = cache.superblock().host != vdcache_cache::layout::host_identity();
    for name in cache.partial_images() {
        let disk = open_chain(
            &name,
            &OpenOptions {
                io: Some(cache.clone()),
                ..OpenOptions::default()
            },
        )
        .with_context(|| format!("opening {name} to fill its partially valid clusters"))?;
        let report = disk.fill_partial(usize::MAX)?;
        tracing::info!(
            "{name}: filled {} bytes of partially valid clusters",
            report.filled_bytes
        );
        disk.close()?;
    }
    let open = |name: &str| -> vdcache_cache::Result<vdcache_backend::BackendRef> {
        Ok(LocalFiles.open(name, true, Some(LockMode::Write))?)
    };
    let written = cache.recover_full(&open)?;
    cache.shutdown(false)?;
    drop(cache);
    for name in &written {
        repair_leaks(name)?;
    }
    if foreign {
        FlashCache::format(open_device(cache_path)?, CacheConfig::default())?.shutdown(false)?;
        tracing::info!("{} now belongs to this host", cache_path.display());
    }
    Ok(written)
}

/// Rebuilds refcounts of a qcow2 image if it has leaks after a crash.
fn repair_leaks(name: &str) -> Result<()> {
    let disk = open_chain(
        name,
        &OpenOptions {
            no_backing: true,
            ..OpenOptions::default()
        },
    )?;
    if let vdcache_image::Layer::Qcow2(img) = &disk.layers()[0] {
        let report = img.check()?;
        if !report.corruptions.is_empty() {
            bail!(
                "{name}: corrupt after write-back: {}",
                report.corruptions.join("; ")
            );
        }
        if !report.leaks.is_empty() {
            tracing::info!("{name}: repairing {} leaked clusters", report.leaks.len());
            img.repair()?;
        }
    }
    disk.close()?;
    Ok(())
}
