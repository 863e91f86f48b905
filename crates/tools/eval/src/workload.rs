//! Synthetic workload generators (boot storm, OLTP, file server, clone
//! storm).
//!
//! This module owns the shapes of the synthetic workloads and their
//! deterministic generation: a [`WorkloadSpec`] names a class and its knobs
//! (working set, read ratio, Zipf skew, duplicate content, request count,
//! seed), a [`Generator`] yields [`TraceRecord`]s one at a time, and
//! [`write_workload`] streams them into any trace format.
//!
//! It must not hold the trace in memory: state is O(working set) at most (two
//! bytes per tracked 4 KiB block, only when content digests are on) and
//! never grows with the request count. It must stay deterministic: the same
//! spec and seed give the same records on every machine. The PRNG is
//! `rand_xoshiro`'s xoshiro256++ seeded by SplitMix64 ([`Rng`]) and the Zipf
//! sampler wraps `rand_distr::Zipf`; both streams are fixed by the versions
//! in Cargo.lock, and the tests `rng_is_fixed` and `zipf_stream_is_fixed`
//! pin them, so a dependency upgrade that changes a generated trace fails
//! there rather than silently.
//!
//! Every request is 4 KiB-aligned with a length that is a multiple of
//! 4 KiB, and every time a multiple of 1 us, so that all formats can carry
//! them (see the round-trip test in `tests/`).

use std::collections::VecDeque;
use std::fmt;
use std::io::Write;
use std::str::FromStr;

use rand::{Rng as RngCore, RngExt, SeedableRng};
use rand_distr::Distribution;
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::trace::{ContentHash, Format, Op, TraceRecord, WriteError, WriterOptions, new_writer};

/// Block size of the generators (alignment and length unit).
pub const BLOCK: u64 = 4096;

// ---------------------------------------------------------------------------
// PRNG and distributions

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash several words into one (SplitMix64 finalizer chain).
fn hash_words(words: &[u64]) -> u64 {
    let mut s = 0x243f_6a88_85a3_08d3u64;
    let mut h = 0;
    for &w in words {
        s ^= w;
        h ^= splitmix64(&mut s);
    }
    h
}

/// The generators' PRNG: xoshiro256++, seeded with
/// [`SeedableRng::seed_from_u64`] (SplitMix64 expands the seed).
pub type Rng = Xoshiro256PlusPlus;

/// Largest accepted Zipf exponent (beyond it all mass is on rank 0 anyway).
pub const MAX_THETA: f64 = 20.0;

/// Zipf over `0..n`: P(k) proportional to 1 / (k + 1)^theta. theta = 0 is
/// uniform.
///
/// `rand_distr::Zipf::new(n, s)` draws k in `1..=n` with P(k) proportional
/// to k^-s, so it is the same law with s = theta, shifted down by one rank.
#[derive(Clone, Copy, Debug)]
pub struct Zipf {
    n: u64,
    dist: rand_distr::Zipf<f64>,
}

impl Zipf {
    /// `n >= 1`, `theta` in [0, [`MAX_THETA`]].
    pub fn new(n: u64, theta: f64) -> Result<Self, GenError> {
        if n == 0 {
            return Err(GenError::Invalid("Zipf over an empty range".into()));
        }
        if !(0.0..=MAX_THETA).contains(&theta) {
            return Err(GenError::Invalid(format!(
                "zipf_theta must be in [0, {MAX_THETA}], got {theta}"
            )));
        }
        let dist = rand_distr::Zipf::new(n as f64, theta)
            .map_err(|e| GenError::Invalid(format!("Zipf over {n} with theta {theta}: {e}")))?;
        Ok(Zipf { n, dist })
    }

    pub fn sample<R: RngCore + ?Sized>(&self, rng: &mut R) -> u64 {
        // The float rank is integral and in 1..=n; the clamp only guards
        // the cast against rounding at n near 2^53.
        (self.dist.sample(rng) as u64).clamp(1, self.n) - 1
    }
}

/// A bijection of `0..n` that scatters Zipf ranks over the address space.
#[derive(Clone, Copy, Debug)]
struct Scatter {
    n: u64,
    mul: u64,
}

impl Scatter {
    fn new(n: u64) -> Self {
        // 2^61 - 1 is prime and larger than any n used here, so it is coprime
        // with n and multiplication by it modulo n is a permutation.
        const P: u64 = (1 << 61) - 1;
        Scatter {
            n: n.max(1),
            mul: P % n.max(1),
        }
    }
    fn map(&self, k: u64) -> u64 {
        ((u128::from(k) * u128::from(self.mul)) % u128::from(self.n)) as u64
    }
}

// ---------------------------------------------------------------------------
// Specs

/// The shape of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadClass {
    /// N cloned VMs booting at once: each VM (one disk each) reads the same
    /// boot sequence over a shared base-image region (so the same content
    /// across VMs), in runs of 4-128 KiB that jump by Zipf; 10% of its reads
    /// go to a VM-specific base block instead; writes (1 - read ratio) go to a
    /// private region of 1/8 of the base, 4-16 KiB.
    BootStorm,
    /// Small random I/O: 4 KiB (70%) or 8 KiB (30%), Zipf over 8 KiB pages of
    /// the working set; every `flush_every_writes` writes, a commit: a
    /// sequential 4-16 KiB log append (log region of 1/64 of the working set,
    /// at least 1 MiB) and a flush.
    Oltp,
    /// Files as 1 MiB slots picked by Zipf; four interleaved streams each run
    /// sequentially through a slot (about 8 requests, sizes 4 KiB-256 KiB);
    /// a run is a whole-slot discard (file deletion) with probability
    /// `discard_ratio`.
    FileServer,
    /// N VMs (one disk each) cloned from one base image, for deduplication.
    /// Each disk is a base region (the working set), an update region and
    /// a private region (each 1/4 of the base, at least 16 blocks). The
    /// base holds the same content at the same offsets on every VM (the
    /// clones' bases are equal in content whatever their names). Every VM
    /// applies the same updates in the same order (the same package
    /// updates, logs rotated, files copied in): one sequence of update
    /// blocks, identical on every VM, written in runs of 4-128 KiB through
    /// the update region, which each VM lays out rotated by its own shift,
    /// so that the same content lands at a different offset in each VM
    /// (for up to as many VMs as the region has blocks); when the sequence
    /// ends it starts over with new content (the next updates), over the
    /// same places. The rest of the writes are private data (Zipf over the
    /// private region, 4-128 KiB, content unique to the VM and the write).
    /// `update_ratio` of the writes apply updates; reads (`read_ratio`) go
    /// 70% to the base, 15% to the update region and 15% to the private
    /// region, each by Zipf (scattered the same way on every VM, so popular
    /// base blocks are the same everywhere), 4-128 KiB. `dup_ratio` draws
    /// that fraction of base and private blocks from the popular pool.
    CloneStorm,
}

impl FromStr for WorkloadClass {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "boot-storm" | "bootstorm" | "boot" => Ok(WorkloadClass::BootStorm),
            "oltp" => Ok(WorkloadClass::Oltp),
            "file-server" | "fileserver" | "fs" => Ok(WorkloadClass::FileServer),
            "clone-storm" | "clonestorm" | "clones" => Ok(WorkloadClass::CloneStorm),
            _ => Err(format!(
                "unknown workload class '{s}' (expected boot-storm, oltp, file-server or clone-storm)"
            )),
        }
    }
}

impl fmt::Display for WorkloadClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkloadClass::BootStorm => "boot-storm",
            WorkloadClass::Oltp => "oltp",
            WorkloadClass::FileServer => "file-server",
            WorkloadClass::CloneStorm => "clone-storm",
        })
    }
}

/// Everything that defines a synthetic trace. Build with
/// [`WorkloadSpec::new`] (class defaults) and adjust fields.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WorkloadSpec {
    pub class: WorkloadClass,
    /// Records to produce (flushes, discards and log writes included).
    pub requests: u64,
    /// Disks; for a boot storm or a clone storm, the number of cloned VMs
    /// (one disk each). Other classes spread requests uniformly over the
    /// disks. At most 65536.
    pub disks: u32,
    /// Working set per disk in bytes (boot storm, clone storm: the shared
    /// base region),
    /// rounded down to 4 KiB, at least 64 KiB. The disks' address space is a
    /// bit larger (private region, log region).
    pub working_set_bytes: u64,
    /// Fraction of data requests that are reads, in [0, 1].
    pub read_ratio: f64,
    /// Zipf exponent of the popularity of blocks/pages/files; 0 = uniform.
    pub zipf_theta: f64,
    /// Fraction of written (and initial) block versions whose content is
    /// drawn from a small pool of popular contents (zero block first), in
    /// [0, 1].
    pub dup_ratio: f64,
    pub seed: u64,
    /// Mean of the exponential inter-arrival time; times are rounded to 1 us.
    pub mean_interarrival_ns: u64,
    /// Time of the first record (rounded down to 1 us).
    pub start_time_ns: u64,
    /// Attach per-4 KiB content digests to reads and writes.
    pub content: bool,
    /// OLTP: a commit (log append + flush) after this many data writes; 0 =
    /// never.
    pub flush_every_writes: u32,
    /// File server: fraction of runs that are whole-file discards, in [0, 1].
    pub discard_ratio: f64,
    /// Clone storm: fraction of writes that apply the updates every VM
    /// applies (the rest are private data), in [0, 1].
    pub update_ratio: f64,
}

impl WorkloadSpec {
    /// Defaults for a class: boot storm 16 VMs over a 1 GiB base, 95% reads,
    /// theta 0.6, 20% duplicate content; OLTP 1 disk, 4 GiB, 70% reads, theta
    /// 0.99, commit every 16 writes; file server 1 disk, 8 GiB, 80% reads,
    /// theta 0.8, 30% duplicate content, 2% discards; clone storm 8 VMs
    /// over a 1 GiB base, 70% reads, theta 0.8, half the writes updates, no
    /// pool duplicates (all sharing is the clones'). 1 million requests,
    /// seed 1, content on.
    pub fn new(class: WorkloadClass) -> Self {
        let base = WorkloadSpec {
            class,
            requests: 1_000_000,
            disks: 1,
            working_set_bytes: 1 << 30,
            read_ratio: 0.7,
            zipf_theta: 0.9,
            dup_ratio: 0.1,
            seed: 1,
            mean_interarrival_ns: 100_000,
            start_time_ns: 0,
            content: true,
            flush_every_writes: 0,
            discard_ratio: 0.0,
            update_ratio: 0.0,
        };
        match class {
            WorkloadClass::BootStorm => WorkloadSpec {
                disks: 16,
                read_ratio: 0.95,
                zipf_theta: 0.6,
                dup_ratio: 0.2,
                mean_interarrival_ns: 20_000,
                ..base
            },
            WorkloadClass::Oltp => WorkloadSpec {
                working_set_bytes: 4 << 30,
                zipf_theta: 0.99,
                dup_ratio: 0.05,
                flush_every_writes: 16,
                ..base
            },
            WorkloadClass::FileServer => WorkloadSpec {
                working_set_bytes: 8 << 30,
                read_ratio: 0.8,
                zipf_theta: 0.8,
                dup_ratio: 0.3,
                mean_interarrival_ns: 200_000,
                discard_ratio: 0.02,
                ..base
            },
            WorkloadClass::CloneStorm => WorkloadSpec {
                disks: 8,
                read_ratio: 0.7,
                zipf_theta: 0.8,
                dup_ratio: 0.0,
                mean_interarrival_ns: 50_000,
                update_ratio: 0.5,
                ..base
            },
        }
    }

    /// Check every knob; the error names the field.
    pub fn validate(&self) -> Result<(), GenError> {
        let unit = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(GenError::Invalid(format!(
                    "{name} must be in [0, 1], got {v}"
                )))
            }
        };
        unit("read_ratio", self.read_ratio)?;
        unit("dup_ratio", self.dup_ratio)?;
        unit("discard_ratio", self.discard_ratio)?;
        unit("update_ratio", self.update_ratio)?;
        if !(0.0..=MAX_THETA).contains(&self.zipf_theta) {
            return Err(GenError::Invalid(format!(
                "zipf_theta must be in [0, {MAX_THETA}], got {}",
                self.zipf_theta
            )));
        }
        if self.disks == 0 || self.disks > 65536 {
            return Err(GenError::Invalid(format!(
                "disks must be in 1..=65536, got {}",
                self.disks
            )));
        }
        if self.working_set_bytes < 16 * BLOCK {
            return Err(GenError::Invalid(format!(
                "working_set_bytes must be at least 64 KiB, got {}",
                self.working_set_bytes
            )));
        }
        if self.working_set_bytes / BLOCK > u64::from(u32::MAX) {
            return Err(GenError::Invalid(
                "working_set_bytes must be below 16 TiB".into(),
            ));
        }
        if self.content {
            let tracked = self
                .layout()
                .tracked_blocks
                .saturating_mul(u64::from(self.disks));
            if tracked > MAX_TRACKED_BLOCKS {
                return Err(GenError::Invalid(format!(
                    "content digests need 2 bytes per tracked block: {tracked} blocks is over the {MAX_TRACKED_BLOCKS} limit (lower the working set or disks, or turn content off)"
                )));
            }
        }
        Ok(())
    }

    fn layout(&self) -> Layout {
        let b = self.working_set_bytes / BLOCK;
        match self.class {
            WorkloadClass::BootStorm => {
                let private = (b / 8).max(16);
                Layout {
                    base: b,
                    extra: private,
                    tracked_blocks: private,
                }
            }
            WorkloadClass::Oltp => {
                let log = (b / 64).max(256);
                Layout {
                    base: b,
                    extra: log,
                    tracked_blocks: b + log,
                }
            }
            WorkloadClass::FileServer => Layout {
                base: b,
                extra: 0,
                tracked_blocks: b,
            },
            WorkloadClass::CloneStorm => {
                let quarter = (b / 4).max(16);
                Layout {
                    base: b,
                    extra: 2 * quarter,
                    tracked_blocks: quarter,
                }
            }
        }
    }

    /// Bytes of each disk's address space that the workload can touch.
    pub fn disk_bytes(&self) -> u64 {
        let l = self.layout();
        (l.base + l.extra) * BLOCK
    }
}

/// At most 2^31 tracked blocks (4 GiB of version counters).
const MAX_TRACKED_BLOCKS: u64 = 1 << 31;

struct Layout {
    /// Blocks of the working set (boot storm: shared base).
    base: u64,
    /// Blocks after it (boot storm: private region; OLTP: log; clone
    /// storm: update region, then private region, of `extra / 2` each).
    extra: u64,
    /// Blocks whose versions are tracked, per disk.
    tracked_blocks: u64,
}

/// Errors from generation.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error("invalid workload: {0}")]
    Invalid(String),
    #[error(transparent)]
    Write(#[from] WriteError),
}

// ---------------------------------------------------------------------------
// Content model

const DISCARDED: u16 = u16::MAX;
const POOL: u64 = 64;

fn digest_of(words: &[u64]) -> ContentHash {
    let a = hash_words(words);
    let b = hash_words(&[a, 0x1234_5678_9abc_def0]);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

/// Content of one of the popular pool entries; entry 0 is the zero block.
fn pool_digest(seed: u64, idx: u64) -> ContentHash {
    digest_of(&[seed, 0x9001, idx])
}

/// Content of a block version: from the pool with probability `dup`, else
/// unique to (space, disk, block, version).
fn version_digest(
    seed: u64,
    dup: f64,
    space: u64,
    disk: u64,
    block: u64,
    version: u16,
) -> ContentHash {
    if version == DISCARDED {
        return pool_digest(seed, 0);
    }
    let h = hash_words(&[seed, space, disk, block, u64::from(version)]);
    if ((h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)) < dup {
        // Geometric pool index: entry 0 (the zero block) half the time.
        let idx = u64::from(hash_words(&[h, 7]).trailing_zeros()).min(POOL - 1);
        pool_digest(seed, idx)
    } else {
        digest_of(&[seed, space, disk, block, u64::from(version), 0xc0de])
    }
}

/// Content of block `k` of the clone storm's update sequence, in round
/// `round`: the same on every VM, never from the pool.
fn update_digest(seed: u64, round: u64, k: u64) -> ContentHash {
    digest_of(&[seed, 0xc10e, round, k, 0x00bd_a7e5])
}

// ---------------------------------------------------------------------------
// Generator

#[derive(Clone, Copy, Debug)]
struct BootCursor {
    step: u64,
    next_block: u64,
}

/// Where a clone storm's VM is in the update sequence: blocks `0..next`
/// of round `round` are applied; the rest hold round `round - 1` (or
/// nothing yet, in round 0).
#[derive(Clone, Copy, Debug, Default)]
struct UpdateCursor {
    round: u64,
    next: u64,
}

/// The clone storm's Zipf samplers over the update and private regions.
#[derive(Clone, Copy, Debug)]
struct CloneRegions {
    update: (Zipf, Scatter),
    private: (Zipf, Scatter),
    /// Offset of every VM's rotation (from the seed).
    shift: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Stream {
    disk: u32,
    block: u64,
    end: u64,
    remaining: u32,
    op: Option<Op>,
}

/// Yields the records of a [`WorkloadSpec`], one at a time.
pub struct Generator {
    spec: WorkloadSpec,
    layout: Layout,
    rng: Rng,
    zipf: Zipf,
    scatter: Scatter,
    time_ns: u64,
    emitted: u64,
    pending: VecDeque<TraceRecord>,
    /// versions[disk * tracked + i]
    versions: Vec<u16>,
    boot: Vec<BootCursor>,
    streams: [Stream; 4],
    writes: u64,
    log_head: Vec<u64>,
    /// Clone storm: each VM's place in the update sequence.
    updates: Vec<UpdateCursor>,
    clone: Option<CloneRegions>,
}

/// Start generating. Fails if the spec is invalid.
pub fn generate(spec: &WorkloadSpec) -> Result<Generator, GenError> {
    spec.validate()?;
    let layout = spec.layout();
    let units = match spec.class {
        WorkloadClass::BootStorm => layout.base,
        WorkloadClass::Oltp => (layout.base / 2).max(1),
        WorkloadClass::FileServer => (layout.base / FILE_SLOT_BLOCKS).max(1),
        WorkloadClass::CloneStorm => layout.base,
    };
    let versions = if spec.content {
        vec![0u16; (layout.tracked_blocks * u64::from(spec.disks)) as usize]
    } else {
        Vec::new()
    };
    let boot = if spec.class == WorkloadClass::BootStorm {
        vec![
            BootCursor {
                step: 0,
                next_block: 0
            };
            spec.disks as usize
        ]
    } else {
        Vec::new()
    };
    let log_head = if spec.class == WorkloadClass::Oltp {
        vec![0; spec.disks as usize]
    } else {
        Vec::new()
    };
    let (updates, clone) = if spec.class == WorkloadClass::CloneStorm {
        let quarter = layout.extra / 2;
        let region = (Zipf::new(quarter, spec.zipf_theta)?, Scatter::new(quarter));
        (
            vec![UpdateCursor::default(); spec.disks as usize],
            Some(CloneRegions {
                update: region,
                private: region,
                shift: hash_words(&[spec.seed, 0x5_41f7]) % quarter,
            }),
        )
    } else {
        (Vec::new(), None)
    };
    Ok(Generator {
        zipf: Zipf::new(units, spec.zipf_theta)?,
        scatter: Scatter::new(units),
        rng: Rng::seed_from_u64(spec.seed),
        time_ns: spec.start_time_ns / 1000 * 1000,
        emitted: 0,
        pending: VecDeque::new(),
        versions,
        boot,
        streams: [Stream::default(); 4],
        writes: 0,
        log_head,
        updates,
        clone,
        layout,
        spec: spec.clone(),
    })
}

const FILE_SLOT_BLOCKS: u64 = 256;
const BOOT_SIZES: [(u64, f64); 6] = [
    (1, 0.30),
    (2, 0.20),
    (4, 0.20),
    (8, 0.15),
    (16, 0.10),
    (32, 0.05),
];
const FS_SIZES: [(u64, f64); 7] = [
    (1, 0.30),
    (2, 0.15),
    (4, 0.15),
    (8, 0.10),
    (16, 0.15),
    (32, 0.10),
    (64, 0.05),
];

fn pick_size(rng: &mut Rng, table: &[(u64, f64)]) -> u64 {
    let mut u: f64 = rng.random();
    for &(blocks, p) in table {
        if u < p {
            return blocks;
        }
        u -= p;
    }
    table.last().map_or(1, |t| t.0)
}

impl Generator {
    /// The spec being generated.
    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    fn tracked_index(&self, disk: u32, tracked_block: u64) -> usize {
        (u64::from(disk) * self.layout.tracked_blocks + tracked_block) as usize
    }

    /// Digests of blocks `block..block+n` of `disk` as they are now. Untracked
    /// blocks are the shared base of a boot storm or a clone storm, the same
    /// on every disk, or a clone storm's update region.
    fn content_of(&self, disk: u32, block: u64, n: u64) -> Option<Vec<ContentHash>> {
        if !self.spec.content {
            return None;
        }
        let (seed, dup) = (self.spec.seed, self.spec.dup_ratio);
        Some(
            (block..block + n)
                .map(|b| {
                    if let Some(pos) = self.update_pos(b) {
                        return self.update_content(disk, pos);
                    }
                    match self.tracked_of(b) {
                        None => version_digest(seed, dup, 1, 0, b, 0),
                        Some(t) => {
                            let v = self.versions[self.tracked_index(disk, t)];
                            version_digest(seed, dup, 2, u64::from(disk), b, v)
                        }
                    }
                })
                .collect(),
        )
    }

    /// Index among tracked blocks, or None for the shared base (and a clone
    /// storm's update region).
    fn tracked_of(&self, block: u64) -> Option<u64> {
        match self.spec.class {
            WorkloadClass::BootStorm => block.checked_sub(self.layout.base),
            WorkloadClass::CloneStorm => {
                block.checked_sub(self.layout.base + self.layout.extra / 2)
            }
            _ => Some(block),
        }
    }

    /// Clone storm: the place of `block` in the update region, if it is
    /// there.
    fn update_pos(&self, block: u64) -> Option<u64> {
        if self.spec.class != WorkloadClass::CloneStorm {
            return None;
        }
        block
            .checked_sub(self.layout.base)
            .filter(|&p| p < self.layout.extra / 2)
    }

    /// Clone storm: how far VM `disk` rotates the update sequence in its
    /// update region. Distinct for every VM while there are no more VMs
    /// than blocks in the region.
    fn rotation(&self, disk: u32) -> u64 {
        let quarter = self.layout.extra / 2;
        let shift = self.clone.map_or(0, |c| c.shift);
        (shift + u64::from(disk) * quarter / u64::from(self.spec.disks)) % quarter
    }

    /// Clone storm: what place `pos` of VM `disk`'s update region holds
    /// now: the update block the VM's rotation puts there, of the current
    /// round if the VM has applied it, else of the round before (nothing,
    /// a zero block, before the first).
    fn update_content(&self, disk: u32, pos: u64) -> ContentHash {
        let quarter = self.layout.extra / 2;
        let k = (pos + quarter - self.rotation(disk)) % quarter;
        let cur = self.updates[disk as usize];
        let seed = self.spec.seed;
        if k < cur.next {
            update_digest(seed, cur.round, k)
        } else if cur.round > 0 {
            update_digest(seed, cur.round - 1, k)
        } else {
            pool_digest(seed, 0)
        }
    }

    fn bump(&mut self, disk: u32, block: u64, n: u64, discard: bool) {
        if !self.spec.content {
            return;
        }
        for b in block..block + n {
            if let Some(t) = self.tracked_of(b) {
                let i = self.tracked_index(disk, t);
                let v = &mut self.versions[i];
                *v = if discard {
                    DISCARDED
                } else if *v >= DISCARDED - 1 {
                    1
                } else {
                    *v + 1
                };
            }
        }
    }

    fn data(&mut self, disk: u32, op: Op, block: u64, n: u64) -> TraceRecord {
        let mut rec = TraceRecord::new(0, disk, op, block * BLOCK, n * BLOCK);
        match op {
            Op::Read => rec.content = self.content_of(disk, block, n),
            Op::Write => {
                self.bump(disk, block, n, false);
                rec.content = self.content_of(disk, block, n);
            }
            Op::Discard => self.bump(disk, block, n, true),
            Op::Flush => {}
        }
        rec
    }

    fn boot_step(&mut self) -> TraceRecord {
        let disk = self.rng.random_range(0..u64::from(self.spec.disks)) as u32;
        let base = self.layout.base;
        if !self.rng.random_bool(self.spec.read_ratio) {
            let private = self.layout.extra;
            let n = 1 + self.rng.random_range(0..4).min(private - 1);
            let block = base + self.rng.random_range(0..private - n + 1);
            return self.data(disk, Op::Write, block, n);
        }
        if self.rng.random_bool(0.1) {
            let start = self.scatter.map(self.zipf.sample(&mut self.rng));
            let n = pick_size(&mut self.rng, &BOOT_SIZES).min(base - start);
            return self.data(disk, Op::Read, start, n);
        }
        // The shared boot sequence: step j is the same for every VM.
        let cur = self.boot[disk as usize];
        let mut step_rng = Rng::seed_from_u64(hash_words(&[self.spec.seed, 0xb007, cur.step]));
        let sequential = cur.step > 0 && step_rng.random_bool(0.6) && cur.next_block < base;
        let start = if sequential {
            cur.next_block
        } else {
            self.scatter.map(self.zipf.sample(&mut step_rng))
        };
        let n = pick_size(&mut step_rng, &BOOT_SIZES).min(base - start);
        self.boot[disk as usize] = BootCursor {
            step: cur.step + 1,
            next_block: start + n,
        };
        self.data(disk, Op::Read, start, n)
    }

    fn clone_step(&mut self) -> TraceRecord {
        let disk = self.rng.random_range(0..u64::from(self.spec.disks)) as u32;
        let (base, quarter) = (self.layout.base, self.layout.extra / 2);
        let regions = self
            .clone
            .expect("generate() sets up a clone storm's regions");
        let n = pick_size(&mut self.rng, &BOOT_SIZES);
        if !self.rng.random_bool(self.spec.read_ratio) {
            if self.rng.random_bool(self.spec.update_ratio) {
                // The next run of the update sequence, where this VM puts
                // it, not wrapping around the region.
                let cur = self.updates[disk as usize];
                let pos = (cur.next + self.rotation(disk)) % quarter;
                let n = n.min(quarter - cur.next).min(quarter - pos);
                let next = cur.next + n;
                self.updates[disk as usize] = if next == quarter {
                    UpdateCursor {
                        round: cur.round + 1,
                        next: 0,
                    }
                } else {
                    UpdateCursor { next, ..cur }
                };
                return self.data(disk, Op::Write, base + pos, n);
            }
            let (z, sc) = regions.private;
            let start = sc.map(z.sample(&mut self.rng));
            let n = n.min(quarter - start);
            return self.data(disk, Op::Write, base + quarter + start, n);
        }
        let u: f64 = self.rng.random();
        let (first, len, (z, sc)) = if u < 0.7 {
            (0, base, (self.zipf, self.scatter))
        } else if u < 0.85 {
            (base, quarter, regions.update)
        } else {
            (base + quarter, quarter, regions.private)
        };
        let start = sc.map(z.sample(&mut self.rng));
        let n = n.min(len - start);
        self.data(disk, Op::Read, first + start, n)
    }

    fn oltp_step(&mut self) -> TraceRecord {
        let disk = self.rng.random_range(0..u64::from(self.spec.disks)) as u32;
        let page = self.scatter.map(self.zipf.sample(&mut self.rng));
        let (block, n) = if self.rng.random_bool(0.3) {
            (page * 2, 2)
        } else {
            (page * 2 + self.rng.random_range(0..2), 1)
        };
        let n = n.min(self.layout.base - block);
        if self.rng.random_bool(self.spec.read_ratio) {
            return self.data(disk, Op::Read, block, n);
        }
        let rec = self.data(disk, Op::Write, block, n);
        self.writes += 1;
        let every = u64::from(self.spec.flush_every_writes);
        if every > 0 && self.writes.is_multiple_of(every) {
            let log = self.layout.extra;
            let len = 1 + self.rng.random_range(0..4);
            let head = &mut self.log_head[disk as usize];
            if *head + len > log {
                *head = 0;
            }
            let block = self.layout.base + *head;
            *head += len;
            let append = self.data(disk, Op::Write, block, len);
            self.pending.push_back(append);
            self.pending
                .push_back(TraceRecord::new(0, disk, Op::Flush, 0, 0));
        }
        rec
    }

    fn fs_step(&mut self) -> TraceRecord {
        let si = self.rng.random_range(0..self.streams.len() as u64) as usize;
        let mut s = self.streams[si];
        if s.remaining == 0 || s.block >= s.end {
            let slots = (self.layout.base / FILE_SLOT_BLOCKS).max(1);
            let slot = self
                .scatter
                .map(self.zipf.sample(&mut self.rng))
                .min(slots - 1); // units == slots
            let start = slot * FILE_SLOT_BLOCKS;
            let end = (start + FILE_SLOT_BLOCKS).min(self.layout.base);
            let disk = self.rng.random_range(0..u64::from(self.spec.disks)) as u32;
            if self.rng.random_bool(self.spec.discard_ratio) {
                self.streams[si].remaining = 0;
                return self.data(disk, Op::Discard, start, end - start);
            }
            let op = if self.rng.random_bool(self.spec.read_ratio) {
                Op::Read
            } else {
                Op::Write
            };
            let block = if self.rng.random_bool(0.5) {
                start
            } else {
                start + self.rng.random_range(0..end - start)
            };
            // Geometric run length, mean 8.
            let remaining = 1 + (-(1.0 - self.rng.random::<f64>()).ln() * 7.0) as u32;
            s = Stream {
                disk,
                block,
                end,
                remaining,
                op: Some(op),
            };
        }
        let n = pick_size(&mut self.rng, &FS_SIZES).min(s.end - s.block);
        let rec = self.data(s.disk, s.op.unwrap_or(Op::Read), s.block, n);
        s.block += n;
        s.remaining -= 1;
        self.streams[si] = s;
        rec
    }

    fn advance_time(&mut self) -> u64 {
        let now = self.time_ns;
        let mean = self.spec.mean_interarrival_ns as f64;
        let dt = -(1.0 - self.rng.random::<f64>()).ln() * mean;
        let dt_us = (dt / 1000.0).round() as u64;
        self.time_ns = self.time_ns.saturating_add(dt_us.saturating_mul(1000));
        now
    }
}

impl Iterator for Generator {
    type Item = TraceRecord;

    fn next(&mut self) -> Option<TraceRecord> {
        if self.emitted >= self.spec.requests {
            return None;
        }
        let mut rec = match self.pending.pop_front() {
            Some(r) => r,
            None => match self.spec.class {
                WorkloadClass::BootStorm => self.boot_step(),
                WorkloadClass::Oltp => self.oltp_step(),
                WorkloadClass::FileServer => self.fs_step(),
                WorkloadClass::CloneStorm => self.clone_step(),
            },
        };
        rec.time_ns = self.advance_time();
        self.emitted += 1;
        Some(rec)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.spec.requests - self.emitted).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}

/// What [`write_workload`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GenSummary {
    /// Records generated.
    pub generated: u64,
    /// Records written.
    pub written: u64,
    /// Records the format could not carry (e.g. flushes in MSR), skipped.
    pub skipped: u64,
}

/// Generate `spec` and write it to `out` in `format`. Content digests are
/// generated only for FIU (the one format that carries them), and fio files
/// are declared for all `spec.disks`. Wrap `out` in a `BufWriter`.
pub fn write_workload<W: Write>(
    spec: &WorkloadSpec,
    format: Format,
    opts: &WriterOptions,
    out: W,
) -> Result<GenSummary, GenError> {
    let mut spec = spec.clone();
    if format != Format::Fiu {
        spec.content = false;
    }
    let opts = WriterOptions {
        fio_disks: spec.disks,
        ..opts.clone()
    };
    let mut writer = new_writer(format, out, &opts);
    let mut sum = GenSummary::default();
    for rec in generate(&spec)? {
        sum.generated += 1;
        if writer.write_record(&rec)? {
            sum.written += 1;
        } else {
            sum.skipped += 1;
        }
    }
    writer.finish()?;
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(class: WorkloadClass) -> WorkloadSpec {
        WorkloadSpec {
            requests: 20_000,
            working_set_bytes: 64 << 20,
            ..WorkloadSpec::new(class)
        }
    }

    #[test]
    fn rng_is_fixed() {
        // Pin the stream: a change here changes every generated trace.
        let mut r = Rng::seed_from_u64(42);
        let v: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(
            v,
            vec![
                0xd076_4d4f_4476_689f,
                0x519e_4174_576f_3791,
                0xfbe0_7cfb_0c24_ed8c
            ]
        );
        let mut r3 = Rng::seed_from_u64(7);
        for _ in 0..1000 {
            let x: f64 = r3.random();
            assert!((0.0..1.0).contains(&x));
            assert!(r3.random_range(0..10u64) < 10);
        }
    }

    #[test]
    fn zipf_stream_is_fixed() {
        // Pin the sampler: a change here changes every generated trace.
        let z = Zipf::new(1000, 0.99).expect("valid");
        let mut r = Rng::seed_from_u64(42);
        let v: Vec<u64> = (0..8).map(|_| z.sample(&mut r)).collect();
        assert_eq!(v, vec![241, 884, 205, 1, 33, 85, 9, 2]);
    }

    #[test]
    fn zipf_is_skewed_and_in_range() {
        let mut rng = Rng::seed_from_u64(3);
        for &theta in &[0.0, 0.5, 0.99, 1.0, 1.2] {
            let z = Zipf::new(1000, theta).expect("valid");
            let mut counts = vec![0u32; 1000];
            for _ in 0..100_000 {
                let k = z.sample(&mut rng);
                assert!(k < 1000);
                counts[k as usize] += 1;
            }
            if theta >= 0.99 {
                // P(0)/P(9) = 10^theta: rank 0 is far more popular than rank 9.
                assert!(
                    counts[0] > 5 * counts[9],
                    "theta {theta}: {} vs {}",
                    counts[0],
                    counts[9]
                );
                // Theory for theta = 1, n = 1000: P(0) = 1 / H(1000) = 0.1336.
                if theta == 1.0 {
                    let p0 = f64::from(counts[0]) / 100_000.0;
                    assert!((p0 - 0.1336).abs() < 0.01, "p0 {p0}");
                }
            }
            if theta == 0.0 {
                assert!(counts.iter().all(|&c| c > 40 && c < 180));
            }
        }
        assert!(Zipf::new(0, 1.0).is_err());
        assert!(Zipf::new(10, -1.0).is_err());
        assert!(Zipf::new(10, f64::NAN).is_err());
        assert!(Zipf::new(10, 21.0).is_err());
        let steep = Zipf::new(1 << 30, MAX_THETA).expect("valid");
        assert!((0..1000).all(|_| steep.sample(&mut rng) < 3));
        let one = Zipf::new(1, 2.0).expect("valid");
        assert_eq!(one.sample(&mut rng), 0);
    }

    #[test]
    fn scatter_is_a_permutation() {
        for n in [1u64, 2, 7, 64, 1000] {
            let s = Scatter::new(n);
            let mut seen: Vec<u64> = (0..n).map(|k| s.map(k)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn deterministic_and_well_formed() {
        for class in [
            WorkloadClass::BootStorm,
            WorkloadClass::Oltp,
            WorkloadClass::FileServer,
            WorkloadClass::CloneStorm,
        ] {
            let spec = small(class);
            let a: Vec<TraceRecord> = generate(&spec).expect("valid").collect();
            let b: Vec<TraceRecord> = generate(&spec).expect("valid").collect();
            assert_eq!(a.len(), 20_000);
            assert_eq!(a, b, "{class}: same seed, same trace");
            let other: Vec<TraceRecord> = generate(&WorkloadSpec {
                seed: 2,
                ..spec.clone()
            })
            .expect("valid")
            .collect();
            assert_ne!(a, other);
            let mut last = 0;
            for r in &a {
                assert!(r.time_ns >= last && r.time_ns % 1000 == 0);
                last = r.time_ns;
                assert!(r.disk < spec.disks);
                assert_eq!(r.offset % BLOCK, 0);
                assert_eq!(r.len % BLOCK, 0);
                assert!(r.end() <= spec.disk_bytes(), "{class}: {r:?}");
                match r.op {
                    Op::Read | Op::Write => {
                        assert!(r.len > 0);
                        assert_eq!(
                            r.content.as_ref().map(Vec::len),
                            Some((r.len / BLOCK) as usize)
                        );
                    }
                    Op::Flush => assert_eq!((r.offset, r.len), (0, 0)),
                    Op::Discard => assert!(r.len > 0),
                }
            }
        }
    }

    #[test]
    fn reads_see_the_last_write() {
        let oltp = WorkloadSpec {
            requests: 50_000,
            working_set_bytes: 1 << 20,
            read_ratio: 0.5,
            ..small(WorkloadClass::Oltp)
        };
        // A clone storm's update region is not tracked block by block: its
        // content comes from each VM's place in the update sequence.
        let clones = WorkloadSpec {
            disks: 3,
            ..oltp.clone()
        };
        let clones = WorkloadSpec {
            class: WorkloadClass::CloneStorm,
            update_ratio: 0.7,
            ..clones
        };
        for spec in [oltp, clones] {
            assert!(read_after_write(&spec) > 1000, "{}", spec.class);
        }
    }

    /// Reads of blocks written before return what was written; how many
    /// read blocks were checked.
    fn read_after_write(spec: &WorkloadSpec) -> u64 {
        let mut model: std::collections::HashMap<(u32, u64), ContentHash> =
            std::collections::HashMap::new();
        let mut checked = 0;
        for r in generate(spec).expect("valid") {
            let Some(c) = &r.content else { continue };
            for (i, h) in c.iter().enumerate() {
                let key = (r.disk, r.offset / BLOCK + i as u64);
                match r.op {
                    Op::Write => {
                        model.insert(key, *h);
                    }
                    Op::Read => {
                        if let Some(w) = model.get(&key) {
                            assert_eq!(w, h, "read after write returns the written content");
                            checked += 1;
                        }
                    }
                    _ => {}
                }
            }
        }
        checked
    }

    fn clone_spec() -> WorkloadSpec {
        WorkloadSpec {
            requests: 40_000,
            working_set_bytes: 16 << 20,
            disks: 6,
            read_ratio: 0.5,
            ..WorkloadSpec::new(WorkloadClass::CloneStorm)
        }
    }

    /// Every written 4 KiB block of a trace: (disk, block, digest).
    fn written_blocks(spec: &WorkloadSpec) -> Vec<(u32, u64, ContentHash)> {
        let mut out = Vec::new();
        for r in generate(spec).expect("valid") {
            if r.op != Op::Write {
                continue;
            }
            for (i, h) in r.content.iter().flatten().enumerate() {
                out.push((r.disk, r.offset / BLOCK + i as u64, *h));
            }
        }
        out
    }

    #[test]
    fn clone_storm_writes_the_same_updates_at_different_offsets() {
        use std::collections::{HashMap, HashSet};
        let spec = clone_spec();
        let base = spec.working_set_bytes / BLOCK;
        let quarter = base / 4;
        let blocks = written_blocks(&spec);
        let mut places: HashMap<ContentHash, HashSet<(u32, u64)>> = HashMap::new();
        for &(disk, block, h) in &blocks {
            places.entry(h).or_default().insert((disk, block));
        }
        let (mut shared, mut same_offset) = (0u64, 0u64);
        for &(disk, block, h) in &blocks {
            let others = &places[&h];
            if others.iter().any(|&(d, b)| d != disk && b != block) {
                shared += 1;
            }
            if others.iter().any(|&(d, b)| d != disk && b == block) {
                same_offset += 1;
            }
            // Updates go to the update region, private data after it; the
            // base is never written.
            assert!(block >= base && block < base + 2 * quarter, "{block}");
        }
        let fraction = shared as f64 / blocks.len() as f64;
        // Half the writes are updates; runs are cut where the region wraps,
        // and the VMs furthest ahead wrote updates the others have not yet.
        assert!(
            (0.4..=0.65).contains(&fraction),
            "{shared} of {} written blocks shared with another VM",
            blocks.len()
        );
        assert_eq!(
            same_offset, 0,
            "each VM places the updates at its own offsets"
        );
        // Every VM applied updates, and most update blocks reached all VMs.
        let update_digests: Vec<&HashSet<(u32, u64)>> =
            places.values().filter(|p| p.len() > 1).collect();
        let everywhere = update_digests
            .iter()
            .filter(|p| p.iter().map(|&(d, _)| d).collect::<HashSet<_>>().len() == 6)
            .count();
        assert!(
            everywhere * 2 > update_digests.len(),
            "{everywhere} of {} update blocks written by every VM",
            update_digests.len()
        );

        // No updates: nothing is shared.
        let private_only = written_blocks(&WorkloadSpec {
            update_ratio: 0.0,
            ..clone_spec()
        });
        let mut seen = HashSet::new();
        assert!(private_only.iter().all(|&(_, _, h)| seen.insert(h)));
    }

    #[test]
    fn clone_storm_private_data_is_unique() {
        use std::collections::HashMap;
        let spec = clone_spec();
        let private_start = spec.working_set_bytes / BLOCK * 5 / 4;
        let mut count: HashMap<ContentHash, u32> = HashMap::new();
        let mut private: HashMap<ContentHash, u32> = HashMap::new();
        for (disk, block, h) in written_blocks(&spec) {
            *count.entry(h).or_default() += 1;
            if block >= private_start {
                private.insert(h, disk);
            }
        }
        assert!(private.len() > 10_000, "{} private blocks", private.len());
        // A private block version is written once, by one VM, and no update
        // or other VM's data has its content.
        for h in private.keys() {
            assert_eq!(count[h], 1, "private digest written more than once");
        }
        // Reads see a VM's private data only on that VM, and what its
        // private region held before it wrote there is its own too.
        let mut before: HashMap<ContentHash, u32> = HashMap::new();
        let mut checked = 0;
        for r in generate(&spec).expect("valid") {
            if r.op != Op::Read || r.offset / BLOCK < private_start {
                continue;
            }
            for h in r.content.iter().flatten() {
                let owner = private
                    .get(h)
                    .copied()
                    .unwrap_or_else(|| *before.entry(*h).or_insert(r.disk));
                assert_eq!(owner, r.disk, "another VM's private block");
                checked += 1;
            }
        }
        assert!(checked > 1000, "{checked}");
    }

    #[test]
    fn clone_storm_base_reads_match_across_vms() {
        use std::collections::{HashMap, HashSet};
        let spec = clone_spec();
        let base = spec.working_set_bytes / BLOCK;
        let mut at: HashMap<u64, (ContentHash, HashSet<u32>)> = HashMap::new();
        let (mut reads, mut base_reads) = (0u64, 0u64);
        for r in generate(&spec).expect("valid") {
            if r.op != Op::Read {
                continue;
            }
            reads += 1;
            if r.offset / BLOCK >= base {
                continue;
            }
            base_reads += 1;
            for (i, h) in r.content.iter().flatten().enumerate() {
                let e = at
                    .entry(r.offset / BLOCK + i as u64)
                    .or_insert_with(|| (*h, HashSet::new()));
                assert_eq!(&e.0, h, "base block {} differs between VMs", r.offset);
                e.1.insert(r.disk);
            }
        }
        let share = base_reads as f64 / reads as f64;
        assert!((0.65..0.75).contains(&share), "base reads {share}");
        // Popular base blocks are read by several VMs...
        let by_many = at.values().filter(|(_, d)| d.len() >= 3).count();
        assert!(by_many * 4 > at.len(), "{by_many} of {}", at.len());
        // ...and distinct offsets hold distinct content (no pool).
        let distinct: HashSet<ContentHash> = at.values().map(|(h, _)| *h).collect();
        assert_eq!(distinct.len(), at.len());
    }

    #[test]
    fn ratios_shape_the_trace() {
        let spec = WorkloadSpec {
            requests: 40_000,
            read_ratio: 0.9,
            ..small(WorkloadClass::Oltp)
        };
        let recs: Vec<TraceRecord> = generate(&spec).expect("valid").collect();
        let reads = recs.iter().filter(|r| r.op == Op::Read).count() as f64;
        let data = recs
            .iter()
            .filter(|r| matches!(r.op, Op::Read | Op::Write))
            .count() as f64;
        let ratio = reads / data;
        assert!(ratio > 0.85 && ratio < 0.93, "read ratio {ratio}");
        assert!(recs.iter().any(|r| r.op == Op::Flush));

        // Boot storm: reads of the base are shared across VMs; duplicate content high.
        let boot = WorkloadSpec {
            disks: 8,
            ..small(WorkloadClass::BootStorm)
        };
        let recs: Vec<TraceRecord> = generate(&boot).expect("valid").collect();
        let mut seen = std::collections::HashSet::new();
        let (mut total, mut dup) = (0u64, 0u64);
        for r in recs.iter().filter(|r| r.op == Op::Read) {
            for h in r.content.iter().flatten() {
                total += 1;
                if !seen.insert(*h) {
                    dup += 1;
                }
            }
        }
        assert!(
            dup as f64 / total as f64 > 0.5,
            "duplicate read content {dup}/{total}"
        );

        // File server discards at the requested rate.
        let fs = WorkloadSpec {
            discard_ratio: 0.2,
            ..small(WorkloadClass::FileServer)
        };
        let n = generate(&fs)
            .expect("valid")
            .filter(|r| r.op == Op::Discard)
            .count();
        assert!(n > 100, "discards {n}");
    }

    #[test]
    fn invalid_specs_are_rejected() {
        let ok = small(WorkloadClass::Oltp);
        for bad in [
            WorkloadSpec {
                read_ratio: 1.5,
                ..ok.clone()
            },
            WorkloadSpec {
                dup_ratio: -0.1,
                ..ok.clone()
            },
            WorkloadSpec {
                zipf_theta: f64::INFINITY,
                ..ok.clone()
            },
            WorkloadSpec {
                disks: 0,
                ..ok.clone()
            },
            WorkloadSpec {
                working_set_bytes: 4096,
                ..ok.clone()
            },
            WorkloadSpec {
                working_set_bytes: 1 << 50,
                ..ok.clone()
            },
            WorkloadSpec {
                update_ratio: 1.01,
                ..small(WorkloadClass::CloneStorm)
            },
        ] {
            assert!(generate(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            "boot_storm".parse::<WorkloadClass>(),
            Ok(WorkloadClass::BootStorm)
        );
        assert_eq!(
            "clone-storm".parse::<WorkloadClass>(),
            Ok(WorkloadClass::CloneStorm)
        );
        assert_eq!(WorkloadClass::CloneStorm.to_string(), "clone-storm");
        let e = "tpcc".parse::<WorkloadClass>().expect_err("no such class");
        assert!(e.contains("tpcc") && e.contains("clone-storm"), "{e}");
    }
}
