//! The vhost-user-blk front end with arbitrary bytes as a guest's virtqueue
//! (its rings, descriptors, requests and kicks) or as a front end's
//! vhost-user messages; bit 0 of the first byte selects which (see
//! `vdcache_vhost_user_blk::fuzzing`). A queue stopped for a broken ring
//! must take nothing more.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some(run) = vdcache_vhost_user_blk::fuzzing::exercise(data) {
        assert_eq!(run.taken_while_stopped, 0, "a stopped queue took requests");
    }
});
