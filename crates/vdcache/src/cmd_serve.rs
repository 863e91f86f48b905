//! `vdcache serve`, `stats`, `flush` and `recover`: the daemon and the
//! commands that talk to it (or, for recover, to its cache device).

use crate::serve::config::{
    CacheSection, ExportConfig, Listen, ServerConfig, StorageSection, TlsConfig,
};
use crate::serve::control::{Request, request};
use crate::serve::run::run;
use crate::size::human;
use anyhow::{Context, Result, bail};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Serve the exports of a TOML configuration file instead of IMAGE.
    #[arg(long, conflicts_with = "image")]
    config: Option<PathBuf>,
    /// Unix socket to listen on (mode 0600).
    #[arg(long, conflicts_with = "config")]
    socket: Option<PathBuf>,
    /// Also listen on TCP (e.g. 127.0.0.1:10809); needs TLS (--tls-cert
    /// and --tls-key, or --tls-psk), or --insecure-tcp.
    #[arg(long, conflicts_with = "config")]
    tcp: Option<String>,
    /// Listen on --tcp without TLS: anyone who can reach the address
    /// (every local user, for a loopback address) can read and write the
    /// disk. Refused unless given; logged as a warning.
    #[arg(long, requires = "tcp", conflicts_with_all = ["tls_cert", "tls_psk", "config"])]
    insecure_tcp: bool,
    /// Also show the disk as a file in this directory (FUSE, as root), for
    /// a loop device, mkfs and mount on the host.
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    fuse: Option<PathBuf>,
    /// Also serve the disk over vhost-user-blk on this Unix socket, for
    /// QEMU's `-device vhost-user-blk-pci`.
    #[arg(long, value_name = "SOCKET", conflicts_with = "config")]
    vhost_user_blk: Option<PathBuf>,
    /// Mode of the NBD and vhost-user sockets, octal (default 0600).
    #[arg(long, value_name = "MODE", conflicts_with = "config")]
    socket_mode: Option<String>,
    /// Owner (user or uid) of the NBD and vhost-user sockets, e.g. the
    /// user QEMU runs as.
    #[arg(long, value_name = "USER", conflicts_with = "config")]
    socket_owner: Option<String>,
    /// Group (name or gid) of the NBD and vhost-user sockets.
    #[arg(long, value_name = "GROUP", conflicts_with = "config")]
    socket_group: Option<String>,
    /// Control socket for stats and flush (default: SOCKET.control).
    #[arg(long, conflicts_with = "config")]
    control: Option<PathBuf>,
    /// Require TLS with this certificate (PEM) ...
    #[arg(long, requires = "tls_key", conflicts_with = "config")]
    tls_cert: Option<PathBuf>,
    /// ... and this private key (PEM).
    #[arg(long, requires = "tls_cert", conflicts_with = "config")]
    tls_key: Option<PathBuf>,
    /// Require TLS with a pre-shared key from this `username:hexkey` file
    /// (qemu's keys.psk, as made by `psktool -u USER -p FILE`).
    #[arg(long, conflicts_with_all = ["tls_cert", "config"])]
    tls_psk: Option<PathBuf>,
    /// Worker threads per connection: requests served in parallel (default 16).
    #[arg(long, conflicts_with = "config")]
    workers: Option<usize>,
    /// Export name of IMAGE (default: the default export "").
    #[arg(long, default_value = "", conflicts_with = "config")]
    export_name: String,
    /// Serve IMAGE read-only.
    #[arg(short = 'r', long, conflicts_with = "config")]
    read_only: bool,
    /// Format of IMAGE (probed when absent).
    #[arg(short = 'f', long, conflicts_with = "config")]
    format: Option<String>,
    /// Flash cache: a block device, or a file (created with --cache-size
    /// if missing). Default: no cache.
    #[arg(long, conflicts_with = "config")]
    cache: Option<PathBuf>,
    /// Size of the cache file to create, e.g. 20G (k, M, G, T: powers of
    /// 1024; at least 16M). Only when the file is created: an existing
    /// cache keeps its size, and a different one is an error.
    #[arg(long, requires = "cache", conflicts_with = "config")]
    cache_size: Option<String>,
    /// writeback (default), writethrough or writearound.
    #[arg(long, requires = "cache", conflicts_with = "config")]
    cache_mode: Option<String>,
    /// all (default), hot or sequential-bypass (read misses in long runs
    /// are not promoted).
    #[arg(long, requires = "cache", conflicts_with = "config")]
    admission: Option<String>,
    /// Guest sequential write runs reaching this size go straight to the
    /// backend (default 4M; 0: cache every write).
    #[arg(long, requires = "cache", conflicts_with = "config")]
    sequential_write_cutoff: Option<String>,
    /// lru (default), clock, arc, or the dedup-aware d-lru and d-arc (which
    /// spare regions whose blocks many addresses share).
    #[arg(long, requires = "cache", conflicts_with = "config")]
    replacement: Option<String>,
    /// Region (erase block) size, fixed when the cache is formatted (default 2M).
    #[arg(long, requires = "cache", conflicts_with = "config")]
    region_size: Option<String>,
    /// cow-aware (default: fine-grained metadata, decoupled copy-on-write,
    /// no filler in flash) or stacked (the cache sees host I/O only).
    #[arg(long, requires = "cache", conflicts_with = "config")]
    cow: Option<String>,
    /// On a clean stop, leave dirty data in flash for a fast restart on
    /// this host instead of writing it back.
    #[arg(long, requires = "cache", conflicts_with = "config")]
    keep_dirty: bool,
    /// on: blocks entering flash that it already holds (in any disk) share
    /// the block instead of being written again; off (default).
    #[arg(
        long,
        requires = "cache",
        conflicts_with = "config",
        value_name = "on|off"
    )]
    dedup: Option<String>,
    /// With --dedup on, compare every byte before sharing a block (one
    /// flash read per shared block) instead of trusting the fingerprint.
    #[arg(long, requires = "cache", conflicts_with = "config")]
    dedup_verify: bool,
    /// Do not fill partially valid clusters from their backing files while
    /// the server is idle (`vdcache flush --fill` and a clean stop still do).
    #[arg(long, requires = "cache", conflicts_with = "config")]
    no_idle_fill: bool,
    /// Seconds requests wait for a storage server (an image given as an
    /// NBD URI) whose connection dropped before they fail (default 30;
    /// 0: at once). Reconnection is tried meanwhile and afterwards.
    #[arg(long, value_name = "SECS", conflicts_with = "config")]
    reconnect_delay: Option<f64>,
    /// Format the cache device even if it holds something that is not a
    /// vdcache cache (its content is lost).
    #[arg(long)]
    format_cache: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g.
    /// 127.0.0.1:9100; port 0 picks a free one, logged at start).
    /// With --config, this replaces the file's `[server] metrics`.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// The image's per-disk metadata journal (one store sync per guest
    /// flush), without a cache or with a writethrough or writearound one:
    /// auto (the default: on where the image can carry one), on (refuse an
    /// image that cannot), or off.
    #[arg(long, value_name = "auto|on|off", conflicts_with = "config")]
    metadata_journal: Option<String>,
    /// With the metadata journal and no cache: write zeros ahead of
    /// allocation, so the store's file system allocates ahead of the
    /// guest's flushes (adaptive preallocation; off by default: over a
    /// storage server it doubles the bytes written, see docs/internals.md).
    #[arg(long, conflicts_with = "config")]
    preallocate: bool,
    #[command(flatten)]
    meta: crate::meta_args::MetaCacheArgs,
    /// (With --config, these add to the file's `[storage] allow_backing`.)
    #[command(flatten)]
    backing: crate::backing_args::BackingArgs,
    /// The disk to serve: the top image of a qcow2 chain (or a raw image),
    /// a file or an NBD URI of a storage server (nbd://HOST/EXPORT,
    /// nbd+unix:///EXPORT?socket=PATH).
    image: Option<String>,
}

impl ServeArgs {
    fn config(self) -> Result<ServerConfig> {
        if let Some(path) = &self.config {
            let m = &self.meta;
            if m.l2_cache_size.is_some()
                || m.refcount_cache_size.is_some()
                || m.slice_size.is_some()
            {
                bail!(
                    "--l2-cache-size, --refcount-cache-size and --meta-slice-size cannot be used with --config: set them per [[export]] in the file"
                );
            }
            let mut cfg = ServerConfig::load(path)?;
            if self.metrics.is_some() {
                cfg.server.metrics = self.metrics;
            }
            cfg.storage.allow_backing.extend(self.backing.allow_backing);
            cfg.validate()?;
            return Ok(cfg);
        }
        let Some(image) = self.image else {
            bail!("give an IMAGE to serve, or --config FILE");
        };
        if self.socket.is_none()
            && self.tcp.is_none()
            && self.fuse.is_none()
            && self.vhost_user_blk.is_none()
        {
            bail!(
                "give --socket PATH (or --tcp ADDR, --fuse DIR or --vhost-user-blk SOCKET) to listen on"
            );
        }
        let cache = self.cache.map(|path| CacheSection {
            path,
            size: self.cache_size,
            mode: self.cache_mode,
            admission: self.admission,
            sequential_write_cutoff: self.sequential_write_cutoff,
            replacement: self.replacement,
            region_size: self.region_size,
            cow: self.cow,
            keep_dirty: Some(self.keep_dirty),
            idle_fill: Some(!self.no_idle_fill),
            dedup: self.dedup,
            dedup_verify: Some(self.dedup_verify),
            from_command_line: true,
            ..CacheSection::default()
        });
        let meta = self.meta;
        let cfg = ServerConfig {
            server: Listen {
                socket: self.socket,
                tcp: self.tcp,
                insecure_tcp: self.insecure_tcp,
                control: self.control,
                fuse: self.fuse,
                tls: (self.tls_cert.is_some() || self.tls_psk.is_some()).then_some(TlsConfig {
                    cert: self.tls_cert,
                    key: self.tls_key,
                    psk: self.tls_psk,
                }),
                workers: self.workers,
                metrics: self.metrics,
                socket_mode: self.socket_mode,
                socket_owner: self.socket_owner,
                socket_group: self.socket_group,
                ..Listen::default()
            },
            cache,
            storage: StorageSection {
                reconnect_delay: self.reconnect_delay,
                allow_backing: self.backing.allow_backing,
                ..StorageSection::default()
            },
            exports: vec![ExportConfig {
                name: self.export_name,
                image,
                format: self.format,
                read_only: self.read_only,
                l2_cache_size: meta.l2_cache_size.clone(),
                refcount_cache_size: meta.refcount_cache_size.clone(),
                meta_slice_size: meta.slice_size.clone(),
                vhost_user_blk: self.vhost_user_blk,
                metadata_journal: self.metadata_journal,
                preallocate: self.preallocate.then_some(true),
                ..ExportConfig::default()
            }],
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

pub fn serve(a: ServeArgs) -> Result<u8> {
    let format_cache = a.format_cache;
    run(a.config()?, format_cache)?;
    Ok(0)
}

#[derive(clap::Args)]
pub struct ControlArgs {
    /// Control socket of the server (SOCKET.control by default).
    #[arg(long)]
    control: Option<PathBuf>,
    /// The server's NBD socket (its control socket is next to it).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Give up when the server has not answered within SECS seconds
    /// (default 30; flush: as long as writing back takes; 0: no limit).
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
}

/// How long `stats` and `share` wait for a reply by default.
const CONTROL_TIMEOUT_SECS: f64 = 30.0;

impl ControlArgs {
    /// The reply timeout: --timeout, else `default` (None: no limit).
    fn timeout(&self, default: Option<f64>) -> Result<Option<std::time::Duration>> {
        match self.timeout.or(default) {
            None => Ok(None),
            Some(0.0) => Ok(None),
            Some(s) if s.is_finite() && s > 0.0 => Ok(Some(std::time::Duration::from_secs_f64(s))),
            Some(s) => bail!("--timeout takes a number of seconds (0: no limit), not {s}"),
        }
    }

    fn path(&self) -> Result<PathBuf> {
        if let Some(c) = &self.control {
            return Ok(c.clone());
        }
        let s = self.socket.as_ref().context(
            "say which server: --socket PATH (its NBD socket) or --control PATH (its control socket)",
        )?;
        let mut p = s.clone().into_os_string();
        p.push(".control");
        Ok(PathBuf::from(p))
    }
}

#[derive(clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    control: ControlArgs,
    /// Refresh every SECS seconds, like top (Ctrl-C stops).
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// With --watch: stop after this many refreshes.
    #[arg(long, requires = "watch", value_name = "N")]
    count: Option<u64>,
}

pub fn stats(a: StatsArgs) -> Result<u8> {
    let path = a.control.path()?;
    let timeout = a.control.timeout(Some(CONTROL_TIMEOUT_SECS))?;
    let Some(every) = a.watch else {
        let data = request(&path, &Request::Stats, timeout)?;
        if a.control.json {
            outln!("{}", serde_json::to_string_pretty(&data)?);
        } else {
            print_stats(&data);
        }
        return Ok(0);
    };
    if !(every.is_finite() && every > 0.0) {
        bail!("--watch takes a number of seconds above 0, not {every}");
    }
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut shown = 0u64;
    loop {
        let data = request(&path, &Request::Stats, timeout)?;
        if a.control.json {
            outln!("{}", serde_json::to_string(&data)?);
        } else {
            if tty {
                // Home and clear, as top redraws.
                out!("\x1b[H\x1b[2J");
            }
            outln!(
                "vdcache stats of {} every {every} s{}",
                path.display(),
                if tty { " (Ctrl-C stops)" } else { "" }
            );
            print_stats(&data);
            if !tty {
                outln!();
            }
        }
        shown += 1;
        // Nobody reads any more (`| head`, a full device): main reports it.
        if a.count.is_some_and(|n| shown >= n) || crate::output::stdout_failed() {
            return Ok(0);
        }
        std::thread::sleep(std::time::Duration::from_secs_f64(every));
    }
}

/// A share as a percentage, or "-" when there is nothing to share.
fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / whole as f64)
    }
}

/// The dedup line of `vdcache stats`.
fn print_dedup(d: &serde_json::Value, total: &serde_json::Value) {
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let shared = n(&total["dedup_blocks_shared"]);
    let hashed = n(&total["hashed_blocks"]);
    outln!(
        "dedup {}: {:.2} cached addresses per flash block, {} blocks shared ({} of flash writes saved), {} fingerprinted{}; checkpoint room {} used{}",
        d["mode"].as_str().unwrap_or("on"),
        d["ratio"].as_f64().unwrap_or(1.0),
        shared,
        human(shared * 4096),
        hashed,
        n(&total["hash_nanos"])
            .checked_div(hashed)
            .map_or_else(String::new, |ns| format!(" ({ns} ns each)")),
        pct(
            n(&d["checkpoint_map_bytes"]),
            n(&d["checkpoint_room_bytes"])
        ),
        match n(&d["counts"]["no_room"]) {
            0 => String::new(),
            r => format!(", {r} stored as copies for want of checkpoint room"),
        }
    );
}

fn print_stats(d: &serde_json::Value) {
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let h = |v: &serde_json::Value| human(n(v));
    let cache = d.get("cache").filter(|c| !c.is_null());
    if let Some(c) = cache {
        let dedup = c.get("dedup").filter(|d| !d.is_null());
        // With dedup, cached addresses may outnumber the flash blocks.
        let in_flash = dedup.map_or(n(&c["cached_bytes"]), |d| n(&d["unique_blocks"]) * 4096);
        outln!(
            "cache: {} cached{} of {} for data ({}), {} dirty (in flash only, not yet written back); regions {} free, {} open, {} full",
            h(&c["cached_bytes"]),
            if dedup.is_some() {
                format!(" in {} of flash", human(in_flash))
            } else {
                String::new()
            },
            h(&c["data_bytes"]),
            pct(in_flash, n(&c["data_bytes"])),
            h(&c["dirty_bytes"]),
            n(&c["regions_free"]),
            n(&c["regions_open"]),
            n(&c["regions_full"]),
        );
        if let Some(d) = dedup {
            print_dedup(d, &c["total"]);
        }
        outln!(
            "index memory: {} = {} fixed for the device + {:.3}% of the cached bytes (under 0.25% for pieces with nothing partially valid; a little cached or many partially written clusters read higher: docs/internals.md)",
            h(&c["index_memory_bytes"]),
            h(&c["index_memory_fixed_bytes"]),
            c["index_memory_ratio"].as_f64().unwrap_or(0.0) * 100.0
        );
        let dev = &c["device"];
        outln!(
            "flash device: written {} (data {}, journal and checkpoints {}), read {}, {} syncs, {} discarded, {} checkpoints",
            human(n(&dev["data_bytes_written"]) + n(&dev["meta_bytes_written"])),
            h(&dev["data_bytes_written"]),
            h(&dev["meta_bytes_written"]),
            h(&dev["bytes_read"]),
            n(&dev["syncs"]),
            h(&dev["bytes_discarded"]),
            n(&dev["checkpoints"]),
        );
        if n(&c["unreadable_blocks"]) > 0 {
            outln!(
                "LOST: {} dirty blocks no longer verify on the cache device (reads of them fail; see the log)",
                n(&c["unreadable_blocks"])
            );
        }
    } else {
        outln!("no flash cache: every request goes to the images");
    }
    let storage = &d["storage"];
    if n(&storage["reconnects"]) + n(&storage["early_flushes"]) > 0 {
        outln!(
            "storage servers: {} reconnections, rewrote {} writes ({}) they had not flushed; {} early flushes (unflushed_limit reached)",
            n(&storage["reconnects"]),
            n(&storage["rewritten_writes"]),
            h(&storage["rewritten_bytes"]),
            n(&storage["early_flushes"]),
        );
    }
    // One row per export: what the NBD clients asked, what the cache did.
    let empty = Vec::new();
    let exports = d["exports"].as_array().unwrap_or(&empty);
    let disks = d["disks"].as_array().unwrap_or(&empty);
    let cached = cache.and_then(|c| c["disks"].as_array()).unwrap_or(&empty);
    let dedups = cache.is_some_and(|c| !c["dedup"].is_null());
    outln!(
        "{:<16} {:>4} {:>10} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}",
        "EXPORT",
        "CONN",
        "REQUESTS",
        "READ",
        "WRITTEN",
        "HIT",
        "DIRTY",
        "FLASH-W",
        "SAVED",
        "STORE-R",
        "STORE-W",
        "SYNCS",
        "L2-HIT"
    );
    for disk in disks {
        let name = disk["export"].as_str().unwrap_or("");
        let e = exports
            .iter()
            .find(|e| e["name"].as_str() == Some(name))
            .unwrap_or(&serde_json::Value::Null);
        let s = cached
            .iter()
            .find(|p| p[0] == disk["disk"])
            .map(|p| &p[1])
            .unwrap_or(&serde_json::Value::Null);
        let hits = n(&s["read_hit_blocks"]);
        let shown = if name.is_empty() { "(default)" } else { name };
        let l2 = disk["l2_hit_ratio"]
            .as_f64()
            .map(|r| format!("{:.1}%", r * 100.0))
            .unwrap_or_else(|| "-".into());
        let saved = if dedups {
            human(n(&s["dedup_blocks_shared"]) * 4096)
        } else {
            "-".into()
        };
        outln!(
            "{:<16} {:>4} {:>10} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}",
            shown,
            n(&e["active_connections"]),
            n(&e["requests"]) + n(&disk["vhost_user"]["requests"]),
            human(n(&e["bytes_read"]) + n(&disk["vhost_user"]["bytes_read"])),
            human(n(&e["bytes_written"]) + n(&disk["vhost_user"]["bytes_written"])),
            pct(hits, hits + n(&s["read_miss_blocks"])),
            h(&s["dirty_bytes"]),
            h(&s["flash_bytes_written"]),
            saved,
            h(&s["backend_bytes_read"]),
            h(&s["backend_bytes_written"]),
            n(&s["backend_syncs"]),
            l2
        );
    }
    outln!(
        "CONN: open NBD connections; REQUESTS, READ/WRITTEN: what the NBD and vhost-user clients asked, read and wrote; HIT: 4 KiB blocks of reads served from flash; DIRTY: not yet written back; FLASH-W: written to the cache device; SAVED: flash writes dedup saved (blocks that shared a block flash held; - without dedup); STORE-R/W, SYNCS: traffic to the image stores; L2-HIT: qcow2 mapping lookups served from memory"
    );
}

#[derive(clap::Args)]
pub struct ShareArgs {
    #[command(flatten)]
    control: ControlArgs,
    /// The export whose share changes.
    export: String,
    /// Flash it keeps however others reuse theirs (e.g. 4G; 0: none).
    #[arg(long)]
    min: Option<String>,
    /// Flash it may hold at most (e.g. 20G; none: no maximum).
    #[arg(long)]
    max: Option<String>,
    /// Weight of its demand against the other exports' (default 1).
    #[arg(long)]
    weight: Option<f64>,
}

/// `vdcache share`: changes an export's share of a running server's cache.
pub fn share(a: ShareArgs) -> Result<u8> {
    if a.min.is_none() && a.max.is_none() && a.weight.is_none() {
        bail!("give --min, --max or --weight to change");
    }
    let data = request(
        &a.control.path()?,
        &Request::Share {
            export: a.export.clone(),
            min: a.min,
            max: a.max,
            weight: a.weight,
        },
        a.control.timeout(Some(CONTROL_TIMEOUT_SECS))?,
    )?;
    let blocks = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let max = blocks(&data["max_blocks"]);
    outln!(
        "export '{}': min {}, max {}, weight {}",
        a.export,
        human(blocks(&data["min_blocks"]) * 4096),
        if max == u64::MAX {
            "none".to_string()
        } else {
            human(max.saturating_mul(4096))
        },
        data["weight"]
    );
    Ok(0)
}

#[derive(clap::Args)]
pub struct FlushArgs {
    #[command(flatten)]
    control: ControlArgs,
    /// Also fill partially valid clusters from their backing files, so the
    /// images no longer depend on the cache at all.
    #[arg(long)]
    fill: bool,
}

pub fn flush(a: FlushArgs) -> Result<u8> {
    request(
        &a.control.path()?,
        &Request::Flush { fill: a.fill },
        a.control.timeout(None)?,
    )?;
    outln!(
        "all dirty data written back{}",
        if a.fill {
            ", partially valid clusters filled"
        } else {
            ""
        }
    );
    Ok(0)
}

#[derive(clap::Args)]
pub struct RecoverArgs {
    /// Write every dirty block back and leave the images standalone.
    #[arg(long, requires = "cache")]
    full: bool,
    /// The cache device or file.
    #[arg(long)]
    cache: Option<PathBuf>,
    /// With --full on a cache the device damaged: write back everything
    /// that still verifies and give up the rest (the images affected lose
    /// those writes; check them afterwards).
    #[arg(long, requires = "full")]
    salvage: bool,
    /// The cache of IMAGE is lost: make IMAGE usable without it, giving up
    /// the newer data the cache held (then check it: `vdcache check -r all`).
    #[arg(long, value_name = "IMAGE", conflicts_with_all = ["full", "cache"])]
    without_cache: Option<PathBuf>,
    /// Apply what a crash left in IMAGE's metadata journal, so QEMU can
    /// open it (a writable open by vdcache does the same by itself).
    #[arg(value_name = "IMAGE", conflicts_with_all = ["full", "cache", "without_cache"])]
    image: Option<PathBuf>,
    #[command(flatten)]
    backing: crate::backing_args::BackingArgs,
}

pub fn recover(a: RecoverArgs) -> Result<u8> {
    if let Some(image) = &a.without_cache {
        return abandon(image);
    }
    if let Some(image) = &a.image {
        return apply_metadata_journal(image, a.backing.allow_backing);
    }
    let Some(cache) = a.cache.as_ref().filter(|_| a.full) else {
        bail!(
            "say what to recover: `--full --cache PATH` writes a cache's dirty data back so its images stand alone (before moving them to another host, or for a cache from another host); `--without-cache IMAGE` makes IMAGE usable when its cache is lost. After a crash nothing is needed: `vdcache serve` with the same cache recovers it quickly by itself"
        );
    };
    let written = vdcache_host::recover_full_at(
        cache,
        &vdcache_host::FullRecovery {
            salvage: a.salvage,
            allow_backing: a.backing.allow_backing,
            ..vdcache_host::FullRecovery::default()
        },
    )?;
    remove_journal_markers(cache);
    if written.is_empty() {
        outln!(
            "no dirty data in {}; the images are already complete",
            cache.display()
        );
    }
    for w in written {
        outln!("written back: {w}");
    }
    Ok(0)
}

/// After full recovery no journal device's blocks live only in the cache
/// at `cache`: their markers (see `config::journal_marker`) go.
fn remove_journal_markers(cache: &std::path::Path) {
    let (Some(dir), Some(file)) = (cache.parent(), cache.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        dir
    };
    let mut prefix = file.to_os_string();
    prefix.push(".journal-");
    let prefix = prefix.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name.ends_with(".in-cache") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn apply_metadata_journal(image: &std::path::Path, allow_backing: Vec<String>) -> Result<u8> {
    let name = image.to_string_lossy();
    let disk = vdcache_image::open_chain(
        &name,
        &vdcache_image::OpenOptions {
            allow_backing,
            ..vdcache_image::OpenOptions::default()
        },
    )
    .with_context(|| format!("cannot recover {name}"))?;
    let applied = disk.journal_records_applied();
    disk.close()
        .with_context(|| format!("cannot close {name} after recovery"))?;
    if applied == 0 {
        outln!("{name}: no metadata journal to apply; nothing was changed");
    } else {
        outln!("{name}: applied {applied} metadata journal record(s); QEMU can open it again");
    }
    Ok(0)
}

fn abandon(image: &std::path::Path) -> Result<u8> {
    match vdcache_host::abandon_cache(image)? {
        None => outln!(
            "{} does not need a cache; nothing was changed",
            image.display()
        ),
        Some(cache) => outln!(
            "{} no longer needs the cache {cache}; whatever that cache held of it is lost. Check it now: vdcache check -r all {}",
            image.display(),
            image.display()
        ),
    }
    Ok(0)
}
