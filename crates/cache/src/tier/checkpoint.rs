//! Checkpoints: the whole index written into the slot that does not hold
//! the newest durable checkpoint, so replay starts later and the journal
//! ring can be reused.
//!
//! A checkpoint is taken under the state lock (the pending entries written
//! as a batch, a snapshot of the index, the journal's mark) and written
//! outside it by the checkpoint thread: two syncs of the cache device that
//! may wait for every page written since the last one. Meanwhile the
//! journal goes on in the new checkpoint's epoch; a writer waits only when
//! the ring has no room left. Replay from the older checkpoint follows the
//! journal into that epoch, so a checkpoint that never lands loses nothing.
//! Without background threads (`inline_background`) a later journal write
//! writes a started checkpoint, deterministically: for even epochs the
//! next one, before its batch; for odd ones the next commit, after its
//! sync. So crash sweeps see both a checkpoint racing the blocks it names
//! and the journal running ahead of a checkpoint.
//!
//! Epochs: batches carry the tag of the newest checkpoint started. One
//! epoch past the durable checkpoint may be in flight; a checkpoint that
//! failed is retried in its own epoch, synchronously. Recovery starts its
//! run two epochs past the checkpoint it loaded.
//!
//! Lock order: `state`, then the checkpointer's `progress`. The thread
//! never holds `progress` while it takes `state`.
//!
//! This module must not interpret the index beyond encoding it.

use super::commit::Unsynced;
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::journal::{CheckpointMark, Reader, write_checkpoint};
use crate::layout::LINE_BLOCKS;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

/// A snapshot to write.
pub(crate) struct Job {
    mark: CheckpointMark,
    payload: Vec<u8>,
}

enum Progress {
    Idle,
    /// Started, waiting for the thread (or a writer out of ring room).
    Queued(Job),
    Writing,
    Written(Result<CheckpointMark>),
}

struct Slot {
    progress: Progress,
    stop: bool,
}

/// Hands checkpoints from the state lock to whoever writes them.
pub(crate) struct Checkpointer {
    /// A leaf lock, taken under the state lock or alone (see the lock
    /// order in the tier's module doc).
    slot: Mutex<Slot>,
    changed: Condvar,
}

impl Default for Checkpointer {
    fn default() -> Self {
        Checkpointer {
            slot: Mutex::new(Slot {
                progress: Progress::Idle,
                stop: false,
            }),
            changed: Condvar::new(),
        }
    }
}

impl Checkpointer {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Slot>) -> MutexGuard<'a, Slot> {
        self.changed.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    fn queue(&self, job: Job) {
        self.lock().progress = Progress::Queued(job);
        self.changed.notify_all();
    }

    fn set(&self, progress: Progress) {
        self.lock().progress = progress;
        self.changed.notify_all();
    }

    /// Asks the thread to end once it is idle.
    pub(crate) fn stop(&self) {
        self.lock().stop = true;
        self.changed.notify_all();
    }

    /// The next job for the thread; None when it should end.
    fn next_job(&self) -> Option<Job> {
        let mut g = self.lock();
        loop {
            match std::mem::replace(&mut g.progress, Progress::Writing) {
                Progress::Queued(job) => return Some(job),
                other => g.progress = other,
            }
            if g.stop {
                return None;
            }
            g = self.wait(g);
        }
    }

    /// The outcome of the checkpoint in flight: writes it when nobody has
    /// taken it yet, waits while the thread writes it.
    fn outcome(
        &self,
        write: impl FnOnce(&Job) -> Result<CheckpointMark>,
    ) -> Result<CheckpointMark> {
        let mut g = self.lock();
        loop {
            match std::mem::replace(&mut g.progress, Progress::Idle) {
                Progress::Queued(job) => {
                    g.progress = Progress::Writing;
                    drop(g);
                    let result = write(&job);
                    self.set(Progress::Idle);
                    return result;
                }
                Progress::Writing => {
                    g.progress = Progress::Writing;
                    g = self.wait(g);
                }
                Progress::Written(result) => return result,
                Progress::Idle => {
                    return Err(CacheError::Corrupt(
                        "a checkpoint was recorded as started but none is in flight".into(),
                    ));
                }
            }
        }
    }

    /// The outcome the thread left, if nobody has taken it.
    fn take_written(&self) -> Option<Result<CheckpointMark>> {
        let mut g = self.lock();
        match std::mem::replace(&mut g.progress, Progress::Idle) {
            Progress::Written(result) => Some(result),
            other => {
                g.progress = other;
                None
            }
        }
    }
}

pub(super) fn start(cache: &Arc<FlashCache>) {
    let checkpointer = cache.checkpointer.clone();
    FlashCache::spawn_background(
        cache,
        "vdcache-checkpoint",
        &cache.checkpoint_thread,
        move |weak| run(&weak, &checkpointer),
    );
}

fn run(weak: &Weak<FlashCache>, checkpointer: &Checkpointer) {
    while let Some(job) = checkpointer.next_job() {
        let Some(cache) = weak.upgrade() else { return };
        checkpointer.set(Progress::Written(cache.write_job(&job)));
        let mut st = cache.lock();
        if let Some(result) = checkpointer.take_written()
            && let Err(e) = cache.checkpoint_landed(&mut st, result)
        {
            tracing::error!("writing a checkpoint failed (the next one is synchronous): {e}");
        }
    }
}

impl FlashCache {
    /// Writes the pending journal entries (not synced). Starts a checkpoint
    /// when the journal since the last one reached the interval; waits for
    /// the one in flight only when the ring has no room.
    pub(crate) fn append_journal(&self, st: &mut State) -> Result<()> {
        let all = st.journal.pushed();
        self.append_journal_through(st, all)
    }

    /// [`Self::append_journal`], where a batch written now need only reach
    /// journal position `through` (a guest flush leaves later entries, of
    /// write-through data its backend sync did not cover, pending).
    pub(crate) fn append_journal_through(&self, st: &mut State, through: u64) -> Result<()> {
        if !st.epochs.running() && !st.epochs.settled() {
            // The last checkpoint failed, and a synchronous one that failed
            // had dropped the pending entries it was to capture: until a
            // checkpoint lands, no commit may count as durable.
            return self.checkpoint(st);
        }
        if st.journal.pending_bytes() == 0 {
            return Ok(());
        }
        st.journal.note_durable(self.group_sync.durable());
        if self.config.inline_background
            && st.epochs.running()
            && st.epochs.epoch().is_multiple_of(2)
        {
            self.finish_checkpoint(st)?;
        }
        if st.epochs.running() && !st.journal.has_room() {
            self.counted.note_checkpoint_wait();
            self.finish_checkpoint(st)?;
        }
        let room = st.journal.has_room();
        let due = !room || st.journal.needs_checkpoint(self.checkpoint_interval());
        if st.epochs.running() || !due {
            let written = st.journal.write_pending_through(&*self.device, through);
            if written.is_err() && self.config.test_forget_failed_batches {
                st.journal.drop_pending();
            }
            written?;
        } else if room && st.epochs.settled() {
            let job = self.begin_checkpoint(st)?;
            st.epochs.started();
            self.checkpointer.queue(job);
        } else {
            // No room, or the last checkpoint failed: write one now.
            self.checkpoint(st)?;
        }
        Ok(())
    }

    /// Journal bytes between checkpoints.
    fn checkpoint_interval(&self) -> u64 {
        let half = self.layout.journal_bytes / 2;
        self.config
            .checkpoint_interval_bytes
            .map_or(half, |b| b.clamp(crate::layout::BLOCK, half))
    }

    /// Writes a checkpoint now, under the lock (after the one in flight):
    /// when opening, stopping, or retrying one that failed.
    pub(crate) fn checkpoint(&self, st: &mut State) -> Result<()> {
        self.finish_checkpoint(st)?;
        let job = self.begin_checkpoint(st)?;
        let result = self.write_job(&job);
        if result.is_ok() {
            // Every record and block before the mark is durable, and
            // nothing was written after it.
            st.ledger.uncommitted_dirty = false;
        }
        self.checkpoint_landed(st, result)
    }

    /// Waits for (or writes) the checkpoint in flight, if any.
    pub(crate) fn finish_checkpoint(&self, st: &mut State) -> Result<()> {
        if !st.epochs.running() {
            return Ok(());
        }
        let result = self.checkpointer.outcome(|job| self.write_job(job));
        self.checkpoint_landed(st, result)
    }

    /// Under the lock: the pending entries go out as the old epoch's last
    /// batch (later batches describe changes to the snapshot, so replay
    /// from the older checkpoint needs every entry before it), then the
    /// snapshot and the mark.
    fn begin_checkpoint(&self, st: &mut State) -> Result<Job> {
        self.sync_backends(st, Unsynced::Indexed)?;
        st.journal.note_durable(self.group_sync.durable());
        if st.journal.has_room() {
            st.journal.write_pending(&*self.device)?;
        } else {
            // Only a synchronous checkpoint gets here (no room and none in
            // flight): nothing is written before it lands, so a crash
            // before then loses only entries that were never written.
            st.journal.drop_pending();
        }
        let (generation, slot) = st.epochs.begin();
        let mark = CheckpointMark {
            generation,
            slot,
            journal_seq: st.journal.next_seq,
            journal_pos: st.journal.pos,
        };
        st.journal.start_epoch(generation);
        Ok(Job {
            mark,
            payload: encode_checkpoint(st),
        })
    }

    /// Outside the lock: every block and record the snapshot depends on is
    /// made durable, then the snapshot is written and made durable.
    fn write_job(&self, job: &Job) -> Result<CheckpointMark> {
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        write_checkpoint(
            &*self.device,
            &self.layout,
            &self.sb.uuid,
            job.mark,
            &job.payload,
        )?;
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        Ok(job.mark)
    }

    /// Records the outcome of a checkpoint.
    fn checkpoint_landed(&self, st: &mut State, result: Result<CheckpointMark>) -> Result<()> {
        st.epochs.landed(result.as_ref().ok().copied());
        let mark = result?;
        st.journal.checkpoint_durable(mark.generation);
        self.counted.note_checkpoint();
        // Before the next checkpoint may overwrite the older slot. A seal
        // that fails here is written by the next flush's.
        let durable = self.group_sync.durable().max(mark.journal_seq);
        if let Err(e) = self.sealer.seal(&*self.counted, durable, mark.generation) {
            tracing::warn!("a checkpoint landed, but its seal was not written: {e}");
        }
        Ok(())
    }

    /// Stops the checkpoint thread (after the last checkpoint).
    pub(crate) fn stop_checkpoint_thread(&self) {
        self.checkpointer.stop();
        let thread = self
            .checkpoint_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Most bytes a line takes in a checkpoint beside its blocks: key, guest
/// cluster, three bitmaps and, partially valid, the bitmap of its blocks
/// with valid sectors (one byte more per such block, counted apart).
const LINE_BYTES: u64 = 24;
/// Bytes of a present block in a checkpoint: its number and checksum.
const BLOCK_BYTES: u64 = 8;
/// Most bytes of a lost block's entry.
const LOST_BYTES: u64 = 16;
/// Most bytes one more address can add: a block in a line of its own,
/// partially valid with valid sectors.
pub(crate) const ADDRESS_BYTES: u64 = LINE_BYTES + BLOCK_BYTES + 1;

/// Most bytes the checkpoint's lines and lost blocks take now, counted
/// against [`crate::layout::Layout::checkpoint_lines_room`].
pub(crate) fn lines_bound(st: &State) -> u64 {
    LINE_BYTES * st.index.line_count() as u64
        + BLOCK_BYTES * st.index.present_blocks()
        + st.index.valid_sector_count() as u64
        + LOST_BYTES * st.integrity.unreadable.len() as u64
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(bytes);
}

/// Checkpoint payload: the image registry, then every line with the block
/// numbers of its present blocks (and, for a partially valid line, which
/// of its blocks have valid sectors and their bitmaps).
fn encode_checkpoint(st: &State) -> Vec<u8> {
    let mut out = Vec::new();
    put(&mut out, &(st.catalog.images.len() as u32).to_le_bytes());
    for (id, r) in st.catalog.images.iter().enumerate() {
        crate::journal::Entry::Image {
            id: id as u16,
            name: r.name.clone(),
            identity: r.identity,
        }
        .encode(&mut out);
    }
    put(&mut out, &(st.index.line_count() as u64).to_le_bytes());
    for l in st.index.lines() {
        put(&mut out, &l.key.to_le_bytes());
        put(&mut out, &u64::from(l.guest).to_le_bytes());
        put(&mut out, &l.present.to_le_bytes());
        put(&mut out, &l.dirty.to_le_bytes());
        put(&mut out, &l.partial.to_le_bytes());
        for (_, cbn) in l.blocks() {
            put(&mut out, &cbn.to_le_bytes());
            put(
                &mut out,
                &st.integrity.crcs.get(cbn).unwrap_or(0).to_le_bytes(),
            );
        }
        if l.partial != 0 {
            let sectors: Vec<(usize, u8)> = (0..LINE_BLOCKS as usize)
                .map(|slot| (slot, st.index.valid_sectors(l.key, slot)))
                .filter(|&(_, v)| v != 0)
                .collect();
            let with: u16 = sectors.iter().fold(0, |m, &(slot, _)| m | 1 << slot);
            put(&mut out, &with.to_le_bytes());
            out.extend(sectors.iter().map(|&(_, v)| v));
        }
    }
    put(&mut out, &(st.meta.dirty_len() as u64).to_le_bytes());
    for (image, offset, data) in st.meta.dirty_sectors() {
        match data {
            Some(data) => crate::journal::Entry::MetaSector {
                image,
                offset,
                data: data.into(),
            },
            None => crate::journal::Entry::MetaZero {
                image,
                offset,
                sectors: 1,
            },
        }
        .encode(&mut out);
    }
    put(
        &mut out,
        &(st.integrity.unreadable.len() as u64).to_le_bytes(),
    );
    for &(key, slot) in &st.integrity.unreadable {
        crate::journal::Entry::Lost {
            key,
            slot,
            lost: true,
        }
        .encode(&mut out);
    }
    out
}

/// A line as a checkpoint stores it.
pub(crate) struct SavedLine {
    pub key: u64,
    pub guest: u64,
    pub dirty: u16,
    pub partial: u16,
    /// (slot, cache block, checksum of its content).
    pub cbn: Vec<(usize, u32, u32)>,
    /// (slot, valid sectors) of partially valid blocks with some.
    pub valid_sectors: Vec<(usize, u8)>,
}

/// A decoded checkpoint: image entries, lines, metadata sector entries,
/// lost blocks.
type Checkpoint = (
    Vec<crate::journal::Entry>,
    Vec<SavedLine>,
    Vec<crate::journal::Entry>,
    Vec<crate::journal::Entry>,
);

/// Decodes a checkpoint payload.
pub(crate) fn decode_checkpoint(payload: &[u8]) -> Result<Checkpoint> {
    let mut r = Reader::new(payload);
    let images = r.u32()?;
    let mut entries = Vec::with_capacity((images as usize).min(65536));
    for _ in 0..images {
        entries.push(crate::journal::Entry::decode(&mut r)?);
    }
    let count = r.u64()?;
    let mut lines = Vec::with_capacity((count as usize).min(payload.len() / 30 + 1));
    for _ in 0..count {
        let key = r.u64()?;
        let guest = r.u64()?;
        let present = r.u16()?;
        let dirty = r.u16()?;
        let partial = r.u16()?;
        let mut cbn = Vec::with_capacity(present.count_ones() as usize);
        for slot in 0..LINE_BLOCKS as usize {
            if present & (1 << slot) != 0 {
                cbn.push((slot, r.u32()?, r.u32()?));
            }
        }
        let mut valid_sectors = Vec::new();
        if partial != 0 {
            let with = r.u16()?;
            for slot in 0..LINE_BLOCKS as usize {
                if with & (1 << slot) != 0 {
                    valid_sectors.push((slot, r.u8()?));
                }
            }
        }
        lines.push(SavedLine {
            key,
            guest,
            dirty: dirty & present,
            partial,
            cbn,
            valid_sectors,
        });
    }
    let count = r.u64()?;
    let mut sectors = Vec::with_capacity((count as usize).min(payload.len() / 512 + 1));
    for _ in 0..count {
        let e = crate::journal::Entry::decode(&mut r)?;
        if !matches!(
            e,
            crate::journal::Entry::MetaSector { .. } | crate::journal::Entry::MetaZero { .. }
        ) {
            return Err(CacheError::Corrupt(
                "checkpoint holds a non-sector entry among metadata sectors".into(),
            ));
        }
        sectors.push(e);
    }
    let count = r.u64()?;
    let mut lost = Vec::with_capacity((count as usize).min(payload.len() / 11 + 1));
    for _ in 0..count {
        let e = crate::journal::Entry::decode(&mut r)?;
        if !matches!(e, crate::journal::Entry::Lost { .. }) {
            return Err(CacheError::Corrupt(
                "checkpoint holds another entry among lost blocks".into(),
            ));
        }
        lost.push(e);
    }
    Ok((entries, lines, sectors, lost))
}
