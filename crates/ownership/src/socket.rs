//! Unix sockets vdcache listens on. A socket path may hold nothing, or a
//! socket nobody listens on any more (a server killed with SIGKILL left
//! it): that one is replaced. Anything else (a regular file, a directory,
//! a link, a socket someone listens on) is refused before anything is
//! touched. A bound socket is removed at the end only while the path
//! still names the socket this process bound.

use crate::{OwnershipError, Result, describe, parent_of};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What binding a socket at `path` would find there.
enum Found {
    Nothing,
    Stale,
}

fn inspect(path: &Path) -> Result<Found> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let dir = parent_of(path);
            return match std::fs::metadata(dir) {
                Ok(m) if m.is_dir() => Ok(Found::Nothing),
                Ok(m) => Err(OwnershipError::NotAFile {
                    path: dir.to_path_buf(),
                    what: describe(m.file_type()),
                }),
                Err(e) => Err(OwnershipError::io("listen on", path)(e)),
            };
        }
        Err(e) => return Err(OwnershipError::io("look at", path)(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(OwnershipError::NotASocket {
            path: path.to_path_buf(),
            what: describe(meta.file_type()),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(OwnershipError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Ok(Found::Stale),
        Err(e) => Err(OwnershipError::io("connect to", path)(e)),
    }
}

/// Checks, without changing anything, that a socket may be bound at
/// `path`: nothing is there, or a socket nobody listens on.
pub fn check_socket_path(path: &Path) -> Result<()> {
    inspect(path).map(|_| ())
}

/// Who may connect to a socket vdcache binds: its mode, and the user and
/// group it is given (`None`: this process's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: u32,
    pub owner: Option<u32>,
    pub group: Option<u32>,
}

impl Default for SocketAccess {
    /// Mode 0600, this process's user and group.
    fn default() -> Self {
        SocketAccess {
            mode: 0o600,
            owner: None,
            group: None,
        }
    }
}

impl SocketAccess {
    /// Gives the socket bound at `tmp` (to appear at `path`) its owner,
    /// group, then mode.
    fn apply(&self, tmp: &Path, path: &Path) -> Result<()> {
        if self.owner.is_some() || self.group.is_some() {
            std::os::unix::fs::chown(tmp, self.owner, self.group).map_err(OwnershipError::io(
                "give its owner and group to socket",
                path,
            ))?;
        }
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(self.mode))
            .map_err(OwnershipError::io("set the mode of socket", path))
    }
}

/// A socket this process bound; dropping it removes the socket file if
/// the path still names it (not if someone replaced it meanwhile).
#[derive(Debug)]
pub struct OwnedSocket {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl OwnedSocket {
    /// [`OwnedSocket::bind_with`] the default access: mode 0600, this
    /// process's user and group.
    pub fn bind(path: &Path) -> Result<(UnixListener, OwnedSocket)> {
        OwnedSocket::bind_with(path, &SocketAccess::default())
    }

    /// Binds a listening socket at `path` that appears there only with
    /// its final owner, group and mode: bound inside a fresh 0700
    /// directory next to `path`, given `access`, then hard-linked into
    /// place (a link never replaces anything, so a server that bound
    /// `path` meanwhile is left alone). A client that finds the path can
    /// connect exactly as `access` says, never with a mode or an owner in
    /// between. A stale socket at `path` is removed first; anything else
    /// there is refused.
    pub fn bind_with(path: &Path, access: &SocketAccess) -> Result<(UnixListener, OwnedSocket)> {
        if path.file_name().is_none() {
            return Err(OwnershipError::NotAFile {
                path: path.to_path_buf(),
                what: "a directory name",
            });
        }
        if let Found::Stale = inspect(path)? {
            tracing::debug!("removing stale socket {}", path.display());
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(OwnershipError::io("remove stale socket", path)(e)),
            }
        }
        static SEQ: AtomicU64 = AtomicU64::new(0);
        // Short names: the temporary path must fit in sun_path too.
        let dir = parent_of(path).join(format!(
            ".vs{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(OwnershipError::io("create a directory next to", path))?;
        let tmp = dir.join("s");
        let bound = (|| {
            let l = UnixListener::bind(&tmp).map_err(OwnershipError::io("listen on", path))?;
            access.apply(&tmp, path)?;
            let meta = std::fs::symlink_metadata(&tmp)
                .map_err(OwnershipError::io("look at the socket bound for", path))?;
            std::fs::hard_link(&tmp, path).map_err(|e| match e.kind() {
                ErrorKind::AlreadyExists => OwnershipError::InUse {
                    path: path.to_path_buf(),
                },
                _ => OwnershipError::io("listen on", path)(e),
            })?;
            Ok((l, meta.dev(), meta.ino()))
        })();
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_dir(&dir);
        bound.map(|(listener, dev, ino)| {
            (
                listener,
                OwnedSocket {
                    path: path.to_path_buf(),
                    dev,
                    ino,
                },
            )
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `path` still names the socket bound here.
    fn still_ours(&self) -> bool {
        std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && m.dev() == self.dev && m.ino() == self.ino)
    }
}

impl Drop for OwnedSocket {
    fn drop(&mut self) {
        if self.still_ours() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_a_stale_socket_and_leaves_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("notes");
        std::fs::write(&file, b"important").unwrap();
        let e = OwnedSocket::bind(&file).unwrap_err().to_string();
        assert!(e.contains("is a regular file, not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"important");
        std::os::unix::fs::symlink(&file, dir.path().join("link")).unwrap();
        let e = check_socket_path(&dir.path().join("link"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = check_socket_path(&file.join("x")).unwrap_err().to_string();
        assert!(e.contains("Not a directory"), "{e}");
    }

    #[test]
    fn replaces_a_stale_socket_refuses_a_live_one_removes_only_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        drop(UnixListener::bind(&path).unwrap());
        check_socket_path(&path).unwrap();
        let (l, owned) = OwnedSocket::bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let e = OwnedSocket::bind(&path).unwrap_err();
        assert!(matches!(e, OwnershipError::InUse { .. }), "{e}");
        // Replaced underneath: the new file is not removed.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"someone else's").unwrap();
        drop(owned);
        drop(l);
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
        std::fs::remove_file(&path).unwrap();
        let (l, owned) = OwnedSocket::bind(&path).unwrap();
        drop(l);
        drop(owned);
        assert!(!path.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_socket_appears_with_its_group_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.sock");
        let own = std::fs::metadata(dir.path()).unwrap();
        // Root gives another group (nogroup); a user only its own.
        let gid = if own.uid() == 0 { 65534 } else { own.gid() };
        let access = SocketAccess {
            mode: 0o660,
            owner: None,
            group: Some(gid),
        };
        let (l, owned) = OwnedSocket::bind_with(&path, &access).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, gid));
        drop((l, owned));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
