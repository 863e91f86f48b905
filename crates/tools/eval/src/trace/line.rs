//! The one line reader every trace format reads through: a reused buffer
//! with a length cap (constant memory), line counting, and the loop that
//! turns a format's per-line verdict into records and typed errors naming
//! the line.
//!
//! Owns line splitting, line numbers and the error protocol shared by all
//! readers (an overlong or unparsable line is reported and skipped; a read
//! error ends the reading). It must not grow its buffer past
//! [`MAX_LINE_BYTES`] nor interpret content: what a line means belongs to
//! the format's [`LineParser`].

use std::io::{self, BufRead};

use super::{LineProblem, TraceError, TraceRecord};

/// Longest line any reader accepts; longer lines are reported and skipped.
pub const MAX_LINE_BYTES: usize = 1 << 16;

/// Outcome of reading one line.
enum Next {
    /// A line is in the buffer (without its `\n` or `\r\n`).
    Line,
    /// The line exceeded [`MAX_LINE_BYTES`]; its bytes were consumed.
    TooLong,
    /// End of input.
    Eof,
}

struct LineSource<R> {
    inner: R,
    buf: Vec<u8>,
    line_no: u64,
}

impl<R: BufRead> LineSource<R> {
    fn new(inner: R) -> Self {
        LineSource {
            inner,
            buf: Vec::with_capacity(256),
            line_no: 0,
        }
    }

    /// 1-based number of the line last returned.
    fn line_no(&self) -> u64 {
        self.line_no
    }

    fn line(&self) -> &[u8] {
        &self.buf
    }

    fn next_line(&mut self) -> io::Result<Next> {
        self.buf.clear();
        let mut any = false;
        let mut too_long = false;
        loop {
            let avail = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Count the line being read so the error names it.
                    self.line_no += 1;
                    return Err(e);
                }
            };
            if avail.is_empty() {
                break;
            }
            any = true;
            let (chunk, used, done) = match memchr::memchr(b'\n', avail) {
                Some(i) => (&avail[..i], i + 1, true),
                None => (avail, avail.len(), false),
            };
            if !too_long {
                if self.buf.len() + chunk.len() > MAX_LINE_BYTES {
                    too_long = true;
                    self.buf.clear();
                } else {
                    self.buf.extend_from_slice(chunk);
                }
            }
            self.inner.consume(used);
            if done {
                break;
            }
        }
        if !any {
            return Ok(Next::Eof);
        }
        self.line_no += 1;
        if too_long {
            return Ok(Next::TooLong);
        }
        if self.buf.last() == Some(&b'\r') {
            self.buf.pop();
        }
        Ok(Next::Line)
    }
}

/// What a trace format contributes to a [`LineReader`]: the meaning of one line.
pub trait LineParser {
    /// Parses one line (without its line ending). `Ok(None)`: the line holds
    /// no record (blank, a header, an event not read).
    fn parse_line(&mut self, line: &[u8]) -> Result<Option<TraceRecord>, LineProblem>;

    /// A further record the last parsed line yielded; the reader returns it
    /// before reading another line.
    fn take_pending(&mut self) -> Option<TraceRecord> {
        None
    }

    /// Whether, after the error `parse_line` just returned, nothing more
    /// can be read (the reader then ends).
    fn stops_after_error(&self) -> bool {
        false
    }

    /// Asked once, at the first end of input: an error saying why the
    /// trace cannot be used as asked, if so.
    fn at_end(&mut self) -> Option<TraceError> {
        None
    }
}

/// Records, each from a known line.
pub trait Records: Iterator<Item = Result<TraceRecord, TraceError>> + Send {
    /// 1-based number of the line the item last returned came from (a
    /// line that yields several records gives each its number).
    fn line(&self) -> u64;
}

impl<R: BufRead + Send, P: LineParser + Send> Records for LineReader<R, P> {
    fn line(&self) -> u64 {
        self.src.line_no()
    }
}

/// A streaming trace reader: lines from `R`, meaning from `P`.
///
/// Yields one item per record or per bad line; a bad line is reported as
/// [`TraceError::Line`] with its 1-based number and reading continues with
/// the next line. A read error is reported once as [`TraceError::Io`] and
/// ends the reading.
pub struct LineReader<R, P> {
    src: LineSource<R>,
    parser: P,
    failed: bool,
    end_asked: bool,
}

impl<R: BufRead, P: LineParser> LineReader<R, P> {
    pub(crate) fn with_parser(input: R, parser: P) -> Self {
        LineReader {
            src: LineSource::new(input),
            parser,
            failed: false,
            end_asked: false,
        }
    }

    /// The format's parser, for what it has learnt of the trace so far.
    pub(crate) fn parser(&self) -> &P {
        &self.parser
    }

    fn line_error(&self, problem: LineProblem) -> TraceError {
        TraceError::Line {
            line: self.src.line_no(),
            problem,
        }
    }
}

impl<R: BufRead, P: LineParser> Iterator for LineReader<R, P> {
    type Item = Result<TraceRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(rec) = self.parser.take_pending() {
            return Some(Ok(rec));
        }
        if self.failed {
            return None;
        }
        loop {
            match self.src.next_line() {
                Ok(Next::Eof) => {
                    if self.end_asked {
                        return None;
                    }
                    self.end_asked = true;
                    return self.parser.at_end().map(Err);
                }
                Ok(Next::TooLong) => {
                    return Some(Err(self.line_error(LineProblem::TooLong {
                        max: MAX_LINE_BYTES,
                    })));
                }
                Err(source) => {
                    self.failed = true;
                    return Some(Err(TraceError::Io {
                        line: self.src.line_no(),
                        source,
                    }));
                }
                Ok(Next::Line) => match self.parser.parse_line(self.src.line()) {
                    Ok(Some(rec)) => return Some(Ok(rec)),
                    Ok(None) => continue,
                    Err(problem) => {
                        if self.parser.stops_after_error() {
                            self.failed = true;
                        }
                        return Some(Err(self.line_error(problem)));
                    }
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_crlf_last_line_and_overlong() {
        let mut data = b"a\r\nbb\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 1));
        data.extend_from_slice(b"\nlast");
        let mut src = LineSource::new(io::BufReader::with_capacity(7, &data[..]));
        assert!(matches!(src.next_line(), Ok(Next::Line)));
        assert_eq!(src.line(), b"a");
        assert!(matches!(src.next_line(), Ok(Next::Line)));
        assert_eq!(src.line(), b"bb");
        assert!(matches!(src.next_line(), Ok(Next::TooLong)));
        assert_eq!(src.line_no(), 3);
        assert!(matches!(src.next_line(), Ok(Next::Line)));
        assert_eq!((src.line(), src.line_no()), (&b"last"[..], 4));
        assert!(matches!(src.next_line(), Ok(Next::Eof)));
    }
}
