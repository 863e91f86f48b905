//! The NBD server, a front end of vdcache: it serves [`Export`]s to
//! hypervisors and tools (qemu, nbdkit's tools, the kernel client, fio)
//! over Unix sockets, TCP and TLS, speaking the fixed newstyle handshake
//! with structured replies and `base:allocation` block status. Threads
//! only: one thread per connection reads requests, plus up to a few
//! workers that execute them.
//!
//! The wire format, URIs, TLS and the transport come from
//! `vdcache-nbd-proto`, which the NBD client (a backend) shares.
//!
//! Owns: the server's handshake and option parsing, request validation and
//! execution against an [`Export`], replies, per-connection and server-wide
//! limits, the [`Export`] contract, and the server-side fuzzing entry points.
//! Must not: know what an export stores (that is the COW engine's business),
//! depend on the client or any backend, or install signal handlers.

pub mod export;
pub mod fuzzing;
pub mod server;

pub use export::{BlockSizes, Export, ExportError, Extent, MemExport, ZeroFlags};
pub use server::{
    ConnectionStats, ExportStats, IoStats, Limits, Server, ServerBuilder, ServerError, ServerStats,
    ShutdownHandle,
};
pub use vdcache_nbd_proto::TlsServerConfig;
