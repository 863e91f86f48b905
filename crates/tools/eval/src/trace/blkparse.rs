//! blkparse default text output (blktrace's formatter).
//!
//! Owns the blkparse text parser and writer; must not keep anything across
//! lines beyond a few counters, and must not accept an event line it cannot
//! fully parse. The rules below are the contract.
//!
//! Format, as blkparse(1) ("DEFAULT OUTPUT") and blktrace's `blkparse_fmt.c`
//! define it: every event line starts with the header
//! `%D %2c %8s %5T.%9t %5p %2a %3d`, that is
//!
//! `MAJOR,MINOR CPU SEQUENCE SECONDS.NANOSECONDS PID ACTION RWBS`
//!
//! followed, for the Q (queue), D (issue) and C (complete) actions, by
//! `SECTOR + NSECTORS [PROCESS]` (Q, D) or `SECTOR + NSECTORS [ERROR]` (C);
//! an event without sectors (a pure flush) prints only `[PROCESS]` or
//! `[ERROR]`.
//!
//! Rules this reader applies:
//!
//! - A line whose first token is `MAJOR,MINOR` (decimal, major <= 4095,
//!   minor <= 1048575) is an event; its CPU, sequence and PID must be decimal
//!   and its time `SECONDS.FRACTION` with 1 to 9 fraction digits. Record time
//!   = that time in ns, disk = major << 20 | minor.
//! - Only events of one action become records: `Q` by default, or `D` or `C`
//!   ([`BlkAction`]). Q is the request as submitted (before merges), the
//!   closest to what a guest asked for. Other actions (G, I, M, P, U, A, X,
//!   m ...) are checked for a valid header and skipped.
//! - RWBS: an optional leading `F` (preflush) gives an [`Op::Flush`] record;
//!   then one op letter: `R` read, `W` write, `D` discard, `E` (secure erase)
//!   discard, `N` or `Z` (zone management) no data. Further letters (`F`
//!   FUA, `A`, `S`, `M`, ...) are ignored. A preflush with data gives two
//!   records: the flush, then the data op.
//! - Sectors are 512 bytes: offset = SECTOR x 512, len = NSECTORS x 512. An
//!   event with no `+ NSECTORS` has no data.
//! - A C event whose trailing `[ERROR]` is non-zero (a failed I/O) is skipped.
//! - Blank lines and `Input file ...` lines are skipped. The per-CPU summary
//!   blkparse prints at the end (from a line starting with `CPU<n>`,
//!   `Total (`, `Events (`, `Throughput` or `Skips:`) is skipped to the end.
//!   Any other line is an error.
//! - A trace with no event of the selected action but some of another of Q, D,
//!   C ends with [`TraceError::Unusable`] naming the action to use.
//!
//! Not carried: content digests; offsets and lengths must be multiples of 512.
//! The writer writes `Q` lines (and `D`, `C` with
//! [`WriterOptions::blkparse_lifecycle`](super::WriterOptions)), flushes as
//! `FN` with no sectors, CPU 0 and increasing sequence numbers.

use std::io::{BufRead, Write};

use super::line::{LineParser, LineReader};
use super::{
    BlkAction, LineProblem, Op, SECTOR, TraceError, TraceRecord, TraceWrite, WriteError,
    WriterOptions, bad, excerpt, is_digits, num_field, parse_u64, split_once,
};

/// Streaming blkparse reader.
pub type BlkparseReader<R> = LineReader<R, BlkparseLines>;

/// What a blkparse line means for the selected action.
pub struct BlkparseLines {
    action: BlkAction,
    /// The data record of a line that also yielded a flush.
    pending: Option<TraceRecord>,
    in_summary: bool,
    /// Records produced so far.
    emitted: u64,
    /// Data-carrying events seen per action, Q, D, C.
    seen: [u64; 3],
}

enum Parsed {
    Skip,
    One(TraceRecord),
    Two(TraceRecord, TraceRecord),
}

fn parse_time(s: &[u8]) -> Option<u64> {
    let (sec, frac) = split_once(s, b'.')?;
    if !is_digits(sec) || !is_digits(frac) || frac.len() > 9 {
        return None;
    }
    let mut ns = parse_u64(frac)?;
    for _ in frac.len()..9 {
        ns *= 10;
    }
    parse_u64(sec)?.checked_mul(1_000_000_000)?.checked_add(ns)
}

fn is_summary_start(line: &[u8]) -> bool {
    let l = line.trim_ascii_start();
    (l.starts_with(b"CPU") && l.get(3).is_some_and(u8::is_ascii_digit))
        || l.starts_with(b"Total (")
        || l.starts_with(b"Events (")
        || l.starts_with(b"Throughput")
        || l.starts_with(b"Skips:")
}

/// Parse a `[N]` token as an integer error code.
fn bracket_code(t: &[u8]) -> Option<i64> {
    let inner = t.strip_prefix(b"[")?.strip_suffix(b"]")?;
    let (neg, digits) = match inner.strip_prefix(b"-") {
        Some(d) => (true, d),
        None => (false, inner),
    };
    let v = i64::try_from(parse_u64(digits)?).ok()?;
    Some(if neg { -v } else { v })
}

impl<R: BufRead> BlkparseReader<R> {
    pub fn new(input: R, action: BlkAction) -> Self {
        LineReader::with_parser(
            input,
            BlkparseLines {
                action,
                pending: None,
                in_summary: false,
                emitted: 0,
                seen: [0; 3],
            },
        )
    }
}

impl BlkparseLines {
    fn parse(&mut self, line: &[u8]) -> Result<Parsed, LineProblem> {
        let mut t: [&[u8]; 10] = [&[]; 10];
        let mut n = 0;
        for tok in line
            .split(|b| b.is_ascii_whitespace())
            .filter(|t| !t.is_empty())
        {
            if n < t.len() {
                t[n] = tok;
            }
            n += 1;
        }
        let last = line
            .split(|b| b.is_ascii_whitespace())
            .rfind(|t| !t.is_empty())
            .unwrap_or(&[]);
        if n == 0 {
            return Ok(Parsed::Skip);
        }
        let dev = split_once(t[0], b',').filter(|(a, b)| is_digits(a) && is_digits(b));
        let Some((maj, min)) = dev else {
            if self.in_summary || line.trim_ascii_start().starts_with(b"Input file") {
                return Ok(Parsed::Skip);
            }
            if is_summary_start(line) {
                self.in_summary = true;
                return Ok(Parsed::Skip);
            }
            return Err(LineProblem::Other(format!(
                "not a blkparse event line (expected 'MAJOR,MINOR CPU SEQUENCE SECONDS.NANOSECONDS PID ACTION ...'): '{}'",
                excerpt(line.trim_ascii())
            )));
        };
        if self.in_summary {
            // Event lines after a summary (several blkparse runs concatenated).
            self.in_summary = false;
        }
        if n < 6 {
            return Err(LineProblem::FieldCount {
                expected: "at least 6",
                found: n,
            });
        }
        let major = num_field(maj, 1, "device major")?;
        let minor = num_field(min, 1, "device minor")?;
        if major > 0xFFF || minor > 0xF_FFFF {
            return Err(bad(
                1,
                "device",
                "is out of range (major <= 4095, minor <= 1048575)",
                t[0],
            ));
        }
        num_field(t[1], 2, "cpu")?;
        num_field(t[2], 3, "sequence")?;
        let time_ns =
            parse_time(t[3]).ok_or_else(|| bad(4, "time", "is not SECONDS.NANOSECONDS", t[3]))?;
        num_field(t[4], 5, "pid")?;
        let act = t[5];
        let slot = match act {
            b"Q" => Some(0),
            b"D" => Some(1),
            b"C" => Some(2),
            _ => None,
        };
        if act != [self.action.letter()] {
            // Count data events of the other actions for the end-of-trace hint.
            if let Some(i) = slot
                && n >= 9
                && is_digits(t[7])
            {
                self.seen[i] += 1;
            }
            return Ok(Parsed::Skip);
        }
        if n < 7 {
            return Err(LineProblem::FieldCount {
                expected: "at least 7 for this action",
                found: n,
            });
        }
        let rwbs = t[6];
        let (preflush, rest) = if rwbs == b"F" {
            (true, &b"N"[..])
        } else if rwbs.len() >= 2
            && rwbs[0] == b'F'
            && matches!(rwbs[1], b'R' | b'W' | b'D' | b'N' | b'E' | b'Z')
        {
            (true, &rwbs[1..])
        } else {
            (false, rwbs)
        };
        let op = match rest.first() {
            Some(b'R') => Some(Op::Read),
            Some(b'W') => Some(Op::Write),
            Some(b'D') | Some(b'E') => Some(Op::Discard),
            Some(b'N') | Some(b'Z') => None,
            _ => {
                return Err(bad(
                    7,
                    "RWBS",
                    "does not start with F, R, W, D, E, N or Z",
                    rwbs,
                ));
            }
        };
        // Payload: SECTOR + NSECTORS, or nothing.
        let (sector, nsect) = if n >= 8 && is_digits(t[7]) {
            let sector = num_field(t[7], 8, "sector")?;
            if n >= 10 && t[8] == b"+" {
                (sector, num_field(t[9], 10, "sectors")?)
            } else if n == 8 || t[8].starts_with(b"[") || t[8].starts_with(b"(") {
                (sector, 0)
            } else {
                return Err(bad(9, "'+'", "is not '+ NSECTORS'", t[8]));
            }
        } else if n == 7 || t[7].starts_with(b"[") || t[7].starts_with(b"(") {
            (0, 0)
        } else {
            return Err(LineProblem::NotANumber {
                index: 8,
                name: "sector",
                value: excerpt(t[7]),
            });
        };
        if self.action == BlkAction::Complete && bracket_code(last).is_some_and(|c| c != 0) {
            return Ok(Parsed::Skip);
        }
        let offset = sector
            .checked_mul(SECTOR)
            .ok_or_else(|| bad(8, "sector", "is too large", t[7]))?;
        let len = nsect
            .checked_mul(SECTOR)
            .ok_or_else(|| bad(10, "sectors", "is too large", t[9]))?;
        if offset.checked_add(len).is_none() {
            return Err(bad(10, "sectors", "makes sector + sectors overflow", t[9]));
        }
        let disk = ((major as u32) << 20) | minor as u32;
        let flush = preflush.then(|| TraceRecord::new(time_ns, disk, Op::Flush, 0, 0));
        let data = match op {
            Some(op) if len > 0 => Some(TraceRecord::new(time_ns, disk, op, offset, len)),
            _ => None,
        };
        Ok(match (flush, data) {
            (Some(f), Some(d)) => Parsed::Two(f, d),
            (Some(r), None) | (None, Some(r)) => Parsed::One(r),
            (None, None) => Parsed::Skip,
        })
    }

    fn end_hint(&self) -> Option<TraceError> {
        if self.emitted > 0 {
            return None;
        }
        let names = [
            (b'Q', "blkparse:q"),
            (b'D', "blkparse:d"),
            (b'C', "blkparse:c"),
        ];
        let (i, &count) = self.seen.iter().enumerate().max_by_key(|(_, c)| **c)?;
        if count == 0 {
            return None;
        }
        Some(TraceError::Unusable(format!(
            "this blkparse trace has no '{}' events but {count} '{}' events; read it with --format {}",
            self.action.letter() as char,
            names[i].0 as char,
            names[i].1
        )))
    }
}

impl LineParser for BlkparseLines {
    fn parse_line(&mut self, line: &[u8]) -> Result<Option<TraceRecord>, LineProblem> {
        Ok(match self.parse(line)? {
            Parsed::Skip => None,
            Parsed::One(r) => {
                self.emitted += 1;
                Some(r)
            }
            Parsed::Two(a, b) => {
                self.emitted += 2;
                self.pending = Some(b);
                Some(a)
            }
        })
    }

    fn take_pending(&mut self) -> Option<TraceRecord> {
        self.pending.take()
    }

    fn at_end(&mut self) -> Option<TraceError> {
        self.end_hint()
    }
}

/// Streaming blkparse writer.
pub struct BlkparseWriter<W: Write> {
    out: W,
    lifecycle: bool,
    process: String,
    pid: u32,
    seq: u64,
    buf: Vec<u8>,
}

impl<W: Write> BlkparseWriter<W> {
    pub fn new(out: W, opts: &WriterOptions) -> Self {
        let process: String = opts
            .process
            .chars()
            .filter(|c| !c.is_whitespace() && *c != ']')
            .collect();
        BlkparseWriter {
            out,
            lifecycle: opts.blkparse_lifecycle,
            process,
            pid: opts.pid,
            seq: 0,
            buf: Vec::with_capacity(128),
        }
    }

    fn line(&mut self, rec: &TraceRecord, act: char, rwbs: &str) -> std::io::Result<()> {
        use std::io::Write as _;
        self.seq += 1;
        let (sec, ns) = (rec.time_ns / 1_000_000_000, rec.time_ns % 1_000_000_000);
        write!(
            self.buf,
            "{:>3},{:<3} {:>2} {:>8} {:>5}.{:09} {:>5} {:>2} {:>3} ",
            rec.disk >> 20,
            rec.disk & 0xF_FFFF,
            0,
            self.seq,
            sec,
            ns,
            self.pid,
            act,
            rwbs
        )?;
        if rec.len > 0 {
            write!(self.buf, "{} + {} ", rec.offset / SECTOR, rec.len / SECTOR)?;
        }
        if act == 'C' {
            self.buf.extend_from_slice(b"[0]\n");
        } else {
            writeln!(self.buf, "[{}]", self.process)?;
        }
        Ok(())
    }
}

impl<W: Write> TraceWrite for BlkparseWriter<W> {
    fn write_record(&mut self, rec: &TraceRecord) -> Result<bool, WriteError> {
        let rwbs = match rec.op {
            Op::Read => "R",
            Op::Write => "W",
            Op::Discard => "D",
            Op::Flush => "FN",
        };
        if rec.op != Op::Flush {
            if rec.len == 0 {
                return Ok(false);
            }
            if !rec.offset.is_multiple_of(SECTOR) || !rec.len.is_multiple_of(SECTOR) {
                return Err(WriteError::Unrepresentable {
                    format: "blkparse",
                    reason: format!(
                        "offset {} or length {} is not a multiple of 512",
                        rec.offset, rec.len
                    ),
                });
            }
        }
        let mut r = rec.clone();
        if rec.op == Op::Flush {
            r.offset = 0;
            r.len = 0;
        }
        self.buf.clear();
        self.line(&r, 'Q', rwbs)?;
        if self.lifecycle {
            self.line(&r, 'D', rwbs)?;
            self.line(&r, 'C', rwbs)?;
        }
        self.out.write_all(&self.buf)?;
        Ok(true)
    }

    fn finish(&mut self) -> Result<(), WriteError> {
        self.out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
  8,0    3        1     0.000000000   697  A  WS 1051776 + 8 <- (8,1) 1049728
  8,0    3        2     0.000001033   697  Q  WS 1051776 + 8 [jbd2/sda1-8]
  8,0    3        3     0.000004223   697  G  WS 1051776 + 8 [jbd2/sda1-8]
  8,0    3        4     0.000006000   697  P   N [jbd2/sda1-8]
  8,0    3        5     0.000010000   697  I  WS 1051776 + 8 [jbd2/sda1-8]
  8,0    3        6     0.000012000   697  D  WS 1051776 + 8 [jbd2/sda1-8]
  8,0    3        7     0.000300000     0  C  WS 1051776 + 8 [0]
  8,0    1        8     0.100000000   812  Q FWS [kworker/1:1H]
  8,0    1        9     0.200000000   812  Q FWFS 2048 + 16 [kworker/1:1H]
  8,0    1       10     0.300000000   900  Q   D 4096 + 2048 [fstrim]
  8,0    1       11     0.400000000   900  Q   R 0 + 8 [cat]
  8,0    1       12     0.400100000     0  C   R 0 + 8 [-5]
  8,0    1        0     0.500000000     0  m   N cfq workload slice:100
CPU0 (sda):
 Reads Queued:           0,        0KiB\t Writes Queued:           4,       16KiB
Total (sda):
Throughput (R/W): 0KiB/s / 20KiB/s
";

    fn read(text: &str, a: BlkAction) -> Vec<Result<TraceRecord, TraceError>> {
        BlkparseReader::new(text.as_bytes(), a).collect()
    }

    #[test]
    fn queue_events() {
        let recs: Vec<TraceRecord> = read(SAMPLE, BlkAction::Queue)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("valid");
        let disk = 8 << 20;
        assert_eq!(
            recs,
            vec![
                TraceRecord::new(1033, disk, Op::Write, 1051776 * 512, 4096),
                TraceRecord::new(100_000_000, disk, Op::Flush, 0, 0),
                TraceRecord::new(200_000_000, disk, Op::Flush, 0, 0),
                TraceRecord::new(200_000_000, disk, Op::Write, 2048 * 512, 8192),
                TraceRecord::new(300_000_000, disk, Op::Discard, 4096 * 512, 2048 * 512),
                TraceRecord::new(400_000_000, disk, Op::Read, 0, 4096),
            ]
        );
    }

    #[test]
    fn issue_and_complete_events() {
        let d: Vec<TraceRecord> = read(SAMPLE, BlkAction::Issue)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("valid");
        assert_eq!(
            d,
            vec![TraceRecord::new(
                12000,
                8 << 20,
                Op::Write,
                1051776 * 512,
                4096
            )]
        );
        let c: Vec<TraceRecord> = read(SAMPLE, BlkAction::Complete)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("valid");
        assert_eq!(c.len(), 1, "the failed read ([-5]) is skipped");
        assert_eq!(c[0].time_ns, 300_000);
    }

    #[test]
    fn wrong_action_gets_a_hint() {
        let only_c = "  8,0 0 1 0.000000001 0 C W 8 + 8 [0]\n";
        let r = read(only_c, BlkAction::Queue);
        assert_eq!(r.len(), 1);
        assert!(
            r[0].as_ref()
                .is_err_and(|e| e.to_string().contains("--format blkparse:c"))
        );
    }

    #[test]
    fn malformed_lines() {
        let text = "8,0 0 1 0.1 5 Q W 8 + x [p]\n8,0 0 1 zero 5 Q W 8 + 8 [p]\ngarbage here\n8,0 0 1 0.1 5 Q Y 8 + 8 [p]\n8,0 0 1 0.1 5 Q W 8 - 8 [p]\n8,0 0 2 0.2 5 Q R 16 + 8 [p]\n";
        let msgs: Vec<String> = read(text, BlkAction::Queue)
            .iter()
            .map(|r| {
                r.as_ref()
                    .map(|_| "ok".into())
                    .unwrap_or_else(|e| e.to_string())
            })
            .collect();
        assert_eq!(msgs[0], "line 1: field 10 (sectors) is not a number: 'x'");
        assert_eq!(
            msgs[1],
            "line 2: field 4 (time) is not SECONDS.NANOSECONDS: 'zero'"
        );
        assert!(msgs[2].starts_with("line 3: not a blkparse event line"));
        assert_eq!(
            msgs[3],
            "line 4: field 7 (RWBS) does not start with F, R, W, D, E, N or Z: 'Y'"
        );
        assert_eq!(msgs[4], "line 5: field 9 ('+') is not '+ NSECTORS': '-'");
        assert_eq!(msgs[5], "ok");
    }

    #[test]
    fn writer_lifecycle_reads_back_with_any_action() {
        let recs = vec![
            TraceRecord::new(1_500_000_123, 3 << 20 | 7, Op::Write, 4096, 8192),
            TraceRecord::new(1_600_000_000, 3 << 20 | 7, Op::Flush, 0, 0),
            TraceRecord::new(1_700_000_000, 3 << 20 | 7, Op::Discard, 0, 1 << 20),
        ];
        let mut out = Vec::new();
        let opts = WriterOptions {
            blkparse_lifecycle: true,
            ..WriterOptions::default()
        };
        let mut w = BlkparseWriter::new(&mut out, &opts);
        for r in &recs {
            assert!(w.write_record(r).expect("write"));
        }
        w.finish().expect("flush");
        let text = String::from_utf8_lossy(&out).into_owned();
        assert!(
            text.starts_with("  3,7    0        1     1.500000123  4242  Q   W 8 + 16 [vdgen]\n"),
            "{text}"
        );
        for a in [BlkAction::Queue, BlkAction::Issue, BlkAction::Complete] {
            let back: Vec<TraceRecord> = read(&text, a)
                .into_iter()
                .collect::<Result<_, _>>()
                .expect("valid");
            assert_eq!(back, recs, "{a:?}");
        }
    }
}
