//! The in-memory metadata cache: L2 tables and refcount blocks kept as
//! slices whose size is a setting, from a whole table down to one 512-byte
//! sector, evicted least recently used first.
//!
//! The cache only holds bytes and dirty marks. Writing a dirty slice back,
//! and the ordering that requires, belongs to the image that owns the cache.

use lru::LruCache;
use std::num::NonZeroUsize;

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
    pub hits: u64,
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

/// Slices of one kind of table, keyed by their host offset.
#[derive(Debug)]
pub struct SliceCache {
    slice: u64,
    lru: LruCache<u64, Slot>,
    pub stats: CacheStats,
}

impl SliceCache {
    /// `capacity` bytes of `slice`-byte slices (at least two slices, so a
    /// caller can hold one while loading another).
    pub fn new(capacity: u64, slice: u64) -> SliceCache {
        let slots = (capacity / slice).max(2) as usize;
        SliceCache {
            slice,
            lru: LruCache::new(NonZeroUsize::new(slots).unwrap_or(NonZeroUsize::MIN)),
            stats: CacheStats::default(),
        }
    }

    pub fn slice_size(&self) -> u64 {
        self.slice
    }

    /// Start of the slice holding `offset`.
    pub fn slice_start(&self, offset: u64) -> u64 {
        offset & !(self.slice - 1)
    }

    /// Looks a slice up, counting a hit or a miss.
    pub fn lookup(&mut self, start: u64) -> Option<&mut Slot> {
        match self.lru.get_mut(&start) {
            Some(s) => {
                self.stats.hits += 1;
                Some(s)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
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
        if self.lru.len() < self.lru.cap().get() {
            return None;
        }
        self.lru.peek_lru().map(|(k, s)| (*k, s.dirty))
    }

    /// Inserts a slice; the caller has made room (see [`Self::next_victim`]),
    /// so nothing dirty is ever dropped here.
    pub fn insert(&mut self, start: u64, slot: Slot) {
        if let Some((_, old)) = self.lru.push(start, slot) {
            self.stats.evictions += 1;
            debug_assert!(!old.dirty, "a dirty slice was evicted without write-back");
        }
    }

    /// Removes a slice (after its write-back).
    pub fn remove(&mut self, start: u64) -> Option<Slot> {
        let s = self.lru.pop(&start);
        if s.is_some() {
            self.stats.evictions += 1;
        }
        s
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
