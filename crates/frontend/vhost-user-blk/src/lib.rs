//! vdcache-vhost-user-blk: the vhost-user-blk front end. QEMU attaches a
//! served disk with `-chardev socket,path=SOCKET` and `-device
//! vhost-user-blk-pci,chardev=...` over shared guest memory (memfd), and
//! the guest's virtio-blk requests reach [`VirtualDisk`] without an NBD
//! hop: one socket per export, one worker thread per queue.
//!
//! Owns: each export's listening socket (refusing one a live server
//! holds), the connection's lifetime (QEMU may disconnect and, with
//! `reconnect=`, come back: a new connection gets a fresh device state),
//! and the stop: connections are shut, every request in flight finishes,
//! then the caller may close the disks.
//!
//! Must not: hold a second path to the storage (it calls the very
//! `VirtualDisk` the NBD front end calls) or acknowledge a flush before
//! `VirtualDisk::flush` returned.

mod device;
mod failure_log;
pub mod fuzzing;
mod inflight;
pub mod request;
mod ring;

use device::{Backend, Counters, Device, WORKERS_PER_QUEUE};
use request::BlockDevice;
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vdcache_image::VirtualDisk;
use vdcache_image::disk::ZeroFlags;
use vdcache_ownership::OwnedSocket;
pub use vdcache_ownership::SocketAccess;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

/// One disk to serve on a vhost-user socket.
pub struct VhostUserBlkExport {
    pub name: String,
    pub disk: Arc<VirtualDisk>,
    pub socket: PathBuf,
    /// Virtqueues offered (QEMU's `num-queues` may not exceed it).
    pub queues: usize,
    /// Who may connect: the socket appears with it.
    pub access: SocketAccess,
}

/// Why the front end could not start.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserBlkError {
    #[error("vhost-user-blk socket: {0}")]
    Socket(#[from] vdcache_ownership::OwnershipError),
    #[error("cannot start the vhost-user-blk thread for {path}: {cause}")]
    Thread {
        path: PathBuf,
        cause: std::io::Error,
    },
}

/// What one export served over vhost-user so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub written_bytes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub errors: u64,
}

/// Counts requests of every export (see [`VhostUserBlkServer::activity`]).
#[derive(Clone)]
pub struct Activity(Vec<(String, Arc<Counters>)>);

impl Activity {
    /// Requests served so far, of any kind, failed ones included.
    pub fn requests(&self) -> u64 {
        self.0.iter().map(|(_, c)| c.total()).sum()
    }

    /// What export `name` served so far (None: not served over vhost-user).
    pub fn export(&self, name: &str) -> Option<Totals> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.totals())
    }
}

/// The serving exports; [`VhostUserBlkServer::stop`] ends them.
pub struct VhostUserBlkServer {
    exports: Vec<Serving>,
}

struct Serving {
    name: String,
    /// Removed at the stop, if still the socket bound here.
    socket: OwnedSocket,
    /// The listening socket again: shutting it down wakes the accept.
    waker: Option<UnixListener>,
    stop: Arc<AtomicBool>,
    connection: Arc<Mutex<Option<ShutdownHandle>>>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
}

/// [`VirtualDisk`] as a virtio-blk device.
struct DiskDevice {
    disk: Arc<VirtualDisk>,
    id: Vec<u8>,
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl BlockDevice for DiskDevice {
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn read_only(&self) -> bool {
        self.disk.read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.disk.read(offset, buf).map_err(io_err)
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.disk.write(offset, data, false).map_err(io_err)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.disk.flush().map_err(io_err)
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.disk.discard(offset, len).map_err(io_err)
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> std::io::Result<()> {
        let flags = ZeroFlags {
            may_unmap,
            fua: false,
        };
        self.disk.write_zeroes(offset, len, flags).map_err(io_err)
    }
    fn id(&self) -> &[u8] {
        &self.id
    }
}

/// Whether a server accepts connections on `path` now.
impl VhostUserBlkServer {
    /// Listens on every export's socket; QEMU may connect at once.
    pub fn start(
        exports: Vec<VhostUserBlkExport>,
    ) -> Result<VhostUserBlkServer, VhostUserBlkError> {
        let mut server = VhostUserBlkServer {
            exports: Vec::new(),
        };
        for e in exports {
            // On error, `server` drops and stops what already started.
            server.exports.push(Serving::start(e)?);
        }
        Ok(server)
    }

    /// A handle counting every request served so far, for a thread that
    /// watches for idleness.
    pub fn activity(&self) -> Activity {
        Activity(
            self.exports
                .iter()
                .map(|s| (s.name.clone(), s.counters.clone()))
                .collect(),
        )
    }

    /// Shuts every connection, waits until no request is in flight, and
    /// removes the sockets. The disks may be closed after this returns.
    pub fn stop(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        for s in &mut self.exports {
            s.stop();
        }
    }
}

impl Drop for VhostUserBlkServer {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl Serving {
    fn start(e: VhostUserBlkExport) -> Result<Serving, VhostUserBlkError> {
        let id = if e.name.is_empty() {
            b"vdcache".to_vec()
        } else {
            e.name.as_bytes().to_vec()
        };
        let device = DiskDevice {
            disk: e.disk.clone(),
            id,
        };
        let queues = (e.queues, WORKERS_PER_QUEUE);
        Serving::start_device(e.name, Arc::new(device), (&e.socket, &e.access), queues)
    }

    /// Serves `device` on `socket`, which appears with `access`, with
    /// `(queues, workers per queue)`.
    fn start_device(
        name: String,
        device: Arc<dyn BlockDevice + Send + Sync>,
        (socket, access): (&std::path::Path, &SocketAccess),
        (queues, workers): (usize, usize),
    ) -> Result<Serving, VhostUserBlkError> {
        let (listener, socket) = OwnedSocket::bind_with(socket, access)?;
        let waker = listener
            .try_clone()
            .map_err(|cause| VhostUserBlkError::Thread {
                path: socket.path().to_path_buf(),
                cause,
            })?;
        let listener = Listener::from(listener);
        let counters = Arc::new(Counters::default());
        let backend = Backend(Arc::new(Device::new(
            name.clone(),
            device,
            queues,
            workers,
            counters.clone(),
        )));
        let stop = Arc::new(AtomicBool::new(false));
        let connection = Arc::new(Mutex::new(None));
        let thread = {
            let (stop, connection, name) = (stop.clone(), connection.clone(), name.clone());
            std::thread::Builder::new()
                .name("vdcache-vhost-user".into())
                .spawn(move || serve_connections(listener, backend, &name, &stop, &connection))
                .map_err(|cause| VhostUserBlkError::Thread {
                    path: socket.path().to_path_buf(),
                    cause,
                })?
        };
        Ok(Serving {
            name,
            socket,
            waker: Some(waker),
            stop,
            connection,
            counters,
            thread: Some(thread),
        })
    }

    fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        let connected = self
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(handle) = connected {
            handle.shutdown();
        }
        // The thread may wait in accept: shutting the listening socket
        // down makes that accept (and any later one) fail at once, whoever
        // holds the socket's path now. std offers shutdown(2) on streams
        // only; on a listening socket it does the same.
        if let Some(w) = self.waker.take() {
            let _ = UnixStream::from(std::os::fd::OwnedFd::from(w)).shutdown(Shutdown::Both);
        }
        if thread.join().is_err() {
            tracing::error!(
                "the vhost-user-blk thread of {} panicked",
                self.socket.path().display()
            );
        }
    }
}

/// Serves one QEMU connection after another until told to stop. Each
/// connection gets a fresh daemon (device state, memory table, worker
/// threads); dropping it joins its workers, so no request outlives it.
fn serve_connections(
    mut listener: Listener,
    backend: Backend,
    name: &str,
    stop: &AtomicBool,
    connection: &Mutex<Option<ShutdownHandle>>,
) {
    let label = if name.is_empty() {
        "default export"
    } else {
        name
    };
    loop {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let daemon = VhostUserDaemon::new(format!("vdcache-vub-{label}"), backend.clone(), mem);
        let go_on = match daemon {
            Ok(mut daemon) => {
                backend.0.start_connection();
                let go_on = serve_one(&mut daemon, &mut listener, label, stop, connection);
                // A guest that keeps posting must not keep its queue's
                // thread from the exit event dropping the daemon sends.
                backend.0.end_connection();
                drop(daemon);
                go_on
            }
            Err(e) => {
                tracing::error!("vhost-user-blk {label}: cannot start a device: {e}");
                false
            }
        };
        backend.0.finish_requests();
        backend.0.close_exit_events();
        if !go_on {
            return;
        }
    }
}

/// Longest pause between two tries to accept a connection after a
/// failure, and how often a failure that lasts is logged again.
const ACCEPT_RETRY_MAX: Duration = Duration::from_secs(1);
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(60);

/// Accepts the next connection on `daemon`; false once stopped. A failed
/// accept or start (out of file descriptors or memory; the front end
/// connects again, as QEMU's reconnect does) is tried again with a growing
/// pause, logged when it starts, once a minute while it lasts and when a
/// connection is served again, so the export never stops listening while
/// its socket stays bound.
fn accept_until_stopped(
    daemon: &mut VhostUserDaemon<Backend>,
    listener: &mut Listener,
    label: &str,
    stop: &AtomicBool,
) -> bool {
    let mut pause = Duration::from_millis(10);
    let mut failing_since: Option<(Instant, Instant)> = None;
    loop {
        match daemon.start(listener) {
            Ok(()) => {
                if let Some((since, _)) = failing_since {
                    tracing::info!(
                        "vhost-user-blk {label}: accepted a connection again, {:.1} s after the first failure",
                        since.elapsed().as_secs_f64()
                    );
                }
                return true;
            }
            Err(_) if stop.load(Ordering::SeqCst) => return false,
            Err(e) => {
                let now = Instant::now();
                match &mut failing_since {
                    None => {
                        tracing::error!(
                            "vhost-user-blk {label}: accepting a connection: {e} (trying again)"
                        );
                        failing_since = Some((now, now));
                    }
                    Some((_, logged)) if now.duration_since(*logged) >= ACCEPT_LOG_EVERY => {
                        tracing::error!(
                            "vhost-user-blk {label}: still cannot accept a connection: {e}"
                        );
                        *logged = now;
                    }
                    Some(_) => {}
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(ACCEPT_RETRY_MAX);
            }
        }
    }
}

/// Serves one connection on `daemon`, and waits until its connection
/// thread ended; false when no other connection may follow (a stop).
fn serve_one(
    daemon: &mut VhostUserDaemon<Backend>,
    listener: &mut Listener,
    label: &str,
    stop: &AtomicBool,
    connection: &Mutex<Option<ShutdownHandle>>,
) -> bool {
    if !accept_until_stopped(daemon, listener, label, stop) {
        return false;
    }
    *connection.lock().unwrap_or_else(PoisonError::into_inner) = daemon.shutdown_handle();
    // The stop may have come before the handle was there.
    if stop.load(Ordering::SeqCst) {
        daemon.request_shutdown();
    } else {
        tracing::info!("vhost-user-blk {label}: a front end connected");
    }
    match daemon.wait() {
        Ok(())
        | Err(vhost_user_backend::Error::HandleRequest(
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
        )) => tracing::info!("vhost-user-blk {label}: the front end disconnected"),
        Err(e) => tracing::warn!("vhost-user-blk {label}: connection ended: {e}"),
    }
    connection
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    !stop.load(Ordering::SeqCst)
}
