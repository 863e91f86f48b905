//! NBD (Network Block Device) protocol for vdcache: a server that serves
//! [`Export`]s to hypervisors and tools (qemu, nbdkit's tools, the kernel
//! client, fio), and a client, [`NbdClient`], that uses a remote NBD
//! export as a storage backend.
//!
//! Both speak the fixed newstyle handshake with structured replies and
//! `base:allocation` block status, over Unix sockets, TCP, and TLS (X.509
//! certificates with rustls, or pre-shared keys). Threads only: the server runs one thread per
//! connection that reads requests plus up to a few workers that execute them;
//! the client runs one reader thread that hands replies to waiting callers.
//!
//! TLS-PSK (the `username:hexkey` files of qemu and nbdkit) runs on
//! OpenSSL, because rustls does not implement external pre-shared keys;
//! both engines sit behind one socket-free session type.
//!
//! Owns: the wire protocol. Must not: know what the export stores (that is
//! the COW engine's business) or install signal handlers.

pub mod client;
pub mod export;
pub mod fuzzing;
pub mod proto;
pub mod psk;
pub mod server;
pub mod tls;
mod tls_session;
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
