//! Running a server: listeners, the control socket, and the signal-driven
//! stop (stop accepting, finish in-flight requests, flush, close the
//! images clean, write the cache back unless told to keep it dirty).

use super::access::{SocketAccess, parse_access};
use super::config::ServerConfig;
use super::control::{ControlServer, Handler, Request};
use super::daemon::Daemon;
use super::export::DiskExport;
use super::metrics::{self, MetricsServer};
use crate::size::parse_size;
use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use std::path::PathBuf;
use std::sync::Arc;
use vdcache_nbd_server::{Limits, Server, TlsServerConfig};

/// Default worker threads per connection: enough for a queue depth of 16.
pub const DEFAULT_WORKERS: usize = 16;

struct Control {
    daemon: Arc<Daemon>,
    server: Arc<Server>,
    vhost: Option<vdcache_vhost_user_blk::Activity>,
}

impl Handler for Control {
    fn handle(&self, req: &Request) -> Result<serde_json::Value> {
        match req {
            Request::Stats => Ok(stats_json(&self.daemon, &self.server, self.vhost.as_ref())),
            Request::Flush { fill } => {
                for d in &self.daemon.disks {
                    d.disk.write_back(*fill)?;
                }
                if let Some(c) = &self.daemon.cache {
                    // Journal devices' blocks too: an operator's flush
                    // leaves every image complete.
                    c.write_out_held()?;
                }
                Ok(serde_json::json!({"flushed": true}))
            }
            Request::Share {
                export,
                min,
                max,
                weight,
            } => change_share(&self.daemon, export, min, max, weight),
        }
    }
}

/// Sets part of an export's share (the rest stays as configured or last
/// set); the whole change is checked before any of it applies.
fn change_share(
    daemon: &Daemon,
    export: &str,
    min: &Option<String>,
    max: &Option<String>,
    weight: &Option<f64>,
) -> Result<serde_json::Value> {
    let Some(cache) = &daemon.cache else {
        anyhow::bail!("this server has no cache");
    };
    if !cache.config().shares {
        anyhow::bail!("shares are off: set [cache] shares = true");
    }
    let Some(d) = daemon.disks.iter().find(|d| d.config.name == export) else {
        anyhow::bail!("no export '{export}'");
    };
    let mut share = cache.share(d.id);
    let blocks = |key: &str, v: &str| -> Result<u64> {
        if v == "none" {
            return Ok(u64::MAX);
        }
        Ok(parse_size(v).with_context(|| format!("share {key}"))? / 4096)
    };
    if let Some(v) = min {
        share.min_blocks = blocks("min", v)?;
    }
    if let Some(v) = max {
        share.max_blocks = blocks("max", v)?;
    }
    if let Some(w) = *weight {
        if !(w.is_finite() && w > 0.0) {
            anyhow::bail!("share weight must be above 0, not {w}");
        }
        share.weight = w;
    }
    if share.min_blocks != u64::MAX
        && share.max_blocks != u64::MAX
        && share.min_blocks > share.max_blocks
    {
        anyhow::bail!("share min is above max");
    }
    cache.set_share(d.id, share);
    tracing::info!(
        "export '{export}': share now min {} max {} weight {}",
        share.min_blocks * 4096,
        if share.max_blocks == u64::MAX {
            "none".to_string()
        } else {
            (share.max_blocks * 4096).to_string()
        },
        share.weight
    );
    Ok(serde_json::to_value(share).unwrap_or_default())
}

fn stats_json(
    daemon: &Daemon,
    server: &Server,
    vhost: Option<&vdcache_vhost_user_blk::Activity>,
) -> serde_json::Value {
    let nbd = server.stats();
    let disks: Vec<serde_json::Value> = daemon
        .disks
        .iter()
        .map(|d| {
            let meta = d.disk.meta_stats();
            serde_json::json!({
                "export": d.config.name,
                "image": d.config.image,
                "disk": d.id.0,
                "l2_hit_ratio": meta.map(|m| m.l2.hit_ratio()),
                "l2_hits": meta.map(|m| m.l2.hits),
                "l2_misses": meta.map(|m| m.l2.misses),
                "l2_zero_hits": meta.map(|m| m.l2.zero_hits),
                "partially_valid_bytes": d.disk.partially_valid_bytes().ok(),
                "deferred_cow_writes": d.disk.deferred_cow_writes(),
                "meta_zero_map_bytes": meta.map(|m| m.zero_map_bytes),
                "journal": daemon.cache.as_ref().and_then(|c| c.journal_counts(d.id)),
                "metadata_journal": d.disk.journal_stats().map(|j| serde_json::json!({
                    "records": j.records,
                    "eager_records": j.eager_records,
                    "logged_bytes": j.logged_bytes,
                    "held_bytes": j.held_bytes,
                    "held_writes": j.held_writes,
                    "overwrite_waits": j.overwrite_waits,
                })),
                "vhost_user": vhost.and_then(|v| v.export(&d.config.name)).map(|t| serde_json::json!({
                    "requests": t.reads + t.writes + t.flushes + t.discards + t.errors,
                    "reads": t.reads,
                    "writes": t.writes,
                    "bytes_read": t.read_bytes,
                    "bytes_written": t.written_bytes,
                    "flushes": t.flushes,
                    "discards": t.discards,
                    "errors": t.errors,
                })),
            })
        })
        .collect();
    let exports: Vec<serde_json::Value> = nbd
        .exports
        .iter()
        .map(|e| {
            serde_json::json!({
                "name": e.name,
                "active_connections": e.active_connections,
                "total_connections": e.total_connections,
                "requests": e.io.requests,
                "bytes_read": e.io.bytes_read,
                "bytes_written": e.io.bytes_written,
            })
        })
        .collect();
    let rewrites = vdcache_backend::rewrite_totals();
    serde_json::json!({
        "cache": daemon.cache.as_ref().map(|c| serde_json::to_value(c.report()).unwrap_or_default()),
        "storage": {
            "reconnects": rewrites.reconnects,
            "rewritten_writes": rewrites.writes,
            "rewritten_bytes": rewrites.bytes,
            "early_flushes": rewrites.early_flushes,
        },
        "disks": disks,
        "exports": exports,
        "connections_accepted": nbd.accepted,
        "connections_refused": nbd.refused,
        "connections_in_handshake": nbd.handshakes,
        "connections_evicted": nbd.evicted,
        "handshake_timeouts": nbd.handshake_timeouts,
        "buffered_payload_bytes": nbd.buffered_bytes,
        "buffered_payload_bytes_peak": nbd.buffered_bytes_peak,
    })
}

fn tls(cfg: &ServerConfig) -> Result<Option<TlsServerConfig>> {
    let Some(t) = &cfg.server.tls else {
        return Ok(None);
    };
    if let Some(keys) = &t.psk {
        return Ok(Some(
            TlsServerConfig::from_psk_file(keys).context("loading TLS pre-shared keys")?,
        ));
    }
    let (Some(cert), Some(key)) = (&t.cert, &t.key) else {
        anyhow::bail!("TLS needs a certificate and a key");
    };
    Ok(Some(
        TlsServerConfig::from_pem_files(cert, key, None).context("loading TLS credentials")?,
    ))
}

/// The NBD server's limits: the configured ones, defaults for the rest.
fn limits(cfg: &ServerConfig) -> Result<Limits> {
    let d = Limits::default();
    let s = &cfg.server;
    Ok(Limits {
        workers_per_connection: s.workers.unwrap_or(DEFAULT_WORKERS),
        max_connections: s.max_connections.unwrap_or(d.max_connections),
        max_handshakes: s.max_handshakes.unwrap_or(d.max_handshakes),
        max_connections_per_ip: s.max_connections_per_ip.unwrap_or(d.max_connections_per_ip),
        max_connections_per_uid: s
            .max_connections_per_uid
            .unwrap_or(d.max_connections_per_uid),
        handshake_timeout: match s.handshake_timeout {
            None => d.handshake_timeout,
            Some(0.0) => None,
            Some(t) => Some(std::time::Duration::from_secs_f64(t)),
        },
        max_buffered_bytes: match &s.max_buffered {
            Some(v) => parse_size(v).context("[server] max_buffered")?,
            None => d.max_buffered_bytes,
        },
        ..d
    })
}

/// Serves until SIGINT or SIGTERM, then stops cleanly. `format_cache`
/// formats a cache device that holds something other than a cache.
pub fn run(cfg: ServerConfig, format_cache: bool) -> Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing signal handlers")?;
    let access = socket_access(&cfg)?;
    super::preflight::check(&cfg)?;
    let daemon = Arc::new(Daemon::build(&cfg, format_cache)?);
    let limits = limits(&cfg)?;
    let mut builder = Server::builder().limits(limits);
    for d in &daemon.disks {
        let export = Arc::new(DiskExport {
            disk: d.disk.clone(),
            // Measured only when someone can see it: an observation
            // takes the histogram's lock on every request.
            latency: cfg
                .server
                .metrics
                .is_some()
                .then(|| super::metrics::latencies().for_export(&d.config.name)),
        });
        builder = builder.export_with_description(
            d.config.name.clone(),
            d.config
                .description
                .clone()
                .unwrap_or_else(|| d.config.image.clone()),
            export,
        );
    }
    if let Some(t) = tls(&cfg)? {
        builder = builder.tls(t);
    }
    let server = Arc::new(builder.build()?);
    // The NBD sockets listen last: whoever can connect to one (a client, or
    // a script waiting for the socket) finds every other front end up, and
    // a server refused for a busy vhost-user socket or mount point never
    // accepted anyone.
    let front_ends = match FrontEnds::start(&cfg, &daemon, &server, &access) {
        Ok(f) => f,
        Err(e) => return Err(abandon(e, &server, &daemon)),
    };
    if let Err(e) = listen_nbd(&cfg, &server, &access) {
        drop(front_ends);
        return Err(abandon(e, &server, &daemon));
    }
    let FrontEnds {
        vhost,
        fuse,
        control: _control,
        metrics: _metrics,
    } = front_ends;
    log_serving(&cfg, &daemon);
    let idle_fill = cfg
        .cache
        .as_ref()
        .is_some_and(|c| c.idle_fill.unwrap_or(true));
    let fuse_requests = fuse.as_ref().map(|f| f.requests());
    let vhost_requests = vhost.as_ref().map(|v| v.activity());
    let other_requests = move || {
        fuse_requests
            .as_ref()
            .map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed))
            + vhost_requests.as_ref().map_or(0, |v| v.requests())
    };
    let filler = idle_fill.then(|| start_filler(daemon.clone(), server.clone(), other_requests));
    let watch = start_image_watch(&daemon);
    let signal = signals.forever().next();
    impatient(signals);
    watch.stop();
    if let Some(f) = filler {
        f.stop();
    }
    tracing::info!(
        "{}: stopping (finishing in-flight requests)",
        match signal {
            Some(SIGINT) => "SIGINT",
            Some(SIGTERM) => "SIGTERM",
            _ => "signal",
        }
    );
    let unmounted = fuse.map(|f| f.unmount()).transpose();
    // Every vhost-user request in flight finishes before the disks close.
    if let Some(v) = vhost {
        v.stop();
    }
    server.shutdown();
    // Held blocks (guests' journal devices) are not written back at a stop.
    let dirty_before = daemon.cache.as_ref().map(|c| {
        let r = c.report();
        (r.dirty_bytes - r.held_bytes, r.held_bytes)
    });
    daemon.stop()?;
    unmounted?;
    if !daemon.keep_dirty
        && let Some(c) = &daemon.cache
    {
        stopped_with_data_left(c)?;
    }
    match (dirty_before, daemon.keep_dirty) {
        (Some((dirty, 0)), false) => tracing::info!(
            "stopped cleanly: {} written back from the cache, the images are complete without it",
            crate::size::human(dirty)
        ),
        (Some((dirty, held)), false) => tracing::info!(
            "stopped cleanly: {} written back from the cache, the disk images are complete without it; {} of journal devices stays in it (cache-only logging)",
            crate::size::human(dirty),
            crate::size::human(held)
        ),
        (Some((dirty, held)), true) => tracing::info!(
            "stopped cleanly: {} of dirty data kept in the cache for a fast restart on this host (--keep-dirty)",
            crate::size::human(dirty + held)
        ),
        (None, _) => tracing::info!("stopped cleanly"),
    }
    Ok(())
}

/// After a stop that wrote everything back it could: an error when the
/// cache still holds blocks the device damaged (they never go to an
/// image, whose needs-cache mark stays), naming the images holding data
/// in it. Never "complete without it" then.
fn stopped_with_data_left(cache: &vdcache_cache::FlashCache) -> Result<()> {
    let r = cache.report();
    if r.unreadable_blocks == 0 {
        return Ok(());
    }
    let images: Vec<&str> = r
        .images
        .iter()
        .filter(|i| i.dirty_bytes > 0)
        .map(|i| i.name.as_str())
        .collect();
    let device = cache.device_name();
    anyhow::bail!(
        "stopped, but the cache {device} still holds {} block(s) the device damaged, which could not be written back (their reads fail): {} stay(s) marked as needing the cache; `vdcache recover --full --salvage --cache {device}` gives them up and leaves the images standalone (check them afterwards)",
        r.unreadable_blocks,
        images.join(", "),
    )
}

/// A second SIGINT or SIGTERM during the stop ends the process at once:
/// what was flushed is safe as after a crash (the next start recovers it),
/// and an operator who asks twice must not wait for a stop that writes
/// back to slow or failing storage.
fn impatient(mut signals: signal_hook::iterator::Signals) {
    let _ = std::thread::Builder::new()
        .name("vdcache-signals".into())
        .spawn(move || {
            if signals.forever().next().is_some() {
                tracing::error!(
                    "second signal: exiting now without finishing the stop; flushed data is safe (the next start recovers it, as after a crash)"
                );
                std::process::exit(1);
            }
        });
}

/// A background thread calling a closure at a fixed interval until it is
/// stopped.
struct Ticker {
    /// Dropping it wakes the thread at once, so stopping never waits out
    /// the rest of an interval.
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(
        name: &str,
        interval: std::time::Duration,
        mut tick: impl FnMut() + Send + 'static,
    ) -> Ticker {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(interval)
                {
                    tick();
                }
            })
            .ok();
        Ticker {
            stop: Some(stop),
            thread,
        }
    }

    fn stop(mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const FILL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
const FILL_BATCH: usize = 16;

/// Fills partially valid clusters while the server is idle (no NBD or FUSE
/// request in the last interval), a few at a time, so a busy guest never
/// waits on it.
fn start_filler(
    daemon: Arc<Daemon>,
    server: Arc<Server>,
    other_requests: impl Fn() -> u64 + Send + 'static,
) -> Ticker {
    let requests = move |srv: &Server| {
        srv.stats()
            .exports
            .iter()
            .map(|e| e.io.requests)
            .sum::<u64>()
            + other_requests()
    };
    let mut last = requests(&server);
    Ticker::start("vdcache-filler", FILL_INTERVAL, move || {
        let now = requests(&server);
        if now != last {
            last = now;
            return;
        }
        for d in &daemon.disks {
            if let Err(e) = d.disk.fill_partial(FILL_BATCH) {
                tracing::warn!("background fill of '{}': {e}", d.config.name);
            }
        }
    })
}

const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The file behind an export's path: device and inode.
fn file_at(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Warns, once per file, when the file at an export's image path or at the
/// cache's path is no longer the one the server opened (replaced by `mv`,
/// `cp` to a new file, or removed): the server goes on with the file it
/// opened, and what it writes from then on is not in the file at that path.
fn start_image_watch(daemon: &Daemon) -> Ticker {
    let images = daemon
        .disks
        .iter()
        .filter(|d| !vdcache_backend::is_nbd_uri(&d.config.image))
        .map(|d| {
            (
                format!("export '{}'", d.config.name),
                PathBuf::from(&d.config.image),
                "what guests write from now on is not in the file at that path (stop the server before replacing an image)",
            )
        });
    let cache = daemon.cache_path.iter().map(|p| {
        (
            "the cache".to_string(),
            p.clone(),
            "its dirty data lives on in the file the server has open, out of reach of anything else: stop the server cleanly now (it writes the data back), and never remove a cache that is in use",
        )
    });
    let mut watched: Vec<(String, PathBuf, &str, (u64, u64))> = images
        .chain(cache)
        .filter_map(|(what, path, advice)| file_at(&path).map(|id| (what, path, advice, id)))
        .collect();
    Ticker::start("vdcache-image-watch", WATCH_INTERVAL, move || {
        watched.retain(|(what, path, advice, opened)| {
            if file_at(path) == Some(*opened) {
                return true;
            }
            tracing::warn!(
                "{what}: {} was replaced or removed while being served; the server goes on with the file it opened, so {advice}",
                path.display()
            );
            false
        });
    })
}

/// The front ends other than NBD, started before any NBD socket listens.
/// Dropping it stops each.
struct FrontEnds {
    vhost: Option<vdcache_vhost_user_blk::VhostUserBlkServer>,
    fuse: Option<vdcache_fuse_server::FuseServer>,
    control: Option<ControlServer>,
    metrics: Option<MetricsServer>,
}

impl FrontEnds {
    fn start(
        cfg: &ServerConfig,
        daemon: &Arc<Daemon>,
        server: &Arc<Server>,
        access: &SocketAccess,
    ) -> Result<FrontEnds> {
        let vhost = start_vhost_user(daemon, access)?;
        let metrics = match &cfg.server.metrics {
            Some(addr) => {
                let m =
                    MetricsServer::start(addr, metrics::registry(daemon.clone(), server.clone()))?;
                tracing::info!("metrics on http://{}/metrics", m.addr);
                Some(m)
            }
            None => None,
        };
        let control = match &control_path(cfg) {
            Some(p) => Some(ControlServer::start(
                p,
                Arc::new(Control {
                    daemon: daemon.clone(),
                    server: server.clone(),
                    vhost: vhost.as_ref().map(|v| v.activity()),
                }),
            )?),
            None => None,
        };
        let fuse = match &cfg.server.fuse {
            Some(dir) => {
                let exports = daemon
                    .disks
                    .iter()
                    .map(|d| vdcache_fuse_server::FuseExport {
                        name: d.config.name.clone(),
                        disk: d.disk.clone(),
                    })
                    .collect();
                let mounted = vdcache_fuse_server::FuseServer::mount(dir, exports)?;
                tracing::info!("disks shown as files in {}", dir.display());
                Some(mounted)
            }
            None => None,
        };
        Ok(FrontEnds {
            vhost,
            fuse,
            control,
            metrics,
        })
    }
}

/// Listens on the configured NBD Unix socket and TCP address.
fn listen_nbd(cfg: &ServerConfig, server: &Server, access: &SocketAccess) -> Result<()> {
    if let Some(path) = &cfg.server.socket {
        server
            .listen_unix_with(path, access)
            .with_context(|| format!("cannot listen on {}", path.display()))?;
    }
    if let Some(addr) = &cfg.server.tcp {
        // The server's error already names the address.
        let bound = server.listen_tcp(addr.as_str()).map_err(|e| {
            anyhow::anyhow!("{e} (give an address of this host whose port is free)")
        })?;
        if cfg.server.tls.is_some() {
            tracing::info!("listening on tcp {bound} (TLS required)");
        } else {
            // Only with insecure_tcp: validation refuses it otherwise.
            tracing::warn!(
                "listening on tcp {bound} without TLS, as --insecure-tcp ([server] insecure_tcp) asks: anyone who can reach this address{} can read and write every export{}",
                if bound.ip().is_loopback() {
                    ", every local user included,"
                } else {
                    ""
                },
                if bound.ip().is_loopback() {
                    ""
                } else {
                    ", and the data crosses the network in plaintext"
                }
            );
        }
    }
    Ok(())
}

/// A start that failed before anything was served: closes the disks
/// cleanly and returns the failure.
fn abandon(e: anyhow::Error, server: &Server, daemon: &Daemon) -> anyhow::Error {
    server.shutdown();
    if let Err(stop) = daemon.stop() {
        tracing::error!("closing the disks: {stop:#}");
    }
    e
}

fn log_serving(cfg: &ServerConfig, daemon: &Daemon) {
    for d in &daemon.disks {
        tracing::info!(
            "serving {}: {} ({}{}, {})",
            if d.config.name.is_empty() {
                "the default export".to_string()
            } else {
                format!("export '{}'", d.config.name)
            },
            d.config.image,
            if d.disk.read_only() {
                "read-only"
            } else {
                "read-write"
            },
            match (&daemon.cache, d.config.no_cache) {
                (Some(c), false) => format!(", through the cache ({})", c.policy(d.id).mode.name()),
                (Some(_), true) => ", not cached".into(),
                (None, _) => String::new(),
            },
            crate::size::human(d.disk.size())
        );
    }
    tracing::info!(
        "serving {} export(s){}{}",
        daemon.disks.len(),
        cfg.server
            .socket
            .as_ref()
            .map(|p| format!(" on {}", p.display()))
            .unwrap_or_default(),
        control_path(cfg)
            .map(|p| format!(", control {}", p.display()))
            .unwrap_or_default()
    );
}

/// Mode, owner and group of the data sockets, checked before any is bound.
fn socket_access(cfg: &ServerConfig) -> Result<SocketAccess> {
    let l = &cfg.server;
    parse_access(
        l.socket_mode.as_deref(),
        l.socket_owner.as_deref(),
        l.socket_group.as_deref(),
    )
}

/// Serves the exports that name a vhost-user-blk socket (none: nothing).
fn start_vhost_user(
    daemon: &Daemon,
    access: &SocketAccess,
) -> Result<Option<vdcache_vhost_user_blk::VhostUserBlkServer>> {
    let exports: Vec<_> = daemon
        .disks
        .iter()
        .filter_map(|d| {
            Some(vdcache_vhost_user_blk::VhostUserBlkExport {
                name: d.config.name.clone(),
                disk: d.disk.clone(),
                socket: d.config.vhost_user_blk.clone()?,
                queues: d.config.vhost_user_queues.unwrap_or(2),
                access: *access,
            })
        })
        .collect();
    if exports.is_empty() {
        return Ok(None);
    }
    let sockets: Vec<PathBuf> = exports.iter().map(|e| e.socket.clone()).collect();
    let server = vdcache_vhost_user_blk::VhostUserBlkServer::start(exports)?;
    let names: Vec<String> = sockets.iter().map(|s| s.display().to_string()).collect();
    tracing::info!("vhost-user-blk on {}", names.join(", "));
    Ok(Some(server))
}

/// The control socket: configured, or next to the NBD socket.
pub fn control_path(cfg: &ServerConfig) -> Option<PathBuf> {
    cfg.server.control.clone().or_else(|| {
        let first_vhost = || cfg.exports.iter().find_map(|e| e.vhost_user_blk.as_ref());
        cfg.server.socket.as_ref().or_else(first_vhost).map(|s| {
            let mut p = s.clone().into_os_string();
            p.push(".control");
            PathBuf::from(p)
        })
    })
}
