//! Admission filters: lazy promotion of reads (a block enters the cache on
//! its second miss within a window, like SVD's CLOCK-based promotion) and
//! detection of sequential runs to bypass.

/// Remembers recently missed blocks in a fixed direct-mapped table; a
/// block found there on its next miss is hot.
#[derive(Debug)]
pub struct HotFilter {
    slots: Vec<u64>,
}

impl HotFilter {
    pub fn new(entries: usize) -> HotFilter {
        HotFilter {
            slots: vec![u64::MAX; entries.max(1)],
        }
    }

    fn slot(&self, block: u64) -> usize {
        // A multiplicative hash spreads neighbouring blocks over the table.
        (block.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) as usize % self.slots.len()
    }

    /// Records a miss; true when the block missed recently before.
    pub fn missed(&mut self, block: u64) -> bool {
        let i = self.slot(block);
        if self.slots[i] == block {
            self.slots[i] = u64::MAX;
            true
        } else {
            self.slots[i] = block;
            false
        }
    }
}

/// Tracks one stream of consecutive requests.
#[derive(Debug, Default, Clone, Copy)]
pub struct SequentialRun {
    next: u64,
    run: u64,
}

impl SequentialRun {
    /// Feeds a request; returns the length of the run it continues.
    pub fn observe(&mut self, offset: u64, len: u64) -> u64 {
        if offset == self.next {
            self.run += len;
        } else {
            self.run = len;
        }
        self.next = offset + len;
        self.run
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_miss_promotes() {
        let mut h = HotFilter::new(1024);
        assert!(!h.missed(42));
        assert!(h.missed(42));
        assert!(!h.missed(42));
    }

    #[test]
    fn runs_grow_only_when_consecutive() {
        let mut s = SequentialRun::default();
        assert_eq!(s.observe(0, 4096), 4096);
        assert_eq!(s.observe(4096, 4096), 8192);
        assert_eq!(s.observe(0, 4096), 4096);
    }
}
