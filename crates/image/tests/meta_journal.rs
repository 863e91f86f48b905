//! The metadata journal's full mode and group commit, on in-memory
//! images: writes over data the newest record checksums are held (reads
//! see them) and reach the image at a checkpoint; a held write of a
//! cluster the guest then frees never leaks into the cluster's next
//! owner; concurrent flushes share commits; every flush costs the store
//! one sync; a guest flushing after each write has its records written
//! with its writes, and a failed data or record write leaves nothing a
//! recovery would misread.

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

/// Direct I/O that fails the next write of one class, once.
#[derive(Debug, Default)]
struct FailingIo {
    inner: DirectIo,
    fail_next: Mutex<Option<IoClass>>,
}

impl FailingIo {
    fn fail_next_write_of(&self, class: IoClass) {
        *self.fail_next.lock().unwrap() = Some(class);
    }
}

impl HostIo for FailingIo {
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
        let mut fail = self.fail_next.lock().unwrap();
        if fail.is_some_and(|c| segments.iter().any(|s| s.tag.class == c)) {
            *fail = None;
            return Err(HostError::Io(std::io::Error::other(
                "injected write failure",
            )));
        }
        drop(fail);
        self.inner.write(image, offset, segments)
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
        self.inner.flush(image, kind)
    }
}

#[test]
fn a_failed_eager_record_or_data_write_leaves_every_flushed_write_readable() {
    let io = Arc::new(FailingIo::default());
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
