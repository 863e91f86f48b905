//! What a store on a storage server must be able to write again: the
//! writes and trims the server acknowledged on the current connection since
//! the last flush that completed on it. A server with a volatile write
//! cache that restarts loses exactly those, while vdcache (its COW layer,
//! its metadata cache, a write-through cache) goes on believing them
//! written; so after a reconnection they are written again, in their
//! original order, and flushed, before the store serves anything else.
//!
//! Connections are numbered (epochs). An operation is recorded with the
//! epoch of the connection that acknowledged it; once that connection is
//! [lost](Unflushed::lost), a late record for it is refused
//! ([`Recorded::Stale`]) and its writer sends the operation again on the
//! next connection, so nothing acknowledged escapes both the rewrite and
//! the record.
//!
//! The record is bounded ([`DEFAULT_UNFLUSHED_LIMIT`] bytes by default):
//! past the bound, [`Recorded::Kept`] says so and the store flushes early
//! (a flush nobody asked for is always allowed), which empties it.
//!
//! Owns: the record, its bound, the epochs, the order of a rewrite. Must
//! not: talk to a server itself (the store passes how to write, trim and
//! flush), or drop an operation that no completed flush covered.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

/// Bytes of unflushed writes a store keeps by default before it flushes
/// early (`[storage] unflushed_limit`).
pub const DEFAULT_UNFLUSHED_LIMIT: u64 = 256 << 20;

/// What each recorded operation costs besides its data (its place in the
/// record), so that a stream of trims is bounded too.
const ENTRY_COST: u64 = 64;

/// An operation the server acknowledged and no flush has covered yet.
#[derive(Debug, Clone)]
pub enum UnflushedOp {
    Write { offset: u64, data: Arc<[u8]> },
    Trim { offset: u64, len: u64 },
}

impl UnflushedOp {
    fn cost(&self) -> u64 {
        match self {
            UnflushedOp::Write { data, .. } => data.len() as u64 + ENTRY_COST,
            UnflushedOp::Trim { .. } => ENTRY_COST,
        }
    }
}

/// The answer to [`Unflushed::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Kept; `over_limit`: the record is past its bound, flush now.
    Kept { over_limit: bool },
    /// The connection that acknowledged it is gone and the rewrite may
    /// have missed it: send it again on the current connection.
    Stale,
}

/// Where a flush's coverage ends: taken right before the flush is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushMark(u64);

/// What one rewrite wrote again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rewritten {
    pub writes: u64,
    pub bytes: u64,
    pub trims: u64,
}

/// The unflushed operations of one store (see the module comment).
#[derive(Debug)]
pub struct Unflushed {
    limit: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// (sequence number, operation), oldest first.
    ops: VecDeque<(u64, UnflushedOp)>,
    next_seq: u64,
    cost: u64,
    /// The current connection's epoch.
    epoch: u64,
}

impl Unflushed {
    /// An empty record for a store whose first connection is epoch 0,
    /// flushing early past `limit` bytes.
    pub fn new(limit: u64) -> Unflushed {
        Unflushed {
            limit,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current connection's epoch.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Records an operation that connection `epoch` acknowledged (`op`
    /// builds it only when it is kept: a write's data is copied then).
    pub fn record(&self, epoch: u64, op: impl FnOnce() -> UnflushedOp) -> Recorded {
        let mut st = self.lock();
        if epoch != st.epoch {
            return Recorded::Stale;
        }
        let op = op();
        st.cost += op.cost();
        let seq = st.next_seq;
        st.next_seq += 1;
        st.ops.push_back((seq, op));
        Recorded::Kept {
            over_limit: st.cost > self.limit,
        }
    }

    /// Where a flush sent now covers up to: every operation recorded so
    /// far (each was acknowledged before it was recorded).
    pub fn mark(&self) -> FlushMark {
        FlushMark(self.lock().next_seq)
    }

    /// A flush sent at `mark` completed: what it covers is durable.
    pub fn flushed(&self, mark: FlushMark) {
        let mut st = self.lock();
        while let Some((seq, _)) = st.ops.front() {
            if *seq >= mark.0 {
                break;
            }
            if let Some((_, op)) = st.ops.pop_front() {
                st.cost -= op.cost();
            }
        }
    }

    /// Connection `epoch` is gone: the next one is a new epoch, and late
    /// records for this one are refused. Nothing recorded is dropped.
    pub fn lost(&self, epoch: u64) {
        let mut st = self.lock();
        if st.epoch == epoch {
            st.epoch += 1;
        }
    }

    /// Operations kept and their bytes of data.
    pub fn pending(&self) -> (usize, u64) {
        let st = self.lock();
        let bytes = st
            .ops
            .iter()
            .map(|(_, op)| match op {
                UnflushedOp::Write { data, .. } => data.len() as u64,
                UnflushedOp::Trim { .. } => 0,
            })
            .sum();
        (st.ops.len(), bytes)
    }

    /// Writes every kept operation again, in order, with `apply`, then
    /// flushes with `flush`; once that flush completed they are dropped.
    /// Called on a new connection before it serves any request (so no
    /// operation is recorded meanwhile). An error leaves the record as it
    /// was, for the next connection to try again.
    pub fn rewrite<E>(
        &self,
        mut apply: impl FnMut(&UnflushedOp) -> Result<(), E>,
        flush: impl FnOnce() -> Result<(), E>,
    ) -> Result<Rewritten, E> {
        let (ops, mark) = {
            let st = self.lock();
            let ops: Vec<UnflushedOp> = st.ops.iter().map(|(_, op)| op.clone()).collect();
            (ops, FlushMark(st.next_seq))
        };
        let mut done = Rewritten::default();
        if ops.is_empty() {
            return Ok(done);
        }
        if !deliberately_skipped() {
            for op in &ops {
                apply(op)?;
                match op {
                    UnflushedOp::Write { data, .. } => {
                        done.writes += 1;
                        done.bytes += data.len() as u64;
                    }
                    UnflushedOp::Trim { .. } => done.trims += 1,
                }
            }
        }
        flush()?;
        self.flushed(mark);
        Ok(done)
    }
}

/// Whether a test switched on the deliberate bug that serves on after a
/// reconnection without writing anything again (see [`crate::testing`]).
fn deliberately_skipped() -> bool {
    #[cfg(any(test, feature = "deliberate-bugs"))]
    return crate::testing::active(crate::testing::Fault::SkipRewrite);
    #[cfg(not(any(test, feature = "deliberate-bugs")))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(offset: u64, len: usize) -> impl FnOnce() -> UnflushedOp {
        move || UnflushedOp::Write {
            offset,
            data: Arc::from(vec![offset as u8; len]),
        }
    }

    #[test]
    fn a_completed_flush_drops_what_it_covers_and_only_that() {
        let u = Unflushed::new(1 << 20);
        assert_eq!(
            u.record(0, write(0, 512)),
            Recorded::Kept { over_limit: false }
        );
        let mark = u.mark();
        u.record(0, write(512, 512));
        u.flushed(mark);
        assert_eq!(u.pending(), (1, 512));
        u.flushed(u.mark());
        assert_eq!(u.pending(), (0, 0));
    }

    #[test]
    fn a_record_for_a_lost_connection_is_refused_and_the_rest_rewritten_in_order() {
        let _serial = crate::testing::serial();
        let u = Unflushed::new(1 << 20);
        u.record(0, write(4096, 100));
        u.record(0, || UnflushedOp::Trim {
            offset: 0,
            len: 4096,
        });
        u.record(0, write(0, 10));
        u.lost(0);
        assert_eq!(u.record(0, write(8192, 1)), Recorded::Stale);
        assert_eq!(u.epoch(), 1);
        // A failed rewrite keeps everything for the next connection.
        let failed: Result<Rewritten, &str> = u.rewrite(|_| Err("dropped"), || Ok(()));
        assert_eq!(failed, Err("dropped"));
        assert_eq!(u.pending(), (3, 110));
        let mut seen = Vec::new();
        let mut flushed = false;
        let done = u
            .rewrite(
                |op| {
                    seen.push(match op {
                        UnflushedOp::Write { offset, .. } => (*offset, 'w'),
                        UnflushedOp::Trim { offset, .. } => (*offset, 't'),
                    });
                    Ok::<(), ()>(())
                },
                || {
                    flushed = true;
                    Ok(())
                },
            )
            .unwrap_or_default();
        assert_eq!(seen, [(4096, 'w'), (0, 't'), (0, 'w')]);
        assert!(flushed);
        assert_eq!(
            done,
            Rewritten {
                writes: 2,
                bytes: 110,
                trims: 1
            }
        );
        assert_eq!(u.pending(), (0, 0));
    }

    #[test]
    fn the_bound_says_when_to_flush() {
        let u = Unflushed::new(2 * 4096 + 2 * ENTRY_COST);
        assert_eq!(
            u.record(0, write(0, 4096)),
            Recorded::Kept { over_limit: false }
        );
        assert_eq!(
            u.record(0, write(0, 4096)),
            Recorded::Kept { over_limit: false }
        );
        assert_eq!(
            u.record(0, write(0, 1)),
            Recorded::Kept { over_limit: true }
        );
        u.flushed(u.mark());
        assert_eq!(
            u.record(0, write(0, 1)),
            Recorded::Kept { over_limit: false }
        );
    }
}
