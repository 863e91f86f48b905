//! Byte transport under the NBD protocol: Unix or TCP sockets, optionally
//! upgraded to TLS in place after `NBD_OPT_STARTTLS`.
//!
//! Owns: splitting one connection into a reading half (used by one thread)
//! and a writing half (used under the caller's lock), TLS record handling
//! for both halves, vectored writes, clean close (TLS close_notify), and
//! naming the peer for per-client limits. In-memory halves
//! ([`ConnReader::Bytes`], [`ConnWriter::Bytes`]) run the same protocol
//! code over a byte slice for the fuzzing entry points.
//! Must not: interpret NBD messages, or block the reading half on a lock
//! that a blocked writer holds (the reader never waits for the socket
//! writer; see [`TlsShared`]).

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::tls_session::TlsSession;

/// A connected stream socket.
#[derive(Debug)]
pub enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Socket {
    pub fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Socket::Unix(s) => s.shutdown(how),
            Socket::Tcp(s) => s.shutdown(how),
        }
    }

    /// The client at the other end, for per-client connection limits.
    pub fn client(&self) -> PeerId {
        match self {
            Socket::Unix(s) => rustix::net::sockopt::socket_peercred(s)
                .map(|c| PeerId::Uid(c.uid.as_raw()))
                .unwrap_or(PeerId::Unknown),
            Socket::Tcp(s) => s
                .peer_addr()
                .map(|a| PeerId::Ip(a.ip().to_canonical()))
                .unwrap_or(PeerId::Unknown),
        }
    }

    /// True when the peer has sent bytes not yet read (or closed its
    /// side): one non-blocking peek, no wait.
    pub fn has_unread(&self) -> bool {
        let mut byte = [0u8; 1];
        let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
        let peeked = match self {
            Socket::Unix(s) => rustix::net::recv(s, &mut byte, flags),
            Socket::Tcp(s) => rustix::net::recv(s, &mut byte, flags),
        };
        // EOF (0 bytes) counts: the next read returns at once too.
        peeked.is_ok()
    }

    /// A printable peer address for logs and statistics.
    pub fn peer(&self) -> String {
        match self {
            Socket::Unix(_) => "unix".to_string(),
            Socket::Tcp(s) => s
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "tcp".to_string()),
        }
    }
}

/// Who connected: a TCP peer's IP address (an IPv4 address reached over
/// IPv6 counts as the IPv4 address), or a Unix socket peer's uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerId {
    Ip(IpAddr),
    Uid(u32),
    /// The kernel could not say (the peer already left).
    Unknown,
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.read(buf),
            Socket::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.write(buf),
            Socket::Tcp(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.write_vectored(bufs),
            Socket::Tcp(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes every byte of `bufs` with as few syscalls as the kernel allows.
pub fn write_all_vectored(w: &mut impl Write, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut bufs = bufs;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// TLS state shared by the two halves of a connection.
///
/// Locking: `state` (the TLS state machine plus encrypted bytes waiting to
/// be sent) is only held for in-memory work, never across a socket call.
/// `send` (the socket's writing clone) is held while sending; only whoever
/// holds it takes bytes out of `pending`, so bytes reach the socket in the
/// order the TLS engine produced them. The reading half only ever `try_lock`s `send`:
/// if a writer holds it, the writer sends the reader's bytes too before
/// releasing (or, in a narrow race, with its next write).
pub struct TlsShared {
    state: Mutex<TlsState>,
    send: Mutex<Socket>,
    /// Another clone of the socket, only for `shutdown` (never blocks).
    ctl: Socket,
}

struct TlsState {
    session: TlsSession,
    pending: Vec<u8>,
}

impl TlsShared {
    /// Drains encrypted output into `pending` (in memory, cannot block).
    fn collect(st: &mut TlsState) -> io::Result<()> {
        let TlsState { session, pending } = st;
        session.take_output(pending)
    }

    /// With `send` held: sends everything pending until nothing is left.
    fn drain(&self, sock: &mut Socket) -> io::Result<()> {
        let mut buf = Vec::new();
        loop {
            {
                let mut st = lock(&self.state);
                std::mem::swap(&mut buf, &mut st.pending);
            }
            if buf.is_empty() {
                return Ok(());
            }
            sock.write_all(&buf)?;
            buf.clear();
        }
    }
}

/// Runs a TLS handshake to completion on a blocking socket. Bytes the
/// peer sent right behind its last handshake message stay in the session.
pub fn tls_handshake(mut session: TlsSession, sock: &mut Socket) -> io::Result<TlsSession> {
    let mut out = Vec::new();
    let mut raw = vec![0u8; 16 * 1024];
    let mut fed = session.feed(&[]).map(drop);
    loop {
        session.take_output(&mut out)?;
        if !out.is_empty() {
            // On failure the alert goes out before the error is returned.
            let sent = sock.write_all(&out);
            out.clear();
            if fed.is_ok() {
                sent?;
            }
        }
        fed?;
        if !session.is_handshaking() {
            return Ok(session);
        }
        let n = loop {
            match sock.read(&mut raw) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed during TLS handshake",
            ));
        }
        fed = feed_all(&mut session, &raw[..n]);
    }
}

fn feed_all(session: &mut TlsSession, mut raw: &[u8]) -> io::Result<()> {
    while !raw.is_empty() {
        let n = session.feed(raw)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "TLS engine took no bytes during the handshake",
            ));
        }
        raw = &raw[n..];
    }
    Ok(())
}

/// The reading half of a connection.
pub enum ConnReader {
    Plain(BufReader<Socket>),
    Tls(TlsReader),
    /// Placeholder while a socket is being upgraded; reads see EOF.
    Closed,
    /// Bytes in memory instead of a socket (fuzzing entry points).
    Bytes(io::Cursor<Vec<u8>>),
}

/// The writing half of a connection.
pub enum ConnWriter {
    Plain(Socket),
    Tls(Arc<TlsShared>),
    /// Collects what would be sent (fuzzing entry points); shared so the
    /// caller can look at it after the protocol code dropped the writer.
    Bytes(Arc<Mutex<Vec<u8>>>),
}

/// Splits a plain socket into halves.
pub fn split_plain(sock: Socket) -> io::Result<(ConnReader, ConnWriter)> {
    let w = sock.try_clone()?;
    Ok((
        ConnReader::Plain(BufReader::with_capacity(64 * 1024, sock)),
        ConnWriter::Plain(w),
    ))
}

/// Splits a socket whose TLS handshake is complete into halves.
pub fn split_tls(sock: Socket, session: TlsSession) -> io::Result<(ConnReader, ConnWriter)> {
    let w = sock.try_clone()?;
    let ctl = sock.try_clone()?;
    let shared = Arc::new(TlsShared {
        state: Mutex::new(TlsState {
            session,
            pending: Vec::new(),
        }),
        send: Mutex::new(w),
        ctl,
    });
    Ok((
        ConnReader::Tls(TlsReader {
            shared: shared.clone(),
            sock,
            raw: vec![0u8; 64 * 1024].into_boxed_slice(),
            pos: 0,
            end: 0,
        }),
        ConnWriter::Tls(shared),
    ))
}

impl ConnReader {
    /// True when bytes the peer sent are buffered but not yet consumed
    /// (used to refuse data pipelined behind `NBD_OPT_STARTTLS`).
    pub fn has_buffered(&self) -> bool {
        match self {
            ConnReader::Plain(b) => !b.buffer().is_empty(),
            ConnReader::Tls(t) => t.pos < t.end,
            ConnReader::Closed => false,
            ConnReader::Bytes(b) => remaining(b) > 0,
        }
    }

    /// True when a read would find bytes (or EOF) without waiting: buffered
    /// here or already in the socket. One non-blocking system call at most.
    pub fn would_not_wait(&self) -> bool {
        match self {
            ConnReader::Plain(b) => !b.buffer().is_empty() || b.get_ref().has_unread(),
            ConnReader::Tls(t) => t.pos < t.end || t.sock.has_unread(),
            ConnReader::Closed => true,
            ConnReader::Bytes(b) => remaining(b) > 0,
        }
    }

    /// Bytes of a plain connection received but not yet consumed (0 for
    /// TLS, whose records are decrypted as they are read).
    pub fn buffered_len(&self) -> usize {
        match self {
            ConnReader::Plain(b) => b.buffer().len(),
            ConnReader::Tls(_) | ConnReader::Closed => 0,
            ConnReader::Bytes(b) => remaining(b),
        }
    }

    /// Gives back the plain socket (before a TLS upgrade).
    pub fn into_plain_socket(self) -> Option<Socket> {
        match self {
            ConnReader::Plain(b) => Some(b.into_inner()),
            ConnReader::Tls(_) | ConnReader::Closed | ConnReader::Bytes(_) => None,
        }
    }
}

fn remaining(b: &io::Cursor<Vec<u8>>) -> usize {
    let len = b.get_ref().len() as u64;
    len.saturating_sub(b.position()) as usize
}

impl Read for ConnReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ConnReader::Plain(b) => b.read(buf),
            ConnReader::Tls(t) => t.read(buf),
            ConnReader::Closed => Ok(0),
            ConnReader::Bytes(b) => b.read(buf),
        }
    }
}

impl ConnWriter {
    /// Sends all of `bufs`, in order, as one contiguous stream segment.
    pub fn write_all_vectored(&mut self, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        match self {
            ConnWriter::Plain(s) => write_all_vectored(s, bufs),
            ConnWriter::Bytes(v) => {
                let mut v = lock(v);
                for b in bufs.iter() {
                    v.extend_from_slice(b);
                }
                Ok(())
            }
            ConnWriter::Tls(shared) => {
                let mut sock = lock(&shared.send);
                for b in bufs.iter() {
                    let mut rest: &[u8] = b;
                    while !rest.is_empty() {
                        {
                            let mut st = lock(&shared.state);
                            let n = st.session.write_plain(rest)?;
                            TlsShared::collect(&mut st)?;
                            if n == 0 && st.pending.is_empty() {
                                return Err(io::ErrorKind::WriteZero.into());
                            }
                            rest = &rest[n..];
                        }
                        shared.drain(&mut sock)?;
                    }
                }
                shared.drain(&mut sock)
            }
        }
    }

    pub fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_all_vectored(&mut [IoSlice::new(buf)])
    }

    /// Ends the connection: TLS close_notify if TLS, then shuts the socket down.
    pub fn close(&mut self) {
        match self {
            ConnWriter::Plain(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            ConnWriter::Tls(shared) => {
                let mut sock = lock(&shared.send);
                {
                    let mut st = lock(&shared.state);
                    st.session.close_notify();
                    let _ = TlsShared::collect(&mut st);
                }
                let _ = shared.drain(&mut sock);
                let _ = sock.shutdown(Shutdown::Both);
            }
            ConnWriter::Bytes(_) => {}
        }
    }

    /// Shuts the socket down without any TLS goodbye (to unblock a reader).
    pub fn abort(&self) {
        match self {
            ConnWriter::Plain(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            ConnWriter::Tls(shared) => {
                let _ = shared.ctl.shutdown(Shutdown::Both);
            }
            ConnWriter::Bytes(_) => {}
        }
    }
}

/// The reading half of a TLS connection: raw bytes are read from the socket
/// without any lock, then decrypted under the state lock.
pub struct TlsReader {
    shared: Arc<TlsShared>,
    sock: Socket,
    raw: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            let have_output;
            // Some(..): done; None: fed raw bytes, look again; or need more raw bytes.
            let (result, need_raw) = {
                let mut st = lock(&self.shared.state);
                let step = match st.session.read_plain(out) {
                    Ok(n) => (Some(Ok(n)), false),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if self.pos < self.end {
                            match st.session.feed(&self.raw[self.pos..self.end]) {
                                Ok(n) => {
                                    self.pos += n;
                                    (None, false)
                                }
                                Err(e) => (Some(Err(e)), false),
                            }
                        } else {
                            (None, true)
                        }
                    }
                    Err(e) => (Some(Err(e)), false),
                };
                // Reading can produce output too (alerts, key update replies).
                TlsShared::collect(&mut st)?;
                have_output = !st.pending.is_empty();
                step
            };
            if have_output {
                // Never wait for the sender: if it is busy it will send these too.
                if let Ok(mut sock) = self.shared.send.try_lock() {
                    let _ = self.shared.drain(&mut sock);
                }
            }
            if let Some(r) = result {
                return r;
            }
            if need_raw {
                let n = loop {
                    match self.sock.read(&mut self.raw) {
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        r => break r?,
                    }
                };
                if n == 0 {
                    return Ok(0);
                }
                self.pos = 0;
                self.end = n;
            }
        }
    }
}
