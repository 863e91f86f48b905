//! The checksums a metadata journal record carries for guest data its
//! interval wrote in place (no-data mode): recovery replays the record
//! only if the data still matches them.
//!
//! A piece never crosses a 4 KiB boundary. A piece of whole sectors also
//! keeps each sector's checksum, so a later write of the same interval
//! over part of it (another 4 KiB write into a cluster this interval
//! allocated) can replace the checksums of the sectors it covers and keep
//! the rest: the record then vouches for exactly the bytes in place.
//!
//! This module owns that bookkeeping. It must not decide where a write
//! goes, nor read or write anything (the journal does both).

use crate::hostio::WriteSegment;
use std::collections::BTreeMap;
use vdcache_qcow2::meta_journal::{CHECKSUM_BYTES, Entry};

/// Checksums cover data in pieces that never cross one of these.
const PIECE: u64 = 4096;
/// The unit a piece can be cut at: whole sectors, the unit writes land
/// (and tear) in.
use crate::SECTOR;

/// A record's checksum of a piece of data.
pub(crate) type Sum = [u8; CHECKSUM_BYTES];

/// CRC-32C's polynomial, bit-reversed (the register shifts right).
const POLY: u32 = 0x82f6_3b78;

/// The linear map that takes the CRC-32C of `A` to its contribution to the
/// CRC-32C of `A` followed by a sector (`crc(AB) = shift(crc(A)) ^
/// crc(B)`, as in zlib's crc32_combine): column `i` is the image of bit
/// `i`, i.e. 4,096 zero bits shifted through the register. Computed at
/// build time, so a piece's checksum comes from its sectors' in 7 cheap
/// steps instead of a second pass over its bytes.
const SECTOR_SHIFT: [u32; 32] = {
    let mut columns = [0u32; 32];
    let mut i = 0;
    while i < 32 {
        let mut reg = 1u32 << i;
        let mut bit = 0;
        while bit < SECTOR * 8 {
            reg = if reg & 1 == 1 {
                (reg >> 1) ^ POLY
            } else {
                reg >> 1
            };
            bit += 1;
        }
        columns[i] = reg;
        i += 1;
    }
    columns
};

/// The CRC-32C of `A` followed by a sector whose CRC-32C is `sector`.
fn append_sector(crc: u32, sector: u32) -> u32 {
    let (mut bits, mut shifted) = (crc, 0);
    while bits != 0 {
        shifted ^= SECTOR_SHIFT[bits.trailing_zeros() as usize];
        bits &= bits - 1;
    }
    shifted ^ sector
}

/// A checksummed piece of data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) sum: Sum,
    /// Each sector's CRC-32C, when the piece is whole sectors.
    sectors: Option<SectorSums>,
}

/// The CRC-32C of each sector of a piece (a piece holds at most
/// `PIECE / SECTOR` of them); kept inline, as pieces are many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SectorSums {
    count: u8,
    crcs: [u32; (PIECE / SECTOR) as usize],
}

impl SectorSums {
    fn of(data: &[u8]) -> SectorSums {
        let mut sums = SectorSums {
            count: 0,
            crcs: [0; (PIECE / SECTOR) as usize],
        };
        for (slot, sector) in sums.crcs.iter_mut().zip(data.chunks(SECTOR as usize)) {
            *slot = crc32c::crc32c(sector);
            sums.count += 1;
        }
        sums
    }

    fn of_one(crc: u32) -> SectorSums {
        let mut crcs = [0; (PIECE / SECTOR) as usize];
        crcs[0] = crc;
        SectorSums { count: 1, crcs }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.crcs[..usize::from(self.count)].iter().copied()
    }

    /// The CRC-32C of all the sectors together.
    fn combined(&self) -> u32 {
        let mut all = self.iter();
        let first = all.next().unwrap_or(0);
        all.fold(first, append_sector)
    }
}

impl Piece {
    /// The piece of `data` at `start`.
    fn of(start: u64, data: &[u8]) -> Piece {
        let end = start + data.len() as u64;
        let whole_sectors = start.is_multiple_of(SECTOR) && end.is_multiple_of(SECTOR);
        if !whole_sectors || data.is_empty() || data.len() as u64 > PIECE {
            return Piece {
                start,
                end,
                sum: crc32c::crc32c(data).to_be_bytes(),
                sectors: None,
            };
        }
        let sectors = SectorSums::of(data);
        Piece {
            start,
            end,
            sum: sectors.combined().to_be_bytes(),
            sectors: Some(sectors),
        }
    }

    fn overlaps(&self, at: u64, end: u64) -> bool {
        self.start < end && at < self.end
    }

    /// What is left of this piece outside `[at, end)`, a piece per
    /// sector; `None` if it cannot be cut there (no sector checksums, or
    /// a cut inside a sector).
    fn outside(&self, at: u64, end: u64) -> Option<Vec<Piece>> {
        let keep = |s: u64| s < at || s >= end;
        if !self.overlaps(at, end) {
            return Some(vec![self.clone()]);
        }
        let cuts_cleanly = |x: u64| x <= self.start || x >= self.end || x.is_multiple_of(SECTOR);
        if at <= self.start && end >= self.end {
            return Some(Vec::new());
        }
        let sectors = self.sectors?;
        if !cuts_cleanly(at) || !cuts_cleanly(end) {
            return None;
        }
        Some(
            sectors
                .iter()
                .enumerate()
                .map(|(i, crc)| (self.start + i as u64 * SECTOR, crc))
                .filter(|&(s, _)| keep(s))
                .map(|(s, crc)| Piece {
                    start: s,
                    end: s + SECTOR,
                    sum: crc.to_be_bytes(),
                    sectors: Some(SectorSums::of_one(crc)),
                })
                .collect(),
        )
    }
}

/// The checksummed pieces of a write of `segments` at `at`.
pub(crate) fn pieces(at: u64, segments: &[WriteSegment<'_>]) -> Vec<Piece> {
    let mut out = Vec::new();
    // The bytes of the piece being gathered, when it spans segments.
    let mut gathered: Vec<u8> = Vec::new();
    let mut pos = at;
    for seg in segments {
        let mut data = seg.data;
        while !data.is_empty() {
            let piece_end = (pos / PIECE + 1) * PIECE;
            let take = data.len().min((piece_end - pos) as usize);
            let (part, rest) = data.split_at(take);
            data = rest;
            pos += take as u64;
            if pos < piece_end {
                gathered.extend_from_slice(part);
            } else if gathered.is_empty() {
                out.push(Piece::of(pos - take as u64, part));
            } else {
                gathered.extend_from_slice(part);
                out.push(Piece::of(pos - gathered.len() as u64, &gathered));
                gathered.clear();
            }
        }
    }
    if !gathered.is_empty() {
        out.push(Piece::of(pos - gathered.len() as u64, &gathered));
    }
    out
}

/// Pieces by their start; no two overlap.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sums(BTreeMap<u64, Piece>);

impl Sums {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pieces overlapping `[at, end)`.
    fn overlapping(&self, at: u64, end: u64) -> impl Iterator<Item = &Piece> {
        self.0
            .range(..end)
            .rev()
            .map(|(_, p)| p)
            .take_while(move |p| p.end > at)
    }

    /// Whether any piece overlaps `[at, end)`.
    pub(crate) fn touches(&self, at: u64, end: u64) -> bool {
        self.overlapping(at, end).next().is_some()
    }

    /// Whether new pieces of `[at, end)` can replace what they cover:
    /// every piece they cover in part can be cut at their edges.
    pub(crate) fn can_replace(&self, at: u64, end: u64) -> bool {
        self.overlapping(at, end)
            .all(|p| p.outside(at, end).is_some())
    }

    /// `[at, end)` widened to the whole pieces it overlaps.
    pub(crate) fn extent(&self, at: u64, end: u64) -> (u64, u64) {
        self.overlapping(at, end)
            .fold((at, end), |(a, e), p| (a.min(p.start), e.max(p.end)))
    }

    /// Adds `piece`, replacing the checksums of what it covers. Returns
    /// the span of a piece it covered in part and could not cut (its
    /// checksum is dropped: the bytes there must be checksummed anew).
    pub(crate) fn put(&mut self, piece: Piece) -> Option<(u64, u64)> {
        let (at, end) = (piece.start, piece.end);
        let covered: Vec<u64> = self.overlapping(at, end).map(|p| p.start).collect();
        let mut uncut: Option<(u64, u64)> = None;
        for start in covered {
            let Some(old) = self.0.remove(&start) else {
                continue;
            };
            match old.outside(at, end) {
                Some(rest) => self.0.extend(rest.into_iter().map(|p| (p.start, p))),
                None => {
                    let (a, e) = uncut.unwrap_or((old.start, old.end));
                    uncut = Some((a.min(old.start), e.max(old.end)));
                }
            }
        }
        self.0.insert(at, piece);
        uncut
    }

    /// Drops the pieces of freed clusters: nothing maps them once the
    /// record is durable, and they may be discarded after.
    pub(crate) fn drop_freed(&mut self, freed: &[u64], cluster: u64) {
        if !freed.is_empty() {
            let freed: std::collections::HashSet<u64> = freed.iter().copied().collect();
            self.0.retain(|s, _| !freed.contains(&(s / cluster)));
        }
    }

    /// Moves `other`'s pieces in, where they do not overlap this one's
    /// (this one is newer).
    pub(crate) fn absorb_older(&mut self, other: Sums) {
        for (start, p) in other.0 {
            if !self.touches(p.start, p.end) {
                self.0.insert(start, p);
            }
        }
    }

    /// Every piece's span.
    pub(crate) fn spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.values().map(|p| (p.start, p.end))
    }

    /// The record entries of these checksums.
    pub(crate) fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.0.values().map(|p| Entry::Checksum {
            offset: p.start,
            len: (p.end - p.start) as u32,
            sum: p.sum,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostio::{DiskId, IoClass, IoTag};

    fn segment(data: &[u8]) -> WriteSegment<'_> {
        WriteSegment {
            data,
            tag: IoTag {
                class: IoClass::GuestData,
                disk: DiskId(0),
                guest_cluster: None,
                unit: None,
            },
        }
    }

    fn sum_of(data: &[u8]) -> Sum {
        crc32c::crc32c(data).to_be_bytes()
    }

    #[test]
    fn a_piece_sum_built_from_its_sectors_is_the_crc_of_its_bytes() {
        let mut x = 0x1234_5678_u32;
        let bytes: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        let got = pieces(0x7000, &[segment(&bytes)]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].sum, sum_of(&bytes));
        for k in [1, 7, 0xdead_beef] {
            assert_eq!(append_sector(k, 0), crc32c::crc32c_combine(k, 0, 512));
        }
    }

    #[test]
    fn pieces_end_at_4k_boundaries_across_segments() {
        let (a, b, c) = (vec![1u8; 1000], vec![2u8; 5000], vec![3u8; 3000]);
        let got = pieces(0x10200, &[segment(&a), segment(&b), segment(&c)]);
        let all: Vec<u8> = [a, b, c].concat();
        let spans: Vec<(u64, u64)> = got.iter().map(|p| (p.start, p.end)).collect();
        assert_eq!(
            spans,
            vec![(0x10200, 0x11000), (0x11000, 0x12000), (0x12000, 0x12528)]
        );
        for p in &got {
            let bytes = &all[(p.start - 0x10200) as usize..(p.end - 0x10200) as usize];
            assert_eq!(p.sum, sum_of(bytes));
        }
        assert!(got[0].sectors.is_some() && got[1].sectors.is_some());
        assert!(got[2].sectors.is_none(), "ends inside a sector");
    }

    /// The checksums a record would carry, as (offset, len, sum).
    fn entries(s: &Sums) -> Vec<(u64, u32, Sum)> {
        s.entries()
            .map(|e| match e {
                Entry::Checksum { offset, len, sum } => (offset, len, sum),
                other => panic!("not a checksum: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_write_over_part_of_a_piece_keeps_the_rest_checksummed() {
        let mut disk = vec![7u8; 8192];
        disk[100] = 1;
        let mut s = Sums::default();
        for p in pieces(0x40000, &[segment(&disk)]) {
            assert_eq!(s.put(p), None);
        }
        let new = vec![9u8; 1536];
        assert!(s.can_replace(0x40a00, 0x41000));
        for p in pieces(0x40a00, &[segment(&new)]) {
            assert_eq!(s.put(p), None);
        }
        disk[0xa00..0x1000].copy_from_slice(&new);
        // Every checksum the record carries matches the bytes in place,
        // and together they cover all of them once.
        let mut covered = 0;
        for (offset, len, sum) in entries(&s) {
            let at = (offset - 0x40000) as usize;
            assert_eq!(sum, sum_of(&disk[at..at + len as usize]), "at {offset:#x}");
            covered += len;
        }
        assert_eq!(covered, 8192);
        assert_eq!(
            s.spans().count(),
            5 + 1 + 1,
            "five sectors kept, the write, the untouched piece"
        );
    }

    #[test]
    fn a_piece_that_cannot_be_cut_is_reported_not_kept() {
        let mut s = Sums::default();
        let odd = vec![5u8; 4000];
        for p in pieces(0x40000, &[segment(&odd)]) {
            s.put(p);
        }
        assert!(!s.can_replace(0x40200, 0x40400), "no sector checksums");
        let over = pieces(0x40200, &[segment(&[6u8; 512])]);
        assert_eq!(s.put(over[0].clone()), Some((0x40000, 0x40fa0)));
        assert_eq!(entries(&s).len(), 1, "only the new piece is vouched for");
        let mut aligned = Sums::default();
        aligned.put(pieces(0x50000, &[segment(&[5u8; 4096])])[0].clone());
        assert!(
            !aligned.can_replace(0x50010, 0x50400),
            "a cut inside a sector"
        );
        assert!(aligned.can_replace(0x50200, 0x50400));
    }

    #[test]
    fn an_older_set_fills_in_only_where_the_newer_has_nothing() {
        let mut newer = Sums::default();
        newer.put(pieces(0x1000, &[segment(&[1u8; 4096])])[0].clone());
        let mut older = Sums::default();
        older.put(pieces(0x1000, &[segment(&[2u8; 4096])])[0].clone());
        older.put(pieces(0x3000, &[segment(&[3u8; 4096])])[0].clone());
        newer.absorb_older(older);
        let got = entries(&newer);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].2, sum_of(&[1u8; 4096]));
        assert_eq!(got[1].2, sum_of(&[3u8; 4096]));
    }

    #[test]
    fn freed_clusters_lose_their_pieces() {
        let mut s = Sums::default();
        for p in pieces(0x10000, &[segment(&[1u8; 0x20000])]) {
            s.put(p);
        }
        s.drop_freed(&[1], 0x10000);
        assert!(s.spans().all(|(a, _)| a >= 0x20000));
        assert_eq!(s.spans().count(), 16);
    }
}
