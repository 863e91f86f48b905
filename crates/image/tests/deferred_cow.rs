//! Deferred copy-on-write: a small allocating write into a cluster the
//! backing chain supplies is acknowledged before its filler is read, and
//! a worker completes it. Reads of the cluster see the guest's bytes at
//! once, a flush returns only once every such write is in the image, a
//! worker's failure (or panic) fails every later flush, and a disk that
//! flushes often writes inline.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use vdcache_backend::inject::{Gate, eventually};
use vdcache_image::{
    CreateOptions, DirectIo, FlushKind, HostError, HostIo, ImageFormat, ImageHandle, IoClass,
    IoTag, Layer, MemFiles, OpenOptions, VirtualDisk, WriteSegment, open_chain, qcow2_image_bytes,
};
use vdcache_qcow2::HostOffset;

type Result<T> = std::result::Result<T, HostError>;

const CLUSTER: u64 = 64 << 10;
const SIZE: u64 = 32 << 20;
const TOP: &str = "dir/top.qcow2";

/// Direct I/O whose copy-on-write filler reads wait at a gate (when it
/// is armed) or fail (when told to), and which counts them.
#[derive(Debug, Default)]
struct FillerIo {
    inner: DirectIo,
    armed: AtomicBool,
    gate: Gate,
    fail: AtomicBool,
    panic: AtomicBool,
    filler_reads: AtomicU64,
}

impl HostIo for FillerIo {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()> {
        if tag.class == IoClass::CowFill {
            self.filler_reads.fetch_add(1, Ordering::SeqCst);
            if self.armed.load(Ordering::SeqCst) {
                self.gate.wait();
            }
            assert!(!self.panic.load(Ordering::SeqCst), "injected panic");
            if self.fail.load(Ordering::SeqCst) {
                return Err(HostError::from(std::io::Error::other(
                    "injected read error",
                )));
            }
        }
        self.inner.read(image, offset, buf, tag)
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<()> {
        self.inner.write(image, offset, segments)
    }

    fn discard(&self, image: &ImageHandle, offset: HostOffset, len: u64, tag: IoTag) -> Result<()> {
        self.inner.discard(image, offset, len, tag)
    }

    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> Result<()> {
        self.inner.flush(image, kind)
    }
}

/// The base's byte at guest offset `at`.
fn base_byte(at: u64) -> u8 {
    (at / 4096 % 251) as u8 + 1
}

/// A delta over a full raw base, in memory; returns the files and the
/// guest's view of the base.
fn chain() -> (Arc<MemFiles>, Vec<u8>) {
    let files = MemFiles::new();
    let base: Vec<u8> = (0..SIZE).map(base_byte).collect();
    files.insert("dir/base.raw", base.clone());
    let opts = CreateOptions {
        size: Some(SIZE),
        backing: Some(("base.raw".into(), ImageFormat::Raw)),
        ..CreateOptions::default()
    };
    let bytes = qcow2_image_bytes(Path::new("top"), &opts, SIZE).unwrap();
    files.insert(TOP, bytes);
    (files, base)
}

fn open(files: &Arc<MemFiles>, io: Option<Arc<FillerIo>>) -> Arc<VirtualDisk> {
    let io: Option<Arc<dyn HostIo>> = io.map(|i| i as Arc<dyn HostIo>);
    Arc::new(
        open_chain(
            TOP,
            &OpenOptions {
                format: Some(ImageFormat::Qcow2),
                opener: files.clone(),
                io,
                ..OpenOptions::default()
            },
        )
        .unwrap(),
    )
}

/// The image's bytes as the store holds them now, opened on their own
/// (what a crash right now would leave).
fn reopen_copy(files: &Arc<MemFiles>) -> Arc<VirtualDisk> {
    let copy = MemFiles::new();
    for name in [TOP, "dir/base.raw"] {
        let b = files.get(name).unwrap();
        let mut bytes = vec![0u8; vdcache_backend::Backend::len(&*b).unwrap() as usize];
        vdcache_backend::Backend::read_at(&*b, &mut bytes, 0).unwrap();
        copy.insert(name, bytes);
    }
    open(&copy, None)
}

fn assert_reads(disk: &VirtualDisk, model: &[u8]) {
    let mut all = vec![0u8; SIZE as usize];
    disk.read(0, &mut all).unwrap();
    let diff = all.iter().zip(model).position(|(a, b)| a != b);
    assert_eq!(diff, None, "first difference from the model");
}

fn assert_clean(disk: &VirtualDisk) {
    let Layer::Qcow2(img) = &disk.layers()[0] else {
        unreachable!()
    };
    let report = img.check().unwrap();
    assert!(
        report.is_clean(),
        "check: {:?} {:?}",
        report.corruptions,
        report.leaks
    );
}

#[test]
fn stream_writes_are_read_back_at_once_and_complete_at_close() {
    let (files, mut model) = chain();
    let disk = open(&files, None);
    disk.defer_cow_writes(0);
    // 4 KiB writes at 512-byte multiples: 200 clusters, some twice, a few
    // writes across a cluster boundary (those go inline).
    let mut deferrable = 0;
    let mut touched = std::collections::BTreeSet::new();
    for i in 0..300u64 {
        let off = (i * 7919 * 512) % (SIZE - 8192) / 512 * 512 + (i % 3) * 512;
        let data = vec![(i % 250) as u8 + 3; 4096];
        let (first, last) = (off / CLUSTER, (off + 4095) / CLUSTER);
        if first == last && !touched.contains(&first) {
            deferrable += 1;
        }
        touched.insert(first);
        touched.insert(last);
        disk.write(off, &data, false).unwrap();
        model[off as usize..off as usize + 4096].copy_from_slice(&data);
        let mut back = vec![0u8; 8192];
        disk.read(off, &mut back).unwrap();
        assert_eq!(
            back[..],
            model[off as usize..off as usize + 8192],
            "write {i} at {off}"
        );
    }
    assert_eq!(disk.deferred_cow_writes(), deferrable);
    assert!(deferrable > 200, "{deferrable} writes deferred");
    disk.close().unwrap();
    assert_clean(&disk);
    drop(disk);
    assert_reads(&open(&files, None), &model);
}

#[test]
fn a_flush_returns_once_deferred_writes_are_in_the_image() {
    let (files, mut model) = chain();
    let io = Arc::new(FillerIo::default());
    io.armed.store(true, Ordering::SeqCst);
    let disk = open(&files, Some(io.clone()));
    disk.defer_cow_writes(0);
    let data = vec![0xee; 4096];
    disk.write(3 * CLUSTER + 8192, &data, false).unwrap();
    model[(3 * CLUSTER + 8192) as usize..(3 * CLUSTER + 12288) as usize].fill(0xee);
    assert_eq!(
        disk.deferred_cow_writes(),
        1,
        "acknowledged with the filler unread"
    );
    assert!(eventually(|| io.gate.held() == 1));
    std::thread::scope(|s| {
        let flusher = s.spawn(|| disk.flush());
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !flusher.is_finished(),
            "the flush waits for the deferred write"
        );
        io.gate.release();
        flusher.join().unwrap().unwrap();
    });
    assert!(!io.gate.opened_by_timeout());
    // What the store holds now is what a crash would leave: the write is
    // in it, mapped.
    let after_crash = reopen_copy(&files);
    assert_reads(&after_crash, &model);
    disk.close().unwrap();
    assert_clean(&disk);
}

/// A deferred write whose filler read fails (or panics): every flush
/// fails from then on, naming the cause, though the disk's other writes
/// are still flushed; the write's cluster is released (nothing leaks) and
/// the guest range reads as before the write.
fn a_lost_deferred_write_fails_every_flush(panic: bool) {
    let (files, mut model) = chain();
    let io = Arc::new(FillerIo::default());
    let disk = open(&files, Some(io.clone()));
    disk.defer_cow_writes(0);
    disk.write(CLUSTER, &[0x22; 65536], false).unwrap();
    model[CLUSTER as usize..2 * CLUSTER as usize].fill(0x22);
    io.fail.store(true, Ordering::SeqCst);
    io.panic.store(panic, Ordering::SeqCst);
    disk.write(5 * CLUSTER + 512, &[0x11; 4096], false).unwrap();
    let cause = if panic {
        "panicked"
    } else {
        "injected read error"
    };
    for _ in 0..2 {
        // On a thread: a worker that never ends its write would hang it.
        let (tx, rx) = std::sync::mpsc::channel();
        let flushing = disk.clone();
        std::thread::spawn(move || tx.send(flushing.flush().map_err(|e| e.to_string())));
        let err = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the flush returns")
            .unwrap_err();
        assert!(err.contains("was lost") && err.contains(cause), "{err}");
    }
    io.fail.store(false, Ordering::SeqCst);
    io.panic.store(false, Ordering::SeqCst);
    assert_reads(&disk, &model);
    let err = disk.close().unwrap_err().to_string();
    assert!(err.contains(cause), "{err}");
    assert_clean(&disk);
    drop(disk);
    assert_reads(&reopen_copy(&files), &model);
}

#[test]
fn a_failed_deferred_write_fails_every_flush_and_leaks_nothing() {
    a_lost_deferred_write_fails_every_flush(false);
}

#[test]
fn a_panicking_worker_fails_every_flush_instead_of_hanging_the_disk() {
    a_lost_deferred_write_fails_every_flush(true);
}

#[test]
fn a_disk_flushing_every_few_writes_writes_inline() {
    let (files, mut model) = chain();
    let io = Arc::new(FillerIo::default());
    let disk = open(&files, Some(io.clone()));
    disk.defer_cow_writes(vdcache_image::STREAM_WRITES);
    for i in 0..200u64 {
        let off = i * CLUSTER + 4096;
        disk.write(off, &[9; 4096], false).unwrap();
        model[off as usize..off as usize + 4096].fill(9);
        if i % 8 == 7 {
            disk.flush().unwrap();
        }
    }
    assert_eq!(disk.deferred_cow_writes(), 0);
    assert_eq!(io.filler_reads.load(Ordering::SeqCst), 200);
    // A stream without flushes defers from its STREAM_WRITES-th write.
    for i in 200..250u64 {
        let off = i * CLUSTER + 4096;
        disk.write(off, &[9; 4096], false).unwrap();
        model[off as usize..off as usize + 4096].fill(9);
    }
    assert_eq!(disk.deferred_cow_writes(), 0);
    for i in 0..100u64 {
        let off = (i + 250) * CLUSTER;
        disk.write(off, &[7; 4096], false).unwrap();
        model[off as usize..off as usize + 4096].fill(7);
    }
    let inline = vdcache_image::STREAM_WRITES - 1 - 50;
    assert_eq!(disk.deferred_cow_writes(), 100 - inline);
    disk.close().unwrap();
    assert_clean(&disk);
    assert_reads(&disk, &model);
}
