//! A hostile guest's virtqueue, served by the device's own queue loop (the
//! fuzzing entry point's queue layout, see `fuzzing`): a ring that breaks
//! virtio's rules stops its queue, which takes nothing more until the
//! front end restarts it; a malformed request fails alone and the queue
//! goes on. Every run ends (a loop would hang the test).

use vdcache_vhost_user_blk::fuzzing::{
    Data, Desc, Op, QueueRun, REGION0, RingBuilder, exercise_queue,
};
use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_NEXT;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
/// Status byte of a request the device never answered.
const UNTOUCHED: u8 = 0xff;

fn run(b: &RingBuilder) -> QueueRun {
    let run = exercise_queue(&b.input).expect("the queue could be set up");
    assert_eq!(run.taken_while_stopped, 0, "a stopped queue took requests");
    run
}

fn status(run: &QueueRun, at: u64) -> u8 {
    RingBuilder::status(&run.memory, at).expect("status inside memory")
}

/// A ring with one read at `at`, kicked once.
fn one_read(event_idx: bool, at: u64) -> RingBuilder {
    let mut b = RingBuilder::new(3, event_idx);
    b.request(at, VIRTIO_BLK_T_IN, 0, Data::In(4096));
    b.op(Op::Kick);
    b
}

#[test]
fn an_available_index_past_the_queue_size_stops_the_queue_until_a_restart() {
    for event_idx in [false, true] {
        let mut b = RingBuilder::new(8, event_idx);
        let (first, second) = (0x2000, 0x4000);
        b.request(first, VIRTIO_BLK_T_IN, 0, Data::In(512));
        b.request(second, VIRTIO_BLK_T_IN, 8, Data::In(512));
        // Only the first is available to begin with.
        b.set_avail_idx(1);
        let idx = b.avail_idx_at();
        b.op(Op::Kick)
            .op(Op::Poke {
                at: idx,
                value: 40000,
            })
            .op(Op::Kick)
            .op(Op::Kick);
        let stopped = run(&b);
        assert!(stopped.stopped, "event_idx {event_idx}: the queue goes on");
        assert_eq!(stopped.taken, 1);
        assert_eq!(status(&stopped, first), OK);
        assert_eq!(status(&stopped, second), UNTOUCHED);

        // The guest resets the device: the front end restarts the queue
        // and the driver's ring is sane again.
        b.op(Op::Restart)
            .op(Op::Poke { at: idx, value: 2 })
            .op(Op::Kick);
        let served = run(&b);
        assert!(!served.stopped);
        assert_eq!(served.taken, 2);
        assert_eq!(status(&served, second), OK);
        assert_eq!(served.totals.reads, 2);
    }
}

#[test]
fn a_restart_with_the_index_still_broken_stops_the_queue_again() {
    let mut b = one_read(true, 0x2000);
    let idx = b.avail_idx_at();
    b.op(Op::Poke {
        at: idx,
        value: 40000,
    })
    .op(Op::Kick)
    .op(Op::Restart)
    .op(Op::Kick)
    .op(Op::Kick);
    let r = run(&b);
    assert!(r.stopped);
    assert_eq!(r.taken, 1);
}

#[test]
fn an_entry_naming_a_descriptor_past_the_queue_stops_the_queue() {
    for event_idx in [false, true] {
        let mut b = RingBuilder::new(3, event_idx);
        b.make_available(300);
        b.request(0x2000, VIRTIO_BLK_T_IN, 0, Data::In(512));
        b.op(Op::Kick).op(Op::Kick);
        let r = run(&b);
        assert!(r.stopped, "event_idx {event_idx}");
        assert_eq!(r.taken, 1, "only the bad entry was taken");
        assert_eq!(status(&r, 0x2000), UNTOUCHED);
        assert_eq!(r.totals.errors, 0, "no request was carried out");
    }
}

#[test]
fn an_available_ring_whose_entries_lie_outside_memory_stops_the_queue() {
    for event_idx in [false, true] {
        let mut b = RingBuilder::new(3, event_idx);
        // The index is the region's last two bytes; the entries are past it.
        b.input.avail = REGION0.1 as u32 - 4;
        b.input.ops = vec![
            Op::Poke {
                at: REGION0.1 as u16 - 2,
                value: 1,
            },
            Op::Kick,
            Op::Kick,
        ];
        let r = run(&b);
        assert!(r.stopped, "event_idx {event_idx}");
        assert_eq!(r.taken, 0);
    }
}

#[test]
fn rings_outside_guest_memory_stop_the_queue() {
    // The available ring in the hole between the regions, and the used
    // ring there (with and without EVENT_IDX, which writes to it first).
    for (event_idx, avail_in_hole) in [(false, true), (true, false), (false, false)] {
        let mut b = one_read(event_idx, 0x2000);
        if avail_in_hole {
            b.input.avail = REGION0.1 as u32 + 0x100;
        } else {
            b.input.used = REGION0.1 as u32 + 0x100;
        }
        b.op(Op::Kick);
        let r = run(&b);
        assert!(
            r.stopped,
            "event_idx {event_idx}, avail in hole {avail_in_hole}"
        );
        assert!(r.taken <= 1);
    }
}

/// Requests the guest got wrong fail alone: the next request is served.
fn fails_alone(bad: impl Fn(&mut RingBuilder), expect: u8) {
    for event_idx in [false, true] {
        let mut b = RingBuilder::new(4, event_idx);
        bad(&mut b);
        let good = 0x3000;
        b.request(good, VIRTIO_BLK_T_IN, 0, Data::In(512));
        b.op(Op::Kick);
        let r = run(&b);
        assert!(!r.stopped, "event_idx {event_idx}: the queue stopped");
        assert_eq!(r.taken, 2);
        assert_eq!(status(&r, good), OK);
        assert_eq!(r.totals.errors, 1);
        assert_eq!(status(&r, 0x2000), expect, "the bad request's status");
    }
}

#[test]
fn a_descriptor_chain_that_loops_fails_alone() {
    fails_alone(
        |b| {
            let desc = u64::from(b.input.desc);
            b.put(0x2000, &[0u8; 16]);
            b.put(0x2010, &[UNTOUCHED]);
            let header = Desc {
                addr: 0x2000,
                len: 16,
                write: false,
            };
            let status = Desc {
                addr: 0x2010,
                len: 1,
                write: true,
            };
            // 14 -> 15 -> 14 -> ... (the good request takes 0 to 2).
            b.put_desc(desc, 14, header, VRING_DESC_F_NEXT as u16, 15);
            b.put_desc(desc, 15, status, VRING_DESC_F_NEXT as u16, 14);
            b.make_available(14);
        },
        // The loop is cut at the queue size: the last writable byte seen
        // gets the status.
        IOERR,
    );
}

#[test]
fn a_read_only_status_descriptor_fails_alone() {
    fails_alone(
        |b| {
            b.put(0x2000, &[0u8; 16]);
            b.put(0x2010, &[UNTOUCHED]);
            b.post(&[
                Desc {
                    addr: 0x2000,
                    len: 16,
                    write: false,
                },
                Desc {
                    addr: 0x2010,
                    len: 1,
                    write: false,
                },
            ]);
        },
        UNTOUCHED,
    );
}

#[test]
fn a_request_header_too_short_fails_alone() {
    fails_alone(
        |b| {
            b.put(0x2010, &[UNTOUCHED]);
            b.post(&[
                Desc {
                    addr: 0x2000,
                    len: 8,
                    write: false,
                },
                Desc {
                    addr: 0x2010,
                    len: 1,
                    write: true,
                },
            ]);
        },
        IOERR,
    );
}

#[test]
fn huge_or_outside_buffers_fail_alone() {
    let buffers = [
        // 4 GiB - 1 to read: more than a request may move.
        Desc {
            addr: 0x2020,
            len: u32::MAX - 16,
            write: true,
        },
        // Past the end of guest memory.
        Desc {
            addr: 1 << 40,
            len: 4096,
            write: true,
        },
        // Across the hole between the two regions.
        Desc {
            addr: REGION0.1 as u64 - 512,
            len: 4096,
            write: true,
        },
    ];
    for data in buffers {
        fails_alone(
            |b| {
                b.put(0x2000, &RingBuilder::header_bytes(VIRTIO_BLK_T_IN, 0));
                b.put(0x2010, &[UNTOUCHED]);
                b.post(&[
                    Desc {
                        addr: 0x2000,
                        len: 16,
                        write: false,
                    },
                    data,
                    Desc {
                        addr: 0x2010,
                        len: 1,
                        write: true,
                    },
                ]);
            },
            UNTOUCHED,
        );
    }
}

#[test]
fn many_requests_with_event_idx_are_all_served_in_order() {
    let mut b = RingBuilder::new(8, true);
    let pattern: Vec<u8> = (0..512u32).map(|i| (i % 251) as u8).collect();
    let at = |i: u64| 0x2000 + 0x400 * i;
    for i in 0..20 {
        b.request(at(i), VIRTIO_BLK_T_OUT, i, Data::Out(&pattern));
    }
    b.op(Op::Kick);
    let r = run(&b);
    assert_eq!(r.taken, 20);
    assert_eq!(b.used_idx(&r.memory), 20);
    assert_eq!(r.totals.writes, 20);
    assert!((0..20).all(|i| status(&r, at(i)) == OK));
}
