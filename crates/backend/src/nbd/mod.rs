//! An image file that lives on an NBD export (a storage server): reads and
//! writes become NBD requests, several in flight from different threads.
//! An export has a fixed size, so the store cannot grow; writing past its
//! end fails with ENOSPC, which the COW layer reports as a full store.
//!
//! The connection is replaced when it drops (server restarted, socket
//! closed): a reconnection to the same URI is tried in the background,
//! 50 ms after the loss and then at doubling intervals up to 2 s, like
//! QEMU's `reconnect-delay`. Requests that failed because the connection
//! dropped are sent again on the new one (a read or write at the same
//! offset is idempotent). While there is no connection, a request waits,
//! but no longer than `reconnect_delay` counted from the loss; after that,
//! requests fail at once with [`StoreFault::Unreachable`] (EIO to a guest)
//! until a reconnection succeeds. A reconnection checks that the export
//! still has the size it had when opened.
//!
//! A storage server with a volatile write cache that restarts loses the
//! writes it acknowledged and no flush covered, while the layers above
//! (the COW layer's metadata, a write-through cache) go on believing them
//! written. The store therefore keeps them ([`Unflushed`], bounded by
//! `unflushed_limit`: past it the store flushes early) and, on every new
//! connection, writes them again in their original order and flushes
//! before the connection serves any request; the log says "reconnected
//! to ..., rewrote N writes (B bytes) not yet flushed". If the server
//! refuses that rewrite, every later request fails with
//! [`StoreFault::RewriteFailed`]: the store never serves on as if nothing
//! happened.
//!
//! The NBD client itself ([`client`]) speaks the protocol of
//! `vdcache-nbd-proto`; it is a backend's tool and never part of the server.
//!
//! Owns: the NBD client, the current connection, reconnection, request
//! retry, rewriting what a reconnection may have lost. Must not: depend on
//! the NBD server (a front end), keep a request waiting past the reconnect
//! delay, or serve on a new connection before the rewrite completed.

pub mod client;
pub mod fuzzing;

pub use client::{ClientError, ClientOptions, NbdClient, ServerErrno};

use crate::unflushed::{DEFAULT_UNFLUSHED_LIMIT, Recorded, Rewritten, Unflushed, UnflushedOp};
use crate::{Backend, StoreFault};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use vdcache_nbd_proto::{NbdUri, Transport};

/// How long requests wait for a lost storage server by default. Long
/// enough for a storage server to restart or a network path to fail over,
/// short enough that a stop (which gives up on an unreachable server once
/// its requests fail) ends in well under systemd's default 90 s.
pub const DEFAULT_RECONNECT_DELAY: Duration = Duration::from_secs(30);

/// First pause between reconnection attempts; it doubles up to the next.
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// NBD errno a server sends for requests it will not serve because it is
/// shutting down: the connection is about to drop.
const ESHUTDOWN: u32 = 108;

/// Settings of NBD-backed stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdOptions {
    /// How long requests wait for a connection after it dropped (counted
    /// from the loss) before they fail. Zero: they fail at once (a
    /// reconnection is still tried).
    pub reconnect_delay: Duration,
    /// Bytes of acknowledged, unflushed writes a store keeps to write
    /// again after a reconnection; past them it flushes early.
    pub unflushed_limit: u64,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            reconnect_delay: DEFAULT_RECONNECT_DELAY,
            unflushed_limit: DEFAULT_UNFLUSHED_LIMIT,
        }
    }
}

/// What reconnections wrote again, of one store or of every NBD store of
/// the process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RewriteTotals {
    /// Reconnections (each followed by a rewrite, perhaps of nothing).
    pub reconnects: u64,
    pub writes: u64,
    pub bytes: u64,
    /// Early flushes because a store's record reached its bound.
    pub early_flushes: u64,
}

/// [`RewriteTotals`] as they are counted.
#[derive(Debug)]
struct Counters {
    reconnects: AtomicU64,
    writes: AtomicU64,
    bytes: AtomicU64,
    early_flushes: AtomicU64,
}

impl Counters {
    const fn new() -> Counters {
        Counters {
            reconnects: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            early_flushes: AtomicU64::new(0),
        }
    }

    fn reconnected(&self, done: Rewritten) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
        self.writes.fetch_add(done.writes, Ordering::Relaxed);
        self.bytes.fetch_add(done.bytes, Ordering::Relaxed);
    }

    fn totals(&self) -> RewriteTotals {
        RewriteTotals {
            reconnects: self.reconnects.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            early_flushes: self.early_flushes.load(Ordering::Relaxed),
        }
    }
}

static PROCESS_TOTALS: Counters = Counters::new();

/// The [`RewriteTotals`] of every NBD store of the process (for `vdcache
/// stats`).
pub fn rewrite_totals() -> RewriteTotals {
    PROCESS_TOTALS.totals()
}

/// Storage servers (by address) that a connection attempt failed to
/// reach, with when the outage began, until one is reached again. Stores
/// on the same server share their outage: the images of a server that went
/// away wait one reconnect delay in all, not one each in turn (a stop
/// closes them one after the other).
fn outages() -> &'static Mutex<HashMap<String, Instant>> {
    static OUTAGES: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    OUTAGES.get_or_init(|| Mutex::new(HashMap::new()))
}

fn server_key(uri: &NbdUri) -> String {
    match &uri.transport {
        Transport::Unix(p) => format!("unix:{}", p.display()),
        Transport::Tcp { host, port } => format!("tcp:{host}:{port}"),
    }
}

fn outage_began(key: &str) -> Option<Instant> {
    outages()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(key)
        .copied()
}

/// Records an outage of `key` that began `since` (an earlier record
/// stands), or its end.
fn record_outage(key: &str, since: Option<Instant>) {
    let mut o = outages().lock().unwrap_or_else(|p| p.into_inner());
    match since {
        Some(t) => {
            o.entry(key.to_string()).or_insert(t);
        }
        None => {
            o.remove(key);
        }
    }
}

/// A store on an NBD export.
pub struct NbdBackend {
    shared: Arc<Shared>,
    chunk: u64,
}

/// What the backend and its reconnecting thread share.
struct Shared {
    name: String,
    uri: NbdUri,
    /// The server's address, for [`outages`].
    server: String,
    size: u64,
    opts: NbdOptions,
    /// What the server acknowledged and no flush covered yet.
    unflushed: Unflushed,
    counters: Counters,
    state: Mutex<State>,
    /// Signalled when a connection is installed, the export turns out to
    /// have changed or the rewrite failed, or the backend is dropped.
    changed: Condvar,
}

struct State {
    link: Option<Arc<Link>>,
    /// When the current outage began (no connection since).
    down_since: Option<Instant>,
    last_error: String,
    /// A reconnecting thread is running.
    connecting: bool,
    /// The export came back with another size: never used again.
    changed_to: Option<u64>,
    /// Writing the unflushed record again failed (why): never used again.
    rewrite_failed: Option<String>,
    /// The backend was dropped: the reconnecting thread ends.
    closed: bool,
}

/// One connection, with its epoch in the [`Unflushed`] record.
struct Link {
    client: NbdClient,
    epoch: u64,
}

impl std::fmt::Debug for NbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdBackend")
            .field("uri", &self.shared.name)
            .field("size", &self.shared.size)
            .finish()
    }
}

fn to_io(e: ClientError) -> io::Error {
    match e.errno().map(|n| n.0) {
        Some(28) => io::Error::from_raw_os_error(libc::ENOSPC),
        Some(1) => io::Error::from_raw_os_error(libc::EPERM),
        Some(22) => io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
        _ => io::Error::other(e.to_string()),
    }
}

/// Whether a request failed because the connection is gone (so it may be
/// sent again on a new one), rather than because the server refused it.
fn connection_lost(e: &ClientError) -> bool {
    match e {
        ClientError::Disconnected(_) => true,
        ClientError::Io(x) => matches!(
            x.kind(),
            io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
                | io::ErrorKind::NotConnected
        ),
        ClientError::Server { errno, .. } => errno.0 == ESHUTDOWN,
        _ => false,
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NbdBackend {
    /// Connects to the export named by `uri` with the default settings.
    pub fn connect(uri: &str) -> io::Result<NbdBackend> {
        Self::connect_with(uri, NbdOptions::default())
    }

    /// Connects to the export named by `uri`. The first connection must
    /// succeed; later ones are made as the module comment says.
    pub fn connect_with(uri: &str, opts: NbdOptions) -> io::Result<NbdBackend> {
        let parsed = NbdUri::parse(uri).map_err(|e| io::Error::other(format!("{uri}: {e}")))?;
        let client = NbdClient::connect_with(&parsed, &ClientOptions::default())
            .map_err(|e| io::Error::other(format!("{uri}: {e}")))?;
        let size = client.size();
        let chunk = u64::from(client.block_sizes().maximum).clamp(4096, 32 << 20);
        let server = server_key(&parsed);
        record_outage(&server, None);
        let unflushed = Unflushed::new(opts.unflushed_limit);
        let epoch = unflushed.epoch();
        Ok(NbdBackend {
            shared: Arc::new(Shared {
                name: uri.to_string(),
                uri: parsed,
                server,
                size,
                opts,
                unflushed,
                counters: Counters::new(),
                state: Mutex::new(State {
                    link: Some(Arc::new(Link { client, epoch })),
                    down_since: None,
                    last_error: String::new(),
                    connecting: false,
                    changed_to: None,
                    rewrite_failed: None,
                    closed: false,
                }),
                changed: Condvar::new(),
            }),
            chunk,
        })
    }

    /// What this store's reconnections wrote again.
    pub fn rewrites(&self) -> RewriteTotals {
        self.shared.counters.totals()
    }

    fn check_room(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.shared.size => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
        }
    }

    /// Runs `op` on the current connection, again on the next one each
    /// time the connection drops under it, until it succeeds, the server
    /// refuses it, or no connection comes within the reconnect delay.
    fn run<T>(&self, mut op: impl FnMut(&Link) -> Result<T, ClientError>) -> io::Result<T> {
        // A server that accepts connections and drops each one under the
        // request must not keep it going round forever.
        let mut first_loss: Option<Instant> = None;
        loop {
            let link = self.shared.current()?;
            match op(&link) {
                Ok(v) => return Ok(v),
                Err(e) if connection_lost(&e) => {
                    self.shared.retire(&link, &e);
                    let since = *first_loss.get_or_insert_with(Instant::now);
                    if since.elapsed() > self.shared.opts.reconnect_delay {
                        return Err(StoreFault::Unreachable {
                            uri: self.shared.name.clone(),
                            waited_secs: since.elapsed().as_secs_f64(),
                            delay_secs: self.shared.opts.reconnect_delay.as_secs_f64(),
                            last_error: e.to_string(),
                        }
                        .into_io());
                    }
                }
                Err(e) => return Err(to_io(e)),
            }
        }
    }

    /// Sends a write or trim (`send`) and records it as `op` builds it,
    /// again on the next connection when the one that acknowledged it
    /// dropped before it was recorded (the rewrite may have missed it);
    /// flushes early when the record reached its bound.
    fn change(
        &self,
        send: impl Fn(&NbdClient) -> Result<(), ClientError>,
        op: impl Fn() -> UnflushedOp,
    ) -> io::Result<()> {
        let recorded = self.run(|l| {
            send(&l.client)?;
            match self.shared.unflushed.record(l.epoch, &op) {
                Recorded::Stale => Err(ClientError::Disconnected(
                    "the connection dropped before the write was recorded".into(),
                )),
                kept => Ok(kept),
            }
        })?;
        if matches!(recorded, Recorded::Kept { over_limit: true }) {
            for c in [&PROCESS_TOTALS, &self.shared.counters] {
                c.early_flushes.fetch_add(1, Ordering::Relaxed);
            }
            self.flush()?;
        }
        Ok(())
    }
}

impl Shared {
    /// The current connection, waiting for a reconnection when there is
    /// none (no longer than the reconnect delay from the loss).
    fn current(self: &Arc<Self>) -> io::Result<Arc<Link>> {
        let mut st = lock(&self.state);
        loop {
            if let Some(now) = st.changed_to {
                return Err(StoreFault::ExportChanged {
                    uri: self.name.clone(),
                    was: self.size,
                    now,
                }
                .into_io());
            }
            if let Some(reason) = &st.rewrite_failed {
                return Err(StoreFault::RewriteFailed {
                    uri: self.name.clone(),
                    reason: reason.clone(),
                }
                .into_io());
            }
            if let Some(l) = &st.link {
                return Ok(l.clone());
            }
            let own = *st.down_since.get_or_insert_with(Instant::now);
            let since = outage_began(&self.server).map_or(own, |t| t.min(own));
            self.start_reconnecting(&mut st);
            let deadline = since + self.opts.reconnect_delay;
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreFault::Unreachable {
                    uri: self.name.clone(),
                    waited_secs: now.duration_since(since).as_secs_f64(),
                    delay_secs: self.opts.reconnect_delay.as_secs_f64(),
                    last_error: st.last_error.clone(),
                }
                .into_io());
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Gives up `link` after `why` showed it dropped: what it acknowledged
    /// and did not record yet is refused from now on (its writers send it
    /// again), and a reconnection starts.
    fn retire(self: &Arc<Self>, link: &Arc<Link>, why: &ClientError) {
        let old = {
            let mut st = lock(&self.state);
            self.unflushed.lost(link.epoch);
            if !st.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
                // Another request saw the loss first.
                return;
            }
            tracing::warn!(
                "{}: lost the connection to the storage server ({why}); reconnecting (requests wait up to {:.1} s)",
                self.name,
                self.opts.reconnect_delay.as_secs_f64()
            );
            st.down_since = Some(Instant::now());
            st.last_error = why.to_string();
            self.start_reconnecting(&mut st);
            st.link.take()
        };
        // Closing it joins its reader, which is done (or ends as the
        // socket is shut down); never under the state lock.
        drop(old);
    }

    fn start_reconnecting(self: &Arc<Self>, st: &mut State) {
        if st.connecting || st.closed || st.changed_to.is_some() || st.rewrite_failed.is_some() {
            return;
        }
        let me = self.clone();
        match std::thread::Builder::new()
            .name("nbd-reconnect".into())
            .spawn(move || me.reconnect())
        {
            Ok(_) => st.connecting = true,
            Err(e) => st.last_error = format!("cannot start a reconnecting thread: {e}"),
        }
    }

    /// The reconnecting thread: tries until a connection to the same
    /// export is made and the unflushed record written again on it, the
    /// export proves changed, the server refuses the rewrite, or the
    /// backend is gone.
    fn reconnect(self: Arc<Self>) {
        let mut pause = BACKOFF_FIRST;
        let started = Instant::now();
        loop {
            {
                let st = lock(&self.state);
                let st = self
                    .changed
                    .wait_timeout_while(st, pause, |s| !s.closed)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
                if st.closed {
                    return;
                }
            }
            let attempt = NbdClient::connect_with(&self.uri, &ClientOptions::default());
            let mut st = lock(&self.state);
            match attempt {
                Ok(client) if st.closed => {
                    drop(st);
                    drop(client);
                    return;
                }
                Ok(client) if client.size() != self.size => {
                    tracing::error!(
                        "{}: reconnected, but the export is now {} bytes, not {}: it is not the same image; giving it up",
                        self.name,
                        client.size(),
                        self.size
                    );
                    st.changed_to = Some(client.size());
                    st.connecting = false;
                    self.changed.notify_all();
                    drop(st);
                    drop(client);
                    return;
                }
                Ok(client) => {
                    drop(st);
                    match self.rewrite_on(&client) {
                        Ok(done) => {
                            self.install(client, done, started);
                            return;
                        }
                        Err(e) if connection_lost(&e) => {
                            let mut st = lock(&self.state);
                            st.last_error = e.to_string();
                            pause = (pause * 2).min(BACKOFF_MAX);
                        }
                        Err(e) => {
                            self.give_up_rewriting(&e);
                            return;
                        }
                    }
                }
                Err(e) => {
                    st.last_error = e.to_string();
                    record_outage(&self.server, st.down_since);
                    pause = (pause * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

impl Shared {
    /// Writes the unflushed record again on `client`, in order, and
    /// flushes. A trim the server now refuses is skipped: what a trim
    /// leaves was never promised.
    fn rewrite_on(&self, client: &NbdClient) -> Result<Rewritten, ClientError> {
        self.unflushed.rewrite(
            |op| match op {
                UnflushedOp::Write { offset, data } => client.write_at(*offset, data, false),
                UnflushedOp::Trim { offset, len } => match client.trim(*offset, *len, false) {
                    Err(e) if !connection_lost(&e) => Ok(()),
                    r => r,
                },
            },
            || client.flush(),
        )
    }

    /// Serves on `client`, whose rewrite is `done`.
    fn install(&self, client: NbdClient, done: Rewritten, started: Instant) {
        let mut st = lock(&self.state);
        if st.closed {
            drop(st);
            drop(client);
            return;
        }
        record_outage(&self.server, None);
        PROCESS_TOTALS.reconnected(done);
        self.counters.reconnected(done);
        tracing::warn!(
            "{}: reconnected to the storage server after {:.1} s, rewrote {} writes ({} bytes) not yet flushed",
            self.name,
            started.elapsed().as_secs_f64(),
            done.writes,
            done.bytes
        );
        st.link = Some(Arc::new(Link {
            client,
            epoch: self.unflushed.epoch(),
        }));
        st.down_since = None;
        st.connecting = false;
        self.changed.notify_all();
    }

    /// The server refused the rewrite (`why`): every later request fails.
    fn give_up_rewriting(&self, why: &ClientError) {
        let (writes, bytes) = self.unflushed.pending();
        tracing::error!(
            "{}: reconnected, but writing again the {writes} writes ({bytes} bytes) the storage server had acknowledged and not flushed failed ({why}); the image may be missing them: every request to it fails from now on",
            self.name
        );
        let mut st = lock(&self.state);
        st.rewrite_failed = Some(why.to_string());
        st.connecting = false;
        self.changed.notify_all();
    }
}

impl Drop for NbdBackend {
    fn drop(&mut self) {
        let link = {
            let mut st = lock(&self.shared.state);
            st.closed = true;
            self.shared.changed.notify_all();
            st.link.take()
        };
        drop(link);
    }
}

impl Backend for NbdBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(self.shared.size)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let inside = self
            .shared
            .size
            .saturating_sub(offset)
            .min(buf.len() as u64) as usize;
        buf[inside..].fill(0);
        let mut done = 0usize;
        while done < inside {
            let n = (inside - done).min(self.chunk as usize);
            let part = &mut buf[done..done + n];
            self.run(|l| l.client.read_at(offset + done as u64, part))?;
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_room(offset, buf.len() as u64)?;
        let mut done = 0usize;
        while done < buf.len() {
            let n = (buf.len() - done).min(self.chunk as usize);
            let part = &buf[done..done + n];
            let at = offset + done as u64;
            self.change(
                |c| c.write_at(at, part, false),
                || UnflushedOp::Write {
                    offset: at,
                    data: Arc::from(part),
                },
            )?;
            done += n;
        }
        Ok(())
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        // One request (one network round trip) for the whole run.
        let joined: Vec<u8> = bufs.concat();
        self.write_at(&joined, offset)
    }

    fn flush(&self) -> io::Result<()> {
        // A flush covers the writes recorded before it was sent (each was
        // acknowledged before it was recorded).
        let mark = self.run(|l| {
            let mark = self.shared.unflushed.mark();
            l.client.flush().map(|()| mark)
        })?;
        self.shared.unflushed.flushed(mark);
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = len.min(self.shared.size.saturating_sub(offset));
        if len == 0 {
            return Ok(());
        }
        self.change(
            |c| c.trim(offset, len, false),
            || UnflushedOp::Trim { offset, len },
        )
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len == self.shared.size {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: an NBD export cannot change size", self.shared.name),
            ))
        }
    }

    fn can_grow(&self) -> bool {
        false
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn identity(&self) -> io::Result<crate::StoreIdentity> {
        // An export says nothing of its file but its size.
        Ok(crate::StoreIdentity {
            size: self.shared.size,
            ..crate::StoreIdentity::default()
        })
    }
}
