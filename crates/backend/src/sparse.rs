//! A sparse in-memory store for trace replay: only the chunks ever written
//! take memory, so a replayed disk of terabytes costs what its trace wrote.
//! Holes read as zeros, or as a fixed pattern of the offset when the store
//! stands for a full base image (every block holds distinct data). It must
//! not be used where durability matters: `flush` does nothing.

use crate::Backend;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Bytes per allocation unit.
const CHUNK: u64 = 64 << 10;

/// What a hole reads as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoleFill {
    Zeros,
    /// Every 8 bytes hold their own offset: a base image full of data.
    OffsetPattern,
}

/// A sparse, optionally growable byte store in memory.
#[derive(Debug)]
pub struct SparseStore {
    name: String,
    len: AtomicU64,
    growable: bool,
    fill: HoleFill,
    chunks: Mutex<HashMap<u64, Box<[u8]>>>,
}

impl SparseStore {
    pub fn new(name: impl Into<String>, len: u64, growable: bool, fill: HoleFill) -> SparseStore {
        SparseStore {
            name: name.into(),
            len: AtomicU64::new(len),
            growable,
            fill,
            chunks: Mutex::new(HashMap::new()),
        }
    }

    /// Memory held by written chunks.
    pub fn resident_bytes(&self) -> u64 {
        self.chunks().len() as u64 * CHUNK
    }

    fn chunks(&self) -> MutexGuard<'_, HashMap<u64, Box<[u8]>>> {
        // Chunk copies are plain memcpys: a panicking holder leaves at
        // worst one chunk half-written, which a replay tolerates.
        self.chunks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fill_hole(&self, buf: &mut [u8], offset: u64) {
        match self.fill {
            HoleFill::Zeros => buf.fill(0),
            HoleFill::OffsetPattern => {
                for (i, b) in buf.iter_mut().enumerate() {
                    let at = offset + i as u64;
                    *b = (at & !7).to_le_bytes()[(at & 7) as usize];
                }
            }
        }
    }

    fn fresh_chunk(&self, index: u64) -> Box<[u8]> {
        let mut c = vec![0u8; CHUNK as usize].into_boxed_slice();
        self.fill_hole(&mut c, index * CHUNK);
        c
    }
}

/// Splits `[offset, offset + len)` into (chunk index, offset in chunk,
/// position in the buffer, length) pieces.
fn pieces(offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize, usize)> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let at = offset + done as u64;
        let inner = (at % CHUNK) as usize;
        let n = (CHUNK as usize - inner).min(len - done);
        let piece = (at / CHUNK, inner, done, n);
        done += n;
        Some(piece)
    })
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOSPC)
}

impl Backend for SparseStore {
    fn len(&self) -> io::Result<u64> {
        Ok(self.len.load(Ordering::Relaxed))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = self.len.load(Ordering::Relaxed);
        let chunks = self.chunks();
        for (index, inner, pos, n) in pieces(offset, buf.len()) {
            let dst = &mut buf[pos..pos + n];
            match chunks.get(&index) {
                Some(c) => dst.copy_from_slice(&c[inner..inner + n]),
                None => self.fill_hole(dst, index * CHUNK + inner as u64),
            }
        }
        // Bytes past the end read as zeros, as the trait says.
        let inside = len.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[inside..].fill(0);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset overflow"))?;
        if end > self.len.load(Ordering::Relaxed) {
            if !self.growable {
                return Err(enospc());
            }
            self.len.fetch_max(end, Ordering::Relaxed);
        }
        let mut chunks = self.chunks();
        for (index, inner, pos, n) in pieces(offset, buf.len()) {
            let c = chunks
                .entry(index)
                .or_insert_with(|| self.fresh_chunk(index));
            c[inner..inner + n].copy_from_slice(&buf[pos..pos + n]);
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    /// Whole chunks are freed; partly covered ones read back as zeros.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = len.min(self.len.load(Ordering::Relaxed).saturating_sub(offset));
        let Ok(len) = usize::try_from(len) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "discard too large",
            ));
        };
        let mut chunks = self.chunks();
        for (index, inner, _, n) in pieces(offset, len) {
            if n as u64 == CHUNK {
                chunks.remove(&index);
            } else {
                let c = chunks
                    .entry(index)
                    .or_insert_with(|| self.fresh_chunk(index));
                c[inner..inner + n].fill(0);
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len > self.len.load(Ordering::Relaxed) && !self.growable {
            return Err(enospc());
        }
        self.len.store(len, Ordering::Relaxed);
        // Forget chunks past the end so that growing again reads holes.
        self.chunks().retain(|&i, _| i * CHUNK < len);
        Ok(())
    }

    fn can_grow(&self) -> bool {
        self.growable
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_read_back_across_chunks_and_holes_keep_their_fill() {
        let s = SparseStore::new("s", 4 * CHUNK, false, HoleFill::OffsetPattern);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        s.write_at(&data, CHUNK - 10).expect("write");
        let mut back = vec![0u8; data.len()];
        s.read_at(&mut back, CHUNK - 10).expect("read");
        assert_eq!(back, data);
        let mut hole = [0u8; 16];
        s.read_at(&mut hole, 3 * CHUNK + 8).expect("read hole");
        assert_eq!(&hole[..8], &(3 * CHUNK + 8).to_le_bytes());
        // The head of the first written chunk kept its pattern.
        let mut head = [0u8; 8];
        s.read_at(&mut head, 8).expect("read head");
        assert_eq!(head, 8u64.to_le_bytes());
        assert!(s.write_at(&[1], 4 * CHUNK).is_err(), "fixed store grew");
    }

    #[test]
    fn discard_frees_whole_chunks_and_zeroes_partial_ones() {
        let s = SparseStore::new("s", 0, true, HoleFill::Zeros);
        s.write_at(&vec![7u8; 3 * CHUNK as usize], 0)
            .expect("write");
        assert_eq!(s.len().expect("len"), 3 * CHUNK);
        s.discard(CHUNK / 2, 2 * CHUNK).expect("discard");
        assert_eq!(s.resident_bytes(), 2 * CHUNK);
        let mut b = vec![0u8; 3 * CHUNK as usize];
        s.read_at(&mut b, 0).expect("read");
        assert!(b[..CHUNK as usize / 2].iter().all(|&x| x == 7));
        assert!(
            b[CHUNK as usize / 2..5 * CHUNK as usize / 2]
                .iter()
                .all(|&x| x == 0)
        );
        assert!(b[5 * CHUNK as usize / 2..].iter().all(|&x| x == 7));
    }
}
