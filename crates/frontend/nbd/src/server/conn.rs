//! One server connection: handshake, then the transmission phase.
//!
//! The connection thread reads requests, validates them and runs each
//! itself while its client waits for replies one at a time; once slow
//! requests hold up the requests queued behind them, a small pool of
//! worker threads (started on demand, at most `workers_per_connection`)
//! executes them against the export for a while (see [`Placement`]).
//! Replies go out under one writer lock, so they may leave out of order. Each thread encodes its replies
//! in its own [`Outbox`], reading data straight into it. A reply to a
//! request run on the reading thread while the next request is already
//! received is held there and sent with the next one that is not: one
//! write for a burst of replies. Held replies are sent before the reading
//! thread waits.
//!
//! Every buffered payload byte is taken from the server-wide budget first.
//! A payload larger than `Limits::payload_chunk`, or one the budget has no
//! room for, is never buffered whole: a write is read in pieces, each
//! stored by its own job as soon as it is read (so large writes still run
//! in parallel); a read is read from the export and sent piece by piece.
//!
//! Owns: request validation (magic, flags, bounds, alignment, payload
//! limits, read-only), reply encoding (simple and structured), payload
//! streaming, the in-flight budget, per-connection counters.
//! Must not: let a bad request crash the process or touch other
//! connections; allocate a payload before checking its length and taking
//! it from the budget; keep reading once the client misbehaved at the
//! framing level.

use std::cell::Cell;
use std::collections::VecDeque;
use std::io::{self, Read};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tracing::{debug, warn};

use super::budget::MIN_PIECE;
use super::handshake::{self, Negotiated};
use super::outbox::Outbox;
use super::payloads::Payload;
use super::{ConnInfo, ExportEntry, ServerInner};
use crate::export::{Export, ExportError, Extent, ZeroFlags};
use vdcache_nbd_proto::proto::{self, Request};
use vdcache_nbd_proto::transport::{ConnReader, ConnWriter, Socket};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Entry point of a connection thread.
pub(super) fn serve(inner: &Arc<ServerInner>, id: u64, sock: Socket, info: &Arc<ConnInfo>) {
    let peer = sock.peer();
    let ctl = match sock.try_clone() {
        Ok(c) => c,
        Err(e) => {
            warn!("nbd: connection {id}: cannot clone socket: {e}");
            return;
        }
    };
    let (reader, writer, neg, tls) =
        match handshake::negotiate(inner, sock, &mut || inner.established(id)) {
            Ok(x) => x,
            Err(end) => {
                handshake::log_end(id, &peer, &end);
                return;
            }
        };
    let conn = ConnCtx {
        id,
        peer: &peer,
        info,
        ctl: Some(&ctl),
    };
    transmission(inner, &conn, reader, writer, neg, tls);
}

/// Runs one connection over in-memory bytes (the fuzzing entry points):
/// the handshake, or with `preset` straight the transmission phase with
/// that state. Returns whether the transmission phase was reached.
pub(super) fn serve_bytes(
    inner: &Arc<ServerInner>,
    input: &[u8],
    sent: &Arc<Mutex<Vec<u8>>>,
    preset: Option<Negotiated>,
) -> bool {
    let r = ConnReader::Bytes(io::Cursor::new(input.to_vec()));
    let w = ConnWriter::Bytes(sent.clone());
    let (r, w, neg, tls) = match preset {
        Some(neg) => (r, w, neg, false),
        None => match handshake::negotiate_on(inner, r, w, &mut || true) {
            Ok(x) => x,
            Err(_) => return false,
        },
    };
    let info = Arc::new(ConnInfo::default());
    let conn = ConnCtx {
        id: 0,
        peer: "bytes",
        info: &info,
        ctl: None,
    };
    transmission(inner, &conn, r, w, neg, tls);
    true
}

/// Who a transmission phase serves.
pub(super) struct ConnCtx<'a> {
    pub(super) id: u64,
    pub(super) peer: &'a str,
    pub(super) info: &'a Arc<ConnInfo>,
    /// A clone of the socket, to cut a misbehaving client off (`None`
    /// without a socket).
    pub(super) ctl: Option<&'a Socket>,
}

/// Serves requests until the client leaves, then closes the connection.
pub(super) fn transmission(
    inner: &Arc<ServerInner>,
    conn: &ConnCtx<'_>,
    mut reader: ConnReader,
    writer: ConnWriter,
    neg: Negotiated,
    tls: bool,
) {
    let (id, peer, info) = (conn.id, conn.peer, conn.info);
    let entry = &inner.exports[neg.export];
    debug!(
        "nbd: connection {id} ({peer}) serving export {:?} (structured={}, tls={tls})",
        entry.name, neg.structured
    );
    info.tls.store(tls, Ordering::Relaxed);
    *lock(&info.export) = Some(entry.name.clone());
    entry.connection_started();
    // Pieces start at multiples of the chunk: keep them aligned for the export.
    let min_block = neg.block_sizes.minimum.max(1);
    let chunk = inner.limits.payload_chunk.max(min_block);
    let session = Arc::new(Session {
        export: entry.export.clone(),
        size: entry.export.size(),
        chunk: chunk - chunk % min_block,
        neg,
        writer: Mutex::new(writer),
        broken: AtomicBool::new(false),
        info: info.clone(),
        inner: inner.clone(),
        budget: Budget::new(
            inner.limits.max_inflight_bytes,
            inner.limits.max_inflight_requests,
        ),
        buffered: AtomicU64::new(0),
    });
    let pool = Pool::new(session.clone(), inner.limits.workers_per_connection);
    let end = read_loop(&session, &mut reader, &pool);
    match &end {
        LoopEnd::Eof => debug!("nbd: connection {id} ({peer}) closed by client"),
        LoopEnd::Disc => debug!("nbd: connection {id} ({peer}) disconnected (NBD_CMD_DISC)"),
        LoopEnd::Abuse(m) => {
            warn!("nbd: connection {id} ({peer}) dropped: {m}");
            // Do not wait for a misbehaving client to read its replies.
            if let Some(ctl) = conn.ctl {
                let _ = ctl.shutdown(std::net::Shutdown::Both);
            }
        }
    }
    pool.finish();
    drop(reader);
    send_held(&session);
    lock(&session.writer).close();
    entry.connection_ended();
}

enum LoopEnd {
    Eof,
    Disc,
    Abuse(String),
}

struct Session {
    export: Arc<dyn Export>,
    size: u64,
    /// Payloads larger than this are streamed in pieces of this size (a
    /// multiple of the export's minimum block size).
    chunk: u32,
    neg: Negotiated,
    writer: Mutex<ConnWriter>,
    broken: AtomicBool,
    info: Arc<ConnInfo>,
    inner: Arc<ServerInner>,
    budget: Budget,
    /// This connection's share of the server-wide payload budget.
    buffered: AtomicU64,
}

impl Session {
    /// Takes room in the server-wide payload budget for the next piece of
    /// a payload with `remaining` bytes: all of them up to the chunk size
    /// if they fit, else (when this connection holds nothing) a small
    /// piece. Replies held for a burst go out first if it has to wait:
    /// their client may need them before it reads what frees the budget.
    fn take_piece(&self, remaining: u64) -> u64 {
        let budget = &self.inner.budget;
        let want = remaining.min(u64::from(self.chunk));
        let alone = remaining.min(MIN_PIECE);
        match budget.try_take(want, alone, &self.buffered) {
            Some(n) => n,
            None => {
                send_held(self);
                budget.take(want, alone, &self.buffered)
            }
        }
    }

    fn give_back_buffered(&self, n: u64) {
        self.inner.budget.give_back(n, &self.buffered);
    }
}

/// Held replies beyond this many bytes are sent at once.
const MAX_HELD: usize = 256 << 10;

thread_local! {
    /// Set on the reading thread while it runs a request with the next one
    /// already received: the reply may wait for the next write.
    static HOLD_REPLY: Cell<bool> = const { Cell::new(false) };
}

/// One validated request waiting for a worker.
struct Job {
    req: Request,
    payload: Payload,
    /// Set when validation already failed: reply with this error.
    error: Option<ExportError>,
    /// Budget units held until the reply is sent.
    cost: u64,
    /// Bytes of the server-wide payload budget held until the payload is
    /// stored (writes) or sent (reads); less than a READ's length when its
    /// data goes out in pieces of this size.
    buffered: u64,
    /// Set for one piece of a streamed write (`req` is then the piece's).
    part: Option<Arc<StreamedWrite>>,
}

/// A write streamed in pieces, each stored by its own job; the reply goes
/// out once the last piece is stored.
struct StreamedWrite {
    req: Request,
    /// Pieces not yet stored, plus one while the reading thread still
    /// reads the payload; whoever takes it to zero replies.
    left: AtomicUsize,
    /// The first failure.
    error: Mutex<Option<ExportError>>,
}

impl StreamedWrite {
    /// Counts one part done; the last one sends the reply.
    fn done(&self, s: &Session) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let error = lock(&self.error).take();
            reply(s, &self.req, error.map_or(Ok(()), Err));
        }
    }
}

/// An inline request slower than this counts as slow.
const INLINE_SLOW: std::time::Duration = std::time::Duration::from_micros(200);
/// Slow inline requests in a row that a later request waited behind before
/// requests go to workers: one alone is as likely the reading thread
/// preempted (client and server share the cores) as a request that waits
/// for a backend.
const INLINE_SLOW_STREAK: u32 = 2;
/// Requests handed to workers after a slow streak, before trying again.
const INLINE_BACKOFF: u32 = 256;

/// Decides where a request runs. Handing a request to a worker costs two
/// thread switches, which dominate when the export answers from memory or
/// flash, and, for a client that waits for each reply (a guest's fsync at
/// queue depth 1), also when the export waits for its store. So requests
/// run on the reading thread, and go to workers (which overlap slow ones)
/// only after a streak of slow ones that the client's next request had to
/// wait behind.
#[derive(Default)]
struct Placement {
    dispatch_left: u32,
    slow_in_a_row: u32,
}

impl Placement {
    /// `more`: the next request is already received.
    fn run(&mut self, s: &Session, r: &ConnReader, pool: &Pool, job: Job, more: bool) {
        if self.dispatch_left > 0 {
            self.dispatch_left -= 1;
            pool.push(job);
            return;
        }
        let start = std::time::Instant::now();
        // Held until the check below: a client that waits for each reply
        // must not be seen sending its next request because of this one's.
        HOLD_REPLY.set(true);
        run_job(s, job);
        HOLD_REPLY.set(false);
        let slow = start.elapsed() > INLINE_SLOW;
        self.ran_inline(slow && (more || r.would_not_wait()));
        if !more {
            send_held(s);
        }
    }

    /// Counts an inline request; a streak of slow ones that held up the
    /// next request sends the next [`INLINE_BACKOFF`] requests to workers.
    fn ran_inline(&mut self, held_up_next: bool) {
        if !held_up_next {
            self.slow_in_a_row = 0;
            return;
        }
        self.slow_in_a_row += 1;
        if self.slow_in_a_row >= INLINE_SLOW_STREAK {
            self.slow_in_a_row = 0;
            self.dispatch_left = INLINE_BACKOFF;
        }
    }
}

/// Reads and validates requests until EOF, DISC or abuse.
fn read_loop(s: &Arc<Session>, r: &mut ConnReader, pool: &Pool) -> LoopEnd {
    let max_payload = s.neg.block_sizes.maximum;
    let mut placement = Placement::default();
    loop {
        if r.buffered_len() < proto::REQUEST_LEN {
            // About to wait for the client, which may wait for these.
            send_held(s);
        }
        let mut hdr = [0u8; proto::REQUEST_LEN];
        if let Err(e) = r.read_exact(&mut hdr) {
            return match e.kind() {
                io::ErrorKind::UnexpectedEof => LoopEnd::Eof,
                _ => LoopEnd::Abuse(format!("read failed: {e}")),
            };
        }
        let Some(req) = Request::decode(&hdr) else {
            return LoopEnd::Abuse("bad request magic".into());
        };
        if req.kind == proto::CMD_DISC {
            return LoopEnd::Disc;
        }
        let mut payload = Payload::default();
        let mut cost = 0u64;
        let mut buffered = 0u64;
        if req.kind == proto::CMD_WRITE {
            if req.length > max_payload {
                // The payload follows and cannot be skipped cheaply: the
                // spec allows a hard disconnect for oversized writes.
                return LoopEnd::Abuse(format!(
                    "write payload of {} bytes exceeds the maximum {max_payload}",
                    req.length
                ));
            }
            cost = u64::from(req.length);
            buffered = s.take_piece(cost);
            if buffered < cost {
                if let Err(end) = stream_write(s, r, &req, buffered, pool, &mut placement) {
                    return end;
                }
                continue;
            }
            s.budget.acquire(cost);
            payload = s.inner.payloads.take(req.length as usize);
            if let Err(e) = r.read_exact(payload.as_mut_slice()) {
                s.inner.payloads.give_back(payload);
                s.give_back_buffered(buffered);
                s.budget.release(cost);
                return LoopEnd::Abuse(vanished(&e));
            }
        } else if req.kind == proto::CMD_READ && req.length <= max_payload {
            cost = u64::from(req.length);
            // All of it, or the size of the pieces it is sent in.
            buffered = s.take_piece(cost);
            s.budget.acquire(cost);
        } else {
            s.budget.acquire(0);
        }
        let error = validate(s, &req).err();
        let more = r.buffered_len() >= proto::REQUEST_LEN;
        placement.run(
            s,
            r,
            pool,
            Job {
                req,
                payload,
                error,
                cost,
                buffered,
                part: None,
            },
            more,
        );
    }
}

fn vanished(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => "client vanished mid-request".into(),
        _ => format!("read failed: {e}"),
    }
}

/// A write whose payload is larger than the session's chunk, or did not
/// fit the budget: read in pieces (the first, of `first` bytes, already
/// taken from the budget), each stored by a job of its own as soon as it
/// is read, so no more than the budget allows is ever held and large
/// writes still run in parallel. A write that failed validation has its
/// payload read into one piece and dropped.
fn stream_write(
    s: &Session,
    r: &mut ConnReader,
    req: &Request,
    first: u64,
    pool: &Pool,
    placement: &mut Placement,
) -> Result<(), LoopEnd> {
    let len = u64::from(req.length);
    if let Err(e) = validate(s, req) {
        let mut piece = s.inner.payloads.take(first as usize);
        let mut pos = 0u64;
        let mut read = Ok(());
        while pos < len {
            let n = (len - pos).min(first) as usize;
            if let Err(e) = r.read_exact(&mut piece.as_mut_slice()[..n]) {
                read = Err(LoopEnd::Abuse(vanished(&e)));
                break;
            }
            pos += n as u64;
        }
        s.inner.payloads.give_back(piece);
        s.give_back_buffered(first);
        if read.is_ok() {
            send_error(s, req, &e);
        }
        return read;
    }
    let stream = Arc::new(StreamedWrite {
        req: *req,
        left: AtomicUsize::new(1),
        error: Mutex::new(None),
    });
    let mut pos = 0u64;
    let mut taken = first;
    loop {
        let n = taken;
        s.budget.acquire(n);
        let mut payload = s.inner.payloads.take(n as usize);
        if let Err(e) = r.read_exact(payload.as_mut_slice()) {
            s.inner.payloads.give_back(payload);
            s.give_back_buffered(n);
            s.budget.release(n);
            // The reading thread's count stays: no reply for a write
            // whose client is gone.
            return Err(LoopEnd::Abuse(vanished(&e)));
        }
        stream.left.fetch_add(1, Ordering::AcqRel);
        let piece = Request {
            offset: req.offset + pos,
            length: n as u32,
            ..*req
        };
        placement.run(
            s,
            r,
            pool,
            Job {
                req: piece,
                payload,
                error: None,
                cost: n,
                buffered: n,
                part: Some(stream.clone()),
            },
            false,
        );
        pos += n;
        if pos == len {
            break;
        }
        taken = s.take_piece(len - pos);
    }
    stream.done(s);
    Ok(())
}

fn inval(m: impl Into<String>) -> ExportError {
    ExportError::Invalid(m.into())
}

/// Checks a request against the negotiated state; the error to reply with.
fn validate(s: &Session, req: &Request) -> Result<(), ExportError> {
    use proto::*;
    let neg = &s.neg;
    let allowed = match req.kind {
        CMD_READ => CMD_FLAG_FUA | if neg.structured { CMD_FLAG_DF } else { 0 },
        CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        other => return Err(inval(format!("unknown command {other}"))),
    };
    if req.flags & !allowed != 0 {
        return Err(inval(format!(
            "flags {:#x} not valid for this command",
            req.flags
        )));
    }
    if req.kind == CMD_FLUSH {
        return Ok(());
    }
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && s.export.read_only() {
        return Err(ExportError::PermissionDenied("export is read-only".into()));
    }
    let len = u64::from(req.length);
    let in_bounds = req.offset.checked_add(len).is_some_and(|end| end <= s.size);
    if !in_bounds {
        let msg = format!(
            "request {}+{} beyond the end of the export ({} bytes)",
            req.offset, req.length, s.size
        );
        return Err(match req.kind {
            CMD_WRITE | CMD_WRITE_ZEROES => ExportError::NoSpace(msg),
            _ => ExportError::Invalid(msg),
        });
    }
    let bs = neg.block_sizes;
    if matches!(req.kind, CMD_READ | CMD_CACHE) && req.length > bs.maximum {
        return Err(inval(format!(
            "length {} exceeds the maximum block size {}",
            req.length, bs.maximum
        )));
    }
    let min = u64::from(bs.minimum);
    if min > 1
        && (!req.offset.is_multiple_of(min)
            || (!len.is_multiple_of(min) && req.offset + len != s.size))
    {
        return Err(inval(format!("request not aligned to {min} bytes")));
    }
    if req.kind == CMD_BLOCK_STATUS {
        if neg.meta_id.is_none() {
            return Err(inval("no metadata context negotiated"));
        }
        if req.length == 0 {
            return Err(inval("empty block status request"));
        }
    }
    Ok(())
}

/// Bounds what one connection holds in flight (requests and payload bytes).
struct Budget {
    state: Mutex<Held>,
    cv: Condvar,
    max_bytes: u64,
    max_requests: usize,
}

/// What a connection holds, and whether its reader waits for room (only
/// then does a release pay for a wake-up).
#[derive(Default)]
struct Held {
    bytes: u64,
    requests: usize,
    reader_waits: bool,
}

impl Budget {
    fn new(max_bytes: u64, max_requests: usize) -> Budget {
        Budget {
            state: Mutex::new(Held::default()),
            cv: Condvar::new(),
            max_bytes,
            max_requests,
        }
    }

    /// Waits until the request fits; a lone request always fits.
    fn acquire(&self, bytes: u64) {
        let mut st = lock(&self.state);
        while st.requests > 0
            && (st.requests >= self.max_requests || st.bytes + bytes > self.max_bytes)
        {
            st.reader_waits = true;
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.reader_waits = false;
        st.bytes += bytes;
        st.requests += 1;
    }

    fn release(&self, bytes: u64) {
        let mut st = lock(&self.state);
        st.bytes = st.bytes.saturating_sub(bytes);
        st.requests = st.requests.saturating_sub(1);
        if st.reader_waits {
            self.cv.notify_all();
        }
    }
}

/// Worker threads of one connection, started when all are busy.
struct Pool {
    session: Arc<Session>,
    shared: Arc<PoolShared>,
    max_workers: usize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct PoolShared {
    state: Mutex<PoolState>,
    cv: Condvar,
}

struct PoolState {
    jobs: VecDeque<Job>,
    idle: usize,
    closed: bool,
}

impl Pool {
    fn new(session: Arc<Session>, max_workers: usize) -> Pool {
        Pool {
            session,
            shared: Arc::new(PoolShared {
                state: Mutex::new(PoolState {
                    jobs: VecDeque::new(),
                    idle: 0,
                    closed: false,
                }),
                cv: Condvar::new(),
            }),
            max_workers,
            threads: Mutex::new(Vec::new()),
        }
    }

    fn push(&self, job: Job) {
        let (need_worker, wake) = {
            let mut st = lock(&self.shared.state);
            st.jobs.push_back(job);
            (st.idle < st.jobs.len(), st.idle > 0)
        };
        // A wake-up is a system call: only for a worker that sleeps.
        if wake {
            self.shared.cv.notify_one();
        }
        if need_worker {
            let mut threads = lock(&self.threads);
            if threads.len() < self.max_workers {
                let shared = self.shared.clone();
                let session = self.session.clone();
                match std::thread::Builder::new()
                    .name("nbd-worker".into())
                    .spawn(move || worker(&shared, &session))
                {
                    Ok(t) => threads.push(t),
                    Err(e) if threads.is_empty() => {
                        // Without any worker the job would never run: do it here.
                        warn!("nbd: cannot start a worker thread: {e}");
                        let job = lock(&self.shared.state).jobs.pop_back();
                        if let Some(job) = job {
                            run_job(&self.session, job);
                        }
                    }
                    Err(e) => debug!("nbd: cannot start another worker thread: {e}"),
                }
            }
        }
    }

    /// Lets queued jobs finish, then stops and joins the workers.
    fn finish(&self) {
        lock(&self.shared.state).closed = true;
        self.shared.cv.notify_all();
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
        // Jobs left only if no worker could ever start.
        let rest: Vec<Job> = lock(&self.shared.state).jobs.drain(..).collect();
        for job in rest {
            run_job(&self.session, job);
        }
    }
}

fn worker(shared: &PoolShared, session: &Session) {
    loop {
        let job = {
            let mut st = lock(&shared.state);
            loop {
                if let Some(j) = st.jobs.pop_front() {
                    break Some(j);
                }
                if st.closed {
                    break None;
                }
                st.idle += 1;
                st = shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                st.idle -= 1;
            }
        };
        match job {
            Some(j) => run_job(session, j),
            None => return,
        }
    }
}

/// Runs an export call, turning a panic inside the export into EIO.
fn guarded<T>(f: impl FnOnce() -> Result<T, ExportError>) -> Result<T, ExportError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => Err(ExportError::Io("internal error in the export".into())),
    }
}

fn run_job(s: &Session, job: Job) {
    let req = job.req;
    if let Some(stream) = job.part {
        let fua = req.flags & proto::CMD_FLAG_FUA != 0;
        let res = guarded(|| s.export.write(req.offset, &job.payload, fua));
        s.inner.payloads.give_back(job.payload);
        s.give_back_buffered(job.buffered);
        if let Err(e) = res {
            lock(&stream.error).get_or_insert(e);
        }
        s.budget.release(job.cost);
        stream.done(s);
        return;
    }
    match (job.error, req.kind) {
        (Some(e), _) => {
            s.inner.payloads.give_back(job.payload);
            s.give_back_buffered(job.buffered);
            send_error(s, &req, &e);
        }
        (None, proto::CMD_READ) => {
            read(s, &req, job.buffered);
            s.give_back_buffered(job.buffered);
        }
        (None, proto::CMD_BLOCK_STATUS) => block_status(s, &req),
        (None, _) => {
            let res = execute(s, &req, &job.payload);
            // Stored: the payload's memory is free before the reply waits
            // for a client that may not read it.
            s.inner.payloads.give_back(job.payload);
            s.give_back_buffered(job.buffered);
            reply(s, &req, res);
        }
    }
    s.budget.release(job.cost);
}

fn record(s: &Session, read: u64, written: u64, error: bool) {
    s.info.counters.record(read, written, error);
    let entry: &ExportEntry = &s.inner.exports[s.neg.export];
    entry.counters.record(read, written, error);
}

/// Executes a valid request other than READ and BLOCK_STATUS (which
/// encode their own replies).
fn execute(s: &Session, req: &Request, payload: &[u8]) -> Result<(), ExportError> {
    use proto::*;
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let len = u64::from(req.length);
    let e = &s.export;
    let res = match req.kind {
        CMD_WRITE => guarded(|| e.write(req.offset, payload, fua)),
        CMD_FLUSH => guarded(|| e.flush()),
        CMD_TRIM if len == 0 => Ok(()),
        CMD_TRIM => guarded(|| e.trim(req.offset, len, fua)),
        CMD_WRITE_ZEROES if len == 0 => Ok(()),
        CMD_WRITE_ZEROES => {
            let flags = ZeroFlags {
                no_hole: req.flags & CMD_FLAG_NO_HOLE != 0,
                fast_zero: req.flags & CMD_FLAG_FAST_ZERO != 0,
                fua,
            };
            match guarded(|| e.write_zeroes(req.offset, len, flags)) {
                // Only a fast-zero request may fail for lack of support.
                Err(ExportError::NotSupported(_)) if !flags.fast_zero => {
                    write_zero_buffers(e.as_ref(), req.offset, len, fua)
                }
                r => r,
            }
        }
        CMD_CACHE => guarded(|| e.cache(req.offset, len)),
        _ => Err(inval("unknown command")),
    };
    // ENOTSUP is reserved for fast zeroing; trim and cache are only hints.
    match res {
        Err(ExportError::NotSupported(_)) if matches!(req.kind, CMD_TRIM | CMD_CACHE) => Ok(()),
        Err(ExportError::NotSupported(m)) if req.kind != CMD_WRITE_ZEROES => {
            Err(ExportError::Invalid(m))
        }
        r => r,
    }
}

/// Replies to a request without data: success or the error.
fn reply(s: &Session, req: &Request, res: Result<(), ExportError>) {
    match res {
        Ok(()) => {
            let hdr = proto::simple_reply(req.cookie, 0);
            let written = if req.kind == proto::CMD_WRITE {
                u64::from(req.length)
            } else {
                0
            };
            send(s, Stat::ok(0, written), &[&hdr]);
        }
        Err(err) => send_error(s, req, &err),
    }
}

/// WRITE_ZEROES for an export that cannot zero: plain writes of zeroes.
fn write_zero_buffers(e: &dyn Export, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
    let zeroes = vec![0u8; len.min(1 << 20) as usize];
    let mut pos = 0u64;
    while pos < len {
        let n = (len - pos).min(zeroes.len() as u64);
        let last = pos + n == len;
        guarded(|| e.write(offset + pos, &zeroes[..n as usize], fua && last))?;
        pos += n;
    }
    if fua {
        guarded(|| e.flush())?;
    }
    Ok(())
}

/// What a reply accounts for in the counters.
struct Stat {
    read: u64,
    written: u64,
    error: bool,
}

impl Stat {
    fn err() -> Stat {
        Stat {
            read: 0,
            written: 0,
            error: true,
        }
    }

    fn ok(read: u64, written: u64) -> Stat {
        Stat {
            read,
            written,
            error: false,
        }
    }
}

/// Counts the request whose reply was just put in this thread's outbox,
/// then writes the outbox under the writer lock, unless the reply may be
/// held (counting first, so a client that saw the reply sees the
/// counters). A failed write ends the connection (the stream is unusable
/// after a partial reply).
fn finish_reply(s: &Session, stat: Stat, out: &mut Outbox) {
    record(s, stat.read, stat.written, stat.error);
    if HOLD_REPLY.get() && out.len() < MAX_HELD {
        return;
    }
    write_out(s, out);
}

/// Puts a reply made of `parts` in this thread's outbox and finishes it.
fn send(s: &Session, stat: Stat, parts: &[&[u8]]) {
    Outbox::with(|out| {
        for p in parts {
            out.push(p);
        }
        finish_reply(s, stat, out);
    });
}

/// Sends the replies held back, if any.
fn send_held(s: &Session) {
    Outbox::with(|out| {
        if out.len() > 0 {
            write_out(s, out);
        }
    });
}

/// Writes the outbox in one go.
fn write_out(s: &Session, out: &mut Outbox) {
    if !s.broken.load(Ordering::Relaxed) {
        write_locked(s, &mut lock(&s.writer), out);
    }
    out.clear();
}

/// Writes the outbox with the writer lock held, keeping its memory for
/// the next piece of a streamed reply.
fn write_locked(s: &Session, conn: &mut ConnWriter, out: &mut Outbox) {
    if !s.broken.load(Ordering::Relaxed)
        && let Err(e) = conn.write_all(out.pending())
    {
        debug!("nbd: reply write failed: {e}");
        s.broken.store(true, Ordering::Relaxed);
        conn.abort();
    }
    out.sent();
}

fn send_error(s: &Session, req: &Request, err: &ExportError) {
    debug!(
        "nbd: request type {} at {}+{} failed: {err}",
        req.kind, req.offset, req.length
    );
    let code = err.code();
    if s.neg.structured {
        let msg = err.to_string();
        let msg = &msg.as_bytes()[..msg.len().min(proto::MAX_STRING)];
        let hdr = proto::chunk_header(
            req.cookie,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_ERROR,
            (6 + msg.len()) as u32,
        );
        let mut body = [0u8; 6];
        body[0..4].copy_from_slice(&code.to_be_bytes());
        body[4..6].copy_from_slice(&(msg.len() as u16).to_be_bytes());
        send(s, Stat::err(), &[&hdr, &body, msg]);
    } else {
        let hdr = proto::simple_reply(req.cookie, code);
        send(s, Stat::err(), &[&hdr]);
    }
}

/// One piece of a structured read reply, relative to the request offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    start: u64,
    len: u64,
    zero: bool,
}

/// Zero runs shorter than this are sent as data (a hole chunk costs more).
const MIN_HOLE: u64 = 4096;
/// More runs than this and the read is sent as one data chunk.
const MAX_RUNS: usize = 64;

/// Splits `[0, len)` into data and zero runs from block status extents.
fn plan_runs(extents: &[Extent], len: u64) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut pos = 0u64;
    for ext in extents {
        if pos >= len || ext.length == 0 {
            break;
        }
        let n = ext.length.min(len - pos);
        let zero = ext.zero && n >= MIN_HOLE;
        push_run(
            &mut runs,
            Run {
                start: pos,
                len: n,
                zero,
            },
        );
        pos += n;
    }
    if pos < len {
        push_run(
            &mut runs,
            Run {
                start: pos,
                len: len - pos,
                zero: false,
            },
        );
    }
    if runs.len() > MAX_RUNS {
        return vec![Run {
            start: 0,
            len,
            zero: false,
        }];
    }
    runs
}

fn push_run(runs: &mut Vec<Run>, r: Run) {
    match runs.last_mut() {
        Some(last) if last.zero == r.zero => last.len += r.len,
        _ => runs.push(r),
    }
}

/// A READ for which `piece` bytes of the budget were taken: all of its
/// data, or the size of the pieces it is sent in.
fn read(s: &Session, req: &Request, piece: u64) {
    let len = u64::from(req.length);
    let e = &s.export;
    let streamed = piece < len;
    if !s.neg.structured {
        if streamed {
            read_contiguous(s, req, &proto::simple_reply(req.cookie, 0), piece);
            return;
        }
        reply_in_outbox(s, req, Stat::ok(len, 0), |out| {
            out.push(&proto::simple_reply(req.cookie, 0));
            guarded(|| e.read(req.offset, out.grow(req.length as usize)))
        });
        return;
    }
    let df = req.flags & proto::CMD_FLAG_DF != 0;
    if df && streamed {
        // Not to be fragmented: one data chunk, streamed.
        let mut hdr = [0u8; proto::CHUNK_HEADER_LEN + 8];
        hdr[..proto::CHUNK_HEADER_LEN].copy_from_slice(&proto::chunk_header(
            req.cookie,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_OFFSET_DATA,
            (8 + u64::from(req.length)) as u32,
        ));
        hdr[proto::CHUNK_HEADER_LEN..].copy_from_slice(&req.offset.to_be_bytes());
        read_contiguous(s, req, &hdr, piece);
        return;
    }
    let runs = if len == 0 {
        Vec::new()
    } else if df || len < 2 * MIN_HOLE {
        vec![Run {
            start: 0,
            len,
            zero: false,
        }]
    } else {
        match guarded(|| e.block_status(req.offset, len)) {
            Ok(ext) => plan_runs(&ext, len),
            Err(_) => vec![Run {
                start: 0,
                len,
                zero: false,
            }],
        }
    };
    if !streamed {
        reply_in_outbox(s, req, Stat::ok(len, 0), |out| {
            encode_runs(s, req, &runs, out, None)
        });
        return;
    }
    // Chunks already sent are valid on their own: a failure ends the
    // reply with an error chunk after them.
    let pieces = split_runs(&runs, piece);
    let result = Outbox::with(|out| {
        let result = encode_runs(s, req, &pieces, out, Some(piece as usize));
        if result.is_ok() {
            finish_reply(s, Stat::ok(len, 0), out);
        }
        result
    });
    if let Err(err) = result {
        send_error(s, req, &err);
    }
}

/// Data runs cut into pieces of at most `chunk` bytes (holes stay whole).
fn split_runs(runs: &[Run], chunk: u64) -> Vec<Run> {
    let mut pieces = Vec::with_capacity(runs.len());
    for r in runs {
        if r.zero {
            pieces.push(*r);
            continue;
        }
        let mut pos = 0;
        while pos < r.len {
            let n = (r.len - pos).min(chunk);
            pieces.push(Run {
                start: r.start + pos,
                len: n,
                zero: false,
            });
            pos += n;
        }
    }
    pieces
}

/// A READ sent in pieces of `piece` bytes whose data must follow `header`
/// in one piece (a simple reply, or a structured one that must not be
/// fragmented): after the first piece the writer lock is held while the
/// export reads piece after piece. A failure after the header left cannot
/// be reported any more: the connection is cut, as the protocol asks.
fn read_contiguous(s: &Session, req: &Request, header: &[u8], piece: u64) {
    let chunk = piece as usize;
    let len = req.length as usize;
    let first = Outbox::with(|out| {
        let mark = out.len();
        out.push(header);
        let r = guarded(|| s.export.read(req.offset, out.grow(chunk)));
        if r.is_err() {
            out.truncate(mark);
        }
        r
    });
    if let Err(err) = first {
        send_error(s, req, &err);
        return;
    }
    // Counted before the client can see the reply, as every reply is.
    record(s, len as u64, 0, false);
    Outbox::with(|out| {
        let mut conn = lock(&s.writer);
        let mut pos = chunk;
        loop {
            write_locked(s, &mut conn, out);
            if pos == len || s.broken.load(Ordering::Relaxed) {
                break;
            }
            let n = (len - pos).min(chunk);
            let off = req.offset + pos as u64;
            if let Err(err) = guarded(|| s.export.read(off, out.grow(n))) {
                warn!(
                    "nbd: read of {}+{} failed after its reply began ({err}): closing the connection",
                    req.offset, req.length
                );
                s.broken.store(true, Ordering::Relaxed);
                conn.abort();
                break;
            }
            pos += n;
        }
        drop(conn);
        out.clear();
    });
}

/// Encodes a reply into this thread's outbox with `encode` and finishes
/// it; if `encode` fails, what it wrote is dropped and an error reply
/// goes instead.
fn reply_in_outbox(
    s: &Session,
    req: &Request,
    stat: Stat,
    encode: impl FnOnce(&mut Outbox) -> Result<(), ExportError>,
) {
    let result = Outbox::with(|out| {
        let mark = out.len();
        let result = encode(out);
        match result {
            Ok(()) => finish_reply(s, stat, out),
            Err(_) => out.truncate(mark),
        }
        result
    });
    if let Err(err) = result {
        send_error(s, req, &err);
    }
}

/// Encodes a structured read reply into the outbox, one chunk per run
/// (`NONE` for an empty read), data read straight into place. With
/// `flush_at`, the outbox is written out whenever it holds that many
/// bytes (a streamed reply). On failure the chunk being encoded is
/// dropped; earlier ones stay.
fn encode_runs(
    s: &Session,
    req: &Request,
    runs: &[Run],
    out: &mut Outbox,
    flush_at: Option<usize>,
) -> Result<(), ExportError> {
    if runs.is_empty() {
        let hdr = proto::chunk_header(
            req.cookie,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_NONE,
            0,
        );
        out.push(&hdr);
        return Ok(());
    }
    for (i, r) in runs.iter().enumerate() {
        let last = i + 1 == runs.len();
        let flags = if last { proto::REPLY_FLAG_DONE } else { 0 };
        let off = req.offset + r.start;
        if r.zero {
            out.push(&proto::chunk_header(
                req.cookie,
                flags,
                proto::REPLY_TYPE_OFFSET_HOLE,
                12,
            ));
            out.push(&off.to_be_bytes());
            out.push(&(r.len as u32).to_be_bytes());
        } else {
            let mark = out.len();
            out.push(&proto::chunk_header(
                req.cookie,
                flags,
                proto::REPLY_TYPE_OFFSET_DATA,
                (8 + r.len) as u32,
            ));
            out.push(&off.to_be_bytes());
            let dst = out.grow(r.len as usize);
            if let Err(err) = guarded(|| s.export.read(off, dst)) {
                out.truncate(mark);
                return Err(err);
            }
        }
        if !last && flush_at.is_some_and(|at| out.len() >= at) {
            write_locked(s, &mut lock(&s.writer), out);
        }
    }
    Ok(())
}

/// Largest extent length we put in one descriptor (u32, 4 KiB aligned).
const MAX_DESCRIPTOR: u64 = 0xFFFF_F000;
/// Descriptors per reply (8 bytes each).
const MAX_DESCRIPTORS: usize = 1 << 16;

fn block_status(s: &Session, req: &Request) {
    let Some(meta_id) = s.neg.meta_id else {
        send_error(s, req, &inval("no metadata context negotiated"));
        return;
    };
    let len = u64::from(req.length);
    let extents = match guarded(|| s.export.block_status(req.offset, len)) {
        Ok(x) => x,
        Err(err) => {
            send_error(s, req, &err);
            return;
        }
    };
    let descs = descriptors(
        &extents,
        req.offset,
        len,
        s.size,
        req.flags & proto::CMD_FLAG_REQ_ONE != 0,
        u64::from(s.neg.block_sizes.minimum),
    );
    let mut body = Vec::with_capacity(4 + 8 * descs.len());
    body.extend_from_slice(&meta_id.to_be_bytes());
    for (l, f) in &descs {
        body.extend_from_slice(&l.to_be_bytes());
        body.extend_from_slice(&f.to_be_bytes());
    }
    let hdr = proto::chunk_header(
        req.cookie,
        proto::REPLY_FLAG_DONE,
        proto::REPLY_TYPE_BLOCK_STATUS,
        body.len() as u32,
    );
    send(s, Stat::ok(0, 0), &[&hdr, &body]);
}

/// Turns export extents into valid wire descriptors: nonzero u32 lengths,
/// inside the export, the first N-1 summing to less than `len`, exactly
/// one no longer than `len` with `req_one`, at least one always.
fn descriptors(
    extents: &[Extent],
    offset: u64,
    len: u64,
    size: u64,
    req_one: bool,
    min_block: u64,
) -> Vec<(u32, u32)> {
    let limit = size - offset;
    let max_piece = MAX_DESCRIPTOR - MAX_DESCRIPTOR % min_block.max(1);
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut covered = 0u64;
    for ext in extents {
        if covered >= len || covered >= limit || out.len() >= MAX_DESCRIPTORS {
            break;
        }
        let mut n = ext.length.min(limit - covered);
        if req_one {
            n = n.min(len);
        }
        if n == 0 {
            break;
        }
        let flags = ext.flags();
        while n > 0 && out.len() < MAX_DESCRIPTORS {
            let piece = n.min(max_piece);
            match out.last_mut() {
                Some((l, f)) if *f == flags && u64::from(*l) + piece <= max_piece => {
                    *l += piece as u32;
                }
                _ => out.push((piece as u32, flags)),
            }
            covered += piece;
            n -= piece;
            if req_one || covered >= len {
                break;
            }
        }
        if req_one {
            break;
        }
    }
    if out.is_empty() {
        // Nothing usable from the export: "unknown" (0) is always safe.
        let n = len.min(limit).min(max_piece).max(1);
        out.push((n as u32, 0));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_streak_of_slow_inline_requests_moves_requests_to_workers() {
        let mut p = super::Placement::default();
        p.ran_inline(true);
        p.ran_inline(false);
        p.ran_inline(true);
        assert_eq!(p.dispatch_left, 0, "one slow request at a time moved work");
        p.ran_inline(true);
        assert_eq!(p.dispatch_left, super::INLINE_BACKOFF);
    }

    use super::*;

    fn ext(length: u64, zero: bool) -> Extent {
        Extent {
            length,
            hole: zero,
            zero,
        }
    }

    #[test]
    fn runs_merge_and_skip_small_holes() {
        let r = plan_runs(
            &[
                ext(8192, true),
                ext(100, false),
                ext(100, true),
                ext(8192, true),
            ],
            20000,
        );
        assert_eq!(
            r,
            vec![
                Run {
                    start: 0,
                    len: 8192,
                    zero: true
                },
                Run {
                    start: 8192,
                    len: 200,
                    zero: false
                },
                Run {
                    start: 8392,
                    len: 8192,
                    zero: true
                },
                Run {
                    start: 16584,
                    len: 3416,
                    zero: false
                },
            ]
        );
        let r = plan_runs(&[ext(1 << 30, true)], 65536);
        assert_eq!(
            r,
            vec![Run {
                start: 0,
                len: 65536,
                zero: true
            }]
        );
    }

    #[test]
    fn descriptors_respect_limits() {
        // REQ_ONE: exactly one, no longer than the request.
        let d = descriptors(
            &[ext(1 << 20, true), ext(10, false)],
            0,
            4096,
            1 << 30,
            true,
            1,
        );
        assert_eq!(d, vec![(4096, proto::STATE_HOLE | proto::STATE_ZERO)]);
        // Clipped to the export size; huge extents split into u32 pieces.
        let d = descriptors(
            &[ext(u64::MAX, false)],
            0,
            u64::from(u32::MAX),
            1 << 40,
            false,
            512,
        );
        assert_eq!(d.len(), 2);
        assert!(d.iter().all(|(l, _)| *l > 0 && u64::from(*l) % 512 == 0));
        let d = descriptors(&[ext(1 << 20, false)], 100, 50, 120, false, 1);
        assert_eq!(d, vec![(20, 0)]);
        // Empty answer from the export still yields one descriptor.
        let d = descriptors(&[], 0, 10, 100, false, 1);
        assert_eq!(d, vec![(10, 0)]);
    }
}
