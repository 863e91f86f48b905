//! `vdcache serve`, `stats`, `flush` and `recover`: the daemon and the
//! commands that talk to it (or, for recover, to its cache device).

use crate::serve::config::{
    CacheSection, ExportConfig, Listen, ServerConfig, StorageSection, TlsConfig,
};
use crate::serve::control::{Request, request};
use crate::serve::run::run;
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
    /// Also listen on TCP (e.g. 127.0.0.1:10809); only when asked.
    #[arg(long, conflicts_with = "config")]
    tcp: Option<String>,
    /// Also show the disk as a file in this directory (FUSE, as root), for
    /// a loop device, mkfs and mount on the host.
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    fuse: Option<PathBuf>,
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
    /// Worker threads per connection (requests served in parallel).
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
    /// Flash cache device or file (created with --cache-size if missing).
    #[arg(long, conflicts_with = "config")]
    cache: Option<PathBuf>,
    /// Size of a cache file to create.
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
    /// lru (default), clock or arc.
    #[arg(long, requires = "cache", conflicts_with = "config")]
    replacement: Option<String>,
    /// Region (erase block) size when formatting the cache (default 2M).
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
    #[command(flatten)]
    meta: crate::meta_args::MetaCacheArgs,
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
            return ServerConfig::load(path);
        }
        let Some(image) = self.image else {
            bail!("give an IMAGE to serve, or --config FILE");
        };
        if self.socket.is_none() && self.tcp.is_none() && self.fuse.is_none() {
            bail!("give --socket PATH (or --tcp ADDR, or --fuse DIR) to listen on");
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
            ..CacheSection::default()
        });
        let meta = self.meta;
        let cfg = ServerConfig {
            server: Listen {
                socket: self.socket,
                tcp: self.tcp,
                control: self.control,
                fuse: self.fuse,
                tls: (self.tls_cert.is_some() || self.tls_psk.is_some()).then_some(TlsConfig {
                    cert: self.tls_cert,
                    key: self.tls_key,
                    psk: self.tls_psk,
                }),
                workers: self.workers,
                ..Listen::default()
            },
            cache,
            storage: StorageSection {
                reconnect_delay: self.reconnect_delay,
            },
            exports: vec![ExportConfig {
                name: self.export_name,
                image,
                format: self.format,
                read_only: self.read_only,
                l2_cache_size: meta.l2_cache_size.clone(),
                refcount_cache_size: meta.refcount_cache_size.clone(),
                meta_slice_size: meta.slice_size.clone(),
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
}

impl ControlArgs {
    fn path(&self) -> Result<PathBuf> {
        if let Some(c) = &self.control {
            return Ok(c.clone());
        }
        let s = self
            .socket
            .as_ref()
            .context("give --control PATH or --socket PATH")?;
        let mut p = s.clone().into_os_string();
        p.push(".control");
        Ok(PathBuf::from(p))
    }
}

pub fn stats(a: ControlArgs) -> Result<u8> {
    let data = request(&a.path()?, &Request::Stats)?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&data)?);
        return Ok(0);
    }
    print_stats(&data);
    Ok(0)
}

fn print_stats(d: &serde_json::Value) {
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    if let Some(c) = d.get("cache").filter(|c| !c.is_null()) {
        let t = &c["total"];
        outln!(
            "cache: {} of {} bytes cached, {} dirty; regions free {} open {} full {}; index memory {} bytes ({} fixed for the device, the rest {:.3}% of cached)",
            n(&c["cached_bytes"]),
            n(&c["data_bytes"]),
            n(&c["dirty_bytes"]),
            n(&c["regions_free"]),
            n(&c["regions_open"]),
            n(&c["regions_full"]),
            n(&c["index_memory_bytes"]),
            n(&c["index_memory_fixed_bytes"]),
            c["index_memory_ratio"].as_f64().unwrap_or(0.0) * 100.0
        );
        outln!(
            "total: reads {} writes {} read hits {}/{} blocks; flash written {} read {}; backend read {} written {} syncs {}",
            n(&t["guest_reads"]),
            n(&t["guest_writes"]),
            n(&t["read_hit_blocks"]),
            n(&t["read_hit_blocks"]) + n(&t["read_miss_blocks"]),
            n(&t["flash_bytes_written"]),
            n(&t["flash_bytes_read"]),
            n(&t["backend_bytes_read"]),
            n(&t["backend_bytes_written"]),
            n(&t["backend_syncs"])
        );
        if n(&c["unreadable_blocks"]) > 0 {
            outln!(
                "LOST: {} dirty blocks no longer verify on the cache device (reads of them fail; see the log)",
                n(&c["unreadable_blocks"])
            );
        }
        let dev = &c["device"];
        outln!(
            "device: data zone written {} metadata zone written {} read {} syncs {} (commits waited for one in flight {} times) discarded {}; checkpoints {} (writers waited for one {} times)",
            n(&dev["data_bytes_written"]),
            n(&dev["meta_bytes_written"]),
            n(&dev["bytes_read"]),
            n(&dev["syncs"]),
            n(&dev["sync_waits"]),
            n(&dev["bytes_discarded"]),
            n(&dev["checkpoints"]),
            n(&dev["checkpoint_waits"])
        );
        if let Some(disks) = c["disks"].as_array() {
            for pair in disks {
                let (id, s) = (&pair[0], &pair[1]);
                outln!(
                    "  disk {}: reads {} writes {} hits {}/{} flash w {} backend r {} w {} syncs {} dirty {}",
                    n(id),
                    n(&s["guest_reads"]),
                    n(&s["guest_writes"]),
                    n(&s["read_hit_blocks"]),
                    n(&s["read_hit_blocks"]) + n(&s["read_miss_blocks"]),
                    n(&s["flash_bytes_written"]),
                    n(&s["backend_bytes_read"]),
                    n(&s["backend_bytes_written"]),
                    n(&s["backend_syncs"]),
                    n(&s["dirty_bytes"])
                );
            }
        }
    } else {
        outln!("no flash cache");
    }
    if let Some(disks) = d["disks"].as_array() {
        for disk in disks {
            outln!(
                "export '{}' ({}): L2 memory cache hit ratio {:.3}",
                disk["export"].as_str().unwrap_or(""),
                disk["image"].as_str().unwrap_or(""),
                disk["l2_hit_ratio"].as_f64().unwrap_or(0.0)
            );
        }
    }
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
    request(&a.control.path()?, &Request::Flush { fill: a.fill })?;
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
}

pub fn recover(a: RecoverArgs) -> Result<u8> {
    if let Some(image) = &a.without_cache {
        return abandon(image);
    }
    let Some(cache) = a.cache.as_ref().filter(|_| a.full) else {
        bail!(
            "give --full --cache PATH to write a cache's data back to its images (fast recovery happens when serve opens the cache), or --without-cache IMAGE if an image's cache is lost"
        );
    };
    let written = vdcache_host::recover_full_at(
        cache,
        &vdcache_host::FullRecovery {
            salvage: a.salvage,
            ..vdcache_host::FullRecovery::default()
        },
    )?;
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

fn abandon(image: &std::path::Path) -> Result<u8> {
    match vdcache_image::abandon_cache(image)? {
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
