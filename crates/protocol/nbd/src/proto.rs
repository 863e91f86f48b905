//! Wire constants and fixed-size encodings of the NBD protocol (fixed newstyle
//! handshake, simple and structured replies, `base:allocation`).
//!
//! Owns: magic numbers, option/reply/command/flag values, errno values and
//! their names, and encode/decode of the fixed-size headers.
//! Must not: do I/O, allocate per byte of payload, or trust any length it
//! decodes (callers validate lengths against their own limits).

/// `NBDMAGIC`, first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle magic, also the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Oldstyle `cliserv_magic` (only recognised to reject oldstyle servers).
pub const CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Magic of every fixed newstyle option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_BIT: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR_BIT | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR_BIT | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR_BIT | 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR_BIT | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR_BIT | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR_BIT | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR_BIT | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR_BIT | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR_BIT | 9;

// Info types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

// base:allocation state flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context this crate implements.
pub const META_BASE_ALLOCATION: &str = "base:allocation";

// Error values.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Longest string (export name, description, error message) the protocol allows.
pub const MAX_STRING: usize = 4096;

/// Size of a request header on the wire.
pub const REQUEST_LEN: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Size of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;

/// Name of an NBD error value, e.g. `"EIO"`; unknown values give `"E?"`.
pub fn errno_name(code: u32) -> &'static str {
    match code {
        0 => "OK",
        EPERM => "EPERM",
        EIO => "EIO",
        ENOMEM => "ENOMEM",
        EINVAL => "EINVAL",
        ENOSPC => "ENOSPC",
        EOVERFLOW => "EOVERFLOW",
        ENOTSUP => "ENOTSUP",
        ESHUTDOWN => "ESHUTDOWN",
        _ => "E?",
    }
}

/// Name of an option, e.g. `"NBD_OPT_GO"`.
pub fn option_name(opt: u32) -> &'static str {
    match opt {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        _ => "NBD_OPT_?",
    }
}

/// Name of an option reply type, e.g. `"NBD_REP_ERR_UNKNOWN"`.
pub fn reply_name(rep: u32) -> &'static str {
    match rep {
        REP_ACK => "NBD_REP_ACK",
        REP_SERVER => "NBD_REP_SERVER",
        REP_INFO => "NBD_REP_INFO",
        REP_META_CONTEXT => "NBD_REP_META_CONTEXT",
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        _ => "NBD_REP_?",
    }
}

/// A decoded transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    /// Encodes the 28-byte request header.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Decodes a request header; `None` when the magic is wrong.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Option<Request> {
        if be32(&b[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(Request {
            flags: be16(&b[4..6]),
            kind: be16(&b[6..8]),
            cookie: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            length: be32(&b[24..28]),
        })
    }
}

/// Encodes a simple reply header.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Encodes a structured reply chunk header.
pub fn chunk_header(cookie: u64, flags: u16, kind: u16, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Encodes an option reply header (fixed newstyle).
pub fn option_reply_header(opt: u32, reply: u32, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..8].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&opt.to_be_bytes());
    b[12..16].copy_from_slice(&reply.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Big-endian u16 from the first two bytes; callers pass exact slices.
pub fn be16(b: &[u8]) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[..2]);
    u16::from_be_bytes(a)
}

/// Big-endian u32 from the first four bytes.
pub fn be32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_be_bytes(a)
}

/// Big-endian u64 from the first eight bytes.
pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// A cursor over untrusted option data: every read is bounds-checked.
pub struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Cursor { data, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.remaining() < n {
            return None;
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Some(s)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(be16)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.bytes(4).map(be32)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.bytes(8).map(be64)
    }

    /// A length-prefixed (u32) string of at most [`MAX_STRING`] bytes, valid UTF-8.
    pub fn string32(&mut self) -> Option<&'a str> {
        let len = self.u32()? as usize;
        if len > MAX_STRING {
            return None;
        }
        std::str::from_utf8(self.bytes(len)?).ok()
    }

    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.data[self.pos..];
        self.pos = self.data.len();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip_and_bad_magic() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            cookie: 0x1122_3344_5566_7788,
            offset: 1 << 40,
            length: 4096,
        };
        let b = r.encode();
        assert_eq!(Request::decode(&b), Some(r));
        let mut bad = b;
        bad[0] ^= 1;
        assert_eq!(Request::decode(&bad), None);
    }

    #[test]
    fn cursor_never_reads_past_end() {
        let data = [0u8, 0, 0, 9, b'a'];
        let mut c = Cursor::new(&data);
        assert_eq!(c.string32(), None);
        let mut c = Cursor::new(&data[..3]);
        assert_eq!(c.u32(), None);
        let data = [0u8, 0, 0, 1, b'a', 7];
        let mut c = Cursor::new(&data);
        assert_eq!(c.string32(), Some("a"));
        assert_eq!(c.remaining(), 1);
        assert_eq!(c.u16(), None);
    }

    #[test]
    fn names() {
        assert_eq!(errno_name(EIO), "EIO");
        assert_eq!(reply_name(REP_ERR_UNKNOWN), "NBD_REP_ERR_UNKNOWN");
        assert_eq!(option_name(OPT_GO), "NBD_OPT_GO");
    }
}
