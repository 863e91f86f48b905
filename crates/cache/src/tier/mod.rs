//! The cache tier proper: state behind one mutex (index, regions, journal
//! buffer, image registry), data I/O on flash and backends outside it,
//! background write-back and checkpoint threads.
//!
//! State owners: `State` keeps one field per owner, each a module whose
//! doc says what it owns and must not touch: the index (`crate::index`),
//! block checksums and lost blocks (`crate::checksums`), region space and
//! the replacement policy (`crate::region`, `crate::replacement`), reclaim
//! (`space`, with `crate::reinsertion`), the journal buffer
//! (`crate::journal`) and checkpoint epochs (`epochs`), the image catalog
//! (`catalog`), the admission filters and write streams
//! (`crate::admission`), the durability ledger (`ledger`), the write-back
//! queue (`dirty`), the write history (`history`) and dirty metadata
//! (`metastore`); write routing is a pure function (`crate::routing`).
//!
//! Lock order (every lock the cache takes; a lock is only ever taken while
//! holding locks above it in this list):
//! 1. `FlashCache::thread` / `checkpoint_thread` (join handles): taken
//!    alone, never with `state` held (the threads take `state`).
//! 2. A line fill's `base` (`fills::LineFill`): held while the COW layer
//!    reads the backing chain, which may come back into the cache and take
//!    the locks below.
//! 3. Backend ranges (`ranges::BackendRanges`), all of a request's at once:
//!    before `state`, never the other way round.
//! 4. `FlashCache::state` (`State`, this module).
//! 5. Under `state` or alone, leaves that take nothing else while held:
//!    the checkpointer's hand-off slot (`checkpoint::Checkpointer`), the
//!    device's staging chunks (`crate::staging`), a group-commit round
//!    (`crate::group_sync`: the cache device's and each image's backend
//!    syncs), `copy_depth` (`copyback::DepthLimit`), the write-back
//!    wake-up flags (`writeback::Wakeup`), the per-disk counters
//!    (`crate::stats`), a parallel copy's first error (`copyback`), the
//!    seal writer (`crate::seal::Sealer`, held across its own one-sector
//!    write so two seals never land out of order).
//!
//! A group-commit sync itself runs with no lock held (not even its round),
//! and may be waited for with `state` held (a commit under the lock): so
//! the sync must never take `state`. A guest flush's device sync and a
//! write-back batch's backend writes run without `state`.
//! Durability: a block's journal record carries its checksum, replay stops
//! at the first record whose batch or data does not verify, and a region is
//! reused only after the records that emptied it are durable; so recovery
//! always yields a prefix of what was acknowledged, never garbage.

mod catalog;
pub(crate) use catalog::ImageRecord;
mod checkpoint;
mod commit;
mod copyback;
mod dirty;
mod epochs;
mod fills;
mod history;
mod ledger;
mod logical;
mod metastore;
mod partial;
mod ranges;
mod read;
mod recover;
pub use recover::{Affected, DeviceContent, RecoveryReport};
mod report;
pub use report::{CacheReport, DedupReport, ImageReport, ShareReport};
mod sharing;
mod signatures;
mod space;
mod through;
mod write;
mod writeback;

use crate::admission::{Admissions, WriteStreams};
use crate::config::{CacheConfig, DiskPolicy};
use crate::error::{CacheError, Result};
use crate::group_sync::GroupSync;
use crate::index::{Cbn, Index};
use crate::journal::{CheckpointMark, Entry, JournalWriter};
use crate::layout::{Layout, Superblock};
use crate::region::Regions;
use crate::stats::{CountedDevice, Stats};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use vdcache_backend::BackendRef;
use vdcache_contract::{
    BackingFill, CopyHolder, CowHints, DiskId, FlushKind, HostError, HostIo, ImageHandle,
    ImageIdentity, IoTag, PartialRange, PartialValidity, WriteSegment,
};
use vdcache_contract::{Holder, Result as HostResult};
use vdcache_qcow2::HostOffset;

const HOT_FILTER_ENTRIES: usize = 1 << 16;

pub(crate) struct State {
    pub index: Index,
    /// Checksums of cached blocks, and dirty blocks lost to corruption.
    pub integrity: crate::checksums::Integrity,
    pub regions: Regions,
    /// Regions reclaimed, by how their blocks were found (see `space`).
    pub reclaimed: space::ReclaimCounts,
    pub journal: JournalWriter,
    /// Checkpoint generations and the journal's epoch.
    pub epochs: epochs::Epochs,
    /// Images, disks' policies and backing-chain readers.
    pub catalog: catalog::Catalog,
    /// The admission policies' filters (see `admission`).
    pub admission: Admissions,
    /// Sequential streams of guest writes per disk, for write routing.
    pub write_streams: WriteStreams,
    /// What is unsynced on backends, held out of the journal, or
    /// recorded but not committed.
    pub ledger: ledger::Ledger,
    /// Lines holding dirty blocks and the write-back thread's progress.
    pub dirty: dirty::DirtySet,
    /// Recent writes, numbered (see `history`).
    pub history: history::WriteHistory,
    /// Dirty metadata sectors (cow-aware write-back).
    pub meta: metastore::MetaStore,
    /// Guests' journal devices and what their logs say (see `logical`).
    pub guest_journals: crate::guest_journal::GuestJournals,
    /// Checksum to cache block, and fingerprints learned (dedup, see
    /// `signatures`).
    pub signatures: crate::dedup::Signatures,
    /// Per-VM shares of flash and their demand (see `crate::shares`).
    pub shares: crate::shares::Shares,
}

impl State {
    /// Maps block `slot` of line `key` to `cbn`, which holds bytes with
    /// checksum `crc`; returns the block it replaced, as [`Index::map`].
    pub(crate) fn map_block(
        &mut self,
        key: u64,
        guest: u64,
        slot: usize,
        cbn: Cbn,
        dirty: bool,
        crc: u32,
    ) -> Option<(Cbn, crate::index::BlockRef)> {
        self.integrity.wrote(cbn, key, slot, crc);
        self.index.map(key, guest, slot, cbn, dirty)
    }

    /// Records a write of `[start, end)` of image `id` that went to its
    /// backend, not yet synced there; `described`: journal entries describe
    /// its data. Returns the write's mark (see `unsynced`).
    fn note_write_through(&mut self, id: u16, start: u64, end: u64, described: bool) -> u64 {
        let mark = self.history.note(id, start, end);
        self.ledger.wrote_through(id, mark, described);
        if let Some(rec) = self.catalog.images.get(id as usize) {
            rec.backend_syncs.publish(mark);
        }
        mark
    }

    /// Whether image `id` is open (has a store to write back to).
    pub(crate) fn is_open(&self, id: u16) -> bool {
        self.catalog
            .images
            .get(id as usize)
            .is_some_and(|r| r.backend.is_some())
    }

    /// Whether an open image has dirty blocks or metadata sectors: what a
    /// drain waits for. Dirty data of an image nobody opened stays in
    /// flash until one does (or `recover --full`), and so do held images'
    /// blocks unless they are being written out.
    pub(crate) fn open_dirty(&self) -> bool {
        (0..self.catalog.images.len() as u16).any(|id| {
            self.is_open(id)
                && self.writes_back(id)
                && (self
                    .dirty
                    .lines
                    .range(crate::index::line_key(id, 0)..=crate::index::line_key(id, u64::MAX))
                    .any(|&key| self.has_writable_dirty(key))
                    || self.meta.has_dirty_of(id))
        })
    }

    /// Whether write-back copies image `id`'s dirty blocks now: always,
    /// but for a held image's, which only an explicit write-out copies.
    pub(crate) fn writes_back(&self, id: u16) -> bool {
        !self.index.is_held(id) || self.dirty.writing_out_held()
    }

    /// Whether line `key` has a dirty block that can still be written
    /// back (not one whose flash copy was lost).
    fn has_writable_dirty(&self, key: u64) -> bool {
        let Some(l) = self.index.get(key) else {
            return false;
        };
        self.integrity.any_readable(key, l.dirty)
    }
}

/// A flash cache on one device, shared by every disk of a server.
pub struct FlashCache {
    /// The device, data-zone writes staged in chunks (see `staging`).
    device: BackendRef,
    /// The device under the staging, for its counters.
    counted: Arc<CountedDevice>,
    sb: Superblock,
    layout: Layout,
    config: CacheConfig,
    /// Lock 4 of the order in the module doc: after backend ranges and a
    /// line fill's base, before every leaf lock.
    state: Mutex<State>,
    /// Wakes the write-back thread (shared with it, so the thread can wait
    /// without keeping the cache alive).
    wake: Arc<writeback::Wakeup>,
    /// Signals progress of write-back (drains wait on it).
    progress: Condvar,
    stats: Stats,
    stop: AtomicBool,
    /// Never taken with `state` held (the thread takes it).
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    checkpointer: Arc<checkpoint::Checkpointer>,
    /// Guest flushes sync the device outside the state lock, together.
    group_sync: GroupSync,
    checkpoint_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// What fast recovery found when the cache opened.
    recovery: RecoveryReport,
    /// What a salvage gave up when the cache opened (see
    /// [`FlashCache::salvaged`]).
    salvaged: Option<Affected>,
    /// Writes the seal after each sync (see `crate::seal`).
    sealer: crate::seal::Sealer,
    /// Image ranges with a backend write in progress outside the state lock.
    ranges: ranges::BackendRanges,
    /// Write-back requests to keep in flight. A leaf lock: held only to
    /// read or feed the limit.
    copy_depth: Mutex<copyback::DepthLimit>,
    /// Guest requests waiting on a backend now (write-back yields to them).
    foreground: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for FlashCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashCache")
            .field("device", &self.device.name())
            .finish()
    }
}

/// A cache error as the COW layer above sees it, typed by what it means
/// there; the text is the cache's own.
fn host_err(e: CacheError) -> HostError {
    match e {
        // The cache device's own error, named as such (the layers above
        // name the image): a full device stays ENOSPC, anything else EIO.
        CacheError::Device { op, cause } => {
            let full = cause.kind() == std::io::ErrorKind::StorageFull;
            let named = std::io::Error::other(CacheError::Device { op, cause }.to_string());
            if full {
                HostError::NoSpace(named)
            } else {
                HostError::Io(named)
            }
        }
        // Keeps the typed fault, so the layers above can tell it.
        CacheError::Unreachable { fault } => HostError::from(fault),
        e @ (CacheError::NotACache
        | CacheError::Corrupt(_)
        | CacheError::Damaged { .. }
        | CacheError::Unreadable { .. }) => HostError::Corrupt(e.to_string()),
        other => HostError::Refused(other.to_string()),
    }
}

impl FlashCache {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the cache lives (its device's name).
    pub fn device_name(&self) -> &str {
        self.device.name()
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Sets the policy of one disk.
    pub fn set_policy(&self, disk: DiskId, policy: DiskPolicy) {
        self.lock().catalog.policies.insert(disk.0, policy);
    }

    /// The policy `disk` is served with.
    pub fn policy(&self, disk: DiskId) -> DiskPolicy {
        self.lock().catalog.policy(disk, self.config.default_policy)
    }

    /// Sets `disk`'s share of flash (see `crate::shares`; effective only
    /// with shares on).
    pub fn set_share(&self, disk: DiskId, share: crate::shares::Share) {
        self.lock().shares.set(disk.0, share);
    }

    /// `disk`'s share of flash now.
    pub fn share(&self, disk: DiskId) -> crate::shares::Share {
        self.lock().shares.get(disk.0)
    }

    /// State after checkpoint `durable`, with the journal writing in
    /// `epoch`.
    fn new_state(
        layout: &Layout,
        config: &CacheConfig,
        journal: JournalWriter,
        durable: CheckpointMark,
        epoch: u64,
    ) -> State {
        State {
            index: Index::new(layout.regions, layout.blocks_per_region()),
            integrity: crate::checksums::Integrity::new(layout.regions, layout.blocks_per_region()),
            regions: {
                let mut r = Regions::new(
                    layout.regions,
                    layout.blocks_per_region(),
                    layout.blocks_per_region() - layout.data_blocks_per_region(),
                    config.replacement,
                );
                r.set_read_split(config.read_split);
                r
            },
            reclaimed: space::ReclaimCounts::default(),
            journal,
            epochs: epochs::Epochs::new(durable, epoch),
            catalog: catalog::Catalog::default(),
            admission: Admissions::new(HOT_FILTER_ENTRIES),
            write_streams: WriteStreams::default(),
            ledger: ledger::Ledger::new(ledger::unjournaled_limit(layout.cacheable_blocks())),
            dirty: dirty::DirtySet::default(),
            history: history::WriteHistory::default(),
            meta: metastore::MetaStore::default(),
            guest_journals: Default::default(),
            signatures: Default::default(),
            shares: crate::shares::Shares::new(config.shares, layout.cacheable_blocks()),
        }
    }

    fn assemble(
        device: BackendRef,
        sb: Superblock,
        config: CacheConfig,
        state: State,
        opened: recover::Opened,
    ) -> Arc<FlashCache> {
        let counted = Arc::new(CountedDevice::new(device, sb.layout.data_offset));
        let staged = crate::staging::StagedDevice::new(
            counted.clone(),
            sb.layout.data_offset,
            sb.layout.region_bytes,
            !config.inline_background,
        );
        let copy_depth = Mutex::new(copyback::DepthLimit::new(config.writeback_depth));
        Arc::new(FlashCache {
            layout: sb.layout,
            device: Arc::new(staged),
            counted,
            sb,
            config,
            state: Mutex::new(state),
            wake: Arc::default(),
            progress: Condvar::new(),
            stats: Stats::default(),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            checkpointer: Arc::default(),
            group_sync: GroupSync::default(),
            checkpoint_thread: Mutex::new(None),
            recovery: opened.report,
            salvaged: opened.salvaged,
            sealer: opened.sealer,
            ranges: ranges::BackendRanges::default(),
            copy_depth,
            foreground: Default::default(),
        })
    }

    /// Starts the background threads (none with `inline_background`).
    fn start_threads(cache: &Arc<FlashCache>) {
        if cache.config.inline_background {
            return;
        }
        writeback::start(cache);
        checkpoint::start(cache);
        cache.rebuild_signatures();
    }

    /// Starts a background thread into `slot`. It gets only a weak
    /// reference, so the cache closes when its last user drops it.
    fn spawn_background(
        cache: &Arc<FlashCache>,
        name: &str,
        slot: &Mutex<Option<std::thread::JoinHandle<()>>>,
        body: impl FnOnce(std::sync::Weak<FlashCache>) + Send + 'static,
    ) {
        let weak = Arc::downgrade(cache);
        match std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(weak))
        {
            Ok(h) => *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(h),
            Err(e) => tracing::error!("cannot start thread {name}: {e}"),
        }
    }

    /// Removes one slot from the index, journaling it and freeing its block.
    pub(crate) fn unmap_block(&self, st: &mut State, key: u64, slot: usize) -> bool {
        let Some((cbn, _dirty, r)) = st.index.unmap(key, slot) else {
            return false;
        };
        if st.index.release(cbn, r) {
            st.regions.release_block(cbn);
        }
        st.journal.push(&Entry::Unmap {
            key,
            slot: slot as u8,
        });
        if st.index.get(key).is_none_or(|l| l.dirty == 0) {
            st.dirty.lines.remove(&key);
        }
        true
    }

    /// Stops the write-back thread. With `keep_dirty` false every dirty
    /// block is written back first, so the images are complete; either way
    /// the index is checkpointed so the next open is fast.
    pub fn shutdown(&self, keep_dirty: bool) -> Result<()> {
        if !keep_dirty {
            self.drain()?;
        }
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        let mut st = self.lock();
        self.commit(&mut st)?;
        self.checkpoint(&mut st)?;
        drop(st);
        // The thread may wait for the state lock to record its last one.
        self.stop_checkpoint_thread();
        Ok(())
    }
}

impl Drop for FlashCache {
    fn drop(&mut self) {
        // Let the background threads see that the cache is gone.
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify();
        self.checkpointer.stop();
    }
}

impl HostIo for FlashCache {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> HostResult<()> {
        self.read_blocks(image, offset.0, buf, tag)
            .map_err(host_err)
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> HostResult<()> {
        self.write_blocks(image, offset.0, segments)
            .map_err(host_err)
    }

    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        tag: IoTag,
    ) -> HostResult<()> {
        self.discard_blocks(image, offset.0, len, tag)
            .map_err(host_err)
    }

    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> HostResult<()> {
        self.flush_image(image, kind).map_err(host_err)
    }

    fn len(&self, image: &ImageHandle) -> HostResult<u64> {
        let stored = image.backend.len()?;
        let st = self.lock();
        let cached = st
            .catalog
            .id_of(&image.name)
            .and_then(|id| st.catalog.images.get(id as usize))
            .map_or(0, |r| r.end);
        Ok(stored.max(cached))
    }

    fn write_durable(
        &self,
        image: &ImageHandle,
        writes: &[(HostOffset, &[u8])],
        tag: IoTag,
    ) -> HostResult<()> {
        self.write_to_store(image, writes, tag).map_err(host_err)
    }

    fn partial(&self) -> &dyn PartialValidity {
        self
    }

    fn hints(&self) -> &dyn CowHints {
        self
    }

    fn copies(&self) -> &dyn CopyHolder {
        self
    }
}

impl PartialValidity for FlashCache {
    fn decoupled_cow(&self, disk: DiskId) -> bool {
        self.decoupled_for(disk)
    }

    fn set_backing_fill(&self, image: &ImageHandle, fill: std::sync::Weak<dyn BackingFill>) {
        let mut st = self.lock();
        if let Some(id) = st.catalog.id_of(&image.name) {
            st.catalog.fillers.insert(id, fill);
        }
    }

    fn set_invalid(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        invalid: bool,
        tag: IoTag,
    ) -> HostResult<()> {
        self.set_invalid_range(image, offset.0, len, invalid, tag)
            .map_err(host_err)
    }

    fn invalid_ranges(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
    ) -> HostResult<Vec<(u64, u64)>> {
        Ok(self.invalid_ranges_of(image, offset.0, len))
    }

    fn partial_ranges(&self, image: &ImageHandle) -> HostResult<Vec<PartialRange>> {
        Ok(self.partial_ranges_of(image))
    }
}

impl CowHints for FlashCache {
    fn wants_masked_hints(&self, disk: DiskId) -> bool {
        self.lock()
            .catalog
            .policy(disk, self.config.default_policy)
            .cow
            == crate::config::CowMode::CowAware
    }

    fn forget(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        tag: IoTag,
    ) -> HostResult<()> {
        self.drop_masked(image, offset.0, len, tag);
        Ok(())
    }
}

impl CopyHolder for FlashCache {
    fn holder(&self) -> Option<Holder> {
        Some(Holder {
            id: self.sb.uuid,
            path: self.device.name().to_string(),
        })
    }

    fn attach(
        &self,
        image: &ImageHandle,
        disk: DiskId,
        identity: &ImageIdentity,
    ) -> HostResult<()> {
        self.attach_image(image, disk, identity)
            .map(|_| ())
            .map_err(host_err)
    }

    fn keeps_newer(&self, disk: DiskId) -> bool {
        self.lock()
            .catalog
            .policy(disk, self.config.default_policy)
            .mode
            == crate::config::WriteMode::WriteBack
    }

    fn holds_newer(&self, image: &ImageHandle) -> HostResult<bool> {
        let st = self.lock();
        Ok(st
            .catalog
            .id_of(&image.name)
            .is_some_and(|id| self.holds_newer_of(&st, id)))
    }

    fn write_back_image(&self, _image: &ImageHandle) -> HostResult<()> {
        self.drain().map_err(host_err)
    }
}
