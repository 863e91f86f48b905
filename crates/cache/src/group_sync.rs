//! Group commit: a sync that runs outside the cache's state lock, shared
//! by every caller whose writes were published before it started.
//!
//! For the cache device, a guest flush writes its journal batch under the
//! state lock, publishes the batch's sequence number, drops the lock and
//! asks for a sync covering that number. For an image's backend, each
//! write-through write publishes its unsynced mark (see the tier's ledger).
//! One sync at a time runs; it covers every number published before it
//! started (their writes completed before the publication). A caller that
//! would write while a sync runs may wait for it first ([`GroupSync::wait_idle`]),
//! so that the writes of everyone who waited go out as one.
//!
//! Owns: the published and durable numbers, the one-sync-at-a-time rule,
//! the count of callers that waited for another's sync.
//! Must not: decide what a sync covers beyond published numbers (callers
//! publish only after their writes completed), or hide a failed sync (its
//! waiters see the error or run their own).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug, Default)]
pub struct GroupSync {
    /// A leaf lock, taken under the cache's state lock or alone, never held
    /// across the sync it guards.
    round: Mutex<Round>,
    finished: Condvar,
    /// The highest number whose write completed.
    published: AtomicU64,
    /// Callers that found a sync running and waited for it.
    waits: AtomicU64,
}

#[derive(Debug, Default)]
struct Round {
    /// Every write up to this number is durable.
    durable: u64,
    running: bool,
}

impl GroupSync {
    /// Write `seq` (and every one numbered before it) completed: a sync
    /// that starts from now on covers it.
    pub fn publish(&self, seq: u64) {
        self.published.fetch_max(seq, Ordering::Release);
    }

    /// Returns once write `seq` is durable, running `sync` unless a sync
    /// that covers it already ran. `seq` must have been published.
    pub fn sync_through(&self, seq: u64, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let mut round = self.lock();
        let mut waited = false;
        while round.running && round.durable < seq {
            if !waited {
                waited = true;
                self.waits.fetch_add(1, Ordering::Relaxed);
            }
            round = self.finished.wait(round).unwrap_or_else(|p| p.into_inner());
        }
        if round.durable >= seq {
            return Ok(());
        }
        round.running = true;
        drop(round);
        let covered = self.published.load(Ordering::Acquire);
        let result = sync();
        let mut round = self.lock();
        round.running = false;
        if result.is_ok() {
            round.durable = round.durable.max(covered);
        }
        self.finished.notify_all();
        result
    }

    /// Whether a sync runs now (the state lock may be held: it is taken
    /// before this one, as in [`GroupSync::note_durable`]).
    pub fn is_running(&self) -> bool {
        self.lock().running
    }

    /// Returns once no sync runs (a write made now would wait for the
    /// next one anyway; made after this, it can share it with others).
    pub fn wait_idle(&self) {
        let mut round = self.lock();
        if round.running {
            self.waits.fetch_add(1, Ordering::Relaxed);
        }
        while round.running {
            round = self.finished.wait(round).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Every write before `seq` became durable by a sync run elsewhere
    /// (under the caller's lock, so nothing later was written meanwhile).
    pub fn note_durable(&self, seq: u64) {
        let mut round = self.lock();
        round.durable = round.durable.max(seq);
    }

    /// Every write numbered below this is durable.
    pub fn durable(&self) -> u64 {
        self.lock().durable
    }

    /// Callers that waited for a sync another caller had started.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn a_sync_covers_only_what_was_published_before_it_started() {
        let g = GroupSync::default();
        let syncs = AtomicU64::new(0);
        let count = || {
            syncs.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        g.publish(1);
        g.sync_through(1, count).unwrap();
        // Already durable: no second sync.
        g.sync_through(1, count).unwrap();
        assert_eq!(syncs.load(Ordering::SeqCst), 1);
        // Published after the last sync started: needs a new one.
        g.publish(3);
        g.sync_through(2, count).unwrap();
        g.sync_through(3, count).unwrap();
        assert_eq!(syncs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_failed_sync_makes_nothing_durable() {
        let g = GroupSync::default();
        g.publish(1);
        let err = g.sync_through(1, || Err(io::Error::other("EIO")));
        assert!(err.is_err());
        let mut ran = false;
        g.sync_through(1, || {
            ran = true;
            Ok(())
        })
        .unwrap();
        assert!(ran, "a failed sync counted as durable");
    }

    #[test]
    fn flushes_arriving_during_a_sync_share_the_next_one() {
        let g = Arc::new(GroupSync::default());
        let release = Arc::new(AtomicBool::new(false));
        let syncs = Arc::new(AtomicU64::new(0));
        g.publish(1);
        let first = {
            let (g, release, syncs) = (g.clone(), release.clone(), syncs.clone());
            std::thread::spawn(move || {
                g.sync_through(1, || {
                    syncs.fetch_add(1, Ordering::SeqCst);
                    while !release.load(Ordering::SeqCst) {
                        std::thread::yield_now();
                    }
                    Ok(())
                })
            })
        };
        while syncs.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        g.publish(3);
        let joiners: Vec<_> = [2, 3]
            .into_iter()
            .map(|seq| {
                let (g, syncs) = (g.clone(), syncs.clone());
                std::thread::spawn(move || {
                    g.sync_through(seq, || {
                        syncs.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                })
            })
            .collect();
        while g.waits() < 2 {
            std::thread::yield_now();
        }
        release.store(true, Ordering::SeqCst);
        first.join().unwrap().unwrap();
        for j in joiners {
            j.join().unwrap().unwrap();
        }
        assert_eq!(syncs.load(Ordering::SeqCst), 2);
    }
}
