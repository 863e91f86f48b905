//! NBD client used as a storage backend: connects by URI, negotiates fixed
//! newstyle (STARTTLS, STRUCTURED_REPLY, SET_META_CONTEXT, GO with a
//! fallback to EXPORT_NAME), then lets any number of threads issue requests
//! at once.
//!
//! One reader thread demultiplexes replies by cookie and places READ data
//! straight into the caller's buffer; callers write their own requests
//! (header and payload in one vectored write) under a writer lock. Large
//! requests are split at the server's maximum block size and pipelined.
//!
//! Owns: the client handshake, request submission, reply validation (bounds
//! of every chunk, full coverage of reads), typed errors.
//! Must not: spawn a thread per request, trust any length or offset the
//! server sends, or touch a caller's buffer after that caller's request
//! completed.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, IoSlice, Read};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use thiserror::Error;
use tracing::debug;

use vdcache_nbd_proto::proto::{self, Cursor, Request};
use vdcache_nbd_proto::tls::{TlsClientConfig, TlsConfigError};
use vdcache_nbd_proto::transport::{
    ConnReader, ConnWriter, Socket, split_plain, split_tls, tls_handshake,
};
use vdcache_nbd_proto::uri::{NbdUri, Transport, UriError};
use vdcache_nbd_proto::{BlockSizes, Extent, ZeroFlags};

/// An NBD error value sent by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerErrno(pub u32);

impl ServerErrno {
    /// `"EIO"`, `"ENOSPC"`, ...
    pub fn name(&self) -> &'static str {
        proto::errno_name(self.0)
    }
}

impl fmt::Display for ServerErrno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// Client failures.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error(transparent)]
    InvalidUri(#[from] UriError),
    #[error("connection refused by {addr}")]
    ConnectionRefused { addr: String },
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("not an NBD fixed newstyle server: {0}")]
    NotNbd(String),
    #[error("export {export:?} not found on the server{}", fmt_msg(message))]
    ExportNotFound { export: String, message: String },
    #[error("the server requires TLS")]
    TlsRequired,
    #[error("TLS: {0}")]
    Tls(String),
    #[error("server refused {option}: {reply}{}", fmt_msg(message))]
    OptionRefused {
        option: &'static str,
        reply: &'static str,
        message: String,
    },
    #[error("server error {errno}{}", fmt_msg(message))]
    Server { errno: ServerErrno, message: String },
    #[error("short reply: {0}")]
    ShortReply(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("disconnected: {0}")]
    Disconnected(String),
    #[error("request {offset}+{len} is outside the export of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("request {offset}+{len} is not aligned to the minimum block size {align}")]
    Unaligned { offset: u64, len: u64, align: u32 },
    #[error("the export is read-only")]
    ReadOnly,
    #[error("not supported by the server: {0}")]
    Unsupported(&'static str),
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

fn fmt_msg(m: &str) -> String {
    if m.is_empty() {
        String::new()
    } else {
        format!(": {m}")
    }
}

impl From<TlsConfigError> for ClientError {
    fn from(e: TlsConfigError) -> Self {
        ClientError::Tls(e.to_string())
    }
}

impl ClientError {
    /// The server's error value, for errors the server reported.
    pub fn errno(&self) -> Option<ServerErrno> {
        match self {
            ClientError::Server { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

impl From<ClientError> for io::Error {
    fn from(e: ClientError) -> io::Error {
        let kind = match &e {
            ClientError::Io(x) => x.kind(),
            ClientError::Server { errno, .. } => {
                return io::Error::new(
                    match errno.0 {
                        proto::EPERM => io::ErrorKind::PermissionDenied,
                        proto::ENOMEM => io::ErrorKind::OutOfMemory,
                        proto::EINVAL => io::ErrorKind::InvalidInput,
                        proto::ENOSPC => io::ErrorKind::StorageFull,
                        proto::ENOTSUP => io::ErrorKind::Unsupported,
                        _ => io::ErrorKind::Other,
                    },
                    e,
                );
            }
            ClientError::ConnectionRefused { .. } => io::ErrorKind::ConnectionRefused,
            ClientError::Disconnected(_) => io::ErrorKind::ConnectionAborted,
            ClientError::OutOfRange { .. } | ClientError::Unaligned { .. } => {
                io::ErrorKind::InvalidInput
            }
            ClientError::ReadOnly => io::ErrorKind::ReadOnlyFilesystem,
            ClientError::Unsupported(_) => io::ErrorKind::Unsupported,
            ClientError::ExportNotFound { .. } => io::ErrorKind::NotFound,
            ClientError::ShortReply(_) | ClientError::Protocol(_) => io::ErrorKind::InvalidData,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Connection settings beyond the URI.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// TLS credentials; otherwise `tls-certificates=` of the URI is used.
    pub tls: Option<TlsClientConfig>,
    /// Ask for structured replies (sparse reads, error messages, block status).
    pub structured_replies: bool,
    /// Select `base:allocation` so [`NbdClient::block_status`] works.
    pub block_status: bool,
    /// Upper bound for one READ/WRITE request (the server's maximum applies too).
    pub max_request: u32,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            tls: None,
            structured_replies: true,
            block_status: true,
            max_request: 32 << 20,
        }
    }
}

/// What the handshake established.
#[derive(Debug, Clone)]
struct ExportInfo {
    size: u64,
    flags: u16,
    block_sizes: BlockSizes,
    structured: bool,
    meta_id: Option<u32>,
    max_request: u32,
}

/// A connection to one export. `Send + Sync`: share it between threads (by
/// reference or in an `Arc`); requests from several threads are in flight
/// together. Dropping it sends `NBD_CMD_DISC` and closes the connection.
pub struct NbdClient {
    inner: Arc<Inner>,
    info: ExportInfo,
    reader: Option<JoinHandle<()>>,
    closed: AtomicBool,
}

struct Inner {
    writer: Mutex<ConnWriter>,
    table: Mutex<Table>,
    /// A clone of the socket for shutting it down without the writer lock.
    ctl: Socket,
}

struct Table {
    slots: HashMap<u64, Arc<Slot>>,
    next_cookie: u64,
    /// Set once the reader is gone; no slot is registered after that.
    dead: Option<String>,
}

/// Where READ data goes: a caller's buffer.
///
/// SAFETY argument for the raw pointer (the only `unsafe` in the crate):
/// the pointer comes from a `&mut [u8]` that the submitting caller holds for
/// the whole request; that caller does not touch the buffer and does not
/// return until the slot is marked done (`wait` below loops until `done`,
/// and every path that could leave early first makes sure the reader thread
/// ends and completes all slots). Only the single reader thread writes
/// through the pointer, and only while the slot is still in the table and
/// not done, within `len` bytes (every offset is bounds-checked first).
/// Completion happens under the slot mutex after the last write, so the
/// caller's later accesses happen-after the reader's writes.
struct ReadTarget {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: see `ReadTarget`: the buffer is exclusively lent to the reader
// thread while the request is pending, and the lender waits for completion.
unsafe impl Send for ReadTarget {}
// SAFETY: only the reader thread dereferences the pointer (see above).
unsafe impl Sync for ReadTarget {}

struct Slot {
    kind: u16,
    offset: u64,
    len: u64,
    target: Option<ReadTarget>,
    state: Mutex<SlotState>,
    cv: Condvar,
}

#[derive(Default)]
struct SlotState {
    done: bool,
    error: Option<ClientError>,
    extents: Option<Vec<Extent>>,
    /// Byte ranges of a READ already delivered (structured replies).
    covered: Vec<(u64, u64)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads one option reply: (reply type, payload).
fn read_option_reply(r: &mut ConnReader, opt: u32) -> Result<(u32, Vec<u8>), ClientError> {
    let mut h = [0u8; 20];
    r.read_exact(&mut h).map_err(handshake_io)?;
    if proto::be64(&h[0..8]) != proto::REPLY_MAGIC {
        return Err(ClientError::Protocol("bad option reply magic".into()));
    }
    if proto::be32(&h[8..12]) != opt {
        return Err(ClientError::Protocol(format!(
            "reply to {} while waiting for {}",
            proto::option_name(proto::be32(&h[8..12])),
            proto::option_name(opt)
        )));
    }
    let rep = proto::be32(&h[12..16]);
    let len = proto::be32(&h[16..20]);
    if len > 1 << 20 {
        return Err(ClientError::Protocol(format!(
            "option reply of {len} bytes"
        )));
    }
    let mut data = vec![0u8; len as usize];
    r.read_exact(&mut data).map_err(handshake_io)?;
    Ok((rep, data))
}

fn handshake_io(e: io::Error) -> ClientError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        ClientError::Disconnected("server closed the connection during the handshake".into())
    } else {
        ClientError::Io(e)
    }
}

fn send_option(w: &mut ConnWriter, opt: u32, data: &[u8]) -> Result<(), ClientError> {
    let mut h = [0u8; 16];
    h[0..8].copy_from_slice(&proto::IHAVEOPT.to_be_bytes());
    h[8..12].copy_from_slice(&opt.to_be_bytes());
    h[12..16].copy_from_slice(&(data.len() as u32).to_be_bytes());
    w.write_all_vectored(&mut [IoSlice::new(&h), IoSlice::new(data)])
        .map_err(ClientError::Io)
}

fn refused(opt: u32, rep: u32, data: &[u8]) -> ClientError {
    ClientError::OptionRefused {
        option: proto::option_name(opt),
        reply: proto::reply_name(rep),
        message: String::from_utf8_lossy(data).into_owned(),
    }
}

impl NbdClient {
    /// Connects to `uri` (see [`NbdUri`]) with default options.
    pub fn connect(uri: &str) -> Result<NbdClient, ClientError> {
        Self::connect_with(&NbdUri::parse(uri)?, &ClientOptions::default())
    }

    /// Connects with explicit options.
    pub fn connect_with(uri: &NbdUri, opts: &ClientOptions) -> Result<NbdClient, ClientError> {
        let (sock, default_host) = match &uri.transport {
            Transport::Unix(p) => {
                let addr = p.display().to_string();
                let s = UnixStream::connect(p).map_err(|e| connect_error(addr, e))?;
                (Socket::Unix(s), "localhost".to_string())
            }
            Transport::Tcp { host, port } => {
                let addr = format!("{host}:{port}");
                let s = TcpStream::connect((host.as_str(), *port))
                    .map_err(|e| connect_error(addr, e))?;
                let _ = s.set_nodelay(true);
                (Socket::Tcp(s), host.clone())
            }
        };
        let tls = if uri.tls {
            Some(
                match (&opts.tls, &uri.tls_certificates, &uri.tls_psk_file) {
                    (Some(t), _, _) => t.clone(),
                    (None, Some(dir), None) => TlsClientConfig::from_x509_dir(dir)?,
                    (None, None, Some(keys)) => {
                        let user = uri.user.as_deref().ok_or_else(|| {
                            ClientError::Tls("tls-psk-file needs a user: nbds://USER@...".into())
                        })?;
                        TlsClientConfig::from_psk_file(keys, user)?
                    }
                    (None, Some(_), Some(_)) => {
                        return Err(ClientError::Tls(
                            "give tls-certificates or tls-psk-file, not both".into(),
                        ));
                    }
                    (None, None, None) => {
                        return Err(ClientError::Tls(
                        "nbds URI without credentials (tls-certificates=DIR or tls-psk-file=FILE)"
                            .into(),
                    ));
                    }
                },
            )
        } else {
            None
        };
        let server_name = uri.tls_hostname.clone().unwrap_or(default_host);
        Self::handshake(sock, &uri.export, tls.as_ref(), &server_name, opts)
    }

    fn handshake(
        sock: Socket,
        export: &str,
        tls: Option<&TlsClientConfig>,
        server_name: &str,
        opts: &ClientOptions,
    ) -> Result<NbdClient, ClientError> {
        let ctl = sock.try_clone()?;
        let (mut r, mut w) = split_plain(sock)?;
        let info = negotiate(&mut r, &mut w, export, tls, server_name, opts)?;
        let structured = info.structured;
        debug!("nbd client: connected, {info:?}");
        let inner = Arc::new(Inner {
            writer: Mutex::new(w),
            table: Mutex::new(Table {
                slots: HashMap::new(),
                next_cookie: 1,
                dead: None,
            }),
            ctl,
        });
        let rinner = inner.clone();
        let reader = std::thread::Builder::new()
            .name("nbd-client-reader".into())
            .spawn(move || reader_thread(&rinner, r, structured))?;
        Ok(NbdClient {
            inner,
            info,
            reader: Some(reader),
            closed: AtomicBool::new(false),
        })
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.info.size
    }

    /// Transmission flags sent by the server.
    pub fn transmission_flags(&self) -> u16 {
        self.info.flags
    }

    pub fn read_only(&self) -> bool {
        self.info.flags & proto::TFLAG_READ_ONLY != 0
    }

    pub fn can_multi_conn(&self) -> bool {
        self.info.flags & proto::TFLAG_CAN_MULTI_CONN != 0
    }

    /// Block sizes the server advertised (defaults if it did not).
    pub fn block_sizes(&self) -> BlockSizes {
        self.info.block_sizes
    }

    /// Structured replies were negotiated.
    pub fn structured_replies(&self) -> bool {
        self.info.structured
    }

    /// `base:allocation` was negotiated: [`NbdClient::block_status`] works.
    pub fn supports_block_status(&self) -> bool {
        self.info.meta_id.is_some()
    }

    fn has(&self, flag: u16) -> bool {
        self.info.flags & flag != 0
    }

    fn check_range(&self, offset: u64, len: u64, write: bool) -> Result<(), ClientError> {
        if write && self.read_only() {
            return Err(ClientError::ReadOnly);
        }
        if offset.checked_add(len).is_none_or(|e| e > self.info.size) {
            return Err(ClientError::OutOfRange {
                offset,
                len,
                size: self.info.size,
            });
        }
        let align = self.info.block_sizes.minimum;
        let a = u64::from(align);
        if a > 1
            && (!offset.is_multiple_of(a)
                || (!len.is_multiple_of(a) && offset + len != self.info.size))
        {
            return Err(ClientError::Unaligned { offset, len, align });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        self.check_range(offset, buf.len() as u64, false)?;
        let max = self.info.max_request as usize;
        let mut slots = Vec::with_capacity(buf.len().div_ceil(max.max(1)).max(1));
        let mut first_err = None;
        for (i, chunk) in buf.chunks_mut(max).enumerate() {
            let off = offset + (i * max) as u64;
            let target = ReadTarget {
                ptr: chunk.as_mut_ptr(),
                len: chunk.len(),
            };
            match self.submit(
                proto::CMD_READ,
                0,
                off,
                chunk.len() as u64,
                Some(target),
                &[],
            ) {
                Ok(s) => slots.push(s),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        // Every submitted slot must be waited for before `buf` is released.
        self.wait_all(slots, first_err).map(|_| ())
    }

    /// Writes `data` at `offset`; with `fua`, durable before returning.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        self.check_range(offset, data.len() as u64, true)?;
        let native_fua = fua && self.has(proto::TFLAG_SEND_FUA);
        let flags = if native_fua { proto::CMD_FLAG_FUA } else { 0 };
        let max = self.info.max_request as usize;
        let mut slots = Vec::new();
        let mut first_err = None;
        for (i, chunk) in data.chunks(max).enumerate() {
            let off = offset + (i * max) as u64;
            match self.submit(
                proto::CMD_WRITE,
                flags,
                off,
                chunk.len() as u64,
                None,
                chunk,
            ) {
                Ok(s) => slots.push(s),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        self.wait_all(slots, first_err)?;
        if fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Makes all completed writes durable (no-op if the server has no flush).
    pub fn flush(&self) -> Result<(), ClientError> {
        if !self.has(proto::TFLAG_SEND_FLUSH) {
            return Ok(());
        }
        let s = self.submit(proto::CMD_FLUSH, 0, 0, 0, None, &[])?;
        self.wait(&s).map(|_| ())
    }

    /// Discards a range (a hint; no-op if the server has no trim).
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ClientError> {
        self.check_range(offset, len, true)?;
        if !self.has(proto::TFLAG_SEND_TRIM) {
            return Ok(());
        }
        self.ranged(proto::CMD_TRIM, offset, len, fua, 0)
    }

    /// Zeroes a range. Without server support (and without `fast_zero`),
    /// zeroes are written as data.
    pub fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ClientError> {
        self.check_range(offset, len, true)?;
        if !self.has(proto::TFLAG_SEND_WRITE_ZEROES) {
            if flags.fast_zero {
                return Err(ClientError::Unsupported("NBD_CMD_WRITE_ZEROES"));
            }
            let zeroes = vec![0u8; (self.info.max_request as u64).min(len) as usize];
            let mut pos = 0;
            while pos < len {
                let n = (len - pos).min(zeroes.len() as u64) as usize;
                self.write_at(offset + pos, &zeroes[..n], false)?;
                pos += n as u64;
            }
            if flags.fua {
                self.flush()?;
            }
            return Ok(());
        }
        if flags.fast_zero && !self.has(proto::TFLAG_SEND_FAST_ZERO) {
            return Err(ClientError::Unsupported("NBD_CMD_FLAG_FAST_ZERO"));
        }
        let mut f = 0;
        if flags.no_hole {
            f |= proto::CMD_FLAG_NO_HOLE;
        }
        if flags.fast_zero {
            f |= proto::CMD_FLAG_FAST_ZERO;
        }
        self.ranged(proto::CMD_WRITE_ZEROES, offset, len, flags.fua, f)
    }

    /// Prefetch hint (no-op if the server does not advertise NBD_CMD_CACHE).
    pub fn cache(&self, offset: u64, len: u64) -> Result<(), ClientError> {
        self.check_range(offset, len, false)?;
        if !self.has(proto::TFLAG_SEND_CACHE) {
            return Ok(());
        }
        self.ranged(proto::CMD_CACHE, offset, len, false, 0)
    }

    /// Allocation status of the range starting at `offset` (one round trip;
    /// the answer may cover less than `len`, or run past it).
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ClientError> {
        if self.info.meta_id.is_none() {
            return Err(ClientError::Unsupported("base:allocation"));
        }
        let len = len.min(u64::from(
            u32::MAX - u32::MAX % self.info.block_sizes.minimum,
        ));
        self.check_range(offset, len, false)?;
        let s = self.submit(proto::CMD_BLOCK_STATUS, 0, offset, len, None, &[])?;
        let ext = self.wait(&s)?;
        ext.ok_or_else(|| ClientError::ShortReply("block status without extents".into()))
    }

    /// Splits a payload-less command into u32-sized, aligned requests.
    fn ranged(
        &self,
        kind: u16,
        offset: u64,
        len: u64,
        fua: bool,
        extra: u16,
    ) -> Result<(), ClientError> {
        let native_fua = fua && self.has(proto::TFLAG_SEND_FUA);
        let flags = extra | if native_fua { proto::CMD_FLAG_FUA } else { 0 };
        let align = u64::from(self.info.block_sizes.minimum.max(4096));
        let mut max = u64::from(u32::MAX) - u64::from(u32::MAX) % align;
        if kind == proto::CMD_WRITE_ZEROES || kind == proto::CMD_CACHE {
            max = max.min(u64::from(
                self.info.block_sizes.maximum.max(self.info.max_request),
            ));
        }
        if len == 0 {
            let s = self.submit(kind, flags, offset, 0, None, &[])?;
            return self.wait(&s).map(|_| ());
        }
        let mut slots = Vec::new();
        let mut first_err = None;
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(max);
            match self.submit(kind, flags, offset + pos, n, None, &[]) {
                Ok(s) => slots.push(s),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
            pos += n;
        }
        self.wait_all(slots, first_err)?;
        if fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Registers a slot and sends the request. On a send failure the
    /// connection is cut, so the reader fails the slot; the caller still
    /// waits for it.
    fn submit(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u64,
        target: Option<ReadTarget>,
        payload: &[u8],
    ) -> Result<Arc<Slot>, ClientError> {
        let slot = Arc::new(Slot {
            kind,
            offset,
            len,
            target,
            state: Mutex::new(SlotState::default()),
            cv: Condvar::new(),
        });
        let cookie = {
            let mut t = lock(&self.inner.table);
            if let Some(reason) = &t.dead {
                return Err(ClientError::Disconnected(reason.clone()));
            }
            let c = t.next_cookie;
            t.next_cookie = t.next_cookie.wrapping_add(1);
            t.slots.insert(c, slot.clone());
            c
        };
        let hdr = Request {
            flags,
            kind,
            cookie,
            offset,
            length: len as u32,
        }
        .encode();
        let mut w = lock(&self.inner.writer);
        if let Err(e) = w.write_all_vectored(&mut [IoSlice::new(&hdr), IoSlice::new(payload)]) {
            debug!("nbd client: request write failed: {e}");
            // A partial request leaves the stream unusable: end it so the
            // reader completes every slot, including this one.
            w.abort();
        }
        Ok(slot)
    }

    fn wait(&self, slot: &Slot) -> Result<Option<Vec<Extent>>, ClientError> {
        let mut st = lock(&slot.state);
        while !st.done {
            st = slot.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match st.error.take() {
            Some(e) => Err(e),
            None => Ok(st.extents.take()),
        }
    }

    fn wait_all(
        &self,
        slots: Vec<Arc<Slot>>,
        first_err: Option<ClientError>,
    ) -> Result<(), ClientError> {
        let mut err = first_err;
        for s in &slots {
            if let Err(e) = self.wait(s) {
                err.get_or_insert(e);
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Sends `NBD_CMD_DISC` and closes the connection.
    pub fn disconnect(mut self) -> Result<(), ClientError> {
        self.close()
    }

    fn close(&mut self) -> Result<(), ClientError> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let hdr = Request {
            flags: 0,
            kind: proto::CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
        }
        .encode();
        let res = {
            let mut w = lock(&self.inner.writer);
            let r = w.write_all(&hdr);
            w.close();
            r
        };
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
        res.map_err(ClientError::Io)
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

fn connect_error(addr: String, e: io::Error) -> ClientError {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => ClientError::ConnectionRefused { addr },
        _ => ClientError::Connect { addr, source: e },
    }
}

/// The client side of the handshake, up to the transmission phase:
/// greeting, STARTTLS (swapping `r` and `w` for TLS halves), structured
/// replies, `base:allocation`, NBD_OPT_GO (or EXPORT_NAME on old servers).
/// Every reply is checked before it is believed.
fn negotiate(
    r: &mut ConnReader,
    w: &mut ConnWriter,
    export: &str,
    tls: Option<&TlsClientConfig>,
    server_name: &str,
    opts: &ClientOptions,
) -> Result<ExportInfo, ClientError> {
    let mut g = [0u8; 18];
    r.read_exact(&mut g).map_err(handshake_io)?;
    if proto::be64(&g[0..8]) != proto::NBD_MAGIC {
        return Err(ClientError::NotNbd("bad greeting magic".into()));
    }
    match proto::be64(&g[8..16]) {
        proto::IHAVEOPT => {}
        proto::CLISERV_MAGIC => return Err(ClientError::NotNbd("oldstyle server".into())),
        _ => return Err(ClientError::NotNbd("unknown handshake".into())),
    }
    let hflags = proto::be16(&g[16..18]);
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ClientError::NotNbd("server is not fixed newstyle".into()));
    }
    let no_zeroes = hflags & proto::FLAG_NO_ZEROES != 0;
    let cflags = proto::FLAG_C_FIXED_NEWSTYLE
        | if no_zeroes {
            proto::FLAG_C_NO_ZEROES
        } else {
            0
        };
    w.write_all(&cflags.to_be_bytes())?;

    if let Some(tls) = tls {
        send_option(w, proto::OPT_STARTTLS, &[])?;
        let (rep, data) = read_option_reply(r, proto::OPT_STARTTLS)?;
        if rep != proto::REP_ACK {
            return Err(ClientError::Tls(format!(
                "server refused STARTTLS: {}{}",
                proto::reply_name(rep),
                fmt_msg(&String::from_utf8_lossy(&data))
            )));
        }
        let mut sock = std::mem::replace(r, ConnReader::Closed)
            .into_plain_socket()
            .ok_or_else(|| ClientError::Tls("already TLS".into()))?;
        let conn = tls.session(server_name)?;
        let conn = tls_handshake(conn, &mut sock).map_err(|e| ClientError::Tls(e.to_string()))?;
        (*r, *w) = split_tls(sock, conn)?;
    }

    let mut structured = false;
    if opts.structured_replies {
        send_option(w, proto::OPT_STRUCTURED_REPLY, &[])?;
        let (rep, data) = read_option_reply(r, proto::OPT_STRUCTURED_REPLY)?;
        match rep {
            proto::REP_ACK => structured = true,
            proto::REP_ERR_TLS_REQD => return Err(ClientError::TlsRequired),
            x if x & proto::REP_ERR_BIT != 0 => {
                debug!(
                    "nbd client: no structured replies: {}",
                    proto::reply_name(x)
                );
            }
            x => return Err(refused(proto::OPT_STRUCTURED_REPLY, x, &data)),
        }
    }

    let mut meta_id = None;
    if structured && opts.block_status {
        let mut d = Vec::new();
        d.extend_from_slice(&(export.len() as u32).to_be_bytes());
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&(proto::META_BASE_ALLOCATION.len() as u32).to_be_bytes());
        d.extend_from_slice(proto::META_BASE_ALLOCATION.as_bytes());
        send_option(w, proto::OPT_SET_META_CONTEXT, &d)?;
        loop {
            let (rep, data) = read_option_reply(r, proto::OPT_SET_META_CONTEXT)?;
            match rep {
                proto::REP_META_CONTEXT if data.len() >= 4 => {
                    if &data[4..] == proto::META_BASE_ALLOCATION.as_bytes() {
                        meta_id = Some(proto::be32(&data[0..4]));
                    }
                }
                proto::REP_ACK => break,
                proto::REP_ERR_UNKNOWN => {
                    return Err(ClientError::ExportNotFound {
                        export: export.to_string(),
                        message: String::from_utf8_lossy(&data).into_owned(),
                    });
                }
                x if x & proto::REP_ERR_BIT != 0 => {
                    meta_id = None;
                    break;
                }
                x => return Err(refused(proto::OPT_SET_META_CONTEXT, x, &data)),
            }
        }
    }

    // NBD_OPT_GO, asking for block sizes (we honour them).
    let mut d = Vec::new();
    d.extend_from_slice(&(export.len() as u32).to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    send_option(w, proto::OPT_GO, &d)?;
    let mut size_flags: Option<(u64, u16)> = None;
    let mut bs: Option<BlockSizes> = None;
    loop {
        let (rep, data) = read_option_reply(r, proto::OPT_GO)?;
        match rep {
            proto::REP_INFO => {
                let mut c = Cursor::new(&data);
                match c.u16() {
                    Some(proto::INFO_EXPORT) => {
                        let (Some(size), Some(flags)) = (c.u64(), c.u16()) else {
                            return Err(ClientError::Protocol("short NBD_INFO_EXPORT".into()));
                        };
                        size_flags = Some((size, flags));
                    }
                    Some(proto::INFO_BLOCK_SIZE) => {
                        let (Some(minimum), Some(preferred), Some(maximum)) =
                            (c.u32(), c.u32(), c.u32())
                        else {
                            return Err(ClientError::Protocol("short NBD_INFO_BLOCK_SIZE".into()));
                        };
                        bs = Some(BlockSizes {
                            minimum,
                            preferred,
                            maximum,
                        });
                    }
                    _ => {}
                }
            }
            proto::REP_ACK => break,
            proto::REP_ERR_UNSUP => {
                // Old server: NBD_OPT_EXPORT_NAME cannot report errors.
                send_option(w, proto::OPT_EXPORT_NAME, export.as_bytes())?;
                let mut b = [0u8; 10];
                r.read_exact(&mut b).map_err(|e| match e.kind() {
                    io::ErrorKind::UnexpectedEof => ClientError::ExportNotFound {
                        export: export.to_string(),
                        message: "server closed the connection".into(),
                    },
                    _ => ClientError::Io(e),
                })?;
                if !no_zeroes {
                    let mut z = [0u8; 124];
                    r.read_exact(&mut z).map_err(handshake_io)?;
                }
                size_flags = Some((proto::be64(&b[0..8]), proto::be16(&b[8..10])));
                // Structured replies and contexts stay as negotiated.
                break;
            }
            proto::REP_ERR_UNKNOWN => {
                return Err(ClientError::ExportNotFound {
                    export: export.to_string(),
                    message: String::from_utf8_lossy(&data).into_owned(),
                });
            }
            proto::REP_ERR_TLS_REQD => return Err(ClientError::TlsRequired),
            x => return Err(refused(proto::OPT_GO, x, &data)),
        }
    }
    let (size, flags) =
        size_flags.ok_or_else(|| ClientError::Protocol("no NBD_INFO_EXPORT".into()))?;
    let block_sizes = sane_client_block_sizes(bs);
    let mut max_request = block_sizes
        .maximum
        .min(opts.max_request)
        .max(block_sizes.minimum);
    max_request -= max_request % block_sizes.minimum;
    Ok(ExportInfo {
        size,
        flags,
        block_sizes,
        structured,
        meta_id,
        max_request,
    })
}

fn sane_client_block_sizes(bs: Option<BlockSizes>) -> BlockSizes {
    let d = BlockSizes {
        minimum: 1,
        preferred: 4096,
        maximum: 32 << 20,
    };
    let Some(bs) = bs else { return d };
    let minimum = if bs.minimum.is_power_of_two() && bs.minimum <= 65536 {
        bs.minimum
    } else {
        1
    };
    let preferred = if bs.preferred.is_power_of_two() {
        bs.preferred
    } else {
        4096
    };
    let maximum = bs.maximum.max(minimum);
    BlockSizes {
        minimum,
        preferred,
        maximum,
    }
}

/// Largest chunk payload the reader accepts for non-data chunks.
const MAX_META_CHUNK: u32 = 16 << 20;

fn reader_thread(inner: &Inner, mut r: ConnReader, structured: bool) {
    // Fails every pending request when the reader stops, even by a panic,
    // so no caller waits forever on a slot nobody will complete.
    struct Cleanup<'a> {
        inner: &'a Inner,
        reason: String,
    }
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            let inner = self.inner;
            let reason = std::mem::take(&mut self.reason);
            debug!("nbd client: reader stops: {reason}");
            let slots: Vec<Arc<Slot>> = {
                let mut t = lock(&inner.table);
                t.dead = Some(reason.clone());
                t.slots.drain().map(|(_, s)| s).collect()
            };
            for s in slots {
                complete(&s, Some(ClientError::Disconnected(reason.clone())));
            }
            // Make sure writers blocked on a dead socket see it (without
            // taking the writer lock, which a blocked writer may hold).
            let _ = inner.ctl.shutdown(std::net::Shutdown::Both);
        }
    }
    let mut cleanup = Cleanup {
        inner,
        reason: "reader thread failed".to_string(),
    };
    cleanup.reason = match read_replies(&inner.table, &mut r, structured) {
        Ok(()) => "connection closed".to_string(),
        Err(e) => e,
    };
}

fn complete(slot: &Slot, error: Option<ClientError>) {
    let mut st = lock(&slot.state);
    if st.error.is_none() {
        st.error = error;
    }
    st.done = true;
    slot.cv.notify_all();
}

fn lookup(table: &Mutex<Table>, cookie: u64) -> Result<Arc<Slot>, String> {
    lock(table)
        .slots
        .get(&cookie)
        .cloned()
        .ok_or_else(|| format!("reply for unknown cookie {cookie}"))
}

fn finish(table: &Mutex<Table>, cookie: u64, slot: &Slot, error: Option<ClientError>) {
    lock(table).slots.remove(&cookie);
    complete(slot, error);
}

fn io_reason(e: io::Error) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => "server closed the connection".to_string(),
        _ => format!("read failed: {e}"),
    }
}

/// Runs `f` on the destination slice for `[off, off+len)` of a READ slot,
/// bounds-checked; the slice cannot escape `f`.
fn with_target<T>(
    slot: &Slot,
    off: u64,
    len: u64,
    f: impl FnOnce(&mut [u8]) -> T,
) -> Result<T, String> {
    let t = slot
        .target
        .as_ref()
        .ok_or_else(|| "data for a request without a buffer".to_string())?;
    let rel = off
        .checked_sub(slot.offset)
        .ok_or_else(|| "data chunk before the request".to_string())?;
    let end = rel
        .checked_add(len)
        .filter(|e| *e <= t.len as u64)
        .ok_or_else(|| "data chunk past the request".to_string())?;
    // SAFETY: `rel..end` lies within the caller's buffer of `t.len` bytes
    // (checked above). This runs on the reader thread while the slot is
    // registered and not done, so the caller is still waiting and does not
    // access the buffer (see `ReadTarget`); only this thread writes through
    // the pointer and the slice does not outlive `f`.
    let dst =
        unsafe { std::slice::from_raw_parts_mut(t.ptr.add(rel as usize), (end - rel) as usize) };
    Ok(f(dst))
}

/// Reads replies until EOF and completes the slots of `table` they answer;
/// `Err` names what was wrong with the stream.
fn read_replies(table: &Mutex<Table>, r: &mut ConnReader, structured: bool) -> Result<(), String> {
    loop {
        let mut magic = [0u8; 4];
        match r.read_exact(&mut magic) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io_reason(e)),
        }
        match u32::from_be_bytes(magic) {
            proto::SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; 12];
                r.read_exact(&mut h).map_err(io_reason)?;
                let error = proto::be32(&h[0..4]);
                let cookie = proto::be64(&h[4..12]);
                let slot = lookup(table, cookie)?;
                if error != 0 {
                    finish(
                        table,
                        cookie,
                        &slot,
                        Some(server_error(error, String::new())),
                    );
                    continue;
                }
                if slot.kind == proto::CMD_READ {
                    if structured {
                        return Err(
                            "simple reply with data to a READ after structured replies".into()
                        );
                    }
                    with_target(&slot, slot.offset, slot.len, |dst| r.read_exact(dst))?
                        .map_err(io_reason)?;
                } else if slot.kind == proto::CMD_BLOCK_STATUS {
                    return Err("simple reply to BLOCK_STATUS".into());
                }
                finish(table, cookie, &slot, None);
            }
            proto::STRUCTURED_REPLY_MAGIC if structured => {
                let mut h = [0u8; 16];
                r.read_exact(&mut h).map_err(io_reason)?;
                let flags = proto::be16(&h[0..2]);
                let kind = proto::be16(&h[2..4]);
                let cookie = proto::be64(&h[4..12]);
                let length = proto::be32(&h[12..16]);
                let slot = lookup(table, cookie)?;
                chunk(r, &slot, kind, length)?;
                if flags & proto::REPLY_FLAG_DONE != 0 {
                    let err = final_check(&slot);
                    finish(table, cookie, &slot, err);
                }
            }
            m => return Err(format!("bad reply magic {m:#x}")),
        }
    }
}

/// Reads one structured chunk's payload into the slot.
fn chunk(r: &mut ConnReader, slot: &Slot, kind: u16, length: u32) -> Result<(), String> {
    match kind {
        proto::REPLY_TYPE_NONE => {
            if length != 0 {
                return Err("NBD_REPLY_TYPE_NONE with a payload".into());
            }
        }
        proto::REPLY_TYPE_OFFSET_DATA => {
            if slot.kind != proto::CMD_READ || length < 9 {
                return Err("unexpected or short data chunk".into());
            }
            let mut o = [0u8; 8];
            r.read_exact(&mut o).map_err(io_reason)?;
            let off = u64::from_be_bytes(o);
            let n = u64::from(length - 8);
            with_target(slot, off, n, |dst| r.read_exact(dst))?.map_err(io_reason)?;
            lock(&slot.state).covered.push((off, n));
        }
        proto::REPLY_TYPE_OFFSET_HOLE => {
            if slot.kind != proto::CMD_READ || length != 12 {
                return Err("unexpected or malformed hole chunk".into());
            }
            let mut b = [0u8; 12];
            r.read_exact(&mut b).map_err(io_reason)?;
            let off = proto::be64(&b[0..8]);
            let n = u64::from(proto::be32(&b[8..12]));
            if n == 0 {
                return Err("empty hole chunk".into());
            }
            with_target(slot, off, n, |dst| dst.fill(0))?;
            lock(&slot.state).covered.push((off, n));
        }
        proto::REPLY_TYPE_BLOCK_STATUS => {
            if slot.kind != proto::CMD_BLOCK_STATUS
                || length < 12
                || !(length - 4).is_multiple_of(8)
                || length > MAX_META_CHUNK
            {
                return Err("unexpected or malformed block status chunk".into());
            }
            let mut b = vec![0u8; length as usize];
            r.read_exact(&mut b).map_err(io_reason)?;
            let mut ext = Vec::with_capacity((b.len() - 4) / 8);
            for d in b[4..].chunks_exact(8) {
                let l = proto::be32(&d[0..4]);
                let f = proto::be32(&d[4..8]);
                if l == 0 {
                    return Err("zero-length extent".into());
                }
                ext.push(Extent {
                    length: u64::from(l),
                    hole: f & proto::STATE_HOLE != 0,
                    zero: f & proto::STATE_ZERO != 0,
                });
            }
            lock(&slot.state).extents = Some(ext);
        }
        k if k & 0x8000 != 0 => {
            if !(6..=MAX_META_CHUNK).contains(&length) {
                return Err("malformed error chunk".into());
            }
            let mut b = vec![0u8; length as usize];
            r.read_exact(&mut b).map_err(io_reason)?;
            let code = proto::be32(&b[0..4]);
            let mlen = usize::from(proto::be16(&b[4..6]));
            if mlen > b.len() - 6 {
                return Err("error message longer than its chunk".into());
            }
            let msg = String::from_utf8_lossy(&b[6..6 + mlen]).into_owned();
            let mut st = lock(&slot.state);
            if st.error.is_none() {
                st.error = Some(server_error(
                    if code == 0 { proto::EINVAL } else { code },
                    msg,
                ));
            }
        }
        k => return Err(format!("unknown reply chunk type {k}")),
    }
    Ok(())
}

/// Runs the client's handshake against `input` as everything the server
/// says (the fuzzing entry points): the export's size and flags, or why
/// the server's side was refused.
pub(crate) fn negotiate_bytes(
    input: &[u8],
    opts: &ClientOptions,
) -> Result<(u64, u16), ClientError> {
    let mut r = ConnReader::Bytes(io::Cursor::new(input.to_vec()));
    let mut w = ConnWriter::Bytes(Arc::default());
    negotiate(&mut r, &mut w, "", None, "localhost", opts).map(|i| (i.size, i.flags))
}

/// Requests pending while [`replies_bytes`] reads (cookie = index + 1):
/// (command, offset, length).
pub(crate) const PENDING: [(u16, u64, u64); 6] = [
    (proto::CMD_READ, 0, 512),
    (proto::CMD_READ, 4096, 65536),
    (proto::CMD_BLOCK_STATUS, 0, 1 << 20),
    (proto::CMD_WRITE, 0, 4096),
    (proto::CMD_FLUSH, 0, 0),
    (proto::CMD_READ, 1 << 40, 1),
];

/// Per request: its data (reads), its extents' lengths (block status),
/// or its error.
pub(crate) type RequestResults = Vec<Result<Vec<u8>, ClientError>>;

/// Reads `input` as the server's replies to the [`PENDING`] requests (the
/// fuzzing entry points), as the reader thread does: how the stream
/// ended, and for each request its data (reads), its extents' lengths
/// (block status), or its error.
pub(crate) fn replies_bytes(
    input: &[u8],
    structured: bool,
) -> (Result<(), String>, RequestResults) {
    let mut bufs: Vec<Vec<u8>> = PENDING
        .iter()
        .map(|&(kind, _, len)| {
            vec![
                0u8;
                if kind == proto::CMD_READ {
                    len as usize
                } else {
                    0
                }
            ]
        })
        .collect();
    let table = Mutex::new(Table {
        slots: HashMap::new(),
        next_cookie: PENDING.len() as u64 + 1,
        dead: None,
    });
    // The buffers outlive the table and its slots, and nothing else
    // touches them until `read_replies` returned: the `ReadTarget`
    // contract, with this function as the waiting caller.
    let slots: Vec<Arc<Slot>> = PENDING
        .iter()
        .zip(bufs.iter_mut())
        .enumerate()
        .map(|(i, (&(kind, offset, len), buf))| {
            let slot = Arc::new(Slot {
                kind,
                offset,
                len,
                target: (kind == proto::CMD_READ).then_some(ReadTarget {
                    ptr: buf.as_mut_ptr(),
                    len: buf.len(),
                }),
                state: Mutex::new(SlotState::default()),
                cv: Condvar::new(),
            });
            lock(&table).slots.insert(i as u64 + 1, slot.clone());
            slot
        })
        .collect();
    let mut r = ConnReader::Bytes(io::Cursor::new(input.to_vec()));
    let end = read_replies(&table, &mut r, structured);
    // What the stream left unanswered fails, as when the reader stops.
    let left: Vec<Arc<Slot>> = lock(&table).slots.drain().map(|(_, s)| s).collect();
    for s in left {
        complete(&s, Some(ClientError::Disconnected("end of input".into())));
    }
    let results = slots
        .iter()
        .zip(bufs)
        .map(|(slot, buf)| {
            let mut st = lock(&slot.state);
            match st.error.take() {
                Some(e) => Err(e),
                None => Ok(match st.extents.take() {
                    Some(ext) => ext.iter().flat_map(|e| e.length.to_be_bytes()).collect(),
                    None => buf,
                }),
            }
        })
        .collect();
    (end, results)
}

/// After the final chunk: a READ must be fully and exactly covered.
fn final_check(slot: &Slot) -> Option<ClientError> {
    let mut st = lock(&slot.state);
    if st.error.is_some() {
        return None;
    }
    match slot.kind {
        proto::CMD_READ => {
            let mut c = std::mem::take(&mut st.covered);
            c.sort_unstable();
            let mut pos = slot.offset;
            for (o, n) in c {
                if o != pos {
                    return Some(ClientError::ShortReply(format!(
                        "read of {}+{}: {} at {o}",
                        slot.offset,
                        slot.len,
                        if o < pos { "overlapping chunk" } else { "gap" }
                    )));
                }
                pos = o + n;
            }
            (pos != slot.offset + slot.len).then(|| {
                ClientError::ShortReply(format!(
                    "read of {}+{} ended at {pos}",
                    slot.offset, slot.len
                ))
            })
        }
        proto::CMD_BLOCK_STATUS if st.extents.is_none() => Some(ClientError::ShortReply(
            "block status reply without extents".into(),
        )),
        _ => None,
    }
}

fn server_error(code: u32, message: String) -> ClientError {
    ClientError::Server {
        errno: ServerErrno(code),
        message,
    }
}
