//! `vdcache serve --metrics ADDR`: the server's statistics as Prometheus
//! metrics over HTTP (`GET /metrics`, Prometheus text format 0.0.4).
//!
//! Every scrape reads the same snapshots `vdcache stats` reads (the NBD
//! server's per-export counters, the cache's report, each disk's metadata
//! cache), so the two never disagree; the request latency histograms are
//! the only state of this module's own, fed by the exports.
//!
//! Must not: change anything it reports, or let an HTTP client hold the
//! server or a scrape up (a bounded request, one deadline for a client's
//! whole exchange, a few clients at a time with the oldest giving way).

use super::daemon::Daemon;
use anyhow::{Context, Result};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vdcache_nbd_server::Server;

/// Labels of a latency histogram: the export and the NBD command.
type OpLabels = Vec<(&'static str, String)>;

/// Buckets from 10 µs to about 5 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(10e-6, 2.0, 20))
}

/// The NBD commands whose latency is measured, in [`Latency`] order.
pub const OPS: [&str; 6] = ["read", "write", "flush", "trim", "write_zeroes", "cache"];

/// Request latency histograms of every export, by command.
#[derive(Debug)]
pub struct LatencyFamily {
    family: Family<OpLabels, Histogram, fn() -> Histogram>,
}

impl Default for LatencyFamily {
    fn default() -> Self {
        LatencyFamily {
            family: Family::new_with_constructor(latency_histogram),
        }
    }
}

impl LatencyFamily {
    /// The histograms of one export, created once so a request only
    /// observes (no lookup on the data path).
    pub fn for_export(&self, export: &str) -> Latency {
        Latency {
            by_op: OPS.map(|op| {
                self.family
                    .get_or_create(&vec![
                        ("export", export.to_string()),
                        ("op", op.to_string()),
                    ])
                    .clone()
            }),
        }
    }
}

/// One export's latency histograms, indexed like [`OPS`].
#[derive(Clone, Debug)]
pub struct Latency {
    by_op: [Histogram; 6],
}

impl Latency {
    /// Records a request of command `op` (an index into [`OPS`]).
    pub fn observe(&self, op: usize, took: Duration) {
        if let Some(h) = self.by_op.get(op) {
            h.observe(took.as_secs_f64());
        }
    }
}

/// The shared latency histograms of this process's exports.
pub fn latencies() -> &'static LatencyFamily {
    static FAMILY: OnceLock<LatencyFamily> = OnceLock::new();
    FAMILY.get_or_init(LatencyFamily::default)
}

/// Reads the server's snapshots at each scrape.
struct Snapshot {
    daemon: Arc<Daemon>,
    server: Arc<Server>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Snapshot")
    }
}

fn labels(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(k, v)| (*k, (*v).to_string())).collect()
}

/// Writes one metric family whose samples all carry a label set.
fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: &[(Vec<(&'static str, String)>, M)],
) -> std::fmt::Result {
    if samples.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (l, v) in samples {
        v.encode(m.encode_family(l)?)?;
    }
    Ok(())
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let nbd = self.server.stats();
        let c = MetricType::Counter;
        let g = MetricType::Gauge;
        // Per export, as the NBD server counts them.
        let by_export = |f: &dyn Fn(&vdcache_nbd_server::ExportStats) -> u64| {
            nbd.exports
                .iter()
                .map(|e| (labels(&[("export", &e.name)]), f(e)))
                .collect::<Vec<_>>()
        };
        let counters = |v: Vec<(OpLabels, u64)>| {
            v.into_iter()
                .map(|(l, n)| (l, counter(n)))
                .collect::<Vec<_>>()
        };
        let gauges = |v: Vec<(OpLabels, u64)>| {
            v.into_iter()
                .map(|(l, n)| (l, gauge(n)))
                .collect::<Vec<_>>()
        };
        family(
            &mut enc,
            "vdcache_export_requests",
            "NBD requests answered, errors included",
            c,
            &counters(by_export(&|e| e.io.requests)),
        )?;
        family(
            &mut enc,
            "vdcache_export_errors",
            "NBD requests answered with an error",
            c,
            &counters(by_export(&|e| e.io.errors)),
        )?;
        family(
            &mut enc,
            "vdcache_export_read_bytes",
            "Bytes returned by NBD reads",
            c,
            &counters(by_export(&|e| e.io.bytes_read)),
        )?;
        family(
            &mut enc,
            "vdcache_export_written_bytes",
            "Bytes stored by NBD writes",
            c,
            &counters(by_export(&|e| e.io.bytes_written)),
        )?;
        family(
            &mut enc,
            "vdcache_export_connections",
            "NBD connections open on the export",
            g,
            &gauges(by_export(&|e| e.active_connections)),
        )?;
        family(
            &mut enc,
            "vdcache_export_connections_opened",
            "NBD connections that selected the export",
            c,
            &counters(by_export(&|e| e.total_connections)),
        )?;
        let none: Vec<(&'static str, String)> = Vec::new();
        family(
            &mut enc,
            "vdcache_connections_accepted",
            "Connections accepted",
            c,
            &[(none.clone(), counter(nbd.accepted))],
        )?;
        family(
            &mut enc,
            "vdcache_connections_refused",
            "Connections refused by a connection limit",
            c,
            &[(none.clone(), counter(nbd.refused))],
        )?;
        family(
            &mut enc,
            "vdcache_connections_in_handshake",
            "Connections in their handshake now",
            g,
            &[(none.clone(), gauge(nbd.handshakes))],
        )?;
        family(
            &mut enc,
            "vdcache_buffered_payload_bytes",
            "Request payload bytes buffered now",
            g,
            &[(none.clone(), gauge(nbd.buffered_bytes))],
        )?;
        // Each disk's in-memory metadata (L2) cache.
        let disks = &self.daemon.disks;
        let meta: Vec<_> = disks
            .iter()
            .filter_map(|d| {
                d.disk
                    .meta_stats()
                    .map(|m| (labels(&[("export", &d.config.name)]), m))
            })
            .collect();
        let l2 = |f: &dyn Fn(&vdcache_image::qimage::MetaStats) -> u64| {
            meta.iter()
                .map(|(l, m)| (l.clone(), counter(f(m))))
                .collect::<Vec<_>>()
        };
        family(
            &mut enc,
            "vdcache_export_l2_cache_hits",
            "Lookups served by the in-memory L2 table cache",
            c,
            &l2(&|m| m.l2.hits),
        )?;
        family(
            &mut enc,
            "vdcache_export_l2_cache_misses",
            "Lookups that read an L2 table slice",
            c,
            &l2(&|m| m.l2.misses),
        )?;
        let Some(cache) = &self.daemon.cache else {
            return Ok(());
        };
        let r = cache.report();
        let name = cache.device_name().to_string();
        let dev = labels(&[("cache", &name)]);
        // Per export, as the flash cache counts them.
        let export_of = |id: u32| {
            disks
                .iter()
                .find(|d| d.id.0 == id)
                .map(|d| d.config.name.clone())
                .unwrap_or_else(|| format!("disk {id}"))
        };
        let per_disk = |f: &dyn Fn(&vdcache_cache::DiskStats) -> u64| {
            r.disks
                .iter()
                .map(|(id, s)| (vec![("export", export_of(*id))], f(s)))
                .collect::<Vec<_>>()
        };
        family(
            &mut enc,
            "vdcache_cache_guest_reads",
            "Guest reads that reached the flash cache",
            c,
            &counters(per_disk(&|s| s.guest_reads)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_guest_writes",
            "Guest writes that reached the flash cache",
            c,
            &counters(per_disk(&|s| s.guest_writes)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_guest_read_bytes",
            "Bytes of guest reads that reached the flash cache",
            c,
            &counters(per_disk(&|s| s.guest_read_bytes)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_guest_written_bytes",
            "Bytes of guest writes that reached the flash cache",
            c,
            &counters(per_disk(&|s| s.guest_write_bytes)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_read_hit_blocks",
            "4 KiB blocks of guest reads served from flash",
            c,
            &counters(per_disk(&|s| s.read_hit_blocks)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_read_miss_blocks",
            "4 KiB blocks of guest reads read from the images",
            c,
            &counters(per_disk(&|s| s.read_miss_blocks)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_write_hit_blocks",
            "4 KiB blocks of guest writes already in flash",
            c,
            &counters(per_disk(&|s| s.write_hit_blocks)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_write_miss_blocks",
            "4 KiB blocks of guest writes not yet in flash",
            c,
            &counters(per_disk(&|s| s.write_miss_blocks)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_flash_written_bytes",
            "Bytes the cache wrote to flash for the export",
            c,
            &counters(per_disk(&|s| s.flash_bytes_written)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_flash_read_bytes",
            "Bytes the cache read from flash for the export",
            c,
            &counters(per_disk(&|s| s.flash_bytes_read)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_backend_read_bytes",
            "Bytes read from the image stores (misses, copy-on-write, metadata)",
            c,
            &counters(per_disk(&|s| s.backend_bytes_read)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_backend_written_bytes",
            "Bytes written to the image stores (write-through, write-back)",
            c,
            &counters(per_disk(&|s| s.backend_bytes_written)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_backend_syncs",
            "Syncs of the image stores",
            c,
            &counters(per_disk(&|s| s.backend_syncs)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_guest_flushes",
            "Guest flushes",
            c,
            &counters(per_disk(&|s| s.guest_flushes)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_writeback_requests",
            "Write-back requests sent to the image stores",
            c,
            &counters(per_disk(&|s| s.writeback_requests)),
        )?;
        family(
            &mut enc,
            "vdcache_cache_export_dirty_bytes",
            "Bytes only in flash, not yet written back, of the export",
            g,
            &gauges(per_disk(&|s| s.dirty_bytes)),
        )?;
        // The cache device as a whole.
        let one = |v: u64| [(dev.clone(), gauge(v))];
        let one_c = |v: u64| [(dev.clone(), counter(v))];
        family(
            &mut enc,
            "vdcache_cache_data_bytes",
            "Bytes of the cache device that hold cached data",
            g,
            &one(r.data_bytes),
        )?;
        family(
            &mut enc,
            "vdcache_cache_cached_bytes",
            "Bytes cached now",
            g,
            &one(r.cached_bytes),
        )?;
        family(
            &mut enc,
            "vdcache_cache_dirty_bytes",
            "Bytes only in flash, not yet written back",
            g,
            &one(r.dirty_bytes),
        )?;
        let regions: Vec<_> = [
            ("free", r.regions_free),
            ("open", r.regions_open),
            ("full", r.regions_full),
        ]
        .into_iter()
        .map(|(state, n)| {
            (
                labels(&[("cache", &name), ("state", state)]),
                gauge(u64::from(n)),
            )
        })
        .collect();
        family(
            &mut enc,
            "vdcache_cache_regions",
            "Regions (erase blocks) of the cache by state",
            g,
            &regions,
        )?;
        family(
            &mut enc,
            "vdcache_cache_index_memory_bytes",
            "Memory of the cache index",
            g,
            &one(r.index_memory_bytes),
        )?;
        family(
            &mut enc,
            "vdcache_cache_index_memory_fixed_bytes",
            "Part of the index memory sized by the device",
            g,
            &one(r.index_memory_fixed_bytes),
        )?;
        family(
            &mut enc,
            "vdcache_cache_checksum_memory_bytes",
            "Memory of the cached blocks' checksums",
            g,
            &one(r.checksum_memory_bytes),
        )?;
        family(
            &mut enc,
            "vdcache_cache_unreadable_blocks",
            "Dirty blocks the device no longer returns intact (lost)",
            g,
            &one(r.unreadable_blocks),
        )?;
        let zones: Vec<_> = [
            ("data", r.device.data_bytes_written),
            ("meta", r.device.meta_bytes_written),
        ]
        .into_iter()
        .map(|(zone, n)| (labels(&[("cache", &name), ("zone", zone)]), counter(n)))
        .collect();
        family(
            &mut enc,
            "vdcache_cache_device_written_bytes",
            "Bytes written to the cache device by zone",
            c,
            &zones,
        )?;
        family(
            &mut enc,
            "vdcache_cache_device_read_bytes",
            "Bytes read from the cache device",
            c,
            &one_c(r.device.bytes_read),
        )?;
        family(
            &mut enc,
            "vdcache_cache_device_syncs",
            "Syncs of the cache device",
            c,
            &one_c(r.device.syncs),
        )?;
        family(
            &mut enc,
            "vdcache_cache_device_discarded_bytes",
            "Bytes discarded on the cache device (reclaimed regions)",
            c,
            &one_c(r.device.bytes_discarded),
        )?;
        family(
            &mut enc,
            "vdcache_cache_checkpoints",
            "Checkpoints written",
            c,
            &one_c(r.device.checkpoints),
        )?;
        Ok(())
    }
}

/// The registry a metrics endpoint encodes.
pub fn registry(daemon: Arc<Daemon>, server: Arc<Server>) -> Registry {
    let mut reg = Registry::default();
    reg.register(
        "vdcache_request_duration_seconds",
        "Time to answer an NBD request, by export and command",
        latencies().family.clone(),
    );
    reg.register_collector(Box::new(Snapshot { daemon, server }));
    reg
}

/// Most HTTP clients served at once; a newcomer beyond them closes the
/// oldest (see [`Clients`]).
const MAX_CLIENTS: usize = 16;
/// Most bytes of an HTTP request read.
const MAX_REQUEST: usize = 8 * 1024;
/// Time a client has for its whole exchange, from its connection to the
/// last byte of the reply: a client that trickles its request a byte at a
/// time is closed at this deadline, however often it sends.
const CLIENT_DEADLINE: Duration = Duration::from_secs(5);

/// A listening metrics endpoint and its thread.
pub struct MetricsServer {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    pub fn start(addr: &str, registry: Registry) -> Result<MetricsServer> {
        let listener = TcpListener::bind(addr).with_context(|| {
            format!("cannot listen for metrics on {addr} (is the port in use? pick another with --metrics ADDR)")
        })?;
        let bound = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let registry = Arc::new(registry);
        let thread = std::thread::Builder::new()
            .name("vdcache-metrics".into())
            .spawn(move || accept(listener, registry, s))?;
        Ok(MetricsServer {
            addr: bound,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The clients being served, oldest first. A newcomer that finds every
/// slot taken closes the oldest: a scrape takes milliseconds, so whoever
/// holds a slot longest is the slowest, and a few slow clients cannot keep
/// the scrapes out (only a flood of newer connections can close a scrape,
/// and it closes its own older ones first).
#[derive(Default)]
struct Clients {
    next_id: u64,
    /// Each client's id and a handle on its socket (to close it).
    live: Vec<(u64, TcpStream)>,
}

impl Clients {
    /// Admits a client, closing the oldest if every slot is taken; its id,
    /// or `None` when its socket cannot be kept.
    fn admit(&mut self, stream: &TcpStream) -> Option<u64> {
        let handle = stream.try_clone().ok()?;
        if self.live.len() >= MAX_CLIENTS {
            let (_, oldest) = self.live.remove(0);
            let _ = oldest.shutdown(std::net::Shutdown::Both);
        }
        self.next_id += 1;
        self.live.push((self.next_id, handle));
        Some(self.next_id)
    }

    /// A client is done (or was closed to make room).
    fn leave(&mut self, id: u64) {
        self.live.retain(|(i, _)| *i != id);
    }
}

/// The client list (one left by a panicking holder is still a list).
fn locked(c: &Mutex<Clients>) -> std::sync::MutexGuard<'_, Clients> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn accept(listener: TcpListener, registry: Arc<Registry>, stop: Arc<AtomicBool>) {
    let clients = Arc::new(Mutex::new(Clients::default()));
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let Some(id) = locked(&clients).admit(&stream) else {
                    continue;
                };
                let (reg, c) = (registry.clone(), clients.clone());
                let spawned = std::thread::Builder::new()
                    .name("vdcache-metrics-client".into())
                    .spawn(move || {
                        answer(&stream, &reg, Instant::now() + CLIENT_DEADLINE);
                        locked(&c).leave(id);
                    });
                if spawned.is_err() {
                    locked(&clients).leave(id);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                tracing::warn!("metrics endpoint: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// The time left before `deadline`; `None` once it passed.
fn left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

/// Reads a request head (up to its blank line, the end of the stream or
/// [`MAX_REQUEST`] bytes) before `deadline`; `None` when the deadline
/// passes first or the socket fails.
fn read_head(stream: &TcpStream, deadline: Instant) -> Option<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while head.len() < MAX_REQUEST {
        stream.set_read_timeout(Some(left(deadline)?)).ok()?;
        let n = (&*stream).read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(2).any(|w| w == b"\n\n") || head.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// Writes all of `bytes` before `deadline` (a reader too slow to take
/// them is given up on).
fn write_by(stream: &TcpStream, mut bytes: &[u8], deadline: Instant) {
    while !bytes.is_empty() {
        let Some(t) = left(deadline) else { return };
        if stream.set_write_timeout(Some(t)).is_err() {
            return;
        }
        match (&*stream).write(bytes) {
            Ok(0) | Err(_) => return,
            Ok(n) => bytes = &bytes[n..],
        }
    }
}

/// Answers one HTTP/1.x request and closes the connection, all before
/// `deadline`.
fn answer(stream: &TcpStream, registry: &Registry, deadline: Instant) {
    let _ = stream.set_nonblocking(false);
    let Some(head) = read_head(stream, deadline) else {
        return;
    };
    let mut first = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics") | ("GET", "/") => {
            let mut body = String::new();
            match prometheus_client::encoding::prometheus_text::encode(&mut body, registry) {
                Ok(()) => (
                    "200 OK",
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                    body,
                ),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain",
                    "metrics could not be encoded\n".into(),
                ),
            }
        }
        ("GET", _) => ("404 Not Found", "text/plain", "try /metrics\n".into()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET /metrics\n".into(),
        ),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    write_by(stream, reply.as_bytes(), deadline);
}
