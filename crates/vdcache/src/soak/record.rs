//! The soak's flush-aware record: for every sector of the disk, the
//! version that must survive a crash and the versions that may.
//!
//! The rule is DESIGN.md's invariant 1 in NBD terms. A write is durable
//! once a FLUSH completed that was sent after the write's reply arrived
//! (on any connection: the export offers multi-conn), or once the write
//! itself completed with FUA. After a crash a sector must read back its
//! last durable version or a version written after it (acknowledged or
//! still in flight: unflushed writes may or may not survive); anything
//! else (an older version, another sector's data, zeros where data was
//! durable, garbage) is a violation.
//!
//! Writes to one sector never overlap in time (the writer keeps ranges in
//! flight apart), so each sector's versions are totally ordered and "after
//! the durable one" is exact. Acknowledgements are numbered when the
//! writer records them, after the reply arrived; a flush covers the
//! numbers taken before it was sent. That errs one way only: a write
//! whose reply arrived just before a flush was sent but was recorded just
//! after is not counted as covered, which allows more, never less, than
//! the truth.
//!
//! Owns that rule and the bookkeeping. Must not do I/O: it judges bytes it
//! is given.

use super::stamp::{Found, SECTOR, Version, classify};
use std::collections::VecDeque;
use std::fmt::{self, Write as _};
use std::time::{Duration, Instant};

/// What a request does to the sectors it sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write,
    Zeroes,
    Trim,
}

/// How a request became durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durable {
    Fua,
    Flush(usize),
}

/// One request of the current cycle, for explaining a violation.
#[derive(Debug, Clone)]
struct Op {
    version: Version,
    kind: Kind,
    first: u64,
    end: u64,
    fua: bool,
    begun: Duration,
    acked: Option<Duration>,
    durable: Option<(Durable, Duration)>,
}

/// One flush of the current cycle.
#[derive(Debug, Clone)]
struct FlushOp {
    point: u64,
    sent: Duration,
    done: Option<Duration>,
}

/// A flush on its way: what it covers.
#[derive(Debug, Clone, Copy)]
pub struct Flush {
    id: usize,
    point: u64,
}

struct Sector {
    durable: Version,
    /// Versions begun after `durable`, oldest first.
    later: Vec<Version>,
}

/// An acknowledged write not yet covered by a completed flush.
struct Unflushed {
    ack: u64,
    version: Version,
    first: u64,
    end: u64,
}

/// Which allowed version a sector held when checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Its last durable version.
    Durable,
    /// A version written after that (one that may or may not survive).
    Newer,
}

/// A sector that read back something it may not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub sector: u64,
    pub found: Found,
    pub durable: Version,
    pub later: Vec<Version>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sector {} (byte {:#x}): found {}; must hold {}",
            self.sector,
            self.sector * SECTOR,
            self.found,
            self.durable
        )?;
        if !self.later.is_empty() {
            write!(f, " or one written after it:")?;
            for v in self.later.iter().take(8) {
                write!(f, " [{v}]")?;
            }
            if self.later.len() > 8 {
                write!(f, " and {} more", self.later.len() - 8)?;
            }
        }
        Ok(())
    }
}

/// Every sector's durable and possible versions, and the current cycle's
/// requests, flushes and events (what a violation report shows).
pub struct Record {
    key: u64,
    sectors: Vec<Sector>,
    next_write: u64,
    acks: u64,
    unflushed: VecDeque<Unflushed>,
    epoch: Instant,
    /// Write number of `ops[0]`.
    first_op: u64,
    ops: Vec<Op>,
    flushes: Vec<FlushOp>,
    events: Vec<(Duration, String)>,
}

impl Record {
    /// A disk of `sectors` sectors where `has_base(s)` says which hold the
    /// base image's data (the others read zeros); `key` names the run.
    pub fn new(sectors: u64, key: u64, has_base: impl Fn(u64) -> bool) -> Record {
        Record {
            key,
            sectors: (0..sectors)
                .map(|s| Sector {
                    durable: if has_base(s) {
                        Version::BASE
                    } else {
                        Version::INITIAL_ZERO
                    },
                    later: Vec::new(),
                })
                .collect(),
            next_write: 1,
            acks: 0,
            unflushed: VecDeque::new(),
            epoch: Instant::now(),
            first_op: 1,
            ops: Vec::new(),
            flushes: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Forgets the history of the last cycle (its requests are settled).
    pub fn start_cycle(&mut self) {
        self.epoch = Instant::now();
        self.first_op = self.next_write;
        self.ops.clear();
        self.flushes.clear();
        self.events.clear();
    }

    /// Notes an event (a kill, a restart) in the cycle's history.
    pub fn note(&mut self, what: String) {
        self.events.push((self.epoch.elapsed(), what));
    }

    fn op(&mut self, v: Version) -> Option<&mut Op> {
        let i = v.write().checked_sub(self.first_op)?;
        self.ops.get_mut(i as usize)
    }

    pub fn key(&self) -> u64 {
        self.key
    }

    /// Number of writes begun so far.
    pub fn writes(&self) -> u64 {
        self.next_write - 1
    }

    /// A request setting sectors `first..end` is about to be sent: its
    /// version (data, or zeros) from now on may be what those sectors hold.
    pub fn begin(&mut self, first: u64, end: u64, kind: Kind, fua: bool) -> Version {
        let w = self.next_write;
        self.next_write += 1;
        let v = if kind == Kind::Write {
            Version::data(w)
        } else {
            Version::zero(w)
        };
        for s in &mut self.sectors[first as usize..end as usize] {
            s.later.push(v);
        }
        self.ops.push(Op {
            version: v,
            kind,
            first,
            end,
            fua,
            begun: self.epoch.elapsed(),
            acked: None,
            durable: None,
        });
        v
    }

    /// The write `v` of `first..end` completed; with FUA (`durable`) it is
    /// durable now, otherwise once a flush covers it.
    pub fn acked(&mut self, v: Version, first: u64, end: u64, durable: bool) {
        let now = self.epoch.elapsed();
        if let Some(op) = self.op(v) {
            op.acked = Some(now);
            if durable {
                op.durable = Some((Durable::Fua, now));
            }
        }
        if durable {
            self.promote(v, first, end);
        } else {
            self.acks += 1;
            self.unflushed.push_back(Unflushed {
                ack: self.acks,
                version: v,
                first,
                end,
            });
        }
    }

    /// Taken just before a FLUSH is sent: what it will cover.
    pub fn flush_point(&mut self) -> Flush {
        self.flushes.push(FlushOp {
            point: self.acks,
            sent: self.epoch.elapsed(),
            done: None,
        });
        Flush {
            id: self.flushes.len() - 1,
            point: self.acks,
        }
    }

    /// The FLUSH `f` completed.
    pub fn flushed(&mut self, f: Flush) {
        let now = self.epoch.elapsed();
        if let Some(op) = self.flushes.get_mut(f.id) {
            op.done = Some(now);
        }
        while self.unflushed.front().is_some_and(|u| u.ack <= f.point) {
            if let Some(u) = self.unflushed.pop_front() {
                if let Some(op) = self.op(u.version) {
                    op.durable = Some((Durable::Flush(f.id), now));
                }
                self.promote(u.version, u.first, u.end);
            }
        }
    }

    fn promote(&mut self, v: Version, first: u64, end: u64) {
        for s in &mut self.sectors[first as usize..end as usize] {
            // Absent when a newer version became durable first (a FUA
            // write completing before the flush that covers this one).
            if let Some(i) = s.later.iter().position(|&x| x == v) {
                s.durable = v;
                s.later.drain(..=i);
            }
        }
    }

    /// Judges what sector `sector` read back (512 bytes). An allowed
    /// version becomes the sector's only one (the server holds it now);
    /// a violation changes nothing.
    pub fn check(&mut self, sector: u64, data: &[u8]) -> Result<Held, Violation> {
        let found = classify(data, self.key);
        let s = &mut self.sectors[sector as usize];
        let wanted = |v: &Version| match found {
            Found::Zero => v.is_zero(),
            Found::Data { sector: at, write } => at == sector && *v == Version::data(write),
            Found::Garbage { .. } => false,
        };
        let matched = s
            .later
            .iter()
            .rev()
            .find(|v| wanted(v))
            .copied()
            .map(|v| (v, Held::Newer))
            .or_else(|| wanted(&s.durable).then_some((s.durable, Held::Durable)));
        match matched {
            Some((v, held)) => {
                s.durable = v;
                s.later.clear();
                Ok(held)
            }
            None => Err(Violation {
                sector,
                found,
                durable: s.durable,
                later: s.later.clone(),
            }),
        }
    }

    /// The sector's durable version and those that may follow it.
    pub fn allowed(&self, sector: u64) -> (Version, &[Version]) {
        let s = &self.sectors[sector as usize];
        (s.durable, &s.later)
    }

    /// The current cycle's requests touching `sector`, the flushes that
    /// made them durable and the cycle's events, for a violation report.
    pub fn explain(&self, sector: u64) -> String {
        let ms = |d: Duration| format!("{:.3}s", d.as_secs_f64());
        let mut out = String::new();
        let touching: Vec<&Op> = self
            .ops
            .iter()
            .filter(|o| (o.first..o.end).contains(&sector))
            .collect();
        if touching.is_empty() {
            let _ = write!(out, "no request of this cycle set sector {sector}");
        }
        for o in touching {
            let _ = write!(
                out,
                "\n      write {} {:?}{} sectors {}..{} begun {}",
                o.version.write(),
                o.kind,
                if o.fua { " FUA" } else { "" },
                o.first,
                o.end,
                ms(o.begun)
            );
            match o.acked {
                Some(t) => {
                    let _ = write!(out, " acked {}", ms(t));
                }
                None => out.push_str(" never acked"),
            }
            match o.durable {
                Some((Durable::Fua, t)) => {
                    let _ = write!(out, ", durable by FUA at {}", ms(t));
                }
                Some((Durable::Flush(id), t)) => {
                    let f = &self.flushes[id];
                    let _ = write!(
                        out,
                        ", durable by flush {id} (covering acks up to {}, sent {}, done {})",
                        f.point,
                        ms(f.sent),
                        ms(t)
                    );
                }
                None => out.push_str(", not durable"),
            }
        }
        for (t, e) in &self.events {
            let _ = write!(out, "\n      at {}: {e}", ms(*t));
        }
        out
    }

    /// Whether every acknowledged write is covered by a completed flush and
    /// nothing is in flight: each sector then has exactly one version.
    pub fn settled(&self) -> bool {
        self.unflushed.is_empty() && self.sectors.iter().all(|s| s.later.is_empty())
    }

    /// Sectors whose only allowed content is data a soak write stored.
    pub fn durable_data_sectors(&self) -> impl Iterator<Item = u64> + '_ {
        self.sectors.iter().enumerate().filter_map(|(i, s)| {
            (s.later.is_empty() && !s.durable.is_zero() && s.durable.write() > 0)
                .then_some(i as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::stamp::fill;
    use super::*;

    const KEY: u64 = 77;

    fn data(sector: u64, v: Version) -> Vec<u8> {
        let mut b = vec![0u8; SECTOR as usize];
        if !v.is_zero() {
            fill(&mut b, sector, v.write(), KEY);
        }
        b
    }

    /// A fresh 16-sector disk whose sectors 0..8 have base data.
    fn disk() -> Record {
        Record::new(16, KEY, |s| s < 8)
    }

    /// Checks `sector` reading `v` without settling anything.
    fn judge(r: &Record, sector: u64, v: Version) -> Result<Held, Violation> {
        let (durable, later) = r.allowed(sector);
        let mut copy = Record::new(r.sectors.len() as u64, KEY, |_| false);
        copy.sectors[sector as usize] = Sector {
            durable,
            later: later.to_vec(),
        };
        copy.check(sector, &data(sector, v))
    }

    #[test]
    fn flushed_write_must_read_back() {
        let mut r = disk();
        let w = r.begin(2, 6, Kind::Write, false);
        r.acked(w, 2, 6, false);
        let f = r.flush_point();
        r.flushed(f);
        assert_eq!(judge(&r, 3, w), Ok(Held::Durable));
        // The base it overwrote, or zeros, are lost data.
        let lost = judge(&r, 3, Version::BASE).unwrap_err();
        assert_eq!(lost.durable, w);
        assert!(lost.later.is_empty());
        assert!(judge(&r, 3, Version::INITIAL_ZERO).is_err());
        // Sectors the write did not touch keep the base.
        assert_eq!(judge(&r, 7, Version::BASE), Ok(Held::Durable));
        assert!(judge(&r, 7, w).is_err());
        assert_eq!(judge(&r, 9, Version::INITIAL_ZERO), Ok(Held::Durable));
    }

    #[test]
    fn unflushed_and_in_flight_writes_may_or_may_not_survive() {
        let mut r = disk();
        let a = r.begin(0, 4, Kind::Write, false);
        r.acked(a, 0, 4, false);
        let b = r.begin(0, 4, Kind::Write, false); // in flight at the crash
        assert_eq!(judge(&r, 1, Version::BASE), Ok(Held::Durable));
        assert_eq!(judge(&r, 1, a), Ok(Held::Newer));
        assert_eq!(judge(&r, 1, b), Ok(Held::Newer));
        // A flush sent but not completed covers nothing.
        let _ = r.flush_point();
        assert_eq!(judge(&r, 1, Version::BASE), Ok(Held::Durable));
    }

    #[test]
    fn a_flush_covers_only_writes_acknowledged_before_it_was_sent() {
        let mut r = disk();
        let a = r.begin(10, 12, Kind::Write, false);
        r.acked(a, 10, 12, false);
        let p = r.flush_point();
        let b = r.begin(10, 12, Kind::Write, false);
        r.acked(b, 10, 12, false);
        r.flushed(p);
        assert_eq!(judge(&r, 10, a), Ok(Held::Durable));
        assert_eq!(judge(&r, 10, b), Ok(Held::Newer));
        let stale = judge(&r, 10, Version::INITIAL_ZERO).unwrap_err();
        assert_eq!((stale.durable, stale.later.as_slice()), (a, &[b][..]));
        // A second flush covers b; a is then stale too.
        let f = r.flush_point();
        r.flushed(f);
        assert!(judge(&r, 10, a).is_err());
        assert_eq!(judge(&r, 10, b), Ok(Held::Durable));
    }

    #[test]
    fn fua_is_durable_at_once_and_an_older_flush_does_not_undo_it() {
        let mut r = disk();
        let a = r.begin(12, 13, Kind::Write, false);
        r.acked(a, 12, 13, false);
        let p = r.flush_point();
        let b = r.begin(12, 13, Kind::Write, false);
        r.acked(b, 12, 13, true);
        assert_eq!(judge(&r, 12, b), Ok(Held::Durable));
        assert!(judge(&r, 12, a).is_err());
        r.flushed(p);
        assert_eq!(r.allowed(12), (b, &[][..]));
    }

    #[test]
    fn zeros_are_a_version_like_any_other() {
        let mut r = disk();
        let z = r.begin(0, 2, Kind::Zeroes, false);
        r.acked(z, 0, 2, false);
        let f = r.flush_point();
        r.flushed(f);
        assert_eq!(judge(&r, 0, z), Ok(Held::Durable));
        assert!(judge(&r, 0, Version::BASE).is_err());
        let w = r.begin(0, 2, Kind::Write, false);
        assert_eq!(judge(&r, 0, w), Ok(Held::Newer));
        assert_eq!(judge(&r, 0, Version::INITIAL_ZERO), Ok(Held::Durable));
    }

    #[test]
    fn misplaced_data_and_garbage_are_violations() {
        let mut r = disk();
        let w = r.begin(0, 16, Kind::Write, false);
        // Not even flushed: every version of w is allowed, but only at its
        // own sector.
        assert_eq!(judge(&r, 5, w), Ok(Held::Newer));
        let v = r.check(5, &data(6, w)).unwrap_err();
        assert_eq!(
            v.found,
            Found::Data {
                sector: 6,
                write: w.write()
            }
        );
        let mut torn = data(5, w);
        torn[400..].copy_from_slice(&data(5, Version::BASE)[400..]);
        assert!(matches!(
            r.check(5, &torn).unwrap_err().found,
            Found::Garbage { .. }
        ));
        // A version that was never written anywhere.
        assert!(r.check(5, &data(5, Version::data(999))).is_err());
        // The violations changed nothing.
        assert_eq!(r.allowed(5), (Version::BASE, &[w][..]));
    }

    #[test]
    fn what_a_sector_held_after_a_crash_is_all_it_may_hold_next() {
        let mut r = disk();
        let a = r.begin(3, 4, Kind::Write, false);
        r.acked(a, 3, 4, false);
        assert_eq!(r.check(3, &data(3, Version::BASE)), Ok(Held::Durable));
        // The unflushed write did not survive: it can no longer appear.
        assert_eq!(r.allowed(3), (Version::BASE, &[][..]));
        assert!(r.check(3, &data(3, a)).is_err());
        let f = r.flush_point();
        r.flushed(f); // its acknowledgement is stale: changes nothing
        assert_eq!(r.allowed(3), (Version::BASE, &[][..]));
        assert!(r.settled());
    }

    #[test]
    fn a_violation_is_explained_by_the_cycles_requests_on_its_sector() {
        let mut r = disk();
        let a = r.begin(2, 6, Kind::Write, false);
        r.acked(a, 2, 6, false);
        let f = r.flush_point();
        r.flushed(f);
        let b = r.begin(4, 8, Kind::Zeroes, true);
        r.acked(b, 4, 8, true);
        let _c = r.begin(5, 6, Kind::Trim, false);
        r.note("kill -9".into());
        let e = r.explain(5);
        assert!(e.contains("write 1 Write sectors 2..6"), "{e}");
        assert!(
            e.contains("durable by flush 0 (covering acks up to 1"),
            "{e}"
        );
        assert!(e.contains("write 2 Zeroes FUA sectors 4..8"), "{e}");
        assert!(e.contains("durable by FUA"), "{e}");
        assert!(e.contains("write 3 Trim sectors 5..6"), "{e}");
        assert!(e.contains("never acked, not durable"), "{e}");
        assert!(e.contains(": kill -9"), "{e}");
        assert!(
            r.explain(12)
                .starts_with("no request of this cycle set sector 12")
        );
        // A new cycle forgets the old one's requests, not the record.
        r.start_cycle();
        assert!(r.explain(5).starts_with("no request"));
        assert_eq!(r.allowed(5).0, b);
    }

    #[test]
    fn durable_data_sectors_are_those_with_one_soak_version() {
        let mut r = disk();
        let a = r.begin(9, 11, Kind::Write, false);
        r.acked(a, 9, 11, true);
        let z = r.begin(11, 12, Kind::Zeroes, false);
        r.acked(z, 11, 12, true);
        let _ = r.begin(10, 11, Kind::Write, false);
        assert_eq!(r.durable_data_sectors().collect::<Vec<_>>(), vec![9]);
        assert!(!r.settled());
    }
}
