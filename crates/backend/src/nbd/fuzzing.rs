//! Socket-free entry points of the NBD client for fuzzing (the cargo-fuzz
//! target `nbd_reply` under `fuzz/`) and for tests. Each feeds a byte slice
//! to the production client code through in-memory connection halves: the
//! same functions a socket connection runs, only the transport differs. The
//! server's entry points are in `vdcache_nbd_server::fuzzing`.
//!
//! Owns: the pending-request table an input runs against, and the meaning
//! of the selector byte below.
//! Must not: parse anything itself (a copy of a parser would be fuzzed
//! instead of the parser), or panic on any input.

use super::client::{self, ClientError, ClientOptions};

/// The client's handshake with `input` as everything the server says:
/// the export's (size, transmission flags), or why it was refused.
pub fn client_handshake(input: &[u8]) -> Result<(u64, u16), ClientError> {
    client::negotiate_bytes(input, &ClientOptions::default())
}

/// What the client made of a stream of replies.
#[derive(Debug)]
pub struct ClientReplies {
    /// `Err` when the stream broke the protocol (the connection would end).
    pub stream: Result<(), String>,
    /// Per pending request (see [`PENDING`]): the data of a read, the
    /// extent lengths (8 bytes each, big-endian) of a block status, or the
    /// error the request failed with.
    pub results: Vec<Result<Vec<u8>, ClientError>>,
}

/// The requests waiting for replies in [`client_replies`], cookie `i + 1`
/// for entry `i`: (command, offset, length).
pub const PENDING: [(u16, u64, u64); 6] = client::PENDING;

/// The client's reply parsing (simple and structured replies, block status
/// payloads) with `input[1..]` as the server's replies to [`PENDING`];
/// bit 0 of the first byte says whether structured replies were
/// negotiated.
pub fn client_replies(input: &[u8]) -> ClientReplies {
    let (structured, rest) = match input.split_first() {
        Some((&sel, rest)) => (sel & 1 != 0, rest),
        None => (false, input),
    };
    let (stream, results) = client::replies_bytes(rest, structured);
    ClientReplies { stream, results }
}
