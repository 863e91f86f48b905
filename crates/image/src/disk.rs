//! The virtual disk: a chain of images presented as one block device.
//! Reads walk the chain; writes go to the top image, copying on write from
//! the chain (see `cow.rs`); zero writes and discards change metadata where
//! qcow2 can express them and fall back to writing zeros where it cannot.
//!
//! Every public operation takes the guest range lock of the clusters it
//! touches before any metadata lock.

use crate::cow::DeferredCow;
use crate::deferred::{DeferredFills, FillRunner};
use crate::error::{ImageError, Result};
use crate::hostio::{
    BackingFill, DCOW_BLOCK, DiskId, FlushKind, HostIo, ImageHandle, IoClass, IoTag, PartialRange,
    WriteSegment,
};
use crate::qimage::{ExtentKind, FlushReport, MetaStats, Qcow2Image, TableReads};
use crate::range_lock::{Mode, RangeGuard, RangeLocks};
use std::sync::Arc;
use vdcache_contract::{GuestCluster, GuestOffset, HostError};
use vdcache_qcow2::HostOffset;
use vdcache_qcow2::entries::{L2Mapping, StandardCluster, all_subclusters};

/// Guest clusters of a raw top image (for range locks and tags).
const RAW_CLUSTER_BITS: u32 = 16;
/// Largest buffer used when writing zeros the format cannot express.
const ZERO_CHUNK: u64 = 1 << 20;

/// A raw image in a chain (always the last one).
#[derive(Debug)]
pub struct RawImage {
    pub handle: ImageHandle,
    pub size: u64,
}

/// One image of a chain.
#[derive(Debug)]
pub enum Layer {
    Qcow2(Box<Qcow2Image>),
    Raw(RawImage),
}

impl Layer {
    pub fn name(&self) -> &str {
        match self {
            Layer::Qcow2(q) => q.name(),
            Layer::Raw(r) => &r.handle.name,
        }
    }

    pub fn size(&self) -> u64 {
        match self {
            Layer::Qcow2(q) => q.virtual_size(),
            Layer::Raw(r) => r.size,
        }
    }

    pub fn handle(&self) -> &ImageHandle {
        match self {
            Layer::Qcow2(q) => q.handle(),
            Layer::Raw(r) => &r.handle,
        }
    }
}

/// How a range reads, for block status and allocation maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockState {
    /// Nothing in the chain stores these bytes.
    pub hole: bool,
    /// The bytes read as zeros.
    pub zero: bool,
    /// Depth of the image that provides the bytes (chain length if none).
    pub depth: u32,
}

/// Flags of a zero write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Host space may be released (NBD's lack of NO_HOLE).
    pub may_unmap: bool,
    /// Durable on return.
    pub fua: bool,
}

/// A chain opened as one disk.
#[derive(Debug)]
pub struct VirtualDisk {
    pub(crate) layers: Vec<Layer>,
    pub(crate) io: Arc<dyn HostIo>,
    pub(crate) disk: DiskId,
    size: u64,
    read_only: bool,
    pub(crate) cluster_bits: u32,
    /// Allocating writes skip the filler and leave the cluster partially
    /// valid in the layer below (decoupled copy-on-write).
    pub(crate) decoupled: bool,
    /// The layer below wants to hear which backing blocks writes mask.
    hints_masked: bool,
    locks: RangeLocks,
    /// Copy-on-write fills left to workers (see `deferred`).
    pub(crate) fills: Arc<DeferredFills<DeferredCow, VirtualDisk>>,
}

/// What filling partially valid clusters did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FillReport {
    /// Bytes copied from the backing chain into the top image.
    pub filled_bytes: u64,
    /// Partially valid ranges left (beyond the limit asked for).
    pub remaining: usize,
}

impl VirtualDisk {
    pub(crate) fn new(
        layers: Vec<Layer>,
        io: Arc<dyn HostIo>,
        disk: DiskId,
        read_only: bool,
    ) -> Result<VirtualDisk> {
        let top = layers
            .first()
            .ok_or_else(|| ImageError::corrupt("chain", "no image"))?;
        let cluster_bits = match top {
            Layer::Qcow2(q) => q.geometry().cluster_bits(),
            Layer::Raw(_) => RAW_CLUSTER_BITS,
        };
        let decoupled = match top {
            Layer::Qcow2(q) => {
                let g = q.geometry();
                !read_only
                    && io.partial().decoupled_cow(disk)
                    && !g.extended_l2()
                    && !q.external_data
                    && g.cluster_size() >= 2 * DCOW_BLOCK
                    // Guest cluster numbers are recorded in 32 bits.
                    && top.size() >> g.cluster_bits() < 1 << 32
            }
            Layer::Raw(_) => false,
        };
        let hints_masked = layers.len() > 1 && io.hints().wants_masked_hints(disk);
        Ok(VirtualDisk {
            size: top.size(),
            layers,
            io,
            disk,
            read_only,
            cluster_bits,
            decoupled,
            hints_masked,
            locks: RangeLocks::default(),
            fills: Arc::default(),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    pub fn io(&self) -> &Arc<dyn HostIo> {
        &self.io
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Metadata cache statistics of the top image.
    pub fn meta_stats(&self) -> Option<MetaStats> {
        match &self.layers[0] {
            Layer::Qcow2(q) => Some(q.meta_stats()),
            Layer::Raw(_) => None,
        }
    }

    /// The top image's metadata journal, if it has one on.
    pub fn journal_stats(&self) -> Option<crate::qimage::JournalStats> {
        match &self.layers[0] {
            Layer::Qcow2(q) => q.journal_stats(),
            Layer::Raw(_) => None,
        }
    }

    pub(crate) fn tag(&self, class: IoClass, guest: u64) -> IoTag {
        IoTag {
            class,
            disk: self.disk,
            guest_cluster: Some(GuestCluster::containing(
                GuestOffset(guest),
                self.cluster_bits,
            )),
            unit: None,
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ImageError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(ImageError::ReadOnly {
                image: self.layers[0].name().to_string(),
            });
        }
        if let Layer::Qcow2(img) = &self.layers[0]
            && img.found_corrupt()
        {
            return Err(ImageError::corrupt(
                img.name(),
                "the image was found corrupt and marked so; writes are refused (repair it offline with `vdcache check -r all`)",
            ));
        }
        Ok(())
    }

    /// Before a change of the top image, with its range locked: a cache
    /// that keeps it newer than the file must have the image marked so.
    fn before_change(&self) -> Result<()> {
        match &self.layers[0] {
            Layer::Qcow2(img) => img.ensure_marked(),
            Layer::Raw(_) => Ok(()),
        }
    }

    /// Makes the image complete in its file now, as a clean stop would,
    /// and goes on serving: every change flushed, a cache below writing
    /// back what it holds of the image, and the image then no longer
    /// marked as needing the cache (until the next change). Partially
    /// valid clusters are filled first when `fill`.
    pub fn write_back(&self, fill: bool) -> Result<()> {
        // The bulk is written back here, with guests still served; the
        // exclusive part below only writes what they changed meanwhile.
        self.write_back_below()?;
        if fill {
            self.fill_partial(usize::MAX)?;
        }
        let clusters = self.size.div_ceil(self.cluster_size()).max(1);
        let _all = self.lock_clusters(0, clusters, Mode::Exclusive);
        self.flush()?;
        match &self.layers[0] {
            Layer::Qcow2(img) if !self.read_only => img.release_holder(),
            Layer::Qcow2(_) => Ok(()),
            Layer::Raw(r) => self
                .io
                .copies()
                .write_back_image(&r.handle)
                .map_err(|e| ImageError::io(&r.handle.name, "write back the cache", e)),
        }
    }

    /// Takes the range lock of guest clusters `first..end`, then waits
    /// for their deferred fills.
    fn lock_clusters(&self, first: u64, end: u64, mode: Mode) -> RangeGuard<'_> {
        let guard = self.locks.lock(first, end, mode);
        self.fills.wait_clusters(first, end);
        guard
    }

    /// Lets workers complete small allocating writes once a flush
    /// interval holds `stream_writes` writes (see `deferred`;
    /// [`crate::STREAM_WRITES`] in serving): for a writable qcow2 image
    /// over a backing chain that fills copy-on-write clusters itself (no
    /// decoupled copy-on-write).
    pub fn defer_cow_writes(self: &Arc<Self>, stream_writes: u64) {
        if let Layer::Qcow2(img) = &self.layers[0]
            && !self.read_only
            && !self.decoupled
            && !img.external_data
            && self.layers.len() > 1
        {
            self.fills.enable(Arc::downgrade(self), stream_writes);
        }
    }

    /// Allocating writes left to workers since the disk was opened.
    pub fn deferred_cow_writes(&self) -> u64 {
        self.fills.deferred()
    }

    fn cluster_range(&self, offset: u64, len: u64) -> (u64, u64) {
        let first = offset >> self.cluster_bits;
        let end = if len == 0 {
            first
        } else {
            ((offset + len - 1) >> self.cluster_bits) + 1
        };
        (first, end)
    }

    /// Reads guest bytes.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        let (first, end) = self.cluster_range(offset, buf.len() as u64);
        let _guard = self.lock_clusters(first, end, Mode::Shared);
        self.read_layer(0, offset, buf, IoClass::GuestData)
    }

    /// Reads `buf` at guest `offset` as layer `depth` and those below see it.
    pub(crate) fn read_layer(
        &self,
        depth: usize,
        offset: u64,
        buf: &mut [u8],
        class: IoClass,
    ) -> Result<()> {
        let Some(layer) = self.layers.get(depth) else {
            buf.fill(0);
            return Ok(());
        };
        let size = layer.size();
        let inside = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[inside..].fill(0);
        if inside == 0 {
            return Ok(());
        }
        let buf = &mut buf[..inside];
        match layer {
            Layer::Raw(r) => self
                .io
                .read(&r.handle, HostOffset(offset), buf, self.tag(class, offset))
                .map_err(|e| ImageError::io(&r.handle.name, "read", e)),
            Layer::Qcow2(img) => {
                for e in img.map(offset, inside as u64)? {
                    let rel = (e.guest - offset) as usize;
                    let part = &mut buf[rel..rel + e.len as usize];
                    let tag = self.tag(class, e.guest);
                    match e.kind {
                        ExtentKind::Data(host) if depth == 0 => {
                            self.read_top_data(img, host, e.guest, part, tag)?
                        }
                        ExtentKind::Data(host) => self
                            .io
                            .read(&img.data, host, part, tag)
                            .map_err(|err| ImageError::io(img.name(), "read", err))?,
                        ExtentKind::Zero => part.fill(0),
                        ExtentKind::Unallocated => {
                            self.read_layer(depth + 1, e.guest, part, class)?
                        }
                        ExtentKind::Compressed(d, at) => img.read_compressed(&d, at, part, tag)?,
                    }
                }
                Ok(())
            }
        }
    }

    /// Tells the layer below that the backing chain's copy of guest bytes
    /// `[offset, offset+len)` (as layer `depth` and those below see them)
    /// is masked by the top image now. A hint: a failure only loses it.
    pub(crate) fn forget_masked(&self, depth: usize, offset: u64, len: u64) {
        if !self.hints_masked {
            return;
        }
        if let Err(e) = self.forget_in_layer(depth, offset, len) {
            tracing::debug!(offset, len, error = %e, "masked-block hint lost");
        }
    }

    fn forget_in_layer(&self, depth: usize, offset: u64, len: u64) -> Result<()> {
        let Some(layer) = self.layers.get(depth) else {
            return Ok(());
        };
        let len = layer.size().saturating_sub(offset).min(len);
        if len == 0 {
            return Ok(());
        }
        let tag = self.tag(IoClass::GuestData, offset);
        let forget = |image: &ImageHandle, host: u64, len: u64| {
            self.io
                .hints()
                .forget(image, HostOffset(host), len, tag)
                .map_err(|e| ImageError::io(&image.name, "drop masked blocks", e))
        };
        match layer {
            Layer::Raw(r) => forget(&r.handle, offset, len),
            Layer::Qcow2(img) => {
                // Only what the tables in memory tell: a backing cluster
                // whose table is not at hand was not read lately through
                // this disk, and reading the table for a hint would cost
                // more than the hint saves (a write into a fresh delta
                // cluster would read the base's tables).
                let Some(extents) = img.map_if(offset, len, TableReads::Forbidden)? else {
                    return Ok(());
                };
                for e in extents {
                    match e.kind {
                        ExtentKind::Data(host) => forget(&img.data, host.0, e.len)?,
                        ExtentKind::Unallocated => {
                            self.forget_in_layer(depth + 1, e.guest, e.len)?
                        }
                        _ => {}
                    }
                }
                Ok(())
            }
        }
    }

    /// Reads allocated data of the top image at `host` (guest `guest`):
    /// ranges the layer below keeps not yet valid (a cluster whose filler
    /// was decoupled) come from the backing chain instead.
    pub(crate) fn read_top_data(
        &self,
        img: &Qcow2Image,
        host: HostOffset,
        guest: u64,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()> {
        let len = buf.len() as u64;
        let invalid = self
            .io
            .partial()
            .invalid_ranges(&img.data, host, len)
            .map_err(|e| ImageError::io(img.name(), "read", e))?;
        let mut pos = host.0;
        let end = host.0 + len;
        let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
        for (start, rlen) in invalid {
            let (s, e) = (start.max(host.0), (start + rlen).min(end));
            if s >= e {
                continue;
            }
            if s > pos {
                pieces.push((pos, s, false));
            }
            pieces.push((s, e, true));
            pos = e;
        }
        if pos < end {
            pieces.push((pos, end, false));
        }
        for (s, e, from_backing) in pieces {
            let part = &mut buf[(s - host.0) as usize..(e - host.0) as usize];
            if from_backing {
                self.read_layer(1, guest + (s - host.0), part, tag.class)?;
            } else {
                self.io
                    .read(&img.data, HostOffset(s), part, tag)
                    .map_err(|err| ImageError::io(img.name(), "read", err))?;
            }
        }
        img.overlay_held(host.0, buf);
        Ok(())
    }

    /// Metadata journal records of the top image a crash left and this
    /// open applied.
    pub fn journal_records_applied(&self) -> usize {
        match &self.layers[0] {
            Layer::Qcow2(img) => img
                .journal_replayed
                .load(std::sync::atomic::Ordering::SeqCst),
            Layer::Raw(_) => 0,
        }
    }

    /// Bytes of the top image the layer below keeps not yet valid (what
    /// filling partially valid clusters still has to copy).
    pub fn partially_valid_bytes(&self) -> Result<u64> {
        let Layer::Qcow2(img) = &self.layers[0] else {
            return Ok(0);
        };
        Ok(self.partial_ranges(img)?.iter().map(|r| r.len).sum())
    }

    fn partial_ranges(&self, img: &Qcow2Image) -> Result<Vec<PartialRange>> {
        self.io
            .partial()
            .partial_ranges(&img.data)
            .map_err(|e| ImageError::io(img.name(), "list partially valid clusters", e))
    }

    /// Lets the layer below fill this disk's partially valid clusters
    /// from the backing chain as it writes them back (see
    /// [`BackingFill`]); without it they are filled by
    /// [`Self::fill_partial`] only.
    pub fn offer_backing_fill(self: &Arc<Self>) {
        if let Layer::Qcow2(img) = &self.layers[0]
            && self.decoupled
        {
            let fill: Arc<dyn BackingFill> = self.clone();
            self.io
                .partial()
                .set_backing_fill(&img.data, Arc::downgrade(&fill));
        }
    }

    /// Fills every partially valid cluster: a cache below that was offered
    /// the backing chain fills most of them as it writes them back (each
    /// cluster read and written once, many at a time), so it writes back
    /// first; what it left is filled here.
    fn fill_after_write_back(&self) -> Result<()> {
        self.write_back_below()?;
        self.fill_partial(usize::MAX)?;
        Ok(())
    }

    /// Has a cache below write back what it holds of the top image.
    fn write_back_below(&self) -> Result<()> {
        let handle = match &self.layers[0] {
            Layer::Qcow2(img) => &img.data,
            Layer::Raw(r) => &r.handle,
        };
        self.io
            .copies()
            .write_back_image(handle)
            .map_err(|e| ImageError::io(&handle.name, "write back the cache", e))
    }

    /// Copies the not yet valid parts of partially valid clusters from the
    /// backing chain into the top image (at most `limit` ranges), so the
    /// image no longer depends on the layer below to read correctly.
    pub fn fill_partial(&self, limit: usize) -> Result<FillReport> {
        let Layer::Qcow2(img) = &self.layers[0] else {
            return Ok(FillReport::default());
        };
        let ranges = self.partial_ranges(img)?;
        let cs = img.geometry().cluster_size();
        let mut report = FillReport {
            remaining: ranges.len().saturating_sub(limit),
            ..FillReport::default()
        };
        for r in ranges.into_iter().take(limit) {
            let guest = r.guest_cluster.0 * cs + (r.offset.0 & (cs - 1));
            if guest + r.len > self.size {
                continue;
            }
            let (first, end) = self.cluster_range(guest, r.len);
            let _guard = self.lock_clusters(first, end, Mode::Exclusive);
            self.before_change()?;
            let still_mapped = img
                .map(guest, r.len)?
                .first()
                .is_some_and(|e| e.kind == ExtentKind::Data(r.offset) && e.len == r.len);
            let tag = self.tag(IoClass::CowFill, guest);
            if !still_mapped {
                // An allocation whose L2 entry never became durable (a crash
                // came first) leaves its record orphaned: nothing reads the
                // cluster through this guest address, so nothing needs filling.
                tracing::debug!(
                    image = img.name(),
                    offset = r.offset.0,
                    "dropping an orphaned partially valid record"
                );
                self.io
                    .partial()
                    .set_invalid(&img.data, r.offset, r.len, false, tag)
                    .map_err(|e| ImageError::io(img.name(), "update validity", e))?;
                continue;
            }
            img.lock().check_data_write(r.offset.0, r.len)?;
            let mut buf = vec![0u8; r.len as usize];
            self.read_layer(1, guest, &mut buf, IoClass::CowFill)?;
            self.io
                .write(&img.data, r.offset, &[WriteSegment { data: &buf, tag }])
                .map_err(|e| ImageError::io(img.name(), "fill", e))?;
            report.filled_bytes += r.len;
        }
        Ok(report)
    }

    /// Writes guest bytes; with `fua` they are durable on return.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let (first, end) = self.cluster_range(offset, data.len() as u64);
        let guard = self.lock_clusters(first, end, Mode::Exclusive);
        self.before_change()?;
        self.fills.note_write();
        // A FUA write would wait for its worker at once.
        self.write_locked(offset, data, !fua)?;
        drop(guard);
        self.after_change(fua)
    }

    /// A FUA change is flushed; a journal transaction grown big is
    /// committed without waiting for the guest's flush.
    fn after_change(&self, fua: bool) -> Result<()> {
        if fua {
            return self.flush();
        }
        if let Layer::Qcow2(img) = &self.layers[0]
            && img.journal_wants_commit()
        {
            img.commit_grown_interval()?;
        }
        Ok(())
    }

    /// Writes with the range lock held; a guest's write (`may_defer`)
    /// may leave copying on write to a worker (see `deferred`), a write
    /// that is part of another change may not (the change goes on after
    /// it, from what it wrote).
    fn write_locked(&self, offset: u64, data: &[u8], may_defer: bool) -> Result<()> {
        match &self.layers[0] {
            Layer::Raw(r) => self
                .io
                .write(
                    &r.handle,
                    HostOffset(offset),
                    &[WriteSegment {
                        data,
                        tag: self.tag(IoClass::GuestData, offset),
                    }],
                )
                .map_err(|e| ImageError::io(&r.handle.name, "write", e)),
            Layer::Qcow2(img) => self.cow_write(img, offset, data, may_defer),
        }
    }

    /// Makes a guest range read as zeros.
    pub fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_range(offset, len);
        let guard = self.lock_clusters(first, end, Mode::Exclusive);
        self.before_change()?;
        match &self.layers[0] {
            Layer::Raw(_) => self.write_zero_buffers(offset, len)?,
            Layer::Qcow2(img) => self.zero_qcow2(img, offset, len, flags.may_unmap)?,
        }
        drop(guard);
        self.after_change(flags.fua)
    }

    fn write_zero_buffers(&self, offset: u64, len: u64) -> Result<()> {
        let zeros = vec![0u8; len.min(ZERO_CHUNK) as usize];
        let mut pos = offset;
        while pos < offset + len {
            let n = (offset + len - pos).min(ZERO_CHUNK);
            self.write_locked(pos, &zeros[..n as usize], false)?;
            pos += n;
        }
        Ok(())
    }

    /// Zero writes on qcow2: whole clusters (or subclusters) become zero
    /// entries on version 3 images; everything else is written as zeros.
    fn zero_qcow2(&self, img: &Qcow2Image, offset: u64, len: u64, may_unmap: bool) -> Result<()> {
        let g = *img.geometry();
        let unit = g.subcluster_size();
        let end = offset + len;
        let aligned_start = offset.div_ceil(unit) * unit;
        let aligned_end = end / unit * unit;
        if img.format.version < 3 || aligned_start >= aligned_end {
            return self.zero_by_writing(img, offset, len);
        }
        if aligned_start > offset {
            self.zero_by_writing(img, offset, aligned_start - offset)?;
        }
        let mut fallback: Vec<(u64, u64)> = Vec::new();
        {
            let mut l = img.lock();
            l.mark_dirty_before_change()?;
            let cs = g.cluster_size();
            let mut pos = aligned_start;
            while pos < aligned_end {
                let cluster = pos / cs;
                let cend = ((cluster + 1) * cs).min(aligned_end);
                let first_sub = ((pos % cs) / unit) as u32;
                let subs = ((cend - pos) / unit) as u32;
                let mask = sub_mask(first_sub, subs);
                let old = l.l2_entry(cluster)?;
                match zeroed_mapping(
                    &old,
                    mask,
                    all_subclusters(&g),
                    may_unmap,
                    img.external_data,
                ) {
                    Some(new) if new != old => {
                        l.ensure_l2_writable(cluster)?;
                        l.set_l2_entry(cluster, &new)?;
                        if !img.external_data {
                            l.m.pending_frees.extend(released(&old, &new, &g));
                        }
                        if let L2Mapping::Standard(StandardCluster {
                            host: Some(h),
                            alloc: 0,
                            ..
                        }) = new
                        {
                            // A kept (preallocated) cluster reads zeros: none
                            // of it may be routed to the backing chain later.
                            self.io
                                .partial()
                                .set_invalid(
                                    &img.data,
                                    h,
                                    cs,
                                    false,
                                    self.tag(IoClass::GuestData, pos),
                                )
                                .map_err(|e| ImageError::io(img.name(), "update validity", e))?;
                        }
                    }
                    Some(_) => {}
                    None => fallback.push((pos, cend - pos)),
                }
                pos = cend;
            }
            l.maybe_flush_for_frees()?;
        }
        for (pos, n) in fallback {
            self.zero_by_writing(img, pos, n)?;
        }
        if end > aligned_end {
            self.zero_by_writing(img, aligned_end, end - aligned_end)?;
        }
        Ok(())
    }

    /// Writes zeros as data, skipping clusters that already read as zeros
    /// without a backing file to show through.
    fn zero_by_writing(&self, img: &Qcow2Image, offset: u64, len: u64) -> Result<()> {
        if self.layers.len() == 1 {
            let extents = img.map(offset, len)?;
            if extents
                .iter()
                .all(|e| matches!(e.kind, ExtentKind::Zero | ExtentKind::Unallocated))
            {
                return Ok(());
            }
        }
        self.write_zero_buffers(offset, len)
    }

    /// Discards whole clusters the way QEMU does: they read as zeros
    /// afterwards (version 3, or no backing file), their host space is
    /// freed, and partial clusters are left alone. On a version 2 image with
    /// a backing file discard does nothing (the format cannot hide the
    /// backing data).
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_range(offset, len);
        let guard = self.lock_clusters(first, end, Mode::Exclusive);
        self.before_change()?;
        match &self.layers[0] {
            Layer::Raw(r) => {
                // Through the I/O interface, so a cache drops its copies.
                // Advisory: a store that cannot punch holes keeps the bytes.
                let tag = self.tag(IoClass::GuestData, offset);
                let _ = self.io.discard(&r.handle, HostOffset(offset), len, tag);
            }
            Layer::Qcow2(img) => self.discard_qcow2(img, offset, len)?,
        }
        drop(guard);
        self.after_change(false)
    }

    fn discard_qcow2(&self, img: &Qcow2Image, offset: u64, len: u64) -> Result<()> {
        let g = *img.geometry();
        let has_backing = self.layers.len() > 1;
        if img.format.version < 3 && has_backing {
            return Ok(());
        }
        let cs = g.cluster_size();
        let first = offset.div_ceil(cs);
        let end_byte = offset + len;
        // The partial last cluster of an unaligned disk counts as whole.
        let end = if end_byte == self.size {
            end_byte.div_ceil(cs)
        } else {
            end_byte / cs
        };
        let mut l = img.lock();
        l.mark_dirty_before_change()?;
        for cluster in first..end {
            let old = l.l2_entry(cluster)?;
            let had_storage = !released(&old, &L2Mapping::UNALLOCATED, &g).is_empty();
            if !(has_backing || had_storage) {
                continue;
            }
            let new = if img.format.version >= 3 {
                L2Mapping::Standard(StandardCluster {
                    host: None,
                    copied: false,
                    alloc: 0,
                    zero: all_subclusters(&g),
                })
            } else {
                L2Mapping::UNALLOCATED
            };
            if new == old {
                continue;
            }
            l.ensure_l2_writable(cluster)?;
            l.set_l2_entry(cluster, &new)?;
            if !img.external_data {
                l.m.pending_frees.extend(released(&old, &new, &g));
            }
        }
        l.maybe_flush_for_frees()
    }

    /// Makes every completed write durable.
    pub fn flush(&self) -> Result<()> {
        self.flush_report().map(|_| ())
    }

    /// Flushes and says what it wrote.
    pub fn flush_report(&self) -> Result<FlushReport> {
        if self.read_only {
            return Ok(FlushReport::default());
        }
        let lost = self.fills.wait_acknowledged();
        let report = self.flush_layers()?;
        lost.map_or(Ok(report), Err)
    }

    fn flush_layers(&self) -> Result<FlushReport> {
        match &self.layers[0] {
            Layer::Raw(r) => {
                self.io
                    .flush(&r.handle, FlushKind::Durable)
                    .map_err(|e| ImageError::io(&r.handle.name, "flush", e))?;
                Ok(FlushReport {
                    barriers: 1,
                    ..FlushReport::default()
                })
            }
            Layer::Qcow2(img) => img.flush(),
        }
    }

    /// Leaves the top image complete on its own: partially valid clusters
    /// filled, everything flushed, deferred state persisted, the dirty
    /// bit cleared, and a cache below writing back what it holds of the
    /// image (which then no longer needs it).
    pub fn close(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        // A lost deferred write is reported after the rest is closed.
        let lost = self.fills.wait_acknowledged();
        match &self.layers[0] {
            Layer::Qcow2(img) => {
                self.fill_after_write_back()?;
                img.close(false)?;
            }
            Layer::Raw(r) => {
                self.flush()?;
                self.io
                    .copies()
                    .write_back_image(&r.handle)
                    .map_err(|e| ImageError::io(&r.handle.name, "write back the cache", e))?;
            }
        }
        lost.map_or(Ok(()), Err)
    }

    /// Flushes and persists deferred state like [`Self::close`], but leaves
    /// what a cache below holds there (a fast restart on this host): the
    /// image keeps needing the cache.
    pub fn close_keeping_cached(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let lost = self.fills.wait_acknowledged();
        match &self.layers[0] {
            Layer::Qcow2(img) => img.close(true)?,
            Layer::Raw(_) => self.flush()?,
        }
        lost.map_or(Ok(()), Err)
    }

    /// How `[offset, offset+len)` reads, as extents with hole/zero flags.
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<(u64, BlockState)>> {
        self.check_range(offset, len)?;
        let (first, end) = self.cluster_range(offset, len);
        self.fills.wait_clusters(first, end);
        let mut out: Vec<(u64, BlockState)> = Vec::new();
        self.status_layer(0, offset, len, &mut out)?;
        Ok(out)
    }

    fn status_layer(
        &self,
        depth: usize,
        offset: u64,
        len: u64,
        out: &mut Vec<(u64, BlockState)>,
    ) -> Result<()> {
        let push = |out: &mut Vec<(u64, BlockState)>, n: u64, s: BlockState| match out.last_mut() {
            Some((l, last)) if *last == s => *l += n,
            _ => out.push((n, s)),
        };
        let hole = BlockState {
            hole: true,
            zero: true,
            depth: self.layers.len() as u32,
        };
        let Some(layer) = self.layers.get(depth) else {
            push(out, len, hole);
            return Ok(());
        };
        let inside = layer.size().saturating_sub(offset).min(len);
        let data = |d: usize| BlockState {
            hole: false,
            zero: false,
            depth: d as u32,
        };
        match layer {
            Layer::Raw(_) => push(out, inside, data(depth)),
            Layer::Qcow2(img) if inside > 0 => {
                for e in img.map(offset, inside)? {
                    match e.kind {
                        ExtentKind::Data(_) | ExtentKind::Compressed(..) => {
                            push(out, e.len, data(depth))
                        }
                        ExtentKind::Zero => push(
                            out,
                            e.len,
                            BlockState {
                                hole: true,
                                zero: true,
                                depth: depth as u32,
                            },
                        ),
                        ExtentKind::Unallocated => {
                            self.status_layer(depth + 1, e.guest, e.len, out)?
                        }
                    }
                }
            }
            Layer::Qcow2(_) => {}
        }
        if inside < len {
            push(out, len - inside, hole);
        }
        Ok(())
    }
}

/// Subcluster mask of `count` subclusters starting at `first`.
pub(crate) fn sub_mask(first: u32, count: u32) -> u32 {
    if count >= 32 {
        u32::MAX
    } else {
        ((1u32 << count) - 1) << first
    }
}

/// Host clusters `old` references that `new` no longer does.
pub(crate) fn released(old: &L2Mapping, new: &L2Mapping, g: &vdcache_qcow2::Geometry) -> Vec<u64> {
    let new_host = match new {
        L2Mapping::Standard(s) => s.host,
        L2Mapping::Compressed(_) => None,
    };
    match old {
        L2Mapping::Compressed(d) => d.host_clusters(g).collect(),
        L2Mapping::Standard(s) => match s.host {
            Some(h) if Some(h) != new_host => vec![g.host_cluster(h)],
            _ => Vec::new(),
        },
    }
}

/// The mapping after zeroing the subclusters in `mask`; `None` when only
/// writing zeros can express it (part of a shared or compressed cluster).
fn zeroed_mapping(
    old: &L2Mapping,
    mask: u32,
    all: u32,
    may_unmap: bool,
    external_data: bool,
) -> Option<L2Mapping> {
    let whole = mask == all;
    match old {
        L2Mapping::Compressed(_) if !whole => None,
        L2Mapping::Compressed(_) => Some(zero_plain(all)),
        L2Mapping::Standard(s) => {
            let owned = s.host.is_some() && s.copied;
            if s.host.is_some() && !owned && !whole {
                return None;
            }
            let keep_host = owned && (!may_unmap || external_data || !whole);
            let new = StandardCluster {
                host: if keep_host { s.host } else { None },
                copied: keep_host,
                alloc: s.alloc & !mask,
                zero: (s.zero | mask) & all,
            };
            Some(L2Mapping::Standard(new))
        }
    }
}

fn zero_plain(all: u32) -> L2Mapping {
    L2Mapping::Standard(StandardCluster {
        host: None,
        copied: false,
        alloc: 0,
        zero: all,
    })
}

/// How often a write-back fill tries the top image's metadata lock (100 µs
/// apart) before leaving the line to the ordinary fill.
const FILL_LOCK_TRIES: usize = 50;

impl FillRunner<DeferredCow> for VirtualDisk {
    fn run_fill(&self, job: DeferredCow) -> Result<()> {
        match &self.layers[0] {
            Layer::Qcow2(img) => self.complete_fill(img, job),
            Layer::Raw(r) => Err(ImageError::corrupt(
                &r.handle.name,
                "a deferred fill of a raw image",
            )),
        }
    }
}

impl Drop for VirtualDisk {
    fn drop(&mut self) {
        self.fills.close();
    }
}

impl BackingFill for VirtualDisk {
    fn backing_bytes(
        &self,
        host: HostOffset,
        guest_cluster: GuestCluster,
        buf: &mut [u8],
    ) -> std::result::Result<bool, HostError> {
        let Layer::Qcow2(img) = &self.layers[0] else {
            return Ok(false);
        };
        let cs = img.geometry().cluster_size();
        let len = buf.len() as u64;
        let within = host.0 & (cs - 1);
        let Some(guest) = guest_cluster
            .0
            .checked_mul(cs)
            .map(|g| g + within)
            .filter(|&g| within + len <= cs && g + len <= self.size)
        else {
            return Ok(false);
        };
        // Write-back asks while it holds the cache's ranges of this
        // cluster, and a thread holding the image's metadata lock may wait
        // for those (freeing a cluster discards it through the cache):
        // waiting for the lock here could deadlock. So try for a moment,
        // then leave the line to the ordinary fill.
        let mut extents = None;
        for _ in 0..FILL_LOCK_TRIES {
            extents = img.map_if_unlocked(guest, len)?;
            if extents.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        let mapped = extents
            .as_deref()
            .and_then(<[_]>::first)
            .is_some_and(|e| e.kind == ExtentKind::Data(host) && e.len >= len);
        if !mapped {
            return Ok(false);
        }
        self.read_layer(1, guest, buf, IoClass::CowFill)?;
        Ok(true)
    }
}
