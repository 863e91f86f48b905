//! What `vdcache stats` reports: a snapshot of the cache's state taken
//! under the state lock, and the device's counters read without it.
//!
//! It only reads: it never changes the state it reports.

use super::{FlashCache, RecoveryReport};
use crate::layout::BLOCK;
use crate::region::RegionCounts;
use crate::stats::{DeviceStats, DiskStats};
use std::collections::HashMap;

/// What `vdcache stats` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheReport {
    pub device_bytes: u64,
    pub data_bytes: u64,
    pub region_bytes: u64,
    pub regions_free: u32,
    pub regions_open: u32,
    pub regions_full: u32,
    pub cached_bytes: u64,
    pub dirty_bytes: u64,
    /// The part of `dirty_bytes` that belongs to guests' journal devices:
    /// it lives in flash only (cache-only logging), and no write-back
    /// watermark counts it.
    pub held_bytes: u64,
    /// Clean copies of write-through data waiting out of the journal for
    /// a backend sync (a guest flush's, or the cache's own once a
    /// sixteenth of its blocks wait): a crash forgets them.
    pub unflushed_clean_bytes: u64,
    pub index_memory_bytes: u64,
    /// The part of the index memory sized by the device (held even when
    /// nothing is cached).
    pub index_memory_fixed_bytes: u64,
    /// Index memory beyond the fixed part, as a fraction of the cached
    /// bytes.
    pub index_memory_ratio: f64,
    /// Memory of the checksums of cached blocks.
    pub checksum_memory_bytes: u64,
    /// Deduplication, when the cache deduplicates.
    pub dedup: Option<DedupReport>,
    /// Per-VM shares, when on: each disk's flash, demand and settings.
    pub shares: Option<Vec<ShareReport>>,
    /// Dirty blocks whose only copy the device damaged (reads fail).
    pub unreadable_blocks: u64,
    /// Dirty metadata sectors held (cow-aware write-back), and their memory.
    pub meta_sectors: u64,
    pub meta_sector_memory_bytes: u64,
    /// Regions reclaimed whose blocks were found through the region's
    /// summary, and through a scan of the index (no usable summary: small
    /// regions, or regions filled before a crash).
    pub regions_emptied_by_summary: u64,
    pub regions_emptied_by_scan: u64,
    /// What fast recovery found when the cache opened (zeros: formatted).
    pub recovery: RecoveryReport,
    pub replacement: &'static str,
    /// What the tier wrote to and read from its device since it opened.
    pub device: DeviceStats,
    pub total: DiskStats,
    pub disks: Vec<(u32, DiskStats)>,
    pub images: Vec<ImageReport>,
}

/// What deduplication does for the cache.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DedupReport {
    /// off, on or verify.
    pub mode: &'static str,
    /// Distinct cache blocks the cached addresses map to.
    pub unique_blocks: u64,
    /// Cached addresses per distinct block (1.0: nothing shared).
    pub ratio: f64,
    /// Checksums in the signature table, fingerprints learned, and the
    /// table's memory (counted in `index_memory_bytes` too).
    pub signatures: u64,
    pub fingerprints: u64,
    pub table_memory_bytes: u64,
    pub counts: crate::dedup::DedupCounts,
    /// Most bytes the address map takes in a checkpoint now, and the room
    /// its slot has for them: sharing lets addresses outnumber blocks, so
    /// shares stop, and eviction frees lines, before the map outgrows it.
    pub checkpoint_map_bytes: u64,
    pub checkpoint_room_bytes: u64,
}

/// Each owner's share: its regions' bytes, demand and settings.
fn share_reports(st: &super::State) -> Vec<ShareReport> {
    let usage = st.regions.usage();
    let mut tenants = st.shares.tenants();
    tenants.extend(usage.keys().copied());
    tenants.sort_unstable();
    tenants.dedup();
    tenants
        .into_iter()
        .map(|t| {
            let share = st.shares.get(t);
            ShareReport {
                disk: (t != crate::shares::UNOWNED).then_some(t),
                bytes: usage.get(&t).map_or(0, |u| u.blocks) * BLOCK,
                demand: st.shares.demand(t),
                min_bytes: share.min_blocks.saturating_mul(BLOCK),
                max_bytes: (share.max_blocks != u64::MAX)
                    .then(|| share.max_blocks.saturating_mul(BLOCK)),
                weight: share.weight,
            }
        })
        .collect()
}

/// One disk's share of flash (`crate::shares`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShareReport {
    /// The disk (`None`: regions no disk owns, filled before a restart).
    pub disk: Option<u32>,
    /// Flash its regions hold.
    pub bytes: u64,
    /// Its recent reuse (decayed read hits).
    pub demand: f64,
    pub min_bytes: u64,
    /// None: no maximum.
    pub max_bytes: Option<u64>,
    pub weight: f64,
}

/// One image the cache holds blocks of.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImageReport {
    pub name: String,
    pub cached_bytes: u64,
    pub dirty_bytes: u64,
}

impl FlashCache {
    /// What the tier did to its device, read without the state lock.
    pub fn device_stats(&self) -> DeviceStats {
        DeviceStats {
            sync_waits: self.group_sync.waits(),
            ..self.counted.snapshot()
        }
    }

    /// Statistics.
    pub fn report(&self) -> CacheReport {
        let st = self.lock();
        let counts: RegionCounts = st.regions.counts();
        let cached = st.index.present_blocks() * BLOCK;
        let memory = st.index.memory_bytes() + st.signatures.memory_bytes();
        let dedup = self.config.dedup.enabled().then(|| {
            let unique = st.index.referenced_blocks();
            DedupReport {
                mode: self.config.dedup.name(),
                unique_blocks: unique,
                ratio: if unique == 0 {
                    1.0
                } else {
                    st.index.present_blocks() as f64 / unique as f64
                },
                signatures: st.signatures.len() as u64,
                fingerprints: st.signatures.learned() as u64,
                table_memory_bytes: st.signatures.memory_bytes(),
                counts: st.signatures.counts(),
                checkpoint_map_bytes: super::checkpoint::lines_bound(&st),
                checkpoint_room_bytes: self.layout.checkpoint_lines_room(),
            }
        });
        let shares = st.shares.enabled().then(|| share_reports(&st));
        let fixed = st.index.fixed_memory_bytes();
        let mut per_image: Vec<(u64, u64)> = vec![(0, 0); st.catalog.images.len()];
        let mut dirty_by_disk: HashMap<u32, u64> = HashMap::new();
        for l in st.index.lines() {
            let img = crate::index::key_image(l.key) as usize;
            if let Some(p) = per_image.get_mut(img) {
                p.0 += u64::from(l.present.count_ones()) * BLOCK;
                p.1 += u64::from(l.dirty.count_ones()) * BLOCK;
            }
            if let Some(rec) = st.catalog.images.get(img) {
                *dirty_by_disk.entry(rec.disk.0).or_default() +=
                    u64::from(l.dirty.count_ones()) * BLOCK;
            }
        }
        let images = st
            .catalog
            .images
            .iter()
            .zip(&per_image)
            .map(|(r, &(c, d))| ImageReport {
                name: r.name.clone(),
                cached_bytes: c,
                dirty_bytes: d,
            })
            .collect();
        let dirty = st.index.dirty_blocks() * BLOCK;
        let held = st.index.held_dirty_blocks() * BLOCK;
        let unflushed_clean_bytes = st.ledger.held_clean() as u64 * BLOCK;
        let meta_sectors = st.meta.dirty_len() as u64;
        let checksum_memory_bytes = st.integrity.crcs.memory_bytes();
        let unreadable_blocks = st.integrity.unreadable.len() as u64;
        let meta_sector_memory_bytes = st.meta.memory_bytes();
        let emptied = (st.reclaimed.by_summary, st.reclaimed.by_scan);
        drop(st);
        let mut disks = self.stats.all();
        let mut total = DiskStats::default();
        for (d, s) in &mut disks {
            s.dirty_bytes = dirty_by_disk.get(d).copied().unwrap_or(0);
            total.add(s);
        }
        total.dirty_bytes = dirty;
        CacheReport {
            device_bytes: self.layout.device_bytes,
            data_bytes: self.layout.cacheable_blocks() * BLOCK,
            region_bytes: self.layout.region_bytes,
            regions_free: counts.free,
            regions_open: counts.open,
            regions_full: counts.full,
            cached_bytes: cached,
            dirty_bytes: dirty,
            held_bytes: held,
            unflushed_clean_bytes,
            index_memory_bytes: memory,
            index_memory_fixed_bytes: fixed,
            index_memory_ratio: if cached == 0 {
                0.0
            } else {
                memory.saturating_sub(fixed) as f64 / cached as f64
            },
            checksum_memory_bytes,
            dedup,
            shares,
            unreadable_blocks,
            meta_sectors,
            meta_sector_memory_bytes,
            regions_emptied_by_summary: emptied.0,
            regions_emptied_by_scan: emptied.1,
            recovery: self.recovery,
            replacement: self.config.replacement.name(),
            device: self.device_stats(),
            total,
            disks,
            images,
        }
    }

    /// Checks that every region counts as live exactly the distinct blocks
    /// the index references in it (a block shared by several addresses
    /// counts once). A test oracle: a count too high leaks the region
    /// forever, one too low reuses a block still referenced. Returns the
    /// first region that disagrees.
    pub fn audit_regions(&self) -> std::result::Result<(), String> {
        let st = self.lock();
        let mut referenced = std::collections::HashSet::new();
        for l in st.index.lines() {
            referenced.extend(l.blocks().map(|(_, cbn)| cbn));
        }
        let mut per_region: HashMap<u32, u32> = HashMap::new();
        for cbn in referenced {
            *per_region.entry(self.layout.region_of(cbn)).or_default() += 1;
        }
        for region in 0..self.layout.regions {
            let counted = st.regions.live_blocks(region);
            let found = per_region.get(&region).copied().unwrap_or(0);
            if counted != found {
                return Err(format!(
                    "region {region} counts {counted} live blocks, the index references {found}"
                ));
            }
        }
        Ok(())
    }
}
