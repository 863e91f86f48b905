//! Every check that can refuse `vdcache serve`, run before anything is
//! created, bound or written (invariant 11): each socket path is free or a
//! stale socket, no two paths of the configuration name one file, every
//! image can be locked the way its export needs, every chain reaches only
//! where the operator allows (`--allow-backing`), and the cache is none of
//! the files of a served chain.
//!
//! Must not: create, remove, lock for longer than a probe, or write
//! anything. Opening for real stays the daemon's; a probe that passes here
//! may still fail there (a race with another process), and the daemon
//! undoes what it made.

use super::config::{ExportConfig, ServerConfig};
use super::run::control_path;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vdcache_backend::{FileBackend, FileOptions, LockMode, is_nbd_uri};
use vdcache_image::{ImageFormat, OpenOptions, StoreOpener, Stores, open_chain};
use vdcache_ownership::{check_distinct, check_socket_path, identity};

/// Runs every check; the first that fails is the error.
pub fn check(cfg: &ServerConfig) -> Result<()> {
    let sockets = sockets(cfg);
    for (what, path) in &sockets {
        check_socket_path(path).context(*what)?;
    }
    if let Some(dir) = &cfg.server.fuse
        && dir.exists()
        && !dir.is_dir()
    {
        bail!(
            "--fuse {}: not a directory (give a directory to show the disks in)",
            dir.display()
        );
    }
    // Read-only exports may share an image; a writable one shares nothing.
    let images: Vec<(String, &Path)> = cfg
        .exports
        .iter()
        .filter(|e| !is_nbd_uri(&e.image) && !e.read_only)
        .map(|e| {
            (
                format!("the image of {}", export_label(&e.name)),
                Path::new(&e.image),
            )
        })
        .collect();
    let mut named: Vec<(String, &Path)> = sockets
        .iter()
        .map(|(what, p)| (format!("the {what}"), p.as_path()))
        .collect();
    named.extend(images);
    named.extend(
        cfg.cache
            .as_ref()
            .map(|c| ("the cache".to_string(), c.path.as_path())),
    );
    check_distinct(&named)?;
    for e in cfg.exports.iter().filter(|e| !is_nbd_uri(&e.image)) {
        probe_lock(&e.image, e.read_only).with_context(|| export_label(&e.name))?;
    }
    let cache = cfg
        .cache
        .as_ref()
        .and_then(|c| Some((c.path.as_path(), identity(&c.path)?)));
    let opener: Arc<dyn StoreOpener> = Arc::new(Stores {
        nbd: cfg.storage.nbd_options(),
    });
    for e in cfg.exports.iter().filter(|e| !is_nbd_uri(&e.image)) {
        check_chain(e, cache, &cfg.storage.allow_backing, &opener)
            .with_context(|| export_label(&e.name))?;
    }
    Ok(())
}

fn export_label(name: &str) -> String {
    if name.is_empty() {
        "the default export".into()
    } else {
        format!("export '{name}'")
    }
}

/// The Unix sockets the server would bind, each with what it is for.
fn sockets(cfg: &ServerConfig) -> Vec<(&'static str, PathBuf)> {
    let mut s: Vec<(&'static str, PathBuf)> = Vec::new();
    if let Some(p) = &cfg.server.socket {
        s.push(("NBD socket", p.clone()));
    }
    if let Some(p) = control_path(cfg) {
        s.push(("control socket", p));
    }
    for e in &cfg.exports {
        if let Some(p) = &e.vhost_user_blk {
            s.push(("vhost-user-blk socket", p.clone()));
        }
    }
    s
}

/// Takes and drops the lock the export's open will take on its image, so
/// an image in use is refused before anything is made.
fn probe_lock(image: &str, read_only: bool) -> Result<()> {
    FileBackend::open(
        Path::new(image),
        FileOptions {
            read_only,
            lock: Some(if read_only {
                LockMode::Read
            } else {
                LockMode::Write
            }),
            create: false,
        },
    )?;
    Ok(())
}

/// Opens the chain of an export's image (only its headers are read):
/// refuses a chain that reaches outside where the operator allows, and a
/// cache (`cache`: its path and identity, if it exists) that is a file of
/// the chain (its top or any backing file): formatting it would destroy
/// the disk.
fn check_chain(
    export: &ExportConfig,
    cache: Option<(&Path, (u64, u64))>,
    allow_backing: &[String],
    opener: &Arc<dyn StoreOpener>,
) -> Result<()> {
    let disk = open_chain(
        &export.image,
        &OpenOptions {
            read_only: true,
            force_share: true,
            inspect: true,
            format: export.format.as_deref().and_then(ImageFormat::parse),
            opener: opener.clone(),
            allow_backing: allow_backing.to_vec(),
            ..OpenOptions::default()
        },
    )?;
    let Some((cache, cache_id)) = cache else {
        return Ok(());
    };
    for layer in disk.layers() {
        if identity(Path::new(layer.name())) == Some(cache_id) {
            bail!(
                "the cache {} is {}, a file of the disk's own chain: give the cache a file of its own (nothing was changed)",
                cache.display(),
                layer.name()
            );
        }
    }
    Ok(())
}
