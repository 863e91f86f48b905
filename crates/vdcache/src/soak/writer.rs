//! The soak's guest: threads issuing writes of 512 B to 256 KiB (4 KiB
//! aligned and not), FUA writes, write-zeroes, trims and flushes over NBD,
//! several requests in flight, each one entered in the [`Record`] before
//! it is sent and when its reply arrives.
//!
//! Requests in flight never overlap (a sector has one writer at a time),
//! so the record can order every sector's versions. A request that fails
//! after the driver killed the server is expected (its version stays
//! possible); any other failure stops the soak.
//!
//! Owns the workload and its bookkeeping calls. Must not judge what the
//! disk holds (the record does) or manage the server (the driver does).

use super::record::{self, Record};
use super::stamp::{SECTOR, fill};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use vdcache_backend::nbd::NbdClient;
use vdcache_nbd_server::ZeroFlags;

/// Largest write, in sectors (256 KiB).
const MAX_SECTORS: u64 = 512;

/// What the writers did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Counts {
    /// Data writes answered (FUA ones included).
    pub writes: u64,
    pub fua_writes: u64,
    pub bytes_written: u64,
    pub write_zeroes: u64,
    pub trims: u64,
    /// Flushes answered.
    pub flushes: u64,
    /// Requests a kill left without a reply.
    pub unanswered: u64,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        self.writes += o.writes;
        self.fua_writes += o.fua_writes;
        self.bytes_written += o.bytes_written;
        self.write_zeroes += o.write_zeroes;
        self.trims += o.trims;
        self.flushes += o.flushes;
        self.unanswered += o.unanswered;
    }
}

/// The record and what goes with it, under one lock.
pub struct State {
    pub record: Record,
    /// Sector ranges of the requests in flight.
    inflight: Vec<(u64, u64)>,
    pub counts: Counts,
}

impl State {
    pub fn new(record: Record) -> State {
        State {
            record,
            inflight: Vec::new(),
            counts: Counts::default(),
        }
    }
}

/// Shared by the writer threads and the driver.
pub struct Shared {
    pub state: Mutex<State>,
    /// Writers finish their request and return.
    pub stop: AtomicBool,
    /// Set before the driver kills the server: failures are expected.
    pub killed: AtomicBool,
    pub flushes_in_flight: AtomicUsize,
    /// The first unexpected failure.
    pub failure: Mutex<Option<String>>,
}

impl Shared {
    pub fn new(record: Record) -> Shared {
        Shared {
            state: Mutex::new(State::new(record)),
            stop: AtomicBool::new(false),
            killed: AtomicBool::new(false),
            flushes_in_flight: AtomicUsize::new(0),
            failure: Mutex::new(None),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn fail(&self, what: String) {
        if !self.killed.load(Ordering::SeqCst) {
            let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            f.get_or_insert(what);
            self.stop.store(true, Ordering::SeqCst);
        }
    }
}

/// The disk the writers work on.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub sectors: u64,
    /// Sectors per qcow2 cluster of the delta: a trim zeroes whole ones.
    pub cluster_sectors: u64,
    /// Mean number of requests between two flushes of one writer.
    pub flush_every: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    Zeroes { no_hole: bool },
    Trim,
}

#[derive(Debug, Clone, Copy)]
struct Request {
    kind: Kind,
    first: u64,
    end: u64,
    fua: bool,
}

impl Request {
    /// The sectors whose content it sets: a trim, only the whole clusters
    /// it covers (the engine leaves partial clusters alone, as QEMU does).
    fn affected(&self, g: &Geometry) -> (u64, u64) {
        if self.kind != Kind::Trim {
            return (self.first, self.end);
        }
        let c = g.cluster_sectors;
        let (a, b) = (self.first.div_ceil(c) * c, self.end / c * c);
        if a < b { (a, b) } else { (a, a) }
    }
}

/// A sequential stream one writer is in the middle of.
struct Stream {
    next: u64,
    left: u32,
    len: u64,
}

struct Picker {
    rng: Xoshiro256PlusPlus,
    g: Geometry,
    stream: Option<Stream>,
}

impl Picker {
    /// A length of 1 to 512 sectors, as likely in each power of two.
    fn length(&mut self) -> u64 {
        let k = self.rng.random_range(0..=9u32);
        let max = 1u64 << k;
        self.rng.random_range(max / 2 + 1..=max).min(MAX_SECTORS)
    }

    /// A start for `len` sectors: a small hot zone (rewritten often, so
    /// sectors stack versions between flushes) or anywhere.
    fn start(&mut self, len: u64, align: u64) -> u64 {
        let zone = if self.rng.random_ratio(2, 5) {
            (self.g.sectors / 16).max(len)
        } else {
            self.g.sectors
        };
        let s = self.rng.random_range(0..=zone - len);
        s / align * align
    }

    fn next(&mut self) -> Option<Request> {
        if let Some(st) = &mut self.stream {
            let r = Request {
                kind: Kind::Write,
                first: st.next,
                end: st.next + st.len,
                fua: false,
            };
            st.next += st.len;
            st.left -= 1;
            if st.left == 0 || st.next + st.len > self.g.sectors {
                self.stream = None;
            }
            return Some(r);
        }
        let flush = 1000 / self.g.flush_every.max(1);
        let r = self.rng.random_range(0..1000u32);
        if r < flush {
            return None;
        }
        let fua = self.rng.random_ratio(1, 16);
        if r < flush + 25 {
            let len = self.length();
            let first = self.start(len, 1);
            return Some(Request {
                kind: Kind::Zeroes {
                    no_hole: self.rng.random_bool(0.5),
                },
                first,
                end: first + len,
                fua,
            });
        }
        if r < flush + 50 {
            let c = self.g.cluster_sectors;
            let len = self.rng.random_range(1..=4 * c);
            let align = if self.rng.random_bool(0.5) { c } else { 1 };
            let first = self.start(len, align);
            return Some(Request {
                kind: Kind::Trim,
                first,
                end: first + len,
                fua,
            });
        }
        if r < flush + 60 && self.g.sectors >= 8 << 11 {
            // A sequential run of 128-256 KiB writes, 4-16 MiB in all:
            // long enough for the server's sequential-write bypass.
            let len = self.rng.random_range(32..=64u64) * 8;
            let left = self.rng.random_range(32..=64u32);
            let first = self.start(len, 8);
            self.stream = Some(Stream {
                next: first,
                left,
                len,
            });
            return self.next();
        }
        let mut len = self.length();
        let mut align = 1;
        if self.rng.random_bool(0.5) {
            len = len.div_ceil(8) * 8;
            align = 8;
        }
        let first = self.start(len, align);
        Some(Request {
            kind: Kind::Write,
            first,
            end: first + len,
            fua,
        })
    }
}

/// Runs one writer until `stop` or a failure.
pub fn writer(shared: &Shared, client: &NbdClient, g: Geometry, seed: u64) {
    let mut p = Picker {
        rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        g,
        stream: None,
    };
    let key = shared.lock().record.key();
    let mut buf = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let Some(req) = p.next() else {
            if !flush(shared, client) {
                return;
            }
            continue;
        };
        let (a, b) = req.affected(&g);
        let version = {
            let mut st = shared.lock();
            if st
                .inflight
                .iter()
                .any(|&(x, y)| x < req.end && req.first < y)
            {
                // Another writer has part of this range in flight.
                p.stream = None;
                continue;
            }
            st.inflight.push((req.first, req.end));
            let kind = match req.kind {
                Kind::Write => record::Kind::Write,
                Kind::Zeroes { .. } => record::Kind::Zeroes,
                Kind::Trim => record::Kind::Trim,
            };
            st.record.begin(a, b, kind, req.fua)
        };
        let (off, len) = (req.first * SECTOR, (req.end - req.first) * SECTOR);
        let result = match req.kind {
            Kind::Write => {
                buf.resize(len as usize, 0);
                fill(&mut buf, req.first, version.write(), key);
                client.write_at(off, &buf, req.fua)
            }
            Kind::Zeroes { no_hole } => client.write_zeroes(
                off,
                len,
                ZeroFlags {
                    no_hole,
                    fast_zero: false,
                    fua: req.fua,
                },
            ),
            Kind::Trim => client.trim(off, len, req.fua),
        };
        let mut st = shared.lock();
        if let Some(i) = st.inflight.iter().position(|&r| r == (req.first, req.end)) {
            st.inflight.swap_remove(i);
        }
        match result {
            Ok(()) => {
                st.record.acked(version, a, b, req.fua);
                let c = &mut st.counts;
                match req.kind {
                    Kind::Write => {
                        c.writes += 1;
                        c.fua_writes += u64::from(req.fua);
                        c.bytes_written += len;
                    }
                    Kind::Zeroes { .. } => c.write_zeroes += 1,
                    Kind::Trim => c.trims += 1,
                }
            }
            Err(e) => {
                st.counts.unanswered += 1;
                drop(st);
                shared.fail(format!(
                    "{:?} of {len} bytes at {off:#x} failed: {e}",
                    req.kind
                ));
                return;
            }
        }
    }
}

/// One flush; false if it failed.
fn flush(shared: &Shared, client: &NbdClient) -> bool {
    let ticket = shared.lock().record.flush_point();
    shared.flushes_in_flight.fetch_add(1, Ordering::SeqCst);
    let result = client.flush();
    shared.flushes_in_flight.fetch_sub(1, Ordering::SeqCst);
    let mut st = shared.lock();
    match result {
        Ok(()) => {
            st.record.flushed(ticket);
            st.counts.flushes += 1;
            true
        }
        Err(e) => {
            st.counts.unanswered += 1;
            drop(st);
            shared.fail(format!("flush failed: {e}"));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_sets_only_the_whole_clusters_it_covers() {
        let g = Geometry {
            sectors: 1024,
            cluster_sectors: 128,
            flush_every: 16,
        };
        let t = |first, end| {
            Request {
                kind: Kind::Trim,
                first,
                end,
                fua: false,
            }
            .affected(&g)
        };
        assert_eq!(t(0, 128), (0, 128));
        assert_eq!(t(1, 300), (128, 256));
        assert_eq!(t(1, 200), (128, 128));
        assert_eq!(t(130, 250), (256, 256));
    }

    #[test]
    fn requests_stay_on_the_disk_and_within_256k() {
        let g = Geometry {
            sectors: 8 << 11,
            cluster_sectors: 128,
            flush_every: 16,
        };
        let mut p = Picker {
            rng: Xoshiro256PlusPlus::seed_from_u64(5),
            g,
            stream: None,
        };
        let (mut flushes, mut aligned, mut unaligned) = (0, 0, 0);
        for _ in 0..100_000 {
            match p.next() {
                None => flushes += 1,
                Some(r) => {
                    assert!(r.first < r.end && r.end <= g.sectors, "{r:?}");
                    if r.kind != Kind::Trim {
                        assert!(r.end - r.first <= MAX_SECTORS, "{r:?}");
                    }
                    if r.kind == Kind::Write {
                        if r.first % 8 == 0 && r.end % 8 == 0 {
                            aligned += 1;
                        } else {
                            unaligned += 1;
                        }
                    }
                }
            }
        }
        assert!(flushes > 1000 && aligned > 10_000 && unaligned > 10_000);
    }
}
