//! One TLS session as a socket-free state machine: encrypted bytes go in
//! with [`TlsSession::feed`] and come out with [`TlsSession::take_output`];
//! plaintext is read and written in between. Two engines sit behind it:
//! rustls for X.509 certificates, and OpenSSL for pre-shared keys (rustls
//! has no external PSK).
//!
//! Owns: driving either engine over in-memory buffers, mapping their
//! errors to `io::Error`. Must not: touch sockets (that is `transport`'s
//! job, which needs the reading and writing halves of one connection to
//! share a session under its own lock).

use std::io::{self, Read, Write};

use openssl::ssl::{ErrorCode, SslStream};

/// OpenSSL's view of the wire: bytes received but not yet consumed, and
/// bytes produced but not yet sent. Reading an empty pipe is `WouldBlock`,
/// which OpenSSL reports as "want read" so that the caller can fetch more.
#[derive(Debug, Default)]
pub struct MemPipe {
    incoming: Vec<u8>,
    consumed: usize,
    outgoing: Vec<u8>,
}

impl Read for MemPipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let avail = &self.incoming[self.consumed..];
        if avail.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = avail.len().min(buf.len());
        buf[..n].copy_from_slice(&avail[..n]);
        self.consumed += n;
        if self.consumed == self.incoming.len() {
            self.incoming.clear();
            self.consumed = 0;
        }
        Ok(n)
    }
}

impl Write for MemPipe {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.outgoing.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A TLS session of either engine.
pub enum TlsSession {
    Rustls(Box<rustls::Connection>),
    OpenSsl(Box<SslStream<MemPipe>>),
}

fn openssl_error(e: openssl::ssl::Error) -> io::Error {
    match e.into_io_error() {
        Ok(io) => io,
        Err(e) => io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
    }
}

impl TlsSession {
    pub fn is_handshaking(&self) -> bool {
        match self {
            TlsSession::Rustls(c) => c.is_handshaking(),
            TlsSession::OpenSsl(s) => !s.ssl().is_init_finished(),
        }
    }

    /// Hands encrypted bytes from the peer to the engine and lets it
    /// process them (handshake messages, alerts). Returns how many bytes
    /// were taken; the caller offers the rest again after reading
    /// plaintext. An empty `raw` just lets the engine start or continue.
    pub fn feed(&mut self, raw: &[u8]) -> io::Result<usize> {
        match self {
            TlsSession::Rustls(c) => {
                let mut slice = raw;
                let n = if slice.is_empty() {
                    0
                } else {
                    c.read_tls(&mut slice)?
                };
                c.process_new_packets()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                Ok(n)
            }
            TlsSession::OpenSsl(s) => {
                s.get_mut().incoming.extend_from_slice(raw);
                if !s.ssl().is_init_finished() {
                    match s.do_handshake() {
                        Ok(()) => {}
                        Err(e) if e.code() == ErrorCode::WANT_READ => {}
                        Err(e) => return Err(openssl_error(e)),
                    }
                }
                Ok(raw.len())
            }
        }
    }

    /// Decrypted bytes: `Ok(0)` once the peer closed the session,
    /// `WouldBlock` when more encrypted input is needed.
    pub fn read_plain(&mut self, out: &mut [u8]) -> io::Result<usize> {
        match self {
            TlsSession::Rustls(c) => c.reader().read(out),
            TlsSession::OpenSsl(s) => match s.ssl_read(out) {
                Ok(n) => Ok(n),
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
                Err(e) if e.code() == ErrorCode::WANT_READ => Err(io::ErrorKind::WouldBlock.into()),
                Err(e) => Err(openssl_error(e)),
            },
        }
    }

    /// Encrypts `buf` into the engine's output (never waits for the peer).
    pub fn write_plain(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            TlsSession::Rustls(c) => c.writer().write(buf),
            TlsSession::OpenSsl(s) => s.ssl_write(buf).map_err(openssl_error),
        }
    }

    /// Appends every encrypted byte waiting to be sent to `out`.
    pub fn take_output(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        match self {
            TlsSession::Rustls(c) => {
                while c.wants_write() {
                    c.write_tls(out)?;
                }
                Ok(())
            }
            TlsSession::OpenSsl(s) => {
                out.append(&mut s.get_mut().outgoing);
                Ok(())
            }
        }
    }

    /// Queues the TLS goodbye (close_notify).
    pub fn close_notify(&mut self) {
        match self {
            TlsSession::Rustls(c) => c.send_close_notify(),
            TlsSession::OpenSsl(s) => {
                // Only queues an alert into the pipe; a failure means the
                // session is already unusable and the socket closes anyway.
                let _ = s.shutdown();
            }
        }
    }
}
