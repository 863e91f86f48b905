//! A page-mapped flash translation layer model, to count erases and write
//! amplification (SVD section IV.C, Fig. 8).
//!
//! This module owns the model: a logical device of `logical_bytes` in pages,
//! a physical flash of erase blocks with `over_provisioning` spare capacity,
//! one write frontier, greedy garbage collection (the full block with the
//! fewest valid pages is the victim; its valid pages are copied to the
//! frontier, then it is erased), and TRIM (a discard invalidates the pages
//! it covers completely). It counts host pages written, pages copied by GC,
//! erases, and per-block erase counts.
//!
//! It must not model timing, wear-out or read disturb, and must stay fast:
//! flat `Vec`s indexed by page and block, per-block valid counts, and
//! victim selection in O(1) amortized from buckets of full blocks keyed by
//! valid count (intrusive doubly linked lists). No input panics it: bad
//! geometry and out-of-range requests are [`FtlError`]s.
//!
//! Policy details that decide exact counts:
//! - Free blocks are used in FIFO order (block 0 first); the frontier starts
//!   on block 0.
//! - A host page write first unmaps the page's old copy, then, whenever
//!   fewer than 2 free blocks remain, runs garbage collection until 2 are
//!   free again, then programs the page at the frontier.
//! - Among full blocks with equally few valid pages, the one that reached
//!   that count last is the victim.
//! - A write covering part of a page programs the whole page (read-modify-
//!   write on the device); a discard only invalidates pages it covers whole.

use std::collections::VecDeque;

use crate::trace::{Op, TraceRecord};

const NONE: u32 = u32::MAX;
/// GC keeps at least this many free blocks.
const MIN_FREE: usize = 2;

/// Geometry of the modelled device.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct FtlConfig {
    /// Capacity the host sees.
    pub logical_bytes: u64,
    /// Flash page (program unit), e.g. 4096.
    pub page_bytes: u32,
    /// Erase block, a multiple of the page, e.g. 256 pages = 1 MiB.
    pub erase_block_bytes: u64,
    /// Spare capacity as a fraction of the logical capacity (0.07 = 7%).
    /// Physical blocks = ceil(logical pages x (1 + op) / pages per block).
    pub over_provisioning: f64,
}

impl FtlConfig {
    pub fn new(
        logical_bytes: u64,
        page_bytes: u32,
        erase_block_bytes: u64,
        over_provisioning: f64,
    ) -> Self {
        FtlConfig {
            logical_bytes,
            page_bytes,
            erase_block_bytes,
            over_provisioning,
        }
    }
}

/// Why a configuration or request was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum FtlError {
    #[error("invalid FTL geometry: {0}")]
    Geometry(String),
    #[error("request {offset}+{len} is beyond the logical capacity {capacity}")]
    OutOfRange {
        offset: u64,
        len: u64,
        capacity: u64,
    },
}

/// Counters; `flash_pages_written = host_pages_written + gc_pages_copied`.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct FtlStats {
    /// Pages the host wrote (a partial page counts as one).
    pub host_pages_written: u64,
    /// Valid pages relocated by garbage collection.
    pub gc_pages_copied: u64,
    /// Pages programmed on flash.
    pub flash_pages_written: u64,
    /// Block erases.
    pub erases: u64,
    /// Mapped pages invalidated by discards.
    pub pages_discarded: u64,
    /// Highest erase count of any block.
    pub max_block_erases: u32,
    /// flash / host pages; `None` before any host write.
    pub write_amplification: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockState {
    Free,
    Open,
    Full,
}

/// The model. Feed it with [`Ftl::write`], [`Ftl::discard`] or
/// [`Ftl::apply`].
#[derive(Clone, Debug)]
pub struct Ftl {
    cfg: FtlConfig,
    pages_per_block: u32,
    logical_pages: u64,
    /// logical page -> physical page
    l2p: Vec<u32>,
    /// physical page -> logical page
    p2l: Vec<u32>,
    valid: Vec<u32>,
    state: Vec<BlockState>,
    erase_count: Vec<u32>,
    /// Buckets of full blocks by valid count: heads, and per-block links.
    bucket_head: Vec<u32>,
    next: Vec<u32>,
    prev: Vec<u32>,
    min_bucket: usize,
    free: VecDeque<u32>,
    open: u32,
    open_used: u32,
    stats: FtlStats,
}

impl Ftl {
    /// Build an empty (fully erased, nothing mapped) device.
    ///
    /// Refused: zero sizes, an erase block that is not a whole number of
    /// pages, more than 2^32 - 2 pages, and too little over-provisioning for
    /// greedy GC to make progress (physical blocks must be at least
    /// ceil(logical pages / pages per block) + 3).
    pub fn new(cfg: FtlConfig) -> Result<Self, FtlError> {
        let page = u64::from(cfg.page_bytes);
        if page == 0 || cfg.logical_bytes == 0 || cfg.erase_block_bytes == 0 {
            return Err(FtlError::Geometry("sizes must be non-zero".into()));
        }
        if !cfg.erase_block_bytes.is_multiple_of(page) {
            return Err(FtlError::Geometry(format!(
                "erase block {} is not a multiple of the page {}",
                cfg.erase_block_bytes, page
            )));
        }
        if !cfg.over_provisioning.is_finite() || cfg.over_provisioning < 0.0 {
            return Err(FtlError::Geometry(format!(
                "over-provisioning {} is not >= 0",
                cfg.over_provisioning
            )));
        }
        let ppb = cfg.erase_block_bytes / page;
        let logical_pages = cfg.logical_bytes.div_ceil(page);
        let physical_pages = (logical_pages as f64 * (1.0 + cfg.over_provisioning)).ceil();
        let blocks_f = (physical_pages / ppb as f64).ceil();
        let min_blocks = logical_pages.div_ceil(ppb) + 3;
        if blocks_f < min_blocks as f64 {
            return Err(FtlError::Geometry(format!(
                "over-provisioning {} gives {} erase blocks; greedy GC needs at least {} (3 spare blocks)",
                cfg.over_provisioning, blocks_f, min_blocks
            )));
        }
        if ppb > u64::from(u32::MAX) || blocks_f * ppb as f64 >= f64::from(NONE) {
            return Err(FtlError::Geometry("more than 2^32 - 2 flash pages".into()));
        }
        let blocks = blocks_f as u64;
        let ppb32 = ppb as u32;
        let nblocks = blocks as usize;
        let mut free: VecDeque<u32> = (0..blocks as u32).collect();
        let open = free.pop_front().unwrap_or(0);
        let mut state = vec![BlockState::Free; nblocks];
        state[open as usize] = BlockState::Open;
        Ok(Ftl {
            cfg,
            pages_per_block: ppb32,
            logical_pages,
            l2p: vec![NONE; logical_pages as usize],
            p2l: vec![NONE; (blocks * ppb) as usize],
            valid: vec![0; nblocks],
            state,
            erase_count: vec![0; nblocks],
            bucket_head: vec![NONE; ppb as usize + 1],
            next: vec![NONE; nblocks],
            prev: vec![NONE; nblocks],
            min_bucket: ppb as usize + 1,
            free,
            open,
            open_used: 0,
            stats: FtlStats::default(),
        })
    }

    pub fn config(&self) -> &FtlConfig {
        &self.cfg
    }

    /// Number of erase blocks of the physical flash.
    pub fn physical_blocks(&self) -> u64 {
        self.valid.len() as u64
    }

    pub fn pages_per_block(&self) -> u32 {
        self.pages_per_block
    }

    /// Current counters.
    pub fn stats(&self) -> FtlStats {
        let mut s = self.stats;
        s.flash_pages_written = s.host_pages_written + s.gc_pages_copied;
        s.max_block_erases = self.erase_count.iter().copied().max().unwrap_or(0);
        s.write_amplification = (s.host_pages_written > 0)
            .then(|| s.flash_pages_written as f64 / s.host_pages_written as f64);
        s
    }

    /// Erase count of each block.
    pub fn erase_counts(&self) -> &[u32] {
        &self.erase_count
    }

    /// Mapped (valid) logical pages.
    pub fn mapped_pages(&self) -> u64 {
        self.valid.iter().map(|&v| u64::from(v)).sum()
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), FtlError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.cfg.logical_bytes => Ok(()),
            _ => Err(FtlError::OutOfRange {
                offset,
                len,
                capacity: self.cfg.logical_bytes,
            }),
        }
    }

    /// Host write of `len` bytes at byte `offset`; every page it touches is
    /// programmed.
    pub fn write(&mut self, offset: u64, len: u64) -> Result<(), FtlError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let page = u64::from(self.cfg.page_bytes);
        let first = offset / page;
        let last = (offset + len).div_ceil(page).min(self.logical_pages);
        for lp in first..last {
            self.write_page(lp as u32);
        }
        Ok(())
    }

    /// Discard (TRIM) of `len` bytes at `offset`: pages covered completely
    /// are unmapped.
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), FtlError> {
        self.check(offset, len)?;
        let page = u64::from(self.cfg.page_bytes);
        let first = offset.div_ceil(page);
        let end = (offset + len) / page;
        for lp in first..end {
            if self.invalidate(lp as u32) {
                self.stats.pages_discarded += 1;
            }
        }
        Ok(())
    }

    /// Feed a trace record: writes and discards count, reads and flushes are
    /// ignored.
    pub fn apply(&mut self, rec: &TraceRecord) -> Result<(), FtlError> {
        match rec.op {
            Op::Write => self.write(rec.offset, rec.len),
            Op::Discard => self.discard(rec.offset, rec.len),
            Op::Read | Op::Flush => Ok(()),
        }
    }

    fn write_page(&mut self, lp: u32) {
        self.stats.host_pages_written += 1;
        self.invalidate(lp);
        while self.free.len() < MIN_FREE {
            if !self.collect() {
                break;
            }
        }
        self.program(lp);
    }

    /// Unmap a logical page; true if it was mapped.
    fn invalidate(&mut self, lp: u32) -> bool {
        let pp = self.l2p[lp as usize];
        if pp == NONE {
            return false;
        }
        self.l2p[lp as usize] = NONE;
        self.p2l[pp as usize] = NONE;
        let b = (pp / self.pages_per_block) as usize;
        if self.state[b] == BlockState::Full {
            self.unlink(b);
            self.valid[b] -= 1;
            self.link(b);
        } else {
            self.valid[b] -= 1;
        }
        true
    }

    /// Program `lp` at the frontier, opening a new block when it is full.
    fn program(&mut self, lp: u32) {
        if self.open_used == self.pages_per_block {
            let old = self.open as usize;
            self.state[old] = BlockState::Full;
            self.link(old);
            // GC keeps MIN_FREE >= 1 blocks free, so this always succeeds;
            // if it ever could not, writing in place keeps the model total.
            let Some(b) = self.free.pop_front() else {
                return;
            };
            self.open = b;
            self.open_used = 0;
            self.state[b as usize] = BlockState::Open;
        }
        let pp = self.open * self.pages_per_block + self.open_used;
        self.open_used += 1;
        self.p2l[pp as usize] = lp;
        self.l2p[lp as usize] = pp;
        self.valid[self.open as usize] += 1;
    }

    /// One greedy GC step; false if there is no full block to reclaim.
    fn collect(&mut self) -> bool {
        while self.min_bucket < self.bucket_head.len() && self.bucket_head[self.min_bucket] == NONE
        {
            self.min_bucket += 1;
        }
        if self.min_bucket >= self.bucket_head.len()
            || self.min_bucket == self.pages_per_block as usize
        {
            // No full block, or every full block is entirely valid: GC cannot
            // gain anything (impossible with the geometry `new` accepts).
            return false;
        }
        let victim = self.bucket_head[self.min_bucket] as usize;
        self.unlink(victim);
        self.state[victim] = BlockState::Free;
        let base = victim as u32 * self.pages_per_block;
        for i in 0..self.pages_per_block {
            let lp = self.p2l[(base + i) as usize];
            if lp != NONE {
                self.p2l[(base + i) as usize] = NONE;
                self.l2p[lp as usize] = NONE;
                self.valid[victim] -= 1;
                self.stats.gc_pages_copied += 1;
                self.program(lp);
            }
        }
        self.stats.erases += 1;
        self.erase_count[victim] += 1;
        self.free.push_back(victim as u32);
        true
    }

    fn link(&mut self, b: usize) {
        let v = self.valid[b] as usize;
        let head = self.bucket_head[v];
        self.next[b] = head;
        self.prev[b] = NONE;
        if head != NONE {
            self.prev[head as usize] = b as u32;
        }
        self.bucket_head[v] = b as u32;
        self.min_bucket = self.min_bucket.min(v);
    }

    fn unlink(&mut self, b: usize) {
        let v = self.valid[b] as usize;
        let (p, n) = (self.prev[b], self.next[b]);
        if p == NONE {
            self.bucket_head[v] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n != NONE {
            self.prev[n as usize] = p;
        }
        self.next[b] = NONE;
        self.prev[b] = NONE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Rng;
    use rand::{RngExt, SeedableRng};

    const P: u64 = 4096;

    fn ftl(logical_mib: u64, block_kib: u64, op: f64) -> Ftl {
        Ftl::new(FtlConfig::new(logical_mib << 20, 4096, block_kib << 10, op))
            .expect("valid geometry")
    }

    #[test]
    fn hand_computed_small_case() {
        // 8 logical pages, 4 pages per block, 5 blocks (OP 1.5), traced by
        // hand: 22 host pages, 1 GC copy, 3 erases.
        let mut f = Ftl::new(FtlConfig::new(8 * P, 4096, 4 * P, 1.5)).expect("valid");
        assert_eq!(f.physical_blocks(), 5);
        let seq = [
            0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 0, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5,
        ];
        let mut after = Vec::new();
        for &lp in &seq {
            f.write(lp * P, P).expect("in range");
            let s = f.stats();
            after.push((s.gc_pages_copied, s.erases));
        }
        let s = f.stats();
        assert_eq!(s.host_pages_written, 22);
        assert_eq!(s.gc_pages_copied, 1);
        assert_eq!(s.flash_pages_written, 23);
        assert_eq!(s.erases, 3);
        // First erase at write 14 (lp 4), second at write 18 (lp 1), the
        // copy and third erase at write 22 (lp 5).
        assert_eq!(after[12], (0, 0));
        assert_eq!(after[13], (0, 1));
        assert_eq!(after[16], (0, 1));
        assert_eq!(after[17], (0, 2));
        assert_eq!(after[20], (0, 2));
        assert_eq!(after[21], (1, 3));
        assert_eq!(f.mapped_pages(), 8);
    }

    #[test]
    fn sequential_passes_have_no_amplification() {
        let mut f = ftl(64, 1024, 0.07);
        for _ in 0..4 {
            for off in (0..64u64 << 20).step_by(128 << 10) {
                f.write(off, 128 << 10).expect("in range");
            }
        }
        let s = f.stats();
        assert_eq!(s.host_pages_written, 4 * 16384);
        let wa = s.write_amplification.expect("wrote");
        assert!(wa < 1.05, "sequential WA {wa}");
        assert!(s.erases > 0);
    }

    fn random_overwrites(f: &mut Ftl, span_pages: u64, writes: u64, seed: u64) {
        let mut rng = Rng::seed_from_u64(seed);
        for _ in 0..writes {
            f.write(rng.random_range(0..span_pages) * P, P)
                .expect("in range");
        }
    }

    #[test]
    fn random_overwrites_amplify_at_7_percent() {
        let mut f = ftl(64, 1024, 0.07);
        let pages = 16384;
        f.write(0, 64 << 20).expect("fill");
        let before = f.stats();
        random_overwrites(&mut f, pages, 4 * pages, 1);
        let s = f.stats();
        let wa = (s.flash_pages_written - before.flash_pages_written) as f64
            / (s.host_pages_written - before.host_pages_written) as f64;
        assert!(wa > 2.0, "random 4 KiB WA at 7% OP: {wa}");
        assert!(s.write_amplification.expect("wrote") > 2.0);
        assert_eq!(f.mapped_pages(), pages);
    }

    #[test]
    fn discards_reduce_amplification() {
        let pages = 16384;
        let run = |discard: bool| {
            let mut f = ftl(64, 1024, 0.07);
            f.write(0, 64 << 20).expect("fill");
            if discard {
                // The upper half is deleted and never rewritten: more spare room.
                f.discard(32 << 20, 32 << 20).expect("in range");
            }
            let before = f.stats();
            random_overwrites(&mut f, pages / 2, 2 * pages, 9);
            let s = f.stats();
            (s.flash_pages_written - before.flash_pages_written) as f64
                / (s.host_pages_written - before.host_pages_written) as f64
        };
        let (without, with) = (run(false), run(true));
        assert!(
            with < without * 0.8,
            "WA with discards {with}, without {without}"
        );
        let mut f = ftl(64, 1024, 0.07);
        f.write(0, 1 << 20).expect("fill");
        f.discard(1000, 8192).expect("in range");
        assert_eq!(
            f.stats().pages_discarded,
            1,
            "only whole pages are discarded"
        );
    }

    #[test]
    fn partial_pages_and_ranges() {
        let mut f = ftl(1, 64, 0.5);
        f.write(100, 10).expect("in range");
        f.write(4000, 200).expect("in range");
        assert_eq!(f.stats().host_pages_written, 3);
        assert!(matches!(
            f.write(1 << 20, 1),
            Err(FtlError::OutOfRange { .. })
        ));
        assert!(matches!(
            f.discard(u64::MAX, 2),
            Err(FtlError::OutOfRange { .. })
        ));
        let rec = TraceRecord::new(0, 0, Op::Read, 0, 4096);
        f.apply(&rec).expect("ignored");
        assert_eq!(f.stats().host_pages_written, 3);
    }

    #[test]
    fn bad_geometry_is_refused() {
        assert!(Ftl::new(FtlConfig::new(0, 4096, 1 << 20, 0.1)).is_err());
        assert!(Ftl::new(FtlConfig::new(1 << 20, 4096, 5000, 0.1)).is_err());
        assert!(Ftl::new(FtlConfig::new(64 << 20, 4096, 1 << 20, 0.0)).is_err());
        assert!(Ftl::new(FtlConfig::new(64 << 20, 4096, 1 << 20, f64::NAN)).is_err());
        assert!(Ftl::new(FtlConfig::new(1 << 50, 512, 1 << 20, 0.5)).is_err());
    }
}
