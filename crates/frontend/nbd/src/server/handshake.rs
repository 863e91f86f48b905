//! Server side of the fixed newstyle handshake: greeting, option haggling
//! (EXPORT_NAME, ABORT, LIST, STARTTLS, INFO, GO, STRUCTURED_REPLY,
//! LIST/SET_META_CONTEXT), TLS upgrade.
//!
//! Owns: everything said before the transmission phase, and the limits on it
//! (option length and count; the handshake deadline is enforced by the
//! server's reaper, which shuts the socket down).
//! Must not: allocate more than `max_option_len` per option, accept a client
//! that is not fixed newstyle, or answer anything but STARTTLS/ABORT before
//! TLS when TLS is required.

use std::io::{self, IoSlice, Read};
use std::sync::atomic::Ordering;

use tracing::{debug, warn};

use super::{ExportEntry, ServerInner};
use crate::export::BlockSizes;
use vdcache_nbd_proto::proto::{self, Cursor};
use vdcache_nbd_proto::transport::Socket;
use vdcache_nbd_proto::transport::{ConnReader, ConnWriter, split_plain, split_tls, tls_handshake};

/// Result of a successful handshake.
pub(super) struct Negotiated {
    pub(super) export: usize,
    pub(super) structured: bool,
    /// Context id of `base:allocation` when selected for the chosen export.
    pub(super) meta_id: Option<u32>,
    pub(super) flags: u16,
    pub(super) block_sizes: BlockSizes,
}

/// Why the handshake ended without a transmission phase.
#[derive(Debug)]
pub(super) enum End {
    /// Client aborted or disconnected; nothing wrong.
    Closed,
    /// Protocol violation or I/O failure.
    Error(String),
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe => End::Closed,
            _ => End::Error(e.to_string()),
        }
    }
}

const META_ID_BASE_ALLOCATION: u32 = 1;

/// Block sizes made safe to advertise: powers of two where required and a
/// maximum no larger than the server's payload limit.
pub(super) fn sanitize_block_sizes(bs: BlockSizes, max_payload: u32) -> BlockSizes {
    let mut min = bs.minimum;
    if min == 0 || !min.is_power_of_two() || min > 65536 {
        min = 1;
    }
    let mut pref = bs.preferred;
    if !pref.is_power_of_two() || pref < min.max(512) {
        pref = min.max(4096);
    }
    if pref > max_payload {
        // Largest power of two within the payload limit (>= 4096).
        pref = 1 << (31 - max_payload.leading_zeros());
    }
    let mut max = bs.maximum.min(max_payload);
    max -= max % min;
    if max < pref {
        max = pref.min(max_payload - max_payload % min);
    }
    BlockSizes {
        minimum: min,
        preferred: pref,
        maximum: max,
    }
}

/// Transmission flags for an export.
pub(super) fn transmission_flags(e: &ExportEntry, structured: bool) -> u16 {
    let mut f = proto::TFLAG_HAS_FLAGS
        | proto::TFLAG_SEND_FLUSH
        | proto::TFLAG_SEND_FUA
        | proto::TFLAG_SEND_CACHE;
    if e.export.read_only() {
        f |= proto::TFLAG_READ_ONLY;
    } else {
        f |= proto::TFLAG_SEND_TRIM | proto::TFLAG_SEND_WRITE_ZEROES | proto::TFLAG_SEND_FAST_ZERO;
    }
    if e.export.can_multi_conn() {
        f |= proto::TFLAG_CAN_MULTI_CONN;
    }
    if structured {
        f |= proto::TFLAG_SEND_DF;
    }
    f
}

/// What the transmission phase of export `idx` runs with, given whether
/// structured replies and `base:allocation` were selected.
pub(super) fn negotiated(
    inner: &ServerInner,
    idx: usize,
    structured: bool,
    base_allocation: bool,
) -> Negotiated {
    let e = &inner.exports[idx];
    Negotiated {
        export: idx,
        structured,
        meta_id: (structured && base_allocation).then_some(META_ID_BASE_ALLOCATION),
        flags: transmission_flags(e, structured),
        block_sizes: sanitize_block_sizes(e.export.block_sizes(), inner.limits.max_payload),
    }
}

struct State<'a> {
    inner: &'a ServerInner,
    ready: &'a mut dyn FnMut() -> bool,
    r: ConnReader,
    w: ConnWriter,
    no_zeroes: bool,
    tls: bool,
    structured: bool,
    /// (export name the contexts were selected for, base:allocation selected)
    meta: Option<(String, bool)>,
}

/// Runs the handshake on a freshly accepted socket.
pub(super) fn negotiate(
    inner: &ServerInner,
    sock: Socket,
    ready: &mut dyn FnMut() -> bool,
) -> Result<(ConnReader, ConnWriter, Negotiated, bool), End> {
    let (r, w) = split_plain(sock)?;
    negotiate_on(inner, r, w, ready)
}

/// Runs the handshake over the halves of a connection: returns them (TLS
/// ones after STARTTLS) with what was negotiated and whether TLS is on.
/// `ready` is asked right before the message that starts the transmission
/// phase, so a client that saw it is known to be past its handshake; if
/// it says no (the connection was evicted or timed out), the handshake
/// ends there.
pub(super) fn negotiate_on(
    inner: &ServerInner,
    r: ConnReader,
    mut w: ConnWriter,
    ready: &mut dyn FnMut() -> bool,
) -> Result<(ConnReader, ConnWriter, Negotiated, bool), End> {
    let mut greeting = [0u8; 18];
    greeting[0..8].copy_from_slice(&proto::NBD_MAGIC.to_be_bytes());
    greeting[8..16].copy_from_slice(&proto::IHAVEOPT.to_be_bytes());
    greeting[16..18]
        .copy_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&greeting)?;
    let mut st = State {
        inner,
        ready,
        r,
        w,
        no_zeroes: false,
        tls: false,
        structured: false,
        meta: None,
    };
    let mut cflags = [0u8; 4];
    st.r.read_exact(&mut cflags)?;
    let cflags = u32::from_be_bytes(cflags);
    if cflags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        return Err(End::Error(format!("unknown client flags {cflags:#x}")));
    }
    if cflags & proto::FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(End::Error("client does not speak fixed newstyle".into()));
    }
    st.no_zeroes = cflags & proto::FLAG_C_NO_ZEROES != 0;

    let mut count = 0u32;
    loop {
        count += 1;
        if count > inner.limits.max_options {
            return Err(End::Error("too many options".into()));
        }
        let mut hdr = [0u8; 16];
        st.r.read_exact(&mut hdr)?;
        if proto::be64(&hdr[0..8]) != proto::IHAVEOPT {
            return Err(End::Error("bad option magic".into()));
        }
        let opt = proto::be32(&hdr[8..12]);
        let len = proto::be32(&hdr[12..16]);
        if len > inner.limits.max_option_len {
            return Err(End::Error(format!(
                "option {} of {len} bytes exceeds the limit",
                proto::option_name(opt)
            )));
        }
        let mut data = vec![0u8; len as usize];
        st.r.read_exact(&mut data)?;
        debug!("nbd: option {} ({len} bytes)", proto::option_name(opt));
        if let Some(neg) = st.option(opt, &data)? {
            let State { r, w, tls, .. } = st;
            return Ok((r, w, neg, tls));
        }
    }
}

impl State<'_> {
    fn reply(&mut self, opt: u32, rep: u32, payload: &[u8]) -> io::Result<()> {
        let hdr = proto::option_reply_header(opt, rep, payload.len() as u32);
        self.w
            .write_all_vectored(&mut [IoSlice::new(&hdr), IoSlice::new(payload)])
    }

    fn error(&mut self, opt: u32, rep: u32, msg: &str) -> io::Result<()> {
        debug!(
            "nbd: option {} -> {}: {msg}",
            proto::option_name(opt),
            proto::reply_name(rep)
        );
        let msg = &msg.as_bytes()[..msg.len().min(proto::MAX_STRING)];
        self.reply(opt, rep, msg)
    }

    /// Handles one option; `Some` when the transmission phase starts.
    fn option(&mut self, opt: u32, data: &[u8]) -> Result<Option<Negotiated>, End> {
        let tls_required = self.inner.tls.is_some() && !self.tls;
        if self.inner.stopping.load(Ordering::SeqCst) && opt != proto::OPT_ABORT {
            if opt == proto::OPT_EXPORT_NAME {
                return Err(End::Closed);
            }
            self.error(opt, proto::REP_ERR_SHUTDOWN, "server is shutting down")?;
            return Ok(None);
        }
        if tls_required && !matches!(opt, proto::OPT_STARTTLS | proto::OPT_ABORT) {
            if opt == proto::OPT_EXPORT_NAME {
                return Err(End::Error("NBD_OPT_EXPORT_NAME before TLS".into()));
            }
            self.error(opt, proto::REP_ERR_TLS_REQD, "TLS is required")?;
            return Ok(None);
        }
        match opt {
            proto::OPT_EXPORT_NAME => self.export_name(data).map(Some),
            proto::OPT_ABORT => {
                let _ = self.reply(opt, proto::REP_ACK, &[]);
                Err(End::Closed)
            }
            proto::OPT_LIST => {
                if !data.is_empty() {
                    self.error(opt, proto::REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                    return Ok(None);
                }
                for i in 0..self.inner.exports.len() {
                    let e = &self.inner.exports[i];
                    let mut p = Vec::with_capacity(4 + e.name.len());
                    p.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    p.extend_from_slice(e.name.as_bytes());
                    if let Some(d) = &e.description {
                        p.extend_from_slice(d.as_bytes());
                    }
                    self.reply(opt, proto::REP_SERVER, &p)?;
                }
                self.reply(opt, proto::REP_ACK, &[])?;
                Ok(None)
            }
            proto::OPT_STARTTLS => self.starttls(data).map(|()| None),
            proto::OPT_INFO | proto::OPT_GO => self.info_go(opt, data),
            proto::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.error(opt, proto::REP_ERR_INVALID, "option takes no data")?;
                } else {
                    self.structured = true;
                    self.reply(opt, proto::REP_ACK, &[])?;
                }
                Ok(None)
            }
            proto::OPT_LIST_META_CONTEXT | proto::OPT_SET_META_CONTEXT => {
                self.meta_context(opt, data)?;
                Ok(None)
            }
            _ => {
                self.error(opt, proto::REP_ERR_UNSUP, "option not supported")?;
                Ok(None)
            }
        }
    }

    fn export_name(&mut self, data: &[u8]) -> Result<Negotiated, End> {
        let name =
            std::str::from_utf8(data).map_err(|_| End::Error("export name is not UTF-8".into()))?;
        let Some(idx) = self.inner.exports.iter().position(|e| e.name == name) else {
            // This option cannot return an error: the spec says to disconnect.
            return Err(End::Error(format!("unknown export {name:?}")));
        };
        let neg = self.negotiated(idx);
        self.enter_transmission()?;
        let mut b = Vec::with_capacity(134);
        b.extend_from_slice(&self.inner.exports[idx].export.size().to_be_bytes());
        b.extend_from_slice(&neg.flags.to_be_bytes());
        if !self.no_zeroes {
            b.extend_from_slice(&[0u8; 124]);
        }
        self.w.write_all(&b)?;
        Ok(neg)
    }

    /// Asks the server whether the connection may enter the transmission
    /// phase (it may have been evicted or timed out meanwhile).
    fn enter_transmission(&mut self) -> Result<(), End> {
        // Evicted or timed out: already logged by whoever closed it.
        if (self.ready)() {
            Ok(())
        } else {
            Err(End::Closed)
        }
    }

    fn negotiated(&self, idx: usize) -> Negotiated {
        let e = &self.inner.exports[idx];
        let meta = matches!(&self.meta, Some((name, true)) if *name == e.name);
        negotiated(self.inner, idx, self.structured, meta)
    }

    fn starttls(&mut self, data: &[u8]) -> Result<(), End> {
        let opt = proto::OPT_STARTTLS;
        let Some(tls) = self.inner.tls.clone() else {
            self.error(opt, proto::REP_ERR_UNSUP, "TLS is not configured")?;
            return Ok(());
        };
        if self.tls {
            self.error(opt, proto::REP_ERR_INVALID, "TLS is already active")?;
            return Ok(());
        }
        if !data.is_empty() {
            self.error(
                opt,
                proto::REP_ERR_INVALID,
                "NBD_OPT_STARTTLS takes no data",
            )?;
            return Ok(());
        }
        if self.r.has_buffered() {
            return Err(End::Error("data sent before the STARTTLS reply".into()));
        }
        self.reply(opt, proto::REP_ACK, &[])?;
        // Swap in the TLS halves; the old plain halves are dropped.
        let old = std::mem::replace(&mut self.r, ConnReader::Closed);
        let mut sock = old
            .into_plain_socket()
            .ok_or_else(|| End::Error("no plain socket to upgrade to TLS".into()))?;
        let session = tls
            .session()
            .map_err(|e| End::Error(format!("TLS setup: {e}")))?;
        let conn = tls_handshake(session, &mut sock)
            .map_err(|e| End::Error(format!("TLS handshake failed: {e}")))?;
        let (r, w) = split_tls(sock, conn)?;
        self.r = r;
        self.w = w;
        self.tls = true;
        // STARTTLS forgets everything negotiated before it.
        self.structured = false;
        self.meta = None;
        debug!("nbd: TLS established");
        Ok(())
    }

    fn info_go(&mut self, opt: u32, data: &[u8]) -> Result<Option<Negotiated>, End> {
        let mut c = Cursor::new(data);
        let parsed = (|| {
            let name = c.string32()?;
            let n = c.u16()?;
            let mut reqs = Vec::with_capacity(n as usize);
            for _ in 0..n {
                reqs.push(c.u16()?);
            }
            (c.remaining() == 0).then_some((name, reqs))
        })();
        let Some((name, reqs)) = parsed else {
            self.error(opt, proto::REP_ERR_INVALID, "malformed request")?;
            return Ok(None);
        };
        let Some(idx) = self.inner.exports.iter().position(|e| e.name == name) else {
            let msg = format!("export {name:?} not found");
            self.error(opt, proto::REP_ERR_UNKNOWN, &msg)?;
            return Ok(None);
        };
        let neg = self.negotiated(idx);
        let e = &self.inner.exports[idx];
        let size = e.export.size();
        let description = e.description.clone();
        let canonical = e.name.clone();
        let mut info = Vec::with_capacity(12);
        info.extend_from_slice(&proto::INFO_EXPORT.to_be_bytes());
        info.extend_from_slice(&size.to_be_bytes());
        info.extend_from_slice(&neg.flags.to_be_bytes());
        self.reply(opt, proto::REP_INFO, &info)?;
        let mut bs = Vec::with_capacity(14);
        bs.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
        bs.extend_from_slice(&neg.block_sizes.minimum.to_be_bytes());
        bs.extend_from_slice(&neg.block_sizes.preferred.to_be_bytes());
        bs.extend_from_slice(&neg.block_sizes.maximum.to_be_bytes());
        self.reply(opt, proto::REP_INFO, &bs)?;
        if reqs.contains(&proto::INFO_NAME) {
            let mut p = proto::INFO_NAME.to_be_bytes().to_vec();
            p.extend_from_slice(canonical.as_bytes());
            self.reply(opt, proto::REP_INFO, &p)?;
        }
        if let Some(d) = description.filter(|_| reqs.contains(&proto::INFO_DESCRIPTION)) {
            let mut p = proto::INFO_DESCRIPTION.to_be_bytes().to_vec();
            p.extend_from_slice(d.as_bytes());
            self.reply(opt, proto::REP_INFO, &p)?;
        }
        if opt == proto::OPT_GO {
            self.enter_transmission()?;
        }
        self.reply(opt, proto::REP_ACK, &[])?;
        Ok((opt == proto::OPT_GO).then_some(neg))
    }

    fn meta_context(&mut self, opt: u32, data: &[u8]) -> Result<(), End> {
        let set = opt == proto::OPT_SET_META_CONTEXT;
        if set {
            // Replaces the previous selection even when this request fails.
            self.meta = None;
        }
        let mut c = Cursor::new(data);
        let parsed = (|| {
            let name = c.string32()?;
            let n = c.u32()?;
            let mut queries = Vec::new();
            for _ in 0..n {
                queries.push(c.string32()?);
            }
            (c.remaining() == 0).then_some((name, queries))
        })();
        let Some((name, queries)) = parsed else {
            self.error(opt, proto::REP_ERR_INVALID, "malformed request")?;
            return Ok(());
        };
        if !self.structured {
            self.error(
                opt,
                proto::REP_ERR_INVALID,
                "structured replies not negotiated",
            )?;
            return Ok(());
        }
        if self.inner.find_export(name).is_none() {
            let msg = format!("export {name:?} not found");
            self.error(opt, proto::REP_ERR_UNKNOWN, &msg)?;
            return Ok(());
        }
        let matches = if set {
            queries.contains(&proto::META_BASE_ALLOCATION)
        } else {
            queries.is_empty()
                || queries
                    .iter()
                    .any(|q| *q == "base:" || *q == proto::META_BASE_ALLOCATION)
        };
        let name = name.to_string();
        if matches {
            let id = if set { META_ID_BASE_ALLOCATION } else { 0 };
            let mut p = id.to_be_bytes().to_vec();
            p.extend_from_slice(proto::META_BASE_ALLOCATION.as_bytes());
            self.reply(opt, proto::REP_META_CONTEXT, &p)?;
        }
        if set {
            self.meta = Some((name, matches));
        }
        self.reply(opt, proto::REP_ACK, &[])?;
        Ok(())
    }
}

/// Logs how a handshake ended.
pub(super) fn log_end(id: u64, peer: &str, end: &End) {
    match end {
        End::Closed => debug!("nbd: connection {id} ({peer}) closed during handshake"),
        End::Error(m) => warn!("nbd: connection {id} ({peer}) handshake ended: {m}"),
    }
}
