//! Making the cache's state durable: journal commits (what a guest flush
//! costs: one batch write and one sync of the cache device, shared with
//! the flushes of other disks arriving meanwhile and run outside the state
//! lock, plus a backend sync only for images that took write-through data).

use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::stats::bump;
use std::sync::MutexGuard;
use vdcache_image::{FlushKind, ImageHandle};

impl FlashCache {
    /// Syncs images holding write-through data: journal records of their
    /// clean copies must never outlive the data on the backend.
    pub(crate) fn sync_backends(&self, st: &mut State) -> Result<()> {
        for id in std::mem::take(&mut st.unsynced) {
            let Some(rec) = st.images.get(id as usize) else {
                continue;
            };
            if let Some(b) = &rec.backend {
                b.flush().map_err(CacheError::device("sync backend"))?;
                bump(&self.stats.disk(rec.disk).backend_syncs, 1);
            }
        }
        Ok(())
    }

    /// Writes pending journal entries and syncs the cache device, under the
    /// lock: for commits something else must wait for (a write that
    /// bypasses the log, reclaiming space, stopping).
    pub(crate) fn commit(&self, st: &mut State) -> Result<()> {
        st.uncommitted_dirty = false;
        let started_before = self.write_commit(st)?;
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        self.group_sync.note_durable(st.journal.next_seq);
        self.finish_inline_checkpoint(st, started_before)
    }

    /// What a commit writes before its sync: backend syncs for write-through
    /// data, summaries, the journal batch. Whether a checkpoint was in
    /// flight before the batch.
    fn write_commit(&self, st: &mut State) -> Result<bool> {
        self.sync_backends(st)?;
        // Summaries ride along with this commit's sync (they need none).
        self.write_summaries(st)?;
        let started_before = st.checkpoint_running;
        self.append_journal(st)?;
        Ok(started_before)
    }

    /// No thread writes a started checkpoint in inline mode (see the
    /// checkpoint module): one in flight before a commit's batch is written
    /// after the commit's sync.
    fn finish_inline_checkpoint(&self, st: &mut State, started_before: bool) -> Result<()> {
        if self.config.inline_background && started_before {
            self.finish_checkpoint(st)?;
        }
        Ok(())
    }

    /// A guest flush: the batch is written under the lock, the sync runs
    /// outside it and is shared with flushes arriving meanwhile (see
    /// `group_sync`). Dirty blocks stay marked uncommitted: a write
    /// bypassing the log may not rely on a sync still running.
    fn guest_commit(&self, mut st: MutexGuard<'_, State>) -> Result<()> {
        let started_before = self.write_commit(&mut st)?;
        let written = st.journal.next_seq;
        drop(st);
        self.group_sync.publish(written);
        self.group_sync
            .sync_through(written, || self.device.flush())
            .map_err(CacheError::device("sync cache device"))?;
        self.finish_inline_checkpoint(&mut self.lock(), started_before)
    }

    /// Makes recorded dirty blocks durable before a write that bypasses the
    /// log reaches a backend: the bypassing write may depend on them (an L2
    /// entry written back must not outlive the data it points to).
    pub(crate) fn commit_before_bypass(&self, st: &mut State) -> Result<()> {
        if st.uncommitted_dirty {
            self.commit(st)?;
        }
        Ok(())
    }

    /// A flush from the COW layer.
    pub(crate) fn flush_image(&self, image: &ImageHandle, kind: FlushKind) -> Result<()> {
        let mut st = self.lock();
        let id = st.by_name.get(&*image.name).copied();
        match kind {
            FlushKind::Barrier => {
                // The journal keeps order by itself; only data that went to
                // the backend needs the backend's own barrier.
                if let Some(id) = id.filter(|id| st.unsynced.contains(id)) {
                    st.unsynced.remove(&id);
                    image
                        .backend
                        .flush()
                        .map_err(CacheError::device("sync backend"))?;
                    let disk = st.images[id as usize].disk;
                    bump(&self.stats.disk(disk).backend_syncs, 1);
                }
                Ok(())
            }
            FlushKind::Durable => {
                if let Some(id) = id {
                    bump(
                        &self.stats.disk(st.images[id as usize].disk).guest_flushes,
                        1,
                    );
                }
                self.guest_commit(st)
            }
        }
    }
}
