//! Writing metadata back in an order that keeps the image consistent
//! through a crash at any point:
//!
//! 1. guest data and new tables, then a barrier, before any L2 entry that
//!    points to them;
//! 2. refcount blocks, a barrier, refcount table entries (and a moved
//!    table's header fields), a barrier — all before the L2 entries that
//!    use the clusters (skipped with lazy refcounts: the dirty bit is set and
//!    refcounts are rebuilt after a crash);
//! 3. L2 slices, a barrier, then L1 entries;
//! 4. a final barrier for the guest's flush; only then are queued refcount
//!    decrements applied, because nothing durable references those clusters
//!    any more.

use super::Locked;
use super::l2::Sliced;
use crate::error::{ImageError, Result};
use crate::hostio::{FlushKind, IoClass, IoTag, MetaTable};
use vdcache_qcow2::HostOffset;
use vdcache_qcow2::header::field_offset;

/// What one flush wrote, for tests and statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushReport {
    pub barriers: u32,
    pub l2_slices: u32,
    pub refcount_slices: u32,
    pub l1_sectors: u32,
}

/// What a durable sync covers, noted under the lock before it starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncTicket {
    /// Frees queued so far, counted from the image's open.
    frees: u64,
    unsynced_marks: u64,
}

/// Queued frees beyond this many trigger an internal flush, so that a guest
/// that discards without flushing does not grow the file without bound.
pub(crate) const MAX_PENDING_FREES: usize = 16384;

impl super::Qcow2Image {
    /// A guest flush. The durable sync runs without the metadata lock, so
    /// the disk's reads and writes go on while it takes its time; what it
    /// covers was fixed under the lock before it.
    pub(crate) fn flush(&self) -> Result<FlushReport> {
        if self.lock().journaling() {
            return self.commit();
        }
        let (mut report, ticket) = self.lock().write_back_metadata(false)?;
        self.io
            .flush(&self.handle, FlushKind::Durable)
            .map_err(|e| ImageError::io(self.name(), "flush", e))?;
        report.barriers += 1;
        self.lock().sync_done(ticket)?;
        Ok(report)
    }
}

impl Locked<'_> {
    /// Whether refcounts must be durable before L2 entries that use them.
    /// (A journal transaction logs refcounts with everything else.)
    fn ordered_refcounts(&self) -> bool {
        self.journaling() || !(self.img.lazy_refcounts && self.m.dirty_on_disk)
    }

    /// Writes dirty refcount slices and table entries. Returns whether
    /// anything was written (the caller then needs a barrier before L2).
    pub(crate) fn persist_refcounts(&mut self) -> Result<bool> {
        let mut wrote = false;
        for start in self.m.refblocks.dirty_slices() {
            self.write_back_slice(Sliced::Refblock, start)?;
            wrote = true;
        }
        if self.m.reftable_dirty.is_empty() && self.m.reftable_moved_from.is_none() {
            return Ok(wrote);
        }
        self.barrier()?;
        let table_off = self.m.header.refcount_table_offset;
        if let Some((old_off, old_clusters)) = self.m.reftable_moved_from.take() {
            let bytes: Vec<u8> = self
                .m
                .reftable
                .iter()
                .flat_map(|e| e.to_be_bytes())
                .collect();
            self.write_meta(MetaTable::RefcountTable, table_off, &bytes)?;
            self.barrier()?;
            let mut fields = Vec::with_capacity(12);
            fields.extend_from_slice(&table_off.to_be_bytes());
            fields.extend_from_slice(&self.m.header.refcount_table_clusters.to_be_bytes());
            self.write_meta(
                MetaTable::Header,
                field_offset::REFCOUNT_TABLE_OFFSET,
                &fields,
            )?;
            let g = self.img.geometry;
            let cs = g.cluster_size();
            let old_len = u64::from(old_clusters) * cs;
            self.m.map.remove(
                &g,
                old_off,
                old_len,
                super::overlap::MetaKind::RefcountTable,
            );
            for c in 0..u64::from(old_clusters) {
                self.m.pending_frees.push(old_off / cs + c);
            }
            self.m.reftable_dirty.clear();
        } else {
            let dirty = std::mem::take(&mut self.m.reftable_dirty);
            self.write_entries(MetaTable::RefcountTable, table_off, &dirty, |m, i| {
                m.reftable[i]
            })?;
        }
        Ok(true)
    }

    /// Writes the 512-byte sectors of a table that hold the given entries.
    fn write_entries(
        &mut self,
        table: MetaTable,
        table_off: u64,
        dirty: &std::collections::BTreeSet<u64>,
        entry: impl Fn(&super::Meta, usize) -> u64,
    ) -> Result<u32> {
        let mut sectors: Vec<u64> = dirty.iter().map(|i| i / 64).collect();
        sectors.dedup();
        for &s in &sectors {
            let first = (s * 64) as usize;
            let len = self.table_len(table);
            let last = (first + 64).min(len);
            let bytes: Vec<u8> = (first..last)
                .flat_map(|i| entry(&self.m, i).to_be_bytes())
                .collect();
            self.write_meta(table, table_off + s * 512, &bytes)?;
        }
        Ok(sectors.len() as u32)
    }

    fn table_len(&self, table: MetaTable) -> usize {
        match table {
            MetaTable::L1 => self.m.l1.len(),
            _ => self.m.reftable.len(),
        }
    }

    /// Writes back one dirty L2 slice under memory pressure, with the
    /// ordering of steps 1 and 2.
    pub(crate) fn write_back_l2_slice(&mut self, start: u64) -> Result<()> {
        if self.has_unsynced_writes() {
            self.barrier()?;
        }
        if self.ordered_refcounts() && self.persist_refcounts()? {
            self.barrier()?;
        }
        self.write_back_slice(Sliced::L2, start)
    }

    /// Writes all dirty metadata in order and makes everything durable,
    /// under the lock throughout. `closing` also persists refcounts that
    /// lazy refcounting deferred.
    pub(crate) fn flush_all(&mut self, closing: bool) -> Result<FlushReport> {
        let (mut report, ticket) = self.write_back_metadata(closing)?;
        self.sync(FlushKind::Durable)?;
        report.barriers += 1;
        self.sync_done(ticket)?;
        if closing {
            // The decrements just applied (and any frees a moved refcount
            // table queued) must reach the file too: nothing durable
            // references those clusters any more.
            while self.persist_refcounts()? || !self.m.pending_frees.is_empty() {
                self.barrier()?;
                let all = self.sync_ticket();
                self.apply_pending_frees(all)?;
            }
            self.sync(FlushKind::Durable)?;
        }
        Ok(report)
    }

    /// The first half of a flush: dirty metadata written back in order,
    /// with the barriers it needs. What the durable sync that must follow
    /// covers.
    pub(crate) fn write_back_metadata(
        &mut self,
        closing: bool,
    ) -> Result<(FlushReport, SyncTicket)> {
        let mut report = FlushReport::default();
        let l2_dirty = self.m.l2.dirty_slices();
        let meta_pending = !l2_dirty.is_empty() || !self.m.l1_dirty.is_empty();
        if self.has_unsynced_writes() && meta_pending {
            self.barrier()?;
            report.barriers += 1;
        }
        if self.ordered_refcounts() || closing {
            report.refcount_slices = self.m.refblocks.dirty_slices().len() as u32;
            if self.persist_refcounts()? && meta_pending {
                self.barrier()?;
                report.barriers += 1;
            }
        }
        for start in &l2_dirty {
            self.write_back_slice(Sliced::L2, *start)?;
        }
        report.l2_slices = l2_dirty.len() as u32;
        if !self.m.l1_dirty.is_empty() {
            if !l2_dirty.is_empty() {
                self.barrier()?;
                report.barriers += 1;
            }
            let dirty = std::mem::take(&mut self.m.l1_dirty);
            let off = self.m.header.l1_table_offset;
            report.l1_sectors = self.write_entries(MetaTable::L1, off, &dirty, |m, i| m.l1[i])?;
        }
        Ok((report, self.sync_ticket()))
    }

    /// What a durable sync starting now covers.
    fn sync_ticket(&self) -> SyncTicket {
        SyncTicket {
            frees: self.m.frees_applied + self.m.pending_frees.len() as u64,
            unsynced_marks: self.m.unsynced_marks,
        }
    }

    /// The second half of a flush, after its durable sync (which may have
    /// run without the lock): the frees it covers are applied, and the
    /// writes counted when it started count as synced.
    pub(crate) fn sync_done(&mut self, ticket: SyncTicket) -> Result<()> {
        self.m.synced_marks = self.m.synced_marks.max(ticket.unsynced_marks);
        self.apply_pending_frees(ticket)
    }

    /// Drops the references that durable metadata no longer holds (the
    /// frees queued before `ticket` was taken, unless another flush
    /// applied them already), and hands freed space back to the store.
    fn apply_pending_frees(&mut self, ticket: SyncTicket) -> Result<()> {
        let due = ticket.frees.saturating_sub(self.m.frees_applied);
        let due = (due as usize).min(self.m.pending_frees.len());
        let frees: Vec<u64> = self.m.pending_frees.drain(..due).collect();
        self.m.frees_applied += due as u64;
        let cs = self.img.geometry.cluster_size();
        for c in frees {
            if self.add_refcount(c, -1)? == 0 {
                self.m.map.forget(c);
                if let Some(j) = self.m.journal.as_mut() {
                    j.cluster_freed(c * cs, cs);
                }
                let tag = IoTag {
                    class: IoClass::Reclaim,
                    disk: self.img.disk,
                    guest_cluster: None,
                    unit: None,
                };
                // Reclaiming space is advisory; a store without discard
                // support keeps the bytes.
                let _ = self
                    .img
                    .io
                    .discard(&self.img.handle, HostOffset(c * cs), cs, tag);
            }
        }
        Ok(())
    }

    /// Flushes internally when too many frees wait, bounding file growth.
    pub(crate) fn maybe_flush_for_frees(&mut self) -> Result<()> {
        // With the journal on, the caller commits once the lock is free
        // (`Qcow2Image::journal_wants_commit`).
        if self.m.pending_frees.len() > MAX_PENDING_FREES && !self.journaling() {
            self.flush_all(false)?;
        }
        Ok(())
    }

    /// Sets the dirty bit before the session's first metadata change
    /// (version 3 images): a crash may then leave refcounts that are too
    /// high (a cluster allocated whose L2 entry never landed: a leak), or,
    /// with lazy refcounts, too low, and the next writable open (vdcache's
    /// or QEMU's) rebuilds them before anything else. A clean close clears
    /// it. A journaled image needs none: its journal names what to redo.
    pub(crate) fn mark_dirty_before_change(&mut self) -> Result<()> {
        if !self.m.dirty_on_disk && self.m.header.version >= 3 && !self.journaling() {
            self.set_dirty_bit(true)?;
        }
        Ok(())
    }

    pub(crate) fn io_error(
        &self,
        op: &'static str,
        e: impl Into<vdcache_contract::HostError>,
    ) -> ImageError {
        ImageError::io(self.name(), op, e)
    }
}
