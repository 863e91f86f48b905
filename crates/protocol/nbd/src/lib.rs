//! The NBD (Network Block Device) wire protocol as both ends speak it:
//! message constants, encoding and decoding of requests and replies
//! ([`proto`]), `nbd://` URIs ([`uri`]), the value types an export and a
//! client exchange ([`BlockSizes`], [`ZeroFlags`], [`Extent`]), TLS
//! configuration (X.509 with rustls, pre-shared keys with OpenSSL, behind
//! one socket-free session type) and the byte transport that splits a
//! connection into a reading and a writing half.
//!
//! The server (a front end, `vdcache-nbd-server`) and the client (a
//! storage backend, in `vdcache-backend`) both build on this crate and on
//! nothing of each other.
//!
//! Owns: the wire format, URIs, TLS and PSK setup, the shared transport.
//! Must not: contain the server or the client (no handshake state machine of
//! either side, no export, no request table), know what an export stores, or
//! install signal handlers.

pub mod proto;
pub mod psk;
pub mod tls;
pub mod tls_session;
pub mod transport;
pub mod uri;
mod values;

pub use tls::{TlsClientConfig, TlsConfigError, TlsServerConfig};
pub use uri::{NbdUri, Transport, UriError};
pub use values::{BlockSizes, Extent, ZeroFlags};
