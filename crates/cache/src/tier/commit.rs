//! Making the cache's state durable: journal commits (what a guest flush
//! costs: one batch write and one sync of the cache device, shared with
//! the flushes of other disks arriving meanwhile and run outside the state
//! lock, plus a backend sync only for images that took write-through data).

pub(crate) use super::ledger::Unsynced;
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::group_sync::GroupSync;
use crate::journal::Entry;
use crate::stats::bump;
use std::sync::{Arc, MutexGuard};
use vdcache_backend::BackendRef;
use vdcache_contract::{DiskId, FlushKind, ImageHandle};

impl FlashCache {
    /// Syncs images holding write-through data (`which`: all of them, or
    /// those the journal describes: its records of their clean copies must
    /// never outlive the data on the backend). An image stays marked until
    /// its sync succeeded.
    pub(crate) fn sync_backends(&self, st: &mut State, which: Unsynced) -> Result<()> {
        for m in marked_backends(st, which) {
            self.sync_backend(&m)?;
            m.synced(st);
        }
        if which == Unsynced::All {
            // What is left has no open store to sync.
            st.ledger.forget_all();
        }
        Ok(())
    }

    /// [`Self::sync_backends`] without the lock (a backend sync may cross
    /// the network, and every disk would wait for it). An image stays
    /// marked unless nothing was written through to it since the snapshot,
    /// so a commit meanwhile still syncs it itself.
    pub(crate) fn sync_backends_unlocked<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        which: Unsynced,
    ) -> Result<MutexGuard<'a, State>> {
        let marked = marked_backends(&st, which);
        if marked.is_empty() {
            return Ok(st);
        }
        drop(st);
        for m in &marked {
            self.sync_backend(m)?;
        }
        let mut st = self.lock();
        for m in marked {
            m.synced(&mut st);
        }
        Ok(st)
    }

    /// Syncs image `id`'s backend if it holds write-through data not yet
    /// synced, without the lock held across the sync.
    pub(crate) fn sync_image(&self, id: u16) -> Result<()> {
        let m = marked(&self.lock(), id);
        if let Some(m) = m {
            self.sync_backend(&m)?;
            m.synced(&mut self.lock());
        }
        Ok(())
    }

    /// Returns once a backend sync that started after the image's mark
    /// ran: this one, or one another flush started meanwhile.
    fn sync_backend(&self, m: &Marked) -> Result<()> {
        m.syncs
            .sync_through(m.mark, || {
                m.backend.flush()?;
                bump(&self.stats.disk(m.disk).backend_syncs, 1);
                Ok(())
            })
            .map_err(CacheError::store("sync", &*m.backend))
    }

    /// Writes pending journal entries and syncs the cache device, under the
    /// lock: for commits something else must wait for (a write that
    /// bypasses the log, reclaiming space, stopping).
    pub(crate) fn commit(&self, st: &mut State) -> Result<()> {
        let started_before = self.write_commit(st)?;
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        st.ledger.uncommitted_dirty = false;
        self.group_sync.note_durable(st.journal.next_seq);
        self.seal_synced()?;
        if self.inline_checkpoint_due(started_before) {
            self.finish_checkpoint(st)?;
        }
        Ok(())
    }

    /// What a commit writes before its sync: backend syncs for write-through
    /// data, summaries, the journal batch. Whether a checkpoint was in
    /// flight before the batch.
    fn write_commit(&self, st: &mut State) -> Result<bool> {
        self.sync_backends(st, Unsynced::All)?;
        let all = st.journal.pushed();
        self.write_commit_through(st, all)
    }

    /// [`Self::write_commit`] once the backends of the write-through data
    /// recorded before journal position `through` are synced.
    fn write_commit_through(&self, st: &mut State, through: u64) -> Result<bool> {
        // Summaries ride along with this commit's sync (they need none).
        self.write_summaries(st)?;
        let started_before = st.epochs.running();
        self.append_journal_through(st, through)?;
        Ok(started_before)
    }

    /// No thread writes a started checkpoint in inline mode (see the
    /// checkpoint module): one in flight before a commit's batch is written
    /// after the commit's sync.
    fn inline_checkpoint_due(&self, started_before: bool) -> bool {
        self.config.inline_background && started_before
    }

    /// A commit that takes the lock and gives it up for its syncs: a guest
    /// flush (`which`: all backends of write-through data), or a
    /// write-through write's unmaps (those the journal describes). Backends
    /// are synced outside the lock, the batch is written under it, and
    /// the cache device's sync runs outside it again, shared with commits
    /// arriving meanwhile (see `group_sync`). Entries recorded while the
    /// backends synced that describe data written through meanwhile stay
    /// pending (the batch then reaches only the entries recorded before the
    /// call), so it costs no second backend sync. Dirty blocks stay marked
    /// uncommitted: a write bypassing the log may not rely on a sync still
    /// running.
    pub(crate) fn commit_unlocked(&self, st: MutexGuard<'_, State>, which: Unsynced) -> Result<()> {
        let through = st.journal.pushed();
        let mut st = self.sync_backends_unlocked(st, which)?;
        // A batch written while the device syncs waits for the next sync
        // anyway: wait first, so that the commits arriving meanwhile write
        // one batch between them, not one block each.
        if self.group_sync.is_running() {
            drop(st);
            self.group_sync.wait_idle();
            st = self.lock();
        }
        // The backend sync journaled the clean copies it covered. Unless
        // what was recorded meanwhile depends on a backend, the batch takes
        // every pending entry.
        let through = if !st.ledger.has_journal_deps() {
            st.journal.pushed()
        } else {
            through
        };
        let started_before = self.write_commit_through(&mut st, through)?;
        let written = st.journal.next_seq;
        drop(st);
        self.group_sync.publish(written);
        self.group_sync
            .sync_through(written, || self.device.flush())
            .map_err(CacheError::device("sync cache device"))?;
        self.seal_synced()?;
        if self.inline_checkpoint_due(started_before) {
            self.finish_checkpoint(&mut self.lock())?;
        }
        Ok(())
    }

    /// After a sync, before the flush it serves is acknowledged: the seal
    /// says what is durable now (see `crate::seal`). It bypasses staging:
    /// it names no data block.
    pub(crate) fn seal_synced(&self) -> Result<()> {
        self.sealer
            .seal(&*self.counted, self.group_sync.durable(), 0)
    }

    /// Makes recorded dirty blocks durable before a write that bypasses the
    /// log reaches a backend: the bypassing write may depend on them (an L2
    /// entry written back must not outlive the data it points to).
    pub(crate) fn commit_before_bypass(&self, st: &mut State) -> Result<()> {
        if st.ledger.uncommitted_dirty {
            self.commit(st)?;
        }
        Ok(())
    }

    /// A flush from the COW layer.
    pub(crate) fn flush_image(&self, image: &ImageHandle, kind: FlushKind) -> Result<()> {
        let mut st = self.lock();
        let id = st.catalog.id_of(&image.name);
        match kind {
            FlushKind::Barrier => {
                // The journal keeps order by itself; only data that went to
                // the backend needs the backend's own barrier.
                if let Some(m) = id.and_then(|id| marked(&st, id)) {
                    self.sync_backend(&m)?;
                    m.synced(&mut st);
                }
                Ok(())
            }
            FlushKind::Durable => {
                let disk = id.map(|id| st.catalog.images[id as usize].disk);
                if let Some(disk) = disk {
                    bump(&self.stats.disk(disk).guest_flushes, 1);
                }
                self.commit_unlocked(st, Unsynced::All)
            }
        }
    }
}

/// An image marked unsynced, as the mark stood.
struct Marked {
    id: u16,
    mark: u64,
    disk: DiskId,
    backend: BackendRef,
    syncs: Arc<GroupSync>,
}

/// Image `id`, if marked unsynced and with an open store.
fn marked(st: &State, id: u16) -> Option<Marked> {
    let mark = st.ledger.unsynced_mark(id)?;
    let rec = st.catalog.images.get(id as usize)?;
    Some(Marked {
        id,
        mark,
        disk: rec.disk,
        backend: rec.backend.clone()?,
        syncs: rec.backend_syncs.clone(),
    })
}

impl Marked {
    /// After its backend synced: unmarked unless written through since;
    /// the clean copies of data the sync covered are journaled.
    fn synced(&self, st: &mut State) {
        for ((key, slot), c) in st.ledger.synced(self.id, self.mark) {
            // Overwritten, evicted or moved since: the index's own record
            // (an unmap, a relocation) already says what holds.
            if st.index.block(key, slot as usize) != Some(c.cbn) {
                continue;
            }
            st.journal.push(&Entry::Map {
                key,
                slot,
                cbn: c.cbn,
                guest: c.guest,
                dirty: false,
                crc: c.crc,
            });
        }
    }
}

/// The images marked unsynced that have an open store.
fn marked_backends(st: &State, which: Unsynced) -> Vec<Marked> {
    let ids = st.ledger.to_sync(which);
    ids.into_iter().filter_map(|id| marked(st, id)).collect()
}
