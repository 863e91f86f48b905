//! Entry points of the vhost-user-blk front end for fuzzing (the cargo-fuzz
//! target `vhost_user` under `fuzz/`) and for tests. Bit 0 of an input's
//! first byte picks what the rest drives:
//!
//! - 0, one virtqueue ([`QueueInput`]): guest memory holding the input's
//!   bytes, a queue at the input's addresses, size and start index, and a
//!   list of kicks, front-end restarts and guest writes, served by the
//!   device's own queue loop, request code and in-order completions on an
//!   in-memory disk. Synchronous: an input runs the same way every time.
//! - 1, a connection ([`ConnectionInput`]): the input's vhost-user
//!   messages sent over a socket to a server started as `vdcache serve`
//!   starts one, with guest memory and eventfds attached as a front end
//!   attaches them and kicks in between; then the server is stopped as a
//!   SIGTERM stops it.
//!
//! Owns: the in-memory disk, both input layouts, [`RingBuilder`] (a
//! driver's view for writing inputs) and [`ConnectionInput::negotiated`]
//! (a front end's). Must not: parse a request or a
//! message itself (a copy of a parser would be fuzzed instead of the
//! parser), or panic on any input.

use crate::device::{Backend, Counters, Device};
use crate::request::BlockDevice;
use crate::{Serving, SocketAccess, Totals};
use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Guest memory of a queue input: region 0 holds the input's memory image;
/// region 1 lies past a one-page hole (a buffer across it is refused).
pub const REGION0: (u64, usize) = (0, 0x1_0000);
pub const REGION1: (u64, usize) = (0x1_1000, 0x8000);
/// The in-memory disk's size.
pub const DISK_SIZE: u64 = 64 << 10;
/// Queues the connection's server offers.
pub const QUEUES: usize = 2;
/// The largest queue the device takes (the server offers more; a queue
/// input's size is `1 << (size_log2 % 9)`).
pub const MAX_QUEUE: u16 = 256;
/// Size of the guest memory file a connection input's SET_MEM_TABLE and
/// ADD_MEM_REG attach (their regions are cut to fit inside it).
pub const MEMORY_FILE: u64 = 0x1_0000;
/// Request codes from here on are no message but a kick of queue
/// `code & 0xff` (its last SET_VRING_KICK eventfd is written).
pub const KICK: u32 = 0x8000_0000;

/// Disk calls one input may make; the later ones fail. A guest may keep
/// its queue busy as long as it likes (its requests may write into its
/// own rings), as it may keep a real disk busy; an input must end.
pub const DISK_CALLS: u64 = 1 << 14;

/// A disk held in memory. The offsets it is given index its bytes
/// directly: a request that passed the checks in `request` with an
/// offset past the end panics here, which is a finding.
struct MemDisk {
    bytes: Mutex<Vec<u8>>,
    read_only: bool,
    calls: AtomicU64,
}

impl MemDisk {
    fn new(read_only: bool) -> MemDisk {
        MemDisk {
            bytes: Mutex::new(vec![0; DISK_SIZE as usize]),
            read_only,
            calls: AtomicU64::new(0),
        }
    }

    fn with(&self, f: impl FnOnce(&mut Vec<u8>)) -> std::io::Result<()> {
        if self.calls.fetch_add(1, Ordering::Relaxed) >= DISK_CALLS {
            return Err(std::io::Error::other("the fuzzing disk's calls are spent"));
        }
        f(&mut self.bytes.lock().unwrap_or_else(PoisonError::into_inner));
        Ok(())
    }
}

fn span(offset: u64, len: u64) -> std::ops::Range<usize> {
    offset as usize..(offset + len) as usize
}

impl BlockDevice for MemDisk {
    fn size(&self) -> u64 {
        DISK_SIZE
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.with(|b| buf.copy_from_slice(&b[span(offset, buf.len() as u64)]))
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.with(|b| b[span(offset, data.len() as u64)].copy_from_slice(data))
    }
    fn flush(&self) -> std::io::Result<()> {
        self.with(|_| {})
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.write_zeroes(offset, len, true)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _may_unmap: bool) -> std::io::Result<()> {
        self.with(|b| b[span(offset, len)].fill(0))
    }
    fn id(&self) -> &[u8] {
        b"vdcache-fuzz"
    }
}

/// Reads an input front to back; past its end every field reads as zero.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0; N];
        let got = self.take(N);
        a[..got.len()].copy_from_slice(got);
        a
    }
    fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

/// What happens to a queue input's queue, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The guest kicks the queue (its worker runs the queue loop once).
    Kick,
    /// The front end stops the queue and starts it again (GET_VRING_BASE
    /// and a new SET_VRING_KICK, as when the guest resets the device).
    Restart,
    /// The guest writes `value` at guest address `at` (a ring's index, an
    /// entry) between kicks.
    Poke { at: u16, value: u16 },
}

/// One virtqueue and what is done to it; see the module's doc.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueInput {
    pub event_idx: bool,
    pub read_only: bool,
    /// The queue holds `1 << (size_log2 % 9)` descriptors.
    pub size_log2: u8,
    /// Where the device starts taking requests (SET_VRING_BASE).
    pub next_avail: u16,
    /// Guest addresses of the descriptor table and the two rings.
    pub desc: u32,
    pub avail: u32,
    pub used: u32,
    /// At most 255 are encoded.
    pub ops: Vec<Op>,
    /// Guest memory from address 0 (the rest of it is zero).
    pub memory: Vec<u8>,
}

impl QueueInput {
    /// The input bytes that decode to this.
    pub fn encode(&self) -> Vec<u8> {
        let sel = (u8::from(self.event_idx) << 1) | (u8::from(self.read_only) << 2);
        let mut out = vec![sel, self.size_log2];
        out.extend_from_slice(&self.next_avail.to_le_bytes());
        for a in [self.desc, self.avail, self.used] {
            out.extend_from_slice(&a.to_le_bytes());
        }
        let ops = &self.ops[..self.ops.len().min(255)];
        out.push(ops.len() as u8);
        for op in ops {
            match *op {
                Op::Kick => out.push(0),
                Op::Restart => out.push(2),
                Op::Poke { at, value } => {
                    out.push(3);
                    out.extend_from_slice(&at.to_le_bytes());
                    out.extend_from_slice(&value.to_le_bytes());
                }
            }
        }
        out.extend_from_slice(&self.memory);
        out
    }

    fn decode(input: &[u8]) -> QueueInput {
        let mut c = Cursor(input);
        let sel = c.u8();
        let mut q = QueueInput {
            event_idx: sel & 2 != 0,
            read_only: sel & 4 != 0,
            size_log2: c.u8(),
            next_avail: c.u16(),
            desc: c.u32(),
            avail: c.u32(),
            used: c.u32(),
            ..QueueInput::default()
        };
        for _ in 0..c.u8() {
            q.ops.push(match c.u8() % 4 {
                0 | 1 => Op::Kick,
                2 => Op::Restart,
                _ => Op::Poke {
                    at: c.u16(),
                    value: c.u16(),
                },
            });
        }
        q.memory = c.take(REGION0.1).to_vec();
        q
    }
}

/// What a queue input's run did.
#[derive(Debug, Clone)]
pub struct QueueRun {
    /// Requests taken from the available ring.
    pub taken: u16,
    /// Requests taken by a kick while the queue was stopped (must be 0).
    pub taken_while_stopped: u16,
    /// The queue is stopped at the end (a broken ring).
    pub stopped: bool,
    pub totals: Totals,
    /// Guest memory region 0 after the run (used ring, buffers, status
    /// bytes).
    pub memory: Vec<u8>,
}

/// Runs `input` (bit 0 of its first byte picks the layout, see the
/// module's doc).
pub fn exercise(input: &[u8]) -> Option<QueueRun> {
    if input.first().is_some_and(|sel| sel & 1 != 0) {
        exercise_connection(&ConnectionInput::decode(input));
        None
    } else {
        exercise_queue(&QueueInput::decode(input))
    }
}

/// Serves `input`'s queue; `None` when the queue cannot even be set up
/// (its addresses break virtio's alignment, as SET_VRING_ADDR refuses).
pub fn exercise_queue(input: &QueueInput) -> Option<QueueRun> {
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(REGION0.0), REGION0.1),
        (GuestAddress(REGION1.0), REGION1.1),
    ])
    .ok()?;
    let image = &input.memory[..input.memory.len().min(REGION0.1)];
    mem.write_slice(image, GuestAddress(REGION0.0)).ok()?;
    let mem = GuestMemoryAtomic::new(mem);
    let counters = Arc::new(Counters::default());
    let disk = Arc::new(MemDisk::new(input.read_only));
    let device = Arc::new(Device::new("fuzz".into(), disk, 1, 1, counters.clone()));
    let backend = Backend(device.clone());
    backend.set_event_idx(input.event_idx);
    backend.update_memory(mem.clone()).ok()?;
    let vring = VringRwLock::new(mem.clone(), MAX_QUEUE).ok()?;
    vring.set_queue_size(1 << (input.size_log2 % 9));
    let addrs = [input.desc, input.avail, input.used].map(u64::from);
    vring.set_queue_info(addrs[0], addrs[1], addrs[2]).ok()?;
    vring.set_queue_next_avail(input.next_avail);
    vring.set_queue_event_idx(input.event_idx);
    vring.set_queue_ready(true);
    vring.set_enabled(true);
    let vrings = [vring.clone()];
    let mut taken_while_stopped = 0u16;
    for op in &input.ops {
        match *op {
            Op::Kick => {
                let stopped = device.stops.serving(0).is_none();
                let before = vring.queue_next_avail();
                // An error ends the queue's worker; the run goes on to
                // see what the next kick does.
                let _ = backend.handle_event(0, EventSet::IN, &vrings, 0);
                // What the guest does next sees every request completed.
                device.wait_idle(0);
                if stopped {
                    let taken = vring.queue_next_avail().wrapping_sub(before);
                    taken_while_stopped = taken_while_stopped.saturating_add(taken);
                }
            }
            Op::Restart => {
                vring.set_queue_ready(false);
                let _ = backend.stop_vring(0);
                vring.set_queue_ready(true);
            }
            Op::Poke { at, value } => {
                let _ = mem
                    .memory()
                    .write_obj(value.to_le(), GuestAddress(u64::from(at)));
            }
        }
    }
    device.finish_requests();
    let mut memory = vec![0; REGION0.1];
    mem.memory()
        .read_slice(&mut memory, GuestAddress(REGION0.0))
        .ok()?;
    Some(QueueRun {
        taken: vring.queue_next_avail().wrapping_sub(input.next_avail),
        taken_while_stopped,
        stopped: device.stops.serving(0).is_none(),
        totals: counters.totals(),
        memory,
    })
}

/// One thing a connection input's front end does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A vhost-user message: its header's request code, flags and size,
    /// and the payload bytes sent (the size need not match them).
    Send {
        request: u32,
        flags: u32,
        size: u32,
        payload: Vec<u8>,
    },
    /// The guest kicks queue `n`.
    Kick(u8),
}

impl Message {
    /// A message whose size is its payload's, with the protocol version
    /// in its flags (what a well-behaved front end sends).
    pub fn send(request: u32, payload: &[u8]) -> Message {
        Message::Send {
            request,
            flags: 1,
            size: payload.len() as u32,
            payload: payload.to_vec(),
        }
    }
}

/// A vhost-user connection; see the module's doc.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectionInput {
    /// The guest memory file's first bytes (at most 65535 are encoded).
    pub memory: Vec<u8>,
    pub messages: Vec<Message>,
}

/// Payload bytes one message carries at most.
const MAX_PAYLOAD: usize = 4096;

impl ConnectionInput {
    /// The input bytes that decode to this.
    pub fn encode(&self) -> Vec<u8> {
        let memory = &self.memory[..self.memory.len().min(usize::from(u16::MAX))];
        let mut out = vec![1];
        out.extend_from_slice(&(memory.len() as u16).to_le_bytes());
        out.extend_from_slice(memory);
        for m in &self.messages {
            match m {
                Message::Kick(n) => out.extend_from_slice(&(KICK | u32::from(*n)).to_le_bytes()),
                Message::Send {
                    request,
                    flags,
                    size,
                    payload,
                } => {
                    for v in [request & !KICK, *flags, *size] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                    out.extend_from_slice(&payload[..payload.len().min(*size as usize)]);
                }
            }
        }
        out
    }

    fn decode(input: &[u8]) -> ConnectionInput {
        let mut c = Cursor(input);
        c.u8();
        let len = c.u16();
        let mut out = ConnectionInput {
            memory: c.take(usize::from(len)).to_vec(),
            messages: Vec::new(),
        };
        while !c.done() {
            let request = c.u32();
            if request & KICK != 0 {
                out.messages.push(Message::Kick(request as u8));
                continue;
            }
            let (flags, size) = (c.u32(), c.u32());
            let payload = c.take((size as usize).min(MAX_PAYLOAD)).to_vec();
            out.messages.push(Message::Send {
                request,
                flags,
                size,
                payload,
            });
        }
        out
    }
}

fn le32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le64(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Where [`ConnectionInput::negotiated`]'s front end says guest memory is
/// mapped in its own address space.
pub const FRONT_END_BASE: u64 = 0x7f00_0000_0000;

impl ConnectionInput {
    /// A connection that negotiates as QEMU does, starts queue 0 on
    /// `ring`'s layout (guest memory is `ring`'s) and queue 1 on empty
    /// rings 32 KiB further, kicks queue 0, and stops it.
    pub fn negotiated(ring: &RingBuilder) -> ConnectionInput {
        let send = Message::send;
        // VERSION_1, PROTOCOL_FEATURES, EVENT_IDX, INDIRECT_DESC,
        // WRITE_ZEROES, DISCARD, MQ, FLUSH.
        let features: u64 = [32, 30, 29, 28, 14, 13, 12, 9]
            .iter()
            .map(|b| 1u64 << b)
            .sum();
        let region = le64(&[0, MEMORY_FILE, FRONT_END_BASE, 0]);
        let mut m = vec![
            send(3, &[]),
            send(1, &[]),
            send(2, &le64(&[features])),
            send(15, &[]),
            // CONFIG and MQ.
            send(16, &le64(&[(1 << 9) | 1])),
            send(SET_MEM_TABLE, &[le32(&[1, 0]), region].concat()),
            send(24, &[le32(&[0, 60, 0]), vec![0; 60]].concat()),
        ];
        let input = &ring.input;
        for q in 0..QUEUES as u32 {
            let size = 1u32 << input.size_log2;
            let at = |a: u32| FRONT_END_BASE + u64::from(a + 0x8000 * q);
            m.push(send(8, &le32(&[q, size])));
            let addrs = le64(&[at(input.desc), at(input.used), at(input.avail), 0]);
            m.push(send(9, &[le32(&[q, 0]), addrs].concat()));
            m.push(send(10, &le32(&[q, 0])));
            m.push(send(SET_VRING_CALL, &le64(&[u64::from(q)])));
            m.push(send(SET_VRING_KICK, &le64(&[u64::from(q)])));
            m.push(send(18, &le32(&[q, 1])));
        }
        m.push(Message::Kick(0));
        // Round trips while the queue thread serves the kick.
        m.extend([send(1, &[]), send(15, &[]), send(1, &[])]);
        m.push(send(11, &le32(&[0, 0])));
        ConnectionInput {
            memory: input.memory.clone(),
            messages: m,
        }
    }
}

// vhost-user request codes whose messages carry file descriptors.
const SET_MEM_TABLE: u32 = 5;
const SET_LOG_BASE: u32 = 6;
const SET_LOG_FD: u32 = 7;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const SET_VRING_ERR: u32 = 14;
const SET_BACKEND_REQ_FD: u32 = 21;
const SET_INFLIGHT_FD: u32 = 32;
const ADD_MEM_REG: u32 = 37;
const SET_DEVICE_STATE_FD: u32 = 42;
/// A memory region's layout in SET_MEM_TABLE and ADD_MEM_REG payloads:
/// guest address, size, front-end address, offset in the file (u64 each).
const REGION_BYTES: usize = 32;
/// The vring index bit that says no file descriptor comes with it.
const NO_FD: u8 = 1;

/// The front end's side of one connection input.
struct FrontEnd {
    stream: UnixStream,
    memory: std::fs::File,
    /// The last kick eventfd sent for each queue index.
    kicks: HashMap<u8, EventFd>,
}

impl FrontEnd {
    /// Sends `m`; an error means the server hung up.
    fn act(&mut self, m: &Message) -> std::io::Result<()> {
        let (request, flags, size, payload) = match m {
            Message::Kick(n) => {
                if let Some(k) = self.kicks.get(n) {
                    k.write(1)?;
                    wait_consumed(k);
                }
                return Ok(());
            }
            Message::Send {
                request,
                flags,
                size,
                payload,
            } => (*request, *flags, *size, payload),
        };
        let mut bytes = Vec::with_capacity(12 + payload.len());
        for v in [request, flags, size] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes.extend_from_slice(payload);
        let mut owned = Vec::new();
        let fds = self.attach(request, &mut bytes[12..], &mut owned)?;
        let sent = self.stream.send_with_fds(&[&bytes[..]], &fds)?;
        (&self.stream).write_all(&bytes[sent..])
    }

    /// The descriptors a front end attaches to `request` (kept open in
    /// `owned` until sent). Memory regions are cut to fit in the memory
    /// file: a front end that maps past its file's end makes the server
    /// fault (SIGBUS) on the first access, and QEMU never does.
    fn attach(
        &mut self,
        request: u32,
        payload: &mut [u8],
        owned: &mut Vec<EventFd>,
    ) -> std::io::Result<Vec<RawFd>> {
        let memory = self.memory.as_raw_fd();
        Ok(match request {
            SET_MEM_TABLE => {
                let count = u32::from_le_bytes(payload_array(payload, 0)).min(8) as usize;
                for r in 0..count {
                    fit_region(payload, 8 + r * REGION_BYTES);
                }
                vec![memory; count]
            }
            ADD_MEM_REG => {
                fit_region(payload, 8);
                vec![memory]
            }
            SET_VRING_KICK | SET_VRING_CALL | SET_VRING_ERR => {
                let [index, flags] = payload_array::<2>(payload, 0);
                if flags & NO_FD != 0 {
                    return Ok(Vec::new());
                }
                let fd = EventFd::new(EFD_NONBLOCK)?;
                if request == SET_VRING_KICK {
                    self.kicks.insert(index, fd.try_clone()?);
                }
                let raw = fd.as_raw_fd();
                owned.push(fd);
                vec![raw]
            }
            SET_LOG_BASE | SET_LOG_FD | SET_BACKEND_REQ_FD | SET_INFLIGHT_FD
            | SET_DEVICE_STATE_FD => {
                let fd = EventFd::new(EFD_NONBLOCK)?;
                let raw = fd.as_raw_fd();
                owned.push(fd);
                vec![raw]
            }
            _ => Vec::new(),
        })
    }
}

/// Waits a little for the server's queue thread to take a kick, so that
/// the messages after it more often find it served (a queue the front
/// end has not started never takes it; the wait is short for that).
fn wait_consumed(kick: &EventFd) {
    const TRIES: u32 = 20;
    for _ in 0..TRIES {
        let mut fd = libc::pollfd {
            fd: kick.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `fd` is one valid pollfd that outlives the call, and
        // the count says one; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut fd, 1, 0) };
        if ready <= 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// `N` bytes of `payload` at `at`, zeros past its end.
fn payload_array<const N: usize>(payload: &[u8], at: usize) -> [u8; N] {
    Cursor(payload.get(at..).unwrap_or_default()).array()
}

/// Cuts the region at `at` of a memory table payload to fit inside the
/// memory file.
fn fit_region(payload: &mut [u8], at: usize) {
    let size = u64::from_le_bytes(payload_array(payload, at + 8));
    let offset = u64::from_le_bytes(payload_array(payload, at + 24)) % MEMORY_FILE;
    let size = size.min(MEMORY_FILE - offset);
    for (field, v) in [(at + 8, size), (at + 24, offset)] {
        if let Some(dst) = payload.get_mut(field..field + 8) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Sends `input`'s messages to a fresh server, then stops the server.
/// Returns what the server counted (`None`: no server could be started
/// here, e.g. no temporary directory).
pub fn exercise_connection(input: &ConnectionInput) -> Option<Totals> {
    let dir = tempfile::tempdir().ok()?;
    let socket = dir.path().join("vhost-user.sock");
    let disk = Arc::new(MemDisk::new(false));
    let mut serving = Serving::start_device(
        "fuzz".into(),
        disk,
        (&socket, &SocketAccess::default()),
        (QUEUES, 1),
    )
    .ok()?;
    let mut memory = tempfile::tempfile_in(dir.path()).ok()?;
    memory.set_len(MEMORY_FILE).ok()?;
    memory
        .write_all(&input.memory[..input.memory.len().min(MEMORY_FILE as usize)])
        .ok()?;
    let stream = UnixStream::connect(&socket).ok()?;
    let mut replies = stream.try_clone().ok()?;
    // Replies are read (and dropped) as they come, so that the server
    // never waits on a full socket.
    let reader = std::thread::spawn(move || std::io::copy(&mut replies, &mut std::io::sink()));
    let mut front = FrontEnd {
        stream,
        memory,
        kicks: HashMap::new(),
    };
    for m in &input.messages {
        if front.act(m).is_err() {
            break;
        }
    }
    // The server reads every message before it sees the end of the
    // stream and hangs up.
    let _ = front.stream.shutdown(std::net::Shutdown::Write);
    let _ = reader.join();
    let totals = serving.counters.totals();
    serving.stop();
    Some(totals)
}

/// A driver's view of a queue input's memory: lays out a split virtqueue
/// (descriptor table at 0, the rings right behind it) and requests in it,
/// as a guest driver would, in as few bytes as it can.
pub struct RingBuilder {
    pub input: QueueInput,
    size: u16,
    next_desc: u16,
    avail_idx: u16,
}

/// One descriptor of a chain: guest address, length, writable by the
/// device.
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

fn flags(write: bool, next: bool) -> u16 {
    let mut f = 0;
    if write {
        f |= VRING_DESC_F_WRITE;
    }
    if next {
        f |= VRING_DESC_F_NEXT;
    }
    f as u16
}

impl RingBuilder {
    /// A queue of `1 << size_log2` descriptors (at most 256).
    pub fn new(size_log2: u8, event_idx: bool) -> RingBuilder {
        let size_log2 = size_log2.min(8);
        let size = 1u32 << size_log2;
        let avail = 16 * size;
        // virtio 1.2, 2.7: the used ring is 4-byte aligned.
        let used = (avail + 6 + 2 * size).next_multiple_of(4);
        RingBuilder {
            input: QueueInput {
                event_idx,
                size_log2,
                desc: 0,
                avail,
                used,
                ..QueueInput::default()
            },
            size: size as u16,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Guest memory from here on is free for requests.
    pub fn free(&self) -> u64 {
        u64::from(self.input.used + 6 + 8 * u32::from(self.size)).next_multiple_of(16)
    }

    /// Writes `bytes` at guest address `at` of region 0.
    pub fn put(&mut self, at: u64, bytes: &[u8]) {
        let end = at as usize + bytes.len();
        if self.input.memory.len() < end {
            self.input.memory.resize(end, 0);
        }
        self.input.memory[at as usize..end].copy_from_slice(bytes);
    }

    /// Writes descriptor `index` of a table at `table` as it is, with
    /// raw `flags` and `next` (chains with loops, indirect tables).
    pub fn put_desc(&mut self, table: u64, index: u16, d: Desc, flags: u16, next: u16) {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&d.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&d.len.to_le_bytes());
        raw[12..14].copy_from_slice(&(flags | self::flags(d.write, false)).to_le_bytes());
        raw[14..].copy_from_slice(&next.to_le_bytes());
        self.put(table + 16 * u64::from(index), &raw);
    }

    /// Puts `chain` in the next free descriptors (linked in order) and
    /// makes it available; returns its head.
    pub fn post(&mut self, chain: &[Desc]) -> u16 {
        let head = self.next_desc;
        for (i, d) in chain.iter().enumerate() {
            let index = (head + i as u16) % self.size;
            let next = (index + 1) % self.size;
            let more = flags(false, i + 1 < chain.len());
            self.put_desc(u64::from(self.input.desc), index, *d, more, next);
        }
        self.next_desc = (head + chain.len() as u16) % self.size;
        self.make_available(head);
        head
    }

    /// Puts `chain` as an indirect table at `table` and makes a chain of
    /// one descriptor pointing at it available; returns its head.
    pub fn post_indirect(&mut self, table: u64, chain: &[Desc]) -> u16 {
        for (i, d) in chain.iter().enumerate() {
            let more = flags(false, i + 1 < chain.len());
            self.put_desc(table, i as u16, *d, more, i as u16 + 1);
        }
        let head = self.next_desc;
        let whole = Desc {
            addr: table,
            len: 16 * chain.len() as u32,
            write: false,
        };
        let indirect = VRING_DESC_F_INDIRECT as u16;
        self.put_desc(u64::from(self.input.desc), head, whole, indirect, 0);
        self.next_desc = (head + 1) % self.size;
        self.make_available(head);
        head
    }

    /// Adds `head` to the available ring and bumps its index.
    pub fn make_available(&mut self, head: u16) {
        let slot = 4 + 2 * u64::from(self.avail_idx % self.size);
        self.put(u64::from(self.input.avail) + slot, &head.to_le_bytes());
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// The guest address of the available ring's index.
    pub fn avail_idx_at(&self) -> u16 {
        self.input.avail as u16 + 2
    }

    /// Writes the available ring's index as the guest may: anything.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.put(u64::from(self.avail_idx_at()), &idx.to_le_bytes());
    }

    /// Posts a whole request at `at`: its 16-byte header, then its status
    /// byte (at `at + 16`, set to 0xff so that a status written shows),
    /// then its data (at `at + 32`; written by the guest for `Data::Out`).
    /// The chain is header, data, status, as virtio-blk lays it out.
    pub fn request(&mut self, at: u64, kind: u32, sector: u64, data: Data) -> u16 {
        self.put(at, &Self::header_bytes(kind, sector));
        self.put(at + 16, &[0xff]);
        let header = Desc {
            addr: at,
            len: 16,
            write: false,
        };
        let status = Desc {
            addr: at + 16,
            len: 1,
            write: true,
        };
        let data = match data {
            Data::None => None,
            Data::Out(bytes) => {
                self.put(at + 32, bytes);
                let len = bytes.len() as u32;
                Some(Desc {
                    addr: at + 32,
                    len,
                    write: false,
                })
            }
            Data::In(len) => Some(Desc {
                addr: at + 32,
                len,
                write: true,
            }),
        };
        let chain: Vec<Desc> = [Some(header), data, Some(status)]
            .into_iter()
            .flatten()
            .collect();
        self.post(&chain)
    }

    /// A virtio-blk request header: type, reserved, sector.
    pub fn header_bytes(kind: u32, sector: u64) -> [u8; 16] {
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&kind.to_le_bytes());
        header[8..].copy_from_slice(&sector.to_le_bytes());
        header
    }

    /// The status byte of the request [`RingBuilder::request`] put at
    /// `at`, in `memory` after a run (0xff: none written).
    pub fn status(memory: &[u8], at: u64) -> Option<u8> {
        memory.get(at as usize + 16).copied()
    }

    /// The used ring's index in `memory` after a run.
    pub fn used_idx(&self, memory: &[u8]) -> u16 {
        u16::from_le_bytes(payload_array(memory, self.input.used as usize + 2))
    }

    /// Adds `op` to what the run does.
    pub fn op(&mut self, op: Op) -> &mut RingBuilder {
        self.input.ops.push(op);
        self
    }
}

/// The data of a request [`RingBuilder::request`] posts.
#[derive(Debug, Clone, Copy)]
pub enum Data<'a> {
    None,
    /// Bytes the guest writes to the disk.
    Out(&'a [u8]),
    /// Room for this many bytes read from the disk.
    In(u32),
}
