//! Replacement policies: which full region to reclaim when space runs
//! short (LRU, CLOCK or ARC over regions), each behind
//! [`ReplacementPolicy`] and chosen by name ([`Replacement`]).
//!
//! A policy owns only its own memory (CLOCK's hand, ARC's target and ghost
//! lists) and reads the regions' recency counters; it never changes a
//! region's state, live count or pins (that is `region`'s), and never
//! empties a region (the cache's job).

use std::collections::VecDeque;
use std::str::FromStr;

/// How the victim region is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replacement {
    /// Least recently accessed region.
    Lru,
    /// Second chance: a region accessed since the hand last passed is spared once.
    Clock,
    /// Adaptive replacement: regions hit once (recency) versus more often
    /// (frequency), the split tuned by misses on recently evicted lines.
    Arc,
    /// Dedup-aware LRU: among the least recently accessed regions, the one
    /// serving the fewest addresses (a block shared by many addresses is
    /// worth as many blocks: DASH's reference-count weighting, after
    /// CacheDedup's D-LRU).
    DedupLru,
    /// ARC choosing its side as ARC does, then weighing sharing as
    /// `DedupLru` among that side's oldest regions (after D-ARC).
    DedupArc,
}

impl FromStr for Replacement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Replacement::Lru),
            "clock" => Ok(Replacement::Clock),
            "arc" => Ok(Replacement::Arc),
            "d-lru" => Ok(Replacement::DedupLru),
            "d-arc" => Ok(Replacement::DedupArc),
            _ => Err(format!(
                "unknown replacement policy '{s}' (lru, clock, arc, d-lru, d-arc)"
            )),
        }
    }
}

impl Replacement {
    pub fn name(self) -> &'static str {
        match self {
            Replacement::Lru => "lru",
            Replacement::Clock => "clock",
            Replacement::Arc => "arc",
            Replacement::DedupLru => "d-lru",
            Replacement::DedupArc => "d-arc",
        }
    }

    /// The policy this name stands for, over `regions` regions of
    /// `blocks_per_region` blocks.
    pub(crate) fn build(self, regions: u32, blocks_per_region: u32) -> Box<dyn ReplacementPolicy> {
        match self {
            Replacement::Lru => Box::new(Lru),
            Replacement::Clock => Box::new(Clock { hand: 0 }),
            Replacement::Arc => Box::new(Arc::new(regions, blocks_per_region, false)),
            Replacement::DedupLru => Box::new(DedupLru),
            Replacement::DedupArc => Box::new(Arc::new(regions, blocks_per_region, true)),
        }
    }
}

/// What a policy sees of one region.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Recency {
    /// Full and unpinned: may be reclaimed.
    pub evictable: bool,
    pub last_access: u64,
    /// Accessed since CLOCK's hand last passed.
    pub referenced: bool,
    /// Accesses since the region was filled.
    pub accesses: u32,
    /// Live blocks, and references to them beyond each one's first: the
    /// region serves `live + extra_refs` addresses.
    pub live: u32,
    pub extra_refs: u32,
}

/// How many of the oldest regions a dedup-aware policy weighs.
const WEIGHED: usize = 8;

/// Among the `WEIGHED` least recently accessed evictable regions passing
/// `filter`, the one serving the fewest addresses (the oldest on a tie).
fn fewest_addresses(regions: &[Recency], filter: impl Fn(&Recency) -> bool) -> Option<u32> {
    let mut oldest: Vec<usize> = (0..regions.len())
        .filter(|&i| regions[i].evictable && filter(&regions[i]))
        .collect();
    let key = |&i: &usize| regions[i].last_access;
    if oldest.len() > WEIGHED {
        oldest.select_nth_unstable_by_key(WEIGHED - 1, key);
        oldest.truncate(WEIGHED);
    }
    oldest
        .into_iter()
        .min_by_key(|&i| {
            let r = &regions[i];
            (u64::from(r.live) + u64::from(r.extra_refs), r.last_access)
        })
        .map(|i| i as u32)
}

#[derive(Debug)]
struct DedupLru;

impl ReplacementPolicy for DedupLru {
    fn choose(&mut self, regions: &mut [Recency]) -> Option<u32> {
        fewest_addresses(regions, |_| true)
    }
}

/// Chooses victims among regions.
pub(crate) trait ReplacementPolicy: std::fmt::Debug + Send {
    /// The region to reclaim among `regions` (none evictable: none). May
    /// clear `referenced` flags (second chances used up).
    fn choose(&mut self, regions: &mut [Recency]) -> Option<u32>;

    /// Lines a reclaimed region held; `frequent`: it was accessed more than
    /// once since filled.
    fn evicted(&mut self, _frequent: bool, _keys: &mut dyn Iterator<Item = u64>) {}

    /// A read missed line `key` of a cache of `regions` regions.
    fn missed(&mut self, _key: u64, _regions: usize) {}
}

/// The least recently accessed evictable region passing `filter`.
fn oldest(regions: &[Recency], filter: impl Fn(&Recency) -> bool) -> Option<u32> {
    (0..regions.len())
        .filter(|&i| regions[i].evictable && filter(&regions[i]))
        .min_by_key(|&i| regions[i].last_access)
        .map(|i| i as u32)
}

#[derive(Debug)]
struct Lru;

impl ReplacementPolicy for Lru {
    fn choose(&mut self, regions: &mut [Recency]) -> Option<u32> {
        oldest(regions, |_| true)
    }
}

#[derive(Debug)]
struct Clock {
    hand: u32,
}

impl ReplacementPolicy for Clock {
    fn choose(&mut self, regions: &mut [Recency]) -> Option<u32> {
        let n = regions.len() as u32;
        for _ in 0..2 * n {
            let i = self.hand;
            self.hand = (self.hand + 1) % n;
            let r = &mut regions[i as usize];
            if !r.evictable {
                continue;
            }
            if r.referenced {
                r.referenced = false;
            } else {
                return Some(i);
            }
        }
        oldest(regions, |_| true)
    }
}

/// Ghost lists of ARC: keys of lines recently evicted from each side.
#[derive(Debug, Default)]
struct Ghosts {
    recency: VecDeque<u64>,
    frequency: VecDeque<u64>,
    capacity: usize,
}

#[derive(Debug)]
struct Arc {
    /// Target share of recency regions (0..=regions).
    target: f64,
    ghosts: Ghosts,
    /// Within the side chosen, weigh sharing (D-ARC) rather than age alone.
    dedup: bool,
}

impl Arc {
    fn new(regions: u32, blocks_per_region: u32, dedup: bool) -> Arc {
        Arc {
            target: f64::from(regions) / 2.0,
            ghosts: Ghosts {
                capacity: (regions as usize * blocks_per_region as usize / 4).clamp(1024, 1 << 20),
                ..Ghosts::default()
            },
            dedup,
        }
    }

    fn pick(&self, regions: &[Recency], filter: impl Fn(&Recency) -> bool) -> Option<u32> {
        if self.dedup {
            fewest_addresses(regions, filter)
        } else {
            oldest(regions, filter)
        }
    }
}

impl ReplacementPolicy for Arc {
    fn choose(&mut self, regions: &mut [Recency]) -> Option<u32> {
        let recency = regions
            .iter()
            .filter(|r| r.evictable && r.accesses < 2)
            .count();
        let from_recency = recency as f64 > self.target || recency == regions.len();
        let pick = if from_recency {
            self.pick(regions, |r| r.accesses < 2)
        } else {
            self.pick(regions, |r| r.accesses >= 2)
        };
        pick.or_else(|| self.pick(regions, |_| true))
    }

    fn evicted(&mut self, frequent: bool, keys: &mut dyn Iterator<Item = u64>) {
        let cap = self.ghosts.capacity;
        let list = if frequent {
            &mut self.ghosts.frequency
        } else {
            &mut self.ghosts.recency
        };
        for k in keys {
            list.push_back(k);
            if list.len() > cap {
                list.pop_front();
            }
        }
    }

    /// If ARC evicted the line recently, move the recency/frequency split
    /// toward the side that would have kept it.
    fn missed(&mut self, key: u64, regions: usize) {
        let n = regions as f64;
        if self.ghosts.recency.contains(&key) {
            self.target = (self.target + 1.0).min(n);
        } else if self.ghosts.frequency.contains(&key) {
            self.target = (self.target - 1.0).max(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(last_access: u64, referenced: bool, accesses: u32) -> Recency {
        Recency {
            evictable: true,
            last_access,
            referenced,
            accesses,
            live: 8,
            extra_refs: 0,
        }
    }

    #[test]
    fn dedup_aware_policies_spare_the_most_shared_of_the_oldest() {
        // Region 1 is the oldest but its blocks serve 30 addresses.
        let mut regions = [
            region(5, false, 0),
            region(1, false, 0),
            region(3, false, 0),
            region(90, false, 0),
        ];
        regions[1].extra_refs = 22;
        let mut lru = Replacement::Lru.build(4, 8);
        assert_eq!(lru.choose(&mut regions), Some(1));
        let mut dlru = Replacement::DedupLru.build(4, 8);
        assert_eq!(dlru.choose(&mut regions), Some(2), "next oldest, unshared");
        // Fewer live blocks count as fewer addresses too.
        regions[0].live = 2;
        assert_eq!(dlru.choose(&mut regions), Some(0));
        // Beyond the oldest WEIGHED regions nothing is weighed.
        let mut many: Vec<Recency> = (0..20).map(|i| region(i, false, 0)).collect();
        for r in many.iter_mut().take(WEIGHED) {
            r.extra_refs = 100;
        }
        many[19].live = 0;
        assert_eq!(dlru.choose(&mut many), Some(0), "the oldest of equals");
        let mut darc = Replacement::DedupArc.build(4, 8);
        assert_eq!(darc.choose(&mut regions), Some(0));
        assert_eq!("d-lru".parse::<Replacement>(), Ok(Replacement::DedupLru));
        assert_eq!(Replacement::DedupArc.name(), "d-arc");
    }

    #[test]
    fn lru_picks_the_oldest_evictable() {
        let mut regions = [
            region(5, false, 0),
            region(1, false, 0),
            region(3, false, 0),
        ];
        let mut p = Replacement::Lru.build(3, 4);
        assert_eq!(p.choose(&mut regions), Some(1));
        regions[1].evictable = false;
        assert_eq!(p.choose(&mut regions), Some(2));
        for r in &mut regions {
            r.evictable = false;
        }
        assert_eq!(p.choose(&mut regions), None);
    }

    #[test]
    fn clock_spares_a_referenced_region_once() {
        let mut regions = [region(1, true, 1), region(2, false, 0), region(3, true, 1)];
        let mut p = Replacement::Clock.build(3, 4);
        assert_eq!(p.choose(&mut regions), Some(1));
        assert!(!regions[0].referenced, "its second chance is used up");
        // The hand goes on from region 2, whose chance it takes, to 0.
        assert_eq!(p.choose(&mut regions), Some(0));
        assert!(!regions[2].referenced);
    }

    #[test]
    fn arc_moves_its_split_toward_ghost_hits() {
        // One region hit once (recency), one hit often (frequency), older.
        let mut regions = [region(5, false, 1), region(1, false, 3)];
        let mut p = Replacement::Arc.build(2, 1024);
        // Target 1: one recency region is not over it, so frequency loses.
        assert_eq!(p.choose(&mut regions), Some(1));
        // Misses on lines evicted from the frequency side lower the target.
        p.evicted(true, &mut [7u64].into_iter());
        p.missed(7, 2);
        assert_eq!(p.choose(&mut regions), Some(0));
        // Misses on recency ghosts raise it back, up to the region count.
        p.evicted(false, &mut [8u64].into_iter());
        for _ in 0..3 {
            p.missed(8, 2);
        }
        assert_eq!(p.choose(&mut regions), Some(1));
    }
}
