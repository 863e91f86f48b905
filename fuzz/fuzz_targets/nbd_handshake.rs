//! The NBD server's handshake and option parsing with arbitrary bytes as
//! everything the client sends (and, when a handshake completes, the
//! transmission phase on the bytes after it), on a server without TLS and
//! on one that requires it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = vdcache_nbd_server::fuzzing::server_handshake(data);
});
