//! The virtual cache map (paper 000, section 4.1): one line per (image,
//! 64 KiB of the image), holding the guest line number, the cache block
//! numbers of the blocks present, and the present / dirty / partially
//! valid bitmaps; plus, per cache block, the line that owns it (so a region
//! can be emptied) and a reference count (so several addresses may share
//! one block, for dedup and journal-aware caching).
//!
//! Lines live in a slab; a hash table of slab indices finds them by key,
//! so each line's key is stored once. The index never does I/O.

use crate::layout::LINE_BLOCKS;
use hashbrown::DefaultHashBuilder;
use hashbrown::HashTable;
use std::hash::BuildHasher;

/// A cache block number in the data zone.
pub type Cbn = u32;

/// One reference to a cache block: the (line, slot) holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef(u32);

impl BlockRef {
    fn new(line: u32, slot: usize) -> BlockRef {
        BlockRef((line << 4) | slot as u32)
    }
}
/// No block.
pub const NO_BLOCK: Cbn = u32::MAX;
const NO_OWNER: u32 = u32::MAX;

/// Key of a line: image id (16 bits) and line number (48 bits).
pub fn line_key(image: u16, line: u64) -> u64 {
    (u64::from(image) << 48) | (line & ((1 << 48) - 1))
}

pub fn key_image(key: u64) -> u16 {
    (key >> 48) as u16
}

pub fn key_line(key: u64) -> u64 {
    key & ((1 << 48) - 1)
}

/// One entry of the virtual cache map (84 bytes: packed to 4-byte
/// alignment so that the u64 key costs no padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, packed(4))]
pub struct Line {
    pub key: u64,
    /// Guest cluster number the line serves (low 32 bits, as COWCache's
    /// GCN); tells snapshots of one guest address apart.
    pub guest: u32,
    pub present: u16,
    pub dirty: u16,
    /// Partially valid (dcow) bitmap: blocks of a delta cluster that hold
    /// no data yet (filled from the base on read).
    pub partial: u16,
    pub cbn: [Cbn; LINE_BLOCKS as usize],
}

impl Line {
    fn empty(key: u64, guest: u64) -> Line {
        Line {
            key,
            guest: guest as u32,
            present: 0,
            dirty: 0,
            partial: 0,
            cbn: [NO_BLOCK; LINE_BLOCKS as usize],
        }
    }
}

/// Lines per slab chunk: the slab grows a chunk at a time, so at most one
/// chunk is allocated but unused.
const CHUNK: usize = 1024;

/// Line storage that grows in fixed chunks (a `Vec` doubling would waste
/// up to half of the largest part of the index).
#[derive(Default)]
struct Slab {
    chunks: Vec<Box<[Line]>>,
    len: usize,
}

impl Slab {
    fn push(&mut self, line: Line) -> u32 {
        if self.len == self.chunks.len() * CHUNK {
            self.chunks.push(vec![line; CHUNK].into_boxed_slice());
        }
        let i = self.len;
        self.chunks[i / CHUNK][i % CHUNK] = line;
        self.len += 1;
        i as u32
    }

    fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<Line>()
    }
}

impl std::ops::Index<usize> for Slab {
    type Output = Line;
    fn index(&self, i: usize) -> &Line {
        &self.chunks[i / CHUNK][i % CHUNK]
    }
}

impl std::ops::IndexMut<usize> for Slab {
    fn index_mut(&mut self, i: usize) -> &mut Line {
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }
}

/// The map plus per-block owners and reference counts.
pub struct Index {
    lines: Slab,
    free_lines: Vec<u32>,
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
    /// Per cache block: owning line index << 4 | slot, or NO_OWNER.
    owners: Vec<u32>,
    /// Per shared cache block: the references beyond `owners`.
    shared: hashbrown::HashMap<Cbn, Vec<u32>>,
    live_lines: usize,
    dirty_blocks: u64,
    present_blocks: u64,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("lines", &self.live_lines)
            .field("present_blocks", &self.present_blocks)
            .field("dirty_blocks", &self.dirty_blocks)
            .finish()
    }
}

impl Index {
    pub fn new(data_blocks: u64) -> Index {
        Index {
            lines: Slab::default(),
            free_lines: Vec::new(),
            table: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            owners: vec![NO_OWNER; data_blocks as usize],
            shared: hashbrown::HashMap::new(),
            live_lines: 0,
            dirty_blocks: 0,
            present_blocks: 0,
        }
    }

    fn hash(&self, key: u64) -> u64 {
        self.hasher.hash_one(key)
    }

    fn find(&self, key: u64) -> Option<u32> {
        let lines = &self.lines;
        self.table
            .find(self.hash(key), |&i| lines[i as usize].key == key)
            .copied()
    }

    pub fn get(&self, key: u64) -> Option<&Line> {
        self.find(key).map(|i| &self.lines[i as usize])
    }

    /// The block a slot maps to, if present.
    pub fn block(&self, key: u64, slot: usize) -> Option<Cbn> {
        self.get(key)
            .filter(|l| l.present & (1 << slot) != 0)
            .map(|l| l.cbn[slot])
    }

    fn get_or_insert(&mut self, key: u64, guest: u64) -> u32 {
        if let Some(i) = self.find(key) {
            return i;
        }
        let line = Line::empty(key, guest);
        let idx = match self.free_lines.pop() {
            Some(i) => {
                self.lines[i as usize] = line;
                i
            }
            None => self.lines.push(line),
        };
        let h = self.hash(key);
        let (lines, hasher) = (&self.lines, &self.hasher);
        self.table
            .insert_unique(h, idx, |&i| hasher.hash_one(lines[i as usize].key));
        self.live_lines += 1;
        idx
    }

    fn drop_line_if_empty(&mut self, idx: u32) {
        let line = self.lines[idx as usize];
        if line.present != 0 || line.partial != 0 {
            return;
        }
        let h = self.hash(line.key);
        let lines = &self.lines;
        if let Ok(entry) = self
            .table
            .find_entry(h, |&i| lines[i as usize].key == line.key)
        {
            entry.remove();
        }
        self.free_lines.push(idx);
        self.live_lines -= 1;
    }

    /// Maps a slot to `cbn`, returning the block it replaces and the
    /// reference to release with [`Index::release`].
    pub fn map(
        &mut self,
        key: u64,
        guest: u64,
        slot: usize,
        cbn: Cbn,
        dirty: bool,
    ) -> Option<(Cbn, BlockRef)> {
        let idx = self.get_or_insert(key, guest);
        let line = &mut self.lines[idx as usize];
        // A partially valid line keeps the guest cluster it was allocated
        // for: filling it depends on that.
        if line.partial == 0 {
            line.guest = guest as u32;
        }
        let bit = 1u16 << slot;
        let old = (line.present & bit != 0).then_some((line.cbn[slot], BlockRef::new(idx, slot)));
        if old.is_none() {
            self.present_blocks += 1;
        }
        if line.dirty & bit != 0 {
            self.dirty_blocks -= 1;
        }
        line.present |= bit;
        line.cbn[slot] = cbn;
        if dirty {
            line.dirty |= bit;
            self.dirty_blocks += 1;
        } else {
            line.dirty &= !bit;
        }
        self.take_reference(cbn, idx, slot);
        old
    }

    fn take_reference(&mut self, cbn: Cbn, idx: u32, slot: usize) {
        let r = BlockRef::new(idx, slot).0;
        let owner = &mut self.owners[cbn as usize];
        if *owner == NO_OWNER {
            *owner = r;
        } else {
            self.shared.entry(cbn).or_default().push(r);
        }
    }

    /// Drops one reference to a block; true when the block is now free.
    pub fn release(&mut self, cbn: Cbn, r: BlockRef) -> bool {
        let owner = &mut self.owners[cbn as usize];
        let extras = self.shared.get_mut(&cbn);
        match extras {
            None => {
                *owner = NO_OWNER;
                true
            }
            Some(list) => {
                if *owner == r.0 {
                    *owner = list.pop().unwrap_or(NO_OWNER);
                } else {
                    list.retain(|&x| x != r.0);
                }
                if list.is_empty() {
                    self.shared.remove(&cbn);
                }
                false
            }
        }
    }

    /// Removes a slot; returns its block, whether it was dirty, and the
    /// reference to release.
    pub fn unmap(&mut self, key: u64, slot: usize) -> Option<(Cbn, bool, BlockRef)> {
        let idx = self.find(key)?;
        let line = &mut self.lines[idx as usize];
        let bit = 1u16 << slot;
        if line.present & bit == 0 {
            return None;
        }
        let dirty = line.dirty & bit != 0;
        line.present &= !bit;
        line.dirty &= !bit;
        let cbn = line.cbn[slot];
        line.cbn[slot] = NO_BLOCK;
        self.present_blocks -= 1;
        if dirty {
            self.dirty_blocks -= 1;
        }
        self.drop_line_if_empty(idx);
        Some((cbn, dirty, BlockRef::new(idx, slot)))
    }

    /// Marks a slot clean if it still maps to `cbn`.
    pub fn mark_clean(&mut self, key: u64, slot: usize, cbn: Cbn) -> bool {
        let Some(idx) = self.find(key) else {
            return false;
        };
        let line = &mut self.lines[idx as usize];
        let bit = 1u16 << slot;
        if line.present & bit == 0 || line.cbn[slot] != cbn || line.dirty & bit == 0 {
            return false;
        }
        line.dirty &= !bit;
        self.dirty_blocks -= 1;
        true
    }

    /// Sets the partially valid bitmap of a line (creating it if needed);
    /// `guest` replaces the line's guest cluster when given.
    pub fn set_partial(&mut self, key: u64, guest: Option<u64>, mask: u16) {
        let idx = self.get_or_insert(key, guest.unwrap_or(u64::MAX));
        let line = &mut self.lines[idx as usize];
        line.partial = mask;
        if let Some(g) = guest {
            line.guest = g as u32;
        }
        self.drop_line_if_empty(idx);
    }

    /// The (key, slot) a block belongs to, if any.
    pub fn owner(&self, cbn: Cbn) -> Option<(u64, usize)> {
        let o = self.owners[cbn as usize];
        (o != NO_OWNER).then(|| (self.lines[(o >> 4) as usize].key, (o & 15) as usize))
    }

    pub fn is_shared(&self, cbn: Cbn) -> bool {
        self.shared.contains_key(&cbn)
    }

    pub fn dirty_blocks(&self) -> u64 {
        self.dirty_blocks
    }

    pub fn present_blocks(&self) -> u64 {
        self.present_blocks
    }

    pub fn line_count(&self) -> usize {
        self.live_lines
    }

    /// Every live line (for checkpoints and scans).
    pub fn lines(&self) -> impl Iterator<Item = &Line> {
        let lines = &self.lines;
        self.table.iter().map(move |&i| &lines[i as usize])
    }

    /// Bytes of memory the index uses (lines, table, owners, shares).
    pub fn memory_bytes(&self) -> u64 {
        let lines = self.lines.bytes();
        let table = self.table.capacity() * (std::mem::size_of::<u32>() + 1);
        let owners = self.owners.capacity() * std::mem::size_of::<u32>();
        let shared = self.shared.capacity() * (std::mem::size_of::<(Cbn, Vec<u32>)>() + 1)
            + self
                .shared
                .values()
                .map(|v| v.capacity() * 4)
                .sum::<usize>();
        let free = self.free_lines.capacity() * std::mem::size_of::<u32>();
        (lines + table + owners + shared + free) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_unmap_and_owner_tracking() {
        let mut ix = Index::new(64);
        let k = line_key(3, 77);
        assert_eq!(key_image(k), 3);
        assert_eq!(key_line(k), 77);
        assert_eq!(ix.map(k, 5, 2, 10, true), None);
        assert_eq!(ix.map(k, 5, 3, 11, false), None);
        assert_eq!(ix.dirty_blocks(), 1);
        assert_eq!(ix.owner(10), Some((k, 2)));
        let (old, r) = ix.map(k, 5, 2, 12, false).unwrap();
        assert_eq!(old, 10);
        assert!(ix.release(10, r));
        assert_eq!(ix.owner(10), None);
        assert_eq!(ix.dirty_blocks(), 0);
        assert!(!ix.mark_clean(k, 2, 12));
        assert_eq!(ix.unmap(k, 3).map(|u| (u.0, u.1)), Some((11, false)));
        assert_eq!(ix.unmap(k, 2).map(|u| (u.0, u.1)), Some((12, false)));
        assert!(ix.get(k).is_none());
        assert_eq!(ix.line_count(), 0);
    }

    #[test]
    fn shared_blocks_count_references() {
        let mut ix = Index::new(8);
        let (a, b) = (line_key(1, 0), line_key(2, 0));
        ix.map(a, 0, 0, 4, false);
        ix.map(b, 0, 0, 4, false);
        assert!(ix.is_shared(4));
        let (_, _, ra) = ix.unmap(a, 0).unwrap();
        assert!(!ix.release(4, ra));
        assert_eq!(ix.owner(4), Some((b, 0)));
        let (_, _, rb) = ix.unmap(b, 0).unwrap();
        assert!(ix.release(4, rb));
    }

    #[test]
    fn memory_per_dense_line_is_small() {
        let mut ix = Index::new(16 * 10_000);
        for l in 0..10_000u64 {
            for s in 0..16 {
                ix.map(line_key(1, l), l, s, (l * 16 + s as u64) as u32, false);
            }
        }
        let cached = 10_000u64 * 16 * 4096;
        let ratio = ix.memory_bytes() as f64 / cached as f64;
        assert!(ratio < 0.0025, "index memory {ratio:.5} of cached bytes");
    }
}
