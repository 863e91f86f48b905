//! Who may connect to the data sockets (the NBD Unix socket and each
//! vhost-user-blk socket): their mode, owner and group, from `[server]
//! socket_mode / socket_owner / socket_group` or the same `--socket-*`
//! flags. libvirt runs QEMU as its own user (libvirt-qemu, qemu), which a
//! root-owned 0600 socket shuts out.
//!
//! Owns: parsing and checking those settings (a user or group that does
//! not exist is an error at start, not a socket nobody can use) and
//! applying them to a socket once it is bound. Must not: touch the control
//! socket (stats, flush and stop stay root's) or widen a mode before the
//! owner and group are set.

use anyhow::{Context, Result, bail};
use nix::unistd::{Gid, Group, Uid, User, chown};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use vdcache::config::parse_socket_mode as parse_mode;

/// The mode sockets get when none is given: the owner only.
const DEFAULT_MODE: u32 = 0o600;

/// Mode, owner and group for the data sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: u32,
    pub owner: Option<Uid>,
    pub group: Option<Gid>,
}

impl Default for SocketAccess {
    fn default() -> Self {
        SocketAccess {
            mode: DEFAULT_MODE,
            owner: None,
            group: None,
        }
    }
}

fn user(name: &str) -> Result<Uid> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(Uid::from_raw(n));
    }
    match User::from_name(name) {
        Ok(Some(u)) => Ok(u.uid),
        Ok(None) => bail!("socket owner '{name}' is not a user of this host"),
        Err(e) => bail!("looking up socket owner '{name}': {e}"),
    }
}

fn group(name: &str) -> Result<Gid> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(Gid::from_raw(n));
    }
    match Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid),
        Ok(None) => bail!("socket group '{name}' is not a group of this host"),
        Err(e) => bail!("looking up socket group '{name}': {e}"),
    }
}

impl SocketAccess {
    /// From the settings' text (each may be absent).
    pub fn parse(
        mode: Option<&str>,
        owner: Option<&str>,
        group_name: Option<&str>,
    ) -> Result<Self> {
        Ok(SocketAccess {
            mode: mode.map(parse_mode).transpose()?.unwrap_or(DEFAULT_MODE),
            owner: owner.map(user).transpose()?,
            group: group_name.map(group).transpose()?,
        })
    }

    /// Gives the bound socket at `path` its owner, group, then mode.
    pub fn apply(&self, path: &Path) -> Result<()> {
        if self.owner.is_some() || self.group.is_some() {
            chown(path, self.owner, self.group).with_context(|| {
                format!("cannot give socket {} its owner and group", path.display())
            })?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(self.mode))
            .with_context(|| format!("cannot set the mode of socket {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_resolve_and_unknown_ones_are_errors() {
        let a = SocketAccess::parse(Some("0660"), Some("root"), Some("0")).ok();
        assert_eq!(
            a,
            Some(SocketAccess {
                mode: 0o660,
                owner: Some(Uid::from_raw(0)),
                group: Some(Gid::from_raw(0)),
            })
        );
        let e = SocketAccess::parse(None, Some("no-such-user-vdcache"), None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("no-such-user-vdcache"), "{e}");
        let e = SocketAccess::parse(None, None, Some("no-such-group-vdcache"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("no-such-group-vdcache"), "{e}");
    }
}
