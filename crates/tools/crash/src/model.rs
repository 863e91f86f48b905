//! The guest-level history and what it allows after a crash: per 512-byte
//! guest sector, the chronological list of versions it held (content
//! stored once, identified by the guest op that produced it), and for a
//! crash point, which of them may be read back.
//!
//! The rule (DESIGN.md invariants 1 and 2): a sector may read back the
//! version it had when its durability point was reached — the last
//! completed guest flush, or a later completed FUA write of that sector —
//! or any version written after that by an op that had started (or
//! completed) by the crash point. Nothing older (stale), nothing else
//! (garbage).
//!
//! This module owns that rule and the bookkeeping. It must not talk to a
//! disk or a device: it judges bytes it is given.

use std::fmt;

/// Guest sector size: the unit of the model.
pub const SECTOR: u64 = 512;

/// The op index of the content the disk had before the workload.
const INITIAL: u32 = u32::MAX;

/// A guest operation of the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestOpKind {
    Write,
    WriteZeroes {
        may_unmap: bool,
    },
    Discard,
    Read,
    Flush,
    /// Clean close and open again (a close is a flush).
    Reopen,
    /// Clean close at the end of the workload.
    Close,
}

/// One guest op and where it sits in the device log: entries
/// `start..end` are the backend operations it caused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestOp {
    pub kind: GuestOpKind,
    pub offset: u64,
    pub len: u64,
    pub fua: bool,
    pub start: u64,
    pub end: u64,
}

impl GuestOp {
    /// Whether completing it makes everything before it durable.
    pub fn is_barrier(&self) -> bool {
        matches!(
            self.kind,
            GuestOpKind::Flush | GuestOpKind::Reopen | GuestOpKind::Close
        )
    }
}

impl fmt::Display for GuestOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.kind {
            GuestOpKind::Write => "write",
            GuestOpKind::WriteZeroes { may_unmap: true } => "write-zeroes(unmap)",
            GuestOpKind::WriteZeroes { may_unmap: false } => "write-zeroes",
            GuestOpKind::Discard => "discard",
            GuestOpKind::Read => "read",
            GuestOpKind::Flush => return write!(f, "flush [log {}..{}]", self.start, self.end),
            GuestOpKind::Reopen => return write!(f, "reopen [log {}..{}]", self.start, self.end),
            GuestOpKind::Close => return write!(f, "close [log {}..{}]", self.start, self.end),
        };
        write!(
            f,
            "{name}{} {:#x}+{:#x} [log {}..{}]",
            if self.fua { "(fua)" } else { "" },
            self.offset,
            self.len,
            self.start,
            self.end
        )
    }
}

#[derive(Debug, Clone, Copy)]
struct Version {
    op: u32,
    hash: u64,
    /// Offset of its 512 bytes in the arena.
    at: usize,
}

/// The guest disk as the workload wrote it, with every sector's versions.
#[derive(Debug, Clone)]
pub struct GuestModel {
    current: Vec<u8>,
    versions: Vec<Vec<Version>>,
    arena: Vec<u8>,
}

/// A fast 64-bit hash of one sector (content identity, not security).
pub fn sector_hash(data: &[u8]) -> u64 {
    let mut h = 0x84222325_cbf29ce4u64 ^ data.len() as u64;
    let mut g = 0x9e37_79b9_7f4a_7c15u64;
    let mut words = data.chunks_exact(16);
    for w in &mut words {
        let (x, y) = w.split_at(8);
        let x = u64::from_le_bytes(x.try_into().unwrap_or([0; 8]));
        let y = u64::from_le_bytes(y.try_into().unwrap_or([0; 8]));
        h = (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(27);
        g = (g ^ y).wrapping_mul(0xc2b2_ae3d_27d4_eb4f).rotate_left(31);
    }
    for (i, &x) in words.remainder().iter().enumerate() {
        h = crate::rng::mix(h ^ (u64::from(x) << (i % 8 * 8)));
    }
    crate::rng::mix(h ^ g.rotate_left(32))
}

impl GuestModel {
    /// A model whose every sector holds `initial` (the disk before the
    /// workload, as read through the target).
    pub fn new(initial: Vec<u8>) -> GuestModel {
        let sectors = (initial.len() as u64).div_ceil(SECTOR) as usize;
        let mut arena = initial.clone();
        arena.resize(sectors * SECTOR as usize, 0);
        let versions = (0..sectors)
            .map(|s| {
                let at = s * SECTOR as usize;
                vec![Version {
                    op: INITIAL,
                    hash: sector_hash(&arena[at..at + SECTOR as usize]),
                    at,
                }]
            })
            .collect();
        GuestModel {
            current: initial,
            versions,
            arena,
        }
    }

    pub fn size(&self) -> u64 {
        self.current.len() as u64
    }

    /// The disk as it reads now.
    pub fn current(&self) -> &[u8] {
        &self.current
    }

    /// Records that guest op `op` made `[offset, offset+bytes.len())` read
    /// `bytes`.
    pub fn apply(&mut self, op: usize, offset: u64, bytes: &[u8]) {
        let end = offset + bytes.len() as u64;
        self.current[offset as usize..end as usize].copy_from_slice(bytes);
        if bytes.is_empty() {
            return;
        }
        let first = offset / SECTOR;
        let last = (end - 1) / SECTOR;
        for s in first..=last {
            let (a, b) = self.sector_bounds(s);
            let hash = sector_hash(&self.current[a..b]);
            let list = &mut self.versions[s as usize];
            if list.last().is_some_and(|v| v.hash == hash) {
                continue;
            }
            let at = self.arena.len();
            self.arena.extend_from_slice(&self.current[a..b]);
            self.arena.resize(at + SECTOR as usize, 0);
            list.push(Version {
                op: op as u32,
                hash,
                at,
            });
        }
    }

    fn sector_bounds(&self, s: u64) -> (usize, usize) {
        let a = (s * SECTOR) as usize;
        let b = ((s + 1) * SECTOR).min(self.size()) as usize;
        (a, b)
    }

    fn version_bytes(&self, v: &Version, len: usize) -> &[u8] {
        &self.arena[v.at..v.at + len]
    }

    /// Number of sectors that ever held more than one version.
    pub fn rewritten_sectors(&self) -> usize {
        self.versions.iter().filter(|v| v.len() > 1).count()
    }
}

/// The guest side of a workload run: its ops (in order) and the model.
#[derive(Debug, Clone)]
pub struct GuestHistory {
    pub ops: Vec<GuestOp>,
    pub model: GuestModel,
    /// Indices of barrier ops (flush, reopen, close), ascending.
    barriers: Vec<usize>,
}

/// What the guest history allows at one crash point.
#[derive(Debug, Clone, Copy)]
pub struct PointView {
    pub point: u64,
    /// Ops `0..included` may have had an effect (they had started).
    pub included: usize,
    /// The last barrier op completed before the crash.
    pub last_barrier: Option<usize>,
    /// The op in flight at the crash, if any.
    pub in_flight: Option<usize>,
}

/// The first bad sector of a recovered disk and what was allowed there.
#[derive(Debug, Clone)]
pub struct DataMismatch {
    /// First guest byte that differs from the newest allowed version.
    pub offset: u64,
    /// Sectors that read something not allowed.
    pub bad_sectors: u64,
    /// The allowed versions of the first bad sector, newest first.
    pub allowed: Vec<String>,
    /// What the found bytes are.
    pub found: String,
    /// 16 bytes from `offset`: expected (newest allowed) and found.
    pub expected_bytes: String,
    pub found_bytes: String,
}

impl fmt::Display for DataMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "first bad guest offset {:#x} ({} bad sectors): allowed [{}]; found {} (expected {} found {})",
            self.offset,
            self.bad_sectors,
            self.allowed.join(", "),
            self.found,
            self.expected_bytes,
            self.found_bytes
        )
    }
}

fn hex16(b: &[u8]) -> String {
    b.iter().take(16).map(|x| format!("{x:02x}")).collect()
}

impl GuestHistory {
    pub fn new(ops: Vec<GuestOp>, model: GuestModel) -> GuestHistory {
        let barriers = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.is_barrier())
            .map(|(i, _)| i)
            .collect();
        GuestHistory {
            ops,
            model,
            barriers,
        }
    }

    /// The guest's view of a crash at log position `point`.
    pub fn view(&self, point: u64) -> PointView {
        let included = self
            .ops
            .partition_point(|o| o.start < point || o.end <= point);
        let completed = self.ops.partition_point(|o| o.end <= point);
        let nb = self.barriers.partition_point(|&i| self.ops[i].end <= point);
        PointView {
            point,
            included,
            last_barrier: nb.checked_sub(1).map(|i| self.barriers[i]),
            in_flight: (completed < included).then_some(completed),
        }
    }

    /// A human description of where a crash point falls.
    pub fn describe_point(&self, view: &PointView) -> String {
        let mut s = match view.in_flight {
            Some(i) => format!("during op #{i} {}", self.ops[i]),
            None if view.included > 0 => format!(
                "after op #{} {}",
                view.included - 1,
                self.ops[view.included - 1]
            ),
            None => "before the first op".to_string(),
        };
        match view.last_barrier {
            Some(b) => s.push_str(&format!("; last completed flush: op #{b}")),
            None => s.push_str("; no completed flush"),
        }
        s
    }

    fn durable(&self, v: &Version, view: &PointView) -> bool {
        if v.op == INITIAL {
            return true;
        }
        let op = v.op as usize;
        view.last_barrier.is_some_and(|b| op < b)
            || (self.ops[op].fua && self.ops[op].end <= view.point)
    }

    /// The allowed versions of sector `s` at `view`, newest first.
    fn allowed(&self, s: usize, view: &PointView) -> Vec<&Version> {
        let list = &self.model.versions[s];
        let end = list.partition_point(|v| v.op == INITIAL || (v.op as usize) < view.included);
        let mut out = Vec::new();
        for v in list[..end].iter().rev() {
            out.push(v);
            if self.durable(v, view) {
                break;
            }
        }
        out
    }

    /// Checks a whole recovered disk (`found` is every guest byte);
    /// `None` when every sector reads an allowed version.
    pub fn check(&self, found: &[u8], view: &PointView) -> Option<DataMismatch> {
        self.check_readable(found, view, |_| true)
    }

    /// [`Self::check`] of the sectors `readable` says were read (by
    /// number); the others failed to read and are not judged here.
    pub fn check_readable(
        &self,
        found: &[u8],
        view: &PointView,
        readable: impl Fn(usize) -> bool,
    ) -> Option<DataMismatch> {
        let mut first: Option<usize> = None;
        let mut bad = 0u64;
        for (s, list) in self.model.versions.iter().enumerate() {
            if !readable(s) {
                continue;
            }
            let (a, b) = self.model.sector_bounds(s as u64);
            let h = sector_hash(&found[a..b]);
            let ok = if list.len() == 1 {
                list[0].hash == h
            } else {
                self.allowed(s, view).iter().any(|v| v.hash == h)
            };
            if !ok {
                bad += 1;
                first.get_or_insert(s);
            }
        }
        let s = first?;
        Some(self.describe_mismatch(s, found, view, bad))
    }

    fn describe_version(&self, v: &Version, view: &PointView) -> String {
        if v.op == INITIAL {
            return "initial content".to_string();
        }
        let op = v.op as usize;
        let durable = if self.durable(v, view) {
            " (durable)"
        } else {
            ""
        };
        format!("op #{op} {}{durable}", self.ops[op])
    }

    fn describe_mismatch(
        &self,
        s: usize,
        found: &[u8],
        view: &PointView,
        bad: u64,
    ) -> DataMismatch {
        let (a, b) = self.model.sector_bounds(s as u64);
        let got = &found[a..b];
        let h = sector_hash(got);
        let allowed = self.allowed(s, view);
        let newest = allowed[0];
        let expected = self.model.version_bytes(newest, b - a);
        let diff = expected
            .iter()
            .zip(got)
            .position(|(x, y)| x != y)
            .unwrap_or(0);
        let list = &self.model.versions[s];
        let started = list.partition_point(|v| v.op == INITIAL || (v.op as usize) < view.included);
        let stale = list[..started].iter().rposition(|v| v.hash == h);
        let future = list[started..].iter().position(|v| v.hash == h);
        let found_desc = match (stale, future) {
            (Some(i), _) => format!(
                "stale {}, superseded before the durability point",
                self.describe_version(&list[i], view)
            ),
            (None, Some(i)) => {
                let v = &list[started + i];
                format!(
                    "the version of op #{} {}, which had not started at the crash",
                    v.op, self.ops[v.op as usize]
                )
            }
            _ if got.iter().all(|&x| x == 0) => {
                "zeros, which this sector never held (garbage)".to_string()
            }
            _ => {
                let elsewhere = (0..self.model.versions.len())
                    .find(|&o| self.model.versions[o].iter().any(|v| v.hash == h && o != s))
                    .map(|o| format!(" (content of guest sector {:#x})", o as u64 * SECTOR))
                    .unwrap_or_default();
                format!("bytes this sector never held (garbage){elsewhere}")
            }
        };
        DataMismatch {
            offset: a as u64 + diff as u64,
            bad_sectors: bad,
            allowed: allowed
                .iter()
                .map(|v| self.describe_version(v, view))
                .collect(),
            found: found_desc,
            expected_bytes: hex16(&expected[diff..]),
            found_bytes: hex16(&got[diff..]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kind: GuestOpKind, start: u64, end: u64, fua: bool) -> GuestOp {
        GuestOp {
            kind,
            offset: 0,
            len: 512,
            fua,
            start,
            end,
        }
    }

    #[test]
    fn allowed_versions_follow_flushes_and_fua() {
        let mut m = GuestModel::new(vec![0; 2048]);
        m.apply(0, 0, &[1; 512]); // op 0: log 0..1
        m.apply(2, 0, &[2; 512]); // op 2: log 3..4
        m.apply(3, 512, &[3; 512]); // op 3 (fua): log 4..6
        let ops = vec![
            op(GuestOpKind::Write, 0, 1, false),
            op(GuestOpKind::Flush, 1, 3, false),
            op(GuestOpKind::Write, 3, 4, false),
            op(GuestOpKind::Write, 4, 6, true),
        ];
        let h = GuestHistory::new(ops, m);
        let mut disk = vec![0u8; 2048];
        // Before the flush completes, zeros and 1s are fine.
        assert!(h.check(&disk, &h.view(2)).is_none());
        // After it, sector 0 must hold 1 (or the later 2).
        let bad = h.check(&disk, &h.view(3)).expect("zeros are stale");
        assert_eq!(bad.offset, 0);
        assert!(bad.found.contains("stale"), "{}", bad.found);
        disk[..512].fill(1);
        assert!(h.check(&disk, &h.view(5)).is_none());
        disk[..512].fill(2);
        assert!(h.check(&disk, &h.view(5)).is_none());
        // Op 2 had not started at point 3: its bytes are not allowed yet.
        assert!(h.check(&disk, &h.view(3)).is_some());
        // The FUA write is durable once it completed: sector 1 must read 3.
        disk[..512].fill(1);
        assert!(h.check(&disk, &h.view(5)).is_none());
        assert!(h.check(&disk, &h.view(6)).is_some());
        disk[512..1024].fill(3);
        assert!(h.check(&disk, &h.view(6)).is_none());
        disk[700] = 9;
        let bad = h.check(&disk, &h.view(6)).expect("garbage");
        assert_eq!(bad.offset, 700);
        assert!(bad.found.contains("garbage"));
    }
}
