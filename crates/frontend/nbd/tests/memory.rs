//! Memory the server holds for payloads: large writes and reads go through
//! in pieces instead of whole, the server-wide budget counts every
//! buffered byte, and a client that stops reading its replies slows others
//! down but cannot lock them out. Alone in its test binary because it
//! counts the process's heap (the server runs in-process).
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use common::*;
use vdcache_backend::nbd::NbdClient;
use vdcache_nbd_proto::proto::{CMD_READ, Request};
use vdcache_nbd_server::{Export, Limits, MemExport, Server};

/// Counts the bytes the process has allocated and not freed.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed unchanged to the system allocator, which
// upholds the `GlobalAlloc` contract; the counter only observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as given to us, a valid non-zero-size layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (that is, from `System`)
        // with this layout, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's guarantees for `realloc` are passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The heap is counted for the whole process: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const CONNS: usize = 8;
const LEN: usize = 8 << 20;
/// The default piece size of streamed payloads.
const CHUNK: usize = 1 << 20;
/// Heap the server may use besides payload pieces while the test waits
/// (thread stacks are not heap; buffers of a few KiB per connection are).
const SLACK: usize = 2 << 20;

/// A connection in the transmission phase, spoken by hand (the crate's
/// client always reads its replies and sends whole payloads).
fn raw_session(path: &std::path::Path) -> UnixStream {
    use std::io::Read;
    let mut s = UnixStream::connect(path).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = vdcache_nbd_proto::proto::IHAVEOPT.to_be_bytes().to_vec();
    opt.extend_from_slice(&vdcache_nbd_proto::proto::OPT_EXPORT_NAME.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&opt).unwrap();
    let mut r = [0u8; 10];
    s.read_exact(&mut r).unwrap();
    s
}

fn clients(t: &TestServer) -> Vec<NbdClient> {
    (0..CONNS)
        .map(|_| NbdClient::connect(&t.uri("")).unwrap())
        .collect()
}

#[test]
fn large_writes_are_stored_in_pieces_not_buffered_whole() {
    let _serial = serial();
    assert_eq!(Limits::default().payload_chunk as usize, CHUNK);
    let disk = Arc::new(Gated::new(MemExport::new((CONNS * LEN) as u64), false));
    let t = TestServer::start(vec![("", disk.clone() as Arc<dyn Export>)]);
    let data: Vec<Vec<u8>> = (0..CONNS).map(|i| pattern(LEN, i as u64)).collect();
    let cs = clients(&t);
    let base = live();
    std::thread::scope(|sc| {
        let writers: Vec<_> = cs
            .iter()
            .zip(&data)
            .enumerate()
            .map(|(i, (c, d))| sc.spawn(move || c.write_at((i * LEN) as u64, d, false)))
            .collect();
        let _open = disk.open_on_drop();
        // Every connection has a write in the export, and waits there.
        disk.wait_entered(CONNS);
        let held = live().saturating_sub(base);
        let st = t.server.stats();
        println!(
            "{CONNS} writes of {LEN} bytes waiting in the export: heap +{held}, buffered {}",
            st.buffered_bytes
        );
        assert_eq!(
            st.buffered_bytes as usize,
            CONNS * CHUNK,
            "{CONNS} writes of {LEN} bytes in flight"
        );
        assert!(
            held < CONNS * CHUNK + SLACK,
            "the heap grew by {held} bytes with {CONNS} writes of {LEN} bytes in flight"
        );
        disk.open();
        for w in writers {
            w.join().unwrap().unwrap();
        }
    });
    let contents = disk.mem.contents();
    for (i, d) in data.iter().enumerate() {
        assert!(contents[i * LEN..(i + 1) * LEN] == d[..], "connection {i}");
    }
    let st = t.server.stats();
    assert_eq!(st.buffered_bytes, 0);
    // Once the export went on, pieces were stored in parallel: never more
    // than the budget plus a small piece per connection.
    let bound = Limits::default().max_buffered_bytes + (CONNS as u64) * (64 << 10);
    assert!(
        st.buffered_bytes_peak <= bound,
        "peak {}",
        st.buffered_bytes_peak
    );
}

#[test]
fn clients_that_stop_halfway_through_large_writes_hold_one_piece_each() {
    let _serial = serial();
    let (t, _disk) = mem_server((CONNS * LEN) as u64);
    let base = live();
    // 32 MiB announced, 100 KiB sent, then nothing.
    let stalled: Vec<UnixStream> = (0..CONNS)
        .map(|i| {
            let mut s = raw_session(&t.socket);
            let req = Request {
                flags: 0,
                kind: vdcache_nbd_proto::proto::CMD_WRITE,
                cookie: i as u64,
                offset: 0,
                length: 32 << 20,
            };
            s.write_all(&req.encode()).unwrap();
            s.write_all(&[0x5a; 100 << 10]).unwrap();
            s
        })
        .collect();
    eventually("every connection took room for its first piece", || {
        t.server.stats().buffered_bytes as usize == CONNS * CHUNK
    });
    let held = live().saturating_sub(base);
    println!("{CONNS} writes of 32 MiB stalled after 100 KiB: heap +{held}");
    assert!(
        held < CONNS * CHUNK + SLACK,
        "the heap grew by {held} bytes for {CONNS} stalled 32 MiB writes"
    );
    drop(stalled);
    eventually("the stalled writes' room given back", || {
        t.server.stats().buffered_bytes == 0
    });
}

#[test]
fn large_reads_are_sent_in_pieces_not_buffered_whole() {
    let _serial = serial();
    let image = pattern(CONNS * LEN, 77);
    let disk = Arc::new(Gated::new(MemExport::with_data(&image), true));
    let t = TestServer::start(vec![("", disk.clone() as Arc<dyn Export>)]);
    let cs = clients(&t);
    let mut bufs: Vec<Vec<u8>> = (0..CONNS).map(|_| vec![0u8; LEN]).collect();
    let base = live();
    std::thread::scope(|sc| {
        let readers: Vec<_> = cs
            .iter()
            .zip(bufs.iter_mut())
            .enumerate()
            .map(|(i, (c, b))| sc.spawn(move || c.read_at((i * LEN) as u64, b)))
            .collect();
        let _open = disk.open_on_drop();
        disk.wait_entered(CONNS);
        let held = live().saturating_sub(base);
        println!("{CONNS} reads of {LEN} bytes waiting in the export: heap +{held}");
        assert_eq!(t.server.stats().buffered_bytes as usize, CONNS * CHUNK);
        assert!(
            held < CONNS * CHUNK + SLACK,
            "the heap grew by {held} bytes with {CONNS} reads of {LEN} bytes in flight"
        );
        disk.open();
        for r in readers {
            r.join().unwrap().unwrap();
        }
    });
    for (i, b) in bufs.iter().enumerate() {
        assert!(b[..] == image[i * LEN..(i + 1) * LEN], "connection {i}");
    }
    // A read gives its bytes back right after its reply left.
    eventually("buffered payloads given back", || {
        t.server.stats().buffered_bytes == 0
    });
}

#[test]
fn a_client_that_stops_reading_its_replies_cannot_lock_others_out() {
    let _serial = serial();
    // A budget of a single piece: one stuck reply fills it.
    let limits = Limits {
        max_buffered_bytes: CHUNK as u64,
        ..Default::default()
    };
    let disk = Arc::new(MemExport::new((CONNS * LEN) as u64));
    let t = TestServer::start_with(Server::builder().export("", disk).limits(limits));
    // Reads of 4 MiB, never read back: the server blocks on its reply.
    let stuck_session = {
        let mut stuck = raw_session(&t.socket);
        for i in 0..16u64 {
            let req = Request {
                flags: 0,
                kind: CMD_READ,
                cookie: i,
                offset: i << 22,
                length: 4 << 20,
            };
            stuck.write_all(&req.encode()).unwrap();
        }
        stuck
    };
    eventually("the stuck client holds the whole budget", || {
        t.server.stats().buffered_bytes >= CHUNK as u64
    });
    // Others still get through, one request at a time per connection.
    let (tx, rx) = std::sync::mpsc::channel();
    let uri = t.uri("");
    std::thread::spawn(move || {
        let result = std::panic::catch_unwind(|| {
            let cs: Vec<NbdClient> = (0..4).map(|_| NbdClient::connect(&uri).unwrap()).collect();
            std::thread::scope(|sc| {
                for (i, c) in cs.iter().enumerate() {
                    sc.spawn(move || {
                        let d = pattern(3 << 20, i as u64);
                        let off = ((i + 1) * LEN) as u64;
                        c.write_at(off, &d, false).unwrap();
                        let mut b = vec![0u8; d.len()];
                        c.read_at(off, &mut b).unwrap();
                        assert!(b == d, "client {i}");
                    });
                }
            });
        });
        let _ = tx.send(result.is_ok());
    });
    let done = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("other clients were locked out by one that does not read its replies");
    assert!(done, "other clients failed");
    let st = t.server.stats();
    // The stuck client's piece, and past the limit at most a 64 KiB piece
    // per other connection.
    assert!(
        st.buffered_bytes_peak as usize <= CHUNK + 4 * (64 << 10),
        "peak {}",
        st.buffered_bytes_peak
    );
    drop(stuck_session);
}
