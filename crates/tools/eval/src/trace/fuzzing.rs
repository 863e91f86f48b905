//! Entry points shared by the trace fuzz targets (fuzz/) and the bounded
//! fuzz test of the suite: arbitrary bytes read to the end by the real
//! readers, with the promises every reader makes checked on each item.
//!
//! Owns only the checks; it must not parse anything itself. A broken promise
//! panics, on purpose: a panic is how a fuzzer reports a finding. Any error
//! the readers return for bad input is a correct outcome.

use std::io::{BufRead, Cursor, Read};

use super::{
    BlkAction, CONTENT_BLOCK, Format, GZIP_MAGIC, MAX_LINE_BYTES, Op, TraceError, TraceRecord,
    ZSTD_MAGIC, decompress, detect_format, read_trace,
};

/// How much decompressed text [`exercise_detection`] reads: a few bytes of
/// zstd can stand for gigabytes of output, and reading them all would only
/// make one input slow, not reach more code.
const MAX_DECOMPRESSED: u64 = 4 << 20;

/// Reads `data` as a trace of `format` to its end. For blkparse, once with
/// each action (Q, D, C), whatever action `format` names.
pub fn exercise_reader(format: Format, data: &[u8]) {
    let formats: &[Format] = match format {
        Format::Blkparse(_) => &[
            Format::Blkparse(BlkAction::Queue),
            Format::Blkparse(BlkAction::Issue),
            Format::Blkparse(BlkAction::Complete),
        ],
        _ => &[format],
    };
    for &f in formats {
        let input: Box<dyn BufRead + Send> = Box::new(Cursor::new(data.to_vec()));
        match read_trace(input, Some(f)) {
            Ok(reader) => drain(reader, Some(line_count(data))),
            Err(e) => panic!("a reader of a given format opens without reading: {e}"),
        }
    }
}

/// What `open_trace` does with a file's bytes when neither the name nor the
/// caller says what they are: decompression chosen by magic bytes, format
/// detection, then the detected reader to the end.
pub fn exercise_detection(data: &[u8]) {
    let Ok(text) = decompress(Cursor::new(data.to_vec()), None) else {
        return;
    };
    let compressed = data.starts_with(&GZIP_MAGIC) || data.starts_with(&ZSTD_MAGIC);
    let bounded: Box<dyn BufRead + Send> = Box::new(text.take(MAX_DECOMPRESSED));
    let Ok(reader) = read_trace(bounded, None) else {
        return;
    };
    let detected = reader.format();
    if !compressed {
        // Detection looks at the first non-blank line alone (cut at the
        // line length cap), so that line must be what decided.
        let first = data
            .split(|&b| b == b'\n')
            .map(<[u8]>::trim_ascii)
            .find(|l| !l.is_empty());
        if let Some(first) = first.filter(|l| l.len() < MAX_LINE_BYTES) {
            assert_eq!(
                detect_format(first),
                Some(detected),
                "detected {detected} but the first data line says otherwise"
            );
        }
    }
    drain(reader, (!compressed).then(|| line_count(data)));
}

/// Lines in `data` as the line reader counts them (a last line without `\n`
/// counts).
fn line_count(data: &[u8]) -> u64 {
    let newlines = memchr::memchr_iter(b'\n', data).count() as u64;
    newlines + u64::from(!data.is_empty() && !data.ends_with(b"\n"))
}

/// Reads every item and checks it. With `lines` known, also bounds the
/// number of items and the line numbers errors name, so that a reader that
/// repeats itself forever is caught instead of hanging the fuzzer.
fn drain(reader: impl Iterator<Item = Result<TraceRecord, TraceError>>, lines: Option<u64>) {
    let mut items: u64 = 0;
    let mut last_line: u64 = 0;
    for item in reader {
        items += 1;
        if let Some(lines) = lines {
            // At most two records per line (a blkparse preflush with data)
            // and one end-of-trace error.
            assert!(
                items <= 2 * lines + 1,
                "{items} items from {lines} lines: the reader repeats itself"
            );
        }
        match item {
            Ok(rec) => {
                assert!(
                    rec.offset.checked_add(rec.len).is_some(),
                    "offset + len overflows: {rec:?}"
                );
                if rec.op == Op::Flush {
                    assert_eq!((rec.offset, rec.len), (0, 0), "a flush with a range");
                }
                if let Some(c) = &rec.content {
                    assert_eq!(
                        c.len() as u64,
                        rec.len.div_ceil(CONTENT_BLOCK),
                        "not one digest per 4 KiB: {rec:?}"
                    );
                }
            }
            Err(e) => {
                let message = e.to_string();
                assert!(!message.is_empty(), "an error without a message");
                if let Some(line) = e.line() {
                    assert!(line >= 1, "line numbers start at 1: {message}");
                    assert!(
                        line >= last_line,
                        "line numbers go back ({last_line} then {line}): {message}"
                    );
                    if let Some(lines) = lines {
                        assert!(line <= lines, "line {line} of {lines}: {message}");
                    }
                    last_line = line;
                }
            }
        }
    }
}
