//! A recording backend for crash testing: an in-memory store that logs
//! every write, discard, length change and flush into one [`Log`] shared
//! by several devices (image files, a cache device), so their operations
//! are totally ordered against each other. From a frozen [`History`] it
//! materialises the device contents a real crash could leave at any
//! crash point, deterministically from a seed.
//!
//! The crash model, per device: every operation before the device's last
//! completed flush (before the crash point) is durable; each later one may
//! or may not have landed, a write or discard torn at 512-byte sector
//! granularity (each sector independently old or new; a landed discard
//! reads zeros), and later operations win where they land on the same
//! bytes. Flushed discards read zeros. A write or discard that covers part
//! of a sector is recorded as the whole sector as it read right after the
//! operation (the read-modify-write a page cache or device performs), so
//! a landed sector is always one the store really held.
//!
//! Each operation is applied to the store and appended to the log under
//! the log's lock: the recorded order is the order of effect, across all
//! devices of the log.
//!
//! This module owns recording and materialisation only. It must not know
//! what the bytes mean (qcow2, cache layouts) or judge a state: checking
//! belongs to the crash harness.

use crate::{Backend, MemBackend};
use rand::{Rng as _, RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// Granularity at which a write can be torn.
pub const SECTOR: u64 = 512;

/// A device (one recorded store) in a [`Log`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(pub u32);

/// What a device was when it was registered.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub name: String,
    /// Contents at registration; they count as durable.
    pub initial: Arc<[u8]>,
    pub growable: bool,
}

/// One recorded operation.
#[derive(Debug, Clone)]
pub enum LogOp {
    Write { offset: u64, data: Arc<[u8]> },
    Discard { offset: u64, len: u64 },
    SetLen { len: u64 },
    Flush,
}

/// An operation with its place in the global order.
#[derive(Debug, Clone)]
pub struct LogEntry {
    /// Position in the log; crash point `k` means entries `0..k` completed.
    pub seq: u64,
    pub device: DeviceId,
    pub op: LogOp,
}

#[derive(Debug, Default)]
struct LogInner {
    devices: Vec<DeviceInfo>,
    entries: Vec<LogEntry>,
}

/// The global, ordered record of all operations on its devices.
#[derive(Debug, Default)]
pub struct Log {
    inner: Mutex<LogInner>,
}

impl Log {
    pub fn new() -> Arc<Log> {
        Arc::new(Log::default())
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of operations recorded so far (the next crash point).
    pub fn len(&self) -> u64 {
        self.lock().entries.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Freezes what has been recorded so far for crash-state enumeration.
    pub fn snapshot(&self) -> History {
        let inner = self.lock();
        History::new(inner.devices.clone(), inner.entries.clone())
    }

    fn register(&self, info: DeviceInfo) -> DeviceId {
        let mut inner = self.lock();
        inner.devices.push(info);
        DeviceId(inner.devices.len() as u32 - 1)
    }
}

impl LogInner {
    fn push(&mut self, device: DeviceId, op: LogOp) {
        let seq = self.entries.len() as u64;
        self.entries.push(LogEntry { seq, device, op });
    }
}

/// An in-memory store whose every change is recorded in a shared [`Log`].
/// Reads are not recorded.
#[derive(Debug)]
pub struct RecordingBackend {
    id: DeviceId,
    log: Arc<Log>,
    store: MemBackend,
}

impl RecordingBackend {
    /// A growable store with `initial` contents (durable from the start).
    pub fn new(log: &Arc<Log>, name: impl Into<String>, initial: Vec<u8>) -> RecordingBackend {
        Self::build(log, name.into(), initial, true)
    }

    /// A fixed-size zeroed store that cannot grow, like a partition.
    pub fn fixed(log: &Arc<Log>, name: impl Into<String>, len: usize) -> RecordingBackend {
        Self::build(log, name.into(), vec![0; len], false)
    }

    fn build(log: &Arc<Log>, name: String, initial: Vec<u8>, growable: bool) -> RecordingBackend {
        let id = log.register(DeviceInfo {
            name: name.clone(),
            initial: Arc::from(initial.as_slice()),
            growable,
        });
        let store = if growable {
            MemBackend::new(name, initial)
        } else {
            // A fixed store starts zeroed, as `initial` is.
            MemBackend::fixed(name, initial.len())
        };
        RecordingBackend {
            id,
            log: log.clone(),
            store,
        }
    }

    pub fn id(&self) -> DeviceId {
        self.id
    }

    pub fn log(&self) -> &Arc<Log> {
        &self.log
    }

    /// A copy of the current (not necessarily durable) contents.
    pub fn contents(&self) -> Vec<u8> {
        self.store.snapshot()
    }

    /// Records the whole sectors `[offset, offset+len)` touches, as the
    /// store holds them now: a store (or the page cache above a disk)
    /// writes partial sectors by read-modify-write, so what can land is
    /// the whole sector as it was right after this operation.
    fn push_sectors(&self, log: &mut LogInner, offset: u64, len: u64) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let a = offset / SECTOR * SECTOR;
        // Never past the end: a discard beyond it changed nothing there.
        let b = (offset + len)
            .div_ceil(SECTOR)
            .saturating_mul(SECTOR)
            .min(self.store.len()?);
        if b <= a {
            return Ok(());
        }
        let mut data = vec![0u8; (b - a) as usize];
        self.store.read_at(&mut data, a)?;
        log.push(
            self.id,
            LogOp::Write {
                offset: a,
                data: Arc::from(data),
            },
        );
        Ok(())
    }
}

impl Backend for RecordingBackend {
    fn len(&self) -> io::Result<u64> {
        self.store.len()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.store.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut log = self.log.lock();
        self.store.write_at(buf, offset)?;
        self.push_sectors(&mut log, offset, buf.len() as u64)
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        // One request: recorded (and possibly torn) as one write.
        let joined: Vec<u8> = bufs.concat();
        self.write_at(&joined, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.log.lock().push(self.id, LogOp::Flush);
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut log = self.log.lock();
        self.store.discard(offset, len)?;
        let end = offset.saturating_add(len);
        let inner = (offset.div_ceil(SECTOR) * SECTOR, end / SECTOR * SECTOR);
        if inner.0 >= inner.1 {
            // Inside one sector: the store rewrote it.
            return self.push_sectors(&mut log, offset, len);
        }
        if offset < inner.0 {
            self.push_sectors(&mut log, offset, inner.0 - offset)?;
        }
        log.push(
            self.id,
            LogOp::Discard {
                offset: inner.0,
                len: inner.1 - inner.0,
            },
        );
        if inner.1 < end {
            self.push_sectors(&mut log, inner.1, end - inner.1)?;
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut log = self.log.lock();
        self.store.set_len(len)?;
        log.push(self.id, LogOp::SetLen { len });
        Ok(())
    }

    fn can_grow(&self) -> bool {
        self.store.can_grow()
    }

    fn name(&self) -> &str {
        self.store.name()
    }
}

/// Which of the operations in flight at a crash point landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// Every unflushed operation landed whole (what a reader saw).
    All,
    /// No unflushed operation landed.
    None,
    /// A seeded random choice: some operations landed, some whole, some
    /// torn at sector granularity, some not at all.
    Random(u64),
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateKind::All => write!(f, "all"),
            StateKind::None => write!(f, "none"),
            StateKind::Random(s) => write!(f, "random:{s:#018x}"),
        }
    }
}

impl StateKind {
    /// Parses what [`fmt::Display`] prints.
    pub fn parse(s: &str) -> Option<StateKind> {
        match s {
            "all" => Some(StateKind::All),
            "none" => Some(StateKind::None),
            _ => {
                let hex = s.strip_prefix("random:")?;
                let hex = hex.strip_prefix("0x").unwrap_or(hex);
                u64::from_str_radix(hex, 16).ok().map(StateKind::Random)
            }
        }
    }
}

/// One device as a crash left it.
#[derive(Debug, Clone)]
pub struct DeviceState {
    pub id: DeviceId,
    pub name: String,
    pub growable: bool,
    pub data: Vec<u8>,
    /// Operations after the device's last completed flush.
    pub pending: usize,
    /// Of those, how many landed whole and how many in part.
    pub landed: usize,
    pub torn: usize,
    /// How many of the device's operations its durable image holds.
    base: usize,
    /// The byte ranges the pending operations can have changed, sorted
    /// and disjoint: outside them (and past the durable image's length)
    /// every state built on that durable image holds its bytes.
    touched: Vec<(u64, u64)>,
}

impl DeviceState {
    /// A fresh in-memory store holding this state (growable as the
    /// original was).
    pub fn to_mem_backend(&self) -> MemBackend {
        if self.growable {
            MemBackend::new(self.name.clone(), self.data.clone())
        } else {
            MemBackend::fixed_from(self.name.clone(), self.data.clone())
        }
    }
}

/// What every device holds after a crash at `point`.
#[derive(Debug, Clone)]
pub struct CrashState {
    pub point: u64,
    pub kind: StateKind,
    pub devices: Vec<DeviceState>,
}

impl CrashState {
    pub fn device(&self, name: &str) -> Option<&DeviceState> {
        self.devices.iter().find(|d| d.name == name)
    }

    /// A short description: point, kind and per-device landing counts.
    pub fn describe(&self) -> String {
        let mut s = format!("crash point {} state {}", self.point, self.kind);
        for d in &self.devices {
            if d.pending > 0 {
                s.push_str(&format!(
                    " [{}: {} pending, {} landed, {} torn]",
                    d.name, d.pending, d.landed, d.torn
                ));
            }
        }
        s
    }

    /// A 128-bit fingerprint of the contents of the devices that had
    /// operations in flight: it tells states of one crash point apart
    /// (the other devices are the same in all of them).
    ///
    /// Only the bytes the pending operations touched are hashed, with each
    /// device's length: every state of a point starts from the same durable
    /// image, so a byte outside those ranges is the durable one (or the
    /// zero a growth added) in all of them. Hashing whole device images
    /// cost as much as checking a state.
    pub fn fingerprint(&self) -> u128 {
        let mut h = Fingerprint::new();
        for d in self.devices.iter().filter(|d| d.pending > 0) {
            let len = d.data.len() as u64;
            h.device(len, d.id);
            for &(a, b) in &d.touched {
                h.bytes(&d.data[a.min(len) as usize..b.min(len) as usize]);
            }
        }
        h.finish()
    }
}

/// The two-lane hash behind [`CrashState::fingerprint`].
struct Fingerprint {
    a: u64,
    b: u64,
}

impl Fingerprint {
    fn new() -> Fingerprint {
        Fingerprint {
            a: 0x243f_6a88_85a3_08d3,
            b: 0x1319_8a2e_0370_7344,
        }
    }

    fn device(&mut self, len: u64, id: DeviceId) {
        self.a = mix(self.a ^ len);
        self.b = mix(self.b.wrapping_add(u64::from(id.0)));
    }

    fn bytes(&mut self, data: &[u8]) {
        let mut words = data.chunks_exact(16);
        for w in &mut words {
            let (x, y) = w.split_at(8);
            let x = u64::from_le_bytes(x.try_into().unwrap_or([0; 8]));
            let y = u64::from_le_bytes(y.try_into().unwrap_or([0; 8]));
            self.a = (self.a ^ x)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(29);
            self.b = (self.b ^ y)
                .wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
                .rotate_left(31);
        }
        for (i, &x) in words.remainder().iter().enumerate() {
            self.a = mix(self.a ^ (u64::from(x) << (i % 8 * 8)));
        }
        // Where one range ends and the next begins is part of the input.
        self.b = mix(self.b ^ data.len() as u64);
    }

    fn finish(&self) -> u128 {
        let (a, b) = (self.a, self.b);
        (u128::from(mix(a ^ b.rotate_left(17))) << 64) | u128::from(mix(b ^ a))
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The generator of crash states: a [`StateKind::Random`] seed gives the
/// same state for as long as Cargo.lock keeps the `rand` crates' versions.
type Rng = Xoshiro256PlusPlus;

/// A frozen log: the input of crash-state enumeration. Crash points run
/// from 0 (nothing recorded happened) to [`History::len`] (all did).
#[derive(Debug, Clone)]
pub struct History {
    devices: Vec<DeviceInfo>,
    entries: Vec<LogEntry>,
    /// Per device, indices into `entries`.
    per_device: Vec<Vec<usize>>,
}

impl History {
    fn new(devices: Vec<DeviceInfo>, entries: Vec<LogEntry>) -> History {
        let mut per_device = vec![Vec::new(); devices.len()];
        for (i, e) in entries.iter().enumerate() {
            per_device[e.device.0 as usize].push(i);
        }
        History {
            devices,
            entries,
            per_device,
        }
    }

    /// Number of recorded operations; the last crash point.
    pub fn len(&self) -> u64 {
        self.entries.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    pub fn entries(&self) -> &[LogEntry] {
        &self.entries
    }

    /// Position (in the device's own list) of the first operation after
    /// the device's last flush before `point`, and the end of its list
    /// before `point`.
    fn window(&self, dev: usize, point: u64) -> (usize, usize) {
        let list = &self.per_device[dev];
        let end = list.partition_point(|&i| (i as u64) < point);
        let start = list[..end]
            .iter()
            .rposition(|&i| matches!(self.entries[i].op, LogOp::Flush))
            .map_or(0, |p| p + 1);
        (start, end)
    }

    /// Operations (not flushes) in flight at `point`, over all devices:
    /// zero means every state at this point is the same.
    pub fn pending_at(&self, point: u64) -> usize {
        (0..self.devices.len())
            .map(|d| {
                let (s, e) = self.window(d, point);
                e - s
            })
            .sum()
    }

    /// An upper bound on the distinct states at `point`: two to the
    /// number of independent choices (sectors of pending writes and
    /// discards, pending length changes), saturating.
    pub fn distinct_bound(&self, point: u64) -> u64 {
        let mut units = 0u64;
        for d in 0..self.devices.len() {
            let (s, e) = self.window(d, point);
            for &i in &self.per_device[d][s..e] {
                units += match &self.entries[i].op {
                    LogOp::Write { offset, data } => sectors_touched(*offset, data.len() as u64),
                    LogOp::Discard { offset, len } => sectors_touched(*offset, *len),
                    LogOp::SetLen { .. } => 1,
                    LogOp::Flush => 0,
                };
                if units >= 63 {
                    return u64::MAX;
                }
            }
        }
        1 << units
    }

    /// The kinds of state to try at `point`: all, none, and up to
    /// `random` seeded random ones derived from `seed` and the point (fewer
    /// when fewer distinct states exist). When nothing is in flight, only
    /// one state exists.
    pub fn kinds_at(&self, point: u64, random: usize, seed: u64) -> Vec<StateKind> {
        let bound = self.distinct_bound(point);
        if bound <= 1 {
            return vec![StateKind::All];
        }
        let random = (random as u64).min(bound - 2) as usize;
        let mut out = vec![StateKind::All, StateKind::None];
        let mut rng = Rng::seed_from_u64(seed ^ mix(point.wrapping_add(0x5bd1_e995)));
        out.extend((0..random).map(|_| StateKind::Random(rng.next_u64())));
        out
    }

    /// Materialises one crash state from scratch.
    pub fn state(&self, point: u64, kind: StateKind) -> CrashState {
        self.replayer().state(point, kind)
    }

    /// A materialiser that reuses durable images between calls; fastest
    /// when called with non-decreasing points.
    pub fn replayer(&self) -> Replayer<'_> {
        Replayer {
            history: self,
            durable: self.devices.iter().map(|d| d.initial.to_vec()).collect(),
            applied: vec![0; self.devices.len()],
            spare: (0..self.devices.len()).map(|_| Spare::default()).collect(),
        }
    }

    /// The byte ranges device `dev`'s operations `start..end` (its own
    /// positions) can change, sorted and merged: a write or discard its
    /// own bytes, a length change everything from the new length on.
    fn touched(&self, dev: usize, start: usize, end: usize) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = self.per_device[dev][start..end]
            .iter()
            .filter_map(|&i| match &self.entries[i].op {
                LogOp::Write { offset, data } => Some((*offset, offset + data.len() as u64)),
                LogOp::Discard { offset, len } => Some((*offset, offset.saturating_add(*len))),
                LogOp::SetLen { len } => Some((*len, u64::MAX)),
                LogOp::Flush => None,
            })
            .collect();
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        merged
    }
}

fn sectors_touched(offset: u64, len: u64) -> u64 {
    if len == 0 {
        0
    } else {
        (offset + len - 1) / SECTOR - offset / SECTOR + 1
    }
}

/// How one pending operation lands.
#[derive(Debug, Clone, Copy)]
enum Landing {
    Not,
    Whole,
    /// Each sector independently, with this probability.
    Torn(f64),
}

/// Materialises crash states of a [`History`], keeping each device's
/// durable image between calls.
#[derive(Debug)]
pub struct Replayer<'a> {
    history: &'a History,
    durable: Vec<Vec<u8>>,
    /// Per device, how many of its operations `durable` includes.
    applied: Vec<usize>,
    /// Per device, a buffer given back by [`Replayer::recycle`] to build
    /// the next state in: a device image is megabytes, and faulting in a
    /// fresh allocation of it, or even copying it, costs more than the
    /// rest of materialising a state.
    spare: Vec<Spare>,
}

/// A device image given back to a [`Replayer`].
#[derive(Debug, Default)]
struct Spare {
    data: Vec<u8>,
    /// The `base` and `touched` of the state `data` holds.
    made_from: Option<(usize, Vec<(u64, u64)>)>,
}

impl Replayer<'_> {
    /// The devices as a crash at `point` leaves them, with the in-flight
    /// operations chosen by `kind`. Points past the end are clamped.
    pub fn state(&mut self, point: u64, kind: StateKind) -> CrashState {
        let h = self.history;
        let point = point.min(h.len());
        let mut rng = Rng::seed_from_u64(match kind {
            StateKind::Random(s) => s,
            _ => 0,
        });
        // One strategy for the whole state, so the population contains
        // sparse, dense, torn and in-order (prefix) landings.
        let strategy = rng.random_range(0..4);
        let p = [0.2, 0.5, 0.8][rng.random_range(0..3)];
        let mut devices = Vec::with_capacity(h.devices.len());
        for (d, info) in h.devices.iter().enumerate() {
            let (start, end) = h.window(d, point);
            self.advance(d, start);
            let mut data = self.durable_copy(d);
            let pending = end - start;
            let prefix = rng.random_range(0..=pending);
            let (mut landed, mut torn) = (0, 0);
            for (n, &i) in h.per_device[d][start..end].iter().enumerate() {
                let landing = match kind {
                    StateKind::All => Landing::Whole,
                    StateKind::None => Landing::Not,
                    StateKind::Random(_) => match strategy {
                        0 if rng.random_bool(p) => Landing::Whole,
                        0 => Landing::Not,
                        1 => Landing::Torn(p),
                        2 if n < prefix => Landing::Whole,
                        2 if n == prefix => Landing::Torn(0.5),
                        2 => Landing::Not,
                        _ => match rng.random_range(0..3) {
                            0 => Landing::Not,
                            1 => Landing::Whole,
                            _ => Landing::Torn(0.5),
                        },
                    },
                };
                match apply(&mut data, &h.entries[i].op, landing, &mut rng) {
                    Applied::None => {}
                    Applied::Whole => landed += 1,
                    Applied::Part => torn += 1,
                }
            }
            devices.push(DeviceState {
                id: DeviceId(d as u32),
                name: info.name.clone(),
                growable: info.growable,
                data,
                pending,
                landed,
                torn,
                base: start,
                touched: h.touched(d, start, end),
            });
        }
        CrashState {
            point,
            kind,
            devices,
        }
    }

    /// Takes back a state this replayer made, once the caller is done
    /// with it, to build later states in its buffers. Its device images
    /// must be as made (or emptied): a later state is its image with the
    /// bytes that differ from the durable image put back.
    pub fn recycle(&mut self, state: CrashState) {
        for d in state.devices {
            if let Some(spare) = self.spare.get_mut(d.id.0 as usize) {
                *spare = Spare {
                    data: d.data,
                    made_from: Some((d.base, d.touched)),
                };
            }
        }
    }

    /// Device `d`'s durable image, in its spare buffer. When that holds a
    /// state built on this same durable image (another state of the same
    /// crash point, or of a later one with no flush between), only that
    /// state's touched ranges and its length are put back: everything else
    /// is the durable image already (see [`CrashState::fingerprint`]).
    fn durable_copy(&mut self, d: usize) -> Vec<u8> {
        let Spare {
            mut data,
            made_from,
        } = std::mem::take(&mut self.spare[d]);
        let durable = &self.durable[d];
        match made_from {
            Some((base, touched)) if base == self.applied[d] => {
                data.truncate(durable.len());
                let len = data.len() as u64;
                for (a, b) in touched {
                    let (a, b) = (a.min(len) as usize, b.min(len) as usize);
                    data[a..b].copy_from_slice(&durable[a..b]);
                }
                let kept = data.len();
                data.extend_from_slice(&durable[kept..]);
            }
            _ => {
                data.clear();
                data.extend_from_slice(durable);
            }
        }
        data
    }

    /// Brings device `d`'s durable image to include exactly its first
    /// `upto` operations.
    fn advance(&mut self, d: usize, upto: usize) {
        if upto < self.applied[d] {
            self.durable[d] = self.history.devices[d].initial.to_vec();
            self.applied[d] = 0;
        }
        let list = &self.history.per_device[d];
        let mut rng = Rng::seed_from_u64(0);
        for &i in &list[self.applied[d]..upto] {
            apply(
                &mut self.durable[d],
                &self.history.entries[i].op,
                Landing::Whole,
                &mut rng,
            );
        }
        self.applied[d] = upto;
    }
}

enum Applied {
    None,
    Whole,
    Part,
}

/// Applies one operation (or the sectors of it that landed) to `data`.
fn apply(data: &mut Vec<u8>, op: &LogOp, landing: Landing, rng: &mut Rng) -> Applied {
    if matches!(landing, Landing::Not) {
        return Applied::None;
    }
    let (offset, len) = match op {
        LogOp::Flush => return Applied::None,
        LogOp::SetLen { len } => {
            data.resize(*len as usize, 0);
            return Applied::Whole;
        }
        LogOp::Write { offset, data } => (*offset, data.len() as u64),
        LogOp::Discard { offset, len } => (*offset, *len),
    };
    let end = offset + len;
    let mut count = 0u64;
    let mut total = 0u64;
    let mut sector = offset / SECTOR;
    while sector * SECTOR < end {
        let from = (sector * SECTOR).max(offset);
        let to = ((sector + 1) * SECTOR).min(end);
        total += 1;
        let lands = match landing {
            Landing::Torn(p) => rng.random_bool(p),
            _ => true,
        };
        if lands {
            count += 1;
            match op {
                LogOp::Write { data: bytes, .. } => {
                    if data.len() < to as usize {
                        data.resize(to as usize, 0);
                    }
                    let src = &bytes[(from - offset) as usize..(to - offset) as usize];
                    data[from as usize..to as usize].copy_from_slice(src);
                }
                _ => {
                    let a = (from as usize).min(data.len());
                    let b = (to as usize).min(data.len());
                    data[a..b].fill(0);
                }
            }
        }
        sector += 1;
    }
    if count == 0 && total > 0 {
        Applied::None
    } else if count == total {
        Applied::Whole
    } else {
        Applied::Part
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Arc<Log>, RecordingBackend, RecordingBackend) {
        let log = Log::new();
        let a = RecordingBackend::new(&log, "a", vec![1; 2048]);
        let b = RecordingBackend::new(&log, "b", vec![0; 1024]);
        (log, a, b)
    }

    #[test]
    fn flushed_writes_are_durable_and_pending_ones_optional() {
        let (log, a, b) = setup();
        a.write_at(&[2; 1024], 0).unwrap(); // 0
        b.write_at(&[3; 512], 0).unwrap(); // 1
        a.flush().unwrap(); // 2
        a.write_at(&[4; 1024], 512).unwrap(); // 3
        b.flush().unwrap(); // 4
        let h = log.snapshot();
        assert_eq!(h.len(), 5);
        // Before a's flush completed, a's write is optional.
        let none = h.state(2, StateKind::None);
        assert_eq!(none.device("a").unwrap().data, vec![1; 2048]);
        assert_eq!(none.device("b").unwrap().data, vec![0; 1024]);
        // After it, the first write is durable, the second optional; b's
        // write is still optional (b has not flushed).
        let none = h.state(4, StateKind::None);
        let a_data = &none.device("a").unwrap().data;
        assert_eq!(&a_data[..1024], &[2; 1024][..]);
        assert_eq!(&a_data[1024..], &[1; 1024][..]);
        assert_eq!(none.device("b").unwrap().data, vec![0; 1024]);
        let all = h.state(4, StateKind::All);
        let a_data = &all.device("a").unwrap().data;
        assert_eq!(&a_data[..512], &[2; 512][..]);
        assert_eq!(&a_data[512..1536], &[4; 1024][..]);
        assert_eq!(all.device("b").unwrap().data[..512], [3; 512]);
        // After b's flush its write is durable.
        let none = h.state(5, StateKind::None);
        assert_eq!(none.device("b").unwrap().data[..512], [3; 512]);
        assert_eq!(h.pending_at(5), 1);
        assert_eq!(h.kinds_at(0, 3, 7), vec![StateKind::All]);
    }

    #[test]
    fn random_states_are_deterministic_and_sector_torn() {
        let log = Log::new();
        let a = RecordingBackend::new(&log, "a", vec![0; 64 * 512]);
        for i in 0..8u8 {
            a.write_at(&vec![i + 1; 8 * 512], u64::from(i) * 2048)
                .unwrap();
        }
        a.discard(0, 4096).unwrap();
        let h = log.snapshot();
        let mut torn_seen = false;
        let mut replayer = h.replayer();
        for kind in h.kinds_at(h.len(), 40, 99) {
            let s1 = replayer.state(h.len(), kind);
            let s2 = h.state(h.len(), kind);
            assert_eq!(s1.fingerprint(), s2.fingerprint(), "{kind}");
            let d = &s1.devices[0].data;
            for sector in d.chunks(512) {
                assert!(
                    sector.iter().all(|&x| x == sector[0]),
                    "torn inside a sector"
                );
            }
            torn_seen |= s1.devices[0].torn > 0;
        }
        assert!(torn_seen);
        assert_eq!(
            StateKind::parse("random:0x00000000000000ff"),
            Some(StateKind::Random(255))
        );
        assert_eq!(
            StateKind::parse(&StateKind::Random(77).to_string()),
            Some(StateKind::Random(77))
        );
    }

    #[test]
    fn partial_sectors_are_recorded_whole() {
        let log = Log::new();
        let a = RecordingBackend::new(&log, "a", vec![1; 1024]);
        a.write_at(&[2; 512], 0).unwrap();
        a.write_at(&[3; 100], 10).unwrap();
        a.discard(500, 600).unwrap();
        let h = log.snapshot();
        // The second write lands as a whole sector holding both writes.
        match &h.entries()[1].op {
            LogOp::Write { offset, data } => {
                assert_eq!(*offset, 0);
                assert_eq!(data.len(), 512);
                assert_eq!(data[0], 2);
                assert_eq!(data[10], 3);
                assert_eq!(data[200], 2);
            }
            op => panic!("{op:?}"),
        }
        // The discard is a sector write (its head) and a sector discard.
        assert!(matches!(h.entries()[2].op, LogOp::Write { offset: 0, .. }));
        assert!(matches!(
            h.entries()[3].op,
            LogOp::Discard {
                offset: 512,
                len: 512
            }
        ));
        let all = h.state(h.len(), StateKind::All);
        assert_eq!(all.devices[0].data, a.contents());
    }

    #[test]
    fn growth_and_set_len_are_replayed() {
        let log = Log::new();
        let a = RecordingBackend::new(&log, "a", Vec::new());
        a.write_at(&[9; 100], 1000).unwrap();
        a.flush().unwrap();
        a.set_len(600).unwrap();
        let h = log.snapshot();
        let none = h.state(h.len(), StateKind::None);
        assert_eq!(none.devices[0].data.len(), 1100);
        let all = h.state(h.len(), StateKind::All);
        assert_eq!(all.devices[0].data.len(), 600);
        assert_eq!(all.devices[0].data, a.contents());
    }

    /// A seeded mix of writes (partial, past the end), discards, length
    /// changes and flushes over a growable and a fixed device.
    fn random_history(seed: u64) -> History {
        let log = Log::new();
        let mut rng = Rng::seed_from_u64(seed);
        let mut initial = vec![0u8; 8192];
        rng.fill_bytes(&mut initial);
        let grows = RecordingBackend::new(&log, "grows", initial);
        let fixed = RecordingBackend::fixed(&log, "fixed", 8192);
        for _ in 0..150 {
            let dev = if rng.random_bool(0.6) { &grows } else { &fixed };
            let room = if dev.can_grow() { 16384 } else { 8192 };
            let offset = rng.random_range(0..room - 1);
            let len = rng.random_range(1..=(room - offset).min(3000));
            match rng.random_range(0..10) {
                0..=5 => {
                    let mut bytes = vec![0u8; len as usize];
                    rng.fill_bytes(&mut bytes);
                    dev.write_at(&bytes, offset).unwrap();
                }
                6 => dev.discard(offset, len).unwrap(),
                7 if dev.can_grow() => dev.set_len(offset).unwrap(),
                _ => dev.flush().unwrap(),
            }
        }
        log.snapshot()
    }

    #[test]
    fn recycled_states_equal_fresh_ones_and_fingerprints_tell_exactly_them_apart() {
        let (mut duplicates, mut distinct) = (0, 0);
        for seed in 0..4 {
            let h = random_history(seed);
            let mut replayer = h.replayer();
            // Forward through every point, then a few points again out of
            // order (durable images rebuilt, spares from other points).
            let points = (0..=h.len()).chain([3, h.len() / 2, 1, h.len()]);
            for point in points {
                let mut seen: Vec<CrashState> = Vec::new();
                for kind in h.kinds_at(point, 12, seed) {
                    let state = replayer.state(point, kind);
                    let fresh = h.state(point, kind);
                    for (a, b) in state.devices.iter().zip(&fresh.devices) {
                        assert!(a.data == b.data, "point {point} {kind}: {}", a.name);
                    }
                    for other in &seen {
                        let same = other
                            .devices
                            .iter()
                            .zip(&state.devices)
                            .all(|(a, b)| a.data == b.data);
                        assert_eq!(same, other.fingerprint() == state.fingerprint());
                        if same {
                            duplicates += 1;
                        } else {
                            distinct += 1;
                        }
                    }
                    seen.push(fresh);
                    replayer.recycle(state);
                }
            }
        }
        assert!(duplicates > 0 && distinct > 0, "{duplicates} {distinct}");
    }
}
