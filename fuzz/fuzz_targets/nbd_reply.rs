//! The NBD client's parsing of what a server says: the same bytes as the
//! server's side of a handshake, and (after a selector byte: structured
//! replies or not) as replies to a fixed set of pending requests (simple
//! and structured replies, block status payloads, error chunks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = vdcache_backend::nbd::fuzzing::client_handshake(data);
    let _ = vdcache_backend::nbd::fuzzing::client_replies(data);
});
