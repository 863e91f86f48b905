//! The NBD server: named exports, listeners (Unix socket by default, TCP on
//! request, TLS when configured), connection bookkeeping, statistics and
//! graceful shutdown.
//!
//! Owns: accept loops, the connection table and its cap, the shutdown
//! sequence (stop accepting, stop reading new requests, let in-flight
//! requests finish, wait for every connection thread), socket file
//! creation (mode 0600) and removal.
//! Must not: parse protocol messages (see `handshake` and `conn`), touch
//! export data, or install signal handlers (the binary owns signals and
//! calls [`ShutdownHandle::shutdown`]).

mod conn;
mod handshake;
mod outbox;
mod payloads;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;
use tracing::{debug, info, warn};

use crate::export::Export;
use crate::proto;
use crate::tls::TlsServerConfig;
use crate::transport::Socket;

/// Errors of building or starting a server.
#[derive(Debug, Error)]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("{path}: something is already listening on this socket")]
    AddressInUse { path: PathBuf },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

/// Resource limits; every one bounds what a client can make the server hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections served at once; further ones are accepted and closed.
    pub max_connections: usize,
    /// Worker threads per connection (started on demand).
    pub workers_per_connection: usize,
    /// Largest READ/WRITE payload (also caps the advertised maximum block size).
    pub max_payload: u32,
    /// Payload bytes of requests in flight per connection before the server
    /// stops reading more (one request is always allowed).
    pub max_inflight_bytes: u64,
    /// Requests in flight per connection before the server stops reading more.
    pub max_inflight_requests: usize,
    /// Largest option the handshake accepts; longer ones end the connection.
    pub max_option_len: u32,
    /// Options per handshake; more end the connection.
    pub max_options: u32,
    /// Time a client may take for the whole handshake (`None`: unlimited).
    pub handshake_timeout: Option<Duration>,
    /// On shutdown, time given to connections to finish in-flight requests
    /// before their sockets are shut down hard (`None`: wait forever).
    pub shutdown_grace: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            workers_per_connection: 4,
            max_payload: 32 << 20,
            max_inflight_bytes: 64 << 20,
            max_inflight_requests: 128,
            max_option_len: 64 << 10,
            max_options: 1024,
            handshake_timeout: Some(Duration::from_secs(60)),
            shutdown_grace: Some(Duration::from_secs(30)),
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
    /// Connections refused because `max_connections` was reached.
    pub refused: u64,
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
    info: Arc<ConnInfo>,
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
    unix_path: Option<(PathBuf, u64, u64)>,
}

pub(crate) struct ServerInner {
    pub(crate) exports: Vec<ExportEntry>,
    pub(crate) limits: Limits,
    pub(crate) tls: Option<TlsServerConfig>,
    pub(crate) stopping: AtomicBool,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    conns_cv: Condvar,
    next_id: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    listeners: Mutex<Vec<Listener>>,
    shutdown_done: Mutex<bool>,
    payloads: payloads::PayloadPool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ServerInner {
    pub(crate) fn find_export(&self, name: &str) -> Option<&ExportEntry> {
        self.exports.iter().find(|e| e.name == name)
    }

    /// Registers a connection and runs it on its own thread.
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
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let info = Arc::new(ConnInfo::default());
        {
            let mut conns = lock(&self.conns);
            if conns.len() >= self.limits.max_connections {
                self.refused.fetch_add(1, Ordering::Relaxed);
                warn!(
                    "nbd: connection limit ({}) reached, refusing a connection",
                    self.limits.max_connections
                );
                let _ = sock.shutdown(Shutdown::Both);
                return;
            }
            conns.insert(
                id,
                ConnEntry {
                    ctl,
                    peer: sock.peer(),
                    info: info.clone(),
                },
            );
        }
        self.accepted.fetch_add(1, Ordering::Relaxed);
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                let _guard = ConnGuard {
                    inner: inner.clone(),
                    id,
                };
                conn::serve(&inner, id, sock, &info);
            });
        if let Err(e) = spawned {
            warn!("nbd: cannot start a connection thread: {e}");
            lock(&self.conns).remove(&id);
            self.conns_cv.notify_all();
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

struct ConnGuard {
    inner: Arc<ServerInner>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.inner.conns).remove(&self.id);
        self.inner.conns_cv.notify_all();
    }
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
        if l.max_connections == 0 || l.workers_per_connection == 0 || l.max_inflight_requests == 0 {
            return Err(ServerError::Config(
                "connection, worker and in-flight limits must be positive".into(),
            ));
        }
        if l.max_payload < 4096 {
            return Err(ServerError::Config(
                "max_payload must be at least 4096".into(),
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
                limits: self.limits,
                tls: self.tls,
                stopping: AtomicBool::new(false),
                conns: Mutex::new(HashMap::new()),
                conns_cv: Condvar::new(),
                next_id: AtomicU64::new(1),
                accepted: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                listeners: Mutex::new(Vec::new()),
                shutdown_done: Mutex::new(false),
                payloads: payloads::PayloadPool::default(),
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
        let path = path.as_ref();
        if self.inner.stopping.load(Ordering::SeqCst) {
            return Err(ServerError::ShuttingDown);
        }
        remove_stale_socket(path)?;
        let listener = bind_unix_private(path)?;
        listener.set_nonblocking(true)?;
        let meta = fs::metadata(path)?;
        self.start_listener(
            ListenerSocket::Unix(listener),
            Some((path.to_path_buf(), meta.dev(), meta.ino())),
        )?;
        info!("nbd: listening on unix socket {}", path.display());
        Ok(())
    }

    /// Listens on TCP; returns the bound address (useful with port 0).
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
        unix_path: Option<(PathBuf, u64, u64)>,
    ) -> Result<(), ServerError> {
        let (wake_r, wake_w) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(io::Error::from)?;
        let inner = self.inner.clone();
        let thread = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || inner.accept_loop(listener, wake_r))?;
        lock(&self.inner.listeners).push(Listener {
            thread: Some(thread),
            wake: wake_w,
            unix_path,
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

    /// Number of live connections.
    pub fn connection_count(&self) -> usize {
        lock(&self.inner.conns).len()
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
        let mut connections: Vec<ConnectionStats> = lock(&self.inner.conns)
            .iter()
            .map(|(id, c)| ConnectionStats {
                id: *id,
                peer: c.peer.clone(),
                export: lock(&c.info.export).clone(),
                tls: c.info.tls.load(Ordering::Relaxed),
                io: c.info.counters.snapshot(),
            })
            .collect();
        connections.sort_by_key(|c| c.id);
        ServerStats {
            exports,
            connections,
            accepted: self.inner.accepted.load(Ordering::Relaxed),
            refused: self.inner.refused.load(Ordering::Relaxed),
        }
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
    // 1. Stop accepting.
    let listeners: Vec<Listener> = std::mem::take(&mut *lock(&inner.listeners));
    for mut l in listeners {
        let _ = rustix::io::write(&l.wake, &[1u8]);
        if let Some(t) = l.thread.take() {
            let _ = t.join();
        }
        if let Some((path, dev, ino)) = &l.unix_path {
            // Remove the socket file only if it is still ours.
            if let Ok(m) = fs::symlink_metadata(path)
                && m.dev() == *dev
                && m.ino() == *ino
            {
                let _ = fs::remove_file(path);
            }
        }
    }
    // 2. Stop reading new requests; in-flight ones finish and get replies.
    {
        let conns = lock(&inner.conns);
        debug!("nbd: shutting down {} connection(s)", conns.len());
        for c in conns.values() {
            let _ = c.ctl.shutdown(Shutdown::Read);
        }
    }
    // 3. Wait for the connection threads, cutting stragglers after the grace.
    let mut conns = lock(&inner.conns);
    if let Some(grace) = inner.limits.shutdown_grace {
        let (g, _) = inner
            .conns_cv
            .wait_timeout_while(conns, grace, |c| !c.is_empty())
            .unwrap_or_else(|p| p.into_inner());
        conns = g;
        if !conns.is_empty() {
            warn!(
                "nbd: {} connection(s) did not finish in time, cutting them",
                conns.len()
            );
            for c in conns.values() {
                let _ = c.ctl.shutdown(Shutdown::Both);
            }
        }
    }
    while !conns.is_empty() {
        conns = inner
            .conns_cv
            .wait(conns)
            .unwrap_or_else(|p| p.into_inner());
    }
    *done = true;
    info!("nbd: server stopped");
}

/// Removes `path` if it is a socket nobody listens on; refuses otherwise.
fn remove_stale_socket(path: &Path) -> Result<(), ServerError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if !meta.file_type().is_socket() {
        return Err(ServerError::Listen {
            addr: path.display().to_string(),
            source: io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a socket"),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(ServerError::AddressInUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            debug!("nbd: removing stale socket {}", path.display());
            fs::remove_file(path)?;
            Ok(())
        }
        Err(e) => Err(ServerError::Listen {
            addr: path.display().to_string(),
            source: e,
        }),
    }
}

/// Binds a listening socket at `path` that is never reachable with a mode
/// wider than 0600: it is bound inside a fresh 0700 directory next to
/// `path`, chmod'ed, then hard-linked into place.
fn bind_unix_private(path: &Path) -> Result<UnixListener, ServerError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if path.file_name().is_none() {
        return Err(ServerError::Listen {
            addr: path.display().to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "no file name"),
        });
    }
    let listen_err = |e: io::Error| ServerError::Listen {
        addr: path.display().to_string(),
        source: e,
    };
    static SEQ: AtomicU64 = AtomicU64::new(0);
    // Short names: the temporary path must fit in sun_path too.
    let dir = parent.join(format!(
        ".nb{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(listen_err)?;
    let tmp = dir.join("s");
    let result = (|| {
        let l = UnixListener::bind(&tmp)?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))?;
        // A hard link never replaces an existing file, unlike rename: a
        // server that bound `path` meanwhile is left alone.
        fs::hard_link(&tmp, path)?;
        Ok::<_, io::Error>(l)
    })();
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_dir(&dir);
    if let Err(e) = &result
        && e.kind() == io::ErrorKind::AlreadyExists
    {
        return Err(ServerError::AddressInUse {
            path: path.to_path_buf(),
        });
    }
    result.map_err(listen_err)
}
