//! Block traces: one record type, a streaming reader and a writer per format.
//!
//! This module owns the on-disk trace formats (SNIA MSR Cambridge CSV, FIU
//! with content digests, blkparse text, fio iolog v2/v3), their detection,
//! decompression (.gz, .zst) and the common [`TraceRecord`]. Each format's
//! exact rules are documented in its submodule ([`msr`], [`fiu`],
//! [`blkparse`], [`fio`]).
//!
//! It must not interpret a workload (no caching, no statistics) and must never
//! hold a whole trace in memory: readers reuse one line buffer, lines are
//! capped at [`MAX_LINE_BYTES`], and per-trace tables (host names, fio file
//! names) grow only with the number of distinct disks. A bad line yields a
//! [`TraceError::Line`] naming the line number and the reason, never a panic;
//! the reader can be polled again to continue with the next line.
//!
//! Times are a unit conversion of what the trace holds, never rebased: see
//! [`TraceRecord::time_ns`]; [`rebase_time`] makes them relative to the first
//! record.

pub mod blkparse;
pub mod fio;
pub mod fiu;
pub mod fuzzing;
mod line;
pub mod msr;

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Cursor, Read, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use line::{LineParser, LineReader, MAX_LINE_BYTES, Records};

/// Size of one content-addressed block: FIU digests and [`TraceRecord::content`]
/// are per 4 KiB.
pub const CONTENT_BLOCK: u64 = 4096;
/// A sector as blkparse and FIU count them.
pub const SECTOR: u64 = 512;

/// A content digest of one 4 KiB block (an MD5 in FIU traces).
pub type ContentHash = [u8; 16];

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Read,
    Write,
    /// TRIM / discard / unmap of `offset..offset+len`.
    Discard,
    /// A cache flush (fsync, preflush). `offset` and `len` are 0.
    Flush,
}

impl Op {
    /// Lower-case name, as used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Discard => "discard",
            Op::Flush => "flush",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One request of a block trace, whatever format it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// Issue time in nanoseconds, converted from the trace's own clock without
    /// rebasing: MSR = Windows filetime x 100 (ns since 1601-01-01 UTC); FIU =
    /// the `ts` field as is; blkparse = seconds.nanoseconds since the start of
    /// tracing; fio v3 = microseconds since the log started x 1000; fio v2 =
    /// the sum of the `wait` lines seen so far x 1000.
    pub time_ns: u64,
    /// Which disk of the trace: MSR = host index << 16 | DiskNumber (host index
    /// by order of first appearance, so one-host traces give DiskNumber);
    /// FIU and blkparse = major << 20 | minor; fio = index of the file in `add`
    /// order.
    pub disk: u32,
    pub op: Op,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Length in bytes (may be 0 in MSR traces; always 0 for [`Op::Flush`]).
    pub len: u64,
    /// Content digests, one per 4 KiB chunk of the request (chunk i covers
    /// `offset + 4096 i .. offset + 4096 (i + 1)`, the last one possibly
    /// shorter), when the trace carries them (FIU). `content.len()` is
    /// `len.div_ceil(4096)`. For 4 KiB-aligned requests, the usual case,
    /// chunk i is the 4 KiB block `offset / 4096 + i`.
    pub content: Option<Vec<ContentHash>>,
}

impl TraceRecord {
    /// A record without content digests.
    pub fn new(time_ns: u64, disk: u32, op: Op, offset: u64, len: u64) -> Self {
        TraceRecord {
            time_ns,
            disk,
            op,
            offset,
            len,
            content: None,
        }
    }

    /// End offset (exclusive). Readers guarantee it does not overflow.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }

    /// Indexes of the `block`-sized blocks the request touches (empty for a
    /// zero-length request). `block` must be non-zero.
    pub fn blocks(&self, block: u64) -> std::ops::Range<u64> {
        let block = block.max(1);
        if self.len == 0 {
            return 0..0;
        }
        (self.offset / block)..self.end().div_ceil(block)
    }
}

/// Split a record into records of one 4 KiB chunk each (the last may be
/// shorter), chunk i covering `offset + 4096 i ..`, each with its own digest.
/// This is the shape FIU traces have (one line per 4 KiB) and what
/// [`fiu::FiuWriter`] writes by default. Flushes and zero-length records are
/// returned unchanged.
pub fn split_record(rec: &TraceRecord) -> Vec<TraceRecord> {
    if rec.len == 0 || rec.op == Op::Flush {
        return vec![rec.clone()];
    }
    let chunks = rec.len.div_ceil(CONTENT_BLOCK);
    (0..chunks)
        .map(|i| {
            let start = i * CONTENT_BLOCK;
            TraceRecord {
                time_ns: rec.time_ns,
                disk: rec.disk,
                op: rec.op,
                offset: rec.offset + start,
                len: (rec.len - start).min(CONTENT_BLOCK),
                content: rec
                    .content
                    .as_ref()
                    .and_then(|c| c.get(i as usize).map(|h| vec![*h])),
            }
        })
        .collect()
}

/// Which blkparse action a reader turns into records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum BlkAction {
    /// `Q`: the request as the submitter queued it, before merging. Default.
    #[default]
    Queue,
    /// `D`: the request as issued to the driver, after merging and splitting.
    Issue,
    /// `C`: completions (what `blkparse -a complete` keeps).
    Complete,
}

impl BlkAction {
    /// The action letter in blkparse output.
    pub fn letter(self) -> u8 {
        match self {
            BlkAction::Queue => b'Q',
            BlkAction::Issue => b'D',
            BlkAction::Complete => b'C',
        }
    }
}

/// A trace format, as named on a command line.
///
/// `FromStr` accepts (case-insensitively) `msr`, `fiu`, `fio`, `blkparse`
/// (= `blkparse:q`), `blkparse:q`, `blkparse:d`, `blkparse:c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Msr,
    Fiu,
    Blkparse(BlkAction),
    /// fio iolog; the version (2 or 3) is read from the header line.
    Fio,
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "msr" => Ok(Format::Msr),
            "fiu" => Ok(Format::Fiu),
            "fio" => Ok(Format::Fio),
            "blkparse" | "blkparse:q" => Ok(Format::Blkparse(BlkAction::Queue)),
            "blkparse:d" => Ok(Format::Blkparse(BlkAction::Issue)),
            "blkparse:c" => Ok(Format::Blkparse(BlkAction::Complete)),
            _ => Err(format!(
                "unknown trace format '{s}' (expected msr, fiu, blkparse, blkparse:q, blkparse:d, blkparse:c or fio)"
            )),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Msr => "msr",
            Format::Fiu => "fiu",
            Format::Fio => "fio",
            Format::Blkparse(BlkAction::Queue) => "blkparse",
            Format::Blkparse(BlkAction::Issue) => "blkparse:d",
            Format::Blkparse(BlkAction::Complete) => "blkparse:c",
        })
    }
}

/// What is wrong with one line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LineProblem {
    #[error("expected {expected} fields, found {found}")]
    FieldCount {
        expected: &'static str,
        found: usize,
    },
    #[error("field {index} ({name}) is not a number: '{value}'")]
    NotANumber {
        index: usize,
        name: &'static str,
        value: String,
    },
    #[error("field {index} ({name}) {reason}: '{value}'")]
    BadField {
        index: usize,
        name: &'static str,
        reason: String,
        value: String,
    },
    #[error("line is longer than {max} bytes")]
    TooLong { max: usize },
    #[error("{0}")]
    Other(String),
}

/// Errors from opening or reading a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{}: {source}", path.display())]
    Open { path: PathBuf, source: io::Error },
    #[error("line {line}: read error: {source}")]
    Io { line: u64, source: io::Error },
    #[error("line {line}: {problem}")]
    Line { line: u64, problem: LineProblem },
    #[error("cannot tell the trace format: {0}")]
    UnknownFormat(String),
    #[error("compressed input: {0}")]
    Compression(String),
    /// The trace parsed but cannot be used as asked (for example a blkparse
    /// trace without any event of the selected action).
    #[error("{0}")]
    Unusable(String),
}

impl TraceError {
    /// The 1-based line number the error refers to, if any.
    pub fn line(&self) -> Option<u64> {
        match self {
            TraceError::Io { line, .. } | TraceError::Line { line, .. } => Some(*line),
            _ => None,
        }
    }
}

/// Errors from writing a trace.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("write error: {0}")]
    Io(#[from] io::Error),
    /// The record cannot be expressed in the format at all (as opposed to an
    /// op the format lacks, which is skipped and reported by `write_record`).
    #[error("record cannot be written as {format}: {reason}")]
    Unrepresentable {
        format: &'static str,
        reason: String,
    },
}

/// A streaming trace writer.
pub trait TraceWrite {
    /// Write one record. Returns `Ok(false)` when the format has no way to
    /// express the record's op (for example a discard in an MSR trace) and the
    /// record was skipped; `Ok(true)` when it was written.
    fn write_record(&mut self, rec: &TraceRecord) -> Result<bool, WriteError>;
    /// Write any trailer and flush. Call once at the end.
    fn finish(&mut self) -> Result<(), WriteError>;
}

/// Which fio iolog version to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FioVersion {
    V2,
    #[default]
    V3,
}

/// Options for [`new_writer`]; each applies to the formats named.
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// MSR: host name of host index 0 (host index h > 0 is written as
    /// `{hostname}{h}`).
    pub hostname: String,
    /// FIU: one line per 4 KiB block (the shape of the FIU traces). When
    /// false, one line per request with one digest per block.
    pub fiu_split_blocks: bool,
    /// FIU and blkparse: process name written on each line.
    pub process: String,
    /// FIU and blkparse: pid written on each line.
    pub pid: u32,
    /// blkparse: also write a `D` and a `C` line (same timestamp) after each
    /// `Q` line, so the trace reads the same with any [`BlkAction`].
    pub blkparse_lifecycle: bool,
    /// fio: iolog version.
    pub fio_version: FioVersion,
    /// fio: files `0..fio_disks` are added and opened up front, so that disk
    /// ids survive a round trip; disks beyond are added when first used.
    pub fio_disks: u32,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            hostname: "vdgen".to_string(),
            fiu_split_blocks: true,
            process: "vdgen".to_string(),
            pid: 4242,
            blkparse_lifecycle: false,
            fio_version: FioVersion::V3,
            fio_disks: 1,
        }
    }
}

/// A writer for `format`. The blkparse action in `format` is ignored (see
/// [`WriterOptions::blkparse_lifecycle`]). Wrap `out` in a `BufWriter`.
pub fn new_writer<'a, W: Write + 'a>(
    format: Format,
    out: W,
    opts: &WriterOptions,
) -> Box<dyn TraceWrite + 'a> {
    match format {
        Format::Msr => Box::new(msr::MsrWriter::new(out, &opts.hostname)),
        Format::Fiu => Box::new(fiu::FiuWriter::new(out, opts)),
        Format::Blkparse(_) => Box::new(blkparse::BlkparseWriter::new(out, opts)),
        Format::Fio => Box::new(fio::FioWriter::new(out, opts.fio_version, opts.fio_disks)),
    }
}

/// Compression of a trace file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// An open trace: an iterator of records in file order.
pub struct TraceReader {
    format: Format,
    inner: Box<dyn Records>,
}

impl TraceReader {
    /// The format being read (detected or given).
    pub fn format(&self) -> Format {
        self.format
    }

    /// 1-based number of the line the record last returned came from.
    pub fn line(&self) -> u64 {
        self.inner.line()
    }
}

impl Iterator for TraceReader {
    type Item = Result<TraceRecord, TraceError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.inner.next()
    }
}

impl fmt::Debug for TraceReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceReader")
            .field("format", &self.format)
            .finish()
    }
}

/// Open a trace file, decompressing and detecting the format as needed.
///
/// Compression: the first bytes decide (gzip `1f 8b`, zstd `28 b5 2f fd`); a
/// `.gz` or `.zst` extension on a file without that magic is an error rather
/// than a silent misread. Concatenated gzip members and zstd frames are read
/// through.
///
/// Format, when `format` is `None`: see [`detect_format`].
pub fn open_trace(path: &Path, format: Option<Format>) -> Result<TraceReader, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let declared = match path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
    {
        Some(e) if e == "gz" || e == "gzip" => Some(Compression::Gzip),
        Some(e) if e == "zst" || e == "zstd" => Some(Compression::Zstd),
        _ => None,
    };
    let buffered = decompress(BufReader::with_capacity(1 << 16, file), declared)?;
    read_trace(buffered, format)
}

/// Wrap `input` in the decompressor its magic bytes call for. `declared` is
/// what the file name says; a mismatch with the magic is an error.
pub fn decompress<R: BufRead + Send + 'static>(
    mut input: R,
    declared: Option<Compression>,
) -> Result<Box<dyn BufRead + Send>, TraceError> {
    let head = fill_at_least(&mut input, 4)
        .map_err(|e| TraceError::Compression(format!("cannot read the first bytes: {e}")))?;
    let found = if head.starts_with(&GZIP_MAGIC) {
        Compression::Gzip
    } else if head.starts_with(&ZSTD_MAGIC) {
        Compression::Zstd
    } else {
        Compression::None
    };
    if let Some(d) = declared
        && d != found
    {
        return Err(TraceError::Compression(format!(
            "the file name says {d:?} but the content starts with {:02x?}",
            &head[..head.len().min(4)]
        )));
    }
    Ok(match found {
        Compression::None => Box::new(input),
        Compression::Gzip => Box::new(BufReader::with_capacity(
            1 << 16,
            flate2::bufread::MultiGzDecoder::new(input),
        )),
        Compression::Zstd => {
            let dec = zstd::stream::read::Decoder::with_buffer(input)
                .map_err(|e| TraceError::Compression(format!("zstd: {e}")))?;
            Box::new(BufReader::with_capacity(1 << 16, dec))
        }
    })
}

/// Peek at least `n` bytes (fewer only at end of input) without consuming.
fn fill_at_least<R: BufRead>(input: &mut R, n: usize) -> io::Result<Vec<u8>> {
    // A BufReader fills its whole buffer on the first call, so one call is
    // enough in practice; a reader that returns less still works, it only
    // makes detection see fewer bytes.
    let buf = input.fill_buf()?;
    Ok(buf[..buf.len().min(n)].to_vec())
}

/// Read a trace from already decompressed text.
pub fn read_trace(
    mut input: Box<dyn BufRead + Send>,
    format: Option<Format>,
) -> Result<TraceReader, TraceError> {
    let format = match format {
        Some(f) => f,
        None => {
            let (prefix, fmt) = sniff(&mut input)?;
            let chained: Box<dyn BufRead + Send> = Box::new(Cursor::new(prefix).chain(input));
            input = chained;
            fmt
        }
    };
    let inner: Box<dyn Records> = match format {
        Format::Msr => Box::new(msr::MsrReader::new(input)),
        Format::Fiu => Box::new(fiu::FiuReader::new(input)),
        Format::Blkparse(a) => Box::new(blkparse::BlkparseReader::new(input, a)),
        Format::Fio => Box::new(fio::FioReader::new(input)),
    };
    Ok(TraceReader { format, inner })
}

/// How many leading lines detection may look at before giving up.
const SNIFF_MAX_LINES: usize = 64;

/// Read lines until the first one that is not blank, and detect the format from it. Returns the bytes consumed (to be replayed)
/// and the format.
fn sniff(input: &mut Box<dyn BufRead + Send>) -> Result<(Vec<u8>, Format), TraceError> {
    let mut consumed = Vec::new();
    for line_no in 1..=SNIFF_MAX_LINES {
        let start = consumed.len();
        let n = input
            .by_ref()
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut consumed)
            .map_err(|source| TraceError::Io {
                line: line_no as u64,
                source,
            })?;
        if n == 0 {
            return Err(TraceError::UnknownFormat(
                "the trace has no data lines".to_string(),
            ));
        }
        let line = &consumed[start..];
        let text = line.trim_ascii();
        if text.is_empty() {
            continue;
        }
        return match detect_format(text) {
            Some(f) => Ok((consumed, f)),
            None => Err(TraceError::UnknownFormat(format!(
                "line {line_no} matches no known format: '{}'",
                excerpt(text)
            ))),
        };
    }
    Err(TraceError::UnknownFormat(format!(
        "no data line in the first {SNIFF_MAX_LINES} lines"
    )))
}

/// Detect the format from the first non-blank line, in this order:
///
/// 1. starts with `fio version ` -> fio;
/// 2. contains a comma and splits into exactly 7 comma-separated fields, or
///    starts with `Timestamp,` (a header) -> MSR;
/// 3. the first whitespace-separated token is `MAJOR,MINOR` (digits) and
///    there are at least 6 tokens -> blkparse, action `Q`;
/// 4. at least 8 tokens, tokens 1, 2, 4, 5, 7, 8 are decimal numbers and
///    token 6 is `R` or `W` (any case) -> FIU.
///
/// Anything else is not detected (give the format explicitly).
pub fn detect_format(line: &[u8]) -> Option<Format> {
    let line = line.trim_ascii();
    if line.starts_with(b"fio version ") {
        return Some(Format::Fio);
    }
    if line.len() >= 10 && line[..10].eq_ignore_ascii_case(b"timestamp,") {
        return Some(Format::Msr);
    }
    if line.contains(&b',') && line.split(|&b| b == b',').count() == 7 {
        return Some(Format::Msr);
    }
    let toks: Vec<&[u8]> = line
        .split(|b| b.is_ascii_whitespace())
        .filter(|t| !t.is_empty())
        .take(9)
        .collect();
    if toks.len() >= 6
        && let Some((a, b)) = split_once(toks[0], b',')
        && is_digits(a)
        && is_digits(b)
    {
        return Some(Format::Blkparse(BlkAction::Queue));
    }
    if toks.len() >= 8
        && [0, 1, 3, 4, 6, 7].iter().all(|&i| is_digits(toks[i]))
        && (toks[5].eq_ignore_ascii_case(b"R") || toks[5].eq_ignore_ascii_case(b"W"))
    {
        return Some(Format::Fiu);
    }
    None
}

/// Make record times relative to the first record's (records earlier than the
/// first, which some traces have, get 0).
pub fn rebase_time<I>(records: I) -> impl Iterator<Item = Result<TraceRecord, TraceError>>
where
    I: Iterator<Item = Result<TraceRecord, TraceError>>,
{
    let mut origin: Option<u64> = None;
    records.map(move |r| {
        r.map(|mut rec| {
            let o = *origin.get_or_insert(rec.time_ns);
            rec.time_ns = rec.time_ns.saturating_sub(o);
            rec
        })
    })
}

// ---------------------------------------------------------------------------
// Small parsing helpers shared by the format modules.

pub(crate) fn is_digits(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(u8::is_ascii_digit)
}

pub(crate) fn split_once(s: &[u8], sep: u8) -> Option<(&[u8], &[u8])> {
    let i = s.iter().position(|&b| b == sep)?;
    Some((&s[..i], &s[i + 1..]))
}

/// Parse a decimal u64 (digits only, no sign, no spaces), None on overflow.
pub(crate) fn parse_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    let mut v: u64 = 0;
    for &b in s {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(d))?;
    }
    Some(v)
}

/// A printable, bounded excerpt of a field for error messages.
pub(crate) fn excerpt(s: &[u8]) -> String {
    const MAX: usize = 64;
    let cut = &s[..s.len().min(MAX)];
    let mut t = String::from_utf8_lossy(cut).into_owned();
    if s.len() > MAX {
        t.push_str("...");
    }
    t
}

/// Parse field `index` (1-based) as a number or explain why not.
pub(crate) fn num_field(s: &[u8], index: usize, name: &'static str) -> Result<u64, LineProblem> {
    parse_u64(s).ok_or_else(|| {
        if is_digits(s) {
            LineProblem::BadField {
                index,
                name,
                reason: "is too large".to_string(),
                value: excerpt(s),
            }
        } else {
            LineProblem::NotANumber {
                index,
                name,
                value: excerpt(s),
            }
        }
    })
}

pub(crate) fn bad(
    index: usize,
    name: &'static str,
    reason: impl Into<String>,
    value: &[u8],
) -> LineProblem {
    LineProblem::BadField {
        index,
        name,
        reason: reason.into(),
        value: excerpt(value),
    }
}

/// Append the decimal form of `v` to `out` (faster than `write!`).
pub(crate) fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[i..]);
}

pub(crate) fn push_hex(out: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(HEX[usize::from(b >> 4)]);
        out.push(HEX[usize::from(b & 15)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_from_str_round_trips() {
        for s in ["msr", "fiu", "fio", "blkparse", "blkparse:d", "blkparse:c"] {
            let f: Format = s.parse().expect("known format");
            assert_eq!(f.to_string(), s);
        }
        assert_eq!(
            "BLKPARSE:Q".parse::<Format>(),
            Ok(Format::Blkparse(BlkAction::Queue))
        );
        assert!("csv".parse::<Format>().is_err());
    }

    #[test]
    fn detection_rules() {
        assert_eq!(detect_format(b"fio version 3 iolog"), Some(Format::Fio));
        assert_eq!(
            detect_format(b"128166372003061629,hm,1,Read,3230752768,4096,12739"),
            Some(Format::Msr)
        );
        assert_eq!(
            detect_format(b"Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime"),
            Some(Format::Msr)
        );
        assert_eq!(
            detect_format(
                b"  8,0    3        1     0.000000000   697  Q  WS 1234 + 8 [jbd2/sda1-8]"
            ),
            Some(Format::Blkparse(BlkAction::Queue))
        );
        assert_eq!(
            detect_format(
                b"89968195792462 20782 gzip 283193184 8 R 6 0 56f11b711d91a065a2b6458eca924523"
            ),
            Some(Format::Fiu)
        );
        assert_eq!(detect_format(b"hello world"), None);
    }

    #[test]
    fn parse_u64_edges() {
        assert_eq!(parse_u64(b"0"), Some(0));
        assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_u64(b"18446744073709551616"), None);
        assert_eq!(parse_u64(b""), None);
        assert_eq!(parse_u64(b"-1"), None);
        assert_eq!(parse_u64(b"1x"), None);
        let mut v = Vec::new();
        push_u64(&mut v, 0);
        v.push(b' ');
        push_u64(&mut v, u64::MAX);
        assert_eq!(v, b"0 18446744073709551615");
    }

    #[test]
    fn split_record_gives_one_digest_per_block() {
        let mut rec = TraceRecord::new(5, 1, Op::Write, 4096, 3 * 4096);
        rec.content = Some(vec![[1; 16], [2; 16], [3; 16]]);
        let parts = split_record(&rec);
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[1].offset, 8192);
        assert_eq!(parts[1].len, 4096);
        assert_eq!(parts[2].content, Some(vec![[3; 16]]));
        let unaligned = TraceRecord::new(0, 0, Op::Read, 1024, 5000);
        let parts = split_record(&unaligned);
        assert_eq!(
            parts.iter().map(|r| (r.offset, r.len)).collect::<Vec<_>>(),
            vec![(1024, 4096), (5120, 904)]
        );
    }

    #[test]
    fn rebase_makes_times_relative() {
        let recs = vec![
            Ok(TraceRecord::new(1000, 0, Op::Read, 0, 512)),
            Ok(TraceRecord::new(900, 0, Op::Read, 0, 512)),
            Ok(TraceRecord::new(1500, 0, Op::Read, 0, 512)),
        ];
        let times: Vec<u64> = rebase_time(recs.into_iter())
            .map(|r| r.map(|r| r.time_ns).unwrap_or(u64::MAX))
            .collect();
        assert_eq!(times, vec![0, 0, 500]);
    }

    #[test]
    fn garbage_never_panics() {
        use crate::workload::Rng;
        use rand::{RngExt, SeedableRng};
        const TOKENS: &[&str] = &[
            "8,0",
            "0",
            "1",
            "4096",
            "18446744073709551615",
            "99999999999999999999",
            "Q",
            "D",
            "C",
            "FWS",
            "F",
            "R",
            "W",
            "D",
            "N",
            "+",
            "[p]",
            "[0]",
            "[-5]",
            "(12)",
            "0.000001",
            "1.",
            ".5",
            "Read",
            "Write",
            ",",
            ",,",
            "a,b,c",
            "fio version 2 iolog",
            "fio version 3 iolog",
            "/f",
            "add",
            "open",
            "write",
            "trim",
            "wait",
            "sync",
            "00112233445566778899aabbccddeeff",
            "0011-",
            "-",
            "\t",
            "\u{0}",
            "\u{e9}",
            "CPU0",
            "Total (x):",
        ];
        let mut rng = Rng::seed_from_u64(99);
        for round in 0..300 {
            let mut text = String::new();
            if round % 3 == 0 {
                text.push_str("fio version 3 iolog\n0 /f add\n");
            }
            for _ in 0..20 {
                let n = rng.random_range(0..12);
                let sep = if rng.random_bool(0.3) { "," } else { " " };
                let line: Vec<&str> = (0..n)
                    .map(|_| TOKENS[rng.random_range(0..TOKENS.len())])
                    .collect();
                text.push_str(&line.join(sep));
                text.push('\n');
            }
            for f in ["msr", "fiu", "blkparse", "blkparse:d", "blkparse:c", "fio"] {
                let fmt: Format = f.parse().expect("known");
                let input: Box<dyn BufRead + Send> =
                    Box::new(Cursor::new(text.clone().into_bytes()));
                let reader = read_trace(input, Some(fmt)).expect("opens");
                for rec in reader.take(1000).flatten() {
                    assert!(rec.offset.checked_add(rec.len).is_some());
                }
            }
            let input: Box<dyn BufRead + Send> = Box::new(Cursor::new(text.into_bytes()));
            if let Ok(reader) = read_trace(input, None) {
                let _ = reader.take(1000).count();
            }
        }
    }
}
