//! What a replayed read returns of a block the replay never wrote. The
//! stores hold only what the replay wrote: elsewhere a raw disk reads as
//! zeros and a qcow2 base as a pattern of the offset, the same on every
//! disk. Without dedup no figure depends on it; with dedup the content
//! decides what flash holds, and every unwritten block reading as zeros
//! would share one cache block. So, with dedup on, before a read the
//! replay seeds each block it has not written, discarded or seeded yet:
//! it writes into the disk's bottom store ([`Rig::seed`]: beneath the
//! cache, unmetered) the bytes the trace says the read returns (its
//! content digests, stamped as a write of the same digests would be, for
//! reads aligned to 4 KiB), or, without digests, bytes unique to the disk
//! and block (the FIU writer's convention for unknown content).
//!
//! Owns: which blocks are seeded and with what. Must not: seed a block the
//! replay wrote or discarded (the disk's content is then the replay's), or
//! count a seed as I/O. Memory: one bit per 4 KiB block the replay set,
//! in pages of 16 MiB of a disk (see `blocks`), plus the seeded blocks in
//! the stores.

use crate::blocks::BlockSet;
use crate::rig::{Rig, RigError};
use std::collections::BTreeMap;
use vdcache_eval::TraceRecord;
use vdcache_eval::trace::CONTENT_BLOCK;
use vdcache_eval::trace::fiu::address_digest;

/// Fills a block with a 16-byte stamp, repeated: equal stamps, equal
/// blocks.
pub(crate) fn stamp_block(block: &mut [u8], stamp: &[u8; 16]) {
    for piece in block.chunks_mut(16) {
        piece.copy_from_slice(&stamp[..piece.len()]);
    }
}

/// Blocks of each disk whose content the replay set (written, discarded or
/// seeded).
#[derive(Debug, Default)]
pub(crate) struct Seeder {
    known: BTreeMap<u32, BlockSet>,
    buf: Vec<u8>,
    /// Blocks seeded so far.
    pub seeded_blocks: u64,
}

impl Seeder {
    /// Marks `block` of `disk` known; whether it was not before.
    fn learn(&mut self, disk: u32, block: u64) -> bool {
        self.known.entry(disk).or_default().insert(block)
    }

    /// The replay writes or discards `[offset, offset + len)` of `disk`.
    pub(crate) fn written(&mut self, disk: u32, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for b in offset / CONTENT_BLOCK..(offset + len).div_ceil(CONTENT_BLOCK) {
            self.learn(disk, b);
        }
    }

    /// Before `rec` reads its first `len` bytes: seeds the blocks it
    /// touches that the replay never set.
    pub(crate) fn before_read(
        &mut self,
        rig: &Rig,
        rec: &TraceRecord,
        len: u64,
    ) -> Result<(), RigError> {
        if len == 0 {
            return Ok(());
        }
        let aligned = rec.offset.is_multiple_of(CONTENT_BLOCK);
        let first = rec.offset / CONTENT_BLOCK;
        for b in first..(rec.offset + len).div_ceil(CONTENT_BLOCK) {
            if !self.learn(rec.disk, b) {
                continue;
            }
            let digest = rec
                .content
                .as_ref()
                .filter(|_| aligned)
                .and_then(|c| c.get((b - first) as usize));
            let stamp = match digest {
                Some(d) => *d,
                None => address_digest(rec.disk, b * CONTENT_BLOCK),
            };
            self.buf.resize(CONTENT_BLOCK as usize, 0);
            stamp_block(&mut self.buf, &stamp);
            rig.seed(rec.disk, b * CONTENT_BLOCK, &self.buf)?;
            self.seeded_blocks += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_learnt_once() {
        let mut s = Seeder::default();
        s.written(3, 4096, 8192);
        assert!(!s.learn(3, 1) && !s.learn(3, 2));
        assert!(s.learn(3, 0) && s.learn(3, 3) && s.learn(4, 1));
        assert!(!s.learn(3, 0));
        s.written(5, 100, 0);
        assert!(s.learn(5, 0));
    }
}
