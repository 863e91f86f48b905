//! Named settings of the cache tier: write mode, admission and replacement
//! policies, watermarks. Every setting parses from the name an operator
//! types (CLI, TOML) and has a sane default.

use crate::error::{CacheError, Result};
use crate::region::Replacement;
use std::str::FromStr;

/// What a write does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Cache the data dirty; acknowledge; write back in the background.
    WriteBack,
    /// Write to the backend and keep a clean copy in flash.
    WriteThrough,
    /// Write to the backend and drop any cached copy.
    WriteAround,
}

impl FromStr for WriteMode {
    type Err = CacheError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "writeback" => Ok(WriteMode::WriteBack),
            "writethrough" => Ok(WriteMode::WriteThrough),
            "writearound" => Ok(WriteMode::WriteAround),
            _ => Err(CacheError::Config(format!(
                "unknown cache mode '{s}' (writeback, writethrough, writearound)"
            ))),
        }
    }
}

impl WriteMode {
    pub fn name(self) -> &'static str {
        match self {
            WriteMode::WriteBack => "writeback",
            WriteMode::WriteThrough => "writethrough",
            WriteMode::WriteAround => "writearound",
        }
    }
}

/// Which blocks enter the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Every read miss and every write.
    All,
    /// Writes, and reads missed twice recently (lazy promotion, SVD).
    Hot,
    /// Everything except read misses in long sequential runs.
    SequentialBypass,
}

impl FromStr for Admission {
    type Err = CacheError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "all" => Ok(Admission::All),
            "hot" => Ok(Admission::Hot),
            "sequential-bypass" | "seq-bypass" => Ok(Admission::SequentialBypass),
            _ => Err(CacheError::Config(format!(
                "unknown admission policy '{s}' (all, hot, sequential-bypass)"
            ))),
        }
    }
}

impl Admission {
    pub fn name(self) -> &'static str {
        match self {
            Admission::All => "all",
            Admission::Hot => "hot",
            Admission::SequentialBypass => "sequential-bypass",
        }
    }
}

/// How the cache relates to the copy-on-write layer above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CowMode {
    /// The papers' stacked baseline (TRDCache): every I/O is cached the
    /// same way, copy-on-write filler and whole metadata tables included.
    Stacked,
    /// COWCache: filler is never admitted, allocating writes in write-back
    /// mode leave clusters partially valid (decoupled copy-on-write), and
    /// metadata is cached and journaled by the sector.
    CowAware,
}

impl FromStr for CowMode {
    type Err = CacheError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "stacked" => Ok(CowMode::Stacked),
            "cow-aware" => Ok(CowMode::CowAware),
            _ => Err(CacheError::Config(format!(
                "unknown cow mode '{s}' (stacked, cow-aware)"
            ))),
        }
    }
}

impl CowMode {
    pub fn name(self) -> &'static str {
        match self {
            CowMode::Stacked => "stacked",
            CowMode::CowAware => "cow-aware",
        }
    }

    /// The slice size of the COW layer's metadata cache that goes with
    /// this mode (`None`: whole tables, for the stacked baseline); 512-byte
    /// sectors when cow-aware, so that an 8-byte L2 change costs one sector
    /// record in the journal and not a whole table (COWCache section 3.2).
    /// Whoever assembles the COW layer over the cache sets it.
    pub fn meta_slice_bytes(self) -> Option<u64> {
        (self == CowMode::CowAware).then_some(512)
    }
}

/// Per-disk policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskPolicy {
    pub mode: WriteMode,
    pub admission: Admission,
    /// Bytes of consecutive read misses after which `sequential-bypass`
    /// stops promoting them.
    pub sequential_threshold: u64,
    /// Once a guest's sequential write run reaches this many bytes, it goes
    /// straight to the backend, whatever the admission policy (0: never). Flash would
    /// only hold it until written back, at twice the device traffic.
    pub sequential_write_cutoff: u64,
    pub cow: CowMode,
    /// The cache is the disk's home (a guest's virtual journal device,
    /// JCache's cache-only logging): every write stays in flash, dirty,
    /// whatever `mode` says; background write-back never copies it to the
    /// store; only lack of flash space or an explicit write-out
    /// ([`crate::FlashCache::write_out_held`]) does.
    pub cache_only: bool,
}

impl DiskPolicy {
    /// The policy of a guest's journal device cached journal-aware: the
    /// cache is its home (cache-only logging), whatever the cache's mode,
    /// and its sequential log never bypasses flash.
    pub fn journal_device() -> DiskPolicy {
        DiskPolicy {
            mode: WriteMode::WriteBack,
            cache_only: true,
            sequential_write_cutoff: 0,
            cow: CowMode::Stacked,
            ..DiskPolicy::default()
        }
    }
}

impl Default for DiskPolicy {
    fn default() -> Self {
        DiskPolicy {
            mode: WriteMode::WriteBack,
            admission: Admission::All,
            sequential_threshold: 4 << 20,
            sequential_write_cutoff: 4 << 20,
            cow: CowMode::CowAware,
            cache_only: false,
        }
    }
}

/// Deduplication of the blocks that enter flash (see `crate::dedup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dedup {
    /// Every address gets its own copy.
    #[default]
    Off,
    /// A block whose bytes are already in flash (same checksum, then same
    /// fingerprint) shares that block.
    On,
    /// The same, after comparing every byte (one flash read per shared
    /// block): for those who will not trust a 128-bit hash.
    Verify,
}

impl Dedup {
    pub fn name(self) -> &'static str {
        match self {
            Dedup::Off => "off",
            Dedup::On => "on",
            Dedup::Verify => "verify",
        }
    }

    pub fn enabled(self) -> bool {
        self != Dedup::Off
    }
}

impl std::str::FromStr for Dedup {
    type Err = CacheError;

    fn from_str(s: &str) -> Result<Dedup> {
        match s {
            "off" => Ok(Dedup::Off),
            "on" => Ok(Dedup::On),
            "verify" => Ok(Dedup::Verify),
            other => Err(CacheError::Config(format!(
                "unknown dedup mode '{other}' (off, on, verify)"
            ))),
        }
    }
}

/// Cache-wide settings.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Region (erase block) size used when formatting.
    pub region_bytes: u64,
    pub replacement: Replacement,
    /// Policy of disks without their own.
    pub default_policy: DiskPolicy,
    /// Background write-back starts above this fraction of the data zone dirty...
    pub high_watermark: f64,
    /// ...and stops below this one.
    pub low_watermark: f64,
    /// Free regions kept in reserve for incoming writes.
    pub reserve_regions: usize,
    /// Most write-back requests in flight at once (the number adapts to
    /// the backend's latency below this).
    pub writeback_depth: usize,
    /// Re-insert hot live blocks of an evicted region.
    pub relocate_hot: bool,
    /// No background threads: write back in the writing thread (after the
    /// write that crossed the high watermark) and write a started
    /// checkpoint at the end of the next commit or when the journal ring
    /// is full. Deterministic, for trace replay and crash sweeps.
    pub inline_background: bool,
    /// Journal bytes after which a checkpoint starts (default and maximum:
    /// half the metadata zone). Smaller means faster recovery and more
    /// checkpoint writes.
    pub checkpoint_interval_bytes: Option<u64>,
    /// Journal entries are written to the metadata zone once this many
    /// bytes are pending (or a second after the oldest, or at a flush).
    pub journal_buffer_bytes: usize,
    /// Open a cache device recorded for another host (its dirty data is
    /// only ever written back, never served).
    pub force_foreign: bool,
    /// This host's identity (default: /etc/machine-id).
    pub host: Option<String>,
    /// Open a device whose metadata was damaged after it landed (a journal
    /// batch or checkpoint that a later record says was durable does not
    /// verify) with what does verify, instead of refusing it; and drop
    /// dirty blocks that do not verify rather than keep them unreadable.
    /// The images the damage touches have lost writes: `recover --full
    /// --salvage` only.
    pub salvage: bool,
    /// Test only: persist index records before the data they describe and
    /// trust them on replay, to prove the crash harness catches it.
    pub test_index_before_data: bool,
    /// Test only: a journal batch that failed to be written loses its
    /// entries (a later flush then succeeds without them), to prove the
    /// crash harness catches a flush trusted after a failed write.
    pub test_forget_failed_batches: bool,
    /// Test only: recovery trusts an older checkpoint when a newer one was
    /// made durable but no longer verifies (the seal's and the journal's
    /// word about newer checkpoints is ignored), to prove the crash
    /// harness's damaged-metadata sweep catches it.
    pub test_open_past_bad_checkpoint: bool,
    /// Deduplicate blocks entering flash, across every disk of the cache.
    pub dedup: Dedup,
    /// Test only: fingerprints keep one byte of the hash, so different
    /// blocks collide; proves that `Dedup::Verify` never shares a block
    /// with other bytes (and that `Dedup::On` trusts its hash).
    pub test_weak_fingerprints: bool,
    /// Per-VM shares (see `shares`): each disk fills regions of its own
    /// and space is taken from the disk with the least demand for it.
    pub shares: bool,
    /// SVD's read/write split: while promoted reads hold at most this
    /// share of the used regions, reclaim takes written data first.
    pub read_split: Option<f64>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            region_bytes: crate::layout::DEFAULT_REGION,
            replacement: Replacement::Lru,
            default_policy: DiskPolicy::default(),
            high_watermark: 0.5,
            low_watermark: 0.25,
            reserve_regions: 2,
            writeback_depth: 64,
            relocate_hot: true,
            inline_background: false,
            checkpoint_interval_bytes: None,
            journal_buffer_bytes: 64 << 10,
            force_foreign: false,
            host: None,
            salvage: false,
            test_index_before_data: false,
            test_forget_failed_batches: false,
            test_open_past_bad_checkpoint: false,
            dedup: Dedup::Off,
            test_weak_fingerprints: false,
            shares: false,
            read_split: None,
        }
    }
}

impl CacheConfig {
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.low_watermark)
            || !(0.0..=1.0).contains(&self.high_watermark)
            || self.low_watermark > self.high_watermark
        {
            return Err(CacheError::Config(format!(
                "watermarks must satisfy 0 <= low ({}) <= high ({}) <= 1",
                self.low_watermark, self.high_watermark
            )));
        }
        if self.writeback_depth == 0 || self.writeback_depth > 1024 {
            return Err(CacheError::Config(format!(
                "write-back depth must be between 1 and 1024, not {}",
                self.writeback_depth
            )));
        }
        Ok(())
    }
}
