//! Opening a chain: resolving backing names relative to the image that
//! names them, keeping them where the operator allows (see `confine`),
//! taking each backing file's format from its parent's header extension (a
//! raw file is never probed as qcow2), locking the files as QEMU does, and
//! refusing loops and missing files with clear errors.

use crate::confine::Confinement;
use crate::disk::{Layer, RawImage, VirtualDisk};
use crate::error::{ImageError, Result};
use crate::hostio::{DirectIo, DiskId, HostIo, ImageHandle};
use crate::identity::read_identity;
use crate::meta_cache::MetaCacheConfig;
use crate::qimage::{self, ImageOptions, Qcow2Image};
use std::sync::Arc;
use vdcache_backend::{
    BackendRef, FileBackend, FileOptions, LockMode, MemBackend, NbdBackend, NbdOptions, StoreName,
    resolve_backing_name,
};
use vdcache_qcow2::header::MAGIC;

/// Longest chain accepted (QEMU has no fixed limit; this bounds recursion).
pub const MAX_CHAIN_DEPTH: usize = 64;

/// Image formats a chain may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    Qcow2,
    Raw,
}

impl ImageFormat {
    pub fn parse(s: &str) -> Option<ImageFormat> {
        match s {
            "qcow2" => Some(ImageFormat::Qcow2),
            "raw" => Some(ImageFormat::Raw),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Raw => "raw",
        }
    }
}

/// Opens the store behind an image name (a path, or later a URI).
pub trait StoreOpener: Send + Sync + std::fmt::Debug {
    /// Opens `name`, locking it in `lock` mode when given.
    fn open(&self, name: &str, writable: bool, lock: Option<LockMode>) -> Result<BackendRef>;
    /// A stable name for loop detection and cache keys.
    fn canonical(&self, name: &str) -> Result<String>;
    /// Resolves a backing name found in `parent`'s header.
    fn resolve(&self, parent: &str, backing: &str) -> String;
}

/// Opens local files (and NBD exports, with the default settings).
#[derive(Debug, Default)]
pub struct LocalFiles;

impl StoreOpener for LocalFiles {
    fn open(&self, name: &str, writable: bool, lock: Option<LockMode>) -> Result<BackendRef> {
        Stores::default().open(name, writable, lock)
    }

    fn canonical(&self, name: &str) -> Result<String> {
        Stores::default().canonical(name)
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        Stores::default().resolve(parent, backing)
    }
}

/// Opens local files and NBD exports, the latter with `nbd` settings (how
/// long requests wait for a storage server that went away).
#[derive(Debug, Default, Clone)]
pub struct Stores {
    pub nbd: NbdOptions,
}

impl StoreOpener for Stores {
    fn open(&self, name: &str, writable: bool, lock: Option<LockMode>) -> Result<BackendRef> {
        let path = match StoreName::of(name) {
            StoreName::Nbd(uri) => {
                let b = NbdBackend::connect_with(uri, self.nbd)
                    .map_err(|e| ImageError::io(name, "connect", e))?;
                return Ok(Arc::new(b));
            }
            StoreName::Path(path) => path,
        };
        let b = FileBackend::open(
            path,
            FileOptions {
                read_only: !writable,
                lock,
                create: false,
            },
        )?;
        Ok(Arc::new(b))
    }

    fn canonical(&self, name: &str) -> Result<String> {
        let StoreName::Path(path) = StoreName::of(name) else {
            return Ok(name.to_string());
        };
        std::fs::canonicalize(path)
            .map(|p| p.display().to_string())
            .map_err(|e| ImageError::io(name, "open", e))
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        resolve_backing_name(parent, backing)
    }
}

/// Keeps images in memory, by name (tests and in-process replay).
#[derive(Debug, Default)]
pub struct MemFiles {
    files: std::sync::Mutex<std::collections::HashMap<String, Arc<MemBackend>>>,
}

impl MemFiles {
    pub fn new() -> Arc<MemFiles> {
        Arc::new(MemFiles::default())
    }

    /// Adds (or replaces) an image.
    pub fn insert(&self, name: &str, bytes: Vec<u8>) -> Arc<MemBackend> {
        let b = Arc::new(MemBackend::new(name, bytes));
        self.files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), b.clone());
        b
    }

    pub fn get(&self, name: &str) -> Option<Arc<MemBackend>> {
        self.files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    /// Removes an image, handing back its store.
    pub fn remove(&self, name: &str) -> Option<Arc<MemBackend>> {
        self.files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
    }
}

impl StoreOpener for MemFiles {
    fn open(&self, name: &str, _writable: bool, _lock: Option<LockMode>) -> Result<BackendRef> {
        match self.get(name) {
            Some(b) => Ok(b),
            None => Err(ImageError::io(
                name,
                "open",
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )),
        }
    }

    fn canonical(&self, name: &str) -> Result<String> {
        Ok(name.to_string())
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        LocalFiles.resolve(parent, backing)
    }
}

/// How to open a chain.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Format of the top image; `None` probes it (only the top image,
    /// which the user named, is ever probed).
    pub format: Option<ImageFormat>,
    pub cache: MetaCacheConfig,
    pub disk: DiskId,
    /// Do not take image locks (like qemu-img -U).
    pub force_share: bool,
    /// Open only the named image, not its backing chain (for check).
    pub no_backing: bool,
    /// Only look at the chain (info): an image whose newest data is in a
    /// cache this open does not go through is opened anyway (read-only).
    pub inspect: bool,
    /// Open for `check` (see `ImageOptions::for_check`).
    pub for_check: bool,
    pub io: Option<Arc<dyn HostIo>>,
    pub opener: Arc<dyn StoreOpener>,
    /// The writable top image's metadata journal (see `qimage::journal`).
    pub metadata_journal: JournalMode,
    /// With the journal on and no cache below: zeros written ahead of
    /// allocation (see `qimage::prealloc`).
    pub preallocate: bool,
    /// Directories and NBD storage servers (URIs) that backing files and
    /// external data files may lie in besides the top image's own
    /// directory tree and storage server (see `confine`).
    pub allow_backing: Vec<String>,
}

/// Whether a writable qcow2 top image logs its table updates in a
/// per-disk journal, so one guest flush costs one sync of the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum JournalMode {
    /// Tables are written in place, ordered by syncs.
    #[default]
    Off,
    /// Journaled; an image that cannot carry a journal (version 2) is
    /// served without one.
    IfPossible,
    /// Journaled, or the open fails.
    Required,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            format: None,
            cache: MetaCacheConfig::default(),
            disk: DiskId(0),
            force_share: false,
            no_backing: false,
            inspect: false,
            for_check: false,
            io: None,
            opener: Arc::new(LocalFiles),
            metadata_journal: JournalMode::Off,
            preallocate: false,
            allow_backing: Vec::new(),
        }
    }
}

fn probe_is_qcow2(backend: &BackendRef, name: &str) -> Result<bool> {
    let mut magic = [0u8; 4];
    if backend.len().map_err(|e| ImageError::io(name, "stat", e))? < 4 {
        return Ok(false);
    }
    backend
        .read_at(&mut magic, 0)
        .map_err(|e| ImageError::io(name, "probe", e))?;
    Ok(u32::from_be_bytes(magic) == MAGIC)
}

/// Opens `name` and its whole backing chain.
pub fn open_chain(name: &str, opts: &OpenOptions) -> Result<VirtualDisk> {
    let io: Arc<dyn HostIo> = opts
        .io
        .clone()
        .unwrap_or_else(|| DirectIo::new() as Arc<dyn HostIo>);
    let mut layers: Vec<Layer> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut current = name.to_string();
    let mut format = opts.format;
    let mut parent: Option<(String, String)> = None;
    let scope = Confinement::new(
        name,
        &opts.opener.canonical(name)?,
        &opts.allow_backing,
        &*opts.opener,
    );
    loop {
        let depth = layers.len();
        if depth >= MAX_CHAIN_DEPTH {
            return Err(ImageError::ChainTooLong(MAX_CHAIN_DEPTH));
        }
        let opened = open_layer(&current, format, depth, &io, opts, &scope, &mut seen);
        let (layer, next) = match (opened, &parent) {
            (Ok(v), _) => v,
            (Err(e @ ImageError::ChainLoop(_)), _) => return Err(e),
            (Err(e), Some((image, backing))) => {
                return Err(ImageError::BackingMissing {
                    image: image.clone(),
                    backing: backing.clone(),
                    cause: Box::new(e),
                });
            }
            (Err(e), None) => return Err(e),
        };
        let layer_name = layer.name().to_string();
        layers.push(layer);
        let Some((backing, backing_format)) = next.filter(|_| !opts.no_backing) else {
            break;
        };
        if backing.starts_with("json:") {
            return Err(ImageError::Unsupported {
                image: layer_name,
                reason: format!(
                    "backing file name '{backing}' uses QEMU's json: pseudo-protocol, which is not supported (it can name any host file); point it at a file with qemu-img rebase -u"
                ),
            });
        }
        let resolved = scope
            .admit(
                &layer_name,
                "backing file",
                &backing,
                &opts.opener.resolve(&layer_name, &backing),
                &*opts.opener,
            )
            .map_err(|e| match e {
                e @ ImageError::NotAllowed(_) => e,
                e => ImageError::BackingMissing {
                    image: layer_name.clone(),
                    backing: backing.clone(),
                    cause: Box::new(e),
                },
            })?;
        format = match backing_format.as_deref() {
            Some(f) => {
                Some(
                    ImageFormat::parse(f).ok_or_else(|| ImageError::UnsupportedFormat {
                        image: layer_name.clone(),
                        format: f.to_string(),
                    })?,
                )
            }
            None => None,
        };
        if format.is_none() {
            format = Some(probe_backing_without_format(
                &layer_name,
                &backing,
                &resolved,
                opts,
            )?);
        }
        parent = Some((layer_name, backing));
        current = resolved;
    }
    prepare_top(&layers, opts)?;
    VirtualDisk::new(layers, io, opts.disk, opts.read_only)
}

/// A backing file without a recorded format may only be used as raw, and
/// only when it does not look like qcow2 (a raw disk can contain a forged
/// qcow2 header pointing at host files).
fn probe_backing_without_format(
    parent: &str,
    backing: &str,
    resolved: &str,
    opts: &OpenOptions,
) -> Result<ImageFormat> {
    let store =
        opts.opener
            .open(resolved, false, None)
            .map_err(|e| ImageError::BackingMissing {
                image: parent.to_string(),
                backing: backing.to_string(),
                cause: Box::new(e),
            })?;
    if probe_is_qcow2(&store, resolved)? {
        return Err(ImageError::UnsafeProbe {
            image: parent.to_string(),
            backing: backing.to_string(),
        });
    }
    Ok(ImageFormat::Raw)
}

type NextBacking = Option<(String, Option<String>)>;

fn open_layer(
    name: &str,
    format: Option<ImageFormat>,
    depth: usize,
    io: &Arc<dyn HostIo>,
    opts: &OpenOptions,
    scope: &Confinement,
    seen: &mut Vec<String>,
) -> Result<(Layer, NextBacking)> {
    let canonical = opts.opener.canonical(name)?;
    if seen.contains(&canonical) {
        return Err(ImageError::ChainLoop(canonical));
    }
    seen.push(canonical.clone());
    let writable = depth == 0 && !opts.read_only;
    let lock = (!opts.force_share).then_some(if writable {
        LockMode::Write
    } else {
        LockMode::Read
    });
    let backend = opts.opener.open(name, writable, lock)?;
    let handle = ImageHandle {
        name: Arc::from(canonical.as_str()),
        depth: depth as u32,
        backend,
    };
    attach(io, &handle, opts.disk, writable)?;
    let format = match format {
        Some(f) => f,
        None if probe_is_qcow2(&handle.backend, name)? => ImageFormat::Qcow2,
        None => ImageFormat::Raw,
    };
    if format == ImageFormat::Raw {
        // Whole sectors, as QEMU sees a raw file: a partial last sector
        // reads as zeros past the end of the file.
        let size = io
            .len(&handle)
            .map_err(|e| ImageError::io(name, "stat", e))?
            .next_multiple_of(crate::SECTOR);
        return Ok((Layer::Raw(RawImage { handle, size }), None));
    }
    let (header, _) = qimage::read_header(&handle, &**io, opts.disk)?;
    let data_file = data_file_name(&header, &canonical, opts, scope)?;
    let data = external_data(data_file, depth, writable, lock, io, opts)?;
    let (header, replayed) = if opts.inspect {
        (header, 0)
    } else {
        qimage::recover_journal(&handle, data.as_ref(), &**io, header, writable, opts.disk)?
    };
    let next = header
        .backing_file
        .clone()
        .map(|b| (b, header.extensions.backing_format.clone()));
    let img = Qcow2Image::open(
        handle,
        data,
        io.clone(),
        header,
        ImageOptions {
            read_only: !writable,
            cache: journal_slices(opts, writable),
            disk: opts.disk,
            for_check: opts.for_check,
        },
    )?;
    img.check_cache_mark(opts.inspect && !writable)?;
    img.journal_replayed
        .store(replayed, std::sync::atomic::Ordering::SeqCst);
    Ok((Layer::Qcow2(Box::new(img)), next))
}

/// A journaled image's metadata cache works in 4 KiB slices unless told
/// otherwise: a record holds whole dirty slices, and a whole-table slice
/// would log a cluster of table for one 8-byte entry.
fn journal_slices(opts: &OpenOptions, writable: bool) -> MetaCacheConfig {
    let mut cache = opts.cache;
    if writable && opts.metadata_journal != JournalMode::Off && cache.slice_bytes.is_none() {
        cache.slice_bytes = Some(JOURNAL_SLICE);
    }
    cache
}

/// Metadata cache slice of a journaled image (see [`journal_slices`]).
const JOURNAL_SLICE: u64 = 4096;

/// The canonical name of the external data file a header names, kept
/// where its backing files may lie; `None` without one.
fn data_file_name(
    header: &vdcache_qcow2::Header,
    canonical: &str,
    opts: &OpenOptions,
    scope: &Confinement,
) -> Result<Option<String>> {
    match (
        &header.extensions.external_data_file,
        header.has_external_data_file(),
    ) {
        (Some(file), true) => scope
            .admit(
                canonical,
                "external data file",
                file,
                &opts.opener.resolve(canonical, file),
                &*opts.opener,
            )
            .map(Some),
        (None, true) => Err(ImageError::Unsupported {
            image: canonical.to_string(),
            reason: "external data file feature is set but the header names no data file".into(),
        }),
        _ => Ok(None),
    }
}

/// The external data file `path` of an image, opened like its image.
fn external_data(
    path: Option<String>,
    depth: usize,
    writable: bool,
    lock: Option<LockMode>,
    io: &Arc<dyn HostIo>,
    opts: &OpenOptions,
) -> Result<Option<ImageHandle>> {
    let Some(path) = path else { return Ok(None) };
    let backend = opts.opener.open(&path, writable, lock)?;
    let data = ImageHandle {
        name: Arc::from(path.as_str()),
        depth: depth as u32,
        backend,
    };
    attach(io, &data, opts.disk, writable)?;
    Ok(Some(data))
}

/// Once the whole chain opened (nothing is written to an image whose chain
/// is refused): the writable top image is stamped for the cache below,
/// repaired if a crash left it dirty, and readied for writes.
fn prepare_top(layers: &[Layer], opts: &OpenOptions) -> Result<()> {
    let Some(Layer::Qcow2(img)) = layers.first() else {
        return Ok(());
    };
    if opts.read_only {
        return Ok(());
    }
    if !opts.for_check {
        let crashed = img.is_dirty();
        img.stamp_for_holder()?;
        if crashed {
            // A session through a cache keeps the bit until its clean close.
            img.repair_dirty(img.is_stamped())?;
        }
        match opts.metadata_journal {
            JournalMode::Off => img.drop_leftover_journal()?,
            JournalMode::IfPossible => img.start_journal(false, opts.preallocate)?,
            JournalMode::Required => img.start_journal(true, opts.preallocate)?,
        }
    }
    img.prepare_for_writes()
}

/// Tells the layer below which file `handle` is, before it serves any
/// copy it kept of it.
fn attach(io: &Arc<dyn HostIo>, handle: &ImageHandle, disk: DiskId, writable: bool) -> Result<()> {
    if io.copies().holder().is_none() {
        return Ok(());
    }
    let identity = read_identity(handle, writable)
        .map_err(|e| ImageError::io(&handle.name, "read its identity", e))?;
    io.copies()
        .attach(handle, disk, &identity)
        .map_err(|e| ImageError::io(&handle.name, "check it against the cache", e))
}
