//! Write-back keeps many requests in flight and coalesces neighbours
//! (issue 25): draining scattered dirty blocks of a slow store sends them
//! concurrently, and a run of adjacent blocks goes as one request.

mod common;

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
