//! A storage server with a volatile write cache, for tests and the crash
//! harness: it acknowledges writes and trims at once, makes them durable
//! only at a flush, and at a restart (chosen by the number of requests it
//! served) loses every one no flush covered and drops its connections.
//! [`ServerStore`] is a store on one of its files that reconnects as the
//! NBD store does: it keeps the same [`Unflushed`] record and writes it
//! again before serving anything on the new connection.
//!
//! Files grow as writes reach past their end, as image files on a file
//! server do; a length change is stable at once (the store flushes before
//! it, so that it cuts nothing a restart could bring back). The store's
//! requests are served one at a time (a test of the record, not of
//! concurrency: the NBD store's tests against a real server cover that).
//!
//! Owns: the server's durable and volatile contents, its restarts, the
//! store's connection. Must not: be used on a production path.

use crate::unflushed::{Recorded, Rewritten, Unflushed, UnflushedOp};
use crate::{Backend, BackendRef};
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A request failed because the server restarted under it (its
/// connection is gone).
#[derive(Debug)]
struct Dropped;

/// One file: what its disk holds and what its volatile cache adds.
#[derive(Debug)]
struct VolatileFile {
    durable: Vec<u8>,
    current: Vec<u8>,
    /// Acknowledged since the last flush, oldest first.
    pending: Vec<UnflushedOp>,
}

impl VolatileFile {
    fn apply(data: &mut Vec<u8>, op: &UnflushedOp) {
        match op {
            UnflushedOp::Write {
                offset,
                data: bytes,
            } => {
                let (at, end) = (*offset as usize, *offset as usize + bytes.len());
                if data.len() < end {
                    data.resize(end, 0);
                }
                data[at..end].copy_from_slice(bytes);
            }
            UnflushedOp::Trim { offset, len } => {
                let end = (*offset + *len).min(data.len() as u64) as usize;
                let at = (*offset as usize).min(end);
                data[at..end].fill(0);
            }
        }
    }

    /// Makes everything acknowledged durable.
    fn settle(&mut self) {
        for op in std::mem::take(&mut self.pending) {
            Self::apply(&mut self.durable, &op);
        }
    }
}

#[derive(Debug, Default)]
struct ServerState {
    files: HashMap<String, VolatileFile>,
    /// Writes, trims and flushes served so far, of every file.
    requests: u64,
    /// The request counts at which the server restarts.
    restarts_at: BTreeSet<u64>,
    /// Restarts so far: the generation of its connections.
    restarts: u64,
}

/// A storage server whose write cache does not survive a restart.
#[derive(Debug, Default)]
pub struct VolatileServer {
    state: Mutex<ServerState>,
}

impl VolatileServer {
    /// A server that restarts right before serving its `n`-th
    /// write, trim or flush (counted from 0, all files together), for
    /// each `n` of `restarts_at`.
    pub fn new(restarts_at: impl IntoIterator<Item = u64>) -> Arc<VolatileServer> {
        Arc::new(VolatileServer {
            state: Mutex::new(ServerState {
                restarts_at: restarts_at.into_iter().collect(),
                ..ServerState::default()
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, ServerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a file holding `bytes` on disk (its size is fixed).
    pub fn add(&self, name: &str, bytes: Vec<u8>) {
        self.lock().files.insert(
            name.to_string(),
            VolatileFile {
                current: bytes.clone(),
                durable: bytes,
                pending: Vec::new(),
            },
        );
    }

    /// A store on file `name` (which must exist), keeping up to `limit`
    /// bytes of unflushed writes before it flushes early.
    pub fn store(self: &Arc<Self>, name: &str, limit: u64) -> io::Result<ServerStore> {
        let st = self.lock();
        if !st.files.contains_key(name) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{name}: no such file"),
            ));
        }
        Ok(ServerStore {
            server: self.clone(),
            name: name.to_string(),
            unflushed: Unflushed::new(limit),
            conn: Mutex::new(Connection {
                generation: st.restarts,
                epoch: 0,
            }),
            rewritten: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
        })
    }

    /// What file `name`'s disk holds (its unflushed writes are not there).
    pub fn durable(&self, name: &str) -> Option<Vec<u8>> {
        self.lock().files.get(name).map(|f| f.durable.clone())
    }

    /// Writes, trims and flushes served so far.
    pub fn requests(&self) -> u64 {
        self.lock().requests
    }

    /// Restarts so far.
    pub fn restarts(&self) -> u64 {
        self.lock().restarts
    }

    /// Counts a modifying request, restarting first if its turn came; then
    /// checks that the connection of `generation` is still up.
    fn admit(st: &mut ServerState, generation: u64) -> Result<(), Dropped> {
        if st.restarts_at.remove(&st.requests) {
            st.restarts += 1;
            for f in st.files.values_mut() {
                f.current.clone_from(&f.durable);
                f.pending.clear();
            }
        }
        st.requests += 1;
        if generation == st.restarts {
            Ok(())
        } else {
            Err(Dropped)
        }
    }

    fn change(&self, generation: u64, name: &str, op: &UnflushedOp) -> Result<(), Dropped> {
        let mut st = self.lock();
        Self::admit(&mut st, generation)?;
        if let Some(f) = st.files.get_mut(name) {
            VolatileFile::apply(&mut f.current, op);
            f.pending.push(op.clone());
        }
        Ok(())
    }

    fn flush(&self, generation: u64, name: &str) -> Result<(), Dropped> {
        let mut st = self.lock();
        Self::admit(&mut st, generation)?;
        if let Some(f) = st.files.get_mut(name) {
            f.settle();
        }
        Ok(())
    }

    /// Changes a file's length, stable at once (what was acknowledged
    /// before it becomes durable first).
    fn set_len(&self, generation: u64, name: &str, len: u64) -> Result<(), Dropped> {
        let mut st = self.lock();
        Self::admit(&mut st, generation)?;
        if let Some(f) = st.files.get_mut(name) {
            f.settle();
            f.durable.resize(len as usize, 0);
            f.current.resize(len as usize, 0);
        }
        Ok(())
    }

    fn len(&self, generation: u64, name: &str) -> Result<u64, Dropped> {
        let st = self.lock();
        if generation != st.restarts {
            return Err(Dropped);
        }
        Ok(st.files.get(name).map_or(0, |f| f.current.len() as u64))
    }

    fn read(
        &self,
        generation: u64,
        name: &str,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<(), Dropped> {
        let st = self.lock();
        if generation != st.restarts {
            return Err(Dropped);
        }
        buf.fill(0);
        if let Some(f) = st.files.get(name) {
            let end = (offset.saturating_add(buf.len() as u64)).min(f.current.len() as u64);
            let at = offset.min(end);
            buf[..(end - at) as usize].copy_from_slice(&f.current[at as usize..end as usize]);
        }
        Ok(())
    }

    fn generation(&self) -> u64 {
        self.lock().restarts
    }
}

/// The store's connection: the server generation it belongs to and its
/// epoch in the store's [`Unflushed`] record.
#[derive(Debug)]
struct Connection {
    generation: u64,
    epoch: u64,
}

/// A store on a [`VolatileServer`] file that reconnects and writes again
/// what the server may have lost.
#[derive(Debug)]
pub struct ServerStore {
    server: Arc<VolatileServer>,
    name: String,
    unflushed: Unflushed,
    conn: Mutex<Connection>,
    rewritten: AtomicU64,
    reconnects: AtomicU64,
}

impl ServerStore {
    /// As a shared backend.
    pub fn shared(self) -> BackendRef {
        Arc::new(self)
    }

    /// Writes written again after reconnections, in all.
    pub fn rewritten(&self) -> u64 {
        self.rewritten.load(Ordering::SeqCst)
    }

    /// Reconnections so far.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `op` on the connection, reconnecting (and writing again what
    /// was not flushed) each time the server restarted under it.
    fn call<T>(&self, mut op: impl FnMut(&Connection) -> Result<T, Dropped>) -> io::Result<T> {
        let mut conn = self.lock();
        loop {
            match op(&conn) {
                Ok(v) => return Ok(v),
                Err(Dropped) => self.reconnect(&mut conn),
            }
        }
    }

    /// A new connection, on which everything unflushed is written again
    /// before anything else (a restart during that starts it over).
    fn reconnect(&self, conn: &mut Connection) {
        self.unflushed.lost(conn.epoch);
        loop {
            let generation = self.server.generation();
            let done: Result<Rewritten, Dropped> = self.unflushed.rewrite(
                |op| self.server.change(generation, &self.name, op),
                || self.server.flush(generation, &self.name),
            );
            if let Ok(done) = done {
                self.rewritten.fetch_add(done.writes, Ordering::SeqCst);
                self.reconnects.fetch_add(1, Ordering::SeqCst);
                conn.generation = generation;
                conn.epoch = self.unflushed.epoch();
                return;
            }
        }
    }

    /// Sends a write or trim and records it; flushes early past the bound.
    fn change(&self, op: impl Fn() -> UnflushedOp) -> io::Result<()> {
        let recorded = self.call(|c| {
            self.server.change(c.generation, &self.name, &op())?;
            Ok(self.unflushed.record(c.epoch, &op))
        })?;
        match recorded {
            Recorded::Kept { over_limit: true } => self.flush(),
            Recorded::Kept { over_limit: false } => Ok(()),
            // One connection at a time: a record is never late here.
            Recorded::Stale => Err(io::Error::other("recorded on a lost connection")),
        }
    }
}

impl Backend for ServerStore {
    fn len(&self) -> io::Result<u64> {
        self.call(|c| self.server.len(c.generation, &self.name))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.call(|c| self.server.read(c.generation, &self.name, buf, offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset overflow"))?;
        self.change(|| UnflushedOp::Write {
            offset,
            data: Arc::from(buf),
        })
    }

    fn flush(&self) -> io::Result<()> {
        let mark = self.call(|c| {
            let mark = self.unflushed.mark();
            self.server.flush(c.generation, &self.name)?;
            Ok(mark)
        })?;
        self.unflushed.flushed(mark);
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = len.min(self.len()?.saturating_sub(offset));
        if len == 0 {
            return Ok(());
        }
        self.change(|| UnflushedOp::Trim { offset, len })
    }

    /// Flushes first: a cut is stable at once, and must not drop a write
    /// that a rewrite after a restart would bring back past the new end.
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.flush()?;
        self.call(|c| self.server.set_len(c.generation, &self.name, len))
    }

    fn can_grow(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Fault, inject, serial};
    use rand::{Rng, RngExt, SeedableRng};
    use rand_xoshiro::Xoshiro256PlusPlus;

    const SIZE: usize = 64 << 10;

    /// Runs a seeded mix of writes, trims, flushes and reads on a store
    /// whose server restarts a few times; returns the first place where
    /// the store read or the server's disk (after a last flush) differed
    /// from what the store had acknowledged, and how many writes it wrote
    /// again.
    fn run(seed: u64, limit: u64) -> (Option<String>, u64) {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let restarts: Vec<u64> = (0..3).map(|_| rng.random_range(0..120)).collect();
        let server = VolatileServer::new(restarts);
        let mut model = vec![0u8; SIZE];
        rng.fill_bytes(&mut model);
        server.add("f", model.clone());
        let store = server.store("f", limit).expect("file");
        for i in 0..100 {
            let offset = rng.random_range(0..SIZE as u64 - 1);
            let len = rng.random_range(1..=(SIZE as u64 - offset).min(8192));
            let (a, b) = (offset as usize, (offset + len) as usize);
            let done = match rng.random_range(0..10) {
                0..=5 => {
                    let mut data = vec![0u8; len as usize];
                    rng.fill_bytes(&mut data);
                    model[a..b].copy_from_slice(&data);
                    store.write_at(&data, offset)
                }
                6 => {
                    model[a..b].fill(0);
                    store.discard(offset, len)
                }
                7 | 8 => store.flush(),
                _ => {
                    let mut buf = vec![0u8; len as usize];
                    let r = store.read_at(&mut buf, offset);
                    if buf != model[a..b] {
                        return (
                            Some(format!("seed {seed} op {i}: read {offset}+{len} differs")),
                            0,
                        );
                    }
                    r
                }
            };
            if let Err(e) = done {
                return (Some(format!("seed {seed} op {i}: {e}")), 0);
            }
        }
        if let Err(e) = store.flush() {
            return (Some(format!("seed {seed}: last flush: {e}")), 0);
        }
        let found = (server.durable("f").as_deref() != Some(&model[..]))
            .then(|| format!("seed {seed}: the server's disk differs after the last flush"));
        (found, store.rewritten())
    }

    #[test]
    fn a_restart_loses_nothing_acknowledged_and_serving_on_without_rewriting_does() {
        let _serial = serial();
        let mut rewritten = 0;
        for seed in 0..64 {
            for limit in [u64::MAX, 16 << 10] {
                let (found, n) = run(seed, limit);
                assert_eq!(found, None);
                rewritten += n;
            }
        }
        assert!(rewritten > 0, "no restart caught an unflushed write");
        // The mutation: dropping the record instead of writing it again.
        let _bug = inject(Fault::SkipRewrite);
        let caught = (0..64)
            .filter(|&seed| run(seed, u64::MAX).0.is_some())
            .count();
        assert!(caught > 0, "serving on without rewriting went unnoticed");
    }

    #[test]
    fn past_its_bound_the_store_flushes_early() {
        let _serial = serial();
        // Room for two writes in the record; the server restarts at the
        // fifth request.
        let server = VolatileServer::new([4]);
        server.add("f", vec![0; 4 * 4096]);
        let store = server.store("f", 2 * (4096 + 64)).expect("file");
        for i in 0..3u8 {
            store
                .write_at(&[i + 1; 4096], u64::from(i) * 4096)
                .expect("write");
        }
        // The third write went past the bound and was flushed (the fourth
        // request): the restart before the next write finds nothing to
        // write again.
        store.write_at(&[9; 4096], 3 * 4096).expect("write");
        assert_eq!(
            (server.restarts(), store.reconnects(), store.rewritten()),
            (1, 1, 0)
        );
        let mut disk = vec![0u8; 4 * 4096];
        store.read_at(&mut disk, 0).expect("read");
        assert_eq!(
            disk[..3 * 4096],
            [[1u8; 4096], [2; 4096], [3; 4096]].concat()
        );
        assert_eq!(store.unflushed.pending(), (1, 4096));
    }
}
