//! What the harness tests: a [`CrashTarget`] creates its devices on a
//! recording log, opens the disk the workload runs on, and recovers a disk
//! from a crash state. [`Qcow2Target`] is the plain qcow2 engine (recovery
//! = opening the chain read-write, which repairs lazy refcounts); the flash
//! cache plugs in as another target (its cache device is one more
//! recording device).
//!
//! This module owns device setup and the default recovery. It must not
//! judge results (that is `check.rs`) and must not write devices behind
//! the target's back.

use crate::error::BoxError;
use crate::interrupted::DiesAfter;
use crate::rng::{Rng, SeedableRng};
use rand::Rng as _;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use vdcache_backend::recording::{CrashState, Log, RecordingBackend};
use vdcache_backend::{BackendRef, LockMode};
use vdcache_image::chain::StoreOpener;
use vdcache_image::{
    CreateOptions, HostIo, ImageError, ImageFormat, JournalMode, MemFiles, MetaCacheConfig,
    OpenOptions, VirtualDisk, open_chain, qcow2_image_bytes,
};

/// A system under crash test.
pub trait CrashTarget: Send + Sync {
    /// A short name for reports (configuration included).
    fn label(&self) -> String;
    /// Creates every device (images, cache device) in `files`, with its
    /// initial, durable contents.
    fn create(&self, files: &Arc<RecordingFiles>) -> Result<(), BoxError>;
    /// Opens the disk the workload runs on, over the recording devices.
    /// Called again after a guest reopen.
    fn open(&self, files: &Arc<RecordingFiles>) -> Result<Arc<VirtualDisk>, BoxError>;
    /// Recovers a disk from the devices a crash left (fresh stores built
    /// from `state`; see [`mem_files`]).
    fn recover(&self, state: &CrashState) -> Result<VirtualDisk, BoxError>;
    /// [`Self::recover`] from `files`, stores holding what
    /// [`mem_files`]`(state)` would: what the harness calls, with stores it
    /// builds in buffers reused from state to state (a fresh copy of every
    /// device image per state was most of a state's cost). A target that
    /// recovers from [`mem_files`] recovers from `files` here; the default
    /// ignores them.
    fn recover_from(
        &self,
        state: &CrashState,
        files: Arc<MemFiles>,
    ) -> Result<VirtualDisk, BoxError> {
        drop(files);
        self.recover(state)
    }
}

/// Recording devices by name, usable as a chain's [`StoreOpener`]; a
/// device can be moved to a store elsewhere ([`Self::serve_from`]), which
/// opens then reach instead.
#[derive(Debug)]
pub struct RecordingFiles {
    log: Arc<Log>,
    map: Mutex<HashMap<String, Arc<RecordingBackend>>>,
    elsewhere: Mutex<HashMap<String, BackendRef>>,
}

impl RecordingFiles {
    pub fn new(log: &Arc<Log>) -> Arc<RecordingFiles> {
        Arc::new(RecordingFiles {
            log: log.clone(),
            map: Mutex::new(HashMap::new()),
            elsewhere: Mutex::new(HashMap::new()),
        })
    }

    /// The names of the recording devices.
    pub fn names(&self) -> Vec<String> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.keys().cloned().collect()
    }

    /// Opens of `name` reach `store` from now on (a storage server's copy
    /// of the device), not the recording device.
    pub fn serve_from(&self, name: &str, store: BackendRef) {
        self.elsewhere
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), store);
    }

    pub fn log(&self) -> &Arc<Log> {
        &self.log
    }

    /// Registers a growable device (an image file) with initial contents.
    pub fn insert(&self, name: &str, bytes: Vec<u8>) -> Arc<RecordingBackend> {
        self.add(
            name,
            Arc::new(RecordingBackend::new(&self.log, name, bytes)),
        )
    }

    /// Registers a fixed-size zeroed device (a cache partition).
    pub fn insert_fixed(&self, name: &str, len: usize) -> Arc<RecordingBackend> {
        self.add(
            name,
            Arc::new(RecordingBackend::fixed(&self.log, name, len)),
        )
    }

    fn add(&self, name: &str, b: Arc<RecordingBackend>) -> Arc<RecordingBackend> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), b.clone());
        b
    }

    pub fn get(&self, name: &str) -> Option<Arc<RecordingBackend>> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }
}

impl StoreOpener for RecordingFiles {
    fn open(
        &self,
        name: &str,
        _writable: bool,
        _lock: Option<LockMode>,
    ) -> vdcache_image::Result<BackendRef> {
        let moved = self
            .elsewhere
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned();
        if let Some(store) = moved {
            return Ok(store);
        }
        match self.get(name) {
            Some(b) => Ok(b),
            None => Err(ImageError::Io {
                image: name.to_string(),
                op: "open",
                cause: std::io::Error::from(std::io::ErrorKind::NotFound).into(),
            }),
        }
    }

    fn canonical(&self, name: &str) -> vdcache_image::Result<String> {
        Ok(name.to_string())
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        vdcache_image::LocalFiles.resolve(parent, backing)
    }
}

/// In-memory stores holding a crash state's devices, by device name (for
/// recovery functions that open a chain with [`OpenOptions::opener`]).
pub fn mem_files(state: &CrashState) -> Arc<MemFiles> {
    let files = MemFiles::new();
    for d in &state.devices {
        files.insert(&d.name, d.data.clone());
    }
    files
}

/// What the top image of a [`Qcow2Target`] sits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    None,
    /// A raw base 64 KiB shorter than the disk (its tail reads zeros),
    /// every sector distinct.
    Raw,
    /// A qcow2 base with three quarters of its clusters written (distinct
    /// sectors) and the rest unallocated.
    Qcow2,
}

/// Wraps the [`HostIo`] of the workload's opens (fault injection).
pub type IoFactory = Arc<dyn Fn() -> Arc<dyn HostIo> + Send + Sync>;

/// The plain qcow2 engine: a top image (optionally over a base) on
/// recording devices; recovery opens the chain read-write.
#[derive(Clone)]
pub struct Qcow2Target {
    pub label: String,
    pub size: u64,
    /// Options of the top image (`backing` is set from [`Self::backing`]).
    pub create: CreateOptions,
    pub backing: Backing,
    pub cache: MetaCacheConfig,
    /// HostIo for the workload's opens; `None` is the engine's direct I/O.
    /// Recovery always uses direct I/O.
    pub io: Option<IoFactory>,
    /// The top image's metadata journal (workload and recovery opens).
    pub journal: JournalMode,
    /// Recovery is first killed after a few changes (how many varies with
    /// the crash point), then run again over what it left.
    pub interrupted_recovery: bool,
    /// The workload's disk leaves every allocating write it can to its
    /// workers (deferred copy-on-write, as serving does in a stream).
    pub deferred_cow: bool,
}

impl std::fmt::Debug for Qcow2Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Target")
            .field("label", &self.label)
            .field("size", &self.size)
            .field("create", &self.create)
            .field("backing", &self.backing)
            .field("cache", &self.cache)
            .field("io", &self.io.is_some())
            .field("journal", &self.journal)
            .field("interrupted_recovery", &self.interrupted_recovery)
            .field("deferred_cow", &self.deferred_cow)
            .finish()
    }
}

impl Qcow2Target {
    /// Name of the top image.
    pub const TOP: &'static str = "dir/top.qcow2";
    pub const RAW_BASE: &'static str = "dir/base.raw";
    pub const QCOW2_BASE: &'static str = "dir/base.qcow2";

    pub fn new(label: impl Into<String>, size: u64, create: CreateOptions) -> Qcow2Target {
        Qcow2Target {
            label: label.into(),
            size,
            create,
            backing: Backing::None,
            cache: MetaCacheConfig::default(),
            io: None,
            journal: JournalMode::Off,
            interrupted_recovery: false,
            deferred_cow: false,
        }
    }

    /// Defers every allocating write the disk can ([`Self::deferred_cow`]).
    pub fn with_deferred_cow(mut self) -> Self {
        self.deferred_cow = true;
        self
    }

    /// `disk`, deferring copy-on-write if asked to.
    pub(crate) fn serving(&self, disk: VirtualDisk) -> Arc<VirtualDisk> {
        let disk = Arc::new(disk);
        if self.deferred_cow {
            disk.defer_cow_writes(0);
        }
        disk
    }

    /// Kills each recovery once in mid-flight before recovering again
    /// ([`crate::interrupted`]).
    pub fn with_interrupted_recovery(mut self) -> Self {
        self.interrupted_recovery = true;
        self
    }

    /// Serves the top image with its metadata journal.
    pub fn with_journal(mut self, journal: JournalMode) -> Self {
        self.journal = journal;
        self
    }

    pub fn with_backing(mut self, backing: Backing) -> Self {
        self.backing = backing;
        self
    }

    pub fn with_cache(mut self, cache: MetaCacheConfig) -> Self {
        self.cache = cache;
        self
    }

    pub fn with_io(mut self, io: IoFactory) -> Self {
        self.io = Some(io);
        self
    }

    fn options(&self, opener: Arc<dyn StoreOpener>, io: Option<Arc<dyn HostIo>>) -> OpenOptions {
        OpenOptions {
            format: Some(ImageFormat::Qcow2),
            cache: self.cache,
            opener,
            io,
            metadata_journal: self.journal,
            // Preallocation is part of what the journal's sweeps cover.
            preallocate: self.journal != JournalMode::Off,
            ..OpenOptions::default()
        }
    }
}

/// Distinct, deterministic content for every sector of a base image.
fn base_pattern(len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    for (i, sector) in v.chunks_mut(512).enumerate() {
        Rng::seed_from_u64(0xba5e_0000 + i as u64).fill_bytes(sector);
    }
    v
}

fn qcow2_base(size: u64) -> Result<Vec<u8>, BoxError> {
    let opts = CreateOptions {
        cluster_size: 65536,
        ..CreateOptions::default()
    };
    let files = MemFiles::new();
    files.insert("base", qcow2_image_bytes(Path::new("base"), &opts, size)?);
    let disk = open_chain(
        "base",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            ..OpenOptions::default()
        },
    )?;
    let pattern = base_pattern(size);
    let cs = opts.cluster_size;
    for c in 0..size / cs {
        if c % 4 != 3 {
            let at = (c * cs) as usize;
            disk.write(c * cs, &pattern[at..at + cs as usize], false)?;
        }
    }
    disk.close()?;
    drop(disk);
    Ok(files.get("base").ok_or("base image vanished")?.snapshot())
}

impl CrashTarget for Qcow2Target {
    fn label(&self) -> String {
        let c = &self.create;
        format!(
            "{} (qcow2 v{} cluster {} refcount_bits {}{}{}{}{}{}, size {}, l2 cache {} slice {:?})",
            self.label,
            c.version,
            c.cluster_size,
            c.refcount_bits,
            if c.extended_l2 { " extended_l2" } else { "" },
            if c.lazy_refcounts {
                " lazy_refcounts"
            } else {
                ""
            },
            match self.backing {
                Backing::None => "",
                Backing::Raw => " over raw",
                Backing::Qcow2 => " over qcow2",
            },
            match (self.journal, self.interrupted_recovery) {
                (JournalMode::Off, false) => "",
                (JournalMode::Off, true) => " interrupted recovery",
                (_, false) => " metadata journal",
                (_, true) => " metadata journal, interrupted recovery",
            },
            if self.deferred_cow {
                ", deferred copy-on-write"
            } else {
                ""
            },
            self.size,
            self.cache.l2_bytes,
            self.cache.slice_bytes,
        )
    }

    fn create(&self, files: &Arc<RecordingFiles>) -> Result<(), BoxError> {
        let mut opts = self.create.clone();
        opts.size = Some(self.size);
        opts.backing = match self.backing {
            Backing::None => None,
            Backing::Raw => {
                let len = self.size.saturating_sub(65536);
                files.insert(Self::RAW_BASE, base_pattern(len));
                Some(("base.raw".into(), ImageFormat::Raw))
            }
            Backing::Qcow2 => {
                files.insert(Self::QCOW2_BASE, qcow2_base(self.size)?);
                Some(("base.qcow2".into(), ImageFormat::Qcow2))
            }
        };
        let bytes = qcow2_image_bytes(Path::new(Self::TOP), &opts, self.size)?;
        files.insert(Self::TOP, bytes);
        Ok(())
    }

    fn open(&self, files: &Arc<RecordingFiles>) -> Result<Arc<VirtualDisk>, BoxError> {
        let opener: Arc<dyn StoreOpener> = files.clone();
        let io = self.io.as_ref().map(|f| f());
        Ok(self.serving(open_chain(Self::TOP, &self.options(opener, io))?))
    }

    fn recover(&self, state: &CrashState) -> Result<VirtualDisk, BoxError> {
        self.recover_from(state, mem_files(state))
    }

    /// A writable open replays what a crash left in a metadata journal
    /// whatever its mode; recovery opens as `vdcache recover` does (the
    /// journal applied, then dropped), so checks see a plain image.
    fn recover_from(
        &self,
        state: &CrashState,
        files: Arc<MemFiles>,
    ) -> Result<VirtualDisk, BoxError> {
        let recovery = |io: Option<Arc<dyn HostIo>>| {
            open_chain(
                Self::TOP,
                &OpenOptions {
                    metadata_journal: JournalMode::Off,
                    ..self.options(files.clone(), io)
                },
            )
        };
        if self.interrupted_recovery {
            let changes = 1 + state.point % 7;
            // Whatever the killed recovery did or failed to do, the next
            // one must cope: its error (or disk) is dropped unseen.
            drop(recovery(Some(Arc::new(DiesAfter::new(changes)))));
        }
        Ok(recovery(None)?)
    }
}

/// A target whose recovery is a closure, everything else from `inner`:
/// e.g. "recover the flash cache, then open the chain through it".
pub struct WithRecovery<T, F> {
    pub inner: T,
    pub recover: F,
}

impl<T, F, E> CrashTarget for WithRecovery<T, F>
where
    T: CrashTarget,
    F: Fn(&CrashState) -> Result<VirtualDisk, E> + Send + Sync,
    E: Into<BoxError>,
{
    fn label(&self) -> String {
        format!("{} (custom recovery)", self.inner.label())
    }

    fn create(&self, files: &Arc<RecordingFiles>) -> Result<(), BoxError> {
        self.inner.create(files)
    }

    fn open(&self, files: &Arc<RecordingFiles>) -> Result<Arc<VirtualDisk>, BoxError> {
        self.inner.open(files)
    }

    fn recover(&self, state: &CrashState) -> Result<VirtualDisk, BoxError> {
        (self.recover)(state).map_err(Into::into)
    }
}
