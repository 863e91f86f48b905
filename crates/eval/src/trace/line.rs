//! A line reader with a reused buffer and a length cap (constant memory).
//!
//! Owns line splitting for all readers; must not grow its buffer past
//! [`MAX_LINE_BYTES`] nor interpret content.

use std::io::{self, BufRead};

/// Longest line any reader accepts; longer lines are reported and skipped.
pub const MAX_LINE_BYTES: usize = 1 << 16;

/// Outcome of reading one line.
pub(crate) enum Next {
    /// A line is in the buffer (without its `\n` or `\r\n`).
    Line,
    /// The line exceeded [`MAX_LINE_BYTES`]; its bytes were consumed.
    TooLong,
    /// End of input.
    Eof,
}

pub(crate) struct LineSource<R> {
    inner: R,
    buf: Vec<u8>,
    line_no: u64,
}

impl<R: BufRead> LineSource<R> {
    pub(crate) fn new(inner: R) -> Self {
        LineSource {
            inner,
            buf: Vec::with_capacity(256),
            line_no: 0,
        }
    }

    /// 1-based number of the line last returned.
    pub(crate) fn line_no(&self) -> u64 {
        self.line_no
    }

    pub(crate) fn line(&self) -> &[u8] {
        &self.buf
    }

    pub(crate) fn next_line(&mut self) -> io::Result<Next> {
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
