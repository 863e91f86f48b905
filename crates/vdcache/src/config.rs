//! The server's configuration: the TOML file of `vdcache serve --config`,
//! or the same settings built from command-line flags. Every key is
//! validated with an error that names it.

use crate::size::parse_size;
use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};

/// A whole server: listeners, the shared cache, the exports.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    #[serde(default)]
    pub server: Listen,
    pub cache: Option<CacheSection>,
    /// How images on storage servers (NBD URIs) are reached.
    #[serde(default)]
    pub storage: StorageSection,
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportConfig>,
}

/// Where clients connect.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Listen {
    /// Unix socket path (created with mode 0600).
    pub socket: Option<PathBuf>,
    /// TCP address, only when asked for (e.g. "127.0.0.1:10809"); needs
    /// TLS, or `insecure_tcp`.
    pub tcp: Option<String>,
    /// Listen on `tcp` without TLS, letting anyone who can reach it (every
    /// local user, for a loopback address) read and write the disks
    /// (`--insecure-tcp`). Default false: TCP without TLS is refused.
    #[serde(default)]
    pub insecure_tcp: bool,
    /// Control socket for `vdcache stats` and `vdcache flush`.
    pub control: Option<PathBuf>,
    /// Also show every export as a file in this directory (FUSE; root).
    pub fuse: Option<PathBuf>,
    /// TLS: when set, clients must use it.
    pub tls: Option<TlsConfig>,
    /// Worker threads per connection (requests served in parallel).
    pub workers: Option<usize>,
    /// NBD connection limits; absent keys keep the server's defaults
    /// (256 connections, 64 in their handshake, 64 per TCP client IP,
    /// 256 per Unix socket client uid).
    pub max_connections: Option<usize>,
    pub max_handshakes: Option<usize>,
    pub max_connections_per_ip: Option<usize>,
    pub max_connections_per_uid: Option<usize>,
    /// Serve Prometheus metrics over HTTP on this address (e.g.
    /// "127.0.0.1:9100"); absent: no metrics endpoint.
    pub metrics: Option<String>,
    /// Seconds a client may take for its whole handshake (default 10;
    /// 0: no limit).
    pub handshake_timeout: Option<f64>,
    /// Payload bytes buffered across all connections before they wait
    /// for room (default "256M").
    pub max_buffered: Option<String>,
    /// Mode of the data sockets (NBD `socket` and every export's
    /// `vhost_user_blk`), octal (default "0600"); the control socket
    /// stays 0600.
    pub socket_mode: Option<String>,
    /// Owner (user name or uid) and group (name or gid) of the data
    /// sockets, e.g. libvirt's QEMU user; default: the server's.
    pub socket_owner: Option<String>,
    pub socket_group: Option<String>,
}

/// An octal socket mode such as "0660", "660" or "0o660": permission bits
/// only, and the owner can always read and write.
pub fn parse_socket_mode(text: &str) -> Result<u32> {
    let digits = text.trim();
    let mode = u32::from_str_radix(digits.strip_prefix("0o").unwrap_or(digits), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .with_context(|| {
            format!("socket mode '{text}' is not an octal mode from 0 to 0777, such as 0660")
        })?;
    if mode & 0o600 != 0o600 {
        bail!("socket mode '{text}' must let the owner read and write (0600 at least)");
    }
    Ok(mode)
}

/// Settings of the storage servers images live on (NBD exports).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StorageSection {
    /// Seconds requests wait for a storage server whose connection dropped
    /// (reconnections are tried meanwhile) before they fail; a stop gives
    /// up on an image whose server stays away that long (default 30; 0:
    /// they fail at once).
    pub reconnect_delay: Option<f64>,
    /// Bytes of acknowledged, unflushed writes an image on a storage
    /// server keeps, to write them again after a reconnection (a server
    /// that restarted may have lost them); past them it flushes early
    /// (default 256M).
    pub unflushed_limit: Option<String>,
    /// Directories and NBD storage servers (URIs) that backing files and
    /// external data files may lie in besides each image's own directory
    /// tree and storage server (`--allow-backing`).
    #[serde(default)]
    pub allow_backing: Vec<String>,
}

impl StorageSection {
    /// The NBD backend settings these keys give (defaults for the rest;
    /// [`ServerConfig::validate`] refused values that do not parse).
    pub fn nbd_options(&self) -> vdcache_backend::NbdOptions {
        let mut o = vdcache_backend::NbdOptions::default();
        if let Some(s) = self.reconnect_delay {
            o.reconnect_delay = std::time::Duration::from_secs_f64(s);
        }
        if let Some(b) = self
            .unflushed_limit
            .as_deref()
            .and_then(|v| parse_size(v).ok())
        {
            o.unflushed_limit = b;
        }
        o
    }
}

/// TLS credentials: an x509 certificate and key, or a PSK keys file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub psk: Option<PathBuf>,
}

/// The shared flash cache.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// Cache device: a file (created) or a block device.
    pub path: PathBuf,
    /// Size of a cache file to create (ignored for block devices).
    pub size: Option<String>,
    pub mode: Option<String>,
    pub admission: Option<String>,
    /// Sequential write runs reaching this size bypass flash ("0": never).
    pub sequential_write_cutoff: Option<String>,
    pub replacement: Option<String>,
    pub region_size: Option<String>,
    /// stacked | cow-aware (the default)
    pub cow: Option<String>,
    pub keep_dirty: Option<bool>,
    /// Fill partially valid clusters from their backing files while the
    /// server is idle (default true).
    pub idle_fill: Option<bool>,
    pub high_watermark: Option<f64>,
    pub low_watermark: Option<f64>,
    /// Most write-back requests in flight (default 64; fewer when the
    /// storage server's latency says they only queue).
    pub writeback_depth: Option<usize>,
    /// Deduplicate blocks entering flash, across every disk: "on" or
    /// "off" (the default).
    pub dedup: Option<String>,
    /// With dedup on, compare every byte before sharing a block (default
    /// false: a 128-bit BLAKE3 prefix and the block's CRC-32C must match).
    pub dedup_verify: Option<bool>,
    /// Per-VM shares (default false): each export fills flash regions of
    /// its own, and space is taken from the export with the least recent
    /// reuse per byte held (within each export's share_min/share_max).
    pub shares: Option<bool>,
    /// SVD's read/write split (e.g. 0.75): while promoted reads hold at
    /// most this share of the cache, reclaim takes written data first, so
    /// a burst of writes does not flush the read cache. Absent: no split.
    pub read_split: Option<f64>,
    /// Built from `vdcache serve` options rather than read from a file:
    /// errors then name the option (`--cache-size`), not the key.
    #[serde(skip)]
    pub from_command_line: bool,
}

impl CacheSection {
    /// How an error names the setting `key` (`[cache] key` in a file, the
    /// option `--flag` on the command line).
    pub fn setting(&self, key: &str, flag: &str) -> String {
        if self.from_command_line {
            flag.to_string()
        } else {
            format!("[cache] {key}")
        }
    }
}

/// One export: a name and the top image of a chain.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    pub name: String,
    pub image: String,
    pub format: Option<String>,
    #[serde(default)]
    pub read_only: bool,
    pub description: Option<String>,
    /// Per-disk cache mode, admission and metadata cache settings.
    pub cache_mode: Option<String>,
    pub admission: Option<String>,
    pub sequential_write_cutoff: Option<String>,
    /// stacked | cow-aware; overrides `cow` of `[cache]` for this export.
    pub cow: Option<String>,
    pub l2_cache_size: Option<String>,
    pub refcount_cache_size: Option<String>,
    pub meta_slice_size: Option<String>,
    /// Bypass the cache for this export.
    #[serde(default)]
    pub no_cache: bool,
    /// Size of this disk's virtual journal device: an extra export
    /// `NAME-journal` for the guest's external ext4 journal (needs a cache).
    pub journal_size: Option<String>,
    /// Where the journal device's blocks go when they leave flash (a path
    /// or an NBD URI; default: `CACHE.journal-NAME` next to the cache).
    pub journal_image: Option<String>,
    /// Journal-aware caching of the journal device (default true): its
    /// blocks live only in flash (cache-only logging) and in-place writes
    /// of this disk share its cached copies (logical caching). false:
    /// the journal device is cached like any disk.
    pub journal_aware: Option<bool>,
    /// Set on a journal device's own export: the export it journals for.
    #[serde(skip)]
    pub journal_for: Option<String>,
    /// Also serve this disk over vhost-user-blk on this Unix socket (QEMU:
    /// `-chardev socket,path=...` and `-device vhost-user-blk-pci`).
    pub vhost_user_blk: Option<PathBuf>,
    /// vhost-user-blk virtqueues offered, each served by its own thread
    /// (default 2; QEMU's `num-queues` may not exceed it).
    pub vhost_user_queues: Option<usize>,
    /// With `[cache] shares`: flash this export keeps however others
    /// reuse theirs (a size), the most it may hold, and the weight of its
    /// demand (default 1).
    pub share_min: Option<String>,
    pub share_max: Option<String>,
    pub share_weight: Option<f64>,
    /// The per-disk metadata journal of the top image, without a cache or
    /// with a writethrough or writearound one: auto (the default: on where
    /// the image can carry one), on, or off.
    pub metadata_journal: Option<String>,
    /// With the metadata journal and no cache: write zeros ahead of
    /// allocation (adaptive preallocation). Default false.
    pub preallocate: Option<bool>,
}

/// Values of `metadata_journal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataJournal {
    Auto,
    On,
    Off,
}

impl std::str::FromStr for MetadataJournal {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(MetadataJournal::Auto),
            "on" => Ok(MetadataJournal::On),
            "off" => Ok(MetadataJournal::Off),
            _ => bail!("metadata_journal must be auto, on or off, not '{s}'"),
        }
    }
}

impl ExportConfig {
    /// The export's `metadata_journal` setting (validated by `validate`).
    pub fn metadata_journal(&self) -> Result<MetadataJournal> {
        self.metadata_journal
            .as_deref()
            .map_or(Ok(MetadataJournal::Auto), str::parse)
            .with_context(|| format!("export '{}'", self.name))
    }
}

/// Largest cache file `[cache] size` (`--cache-size`) creates: 1 PiB.
pub const MAX_CACHE_FILE_BYTES: u64 = 1 << 50;
/// Largest journal device (`journal_size`): 1 TiB (its blocks live in
/// the cache).
pub const MAX_JOURNAL_BYTES: u64 = 1 << 40;

/// Largest metadata cache (`l2_cache_size`, `refcount_cache_size`):
/// 64 GiB, every L2 table of a 512 TiB image of 64 KiB clusters (a
/// journaled image reserves room for the whole cache in its journal).
pub const MAX_META_CACHE_BYTES: u64 = 64 << 30;

/// A metadata cache size; `what` names its key or option in errors.
pub fn parse_meta_cache_size(what: &str, v: &str) -> Result<u64> {
    let bytes = parse_size(v).with_context(|| what.to_string())?;
    if bytes > MAX_META_CACHE_BYTES {
        bail!(
            "{what} {v} is larger than a metadata cache may be, 64 GiB ({MAX_META_CACHE_BYTES} bytes)"
        );
    }
    Ok(bytes)
}

/// Most vhost-user-blk queues an export may offer.
pub const MAX_VHOST_USER_QUEUES: usize = 16;

impl ExportConfig {
    /// The export of this disk's virtual journal device, if it has one:
    /// `NAME-journal`, a raw image (`journal_image`, by default a file
    /// next to the cache device: see [`journal_file`]), always through the
    /// cache.
    pub fn journal_export(&self, cache: &Path) -> Option<ExportConfig> {
        self.journal_size.as_ref()?;
        let image = match &self.journal_image {
            Some(i) => i.clone(),
            None => journal_file(cache, &self.name)
                .to_string_lossy()
                .into_owned(),
        };
        Some(ExportConfig {
            name: format!("{}-journal", self.name),
            image,
            format: Some("raw".into()),
            description: Some(format!("virtual journal device of '{}'", self.name)),
            cache_mode: self.cache_mode.clone(),
            journal_aware: self.journal_aware,
            journal_for: Some(self.name.clone()),
            ..ExportConfig::default()
        })
    }

    /// Whether this is a journal device cached journal-aware.
    pub fn is_aware_journal(&self) -> bool {
        self.journal_for.is_some() && self.journal_aware.unwrap_or(true)
    }
}

/// The file saying that the newest blocks of export `name`'s journal
/// device may live only in the cache at `cache` (cache-only logging): it
/// exists from the start of serving until a stop or write-out leaves
/// nothing of the journal in flash alone, so a cache lost meanwhile is
/// noticed rather than a stale journal served.
pub fn journal_marker(cache: &Path, name: &str) -> PathBuf {
    let mut file = journal_file(cache, name).into_os_string();
    file.push(".in-cache");
    PathBuf::from(file)
}

/// Where the blocks of export `name`'s journal device live: the file
/// `CACHE.journal-NAME` (bytes of the name outside `[A-Za-z0-9._-]`
/// written as `%XX`), next to the cache device.
pub fn journal_file(cache: &Path, name: &str) -> PathBuf {
    let mut file = cache.as_os_str().to_owned();
    file.push(".journal-");
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"._-".contains(&b) {
            file.push(char::from(b).to_string());
        } else {
            file.push(format!("%{b:02X}"));
        }
    }
    PathBuf::from(file)
}

impl ServerConfig {
    /// Reads and validates a TOML configuration file.
    pub fn load(path: &Path) -> Result<ServerConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Self::parse(&text).map_err(|e| e.in_file(path))
    }

    /// Parses and validates the text of a configuration file: all that
    /// [`ServerConfig::load`] does once the file is read (and what the fuzz
    /// target feeds).
    pub fn parse(text: &str) -> Result<ServerConfig, ConfigError> {
        let cfg: ServerConfig = toml::from_str(text).map_err(ConfigError::Syntax)?;
        cfg.validate().map_err(ConfigError::Invalid)?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        if self.exports.is_empty() {
            bail!("no [[export]] is configured");
        }
        let journals: Vec<String> = self
            .exports
            .iter()
            .filter(|e| e.journal_size.is_some())
            .map(|e| format!("{}-journal", e.name))
            .collect();
        let mut names: Vec<&str> = self.exports.iter().map(|e| e.name.as_str()).collect();
        names.extend(journals.iter().map(String::as_str));
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("export name '{}' is used twice", w[0]);
        }
        for e in &self.exports {
            if e.name.len() > 4096 {
                let cut = e.name.floor_char_boundary(32);
                bail!(
                    "export name '{}…' is longer than 4096 bytes",
                    &e.name[..cut]
                );
            }
            if e.image.is_empty() {
                bail!("export '{}': image is empty", e.name);
            }
            e.metadata_journal()?;
            for (key, v) in [
                ("l2_cache_size", &e.l2_cache_size),
                ("refcount_cache_size", &e.refcount_cache_size),
            ] {
                if let Some(v) = v {
                    parse_meta_cache_size(&format!("export '{}': {key}", e.name), v)?;
                }
            }
            for (key, v) in [
                ("meta_slice_size", &e.meta_slice_size),
                ("journal_size", &e.journal_size),
                ("share_min", &e.share_min),
                ("share_max", &e.share_max),
            ] {
                if let Some(v) = v {
                    parse_size(v).with_context(|| format!("export '{}': {key}", e.name))?;
                }
            }
        }
        for e in &self.exports {
            if let Some(v) = &e.journal_size
                && parse_size(v)
                    .is_ok_and(|b| b == 0 || !b.is_multiple_of(4096) || b > MAX_JOURNAL_BYTES)
            {
                bail!(
                    "export '{}': journal_size must be a non-zero multiple of 4096 bytes of at most 1 TiB ({MAX_JOURNAL_BYTES} bytes), not {v}",
                    e.name
                );
            }
        }
        if let Some(e) = self.exports.iter().find(|e| {
            e.journal_size.is_none() && (e.journal_image.is_some() || e.journal_aware.is_some())
        }) {
            bail!(
                "export '{}': journal_image and journal_aware describe a journal device, which journal_size creates",
                e.name
            );
        }
        if let Some(e) = self.exports.iter().find(|e| e.journal_size.is_some())
            && (self.cache.is_none() || e.no_cache)
        {
            bail!(
                "export '{}': journal_size needs the flash cache (a [cache] section, and no_cache unset): the journal device's blocks live in it",
                e.name
            );
        }
        if let Some(c) = &self.cache {
            for (key, flag, v) in [
                ("size", "--cache-size", &c.size),
                ("region_size", "--region-size", &c.region_size),
                (
                    "sequential_write_cutoff",
                    "--sequential-write-cutoff",
                    &c.sequential_write_cutoff,
                ),
            ] {
                if let Some(v) = v {
                    parse_size(v).with_context(|| c.setting(key, flag))?;
                }
            }
            if let Some(v) = &c.size
                && parse_size(v)? > MAX_CACHE_FILE_BYTES
            {
                bail!(
                    "{} {v} is larger than the largest cache file vdcache creates, 1 PiB ({MAX_CACHE_FILE_BYTES} bytes)",
                    c.setting("size", "--cache-size")
                );
            }
        }
        for (what, example, addr) in [
            (
                "the metrics address ([server] metrics, --metrics)",
                "127.0.0.1:9187",
                &self.server.metrics,
            ),
            (
                "the TCP address ([server] tcp, --tcp)",
                "127.0.0.1:10809",
                &self.server.tcp,
            ),
        ] {
            if let Some(a) = addr {
                check_host_port(a).with_context(|| {
                    format!("{what} must be HOST:PORT, such as {example}, not '{a}'")
                })?;
            }
        }
        self.validate_plaintext_tcp()?;
        if self.server.socket.is_none()
            && self.server.tcp.is_none()
            && self.server.fuse.is_none()
            && self.exports.iter().all(|e| e.vhost_user_blk.is_none())
        {
            bail!(
                "[server] needs a socket, a tcp address or a fuse directory (or an export needs vhost_user_blk)"
            );
        }
        self.validate_vhost_user()?;
        self.validate_shares()?;
        if let Some(m) = &self.server.socket_mode {
            parse_socket_mode(m).context("[server] socket_mode (--socket-mode)")?;
        }
        for (key, v) in [
            ("socket_owner", &self.server.socket_owner),
            ("socket_group", &self.server.socket_group),
        ] {
            if v.as_deref().is_some_and(|v| v.trim().is_empty()) {
                bail!("[server] {key} is empty");
            }
        }
        let l = &self.server;
        for (key, v) in [
            ("max_connections", l.max_connections),
            ("max_handshakes", l.max_handshakes),
            ("max_connections_per_ip", l.max_connections_per_ip),
            ("max_connections_per_uid", l.max_connections_per_uid),
            ("workers", l.workers),
        ] {
            if v == Some(0) {
                let flag = if key == "workers" { " (--workers)" } else { "" };
                bail!("[server] {key}{flag} must be at least 1");
            }
        }
        if let Some(t) = l.handshake_timeout
            && !(t.is_finite() && (0.0..=86400.0).contains(&t))
        {
            bail!("[server] handshake_timeout must be 0 to 86400 seconds, not {t}");
        }
        if self
            .storage
            .allow_backing
            .iter()
            .any(|a| a.trim().is_empty())
        {
            bail!("[storage] allow_backing (--allow-backing) names an empty place");
        }
        if let Some(t) = self.storage.reconnect_delay
            && !(t.is_finite() && (0.0..=86400.0).contains(&t))
        {
            bail!("[storage] reconnect_delay must be 0 to 86400 seconds, not {t}");
        }
        if let Some(v) = &self.storage.unflushed_limit {
            parse_size(v).context("[storage] unflushed_limit")?;
        }
        if let Some(v) = &l.max_buffered {
            let bytes = parse_size(v).context("[server] max_buffered")?;
            // The budget must hold one piece of a streamed payload.
            let piece = u64::from(vdcache_nbd_server::Limits::default().payload_chunk);
            if bytes < piece {
                bail!("[server] max_buffered must be at least {piece} bytes, not {v}");
            }
        }
        if let Some(t) = &self.server.tls {
            match (&t.cert, &t.key, &t.psk) {
                (Some(_), Some(_), None) | (None, None, Some(_)) => {}
                _ => bail!("[server.tls] needs cert and key, or psk (not both)"),
            }
        }
        Ok(())
    }
}

/// A listening address: HOST:PORT (an IPv6 host in brackets).
fn check_host_port(addr: &str) -> Result<()> {
    if addr.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        bail!("the port is missing");
    };
    if host.is_empty() || host.contains(':') && !host.starts_with('[') {
        bail!("the host is missing or an IPv6 address is not in brackets");
    }
    port.parse::<u16>()
        .map(|_| ())
        .map_err(|_| anyhow::anyhow!("'{port}' is not a port number"))
}

impl ServerConfig {
    /// TCP without TLS only when asked for by name: unlike the Unix
    /// socket (mode 0600), any local user can reach a TCP port.
    fn validate_plaintext_tcp(&self) -> Result<()> {
        let l = &self.server;
        match (&l.tcp, l.tls.is_some(), l.insecure_tcp) {
            (Some(addr), false, false) => bail!(
                "[server] tcp (--tcp) {addr} without TLS would let anyone who can reach it (every local user, for a loopback address) read and write the disks: require TLS ([server.tls], --tls-cert and --tls-key, or --tls-psk), or, if that is meant, say so with [server] insecure_tcp = true (--insecure-tcp)"
            ),
            (None, _, true) | (_, true, true) => bail!(
                "[server] insecure_tcp (--insecure-tcp) is for a tcp address without TLS; this server has {}",
                if l.tcp.is_none() {
                    "no tcp address"
                } else {
                    "TLS"
                }
            ),
            _ => Ok(()),
        }
    }

    /// Share settings need shares on, and make sense together.
    fn validate_shares(&self) -> Result<()> {
        if let Some(split) = self.cache.as_ref().and_then(|c| c.read_split)
            && !(split.is_finite() && split > 0.0 && split <= 1.0)
        {
            bail!("[cache] read_split must be above 0 and at most 1, not {split}");
        }
        let on = self.cache.as_ref().is_some_and(|c| c.shares == Some(true));
        for e in &self.exports {
            let given = e.share_min.is_some() || e.share_max.is_some() || e.share_weight.is_some();
            if given && !on {
                bail!(
                    "export '{}': share_min, share_max and share_weight need [cache] shares = true",
                    e.name
                );
            }
            if let Some(w) = e.share_weight
                && !(w.is_finite() && w > 0.0)
            {
                bail!("export '{}': share_weight must be above 0, not {w}", e.name);
            }
            let size = |v: &Option<String>| v.as_deref().map(parse_size).transpose();
            if let (Ok(Some(min)), Ok(Some(max))) = (size(&e.share_min), size(&e.share_max))
                && min > max
            {
                bail!("export '{}': share_min is above share_max", e.name);
            }
        }
        Ok(())
    }

    /// Each vhost-user-blk socket names one export, no other socket of the
    /// server, and a queue count the device can offer.
    fn validate_vhost_user(&self) -> Result<()> {
        let mut sockets: Vec<(&Path, &str)> = Vec::new();
        for e in &self.exports {
            if let Some(q) = e.vhost_user_queues {
                if e.vhost_user_blk.is_none() {
                    bail!(
                        "export '{}': vhost_user_queues needs vhost_user_blk",
                        e.name
                    );
                }
                if !(1..=MAX_VHOST_USER_QUEUES).contains(&q) {
                    bail!(
                        "export '{}': vhost_user_queues must be 1 to {MAX_VHOST_USER_QUEUES}, not {q}",
                        e.name
                    );
                }
            }
            let Some(p) = &e.vhost_user_blk else { continue };
            if p.as_os_str().is_empty() {
                bail!("export '{}': vhost_user_blk is empty", e.name);
            }
            if let Some((_, other)) = sockets.iter().find(|(q, _)| *q == p.as_path()) {
                bail!(
                    "exports '{other}' and '{}' both use the vhost-user-blk socket {}",
                    e.name,
                    p.display()
                );
            }
            if self.server.socket.as_deref() == Some(p.as_path()) {
                bail!(
                    "export '{}': vhost_user_blk {} is also [server] socket",
                    e.name,
                    p.display()
                );
            }
            sockets.push((p.as_path(), e.name.as_str()));
        }
        Ok(())
    }
}

/// Why [`ServerConfig::parse`] rejects a text.
#[derive(Debug)]
pub enum ConfigError {
    /// Not TOML, or a key or value that does not fit the schema (the TOML
    /// error names the key and its line).
    Syntax(toml::de::Error),
    /// Well-formed, but not a server that can run (the error names the key).
    Invalid(anyhow::Error),
}

impl ConfigError {
    /// The error as [`ServerConfig::load`] reports it for the file `path`.
    fn in_file(self, path: &Path) -> anyhow::Error {
        match self {
            ConfigError::Syntax(e) => {
                anyhow::Error::new(e).context(format!("config {} is not valid", path.display()))
            }
            ConfigError::Invalid(e) => e.context(format!("config {}", path.display())),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Syntax(e) => write!(f, "not valid: {e}"),
            ConfigError::Invalid(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_split_and_share_keys_are_checked() {
        let cfg = |cache: &str, export: &str| {
            ServerConfig::parse(&format!(
                "[server]\nsocket = \"/s\"\n[cache]\npath = \"/c\"\n{cache}[[export]]\nname = \"a\"\nimage = \"i\"\n{export}"
            ))
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        assert_eq!(
            cfg("read_split = 0.75\nshares = true\n", "share_max = \"1G\"\n"),
            Ok(())
        );
        for (cache, export, word) in [
            ("read_split = 1.5\n", "", "read_split"),
            ("read_split = 0\n", "", "read_split"),
            ("", "share_weight = 2\n", "shares = true"),
            ("shares = true\n", "share_weight = -1\n", "share_weight"),
            (
                "shares = true\n",
                "share_min = \"2G\"\nshare_max = \"1G\"\n",
                "above share_max",
            ),
        ] {
            let e = cfg(cache, export).err().unwrap_or_default();
            assert!(e.contains(word), "{cache}{export}: {e}");
        }
    }

    #[test]
    fn socket_modes_parse_and_bad_ones_are_named() {
        assert_eq!(parse_socket_mode("0660").ok(), Some(0o660));
        assert_eq!(parse_socket_mode("666").ok(), Some(0o666));
        assert_eq!(parse_socket_mode("0o600").ok(), Some(0o600));
        for bad in ["", "0999", "7777", "rw-rw----", "0400", "0060"] {
            let e = parse_socket_mode(bad)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
    }

    #[test]
    fn parses_a_full_config_and_names_bad_keys() {
        let cfg: ServerConfig = toml::from_str(
            r#"
            [server]
            socket = "/run/vd.sock"
            [cache]
            path = "/var/cache.img"
            size = "1G"
            mode = "writeback"
            [[export]]
            name = "vm1"
            image = "/images/vm1.qcow2"
            cache_mode = "writethrough"
            [[export]]
            name = "vm2"
            image = "/images/vm2.qcow2"
            read_only = true
            "#,
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.exports.len(), 2);
        let limits: ServerConfig = toml::from_str(
            "[server]\nsocket=\"s\"\nmax_connections=32\nmax_handshakes=8\nhandshake_timeout=2.5\nmax_buffered=\"64M\"\n[[export]]\nname=\"a\"\nimage=\"x\"\n",
        )
        .unwrap();
        limits.validate().unwrap();
        assert_eq!(limits.server.max_handshakes, Some(8));
        for (bad, key) in [
            ("max_handshakes=0", "max_handshakes"),
            ("handshake_timeout=-1", "handshake_timeout"),
            ("max_buffered=\"lots\"", "max_buffered"),
            ("max_buffered=\"64k\"", "max_buffered"),
            ("[storage]\nreconnect_delay=-1", "reconnect_delay"),
            ("[storage]\nreconnect_delay=nan", "reconnect_delay"),
            ("[storage]\nreconnect_delay=1e9", "reconnect_delay"),
            ("[storage]\nunflushed_limit=\"lots\"", "unflushed_limit"),
        ] {
            let cfg: ServerConfig = toml::from_str(&format!(
                "[server]\nsocket=\"s\"\n{bad}\n[[export]]\nname=\"a\"\nimage=\"x\"\n"
            ))
            .unwrap();
            let err = format!("{:#}", cfg.validate().unwrap_err());
            assert!(err.contains(key), "{bad}: {err}");
        }
        let bad = toml::from_str::<ServerConfig>("[server]\nsockett = \"x\"\n");
        assert!(bad.unwrap_err().to_string().contains("sockett"));
        let dup: ServerConfig = toml::from_str(
            "[server]\nsocket=\"s\"\n[[export]]\nname=\"a\"\nimage=\"x\"\n[[export]]\nname=\"a\"\nimage=\"y\"\n",
        )
        .unwrap();
        assert!(
            dup.validate()
                .unwrap_err()
                .to_string()
                .contains("used twice")
        );
    }

    #[test]
    fn storage_reconnect_delay_reaches_the_nbd_settings() {
        let base = "[server]\nsocket=\"s\"\n[[export]]\nname=\"a\"\nimage=\"x\"\n";
        let cfg = ServerConfig::parse(base).unwrap();
        assert_eq!(
            cfg.storage.nbd_options().reconnect_delay,
            vdcache_backend::DEFAULT_RECONNECT_DELAY
        );
        let cfg =
            ServerConfig::parse(&format!("[storage]\nreconnect_delay = 2.5\n{base}")).unwrap();
        assert_eq!(
            cfg.storage.nbd_options().reconnect_delay,
            std::time::Duration::from_millis(2500)
        );
        assert_eq!(
            cfg.storage.nbd_options().unflushed_limit,
            vdcache_backend::DEFAULT_UNFLUSHED_LIMIT
        );
        let cfg =
            ServerConfig::parse(&format!("[storage]\nunflushed_limit = \"64M\"\n{base}")).unwrap();
        assert_eq!(cfg.storage.nbd_options().unflushed_limit, 64 << 20);
        let err = ServerConfig::parse(&format!("[storage]\nreconect_delay = 2\n{base}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("reconect_delay"), "{err}");
    }

    /// `load` names the file in front of what `parse` reports, as it did
    /// before parsing was split from reading.
    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[server]\nsockett = \"x\"\n").unwrap();
        let err = format!("{:#}", ServerConfig::load(&path).unwrap_err());
        let prefix = format!("config {} is not valid: ", path.display());
        assert!(err.starts_with(&prefix), "{err}");
        assert!(err.contains("unknown field `sockett`"), "{err}");
        std::fs::write(&path, "[server]\nsocket = \"s\"\n").unwrap();
        let err = format!("{:#}", ServerConfig::load(&path).unwrap_err());
        assert_eq!(
            err,
            format!("config {}: no [[export]] is configured", path.display())
        );
        std::fs::write(
            &path,
            "[server]\nsocket = \"s\"\n[[export]]\nname = \"a\"\nimage = \"i\"\n",
        )
        .unwrap();
        let cfg = ServerConfig::load(&path).unwrap();
        assert_eq!(cfg.exports[0].image, "i");
    }

    /// `journal_size` adds the export NAME-journal, needs the cache and a
    /// size in whole 4 KiB blocks; every mistake names the key.
    #[test]
    fn journal_size_is_checked_and_names_its_export() {
        let with = |cache: &str, extra: &str| {
            ServerConfig::parse(&format!(
                "[server]\nsocket = \"s\"\n{cache}[[export]]\nname = \"vm\"\nimage = \"i\"\n{extra}"
            ))
        };
        let cache = "[cache]\npath = \"/c/cache.img\"\n";
        let cfg = with(cache, "journal_size = \"32M\"\n").unwrap();
        let j = cfg.exports[0]
            .journal_export(&cfg.cache.as_ref().unwrap().path)
            .unwrap();
        assert_eq!(j.name, "vm-journal");
        assert_eq!(j.image, "/c/cache.img.journal-vm");
        assert_eq!(j.format.as_deref(), Some("raw"));
        assert!(j.is_aware_journal(), "journal-aware by default");
        assert!(
            !cfg.exports[0].is_aware_journal(),
            "a data disk is no journal"
        );
        assert_eq!(
            journal_marker(Path::new("/c/cache.img"), "vm"),
            PathBuf::from("/c/cache.img.journal-vm.in-cache")
        );
        let plain = with(
            cache,
            "journal_size = \"32M\"\njournal_aware = false\njournal_image = \"nbd+unix:///j?socket=/s\"\n",
        )
        .unwrap();
        let j = plain.exports[0]
            .journal_export(&plain.cache.as_ref().unwrap().path)
            .unwrap();
        assert_eq!(j.image, "nbd+unix:///j?socket=/s");
        assert!(!j.is_aware_journal());
        assert_eq!(j.journal_for.as_deref(), Some("vm"));
        assert_eq!(
            journal_file(Path::new("/c/x"), "a b/é"),
            PathBuf::from("/c/x.journal-a%20b%2F%C3%A9")
        );
        for (cache, extra, want) in [
            (
                "",
                "journal_size = \"32M\"\n",
                "journal_size needs the flash cache",
            ),
            (
                cache,
                "journal_size = \"32M\"\nno_cache = true\n",
                "journal_size needs",
            ),
            (cache, "journal_size = \"1000\"\n", "multiple of 4096"),
            (cache, "journal_size = \"0\"\n", "multiple of 4096"),
            (cache, "journal_size = \"lots\"\n", "journal_size"),
            (
                cache,
                "journal_aware = false\n",
                "which journal_size creates",
            ),
            (
                cache,
                "journal_image = \"j.raw\"\n",
                "which journal_size creates",
            ),
        ] {
            let err = with(cache, extra).unwrap_err().to_string();
            assert!(err.contains(want) && err.contains("'vm'"), "{extra}: {err}");
        }
        let clash = ServerConfig::parse(
            "[server]\nsocket = \"s\"\n[cache]\npath = \"c\"\n[[export]]\nname = \"vm\"\nimage = \"i\"\njournal_size = \"4M\"\n[[export]]\nname = \"vm-journal\"\nimage = \"j\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(clash.contains("'vm-journal' is used twice"), "{clash}");
        // FUSE alone is a front end too.
        assert!(
            ServerConfig::parse(
                "[server]\nfuse = \"/d\"\n[[export]]\nname = \"a\"\nimage = \"i\"\n"
            )
            .is_ok()
        );
    }

    /// A long export name whose 32nd byte falls inside a character is
    /// reported, not a panic (slicing it at byte 32 used to panic).
    #[test]
    fn overlong_multibyte_export_name_is_an_error() {
        let name = format!("a{}", "é".repeat(3000));
        let text =
            format!("[server]\nsocket = \"s\"\n[[export]]\nname = \"{name}\"\nimage = \"i\"\n");
        let cfg: ServerConfig = toml::from_str(&text).unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            format!("export name '{}…' is longer than 4096 bytes", &name[..31])
        );
    }
}
