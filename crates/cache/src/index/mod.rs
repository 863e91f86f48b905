//! The virtual cache map (paper 000, section 4.1): one line per (image,
//! 64 KiB of the image), holding the guest line number, the cache block
//! numbers of the blocks present, and the present / dirty / partially
//! valid bitmaps; plus reference counts (so several addresses may share
//! one block, for dedup and journal-aware caching): one bit per cache
//! block says it is referenced, and blocks with more than one reference
//! list the others.
//!
//! A line takes one of two forms. A full line lives in a slab; a hash
//! table of slab indices finds it by key, so its key is stored once. A
//! line with at most [`SPARSE_MAX`] blocks, nothing partially valid and no
//! block referenced twice is a sparse line instead ([`sparse`]): a 7-byte
//! word per block and no guest cluster number (only partially valid lines
//! use it), because a full line for one block costs about 1% of the block.
//! Lines move between the forms as they gain and lose blocks. The way back
//! from a block to its line (to empty a region) is the region summaries
//! ([`crate::summary`]), recorded here when a block gets its first
//! reference. The index never does I/O.

mod shared;
mod sparse;

use crate::layout::LINE_BLOCKS;
use crate::summary::Summaries;
use hashbrown::DefaultHashBuilder;
use hashbrown::HashTable;
use shared::SharedRefs;
pub use sparse::SPARSE_MAX;
use sparse::{Entry, SparseLine, SparseTable, Upsert};
use std::hash::BuildHasher;
use vdcache_contract::{CacheBlock, ImageId, LineKey};

/// A cache block number in the data zone: the raw form of
/// [`vdcache_contract::CacheBlock`], which the cache's interfaces speak.
pub type Cbn = u32;

/// One reference to a cache block: the (line, slot) holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef(u32);

impl BlockRef {
    fn new(line: u32, slot: usize) -> BlockRef {
        BlockRef((line << 4) | slot as u32)
    }

    /// The reference of a sparse line's block: always a block's first
    /// reference (a block referenced again makes its line full), so it is
    /// never among a shared block's other references.
    const SPARSE: BlockRef = BlockRef(u32::MAX);
}

/// Guest cluster number of a line that does not record one (sparse lines).
pub const NO_GUEST: u64 = u32::MAX as u64;
/// No block.
pub const NO_BLOCK: Cbn = CacheBlock::NONE.0;

/// Key of a line, raw: image id (16 bits) and line number (48 bits), as
/// [`LineKey`] packs them.
pub fn line_key(image: u16, line: u64) -> u64 {
    LineKey::new(ImageId(image), line).0
}

pub fn key_image(key: u64) -> u16 {
    LineKey(key).image().0
}

pub fn key_line(key: u64) -> u64 {
    LineKey(key).line()
}

/// One entry of the virtual cache map (24 bytes: packed to 4-byte
/// alignment so that the u64 key costs no padding). The cache block
/// numbers of the present blocks live in the index's block pool, in slot
/// order, in an array just big enough for them: a line with two blocks
/// costs two block numbers, not sixteen.
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
    /// Size class of the line's block array, [`NO_CLASS`] when it has none.
    class: u8,
    /// Array number within the class.
    at: u32,
}

const NO_CLASS: u8 = u8::MAX;

impl Line {
    fn empty(key: u64, guest: u64) -> Line {
        Line {
            key,
            guest: guest as u32,
            present: 0,
            dirty: 0,
            partial: 0,
            class: NO_CLASS,
            at: 0,
        }
    }

    /// Position of `slot`'s block in the line's array.
    fn rank(&self, slot: usize) -> usize {
        (self.present & ((1u16 << slot) - 1)).count_ones() as usize
    }
}

/// A line with its block numbers, as the index hands it out.
#[derive(Debug, Clone, Copy)]
pub struct LineRef<'a> {
    line: Line,
    cbns: Blocks<'a>,
}

/// Block numbers of the present slots, in slot order.
#[derive(Debug, Clone, Copy)]
enum Blocks<'a> {
    Full(&'a [Cbn]),
    Sparse([Cbn; SPARSE_MAX]),
}

impl std::ops::Deref for LineRef<'_> {
    type Target = Line;
    fn deref(&self) -> &Line {
        &self.line
    }
}

impl<'a> LineRef<'a> {
    fn sparse(s: SparseLine) -> LineRef<'a> {
        let mut line = Line::empty(s.key, NO_GUEST);
        line.present = s.present;
        line.dirty = s.dirty;
        LineRef {
            line,
            cbns: Blocks::Sparse(s.cbns),
        }
    }

    fn cbn_list(&self) -> &[Cbn] {
        let n = self.line.present.count_ones() as usize;
        match &self.cbns {
            Blocks::Full(a) => a,
            Blocks::Sparse(a) => &a[..n],
        }
    }

    /// The block of `slot`, or [`NO_BLOCK`] when the slot is not present.
    pub fn cbn(&self, slot: usize) -> Cbn {
        if self.line.present & (1 << slot) == 0 {
            return NO_BLOCK;
        }
        self.cbn_list()[self.line.rank(slot)]
    }

    /// (slot, block) of every present slot, in slot order.
    pub fn blocks(&self) -> impl Iterator<Item = (usize, Cbn)> + '_ {
        let present = self.line.present;
        (0..LINE_BLOCKS as usize)
            .filter(move |s| present & (1 << s) != 0)
            .zip(self.cbn_list().iter().copied())
    }
}

/// Items per slab chunk: storage grows a chunk at a time, so at most one
/// chunk per slab is allocated but unused.
const CHUNK: usize = 64;

/// Storage that grows in fixed chunks (a `Vec` doubling would waste up to
/// half of the largest part of the index). Item `i` is the `width`
/// elements starting at `i * width`.
struct Slab<T> {
    chunks: Vec<Box<[T]>>,
    width: usize,
    len: usize,
    fill: T,
}

impl<T: Copy> Slab<T> {
    fn new(width: usize, fill: T) -> Slab<T> {
        Slab {
            chunks: Vec::new(),
            width,
            len: 0,
            fill,
        }
    }

    /// Removes the last item, releasing a chunk once two are unused (one
    /// is kept, so a line moving back and forth does not churn).
    fn pop(&mut self) {
        self.len = self.len.saturating_sub(1);
        if self.chunks.len() > self.len.div_ceil(CHUNK) + 1 {
            self.chunks.pop();
        }
    }

    /// Appends a new item (filled); returns its number.
    fn grow(&mut self) -> u32 {
        if self.len == self.chunks.len() * CHUNK {
            self.chunks
                .push(vec![self.fill; CHUNK * self.width].into_boxed_slice());
        }
        self.len += 1;
        (self.len - 1) as u32
    }

    fn item(&self, i: u32) -> &[T] {
        let i = i as usize;
        let at = (i % CHUNK) * self.width;
        &self.chunks[i / CHUNK][at..at + self.width]
    }

    fn item_mut(&mut self, i: u32) -> &mut [T] {
        let i = i as usize;
        let at = (i % CHUNK) * self.width;
        &mut self.chunks[i / CHUNK][at..at + self.width]
    }

    fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * self.width * std::mem::size_of::<T>()
    }
}

/// Array sizes of the block pool: a line with n blocks uses the smallest
/// class that holds n (exactly up to 8 blocks; at most one entry in ten
/// unused beyond).
const CLASSES: [usize; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16];

fn class_for(n: usize) -> u8 {
    CLASSES
        .iter()
        .position(|&c| c >= n)
        .unwrap_or(CLASSES.len() - 1) as u8
}

/// Block number arrays of one size class, kept dense: a freed array is
/// replaced by the last one, so lines that grew through the smaller sizes
/// (random writes fill a line a block at a time) leave nothing behind.
struct PoolClass {
    arrays: Slab<Cbn>,
    /// The line owning each array.
    owners: Slab<u32>,
}

/// Block number arrays of every size class.
struct BlockPool {
    classes: Vec<PoolClass>,
}

impl BlockPool {
    fn new() -> BlockPool {
        BlockPool {
            classes: CLASSES
                .iter()
                .map(|&w| PoolClass {
                    arrays: Slab::new(w, NO_BLOCK),
                    owners: Slab::new(1, 0),
                })
                .collect(),
        }
    }

    /// A new array of `class` for line `owner`.
    fn alloc(&mut self, class: u8, owner: u32) -> u32 {
        let c = &mut self.classes[class as usize];
        let at = c.arrays.grow();
        c.owners.grow();
        c.owners.item_mut(at)[0] = owner;
        at
    }

    /// Frees array `at` of `class`. The last array moves into its place:
    /// returns its owner, whose line must now point at `at`.
    #[must_use]
    fn free(&mut self, class: u8, at: u32) -> Option<u32> {
        let c = &mut self.classes[class as usize];
        let last = c.arrays.len.checked_sub(1)? as u32;
        let moved = (at != last).then(|| {
            let mut tmp = [NO_BLOCK; LINE_BLOCKS as usize];
            let width = c.arrays.width;
            tmp[..width].copy_from_slice(c.arrays.item(last));
            c.arrays.item_mut(at).copy_from_slice(&tmp[..width]);
            let owner = c.owners.item(last)[0];
            c.owners.item_mut(at)[0] = owner;
            owner
        });
        c.arrays.pop();
        c.owners.pop();
        moved
    }

    fn array(&self, class: u8, at: u32) -> &[Cbn] {
        if class == NO_CLASS {
            return &[];
        }
        self.classes[class as usize].arrays.item(at)
    }

    fn array_mut(&mut self, class: u8, at: u32) -> &mut [Cbn] {
        self.classes[class as usize].arrays.item_mut(at)
    }

    fn bytes(&self) -> usize {
        self.classes
            .iter()
            .map(|c| c.arrays.bytes() + c.owners.bytes())
            .sum()
    }
}

/// The map plus reference counts and region summaries.
pub struct Index {
    lines: Slab<Line>,
    free_lines: Vec<u32>,
    pool: BlockPool,
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
    /// One bit per cache block: referenced by at least one slot.
    referenced: Vec<u64>,
    /// Blocks with more than one reference: the references beyond the
    /// first.
    shared: SharedRefs,
    /// For partially valid blocks some of whose 512-byte sectors the guest
    /// already wrote: (line key, slot) to the bitmap of valid sectors. A
    /// partially valid block without an entry has no valid sector. Only
    /// the edges of unaligned writes into fresh delta clusters get one.
    valid_sectors: hashbrown::HashMap<(u64, u8), u8>,
    summaries: Summaries,
    sparse: SparseTable,
    live_lines: usize,
    dirty: DirtyCount,
    present_blocks: u64,
    /// Per region, references to its blocks beyond each block's first:
    /// how many more addresses the region serves than it holds blocks
    /// (dedup-aware replacement weighs it).
    extra_refs: Vec<u32>,
    blocks_per_region: u32,
    /// Bits set in `referenced`.
    referenced_count: u64,
    /// Memory sized by the device, held however little is cached.
    fixed_bytes: u64,
}

/// Dirty blocks, in all and of held images.
#[derive(Debug, Default)]
struct DirtyCount {
    all: u64,
    held: u64,
    /// One bit per image id; empty while no image is held.
    held_images: Vec<u64>,
}

impl DirtyCount {
    fn is_held(&self, image: u16) -> bool {
        self.held_images
            .get(usize::from(image) / 64)
            .is_some_and(|w| w & (1 << (image % 64)) != 0)
    }

    fn add(&mut self, key: u64, n: u64) {
        self.all += n;
        if self.is_held(key_image(key)) {
            self.held += n;
        }
    }

    fn sub(&mut self, key: u64, n: u64) {
        self.all -= n;
        if self.is_held(key_image(key)) {
            self.held -= n;
        }
    }

    /// Holds `image` (whose lines have `dirty` dirty blocks now), or
    /// releases it.
    fn set_held(&mut self, image: u16, held: bool, dirty: u64) {
        if self.held_images.is_empty() {
            self.held_images = vec![0; (1 << 16) / 64];
        }
        let word = &mut self.held_images[usize::from(image) / 64];
        if held {
            *word |= 1 << (image % 64);
            self.held += dirty;
        } else {
            *word &= !(1 << (image % 64));
            self.held -= dirty;
        }
    }
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("lines", &self.live_lines)
            .field("present_blocks", &self.present_blocks)
            .field("dirty_blocks", &self.dirty.all)
            .finish()
    }
}

impl Index {
    pub fn new(regions: u32, blocks_per_region: u32) -> Index {
        let data_blocks = u64::from(regions) * u64::from(blocks_per_region);
        let mut index = Index {
            lines: Slab::new(1, Line::empty(0, 0)),
            free_lines: Vec::new(),
            pool: BlockPool::new(),
            table: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            referenced: vec![0; data_blocks.div_ceil(64) as usize],
            shared: SharedRefs::new(),
            valid_sectors: hashbrown::HashMap::new(),
            summaries: Summaries::new(regions, blocks_per_region),
            sparse: SparseTable::new(data_blocks),
            live_lines: 0,
            dirty: DirtyCount::default(),
            present_blocks: 0,
            extra_refs: vec![0; regions as usize],
            blocks_per_region: blocks_per_region.max(1),
            referenced_count: 0,
            fixed_bytes: 0,
        };
        index.fixed_bytes = index.memory_bytes();
        index
    }

    fn hash(&self, key: u64) -> u64 {
        self.hasher.hash_one(key)
    }

    fn line(&self, idx: u32) -> &Line {
        &self.lines.item(idx)[0]
    }

    fn line_mut(&mut self, idx: u32) -> &mut Line {
        &mut self.lines.item_mut(idx)[0]
    }

    fn view(&self, idx: u32) -> LineRef<'_> {
        let line = *self.line(idx);
        let n = line.present.count_ones() as usize;
        LineRef {
            line,
            cbns: Blocks::Full(&self.pool.array(line.class, line.at)[..n]),
        }
    }

    fn find(&self, key: u64) -> Option<u32> {
        self.table
            .find(self.hash(key), |&i| self.line(i).key == key)
            .copied()
    }

    pub fn get(&self, key: u64) -> Option<LineRef<'_>> {
        if let Some(i) = self.find(key) {
            return Some(self.view(i));
        }
        let s = self.sparse.line(key);
        (s.present != 0).then(|| LineRef::sparse(s))
    }

    /// The block a slot maps to, if present.
    pub fn block(&self, key: u64, slot: usize) -> Option<Cbn> {
        match self.find(key) {
            Some(i) => Some(self.view(i))
                .filter(|l| l.present & (1 << slot) != 0)
                .map(|l| l.cbn(slot)),
            None => self.sparse.get(key, slot).map(|(cbn, _)| cbn),
        }
    }

    fn get_or_insert(&mut self, key: u64, guest: u64) -> u32 {
        if let Some(i) = self.find(key) {
            return i;
        }
        let idx = self.free_lines.pop().unwrap_or_else(|| self.lines.grow());
        *self.line_mut(idx) = Line::empty(key, guest);
        let h = self.hash(key);
        let (lines, hasher) = (&self.lines, &self.hasher);
        self.table
            .insert_unique(h, idx, |&i| hasher.hash_one(lines.item(i)[0].key));
        self.live_lines += 1;
        idx
    }

    /// After a full line lost blocks or its partially valid ones: drops it
    /// when nothing is left, makes it sparse when it may be.
    fn settle(&mut self, idx: u32) {
        let line = *self.line(idx);
        if line.present == 0 && line.partial == 0 {
            self.free_line(idx);
        } else {
            self.try_make_sparse(idx);
        }
    }

    fn free_line(&mut self, idx: u32) {
        let line = *self.line(idx);
        self.free_array(line.class, line.at);
        let h = self.hash(line.key);
        let lines = &self.lines;
        if let Ok(entry) = self
            .table
            .find_entry(h, |&i| lines.item(i)[0].key == line.key)
        {
            entry.remove();
        }
        self.free_lines.push(idx);
        self.live_lines -= 1;
    }

    /// Moves a full line into the sparse table when it may be sparse (few
    /// blocks, nothing partially valid, no block referenced twice) and its
    /// blocks fit there.
    fn try_make_sparse(&mut self, idx: u32) {
        let l = self.view(idx);
        let n = l.present.count_ones() as usize;
        if n > SPARSE_MAX || l.partial != 0 || !sparse::fits(l.key) {
            return;
        }
        let mut entries = [Entry {
            key: l.key,
            slot: 0,
            cbn: NO_BLOCK,
            dirty: false,
        }; SPARSE_MAX];
        for (e, (slot, cbn)) in entries.iter_mut().zip(l.blocks()) {
            e.slot = slot;
            e.cbn = cbn;
            e.dirty = l.dirty & (1 << slot) != 0;
        }
        let entries = &entries[..n];
        if entries.iter().any(|e| self.is_shared(e.cbn)) {
            return;
        }
        self.resize_sparse();
        let placed = entries.iter().take_while(|e| self.sparse.insert(e)).count();
        if placed < n {
            for e in &entries[..placed] {
                self.sparse.remove(e.key, e.slot);
            }
            return;
        }
        self.line_mut(idx).present = 0;
        self.free_line(idx);
    }

    /// Makes a line full (moving its sparse blocks, if any, into it).
    fn make_full(&mut self, key: u64, guest: u64) -> u32 {
        if let Some(idx) = self.find(key) {
            return idx;
        }
        let entries = self.sparse.take_line(key);
        let idx = self.get_or_insert(key, guest);
        for e in entries {
            self.add_full_block(idx, &e);
        }
        idx
    }

    fn add_full_block(&mut self, idx: u32, e: &Entry) {
        self.insert_block(idx, e.slot, e.cbn);
        if e.dirty {
            self.line_mut(idx).dirty |= 1 << e.slot;
        }
    }

    /// Grows or shrinks the sparse table when it is too full or too empty;
    /// lines with a block that no longer fits become full lines.
    fn resize_sparse(&mut self) {
        let Some(homes) = self.sparse.wanted_homes() else {
            return;
        };
        for e in self.sparse.rebuild(homes) {
            let idx = self.make_full(e.key, NO_GUEST);
            self.add_full_block(idx, &e);
        }
    }

    /// Maps a slot of a line that is not full as a sparse block; `None`
    /// when the line must become full for it (too many blocks, the block
    /// is referenced already, or no room).
    fn map_sparse(&mut self, e: &Entry) -> Option<Option<(Cbn, BlockRef)>> {
        if self.is_referenced(e.cbn) {
            return None;
        }
        self.resize_sparse();
        let old = match self.sparse.upsert(e, SPARSE_MAX) {
            Upsert::Refused => return None,
            Upsert::Replaced(old, was_dirty) => {
                self.dirty.sub(e.key, u64::from(was_dirty));
                Some((old, BlockRef::SPARSE))
            }
            Upsert::Added => {
                self.present_blocks += 1;
                None
            }
        };
        self.dirty.add(e.key, u64::from(e.dirty));
        self.take_first_reference(e.cbn, e.key, e.slot);
        Some(old)
    }

    /// Moves a line's blocks into an array of `class` (or none), keeping
    /// the first `keep` of them.
    fn resize_blocks(&mut self, idx: u32, class: u8, keep: usize) {
        let line = *self.line(idx);
        if class == line.class {
            return;
        }
        let at = if class == NO_CLASS {
            0
        } else {
            let at = self.pool.alloc(class, idx);
            if line.class != NO_CLASS {
                let old: [Cbn; LINE_BLOCKS as usize] = {
                    let mut a = [NO_BLOCK; LINE_BLOCKS as usize];
                    let src = self.pool.array(line.class, line.at);
                    a[..src.len()].copy_from_slice(src);
                    a
                };
                self.pool.array_mut(class, at)[..keep].copy_from_slice(&old[..keep]);
            }
            at
        };
        self.free_array(line.class, line.at);
        let l = self.line_mut(idx);
        l.class = class;
        l.at = at;
    }

    /// Frees a line's block array (if it has one), re-pointing the line
    /// whose array moved into its place.
    fn free_array(&mut self, class: u8, at: u32) {
        if class == NO_CLASS {
            return;
        }
        if let Some(owner) = self.pool.free(class, at) {
            self.line_mut(owner).at = at;
        }
    }

    /// Inserts `cbn` for a slot that is not present yet.
    fn insert_block(&mut self, idx: u32, slot: usize, cbn: Cbn) {
        let line = *self.line(idx);
        let n = line.present.count_ones() as usize;
        if line.class == NO_CLASS || CLASSES[line.class as usize] < n + 1 {
            self.resize_blocks(idx, class_for(n + 1), n);
        }
        let line = *self.line(idx);
        let rank = line.rank(slot);
        let arr = self.pool.array_mut(line.class, line.at);
        arr.copy_within(rank..n, rank + 1);
        arr[rank] = cbn;
        self.line_mut(idx).present |= 1 << slot;
    }

    /// Removes a present slot's block, shrinking the array when a smaller
    /// class holds the rest.
    fn remove_block(&mut self, idx: u32, slot: usize) -> Cbn {
        let line = *self.line(idx);
        let n = line.present.count_ones() as usize;
        let rank = line.rank(slot);
        let arr = self.pool.array_mut(line.class, line.at);
        let cbn = arr[rank];
        arr.copy_within(rank + 1..n, rank);
        self.line_mut(idx).present &= !(1 << slot);
        let class = if n == 1 { NO_CLASS } else { class_for(n - 1) };
        if class != line.class {
            self.resize_blocks(idx, class, n - 1);
        }
        cbn
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
        let idx = match self.find(key) {
            Some(idx) => idx,
            None => {
                let e = Entry {
                    key,
                    slot,
                    cbn,
                    dirty,
                };
                if let Some(old) = self.map_sparse(&e) {
                    return old;
                }
                self.make_full(key, guest)
            }
        };
        let line = *self.line(idx);
        let bit = 1u16 << slot;
        let old = if line.present & bit != 0 {
            let arr = self.pool.array_mut(line.class, line.at);
            let old = std::mem::replace(&mut arr[line.rank(slot)], cbn);
            Some((old, BlockRef::new(idx, slot)))
        } else {
            self.insert_block(idx, slot, cbn);
            self.present_blocks += 1;
            None
        };
        if line.dirty & bit != 0 {
            self.dirty.sub(key, 1);
        }
        if dirty {
            self.dirty.add(key, 1);
        }
        let l = self.line_mut(idx);
        // A partially valid line keeps the guest cluster it was allocated
        // for: filling it depends on that.
        if l.partial == 0 {
            l.guest = guest as u32;
        }
        if dirty {
            l.dirty |= bit;
        } else {
            l.dirty &= !bit;
        }
        self.take_reference(cbn, idx, slot);
        old
    }

    /// Whether some slot references `cbn`.
    pub fn is_referenced(&self, cbn: Cbn) -> bool {
        self.referenced[cbn as usize / 64] & (1 << (cbn % 64)) != 0
    }

    fn set_referenced(&mut self, cbn: Cbn, on: bool) {
        let word = &mut self.referenced[cbn as usize / 64];
        let was = *word & (1 << (cbn % 64)) != 0;
        if on {
            *word |= 1 << (cbn % 64);
        } else {
            *word &= !(1 << (cbn % 64));
        }
        match (was, on) {
            (false, true) => self.referenced_count += 1,
            (true, false) => self.referenced_count -= 1,
            _ => {}
        }
    }

    fn take_first_reference(&mut self, cbn: Cbn, key: u64, slot: usize) {
        self.set_referenced(cbn, true);
        self.summaries.record(cbn, key, slot);
    }

    fn take_reference(&mut self, cbn: Cbn, idx: u32, slot: usize) {
        if !self.is_referenced(cbn) {
            self.take_first_reference(cbn, self.line(idx).key, slot);
            return;
        }
        self.shared.add(cbn, BlockRef::new(idx, slot).0);
        self.count_extra(cbn, true);
    }

    /// One more (or one fewer) reference to `cbn` beyond its first.
    fn count_extra(&mut self, cbn: Cbn, more: bool) {
        if let Some(n) = self
            .extra_refs
            .get_mut((cbn / self.blocks_per_region) as usize)
        {
            *n = if more {
                n.saturating_add(1)
            } else {
                n.saturating_sub(1)
            };
        }
    }

    /// Per region, the references to its blocks beyond each block's first.
    pub fn extra_refs(&self) -> &[u32] {
        &self.extra_refs
    }

    /// Drops one reference to a block; true when the block is now free.
    pub fn release(&mut self, cbn: Cbn, r: BlockRef) -> bool {
        let Some(left) = self.shared.remove(cbn, r.0) else {
            self.set_referenced(cbn, false);
            return true;
        };
        if left.others == 0 && !left.first_alive {
            self.set_referenced(cbn, false);
            return true;
        }
        // Still referenced: one reference fewer beyond the first.
        self.count_extra(cbn, false);
        false
    }

    /// Every slot that references `cbn` beyond its first reference.
    pub fn other_references(&self, cbn: Cbn) -> Vec<(u64, usize)> {
        self.shared
            .others(cbn)
            .into_iter()
            .map(|r| (self.line(r >> 4).key, (r & 15) as usize))
            .collect()
    }

    /// The region summaries (recorded on first reference).
    pub fn summaries(&mut self) -> &mut Summaries {
        &mut self.summaries
    }

    /// Removes a slot; returns its block, whether it was dirty, and the
    /// reference to release.
    pub fn unmap(&mut self, key: u64, slot: usize) -> Option<(Cbn, bool, BlockRef)> {
        let Some(idx) = self.find(key) else {
            let (cbn, dirty) = self.sparse.remove(key, slot)?;
            self.present_blocks -= 1;
            self.dirty.sub(key, u64::from(dirty));
            self.resize_sparse();
            return Some((cbn, dirty, BlockRef::SPARSE));
        };
        let bit = 1u16 << slot;
        if self.line(idx).present & bit == 0 {
            return None;
        }
        let dirty = self.line(idx).dirty & bit != 0;
        let cbn = self.remove_block(idx, slot);
        self.line_mut(idx).dirty &= !bit;
        self.present_blocks -= 1;
        if dirty {
            self.dirty.sub(key, 1);
        }
        self.settle(idx);
        Some((cbn, dirty, BlockRef::new(idx, slot)))
    }

    /// Marks a slot clean if it still maps to `cbn`.
    pub fn mark_clean(&mut self, key: u64, slot: usize, cbn: Cbn) -> bool {
        let Some(idx) = self.find(key) else {
            let cleaned = self.sparse.mark_clean(key, slot, cbn);
            self.dirty.sub(key, u64::from(cleaned));
            return cleaned;
        };
        let bit = 1u16 << slot;
        let l = self.view(idx);
        if l.present & bit == 0 || l.cbn(slot) != cbn || l.dirty & bit == 0 {
            return false;
        }
        self.line_mut(idx).dirty &= !bit;
        self.dirty.sub(key, 1);
        true
    }

    /// Sets the partially valid bitmap of a line (creating it if needed);
    /// `guest` replaces the line's guest cluster when given.
    /// Blocks that leave the bitmap forget their valid sectors.
    pub fn set_partial(&mut self, key: u64, guest: Option<u64>, mask: u16) {
        if mask == 0 && self.find(key).is_none() {
            return;
        }
        let idx = self.make_full(key, guest.unwrap_or(NO_GUEST));
        let line = self.line_mut(idx);
        let left = line.partial & !mask;
        line.partial = mask;
        if left != 0 {
            for slot in 0..LINE_BLOCKS as u8 {
                if left & (1 << slot) != 0 {
                    self.valid_sectors.remove(&(key, slot));
                }
            }
        }
        let line = self.line_mut(idx);
        if let Some(g) = guest {
            line.guest = g as u32;
        }
        self.settle(idx);
    }

    /// The valid sectors of a partially valid block (0: none; also for
    /// blocks that are not partially valid, whose sectors are all valid).
    pub fn valid_sectors(&self, key: u64, slot: usize) -> u8 {
        self.valid_sectors
            .get(&(key, slot as u8))
            .copied()
            .unwrap_or(0)
    }

    /// Records the valid sectors of a partially valid block; ignored for a
    /// block that is not partially valid (it is valid as a whole).
    pub fn set_valid_sectors(&mut self, key: u64, slot: usize, sectors: u8) {
        let partial = self.get(key).is_some_and(|l| l.partial & (1 << slot) != 0);
        if sectors == 0 || !partial {
            self.valid_sectors.remove(&(key, slot as u8));
        } else {
            self.valid_sectors.insert((key, slot as u8), sectors);
        }
    }

    /// Blocks with valid sectors recorded (one byte each in a checkpoint).
    pub fn valid_sector_count(&self) -> usize {
        self.valid_sectors.len()
    }

    pub fn is_shared(&self, cbn: Cbn) -> bool {
        self.shared.contains(cbn)
    }

    pub fn dirty_blocks(&self) -> u64 {
        self.dirty.all
    }

    /// Dirty blocks of held images: not counted against the write-back
    /// watermarks.
    pub fn held_dirty_blocks(&self) -> u64 {
        self.dirty.held
    }

    /// Dirty blocks the background write-back is to bring down: those of
    /// images that are not held.
    pub fn writeback_dirty_blocks(&self) -> u64 {
        self.dirty.all - self.dirty.held
    }

    /// Whether image `image`'s blocks are held (see [`Self::set_held`]).
    pub fn is_held(&self, image: u16) -> bool {
        self.dirty.is_held(image)
    }

    /// Marks image `image`'s blocks as held, or no longer: the cache is
    /// their home (a guest's journal device, cache-only logging), so its
    /// dirty blocks are counted apart from those write-back must bring down.
    pub fn set_held(&mut self, image: u16, held: bool) {
        if self.dirty.is_held(image) == held {
            return;
        }
        let dirty: u64 = self
            .lines()
            .filter(|l| key_image(l.key) == image)
            .map(|l| u64::from(l.dirty.count_ones()))
            .sum();
        self.dirty.set_held(image, held, dirty);
    }

    /// Distinct cache blocks referenced (a shared block counts once).
    pub fn referenced_blocks(&self) -> u64 {
        self.referenced_count
    }

    pub fn present_blocks(&self) -> u64 {
        self.present_blocks
    }

    pub fn line_count(&self) -> usize {
        self.live_lines + self.sparse.line_count() as usize
    }

    /// Lines in the sparse form (the rest are full).
    #[cfg(test)]
    pub fn sparse_line_count(&self) -> usize {
        self.sparse.line_count() as usize
    }

    /// Every live line (for checkpoints and scans).
    pub fn lines(&self) -> impl Iterator<Item = LineRef<'_>> {
        self.table
            .iter()
            .map(move |&i| self.view(i))
            .chain(self.sparse.lines().map(LineRef::sparse))
    }

    /// The part of [`Self::memory_bytes`] sized by the device, not by what
    /// is cached: a bit per cache block (referenced), the sparse table's
    /// smallest size (its words must tell apart every cache block number),
    /// and a summary epoch per region.
    pub fn fixed_memory_bytes(&self) -> u64 {
        self.fixed_bytes
    }

    /// Bytes of memory the index uses (lines, block arrays, table,
    /// reference bits, shares, summaries not yet written).
    pub fn memory_bytes(&self) -> u64 {
        let lines = self.lines.bytes();
        let blocks = self.pool.bytes();
        let table = self.table.capacity() * (std::mem::size_of::<u32>() + 1);
        let referenced = self.referenced.capacity() * 8;
        let shared = self.shared.bytes();
        let free = self.free_lines.capacity() * std::mem::size_of::<u32>();
        let sectors = self.valid_sectors.capacity() * (std::mem::size_of::<((u64, u8), u8)>() + 1);
        let sparse = self.sparse.bytes();
        (lines + blocks + table + referenced + shared + free + sectors + sparse) as u64
            + self.summaries.memory_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::decode_entry;

    #[test]
    fn the_fixed_memory_is_under_a_hundredth_percent_of_the_device() {
        // 2 MiB regions of 512 blocks, devices from 64 MiB to 1 TiB.
        for regions in [32u32, 512, 8192, 1 << 19] {
            let index = Index::new(regions, 512);
            let device = u64::from(regions) << 21;
            let fixed = index.fixed_memory_bytes();
            assert!(
                fixed > 0 && fixed * 10_000 <= device,
                "{fixed} for {device}"
            );
            assert_eq!(
                index.memory_bytes(),
                fixed,
                "an empty index holds only its fixed part"
            );
        }
    }

    #[test]
    fn map_unmap_and_first_references() {
        let mut ix = Index::new(1, 64);
        let k = line_key(3, 77);
        assert_eq!(key_image(k), 3);
        assert_eq!(key_line(k), 77);
        assert_eq!(ix.map(k, 5, 2, 10, true), None);
        assert_eq!(ix.map(k, 5, 3, 11, false), None);
        assert_eq!(ix.dirty_blocks(), 1);
        let pending = ix.summaries().pending(0).unwrap().to_vec();
        assert_eq!(decode_entry(pending[10]), Some((k, 2)));
        assert_eq!(decode_entry(pending[11]), Some((k, 3)));
        let (old, r) = ix.map(k, 5, 2, 12, false).unwrap();
        assert_eq!(old, 10);
        assert!(ix.release(10, r));
        assert_eq!(ix.dirty_blocks(), 0);
        assert!(!ix.mark_clean(k, 2, 12));
        assert_eq!(
            ix.get(k).map(|l| l.blocks().collect::<Vec<_>>()),
            Some(vec![(2, 12), (3, 11)])
        );
        assert_eq!(ix.unmap(k, 3).map(|u| (u.0, u.1)), Some((11, false)));
        assert_eq!(ix.unmap(k, 2).map(|u| (u.0, u.1)), Some((12, false)));
        assert!(ix.get(k).is_none());
        assert_eq!(ix.line_count(), 0);
    }

    #[test]
    fn shared_blocks_count_references() {
        let mut ix = Index::new(2, 8);
        let (a, b, c) = (line_key(1, 0), line_key(2, 0), line_key(3, 0));
        ix.map(a, 0, 0, 4, false);
        ix.map(b, 0, 0, 4, false);
        assert!(ix.is_shared(4));
        assert_eq!(ix.other_references(4), vec![(b, 0)]);
        assert_eq!(ix.extra_refs(), &[1, 0], "region 0 serves one address more");
        assert_eq!(ix.referenced_blocks(), 1);
        // The first reference goes: the other one keeps the block.
        let (_, _, ra) = ix.unmap(a, 0).unwrap();
        assert!(!ix.release(4, ra));
        assert_eq!(ix.other_references(4), vec![(b, 0)]);
        assert_eq!(ix.extra_refs(), &[0, 0]);
        let (_, _, rb) = ix.unmap(b, 0).unwrap();
        assert!(ix.release(4, rb));
        assert_eq!(ix.extra_refs(), &[0, 0]);
        // A shared block whose other reference goes first.
        ix.map(a, 0, 1, 13, false);
        ix.map(c, 0, 1, 13, false);
        ix.map(b, 0, 1, 13, false);
        assert_eq!(ix.extra_refs(), &[0, 2]);
        let (_, _, rc) = ix.unmap(c, 1).unwrap();
        assert!(!ix.release(13, rc));
        let (_, _, rb) = ix.unmap(b, 1).unwrap();
        assert!(!ix.release(13, rb));
        assert!(!ix.is_shared(13));
        assert_eq!(ix.extra_refs(), &[0, 0]);
        let (_, _, ra) = ix.unmap(a, 1).unwrap();
        assert!(ix.release(13, ra));
        assert_eq!(ix.extra_refs(), &[0, 0]);
        assert_eq!(ix.referenced_blocks(), 0);
    }

    #[test]
    fn block_arrays_grow_and_shrink_in_slot_order() {
        let mut ix = Index::new(1, 64);
        let k = line_key(1, 9);
        for (i, slot) in [7usize, 0, 15, 3, 9, 1, 12, 5, 2].into_iter().enumerate() {
            ix.map(k, 9, slot, 40 + i as u32, false);
        }
        let l = ix.get(k).unwrap();
        let slots: Vec<usize> = l.blocks().map(|(s, _)| s).collect();
        assert_eq!(slots, vec![0, 1, 2, 3, 5, 7, 9, 12, 15]);
        assert_eq!(l.cbn(15), 42);
        assert_eq!(l.cbn(4), NO_BLOCK);
        for slot in [0usize, 15, 7, 2, 9, 3] {
            ix.unmap(k, slot).unwrap();
        }
        let l = ix.get(k).unwrap();
        assert_eq!(
            l.blocks().collect::<Vec<_>>(),
            vec![(1, 45), (5, 47), (12, 46)]
        );
    }

    /// Hands the summaries of regions full below block `filled` to flash,
    /// as the tier does when a region fills.
    fn write_full_summaries(ix: &mut Index, filled: u64) {
        for r in ix.summaries().pending_regions() {
            if u64::from(r + 1) * 512 <= filled {
                ix.summaries().take_encoded(r, 1);
            }
        }
    }

    /// The bound: index memory within 0.25% of the cached bytes
    /// however densely lines are filled, checked from a half-full cache on
    /// (both table forms, and the sparse table across its growth steps).
    #[test]
    fn memory_stays_within_a_quarter_percent_at_any_density() {
        let blocks = 100_352u64;
        for per_line in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 16] {
            let mut ix = Index::new((blocks / 512) as u32, 512);
            let mut cbn = 0u64;
            let mut worst = 0f64;
            for l in 0..blocks / per_line as u64 {
                let key = line_key(1, l * 7919 % (1 << 30));
                for s in 0..per_line {
                    ix.map(key, l, (s * 3 + l as usize) % 16, cbn as Cbn, false);
                    cbn += 1;
                }
                if cbn * 2 >= blocks && l % 101 == 0 {
                    write_full_summaries(&mut ix, cbn);
                    let ratio = ix.memory_bytes() as f64 / (cbn * 4096) as f64;
                    worst = worst.max(ratio);
                }
            }
            assert!(worst <= 0.0025, "{per_line} blocks per line: {worst:.5}");
            if per_line <= SPARSE_MAX {
                let (sparse, all) = (ix.sparse_line_count(), ix.line_count());
                assert!(
                    sparse * 100 >= all * 95,
                    "{per_line}: {sparse} of {all} sparse, {worst:.5}"
                );
            } else {
                assert_eq!(ix.sparse_line_count(), 0);
            }
        }
    }

    /// Lines filled a block at a time in random order (random writes over
    /// a working set) pass through every array size; what they leave
    /// behind in the smaller sizes must not stay allocated.
    #[test]
    fn memory_stays_within_a_quarter_percent_as_lines_fill_up() {
        let lines = 4096u64;
        let blocks = lines * 16;
        let mut ix = Index::new((blocks / 512) as u32, 512);
        let mut order: Vec<u64> = (0..blocks).collect();
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for i in (1..order.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            order.swap(i, (s % (i as u64 + 1)) as usize);
        }
        let mut worst = 0f64;
        for (cbn, &b) in order.iter().enumerate() {
            let (line, slot) = (b / 16, (b % 16) as usize);
            ix.map(line_key(1, line * 13), line, slot, cbn as Cbn, true);
            let cached = cbn as u64 + 1;
            if cached * 2 >= blocks && cached.is_multiple_of(997) {
                write_full_summaries(&mut ix, cached);
                worst = worst.max(ix.memory_bytes() as f64 / (cached * 4096) as f64);
            }
        }
        assert!(worst <= 0.0025, "worst {worst:.5}");
    }

    /// Eight cloned disks hold the same blocks at their own addresses (each
    /// block shared eight ways, every line full): the whole index stays
    /// within issue 21's 0.35% of the cached bytes (0.32% here: the lines
    /// 0.16%, the shared blocks' other references 0.16%; a hash map with a
    /// vector per shared block took 0.50%).
    #[test]
    fn memory_of_eight_clones_sharing_every_block_is_small() {
        let blocks = 32_768u64;
        let mut ix = Index::new((blocks / 512) as u32, 512);
        for clone in 0..8u16 {
            for b in 0..blocks {
                let line = b / 16 + u64::from(clone) * 4096;
                let cbn = ((b * 7919) % blocks) as Cbn;
                ix.map(
                    line_key(clone + 1, line),
                    line,
                    (b % 16) as usize,
                    cbn,
                    true,
                );
            }
        }
        write_full_summaries(&mut ix, blocks);
        assert_eq!(ix.referenced_blocks(), blocks);
        assert_eq!(ix.present_blocks(), 8 * blocks);
        assert!(ix.is_shared(5) && ix.other_references(5).len() == 7);
        let per_byte =
            (ix.memory_bytes() - ix.fixed_memory_bytes()) as f64 / (8 * blocks * 4096) as f64;
        assert!(per_byte <= 0.0035, "{per_byte:.5}");
    }

    /// Evicting blocks in random order shrinks the sparse table with them.
    #[test]
    fn memory_follows_the_cached_bytes_down() {
        let blocks = 65_536u64;
        let mut ix = Index::new((blocks / 512) as u32, 512);
        for b in 0..blocks {
            ix.map(line_key(2, b * 31), b, (b % 16) as usize, b as Cbn, false);
        }
        write_full_summaries(&mut ix, blocks);
        let mut order: Vec<u64> = (0..blocks).collect();
        {
            use rand::SeedableRng;
            use rand::seq::SliceRandom;
            order.shuffle(&mut rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(11));
        }
        for (n, &b) in order.iter().enumerate().take(blocks as usize * 3 / 4) {
            let (cbn, _, r) = ix.unmap(line_key(2, b * 31), (b % 16) as usize).unwrap();
            assert!(ix.release(cbn, r));
            let cached = (blocks - n as u64 - 1) * 4096;
            if n % 1000 == 0 {
                // The reference bits cover the whole device: 1 bit per block.
                let fixed = blocks / 8;
                let ratio = (ix.memory_bytes() - fixed) as f64 / cached as f64;
                assert!(ratio <= 0.0025, "{n} evicted: {ratio:.5}");
            }
        }
    }

    #[test]
    fn memory_per_dense_line_is_small() {
        let lines = 10_000u64;
        let mut ix = Index::new((lines * 16).div_ceil(512) as u32, 512);
        for l in 0..lines {
            for s in 0..16 {
                ix.map(line_key(1, l), l, s, (l * 16 + s as u64) as u32, false);
            }
        }
        // Full regions have their summaries on flash, not in memory.
        for r in ix.summaries().pending_regions() {
            ix.summaries().take_encoded(r, 1);
        }
        let cached = lines * 16 * 4096;
        let ratio = ix.memory_bytes() as f64 / cached as f64;
        assert!(ratio < 0.0018, "index memory {ratio:.5} of cached bytes");
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Maps a slot to a fresh block or to one some slot maps already.
        Map {
            line: usize,
            slot: usize,
            reuse: Option<usize>,
            dirty: bool,
        },
        Unmap {
            line: usize,
            slot: usize,
        },
        Clean {
            line: usize,
            slot: usize,
        },
        Partial {
            line: usize,
            mask: u16,
        },
    }

    /// Lines of two images, one beyond the sparse key space.
    fn keys() -> Vec<u64> {
        let mut k: Vec<u64> = (0..6).map(|l| line_key(1, l * 1000)).collect();
        k.extend((0..3).map(|l| line_key(7, l)));
        k.push(line_key(2, 1 << 40));
        k
    }

    fn op() -> impl Strategy<Value = Op> {
        let line = 0..10usize;
        let slot = 0..16usize;
        prop_oneof![
            8 => (line.clone(), slot.clone(), proptest::option::weighted(0.15, 0..64usize), any::<bool>())
                .prop_map(|(line, slot, reuse, dirty)| Op::Map { line, slot, reuse, dirty }),
            4 => (line.clone(), slot.clone()).prop_map(|(line, slot)| Op::Unmap { line, slot }),
            2 => (line.clone(), slot).prop_map(|(line, slot)| Op::Clean { line, slot }),
            1 => (line, prop_oneof![Just(0u16), any::<u16>()]).prop_map(|(line, mask)| Op::Partial { line, mask }),
        ]
    }

    #[derive(Default)]
    struct Model {
        slots: std::collections::BTreeMap<(u64, usize), (Cbn, bool)>,
        partial: std::collections::BTreeMap<u64, u16>,
        refs: std::collections::BTreeMap<Cbn, usize>,
    }

    impl Model {
        fn drop_ref(&mut self, cbn: Cbn) -> bool {
            let n = self.refs.get_mut(&cbn).expect("a referenced block");
            *n -= 1;
            if *n == 0 {
                self.refs.remove(&cbn);
                return true;
            }
            false
        }
    }

    fn apply(ix: &mut Index, m: &mut Model, op: &Op, next: &mut Cbn) {
        let keys = keys();
        match *op {
            Op::Map {
                line,
                slot,
                reuse,
                dirty,
            } => {
                let key = keys[line];
                let cbn =
                    match reuse.and_then(|i| m.refs.keys().nth(i % m.refs.len().max(1)).copied()) {
                        Some(c) => c,
                        None => {
                            *next += 1;
                            *next - 1
                        }
                    };
                *m.refs.entry(cbn).or_default() += 1;
                let old = ix.map(key, 0, slot, cbn, dirty);
                let before = m.slots.insert((key, slot), (cbn, dirty));
                assert_eq!(old.map(|o| o.0), before.map(|b| b.0));
                if let Some((old, r)) = old {
                    assert_eq!(ix.release(old, r), m.drop_ref(old));
                }
            }
            Op::Unmap { line, slot } => {
                let key = keys[line];
                let got = ix.unmap(key, slot);
                let want = m.slots.remove(&(key, slot));
                assert_eq!(got.map(|g| (g.0, g.1)), want);
                if let Some((cbn, _, r)) = got {
                    assert_eq!(ix.release(cbn, r), m.drop_ref(cbn));
                }
            }
            Op::Clean { line, slot } => {
                let key = keys[line];
                if let Some(v) = m.slots.get_mut(&(key, slot)) {
                    assert_eq!(ix.mark_clean(key, slot, v.0), v.1);
                    v.1 = false;
                } else {
                    assert!(!ix.mark_clean(key, slot, 0));
                }
            }
            Op::Partial { line, mask } => {
                ix.set_partial(keys[line], Some(9), mask);
                if mask == 0 {
                    m.partial.remove(&keys[line]);
                } else {
                    m.partial.insert(keys[line], mask);
                }
            }
        }
    }

    fn agrees(ix: &Index, m: &Model) {
        let mut live = 0;
        for key in keys() {
            let partial = m.partial.get(&key).copied().unwrap_or(0);
            let want: Vec<(usize, Cbn)> = m
                .slots
                .range((key, 0)..(key, 16))
                .map(|(&(_, s), &(c, _))| (s, c))
                .collect();
            let dirty = m
                .slots
                .range((key, 0)..(key, 16))
                .filter(|(_, v)| v.1)
                .fold(0u16, |d, (&(_, s), _)| d | 1 << s);
            for s in 0..16 {
                let c = want.iter().find(|w| w.0 == s).map(|w| w.1);
                assert_eq!(ix.block(key, s), c, "{key:#x}/{s}");
            }
            match ix.get(key) {
                None => assert!(want.is_empty() && partial == 0, "{key:#x} missing"),
                Some(l) => {
                    live += 1;
                    assert_eq!(l.blocks().collect::<Vec<_>>(), want);
                    assert_eq!((l.dirty, l.partial), (dirty, partial));
                }
            }
        }
        assert_eq!(ix.line_count(), live);
        let mut listed: Vec<u64> = ix.lines().map(|l| l.key).collect();
        listed.sort_unstable();
        listed.dedup();
        assert_eq!(listed.len(), live, "each line listed once");
        assert_eq!(ix.present_blocks(), m.slots.len() as u64);
        assert_eq!(
            ix.dirty_blocks(),
            m.slots.values().filter(|v| v.1).count() as u64
        );
    }

    use proptest::prelude::*;

    proptest! {
        /// Maps, unmaps, cleaning and partially valid marks in any order,
        /// with shared blocks: the index agrees with a plain map however
        /// its lines move between the sparse and the full form.
        #[test]
        fn agrees_with_a_map_in_either_form(ops in proptest::collection::vec(op(), 1..200)) {
            let mut ix = Index::new(8, 512);
            let mut m = Model::default();
            let mut next = 0;
            for op in &ops {
                apply(&mut ix, &mut m, op, &mut next);
                agrees(&ix, &m);
            }
        }
    }
}
