//! Ranges of image bytes being written to a backend. The background
//! write-back thread copies old blocks to a backend without the state lock;
//! a foreground write that bypasses the cache (write-through, write-around,
//! discard) to the same bytes must not interleave with it, or a stale copy
//! could land after the newer bytes. Both take the range first.
//!
//! Lock order: a range before the state lock, never the other way round.

use std::sync::{Condvar, Mutex};

/// A held range: (holder, image, start, end).
type Held = (u64, u16, u64, u64);

#[derive(Debug, Default)]
pub(crate) struct BackendRanges {
    /// Next holder id, and the held ranges.
    held: Mutex<(u64, Vec<Held>)>,
    released: Condvar,
}

/// Holds ranges until dropped.
pub(crate) struct RangeGuard<'a> {
    ranges: &'a BackendRanges,
    id: u64,
}

impl BackendRanges {
    /// Takes every range in `want` (image, start, end) at once.
    pub(crate) fn lock(&self, want: &[(u16, u64, u64)]) -> RangeGuard<'_> {
        let mut g = self.held.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let busy = want.iter().any(|&(img, s, e)| {
                g.1.iter()
                    .any(|&(_, i, hs, he)| i == img && hs < e && s < he)
            });
            if !busy {
                g.0 += 1;
                let id = g.0;
                for &(img, s, e) in want {
                    g.1.push((id, img, s, e));
                }
                return RangeGuard { ranges: self, id };
            }
            g = self.released.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut g = self.ranges.held.lock().unwrap_or_else(|p| p.into_inner());
        g.1.retain(|&(id, ..)| id != self.id);
        drop(g);
        self.ranges.released.notify_all();
    }
}
