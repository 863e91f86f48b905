//! Issue 43, item 5: a guest that breaks its virtqueue, against `vdcache
//! serve` over vhost-user-blk. The front end here speaks vhost-user as
//! QEMU does (guest memory in a shared file, eventfds for kicks); the
//! "guest" writes the rings in that memory. A broken ring stops its queue
//! alone, logged once; other queues, the NBD export, new connections and
//! SIGTERM keep working, and the guest's device reset serves the queue
//! again. Malformed requests fail one by one with bounded logging.

use crate::common;
use crate::serving;

use common::Scratch;
use serving::{Proc, qcow2, qemu_io, serve, uri};
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const M: u64 = 1 << 20;
/// Guest memory of the test's front end.
const MEM: usize = 1 << 20;
const QUEUES: usize = 2;
const QUEUE_SIZE: u16 = 256;
/// How long the server may take to answer a message or complete a
/// request (it takes milliseconds; this only bounds a hang).
const PATIENCE: Duration = Duration::from_secs(10);
/// A server log this large means it logs without bound.
const LOG_FLOOD: u64 = 4 << 20;
/// What the server logs when it stops a queue.
const STOPPED: &str = "stopped until the guest resets the device";

/// Where queue `q`'s rings and request buffers lie in guest memory.
fn desc_at(q: usize) -> u64 {
    0x1_0000 * q as u64
}
fn avail_at(q: usize) -> u64 {
    desc_at(q) + 0x1000
}
fn used_at(q: usize) -> u64 {
    desc_at(q) + 0x2000
}
fn buffers_at(q: usize) -> u64 {
    0x8_0000 + 0x2_0000 * q as u64
}

/// A vhost-user front end and the guest driver behind it.
struct Guest {
    frontend: Frontend,
    mem: GuestMemoryMmap,
    /// Per queue: kick and call eventfds, and the available index the
    /// driver wrote last.
    kicks: Vec<Option<EventFd>>,
    calls: Vec<Option<EventFd>>,
    avail_idx: Vec<u16>,
}

type Res<T> = Result<T, String>;

fn failed(what: &str) -> impl Fn(vhost::Error) -> String + '_ {
    move |err| format!("{what}: {err}")
}

impl Guest {
    /// Connects to `socket` and negotiates as QEMU does; the guest memory
    /// file lives in `dir`. An error: the server did not answer.
    fn connect(socket: &Path, dir: &Path) -> Res<Guest> {
        let stream = connect_when_listening(socket)?;
        stream
            .set_read_timeout(Some(PATIENCE))
            .map_err(|e| e.to_string())?;
        let mut frontend = Frontend::from_stream(stream, QUEUES as u64);
        frontend.set_owner().map_err(failed("SET_OWNER"))?;
        let features = frontend.get_features().map_err(failed("GET_FEATURES"))?;
        assert!(
            features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0,
            "no protocol features offered"
        );
        frontend
            .set_features(features)
            .map_err(failed("SET_FEATURES"))?;
        let protocol = frontend
            .get_protocol_features()
            .map_err(failed("GET_PROTOCOL_FEATURES"))?;
        frontend
            .set_protocol_features(
                protocol & (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ),
            )
            .map_err(failed("SET_PROTOCOL_FEATURES"))?;
        let file = tempfile::tempfile_in(dir).map_err(|e| e.to_string())?;
        file.set_len(MEM as u64).map_err(|e| e.to_string())?;
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            MEM,
            Some(FileOffset::new(file, 0)),
        )])
        .map_err(|e| e.to_string())?;
        let region = mem.find_region(GuestAddress(0)).ok_or("no region")?;
        let info =
            VhostUserMemoryRegionInfo::from_guest_region(region).map_err(failed("region"))?;
        frontend
            .set_mem_table(&[info])
            .map_err(failed("SET_MEM_TABLE"))?;
        let mut g = Guest {
            frontend,
            mem,
            kicks: (0..QUEUES).map(|_| None).collect(),
            calls: (0..QUEUES).map(|_| None).collect(),
            avail_idx: vec![0; QUEUES],
        };
        for q in 0..QUEUES {
            g.start_queue(q, 0, avail_at(q))?;
        }
        Ok(g)
    }

    /// The front end's address of guest address `gpa`.
    fn va(&self, gpa: u64) -> u64 {
        let region = self.mem.find_region(GuestAddress(0)).expect("region");
        region.as_ptr() as u64 + gpa
    }

    /// Configures and starts queue `q` at available index `base`, its
    /// available ring at `avail`.
    fn start_queue(&mut self, q: usize, base: u16, avail: u64) -> Res<()> {
        let config = VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            flags: 0,
            desc_table_addr: self.va(desc_at(q)),
            used_ring_addr: self.va(used_at(q)),
            avail_ring_addr: self.va(avail),
            log_addr: None,
        };
        let f = &mut self.frontend;
        f.set_vring_num(q, QUEUE_SIZE)
            .map_err(failed("SET_VRING_NUM"))?;
        f.set_vring_addr(q, &config)
            .map_err(failed("SET_VRING_ADDR"))?;
        f.set_vring_base(q, base)
            .map_err(failed("SET_VRING_BASE"))?;
        let (kick, call) = (eventfd(), eventfd());
        f.set_vring_call(q, &call)
            .map_err(failed("SET_VRING_CALL"))?;
        f.set_vring_kick(q, &kick)
            .map_err(failed("SET_VRING_KICK"))?;
        f.set_vring_enable(q, true)
            .map_err(failed("SET_VRING_ENABLE"))?;
        // A reply: every message before it was handled.
        f.get_features().map_err(failed("GET_FEATURES"))?;
        self.kicks[q] = Some(kick);
        self.calls[q] = Some(call);
        Ok(())
    }

    /// Stops queue `q` as QEMU does at a device reset; returns the
    /// index the server stopped at.
    fn stop_queue(&mut self, q: usize) -> Res<u16> {
        let base = self
            .frontend
            .get_vring_base(q)
            .map_err(failed("GET_VRING_BASE"))?;
        Ok(base as u16)
    }

    fn kick(&self, q: usize) {
        self.kicks[q]
            .as_ref()
            .expect("started")
            .write(1)
            .expect("kick");
    }

    fn write_u16(&self, at: u64, v: u16) {
        self.mem
            .store(v.to_le(), GuestAddress(at), Ordering::Release)
            .expect("guest write");
    }

    fn used_idx(&self, q: usize) -> u16 {
        u16::from_le(
            self.mem
                .load(GuestAddress(used_at(q) + 2), Ordering::Acquire)
                .expect("guest read"),
        )
    }

    /// What the guest driver writes to publish an index.
    fn set_avail_idx(&mut self, q: usize, idx: u16) {
        self.avail_idx[q] = idx;
        self.write_u16(avail_at(q) + 2, idx);
    }

    /// Writes descriptor `i` of queue `q`.
    fn desc(&self, q: usize, i: u16, addr: u64, len: u32, flags: u32, next: u16) {
        let at = desc_at(q) + 16 * u64::from(i);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&(flags as u16).to_le_bytes());
        d[14..].copy_from_slice(&next.to_le_bytes());
        self.mem.write_slice(&d, GuestAddress(at)).expect("desc");
    }

    /// Makes chains with heads `heads` available on queue `q` at once.
    fn publish(&mut self, q: usize, heads: &[u16]) {
        for &h in heads {
            let slot = self.avail_idx[q] % QUEUE_SIZE;
            self.write_u16(avail_at(q) + 4 + 2 * u64::from(slot), h);
            self.set_avail_idx(q, self.avail_idx[q].wrapping_add(1));
        }
    }

    /// Waits until the used ring of `q` reaches `idx`.
    fn wait_used(&self, q: usize, idx: u16, log: &Proc) -> Res<()> {
        let start = Instant::now();
        while self.used_idx(q) != idx {
            check_log_size(log);
            if start.elapsed() > PATIENCE {
                return Err(format!(
                    "queue {q}: used index {} after {PATIENCE:?}, expected {idx}",
                    self.used_idx(q)
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    /// Reads `len` bytes at `sector` over queue `q`: (status, data).
    fn read(&mut self, q: usize, sector: u64, len: u32, log: &Proc) -> Res<(u8, Vec<u8>)> {
        let buf = buffers_at(q);
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&VIRTIO_BLK_T_IN.to_le_bytes());
        header[8..].copy_from_slice(&sector.to_le_bytes());
        self.mem
            .write_slice(&header, GuestAddress(buf))
            .expect("header");
        let (data, status) = (buf + 0x100, buf + 0x100 + u64::from(len));
        self.mem
            .write_slice(&[0xff], GuestAddress(status))
            .expect("status");
        self.desc(q, 0, buf, 16, VRING_DESC_F_NEXT, 1);
        self.desc(q, 1, data, len, VRING_DESC_F_WRITE | VRING_DESC_F_NEXT, 2);
        self.desc(q, 2, status, 1, VRING_DESC_F_WRITE, 0);
        let want = self.used_idx(q).wrapping_add(1);
        self.publish(q, &[0]);
        self.kick(q);
        self.wait_used(q, want, log)?;
        let mut out = vec![0u8; len as usize];
        self.mem
            .read_slice(&mut out, GuestAddress(data))
            .expect("data");
        let mut st = [0u8];
        self.mem
            .read_slice(&mut st, GuestAddress(status))
            .expect("st");
        Ok((st[0], out))
    }

    /// Posts `n` requests whose header is 8 bytes (virtio-blk's is 16)
    /// on queue `q` at once; returns their status bytes.
    fn short_headers(&mut self, q: usize, n: u16, log: &Proc) -> Res<Vec<u8>> {
        let buf = buffers_at(q);
        let mut heads = Vec::new();
        for i in 0..n {
            let (header, status) = (buf + 16 * u64::from(i), buf + 0x8000 + u64::from(i));
            self.mem
                .write_slice(&[0xff], GuestAddress(status))
                .expect("status");
            self.desc(q, 2 * i, header, 8, VRING_DESC_F_NEXT, 2 * i + 1);
            self.desc(q, 2 * i + 1, status, 1, VRING_DESC_F_WRITE, 0);
            heads.push(2 * i);
        }
        let want = self.used_idx(q).wrapping_add(n);
        self.publish(q, &heads);
        self.kick(q);
        self.wait_used(q, want, log)?;
        let mut st = vec![0u8; usize::from(n)];
        self.mem
            .read_slice(&mut st, GuestAddress(buf + 0x8000))
            .expect("st");
        Ok(st)
    }
}

fn eventfd() -> EventFd {
    EventFd::new(EFD_NONBLOCK).expect("eventfd")
}

fn connect_when_listening(socket: &Path) -> Res<UnixStream> {
    let start = Instant::now();
    loop {
        match UnixStream::connect(socket) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() > PATIENCE => {
                return Err(format!("connect {}: {e}", socket.display()));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Fails at once when the server's log grows without bound (reading it
/// all would take long).
fn check_log_size(server: &Proc) {
    let size = std::fs::metadata(&server.log).map_or(0, |m| m.len());
    assert!(
        size < LOG_FLOOD,
        "the server's log holds {size} bytes: it logs without bound; it begins:\n{}",
        log_head(server)
    );
}

fn log_head(server: &Proc) -> String {
    use std::io::Read;
    let mut head = String::new();
    if let Ok(f) = File::open(&server.log) {
        let _ = f.take(4096).read_to_string(&mut head);
    }
    head
}

/// Waits until the server's log holds `count` lines with `what`.
fn wait_logged(server: &Proc, what: &str, count: usize) {
    let start = Instant::now();
    loop {
        check_log_size(server);
        let n = server.log_text().matches(what).count();
        if n >= count {
            return;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the server logged '{what}' {n} times, not {count}, in {PATIENCE:?}\n--- log ---\n{}",
            log_head(server)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGTERM; the server must be gone within [`PATIENCE`].
fn terminate_within_patience(mut server: Proc) -> String {
    let pid = server.pid().to_string();
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(st.success());
    let start = Instant::now();
    loop {
        check_log_size(&server);
        if let Some(st) = server.exited() {
            let log = server.log_text();
            assert!(st.success(), "the server exited {st}\n{log}");
            return log;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "SIGTERM did not end the server in {PATIENCE:?}\n--- log ---\n{}",
            log_head(&server)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ok<T>(r: Res<T>, server: &Proc) -> T {
    r.unwrap_or_else(|e| panic!("{e}\n--- server log ---\n{}", log_head(server)))
}

/// A 16 MiB qcow2 whose first 64 KiB hold 0x5a, served over NBD and
/// vhost-user-blk: the server, its NBD socket and its vhost-user socket.
fn serve_pattern_disk(s: &Scratch) -> (Proc, std::path::PathBuf, std::path::PathBuf) {
    let img = s.path("d.qcow2");
    qcow2(s, &img, 16 * M, None);
    let img = img.to_str().expect("utf-8");
    qemu_io(s, "qcow2", img, &["write -P 0x5a 0 64k".into()]);
    let (sock, vhost) = (s.path("d.sock"), s.path("d.vhost"));
    let vhost_arg = vhost.to_str().expect("utf-8");
    let server = serve(s, &sock, &["--vhost-user-blk", vhost_arg, img]);
    (server, sock, vhost)
}

/// A guest on `vhost` that read the pattern disk's first block, as written.
fn connect_and_read_pattern(s: &Scratch, server: &Proc, vhost: &Path) -> Guest {
    let mut g = ok(Guest::connect(vhost, s.root()), server);
    let (status, data) = ok(g.read(0, 0, 4096, server), server);
    assert_eq!(status, VIRTIO_BLK_S_OK as u8);
    assert!(
        data.iter().all(|&b| b == 0x5a),
        "the read returned other data"
    );
    g
}

/// The case: negotiate, post one valid request, set
/// `avail.idx = 40000` (queue size 256), kick.
#[test]
fn a_broken_available_ring_stops_its_queue_alone() {
    let s = Scratch::new();
    let (server, sock, vhost) = serve_pattern_disk(&s);
    let mut g = connect_and_read_pattern(&s, &server, &vhost);

    g.set_avail_idx(0, 40000);
    g.kick(0);
    wait_logged(&server, STOPPED, 1);
    for _ in 0..100 {
        g.kick(0);
    }
    // Queue 1 of the same guest, and the same disk over NBD, still serve.
    let (status, _) = ok(g.read(1, 8, 512, &server), &server);
    assert_eq!(status, VIRTIO_BLK_S_OK as u8);
    qemu_io(&s, "raw", &uri(&sock, ""), &["read -P 0x5a 0 64k".into()]);

    // The guest resets the device: QEMU stops the queue, the driver
    // writes a sane ring, QEMU starts the queue where it stopped.
    let base = ok(g.stop_queue(0), &server);
    assert_eq!(base, 1, "the broken ring's entries were taken");
    g.set_avail_idx(0, base);
    ok(g.start_queue(0, base, avail_at(0)), &server);
    let (status, _) = ok(g.read(0, 16, 4096, &server), &server);
    assert_eq!(
        status, VIRTIO_BLK_S_OK as u8,
        "the reset queue serves again"
    );

    // A new front end is served; on it, an available ring whose index
    // can be read but whose entries lie outside guest memory stops that
    // queue too, and malformed requests fail one by one.
    drop(g);
    let mut g = ok(Guest::connect(&vhost, s.root()), &server);
    let statuses = ok(g.short_headers(0, 100, &server), &server);
    assert!(
        statuses.iter().all(|&s| s == VIRTIO_BLK_S_IOERR as u8),
        "requests with a short header did not get IOERR: {statuses:?}"
    );
    let edge = MEM as u64 - 4;
    ok(g.stop_queue(1), &server);
    ok(g.start_queue(1, 0, edge), &server);
    g.write_u16(edge + 2, 1);
    g.kick(1);
    wait_logged(&server, STOPPED, 2);
    let (status, _) = ok(g.read(0, 0, 4096, &server), &server);
    assert_eq!(status, VIRTIO_BLK_S_OK as u8);
    // The stop comes while a queue is stopped and the guest connected.
    g.set_avail_idx(0, 40000);
    g.kick(0);
    wait_logged(&server, STOPPED, 3);

    let log = terminate_within_patience(server);
    let stops: Vec<&str> = log.lines().filter(|l| l.contains(STOPPED)).collect();
    assert_eq!(stops.len(), 3, "one line per stop:\n{log}");
    assert!(stops[0].contains("queue 0") && stops[0].contains("40000"));
    assert!(stops[1].contains("queue 1") && stops[1].contains("cannot be read"));
    assert!(
        !log.contains("Iterator error") && !log.contains("Failed to read"),
        "the library's own lines leaked:\n{log}"
    );
    let failed = log.matches("vhost-user-blk request failed").count();
    assert!(
        (1..=10).contains(&failed),
        "{failed} lines for 100 failed requests:\n{log}"
    );
    assert!(log.contains("counted, not logged"), "{log}");
    s.finish();
}

/// The server's soft limit on open files (`prlimit`, util-linux).
fn set_open_files_limit(server: &Proc, soft: &str) {
    common::ok(
        std::process::Command::new("prlimit")
            .arg("--pid")
            .arg(server.pid().to_string())
            .arg(format!("--nofile={soft}:")),
    );
}

/// A front end that connects while the server has no file descriptor to
/// spare is dropped, and the next one, once descriptors are free again,
/// is served: a failed accept is tried again (before, the first one ended
/// the export's listening for good, its socket still bound).
#[test]
fn a_front_end_connecting_while_descriptors_run_out_is_served_later() {
    let s = Scratch::new();
    let (server, _, vhost) = serve_pattern_disk(&s);
    // A new descriptor takes the lowest free number: none below the limit.
    let open: std::collections::BTreeSet<u64> =
        std::fs::read_dir(format!("/proc/{}/fd", server.pid()))
            .expect("the server's descriptors")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
    let lowest_free = (0..).find(|fd| !open.contains(fd)).unwrap_or(0);
    set_open_files_limit(&server, &lowest_free.to_string());
    let refused = ok(connect_when_listening(&vhost), &server);
    wait_logged(&server, "accepting a connection", 1);
    set_open_files_limit(&server, "1024");
    drop(refused);
    // Accepted at all? (A front end left in the backlog would wait for
    // its first answer for good.)
    let probe = ok(connect_when_listening(&vhost), &server);
    wait_logged(&server, "a front end connected", 1);
    wait_logged(&server, "accepted a connection again", 1);
    drop(probe);
    drop(connect_and_read_pattern(&s, &server, &vhost));
    let log = terminate_within_patience(server);
    assert!(
        log.contains("Too many open files"),
        "the failed accept is named:\n{log}"
    );
    s.finish();
}
