//! Reinsertion policies: how many clean blocks of a region being reclaimed
//! are copied into the promotion stream instead of dropped, behind
//! [`ReinsertionPolicy`] and chosen by the `relocate_hot` setting.
//!
//! A policy only sizes the budget from what the regions say of the victim;
//! it never copies, maps or drops a block (the cache's reclaim does) and
//! never reinserts dirty blocks (they are written back).

use crate::region::Regions;

/// At most this share of a victim region is re-inserted as hot.
const RELOCATE_LIMIT: u32 = 4;

/// Decides how much of a victim region survives its reclaim.
pub(crate) trait ReinsertionPolicy: Sync {
    /// Clean blocks of region `victim` to re-insert (at most).
    fn budget(&self, regions: &Regions, victim: u32) -> u32;
}

/// Never re-inserts.
struct Never;

impl ReinsertionPolicy for Never {
    fn budget(&self, _regions: &Regions, _victim: u32) -> u32 {
        0
    }
}

/// Re-inserts up to a quarter of a region accessed since it was written.
struct HotRegions;

impl ReinsertionPolicy for HotRegions {
    fn budget(&self, regions: &Regions, victim: u32) -> u32 {
        if regions.is_hot(victim) {
            regions.blocks_per_region() / RELOCATE_LIMIT
        } else {
            0
        }
    }
}

/// The policy the `relocate_hot` setting selects.
pub(crate) fn policy(relocate_hot: bool) -> &'static dyn ReinsertionPolicy {
    if relocate_hot { &HotRegions } else { &Never }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{Replacement, Stream};

    #[test]
    fn only_hot_regions_keep_a_quarter() {
        let mut r = Regions::new(2, 8, 0, Replacement::Lru);
        r.allocate(Stream::Write, 8);
        r.allocate(Stream::Write, 8);
        // Region 1 is read twice since written: hot.
        r.touch(1);
        r.touch(1);
        assert_eq!(policy(true).budget(&r, 0), 0);
        assert_eq!(policy(true).budget(&r, 1), 2);
        assert_eq!(policy(false).budget(&r, 1), 0);
    }
}
