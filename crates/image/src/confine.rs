//! Where a chain may reach: the operator names the top image, but whoever
//! wrote an image's header names its backing file and external data file,
//! and such a name can be any host file (`/etc/shadow` as a raw backing
//! file would be served to the guest). So a chain reaches only files in
//! the top image's own directory tree, exports of the storage server the
//! top image is on, and the directory trees and storage servers the
//! operator allows besides (`--allow-backing`, `[storage] allow_backing`),
//! as libvirt and OpenStack confine the images they did not make.
//!
//! Owns: that rule and the error that names a name it refuses.
//! Must not: open a store (names reach it through the chain's store
//! opener, which makes them canonical: symlinks followed, no `..`).

use crate::chain::StoreOpener;
use crate::error::{ImageError, NotAllowed, Result};
use std::path::{Component, Path, PathBuf};
use vdcache_backend::{StoreName, same_server};

/// The directory trees and storage servers one chain may reach.
#[derive(Debug)]
pub(crate) struct Confinement {
    /// Canonical directories whose trees are allowed.
    dirs: Vec<PathBuf>,
    /// NBD URIs whose servers are allowed.
    servers: Vec<String>,
}

impl Confinement {
    /// The places of the chain whose top image the operator named `named`
    /// (canonically `top`), widened by `allowed` (directories and NBD URIs).
    pub(crate) fn new(
        named: &str,
        top: &str,
        allowed: &[String],
        opener: &dyn StoreOpener,
    ) -> Confinement {
        let mut c = Confinement {
            dirs: Vec::new(),
            servers: Vec::new(),
        };
        c.add(top, opener, Place::ParentOf);
        // A top image reached through a symlink: the directory the
        // operator named it in counts as well as the one it lives in.
        c.add(named, opener, Place::ParentOf);
        for a in allowed {
            c.add(a, opener, Place::Itself);
        }
        c
    }

    fn add(&mut self, name: &str, opener: &dyn StoreOpener, place: Place) {
        match StoreName::of(name) {
            StoreName::Nbd(uri) => {
                if !self.servers.iter().any(|s| s == uri) {
                    self.servers.push(uri.to_string());
                }
            }
            StoreName::Path(path) => {
                let dir = match place {
                    Place::Itself => path,
                    Place::ParentOf => path.parent().unwrap_or(Path::new("")),
                };
                // A directory that does not exist holds nothing to allow.
                // (A file name without a directory has the parent "",
                // which only stores of relative names, in memory, take.)
                let dir = dir
                    .to_str()
                    .and_then(|d| opener.canonical(d).ok())
                    .map(PathBuf::from);
                if let Some(dir) = dir.filter(|d| !self.dirs.contains(d)) {
                    self.dirs.push(dir);
                }
            }
        }
    }

    /// Whether the canonical store name `canonical` lies in one of the
    /// places.
    fn admits(&self, canonical: &str) -> bool {
        match StoreName::of(canonical) {
            StoreName::Nbd(uri) => self.servers.iter().any(|s| same_server(s, uri)),
            StoreName::Path(path) => {
                !path.components().any(|c| c == Component::ParentDir)
                    && self.dirs.iter().any(|d| path.starts_with(d))
            }
        }
    }

    /// The canonical name of `resolved`, which `image` names as its `what`
    /// (`backing file`, `external data file`) `named`; an error when it
    /// lies outside the places (or cannot be found: the opener's error).
    pub(crate) fn admit(
        &self,
        image: &str,
        what: &'static str,
        named: &str,
        resolved: &str,
        opener: &dyn StoreOpener,
    ) -> Result<String> {
        let canonical = opener.canonical(resolved)?;
        if self.admits(&canonical) {
            return Ok(canonical);
        }
        Err(ImageError::NotAllowed(Box::new(NotAllowed {
            image: image.to_string(),
            what,
            named: named.to_string(),
            canonical,
            places: self.describe(),
        })))
    }

    /// The places, as an error lists them.
    fn describe(&self) -> String {
        let dirs = self.dirs.iter().map(|d| {
            if d.as_os_str().is_empty() {
                "every relative name".to_string()
            } else {
                format!("{}/", d.display())
            }
        });
        let servers = self.servers.iter().map(|s| format!("the server of {s}"));
        dirs.chain(servers).collect::<Vec<_>>().join(", ")
    }
}

/// Which directory of a path counts.
#[derive(Clone, Copy)]
enum Place {
    /// The path is the directory.
    Itself,
    /// The path is a file; its directory.
    ParentOf,
}

/// What `--allow-backing` would take to admit `canonical`: its server's
/// URI, or its directory.
pub(crate) fn widening(canonical: &str) -> String {
    match StoreName::of(canonical) {
        StoreName::Nbd(uri) => uri.to_string(),
        StoreName::Path(path) => path
            .parent()
            .map_or_else(|| canonical.to_string(), |d| d.display().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::MemFiles;

    fn scope(named: &str, allowed: &[&str]) -> Confinement {
        let allowed: Vec<String> = allowed.iter().map(|s| s.to_string()).collect();
        Confinement::new(named, named, &allowed, &*MemFiles::new())
    }

    #[test]
    fn a_chain_reaches_its_top_images_tree_and_server_only() {
        let local = scope("/vm/top.qcow2", &[]);
        assert!(local.admits("/vm/base.qcow2"));
        assert!(local.admits("/vm/bases/base.qcow2"));
        assert!(!local.admits("/etc/shadow"));
        assert!(!local.admits("/vmx/base.qcow2"));
        assert!(!local.admits("/vm/../etc/shadow"));
        assert!(!local.admits("nbd+unix:///base?socket=/s"));
        let remote = scope("nbd+unix:///top?socket=/s", &[]);
        assert!(remote.admits("nbd+unix:///base?socket=/s"));
        assert!(!remote.admits("nbd+unix:///base?socket=/t"));
        assert!(!remote.admits("/s"));
        let relative = scope("top.qcow2", &[]);
        assert!(relative.admits("base.qcow2"));
        assert!(!relative.admits("../base.qcow2"));
    }

    #[test]
    fn allowed_directories_and_servers_widen_it() {
        let c = scope("/vm/top.qcow2", &["/bases", "nbd://store:10809/x"]);
        assert!(c.admits("/bases/b.qcow2"));
        assert!(c.admits("nbd://store/other"));
        assert!(!c.admits("/etc/passwd"));
        assert!(!c.admits("nbd://elsewhere/x"));
        let e = c
            .admit(
                "/vm/top.qcow2",
                "backing file",
                "/etc/passwd",
                "/etc/passwd",
                &*MemFiles::new(),
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/vm/top.qcow2")
                && e.contains("'/etc/passwd'")
                && e.contains("/vm/, /bases/, the server of nbd://store:10809/x")
                && e.contains("--allow-backing /etc"),
            "{e}"
        );
    }
}
