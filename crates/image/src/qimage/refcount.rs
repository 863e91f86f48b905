//! Refcounts and cluster allocation: reading and updating refcount blocks
//! through the slice cache, finding free runs, creating refcount blocks and
//! growing the refcount table when allocation reaches past what it covers.

use super::Locked;
use super::l2::Sliced;
use super::overlap::MetaKind;
use crate::error::{ImageError, Result};
use crate::hostio::MetaTable;
use std::ops::Range;
use vdcache_qcow2::geometry::MAX_HOST_OFFSET;
use vdcache_qcow2::refcount;

impl Locked<'_> {
    /// (slice start, index of the entry inside the slice) for a cluster, or
    /// `None` when its refcount block does not exist (refcount 0).
    fn refcount_position(&self, cluster: u64) -> Option<(u64, u64)> {
        let g = &self.img.geometry;
        let (ti, idx) = g.refcount_indices(cluster);
        let block = *self.m.reftable.get(ti as usize)?;
        if block == 0 {
            return None;
        }
        let order = g.refcount_order();
        let slice = self.m.refblocks.slice_size();
        let per_slice = (slice * 8) >> order;
        let slice_index = idx / per_slice;
        Some((block + slice_index * slice, idx % per_slice))
    }

    pub(crate) fn refcount(&mut self, cluster: u64) -> Result<u64> {
        let Some((start, idx)) = self.refcount_position(cluster) else {
            return Ok(0);
        };
        let tag = self.tag(MetaTable::RefcountBlock);
        self.load_slice(Sliced::Refblock, start, tag)?;
        let order = self.img.geometry.refcount_order();
        match self.m.refblocks.peek_mut(start) {
            Some(s) => Ok(refcount::get(&s.data, idx, order)),
            None => Err(ImageError::corrupt(
                self.name(),
                "refcount slice vanished from the cache",
            )),
        }
    }

    /// Sets a refcount; the cluster's refcount block must exist.
    pub(crate) fn set_refcount(&mut self, cluster: u64, value: u64) -> Result<()> {
        let Some((start, idx)) = self.refcount_position(cluster) else {
            return Err(ImageError::corrupt(
                self.name(),
                format!("no refcount block covers cluster {cluster}"),
            ));
        };
        let tag = self.tag(MetaTable::RefcountBlock);
        self.load_slice(Sliced::Refblock, start, tag)?;
        let order = self.img.geometry.refcount_order();
        let name = self.img.handle.name.clone();
        match self.m.refblocks.peek_mut(start) {
            Some(s) => {
                refcount::set(&mut s.data, idx, order, value)
                    .map_err(|e| ImageError::format(&name, e))?;
                s.dirty = true;
                Ok(())
            }
            None => Err(ImageError::corrupt(
                &name,
                "refcount slice vanished from the cache",
            )),
        }
    }

    /// Adds `delta` to a refcount, refusing to overflow or go negative.
    pub(crate) fn add_refcount(&mut self, cluster: u64, delta: i64) -> Result<u64> {
        let old = self.refcount(cluster)?;
        let new = if delta >= 0 {
            old.checked_add(delta as u64)
                .filter(|&v| v <= self.img.geometry.max_refcount())
        } else {
            old.checked_sub(delta.unsigned_abs())
        };
        let Some(new) = new else {
            return Err(ImageError::corrupt(
                self.name(),
                format!("refcount of cluster {cluster} would leave its range ({old} {delta:+})"),
            ));
        };
        self.set_refcount(cluster, new)?;
        if new == 0 && cluster < self.m.free_hint {
            self.m.free_hint = cluster;
        }
        Ok(new)
    }

    /// Allocates `n` contiguous clusters with refcount 1 and returns the first.
    pub(crate) fn alloc_clusters(&mut self, n: u64) -> Result<u64> {
        if self.img.read_only {
            return Err(ImageError::ReadOnly {
                image: self.name().to_string(),
            });
        }
        let start = self.find_free_run(n, &[])?;
        let g = self.img.geometry;
        if let Some((cluster, kind)) =
            self.m
                .map
                .conflict(&g, g.cluster_offset(start), n * g.cluster_size(), None)
        {
            return Err(self.corruption(format!(
                "refcounts say cluster {cluster} is free, but it holds the {}",
                kind.describe()
            )));
        }
        self.ensure_refcount_blocks(start..start + n)?;
        for c in start..start + n {
            self.add_refcount(c, 1)?;
        }
        self.preallocate_past(g.cluster_offset(start + n))?;
        // Whatever the clusters held before (a freed table) is gone.
        let (off, len) = (g.cluster_offset(start), n * g.cluster_size());
        self.m.l2.forget_zero(off, len);
        self.m.refblocks.forget_zero(off, len);
        // The search starts at the hint, so for one cluster everything
        // between the hint and `start` is in use: the next search may skip
        // it (without this, each allocation rescans every cluster in use).
        if start <= self.m.free_hint || n == 1 {
            self.m.free_hint = self.m.free_hint.max(start + n);
        }
        Ok(start)
    }

    /// Returns clusters allocated for an operation that then failed. Nothing
    /// references them, so the refcount can drop at once.
    pub(crate) fn release_clusters(&mut self, start: u64, n: u64) -> Result<()> {
        for c in start..start + n {
            self.add_refcount(c, -1)?;
        }
        Ok(())
    }

    /// Checks that clusters up to `end_cluster` may be used, and records
    /// that the file now extends that far.
    pub(crate) fn check_capacity(&mut self, end_cluster: u64) -> Result<()> {
        let g = &self.img.geometry;
        let end = g.cluster_offset(end_cluster);
        if end > MAX_HOST_OFFSET {
            return Err(ImageError::NoSpace {
                image: self.name().to_string(),
                capacity: MAX_HOST_OFFSET,
            });
        }
        let backend = &self.img.handle.backend;
        if !backend.can_grow() {
            let capacity = backend
                .len()
                .map_err(|e| ImageError::io(self.name(), "stat", e))?;
            if end > capacity {
                return Err(ImageError::NoSpace {
                    image: self.name().to_string(),
                    capacity,
                });
            }
        }
        self.m.file_end = self.m.file_end.max(end);
        Ok(())
    }

    /// First run of `n` free clusters at or after the free hint that does
    /// not overlap `reserved`.
    fn find_free_run(&mut self, n: u64, reserved: &[Range<u64>]) -> Result<u64> {
        let per_block = self.img.geometry.refcount_block_entries();
        let mut start = self.m.free_hint.max(1);
        let mut c = start;
        while c - start < n {
            if let Some(r) = reserved.iter().find(|r| r.contains(&c)) {
                c = r.end;
                start = c;
                continue;
            }
            if self.refcount_position(c).is_none() {
                // No refcount block: the whole block range is free, except
                // what this allocation has reserved.
                let block_end = (c / per_block + 1) * per_block;
                let next_reserved = reserved
                    .iter()
                    .filter(|r| r.start > c)
                    .map(|r| r.start)
                    .min()
                    .unwrap_or(u64::MAX);
                c = block_end.min(next_reserved).min(start + n);
                continue;
            }
            if self.refcount(c)? == 0 {
                c += 1;
            } else {
                c += 1;
                start = c;
            }
        }
        self.check_capacity(start + n)?;
        Ok(start)
    }

    /// Makes sure refcount blocks exist for every cluster in `run`, placing
    /// new blocks (and, if needed, a larger refcount table) in free clusters
    /// outside the run.
    pub(crate) fn ensure_refcount_blocks(&mut self, run: Range<u64>) -> Result<()> {
        let g = self.img.geometry;
        let per_block = g.refcount_block_entries();
        let mut reserved = vec![run.clone()];
        let mut new_blocks: Vec<(u64, u64)> = Vec::new();
        let mut todo: Vec<u64> = (run.start / per_block..=(run.end - 1) / per_block).collect();
        let mut new_table: Option<(u64, u64)> = None;
        loop {
            while let Some(ti) = todo.pop() {
                let exists = self.m.reftable.get(ti as usize).is_some_and(|&b| b != 0)
                    || new_blocks.iter().any(|&(t, _)| t == ti);
                if exists {
                    continue;
                }
                // Prefer a cluster inside the block's own range: the block then
                // describes itself and needs no other block.
                let range = ti * per_block..(ti + 1) * per_block;
                let floor = range.start.max(1).max(self.m.free_hint);
                let own = (floor..range.end).find(|c| !reserved.iter().any(|r| r.contains(c)));
                let pos = match own {
                    Some(p) => p,
                    None => self.find_free_run(1, &reserved)?,
                };
                reserved.push(pos..pos + 1);
                new_blocks.push((ti, pos));
                todo.push(pos / per_block);
            }
            let needed_entries = reserved
                .iter()
                .map(|r| (r.end - 1) / per_block + 1)
                .max()
                .unwrap_or(0);
            let capacity = new_table.map_or(self.m.reftable.len() as u64, |(_, clusters)| {
                clusters * g.cluster_size() / 8
            });
            if needed_entries <= capacity {
                break;
            }
            // Grow the table: double it, or more if the new entries need it,
            // and place it past everything reserved so far.
            let entries = needed_entries.max(self.m.reftable.len() as u64 * 2) + 1;
            let clusters = (entries * 8).div_ceil(g.cluster_size());
            if clusters * g.cluster_size() > vdcache_qcow2::header::MAX_REFCOUNT_TABLE_BYTES {
                return Err(ImageError::NoSpace {
                    image: self.name().to_string(),
                    capacity: g.cluster_offset(self.m.reftable.len() as u64 / 8 * per_block),
                });
            }
            if let Some((start, len)) = new_table {
                reserved.retain(|r| *r != (start..start + len));
            }
            let start = self.find_free_run(clusters, &reserved)?;
            reserved.push(start..start + clusters);
            todo.extend(start / per_block..=(start + clusters - 1) / per_block);
            new_table = Some((start, clusters));
        }
        self.install_refcount_blocks(&new_blocks, new_table)
    }

    /// Writes new (zeroed) refcount blocks, points the table at them, moves
    /// the table if it grew, and takes the references the new structures hold.
    fn install_refcount_blocks(
        &mut self,
        new_blocks: &[(u64, u64)],
        new_table: Option<(u64, u64)>,
    ) -> Result<()> {
        let g = self.img.geometry;
        let cs = g.cluster_size();
        let zero = vec![0u8; cs as usize];
        for &(ti, pos) in new_blocks {
            self.check_capacity(pos + 1)?;
            self.write_meta(MetaTable::RefcountBlock, g.cluster_offset(pos), &zero)?;
            if let Err(o) =
                self.m
                    .map
                    .insert(&g, g.cluster_offset(pos), cs, MetaKind::RefcountBlock(ti))
            {
                return Err(self.corruption(format!("a new refcount block: {o}")));
            }
            self.m.l2.forget_zero(g.cluster_offset(pos), cs);
            self.m.refblocks.forget_zero(g.cluster_offset(pos), cs);
            self.m.refblocks.mark_zero(g.cluster_offset(pos), cs);
        }
        if let Some((start, clusters)) = new_table {
            self.check_capacity(start + clusters)?;
            let old_off = self.m.header.refcount_table_offset;
            let old_clusters = self.m.header.refcount_table_clusters;
            if let Err(o) = self.m.map.insert(
                &g,
                g.cluster_offset(start),
                clusters * cs,
                MetaKind::RefcountTable,
            ) {
                return Err(self.corruption(format!("a new refcount table: {o}")));
            }
            self.m.reftable.resize((clusters * cs / 8) as usize, 0);
            self.m.header.refcount_table_offset = g.cluster_offset(start);
            self.m.header.refcount_table_clusters = clusters as u32;
            if self.m.reftable_moved_from.is_none() {
                self.m.reftable_moved_from = Some((old_off, old_clusters));
            }
        }
        for &(ti, pos) in new_blocks {
            self.m.reftable[ti as usize] = g.cluster_offset(pos);
            self.m.reftable_dirty.insert(ti);
        }
        self.mark_unsynced();
        for &(_, pos) in new_blocks {
            self.add_refcount(pos, 1)?;
        }
        if let Some((start, clusters)) = new_table {
            for c in start..start + clusters {
                self.add_refcount(c, 1)?;
            }
        }
        Ok(())
    }
}
