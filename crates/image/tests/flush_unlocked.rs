//! A guest flush's durable sync runs without the image's metadata lock:
//! the disk's requests go on during it, and what they change (a cluster
//! freed, data written) is not counted as covered by that sync.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use vdcache_backend::inject::{Gate, eventually};
use vdcache_image::HostError;
use vdcache_image::{
    CreateOptions, DirectIo, FlushKind, HostIo, ImageFormat, ImageHandle, IoClass, IoTag, MemFiles,
    OpenOptions, VirtualDisk, WriteSegment, open_chain, qcow2_image_bytes,
};
use vdcache_qcow2::HostOffset;

type Result<T> = std::result::Result<T, HostError>;

const CLUSTER: u64 = 64 << 10;
const SIZE: u64 = 64 << 20;
const GATED_THREAD: &str = "gated-flush";

/// Direct I/O whose durable flushes from one thread wait at a gate, and
/// which counts the space the image reclaims.
#[derive(Debug)]
struct GatedIo {
    inner: Arc<DirectIo>,
    gate: Gate,
    reclaimed: AtomicU64,
}

impl GatedIo {
    fn closed() -> Arc<GatedIo> {
        Arc::new(GatedIo {
            inner: DirectIo::new(),
            gate: Gate::default(),
            reclaimed: AtomicU64::new(0),
        })
    }

    fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::SeqCst)
    }
}

impl HostIo for GatedIo {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<()> {
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
        if tag.class == IoClass::Reclaim {
            self.reclaimed.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.discard(image, offset, len, tag)
    }

    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> Result<()> {
        if kind == FlushKind::Durable && std::thread::current().name() == Some(GATED_THREAD) {
            self.gate.wait();
        }
        self.inner.flush(image, kind)
    }
}

fn disk_on(io: &Arc<GatedIo>) -> VirtualDisk {
    let files = MemFiles::new();
    let image =
        qcow2_image_bytes(Path::new("img"), &CreateOptions::default(), SIZE).expect("create");
    files.insert("img.qcow2", image);
    let io: Arc<dyn HostIo> = io.clone();
    open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files,
            io: Some(io),
            ..OpenOptions::default()
        },
    )
    .expect("open")
}

/// Cluster 0 written and flushed; then (`during`) cluster 0 discarded and
/// cluster 2 written, either while a flush's sync waits at the gate or
/// after an ordinary flush. Returns what the next flush wrote.
fn run(io: &Arc<GatedIo>, during_a_gated_sync: bool) -> vdcache_image::qimage::FlushReport {
    let disk = disk_on(io);
    disk.write(0, &[1; CLUSTER as usize], false).expect("write");
    disk.flush().expect("flush");
    let during = || {
        disk.discard(0, CLUSTER).expect("discard");
        disk.write(2 * CLUSTER, &[2; CLUSTER as usize], false)
            .expect("write");
    };
    if during_a_gated_sync {
        std::thread::scope(|s| {
            let flusher = std::thread::Builder::new()
                .name(GATED_THREAD.into())
                .spawn_scoped(s, || disk.flush())
                .expect("spawn");
            assert!(eventually(|| io.gate.held() > 0));
            during();
            assert!(
                !io.gate.is_open(),
                "the requests waited for the flush's sync"
            );
            io.gate.release();
            flusher.join().expect("flusher").expect("flush");
        });
        assert_eq!(
            io.reclaimed(),
            0,
            "a sync that started before the discard applied its free"
        );
    } else {
        disk.flush().expect("flush");
        during();
    }
    let report = disk.flush_report().expect("flush");
    assert_eq!(io.reclaimed(), 1, "the next flush applies the free");
    let mut buf = vec![0; CLUSTER as usize];
    disk.read(2 * CLUSTER, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 2));
    report
}

#[test]
fn changes_made_during_an_unlocked_sync_wait_for_the_next_flush() {
    let sequential = run(&GatedIo::closed(), false);
    let concurrent = run(&GatedIo::closed(), true);
    // The write during the sync still needs its barrier before the
    // metadata pointing at it: the next flush writes what it would have
    // written had the two flushes not overlapped.
    assert_eq!(concurrent, sequential);
    assert!(sequential.barriers >= 2, "{sequential:?}");
}
