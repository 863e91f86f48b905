//! Checkpoints written while the journal goes on (issue 4): a guest flush
//! does not wait for a checkpoint's syncs, a crash before a started
//! checkpoint lands loses nothing flushed after it started, and a writer
//! that fills the journal ring waits for the checkpoint instead of
//! overwriting what replay needs.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use vdcache_backend::recording::{Log, LogOp, RecordingBackend, StateKind};
use vdcache_backend::{Backend, BackendRef, MemBackend};
use vdcache_cache::{CacheConfig, FlashCache};
use vdcache_image::{DiskId, HostIo, ImageFormat, MemFiles, OpenOptions, VirtualDisk, open_chain};

const BLOCK: u64 = 4096;
const IMAGE: u64 = 8 << 20;
const DEVICE: usize = 16 << 20;
const IMAGE_NAME: &str = "d/disk.raw";

fn config(inline: bool, interval: Option<u64>) -> CacheConfig {
    CacheConfig {
        host: Some("test-host".into()),
        inline_background: inline,
        checkpoint_interval_bytes: interval,
        // Nothing is written back: the cache alone holds what was written.
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..CacheConfig::default()
    }
}

fn image_files() -> Arc<MemFiles> {
    let files = MemFiles::new();
    files.insert(IMAGE_NAME, vec![0u8; IMAGE as usize]);
    files
}

fn disk_on(files: &Arc<MemFiles>, cache: &Arc<FlashCache>) -> VirtualDisk {
    let io: Arc<dyn HostIo> = cache.clone();
    open_chain(
        IMAGE_NAME,
        &OpenOptions {
            opener: files.clone(),
            io: Some(io),
            disk: DiskId(1),
            format: Some(ImageFormat::Raw),
            ..OpenOptions::default()
        },
    )
    .expect("open disk")
}

fn content(block: u64, round: u64) -> Vec<u8> {
    let v = (block.wrapping_mul(31) ^ round.wrapping_mul(131)) as u8 | 1;
    vec![v; BLOCK as usize]
}

/// Seeded block numbers.
struct Blocks(u64);

impl Blocks {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % (IMAGE / BLOCK)
    }
}

/// Writes eight random blocks of round `round`, noting them in `model`.
fn write_round(disk: &VirtualDisk, blocks: &mut Blocks, model: &mut HashMap<u64, u64>, round: u64) {
    for _ in 0..8 {
        let b = blocks.next();
        disk.write(b * BLOCK, &content(b, round), false)
            .expect("write");
        model.insert(b, round);
    }
}

/// Every block of the model reads back as its last write.
fn check(disk: &VirtualDisk, model: &HashMap<u64, u64>, what: &str) {
    let mut buf = vec![0u8; BLOCK as usize];
    for (&block, &round) in model {
        disk.read(block * BLOCK, &mut buf).expect("read");
        assert!(
            buf == content(block, round),
            "{what}: block {block} does not read back its write of round {round}"
        );
    }
}

#[test]
fn flushed_writes_survive_checkpoints_that_never_landed() {
    let log = Log::new();
    let device: BackendRef = Arc::new(RecordingBackend::fixed(&log, "cache", DEVICE));
    let files = image_files();
    let cache = FlashCache::format(device, config(true, Some(16 << 10))).expect("format");
    let disk = disk_on(&files, &cache);
    let mut blocks = Blocks(0x5eed);
    let mut model = HashMap::new();
    let mut flushes = Vec::new();
    for round in 0..80 {
        write_round(&disk, &mut blocks, &mut model, round);
        let before = log.len();
        disk.flush().expect("flush");
        flushes.push((before, log.len(), model.clone()));
    }
    let layout = *cache.layout();
    let journal = layout.journal_offset..layout.journal_offset + layout.journal_bytes;
    let started = cache.report();
    assert!(
        started.device.checkpoints >= 10,
        "{} checkpoints",
        started.device.checkpoints
    );
    let history = log.snapshot();
    let mut replayer = history.replayer();
    let mut entered = 0;
    for (before, after, model) in flushes {
        // The sync that made the guest flush's journal batch durable: from
        // there on its writes must survive, whatever the checkpoint
        // written around it does.
        let during = &history.entries()[before as usize..after as usize];
        let batch = during
            .iter()
            .rposition(|e| matches!(&e.op, LogOp::Write { offset, .. } if journal.contains(offset)))
            .unwrap_or(0);
        let synced = during[batch..]
            .iter()
            .find(|e| matches!(e.op, LogOp::Flush))
            .expect("a sync after the batch")
            .seq;
        let state = replayer.state(synced + 1, StateKind::All);
        let dev: BackendRef = Arc::new(state.device("cache").expect("device").to_mem_backend());
        let recovered = FlashCache::open(dev, config(true, Some(16 << 10))).expect("recover");
        entered += u32::from(recovered.report().recovery.entered_next_epoch);
        check(&disk_on(&files, &recovered), &model, "after a crash");
    }
    // Most checkpoints were still in flight at the next flush's sync.
    assert!(
        entered >= 5,
        "replay crossed into a newer epoch {entered} times"
    );
}

/// A cache device whose syncs from the checkpoint thread wait at a gate.
#[derive(Debug)]
struct GatedDevice {
    inner: MemBackend,
    open: Mutex<bool>,
    opened: Condvar,
    held: AtomicU64,
    holding: AtomicBool,
}

impl GatedDevice {
    fn closed() -> Arc<GatedDevice> {
        Arc::new(GatedDevice {
            inner: MemBackend::new("cache", vec![0; DEVICE]),
            open: Mutex::new(false),
            opened: Condvar::new(),
            held: AtomicU64::new(0),
            holding: AtomicBool::new(false),
        })
    }

    fn release(&self) {
        *self.open.lock().expect("gate") = true;
        self.opened.notify_all();
    }
}

impl Backend for GatedDevice {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        if std::thread::current().name() == Some("vdcache-checkpoint") {
            let mut open = self.open.lock().expect("gate");
            if !*open {
                self.held.fetch_add(1, Ordering::SeqCst);
                self.holding.store(true, Ordering::SeqCst);
            }
            while !*open {
                open = self.opened.wait(open).expect("gate");
            }
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn can_grow(&self) -> bool {
        false
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
}

#[test]
fn guest_flushes_do_not_wait_for_a_checkpoint_in_flight() {
    let gated = GatedDevice::closed();
    let device: BackendRef = gated.clone();
    let files = image_files();
    let config = config(false, Some(16 << 10));
    let cache = FlashCache::format(device.clone(), config.clone()).expect("format");
    let disk = disk_on(&files, &cache);
    let mut blocks = Blocks(0xbeef);
    let mut model = HashMap::new();
    let done = (Mutex::new(false), Condvar::new());
    let r = std::thread::scope(|s| {
        // Should a flush wait for the checkpoint after all, the gate opens
        // after a minute and the checks below fail instead of hanging.
        s.spawn(|| {
            let finished = done.0.lock().expect("done");
            let (finished, _) = done
                .1
                .wait_timeout_while(finished, std::time::Duration::from_secs(60), |f| !*f)
                .expect("done");
            if !*finished {
                gated.release();
            }
        });
        // Each round journals about 250 bytes: checkpoints start every ~65
        // rounds, and the first one is stuck at the gate for the whole run.
        for round in 0..400 {
            write_round(&disk, &mut blocks, &mut model, round);
            disk.flush().expect("flush");
        }
        let r = cache.report();
        *done.0.lock().expect("done") = true;
        done.1.notify_all();
        r
    });
    assert!(
        gated.holding.load(Ordering::SeqCst),
        "no checkpoint reached the device"
    );
    assert_eq!(
        r.device.checkpoints, 0,
        "a checkpoint landed through a closed gate"
    );
    assert_eq!(r.device.checkpoint_waits, 0);
    gated.release();
    cache.shutdown(true).expect("shutdown");
    assert!(cache.report().device.checkpoints >= 2);
    drop(disk);
    drop(cache);
    let cache = FlashCache::open(device, config).expect("reopen");
    check(&disk_on(&files, &cache), &model, "after a restart");
    assert!(gated.held.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_full_journal_ring_waits_for_the_checkpoint_in_flight() {
    let gated = GatedDevice::closed();
    let device: BackendRef = gated.clone();
    let files = image_files();
    let config = config(false, None);
    let cache = FlashCache::format(device.clone(), config.clone()).expect("format");
    let disk = disk_on(&files, &cache);
    let mut blocks = Blocks(0xf00d);
    let mut model = HashMap::new();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Opens the gate once a writer waits for the stuck checkpoint (or
        // when the writes are over without one, failing the test below).
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) && cache.device_stats().checkpoint_waits == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            gated.release();
        });
        // About 30 bytes of journal per write: the 4 MiB ring is full
        // after some 150,000 writes since the last checkpoint landed.
        for round in 0..250_000 {
            let b = blocks.next();
            disk.write(b * BLOCK, &content(b, round), false)
                .expect("write");
            model.insert(b, round);
        }
        done.store(true, Ordering::SeqCst);
    });
    let r = cache.device_stats();
    assert!(r.checkpoint_waits >= 1, "{r:?}");
    assert!(r.checkpoints >= 1, "{r:?}");
    disk.flush().expect("flush");
    cache.shutdown(true).expect("shutdown");
    drop(disk);
    drop(cache);
    let cache = FlashCache::open(device, config).expect("reopen");
    check(&disk_on(&files, &cache), &model, "after a restart");
}
