//! A writer of JBD2 journals, laid out and checksummed as the kernel
//! writes them: for the property tests, the fuzz seeds and the cache's
//! tests. Not a journal implementation (no checkpointing, no reuse rules).

use crate::{
    COMMIT, DESCRIPTOR, FEATURE_64BIT, FEATURE_CSUM_V2, FEATURE_CSUM_V3, MAGIC, REVOKE,
    SUPERBLOCK_BYTES, SUPERBLOCK_V1, SUPERBLOCK_V2, Superblock, TAG_ESCAPE, TAG_LAST,
    TAG_SAME_UUID, crc32c_raw,
};

/// The UUID every built journal carries.
pub const UUID: [u8; 16] = *b"vdcache-jbd2-uid";

/// Builds a journal image block by block.
pub struct Writer {
    sb: Superblock,
    blocks: Vec<Vec<u8>>,
    at: u32,
    seq: u32,
}

fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

fn header(b: &mut [u8], block_type: u32, seq: u32) {
    put32(b, 0, MAGIC);
    put32(b, 4, block_type);
    put32(b, 8, seq);
}

impl Writer {
    /// A journal of `max_len` blocks of `block_size` bytes whose log starts
    /// at block `start` (1 for a fresh journal; later to make it wrap) with
    /// sequence `sequence`. `version` 1 has no features.
    pub fn new(
        version: u8,
        block_size: u32,
        max_len: u32,
        incompat: u32,
        start: u32,
        sequence: u32,
    ) -> Writer {
        let incompat = if version == 1 { 0 } else { incompat };
        let sb = Superblock {
            version,
            block_size,
            max_len,
            first: 1,
            sequence,
            start,
            errno: 0,
            compat: 0,
            incompat,
            ro_compat: 0,
            uuid: if version == 1 { [0; 16] } else { UUID },
            checksum_type: if incompat & (FEATURE_CSUM_V2 | FEATURE_CSUM_V3) != 0 {
                4
            } else {
                0
            },
            fc_blocks: 0,
            csum_seed: crc32c_raw(!0, &if version == 1 { [0; 16] } else { UUID }),
        };
        Writer {
            blocks: vec![vec![0u8; block_size as usize]; max_len as usize],
            at: start,
            seq: sequence,
            sb,
        }
    }

    /// The next block the log will be written to.
    pub fn position(&self) -> u32 {
        self.at
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    fn put(&mut self, b: Vec<u8>) -> u32 {
        let at = self.at;
        self.blocks[at as usize] = b;
        self.at = self.sb.next(at);
        at
    }

    fn seal_tail(&self, b: &mut [u8]) {
        if self.sb.csum_v2_or_v3() {
            let n = b.len();
            b[n - 4..].fill(0);
            let c = crc32c_raw(self.sb.csum_seed, b);
            put32(b, n - 4, c);
        }
    }

    /// Writes one transaction: descriptor blocks and the copies of
    /// `copies` (file-system block, its new content), revoke blocks for
    /// `revokes`, and a commit block when `commit`. Returns the journal
    /// block of each copy, in order.
    pub fn transaction(
        &mut self,
        copies: &[(u64, Vec<u8>)],
        revokes: &[u64],
        commit: bool,
    ) -> Vec<u32> {
        let bs = self.sb.block_size as usize;
        let tag_bytes = self.sb.tag_bytes();
        let room = bs - self.sb.tail_bytes();
        let mut placed = Vec::new();
        let mut rest = copies;
        while !rest.is_empty() {
            // Tags that fit: the first carries the UUID after it.
            let mut n = 0;
            let mut used = 12 + 16;
            while n < rest.len() && used + tag_bytes <= room {
                used += tag_bytes;
                n += 1;
            }
            let (now, later) = rest.split_at(n.max(1));
            let mut d = vec![0u8; bs];
            header(&mut d, DESCRIPTOR, self.seq);
            let mut off = 12;
            let mut datas = Vec::new();
            for (i, (target, data)) in now.iter().enumerate() {
                let mut data = data.clone();
                data.resize(bs, 0);
                let mut flags = 0;
                if data[..4] == MAGIC.to_be_bytes() {
                    data[..4].fill(0);
                    flags |= TAG_ESCAPE;
                }
                if i > 0 {
                    flags |= TAG_SAME_UUID;
                }
                if i + 1 == now.len() {
                    flags |= TAG_LAST;
                }
                let csum = self.sb.data_checksum(self.seq, &data);
                put32(&mut d, off, *target as u32);
                if self.sb.has(FEATURE_CSUM_V3) {
                    put32(&mut d, off + 4, flags);
                    put32(&mut d, off + 8, (*target >> 32) as u32);
                    put32(&mut d, off + 12, csum);
                } else {
                    if self.sb.has(FEATURE_CSUM_V2) {
                        d[off + 4..off + 6].copy_from_slice(&(csum as u16).to_be_bytes());
                    }
                    d[off + 6..off + 8].copy_from_slice(&(flags as u16).to_be_bytes());
                    if self.sb.has(FEATURE_64BIT) {
                        put32(&mut d, off + 8, (*target >> 32) as u32);
                    }
                }
                off += tag_bytes;
                if i == 0 {
                    d[off..off + 16].copy_from_slice(&self.sb.uuid);
                    off += 16;
                }
                datas.push(data);
            }
            self.seal_tail(&mut d);
            self.put(d);
            for data in datas {
                placed.push(self.put(data));
            }
            rest = later;
        }
        let record = if self.sb.has(FEATURE_64BIT) { 8 } else { 4 };
        let per_block = (room - 16) / record;
        for chunk in revokes.chunks(per_block.max(1)) {
            let mut r = vec![0u8; bs];
            header(&mut r, REVOKE, self.seq);
            put32(&mut r, 12, (16 + chunk.len() * record) as u32);
            for (i, b) in chunk.iter().enumerate() {
                let off = 16 + i * record;
                if record == 8 {
                    put32(&mut r, off, (*b >> 32) as u32);
                    put32(&mut r, off + 4, *b as u32);
                } else {
                    put32(&mut r, off, *b as u32);
                }
            }
            self.seal_tail(&mut r);
            self.put(r);
        }
        if commit {
            let mut c = vec![0u8; bs];
            header(&mut c, COMMIT, self.seq);
            if self.sb.csum_v2_or_v3() {
                let sum = crc32c_raw(self.sb.csum_seed, &c);
                put32(&mut c, 16, sum);
            }
            self.put(c);
            self.seq = self.seq.wrapping_add(1);
        }
        placed
    }

    /// The journal image: the superblock in block 0, then the log.
    pub fn finish(mut self) -> Vec<u8> {
        let sb = &self.sb;
        let b = &mut self.blocks[0];
        b.fill(0);
        header(
            b,
            if sb.version == 1 {
                SUPERBLOCK_V1
            } else {
                SUPERBLOCK_V2
            },
            0,
        );
        for (off, v) in [
            (0xC, sb.block_size),
            (0x10, sb.max_len),
            (0x14, sb.first),
            (0x18, sb.sequence),
            (0x1C, sb.start),
        ] {
            put32(b, off, v);
        }
        if sb.version == 2 {
            put32(b, 0x28, sb.incompat);
            b[0x30..0x40].copy_from_slice(&sb.uuid);
            put32(b, 0x40, 1);
            b[0x50] = sb.checksum_type;
            if sb.csum_v2_or_v3() {
                let c = crc32c_raw(!0, &b[..SUPERBLOCK_BYTES]);
                put32(b, 0xFC, c);
            }
        }
        self.blocks.concat()
    }
}
