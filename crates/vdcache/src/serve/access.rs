//! Who may connect to the data sockets (the NBD Unix socket and each
//! vhost-user-blk socket): their mode, owner and group, from `[server]
//! socket_mode / socket_owner / socket_group` or the same `--socket-*`
//! flags. libvirt runs QEMU as its own user (libvirt-qemu, qemu), which a
//! root-owned 0600 socket shuts out.
//!
//! Owns: parsing and checking those settings (a user or group that does
//! not exist is an error at start, not a socket nobody can use). Must not:
//! touch the control socket (stats, flush and stop stay root's), or give a
//! socket its access after it is bound (the front ends bind each socket
//! with it: [`SocketAccess`] in `vdcache_ownership`), so that no client
//! ever finds a socket with a mode or an owner in between.

use anyhow::{Result, bail};
use nix::unistd::{Group, User};
use vdcache::config::parse_socket_mode as parse_mode;
pub use vdcache_ownership::SocketAccess;

fn user(name: &str) -> Result<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    match User::from_name(name) {
        Ok(Some(u)) => Ok(u.uid.as_raw()),
        Ok(None) => bail!("socket owner '{name}' is not a user of this host"),
        Err(e) => bail!("looking up socket owner '{name}': {e}"),
    }
}

fn group(name: &str) -> Result<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    match Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => bail!("socket group '{name}' is not a group of this host"),
        Err(e) => bail!("looking up socket group '{name}': {e}"),
    }
}

/// The data sockets' access from the settings' text (each may be absent:
/// mode 0600, this process's user and group).
pub fn parse_access(
    mode: Option<&str>,
    owner: Option<&str>,
    group_name: Option<&str>,
) -> Result<SocketAccess> {
    let default = SocketAccess::default();
    Ok(SocketAccess {
        mode: mode.map(parse_mode).transpose()?.unwrap_or(default.mode),
        owner: owner.map(user).transpose()?,
        group: group_name.map(group).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_resolve_and_unknown_ones_are_errors() {
        let a = parse_access(Some("0660"), Some("root"), Some("0")).ok();
        assert_eq!(
            a,
            Some(SocketAccess {
                mode: 0o660,
                owner: Some(0),
                group: Some(0),
            })
        );
        let e = parse_access(None, Some("no-such-user-vdcache"), None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("no-such-user-vdcache"), "{e}");
        let e = parse_access(None, None, Some("no-such-group-vdcache"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("no-such-group-vdcache"), "{e}");
    }
}
