//! The in-memory metadata cache: L2 tables and refcount blocks kept as
//! slices whose size is a setting, from a whole table down to one 512-byte
//! sector, evicted least recently used first. Slices known to hold only
//! zeros on the image (of a table just created, or evicted clean and all
//! zero) cost one bit instead of their bytes and load without I/O: the
//! finer the slices, the more of a sparse table this knowledge covers.
//!
//! The cache only holds bytes, dirty marks and zero bits. Writing a dirty
//! slice back, the ordering that requires, and forgetting zero bits when a
//! cluster is reused, belong to the image that owns the cache.

use lru::LruCache;
use std::collections::HashMap;

/// Size settings of one metadata cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaCacheConfig {
    /// Bytes of L2 slices kept in memory.
    pub l2_bytes: u64,
    /// Bytes of refcount block slices kept in memory.
    pub refcount_bytes: u64,
    /// Slice size in bytes (a power of two from 512 up to the cluster
    /// size); `None` caches whole tables.
    pub slice_bytes: Option<u64>,
}

impl MetaCacheConfig {
    /// The default sizes with slices of `slice_bytes` (`None`: whole
    /// tables), as the layer below asks for (a flash cache's COW mode).
    pub fn with_slice_bytes(slice_bytes: Option<u64>) -> MetaCacheConfig {
        MetaCacheConfig {
            slice_bytes,
            ..MetaCacheConfig::default()
        }
    }
}

impl Default for MetaCacheConfig {
    fn default() -> Self {
        MetaCacheConfig {
            l2_bytes: 4 << 20,
            refcount_bytes: 1 << 20,
            slice_bytes: None,
        }
    }
}

/// One cached slice.
#[derive(Debug)]
pub struct Slot {
    pub data: Box<[u8]>,
    pub dirty: bool,
}

/// Lookup statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served from memory (including `zero_hits`).
    pub hits: u64,
    /// Hits on slices known to be zero (no bytes were held for them).
    pub zero_hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub dirty_evictions: u64,
}

impl CacheStats {
    pub fn hit_ratio(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The slice is in memory.
    Resident,
    /// The slice is all zeros on the image: the caller inserts zeros.
    KnownZero,
    /// The caller reads the slice.
    Missing,
}

/// Slices of one kind of table, keyed by their host offset.
#[derive(Debug)]
pub struct SliceCache {
    slice: u64,
    /// Bytes of one table (a cluster).
    table: u64,
    /// Most slices held. The LRU itself is unbounded: it grows with the
    /// slices loaded, so a large setting costs nothing until used.
    slots: usize,
    lru: LruCache<u64, Slot>,
    /// Per table start: one bit per slice known to be zero and not resident.
    zeros: HashMap<u64, Vec<u64>>,
    pub stats: CacheStats,
}

impl SliceCache {
    /// `capacity` bytes of `slice`-byte slices (at least two slices, so a
    /// caller can hold one while loading another) of `table`-byte tables.
    pub fn new(capacity: u64, slice: u64, table: u64) -> SliceCache {
        let slots = usize::try_from(capacity / slice)
            .unwrap_or(usize::MAX)
            .max(2);
        SliceCache {
            slice,
            table: table.max(slice),
            slots,
            lru: LruCache::unbounded(),
            zeros: HashMap::new(),
            stats: CacheStats::default(),
        }
    }

    /// Drops every slice, dirty ones included (their table is gone).
    pub fn clear(&mut self) {
        self.lru.clear();
        self.zeros.clear();
    }

    /// (table start, bit) of a slice.
    fn zero_bit(&self, start: u64) -> (u64, usize) {
        let table = start & !(self.table - 1);
        (table, ((start - table) / self.slice) as usize)
    }

    fn set_zero(&mut self, start: u64, on: bool) {
        let (table, bit) = self.zero_bit(start);
        let words = (self.table / self.slice).div_ceil(64) as usize;
        if on {
            let bits = self.zeros.entry(table).or_insert_with(|| vec![0; words]);
            bits[bit / 64] |= 1 << (bit % 64);
        } else if let Some(bits) = self.zeros.get_mut(&table) {
            bits[bit / 64] &= !(1 << (bit % 64));
            if bits.iter().all(|&w| w == 0) {
                self.zeros.remove(&table);
            }
        }
    }

    fn is_known_zero(&self, start: u64) -> bool {
        let (table, bit) = self.zero_bit(start);
        self.zeros
            .get(&table)
            .is_some_and(|bits| bits[bit / 64] & (1 << (bit % 64)) != 0)
    }

    /// Looks a slice up, counting a hit (resident or known zero) or a miss.
    /// A known-zero slice stops being known here: the caller inserts it.
    /// Whether the slice at `start` is at hand without I/O (resident, or
    /// known to be zeros); unlike [`SliceCache::probe`], changes nothing.
    pub fn holds(&self, start: u64) -> bool {
        self.lru.contains(&start) || self.is_known_zero(start)
    }

    pub fn probe(&mut self, start: u64) -> Probe {
        if self.lru.get(&start).is_some() {
            self.stats.hits += 1;
            return Probe::Resident;
        }
        if self.is_known_zero(start) {
            self.set_zero(start, false);
            self.stats.hits += 1;
            self.stats.zero_hits += 1;
            return Probe::KnownZero;
        }
        self.stats.misses += 1;
        Probe::Missing
    }

    /// The image holds zeros in `[start, start + len)` (a table it just
    /// created): its slices will load without I/O.
    pub fn mark_zero(&mut self, start: u64, len: u64) {
        let mut s = self.slice_start(start);
        while s < start + len {
            if !self.lru.contains(&s) {
                self.set_zero(s, true);
            }
            s += self.slice;
        }
    }

    /// Clusters in `[start, start + len)` were reallocated: whatever was
    /// known about their content no longer holds.
    pub fn forget_zero(&mut self, start: u64, len: u64) {
        if self.zeros.is_empty() {
            return;
        }
        let mut t = start & !(self.table - 1);
        while t < start + len {
            self.zeros.remove(&t);
            t += self.table;
        }
    }

    /// Bytes of memory the zero bits take.
    pub fn zero_map_bytes(&self) -> u64 {
        self.zeros.values().map(|v| 8 * v.len() as u64 + 40).sum()
    }

    pub fn slice_size(&self) -> u64 {
        self.slice
    }

    /// Start of the slice holding `offset`.
    pub fn slice_start(&self, offset: u64) -> u64 {
        offset & !(self.slice - 1)
    }

    /// A slice without touching recency or statistics.
    pub fn peek_mut(&mut self, start: u64) -> Option<&mut Slot> {
        self.lru.peek_mut(&start)
    }

    pub fn contains(&self, start: u64) -> bool {
        self.lru.contains(&start)
    }

    /// The slice that the next insertion would evict, when the cache is full.
    pub fn next_victim(&self) -> Option<(u64, bool)> {
        if self.lru.len() < self.slots {
            return None;
        }
        self.lru.peek_lru().map(|(k, s)| (*k, s.dirty))
    }

    /// Inserts a slice; the caller has made room (see [`Self::next_victim`]),
    /// so nothing dirty is ever dropped here.
    pub fn insert(&mut self, start: u64, slot: Slot) {
        if !self.lru.contains(&start)
            && self.lru.len() >= self.slots
            && let Some((old_start, old)) = self.lru.pop_lru()
        {
            self.stats.evictions += 1;
            debug_assert!(!old.dirty, "a dirty slice was evicted without write-back");
            self.remember_if_zero(old_start, &old);
        }
        self.lru.put(start, slot);
    }

    /// Removes a slice (after its write-back).
    pub fn remove(&mut self, start: u64) -> Option<Slot> {
        let s = self.lru.pop(&start);
        if let Some(slot) = &s {
            self.stats.evictions += 1;
            self.remember_if_zero(start, slot);
        }
        s
    }

    /// A clean slice leaving memory that holds only zeros stays known.
    fn remember_if_zero(&mut self, start: u64, slot: &Slot) {
        if !slot.dirty && slot.data.iter().all(|&b| b == 0) {
            self.set_zero(start, true);
        }
    }

    /// Offsets of dirty slices in ascending order.
    pub fn dirty_slices(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .lru
            .iter()
            .filter(|(_, s)| s.dirty)
            .map(|(k, _)| *k)
            .collect();
        v.sort_unstable();
        v
    }

    pub fn has_dirty(&self) -> bool {
        self.lru.iter().any(|(_, s)| s.dirty)
    }

    pub fn len(&self) -> usize {
        self.lru.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(byte: u8) -> Slot {
        Slot {
            data: vec![byte; 512].into_boxed_slice(),
            dirty: false,
        }
    }

    #[test]
    fn zero_slices_cost_a_bit_and_load_without_io() {
        let mut c = SliceCache::new(1024, 512, 65536);
        assert_eq!(c.probe(65536), Probe::Missing);
        c.mark_zero(65536, 65536);
        assert_eq!(c.probe(65536 + 512), Probe::KnownZero);
        // Known once: the caller now holds it.
        c.insert(65536 + 512, slot(0));
        assert_eq!(c.probe(65536 + 512), Probe::Resident);
        assert_eq!(c.stats.zero_hits, 1);
        assert_eq!(c.stats.misses, 1);
        // A clean all-zero slice leaving memory stays known; others do not.
        c.insert(0, slot(7));
        c.insert(512, slot(0));
        assert_eq!(c.probe(65536 + 512), Probe::KnownZero);
        c.insert(1024, slot(0));
        assert_eq!(c.probe(0), Probe::Missing, "non-zero slices are read again");
        c.remove(512);
        assert_eq!(c.probe(512), Probe::KnownZero);
        // Reused clusters forget everything.
        c.forget_zero(65536, 65536);
        assert_eq!(c.probe(65536 + 1024), Probe::Missing);
        c.mark_zero(0, 512);
        assert!(c.zero_map_bytes() > 0);
        c.forget_zero(0, 65536);
        assert_eq!(c.zero_map_bytes(), 0);
    }
}
