//! Per-VM cache shares (SVD, paper 004, section III; CloudCache): when
//! flash space is needed, the victim comes from the VM (disk) with the
//! least demand for its space, so one VM's scan or backup cannot flush
//! another's hot set. Each disk may have a minimum and a maximum of flash
//! and a weight; demand is each disk's recent reuse: read hits on its
//! regions, halved every `decay_every` hits so it follows the workload.
//!
//! With shares on, every region belongs to the disk whose data filled it
//! (each disk appends to open regions of its own), so a disk's occupancy
//! is the space of its regions. Regions with no owner (filled before
//! shares were on, or found by recovery) belong to [`UNOWNED`].
//!
//! Owns: share settings, demand counters, and the choice of which disk
//! gives up a region. Must not: choose the region itself (the replacement
//! policy does, among that disk's regions) or look at blocks.

use std::collections::HashMap;

/// Whose data a region holds: a disk id, or [`UNOWNED`].
pub type Tenant = u32;

/// The owner of regions no disk owns.
pub const UNOWNED: Tenant = u32::MAX;

/// One disk's share of the cache.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Share {
    /// Flash (in blocks) the disk keeps even when others want it.
    pub min_blocks: u64,
    /// Flash (in blocks) the disk may hold at most (u64::MAX: no limit).
    pub max_blocks: u64,
    /// Relative weight of its demand (default 1).
    pub weight: f64,
}

impl Default for Share {
    fn default() -> Self {
        Share {
            min_blocks: 0,
            max_blocks: u64::MAX,
            weight: 1.0,
        }
    }
}

/// What one tenant holds, as the regions see it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Blocks of its regions (full and open).
    pub blocks: u64,
    /// Whether it has a region the policy may reclaim now.
    pub evictable: bool,
}

/// Share settings and demand of every disk.
#[derive(Debug)]
pub struct Shares {
    enabled: bool,
    settings: HashMap<Tenant, Share>,
    demand: HashMap<Tenant, f64>,
    hits: u64,
    decay_every: u64,
}

impl Shares {
    /// `decay_every`: hits after which every demand is halved (about the
    /// cache's size in blocks keeps a few cache-fulls of history).
    pub fn new(enabled: bool, decay_every: u64) -> Shares {
        Shares {
            enabled,
            settings: HashMap::new(),
            demand: HashMap::new(),
            hits: 0,
            decay_every: decay_every.max(1),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The tenant new regions of `disk` belong to.
    pub fn tenant_of(&self, disk: u32) -> Tenant {
        if self.enabled { disk } else { UNOWNED }
    }

    pub fn set(&mut self, tenant: Tenant, share: Share) {
        self.settings.insert(tenant, share);
    }

    pub fn get(&self, tenant: Tenant) -> Share {
        self.settings.get(&tenant).copied().unwrap_or_default()
    }

    /// A read hit on a region of `tenant`.
    pub fn hit(&mut self, tenant: Tenant) {
        if !self.enabled {
            return;
        }
        *self.demand.entry(tenant).or_default() += 1.0;
        self.hits += 1;
        if self.hits.is_multiple_of(self.decay_every) {
            for d in self.demand.values_mut() {
                *d /= 2.0;
            }
        }
    }

    /// Recent reuse of `tenant`'s data (decayed hits).
    pub fn demand(&self, tenant: Tenant) -> f64 {
        self.demand.get(&tenant).copied().unwrap_or(0.0)
    }

    /// The tenant that gives up a region: first one above its maximum
    /// (the most above), else, among those above their minimum, the one
    /// with the least weighted demand per block held (the least reuse
    /// for its space; unowned regions count as no demand). None: no
    /// tenant qualifies (the caller then lets the policy choose among
    /// all regions).
    pub fn victim(&self, usage: &HashMap<Tenant, Usage>) -> Option<Tenant> {
        if !self.enabled {
            return None;
        }
        let candidates = usage.iter().filter(|(_, u)| u.evictable && u.blocks > 0);
        let over_max = candidates
            .clone()
            .filter(|(t, u)| u.blocks > self.get(**t).max_blocks)
            .max_by_key(|(t, u)| u.blocks - self.get(**t).max_blocks)
            .map(|(t, _)| *t);
        if over_max.is_some() {
            return over_max;
        }
        candidates
            .filter(|(t, u)| u.blocks > self.get(**t).min_blocks)
            .map(|(t, u)| {
                let share = self.get(*t);
                let per_block = share.weight.max(0.0) * self.demand(*t) / u.blocks as f64;
                (*t, per_block, u.blocks)
            })
            // Least demand per block; among equals, the largest holder.
            .min_by(|a, b| a.1.total_cmp(&b.1).then(b.2.cmp(&a.2)))
            .map(|(t, _, _)| t)
    }

    /// Every tenant with settings or demand, for the report.
    pub fn tenants(&self) -> Vec<Tenant> {
        let mut t: Vec<Tenant> = self
            .settings
            .keys()
            .chain(self.demand.keys())
            .copied()
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(list: &[(Tenant, u64)]) -> HashMap<Tenant, Usage> {
        list.iter()
            .map(|&(t, blocks)| {
                (
                    t,
                    Usage {
                        blocks,
                        evictable: true,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn the_least_demand_per_block_gives_up_space() {
        let mut s = Shares::new(true, 1 << 20);
        for _ in 0..100 {
            s.hit(1);
        }
        s.hit(2);
        // Disk 2 reuses little of its larger share: it gives up space.
        assert_eq!(s.victim(&usage(&[(1, 30), (2, 60)])), Some(2));
        // Unless it is at its minimum.
        s.set(
            2,
            Share {
                min_blocks: 60,
                ..Share::default()
            },
        );
        assert_eq!(s.victim(&usage(&[(1, 30), (2, 60)])), Some(1));
        // A weight scales demand.
        s.set(2, Share::default());
        s.set(
            2,
            Share {
                weight: 1000.0,
                ..Share::default()
            },
        );
        assert_eq!(s.victim(&usage(&[(1, 30), (2, 60)])), Some(1));
    }

    #[test]
    fn a_tenant_over_its_maximum_goes_first_and_off_means_no_choice() {
        let mut s = Shares::new(true, 1 << 20);
        for _ in 0..10 {
            s.hit(1);
        }
        s.set(
            1,
            Share {
                max_blocks: 20,
                ..Share::default()
            },
        );
        assert_eq!(s.victim(&usage(&[(1, 30), (2, 60)])), Some(1));
        let mut u = usage(&[(1, 30), (2, 60)]);
        u.insert(
            1,
            Usage {
                blocks: 30,
                evictable: false,
            },
        );
        assert_eq!(
            s.victim(&u),
            Some(2),
            "a tenant with nothing evictable is passed over"
        );
        let off = Shares::new(false, 1);
        assert_eq!(off.victim(&usage(&[(1, 30)])), None);
        assert_eq!(off.tenant_of(7), UNOWNED);
    }

    #[test]
    fn demand_decays() {
        let mut s = Shares::new(true, 4);
        for _ in 0..4 {
            s.hit(1);
        }
        assert_eq!(s.demand(1), 2.0);
        assert_eq!(s.tenants(), vec![1]);
    }
}
