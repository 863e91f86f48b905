//! The flash cache under crash test: a [`Qcow2Target`]'s images plus a
//! cache device, all recorded. The workload runs through the cache (with
//! some guest reopens also restarting the cache, keeping its dirty data).
//! Recovery after a crash is the production recovery (`vdcache-host`):
//! the device opened as serve opens it (fast recovery), whose reads must
//! equal, byte for byte, the images after full recovery as `vdcache
//! recover --full` runs it (partially valid clusters filled, every dirty
//! block written back, nothing left dirty or partial in the cache); the
//! harness then checks those standalone images.
//!
//! This module only wires the cache and its recovery into the harness
//! and checks what they leave; it must not recover anything itself, nor
//! relax any check.

use crate::check::first_difference;
use crate::error::BoxError;
use crate::target::{CrashTarget, Qcow2Target, RecordingFiles, mem_files};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use vdcache_backend::BackendRef;
use vdcache_backend::inject::HookedBackend;
use vdcache_backend::recording::CrashState;
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_host::FullRecovery;
use vdcache_image::chain::StoreOpener;
use vdcache_image::{DiskId, HostIo, ImageFormat, MemFiles, OpenOptions, VirtualDisk, open_chain};

/// Opens raw image `name` as disk 1 through `cache`: for tests that drive
/// a cache over recorded devices step by step, without a workload.
pub fn open_raw_through(
    opener: Arc<dyn StoreOpener>,
    cache: &Arc<FlashCache>,
    name: &str,
) -> Result<VirtualDisk, BoxError> {
    open_raw_disk(opener, cache, name, DiskId(1))
}

/// Opens raw image `name` as disk `disk` through `cache` (tests with more
/// than one disk on a cache).
pub fn open_raw_disk(
    opener: Arc<dyn StoreOpener>,
    cache: &Arc<FlashCache>,
    name: &str,
    disk: DiskId,
) -> Result<VirtualDisk, BoxError> {
    let io: Arc<dyn HostIo> = cache.clone();
    Ok(open_chain(
        name,
        &OpenOptions {
            opener,
            io: Some(io),
            disk,
            format: Some(ImageFormat::Raw),
            ..OpenOptions::default()
        },
    )?)
}

/// Name of the cache device among the recorded devices.
pub const CACHE_DEVICE: &str = "cache.dev";

/// Writes to the cache device that fail with ENOSPC during a live run, as
/// when the file system holding a cache file fills up and space returns:
/// `calls` write calls from the `first` (counted from 0 over the run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullDevice {
    pub first: u64,
    pub calls: u64,
}

/// Images of a [`Qcow2Target`] served through a flash cache.
pub struct CacheTarget {
    pub images: Qcow2Target,
    pub config: CacheConfig,
    pub device_bytes: usize,
    /// Device writes that fail in the live run (the workload then needs
    /// [`crate::WorkloadConfig::retries`]).
    pub full: Option<FullDevice>,
    /// The cache the live workload runs through, and how often it was opened.
    live: Mutex<(Option<Arc<FlashCache>>, u32)>,
    /// Write calls to the cache device in the live run so far.
    device_writes: Arc<AtomicU64>,
}

impl CacheTarget {
    pub fn new(images: Qcow2Target, config: CacheConfig, device_bytes: usize) -> CacheTarget {
        CacheTarget {
            images,
            config,
            device_bytes,
            full: None,
            live: Mutex::new((None, 0)),
            device_writes: Arc::default(),
        }
    }

    /// The same target with device writes failing as `full` says.
    pub fn with_full_device(self, full: FullDevice) -> CacheTarget {
        CacheTarget {
            full: Some(full),
            ..self
        }
    }

    /// Write calls the cache device took in the last live run (failed
    /// ones included): where a [`FullDevice`] window can start.
    pub fn device_writes(&self) -> u64 {
        self.device_writes.load(Ordering::SeqCst)
    }

    /// The recorded cache device, as the live run sees it: its writes are
    /// counted, and fail with ENOSPC inside the [`FullDevice`] window.
    fn live_device(&self, files: &RecordingFiles) -> Result<BackendRef, BoxError> {
        let dev: BackendRef = files.get(CACHE_DEVICE).ok_or("no cache device")?;
        let (writes, full) = (self.device_writes.clone(), self.full);
        Ok(Arc::new(HookedBackend::new(dev).on_write(move || {
            let n = writes.fetch_add(1, Ordering::SeqCst);
            match full {
                Some(f) if (f.first..f.first + f.calls).contains(&n) => {
                    Err(std::io::Error::from_raw_os_error(28))
                }
                _ => Ok(()),
            }
        })))
    }

    /// What the cache the live workload ran through reports (none before
    /// a run): for tests that check the workload exercised a mechanism.
    pub fn live_report(&self) -> Option<vdcache_cache::CacheReport> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.0.as_ref().map(|c| c.report())
    }

    /// Opens the images' chain through `cache`, as the guest continues on
    /// this host after a crash.
    pub(crate) fn open_through(
        &self,
        files: Arc<MemFiles>,
        cache: Arc<FlashCache>,
    ) -> Result<VirtualDisk, BoxError> {
        Ok(open_chain(
            Qcow2Target::TOP,
            &self.options(files, Some(cache)),
        )?)
    }

    fn options(&self, opener: Arc<dyn StoreOpener>, io: Option<Arc<dyn HostIo>>) -> OpenOptions {
        OpenOptions {
            format: Some(ImageFormat::Qcow2),
            cache: self.images.cache,
            opener,
            io,
            disk: DiskId(1),
            metadata_journal: self.images.journal,
            ..OpenOptions::default()
        }
    }
}

impl CrashTarget for CacheTarget {
    fn label(&self) -> String {
        let p = self.config.default_policy;
        format!(
            "{} through a {} KiB cache ({}, {}, {}, {}{})",
            self.images.label(),
            self.device_bytes >> 10,
            p.cow.name(),
            p.mode.name(),
            p.admission.name(),
            self.config.replacement.name(),
            if self.config.test_index_before_data {
                ", index before data"
            } else if self.config.test_open_past_bad_checkpoint {
                ", opening past a bad checkpoint"
            } else {
                ""
            }
        )
    }

    fn create(&self, files: &Arc<RecordingFiles>) -> Result<(), BoxError> {
        // A new run: the cache of an earlier run (other devices) is done.
        let old = std::mem::take(&mut *self.live.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(c) = old.0 {
            c.shutdown(true)?;
        }
        self.images.create(files)?;
        self.device_writes.store(0, Ordering::SeqCst);
        let dev: BackendRef = files.insert_fixed(CACHE_DEVICE, self.device_bytes);
        let cache = FlashCache::format(dev, self.config.clone())?;
        cache.shutdown(true)?;
        Ok(())
    }

    fn open(&self, files: &Arc<RecordingFiles>) -> Result<Arc<VirtualDisk>, BoxError> {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        // Every other reopen also restarts the cache (a fast restart that
        // keeps dirty data in flash).
        if live.1 % 2 == 1
            && let Some(c) = live.0.take()
        {
            c.shutdown(true)?;
        }
        live.1 += 1;
        let cache = match &live.0 {
            Some(c) => c.clone(),
            None => {
                let c = FlashCache::open(self.live_device(files)?, self.config.clone())?;
                live.0 = Some(c.clone());
                c
            }
        };
        let opener: Arc<dyn StoreOpener> = files.clone();
        Ok(self.images.serving(open_chain(
            Qcow2Target::TOP,
            &self.options(opener, Some(cache)),
        )?))
    }

    fn recover(&self, state: &CrashState) -> Result<VirtualDisk, BoxError> {
        self.recover_from(state, mem_files(state))
    }

    fn recover_from(
        &self,
        _state: &CrashState,
        files: Arc<MemFiles>,
    ) -> Result<VirtualDisk, BoxError> {
        let dev: BackendRef = files
            .get(CACHE_DEVICE)
            .ok_or("crash state has no cache device")?;
        // The device opened as serve opens it: fast recovery (a crash
        // while the cache was being formatted leaves no cache, and serve
        // formats it again).
        let cache = vdcache_host::open_for_serving(dev.clone(), self.config.clone(), false)?;
        // What the guest sees when it continues on this host.
        let fast = open_chain(
            Qcow2Target::TOP,
            &self.options(files.clone(), Some(cache.clone())),
        )?;
        let mut seen = vec![0u8; fast.size() as usize];
        fast.read(0, &mut seen)?;
        // The server stops keeping its dirty data in flash; the operator
        // then runs `vdcache recover --full`: partially valid clusters
        // filled from the backing chain, every dirty block and metadata
        // sector back to the images, marks cleared, leaks repaired.
        fast.close_keeping_cached()?;
        drop(fast);
        cache.shutdown(true)?;
        drop(cache);
        let recovery = FullRecovery {
            salvage: false,
            host: self.config.host.clone(),
            opener: files.clone(),
            ..FullRecovery::default()
        };
        vdcache_host::recover_full(dev.clone(), CACHE_DEVICE, &recovery)
            .map_err(|e| vdcache_host::error::chain(&e))?;
        check_emptied(dev, &recovery)?;
        let standalone = open_chain(Qcow2Target::TOP, &self.options(files, None))?;
        let mut alone = vec![0u8; standalone.size() as usize];
        standalone.read(0, &mut alone)?;
        if let Some(at) = first_difference(&seen, &alone) {
            return Err(format!(
                "fast recovery read {:#04x} at guest offset {at}, the images after full recovery {:#04x}",
                seen[at], alone[at]
            )
            .into());
        }
        Ok(standalone)
    }
}

/// After full recovery the cache holds nothing the images lack: no dirty
/// block or metadata sector, no partially valid cluster.
fn check_emptied(dev: BackendRef, recovery: &FullRecovery) -> Result<(), BoxError> {
    let cache = FlashCache::open(
        dev,
        CacheConfig {
            force_foreign: true,
            host: recovery.host.clone(),
            ..CacheConfig::default()
        },
    )?;
    let dirty: Vec<(String, u64)> = cache
        .images()
        .into_iter()
        .filter(|(_, bytes)| *bytes > 0)
        .collect();
    let partial = cache.partial_images();
    // Keeping what it holds: a stop must not write anything to the images.
    cache.shutdown(true)?;
    if !dirty.is_empty() {
        return Err(
            format!("dirty data remains in the cache after full recovery: {dirty:?}").into(),
        );
    }
    if !partial.is_empty() {
        return Err(format!("partially valid clusters remain in {partial:?}").into());
    }
    Ok(())
}
