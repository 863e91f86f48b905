//! The server-wide budget of buffered payload bytes: write payloads read
//! from clients and not yet stored, read data fetched from exports and not
//! yet sent.
//!
//! Every connection takes from one shared count before it buffers a
//! payload, and waits while the count is at its limit, so N connections
//! cannot hold N times the per-connection in-flight limit. A connection
//! that holds nothing of the budget may always take one request's worth
//! (at most `Limits::payload_chunk`, since larger payloads are streamed in
//! pieces of that size): clients that stop reading their replies, or stop
//! sending a payload halfway, can slow everyone else down to one request
//! at a time but never lock them out. The bytes held are therefore at most
//! `max_buffered_bytes + connections * payload_chunk`.
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

    /// Takes `n` bytes for a connection holding `mine`, waiting for room
    /// unless that connection holds nothing.
    pub(crate) fn take(&self, n: u64, mine: &AtomicU64) {
        if n == 0 || self.try_take(n, mine) {
            return;
        }
        let mut g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // Registered before looking again: a giver that frees room after
        // this look sees the waiter and wakes it (both sides are SeqCst).
        self.waiters.fetch_add(1, SeqCst);
        while !self.try_take(n, mine) {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        self.waiters.fetch_sub(1, SeqCst);
    }

    /// Takes `n` bytes if that needs no wait.
    pub(crate) fn try_take(&self, n: u64, mine: &AtomicU64) -> bool {
        let alone = mine.load(SeqCst) == 0;
        let mut cur = self.used.load(SeqCst);
        loop {
            let new = cur.saturating_add(n);
            if new > self.max && !alone {
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
    fn a_connection_holding_nothing_always_gets_one_request() {
        let b = PayloadBudget::new(100);
        let (a, c) = (AtomicU64::new(0), AtomicU64::new(0));
        b.take(80, &a);
        // Over the limit, but `c` holds nothing: it goes ahead.
        b.take(60, &c);
        assert_eq!((b.used(), b.peak()), (140, 140));
        assert_eq!((a.load(SeqCst), c.load(SeqCst)), (80, 60));
        assert!(
            !b.try_take(1, &a),
            "a connection holding bytes got more past the limit"
        );
        b.give_back(80, &a);
        b.give_back(60, &c);
        assert_eq!((b.used(), b.peak()), (0, 140));
        assert!(b.try_take(100, &a));
        assert!(!b.try_take(1, &a));
    }

    #[test]
    fn a_waiting_connection_goes_on_when_room_is_given_back() {
        let b = Arc::new(PayloadBudget::new(100));
        let holder = Arc::new(AtomicU64::new(0));
        let waiter_holds = Arc::new(AtomicU64::new(0));
        b.take(90, &holder);
        b.take(10, &waiter_holds);
        let t = {
            let (b, w) = (b.clone(), waiter_holds.clone());
            std::thread::spawn(move || b.take(50, &w))
        };
        // Whether or not the thread already waits, it can only finish
        // once the holder gives its bytes back.
        b.give_back(90, &holder);
        t.join().unwrap();
        assert_eq!(b.used(), 60);
        assert_eq!(waiter_holds.load(SeqCst), 60);
        assert_eq!(b.waiters.load(SeqCst), 0);
    }
}
