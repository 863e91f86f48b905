//! vdcache's per-disk metadata journal, as it lies in the image file: the
//! header extension that says where the journal area is, and the records
//! in it (sync amplification, paper 003: per-virtual-disk journaling).
//!
//! The journal area is a run of clusters inside the image (so one sync of
//! the file covers guest data and journal, and the image moved anywhere
//! carries its journal). It is cut into two slots; transactions go to
//! them in turn, so writing one never touches the other, which holds the
//! previous transaction. While the area may hold updates the tables lack,
//! the image carries [`crate::features::incompatible::META_JOURNAL`].
//!
//! A record (big endian, padded with zeros to a 512-byte multiple):
//! magic u32, version u32, journal id 16 bytes, sequence u64, body length
//! u32, entry count u32, CRC-32C u32 of the header (this field zero) and
//! body, 12 reserved bytes; then the entries, each: kind u8, table u8
//! (metadata entries: which table, as the writer numbers them), 2 zero
//! bytes, length u32, offset u64, payload padded to 8 bytes. A metadata or data
//! entry's payload is `length` bytes to write at `offset` (of the image,
//! or of its data file); a checksum entry's is the CRC-32C the
//! `length` bytes of the data file at `offset` must have for the record
//! to count (no-data mode: the data itself was written in place).
//!
//! Pure format code: no I/O, no policy.

use crate::{FormatError, Result};

/// Header extension type of the journal's location ("vdj1").
pub const EXT_META_JOURNAL: u32 = 0x7664_6a31;
/// Bytes of the extension's data.
pub const EXT_BYTES: usize = 32;
/// Records start and end on multiples of this.
pub const RECORD_ALIGN: u64 = 512;
/// Bytes of a record's fixed header.
pub const RECORD_HEADER: usize = 64;
/// Bytes of a checksum.
/// Bytes of a data checksum: CRC-32C, as JBD2's block tags use to tell a
/// torn journaled block from a whole one.
pub const CHECKSUM_BYTES: usize = 4;
const RECORD_MAGIC: u32 = 0x5644_4a52;
const VERSION: u32 = 1;
const ENTRY_HEADER: usize = 16;

/// Where the journal lives and which records belong to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalExtension {
    /// Offset of the area in the image file (cluster aligned).
    pub offset: u64,
    /// Bytes of the area: two slots of half this each.
    pub size: u64,
    /// Random per journal: records of an earlier journal are not ours.
    pub id: [u8; 16],
}

impl JournalExtension {
    pub fn encode(&self) -> [u8; EXT_BYTES] {
        let mut out = [0u8; EXT_BYTES];
        out[..8].copy_from_slice(&self.offset.to_be_bytes());
        out[8..16].copy_from_slice(&self.size.to_be_bytes());
        out[16..].copy_from_slice(&self.id);
        out
    }

    pub fn decode(data: &[u8]) -> Result<JournalExtension> {
        if data.len() != EXT_BYTES {
            return Err(FormatError::invalid(
                "metadata journal extension",
                format!("is {} bytes, expected {EXT_BYTES}", data.len()),
            ));
        }
        let ext = JournalExtension {
            offset: be64(&data[..8]),
            size: be64(&data[8..16]),
            id: data[16..].try_into().unwrap_or([0; 16]),
        };
        if ext.size < 2 * RECORD_ALIGN || !ext.size.is_multiple_of(2 * RECORD_ALIGN) {
            return Err(FormatError::invalid(
                "metadata journal extension",
                format!("area size {} is not a positive multiple of 1024", ext.size),
            ));
        }
        Ok(ext)
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> u64 {
        self.size / 2
    }

    /// Offset in the file of slot `slot` (0 or 1).
    pub fn slot_offset(&self, slot: u64) -> u64 {
        self.offset + (slot % 2) * self.slot_bytes()
    }
}

/// What a record asks recovery to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Metadata bytes for the image file, and which table they belong to
    /// (a code the writer chooses; recovery writes them as that table, so
    /// a cache below treats them as it treated the original writes).
    Meta {
        offset: u64,
        table: u8,
        bytes: Vec<u8>,
    },
    /// Guest data for the data file, journaled whole (full mode).
    Data { offset: u64, bytes: Vec<u8> },
    /// Data written in place whose checksum must match (no-data mode).
    Checksum {
        offset: u64,
        len: u32,
        sum: [u8; CHECKSUM_BYTES],
    },
}

impl Entry {
    fn kind(&self) -> u8 {
        match self {
            Entry::Meta { .. } => 0,
            Entry::Data { .. } => 1,
            Entry::Checksum { .. } => 2,
        }
    }

    /// Bytes this entry takes in a record.
    pub fn encoded_len(&self) -> usize {
        ENTRY_HEADER + pad8(self.payload().len())
    }

    fn payload(&self) -> &[u8] {
        match self {
            Entry::Meta { bytes, .. } | Entry::Data { bytes, .. } => bytes,
            Entry::Checksum { sum, .. } => sum,
        }
    }

    fn offset_and_len(&self) -> (u64, u32) {
        match self {
            Entry::Meta { offset, bytes, .. } | Entry::Data { offset, bytes } => {
                (*offset, bytes.len() as u32)
            }
            Entry::Checksum { offset, len, .. } => (*offset, *len),
        }
    }
}

/// One transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub entries: Vec<Entry>,
}

/// Bytes a record with entries of `body` bytes takes, padded.
pub fn record_len(body: usize) -> u64 {
    ((RECORD_HEADER + body) as u64).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

impl Record {
    /// The record's bytes, padded to [`RECORD_ALIGN`].
    pub fn encode(&self, id: &[u8; 16]) -> Vec<u8> {
        let body: usize = self.entries.iter().map(Entry::encoded_len).sum();
        let mut out = Vec::with_capacity(record_len(body) as usize);
        out.extend_from_slice(&RECORD_MAGIC.to_be_bytes());
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.extend_from_slice(id);
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&(body as u32).to_be_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_be_bytes());
        out.resize(RECORD_HEADER, 0);
        for e in &self.entries {
            let (offset, len) = e.offset_and_len();
            out.push(e.kind());
            out.push(match e {
                Entry::Meta { table, .. } => *table,
                _ => 0,
            });
            out.extend_from_slice(&[0; 2]);
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(e.payload());
            out.resize(pad8(out.len()), 0);
        }
        let crc = crc32c::crc32c(&out);
        out[40..44].copy_from_slice(&crc.to_be_bytes());
        out.resize(record_len(body) as usize, 0);
        out
    }

    /// How many bytes the record whose header starts `head` (at least
    /// [`RECORD_HEADER`] bytes) takes, if the header is one of journal
    /// `id` (nothing is checked beyond the header): what recovery must
    /// read of a slot.
    pub fn stored_len(head: &[u8], id: &[u8; 16]) -> Option<usize> {
        if head.len() < RECORD_HEADER
            || be32(&head[..4]) != RECORD_MAGIC
            || be32(&head[4..8]) != VERSION
            || &head[8..24] != id
        {
            return None;
        }
        RECORD_HEADER.checked_add(be32(&head[32..36]) as usize)
    }

    /// The record at the start of `buf` if it is a whole, intact record of
    /// journal `id`; `None` for anything else (empty, torn, another
    /// journal's), since a crash may leave any of those in a slot.
    pub fn decode(buf: &[u8], id: &[u8; 16]) -> Option<Record> {
        let end = Self::stored_len(buf, id)?;
        let seq = be64(&buf[24..32]);
        let body = end - RECORD_HEADER;
        let count = be32(&buf[36..40]) as usize;
        if end > buf.len() {
            return None;
        }
        let mut check = buf[..end].to_vec();
        check[40..44].fill(0);
        if crc32c::crc32c(&check) != be32(&buf[40..44]) {
            return None;
        }
        let mut entries = Vec::with_capacity(count.min(body / ENTRY_HEADER));
        let mut pos = RECORD_HEADER;
        for _ in 0..count {
            let (entry, next) = decode_entry(&buf[..end], pos)?;
            entries.push(entry);
            pos = next;
        }
        (pos == end).then_some(Record { seq, entries })
    }
}

fn decode_entry(buf: &[u8], pos: usize) -> Option<(Entry, usize)> {
    let head = buf.get(pos..pos.checked_add(ENTRY_HEADER)?)?;
    let kind = head[0];
    let len = be32(&head[4..8]);
    let offset = be64(&head[8..16]);
    let payload_len = if kind == 2 {
        CHECKSUM_BYTES
    } else {
        len as usize
    };
    let start = pos + ENTRY_HEADER;
    let payload = buf.get(start..start.checked_add(payload_len)?)?;
    let next = start.checked_add(pad8(payload_len))?;
    if next > buf.len() || offset.checked_add(u64::from(len)).is_none() {
        return None;
    }
    let entry = match kind {
        0 => Entry::Meta {
            offset,
            table: head[1],
            bytes: payload.to_vec(),
        },
        1 => Entry::Data {
            offset,
            bytes: payload.to_vec(),
        },
        2 => Entry::Checksum {
            offset,
            len,
            sum: payload.try_into().ok()?,
        },
        _ => return None,
    };
    Some((entry, next))
}

fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            seq: 7,
            entries: vec![
                Entry::Meta {
                    offset: 0x3_0000,
                    table: 2,
                    bytes: vec![1; 512],
                },
                Entry::Data {
                    offset: 0x5_0200,
                    bytes: vec![2; 5],
                },
                Entry::Checksum {
                    offset: 0x6_0000,
                    len: 4096,
                    sum: [3; CHECKSUM_BYTES],
                },
            ],
        }
    }

    #[test]
    fn a_record_round_trips_padded() {
        let id = [9u8; 16];
        let bytes = sample().encode(&id);
        assert_eq!(bytes.len() as u64 % RECORD_ALIGN, 0);
        assert_eq!(Record::decode(&bytes, &id), Some(sample()));
    }

    #[test]
    fn a_torn_or_foreign_record_is_not_one() {
        let id = [9u8; 16];
        let bytes = sample().encode(&id);
        assert_eq!(Record::decode(&bytes, &[8u8; 16]), None);
        for cut in [0, 63, 64, 600] {
            assert_eq!(Record::decode(&bytes[..cut], &id), None, "cut at {cut}");
        }
        for flip in [30, 100, 520, 580] {
            let mut bad = bytes.clone();
            bad[flip] ^= 1;
            assert_eq!(Record::decode(&bad, &id), None, "flip at {flip}");
        }
    }

    #[test]
    fn the_extension_round_trips_and_refuses_a_bad_size() {
        let ext = JournalExtension {
            offset: 0x10_0000,
            size: 1 << 20,
            id: [4; 16],
        };
        assert_eq!(JournalExtension::decode(&ext.encode()), Ok(ext));
        let odd = JournalExtension { size: 1000, ..ext };
        assert!(JournalExtension::decode(&odd.encode()).is_err());
        assert!(JournalExtension::decode(&[0; 8]).is_err());
    }
}
