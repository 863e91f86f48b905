//! Building a server's disks from its configuration: the shared cache
//! (created, recovered or formatted by `vdcache-host`, which owns how a
//! cache device is opened and recovered), one VirtualDisk per export with
//! its own policy, and an orderly stop that leaves every image clean.

use super::config::{CacheSection, ExportConfig, MetadataJournal, ServerConfig, journal_marker};
use crate::size::{human, parse_size};
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::sync::Arc;
use vdcache_cache::{CacheConfig, CowMode, DiskPolicy, FlashCache, WriteMode};
use vdcache_image::{
    DiskId, HostIo, ImageError, ImageFormat, JournalMode, MetaCacheConfig, OpenOptions, Stores,
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
    /// Where the cache lives (journal devices' markers sit next to it).
    pub cache_path: Option<PathBuf>,
    pub disks: Vec<Disk>,
    pub keep_dirty: bool,
    /// Journal device files this start created: removed again (dropped)
    /// if the start fails, kept once it succeeds.
    created_journals: Vec<vdcache_ownership::CreatedFile>,
}

/// Cache settings from a `[cache]` section.
pub fn cache_config(c: &CacheSection) -> Result<CacheConfig> {
    let mut cfg = CacheConfig::default();
    if let Some(r) = &c.region_size {
        cfg.region_bytes =
            parse_size(r).with_context(|| c.setting("region_size", "--region-size"))?;
    }
    if let Some(p) = &c.replacement {
        cfg.replacement = p.parse().map_err(|e: String| {
            anyhow::anyhow!("{}: {e}", c.setting("replacement", "--replacement"))
        })?;
    }
    if let Some(m) = &c.mode {
        cfg.default_policy.mode = m
            .parse()
            .with_context(|| c.setting("mode", "--cache-mode"))?;
    }
    if let Some(a) = &c.admission {
        cfg.default_policy.admission = a
            .parse()
            .with_context(|| c.setting("admission", "--admission"))?;
    }
    if let Some(s) = &c.sequential_write_cutoff {
        cfg.default_policy.sequential_write_cutoff = parse_size(s)
            .with_context(|| c.setting("sequential_write_cutoff", "--sequential-write-cutoff"))?;
    }
    if let Some(cow) = &c.cow {
        cfg.default_policy.cow = cow.parse().with_context(|| c.setting("cow", "--cow"))?;
    }
    if let Some(h) = c.high_watermark {
        cfg.high_watermark = h;
    }
    if let Some(l) = c.low_watermark {
        cfg.low_watermark = l;
    }
    if let Some(d) = c.writeback_depth {
        cfg.writeback_depth = d;
    }
    cfg.dedup = dedup_mode(c)?;
    cfg.shares = c.shares.unwrap_or(false);
    cfg.read_split = c.read_split;
    cfg.validate()?;
    Ok(cfg)
}

/// An export's share of flash (`share_min`, `share_max`, `share_weight`).
pub fn share_of(e: &ExportConfig) -> Result<vdcache_cache::shares::Share> {
    let blocks = |key: &str, v: &Option<String>| -> Result<Option<u64>> {
        v.as_deref()
            .map(|v| {
                crate::size::parse_size(v)
                    .map(|b| b / 4096)
                    .with_context(|| format!("export '{}': {key}", e.name))
            })
            .transpose()
    };
    let default = vdcache_cache::shares::Share::default();
    Ok(vdcache_cache::shares::Share {
        min_blocks: blocks("share_min", &e.share_min)?.unwrap_or(default.min_blocks),
        max_blocks: blocks("share_max", &e.share_max)?.unwrap_or(default.max_blocks),
        weight: e.share_weight.unwrap_or(default.weight),
    })
}

/// The dedup mode `dedup` and `dedup_verify` of a `[cache]` section say.
fn dedup_mode(c: &CacheSection) -> Result<vdcache_cache::Dedup> {
    use vdcache_cache::Dedup;
    let on = match c.dedup.as_deref() {
        None | Some("off") => false,
        Some("on") => true,
        Some(other) => anyhow::bail!(
            "{}: '{other}' is not on or off",
            c.setting("dedup", "--dedup")
        ),
    };
    match (on, c.dedup_verify.unwrap_or(false)) {
        (false, false) => Ok(Dedup::Off),
        (false, true) => anyhow::bail!(
            "{} needs dedup on",
            c.setting("dedup_verify", "--dedup-verify")
        ),
        (true, false) => Ok(Dedup::On),
        (true, true) => Ok(Dedup::Verify),
    }
}

/// Opens the cache device of a `[cache]` section for serving, or creates
/// and formats its cache file (see [`vdcache_host::open_cache_file`]).
/// Returns the cache and whether this call created its file.
pub fn open_cache(
    c: &CacheSection,
    cfg: CacheConfig,
    format_anyway: bool,
) -> Result<(Arc<FlashCache>, bool)> {
    let size = c
        .size
        .as_deref()
        .map(parse_size)
        .transpose()
        .with_context(|| c.setting("size", "--cache-size"))?;
    Ok(vdcache_host::open_cache_file(
        &c.path,
        size,
        cfg,
        format_anyway,
    )?)
}

/// A cache refused as damaged: the exports' images marked as needing it
/// are named (the damage may have taken the cache's own record of them).
fn name_marked_images(
    e: anyhow::Error,
    cache: &std::path::Path,
    exports: &[ExportConfig],
) -> anyhow::Error {
    let damaged = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<vdcache_cache::CacheError>(),
            Some(vdcache_cache::CacheError::Damaged { .. })
        )
    });
    if !damaged {
        return e;
    }
    let images: Vec<&str> = exports.iter().map(|x| x.image.as_str()).collect();
    let marked = vdcache_host::images_needing_cache(cache, &images);
    if marked.is_empty() {
        return e;
    }
    e.context(format!(
        "{} stay(s) marked as needing the cache {} (QEMU refuses such an image), which cannot be opened",
        marked.join(", "),
        cache.display()
    ))
}

/// Metadata cache of an export: whole tables for the stacked baseline;
/// sectors (COWCache's fine-grained metadata) when the cache is cow-aware.
fn meta_cache(e: &ExportConfig, cow: Option<CowMode>) -> Result<MetaCacheConfig> {
    let mut m = MetaCacheConfig::with_slice_bytes(cow.and_then(CowMode::meta_slice_bytes));
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

/// Where an external ext4 journal with 4 KiB blocks keeps its JBD2
/// superblock: device block 1 (block 0 holds the device's own ext4
/// superblock).
const JBD2_BLOCK: usize = 4096;

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

/// The metadata journal an export's top image gets: without a cache or
/// through a writethrough or writearound one, where a guest flush would
/// otherwise cost the store up to four syncs. `auto` (the default) journals
/// an image that can carry one (version 3) and serves the others without;
/// `on` refuses those. In writeback mode a guest flush costs the store no
/// sync, so there is nothing to save.
fn journal_mode(e: &ExportConfig, cached: Option<WriteMode>) -> Result<JournalMode> {
    Ok(match (e.metadata_journal()?, cached) {
        (MetadataJournal::Off, _) | (MetadataJournal::Auto, Some(WriteMode::WriteBack)) => {
            JournalMode::Off
        }
        (MetadataJournal::Auto, _) => JournalMode::IfPossible,
        (MetadataJournal::On, Some(WriteMode::WriteBack)) => anyhow::bail!(
            "export '{}': metadata_journal = \"on\" needs no journal with a writeback cache (a guest flush costs the store no sync there); use it without a cache or with --cache-mode writethrough or writearound",
            e.name
        ),
        (MetadataJournal::On, _) => JournalMode::Required,
    })
}

/// Whether an export preallocates: only asked for, and only where it
/// does something (the journal on, no cache below).
fn preallocation(e: &ExportConfig, cached: Option<WriteMode>) -> Result<bool> {
    if e.preallocate != Some(true) {
        return Ok(false);
    }
    if e.metadata_journal()? == MetadataJournal::Off {
        anyhow::bail!(
            "export '{}': preallocate needs the metadata journal (metadata_journal = \"auto\" or \"on\"): zeros are written ahead of allocation only for a journaled disk",
            e.name
        );
    }
    if cached.is_some() {
        anyhow::bail!(
            "export '{}': preallocate does nothing through a flash cache (the zeros would only fill flash); serve the disk without the cache, or drop preallocate",
            e.name
        );
    }
    Ok(true)
}

impl Daemon {
    /// Opens the cache and every export's chain.
    pub fn build(cfg: &ServerConfig, format_cache: bool) -> Result<Daemon> {
        if let Some(c) = &cfg.cache
            && !c.path.exists()
        {
            // Refused before a new cache file is made for nothing.
            refuse_stale_journals(cfg, &c.path)?;
        }
        let (cache, created, keep_dirty) = match &cfg.cache {
            Some(c) => {
                let (cache, created) = open_cache(c, cache_config(c)?, format_cache)
                    .map_err(|e| name_marked_images(e, &c.path, &cfg.exports))?;
                log_opened(c, &cache, created);
                (Some(cache), created, c.keep_dirty.unwrap_or(false))
            }
            None => (None, false, false),
        };
        if let (Some(c), true) = (&cfg.cache, created)
            && let Err(e) = refuse_stale_journals(cfg, &c.path)
        {
            if let Some(cache) = &cache {
                let _ = cache.shutdown(true);
            }
            drop(cache);
            vdcache_host::remove_created_cache(&c.path);
            return Err(e);
        }
        let mut daemon = Daemon {
            cache,
            cache_path: cfg.cache.as_ref().map(|c| c.path.clone()),
            disks: Vec::new(),
            keep_dirty,
            created_journals: Vec::new(),
        };
        if let Err(e) = daemon
            .open_exports(cfg)
            .and_then(|()| daemon.mark_journals(cfg))
        {
            // Leave everything as it was: the exports opened so far are
            // closed (released from the cache), a cache file made for
            // this start is removed.
            if let Err(stop) = daemon.stop() {
                tracing::error!("undoing a failed start: {stop:#}");
            } else if let (true, Some(c)) = (created, &cfg.cache) {
                vdcache_host::remove_created_cache(&c.path);
            }
            // Journal files made for this start go with it.
            daemon.created_journals.clear();
            return Err(e);
        }
        for made in daemon.created_journals.drain(..) {
            made.keep();
        }
        if let Some(c) = &daemon.cache {
            warn_unserved_dirty(c, &daemon.disks);
        }
        Ok(daemon)
    }

    /// Opens every export's chain, through the cache unless it opts out.
    fn open_exports(&mut self, cfg: &ServerConfig) -> Result<()> {
        let opener = Arc::new(Stores {
            nbd: cfg.storage.nbd_options(),
        });
        // Journal devices come after every disk, so the disks keep their ids.
        let mut journals: Vec<ExportConfig> = Vec::new();
        if let Some(c) = &cfg.cache {
            for e in &cfg.exports {
                let (Some(j), Some(size)) = (e.journal_export(&c.path), e.journal_size.as_deref())
                else {
                    continue;
                };
                self.created_journals.extend(create_journal_file(&j, size)?);
                journals.push(j);
            }
        }
        for (i, e) in cfg.exports.iter().chain(&journals).enumerate() {
            let id = DiskId(i as u32 + 1);
            let mut write_mode = None;
            let (io, cow): (Option<Arc<dyn HostIo>>, Option<CowMode>) =
                match (&self.cache, e.no_cache) {
                    (Some(c), false) => {
                        let policy = if e.is_aware_journal() {
                            DiskPolicy::journal_device()
                        } else {
                            disk_policy(e, c.config().default_policy)?
                        };
                        c.set_policy(id, policy);
                        write_mode = Some(policy.mode);
                        c.set_share(id, share_of(e)?);
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
                    opener: opener.clone(),
                    metadata_journal: journal_mode(e, write_mode)?,
                    preallocate: preallocation(e, write_mode)?,
                    allow_backing: cfg.storage.allow_backing.clone(),
                    ..OpenOptions::default()
                },
            )
            .map_err(|err| {
                // The default export of a one-image server needs no name:
                // the error names the image.
                let err = anyhow::Error::from(err);
                if e.name.is_empty() {
                    err
                } else {
                    err.context(format!("export '{}'", e.name))
                }
            })?;
            let disk = Arc::new(disk);
            disk.offer_backing_fill();
            disk.defer_cow_writes(vdcache_image::STREAM_WRITES);
            self.disks.push(Disk {
                config: e.clone(),
                id,
                disk,
            });
        }
        for j in &journals {
            self.check_journal_size(j, cfg)?;
        }
        self.link_journals();
        Ok(())
    }

    /// Marks every journal-aware journal device as living in the cache
    /// (see [`journal_marker`]) before anything is served.
    fn mark_journals(&self, cfg: &ServerConfig) -> Result<()> {
        let Some(c) = &cfg.cache else { return Ok(()) };
        for (data, marker) in journal_markers(cfg, &c.path) {
            std::fs::write(
                &marker,
                format!(
                    "The newest blocks of the journal device of export '{data}' may live only in the cache {}.\nvdcache removes this file once they are written out (a clean stop with nothing left in flash, `vdcache flush`, `vdcache recover --full`).\n",
                    c.path.display()
                ),
            )
            .with_context(|| format!("export '{data}': writing {}", marker.display()))?;
        }
        Ok(())
    }

    /// After the cache stopped: a journal device whose blocks the cache
    /// still holds alone keeps its marker, and the log says so; the
    /// others' markers go.
    fn unmark_journals(&self, cache: &FlashCache, cache_path: &std::path::Path) {
        let held = cache.images();
        // Every journal device, aware or not: one made unaware since its
        // marker was written must not leave that marker behind.
        for j in self.disks.iter().filter(|d| d.config.journal_for.is_some()) {
            let Some(data) = j.config.journal_for.as_deref() else {
                continue;
            };
            let name = j.disk.layers()[0].name();
            let kept = held
                .iter()
                .find(|(n, _)| n.as_str() == name)
                .map_or(0, |(_, dirty)| *dirty);
            let marker = journal_marker(cache_path, data);
            if kept > 0 {
                if j.config.is_aware_journal() {
                    tracing::info!(
                        "export '{}': {} of the guest's journal kept in flash only (cache-only logging; `vdcache flush` or `vdcache recover --full` writes it to {})",
                        j.config.name,
                        human(kept),
                        j.config.image
                    );
                }
            } else if let Err(e) = std::fs::remove_file(&marker)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!("cannot remove {}: {e}", marker.display());
            }
        }
    }

    /// A journal device's image must have the configured size (a file
    /// created here does; an NBD export is whatever its server serves).
    fn check_journal_size(&self, j: &ExportConfig, cfg: &ServerConfig) -> Result<()> {
        let Some(size) = cfg
            .exports
            .iter()
            .find(|e| Some(&e.name) == j.journal_for.as_ref())
            .and_then(|e| e.journal_size.as_deref())
        else {
            return Ok(());
        };
        let want = parse_size(size)?;
        match self.disks.iter().find(|d| d.config.name == j.name) {
            Some(d) if d.disk.size() != want => anyhow::bail!(
                "export '{}': {} holds {} bytes, not journal_size {size}",
                j.name,
                j.image,
                d.disk.size()
            ),
            _ => Ok(()),
        }
    }

    /// Links every journal-aware journal device to its data disk in the
    /// cache, with the JBD2 superblock the device holds now (if any).
    fn link_journals(&self) {
        let Some(cache) = &self.cache else { return };
        for j in self.disks.iter().filter(|d| d.config.is_aware_journal()) {
            let Some(data) = self
                .disks
                .iter()
                .find(|d| Some(&d.config.name) == j.config.journal_for.as_ref())
            else {
                continue;
            };
            let mut sb = vec![0u8; JBD2_BLOCK];
            let sb = j.disk.read(JBD2_BLOCK as u64, &mut sb).ok().map(|()| sb);
            let bits = data.disk.cluster_size().trailing_zeros();
            match cache.link_journal(j.id, data.id, bits, sb.as_deref()) {
                Ok(()) => tracing::info!(
                    "export '{}': journal-aware (cache-only logging, logical caching for '{}')",
                    j.config.name,
                    data.config.name
                ),
                Err(e) => tracing::warn!(
                    "export '{}': cache-only logging on; logical caching waits for a usable journal superblock ({e})",
                    j.config.name
                ),
            }
        }
    }

    /// Closes every disk (flushing it and clearing its dirty bit), then the
    /// cache: written back unless `keep_dirty`, checkpointed either way.
    ///
    /// A stop always ends: an image that cannot be completed (its storage
    /// server unreachable for the whole reconnect delay, or any other
    /// failure) is closed keeping its dirty data in the cache, as with
    /// `keep_dirty`; it stays marked as needing the cache, and the next
    /// start with this cache writes the data back. That is reported as an
    /// error naming the exports.
    pub fn stop(&self) -> Result<()> {
        let mut first_error = None;
        let mut kept: Vec<&str> = Vec::new();
        let mut unreachable = false;
        for d in &self.disks {
            let name = d.config.name.as_str();
            let closed = if self.keep_dirty {
                d.disk.close_keeping_cached()
            } else {
                match d.disk.close() {
                    Err(e) if self.cache.is_some() => {
                        unreachable |= store_unreachable(&e);
                        tracing::error!(
                            "export '{name}': the image cannot be completed: {e}; its dirty data stays in the cache"
                        );
                        first_error.get_or_insert(anyhow::anyhow!("export '{name}': {e}"));
                        kept.push(name);
                        d.disk.close_keeping_cached()
                    }
                    other => other,
                }
            };
            if let Err(e) = closed {
                tracing::error!("closing export '{name}': {e}");
                first_error.get_or_insert(anyhow::anyhow!("export '{name}': {e}"));
            }
        }
        if let Some(c) = &self.cache {
            let keep = self.keep_dirty || !kept.is_empty();
            let shut = c.shutdown(keep);
            if let Some(path) = &self.cache_path {
                self.unmark_journals(c, path);
            }
            if let Err(e) = shut {
                if keep {
                    return Err(e).context("stopping the cache");
                }
                unreachable |= e.unreachable_store().is_some();
                tracing::error!("the cache cannot be written back: {e}");
                first_error.get_or_insert(anyhow::anyhow!("writing the cache back: {e}"));
                kept.extend(self.disks.iter().map(|d| d.config.name.as_str()));
                c.shutdown(true).context("stopping the cache")?;
            }
            if !self.keep_dirty && !kept.is_empty() {
                kept.sort_unstable();
                kept.dedup();
                let why = if unreachable {
                    "the storage server could not be reached"
                } else {
                    "writing them back failed"
                };
                let device = c.device_name();
                tracing::error!(
                    "stopped with dirty data kept in the cache {device} ({why}): the images of export(s) '{}' stay marked as needing it. The next `vdcache serve` with this cache writes it back once the storage is reachable (or run `vdcache recover --full --cache {device}`)",
                    kept.join("', '")
                );
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Says at info what the cache device held when it opened: a new cache,
/// one fast-recovered with dirty data still to write back, or a clean one.
fn log_opened(c: &CacheSection, cache: &FlashCache, created: bool) {
    let r = cache.report();
    let cfg = cache.config();
    let what = format!(
        "cache {}: {} for data, {} {}, {} admission, {} replacement, dedup {}",
        c.path.display(),
        human(r.data_bytes),
        cfg.default_policy.mode.name(),
        cfg.default_policy.cow.name(),
        cfg.default_policy.admission.name(),
        r.replacement,
        cfg.dedup.name()
    );
    if created {
        tracing::info!(
            "{what}: formatted (new cache file of {})",
            human(r.device_bytes)
        );
    } else if r.recovery.entries_replayed > 0 || r.dirty_bytes > 0 {
        tracing::info!(
            "{what}: fast-recovered ({} journal entries replayed) with {} dirty blocks ({}) still to write back, {} cached",
            r.recovery.entries_replayed,
            r.dirty_bytes / 4096,
            human(r.dirty_bytes),
            human(r.cached_bytes)
        );
    } else if r.cached_bytes > 0 {
        tracing::info!(
            "{what}: reopened clean, {} cached (warm)",
            human(r.cached_bytes)
        );
    } else {
        tracing::info!("{what}: opened, empty");
    }
    if r.recovery.damaged_blocks > 0 {
        tracing::warn!(
            "cache {}: {} blocks no longer verify and were dropped (see `vdcache stats`)",
            c.path.display(),
            r.recovery.damaged_blocks
        );
    }
}

/// Creates the file behind a journal device, zero-filled, unless it
/// exists already with the configured size (an NBD export must exist:
/// its size is checked once it is open). Returns the file made now,
/// removed when dropped unless kept.
fn create_journal_file(
    j: &ExportConfig,
    size: &str,
) -> Result<Option<vdcache_ownership::CreatedFile>> {
    if vdcache_backend::is_nbd_uri(&j.image) {
        return Ok(None);
    }
    let bytes = parse_size(size).with_context(|| format!("export '{}': journal_size", j.name))?;
    let path = std::path::Path::new(&j.image);
    match std::fs::metadata(path) {
        Ok(m) if m.len() == bytes => Ok(None),
        Ok(m) => anyhow::bail!(
            "export '{}': {} holds {} bytes, not journal_size {size} (remove it to start an empty journal)",
            j.name,
            path.display(),
            m.len()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Removed again if it cannot take its size: a refused start
            // leaves nothing it made.
            let (f, created) = vdcache_ownership::CreatedFile::create_new(path)
                .with_context(|| format!("export '{}'", j.name))?;
            f.set_len(bytes).with_context(|| {
                format!(
                    "export '{}': cannot size {} to journal_size {size}",
                    j.name,
                    path.display()
                )
            })?;
            Ok(Some(created))
        }
        Err(e) => Err(e).with_context(|| format!("export '{}': {}", j.name, path.display())),
    }
}

/// For each journal-aware journal device of `cfg`: the export it journals
/// for and its marker file next to the cache at `cache`.
fn journal_markers(cfg: &ServerConfig, cache: &std::path::Path) -> Vec<(String, PathBuf)> {
    cfg.exports
        .iter()
        .filter(|e| e.journal_size.is_some() && e.journal_aware.unwrap_or(true))
        .map(|e| (e.name.clone(), journal_marker(cache, &e.name)))
        .collect()
}

/// A cache created anew cannot hold what a journal device's marker says
/// only a cache held: its image is stale, and serving it would let the
/// guest replay an old journal over newer data.
fn refuse_stale_journals(cfg: &ServerConfig, cache: &std::path::Path) -> Result<()> {
    for (data, marker) in journal_markers(cfg, cache) {
        if marker.exists() {
            anyhow::bail!(
                "export '{data}': the newest blocks of its journal device lived only in the cache {}, which was just created anew (the old one is gone), so its journal image is stale. Put the old cache file back and run `vdcache recover --full --cache {}`; or, to serve the stale journal anyway, remove {} and check the guest's file system (`e2fsck -f` with the journal device) before mounting it",
                cache.display(),
                cache.display(),
                marker.display()
            );
        }
    }
    Ok(())
}

/// Whether an image error comes from a storage server that could not be
/// reached (rather than from the data or a disk).
fn store_unreachable(e: &ImageError) -> bool {
    match e {
        ImageError::Io { cause, .. } => cause.is_unreachable(),
        ImageError::BackingMissing { cause, .. } => store_unreachable(cause),
        _ => false,
    }
}

/// Names the images whose dirty data the cache holds but this server does
/// not serve: it stays in flash, untouched, until a server serves them or
/// `recover --full` writes it back.
fn warn_unserved_dirty(cache: &FlashCache, disks: &[Disk]) {
    let served: Vec<&str> = disks
        .iter()
        .flat_map(|d| d.disk.layers().iter().map(|l| l.name()))
        .collect();
    let device = cache.device_name();
    for (name, dirty) in cache.images() {
        if dirty > 0 && !served.contains(&name.as_str()) {
            tracing::warn!(
                "the cache {device} holds {dirty} bytes of unwritten data of {name}, which is not served here; it stays in the cache (serve {name} with this cache, or run `vdcache recover --full --cache {device}`)"
            );
        }
    }
}
