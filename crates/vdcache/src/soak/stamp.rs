//! Self-describing sector contents for the soak: every 512-byte sector a
//! soak write stores names its own sector number, the write that stored
//! it and the run, and the rest of its bytes follow from those three, so
//! one read tells exactly which write a sector holds, whether it landed at
//! the wrong address, or whether it is garbage (torn, corrupted).
//!
//! A version is a write number and whether that write stored zeros
//! (write-zeroes, a trim of whole clusters) or data. Write number 0 is the
//! disk before the soak: the base image's data, or zeros where the base
//! has none.
//!
//! Owns the encoding and its recognition. Must not keep any state: what a
//! sector may hold is the record's business.

use std::fmt;

/// The unit of the soak's bookkeeping.
pub const SECTOR: u64 = 512;

const MAGIC: [u8; 8] = *b"VDSOAK01";
const HEADER: usize = 32;

/// What one sector holds: the data or the zeros of one write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Version(u64);

impl Version {
    /// The base image's data (write 0).
    pub const BASE: Version = Version(0);
    /// Zeros before the soak wrote anything (write 0).
    pub const INITIAL_ZERO: Version = Version(1);

    /// The data of write `write` (1 and up).
    pub fn data(write: u64) -> Version {
        Version(write << 1)
    }

    /// The zeros of write `write` (1 and up).
    pub fn zero(write: u64) -> Version {
        Version(write << 1 | 1)
    }

    pub fn is_zero(self) -> bool {
        self.0 & 1 == 1
    }

    pub fn write(self) -> u64 {
        self.0 >> 1
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.write(), self.is_zero()) {
            (0, false) => write!(f, "base data"),
            (0, true) => write!(f, "zeros (never written)"),
            (w, false) => write!(f, "data of write {w}"),
            (w, true) => write!(f, "zeros of write {w}"),
        }
    }
}

/// What a read of one sector found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// All 512 bytes zero.
    Zero,
    /// Exactly what write `write` stored for sector `sector` (which may be
    /// another sector than the one read: misplaced data).
    Data { sector: u64, write: u64 },
    /// Neither: the first bytes, for the report.
    Garbage { head: [u8; 16] },
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Zero => write!(f, "zeros"),
            Found::Data { sector, write: 0 } => write!(f, "base data of sector {sector}"),
            Found::Data { sector, write } => write!(f, "data of write {write} for sector {sector}"),
            Found::Garbage { head } => {
                write!(f, "garbage (starts ")?;
                for b in head {
                    write!(f, "{b:02x}")?;
                }
                write!(f, ")")
            }
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills one sector with what write `write` stores at `sector` in the run
/// keyed `key`.
fn fill_sector(out: &mut [u8], sector: u64, write: u64, key: u64) {
    out[..8].copy_from_slice(&MAGIC);
    out[8..16].copy_from_slice(&sector.to_le_bytes());
    out[16..24].copy_from_slice(&write.to_le_bytes());
    out[24..32].copy_from_slice(&key.to_le_bytes());
    let mut state = mix(sector ^ mix(write ^ mix(key)));
    for word in out[HEADER..SECTOR as usize].chunks_exact_mut(8) {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        word.copy_from_slice(&mix(state).to_le_bytes());
    }
}

/// The bytes of write `write` over the sectors from `first_sector`
/// (`out.len()` a multiple of [`SECTOR`]).
pub fn fill(out: &mut [u8], first_sector: u64, write: u64, key: u64) {
    for (i, s) in out.chunks_exact_mut(SECTOR as usize).enumerate() {
        fill_sector(s, first_sector + i as u64, write, key);
    }
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Recognizes one 512-byte sector of the run keyed `key`.
pub fn classify(data: &[u8], key: u64) -> Found {
    if data.iter().all(|&b| b == 0) {
        return Found::Zero;
    }
    let mut head = [0u8; 16];
    head.copy_from_slice(&data[..16]);
    if data.len() != SECTOR as usize || data[..8] != MAGIC || le64(&data[24..32]) != key {
        return Found::Garbage { head };
    }
    let (sector, write) = (le64(&data[8..16]), le64(&data[16..24]));
    let mut expect = [0u8; SECTOR as usize];
    fill_sector(&mut expect, sector, write, key);
    if expect[..] == data[..] {
        Found::Data { sector, write }
    } else {
        Found::Garbage { head }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sector_names_its_write_and_address() {
        let mut b = vec![0u8; 3 * SECTOR as usize];
        fill(&mut b, 40, 7, 99);
        for i in 0..3 {
            let s = &b[i * 512..(i + 1) * 512];
            assert_eq!(
                classify(s, 99),
                Found::Data {
                    sector: 40 + i as u64,
                    write: 7
                }
            );
        }
        // Another run's data is not this run's.
        assert!(matches!(classify(&b[..512], 98), Found::Garbage { .. }));
    }

    #[test]
    fn one_flipped_bit_or_a_torn_sector_is_garbage() {
        let mut b = vec![0u8; SECTOR as usize];
        fill(&mut b, 3, 5, 1);
        b[300] ^= 1;
        assert!(matches!(classify(&b, 1), Found::Garbage { .. }));
        let mut old = vec![0u8; SECTOR as usize];
        let mut new = vec![0u8; SECTOR as usize];
        fill(&mut old, 3, 5, 1);
        fill(&mut new, 3, 6, 1);
        new[256..].copy_from_slice(&old[256..]);
        assert!(matches!(classify(&new, 1), Found::Garbage { .. }));
        assert_eq!(classify(&[0u8; 512], 1), Found::Zero);
    }

    #[test]
    fn versions_encode_write_and_kind() {
        assert_eq!(Version::data(9).write(), 9);
        assert!(!Version::data(9).is_zero());
        assert!(Version::zero(9).is_zero());
        assert_ne!(Version::data(9), Version::zero(9));
        assert_eq!(Version::BASE, Version::data(0));
        assert_eq!(Version::INITIAL_ZERO, Version::zero(0));
    }
}
