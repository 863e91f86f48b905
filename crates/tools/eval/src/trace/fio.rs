//! fio iolog, versions 2 and 3 (fio's `read_iolog` / `write_iolog`).
//!
//! Owns the iolog parser and writer; must not keep anything across lines but
//! the file table and the wait total, and must not accept a line it cannot
//! fully parse. The rules below are the contract.
//!
//! Format, as fio's HOWTO ("Trace file format") and its `iolog.c` define it:
//! the first line is `fio version 2 iolog` or `fio version 3 iolog`; then one
//! action per line, whitespace-separated:
//!
//! - v2: `FILENAME ACTION` for file actions `add`, `open`, `close`, and
//!   `FILENAME ACTION OFFSET LENGTH` for I/O actions `read`, `write`, `trim`,
//!   `sync`, `datasync`, `wait` (offset and length in bytes; for `wait`,
//!   OFFSET is a delay in microseconds, relative to the previous wait).
//! - v3: the same, each line prefixed by a timestamp in microseconds since
//!   the log started (`TIME FILENAME ACTION [OFFSET LENGTH]`); fio ignores
//!   `wait` in v3, and so does this reader.
//!
//! Rules this reader applies:
//!
//! - The first non-blank line must be a v2 or v3 header (trailing text after
//!   `iolog` is tolerated, as fio does); v1 logs are rejected.
//! - `add` gives the file the next disk id (0, 1, ...); adding a file again
//!   is a no-op. `open`, `close` and I/O on a file that was never added are
//!   errors. File names are one token (no spaces), as fio's own parser reads
//!   them.
//! - `read` / `write` -> [`Op::Read`] / [`Op::Write`]; `trim` ->
//!   [`Op::Discard`]; `sync` / `datasync` -> [`Op::Flush`] (OFFSET LENGTH may
//!   be present, and are ignored).
//! - Time: v3 = TIME x 1000 ns; v2 = the sum of all `wait` delays so far x
//!   1000 ns.
//! - Blank lines are skipped; any other unknown action is an error.
//!
//! Not carried: content digests; v2 and v3 keep time at 1 us resolution.
//! The writer adds and opens files `/dev/vdisk<N>` for disks 0..N up front,
//! writes `sync 0 0` for flushes, `wait` lines (v2) when time advances, and
//! `close` lines in `finish`.

use std::collections::HashMap;
use std::io::{BufRead, Write};

use super::line::{LineParser, LineReader};
use super::{
    FioVersion, LineProblem, Op, TraceRecord, TraceWrite, WriteError, bad, excerpt, num_field,
    push_u64,
};

const HEADER_V2: &[u8] = b"fio version 2 iolog";
const HEADER_V3: &[u8] = b"fio version 3 iolog";

/// Streaming fio iolog reader (v2 and v3).
pub type FioReader<R> = LineReader<R, FioLines>;

/// What a fio iolog line means, given the header version, the file table
/// and the wait accumulated so far.
pub struct FioLines {
    version: Option<FioVersion>,
    files: HashMap<Vec<u8>, u32>,
    wait_us: u64,
}

impl<R: BufRead> FioReader<R> {
    pub fn new(input: R) -> Self {
        LineReader::with_parser(
            input,
            FioLines {
                version: None,
                files: HashMap::new(),
                wait_us: 0,
            },
        )
    }

    /// The version from the header, once read.
    pub fn version(&self) -> Option<FioVersion> {
        self.parser().version
    }

    /// File names by disk id.
    pub fn files(&self) -> Vec<String> {
        let mut v: Vec<(u32, String)> = self
            .parser()
            .files
            .iter()
            .map(|(k, &d)| (d, String::from_utf8_lossy(k).into_owned()))
            .collect();
        v.sort();
        v.into_iter().map(|(_, n)| n).collect()
    }
}

impl LineParser for FioLines {
    fn parse_line(&mut self, line: &[u8]) -> Result<Option<TraceRecord>, LineProblem> {
        let line = line.trim_ascii();
        if line.is_empty() {
            return Ok(None);
        }
        let Some(version) = self.version else {
            self.version = Some(if line.starts_with(HEADER_V2) {
                FioVersion::V2
            } else if line.starts_with(HEADER_V3) {
                FioVersion::V3
            } else {
                return Err(LineProblem::Other(format!(
                    "not a fio iolog header (expected 'fio version 2 iolog' or 'fio version 3 iolog'): '{}'",
                    excerpt(line)
                )));
            });
            return Ok(None);
        };
        let mut t: [&[u8]; 5] = [&[]; 5];
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
        let (base, time_ns) = match version {
            FioVersion::V2 => (0, None),
            FioVersion::V3 => {
                let us = num_field(t[0], 1, "time")?;
                (
                    1,
                    Some(
                        us.checked_mul(1000)
                            .ok_or_else(|| bad(1, "time", "is too large", t[0]))?,
                    ),
                )
            }
        };
        let fields = n.saturating_sub(base);
        if fields != 2 && fields != 4 {
            let expected = if base == 0 { "2 or 4" } else { "3 or 5" };
            return Err(LineProblem::FieldCount { expected, found: n });
        }
        let (file, action) = (t[base], t[base + 1]);
        let (fi, ai, oi, li) = (base + 1, base + 2, base + 3, base + 4);
        if action == b"add" {
            if fields != 2 {
                return Err(LineProblem::FieldCount {
                    expected: if base == 0 { "2" } else { "3" },
                    found: n,
                });
            }
            let next = self.files.len() as u32;
            self.files.entry(file.to_vec()).or_insert(next);
            return Ok(None);
        }
        let disk = match self.files.get(file) {
            Some(&d) => d,
            None if action == b"wait" && fields == 4 => 0,
            None => return Err(bad(fi, "filename", "was not added before use", file)),
        };
        if matches!(action, b"open" | b"close") {
            if fields != 2 {
                return Err(LineProblem::FieldCount {
                    expected: if base == 0 { "2" } else { "3" },
                    found: n,
                });
            }
            return Ok(None);
        }
        let (offset, len) = if fields == 4 {
            (
                num_field(t[base + 2], oi, "offset")?,
                num_field(t[base + 3], li, "length")?,
            )
        } else {
            (0, 0)
        };
        let op = match action {
            b"read" => Op::Read,
            b"write" => Op::Write,
            b"trim" => Op::Discard,
            b"sync" | b"datasync" => Op::Flush,
            b"wait" => {
                if fields != 4 {
                    return Err(LineProblem::FieldCount {
                        expected: if base == 0 { "4" } else { "5" },
                        found: n,
                    });
                }
                if version == FioVersion::V2 {
                    self.wait_us = self.wait_us.checked_add(offset).ok_or_else(|| {
                        bad(oi, "offset", "makes the total wait overflow", t[base + 2])
                    })?;
                }
                return Ok(None);
            }
            other => {
                return Err(bad(
                    ai,
                    "action",
                    "is not add, open, close, read, write, trim, sync, datasync or wait",
                    other,
                ));
            }
        };
        if matches!(op, Op::Read | Op::Write | Op::Discard) {
            if fields != 4 {
                return Err(LineProblem::FieldCount {
                    expected: if base == 0 { "4" } else { "5" },
                    found: n,
                });
            }
            if offset.checked_add(len).is_none() {
                return Err(bad(
                    li,
                    "length",
                    "makes offset + length overflow",
                    t[base + 3],
                ));
            }
        }
        let time_ns = match time_ns {
            Some(t) => t,
            None => self
                .wait_us
                .checked_mul(1000)
                .ok_or_else(|| bad(oi, "offset", "makes the total wait overflow", t[base + 2]))?,
        };
        let (offset, len) = if op == Op::Flush {
            (0, 0)
        } else {
            (offset, len)
        };
        Ok(Some(TraceRecord::new(time_ns, disk, op, offset, len)))
    }

    /// Without a valid header nothing after it can be read.
    fn stops_after_error(&self) -> bool {
        self.version.is_none()
    }
}

/// Streaming fio iolog writer.
pub struct FioWriter<W: Write> {
    out: W,
    version: FioVersion,
    files: u32,
    started: bool,
    last_us: u64,
    buf: Vec<u8>,
}

impl<W: Write> FioWriter<W> {
    /// Files for disks `0..disks` are added and opened up front.
    pub fn new(out: W, version: FioVersion, disks: u32) -> Self {
        FioWriter {
            out,
            version,
            files: disks,
            started: false,
            last_us: 0,
            buf: Vec::with_capacity(128),
        }
    }

    fn prefix(&mut self, us: u64) {
        if self.version == FioVersion::V3 {
            push_u64(&mut self.buf, us);
            self.buf.push(b' ');
        }
    }

    fn file_line(&mut self, us: u64, disk: u32, action: &[u8]) {
        self.prefix(us);
        self.buf.extend_from_slice(b"/dev/vdisk");
        push_u64(&mut self.buf, u64::from(disk));
        self.buf.push(b' ');
        self.buf.extend_from_slice(action);
        self.buf.push(b'\n');
    }

    fn start(&mut self) {
        if self.started {
            return;
        }
        self.started = true;
        self.buf
            .extend_from_slice(if self.version == FioVersion::V2 {
                HEADER_V2
            } else {
                HEADER_V3
            });
        self.buf.push(b'\n');
        for d in 0..self.files {
            self.file_line(0, d, b"add");
            self.file_line(0, d, b"open");
        }
    }
}

impl<W: Write> TraceWrite for FioWriter<W> {
    fn write_record(&mut self, rec: &TraceRecord) -> Result<bool, WriteError> {
        self.buf.clear();
        self.start();
        let us = rec.time_ns / 1000;
        while rec.disk >= self.files {
            let d = self.files;
            self.files += 1;
            self.file_line(us, d, b"add");
            self.file_line(us, d, b"open");
        }
        if self.version == FioVersion::V2 && us > self.last_us {
            let delta = us - self.last_us;
            self.file_line(0, rec.disk, b"wait");
            // file_line ended the line; put the delay in before the newline.
            self.buf.pop();
            self.buf.push(b' ');
            push_u64(&mut self.buf, delta);
            self.buf.extend_from_slice(b" 0\n");
        }
        self.last_us = self.last_us.max(us);
        let (action, offset, len): (&[u8], u64, u64) = match rec.op {
            Op::Read => (b"read", rec.offset, rec.len),
            Op::Write => (b"write", rec.offset, rec.len),
            Op::Discard => (b"trim", rec.offset, rec.len),
            Op::Flush => (b"sync", 0, 0),
        };
        self.file_line(us, rec.disk, action);
        self.buf.pop();
        self.buf.push(b' ');
        push_u64(&mut self.buf, offset);
        self.buf.push(b' ');
        push_u64(&mut self.buf, len);
        self.buf.push(b'\n');
        self.out.write_all(&self.buf)?;
        Ok(true)
    }

    fn finish(&mut self) -> Result<(), WriteError> {
        self.buf.clear();
        self.start();
        for d in 0..self.files {
            self.file_line(self.last_us, d, b"close");
        }
        self.out.write_all(&self.buf)?;
        self.out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceError;

    fn read(text: &str) -> Vec<Result<TraceRecord, TraceError>> {
        FioReader::new(text.as_bytes()).collect()
    }

    #[test]
    fn v3_as_fio_writes_it() {
        let text = "fio version 3 iolog\n2 /dev/nvme1n1 add\n872 /dev/nvme1n1 open\n878 /dev/nvme1n1 write 0 16384\n888 /dev/nvme1n1 read 4096 4096\n890 /dev/nvme1n1 trim 0 65536\n891 /dev/nvme1n1 sync 0 0\n900 /dev/nvme1n1 wait 5 0\n10001677 /dev/nvme1n1 close\n";
        let recs: Vec<TraceRecord> = read(text)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("valid");
        assert_eq!(
            recs,
            vec![
                TraceRecord::new(878_000, 0, Op::Write, 0, 16384),
                TraceRecord::new(888_000, 0, Op::Read, 4096, 4096),
                TraceRecord::new(890_000, 0, Op::Discard, 0, 65536),
                TraceRecord::new(891_000, 0, Op::Flush, 0, 0),
            ]
        );
    }

    #[test]
    fn v2_with_waits_and_two_files() {
        let text = "fio version 2 iolog\n/a add\n/b add\n/a open\n/b open\n/a write 0 4096\n/a wait 250 0\n/b read 8192 512\n/b datasync\n/a close\n/b close\n";
        let recs: Vec<TraceRecord> = read(text)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("valid");
        assert_eq!(
            recs,
            vec![
                TraceRecord::new(0, 0, Op::Write, 0, 4096),
                TraceRecord::new(250_000, 1, Op::Read, 8192, 512),
                TraceRecord::new(250_000, 1, Op::Flush, 0, 0),
            ]
        );
    }

    #[test]
    fn errors() {
        assert!(
            read("fio version 1 iolog\n/a add\n")[0]
                .as_ref()
                .is_err_and(|e| e.to_string().starts_with("line 1: not a fio iolog header"))
        );
        assert_eq!(
            read("junk\n/a add\n").len(),
            1,
            "nothing is read after a bad header"
        );
        let r = read(
            "fio version 2 iolog\n/a add\n/b write 0 1\n/a write x 1\n/a erase 0 1\n/a write 0\n/a read 0 8\n",
        );
        let msgs: Vec<String> = r
            .iter()
            .map(|r| {
                r.as_ref()
                    .map(|_| "ok".into())
                    .unwrap_or_else(|e| e.to_string())
            })
            .collect();
        assert_eq!(
            msgs,
            vec![
                "line 3: field 1 (filename) was not added before use: '/b'",
                "line 4: field 3 (offset) is not a number: 'x'",
                "line 5: field 2 (action) is not add, open, close, read, write, trim, sync, datasync or wait: 'erase'",
                "line 6: expected 2 or 4 fields, found 3",
                "ok",
            ]
        );
        let r3 = read("fio version 3 iolog\nabc /a add\n");
        assert!(
            r3[0]
                .as_ref()
                .is_err_and(|e| e.to_string() == "line 2: field 1 (time) is not a number: 'abc'")
        );
    }

    #[test]
    fn writer_round_trip_v2_and_v3() {
        let recs = vec![
            TraceRecord::new(0, 0, Op::Write, 0, 4096),
            TraceRecord::new(7_000, 2, Op::Read, 4096, 8192),
            TraceRecord::new(7_000, 1, Op::Flush, 0, 0),
            TraceRecord::new(19_000, 0, Op::Discard, 0, 1 << 20),
        ];
        for v in [FioVersion::V2, FioVersion::V3] {
            let mut out = Vec::new();
            let mut w = FioWriter::new(&mut out, v, 3);
            for r in &recs {
                assert!(w.write_record(r).expect("write"));
            }
            w.finish().expect("finish");
            let back: Vec<TraceRecord> = read(&String::from_utf8_lossy(&out))
                .into_iter()
                .collect::<Result<_, _>>()
                .expect("valid");
            assert_eq!(back, recs, "{v:?}");
        }
    }
}
