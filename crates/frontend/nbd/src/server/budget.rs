//! The server-wide budget of buffered payload bytes: write payloads read
//! from clients and not yet stored, read data fetched from exports and not
//! yet sent.
//!
//! Every connection takes from one shared count before it buffers a
//! payload, and waits while the count is at its limit, so N connections
//! cannot hold N times the per-connection in-flight limit. A payload
//! larger than `Limits::payload_chunk` is never taken whole: it is
//! streamed in pieces. A connection that holds nothing of the budget may
//! always take a piece of [`MIN_PIECE`] bytes: clients that stop reading
//! their replies, or stop sending a payload halfway, can slow everyone
//! else down to small pieces one at a time but never lock them out. The
//! bytes held are therefore at most `max_buffered_bytes + connections *
//! MIN_PIECE`.
//!
//! Taking and giving back are atomic operations (no lock, no system call)
//! unless someone waits.
//!
//! Owns: the shared count, its peak, the wait for room. Must not: be waited
//! on by anything but a connection's reading thread (workers only give
//! back), or the reader could wait for bytes that only its own queued jobs
//! would free.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};

/// What a connection holding nothing may take past the limit (a multiple
/// of every export's minimum block size, which is at most 64 KiB).
pub(crate) const MIN_PIECE: u64 = 64 << 10;

#[derive(Debug)]
pub(crate) struct PayloadBudget {
    used: AtomicU64,
    peak: AtomicU64,
    max: u64,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl PayloadBudget {
    pub(crate) fn new(max: u64) -> PayloadBudget {
        PayloadBudget {
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            max,
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Takes `want` bytes for a connection holding `mine`, or, if that
    /// connection holds nothing and `want` does not fit, `alone` bytes
    /// (at most `want`) past the limit; waits while neither is possible.
    /// Returns what was taken.
    pub(crate) fn take(&self, want: u64, alone: u64, mine: &AtomicU64) -> u64 {
        if let Some(n) = self.try_take(want, alone, mine) {
            return n;
        }
        let mut g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // Registered before looking again: a giver that frees room after
        // this look sees the waiter and wakes it (both sides are SeqCst).
        self.waiters.fetch_add(1, SeqCst);
        let n = loop {
            if let Some(n) = self.try_take(want, alone, mine) {
                break n;
            }
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        };
        self.waiters.fetch_sub(1, SeqCst);
        n
    }

    /// [`PayloadBudget::take`] without waiting.
    pub(crate) fn try_take(&self, want: u64, alone: u64, mine: &AtomicU64) -> Option<u64> {
        if self.add(want, mine, false) {
            return Some(want);
        }
        let alone = alone.min(want);
        (mine.load(SeqCst) == 0 && self.add(alone, mine, true)).then_some(alone)
    }

    /// Adds `n` to the count if it stays within the limit or `force`.
    fn add(&self, n: u64, mine: &AtomicU64, force: bool) -> bool {
        let mut cur = self.used.load(SeqCst);
        loop {
            let new = cur.saturating_add(n);
            if new > self.max && !force {
                return false;
            }
            match self.used.compare_exchange_weak(cur, new, SeqCst, SeqCst) {
                Ok(_) => {
                    mine.fetch_add(n, SeqCst);
                    if new > self.peak.load(SeqCst) {
                        self.peak.fetch_max(new, SeqCst);
                    }
                    return true;
                }
                Err(x) => cur = x,
            }
        }
    }

    /// Gives back `n` bytes taken for the connection holding `mine`.
    pub(crate) fn give_back(&self, n: u64, mine: &AtomicU64) {
        if n == 0 {
            return;
        }
        mine.fetch_sub(n, SeqCst);
        self.used.fetch_sub(n, SeqCst);
        if self.waiters.load(SeqCst) > 0 {
            // Taking the lock orders this wake-up after a waiter's look.
            let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.cv.notify_all();
        }
    }

    /// Bytes held now.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(SeqCst)
    }

    /// Most bytes ever held at once.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_connection_holding_nothing_always_gets_a_small_piece() {
        let b = PayloadBudget::new(100);
        let (a, c) = (AtomicU64::new(0), AtomicU64::new(0));
        assert_eq!(b.take(80, 80, &a), 80);
        // 60 do not fit, but `c` holds nothing: it gets its small piece,
        // past the limit.
        assert_eq!(b.take(60, 30, &c), 30);
        assert_eq!((b.used(), b.peak()), (110, 110));
        // Holding bytes, neither may go further.
        assert_eq!(b.try_take(1, 1, &a), None);
        assert_eq!(b.try_take(1, 1, &c), None);
        b.give_back(80, &a);
        assert_eq!(b.try_take(60, 1, &c), Some(60));
        b.give_back(90, &c);
        assert_eq!((b.used(), b.peak()), (0, 110));
        assert_eq!((a.load(SeqCst), c.load(SeqCst)), (0, 0));
        assert_eq!(b.try_take(100, 1, &a), Some(100));
        assert_eq!(b.try_take(1, 1, &a), None);
    }

    #[test]
    fn a_waiting_connection_goes_on_when_room_is_given_back() {
        let b = Arc::new(PayloadBudget::new(100));
        let holder = Arc::new(AtomicU64::new(0));
        let waiter_holds = Arc::new(AtomicU64::new(0));
        b.take(90, 90, &holder);
        b.take(10, 10, &waiter_holds);
        let t = {
            let (b, w) = (b.clone(), waiter_holds.clone());
            std::thread::spawn(move || b.take(50, 5, &w))
        };
        // Whether or not the thread already waits, it can only finish
        // once the holder gives its bytes back.
        b.give_back(90, &holder);
        assert_eq!(t.join().unwrap(), 50);
        assert_eq!(b.used(), 60);
        assert_eq!(waiter_holds.load(SeqCst), 60);
        assert_eq!(b.waiters.load(SeqCst), 0);
    }

    #[test]
    fn a_waiting_connection_that_gives_everything_back_takes_its_small_piece() {
        let b = Arc::new(PayloadBudget::new(100));
        let other = Arc::new(AtomicU64::new(0));
        let mine = Arc::new(AtomicU64::new(0));
        b.take(100, 100, &other);
        b.take(10, 10, &mine);
        let t = {
            let (b, m) = (b.clone(), mine.clone());
            std::thread::spawn(move || b.take(50, 5, &m))
        };
        // Its own job finishes: holding nothing, it may go past the limit.
        b.give_back(10, &mine);
        assert_eq!(t.join().unwrap(), 5);
        assert_eq!(b.used(), 105);
    }
}
