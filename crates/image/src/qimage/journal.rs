//! The per-disk metadata journal of one open image (paper 003): every
//! table update is kept out of place and logged; a guest flush writes one
//! record and makes it durable together with the interval's guest data by
//! one sync. Tables reach their places lazily, at checkpoints, so a table
//! sector changed by a thousand flushes is written in place once.
//!
//! Records are cumulative: each holds every update not yet known durable
//! in place, so recovery replays one record. Updates written in place at a
//! checkpoint (after a commit's sync) stay in records until the next
//! commit's sync has made them durable there.
//!
//! No-data mode: guest data is written in place right away and the record
//! holds a checksum of every piece of data its transaction newly maps, so
//! recovery can tell a complete transaction (its sync finished) from one
//! whose data was torn, and then replays the record before it instead. A
//! record is written only after the previous commit's sync returned, so a
//! newer record proves the older; only the newest record's checksums count.
//!
//! Full mode: a write into data whose checksum the newest record (or the
//! one being committed) still needs would make that record look torn. Such
//! a write is held in memory (reads see it), logged whole in records, and
//! written in place once the data it replaces is proven.
//!
//! Records go to the area's two slots in turn, so a record never
//! overwrites the one before it. A checkpoint writes in place only updates
//! a durable record holds (each carries the commit generation it was
//! logged in).
//!
//! Eager records: a guest that flushes after every single write has the
//! record its flush needs written beside the write's data (and the
//! pending checkpoint with it); the flush, finding those exact bytes in
//! the slot, only syncs.
//!
//! Lock order: the image's commit lock, then `Meta`. Commits are strictly
//! one after another.
//!
//! Must not: decide what is metadata (callers route every table write
//! here), or order writes by barriers (a transaction needs none).

use super::overlap::MetaKind;
use super::sums::{Sum, Sums, pieces};
use super::{Locked, Qcow2Image};
use crate::beside::{self, Running};
use crate::error::{ImageError, Result};
use crate::hostio::{FlushKind, IoClass, IoTag, MetaTable, WriteSegment};
use std::collections::{BTreeMap, HashMap};
use vdcache_qcow2::Header;
use vdcache_qcow2::HostOffset;
use vdcache_qcow2::entries::L2Mapping;
use vdcache_qcow2::features::{FeatureKind, incompatible};
use vdcache_qcow2::header::field_offset;
use vdcache_qcow2::meta_journal::{
    CHECKSUM_BYTES, Entry, JournalExtension, RECORD_HEADER, Record, record_len,
};

pub(crate) use super::sums::Piece;

/// An interval this big is committed without waiting for a guest flush.
const COMMIT_AT_BYTES: usize = 4 << 20;
/// Logged updates beyond this many bytes are written in place after the
/// next commit (a checkpoint), so records stay small.
const CHECKPOINT_AT_BYTES: usize = 64 << 10;
/// Checkpoint writes in flight at once.
const CHECKPOINT_WRITERS: usize = 8;
/// Logged updates a guest writing once per flush may leave to its next
/// eager record's checkpoint; beyond, the flush writes them itself.
const EAGER_CHECKPOINT_LIMIT: usize = 4 * CHECKPOINT_AT_BYTES;
/// A full-mode write this big is not held in memory: the records that
/// need the old data are proven first.
const MAX_HELD_WRITE: usize = 256 << 10;

/// What a metadata journal holds (`vdcache stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalStats {
    /// Records committed since the image was opened.
    pub records: u64,
    /// Of those, records written ahead of their flush, in parallel with
    /// the write they anticipate (the flush then only synced).
    pub eager_records: u64,
    /// Bytes of updates not yet known durable in place.
    pub logged_bytes: u64,
    /// Of those, guest data held in memory (full mode).
    pub held_bytes: u64,
    /// Guest writes held in memory since the image was opened.
    pub held_writes: u64,
    /// Commits that waited for writes over data their interval had
    /// checksummed to finish (their new checksums go in the record).
    pub overwrite_waits: u64,
}

/// Whole table slices by their start in the image file.
pub(crate) type Slices = Vec<(u64, Vec<u8>)>;

/// Where a data write goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Placement {
    /// In place now; once written, these pieces' checksums join the open
    /// interval ([`Qcow2Image::data_written`]), not before: a commit in
    /// between must not vouch for bytes not yet issued.
    InPlace(Vec<Piece>),
    /// In place now, over data the open interval checksums: these pieces
    /// replace those checksums once written. Until then the write is in
    /// flight and the next commit waits for it
    /// ([`Qcow2Image::data_written`], [`Qcow2Image::overwrites_failed`]).
    Over(Vec<Piece>),
    /// Held in memory and logged (full mode).
    Held,
    /// Too big to hold: commit twice, then write in place.
    ProveFirst,
}

/// Where an update goes: a table of the image file, or guest data of the
/// data file (with the guest cluster it belongs to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Target {
    Table(MetaTable),
    Data(Option<vdcache_contract::GuestCluster>),
}

impl Target {
    fn is_data(self) -> bool {
        matches!(self, Target::Data(_))
    }
}

/// One logged update.
struct Update {
    target: Target,
    offset: u64,
    bytes: Vec<u8>,
    /// Written in place; durable there once the commit with this sequence
    /// number has synced.
    placed: Option<u64>,
    /// The commit generation it was logged in: records taken in a later
    /// generation hold it (see [`Journal::generation`]).
    logged: u64,
    /// Durable in place, and left out of records from now on; forgotten
    /// once a record without it is durable. Until then the newest durable
    /// record still holds it, so nothing may be written in place over it
    /// (recovery would lay it over the newer bytes).
    retired: bool,
}

/// Updates in the order made; an older update of the same range is
/// dropped when a newer one arrives.
#[derive(Default)]
struct Log {
    updates: Vec<Option<Update>>,
    at: HashMap<(Target, u64, usize), usize>,
    bytes: usize,
}

impl Log {
    fn add(&mut self, target: Target, offset: u64, bytes: Vec<u8>, logged: u64) {
        let key = (target, offset, bytes.len());
        if let Some(i) = self.at.remove(&key)
            && let Some(old) = self.updates[i].take()
        {
            self.bytes -= old.bytes.len() + 16;
        }
        self.at.insert(key, self.updates.len());
        self.bytes += bytes.len() + 16;
        self.updates.push(Some(Update {
            target,
            offset,
            bytes,
            placed: None,
            logged,
            retired: false,
        }));
    }

    fn iter(&self) -> impl Iterator<Item = &Update> {
        self.updates.iter().flatten()
    }

    /// Whether a record would log anything (retired updates are left out).
    fn has_entries(&self) -> bool {
        self.iter().any(|u| !u.retired)
    }

    /// Lays the logged data updates (`data`) or table updates over `buf`,
    /// in log order, so the newest bytes win even where a cluster changed
    /// from one table kind to another.
    fn overlay(&self, data: bool, offset: u64, buf: &mut [u8]) {
        for u in self.iter().filter(|u| u.target.is_data() == data) {
            overlay(offset, buf, u.offset, &u.bytes);
        }
    }

    fn holds_data(&self) -> bool {
        self.iter().any(|u| u.target.is_data())
    }

    fn overlaps_data(&self, at: u64, end: u64) -> bool {
        self.iter()
            .any(|u| u.target.is_data() && u.offset < end && at < u.offset + u.bytes.len() as u64)
    }

    /// Drops held data inside `[at, end)` (a cluster just freed: no
    /// durable mapping reads it any more, and it may be allocated anew).
    fn forget_data_in(&mut self, at: u64, end: u64) {
        for slot in &mut self.updates {
            let inside = slot.as_ref().is_some_and(|u| {
                u.target.is_data() && u.offset >= at && u.offset + u.bytes.len() as u64 <= end
            });
            if inside && let Some(u) = slot.take() {
                self.at.remove(&(u.target, u.offset, u.bytes.len()));
                self.bytes -= u.bytes.len() + 16;
            }
        }
    }

    /// Commit `seq` synced: updates it left out (retired) are forgotten,
    /// and those it made durable in place are retired.
    fn retire_placed(&mut self, seq: u64) {
        for slot in &mut self.updates {
            if slot.as_ref().is_some_and(|u| u.retired)
                && let Some(u) = slot.take()
            {
                self.at.remove(&(u.target, u.offset, u.bytes.len()));
                self.bytes -= u.bytes.len() + 16;
            }
        }
        for u in self.updates.iter_mut().flatten() {
            if u.placed.is_some_and(|p| p <= seq) {
                u.retired = true;
            }
        }
        if self.at.is_empty() {
            self.updates.clear();
        }
    }
}

impl Update {
    fn entry(&self) -> Entry {
        match self.target {
            Target::Table(table) => Entry::Meta {
                offset: self.offset,
                table: table_code(table),
                bytes: self.bytes.clone(),
            },
            Target::Data(_) => Entry::Data {
                offset: self.offset,
                bytes: self.bytes.clone(),
            },
        }
    }
}

/// A record written ahead of the flush that needs it, with the commit lock
/// held (see [`Qcow2Image::eager_record`]).
pub(crate) struct EagerRecord<'a> {
    _commit: std::sync::MutexGuard<'a, ()>,
    at: u64,
    bytes: Vec<u8>,
    /// A checkpoint the last commit left to this write: updates a durable
    /// record holds, written in place beside the record.
    checkpoint: Vec<(Target, u64, Vec<u8>)>,
}

/// How an eager record's writes went, and the record's bytes back.
pub(crate) struct EagerWrites {
    recorded: Result<()>,
    checkpointed: Result<()>,
    bytes: Vec<u8>,
}

impl EagerRecord<'_> {
    /// Starts writing the record and the checkpoint's updates beside the
    /// caller (which writes the data meanwhile); join it before
    /// [`Qcow2Image::eager_written`].
    pub(crate) fn start(&mut self, img: &Qcow2Image) -> Running<EagerWrites> {
        let store = img.journal_store();
        let at = self.at;
        let bytes = std::mem::take(&mut self.bytes);
        let checkpoint = std::mem::take(&mut self.checkpoint);
        beside::run(move || {
            let checkpointing = (!checkpoint.is_empty()).then(|| {
                let store = store.clone();
                beside::run(move || store.write_updates(checkpoint))
            });
            let recorded = store.write_record(at, &bytes);
            EagerWrites {
                recorded,
                checkpointed: checkpointing.map_or(Ok(()), Running::join),
                bytes,
            }
        })
    }
}

/// What writing journal records and checkpoints needs of an image, owned,
/// so the writes can run beside the thread that asked for them.
#[derive(Clone)]
pub(crate) struct JournalStore {
    io: std::sync::Arc<dyn crate::hostio::HostIo>,
    handle: crate::hostio::ImageHandle,
    data: crate::hostio::ImageHandle,
    disk: crate::hostio::DiskId,
}

impl JournalStore {
    /// Writes a checkpoint's updates in place, several at a time: each is
    /// a round trip to the store. Overlapping updates are first merged in
    /// log order, so what is written at once never overlaps. Returns once
    /// every one of them is done, with the first failure.
    fn write_updates(&self, updates: Vec<(Target, u64, Vec<u8>)>) -> Result<()> {
        let mut updates = coalesce(updates);
        let chunk = updates.len().div_ceil(CHECKPOINT_WRITERS).max(1);
        let mut others = Vec::new();
        while updates.len() > chunk {
            let part = updates.split_off(updates.len() - chunk);
            let store = self.clone();
            others.push(beside::run(move || {
                part.iter().try_for_each(|u| store.write_update(u))
            }));
        }
        let mine = updates.iter().try_for_each(|u| self.write_update(u));
        others
            .into_iter()
            .map(Running::join)
            .fold(mine, Result::and)
    }

    fn write_update(&self, (target, offset, bytes): &(Target, u64, Vec<u8>)) -> Result<()> {
        let (handle, tag) = match *target {
            Target::Table(table) => (&self.handle, IoTag::meta(table, self.disk)),
            Target::Data(guest) => (
                &self.data,
                IoTag {
                    class: IoClass::GuestData,
                    disk: self.disk,
                    guest_cluster: guest,
                    unit: None,
                },
            ),
        };
        self.io
            .write(
                handle,
                HostOffset(*offset),
                &[WriteSegment { data: bytes, tag }],
            )
            .map_err(|e| ImageError::io(&self.handle.name, "write a checkpoint", e))
    }

    fn write_record(&self, at: u64, bytes: &[u8]) -> Result<()> {
        self.io
            .write(
                &self.handle,
                HostOffset(at),
                &[WriteSegment {
                    data: bytes,
                    tag: IoTag::meta(MetaTable::Journal, self.disk),
                }],
            )
            .map_err(|e| ImageError::io(&self.handle.name, "write the metadata journal", e))
    }
}

/// A record a commit is about to make durable.
struct PendingRecord {
    at: u64,
    bytes: Vec<u8>,
    /// An eager record left exactly these bytes in the slot.
    written: bool,
}

/// The journal of an image open for writing.
pub(crate) struct Journal {
    pub(crate) ext: JournalExtension,
    /// Sequence number of the next record (its slot is `seq % 2`).
    next_seq: u64,
    /// Every update not yet known durable in place, this interval's
    /// included.
    log: Log,
    /// Checksums of data this interval newly maps.
    sums: Sums,
    /// The checksums of the commit in flight (back to `sums` if it fails).
    committing: Option<Sums>,
    /// Writes placed [`Placement::Over`] and not yet finished.
    overwrites: usize,
    /// A commit waits for those: no new one is placed meanwhile.
    draining: bool,
    /// Spans whose bytes no checksum vouches for any more (a write over
    /// them failed, or covered part of a piece that could not be cut):
    /// the next commit reads and checksums them.
    unknown: Vec<(u64, u64)>,
    /// Pieces whose checksums the newest record (or the one in flight)
    /// holds: start -> end. Nothing is written over them in place.
    unproven: BTreeMap<u64, u64>,
    /// Bytes this interval added (commits early when large).
    interval_bytes: usize,
    /// Guest writes mapped this interval, and in the one before: a guest
    /// that flushes after every write gets eager records.
    interval_writes: u32,
    last_interval_writes: u32,
    /// The bytes of an eager record complete in the next record's slot: a
    /// commit whose record is exactly these bytes need not write it again.
    eager: Option<Vec<u8>>,
    /// Updates logged now belong to this commit generation; a commit takes
    /// its record of everything logged so far and starts the next one, so
    /// what is logged during its unlocked sync is not in its record.
    generation: u64,
    /// The newest generation whose updates a durable record holds: only
    /// they may be written in place.
    durable_generation: Option<u64>,
    /// The generation of the commit in flight.
    committing_generation: u64,
    /// Records committed, for statistics.
    pub(crate) records: u64,
    /// Of those, records written ahead of their flush (eager).
    pub(crate) eager_records: u64,
    /// Writes placed [`Placement::Held`], and commits that waited for
    /// [`Placement::Over`] writes.
    pub(crate) held_writes: u64,
    pub(crate) overwrite_waits: u64,
}

impl Journal {
    pub(crate) fn new(ext: JournalExtension) -> Journal {
        Journal {
            ext,
            next_seq: 1,
            log: Log::default(),
            sums: Sums::default(),
            committing: None,
            overwrites: 0,
            draining: false,
            unknown: Vec::new(),
            unproven: BTreeMap::new(),
            interval_bytes: 0,
            interval_writes: 0,
            last_interval_writes: 0,
            eager: None,
            generation: 0,
            durable_generation: None,
            committing_generation: 0,
            records: 0,
            eager_records: 0,
            held_writes: 0,
            overwrite_waits: 0,
        }
    }

    /// A table write.
    pub(crate) fn add_meta(&mut self, table: MetaTable, offset: u64, bytes: &[u8]) {
        self.interval_bytes += bytes.len();
        self.log.add(
            Target::Table(table),
            offset,
            bytes.to_vec(),
            self.generation,
        );
    }

    /// Whether this interval has grown enough to commit on its own.
    pub(crate) fn wants_commit(&self) -> bool {
        self.interval_bytes >= COMMIT_AT_BYTES
    }

    /// Whether any write is held in memory (reads must look).
    pub(crate) fn holds_data(&self) -> bool {
        self.log.holds_data()
    }

    /// Lays table writes not yet in place over `buf`, read from `offset`.
    pub(crate) fn overlay_meta(&self, offset: u64, buf: &mut [u8]) {
        self.log.overlay(false, offset, buf);
    }

    /// A cluster of the image was freed (see [`Log::forget_data_in`]).
    pub(crate) fn cluster_freed(&mut self, at: u64, len: u64) {
        self.log.forget_data_in(at, at + len);
    }

    /// Lays held data writes over `buf`, read from data offset `offset`.
    pub(crate) fn overlay_data(&self, offset: u64, buf: &mut [u8]) {
        self.log.overlay(true, offset, buf);
    }

    fn is_unproven(&self, at: u64, end: u64) -> bool {
        self.unproven
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > at)
    }

    /// Whether a record still needs the bytes now in `[at, end)`: the
    /// newest, the one being committed, or the open interval's next.
    fn old_bytes_needed(&self, at: u64, end: u64) -> bool {
        self.is_unproven(at, end) || self.sums.touches(at, end)
    }

    /// Decides where a data write of `segments` at `at` goes, recording
    /// what the journal must know of it. `maps_new` says the write fills
    /// space this interval maps for the first time.
    pub(crate) fn place_data(
        &mut self,
        at: u64,
        segments: &[WriteSegment<'_>],
        maps_new: bool,
        may_hold_big: bool,
    ) -> Placement {
        let len: usize = segments.iter().map(|s| s.data.len()).sum();
        let end = at + len as u64;
        // Over the open interval's pieces, the new bytes' checksums replace
        // theirs, and the next commit waits for the write before it takes
        // them; unless one cannot be cut at the write's edges, or a commit
        // is already waiting.
        let replaces_sums = !self.is_unproven(at, end)
            && !self.log.overlaps_data(at, end)
            && self.sums.touches(at, end)
            && !self.draining
            && self.sums.can_replace(at, end);
        if replaces_sums {
            self.overwrites += 1;
            return Placement::Over(pieces(at, segments));
        }
        if self.old_bytes_needed(at, end) || self.log.overlaps_data(at, end) {
            if len > MAX_HELD_WRITE && !may_hold_big {
                return Placement::ProveFirst;
            }
            let bytes: Vec<u8> = segments
                .iter()
                .flat_map(|s| s.data.iter().copied())
                .collect();
            self.interval_bytes += len;
            // The guest cluster goes with the bytes: a cache below files
            // them under it when a checkpoint writes them.
            let guest = segments.first().and_then(|s| s.tag.guest_cluster);
            self.log
                .add(Target::Data(guest), at, bytes, self.generation);
            self.held_writes += 1;
            return Placement::Held;
        }
        if maps_new {
            return Placement::InPlace(pieces(at, segments));
        }
        Placement::InPlace(Vec::new())
    }

    /// The checksums of data written in place, now that it is, and how
    /// many of the writes were [`Placement::Over`].
    fn add_written(&mut self, written: &[Piece], overwrites: usize) {
        self.interval_writes = self.interval_writes.saturating_add(1);
        for piece in written {
            if let Some(span) = self.sums.put(piece.clone()) {
                self.unknown.push(span);
            }
            self.interval_bytes += 24;
        }
        self.overwrites_finished(overwrites);
    }

    fn overwrites_finished(&mut self, count: usize) {
        self.overwrites = self.overwrites.saturating_sub(count);
    }

    /// Whether the next write's record should be written with it: the
    /// guest flushed after the one write of the last interval, and this
    /// interval has none yet (queue depth 1, a flush after each write).
    fn wants_eager(&self) -> bool {
        self.interval_writes == 0 && self.last_interval_writes <= 1
    }

    /// The record a commit would write if `slices` (whole L2 slices) were
    /// logged and the write of `pieces` had completed: an eager record.
    /// Forgets any earlier eager record, whose slot this one takes.
    fn preview_record(
        &mut self,
        slices: &[(u64, Vec<u8>)],
        pieces: &[Piece],
        freed: &[u64],
        cluster: u64,
    ) -> (u64, Vec<u8>) {
        self.eager = None;
        let mut sums = self.sums.clone();
        for piece in pieces {
            sums.put(piece.clone());
        }
        sums.drop_freed(freed, cluster);
        let l2 = Target::Table(MetaTable::L2);
        // As `Log::add` would: an update of the same range moves to the end.
        let replaced = |u: &Update| {
            u.target == l2
                && slices
                    .iter()
                    .any(|(at, b)| u.offset == *at && u.bytes.len() == b.len())
        };
        let logged = self.log.iter().filter(|u| !u.retired && !replaced(u));
        let added = slices.iter().map(|(offset, bytes)| Update {
            target: l2,
            offset: *offset,
            bytes: bytes.clone(),
            placed: None,
            logged: self.generation,
            retired: false,
        });
        let entries: Vec<Entry> = logged
            .map(Update::entry)
            .chain(added.map(|u| u.entry()))
            .collect();
        (
            self.ext.slot_offset(self.next_seq),
            self.encode(entries, &sums),
        )
    }

    /// An eager record is complete in its slot.
    fn eager_written(&mut self, bytes: Vec<u8>) {
        self.eager = Some(bytes);
    }

    fn encode(&self, entries: Vec<Entry>, sums: &Sums) -> Vec<u8> {
        Record {
            seq: self.next_seq,
            entries: entries.into_iter().chain(sums.entries()).collect(),
        }
        .encode(&self.ext.id)
    }

    /// Starts a commit: the record (every logged update and this
    /// interval's checksums, less those of clusters it freed) and where it
    /// goes, or `None` if nothing needs logging.
    fn begin_commit(&mut self, freed: &[u64], cluster: u64, forced: bool) -> Option<PendingRecord> {
        if self.committing.is_some() {
            return None;
        }
        let eager = self.eager.take();
        let mut sums = std::mem::take(&mut self.sums);
        self.interval_bytes = 0;
        self.last_interval_writes = std::mem::take(&mut self.interval_writes);
        sums.drop_freed(freed, cluster);
        let proves_something = forced && !self.unproven.is_empty();
        if !self.log.has_entries() && sums.is_empty() && !proves_something {
            return None;
        }
        let bytes = self.encode(
            self.log
                .iter()
                .filter(|u| !u.retired)
                .map(Update::entry)
                .collect(),
            &sums,
        );
        self.unproven.extend(sums.spans());
        self.committing = Some(sums);
        self.committing_generation = self.generation;
        self.generation += 1;
        Some(PendingRecord {
            at: self.ext.slot_offset(self.next_seq),
            written: eager.as_deref() == Some(&bytes[..]),
            bytes,
        })
    }

    /// The commit's sync returned: its record is the newest, what the one
    /// before needed is proven, and updates placed before it are durable.
    fn end_commit(&mut self) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.records += 1;
        let sums = self.committing.take().unwrap_or_default();
        self.durable_generation = Some(self.committing_generation);
        self.unproven = sums.spans().collect();
        self.log.retire_placed(seq);
    }

    /// The commit failed before its record was known durable: its
    /// checksums are needed again, and the next attempt reuses the same
    /// slot (the other one holds the last good record).
    fn abort_commit(&mut self) {
        if let Some(older) = self.committing.take() {
            self.sums.absorb_older(older);
        }
    }

    /// Updates to write in place now (after commit `seq` synced): all
    /// once the log is big (or `all`), except held data over bytes a
    /// record still needs, including the open interval's pieces (a write
    /// held during the commit's sync may cover data checksummed after the
    /// record was taken). They stay logged until the next commit's sync.
    fn take_checkpoint(&mut self, all: bool) -> Vec<(Target, u64, Vec<u8>)> {
        if !all && self.log.bytes < CHECKPOINT_AT_BYTES {
            return Vec::new();
        }
        let seq = self.next_seq;
        // Only what a durable record holds: an update logged during the
        // last commit's unlocked sync is in no record yet.
        let durable = |u: &Update| self.durable_generation.is_some_and(|d| u.logged <= d);
        // In log order: a held write that waits keeps every newer one over
        // the same bytes waiting too, or the older would land last.
        let mut waiting: Vec<(u64, u64)> = Vec::new();
        let blocked: Vec<bool> = self
            .log
            .updates
            .iter()
            .map(|slot| {
                let Some(u) = slot
                    .as_ref()
                    .filter(|u| u.target.is_data() && u.placed.is_none())
                else {
                    return false;
                };
                let (at, end) = (u.offset, u.offset + u.bytes.len() as u64);
                let blocked = !durable(u)
                    || self.old_bytes_needed(at, end)
                    || waiting.iter().any(|&(a, e)| a < end && at < e);
                if blocked {
                    waiting.push((at, end));
                }
                blocked
            })
            .collect();
        let mut out = Vec::new();
        for (slot, blocked) in self.log.updates.iter_mut().zip(blocked) {
            if let Some(u) = slot
                && u.placed.is_none()
                && !blocked
                && durable(u)
            {
                u.placed = Some(seq);
                out.push((u.target, u.offset, u.bytes.clone()));
            }
        }
        out
    }

    /// The last checkpoint's writes failed: its updates are placed again
    /// by a later one (left placed, the next commit would retire them as
    /// if they were durable in place).
    fn unplace(&mut self) {
        let seq = self.next_seq;
        for u in self.log.updates.iter_mut().flatten() {
            if u.placed == Some(seq) {
                u.placed = None;
            }
        }
    }

    /// Whether a record of `bytes` fits a slot.
    fn fits(&self, bytes: usize) -> bool {
        bytes as u64 <= self.ext.slot_bytes()
    }
}

/// Merges overlapping updates of one file into one write each, applying
/// them in the order given (the log's), so the newest bytes win.
fn coalesce(updates: Vec<(Target, u64, Vec<u8>)>) -> Vec<(Target, u64, Vec<u8>)> {
    let file = |t: Target| t.is_data();
    let mut order: Vec<usize> = (0..updates.len()).collect();
    order.sort_by_key(|&i| (file(updates[i].0), updates[i].1));
    let mut out = Vec::new();
    let mut group: Vec<usize> = Vec::new();
    let mut group_end = 0;
    let merge = |group: &mut Vec<usize>, end: u64, out: &mut Vec<(Target, u64, Vec<u8>)>| {
        let Some(&first) = group.first() else {
            return;
        };
        let start = updates[first].1;
        let mut bytes = vec![0u8; (end - start) as usize];
        group.sort_unstable();
        for &i in group.iter() {
            let (_, at, b) = &updates[i];
            bytes[(at - start) as usize..][..b.len()].copy_from_slice(b);
        }
        out.push((updates[first].0, start, bytes));
        group.clear();
    };
    for i in order {
        let (target, at, ref b) = updates[i];
        let joins = group
            .first()
            .is_some_and(|&g| file(updates[g].0) == file(target) && at < group_end);
        if !joins {
            merge(&mut group, group_end, &mut out);
            group_end = 0;
        }
        group.push(i);
        group_end = group_end.max(at + b.len() as u64);
    }
    merge(&mut group, group_end, &mut out);
    out
}

/// A table's code in records (any unknown code replays as plain
/// metadata of the journal's own class).
fn table_code(table: MetaTable) -> u8 {
    match table {
        MetaTable::Header => 1,
        MetaTable::L1 => 2,
        MetaTable::L2 => 3,
        MetaTable::RefcountTable => 4,
        MetaTable::RefcountBlock => 5,
        MetaTable::SnapshotTable => 6,
        MetaTable::Bitmap => 7,
        MetaTable::Journal => 8,
    }
}

fn table_of(code: u8) -> MetaTable {
    match code {
        1 => MetaTable::Header,
        2 => MetaTable::L1,
        3 => MetaTable::L2,
        4 => MetaTable::RefcountTable,
        5 => MetaTable::RefcountBlock,
        6 => MetaTable::SnapshotTable,
        7 => MetaTable::Bitmap,
        _ => MetaTable::Journal,
    }
}

/// Copies the part of `src` (at `src_at`) that overlaps `buf` (at `at`).
fn overlay(at: u64, buf: &mut [u8], src_at: u64, src: &[u8]) {
    let start = at.max(src_at);
    let end = (at + buf.len() as u64).min(src_at + src.len() as u64);
    if start < end {
        buf[(start - at) as usize..(end - at) as usize]
            .copy_from_slice(&src[(start - src_at) as usize..(end - src_at) as usize]);
    }
}

impl Locked<'_> {
    /// Whether table writes go to the journal.
    pub(crate) fn journaling(&self) -> bool {
        self.m.journal.is_some()
    }
}

impl Qcow2Image {
    /// A guest flush with the journal on: one record, one sync. Flushes
    /// that arrive while a commit runs are served together by the next
    /// one (group commit): a commit that starts after a flush arrived
    /// covers every write that completed before it.
    pub(crate) fn commit(&self) -> Result<super::FlushReport> {
        use std::sync::atomic::Ordering;
        let ticket = self.commit_requests.fetch_add(1, Ordering::SeqCst) + 1;
        let _commit = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.commits_cover.load(Ordering::SeqCst) >= ticket {
            return Ok(super::FlushReport::default());
        }
        let covers = self.commit_requests.load(Ordering::SeqCst);
        let report = self.commit_locked(false, false)?;
        self.commits_cover.fetch_max(covers, Ordering::SeqCst);
        Ok(report)
    }

    /// A commit no guest asked for (the interval grew big), followed by a
    /// record that proves it: without the second, every write over data
    /// the first one checksums would be held in memory until some guest
    /// flush.
    pub(crate) fn commit_grown_interval(&self) -> Result<()> {
        self.commit()?;
        self.commit_with(true, false).map(|_| ())
    }

    /// `forced`: write a record even with nothing new, so the newest
    /// checksums are proven; `checkpoint_all`: afterwards write every
    /// update in place.
    fn commit_with(&self, forced: bool, checkpoint_all: bool) -> Result<super::FlushReport> {
        let _commit = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.commit_locked(forced, checkpoint_all)
    }

    /// [`Self::commit_with`] with the commit lock held.
    fn commit_locked(&self, forced: bool, checkpoint_all: bool) -> Result<super::FlushReport> {
        let (report, ticket, record) = {
            let mut l = self.settle_sums(self.lock())?;
            let (report, ticket) = l.write_back_metadata(false)?;
            let freed = self.freed_this_interval(&l);
            let cluster = self.geometry.cluster_size();
            let Some(j) = l.m.journal.as_mut() else {
                return Err(ImageError::corrupt(self.name(), "the journal vanished"));
            };
            let record = j.begin_commit(&freed, cluster, forced);
            if let Some(PendingRecord { bytes, .. }) = &record
                && !j.fits(bytes.len())
            {
                j.abort_commit();
                return Err(ImageError::Unsupported {
                    image: self.name().to_string(),
                    reason: format!(
                        "a metadata journal record of {} bytes does not fit the journal's {}-byte slot",
                        bytes.len(),
                        j.ext.slot_bytes()
                    ),
                });
            }
            (report, ticket, record)
        };
        let synced = record
            .as_ref()
            .filter(|r| !r.written)
            .map_or(Ok(()), |r| {
                self.journal_store().write_record(r.at, &r.bytes)
            })
            .and_then(|()| {
                self.io
                    .flush(&self.handle, FlushKind::Durable)
                    .map_err(|e| ImageError::io(self.name(), "flush", e))
            });
        let mut l = self.lock();
        let Some(j) = l.m.journal.as_mut() else {
            return Err(ImageError::corrupt(self.name(), "the journal vanished"));
        };
        if let Err(e) = synced {
            j.abort_commit();
            return Err(e);
        }
        if let Some(r) = &record {
            j.eager_records += u64::from(r.written);
            j.end_commit();
        }
        // A guest writing once per flush gets its checkpoints written
        // beside its next eager record instead of before this flush's
        // reply (unless the log has grown far past its threshold).
        let leave_to_eager =
            !checkpoint_all && j.wants_eager() && j.log.bytes < EAGER_CHECKPOINT_LIMIT;
        let updates = if leave_to_eager {
            Vec::new()
        } else {
            j.take_checkpoint(checkpoint_all)
        };
        if !updates.is_empty() {
            // Without the metadata lock: the updates stay logged (reads
            // see them), a newer update of a range is logged over them,
            // and the commit lock keeps the next commit (whose sync makes
            // them durable) waiting until they are all written.
            drop(l);
            let written = self.journal_store().write_updates(updates);
            l = self.lock();
            if let Err(e) = written {
                if let Some(j) = l.m.journal.as_mut() {
                    j.unplace();
                }
                return Err(e);
            }
        }
        let held = l.m.journal.as_ref().is_some_and(Journal::holds_data);
        self.held.store(held, std::sync::atomic::Ordering::SeqCst);
        l.sync_done(ticket)?;
        Ok(super::FlushReport {
            barriers: 1,
            ..report
        })
    }

    /// Clusters whose release this interval's record makes durable.
    fn freed_this_interval(&self, l: &Locked<'_>) -> Vec<u64> {
        if self.external_data {
            Vec::new()
        } else {
            l.m.pending_frees.clone()
        }
    }

    /// An eager record for a write about to be issued, if the guest
    /// flushes after each single write and no commit runs: the record the
    /// flush would write once this write has completed and mapped
    /// `mappings` (guest cluster, new entry), with `pieces` checksummed.
    /// Written in parallel with the data ([`EagerRecord::write`]), it
    /// leaves the flush only its sync. Whether the flush may skip the
    /// write is decided by comparing bytes: anything else that changes the
    /// interval meanwhile makes the flush write its own record.
    ///
    /// Safe unsynced: it is written to the slot the next record takes
    /// (never over the newest durable one), and recovery replays it only
    /// if every piece it checksums is intact, i.e. only if this write
    /// landed whole; otherwise it replays the record before.
    pub(crate) fn eager_record(
        &self,
        mappings: &[(u64, L2Mapping)],
        pieces: &[Piece],
    ) -> Result<Option<EagerRecord<'_>>> {
        // Only the journal checksums pieces.
        if pieces.is_empty() {
            return Ok(None);
        }
        // A commit running now would take this slot; its record covers
        // the write's predecessors, and the flush after it writes its own.
        let commit = match self.commit_lock.try_lock() {
            Ok(guard) => guard,
            // As `commit` does: a panic elsewhere leaves nothing half done
            // under this lock that a later commit would not redo.
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
        };
        let mut l = self.lock();
        if !l.m.journal.as_ref().is_some_and(Journal::wants_eager) {
            return Ok(None);
        }
        // Moves the tables this write allocated into the log (no sync
        // follows: this only logs them earlier than the flush would).
        l.write_back_metadata(false)?;
        let slices = l.l2_slices_with(mappings)?;
        let freed = self.freed_this_interval(&l);
        let cluster = self.geometry.cluster_size();
        let Some(j) = l.m.journal.as_mut() else {
            return Ok(None);
        };
        let (at, bytes) = j.preview_record(&slices, pieces, &freed, cluster);
        if !j.fits(bytes.len()) {
            return Ok(None);
        }
        Ok(Some(EagerRecord {
            _commit: commit,
            at,
            bytes,
            checkpoint: j.take_checkpoint(false),
        }))
    }

    /// The eager record's writes returned: if the record's succeeded, its
    /// slot holds its bytes; a checkpoint that failed is taken again later.
    /// Releases the commit lock.
    pub(crate) fn eager_written(&self, record: EagerRecord<'_>, writes: EagerWrites) {
        // Its commit lock is held until the journal knows what the slot holds.
        let _commit = record;
        let mut l = self.lock();
        let Some(j) = l.m.journal.as_mut() else {
            return;
        };
        if let Err(e) = writes.checkpointed {
            tracing::warn!(
                image = self.name(),
                "metadata journal checkpoint: {e} (retried later)"
            );
            j.unplace();
        }
        match writes.recorded {
            Ok(()) => j.eager_written(writes.bytes),
            Err(e) => tracing::debug!(image = self.name(), "eager journal record not written: {e}"),
        }
    }

    /// What the journal's writes need, owned (see [`JournalStore`]).
    fn journal_store(&self) -> JournalStore {
        JournalStore {
            io: self.io.clone(),
            handle: self.handle.clone(),
            data: self.data.clone(),
            disk: self.disk,
        }
    }

    /// Lays held full-mode writes over data just read (cheap when none).
    pub(crate) fn overlay_held(&self, offset: u64, buf: &mut [u8]) {
        if !self.held.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        if let Some(j) = self.lock().m.journal.as_ref() {
            j.overlay_data(offset, buf);
        }
    }

    /// Where a data write goes (see [`Journal::place_data`]).
    pub(crate) fn place_data(
        &self,
        at: u64,
        segments: &[WriteSegment<'_>],
        maps_new: bool,
        may_hold_big: bool,
    ) -> Placement {
        let mut l = self.lock();
        let Some(j) = l.m.journal.as_mut() else {
            return Placement::InPlace(Vec::new());
        };
        let placement = j.place_data(at, segments, maps_new, may_hold_big);
        if placement == Placement::Held {
            self.held.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        placement
    }

    /// Data placed in place was written: its pieces join the interval
    /// (with the metadata lock held by the caller, who maps the data in
    /// the same hold); `overwrites` of the writes were [`Placement::Over`].
    pub(crate) fn data_written(l: &mut Locked<'_>, written: &[Piece], overwrites: usize) {
        if let Some(j) = l.m.journal.as_mut() {
            j.add_written(written, overwrites);
            if overwrites > 0 {
                l.img.overwrites_done.notify_all();
            }
        }
    }

    /// [`Placement::Over`] writes of these spans failed: nobody knows what
    /// is in place there now, so the next commit checksums it anew.
    pub(crate) fn overwrites_failed(&self, spans: &[(u64, u64)]) {
        let mut l = self.lock();
        if let Some(j) = l.m.journal.as_mut() {
            j.unknown.extend_from_slice(spans);
            j.overwrites_finished(spans.len());
        }
        self.overwrites_done.notify_all();
    }

    /// Waits until no [`Placement::Over`] write is in flight (none is
    /// placed meanwhile), then checksums anew what no checksum vouches
    /// for: the record taken next in this hold vouches for exactly the
    /// bytes in place.
    fn settle_sums<'a>(&'a self, mut l: Locked<'a>) -> Result<Locked<'a>> {
        loop {
            let Some(j) = l.m.journal.as_mut() else {
                return Ok(l);
            };
            if j.overwrites > 0 {
                j.draining = true;
                j.overwrite_waits += 1;
                let Locked { img, mut m } = l;
                while m.journal.as_ref().is_some_and(|j| j.overwrites > 0) {
                    m = self
                        .overwrites_done
                        .wait(m)
                        .unwrap_or_else(|p| p.into_inner());
                }
                l = Locked { img, m };
            }
            let Some(j) = l.m.journal.as_mut() else {
                return Ok(l);
            };
            let unknown = std::mem::take(&mut j.unknown);
            if unknown.is_empty() {
                j.draining = false;
                return Ok(l);
            }
            // Whole pieces: what is read replaces them without a cut.
            let spans: Vec<(u64, u64)> =
                unknown.iter().map(|&(a, e)| j.sums.extent(a, e)).collect();
            j.draining = true;
            drop(l);
            let read = self.checksum_in_place(&spans);
            l = self.lock();
            let Some(j) = l.m.journal.as_mut() else {
                return Ok(l);
            };
            match read {
                Ok(pieces) => {
                    for piece in pieces {
                        if let Some(span) = j.sums.put(piece) {
                            j.unknown.push(span);
                        }
                    }
                }
                Err(e) => {
                    j.unknown.extend(unknown);
                    j.draining = false;
                    return Err(e);
                }
            }
        }
    }

    /// The pieces of the data now in place in `spans`.
    fn checksum_in_place(&self, spans: &[(u64, u64)]) -> Result<Vec<Piece>> {
        let mut out = Vec::new();
        for &(at, end) in spans {
            let mut buf = vec![0u8; (end - at) as usize];
            self.io
                .read(
                    &self.data,
                    HostOffset(at),
                    &mut buf,
                    IoTag::meta(MetaTable::Journal, self.disk),
                )
                .map_err(|e| ImageError::io(self.name(), "read data to checksum it", e))?;
            out.extend(pieces(
                at,
                &[WriteSegment {
                    data: &buf,
                    tag: IoTag::meta(MetaTable::Journal, self.disk),
                }],
            ));
        }
        Ok(out)
    }

    /// Whether the open interval should be committed now.
    pub(crate) fn journal_wants_commit(&self) -> bool {
        let l = self.lock();
        l.m.journal.as_ref().is_some_and(Journal::wants_commit)
            || (l.journaling() && l.m.pending_frees.len() > super::persist::MAX_PENDING_FREES)
    }

    /// What the metadata journal holds, if it is on.
    pub fn journal_stats(&self) -> Option<JournalStats> {
        let l = self.lock();
        let j = l.m.journal.as_ref()?;
        Some(JournalStats {
            records: j.records,
            eager_records: j.eager_records,
            held_writes: j.held_writes,
            overwrite_waits: j.overwrite_waits,
            logged_bytes: j.log.bytes as u64,
            held_bytes: j
                .log
                .iter()
                .filter(|u| u.target.is_data())
                .map(|u| u.bytes.len() as u64)
                .sum(),
        })
    }
}

/// The record recovery replays: the newest, if the data it checksums is
/// all there (its sync finished), else the one before it (which the
/// newest's existence proves complete). Also returns the newest record's
/// sequence number.
pub(crate) fn record_to_replay(
    ext: &JournalExtension,
    slots: [&[u8]; 2],
    data_sum: &mut dyn FnMut(u64, u32) -> Result<Sum>,
) -> Result<Option<(Record, u64)>> {
    let mut found: Vec<Record> = slots
        .iter()
        .filter_map(|s| Record::decode(s, &ext.id))
        .collect();
    found.sort_by_key(|r| r.seq);
    let Some(newest) = found.pop() else {
        return Ok(None);
    };
    let newest_seq = newest.seq;
    let Some(torn) = first_torn(&newest, data_sum)? else {
        return Ok(Some((newest, newest_seq)));
    };
    let previous = found.pop().filter(|r| r.seq + 1 == newest_seq);
    tracing::info!(
        newest = newest_seq,
        torn_data_at = torn,
        replaying = previous.as_ref().map(|r| r.seq),
        "the newest metadata journal record's data is torn: its sync never finished"
    );
    Ok(previous.map(|r| (r, newest_seq)))
}

/// Makes recovery's choice of `chosen` final before any of it is
/// replayed: a copy without checksums, numbered above every record and
/// put in the slot `chosen` does not use, made durable with the data the
/// checksums vouched for. Replaying a held write can change bytes the
/// record checksums; without this, a crash in mid-replay would make the
/// next recovery take the record for torn and replay an older one.
fn settle(
    handle: &crate::hostio::ImageHandle,
    io: &dyn crate::hostio::HostIo,
    ext: &JournalExtension,
    chosen: &Record,
    newest: u64,
    disk: crate::hostio::DiskId,
) -> Result<()> {
    let name = &*handle.name;
    let settled = Record {
        seq: if (newest + 1) % 2 == chosen.seq % 2 {
            newest + 2
        } else {
            newest + 1
        },
        entries: chosen
            .entries
            .iter()
            .filter(|e| !matches!(e, Entry::Checksum { .. }))
            .cloned()
            .collect(),
    };
    io.write(
        handle,
        HostOffset(ext.slot_offset(settled.seq)),
        &[WriteSegment {
            data: &settled.encode(&ext.id),
            tag: IoTag::meta(MetaTable::Journal, disk),
        }],
    )
    .map_err(|e| ImageError::io(name, "settle the metadata journal", e))?;
    io.flush(handle, FlushKind::Durable)
        .map_err(|e| ImageError::io(name, "flush", e))
}

/// Where the first piece of data `r` checksums differs from it, if any.
fn first_torn(
    r: &Record,
    data_sum: &mut dyn FnMut(u64, u32) -> Result<Sum>,
) -> Result<Option<u64>> {
    for e in &r.entries {
        if let Entry::Checksum { offset, len, sum } = e
            && data_sum(*offset, *len)? != *sum
        {
            return Ok(Some(*offset));
        }
    }
    Ok(None)
}

/// The checksum a piece of data has in a record.
pub(crate) fn checksum(data: &[u8]) -> Sum {
    crc32c::crc32c(data).to_be_bytes()
}

/// Bytes a journal slot needs for an image with these metadata caches.
pub(crate) fn slot_bytes(cache: &crate::meta_cache::MetaCacheConfig, cluster: u64) -> u64 {
    // Dirty slices (at most the cache), updates placed at the last
    // checkpoint and not yet durable, and an interval's growth before it
    // commits on its own (each bounded by the constants above).
    let grown = 2 * (COMMIT_AT_BYTES + CHECKPOINT_AT_BYTES + MAX_HELD_WRITE) as u64;
    let want = cache.l2_bytes + cache.refcount_bytes + grown + 4 * cluster;
    record_len(want as usize).next_multiple_of(cluster)
}

impl Qcow2Image {
    /// Turns the journal on for this open: the area (the one a crash left,
    /// or new clusters), a new journal id, and the feature bit, all durable
    /// before the first transaction. `required`: a version 2 image (no
    /// feature bits to guard the journal) is refused rather than served
    /// without one. `preallocate`: write zeros ahead of allocation.
    pub(crate) fn start_journal(&self, required: bool, preallocate: bool) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let mut l = self.lock();
        if l.m.header.version < 3 {
            if required {
                return Err(ImageError::Unsupported {
                    image: self.name().to_string(),
                    reason: "a version 2 (compat=0.10) image has no feature bit to keep QEMU away from a journaled image; upgrade it with `qemu-img amend -o compat=1.1`, or serve it with the metadata journal off".into(),
                });
            }
            return Ok(());
        }
        let g = self.geometry;
        let cs = g.cluster_size();
        let ext = match l.m.header.extensions.meta_journal {
            Some(old) => JournalExtension {
                id: super::marks::random_id(),
                ..old
            },
            None => {
                let slot = slot_bytes(&self.cache_config, cs);
                let first = match l.alloc_clusters(2 * slot / cs) {
                    Ok(first) => first,
                    Err(e @ ImageError::NoSpace { .. }) if !required => {
                        tracing::warn!(
                            image = self.name(),
                            "no room for the metadata journal ({} bytes): serving without it ({e})",
                            2 * slot
                        );
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                };
                // Its refcounts reach the file only after the header names
                // it (below): a crash in between leaves a named journal,
                // and the next open rebuilds refcounts, instead of a
                // leaked area nothing names.
                JournalExtension {
                    offset: g.cluster_offset(first),
                    size: 2 * slot,
                    id: super::marks::random_id(),
                }
            }
        };
        let zero = [0u8; 512];
        for at in [ext.offset, ext.slot_offset(1), ext.offset + ext.size - 512] {
            l.write_in_place(MetaTable::Journal, at, &zero)?;
        }
        let mut wanted = l.m.header.extensions.clone();
        wanted.meta_journal = Some(ext);
        super::marks::name_bits(
            &mut wanted.feature_names,
            &[(FeatureKind::Incompatible, 57)],
        );
        let mut first = self.read_first_cluster()?;
        let bits = l.m.header.incompatible_features | incompatible::META_JOURNAL;
        first[field_offset::INCOMPATIBLE_FEATURES as usize..][..8]
            .copy_from_slice(&bits.to_be_bytes());
        self.rewrite_header(&mut l, &first, &wanted)?;
        l.flush_all(false)?;
        if l.m.map.kind_at(g.host_cluster(HostOffset(ext.offset))) != Some(MetaKind::Journal)
            && let Err(o) = l.m.map.insert(&g, ext.offset, ext.size, MetaKind::Journal)
        {
            return Err(l.corruption(format!("the metadata journal: {o}")));
        }
        l.m.journal = Some(Journal::new(ext));
        if preallocate && self.io.copies().holder().is_none() {
            // Below a cache the zeros would only fill flash.
            l.m.prealloc = Some(super::prealloc::Prealloc::new());
        }
        Ok(())
    }

    /// Commits what is open, puts every table in place durably, then
    /// drops the journal: the bit and the extension go first (no stale
    /// record is ever replayed), then the area's clusters are freed.
    pub(crate) fn stop_journal(&self) -> Result<()> {
        if !self.lock().journaling() {
            return Ok(());
        }
        // Held from the first commit to the end: an eager record built in
        // between would move dirty tables into a log nothing writes out.
        let _commit = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.commit_locked(false, false)?;
        self.commit_locked(true, true)?;
        let mut l = self.lock();
        l.sync(FlushKind::Durable)?;
        l.m.journal = None;
        self.drop_journal_area(&mut l)?;
        l.trim_preallocation()
    }

    /// A journal area an earlier session left (its records were applied
    /// at open) goes when this session runs without one.
    pub(crate) fn drop_leftover_journal(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let mut l = self.lock();
        self.drop_journal_area(&mut l)
    }

    /// Frees the journal's area, then removes its extension and bit. In
    /// that order: a crash in between leaves a journal the header still
    /// names (its last record, if any, replays what the tables already
    /// hold), and the next open rebuilds the refcounts; the other order
    /// would leak the area.
    pub(crate) fn drop_journal_area(&self, l: &mut Locked<'_>) -> Result<()> {
        let Some(ext) = l.m.header.extensions.meta_journal else {
            return Ok(());
        };
        let g = self.geometry;
        l.m.map.remove(&g, ext.offset, ext.size, MetaKind::Journal);
        let cs = g.cluster_size();
        // Freed here rather than queued: nothing but the header references
        // the area, and one discard of it beats one per cluster.
        for c in ext.offset / cs..(ext.offset + ext.size) / cs {
            if l.refcount(c)? > 0 {
                l.add_refcount(c, -1)?;
                l.m.map.forget(c);
            }
        }
        l.flush_all(true)?;
        let mut wanted = l.m.header.extensions.clone();
        wanted.meta_journal = None;
        let mut first = self.read_first_cluster()?;
        let bits = l.m.header.incompatible_features & !incompatible::META_JOURNAL;
        first[field_offset::INCOMPATIBLE_FEATURES as usize..][..8]
            .copy_from_slice(&bits.to_be_bytes());
        self.rewrite_header(l, &first, &wanted)?;
        let tag = IoTag {
            class: IoClass::Reclaim,
            disk: self.disk,
            guest_cluster: None,
            unit: None,
        };
        // Advisory: a store without discard keeps the bytes.
        let _ = self
            .io
            .discard(&self.handle, HostOffset(ext.offset), ext.size, tag);
        Ok(())
    }

    /// Rewrites the header (from `first`, its first cluster with any field
    /// changes) to carry `wanted` extensions, crash-safely, and reloads it.
    fn rewrite_header(
        &self,
        l: &mut Locked<'_>,
        first: &[u8],
        wanted: &vdcache_qcow2::header::Extensions,
    ) -> Result<()> {
        let plan =
            l.m.header
                .rewrite_plan(first, wanted)
                .map_err(|e| ImageError::Unsupported {
                    image: self.name().to_string(),
                    reason: format!("the metadata journal cannot be recorded in the header ({e})"),
                })?;
        for w in &plan {
            self.write_header_durable(&[(w.offset, &w.bytes)])?;
        }
        let first = self.read_first_cluster()?;
        let header = Header::parse(&first).map_err(|e| ImageError::format(self.name(), e))?;
        l.m.header = Header {
            // A reload must not forget a cache mark stamped in memory only.
            extensions: vdcache_qcow2::header::Extensions {
                cache_mark: header.extensions.cache_mark.clone().or(l
                    .m
                    .header
                    .extensions
                    .cache_mark
                    .clone()),
                ..header.extensions.clone()
            },
            ..header
        };
        Ok(())
    }
}

/// Applies what a crash left in an image's metadata journal, before the
/// image is opened (its tables are read from the file). Returns the
/// header as it stands afterwards and the number of records replayed.
/// A read-only open of an image with records to replay is refused.
/// The bytes of journal slot `slot` that its record (if any) takes: its
/// header first, then as much as the header says, within the slot and the
/// file (a slot is far bigger than most records).
fn read_slot(
    handle: &crate::hostio::ImageHandle,
    io: &dyn crate::hostio::HostIo,
    ext: &JournalExtension,
    slot: u64,
    file_len: u64,
    disk: crate::hostio::DiskId,
) -> Result<Vec<u8>> {
    let at = ext.slot_offset(slot);
    let room = ext.slot_bytes().min(file_len.saturating_sub(at)) as usize;
    let read = |buf: &mut [u8]| {
        io.read(
            handle,
            HostOffset(at),
            buf,
            IoTag::meta(MetaTable::Journal, disk),
        )
        .map_err(|e| ImageError::io(&handle.name, "read the metadata journal", e))
    };
    let mut buf = vec![0u8; RECORD_HEADER.min(room)];
    read(&mut buf)?;
    if let Some(len) = Record::stored_len(&buf, &ext.id).filter(|&l| l > buf.len()) {
        buf.resize(len.min(room), 0);
        read(&mut buf)?;
    }
    Ok(buf)
}

pub(crate) fn recover(
    handle: &crate::hostio::ImageHandle,
    data: Option<&crate::hostio::ImageHandle>,
    io: &dyn crate::hostio::HostIo,
    header: Header,
    writable: bool,
    disk: crate::hostio::DiskId,
) -> Result<(Header, usize)> {
    let name = &*handle.name;
    if header.incompatible_features & incompatible::META_JOURNAL == 0 {
        return Ok((header, 0));
    }
    let Some(ext) = header.extensions.meta_journal else {
        return Err(ImageError::corrupt(
            name,
            "the metadata journal bit is set but the header does not say where the journal is",
        ));
    };
    let file_len = io
        .len(handle)
        .map_err(|e| ImageError::io(name, "stat", e))?;
    let mut slots = [Vec::new(), Vec::new()];
    for (i, slot) in slots.iter_mut().enumerate() {
        *slot = read_slot(handle, io, &ext, i as u64, file_len, disk)?;
    }
    let data = data.unwrap_or(handle);
    let data_len = io.len(data).map_err(|e| ImageError::io(name, "stat", e))?;
    let mut data_sum = |offset: u64, len: u32| -> Result<Sum> {
        if offset.saturating_add(u64::from(len)) > data_len {
            return Ok([0; CHECKSUM_BYTES]);
        }
        let mut buf = vec![0u8; len as usize];
        io.read(
            data,
            HostOffset(offset),
            &mut buf,
            IoTag::meta(MetaTable::Journal, disk),
        )
        .map_err(|e| ImageError::io(name, "read data the journal checksums", e))?;
        Ok(checksum(&buf))
    };
    let Some((record, newest)) = record_to_replay(&ext, [&slots[0], &slots[1]], &mut data_sum)?
    else {
        return Ok((header, 0));
    };
    if !writable {
        return Err(ImageError::Unsupported {
            image: name.to_string(),
            reason: "its metadata journal holds updates its tables lack; open it writable once (or run `vdcache recover IMAGE`) to apply them".into(),
        });
    }
    // The data first: the checksums that chose the record vouch for it.
    if !std::ptr::eq(data, handle) {
        io.flush(data, FlushKind::Durable)
            .map_err(|e| ImageError::io(name, "flush", e))?;
    }
    settle(handle, io, &ext, &record, newest, disk)?;
    for e in &record.entries {
        let (target, offset, bytes, tag) = match e {
            Entry::Meta {
                offset,
                table,
                bytes,
            } => (handle, *offset, bytes, IoTag::meta(table_of(*table), disk)),
            Entry::Data { offset, bytes } => (
                data,
                *offset,
                bytes,
                IoTag {
                    class: IoClass::GuestData,
                    disk,
                    guest_cluster: None,
                    unit: None,
                },
            ),
            Entry::Checksum { .. } => continue,
        };
        io.write(
            target,
            HostOffset(offset),
            &[WriteSegment { data: bytes, tag }],
        )
        .map_err(|e| ImageError::io(name, "apply the metadata journal", e))?;
    }
    io.flush(handle, FlushKind::Durable)
        .map_err(|e| ImageError::io(name, "flush", e))?;
    if !std::ptr::eq(data, handle) {
        io.flush(data, FlushKind::Durable)
            .map_err(|e| ImageError::io(name, "flush", e))?;
    }
    tracing::info!(
        image = name,
        record = record.seq,
        "applied the metadata journal"
    );
    let (header, _) = super::read_header(handle, io, disk)?;
    Ok((header, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_replays_as_itself() {
        for t in [
            MetaTable::Header,
            MetaTable::L1,
            MetaTable::L2,
            MetaTable::RefcountTable,
            MetaTable::RefcountBlock,
            MetaTable::SnapshotTable,
            MetaTable::Bitmap,
            MetaTable::Journal,
        ] {
            assert_eq!(table_of(table_code(t)), t);
        }
    }

    fn data(bytes: &[u8]) -> [WriteSegment<'_>; 1] {
        [WriteSegment {
            data: bytes,
            tag: IoTag {
                class: IoClass::GuestData,
                disk: crate::hostio::DiskId(0),
                guest_cluster: None,
                unit: None,
            },
        }]
    }

    fn journal() -> Journal {
        Journal::new(JournalExtension {
            offset: 1 << 20,
            size: 2 << 20,
            id: [7; 16],
        })
    }

    /// A whole commit whose sync returned (`forced`: even with nothing new).
    fn commit(j: &mut Journal, forced: bool) {
        assert!(j.begin_commit(&[], 65536, forced).is_some());
        j.end_commit();
    }

    #[test]
    fn a_write_held_during_a_commit_is_not_checkpointed_over_the_next_records_pieces() {
        let mut j = journal();
        j.add_meta(MetaTable::L2, 0x10000, &[1; 8]);
        assert!(j.begin_commit(&[], 65536, false).is_some());
        // While that record is written and synced, a new cluster's data
        // lands (its checksum goes to the next record), and a write over
        // it that cannot be checksummed on its own (it ends inside a
        // sector) is held.
        let Placement::InPlace(pieces) = j.place_data(0x40000, &data(&[5; 4096]), true, false)
        else {
            panic!("new data over nothing is written in place");
        };
        j.add_written(&pieces, 0);
        let over = j.place_data(0x40200, &data(&[6; 500]), false, false);
        assert_eq!(over, Placement::Held);
        j.end_commit();
        let placed = j.take_checkpoint(true);
        assert!(
            placed.iter().all(|(t, ..)| !t.is_data()),
            "the held write went in place over bytes the next record checksums"
        );
        // Once a record with that checksum is proven by the next, it goes.
        commit(&mut j, true);
        commit(&mut j, true);
        let placed = j.take_checkpoint(true);
        assert!(
            placed
                .iter()
                .any(|(t, at, b)| t.is_data() && *at == 0x40200 && b == &vec![6u8; 500]),
            "the held write reaches its place once nothing needs the old bytes"
        );
    }

    #[test]
    fn a_held_write_waiting_for_proof_keeps_newer_writes_over_it_waiting() {
        let mut j = journal();
        // New data in the second half of a cluster; the open interval
        // checksums it.
        let Placement::InPlace(pieces) = j.place_data(0x48000, &data(&[1; 0x8000]), true, false)
        else {
            panic!("new data over nothing is written in place");
        };
        j.add_written(&pieces, 0);
        // A write of the cluster but for its last bytes is held (it covers
        // that data, and ends inside a sector), then a newer one of its
        // first eighth (over nothing a record needs).
        let older = j.place_data(0x40000, &data(&[2; 0xfff8]), false, false);
        let newer = j.place_data(0x40000, &data(&[3; 0x2000]), false, false);
        assert_eq!((older, newer), (Placement::Held, Placement::Held));
        commit(&mut j, false);
        let placed = j.take_checkpoint(true);
        assert!(
            placed.iter().all(|(t, ..)| !t.is_data()),
            "a newer write went in place before an older one over the same bytes, which would land last"
        );
        commit(&mut j, true);
        commit(&mut j, true);
        let data: Vec<_> = j
            .take_checkpoint(true)
            .into_iter()
            .filter(|(t, ..)| t.is_data())
            .collect();
        let merged = coalesce(data);
        assert_eq!(merged.len(), 1);
        assert_eq!(
            &merged[0].2[..0x2000],
            &[3; 0x2000][..],
            "the newer bytes win"
        );
        assert_eq!(&merged[0].2[0x2000..], &[2; 0xdff8][..]);
    }

    #[test]
    fn a_held_write_in_the_newest_record_keeps_blocking_writes_in_place() {
        let mut j = journal();
        let Placement::InPlace(pieces) = j.place_data(0x40000, &data(&[1; 0x10000]), true, false)
        else {
            panic!("new data over nothing is written in place");
        };
        j.add_written(&pieces, 0);
        // Held (over checksummed data), unaligned at its end.
        assert_eq!(
            j.place_data(0x40000, &data(&[2; 0xefce]), false, false),
            Placement::Held
        );
        commit(&mut j, false);
        commit(&mut j, true);
        let placed = j.take_checkpoint(true);
        assert!(
            placed.iter().any(|(t, ..)| t.is_data()),
            "placed once proven"
        );
        // The commit whose sync makes it durable in place still logs it:
        // that record is the newest, and recovery would replay it.
        let record = j.begin_commit(&[], 65536, true).expect("a record").bytes;
        j.end_commit();
        let logged = |bytes: &[u8]| {
            record_has(bytes, |e| {
                matches!(
                    e,
                    Entry::Data {
                        offset: 0x40000,
                        ..
                    }
                )
            })
        };
        assert!(logged(&record));
        // So a write over it is still held, not written in place, where
        // that record's replay would land over it mid-sector.
        assert_eq!(
            j.place_data(0x41167, &data(&[3; 0xee99]), false, false),
            Placement::Held
        );
        // The next record leaves the durable one out; once it is durable,
        // the old one is forgotten and the newer held write is all that
        // is logged there.
        let record = j.begin_commit(&[], 65536, true).expect("a record").bytes;
        j.end_commit();
        assert!(!logged(&record));
        assert!(!j.log.iter().any(|u| u.offset == 0x40000));
    }

    #[test]
    fn a_table_logged_during_a_commits_sync_waits_for_a_record_that_holds_it() {
        let mut j = journal();
        j.add_meta(MetaTable::L2, 0x30000, &[1; 512]);
        let pending = j.begin_commit(&[], 65536, false).expect("a record");
        // Logged while the record is on its way (an evicted slice).
        j.add_meta(MetaTable::RefcountBlock, 0x20000, &[2; 512]);
        j.end_commit();
        let placed = j.take_checkpoint(true);
        assert!(placed.iter().any(|(_, at, _)| *at == 0x30000));
        assert!(
            !placed.iter().any(|(_, at, _)| *at == 0x20000),
            "written in place before any durable record held it"
        );
        let logged = |bytes: &[u8]| {
            record_has(bytes, |e| {
                matches!(
                    e,
                    Entry::Meta {
                        offset: 0x20000,
                        ..
                    }
                )
            })
        };
        assert!(!logged(&pending.bytes));
        // The next record holds it; after its sync it goes in place.
        let next = j.begin_commit(&[], 65536, false).expect("a record");
        assert!(logged(&next.bytes));
        j.end_commit();
        assert!(
            j.take_checkpoint(true)
                .iter()
                .any(|(_, at, _)| *at == 0x20000)
        );
    }

    #[test]
    fn a_write_over_the_open_intervals_data_goes_in_place_with_its_checksums() {
        let mut j = journal();
        let mut model = vec![1u8; 0x10000];
        let first = in_place(&mut j, 0x40000, &model);
        j.add_written(&first, 0);
        let Placement::Over(pieces) = j.place_data(0x41200, &data(&[2; 4096]), false, false) else {
            panic!("a sector-aligned write over the interval's data goes in place");
        };
        assert_eq!(j.overwrites, 1, "in flight until written");
        // A commit waiting for it lets no other write go in place there.
        j.draining = true;
        let waiting = j.place_data(0x43000, &data(&[3; 512]), false, false);
        assert_eq!(waiting, Placement::Held);
        j.draining = false;
        j.add_written(&pieces, 1);
        assert_eq!(j.overwrites, 0);
        model[0x1200..0x2200].fill(2);
        model[0x3000..0x3200].fill(3);
        let record = j.begin_commit(&[], 65536, false).expect("a record").bytes;
        // Every checksum matches the bytes in place (the held write is
        // not in place yet), and together they cover the cluster once.
        let in_place = |at: u64| {
            if (0x43000..0x43200).contains(&at) {
                1
            } else {
                model[(at - 0x40000) as usize]
            }
        };
        let mut covered = 0;
        for e in Record::decode(&record, &[7; 16]).expect("decodes").entries {
            if let Entry::Checksum { offset, len, sum } = e {
                let bytes: Vec<u8> = (offset..offset + u64::from(len)).map(in_place).collect();
                assert_eq!(sum, checksum(&bytes), "checksum at {offset:#x}");
                covered += len;
            }
        }
        assert_eq!(covered, 0x10000);
    }

    #[test]
    fn a_failed_checkpoint_is_taken_again_not_retired() {
        let mut j = journal();
        j.add_meta(MetaTable::L2, 0x30000, &[1; 512]);
        commit(&mut j, false);
        assert_eq!(j.take_checkpoint(true).len(), 1);
        // Its write failed: the next commit must not count it in place.
        j.unplace();
        commit(&mut j, true);
        assert!(j.log.iter().any(|u| u.offset == 0x30000 && !u.retired));
        assert_eq!(j.take_checkpoint(true).len(), 1, "taken again");
    }

    /// Places a write expected to go in place; its pieces.
    fn in_place(j: &mut Journal, at: u64, bytes: &[u8]) -> Vec<Piece> {
        match j.place_data(at, &data(bytes), true, false) {
            Placement::InPlace(pieces) => pieces,
            p => panic!("a new cluster's data goes in place, not {p:?}"),
        }
    }

    /// Whether `record` holds an entry that `wanted` picks.
    fn record_has(record: &[u8], wanted: impl Fn(&Entry) -> bool) -> bool {
        Record::decode(record, &[7; 16])
            .expect("decodes")
            .entries
            .iter()
            .any(wanted)
    }

    /// A journal after one interval with a single write, and the pieces
    /// and L2 slice of the next write (mapping a new cluster at 0x50000).
    fn after_one_write() -> (Journal, Vec<Piece>, Slices) {
        let mut j = journal();
        j.add_meta(MetaTable::RefcountBlock, 0x20000, &[1; 512]);
        let first = in_place(&mut j, 0x40000, &[1; 4096]);
        j.add_written(&first, 0);
        j.add_meta(MetaTable::L2, 0x30000, &[2; 512]);
        commit(&mut j, false);
        let pieces = in_place(&mut j, 0x50000, &[3; 4096]);
        (j, pieces, vec![(0x30000, vec![4; 512])])
    }

    #[test]
    fn a_flush_finding_its_record_written_eagerly_only_syncs() {
        let (mut j, pieces, slices) = after_one_write();
        assert!(j.wants_eager(), "one write per flush so far");
        let (at, bytes) = j.preview_record(&slices, &pieces, &[], 65536);
        assert_eq!(at, j.ext.slot_offset(j.next_seq));
        j.eager_written(bytes.clone());
        // The write completes and is mapped; the flush logs the slice.
        j.add_written(&pieces, 0);
        j.add_meta(MetaTable::L2, 0x30000, &slices[0].1);
        let pending = j.begin_commit(&[], 65536, false).expect("a record");
        assert_eq!(pending.bytes, bytes, "the preview is the commit's record");
        assert!(pending.written);
        j.end_commit();
        assert!(j.wants_eager(), "still one write per flush");
    }

    #[test]
    fn anything_else_in_the_interval_makes_the_flush_write_its_own_record() {
        let (mut j, pieces, slices) = after_one_write();
        let (_, bytes) = j.preview_record(&slices, &pieces, &[], 65536);
        j.eager_written(bytes);
        j.add_written(&pieces, 0);
        j.add_meta(MetaTable::L2, 0x30000, &slices[0].1);
        j.add_meta(MetaTable::RefcountBlock, 0x20200, &[5; 512]);
        let pending = j.begin_commit(&[], 65536, false).expect("a record");
        assert!(!pending.written);
        // A failed commit forgets the eager record: its retry (or the next
        // eager record) rewrote the slot.
        j.abort_commit();
        assert!(!j.begin_commit(&[], 65536, false).expect("a record").written);
    }

    #[test]
    fn a_guest_writing_several_times_per_flush_gets_no_eager_records() {
        let (mut j, pieces, _) = after_one_write();
        j.add_written(&pieces, 0);
        assert!(!j.wants_eager(), "a write in this interval already");
        let more = in_place(&mut j, 0x60000, &[6; 4096]);
        j.add_written(&more, 0);
        commit(&mut j, false);
        assert!(!j.wants_eager(), "two writes in the last interval");
    }

    #[test]
    fn overlapping_updates_merge_in_log_order_and_never_overlap() {
        let l2 = Target::Table(MetaTable::L2);
        let updates = vec![
            (l2, 0x1000, vec![1u8; 0x1000]),
            (Target::Data(None), 0x1000, vec![7u8; 16]),
            (l2, 0x1000, vec![2u8; 0x200]),
            (l2, 0x1800, vec![3u8; 0x1000]),
            (l2, 0x4000, vec![4u8; 0x200]),
        ];
        let merged = coalesce(updates);
        assert_eq!(
            merged.len(),
            3,
            "{:?}",
            merged.iter().map(|m| (m.1, m.2.len())).collect::<Vec<_>>()
        );
        let table = merged
            .iter()
            .find(|m| m.0 == l2 && m.1 == 0x1000)
            .expect("merged table write");
        assert_eq!(table.2.len(), 0x1800);
        assert_eq!(
            &table.2[..0x200],
            &[2u8; 0x200][..],
            "the newer update wins"
        );
        assert_eq!(&table.2[0x200..0x800], &[1u8; 0x600][..]);
        assert_eq!(&table.2[0x800..], &[3u8; 0x1000][..]);
        assert!(merged.iter().any(|m| m.0.is_data() && m.2 == vec![7u8; 16]));
    }
}
