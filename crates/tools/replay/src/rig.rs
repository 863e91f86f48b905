//! The replay rig: the real COW layer and flash tier, in-process, over
//! in-memory stores. Each disk of the trace becomes a raw image (`raw`) or
//! a qcow2 delta over a full raw base (`qcow2`, the guest disk of COWCache
//! section 5.3); one cache device, seen through an FTL model, serves them
//! all. Write-back runs inline, so a replay is deterministic. With
//! dedup on, the content of what a trace reads matters: the rig keeps each
//! disk's bottom store at hand for the replay to seed (see `seed`).

use crate::files::ReplayFiles;
use crate::ftl_device::FtlDevice;
use crate::meter::{Meter, MeteredStore};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use thiserror::Error;
use vdcache_backend::{BackendRef, HoleFill, SparseStore};
use vdcache_cache::layout::{BLOCK, Layout};
use vdcache_cache::{CacheConfig, CacheError, Dedup, DiskPolicy, FlashCache, Replacement};
use vdcache_eval::cost::DeviceProfile;
use vdcache_eval::ftl::{FtlConfig, FtlError};
use vdcache_image::{
    CreateOptions, DiskId, HostIo, ImageError, ImageFormat, MetaCacheConfig, OpenOptions,
    VirtualDisk, open_chain, qcow2_image_bytes,
};

/// How each trace disk is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskLayout {
    /// A plain block device (raw image).
    Raw,
    /// A qcow2 delta over a full raw base image.
    Qcow2,
}

impl std::str::FromStr for DiskLayout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "raw" => Ok(DiskLayout::Raw),
            "qcow2" => Ok(DiskLayout::Qcow2),
            _ => Err(format!("unknown layout '{s}' (raw, qcow2)")),
        }
    }
}

impl DiskLayout {
    pub fn name(self) -> &'static str {
        match self {
            DiskLayout::Raw => "raw",
            DiskLayout::Qcow2 => "qcow2",
        }
    }
}

/// Everything a replay is configured with.
#[derive(Debug, Clone)]
pub struct RigConfig {
    pub layout: DiskLayout,
    /// Bytes of cached data (the data zone); 0 replays without a cache.
    pub cache_bytes: u64,
    pub region_bytes: u64,
    pub replacement: Replacement,
    pub policy: DiskPolicy,
    pub cluster_size: u64,
    /// Memory for L2 slices of each qcow2 disk; `None` keeps the default.
    pub l2_cache_bytes: Option<u64>,
    pub flash: DeviceProfile,
    pub backend: DeviceProfile,
    /// Spare capacity of the modelled SSD.
    pub over_provisioning: f64,
    /// Deduplication of the blocks entering flash.
    pub dedup: Dedup,
}

impl Default for RigConfig {
    fn default() -> Self {
        RigConfig {
            layout: DiskLayout::Raw,
            cache_bytes: 1 << 30,
            region_bytes: vdcache_cache::layout::DEFAULT_REGION,
            replacement: Replacement::Lru,
            policy: DiskPolicy::default(),
            cluster_size: 65536,
            l2_cache_bytes: None,
            flash: DeviceProfile::NVME,
            backend: DeviceProfile::NETWORK,
            over_provisioning: 0.07,
            dedup: Dedup::Off,
        }
    }
}

#[derive(Debug, Error)]
pub enum RigError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Ftl(#[from] FtlError),
    #[error("{0}")]
    Config(String),
}

/// The flash tier of a rig.
pub struct CacheRig {
    pub cache: Arc<FlashCache>,
    pub ftl: Arc<FtlDevice>,
    /// Blocks the cache holds when full: an LRU of this capacity over 4 KiB
    /// blocks evicts as the cache does with one-block regions.
    pub capacity_blocks: u64,
}

/// A replay's disks and cache.
pub struct Rig {
    pub config: RigConfig,
    files: Arc<ReplayFiles>,
    pub cache: Option<CacheRig>,
    pub flash_meter: Arc<Meter>,
    pub backend_meter: Arc<Meter>,
    /// Trace disk number -> (open disk, delta generation).
    disks: BTreeMap<u32, (VirtualDisk, u32)>,
    sizes: BTreeMap<u32, u64>,
    /// Trace disk number -> the store at the bottom of its chain (the raw
    /// image, or the qcow2 deltas' raw base), unmetered.
    bottoms: BTreeMap<u32, Arc<SparseStore>>,
}

/// The smallest cache device whose data zone holds `data_bytes` (formatted
/// for dedup or not).
pub fn device_bytes_for(data_bytes: u64, region_bytes: u64, dedup: bool) -> Result<u64, RigError> {
    let want = data_bytes.div_ceil(region_bytes).max(1) * region_bytes;
    let mut device = want.max(vdcache_cache::layout::MIN_DEVICE);
    for _ in 0..64 {
        let l = Layout::compute_for(device, region_bytes, dedup)?;
        let have = l.cacheable_blocks() * BLOCK;
        if have >= want {
            return Ok(device);
        }
        device += (want - have).div_ceil(region_bytes) * region_bytes;
    }
    Err(RigError::Config(format!(
        "no cache device layout holds {data_bytes} bytes of data"
    )))
}

impl Rig {
    /// Builds the cache (if any) and one disk per entry of `sizes`
    /// (trace disk number -> bytes the trace addresses).
    pub fn new(config: RigConfig, sizes: &BTreeMap<u32, u64>) -> Result<Rig, RigError> {
        let flash_meter = Meter::new(config.flash);
        let backend_meter = Meter::new(config.backend);
        let mut config = config;
        let cache = if config.cache_bytes > 0 {
            let c = build_cache(&config, &flash_meter)?;
            // The data zone is whole regions, and never below what the
            // smallest device holds: report what was really built.
            config.cache_bytes = c.cache.layout().cacheable_blocks() * BLOCK;
            Some(c)
        } else {
            None
        };
        let mut rig = Rig {
            files: ReplayFiles::new(),
            cache,
            flash_meter,
            backend_meter,
            disks: BTreeMap::new(),
            sizes: BTreeMap::new(),
            bottoms: BTreeMap::new(),
            config,
        };
        for (&n, &bytes) in sizes {
            let size = bytes.max(1).div_ceil(rig.config.cluster_size) * rig.config.cluster_size;
            rig.sizes.insert(n, size);
            rig.create_disk(n, size)?;
        }
        Ok(rig)
    }

    fn io(&self) -> Option<Arc<dyn HostIo>> {
        self.cache
            .as_ref()
            .map(|c| c.cache.clone() as Arc<dyn HostIo>)
    }

    fn metered(&self, store: Arc<SparseStore>) -> BackendRef {
        MeteredStore::new(store, &self.backend_meter)
    }

    fn create_disk(&mut self, n: u32, size: u64) -> Result<(), RigError> {
        let (disk, bottom) = match self.config.layout {
            DiskLayout::Raw => {
                let name = format!("disk{n}.raw");
                let store = Arc::new(SparseStore::new(&name, size, false, HoleFill::Zeros));
                self.files.insert(&name, self.metered(store.clone()));
                (self.open(&name, n, ImageFormat::Raw)?, store)
            }
            DiskLayout::Qcow2 => {
                let base = format!("base{n}.raw");
                let store = Arc::new(SparseStore::new(
                    &base,
                    size,
                    false,
                    HoleFill::OffsetPattern,
                ));
                self.files.insert(&base, self.metered(store.clone()));
                (self.new_delta(n, 0, (base, ImageFormat::Raw))?, store)
            }
        };
        self.disks.insert(n, (disk, 0));
        self.bottoms.insert(n, bottom);
        Ok(())
    }

    /// Writes `data` at guest offset `offset` of disk `n`'s bottom store
    /// (the raw image, or the raw base under the qcow2 deltas), beneath the
    /// COW layer and the cache and outside the meters: what the disk held
    /// before the trace began. Only for blocks the replay has not written
    /// (the cache may hold those, and the deltas may hide the base).
    pub fn seed(&self, n: u32, offset: u64, data: &[u8]) -> Result<(), RigError> {
        let Some(store) = self.bottoms.get(&n) else {
            return Ok(());
        };
        vdcache_backend::Backend::write_at(store.as_ref(), data, offset).map_err(|cause| {
            RigError::Image(ImageError::Io {
                image: vdcache_backend::Backend::name(store.as_ref()).to_string(),
                op: "seed",
                cause: cause.into(),
            })
        })
    }

    /// Creates delta `generation` of disk `n` over `backing` and opens it.
    fn new_delta(
        &self,
        n: u32,
        generation: u32,
        backing: (String, ImageFormat),
    ) -> Result<VirtualDisk, RigError> {
        let size = self.sizes.get(&n).copied().unwrap_or(0);
        let name = format!("delta{n}.{generation}.qcow2");
        let opts = CreateOptions {
            size: Some(size),
            cluster_size: self.config.cluster_size,
            backing: Some(backing),
            ..CreateOptions::default()
        };
        let bytes = qcow2_image_bytes(Path::new(&name), &opts, size)?;
        let store = SparseStore::new(&name, 0, true, HoleFill::Zeros);
        vdcache_backend::Backend::write_at(&store, &bytes, 0).map_err(|cause| ImageError::Io {
            image: name.clone(),
            op: "write",
            cause: cause.into(),
        })?;
        self.files.insert(&name, self.metered(Arc::new(store)));
        self.open(&name, n, ImageFormat::Qcow2)
    }

    fn open(&self, name: &str, n: u32, format: ImageFormat) -> Result<VirtualDisk, RigError> {
        let mut meta = MetaCacheConfig::with_slice_bytes(self.config.policy.cow.meta_slice_bytes());
        if let Some(l2) = self.config.l2_cache_bytes {
            meta.l2_bytes = l2;
        }
        Ok(open_chain(
            name,
            &OpenOptions {
                format: Some(format),
                cache: meta,
                disk: DiskId(n.wrapping_add(1)),
                io: self.io(),
                opener: self.files.clone(),
                ..OpenOptions::default()
            },
        )?)
    }

    /// The open disk for trace disk `n`.
    pub fn disk(&self, n: u32) -> Option<&VirtualDisk> {
        self.disks.get(&n).map(|(d, _)| d)
    }

    pub fn disks(&self) -> impl Iterator<Item = &VirtualDisk> {
        self.disks.values().map(|(d, _)| d)
    }

    /// Takes an external snapshot of every qcow2 disk: the current delta
    /// becomes read-only backing of a new, empty one (COWCache 5.3.2).
    pub fn snapshot(&mut self) -> Result<(), RigError> {
        if self.config.layout != DiskLayout::Qcow2 {
            return Ok(());
        }
        let old = std::mem::take(&mut self.disks);
        for (n, (disk, generation)) in old {
            disk.flush()?;
            disk.close()?;
            let backing = disk
                .layers()
                .first()
                .map(|l| l.name().to_string())
                .ok_or_else(|| RigError::Config(format!("disk {n} has no image")))?;
            drop(disk);
            let next = self.new_delta(n, generation + 1, (backing, ImageFormat::Qcow2))?;
            self.disks.insert(n, (next, generation + 1));
        }
        Ok(())
    }

    /// Closes every disk and the cache (dirty data stays in flash: a
    /// replay measures the trace, not a final drain).
    pub fn close(mut self) -> Result<(), RigError> {
        for (_, (disk, _)) in std::mem::take(&mut self.disks) {
            disk.close()?;
        }
        if let Some(c) = &self.cache {
            c.cache.shutdown(true)?;
        }
        Ok(())
    }
}

fn build_cache(config: &RigConfig, meter: &Arc<Meter>) -> Result<CacheRig, RigError> {
    let device_bytes = device_bytes_for(
        config.cache_bytes,
        config.region_bytes,
        config.dedup != Dedup::Off,
    )?;
    let store: BackendRef = Arc::new(SparseStore::new(
        "cache",
        device_bytes,
        false,
        HoleFill::Zeros,
    ));
    // Greedy garbage collection needs a few spare erase blocks, which a
    // small device's share of over-provisioning may not give.
    let min_spare = (4 * config.region_bytes) as f64 / device_bytes as f64;
    let ftl = FtlDevice::new(
        store,
        FtlConfig::new(
            device_bytes,
            BLOCK as u32,
            config.region_bytes,
            config.over_provisioning.max(min_spare),
        ),
    )?;
    let device = MeteredStore::new(ftl.clone(), meter);
    let cache_config = CacheConfig {
        region_bytes: config.region_bytes,
        replacement: config.replacement,
        default_policy: config.policy,
        inline_background: true,
        host: Some("vdcache-replay".into()),
        dedup: config.dedup,
        ..CacheConfig::default()
    };
    let reserve = cache_config.reserve_regions as u64;
    let cache = FlashCache::format(device, cache_config)?;
    let layout = cache.layout();
    let capacity_blocks = (u64::from(layout.regions).saturating_sub(reserve))
        * u64::from(layout.data_blocks_per_region());
    Ok(CacheRig {
        cache,
        ftl,
        capacity_blocks,
    })
}
