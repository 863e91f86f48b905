//! vdcache-jbd2: the on-disk format of JBD2, the journal of ext3/ext4 (and
//! ocfs2), parsed the way the kernel's recovery scan reads it: the journal
//! superblock (v1 and v2), descriptor blocks (32- and 64-bit block numbers,
//! plain, csum v2 and csum v3 tags, the escape and same-UUID flags), commit
//! blocks, revoke blocks, and the walk of the circular log from its start,
//! wrapping at its end. It tells which file-system block each journal
//! block holds a copy of: what journal-aware caching (JCache) needs to map
//! an in-place write onto the journal copy already in flash.
//!
//! Owns: parsing, checksum verification (crc32c, as the kernel computes
//! it), and [`build`], a writer of journals for tests and fuzz seeds.
//! Must not: do I/O (the caller hands blocks in), depend on the cache, or
//! panic or map a block wrongly on any input: a malformed block is a
//! [`Jbd2Error`].

pub mod build;
pub mod fuzzing;
mod scan;

pub use scan::{Copy, Log, Transaction, scan};

/// The magic number at the start of every JBD2 metadata block.
pub const MAGIC: u32 = 0xC03B_3998;

/// Block types of the common header.
pub const DESCRIPTOR: u32 = 1;
pub const COMMIT: u32 = 2;
pub const SUPERBLOCK_V1: u32 = 3;
pub const SUPERBLOCK_V2: u32 = 4;
pub const REVOKE: u32 = 5;

/// Incompatible feature bits.
pub const FEATURE_REVOKE: u32 = 0x1;
pub const FEATURE_64BIT: u32 = 0x2;
pub const FEATURE_ASYNC_COMMIT: u32 = 0x4;
pub const FEATURE_CSUM_V2: u32 = 0x8;
pub const FEATURE_CSUM_V3: u32 = 0x10;
pub const FEATURE_FAST_COMMIT: u32 = 0x20;
const KNOWN_INCOMPAT: u32 = FEATURE_REVOKE
    | FEATURE_64BIT
    | FEATURE_ASYNC_COMMIT
    | FEATURE_CSUM_V2
    | FEATURE_CSUM_V3
    | FEATURE_FAST_COMMIT;

/// Tag flags.
pub const TAG_ESCAPE: u32 = 0x1;
pub const TAG_SAME_UUID: u32 = 0x2;
pub const TAG_DELETED: u32 = 0x4;
pub const TAG_LAST: u32 = 0x8;

/// Size of the superblock structure the v2 checksum covers.
pub const SUPERBLOCK_BYTES: usize = 1024;
/// Offset of the superblock's checksum.
const SB_CHECKSUM: usize = 0xFC;
/// Fast-commit blocks when the superblock says 0.
const DEFAULT_FC_BLOCKS: u32 = 256;
/// crc32c, the only checksum type of csum v2/v3.
const CHECKSUM_CRC32C: u8 = 4;

/// Why a journal or one of its blocks cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Jbd2Error {
    #[error("journal superblock: {0}")]
    Superblock(String),
    #[error("journal block {block}: {reason}")]
    Block { block: u32, reason: String },
    #[error("journal block {block}: {what} checksum {found:#x}, computed {computed:#x}")]
    Checksum {
        block: u32,
        what: &'static str,
        found: u32,
        computed: u32,
    },
    #[error("journal block {0} is outside the journal (or was not handed in)")]
    Missing(u32),
}

fn be32(b: &[u8], off: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[off..off + 4]);
    u32::from_be_bytes(x)
}

fn be16(b: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([b[off], b[off + 1]])
}

/// The kernel's crc32c: seeded, without the final inversion.
pub fn crc32c_raw(seed: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!seed, data)
}

/// The 12-byte header every metadata block starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub block_type: u32,
    pub sequence: u32,
}

impl Header {
    /// The header of `block`, if it starts with the JBD2 magic.
    pub fn of(block: &[u8]) -> Option<Header> {
        (block.len() >= 12 && be32(block, 0) == MAGIC).then(|| Header {
            block_type: be32(block, 4),
            sequence: be32(block, 8),
        })
    }
}

/// The journal superblock (block 0 of the journal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// 1 or 2.
    pub version: u8,
    pub block_size: u32,
    /// Blocks in the journal, the superblock included.
    pub max_len: u32,
    /// First block of the log.
    pub first: u32,
    /// Sequence of the first transaction expected at `start`.
    pub sequence: u32,
    /// First block of the log's live part; 0 when the journal is empty.
    pub start: u32,
    pub errno: i32,
    pub compat: u32,
    pub incompat: u32,
    pub ro_compat: u32,
    pub uuid: [u8; 16],
    pub checksum_type: u8,
    pub fc_blocks: u32,
    /// crc32c of the UUID: the seed of every csum v2/v3 checksum.
    pub csum_seed: u32,
}

impl Superblock {
    /// Parses and validates block 0 of a journal (at least the first 1024
    /// bytes of it; the whole block is not needed).
    pub fn parse(b: &[u8]) -> Result<Superblock, Jbd2Error> {
        let bad = |m: String| Jbd2Error::Superblock(m);
        if b.len() < SUPERBLOCK_BYTES {
            return Err(bad(format!(
                "{} bytes, a superblock needs {SUPERBLOCK_BYTES}",
                b.len()
            )));
        }
        let h = Header::of(b).ok_or_else(|| bad("no JBD2 magic".into()))?;
        let version = match h.block_type {
            SUPERBLOCK_V1 => 1,
            SUPERBLOCK_V2 => 2,
            t => return Err(bad(format!("block type {t} is not a superblock"))),
        };
        let block_size = be32(b, 0xC);
        if !(1024..=65536).contains(&block_size) || !block_size.is_power_of_two() {
            return Err(bad(format!("block size {block_size}")));
        }
        let (max_len, first, sequence, start) =
            (be32(b, 0x10), be32(b, 0x14), be32(b, 0x18), be32(b, 0x1C));
        let errno = be32(b, 0x20) as i32;
        let (compat, incompat, ro_compat) = if version == 2 {
            (be32(b, 0x24), be32(b, 0x28), be32(b, 0x2C))
        } else {
            (0, 0, 0)
        };
        if incompat & !KNOWN_INCOMPAT != 0 {
            return Err(bad(format!(
                "unknown incompatible features {:#x}",
                incompat & !KNOWN_INCOMPAT
            )));
        }
        if incompat & FEATURE_CSUM_V2 != 0 && incompat & FEATURE_CSUM_V3 != 0 {
            return Err(bad("both csum v2 and csum v3".into()));
        }
        let mut uuid = [0u8; 16];
        if version == 2 {
            uuid.copy_from_slice(&b[0x30..0x40]);
        }
        let checksum_type = if version == 2 { b[0x50] } else { 0 };
        let fc_blocks = match (incompat & FEATURE_FAST_COMMIT != 0, be32(b, 0x54)) {
            (false, _) => 0,
            (true, 0) => DEFAULT_FC_BLOCKS,
            (true, n) => n,
        };
        let sb = Superblock {
            version,
            block_size,
            max_len,
            first,
            sequence,
            start,
            errno,
            compat,
            incompat,
            ro_compat,
            uuid,
            checksum_type,
            fc_blocks,
            csum_seed: crc32c_raw(!0, &uuid),
        };
        let end = sb.log_end();
        if first == 0 || end <= first || max_len < 2 {
            return Err(bad(format!(
                "log blocks {first}..{end} of {max_len} (fast-commit blocks {fc_blocks})"
            )));
        }
        if start != 0 && !(first..end).contains(&start) {
            return Err(bad(format!("start {start} outside the log {first}..{end}")));
        }
        if sb.csum_v2_or_v3() {
            if checksum_type != CHECKSUM_CRC32C {
                return Err(bad(format!("checksum type {checksum_type}, not crc32c")));
            }
            let mut copy = b[..SUPERBLOCK_BYTES].to_vec();
            copy[SB_CHECKSUM..SB_CHECKSUM + 4].fill(0);
            let computed = crc32c_raw(!0, &copy);
            let found = be32(b, SB_CHECKSUM);
            if computed != found {
                return Err(Jbd2Error::Checksum {
                    block: 0,
                    what: "superblock",
                    found,
                    computed,
                });
            }
        }
        Ok(sb)
    }

    pub fn has(&self, incompat: u32) -> bool {
        self.incompat & incompat != 0
    }

    pub fn csum_v2_or_v3(&self) -> bool {
        self.has(FEATURE_CSUM_V2 | FEATURE_CSUM_V3)
    }

    /// One past the last block of the circular log (fast-commit blocks,
    /// at the end of the journal, are not part of it).
    pub fn log_end(&self) -> u32 {
        self.max_len.saturating_sub(self.fc_blocks)
    }

    /// Bytes of one descriptor tag (without the UUID that may follow).
    pub fn tag_bytes(&self) -> usize {
        if self.has(FEATURE_CSUM_V3) {
            return 16;
        }
        let mut n = 12;
        if self.has(FEATURE_CSUM_V2) {
            n += 2;
        }
        if self.has(FEATURE_64BIT) { n } else { n - 4 }
    }

    /// Bytes at the end of descriptor and revoke blocks holding their
    /// checksum.
    pub fn tail_bytes(&self) -> usize {
        if self.csum_v2_or_v3() { 4 } else { 0 }
    }

    /// The log block after `block`, wrapping at the end of the log.
    pub fn next(&self, block: u32) -> u32 {
        let n = block.wrapping_add(1);
        if n >= self.log_end() { self.first } else { n }
    }

    /// Checks that block `at` of the log is one whole block, and verifies
    /// its tail checksum (a descriptor or revoke block's).
    fn check_block(&self, at: u32, b: &[u8], what: &'static str) -> Result<(), Jbd2Error> {
        if b.len() != self.block_size as usize {
            return Err(Jbd2Error::Block {
                block: at,
                reason: format!("{} bytes, blocks are {}", b.len(), self.block_size),
            });
        }
        if !self.csum_v2_or_v3() {
            return Ok(());
        }
        let n = b.len();
        let found = be32(b, n - 4);
        let mut copy = b.to_vec();
        copy[n - 4..].fill(0);
        let computed = crc32c_raw(self.csum_seed, &copy);
        if found != computed {
            return Err(Jbd2Error::Checksum {
                block: at,
                what,
                found,
                computed,
            });
        }
        Ok(())
    }

    /// The checksum a tag carries for `data` logged in transaction
    /// `sequence` (csum v3: all 32 bits; v2: the low 16).
    pub fn data_checksum(&self, sequence: u32, data: &[u8]) -> u32 {
        let c = crc32c_raw(self.csum_seed, &sequence.to_be_bytes());
        let c = crc32c_raw(c, data);
        if self.has(FEATURE_CSUM_V3) {
            c
        } else {
            c & 0xFFFF
        }
    }
}

/// One tag of a descriptor block: the file-system block whose new content
/// is the journal block at the tag's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// File-system block number.
    pub target: u64,
    pub flags: u32,
    /// The data checksum (csum v2: 16 bits, v3: 32 bits; else 0).
    pub checksum: u32,
}

impl Tag {
    /// The journal copy had its first four bytes (the JBD2 magic) zeroed.
    pub fn escaped(&self) -> bool {
        self.flags & TAG_ESCAPE != 0
    }
}

/// Parses the tags of a descriptor block (`at` is its journal block number,
/// for errors). The header's magic and type are the caller's to check.
pub fn parse_descriptor(sb: &Superblock, at: u32, b: &[u8]) -> Result<Vec<Tag>, Jbd2Error> {
    let bad = |reason: String| Jbd2Error::Block { block: at, reason };
    sb.check_block(at, b, "descriptor")?;
    let tag_bytes = sb.tag_bytes();
    let end = b.len() - sb.tail_bytes();
    let mut off = 12;
    let mut tags = Vec::new();
    let mut first = true;
    loop {
        if off + tag_bytes > end {
            if tags.is_empty() {
                return Err(bad("a descriptor without tags".into()));
            }
            // The kernel ends the tag list where the space ends.
            return Ok(tags);
        }
        let low = u64::from(be32(b, off));
        let (flags, high, checksum) = if sb.has(FEATURE_CSUM_V3) {
            (be32(b, off + 4), be32(b, off + 8), be32(b, off + 12))
        } else {
            let checksum = if sb.has(FEATURE_CSUM_V2) {
                u32::from(be16(b, off + 4))
            } else {
                0
            };
            let high = if sb.has(FEATURE_64BIT) {
                be32(b, off + 8)
            } else {
                0
            };
            (u32::from(be16(b, off + 6)), high, checksum)
        };
        let high = if sb.has(FEATURE_64BIT) {
            u64::from(high)
        } else {
            0
        };
        off += tag_bytes;
        if flags & TAG_SAME_UUID == 0 {
            if !first {
                // One journal serves one file system: a second UUID is
                // not something the kernel writes.
                return Err(bad(format!("tag {} carries a UUID of its own", tags.len())));
            }
            off += 16;
            if off > end {
                return Err(bad("the first tag's UUID runs past the block".into()));
            }
        } else if first {
            return Err(bad("the first tag says 'same UUID'".into()));
        }
        first = false;
        tags.push(Tag {
            target: low | high << 32,
            flags,
            checksum,
        });
        if flags & TAG_LAST != 0 {
            return Ok(tags);
        }
    }
}

/// Parses the block numbers of a revoke block.
pub fn parse_revoke(sb: &Superblock, at: u32, b: &[u8]) -> Result<Vec<u64>, Jbd2Error> {
    let bad = |reason: String| Jbd2Error::Block { block: at, reason };
    sb.check_block(at, b, "revoke")?;
    let count = be32(b, 12) as usize;
    let room = b.len() - sb.tail_bytes();
    let record = if sb.has(FEATURE_64BIT) { 8 } else { 4 };
    if count < 16 || count > room || !(count - 16).is_multiple_of(record) {
        return Err(bad(format!(
            "revoke byte count {count} (16 to {room}, records of {record})"
        )));
    }
    Ok(b[16..count]
        .chunks_exact(record)
        .map(|r| {
            if record == 8 {
                u64::from(be32(r, 0)) << 32 | u64::from(be32(r, 4))
            } else {
                u64::from(be32(r, 0))
            }
        })
        .collect())
}

/// Whether a commit block's checksum holds (always, without csum v2/v3).
pub fn commit_checksum_ok(sb: &Superblock, b: &[u8]) -> bool {
    if !sb.csum_v2_or_v3() || b.len() < 20 {
        return true;
    }
    let found = be32(b, 16);
    let mut copy = b.to_vec();
    copy[16..20].fill(0);
    crc32c_raw(sb.csum_seed, &copy) == found
}

/// Puts the magic back into a journal copy whose tag says it was escaped.
pub fn unescape(block: &mut [u8]) {
    if block.len() >= 4 {
        block[..4].copy_from_slice(&MAGIC.to_be_bytes());
    }
}
