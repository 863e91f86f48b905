//! Guest range locks: readers of a guest cluster share it, writers (which
//! may allocate, copy on write or free host clusters) hold it alone, so a
//! read never sees a host cluster that a concurrent write or discard frees
//! and reuses, and two writes never allocate the same guest cluster.
//!
//! Ranges are whole guest clusters. All clusters of a request are taken at
//! once, so requests cannot deadlock one another.

use std::sync::{Condvar, Mutex};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Shared,
    Exclusive,
}

#[derive(Debug)]
struct Held {
    id: u64,
    first: u64,
    end: u64,
    mode: Mode,
}

/// The set of held guest cluster ranges.
#[derive(Debug, Default)]
pub(crate) struct RangeLocks {
    held: Mutex<HeldRanges>,
    released: Condvar,
}

#[derive(Debug, Default)]
struct HeldRanges {
    next_id: u64,
    ranges: Vec<Held>,
    /// Threads waiting for a conflict to clear: a release wakes them (a
    /// wake-up is a system call, so none when nobody waits).
    waiters: usize,
}

/// Holds a range until dropped.
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl RangeLocks {
    /// Locks guest clusters `first..end` in `mode`, waiting for conflicts.
    pub(crate) fn lock(&self, first: u64, end: u64, mode: Mode) -> RangeGuard<'_> {
        let mut g = self.held.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let conflict = g.ranges.iter().any(|h| {
                h.first < end
                    && first < h.end
                    && (mode == Mode::Exclusive || h.mode == Mode::Exclusive)
            });
            if !conflict {
                g.next_id += 1;
                let id = g.next_id;
                g.ranges.push(Held {
                    id,
                    first,
                    end,
                    mode,
                });
                return RangeGuard { locks: self, id };
            }
            g.waiters += 1;
            g = self.released.wait(g).unwrap_or_else(|p| p.into_inner());
            g.waiters -= 1;
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut g = self.locks.held.lock().unwrap_or_else(|p| p.into_inner());
        g.ranges.retain(|h| h.id != self.id);
        let wake = g.waiters > 0;
        drop(g);
        if wake {
            self.locks.released.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn exclusive_waits_for_overlapping_shared() {
        let locks = Arc::new(RangeLocks::default());
        let r = locks.lock(0, 4, Mode::Shared);
        let _other = locks.lock(4, 8, Mode::Exclusive);
        let _also_shared = locks.lock(2, 3, Mode::Shared);
        let done = Arc::new(AtomicBool::new(false));
        let t = {
            let (locks, done) = (locks.clone(), done.clone());
            std::thread::spawn(move || {
                let _w = locks.lock(3, 5, Mode::Exclusive);
                done.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!done.load(Ordering::SeqCst));
        drop(r);
        drop(_also_shared);
        drop(_other);
        t.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
    }
}
