//! One qcow2 image file: its header, L1 table, refcount table, metadata
//! cache and cluster allocator, behind one mutex (`Meta`) that is held for
//! metadata work only, never across guest data I/O nor a guest flush's
//! durable sync (what that sync covers is noted under the mutex first).
//!
//! Lock order: a caller holds guest range locks (see `range_lock`) before
//! it takes `Meta`; nothing here takes a range lock.
//!
//! Write order (what makes a crash safe): guest data reaches storage before
//! the L2 entry that points to it; refcount increments before the L2 entry
//! that uses the cluster; L2 tables before the L1 entry; refcount blocks
//! before the refcount table entry; and refcount decrements only after the
//! metadata that stopped referencing the cluster is durable (frees are
//! queued and applied after the next flush). See `persist.rs`.

mod journal;
mod l2;
mod marks;
mod overlap;
mod persist;
mod prealloc;
mod refcount;
mod sums;

use crate::error::{ImageError, Result};
use crate::hostio::{DiskId, FlushKind, HostIo, ImageHandle, IoTag, MetaTable};
use crate::meta_cache::{CacheStats, MetaCacheConfig, SliceCache};
use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use vdcache_qcow2::bitmap::{self, BitmapEntry};
use vdcache_qcow2::compressed::{self, CompressedDescriptor};
use vdcache_qcow2::entries::{L1Entry, L2Format, L2Mapping, SubclusterState};
use vdcache_qcow2::features::{autoclear, incompatible};
use vdcache_qcow2::header::{self, CompressionType, field_offset};
use vdcache_qcow2::snapshot::{self, Snapshot};
use vdcache_qcow2::{Geometry, Header, HostOffset};

pub use journal::JournalStats;
pub(crate) use journal::{Piece, Placement, recover as recover_journal};
pub use l2::TableReads;
pub use marks::abandon_cache;
pub use persist::FlushReport;

/// Every overlap of two metadata structures in the image's current state.
pub(crate) fn overlap_report(g: &Geometry, m: &Meta) -> Vec<overlap::Overlap> {
    overlap::build(g, m).1
}

/// The metadata map of the image's current state.
pub(crate) fn metadata_map(g: &Geometry, m: &Meta) -> overlap::MetaMap {
    overlap::build(g, m).0
}

/// A piece of a guest range as one image maps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    /// Bytes at this host offset (in the image, or its external data file).
    Data(HostOffset),
    Zero,
    /// Not in this image: read the backing file.
    Unallocated,
    /// Inside a compressed cluster, at this offset within the cluster.
    Compressed(CompressedDescriptor, u64),
}

/// A contiguous guest range with one mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub guest: u64,
    pub len: u64,
    pub kind: ExtentKind,
}

/// Options for opening one image.
#[derive(Debug, Clone, Copy)]
pub struct ImageOptions {
    pub read_only: bool,
    pub cache: MetaCacheConfig,
    pub disk: DiskId,
    /// For check and repair: L1 entries are not validated at open (check
    /// reports them), metadata that overlaps is reported, not refused,
    /// and a corrupt image opens writable (so it can be repaired).
    pub for_check: bool,
}

/// Memory-cache statistics of one image.
#[derive(Debug, Clone, Copy, Default)]
pub struct MetaStats {
    pub l2: CacheStats,
    pub refcount: CacheStats,
    /// Memory of the bits that mark slices known to be zero.
    pub zero_map_bytes: u64,
}

/// Mutable metadata state, guarded by one mutex.
pub(crate) struct Meta {
    pub(crate) header: Header,
    pub(crate) l1: Vec<u64>,
    pub(crate) l1_dirty: BTreeSet<u64>,
    pub(crate) reftable: Vec<u64>,
    pub(crate) reftable_dirty: BTreeSet<u64>,
    /// The refcount table moved; the header and the old table's clusters
    /// are dealt with when refcounts are next persisted.
    pub(crate) reftable_moved_from: Option<(u64, u32)>,
    pub(crate) l2: SliceCache,
    pub(crate) refblocks: SliceCache,
    /// No cluster below this one is free.
    pub(crate) free_hint: u64,
    /// End of the image file as far as this image knows: its length at open,
    /// raised by every allocation. Pointers past it are corruption.
    pub(crate) file_end: u64,
    /// Clusters whose refcount drops by one once the metadata that stopped
    /// referencing them is durable.
    pub(crate) pending_frees: Vec<u64>,
    /// Frees ever applied: `pending_frees[0]` is free number
    /// `frees_applied` (a flush applies those queued before its sync).
    pub(crate) frees_applied: u64,
    /// Guest data or new tables written, and how many of those writes the
    /// last barrier covered: metadata pointing at them needs a barrier
    /// first while the two differ (a sync outside the lock covers only the
    /// writes counted when it started).
    unsynced_marks: u64,
    synced_marks: u64,
    /// The dirty bit is set on disk (lazy refcounts in use).
    pub(crate) dirty_on_disk: bool,
    pub(crate) snapshots: Vec<Snapshot>,
    pub(crate) bitmaps: Vec<BitmapEntry>,
    /// Where the metadata lives (see `overlap`).
    pub(crate) map: overlap::MetaMap,
    /// Table writes go to the metadata journal (see `journal`).
    pub(crate) journal: Option<journal::Journal>,
    /// Zeros written ahead of allocation (see `prealloc`).
    pub(crate) prealloc: Option<prealloc::Prealloc>,
}

/// An open qcow2 image.
pub struct Qcow2Image {
    pub(crate) handle: ImageHandle,
    /// Where guest clusters live: the image itself or its external data file.
    pub(crate) data: ImageHandle,
    pub(crate) external_data: bool,
    pub(crate) io: Arc<dyn HostIo>,
    pub(crate) geometry: Geometry,
    pub(crate) format: L2Format,
    pub(crate) compression: CompressionType,
    pub(crate) size: u64,
    pub(crate) read_only: bool,
    pub(crate) lazy_refcounts: bool,
    pub(crate) disk: DiskId,
    pub(crate) meta: Mutex<Meta>,
    /// This open stamped the image's cache mark; the in-cache bit is set
    /// on disk; the cache below may keep changes newer than the file
    /// (see `marks`).
    pub(crate) stamped: AtomicBool,
    pub(crate) marked: AtomicBool,
    pub(crate) keeps_newer: AtomicBool,
    /// Found inconsistent while open (and marked so, if writable): further
    /// writes are refused.
    pub(crate) corrupt: AtomicBool,
    /// Serializes journal commits (taken before `meta`).
    pub(crate) commit_lock: Mutex<()>,
    /// Guest flushes asked of the journal, and how many of them the
    /// newest finished commit covers (group commit).
    pub(crate) commit_requests: std::sync::atomic::AtomicU64,
    pub(crate) commits_cover: std::sync::atomic::AtomicU64,
    /// Metadata cache sizes (the journal's slots are sized by them).
    pub(crate) cache_config: MetaCacheConfig,
    /// The journal holds data writes in memory that reads must see.
    pub(crate) held: AtomicBool,
    /// Signalled (with `meta`) when writes a commit waits for finish.
    pub(crate) overwrites_done: std::sync::Condvar,
    /// Journal records a crash left that this open applied.
    pub(crate) journal_replayed: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for Qcow2Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Image")
            .field("name", &self.handle.name)
            .finish()
    }
}

/// The image with its metadata lock held.
pub(crate) struct Locked<'a> {
    pub(crate) img: &'a Qcow2Image,
    pub(crate) m: MutexGuard<'a, Meta>,
}

/// Reads the first cluster and parses the header.
pub(crate) fn read_header(
    handle: &ImageHandle,
    io: &dyn HostIo,
    disk: DiskId,
) -> Result<(Header, u64)> {
    let name = &*handle.name;
    let file_len = io
        .len(handle)
        .map_err(|e| ImageError::io(name, "stat", e))?;
    let mut prefix = vec![0u8; 128.min(file_len as usize)];
    io.read(
        handle,
        HostOffset(0),
        &mut prefix,
        IoTag::meta(MetaTable::Header, disk),
    )
    .map_err(|e| ImageError::io(name, "read header", e))?;
    let bits = header::peek_cluster_bits(&prefix).map_err(|e| ImageError::format(name, e))?;
    let mut first = vec![0u8; (1u64 << bits).min(file_len) as usize];
    io.read(
        handle,
        HostOffset(0),
        &mut first,
        IoTag::meta(MetaTable::Header, disk),
    )
    .map_err(|e| ImageError::io(name, "read header", e))?;
    let header = Header::parse(&first).map_err(|e| ImageError::format(name, e))?;
    header
        .validate_against_file(file_len)
        .map_err(|e| ImageError::format(name, e))?;
    Ok((header, file_len))
}

fn read_table(
    handle: &ImageHandle,
    io: &dyn HostIo,
    offset: u64,
    entries: u64,
    tag: IoTag,
) -> Result<Vec<u64>> {
    let mut raw = vec![0u8; (entries * 8) as usize];
    io.read(handle, HostOffset(offset), &mut raw, tag)
        .map_err(|e| ImageError::io(&handle.name, "read table", e))?;
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect())
}

impl Qcow2Image {
    /// Opens an image whose header has been read. `data` is the external
    /// data file, when the header names one (opened by the caller).
    pub(crate) fn open(
        handle: ImageHandle,
        data: Option<ImageHandle>,
        io: Arc<dyn HostIo>,
        header: Header,
        opts: ImageOptions,
    ) -> Result<Qcow2Image> {
        let name = handle.name.clone();
        let fmt_err = |e| ImageError::format(&name, e);
        let geometry = header.geometry().map_err(fmt_err)?;
        if header.is_corrupt() && !opts.read_only && !opts.for_check {
            return Err(ImageError::corrupt(
                &name,
                "the corrupt bit is set; open it read-only or repair it with qemu-img check -r all",
            ));
        }
        let external_data = header.has_external_data_file();
        if external_data && data.is_none() {
            return Err(ImageError::Unsupported {
                image: name.to_string(),
                reason: "the image needs an external data file, but none was given".into(),
            });
        }
        let l1 = read_table(
            &handle,
            &*io,
            header.l1_table_offset,
            u64::from(header.l1_size),
            IoTag::meta(MetaTable::L1, opts.disk),
        )?;
        if !opts.for_check {
            for &raw in &l1 {
                L1Entry::decode(raw, &geometry).map_err(fmt_err)?;
            }
        }
        let reftable_entries = header.refcount_table_bytes() / 8;
        let reftable = read_table(
            &handle,
            &*io,
            header.refcount_table_offset,
            reftable_entries,
            IoTag::meta(MetaTable::RefcountTable, opts.disk),
        )?;
        for &raw in &reftable {
            vdcache_qcow2::refcount::decode_table_entry(raw, &geometry).map_err(fmt_err)?;
        }
        let snapshots = read_snapshots(&handle, &*io, &header, &geometry, opts.disk)?;
        let file_end = io
            .len(&handle)
            .map_err(|e| ImageError::io(&name, "stat", e))?;
        let bitmaps = read_bitmap_directory(&handle, &*io, &header, &geometry, opts.disk)?;
        let slice = opts
            .cache
            .slice_bytes
            .unwrap_or(geometry.cluster_size())
            .clamp(512, geometry.cluster_size());
        if !slice.is_power_of_two() {
            return Err(ImageError::Unsupported {
                image: name.to_string(),
                reason: format!("metadata cache slice size {slice} is not a power of two"),
            });
        }
        let format = L2Format {
            geometry,
            version: header.version,
            external_data,
        };
        let meta = Meta {
            l1,
            l1_dirty: BTreeSet::new(),
            reftable,
            reftable_dirty: BTreeSet::new(),
            reftable_moved_from: None,
            l2: SliceCache::new(opts.cache.l2_bytes, slice, geometry.cluster_size()),
            refblocks: SliceCache::new(opts.cache.refcount_bytes, slice, geometry.cluster_size()),
            free_hint: 0,
            file_end,
            pending_frees: Vec::new(),
            frees_applied: 0,
            unsynced_marks: 0,
            synced_marks: 0,
            dirty_on_disk: header.is_dirty(),
            snapshots,
            bitmaps,
            header: header.clone(),
            map: overlap::MetaMap::default(),
            journal: None,
            prealloc: None,
        };
        let (map, overlaps) = overlap::build(&geometry, &meta);
        if let Some(o) = overlaps.first()
            && !opts.read_only
            && !opts.for_check
        {
            return Err(ImageError::corrupt(
                &name,
                format!(
                    "metadata overlaps other metadata ({o}); writing would destroy one of them. Repair it with `vdcache check -r all` (or qemu-img check -r all), or open it read-only"
                ),
            ));
        }
        let meta = Meta { map, ..meta };
        let data = data.unwrap_or_else(|| handle.clone());
        Ok(Qcow2Image {
            handle,
            data,
            external_data,
            io,
            geometry,
            format,
            compression: header.compression_type,
            size: header.size,
            read_only: opts.read_only,
            lazy_refcounts: header.has_lazy_refcounts(),
            disk: opts.disk,
            meta: Mutex::new(meta),
            stamped: AtomicBool::new(false),
            marked: AtomicBool::new(false),
            keeps_newer: AtomicBool::new(false),
            corrupt: AtomicBool::new(false),
            commit_lock: Mutex::new(()),
            commit_requests: std::sync::atomic::AtomicU64::new(0),
            commits_cover: std::sync::atomic::AtomicU64::new(0),
            cache_config: opts.cache,
            held: AtomicBool::new(false),
            overwrites_done: std::sync::Condvar::new(),
            journal_replayed: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    pub(crate) fn lock(&self) -> Locked<'_> {
        Locked {
            img: self,
            m: self.meta.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// [`Qcow2Image::lock`], or None while another thread holds it.
    fn try_lock(&self) -> Option<Locked<'_>> {
        let m = match self.meta.try_lock() {
            Ok(m) => m,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(Locked { img: self, m })
    }

    pub fn name(&self) -> &str {
        &self.handle.name
    }

    /// Clears the corrupt bit of an image a check found clean.
    pub fn clear_corrupt_bit(&self) -> Result<()> {
        let mut l = self.lock();
        let v = l.m.header.incompatible_features;
        if v & incompatible::CORRUPT == 0 || self.read_only {
            return Ok(());
        }
        let cleared = v & !incompatible::CORRUPT;
        l.write_header_field(field_offset::INCOMPATIBLE_FEATURES, &cleared.to_be_bytes())?;
        l.sync(FlushKind::Durable)?;
        l.m.header.incompatible_features = cleared;
        Ok(())
    }

    /// Found inconsistent while open: writes are refused.
    pub fn found_corrupt(&self) -> bool {
        self.corrupt.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The size guests see: whole 512-byte sectors, as QEMU counts them (a
    /// header size between sectors is rounded down, as QEMU does).
    pub fn virtual_size(&self) -> u64 {
        self.size & !(crate::SECTOR - 1)
    }

    pub fn handle(&self) -> &ImageHandle {
        &self.handle
    }

    pub fn header(&self) -> Header {
        self.lock().m.header.clone()
    }

    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.lock().m.snapshots.clone()
    }

    pub fn meta_stats(&self) -> MetaStats {
        let l = self.lock();
        MetaStats {
            l2: l.m.l2.stats,
            refcount: l.m.refblocks.stats,
            zero_map_bytes: l.m.l2.zero_map_bytes() + l.m.refblocks.zero_map_bytes(),
        }
    }

    /// Maps `[offset, offset+len)` (inside the virtual size) to extents,
    /// merging neighbours with the same kind and contiguous host addresses.
    pub fn map(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(self
            .map_if(offset, len, TableReads::Allowed)?
            .unwrap_or_default())
    }

    /// [`Qcow2Image::map`], or None when that needs a table read and
    /// `reads` forbids it.
    pub fn map_if(&self, offset: u64, len: u64, reads: TableReads) -> Result<Option<Vec<Extent>>> {
        Self::map_locked(&mut self.lock(), offset, len, reads)
    }

    /// [`Qcow2Image::map`], or None when another thread holds the
    /// metadata lock (for callers that must not wait for it).
    pub fn map_if_unlocked(&self, offset: u64, len: u64) -> Result<Option<Vec<Extent>>> {
        match self.try_lock() {
            Some(mut l) => Self::map_locked(&mut l, offset, len, TableReads::Allowed),
            None => Ok(None),
        }
    }

    fn map_locked(
        l: &mut Locked<'_>,
        offset: u64,
        len: u64,
        reads: TableReads,
    ) -> Result<Option<Vec<Extent>>> {
        let mut out: Vec<Extent> = Vec::new();
        let cs = l.img.geometry.cluster_size();
        let sc = l.img.geometry.subcluster_size();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let cluster = pos / cs;
            let cluster_start = cluster * cs;
            let cluster_end = (cluster_start + cs).min(end);
            let Some(mapping) = l.l2_entry_if(cluster, reads)? else {
                return Ok(None);
            };
            match mapping {
                L2Mapping::Compressed(d) => {
                    push_extent(
                        &mut out,
                        pos,
                        cluster_end - pos,
                        ExtentKind::Compressed(d, pos - cluster_start),
                    );
                    pos = cluster_end;
                }
                L2Mapping::Standard(s) => {
                    while pos < cluster_end {
                        let in_cluster = pos - cluster_start;
                        let sub = (in_cluster / sc) as u32;
                        let sub_end = (cluster_start + (u64::from(sub) + 1) * sc).min(cluster_end);
                        let kind = match s.state(sub) {
                            SubclusterState::Allocated => {
                                let host = s.host.map_or(0, |h| h.0);
                                ExtentKind::Data(HostOffset(host + in_cluster))
                            }
                            SubclusterState::Zero => ExtentKind::Zero,
                            SubclusterState::Unallocated => ExtentKind::Unallocated,
                        };
                        push_extent(&mut out, pos, sub_end - pos, kind);
                        pos = sub_end;
                    }
                }
            }
        }
        Ok(Some(out))
    }

    /// Reads part of a compressed cluster.
    pub(crate) fn read_compressed(
        &self,
        desc: &CompressedDescriptor,
        offset_in_cluster: u64,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()> {
        let cluster = self.decompress_cluster(desc, tag)?;
        let start = offset_in_cluster as usize;
        buf.copy_from_slice(&cluster[start..start + buf.len()]);
        Ok(())
    }

    /// Decompresses a whole compressed cluster.
    pub(crate) fn decompress_cluster(
        &self,
        desc: &CompressedDescriptor,
        tag: IoTag,
    ) -> Result<Vec<u8>> {
        let stored = desc.stored_len();
        if stored > 2 * self.geometry.cluster_size() + compressed::SECTOR {
            return Err(self.lock().corruption(format!(
                "compressed cluster at {:#x} claims {stored} bytes",
                desc.offset
            )));
        }
        let file_end = self.lock().m.file_end;
        if desc.offset.saturating_add(stored) > file_end.next_multiple_of(compressed::SECTOR) {
            return Err(self.lock().corruption(format!(
                "compressed cluster at {:#x} (+{stored} bytes) extends past the end of the image file ({file_end} bytes)",
                desc.offset
            )));
        }
        let mut src = vec![0u8; stored as usize];
        self.io
            .read(&self.handle, HostOffset(desc.offset), &mut src, tag)
            .map_err(|e| ImageError::io(self.name(), "read compressed cluster", e))?;
        let mut out = vec![0u8; self.geometry.cluster_size() as usize];
        compressed::decompress(self.compression, &src, &mut out, desc.offset)
            .map_err(|e| ImageError::format(self.name(), e))?;
        Ok(out)
    }

    /// Prepares a writable image for its first write: clears autoclear bits
    /// this implementation does not maintain and marks bitmaps in use, so no
    /// stale bitmap is ever trusted.
    pub(crate) fn prepare_for_writes(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let mut l = self.lock();
        let mut keep = autoclear::BITMAPS & if l.m.bitmaps.is_empty() { 0 } else { u64::MAX };
        if self.stamped.load(std::sync::atomic::Ordering::SeqCst) {
            keep |= autoclear::CACHE_COHERENT;
        }
        let clear = l.m.header.autoclear_features & !keep;
        if clear != 0 {
            let v = l.m.header.autoclear_features & !clear;
            l.m.header.autoclear_features = v;
            if l.m.header.version >= 3 {
                l.write_header_field(field_offset::AUTOCLEAR_FEATURES, &v.to_be_bytes())?;
            }
        }
        l.mark_bitmaps_in_use()?;
        Ok(())
    }

    /// Writes everything back, clears the dirty bit, and makes it durable.
    /// Unless `keep_cached`, a cache below also writes everything of the
    /// image back, and the image no longer needs it.
    pub fn close(&self, keep_cached: bool) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.stop_journal()?;
        let mut l = self.lock();
        l.flush_all(true)?;
        if l.m.dirty_on_disk {
            l.set_dirty_bit(false)?;
        }
        drop(l);
        if keep_cached {
            return Ok(());
        }
        self.release_holder()
    }
}

fn push_extent(out: &mut Vec<Extent>, guest: u64, len: u64, kind: ExtentKind) {
    if let Some(last) = out.last_mut() {
        let merged = match (last.kind, kind) {
            (ExtentKind::Zero, ExtentKind::Zero)
            | (ExtentKind::Unallocated, ExtentKind::Unallocated) => true,
            (ExtentKind::Data(a), ExtentKind::Data(b)) => a.0 + last.len == b.0,
            _ => false,
        };
        if merged && last.guest + last.len == guest {
            last.len += len;
            return;
        }
    }
    out.push(Extent { guest, len, kind });
}

fn read_snapshots(
    handle: &ImageHandle,
    io: &dyn HostIo,
    h: &Header,
    g: &Geometry,
    disk: DiskId,
) -> Result<Vec<Snapshot>> {
    if h.nb_snapshots == 0 {
        return Ok(Vec::new());
    }
    let file_len = io
        .len(handle)
        .map_err(|e| ImageError::io(&handle.name, "stat", e))?;
    let want =
        snapshot::max_table_bytes(h.nb_snapshots).min(file_len.saturating_sub(h.snapshots_offset));
    let mut buf = vec![0u8; want as usize];
    io.read(
        handle,
        HostOffset(h.snapshots_offset),
        &mut buf,
        IoTag::meta(MetaTable::SnapshotTable, disk),
    )
    .map_err(|e| ImageError::io(&handle.name, "read snapshot table", e))?;
    let (snaps, _) = snapshot::parse_table(&buf, h.nb_snapshots, g)
        .map_err(|e| ImageError::format(&handle.name, e))?;
    for s in &snaps {
        if s.l1_table_offset.saturating_add(u64::from(s.l1_size) * 8) > file_len {
            return Err(ImageError::corrupt(
                &handle.name,
                format!(
                    "snapshot '{}' L1 table lies past the end of the file",
                    s.name
                ),
            ));
        }
    }
    Ok(snaps)
}

fn read_bitmap_directory(
    handle: &ImageHandle,
    io: &dyn HostIo,
    h: &Header,
    g: &Geometry,
    disk: DiskId,
) -> Result<Vec<BitmapEntry>> {
    let Some(ext) = h.extensions.bitmaps else {
        return Ok(Vec::new());
    };
    if h.autoclear_features & autoclear::BITMAPS == 0 {
        // Another writer already declared the bitmaps inconsistent.
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; ext.directory_size as usize];
    io.read(
        handle,
        HostOffset(ext.directory_offset),
        &mut buf,
        IoTag::meta(MetaTable::Bitmap, disk),
    )
    .map_err(|e| ImageError::io(&handle.name, "read bitmap directory", e))?;
    bitmap::parse_directory(&buf, ext.nb_bitmaps, g)
        .map_err(|e| ImageError::format(&handle.name, e))
}

impl Locked<'_> {
    pub(crate) fn name(&self) -> &str {
        self.img.name()
    }

    pub(crate) fn tag(&self, table: MetaTable) -> IoTag {
        IoTag::meta(table, self.img.disk)
    }

    /// A table write: into the open journal transaction when the journal
    /// is on, else in place.
    pub(crate) fn write_meta(&mut self, table: MetaTable, offset: u64, data: &[u8]) -> Result<()> {
        self.check_meta_write(table, offset, data.len() as u64)?;
        if let Some(j) = self.m.journal.as_mut()
            && !matches!(table, MetaTable::Bitmap | MetaTable::Journal)
        {
            j.add_meta(table, offset, data);
            return Ok(());
        }
        self.write_in_place(table, offset, data)
    }

    /// Reads table bytes as they stand, journaled writes included.
    pub(crate) fn read_meta(&self, offset: u64, buf: &mut [u8], tag: IoTag) -> Result<()> {
        self.img
            .io
            .read(&self.img.handle, HostOffset(offset), buf, tag)
            .map_err(|e| ImageError::io(self.name(), "read metadata", e))?;
        if let Some(j) = &self.m.journal {
            j.overlay_meta(offset, buf);
        }
        Ok(())
    }

    fn check_meta_write(&mut self, table: MetaTable, offset: u64, len: u64) -> Result<()> {
        let g = self.img.geometry;
        if let Some((cluster, kind)) = self.m.map.conflict(&g, offset, len, Some(table)) {
            return Err(self.corruption(format!(
                "Preventing invalid write on metadata: a write of the {} at {offset:#x} overlaps the {} at cluster {cluster}",
                overlap::table_name(table),
                kind.describe()
            )));
        }
        Ok(())
    }

    /// A table write that goes to the file now, journal or not.
    pub(crate) fn write_in_place(
        &mut self,
        table: MetaTable,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        self.img
            .io
            .write(
                &self.img.handle,
                HostOffset(offset),
                &[crate::hostio::WriteSegment {
                    data,
                    tag: self.tag(table),
                }],
            )
            .map_err(|e| ImageError::io(self.name(), "write metadata", e))
    }

    /// An ordering point: writes issued before it are durable no later
    /// than writes issued after it.
    /// A journal transaction needs none: its tables reach their places
    /// only after its record is durable.
    pub(crate) fn barrier(&mut self) -> Result<()> {
        if self.journaling() {
            return Ok(());
        }
        self.sync(FlushKind::Barrier)
    }

    /// Flushes with the given strength.
    pub(crate) fn sync(&mut self, kind: FlushKind) -> Result<()> {
        self.img
            .io
            .flush(&self.img.handle, kind)
            .map_err(|e| ImageError::io(self.name(), "flush", e))?;
        self.m.synced_marks = self.m.unsynced_marks;
        Ok(())
    }

    /// Guest data or a new table was written: metadata pointing at it needs
    /// a barrier first.
    pub(crate) fn mark_unsynced(&mut self) {
        self.m.unsynced_marks += 1;
    }

    pub(crate) fn has_unsynced_writes(&self) -> bool {
        self.m.unsynced_marks != self.m.synced_marks
    }

    /// A header field written in place (feature bits are for readers of
    /// the file; fields that must change with a transaction go through
    /// [`Self::write_meta`]).
    pub(crate) fn write_header_field(&mut self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.check_meta_write(MetaTable::Header, offset, bytes.len() as u64)?;
        self.write_in_place(MetaTable::Header, offset, bytes)
    }

    /// The image turned out inconsistent: unless it is read-only, it is
    /// marked corrupt on disk (once; QEMU then refuses to write it too)
    /// and refuses further writes. Returns the error to fail the request
    /// with.
    pub(crate) fn corruption(&mut self, reason: String) -> ImageError {
        use std::sync::atomic::Ordering;
        if !self.img.read_only && !self.img.corrupt.swap(true, Ordering::SeqCst) {
            tracing::error!(
                image = self.name(),
                "marking the image as corrupt: {reason}; further writes are refused"
            );
            let v = self.m.header.incompatible_features | incompatible::CORRUPT;
            let marked = self
                .write_header_field(field_offset::INCOMPATIBLE_FEATURES, &v.to_be_bytes())
                .and_then(|()| self.sync(FlushKind::Durable));
            match marked {
                Ok(()) => self.m.header.incompatible_features = v,
                Err(e) => tracing::error!(image = self.name(), "cannot set the corrupt bit: {e}"),
            }
        }
        ImageError::corrupt(self.name(), reason)
    }

    /// Refuses a guest data write of `len` bytes at `offset` of the image
    /// file that would land on metadata.
    pub(crate) fn check_data_write(&mut self, offset: u64, len: u64) -> Result<()> {
        if self.img.external_data {
            return Ok(());
        }
        let g = self.img.geometry;
        match self.m.map.conflict(&g, offset, len, None) {
            None => Ok(()),
            Some((cluster, kind)) => Err(self.corruption(format!(
                "Preventing invalid write on metadata: guest data at {offset:#x} overlaps the {} at cluster {cluster}",
                kind.describe()
            ))),
        }
    }

    /// Sets or clears the dirty bit durably.
    pub(crate) fn set_dirty_bit(&mut self, dirty: bool) -> Result<()> {
        let mut v = self.m.header.incompatible_features & !incompatible::DIRTY;
        if dirty {
            v |= incompatible::DIRTY;
        }
        self.barrier()?;
        self.write_header_field(field_offset::INCOMPATIBLE_FEATURES, &v.to_be_bytes())?;
        self.sync(FlushKind::Durable)?;
        self.m.header.incompatible_features = v;
        self.m.dirty_on_disk = dirty;
        Ok(())
    }

    fn mark_bitmaps_in_use(&mut self) -> Result<()> {
        let Some(ext) = self.m.header.extensions.bitmaps else {
            return Ok(());
        };
        if self
            .m
            .bitmaps
            .iter()
            .all(|b| b.flags & bitmap::FLAG_IN_USE != 0)
        {
            return Ok(());
        }
        let mut dir = vec![0u8; ext.directory_size as usize];
        self.img
            .io
            .read(
                &self.img.handle,
                HostOffset(ext.directory_offset),
                &mut dir,
                self.tag(MetaTable::Bitmap),
            )
            .map_err(|e| ImageError::io(self.name(), "read bitmap directory", e))?;
        let mut bitmaps = std::mem::take(&mut self.m.bitmaps);
        for b in &mut bitmaps {
            bitmap::mark_in_use(&mut dir, b);
            b.flags |= bitmap::FLAG_IN_USE;
        }
        self.m.bitmaps = bitmaps;
        self.write_meta(MetaTable::Bitmap, ext.directory_offset, &dir)?;
        self.barrier()
    }
}
