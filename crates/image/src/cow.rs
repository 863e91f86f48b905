//! The copy-on-write process of an allocating guest write (paper 000,
//! section 2.1): allocate a cluster in the top image, write the guest's
//! bytes together with the parts of the cluster (or, with extended L2
//! entries, of the touched subclusters) that the guest did not write, read
//! from the backing chain, then point the L2 entry at the new cluster.
//!
//! Writes into clusters the top image owns go in place. The guest's bytes
//! and the filler are separate segments of one backend write, each tagged
//! with its class. On a disk taking a stream of writes, a small write into
//! one new cluster is acknowledged once allocated and left to a worker
//! (`deferred`). Nothing here takes a range lock; callers hold it.

use crate::deferred::FillJob;
use crate::disk::{VirtualDisk, released, sub_mask};
use crate::error::{ImageError, Result};
use crate::hostio::{DCOW_BLOCK, DCOW_SECTOR, IoClass, WriteSegment};
use crate::qimage::{Locked, Piece, Placement, Qcow2Image};
use vdcache_qcow2::entries::{L2Mapping, StandardCluster, SubclusterState, all_subclusters};
use vdcache_qcow2::{Geometry, HostOffset};

/// Where a cluster's bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The cluster is owned and every touched subcluster allocated.
    InPlace(HostOffset),
    /// The cluster is owned; touched subclusters need allocating.
    Reuse(HostOffset),
    /// A new host cluster (set once allocated).
    New(Option<HostOffset>),
}

/// The plan for one guest cluster of a write.
#[derive(Debug)]
struct ClusterPlan {
    cluster: u64,
    /// Guest bytes `[lo, hi)` relative to the cluster start.
    lo: u64,
    hi: u64,
    /// Offset of `lo` in the request's buffer.
    data_at: usize,
    old: L2Mapping,
    target: Target,
    /// Bytes `[w_lo, w_hi)` of the cluster that are written.
    w_lo: u64,
    w_hi: u64,
    new: Option<L2Mapping>,
    /// Decoupled copy-on-write: only `[w_lo, w_hi)` (whole sectors around
    /// the guest's bytes) is written; the rest of the new cluster is left
    /// not yet valid in the layer below.
    decoupled: bool,
}

impl ClusterPlan {
    fn touched(&self, g: &Geometry) -> u32 {
        let sc = g.subcluster_size();
        let first = (self.lo / sc) as u32;
        let last = ((self.hi - 1) / sc) as u32;
        sub_mask(first, last - first + 1)
    }
}

/// Whether the backing chain supplies the whole cluster (nothing of it is
/// allocated or zeroed in the top image).
fn backing_supplies(old: &L2Mapping) -> bool {
    matches!(old, L2Mapping::Standard(s) if s.host.is_none() && s.alloc == 0 && s.zero == 0)
}

/// Largest write left to a worker (its bytes wait in memory meanwhile).
const MAX_DEFERRED_WRITE: u64 = 64 * 1024;

/// An allocating write a worker completes (see `deferred`): the plan of
/// its one cluster, allocated, and the guest's bytes.
pub(crate) struct DeferredCow {
    plan: ClusterPlan,
    data: Vec<u8>,
}

impl FillJob for DeferredCow {
    fn cluster(&self) -> u64 {
        self.plan.cluster
    }
}

/// One backend request of a write: where, and its segments.
type Batch<'d> = (HostOffset, Vec<WriteSegment<'d>>);

/// A write's parts placed over data the open journal interval checksums
/// ([`Placement::Over`]): the next commit waits until they are mapped
/// ([`Qcow2Image::data_written`]) or, should the write fail, reported
/// failed, which dropping this does.
struct Overwrites<'i> {
    img: &'i Qcow2Image,
    spans: Vec<(u64, u64)>,
}

impl Drop for Overwrites<'_> {
    fn drop(&mut self) {
        if !self.spans.is_empty() {
            self.img.overwrites_failed(&self.spans);
        }
    }
}

fn old_alloc_mask(old: &L2Mapping, all: u32) -> u32 {
    match old {
        L2Mapping::Compressed(_) => all,
        L2Mapping::Standard(s) => s.alloc,
    }
}

impl VirtualDisk {
    pub(crate) fn cow_write(
        &self,
        img: &Qcow2Image,
        offset: u64,
        data: &[u8],
        may_defer: bool,
    ) -> Result<()> {
        let g = *img.geometry();
        let mut plans = self.plan(img, &g, offset, data)?;
        let new_count = plans
            .iter()
            .filter(|p| matches!(p.target, Target::New(_)))
            .count() as u64;
        let first_new = if new_count > 0 {
            self.allocate(img, &g, &mut plans, new_count)?
        } else {
            None
        };
        if let [p] = plans.as_slice()
            && may_defer
            && self.deferrable(img, p)
            && let Some(plan) = plans.pop()
        {
            return self.defer(img, plan, data);
        }
        let mut overwrites = Overwrites {
            img,
            spans: Vec::new(),
        };
        let written = self
            .mark_decoupled(img, &g, &plans)
            .and_then(|()| self.write_planned(img, &g, &plans, data, &mut overwrites));
        let pieces = match written {
            Ok(pieces) => pieces,
            Err(e) => {
                if let Some(first) = first_new {
                    img.lock().release_clusters(first, new_count)?;
                }
                return Err(e);
            }
        };
        self.commit(img, &plans, &pieces, &mut overwrites)?;
        self.forget_masked_blocks(&g, &plans);
        Ok(())
    }

    /// Whether the one-cluster write `p` is left to a worker (see
    /// `deferred`): a small write into a new cluster the backing chain
    /// supplied, needing filler, on a disk taking a stream of writes.
    fn deferrable(&self, img: &Qcow2Image, p: &ClusterPlan) -> bool {
        matches!(p.target, Target::New(Some(_)))
            && !self.decoupled
            && !img.external_data
            && backing_supplies(&p.old)
            && (p.w_lo < p.lo || p.hi < p.w_hi)
            && p.hi - p.lo <= MAX_DEFERRED_WRITE
            && self.fills.wants_deferral()
    }

    /// Leaves the allocated write `plan` to a worker, with a copy of the
    /// guest's bytes; the cluster stays pending until it is done.
    fn defer(&self, img: &Qcow2Image, plan: ClusterPlan, data: &[u8]) -> Result<()> {
        let cluster = plan.cluster;
        let host = match plan.target {
            Target::New(Some(h)) => h,
            _ => return Err(ImageError::corrupt(img.name(), "unallocated write target")),
        };
        let seq = self.fills.reserve(cluster);
        let job = DeferredCow {
            plan,
            data: data.to_vec(),
        };
        if let Err(e) = self.fills.submit(seq, job) {
            self.fills.cancel(cluster);
            img.lock()
                .release_clusters(host.0 / img.geometry().cluster_size(), 1)?;
            return Err(e);
        }
        Ok(())
    }

    /// A worker's part of a deferred write: what [`Self::cow_write`] does
    /// after allocating.
    pub(crate) fn complete_fill(&self, img: &Qcow2Image, job: DeferredCow) -> Result<()> {
        let g = *img.geometry();
        let DeferredCow { plan, data } = job;
        let plans = std::slice::from_ref(&plan);
        let mut overwrites = Overwrites {
            img,
            spans: Vec::new(),
        };
        // As in `cow_write`: the cluster goes back only if nothing maps it
        // yet (a commit that fails may have set the entry).
        let pieces = match self.write_planned(img, &g, plans, &data, &mut overwrites) {
            Ok(pieces) => pieces,
            Err(e) => {
                if let Target::New(Some(host)) = plan.target
                    && let Err(release) = img.lock().release_clusters(host.0 / g.cluster_size(), 1)
                {
                    tracing::warn!(image = img.name(), "{release}");
                }
                return Err(e);
            }
        };
        self.commit(img, plans, &pieces, &mut overwrites)?;
        self.forget_masked_blocks(&g, plans);
        Ok(())
    }

    /// The backing chain's blocks the guest's bytes just replaced in
    /// clusters the top image took over: the guest reads its own copy
    /// from now on (COWCache 3.3).
    fn forget_masked_blocks(&self, g: &Geometry, plans: &[ClusterPlan]) {
        for p in plans {
            let from_backing = matches!(p.target, Target::New(_)) && backing_supplies(&p.old);
            let start = (g.cluster_offset(p.cluster) + p.lo).div_ceil(DCOW_BLOCK) * DCOW_BLOCK;
            let end = (g.cluster_offset(p.cluster) + p.hi) / DCOW_BLOCK * DCOW_BLOCK;
            if from_backing && start < end {
                self.forget_masked(1, start, end - start);
            }
        }
    }

    /// Maps every touched cluster and decides where its bytes go.
    fn plan(
        &self,
        img: &Qcow2Image,
        g: &Geometry,
        offset: u64,
        data: &[u8],
    ) -> Result<Vec<ClusterPlan>> {
        let cs = g.cluster_size();
        let sc = g.subcluster_size();
        let all = all_subclusters(g);
        let end = offset + data.len() as u64;
        let mut plans = Vec::with_capacity(((end - 1) / cs - offset / cs + 1) as usize);
        let mut l = img.lock();
        let mut pos = offset;
        while pos < end {
            let cluster = pos / cs;
            let base = cluster * cs;
            let lo = pos - base;
            let hi = (end - base).min(cs);
            let old = l.l2_entry(cluster)?;
            let mut p = ClusterPlan {
                cluster,
                lo,
                hi,
                data_at: (pos - offset) as usize,
                old,
                target: Target::New(None),
                w_lo: lo,
                w_hi: hi,
                new: None,
                decoupled: false,
            };
            let touched = p.touched(g);
            let owned = match old {
                L2Mapping::Standard(s) if s.copied => s.host,
                _ => None,
            };
            let fill = match (owned, old) {
                (Some(h), L2Mapping::Standard(s)) if touched & !s.alloc == 0 => {
                    p.target = Target::InPlace(h);
                    0
                }
                (Some(h), _) => {
                    p.target = Target::Reuse(h);
                    touched & !old_alloc_mask(&old, all)
                }
                (None, _) => touched | old_alloc_mask(&old, all),
            };
            if self.decoupled && owned.is_none() && backing_supplies(&old) {
                // Only the sectors the guest touches are written now.
                p.decoupled = true;
                p.w_lo = p.lo / DCOW_SECTOR * DCOW_SECTOR;
                p.w_hi = p.hi.div_ceil(DCOW_SECTOR) * DCOW_SECTOR;
            } else if fill != 0 {
                let first = u64::from(fill.trailing_zeros());
                let last = u64::from(31 - fill.leading_zeros());
                p.w_lo = p.lo.min(first * sc);
                p.w_hi = p.hi.max((last + 1) * sc);
            }
            if let Target::InPlace(h) = p.target {
                self.complete_invalid_edges(img, &mut p, h)?;
            }
            if !matches!(p.target, Target::InPlace(_)) {
                l.mark_dirty_before_change()?;
                l.ensure_l2_writable(cluster)?;
                let alloc = match p.target {
                    Target::Reuse(_) => old_alloc_mask(&old, all) | touched,
                    _ => fill,
                };
                let zero = match old {
                    L2Mapping::Standard(s) => s.zero & !alloc,
                    L2Mapping::Compressed(_) => 0,
                };
                p.new = Some(L2Mapping::Standard(StandardCluster {
                    host: owned,
                    copied: true,
                    alloc,
                    zero,
                }));
            }
            plans.push(p);
            pos = base + hi;
        }
        Ok(plans)
    }

    /// An in-place write that only partly covers a sector the layer below
    /// keeps not yet valid must write the whole sector (its other bytes
    /// from the backing chain), or the sector would stay invalid and lose
    /// the guest's bytes.
    fn complete_invalid_edges(
        &self,
        img: &Qcow2Image,
        p: &mut ClusterPlan,
        host: HostOffset,
    ) -> Result<()> {
        let (lo_b, hi_b) = (
            p.lo / DCOW_SECTOR * DCOW_SECTOR,
            p.hi.div_ceil(DCOW_SECTOR) * DCOW_SECTOR,
        );
        if lo_b == p.lo && hi_b == p.hi {
            return Ok(());
        }
        let invalid = self
            .io
            .partial()
            .invalid_ranges(&img.data, HostOffset(host.0 + lo_b), hi_b - lo_b)
            .map_err(|e| ImageError::io(img.name(), "read validity", e))?;
        let covers = |at: u64| {
            invalid
                .iter()
                .any(|&(s, l)| (s..s + l).contains(&(host.0 + at)))
        };
        if p.lo != lo_b && covers(lo_b) {
            p.w_lo = p.w_lo.min(lo_b);
        }
        if p.hi != hi_b && covers(hi_b - 1) {
            p.w_hi = p.w_hi.max(hi_b);
        }
        Ok(())
    }

    /// Records, for decoupled plans, which blocks of the new clusters hold
    /// no data yet (before anything points at the clusters): every block
    /// the write does not cover whole; the write then makes the sectors it
    /// covers valid.
    fn mark_decoupled(&self, img: &Qcow2Image, g: &Geometry, plans: &[ClusterPlan]) -> Result<()> {
        for p in plans.iter().filter(|p| p.decoupled) {
            let Target::New(Some(host)) = p.target else {
                continue;
            };
            let tag = self.tag(IoClass::CowFill, g.cluster_offset(p.cluster));
            let mark = |start: u64, end: u64, invalid: bool| {
                self.io
                    .partial()
                    .set_invalid(
                        &img.data,
                        HostOffset(host.0 + start),
                        end - start,
                        invalid,
                        tag,
                    )
                    .map_err(|e| ImageError::io(img.name(), "record partially valid cluster", e))
            };
            // The cluster is freshly allocated: whatever an earlier use of
            // it left recorded is void.
            mark(0, g.cluster_size(), false)?;
            let head_end = p.w_lo.div_ceil(DCOW_BLOCK) * DCOW_BLOCK;
            let tail_start = p.w_hi / DCOW_BLOCK * DCOW_BLOCK;
            for (start, end) in [(0, head_end), (tail_start, g.cluster_size())] {
                if end > start {
                    mark(start, end, true)?;
                }
            }
        }
        Ok(())
    }

    /// Gives every `New` plan a host cluster: one contiguous run, so a
    /// sequential write stays one backend request.
    fn allocate(
        &self,
        img: &Qcow2Image,
        g: &Geometry,
        plans: &mut [ClusterPlan],
        count: u64,
    ) -> Result<Option<u64>> {
        let first = if img.external_data {
            None
        } else {
            Some(img.lock().alloc_clusters(count)?)
        };
        let mut next = first;
        for p in plans
            .iter_mut()
            .filter(|p| matches!(p.target, Target::New(_)))
        {
            let host = match next {
                Some(c) => {
                    next = Some(c + 1);
                    HostOffset(g.cluster_offset(c))
                }
                None => HostOffset(g.cluster_offset(p.cluster)),
            };
            p.target = Target::New(Some(host));
            if let Some(L2Mapping::Standard(s)) = &mut p.new {
                s.host = Some(host);
            }
        }
        Ok(first)
    }

    /// Reads the filler, then writes guest bytes and filler; plans whose
    /// host ranges touch are merged into one backend request. With the
    /// metadata journal on, a plan's bytes may be held for the journal
    /// instead (see `qimage::journal`), and the record the next flush
    /// needs may be written alongside. Returns the checksummed pieces of
    /// what was written in place, for the journal once it is mapped.
    fn write_planned(
        &self,
        img: &Qcow2Image,
        g: &Geometry,
        plans: &[ClusterPlan],
        data: &[u8],
        overwrites: &mut Overwrites<'_>,
    ) -> Result<Vec<Piece>> {
        let fills: Vec<(Vec<u8>, Vec<u8>)> = plans
            .iter()
            .map(|p| self.read_fill(img, g, p))
            .collect::<Result<_>>()?;
        let (batches, pieces) = self.batches(img, g, plans, &fills, data, overwrites)?;
        let mappings: Vec<(u64, L2Mapping)> = plans
            .iter()
            .filter_map(|p| Some((p.cluster, p.new?)))
            .collect();
        let write_data = || {
            batches
                .iter()
                .try_for_each(|(at, segments)| self.flush_batch(img, *at, segments))
        };
        match img.eager_record(&mappings, &pieces)? {
            None => write_data()?,
            Some(mut record) => {
                let recording = record.start(img);
                let written = write_data();
                img.eager_written(record, recording.join());
                written?;
            }
        }
        Ok(pieces)
    }

    /// The backend requests of a write (plans whose host ranges touch
    /// merged into one), and the pieces the journal checksums; plans whose
    /// bytes the journal holds are in neither.
    fn batches<'d>(
        &self,
        img: &Qcow2Image,
        g: &Geometry,
        plans: &[ClusterPlan],
        fills: &'d [(Vec<u8>, Vec<u8>)],
        data: &'d [u8],
        overwrites: &mut Overwrites<'_>,
    ) -> Result<(Vec<Batch<'d>>, Vec<Piece>)> {
        let mut pieces = Vec::new();
        let mut batches: Vec<Batch<'d>> = Vec::new();
        let mut batch_end = 0u64;
        for (p, (head, tail)) in plans.iter().zip(fills) {
            let host = match p.target {
                Target::InPlace(h) | Target::Reuse(h) | Target::New(Some(h)) => h,
                Target::New(None) => {
                    return Err(ImageError::corrupt(img.name(), "unallocated write target"));
                }
            };
            let base = g.cluster_offset(p.cluster);
            let start = host.0 + p.w_lo;
            let mut segments = Vec::with_capacity(3);
            if !head.is_empty() {
                segments.push(WriteSegment {
                    data: head,
                    tag: self.tag(IoClass::CowFill, base),
                });
            }
            let len = (p.hi - p.lo) as usize;
            segments.push(WriteSegment {
                data: &data[p.data_at..p.data_at + len],
                tag: self.tag(IoClass::GuestData, base + p.lo),
            });
            if !tail.is_empty() {
                segments.push(WriteSegment {
                    data: tail,
                    tag: self.tag(IoClass::CowFill, base + p.hi),
                });
            }
            let maps_new = !matches!(p.target, Target::InPlace(_));
            let Some(written) = self.goes_in_place(img, start, &segments, maps_new, overwrites)?
            else {
                continue;
            };
            pieces.extend(written);
            match batches.last_mut() {
                Some((_, batch)) if start == batch_end => batch.extend(segments),
                _ => batches.push((HostOffset(start), segments)),
            }
            batch_end = host.0 + p.w_hi;
        }
        Ok((batches, pieces))
    }

    /// Whether a plan's bytes are written in place now (with the pieces
    /// the journal checksums once they are), or held by the journal
    /// (`None`). A write too big to hold waits for the records that need
    /// the old bytes to be proven by two commits, unless parts of this
    /// write wait to be mapped first (those commits would wait for them).
    fn goes_in_place(
        &self,
        img: &Qcow2Image,
        at: u64,
        segments: &[WriteSegment<'_>],
        maps_new: bool,
        overwrites: &mut Overwrites<'_>,
    ) -> Result<Option<Vec<Piece>>> {
        let placement = match img.place_data(at, segments, maps_new, false) {
            Placement::ProveFirst if overwrites.spans.is_empty() => {
                img.commit()?;
                img.commit()?;
                img.place_data(at, segments, maps_new, true)
            }
            Placement::ProveFirst => img.place_data(at, segments, maps_new, true),
            p => p,
        };
        Ok(match placement {
            Placement::InPlace(pieces) => Some(pieces),
            Placement::Over(pieces) => {
                let len: usize = segments.iter().map(|s| s.data.len()).sum();
                overwrites.spans.push((at, at + len as u64));
                Some(pieces)
            }
            Placement::Held | Placement::ProveFirst => None,
        })
    }

    fn flush_batch(
        &self,
        img: &Qcow2Image,
        at: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<()> {
        self.io
            .write(&img.data, at, segments)
            .map_err(|e| ImageError::io(img.name(), "write", e))
    }

    /// The old contents of `[w_lo, lo)` and `[hi, w_hi)`: the filler. Both
    /// parts are read in one request when both are needed.
    fn read_fill(
        &self,
        img: &Qcow2Image,
        g: &Geometry,
        p: &ClusterPlan,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let head_len = (p.lo - p.w_lo) as usize;
        let tail_len = (p.w_hi - p.hi) as usize;
        if head_len == 0 && tail_len == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let base = g.cluster_offset(p.cluster);
        if head_len > 0 && tail_len > 0 {
            let mut all = vec![0u8; (p.w_hi - p.w_lo) as usize];
            self.read_old(img, g, p, base + p.w_lo, &mut all)?;
            let tail = all[all.len() - tail_len..].to_vec();
            all.truncate(head_len);
            return Ok((all, tail));
        }
        let mut head = vec![0u8; head_len];
        let mut tail = vec![0u8; tail_len];
        if head_len > 0 {
            self.read_old(img, g, p, base + p.w_lo, &mut head)?;
        }
        if tail_len > 0 {
            self.read_old(img, g, p, base + p.hi, &mut tail)?;
        }
        Ok((head, tail))
    }

    /// What the guest saw at `guest..guest+buf.len()` before this write
    /// (inside one cluster), read as copy-on-write filler.
    fn read_old(
        &self,
        img: &Qcow2Image,
        g: &Geometry,
        p: &ClusterPlan,
        guest: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let base = g.cluster_offset(p.cluster);
        let tag = self.tag(IoClass::CowFill, guest);
        let s = match p.old {
            L2Mapping::Compressed(d) => return img.read_compressed(&d, guest - base, buf, tag),
            L2Mapping::Standard(s) => s,
        };
        let sc = g.subcluster_size();
        let mut pos = guest;
        let end = guest + buf.len() as u64;
        while pos < end {
            let sub = ((pos - base) / sc) as u32;
            let state = s.state(sub);
            // Extend over following subclusters in the same state.
            let mut run_end = base + (u64::from(sub) + 1) * sc;
            while run_end < end && s.state(((run_end - base) / sc) as u32) == state {
                run_end += sc;
            }
            let run_end = run_end.min(end);
            let part = &mut buf[(pos - guest) as usize..(run_end - guest) as usize];
            match (state, s.host) {
                (SubclusterState::Allocated, Some(h)) => {
                    self.read_top_data(img, HostOffset(h.0 + (pos - base)), pos, part, tag)?
                }
                (SubclusterState::Unallocated, _) => {
                    self.read_layer(1, pos, part, IoClass::CowFill)?
                }
                _ => part.fill(0),
            }
            pos = run_end;
        }
        Ok(())
    }

    /// Points L2 entries at the written clusters and queues the release of
    /// the clusters they replaced.
    fn commit(
        &self,
        img: &Qcow2Image,
        plans: &[ClusterPlan],
        pieces: &[Piece],
        overwrites: &mut Overwrites<'_>,
    ) -> Result<()> {
        if plans.iter().all(|p| p.new.is_none()) && pieces.is_empty() {
            return Ok(());
        }
        let g = *img.geometry();
        let mut l: Locked<'_> = img.lock();
        Qcow2Image::data_written(&mut l, pieces, std::mem::take(&mut overwrites.spans).len());
        // The data just written must be durable before these entries are.
        l.mark_unsynced();
        for p in plans {
            let Some(new) = &p.new else { continue };
            l.set_l2_entry(p.cluster, new)?;
            if !img.external_data {
                let freed = released(&p.old, new, &g);
                l.m.pending_frees.extend(freed);
            }
        }
        l.maybe_flush_for_frees()
    }
}
