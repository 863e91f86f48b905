//! NBD (Network Block Device) protocol for vdcache: a server that serves
//! [`Export`]s to hypervisors and tools (qemu, nbdkit's tools, the kernel
//! client, fio), and a client, [`NbdClient`], that uses a remote NBD
//! export as a storage backend.
//!
//! Both speak the fixed newstyle handshake with structured replies and
//! `base:allocation` block status, over Unix sockets, TCP, and TLS (X.509
//! certificates, rustls). Threads only: the server runs one thread per
//! connection that reads requests plus up to a few workers that execute them;
//! the client runs one reader thread that hands replies to waiting callers.
//!
//! TLS-PSK (the `username:hexkey` files of qemu and nbdkit) is not
//! available: rustls does not implement external pre-shared keys (TLS 1.3
//! `psk_ke`/`psk_dhe_ke` with imported keys, or the TLS 1.2 PSK suites).
//! Supporting it would need an OpenSSL or GnuTLS binding behind the same
//! transport interface.
//!
//! Owns: the wire protocol. Must not: know what the export stores (that is
//! the COW engine's business) or install signal handlers.

pub mod client;
pub mod export;
pub mod proto;
pub mod server;
pub mod tls;
mod transport;
pub mod uri;

pub use client::{ClientError, ClientOptions, NbdClient, ServerErrno};
pub use export::{BlockSizes, Export, ExportError, Extent, MemExport, ZeroFlags};
pub use server::{
    ConnectionStats, ExportStats, IoStats, Limits, Server, ServerBuilder, ServerError, ServerStats,
    ShutdownHandle,
};
pub use tls::{TlsClientConfig, TlsConfigError, TlsServerConfig};
pub use uri::{NbdUri, Transport};
