//! Every file descriptor a vhost-user connection opened is closed when it
//! ends. vhost-user-backend 0.24 never closes the exit event it is
//! given per queue thread: each connection leaked two (the fuzz target
//! `vhost_user` hung after about 10 000 connections, when accept() failed
//! for want of descriptors and QEMU would have waited for ever). Alone in
//! its test binary: other tests would open descriptors meanwhile.

use vdcache_vhost_user_blk::fuzzing::{ConnectionInput, Data, RingBuilder, exercise_connection};
use virtio_bindings::virtio_blk::VIRTIO_BLK_T_IN;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

#[test]
fn connections_leave_no_file_descriptor_open() {
    let mut ring = RingBuilder::new(3, true);
    let at = ring.free();
    ring.request(at, VIRTIO_BLK_T_IN, 0, Data::In(512));
    let input = ConnectionInput::negotiated(&ring);
    // The first run opens what stays open for good (the test harness's).
    exercise_connection(&input).expect("a server");
    let before = open_fds();
    for _ in 0..20 {
        exercise_connection(&input).expect("a server");
    }
    assert_eq!(
        open_fds(),
        before,
        "descriptors left open by 20 connections"
    );
}
