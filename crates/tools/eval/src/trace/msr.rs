//! SNIA MSR Cambridge block traces (CSV).
//!
//! Owns the MSR parser and writer; must not keep anything per line (only
//! the host-name table) and must not accept a line it cannot fully parse.
//! The rules below are the contract.
//!
//! Format, as the README of the SNIA IOTTA distribution ("MSR Cambridge
//! Traces", Narayanan et al., FAST '08) describes it: one request per line,
//! seven comma-separated fields
//!
//! `Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime`
//!
//! 1. Timestamp: issue time in Windows filetime (100 ns ticks since
//!    1601-01-01 UTC); record time = Timestamp x 100 ns (an error if that
//!    overflows u64, i.e. after the year 2185).
//! 2. Hostname: non-empty; hosts get an index by order of first appearance.
//! 3. DiskNumber: decimal, at most 65535; record disk = host index << 16 |
//!    DiskNumber (so a one-host trace, the usual case, has disk = DiskNumber).
//! 4. Type: `Read` or `Write` (any case).
//! 5. Offset: bytes from the start of the disk.
//! 6. Size: bytes (0 is accepted; the record then has `len` 0).
//! 7. ResponseTime: filetime units; checked to be a number, not kept.
//!
//! Fields may carry surrounding spaces. Blank lines are skipped, and so is a
//! first line starting with `Timestamp,` (a header, which the published files
//! do not have but hand-made ones often do). Offset + Size must not overflow.
//!
//! Not carried: discards, flushes, content digests; the writer skips
//! discard and flush records and writes ResponseTime 0.

use std::io::{BufRead, Write};

use super::line::{LineParser, LineReader};
use super::{LineProblem, Op, TraceRecord, TraceWrite, WriteError, bad, num_field, push_u64};

const FIELDS: [&str; 7] = [
    "Timestamp",
    "Hostname",
    "DiskNumber",
    "Type",
    "Offset",
    "Size",
    "ResponseTime",
];
const MAX_HOSTS: usize = 1 << 16;

/// Streaming MSR reader.
pub type MsrReader<R> = LineReader<R, MsrLines>;

/// What an MSR line means; the only state kept across lines is the
/// host-name table.
pub struct MsrLines {
    hosts: Vec<Vec<u8>>,
    last_host: usize,
    seen_data: bool,
}

impl<R: BufRead> MsrReader<R> {
    pub fn new(input: R) -> Self {
        LineReader::with_parser(
            input,
            MsrLines {
                hosts: Vec::new(),
                last_host: 0,
                seen_data: false,
            },
        )
    }

    /// Host names seen so far, by host index.
    pub fn hosts(&self) -> impl Iterator<Item = String> + '_ {
        self.parser()
            .hosts
            .iter()
            .map(|h| String::from_utf8_lossy(h).into_owned())
    }
}

fn host_index(hosts: &mut Vec<Vec<u8>>, last: &mut usize, name: &[u8]) -> Result<u32, LineProblem> {
    if hosts.get(*last).is_some_and(|h| h == name) {
        return Ok(*last as u32);
    }
    let i = match hosts.iter().position(|h| h == name) {
        Some(i) => i,
        None => {
            if hosts.len() >= MAX_HOSTS {
                return Err(bad(
                    2,
                    FIELDS[1],
                    "is one host too many (at most 65536)",
                    name,
                ));
            }
            hosts.push(name.to_vec());
            hosts.len() - 1
        }
    };
    *last = i;
    Ok(i as u32)
}

impl LineParser for MsrLines {
    fn parse_line(&mut self, line: &[u8]) -> Result<Option<TraceRecord>, LineProblem> {
        let line = line.trim_ascii();
        if line.is_empty() {
            return Ok(None);
        }
        if !self.seen_data && line.len() >= 10 && line[..10].eq_ignore_ascii_case(b"timestamp,") {
            self.seen_data = true;
            return Ok(None);
        }
        self.seen_data = true;
        let mut f: [&[u8]; 7] = [&[]; 7];
        let mut n = 0;
        for part in line.split(|&b| b == b',') {
            if n < 7 {
                f[n] = part.trim_ascii();
            }
            n += 1;
        }
        if n != 7 {
            return Err(LineProblem::FieldCount {
                expected: "7 comma-separated",
                found: n,
            });
        }
        let ticks = num_field(f[0], 1, FIELDS[0])?;
        let time_ns = ticks
            .checked_mul(100)
            .ok_or_else(|| bad(1, FIELDS[0], "is too large", f[0]))?;
        if f[1].is_empty() {
            return Err(bad(2, FIELDS[1], "is empty", f[1]));
        }
        let disk_no = num_field(f[2], 3, FIELDS[2])?;
        if disk_no > 0xFFFF {
            return Err(bad(3, FIELDS[2], "is above 65535", f[2]));
        }
        let op = if f[3].eq_ignore_ascii_case(b"read") {
            Op::Read
        } else if f[3].eq_ignore_ascii_case(b"write") {
            Op::Write
        } else {
            return Err(bad(4, FIELDS[3], "is neither Read nor Write", f[3]));
        };
        let offset = num_field(f[4], 5, FIELDS[4])?;
        let len = num_field(f[5], 6, FIELDS[5])?;
        if offset.checked_add(len).is_none() {
            return Err(bad(6, FIELDS[5], "makes Offset + Size overflow", f[5]));
        }
        num_field(f[6], 7, FIELDS[6])?;
        let host = host_index(&mut self.hosts, &mut self.last_host, f[1])?;
        Ok(Some(TraceRecord::new(
            time_ns,
            (host << 16) | disk_no as u32,
            op,
            offset,
            len,
        )))
    }
}

/// Streaming MSR writer.
pub struct MsrWriter<W: Write> {
    out: W,
    hostname: Vec<u8>,
    buf: Vec<u8>,
}

impl<W: Write> MsrWriter<W> {
    /// `hostname` is written for host index 0; host index h > 0 is written as
    /// `{hostname}{h}`. Commas and line breaks in it are replaced by `_`.
    pub fn new(out: W, hostname: &str) -> Self {
        let mut h: Vec<u8> = hostname
            .bytes()
            .map(|b| {
                if b == b',' || b == b'\n' || b == b'\r' {
                    b'_'
                } else {
                    b
                }
            })
            .collect();
        if h.trim_ascii().is_empty() {
            h = b"host".to_vec();
        }
        MsrWriter {
            out,
            hostname: h,
            buf: Vec::with_capacity(128),
        }
    }
}

impl<W: Write> TraceWrite for MsrWriter<W> {
    fn write_record(&mut self, rec: &TraceRecord) -> Result<bool, WriteError> {
        let ty: &[u8] = match rec.op {
            Op::Read => b"Read",
            Op::Write => b"Write",
            Op::Discard | Op::Flush => return Ok(false),
        };
        let b = &mut self.buf;
        b.clear();
        push_u64(b, rec.time_ns / 100);
        b.push(b',');
        b.extend_from_slice(&self.hostname);
        let host = rec.disk >> 16;
        if host > 0 {
            push_u64(b, u64::from(host));
        }
        b.push(b',');
        push_u64(b, u64::from(rec.disk & 0xFFFF));
        b.push(b',');
        b.extend_from_slice(ty);
        b.push(b',');
        push_u64(b, rec.offset);
        b.push(b',');
        push_u64(b, rec.len);
        b.extend_from_slice(b",0\n");
        self.out.write_all(b)?;
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
    use crate::trace::TraceError;

    fn read_all(text: &str) -> Vec<Result<TraceRecord, TraceError>> {
        MsrReader::new(text.as_bytes()).collect()
    }

    #[test]
    fn parses_published_shape() {
        let recs = read_all(
            "128166372003061629,hm,1,Read,3230752768,4096,12739\n128166372016382155,hm,1,Write,0,512,1\n",
        );
        let r0 = recs[0].as_ref().expect("valid line");
        assert_eq!(r0.time_ns, 12816637200306162900);
        assert_eq!(
            (r0.disk, r0.op, r0.offset, r0.len),
            (1, Op::Read, 3230752768, 4096)
        );
        assert_eq!(recs[1].as_ref().map(|r| r.op).ok(), Some(Op::Write));
    }

    #[test]
    fn header_blank_lines_and_hosts() {
        let recs: Vec<TraceRecord> = read_all("Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime\n\n1, a ,0,read,0,1,0\n2,b,3,WRITE,0,1,0\n3,a,2,Read,0,1,0\n")
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("all valid");
        assert_eq!(
            recs.iter().map(|r| r.disk).collect::<Vec<_>>(),
            vec![0, (1 << 16) | 3, 2]
        );
    }

    #[test]
    fn bad_lines_name_line_and_field() {
        let recs = read_all(
            "1,h,0,Read,0,4096,0\n1,h,0,Read,0,x,0\n1,h,0,Erase,0,1,0\n1,h,0,Read,0\n1,h,70000,Read,0,1,0\n2,h,0,Write,0,8,0\n",
        );
        let msgs: Vec<String> = recs
            .iter()
            .map(|r| {
                r.as_ref()
                    .map(|_| "ok".to_string())
                    .unwrap_or_else(|e| e.to_string())
            })
            .collect();
        assert_eq!(msgs[0], "ok");
        assert_eq!(msgs[1], "line 2: field 6 (Size) is not a number: 'x'");
        assert_eq!(
            msgs[2],
            "line 3: field 4 (Type) is neither Read nor Write: 'Erase'"
        );
        assert_eq!(
            msgs[3],
            "line 4: expected 7 comma-separated fields, found 5"
        );
        assert_eq!(
            msgs[4],
            "line 5: field 3 (DiskNumber) is above 65535: '70000'"
        );
        assert_eq!(msgs[5], "ok", "the reader continues after a bad line");
    }

    #[test]
    fn overflowing_values_are_errors() {
        let e =
            read_all("184467440737095517,h,0,Read,0,1,0\n1,h,0,Read,18446744073709551615,1,0\n");
        assert!(
            e[0].as_ref()
                .is_err_and(|e| e.to_string().contains("Timestamp) is too large"))
        );
        assert!(
            e[1].as_ref()
                .is_err_and(|e| e.to_string().contains("overflow"))
        );
    }

    #[test]
    fn writer_skips_what_msr_cannot_say() {
        let mut out = Vec::new();
        let mut w = MsrWriter::new(&mut out, "vm");
        assert!(
            w.write_record(&TraceRecord::new(12345, 2, Op::Write, 8192, 4096))
                .expect("write")
        );
        assert!(
            !w.write_record(&TraceRecord::new(0, 2, Op::Flush, 0, 0))
                .expect("write")
        );
        assert!(
            w.write_record(&TraceRecord::new(100, (1 << 16) | 1, Op::Read, 0, 512))
                .expect("write")
        );
        w.finish().expect("flush");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "123,vm,2,Write,8192,4096,0\n1,vm1,1,Read,0,512,0\n"
        );
    }
}
