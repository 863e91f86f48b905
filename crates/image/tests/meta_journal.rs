//! The metadata journal's full mode and group commit, on in-memory
//! images: writes over data the newest record checksums are held (reads
//! see them) and reach the image at a checkpoint; a held write of a
//! cluster the guest then frees never leaks into the cluster's next
//! owner; concurrent flushes share commits; every flush costs the store
//! one sync; a guest flushing after each write has its records written
//! with its writes, and a failed data or record write leaves nothing a
//! recovery would misread. A write over data its own interval checksums
//! goes in place, and the commit waits for it and vouches for its bytes.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::{Arc, Mutex};
use vdcache_image::{
    CreateOptions, DirectIo, FlushKind, HostError, HostIo, ImageFormat, ImageHandle, IoClass,
    IoTag, JournalMode, MemFiles, MetaTable, OpenOptions, VirtualDisk, WriteSegment, open_chain,
    qcow2_image_bytes,
};
use vdcache_qcow2::HostOffset;

const CLUSTER: u64 = 65536;

fn journaled(size: u64) -> (Arc<MemFiles>, Arc<DirectIo>, VirtualDisk) {
    let io = DirectIo::new();
    let (files, disk) = journaled_on(size, io.clone());
    (files, io, disk)
}

/// A new journaled image of `size` bytes whose I/O goes through `io`.
fn journaled_on(size: u64, io: Arc<dyn HostIo>) -> (Arc<MemFiles>, VirtualDisk) {
    let files = MemFiles::new();
    files.insert(
        "img.qcow2",
        qcow2_image_bytes(Path::new("img"), &CreateOptions::default(), size).unwrap(),
    );
    let disk = open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            io: Some(io),
            metadata_journal: JournalMode::Required,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    (files, disk)
}

fn read(disk: &VirtualDisk, at: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    disk.read(at, &mut buf).unwrap();
    buf
}

#[test]
fn a_held_write_of_a_freed_cluster_never_reaches_its_next_owner() {
    let (_files, _io, disk) = journaled(64 * CLUSTER);
    disk.write(0, &vec![1u8; CLUSTER as usize], false).unwrap();
    disk.flush().unwrap();
    // Over data the newest record checksums: held, and read back.
    disk.write(4096, &[2u8; 4096], false).unwrap();
    assert_eq!(read(&disk, 4096, 4096), vec![2u8; 4096]);
    assert_eq!(disk.journal_stats().unwrap().held_bytes, 4096);
    // The guest frees the cluster; the commit that frees it is proven by
    // the next, so the cluster may be allocated again: the held write
    // must go with it, not be written into the cluster's next owner.
    disk.discard(0, CLUSTER).unwrap();
    disk.flush().unwrap();
    disk.flush().unwrap();
    assert_eq!(disk.journal_stats().unwrap().held_bytes, 0);
    for i in 1..8u64 {
        disk.write(i * CLUSTER, &vec![3u8; CLUSTER as usize], false)
            .unwrap();
    }
    for i in 1..8u64 {
        assert_eq!(
            read(&disk, i * CLUSTER, CLUSTER as usize),
            vec![3u8; CLUSTER as usize],
            "cluster {i} reads another owner's held bytes"
        );
    }
    disk.flush().unwrap();
    disk.close().unwrap();
}

#[test]
fn held_writes_read_back_and_survive_a_clean_close() {
    let (files, _io, disk) = journaled(64 * CLUSTER);
    disk.write(0, &vec![1u8; 2 * CLUSTER as usize], false)
        .unwrap();
    disk.flush().unwrap();
    for i in 0..16u64 {
        disk.write(i * 8192, &[i as u8 + 10; 512], false).unwrap();
        assert_eq!(read(&disk, i * 8192, 512), vec![i as u8 + 10; 512]);
    }
    disk.close().unwrap();
    drop(disk);
    let again = open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    for i in 0..16u64 {
        assert_eq!(read(&again, i * 8192, 512), vec![i as u8 + 10; 512]);
        assert_eq!(read(&again, i * 8192 + 512, 512), vec![1u8; 512]);
    }
}

#[test]
fn each_guest_flush_costs_one_store_sync_and_concurrent_flushes_share_commits() {
    let (_files, io, disk) = journaled(256 * CLUSTER);
    let disk = Arc::new(disk);
    let before = io.counters.snapshot().flushes;
    for i in 0..20u64 {
        disk.write(i * 3 * CLUSTER, &[5u8; 4096], false).unwrap();
        disk.flush().unwrap();
    }
    let serial = io.counters.snapshot().flushes - before;
    assert_eq!(serial, 20, "one store sync per flush, {serial} for 20");
    let before = io.counters.snapshot().flushes;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let disk = disk.clone();
            s.spawn(move || {
                for i in 0..10u64 {
                    disk.write((t * 10 + i) * CLUSTER + 4096, &[6u8; 4096], false)
                        .unwrap();
                    disk.flush().unwrap();
                }
            });
        }
    });
    let shared = io.counters.snapshot().flushes - before;
    assert!(
        shared <= 80,
        "80 concurrent flushes cost {shared} store syncs"
    );
}

/// Opens what `files` hold now as if after a crash: every write issued
/// landed, nothing was closed.
fn reopen_crashed(files: &MemFiles) -> VirtualDisk {
    let crashed = MemFiles::new();
    crashed.insert("img.qcow2", files.get("img.qcow2").unwrap().snapshot());
    open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: crashed,
            metadata_journal: JournalMode::Required,
            ..OpenOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn a_guest_flushing_after_each_write_has_its_records_written_with_the_writes() {
    let (files, io, disk) = journaled(256 * CLUSTER);
    let before = io.counters.snapshot().flushes;
    for i in 0..20u64 {
        disk.write(i * 3 * CLUSTER + 512, &[i as u8 + 1; 4096], false)
            .unwrap();
        disk.flush().unwrap();
    }
    assert_eq!(io.counters.snapshot().flushes - before, 20);
    let stats = disk.journal_stats().unwrap();
    assert_eq!(
        stats.eager_records, 20,
        "each flush found its record written with the write before it"
    );
    // The checkpoints the flushes left to the eager records happened: the
    // L2 table reached its place before any close.
    let l2 = IoClass::Metadata(MetaTable::L2).index();
    assert!(io.counters.snapshot().write_ops[l2] > 0, "{stats:?}");
    // Two writes before a flush: the second makes the first's eager
    // record stale, so the flush writes its own.
    disk.write(61 * CLUSTER, &[99; 4096], false).unwrap();
    disk.write(64 * CLUSTER + 8192, &[98; 4096], false).unwrap();
    disk.flush().unwrap();
    assert_eq!(disk.journal_stats().unwrap().eager_records, 20);
    // One write per flush again: the next write's record goes with it.
    disk.write(66 * CLUSTER, &[96; 4096], false).unwrap();
    disk.flush().unwrap();
    // A write whose eager record landed but that no flush covered yet:
    // the crash state has both whole, so recovery replays that record.
    disk.write(70 * CLUSTER, &[97; 4096], false).unwrap();
    let crashed = reopen_crashed(&files);
    let expect = |at: u64, byte: u8| {
        assert!(
            read(&crashed, at, 4096) == vec![byte; 4096],
            "after the crash {at:#x} does not read {byte}"
        );
    };
    for i in 0..20u64 {
        expect(i * 3 * CLUSTER + 512, i as u8 + 1);
    }
    expect(61 * CLUSTER, 99);
    expect(64 * CLUSTER + 8192, 98);
    expect(66 * CLUSTER, 96);
    expect(70 * CLUSTER, 97);
}

/// What a test store does to writes (and notes of flushes) before direct
/// I/O carries them out.
trait Hook: std::fmt::Debug + Send + Sync {
    fn write(
        &self,
        inner: &DirectIo,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<(), HostError>;

    fn flushing(&self) {}
}

/// Direct I/O with a [`Hook`] on its writes and flushes.
#[derive(Debug, Default)]
struct Hooked<H> {
    inner: DirectIo,
    hook: H,
}

impl<H> std::ops::Deref for Hooked<H> {
    type Target = H;

    fn deref(&self) -> &H {
        &self.hook
    }
}

impl<H: Hook> HostIo for Hooked<H> {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<(), HostError> {
        self.inner.read(image, offset, buf, tag)
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<(), HostError> {
        self.hook.write(&self.inner, image, offset, segments)
    }

    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        tag: IoTag,
    ) -> Result<(), HostError> {
        self.inner.discard(image, offset, len, tag)
    }

    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> Result<(), HostError> {
        self.hook.flushing();
        self.inner.flush(image, kind)
    }
}

/// Fails the next write of one class, once; torn, it
/// writes that write's first sector before it fails.
#[derive(Debug, Default)]
struct FailingIo {
    fail_next: Mutex<Option<IoClass>>,
    torn: std::sync::atomic::AtomicBool,
}

impl FailingIo {
    fn fail_next_write_of(&self, class: IoClass) {
        *self.fail_next.lock().unwrap() = Some(class);
    }

    fn tear_next_write_of(&self, class: IoClass) {
        self.torn.store(true, std::sync::atomic::Ordering::SeqCst);
        self.fail_next_write_of(class);
    }
}

impl Hook for FailingIo {
    fn write(
        &self,
        inner: &DirectIo,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<(), HostError> {
        let mut fail = self.fail_next.lock().unwrap();
        if fail.is_some_and(|c| segments.iter().any(|s| s.tag.class == c)) {
            *fail = None;
            if self.torn.swap(false, std::sync::atomic::Ordering::SeqCst) {
                let bytes: Vec<u8> = segments
                    .iter()
                    .flat_map(|s| s.data.iter().copied())
                    .collect();
                let first = WriteSegment {
                    data: &bytes[..512],
                    tag: segments[0].tag,
                };
                inner.write(image, offset, &[first])?;
            }
            return Err(HostError::Io(std::io::Error::other(
                "injected write failure",
            )));
        }
        drop(fail);
        inner.write(image, offset, segments)
    }
}

#[test]
fn a_failed_eager_record_or_data_write_leaves_every_flushed_write_readable() {
    let io = Arc::new(Hooked::<FailingIo>::default());
    let (files, disk) = journaled_on(256 * CLUSTER, io.clone());
    disk.write(0, &[1; 4096], false).unwrap();
    disk.flush().unwrap();
    // The eager record's write fails: the guest's write does not, and its
    // flush writes the record itself.
    io.fail_next_write_of(IoClass::Metadata(MetaTable::Journal));
    disk.write(3 * CLUSTER, &[2; 4096], false).unwrap();
    let eager = disk.journal_stats().unwrap().eager_records;
    disk.flush().unwrap();
    assert_eq!(disk.journal_stats().unwrap().eager_records, eager);
    // The data write fails after its eager record was written: the guest
    // sees the error, and later flushes write records of their own.
    io.fail_next_write_of(IoClass::GuestData);
    assert!(disk.write(6 * CLUSTER, &[3; 4096], false).is_err());
    disk.flush().unwrap();
    disk.write(9 * CLUSTER, &[4; 4096], false).unwrap();
    disk.flush().unwrap();
    let crashed = reopen_crashed(&files);
    for (at, byte) in [(0, 1u8), (3 * CLUSTER, 2), (9 * CLUSTER, 4)] {
        assert!(
            read(&crashed, at, 4096) == vec![byte; 4096],
            "flushed write at {at:#x} lost"
        );
    }
    let failed = read(&crashed, 6 * CLUSTER, 4096);
    assert!(
        failed == vec![0; 4096] || failed == vec![3; 4096],
        "the failed write's range reads neither the old nor the new bytes"
    );
}

#[test]
fn a_write_over_data_its_interval_checksums_goes_in_place_and_is_vouched_for() {
    let (files, io, disk) = journaled(64 * CLUSTER);
    disk.write(0, &[1; 4096], false).unwrap();
    disk.flush().unwrap();
    // A new cluster, then writes over it in the same interval: none held.
    disk.write(4 * CLUSTER, &[2; 4096], false).unwrap();
    disk.write(4 * CLUSTER + 0x1200, &[3; 4096], false).unwrap();
    disk.write(4 * CLUSTER + 0x1400, &[4; 512], false).unwrap();
    let stats = disk.journal_stats().unwrap();
    assert_eq!(stats.held_bytes, 0, "{stats:?}");
    let writes = io.counters.snapshot();
    disk.flush().unwrap();
    assert_eq!(io.counters.snapshot().flushes - writes.flushes, 1);
    // The record vouches for the bytes in place: recovery replays it
    // rather than the one before (which maps nothing at 4 clusters).
    let crashed = reopen_crashed(&files);
    let mut expect = vec![0u8; CLUSTER as usize];
    expect[..4096].fill(2);
    expect[0x1200..0x2200].fill(3);
    expect[0x1400..0x1600].fill(4);
    assert!(read(&crashed, 4 * CLUSTER, CLUSTER as usize) == expect);
    assert_eq!(read(&crashed, 0, 4096), vec![1; 4096]);
}

#[test]
fn a_torn_write_over_data_its_interval_checksums_is_checksummed_anew() {
    let io = Arc::new(Hooked::<FailingIo>::default());
    let (files, disk) = journaled_on(64 * CLUSTER, io.clone());
    // The first allocations put the tables in place (a checkpoint).
    disk.write(0, &[9; 4096], false).unwrap();
    disk.flush().unwrap();
    disk.flush().unwrap();
    disk.write(2 * CLUSTER, &[1; 4096], false).unwrap();
    disk.write(3 * CLUSTER, &[5; 4096], false).unwrap();
    // Its first sector lands, then it fails: the checksums the interval
    // held for those bytes are wrong now.
    io.tear_next_write_of(IoClass::GuestData);
    assert!(disk.write(2 * CLUSTER + 0x200, &[2; 4096], false).is_err());
    disk.flush().unwrap();
    // The record vouches for what is in place, so it is replayed: both
    // new clusters stay mapped.
    let crashed = reopen_crashed(&files);
    let mut expect = vec![1u8; 4096];
    expect[0x200..0x400].fill(2);
    assert!(
        read(&crashed, 2 * CLUSTER, 4096) == expect,
        "the record was not replayed"
    );
    assert_eq!(read(&crashed, 3 * CLUSTER, 4096), vec![5; 4096]);
}

/// Stops the next guest data write until released, and
/// notes any record write or sync that arrives meanwhile.
#[derive(Debug, Default)]
struct GatedIo {
    gate: Mutex<Gate>,
    changed: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Gate {
    armed: bool,
    stopped: bool,
    released: bool,
    /// A commit's record or sync went out while the write was stopped.
    overtaken: bool,
}

impl GatedIo {
    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap()
    }

    fn wait_until(&self, what: impl Fn(&Gate) -> bool) {
        let mut g = self.gate();
        while !what(&g) {
            g = self.changed.wait(g).unwrap();
        }
    }

    fn set(&self, change: impl FnOnce(&mut Gate)) {
        change(&mut self.gate());
        self.changed.notify_all();
    }

    /// A commit's I/O: it must not overtake the stopped write.
    fn commit_io(&self) {
        self.set(|g| {
            if g.stopped && !g.released {
                g.overtaken = true;
                g.released = true;
            }
        });
    }
}

impl Hook for GatedIo {
    fn write(
        &self,
        inner: &DirectIo,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<(), HostError> {
        let class = segments[0].tag.class;
        if class == IoClass::Metadata(MetaTable::Journal) {
            self.commit_io();
        } else if class == IoClass::GuestData && std::mem::take(&mut self.gate().armed) {
            self.set(|g| g.stopped = true);
            self.wait_until(|g| g.released);
        }
        inner.write(image, offset, segments)
    }

    fn flushing(&self) {
        self.commit_io();
    }
}

#[test]
fn a_commit_waits_for_a_write_over_data_its_interval_checksums() {
    let io = Arc::new(Hooked::<GatedIo>::default());
    let (files, disk) = journaled_on(64 * CLUSTER, io.clone());
    disk.write(0, &[1; 4096], false).unwrap();
    disk.flush().unwrap();
    disk.write(CLUSTER, &[2; 4096], false).unwrap();
    io.set(|g| g.armed = true);
    std::thread::scope(|s| {
        let writer = s.spawn(|| disk.write(CLUSTER + 0x1000, &[3; 4096], false));
        io.wait_until(|g| g.stopped);
        let flusher = s.spawn(|| disk.flush());
        // Released once the commit waits for the write (or, if it does
        // not, once its record or sync overtakes it).
        let mut waits = 0;
        while waits == 0 && !io.gate().overtaken {
            waits = disk.journal_stats().unwrap().overwrite_waits;
            std::thread::yield_now();
        }
        io.set(|g| g.released = true);
        writer.join().unwrap().unwrap();
        flusher.join().unwrap().unwrap();
    });
    assert!(
        !io.gate().overtaken,
        "the commit wrote its record or synced while a write it vouches for was in flight"
    );
    assert_eq!(disk.journal_stats().unwrap().overwrite_waits, 1);
    let crashed = reopen_crashed(&files);
    let mut expect = vec![2u8; 8192];
    expect[4096..].fill(3);
    assert!(read(&crashed, CLUSTER, 8192) == expect);
}
