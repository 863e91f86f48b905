//! Write-back keeps many requests in flight and coalesces neighbours
//! (issue 25): draining scattered dirty blocks of a slow store sends them
//! concurrently, and a run of adjacent blocks goes as one request.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vdcache_backend::inject::HookedBackend;
use vdcache_backend::{BackendRef, LockMode, MemBackend};
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_image::{ImageFormat, MemFiles, StoreOpener};

const BLOCK: u64 = 4096;
const IMAGE: u64 = 64 << 20;
const NAME: &str = "d/disk.raw";

/// Writes by the write-back thread (and the workers it runs under its
/// name) are counted, and each takes a few milliseconds, as on a remote
/// store.
#[derive(Debug)]
struct SlowFiles {
    files: Arc<MemFiles>,
    in_flight: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    requests: Arc<Mutex<Vec<u64>>>,
}

impl StoreOpener for SlowFiles {
    fn open(
        &self,
        name: &str,
        writable: bool,
        lock: Option<LockMode>,
    ) -> vdcache_image::Result<BackendRef> {
        let (in_flight, most) = (self.in_flight.clone(), self.most.clone());
        let requests = self.requests.clone();
        let hook = move || {
            if std::thread::current().name() == Some("vdcache-writeback") {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                requests.lock().expect("requests").push(0);
                std::thread::sleep(Duration::from_millis(5));
                in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            Ok(())
        };
        let inner = HookedBackend::new(self.files.open(name, writable, lock)?).on_write(hook);
        Ok(Arc::new(inner))
    }

    fn canonical(&self, name: &str) -> vdcache_image::Result<String> {
        self.files.canonical(name)
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        self.files.resolve(parent, backing)
    }
}

#[test]
fn draining_scattered_blocks_sends_many_at_once_and_neighbours_as_one() {
    let files = MemFiles::new();
    files.insert(NAME, vec![0u8; IMAGE as usize]);
    let opener = Arc::new(SlowFiles {
        files: files.clone(),
        in_flight: Arc::default(),
        most: Arc::default(),
        requests: Arc::default(),
    });
    let config = CacheConfig {
        host: Some("test-host".into()),
        region_bytes: 1 << 20,
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..CacheConfig::default()
    };
    let device: BackendRef = Arc::new(MemBackend::fixed("cache", 16 << 20));
    let cache = FlashCache::format(device, config).expect("format");
    let disk = common::disk_through(opener.clone(), &cache, NAME, ImageFormat::Raw);
    // 48 blocks 1 MiB apart, and one run of 8 adjacent blocks.
    let mut expected = Vec::new();
    for i in 0..48u64 {
        let at = (i + 1) * (1 << 20);
        disk.write(at, &[i as u8 + 1; BLOCK as usize], false)
            .expect("write");
        expected.push((at, i as u8 + 1));
    }
    disk.write(0, &[0xee; 8 * BLOCK as usize], false)
        .expect("write");
    cache.drain().expect("drain");

    let requests = opener.requests.lock().expect("requests").len();
    assert_eq!(requests, 49, "48 scattered blocks and one run of 8");
    let most = opener.most.load(Ordering::SeqCst);
    assert!(most >= 4, "at most {most} write-back request(s) in flight");
    let image = files.open(NAME, false, None).expect("image");
    for (at, byte) in expected.into_iter().chain([(0, 0xee), (7 * BLOCK, 0xee)]) {
        let mut b = vec![0u8; BLOCK as usize];
        image.read_at(&mut b, at).expect("read");
        assert!(b.iter().all(|&x| x == byte), "block at {at}");
    }
}

/// An image store that forgets what a failed sync did not cover, as a
/// kernel that dropped the dirty pages it could not write: reads see
/// every completed write, but only the `durable` bytes survive a crash.
#[derive(Debug)]
struct ForgetfulStore {
    durable: Mutex<Vec<u8>>,
    /// Completed writes not yet covered by a successful sync, in order.
    unsynced: Mutex<Vec<(u64, Vec<u8>)>>,
    /// How many of the next syncs fail.
    failing_syncs: AtomicUsize,
    syncs: AtomicUsize,
}

impl vdcache_backend::Backend for ForgetfulStore {
    fn len(&self) -> std::io::Result<u64> {
        Ok(IMAGE)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let at = offset as usize;
        buf.copy_from_slice(&self.durable.lock().expect("durable")[at..at + buf.len()]);
        for (w, data) in self.unsynced.lock().expect("unsynced").iter() {
            let (start, end) = (
                offset.max(*w),
                (offset + buf.len() as u64).min(*w + data.len() as u64),
            );
            if start < end {
                buf[(start - offset) as usize..(end - offset) as usize]
                    .copy_from_slice(&data[(start - w) as usize..(end - w) as usize]);
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.unsynced
            .lock()
            .expect("unsynced")
            .push((offset, buf.to_vec()));
        Ok(())
    }

    fn flush(&self) -> std::io::Result<()> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        // Covers what completed before it began.
        let covered: Vec<_> = std::mem::take(&mut *self.unsynced.lock().expect("unsynced"));
        let fail = self
            .failing_syncs
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Err(std::io::Error::other("injected sync failure: writes lost"));
        }
        let mut durable = self.durable.lock().expect("durable");
        for (at, data) in covered {
            durable[at as usize..at as usize + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }

    fn discard(&self, _offset: u64, _len: u64) -> std::io::Result<()> {
        Ok(())
    }

    fn set_len(&self, _len: u64) -> std::io::Result<()> {
        Ok(())
    }

    fn can_grow(&self) -> bool {
        false
    }

    fn name(&self) -> &str {
        NAME
    }
}

#[derive(Debug)]
struct ForgetfulFiles {
    store: Arc<ForgetfulStore>,
    names: Arc<MemFiles>,
}

impl StoreOpener for ForgetfulFiles {
    fn open(&self, _: &str, _: bool, _: Option<LockMode>) -> vdcache_image::Result<BackendRef> {
        Ok(self.store.clone())
    }

    fn canonical(&self, name: &str) -> vdcache_image::Result<String> {
        self.names.canonical(name)
    }

    fn resolve(&self, parent: &str, backing: &str) -> String {
        self.names.resolve(parent, backing)
    }
}

#[test]
fn a_batch_whose_sync_failed_stays_dirty_and_is_written_again() {
    let names = MemFiles::new();
    names.insert(NAME, Vec::new());
    let store = Arc::new(ForgetfulStore {
        durable: Mutex::new(vec![0u8; IMAGE as usize]),
        unsynced: Mutex::default(),
        failing_syncs: AtomicUsize::new(0),
        syncs: AtomicUsize::new(0),
    });
    let opener = Arc::new(ForgetfulFiles {
        store: store.clone(),
        names,
    });
    let config = CacheConfig {
        host: Some("test-host".into()),
        region_bytes: 1 << 20,
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..CacheConfig::default()
    };
    let device: BackendRef = Arc::new(MemBackend::fixed("cache", 64 << 20));
    let cache = FlashCache::format(device, config).expect("format");
    let disk = common::disk_through(opener, &cache, NAME, ImageFormat::Raw);
    // Every other block of 40 MiB: several write-back batches, no runs.
    let blocks: Vec<u64> = (0..(40 << 20) / BLOCK).step_by(2).collect();
    for &b in &blocks {
        disk.write(b * BLOCK, &[(b % 251) as u8 + 1; BLOCK as usize], false)
            .expect("write");
    }
    // The first batch's sync fails: its writes are gone from the store.
    store.failing_syncs.store(1, Ordering::SeqCst);
    cache.drain().expect("drain");
    assert_eq!(
        store.failing_syncs.load(Ordering::SeqCst),
        0,
        "the failure was injected"
    );
    assert!(
        store.syncs.load(Ordering::SeqCst) >= 3,
        "more than one batch"
    );
    // What survives a crash now: every block, written again after the
    // failed sync and covered by a later one.
    let durable = store.durable.lock().expect("durable");
    for &b in &blocks {
        let at = (b * BLOCK) as usize;
        assert!(
            durable[at..at + BLOCK as usize]
                .iter()
                .all(|&x| x == (b % 251) as u8 + 1),
            "block {b} was marked clean without a sync covering it"
        );
    }
}
