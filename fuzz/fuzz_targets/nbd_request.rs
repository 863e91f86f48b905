//! The NBD server's request header parsing, validation, execution and
//! replies with arbitrary bytes as the client's requests; the first byte
//! selects what the handshake negotiated (see `vdcache_nbd_server::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = vdcache_nbd_server::fuzzing::server_requests(data);
});
