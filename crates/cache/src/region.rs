//! Regions of the data zone: each is free, open for appending (one open
//! region per stream: written data, promoted reads), or full. Blocks are
//! only ever appended; a region is reclaimed whole. The replacement policy
//! (LRU, CLOCK or ARC over regions) chooses which full region to reclaim.
//!
//! This module tracks states, live counts, recency and pins; the policy
//! (see `replacement`) only reads recency; emptying a region (writing
//! back, relocating, unmapping) is the cache's job.

use crate::index::Cbn;
use crate::replacement::{Recency, ReplacementPolicy};
use crate::shares::{Shares, Tenant, UNOWNED, Usage};
use std::collections::{HashMap, VecDeque};

/// Which open region a block is appended to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Data the guest (or the COW layer) wrote.
    Write = 0,
    /// Data promoted into the cache on a read miss.
    Promote = 1,
}

pub use crate::replacement::Replacement;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Free,
    Open(Stream),
    Full,
}

#[derive(Debug, Clone, Copy)]
struct Region {
    state: State,
    /// Blocks appended so far.
    next: u32,
    /// Blocks still referenced by the index.
    live: u32,
    last_access: u64,
    referenced: bool,
    /// Accesses since the region was filled (ARC's recency/frequency split).
    accesses: u32,
    pins: u32,
    /// Which filling of the region this is (tells its summaries apart).
    epoch: u32,
    /// Whose data fills it (see `shares`).
    owner: Tenant,
    /// What fills it: written data or promoted reads.
    kind: Stream,
}

/// Counts for statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionCounts {
    pub free: u32,
    pub open: u32,
    pub full: u32,
}

/// All regions and the replacement policy's state.
#[derive(Debug)]
pub struct Regions {
    blocks_per_region: u32,
    /// Blocks of a region that hold data (the rest hold its summary).
    data_per_region: u32,
    epochs: u32,
    regions: Vec<Region>,
    free: VecDeque<u32>,
    /// Open regions by stream and owner (one each).
    open: Vec<(Stream, Tenant, u32)>,
    tick: u64,
    kind: Replacement,
    policy: Box<dyn ReplacementPolicy>,
    /// SVD's read/write split: while promoted reads hold at most this
    /// share of the used regions, victims come from written data first.
    read_split: Option<f64>,
}

impl Regions {
    pub fn new(
        regions: u32,
        blocks_per_region: u32,
        summary_blocks: u32,
        policy: Replacement,
    ) -> Regions {
        Regions {
            blocks_per_region,
            data_per_region: blocks_per_region - summary_blocks,
            epochs: 0,
            regions: vec![
                Region {
                    state: State::Free,
                    next: 0,
                    live: 0,
                    last_access: 0,
                    referenced: false,
                    accesses: 0,
                    pins: 0,
                    epoch: 0,
                    owner: UNOWNED,
                    kind: Stream::Write,
                };
                regions as usize
            ],
            free: (0..regions).collect(),
            open: Vec::new(),
            tick: 0,
            kind: policy,
            policy: policy.build(regions, blocks_per_region),
            read_split: None,
        }
    }

    /// Keeps promoted reads' regions while they hold at most `share` of
    /// the used regions (SVD: 0.75); None: no split.
    pub fn set_read_split(&mut self, share: Option<f64>) {
        self.read_split = share;
    }

    /// The share of used regions that hold promoted reads.
    fn read_share(&self) -> f64 {
        let used = self.regions.iter().filter(|r| r.state != State::Free);
        let (reads, all) = used.fold((0u32, 0u32), |(r, a), reg| {
            (r + u32::from(reg.kind == Stream::Promote), a + 1)
        });
        if all == 0 {
            0.0
        } else {
            f64::from(reads) / f64::from(all)
        }
    }

    pub fn policy(&self) -> Replacement {
        self.kind
    }

    pub fn region_of(&self, cbn: Cbn) -> u32 {
        cbn / self.blocks_per_region
    }

    pub fn blocks_per_region(&self) -> u32 {
        self.blocks_per_region
    }

    /// Up to `want` contiguous blocks from the stream's open region, opening
    /// a free region when needed; `None` when no region is free.
    pub fn allocate(&mut self, stream: Stream, want: u32) -> Option<(Cbn, u32)> {
        self.allocate_for(stream, UNOWNED, want)
    }

    /// [`Regions::allocate`] in a region of `owner`'s (shares on: each disk
    /// appends to regions of its own).
    pub fn allocate_for(&mut self, stream: Stream, owner: Tenant, want: u32) -> Option<(Cbn, u32)> {
        let slot = self
            .open
            .iter()
            .position(|&(s, o, _)| s == stream && o == owner);
        if let Some(i) = slot {
            let r = self.open[i].2;
            let reg = &mut self.regions[r as usize];
            if reg.next < self.data_per_region {
                let n = want.min(self.data_per_region - reg.next);
                let start = r * self.blocks_per_region + reg.next;
                reg.next += n;
                reg.live += n;
                // Appending is an access: a region filled long after it
                // opened is not the least recently used.
                self.tick += 1;
                reg.last_access = self.tick;
                if reg.next == self.data_per_region {
                    reg.state = State::Full;
                    self.open.swap_remove(i);
                }
                return Some((start, n));
            }
            reg.state = State::Full;
            self.open.swap_remove(i);
        }
        let r = self.free.pop_front()?;
        self.seal_idle_open_region();
        self.tick += 1;
        self.epochs += 1;
        self.regions[r as usize] = Region {
            state: State::Open(stream),
            next: 0,
            live: 0,
            last_access: self.tick,
            referenced: false,
            accesses: 0,
            pins: 0,
            epoch: self.epochs,
            owner,
            kind: stream,
        };
        self.open.push((stream, owner, r));
        self.allocate_for(stream, owner, want)
    }

    /// With an open region per stream and owner, a disk that went idle
    /// would keep its open regions out of reclaim forever: past a few,
    /// the least recently appended one is sealed (full, its rest unused).
    fn seal_idle_open_region(&mut self) {
        let limit = (self.regions.len() / 8).max(2);
        if self.open.len() < limit {
            return;
        }
        let oldest =
            (0..self.open.len()).min_by_key(|&i| self.regions[self.open[i].2 as usize].last_access);
        if let Some(i) = oldest {
            let (_, _, r) = self.open.swap_remove(i);
            self.regions[r as usize].state = State::Full;
        }
    }

    /// Whose data region `region` holds.
    pub fn owner(&self, region: u32) -> Tenant {
        self.regions[region as usize].owner
    }

    /// Blocks each owner's regions hold (full and open), and whether it
    /// has one to reclaim now.
    pub fn usage(&self) -> HashMap<Tenant, Usage> {
        let mut out: HashMap<Tenant, Usage> = HashMap::new();
        for (i, r) in self.regions.iter().enumerate() {
            if r.state == State::Free {
                continue;
            }
            let u = out.entry(r.owner).or_default();
            u.blocks += u64::from(self.data_per_region);
            u.evictable |= self.evictable(i);
        }
        out
    }

    /// Records a hit on a block of `region`.
    pub fn touch(&mut self, region: u32) {
        self.tick += 1;
        let r = &mut self.regions[region as usize];
        r.last_access = self.tick;
        r.referenced = true;
        r.accesses = r.accesses.saturating_add(1);
    }

    /// A block of the region stopped being referenced.
    pub fn release_block(&mut self, cbn: Cbn) {
        let region = self.region_of(cbn) as usize;
        let r = &mut self.regions[region];
        r.live = r.live.saturating_sub(1);
    }

    /// Marks a block live again (recovery rebuilds live counts).
    pub fn restore_block(&mut self, cbn: Cbn) {
        let region = self.region_of(cbn);
        let dpr = self.data_per_region;
        let r = &mut self.regions[region as usize];
        if r.state == State::Free {
            self.free.retain(|&f| f != region);
            self.epochs += 1;
            r.state = State::Full;
            r.next = dpr;
            r.epoch = self.epochs;
        }
        r.live += 1;
    }

    pub fn pin(&mut self, region: u32) {
        self.regions[region as usize].pins += 1;
    }

    pub fn unpin(&mut self, region: u32) {
        let r = &mut self.regions[region as usize];
        r.pins = r.pins.saturating_sub(1);
    }

    pub fn free_regions(&self) -> usize {
        self.free.len()
    }

    /// Full regions whose blocks were all superseded or dropped.
    pub fn empty_full_regions(&self) -> usize {
        self.regions
            .iter()
            .filter(|r| r.state == State::Full && r.live == 0)
            .count()
    }

    /// Which filling of the region this is.
    pub fn epoch(&self, region: u32) -> u32 {
        self.regions[region as usize].epoch
    }

    /// Full, with every allocated block mapped (nothing in flight): its
    /// summary is final.
    pub fn is_settled_full(&self, region: u32) -> bool {
        let r = &self.regions[region as usize];
        r.state == State::Full && r.pins == 0
    }

    pub fn live_blocks(&self, region: u32) -> u32 {
        self.regions[region as usize].live
    }

    pub fn counts(&self) -> RegionCounts {
        let mut c = RegionCounts::default();
        for r in &self.regions {
            match r.state {
                State::Free => c.free += 1,
                State::Open(_) => c.open += 1,
                State::Full => c.full += 1,
            }
        }
        c
    }

    fn evictable(&self, i: usize) -> bool {
        let r = &self.regions[i];
        r.state == State::Full && r.pins == 0
    }

    /// Chooses the full region to reclaim next; `extra_refs`: per region,
    /// references to its blocks beyond each block's first (see
    /// [`crate::index::Index::extra_refs`]).
    pub fn choose_victim(&mut self, extra_refs: &[u32]) -> Option<u32> {
        self.choose_victim_among(extra_refs, None)
    }

    /// [`Regions::choose_victim`] among the regions of the owner `shares`
    /// says gives up space (all regions when shares are off or it has
    /// none the policy would take).
    pub fn choose_victim_among(
        &mut self,
        extra_refs: &[u32],
        shares: Option<&Shares>,
    ) -> Option<u32> {
        // A full region with nothing live costs nothing to reclaim.
        if let Some(i) =
            (0..self.regions.len()).find(|&i| self.evictable(i) && self.regions[i].live == 0)
        {
            return Some(i as u32);
        }
        let owner = shares.and_then(|s| s.victim(&self.usage()));
        let kind = self
            .read_split
            .filter(|&share| self.read_share() <= share)
            .map(|_| Stream::Write);
        // The narrowest choice that has a victim: the owner's written
        // data, the owner's regions, any written data, any region.
        let mut tried = Vec::with_capacity(4);
        for filter in [(owner, kind), (owner, None), (None, kind), (None, None)] {
            if tried.contains(&filter) {
                continue;
            }
            tried.push(filter);
            if let Some(v) = self.choose_victim_of(extra_refs, filter.0, filter.1) {
                return Some(v);
            }
        }
        None
    }

    /// The policy's choice among the regions of `owner` holding `kind`
    /// (None: any).
    fn choose_victim_of(
        &mut self,
        extra_refs: &[u32],
        owner: Option<Tenant>,
        kind: Option<Stream>,
    ) -> Option<u32> {
        let mut view: Vec<Recency> = (0..self.regions.len())
            .map(|i| {
                let r = &self.regions[i];
                Recency {
                    evictable: self.evictable(i)
                        && owner.is_none_or(|o| r.owner == o)
                        && kind.is_none_or(|k| r.kind == k),
                    last_access: r.last_access,
                    referenced: r.referenced,
                    accesses: r.accesses,
                    live: r.live,
                    extra_refs: extra_refs.get(i).copied().unwrap_or(0),
                }
            })
            .collect();
        let victim = self.policy.choose(&mut view);
        for (r, v) in self.regions.iter_mut().zip(&view) {
            r.referenced = v.referenced;
        }
        victim
    }

    /// Up to `n` full regions holding live blocks, least recently used
    /// first: the ones reclaimed next (exactly under LRU, roughly under
    /// the other policies), whose dirty blocks write-back copies first so
    /// that reclaiming them costs no backend write.
    pub fn next_victims(&self, n: usize) -> Vec<u32> {
        if n == 0 {
            return Vec::new();
        }
        let mut full: Vec<u32> = (0..self.regions.len())
            .filter(|&i| self.regions[i].state == State::Full && self.regions[i].live > 0)
            .map(|i| i as u32)
            .collect();
        let key = |&i: &u32| self.regions[i as usize].last_access;
        if full.len() > n {
            full.select_nth_unstable_by_key(n - 1, key);
            full.truncate(n);
        }
        full.sort_unstable_by_key(key);
        full.truncate(n);
        full
    }

    /// Whether a region's blocks count as hot (accessed since they were
    /// written), so eviction may re-insert them.
    pub fn is_hot(&self, region: u32) -> bool {
        let r = &self.regions[region as usize];
        r.referenced && r.accesses >= 2
    }

    /// Remembers the lines a reclaimed region held (ARC ghosts).
    pub fn remember_evicted(&mut self, region: u32, mut keys: impl Iterator<Item = u64>) {
        let frequent = self.regions[region as usize].accesses >= 2;
        self.policy.evicted(frequent, &mut keys);
    }

    /// A read missed line `key`: if ARC evicted it recently, move the
    /// recency/frequency split toward the side that would have kept it.
    pub fn note_miss(&mut self, key: u64) {
        self.policy.missed(key, self.regions.len());
    }

    /// Returns a reclaimed region to the free list.
    pub fn reset(&mut self, region: u32) {
        let r = &mut self.regions[region as usize];
        r.state = State::Free;
        r.next = 0;
        r.live = 0;
        r.accesses = 0;
        r.referenced = false;
        r.owner = UNOWNED;
        self.free.push_back(region);
    }

    /// After recovery: regions holding live blocks are full; the rest free.
    pub fn finish_recovery(&mut self) {
        self.open.clear();
        self.free.clear();
        for (i, r) in self.regions.iter_mut().enumerate() {
            if r.live == 0 {
                r.state = State::Free;
                r.next = 0;
                self.free.push_back(i as u32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_then_opens_new_regions_and_runs_out() {
        let mut r = Regions::new(3, 4, 0, Replacement::Lru);
        assert_eq!(r.allocate(Stream::Write, 3), Some((0, 3)));
        assert_eq!(r.allocate(Stream::Write, 3), Some((3, 1)));
        assert_eq!(r.allocate(Stream::Promote, 2), Some((4, 2)));
        assert_eq!(r.allocate(Stream::Write, 1), Some((8, 1)));
        assert_eq!(
            r.counts(),
            RegionCounts {
                free: 0,
                open: 2,
                full: 1
            }
        );
        assert_eq!(r.allocate(Stream::Write, 4), Some((9, 3)));
        assert_eq!(r.allocate(Stream::Write, 1), None);
    }

    #[test]
    fn a_read_split_reclaims_written_data_first_up_to_its_share() {
        let mut r = Regions::new(4, 2, 0, Replacement::Lru);
        r.set_read_split(Some(0.75));
        // Oldest first: two read regions, then two written ones.
        for kind in [
            Stream::Promote,
            Stream::Promote,
            Stream::Write,
            Stream::Write,
        ] {
            assert!(r.allocate(kind, 2).is_some());
        }
        // Reads hold half the regions: the written region goes, though
        // the read regions are older.
        assert_eq!(r.choose_victim(&[]), Some(2));
        // Without the split, LRU takes the oldest.
        r.set_read_split(None);
        assert_eq!(r.choose_victim(&[]), Some(0));
        // Reads above their share: they are taken too.
        let mut r = Regions::new(4, 2, 0, Replacement::Lru);
        r.set_read_split(Some(0.5));
        for kind in [
            Stream::Promote,
            Stream::Promote,
            Stream::Promote,
            Stream::Write,
        ] {
            assert!(r.allocate(kind, 2).is_some());
        }
        assert_eq!(r.choose_victim(&[]), Some(0));
    }

    #[test]
    fn lru_and_clock_pick_the_cold_region() {
        for policy in [Replacement::Lru, Replacement::Clock, Replacement::Arc] {
            let mut r = Regions::new(3, 2, 0, policy);
            for _ in 0..3 {
                r.allocate(Stream::Write, 2);
            }
            r.touch(0);
            r.touch(2);
            assert_eq!(r.choose_victim(&[]), Some(1), "{policy:?}");
            r.pin(1);
            assert_ne!(r.choose_victim(&[]), Some(1));
        }
    }
}
