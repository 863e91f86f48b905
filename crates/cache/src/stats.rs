//! Counters of the cache tier, per disk and in total: what `vdcache stats`
//! reports. Updated with relaxed atomics on the I/O path.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use vdcache_contract::DiskId;

/// Counters of one disk.
#[derive(Debug, Default)]
pub struct DiskCounters {
    pub guest_reads: AtomicU64,
    pub guest_read_bytes: AtomicU64,
    pub guest_writes: AtomicU64,
    pub guest_write_bytes: AtomicU64,
    /// 4 KiB blocks of guest reads served from flash.
    pub read_hit_blocks: AtomicU64,
    /// 4 KiB blocks of guest reads that missed.
    pub read_miss_blocks: AtomicU64,
    /// 4 KiB blocks of guest writes that found the block in flash.
    pub write_hit_blocks: AtomicU64,
    pub write_miss_blocks: AtomicU64,
    /// 4 KiB blocks of any class read that hit (metadata, filler too).
    pub all_hit_blocks: AtomicU64,
    pub all_miss_blocks: AtomicU64,
    pub flash_bytes_written: AtomicU64,
    pub flash_bytes_read: AtomicU64,
    /// Metadata (L2, refcount) bytes written to flash: whole blocks, or
    /// sector records of the journal (cow-aware write-back).
    pub meta_flash_bytes_written: AtomicU64,
    /// Metadata bytes read from flash.
    pub meta_flash_bytes_read: AtomicU64,
    pub backend_bytes_read: AtomicU64,
    pub backend_bytes_written: AtomicU64,
    pub backend_syncs: AtomicU64,
    pub guest_flushes: AtomicU64,
    /// Cached 4 KiB blocks of a backing image dropped because a write to
    /// the delta masked them (cow-aware: they will not be read again).
    pub masked_blocks_dropped: AtomicU64,
    /// Backend write requests of write-back (coalesced runs).
    pub writeback_requests: AtomicU64,
    /// Bytes of partially valid clusters write-back filled from the
    /// backing chain (never through flash).
    pub writeback_filled_bytes: AtomicU64,
    /// 4 KiB blocks of in-place writes mapped onto the cache block of
    /// their journal copy instead of written to flash (logical caching).
    pub journal_copies_shared: AtomicU64,
    /// Journal copies the log named for an in-place write whose bytes
    /// turned out to differ (nothing shared).
    pub journal_copy_mismatches: AtomicU64,
    /// Reads whose blocks could not be admitted into flash (the device
    /// failed the write, as when its file system is full): served from the
    /// image all the same.
    pub promotions_failed: AtomicU64,
    /// 4 KiB blocks (written, or read and promoted) mapped onto a cache
    /// block with the same content instead of written to flash (dedup).
    pub dedup_blocks_shared: AtomicU64,
    /// Nanoseconds spent fingerprinting blocks, and blocks fingerprinted.
    pub hash_nanos: AtomicU64,
    pub hashed_blocks: AtomicU64,
}

/// A plain copy of one disk's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskStats {
    pub guest_reads: u64,
    pub guest_read_bytes: u64,
    pub guest_writes: u64,
    pub guest_write_bytes: u64,
    pub read_hit_blocks: u64,
    pub read_miss_blocks: u64,
    pub write_hit_blocks: u64,
    pub write_miss_blocks: u64,
    pub all_hit_blocks: u64,
    pub all_miss_blocks: u64,
    pub flash_bytes_written: u64,
    pub flash_bytes_read: u64,
    pub meta_flash_bytes_written: u64,
    pub meta_flash_bytes_read: u64,
    pub backend_bytes_read: u64,
    pub backend_bytes_written: u64,
    pub backend_syncs: u64,
    pub guest_flushes: u64,
    pub masked_blocks_dropped: u64,
    pub writeback_requests: u64,
    pub writeback_filled_bytes: u64,
    pub journal_copies_shared: u64,
    pub journal_copy_mismatches: u64,
    pub promotions_failed: u64,
    pub dedup_blocks_shared: u64,
    pub hash_nanos: u64,
    pub hashed_blocks: u64,
    pub dirty_bytes: u64,
}

impl DiskStats {
    pub fn read_hit_ratio(&self) -> f64 {
        ratio(self.read_hit_blocks, self.read_miss_blocks)
    }

    /// Share of guest-written 4 KiB blocks that were already in flash.
    pub fn write_hit_ratio(&self) -> f64 {
        ratio(self.write_hit_blocks, self.write_miss_blocks)
    }

    pub fn add(&mut self, o: &DiskStats) {
        self.guest_reads += o.guest_reads;
        self.guest_read_bytes += o.guest_read_bytes;
        self.guest_writes += o.guest_writes;
        self.guest_write_bytes += o.guest_write_bytes;
        self.read_hit_blocks += o.read_hit_blocks;
        self.read_miss_blocks += o.read_miss_blocks;
        self.write_hit_blocks += o.write_hit_blocks;
        self.write_miss_blocks += o.write_miss_blocks;
        self.all_hit_blocks += o.all_hit_blocks;
        self.all_miss_blocks += o.all_miss_blocks;
        self.flash_bytes_written += o.flash_bytes_written;
        self.flash_bytes_read += o.flash_bytes_read;
        self.meta_flash_bytes_written += o.meta_flash_bytes_written;
        self.meta_flash_bytes_read += o.meta_flash_bytes_read;
        self.backend_bytes_read += o.backend_bytes_read;
        self.backend_bytes_written += o.backend_bytes_written;
        self.backend_syncs += o.backend_syncs;
        self.guest_flushes += o.guest_flushes;
        self.masked_blocks_dropped += o.masked_blocks_dropped;
        self.writeback_requests += o.writeback_requests;
        self.writeback_filled_bytes += o.writeback_filled_bytes;
        self.journal_copies_shared += o.journal_copies_shared;
        self.journal_copy_mismatches += o.journal_copy_mismatches;
        self.promotions_failed += o.promotions_failed;
        self.dedup_blocks_shared += o.dedup_blocks_shared;
        self.hash_nanos += o.hash_nanos;
        self.hashed_blocks += o.hashed_blocks;
        self.dirty_bytes += o.dirty_bytes;
    }
}

fn ratio(hits: u64, misses: u64) -> f64 {
    let total = hits + misses;
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

impl DiskCounters {
    pub fn snapshot(&self) -> DiskStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskStats {
            guest_reads: l(&self.guest_reads),
            guest_read_bytes: l(&self.guest_read_bytes),
            guest_writes: l(&self.guest_writes),
            guest_write_bytes: l(&self.guest_write_bytes),
            read_hit_blocks: l(&self.read_hit_blocks),
            read_miss_blocks: l(&self.read_miss_blocks),
            write_hit_blocks: l(&self.write_hit_blocks),
            write_miss_blocks: l(&self.write_miss_blocks),
            all_hit_blocks: l(&self.all_hit_blocks),
            all_miss_blocks: l(&self.all_miss_blocks),
            flash_bytes_written: l(&self.flash_bytes_written),
            flash_bytes_read: l(&self.flash_bytes_read),
            meta_flash_bytes_written: l(&self.meta_flash_bytes_written),
            meta_flash_bytes_read: l(&self.meta_flash_bytes_read),
            backend_bytes_read: l(&self.backend_bytes_read),
            backend_bytes_written: l(&self.backend_bytes_written),
            backend_syncs: l(&self.backend_syncs),
            guest_flushes: l(&self.guest_flushes),
            masked_blocks_dropped: l(&self.masked_blocks_dropped),
            writeback_requests: l(&self.writeback_requests),
            writeback_filled_bytes: l(&self.writeback_filled_bytes),
            journal_copies_shared: l(&self.journal_copies_shared),
            journal_copy_mismatches: l(&self.journal_copy_mismatches),
            promotions_failed: l(&self.promotions_failed),
            dedup_blocks_shared: l(&self.dedup_blocks_shared),
            hash_nanos: l(&self.hash_nanos),
            hashed_blocks: l(&self.hashed_blocks),
            dirty_bytes: 0,
        }
    }
}

/// Adds to a counter.
pub fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// Counters of every disk the cache has seen.
#[derive(Debug, Default)]
pub struct Stats {
    disks: Mutex<BTreeMap<u32, std::sync::Arc<DiskCounters>>>,
}

impl Stats {
    pub fn disk(&self, d: DiskId) -> std::sync::Arc<DiskCounters> {
        self.disks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(d.0)
            .or_default()
            .clone()
    }

    pub fn all(&self) -> Vec<(u32, DiskStats)> {
        self.disks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(d, c)| (*d, c.snapshot()))
            .collect()
    }
}

/// What the cache tier itself did to its device, by zone: the figures
/// behind flash bytes per guest byte and the SSD's wear.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceStats {
    /// Bytes written into the data zone (cached blocks, relocations).
    pub data_bytes_written: u64,
    /// Bytes written to the superblock, checkpoint slots and journal ring.
    pub meta_bytes_written: u64,
    pub bytes_read: u64,
    /// Durable writes of the device (flushes).
    pub syncs: u64,
    /// Bytes discarded (reclaimed regions).
    pub bytes_discarded: u64,
    /// Checkpoints written, and times the journal ring was full and a
    /// writer had to wait for the checkpoint in flight.
    pub checkpoints: u64,
    pub checkpoint_waits: u64,
    /// Commits (guest flushes, write-through writes dropping cached copies)
    /// that waited for a sync another had started, and were covered by it
    /// or by the next one (group commit).
    pub sync_waits: u64,
}

/// The cache device with counters around it. Every I/O the tier issues
/// after opening goes through one of these.
///
/// A failed sync latches: the kernel may have dropped the pages it could
/// not write, so no later sync can vouch for what was written before it
/// (QEMU's file-posix does the same after a failed fdatasync). Every later
/// sync fails until the cache is opened again and recovers from what is
/// durable.
#[derive(Debug)]
pub struct CountedDevice {
    inner: vdcache_backend::BackendRef,
    sync_failed: AtomicBool,
    data_offset: u64,
    data_written: AtomicU64,
    meta_written: AtomicU64,
    read: AtomicU64,
    syncs: AtomicU64,
    discarded: AtomicU64,
    checkpoints: AtomicU64,
    checkpoint_waits: AtomicU64,
}

impl CountedDevice {
    /// Counts writes below `data_offset` as metadata-zone writes.
    pub fn new(inner: vdcache_backend::BackendRef, data_offset: u64) -> CountedDevice {
        CountedDevice {
            inner,
            sync_failed: AtomicBool::new(false),
            data_offset,
            data_written: AtomicU64::new(0),
            meta_written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            checkpoint_waits: AtomicU64::new(0),
        }
    }

    pub(crate) fn note_checkpoint(&self) {
        bump(&self.checkpoints, 1);
    }

    pub(crate) fn note_checkpoint_wait(&self) {
        bump(&self.checkpoint_waits, 1);
    }

    pub fn snapshot(&self) -> DeviceStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceStats {
            data_bytes_written: l(&self.data_written),
            meta_bytes_written: l(&self.meta_written),
            bytes_read: l(&self.read),
            syncs: l(&self.syncs),
            bytes_discarded: l(&self.discarded),
            checkpoints: l(&self.checkpoints),
            checkpoint_waits: l(&self.checkpoint_waits),
            sync_waits: 0,
        }
    }

    fn count_write(&self, offset: u64, len: u64) {
        let meta = self.data_offset.saturating_sub(offset).min(len);
        bump(&self.meta_written, meta);
        bump(&self.data_written, len - meta);
    }
}

impl vdcache_backend::Backend for CountedDevice {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        bump(&self.read, buf.len() as u64);
        self.inner.read_at(buf, offset)
    }

    /// Counts what was written, not what was tried: a full device fails
    /// writes that staging retries at every sync.
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)?;
        self.count_write(offset, buf.len() as u64);
        Ok(())
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> std::io::Result<()> {
        self.inner.write_vectored_at(bufs, offset)?;
        self.count_write(offset, bufs.iter().map(|b| b.len() as u64).sum());
        Ok(())
    }

    fn flush(&self) -> std::io::Result<()> {
        if self.sync_failed.load(Ordering::Acquire) {
            return Err(std::io::Error::other(
                "an earlier sync of the cache device failed, so data written before it may be \
                 lost: stop the server and open the cache again to recover what is durable",
            ));
        }
        bump(&self.syncs, 1);
        let result = self.inner.flush();
        if result.is_err() {
            self.sync_failed.store(true, Ordering::Release);
        }
        result
    }

    fn start_writeback(&self, offset: u64, len: u64) {
        self.inner.start_writeback(offset, len);
    }

    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        bump(&self.discarded, len);
        self.inner.discard(offset, len)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }

    fn can_grow(&self) -> bool {
        self.inner.can_grow()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }
}
