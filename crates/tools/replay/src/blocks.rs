//! A set of 4 KiB block numbers, one bit each, kept in pages made only
//! where a trace goes: the scan's working set and the seeder's known
//! blocks cost memory with what a trace touches, not with how far apart
//! its disks and offsets are (a dense bitmap of a disk addressed at 1 TiB
//! took 32 MiB before its first block was counted).

use std::collections::HashMap;

/// Blocks per page: 512 bytes of bits cover 16 MiB of a disk.
const PAGE_BLOCKS: u64 = 4096;
const PAGE_WORDS: usize = (PAGE_BLOCKS / 64) as usize;

/// Memory of one page and its table entry, roughly (what
/// [`BlockSet::memory_bytes`] counts).
pub const PAGE_BYTES: u64 = PAGE_WORDS as u64 * 8 + 32;

/// A sparse set of block numbers.
#[derive(Debug, Clone, Default)]
pub struct BlockSet {
    pages: HashMap<u64, Box<[u64; PAGE_WORDS]>>,
    len: u64,
}

impl BlockSet {
    /// Adds `block`; whether it was not in the set.
    pub fn insert(&mut self, block: u64) -> bool {
        let page = self
            .pages
            .entry(block / PAGE_BLOCKS)
            .or_insert_with(|| Box::new([0; PAGE_WORDS]));
        let at = block % PAGE_BLOCKS;
        let (word, bit) = ((at / 64) as usize, 1u64 << (at % 64));
        let new = page[word] & bit == 0;
        page[word] |= bit;
        self.len += u64::from(new);
        new
    }

    /// Blocks in the set.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Memory the set holds, roughly.
    pub fn memory_bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn far_apart_blocks_cost_a_page_each() {
        let mut s = BlockSet::default();
        assert!(s.insert(0) && s.insert(1 << 40) && s.insert(5));
        assert!(!s.insert(1 << 40) && !s.insert(0));
        assert_eq!(s.len(), 3);
        assert_eq!(s.memory_bytes(), 2 * PAGE_BYTES);
    }
}
