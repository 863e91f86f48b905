//! Bounds-checked big-endian field access on byte slices.

use crate::{FormatError, Result};

/// A read cursor over a byte slice; every read is checked against its end.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }

    pub(crate) fn at(buf: &'a [u8], pos: usize, what: &'static str) -> Self {
        Reader { buf, pos, what }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(FormatError::Truncated {
                what: self.what,
                need: (self.pos as u64).saturating_add(n as u64),
                have: self.buf.len() as u64,
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16> {
        let mut b = [0u8; 2];
        b.copy_from_slice(self.take(2)?);
        Ok(u16::from_be_bytes(b))
    }

    pub(crate) fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(b))
    }

    pub(crate) fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }
}

/// Reads the big-endian u64 at `index` (in units of 8 bytes); callers
/// guarantee the index is inside the slice.
pub fn be64_at(buf: &[u8], index: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[index * 8..index * 8 + 8]);
    u64::from_be_bytes(b)
}

/// Writes a big-endian u64 at `index` (in units of 8 bytes).
pub fn put_be64_at(buf: &mut [u8], index: usize, value: u64) {
    buf[index * 8..index * 8 + 8].copy_from_slice(&value.to_be_bytes());
}

/// Rounds `n` up to a multiple of 8.
pub(crate) fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}
