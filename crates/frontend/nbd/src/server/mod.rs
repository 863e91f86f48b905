//! The NBD server: named exports, listeners (Unix socket by default, TCP on
//! request, TLS when configured), connection bookkeeping, statistics and
//! graceful shutdown.
//!
//! Owns: accept loops, the connection table and its limits (total, per
//! client, connections still in the handshake, the handshake deadline and
//! the reaper thread that enforces it), the server-wide budget of buffered
//! payload bytes, the shutdown sequence (stop accepting, stop reading new
//! requests, let in-flight requests finish, wait for every connection
//! thread), the listening sockets (bound and removed through
//! `vdcache-ownership`: mode 0600, never over a file of someone else's).
//! Must not: parse protocol messages (see `handshake` and `conn`), touch
//! export data, evict a connection that finished its handshake, or install
//! signal handlers (the binary owns signals and calls
//! [`ShutdownHandle::shutdown`]).

mod budget;
mod conn;
mod handshake;
mod outbox;
mod payloads;

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, info, warn};

use crate::export::Export;
use vdcache_nbd_proto::proto;
use vdcache_nbd_proto::tls::TlsServerConfig;
use vdcache_nbd_proto::transport::{PeerId, Socket};
use vdcache_ownership::{OwnedSocket, OwnershipError, SocketAccess};

/// Errors of building or starting a server.
#[derive(Debug, Error)]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("{path}: something is already listening on this socket")]
    AddressInUse { path: PathBuf },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error(transparent)]
    Socket(OwnershipError),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

/// Resource limits; every one bounds what a client can make the server hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections served at once; a connection over the limit evicts a
    /// connection still in its handshake (as with `max_handshakes`), or is
    /// closed at once if every connection finished its handshake.
    pub max_connections: usize,
    /// Connections still in the handshake (before TLS and option
    /// negotiation complete). A connection over this limit evicts the
    /// oldest handshake of the client holding the most, so idle or slow
    /// connections cannot keep real clients out, and connections that
    /// completed their handshake are never evicted for newcomers.
    pub max_handshakes: usize,
    /// Connections from one TCP client (one IP address). Over it, the
    /// client's oldest connection still in its handshake is evicted, or
    /// the new one is closed.
    pub max_connections_per_ip: usize,
    /// Connections from one Unix socket client (one uid, from
    /// `SO_PEERCRED`). The socket is mode 0600, so its clients are the
    /// server's own user and root: by default only `max_connections`
    /// applies, so a host whose VMs all connect as one user can use every
    /// slot.
    pub max_connections_per_uid: usize,
    /// Worker threads per connection (started on demand).
    pub workers_per_connection: usize,
    /// Largest READ/WRITE payload (also caps the advertised maximum block size).
    pub max_payload: u32,
    /// Payloads larger than this are never buffered whole: they are
    /// streamed between the socket and the export in pieces of this size
    /// (write pieces are stored in parallel as they arrive).
    pub payload_chunk: u32,
    /// Payload bytes buffered across all connections (write data not yet
    /// stored, read data not yet sent) before connections wait for room.
    /// A connection holding none may still take a piece of 64 KiB, so the
    /// server holds at most this plus `max_connections * 64 KiB`.
    pub max_buffered_bytes: u64,
    /// Payload bytes of requests in flight per connection before the server
    /// stops reading more (one request is always allowed).
    pub max_inflight_bytes: u64,
    /// Requests in flight per connection before the server stops reading more.
    pub max_inflight_requests: usize,
    /// Largest option the handshake accepts; longer ones end the connection.
    pub max_option_len: u32,
    /// Options per handshake; more end the connection.
    pub max_options: u32,
    /// Time a client may take for the whole handshake, from accept to the
    /// transmission phase, however slowly it trickles bytes (`None`:
    /// unlimited). Past it the connection is closed.
    pub handshake_timeout: Option<Duration>,
    /// On shutdown, time given to connections to finish in-flight requests
    /// before their sockets are shut down hard (`None`: wait forever).
    pub shutdown_grace: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            max_handshakes: 64,
            max_connections_per_ip: 64,
            max_connections_per_uid: 256,
            workers_per_connection: 4,
            max_payload: 32 << 20,
            payload_chunk: 1 << 20,
            max_buffered_bytes: 256 << 20,
            max_inflight_bytes: 64 << 20,
            max_inflight_requests: 128,
            max_option_len: 64 << 10,
            max_options: 1024,
            handshake_timeout: Some(Duration::from_secs(10)),
            shutdown_grace: Some(Duration::from_secs(30)),
        }
    }
}

impl Limits {
    fn per_client(&self, client: PeerId) -> usize {
        match client {
            PeerId::Uid(_) => self.max_connections_per_uid,
            PeerId::Ip(_) | PeerId::Unknown => self.max_connections_per_ip,
        }
    }
}

/// Request and byte counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Requests answered (including errors).
    pub requests: u64,
    /// Bytes returned by READ.
    pub bytes_read: u64,
    /// Bytes stored by WRITE.
    pub bytes_written: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

/// One live connection.
#[derive(Debug, Clone)]
pub struct ConnectionStats {
    pub id: u64,
    pub peer: String,
    /// Export selected, once in the transmission phase.
    pub export: Option<String>,
    pub tls: bool,
    pub io: IoStats,
}

/// One export, summed over all its connections, past and present.
#[derive(Debug, Clone)]
pub struct ExportStats {
    pub name: String,
    pub active_connections: u64,
    pub total_connections: u64,
    pub io: IoStats,
}

/// A snapshot of the server's counters.
#[derive(Debug, Clone)]
pub struct ServerStats {
    pub exports: Vec<ExportStats>,
    pub connections: Vec<ConnectionStats>,
    /// Connections accepted since start.
    pub accepted: u64,
    /// Connections closed at once because the total or the per-client
    /// limit was reached by connections that finished their handshake.
    pub refused: u64,
    /// Connections still in their handshake now.
    pub handshakes: u64,
    /// Connections closed in their handshake to make room for a newer one.
    pub evicted: u64,
    /// Connections closed because their handshake took longer than
    /// `Limits::handshake_timeout`.
    pub handshake_timeouts: u64,
    /// Payload bytes buffered now (see `Limits::max_buffered_bytes`).
    pub buffered_bytes: u64,
    /// Most payload bytes ever buffered at once.
    pub buffered_bytes_peak: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    requests: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    pub(crate) fn record(&self, read: u64, written: u64, error: bool) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes_read.fetch_add(read, Ordering::Relaxed);
        self.bytes_written.fetch_add(written, Ordering::Relaxed);
        if error {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn snapshot(&self) -> IoStats {
        IoStats {
            requests: self.requests.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

pub(crate) struct ExportEntry {
    pub(crate) name: String,
    pub(crate) description: Option<String>,
    pub(crate) export: Arc<dyn Export>,
    pub(crate) counters: Counters,
    active: AtomicU64,
    total: AtomicU64,
}

/// Bookkeeping for one live connection.
struct ConnEntry {
    ctl: Socket,
    peer: String,
    client: PeerId,
    info: Arc<ConnInfo>,
    phase: Phase,
}

/// Where a connection is, for the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Negotiating; may be evicted, and closed at its deadline.
    Handshake { deadline: Option<Instant> },
    /// In the transmission phase (after TLS when it is required).
    Established,
    /// Evicted or timed out: its socket is shut down and its thread is
    /// leaving; it no longer counts against any limit.
    Leaving,
}

/// The connection table (ids grow with time: a smaller id is older).
#[derive(Default)]
struct ConnTable {
    entries: HashMap<u64, ConnEntry>,
    /// The reaper waits without a deadline: a new handshake must wake it.
    reaper_idle: bool,
}

/// What a connection thread publishes about itself.
#[derive(Default)]
pub(crate) struct ConnInfo {
    pub(crate) counters: Counters,
    pub(crate) export: Mutex<Option<String>>,
    pub(crate) tls: AtomicBool,
}

struct Listener {
    thread: Option<JoinHandle<()>>,
    wake: OwnedFd,
    /// Removed (if still ours) when the listener stops.
    socket: Option<OwnedSocket>,
}

pub(crate) struct ServerInner {
    pub(crate) exports: Vec<ExportEntry>,
    pub(crate) limits: Limits,
    pub(crate) tls: Option<TlsServerConfig>,
    pub(crate) stopping: AtomicBool,
    conns: Mutex<ConnTable>,
    /// Signalled when a connection leaves the table.
    conns_cv: Condvar,
    /// Wakes the reaper (a new handshake to watch, or shutdown).
    reaper_cv: Condvar,
    reaper: Mutex<Option<JoinHandle<()>>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    handshake_timeouts: AtomicU64,
    listeners: Mutex<Vec<Listener>>,
    shutdown_done: Mutex<bool>,
    conn_threads: Arc<LiveThreads>,
    payloads: payloads::PayloadPool,
    budget: budget::PayloadBudget,
}

/// Connection threads that may still hold the server. A thread leaves the
/// connection table before it lets go of the server, so shutdown waits for
/// this count too: once it returns, nothing of the server holds an export
/// (nor what an export holds, such as a cache device and its lock).
#[derive(Default)]
struct LiveThreads {
    count: Mutex<usize>,
    none_left: Condvar,
}

impl LiveThreads {
    fn enter(&self) {
        *lock(&self.count) += 1;
    }

    fn leave(&self) {
        let mut n = lock(&self.count);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.none_left.notify_all();
        }
    }

    fn wait_for_none(&self) {
        let mut n = lock(&self.count);
        while *n > 0 {
            n = self.none_left.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ServerInner {
    pub(crate) fn find_export(&self, name: &str) -> Option<&ExportEntry> {
        self.exports.iter().find(|e| e.name == name)
    }

    /// Registers a connection and runs it on its own thread, making room
    /// for it or closing it as the limits say.
    fn spawn_connection(self: &Arc<Self>, sock: Socket) {
        if self.stopping.load(Ordering::SeqCst) {
            let _ = sock.shutdown(Shutdown::Both);
            return;
        }
        let ctl = match sock.try_clone() {
            Ok(c) => c,
            Err(e) => {
                warn!("nbd: cannot clone accepted socket: {e}");
                return;
            }
        };
        let client = sock.client();
        let peer = sock.peer();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let info = Arc::new(ConnInfo::default());
        self.start_reaper();
        {
            let mut table = lock(&self.conns);
            let live = table.entries.iter().filter_map(|(id, c)| match c.phase {
                Phase::Handshake { .. } => Some((*id, c.client, true)),
                Phase::Established => Some((*id, c.client, false)),
                Phase::Leaving => None,
            });
            let evict = match admit(live, client, &self.limits) {
                Ok(evict) => evict,
                Err(why) => {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    warn!("nbd: {why} reached, refusing a connection from {peer}");
                    let _ = sock.shutdown(Shutdown::Both);
                    return;
                }
            };
            for old in evict {
                if let Some(c) = table.entries.get_mut(&old) {
                    debug!(
                        "nbd: evicting connection {old} ({}) still in its handshake",
                        c.peer
                    );
                    c.phase = Phase::Leaving;
                    let _ = c.ctl.shutdown(Shutdown::Both);
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                }
            }
            let deadline = self.limits.handshake_timeout.map(|t| Instant::now() + t);
            table.entries.insert(
                id,
                ConnEntry {
                    ctl,
                    peer,
                    client,
                    info: info.clone(),
                    phase: Phase::Handshake { deadline },
                },
            );
            if deadline.is_some() && table.reaper_idle {
                table.reaper_idle = false;
                self.reaper_cv.notify_one();
            }
        }
        self.accepted.fetch_add(1, Ordering::Relaxed);
        let inner = self.clone();
        let live = self.conn_threads.clone();
        live.enter();
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                run_connection(inner, id, sock, info);
                live.leave();
            });
        if let Err(e) = spawned {
            warn!("nbd: cannot start a connection thread: {e}");
            lock(&self.conns).entries.remove(&id);
            self.conns_cv.notify_all();
            self.conn_threads.leave();
        }
    }

    /// Marks a connection's handshake complete; false if it was evicted or
    /// timed out meanwhile (its socket is already shut down).
    pub(crate) fn established(&self, id: u64) -> bool {
        let mut table = lock(&self.conns);
        match table.entries.get_mut(&id) {
            Some(c) if matches!(c.phase, Phase::Handshake { .. }) => {
                c.phase = Phase::Established;
                true
            }
            _ => false,
        }
    }

    /// Starts the thread that enforces the handshake deadline, once (with
    /// the first listener, or the first connection without one).
    fn start_reaper(self: &Arc<Self>) {
        if self.limits.handshake_timeout.is_none() {
            return;
        }
        let mut reaper = lock(&self.reaper);
        if reaper.is_some() || self.stopping.load(Ordering::SeqCst) {
            return;
        }
        let inner = self.clone();
        match std::thread::Builder::new()
            .name("nbd-reaper".into())
            .spawn(move || inner.reap())
        {
            Ok(t) => *reaper = Some(t),
            // Only the deadline is lost; the per-client and handshake
            // limits still keep room for real clients.
            Err(e) => warn!("nbd: cannot start the handshake reaper thread: {e}"),
        }
    }

    /// Closes connections whose handshake is past its deadline, until
    /// shutdown. Shutting the socket down ends whatever the connection's
    /// thread waits for (a read, a write, a TLS handshake).
    fn reap(&self) {
        let mut table = lock(&self.conns);
        while !self.stopping.load(Ordering::SeqCst) {
            let now = Instant::now();
            let mut next: Option<Instant> = None;
            for (id, c) in table.entries.iter_mut() {
                let Phase::Handshake {
                    deadline: Some(deadline),
                } = c.phase
                else {
                    continue;
                };
                if deadline <= now {
                    warn!(
                        "nbd: connection {id} ({}) did not finish its handshake in time, closing it",
                        c.peer
                    );
                    c.phase = Phase::Leaving;
                    let _ = c.ctl.shutdown(Shutdown::Both);
                    self.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                } else {
                    next = Some(next.map_or(deadline, |n| n.min(deadline)));
                }
            }
            table = match next {
                Some(at) => {
                    table.reaper_idle = false;
                    let wait = at.saturating_duration_since(now);
                    self.reaper_cv
                        .wait_timeout(table, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
                None => {
                    table.reaper_idle = true;
                    self.reaper_cv
                        .wait(table)
                        .unwrap_or_else(|p| p.into_inner())
                }
            };
        }
    }

    fn accept_loop(self: Arc<Self>, listener: ListenerSocket, wake: OwnedFd) {
        use rustix::event::{PollFd, PollFlags, poll};
        loop {
            let (l_ready, w_ready) = {
                let mut fds = [
                    PollFd::new(&listener, PollFlags::IN),
                    PollFd::new(&wake, PollFlags::IN),
                ];
                match poll(&mut fds, None) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => {
                        warn!("nbd: poll on listener failed: {e}");
                        return;
                    }
                }
                (!fds[0].revents().is_empty(), !fds[1].revents().is_empty())
            };
            if w_ready || self.stopping.load(Ordering::SeqCst) {
                return;
            }
            if !l_ready {
                continue;
            }
            match listener.accept() {
                Ok(sock) => self.spawn_connection(sock),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Typically EMFILE: back off instead of spinning.
                    warn!("nbd: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

/// A connection thread's work; everything it holds of the server is
/// dropped when it returns.
fn run_connection(inner: Arc<ServerInner>, id: u64, sock: Socket, info: Arc<ConnInfo>) {
    let _guard = ConnGuard {
        inner: inner.clone(),
        id,
    };
    conn::serve(&inner, id, sock, &info);
}

struct ConnGuard {
    inner: Arc<ServerInner>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.inner.conns).entries.remove(&self.id);
        self.inner.conns_cv.notify_all();
    }
}

/// Decides whether a connection from `client` may join the live ones
/// (`(id, client, still in handshake)`): `Ok` with the handshakes to evict
/// for room, or `Err` naming the limit that connections past their
/// handshake already fill.
fn admit(
    live: impl Iterator<Item = (u64, PeerId, bool)>,
    client: PeerId,
    limits: &Limits,
) -> Result<Vec<u64>, &'static str> {
    let mut live: Vec<(u64, PeerId, bool)> = live.collect();
    let mut evict = Vec::new();
    let mut remove = |live: &mut Vec<(u64, PeerId, bool)>, id: u64| {
        live.retain(|e| e.0 != id);
        evict.push(id);
    };
    let oldest_handshake = |live: &[(u64, PeerId, bool)], of: PeerId| {
        live.iter().filter(|e| e.2 && e.1 == of).map(|e| e.0).min()
    };
    // The client with the most handshakes loses its oldest one (ties: the
    // oldest handshake), so a flood evicts itself before anyone else.
    let heaviest_handshake = |live: &[(u64, PeerId, bool)]| {
        let mut per: HashMap<PeerId, (usize, u64)> = HashMap::new();
        for e in live.iter().filter(|e| e.2) {
            let v = per.entry(e.1).or_insert((0, e.0));
            v.0 += 1;
            v.1 = v.1.min(e.0);
        }
        per.into_iter()
            .max_by_key(|(_, (n, oldest))| (*n, std::cmp::Reverse(*oldest)))
            .map(|(_, (_, oldest))| oldest)
    };
    while live.iter().filter(|e| e.1 == client).count() >= limits.per_client(client) {
        let Some(id) = oldest_handshake(&live, client) else {
            return Err("the per-client connection limit");
        };
        remove(&mut live, id);
    }
    while live.iter().filter(|e| e.2).count() >= limits.max_handshakes {
        let Some(id) = heaviest_handshake(&live) else {
            break;
        };
        remove(&mut live, id);
    }
    while live.len() >= limits.max_connections {
        let Some(id) = heaviest_handshake(&live) else {
            return Err("the connection limit");
        };
        remove(&mut live, id);
    }
    Ok(evict)
}

enum ListenerSocket {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl AsFd for ListenerSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            ListenerSocket::Unix(l) => l.as_fd(),
            ListenerSocket::Tcp(l) => l.as_fd(),
        }
    }
}

impl ListenerSocket {
    fn accept(&self) -> io::Result<Socket> {
        match self {
            ListenerSocket::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok(Socket::Unix(s))
            }
            ListenerSocket::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                let _ = s.set_nodelay(true);
                Ok(Socket::Tcp(s))
            }
        }
    }
}

/// Builds a [`Server`].
pub struct ServerBuilder {
    exports: Vec<(String, Option<String>, Arc<dyn Export>)>,
    limits: Limits,
    tls: Option<TlsServerConfig>,
}

impl Default for ServerBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerBuilder {
    pub fn new() -> Self {
        ServerBuilder {
            exports: Vec::new(),
            limits: Limits::default(),
            tls: None,
        }
    }

    /// Adds an export; `""` is the default export.
    pub fn export(mut self, name: impl Into<String>, export: Arc<dyn Export>) -> Self {
        self.exports.push((name.into(), None, export));
        self
    }

    /// Adds an export with a description shown by `nbdinfo` and `NBD_OPT_LIST`.
    pub fn export_with_description(
        mut self,
        name: impl Into<String>,
        description: impl Into<String>,
        export: Arc<dyn Export>,
    ) -> Self {
        self.exports
            .push((name.into(), Some(description.into()), export));
        self
    }

    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn max_connections(mut self, n: usize) -> Self {
        self.limits.max_connections = n;
        self
    }

    pub fn workers_per_connection(mut self, n: usize) -> Self {
        self.limits.workers_per_connection = n;
        self
    }

    /// Requires TLS on every connection (FORCEDTLS mode).
    pub fn tls(mut self, tls: TlsServerConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    pub fn build(self) -> Result<Server, ServerError> {
        let mut seen = std::collections::HashSet::new();
        for (name, desc, _) in &self.exports {
            if name.len() > proto::MAX_STRING || name.contains('\0') {
                return Err(ServerError::Config(format!("invalid export name {name:?}")));
            }
            if desc.as_ref().is_some_and(|d| d.len() > proto::MAX_STRING) {
                return Err(ServerError::Config(format!(
                    "description of {name:?} too long"
                )));
            }
            if !seen.insert(name.clone()) {
                return Err(ServerError::Config(format!("export {name:?} given twice")));
            }
        }
        if self.exports.is_empty() {
            return Err(ServerError::Config("no exports".into()));
        }
        let l = &self.limits;
        if l.max_connections == 0
            || l.max_handshakes == 0
            || l.max_connections_per_ip == 0
            || l.max_connections_per_uid == 0
            || l.workers_per_connection == 0
            || l.max_inflight_requests == 0
        {
            return Err(ServerError::Config(
                "connection, worker and in-flight limits must be positive".into(),
            ));
        }
        // A data chunk's length (offset + data) must fit its u32 field.
        if l.max_payload < 4096 || l.max_payload > u32::MAX - 8 {
            return Err(ServerError::Config(
                "max_payload must be at least 4096 and below 4 GiB - 8".into(),
            ));
        }
        if l.payload_chunk < 4096 || l.payload_chunk > l.max_payload {
            return Err(ServerError::Config(
                "payload_chunk must be at least 4096 and at most max_payload".into(),
            ));
        }
        if l.max_buffered_bytes < u64::from(l.payload_chunk) {
            return Err(ServerError::Config(
                "max_buffered_bytes must be at least payload_chunk".into(),
            ));
        }
        if l.handshake_timeout == Some(Duration::ZERO) {
            return Err(ServerError::Config(
                "handshake_timeout must be positive (or none)".into(),
            ));
        }
        if l.max_option_len < 1024 {
            return Err(ServerError::Config(
                "max_option_len must be at least 1024".into(),
            ));
        }
        let exports = self
            .exports
            .into_iter()
            .map(|(name, description, export)| ExportEntry {
                name,
                description,
                export,
                counters: Counters::default(),
                active: AtomicU64::new(0),
                total: AtomicU64::new(0),
            })
            .collect();
        Ok(Server {
            inner: Arc::new(ServerInner {
                exports,
                tls: self.tls,
                stopping: AtomicBool::new(false),
                conns: Mutex::new(ConnTable::default()),
                conns_cv: Condvar::new(),
                reaper_cv: Condvar::new(),
                reaper: Mutex::new(None),
                next_id: AtomicU64::new(1),
                accepted: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                evicted: AtomicU64::new(0),
                handshake_timeouts: AtomicU64::new(0),
                listeners: Mutex::new(Vec::new()),
                shutdown_done: Mutex::new(false),
                conn_threads: Arc::default(),
                payloads: payloads::PayloadPool::default(),
                budget: budget::PayloadBudget::new(self.limits.max_buffered_bytes),
                limits: self.limits,
            }),
        })
    }
}

/// An NBD server serving a fixed set of exports from background threads.
/// Dropping it shuts it down (as [`Server::shutdown`]).
pub struct Server {
    inner: Arc<ServerInner>,
}

/// A cloneable handle that shuts the server down from anywhere (a signal
/// thread, for instance).
#[derive(Clone)]
pub struct ShutdownHandle {
    inner: Arc<ServerInner>,
}

impl ShutdownHandle {
    /// See [`Server::shutdown`].
    pub fn shutdown(&self) {
        shutdown(&self.inner);
    }
}

impl Server {
    pub fn builder() -> ServerBuilder {
        ServerBuilder::new()
    }

    /// Listens on a Unix socket created with mode 0600. An existing socket
    /// file is replaced only if nothing accepts connections on it.
    pub fn listen_unix(&self, path: impl AsRef<Path>) -> Result<(), ServerError> {
        self.listen_unix_with(path, &SocketAccess::default())
    }

    /// [`Server::listen_unix`] on a socket that appears with `access`.
    pub fn listen_unix_with(
        &self,
        path: impl AsRef<Path>,
        access: &SocketAccess,
    ) -> Result<(), ServerError> {
        let path = path.as_ref();
        if self.inner.stopping.load(Ordering::SeqCst) {
            return Err(ServerError::ShuttingDown);
        }
        let (listener, owned) = OwnedSocket::bind_with(path, access).map_err(|e| match e {
            OwnershipError::InUse { path } => ServerError::AddressInUse { path },
            other => ServerError::Socket(other),
        })?;
        listener.set_nonblocking(true)?;
        self.start_listener(ListenerSocket::Unix(listener), Some(owned))?;
        info!("nbd: listening on unix socket {}", path.display());
        Ok(())
    }

    /// Listens on TCP; returns the bound address (useful with port 0).
    /// Without TLS anyone who can reach the address can read and write the
    /// exports: whether that is acceptable, and saying so in the log, is
    /// the caller's (`vdcache serve` refuses it unless told it is meant).
    pub fn listen_tcp(&self, addr: impl ToSocketAddrs) -> Result<SocketAddr, ServerError> {
        if self.inner.stopping.load(Ordering::SeqCst) {
            return Err(ServerError::ShuttingDown);
        }
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| ServerError::Listen {
            addr: format!("{addrs:?}"),
            source: e,
        })?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        self.start_listener(ListenerSocket::Tcp(listener), None)?;
        info!("nbd: listening on tcp {local}");
        Ok(local)
    }

    /// Serves one already-connected Unix stream (socket activation, tests).
    pub fn serve_unix_stream(&self, stream: UnixStream) -> Result<(), ServerError> {
        if self.inner.stopping.load(Ordering::SeqCst) {
            return Err(ServerError::ShuttingDown);
        }
        self.inner.spawn_connection(Socket::Unix(stream));
        Ok(())
    }

    fn start_listener(
        &self,
        listener: ListenerSocket,
        socket: Option<OwnedSocket>,
    ) -> Result<(), ServerError> {
        self.inner.start_reaper();
        let (wake_r, wake_w) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(io::Error::from)?;
        let inner = self.inner.clone();
        let thread = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || inner.accept_loop(listener, wake_r))?;
        lock(&self.inner.listeners).push(Listener {
            thread: Some(thread),
            wake: wake_w,
            socket,
        });
        Ok(())
    }

    /// A handle for shutting down from another thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            inner: self.inner.clone(),
        }
    }

    /// Stops accepting, stops reading new requests, lets in-flight requests
    /// finish and returns once every connection is closed. Connections that
    /// do not finish within `Limits::shutdown_grace` are cut. Idempotent.
    pub fn shutdown(&self) {
        shutdown(&self.inner);
    }

    /// Number of live connections (evicted or timed-out ones whose thread
    /// is still leaving included).
    pub fn connection_count(&self) -> usize {
        lock(&self.inner.conns).entries.len()
    }

    /// Counters per export and per live connection.
    pub fn stats(&self) -> ServerStats {
        let exports = self
            .inner
            .exports
            .iter()
            .map(|e| ExportStats {
                name: e.name.clone(),
                active_connections: e.active.load(Ordering::Relaxed),
                total_connections: e.total.load(Ordering::Relaxed),
                io: e.counters.snapshot(),
            })
            .collect();
        let (mut connections, handshakes) = {
            let table = lock(&self.inner.conns);
            let connections: Vec<ConnectionStats> = table
                .entries
                .iter()
                .map(|(id, c)| ConnectionStats {
                    id: *id,
                    peer: c.peer.clone(),
                    export: lock(&c.info.export).clone(),
                    tls: c.info.tls.load(Ordering::Relaxed),
                    io: c.info.counters.snapshot(),
                })
                .collect();
            let handshakes = table
                .entries
                .values()
                .filter(|c| matches!(c.phase, Phase::Handshake { .. }))
                .count() as u64;
            (connections, handshakes)
        };
        connections.sort_by_key(|c| c.id);
        let inner = &self.inner;
        ServerStats {
            exports,
            connections,
            accepted: inner.accepted.load(Ordering::Relaxed),
            refused: inner.refused.load(Ordering::Relaxed),
            handshakes,
            evicted: inner.evicted.load(Ordering::Relaxed),
            handshake_timeouts: inner.handshake_timeouts.load(Ordering::Relaxed),
            buffered_bytes: inner.budget.used(),
            buffered_bytes_peak: inner.budget.peak(),
        }
    }
}

impl Server {
    /// Serves one connection made of `input` (see [`crate::fuzzing`]):
    /// with `preset` = (export, structured replies, base:allocation) the
    /// handshake is skipped. Returns whether the transmission phase was
    /// reached and what the server sent.
    pub(crate) fn serve_bytes(
        &self,
        input: &[u8],
        preset: Option<(usize, bool, bool)>,
    ) -> (bool, Vec<u8>) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let preset = preset.map(|(idx, structured, meta)| {
            handshake::negotiated(&self.inner, idx, structured, meta)
        });
        let reached = conn::serve_bytes(&self.inner, input, &sent, preset);
        let sent = std::mem::take(&mut *lock(&sent));
        (reached, sent)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        shutdown(&self.inner);
    }
}

impl ExportEntry {
    pub(crate) fn connection_started(&self) {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn connection_ended(&self) {
        self.active.fetch_sub(1, Ordering::Relaxed);
    }
}

fn shutdown(inner: &Arc<ServerInner>) {
    let mut done = lock(&inner.shutdown_done);
    if *done {
        return;
    }
    inner.stopping.store(true, Ordering::SeqCst);
    // The reaper looks at `stopping` under the table lock before it waits.
    drop(lock(&inner.conns));
    inner.reaper_cv.notify_all();
    let reaper = lock(&inner.reaper).take();
    if let Some(t) = reaper {
        let _ = t.join();
    }
    // 1. Stop accepting.
    let listeners: Vec<Listener> = std::mem::take(&mut *lock(&inner.listeners));
    for mut l in listeners {
        let _ = rustix::io::write(&l.wake, &[1u8]);
        if let Some(t) = l.thread.take() {
            let _ = t.join();
        }
        drop(l.socket.take());
    }
    // 2. Stop reading new requests; in-flight ones finish and get replies.
    {
        let table = lock(&inner.conns);
        debug!("nbd: shutting down {} connection(s)", table.entries.len());
        for c in table.entries.values() {
            let _ = c.ctl.shutdown(Shutdown::Read);
        }
    }
    // 3. Wait for the connection threads, cutting stragglers after the grace.
    let mut table = lock(&inner.conns);
    if let Some(grace) = inner.limits.shutdown_grace {
        let (g, _) = inner
            .conns_cv
            .wait_timeout_while(table, grace, |t| !t.entries.is_empty())
            .unwrap_or_else(|p| p.into_inner());
        table = g;
        if !table.entries.is_empty() {
            warn!(
                "nbd: {} connection(s) did not finish in time, cutting them",
                table.entries.len()
            );
            for c in table.entries.values() {
                let _ = c.ctl.shutdown(Shutdown::Both);
            }
        }
    }
    while !table.entries.is_empty() {
        table = inner
            .conns_cv
            .wait(table)
            .unwrap_or_else(|p| p.into_inner());
    }
    drop(table);
    inner.conn_threads.wait_for_none();
    *done = true;
    info!("nbd: server stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn ip(last: u8) -> PeerId {
        PeerId::Ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)))
    }

    fn limits(total: usize, handshakes: usize, per_ip: usize) -> Limits {
        Limits {
            max_connections: total,
            max_handshakes: handshakes,
            max_connections_per_ip: per_ip,
            ..Limits::default()
        }
    }

    #[test]
    fn a_flood_evicts_its_own_handshakes_first() {
        let l = limits(100, 4, 100);
        // Client 1 holds three handshakes (ids 1-3), client 2 one (id 4).
        let live = [
            (1, ip(1), true),
            (2, ip(1), true),
            (3, ip(1), true),
            (4, ip(2), true),
        ];
        assert_eq!(admit(live.into_iter(), ip(3), &l), Ok(vec![1]));
        assert_eq!(admit(live.into_iter(), ip(1), &l), Ok(vec![1]));
        // A tie goes to the oldest handshake.
        let live = [
            (5, ip(1), true),
            (2, ip(2), true),
            (7, ip(1), true),
            (3, ip(2), true),
        ];
        assert_eq!(admit(live.into_iter(), ip(3), &l), Ok(vec![2]));
    }

    #[test]
    fn finished_handshakes_are_never_evicted() {
        let l = limits(3, 3, 100);
        let live = [(1, ip(1), false), (2, ip(1), false), (3, ip(2), true)];
        assert_eq!(admit(live.into_iter(), ip(3), &l), Ok(vec![3]));
        let live = [(1, ip(1), false), (2, ip(1), false), (3, ip(2), false)];
        assert_eq!(
            admit(live.into_iter(), ip(3), &l),
            Err("the connection limit")
        );
    }

    #[test]
    fn a_client_at_its_limit_loses_its_own_handshake_or_is_refused() {
        let l = limits(100, 100, 2);
        let live = [(1, ip(1), false), (2, ip(1), true), (3, ip(2), true)];
        assert_eq!(admit(live.into_iter(), ip(1), &l), Ok(vec![2]));
        let live = [(1, ip(1), false), (2, ip(1), false), (3, ip(2), true)];
        assert_eq!(
            admit(live.into_iter(), ip(1), &l),
            Err("the per-client connection limit")
        );
        assert_eq!(admit(live.into_iter(), ip(2), &l), Ok(vec![]));
        // Unix clients have their own limit (by uid).
        let l = Limits {
            max_connections_per_uid: 1,
            ..l
        };
        let live = [(1, PeerId::Uid(0), false)];
        assert_eq!(
            admit(live.into_iter(), PeerId::Uid(0), &l),
            Err("the per-client connection limit")
        );
        assert_eq!(admit(live.into_iter(), PeerId::Uid(1000), &l), Ok(vec![]));
    }
}
