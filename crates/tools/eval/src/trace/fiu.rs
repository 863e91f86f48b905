//! FIU block traces with content digests (the "FIU IODedup" traces: homes,
//! web-vm, mail; Koller and Rangaswami, FAST '10).
//!
//! Owns the FIU parser and writer; must not keep anything across lines and
//! must not accept a line it cannot fully parse. The rules below are the
//! contract.
//!
//! Format, as the README shipped with the traces (SNIA IOTTA) gives it: one
//! record per line, fields separated by whitespace,
//!
//! `[ts in ns] [pid] [process] [lba] [size in 512 Bytes blocks] [Write or Read] [major device number] [minor device number] [MD5 per 4096 Bytes]`
//!
//! and, for the homes traces, `[MD5 per 512 Bytes]` in the last field. The
//! published files have one line per 4 KiB (size 8) with one digest. This
//! reader applies these rules:
//!
//! 1. ts: decimal nanoseconds; record time = ts.
//! 2. pid: decimal, checked, not kept.
//! 3. process: one token (names with spaces cannot be told apart from the
//!    next field), not kept.
//! 4. lba: decimal 512-byte sectors; offset = lba x 512.
//! 5. size: decimal 512-byte sectors; len = size x 512.
//! 6. `R`/`W` (also `Read`/`Write`, any case).
//! 7. major: decimal, at most 4095. 8. minor: decimal, at most 1048575;
//!    record disk = major << 20 | minor (Linux's dev_t packing).
//! 9. digests: zero or more tokens, each one or more 32-digit hex MD5s joined
//!    by `-`. With none, `content` is `None`. With `ceil(len / 4096)` of them
//!    they are the per-4 KiB digests. With `size` of them (one per 512-byte
//!    sector, the homes variant) each run of 8 is folded, in order, into one
//!    per-4 KiB digest by a fixed 128-bit mix (equal sectors give equal
//!    blocks; it is not MD5 of the block). Any other count is an error.
//!
//! Blank lines are skipped. offset + len must not overflow.
//!
//! Not carried: discards and flushes (the writer skips them). The writer
//! writes one line per 4 KiB chunk by default (see
//! [`WriterOptions::fiu_split_blocks`](super::WriterOptions)); offsets and
//! lengths must be multiples of 512. A record without digests gets one
//! made up from (disk, chunk offset), that is, content assumed unique per
//! address.

use std::io::{BufRead, Write};

use super::line::{LineParser, LineReader};
use super::{
    CONTENT_BLOCK, ContentHash, LineProblem, Op, SECTOR, TraceRecord, TraceWrite, WriteError,
    WriterOptions, bad, num_field, push_hex, push_u64,
};

const NAMES: [&str; 9] = [
    "ts", "pid", "process", "lba", "size", "op", "major", "minor", "MD5",
];

/// Streaming FIU reader.
pub type FiuReader<R> = LineReader<R, FiuLines>;

/// What an FIU line means; nothing is kept across lines.
pub struct FiuLines;

impl<R: BufRead> FiuReader<R> {
    pub fn new(input: R) -> Self {
        LineReader::with_parser(input, FiuLines)
    }
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn parse_md5(s: &[u8]) -> Option<ContentHash> {
    if s.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = (hex_val(pair[0])? << 4) | hex_val(pair[1])?;
    }
    Some(out)
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fold several digests into one, order-sensitively (not a cryptographic hash).
pub fn fold_digests(parts: &[ContentHash]) -> ContentHash {
    let mut a: u64 = 0x6a09_e667_f3bc_c908;
    let mut b: u64 = 0xbb67_ae85_84ca_a73b;
    for p in parts {
        let (lo, hi) = p.split_at(8);
        let lo = u64::from_le_bytes(lo.try_into().unwrap_or([0; 8]));
        let hi = u64::from_le_bytes(hi.try_into().unwrap_or([0; 8]));
        a = mix64(a ^ lo).wrapping_add(b.rotate_left(17));
        b = mix64(b ^ hi ^ a);
    }
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

/// The digest the writer makes up for a chunk whose content is unknown.
pub fn address_digest(disk: u32, chunk_offset: u64) -> ContentHash {
    let a = mix64(u64::from(disk) ^ 0x5555_0000_0000_0000);
    let b = mix64(chunk_offset ^ a);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&mix64(a ^ b).to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

impl LineParser for FiuLines {
    fn parse_line(&mut self, line: &[u8]) -> Result<Option<TraceRecord>, LineProblem> {
        let mut toks = line
            .split(|b| b.is_ascii_whitespace())
            .filter(|t| !t.is_empty());
        let mut f: [&[u8]; 8] = [&[]; 8];
        let mut n = 0;
        for t in toks.by_ref() {
            f[n] = t;
            n += 1;
            if n == 8 {
                break;
            }
        }
        if n == 0 {
            return Ok(None);
        }
        if n < 8 {
            return Err(LineProblem::FieldCount {
                expected: "at least 8 whitespace-separated",
                found: n,
            });
        }
        let time_ns = num_field(f[0], 1, NAMES[0])?;
        num_field(f[1], 2, NAMES[1])?;
        let lba = num_field(f[3], 4, NAMES[3])?;
        let size = num_field(f[4], 5, NAMES[4])?;
        let offset = lba
            .checked_mul(SECTOR)
            .ok_or_else(|| bad(4, NAMES[3], "is too large", f[3]))?;
        let len = size
            .checked_mul(SECTOR)
            .ok_or_else(|| bad(5, NAMES[4], "is too large", f[4]))?;
        if offset.checked_add(len).is_none() {
            return Err(bad(5, NAMES[4], "makes lba + size overflow", f[4]));
        }
        let op = match f[5] {
            b"R" | b"r" => Op::Read,
            b"W" | b"w" => Op::Write,
            s if s.eq_ignore_ascii_case(b"read") => Op::Read,
            s if s.eq_ignore_ascii_case(b"write") => Op::Write,
            s => return Err(bad(6, NAMES[5], "is neither R nor W", s)),
        };
        let major = num_field(f[6], 7, NAMES[6])?;
        if major > 0xFFF {
            return Err(bad(7, NAMES[6], "is above 4095", f[6]));
        }
        let minor = num_field(f[7], 8, NAMES[7])?;
        if minor > 0xF_FFFF {
            return Err(bad(8, NAMES[7], "is above 1048575", f[7]));
        }
        let mut digests: Vec<ContentHash> = Vec::new();
        for tok in toks {
            for part in tok.split(|&b| b == b'-') {
                match parse_md5(part) {
                    Some(d) => digests.push(d),
                    None => return Err(bad(9, NAMES[8], "is not a 32-digit hex MD5", part)),
                }
                if digests.len() as u64 > size.max(len.div_ceil(CONTENT_BLOCK)) {
                    return Err(LineProblem::Other(format!(
                        "field 9 (MD5): more digests than the {size} sectors of the request"
                    )));
                }
            }
        }
        let chunks = len.div_ceil(CONTENT_BLOCK);
        let content = if digests.is_empty() {
            None
        } else if digests.len() as u64 == chunks {
            Some(digests)
        } else if digests.len() as u64 == size {
            Some(digests.chunks(8).map(fold_digests).collect())
        } else {
            return Err(LineProblem::Other(format!(
                "field 9 (MD5): {} digests for {size} sectors; expected {chunks} (one per 4096 bytes) or {size} (one per 512 bytes)",
                digests.len()
            )));
        };
        Ok(Some(TraceRecord {
            time_ns,
            disk: ((major as u32) << 20) | minor as u32,
            op,
            offset,
            len,
            content,
        }))
    }
}

/// Streaming FIU writer.
pub struct FiuWriter<W: Write> {
    out: W,
    split: bool,
    process: Vec<u8>,
    pid: u32,
    buf: Vec<u8>,
}

impl<W: Write> FiuWriter<W> {
    pub fn new(out: W, opts: &WriterOptions) -> Self {
        let mut process: Vec<u8> = opts
            .process
            .bytes()
            .filter(|b| !b.is_ascii_whitespace())
            .collect();
        if process.is_empty() {
            process = b"-".to_vec();
        }
        FiuWriter {
            out,
            split: opts.fiu_split_blocks,
            process,
            pid: opts.pid,
            buf: Vec::with_capacity(256),
        }
    }

    fn head(&mut self, rec: &TraceRecord, offset: u64, len: u64) {
        let b = &mut self.buf;
        push_u64(b, rec.time_ns);
        b.push(b' ');
        push_u64(b, u64::from(self.pid));
        b.push(b' ');
        b.extend_from_slice(&self.process);
        b.push(b' ');
        push_u64(b, offset / SECTOR);
        b.push(b' ');
        push_u64(b, len / SECTOR);
        b.extend_from_slice(if rec.op == Op::Write { b" W " } else { b" R " });
        push_u64(b, u64::from(rec.disk >> 20));
        b.push(b' ');
        push_u64(b, u64::from(rec.disk & 0xF_FFFF));
    }

    fn digest(rec: &TraceRecord, i: u64) -> ContentHash {
        match &rec.content {
            Some(c) => c.get(i as usize).copied().unwrap_or([0; 16]),
            None => address_digest(rec.disk, rec.offset + i * CONTENT_BLOCK),
        }
    }
}

impl<W: Write> TraceWrite for FiuWriter<W> {
    fn write_record(&mut self, rec: &TraceRecord) -> Result<bool, WriteError> {
        if !matches!(rec.op, Op::Read | Op::Write) {
            return Ok(false);
        }
        if !rec.offset.is_multiple_of(SECTOR) || !rec.len.is_multiple_of(SECTOR) {
            return Err(WriteError::Unrepresentable {
                format: "fiu",
                reason: format!(
                    "offset {} or length {} is not a multiple of 512",
                    rec.offset, rec.len
                ),
            });
        }
        let chunks = rec.len.div_ceil(CONTENT_BLOCK);
        if let Some(c) = &rec.content
            && c.len() as u64 != chunks
        {
            return Err(WriteError::Unrepresentable {
                format: "fiu",
                reason: format!("{} digests for {} chunks of 4 KiB", c.len(), chunks),
            });
        }
        self.buf.clear();
        if self.split && chunks > 1 {
            for i in 0..chunks {
                let start = i * CONTENT_BLOCK;
                self.head(
                    rec,
                    rec.offset + start,
                    (rec.len - start).min(CONTENT_BLOCK),
                );
                self.buf.push(b' ');
                push_hex(&mut self.buf, &Self::digest(rec, i));
                self.buf.push(b'\n');
            }
        } else {
            self.head(rec, rec.offset, rec.len);
            for i in 0..chunks {
                self.buf.push(b' ');
                push_hex(&mut self.buf, &Self::digest(rec, i));
            }
            self.buf.push(b'\n');
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
    use crate::trace::TraceError;

    fn read_all(text: &str) -> Vec<Result<TraceRecord, TraceError>> {
        FiuReader::new(text.as_bytes()).collect()
    }

    #[test]
    fn parses_published_shape() {
        let recs = read_all(
            "89968195792462 20782 gzip 283193184 8 R 6 0 56f11b711d91a065a2b6458eca924523\n",
        );
        let r = recs[0].as_ref().expect("valid");
        assert_eq!(
            (r.time_ns, r.disk, r.op, r.offset, r.len),
            (89968195792462, 6 << 20, Op::Read, 283193184 * 512, 4096)
        );
        let c = r.content.as_ref().expect("digest");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0][0], 0x56);
        assert_eq!(c[0][15], 0x23);
    }

    #[test]
    fn digest_counts() {
        let h = "00112233445566778899aabbccddeeff";
        // two 4 KiB chunks, two digests, space or dash separated
        let two = read_all(&format!(
            "1 1 p 0 16 W 8 1 {h} {h}\n1 1 p 0 16 W 8 1 {h}-{h}\n"
        ));
        assert!(two.iter().all(|r| {
            r.as_ref()
                .is_ok_and(|r| r.content.as_ref().map(Vec::len) == Some(2))
        }));
        // per-sector digests are folded 8 to 1
        let sectors = [h; 8].join(" ");
        let folded = read_all(&format!("1 1 p 0 8 W 8 1 {sectors}\n"));
        let c = folded[0]
            .as_ref()
            .expect("valid")
            .content
            .clone()
            .expect("digests");
        let d = parse_md5(h.as_bytes()).expect("hex");
        assert_eq!(c, vec![fold_digests(&[d; 8])]);
        // no digest at all
        assert_eq!(
            read_all("1 1 p 0 8 W 8 1\n")[0]
                .as_ref()
                .map(|r| r.content.is_none())
                .ok(),
            Some(true)
        );
        // wrong count, bad hex
        let bad = read_all(&format!("1 1 p 0 24 W 8 1 {h} {h}\n1 1 p 0 8 W 8 1 xyz\n"));
        assert!(bad[0].as_ref().is_err_and(|e| {
            e.to_string()
                .starts_with("line 1: field 9 (MD5): 2 digests for 24 sectors")
        }));
        assert!(bad[1].as_ref().is_err_and(
            |e| e.to_string() == "line 2: field 9 (MD5) is not a 32-digit hex MD5: 'xyz'"
        ));
    }

    #[test]
    fn bad_fields() {
        let r = read_all(
            "1 1 p 0 8 X 8 1\n1 1 p 0 8\n1 1 p zz 8 R 8 1\n1 1 p 0 8 R 5000 1\n\n2 2 q 8 8 w 8 2\n",
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
                "line 1: field 6 (op) is neither R nor W: 'X'",
                "line 2: expected at least 8 whitespace-separated fields, found 5",
                "line 3: field 4 (lba) is not a number: 'zz'",
                "line 4: field 7 (major) is above 4095: '5000'",
                "ok",
            ]
        );
    }

    #[test]
    fn writer_splits_and_invents_missing_digests() {
        let mut out = Vec::new();
        let mut w = FiuWriter::new(&mut out, &WriterOptions::default());
        let mut rec = TraceRecord::new(7, (8 << 20) | 16, Op::Write, 4096, 8192);
        rec.content = Some(vec![[0xaa; 16], [0xbb; 16]]);
        assert!(w.write_record(&rec).expect("write"));
        assert!(
            !w.write_record(&TraceRecord::new(8, 0, Op::Discard, 0, 4096))
                .expect("write")
        );
        assert!(
            w.write_record(&TraceRecord::new(9, 0, Op::Read, 0, 4096))
                .expect("write")
        );
        assert!(
            w.write_record(&TraceRecord::new(9, 0, Op::Read, 100, 4096))
                .is_err()
        );
        w.finish().expect("flush");
        let text = String::from_utf8_lossy(&out).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0],
            format!("7 4242 vdgen 8 8 W 8 16 {}", "aa".repeat(16))
        );
        assert_eq!(
            lines[1],
            format!("7 4242 vdgen 16 8 W 8 16 {}", "bb".repeat(16))
        );
        let back: Vec<TraceRecord> = FiuReader::new(text.as_bytes())
            .collect::<Result<_, _>>()
            .expect("reads back");
        assert_eq!(back[2].content, Some(vec![address_digest(0, 0)]));
    }
}
