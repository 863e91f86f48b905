//! Socket-free entry points of the server for fuzzing (the cargo-fuzz
//! targets under `fuzz/`) and for tests. Each feeds a byte slice to the
//! production server code through in-memory connection halves: the same
//! functions a socket connection runs, only the transport differs. The
//! client's entry points are in `vdcache_backend::nbd::fuzzing`.
//!
//! Owns: the small servers an input runs against, and the meaning of the
//! selector bytes below.
//! Must not: parse anything itself (a copy of a parser would be fuzzed
//! instead of the parser), or panic on any input.

use std::sync::{Arc, OnceLock};

use vdcache_nbd_proto::psk::PskKeys;
use vdcache_nbd_proto::tls::TlsServerConfig;

use crate::export::{BlockSizes, MemExport};
use crate::server::{Limits, Server};

/// Export size of the fuzzing servers: small, so reads and writes are cheap.
pub const EXPORT_SIZE: u64 = 64 << 10;

/// What a server said to one connection.
#[derive(Debug)]
pub struct ServerRun {
    /// The handshake completed (or was skipped) and requests were served.
    pub transmission: bool,
    /// Every byte the server sent.
    pub sent: Vec<u8>,
}

/// A server with exports `""` (read-write), `"ro"` (read-only) and
/// `"b512"` (512-byte minimum block size), with small limits so the
/// streaming paths run too (payloads over 4 KiB are streamed).
fn server(tls_required: bool) -> Option<Server> {
    let limits = Limits {
        max_payload: 32 << 10,
        payload_chunk: 4096,
        max_buffered_bytes: 64 << 10,
        workers_per_connection: 1,
        max_option_len: 4096,
        max_options: 64,
        handshake_timeout: None,
        ..Limits::default()
    };
    let b512 = BlockSizes {
        minimum: 512,
        preferred: 4096,
        maximum: 16 << 10,
    };
    let mut b = Server::builder()
        .limits(limits)
        .export_with_description("", "fuzz", Arc::new(MemExport::new(EXPORT_SIZE)))
        .export("ro", Arc::new(MemExport::new(EXPORT_SIZE).read_only(true)))
        .export(
            "b512",
            Arc::new(MemExport::new(EXPORT_SIZE).block_sizes(b512)),
        );
    if tls_required {
        b = b.tls(psk_config()?);
    }
    b.build().ok()
}

/// A PSK configuration (made once: OpenSSL contexts are slow to build).
/// Without a socket STARTTLS cannot complete, but requiring TLS runs the
/// refusals that guard everything before it.
fn psk_config() -> Option<TlsServerConfig> {
    static CONFIG: OnceLock<Option<TlsServerConfig>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let keys = PskKeys::parse("fuzz:000102030405060708090a0b0c0d0e0f").ok()?;
            TlsServerConfig::from_psk_keys(keys).ok()
        })
        .clone()
}

/// The server's handshake (then, if it completes, its transmission
/// phase) with `input` as everything the client sends, on a server
/// without TLS and on one that requires it. Returns the run without TLS.
pub fn server_handshake(input: &[u8]) -> ServerRun {
    if let Some(s) = server(true) {
        let _ = s.serve_bytes(input, None);
    }
    run(server(false), input, None)
}

/// The server's transmission phase (request parsing, validation,
/// execution, replies) with `input[1..]` as the client's requests. The
/// first byte selects what was negotiated: bit 0 structured replies, bit 1
/// `base:allocation`, bits 2-3 the export (0 and 3: `""`, 1: `"ro"`, 2:
/// `"b512"`).
pub fn server_requests(input: &[u8]) -> ServerRun {
    let Some((&sel, rest)) = input.split_first() else {
        return ServerRun {
            transmission: false,
            sent: Vec::new(),
        };
    };
    let export = match (sel >> 2) & 3 {
        1 => 1,
        2 => 2,
        _ => 0,
    };
    run(
        server(false),
        rest,
        Some((export, sel & 1 != 0, sel & 2 != 0)),
    )
}

fn run(server: Option<Server>, input: &[u8], preset: Option<(usize, bool, bool)>) -> ServerRun {
    let Some(server) = server else {
        return ServerRun {
            transmission: false,
            sent: Vec::new(),
        };
    };
    let (transmission, sent) = server.serve_bytes(input, preset);
    ServerRun { transmission, sent }
}
