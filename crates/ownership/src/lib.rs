//! Invariant 11 in one place: vdcache creates, replaces or deletes only
//! files it can recognise as its own, and checks before it writes.
//!
//! Owns the rules for every path a user names that vdcache writes or
//! removes: sockets it binds (removed only while still the socket it bound;
//! a stale socket nobody listens on may be replaced, nothing else), files a
//! command writes its results to (never renamed over a symbolic link or a
//! device, never replacing a file with content unless told to), files
//! created whole or not at all, and directories it made (marked, so a
//! later run knows them).
//!
//! Must not: know what a cache, an image or a trace looks like inside
//! (callers that recognise their own formats pass that knowledge in).

mod dir;
mod output;
mod socket;

pub use dir::OwnedDir;
pub use output::Output;
pub use socket::{OwnedSocket, SocketAccess, check_socket_path};

use std::fs::FileType;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// Why vdcache refuses to touch a path, or could not.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error("{path} is {what}, not a socket: vdcache replaces only a socket nobody listens on")]
    NotASocket { path: PathBuf, what: &'static str },
    #[error("{path} is in use by a running server (something listens on this socket)")]
    InUse { path: PathBuf },
    #[error(
        "{path} exists and holds {bytes} bytes; vdcache does not replace a file it cannot recognise as its own{hint}"
    )]
    Exists {
        path: PathBuf,
        bytes: u64,
        hint: &'static str,
    },
    #[error("{path} is {what}; give a file name")]
    NotAFile { path: PathBuf, what: &'static str },
    #[error(
        "{path} holds files that are not vdcache's ({first} among them); give a new or empty directory"
    )]
    ForeignDir { path: PathBuf, first: String },
    #[error("{what} {} and {other_what} {} are the same file: give each its own", path.display(), other.display())]
    Same {
        what: String,
        path: PathBuf,
        other_what: String,
        other: PathBuf,
    },
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl OwnershipError {
    pub(crate) fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| OwnershipError::Io { op, path, source }
    }
}

pub type Result<T> = std::result::Result<T, OwnershipError>;

/// A file type in words, for messages.
pub fn describe(t: FileType) -> &'static str {
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "a special file"
    }
}

/// The directory `path` lives in (`.` for a bare name).
pub(crate) fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Device and inode of the file at `path` (links followed), if any.
pub fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Refuses two paths of `paths` (each with what it is for) that name one
/// file, or one socket path twice: a control socket given the image's
/// name, a cache that is also an image. Paths that do not exist yet are
/// compared by name.
pub fn check_distinct(paths: &[(String, &Path)]) -> Result<()> {
    for (i, (what, a)) in paths.iter().enumerate() {
        for (other_what, b) in &paths[..i] {
            let same = match (identity(a), identity(b)) {
                (Some(x), Some(y)) => x == y,
                _ => normalise(a) == normalise(b),
            };
            if same {
                return Err(OwnershipError::Same {
                    what: other_what.clone(),
                    path: b.to_path_buf(),
                    other_what: what.clone(),
                    other: a.to_path_buf(),
                });
            }
        }
    }
    Ok(())
}

/// `path` made absolute against the working directory, `.` parts dropped.
fn normalise(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    };
    abs.components()
        .filter(|c| !matches!(c, std::path::Component::CurDir))
        .collect()
}

/// Moves a fully written file `tmp` to `dest`, failing if `dest` exists,
/// and makes the rename durable: a file appears under `dest` complete or
/// not at all, and two processes racing to create it cannot replace each
/// other's file.
pub fn publish_new_file(tmp: &Path, dest: &Path) -> std::io::Result<()> {
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        tmp,
        rustix::fs::CWD,
        dest,
        rustix::fs::RenameFlags::NOREPLACE,
    )
    .map_err(std::io::Error::from)?;
    sync_dir(parent_of(dest))
}

/// Makes a directory's entries durable (a rename or a new name in it).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// A file this run created at a path that was free: removed again when
/// dropped, unless kept. What a start that fails half way leaves behind:
/// nothing it made.
#[derive(Debug)]
pub struct CreatedFile {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl CreatedFile {
    /// Creates an empty file at `path`; an existing file is an error.
    pub fn create_new(path: &Path) -> Result<(std::fs::File, CreatedFile)> {
        let f = std::fs::File::create_new(path).map_err(OwnershipError::io("create", path))?;
        let id = identity(path);
        Ok((
            f,
            CreatedFile {
                path: path.to_path_buf(),
                id,
            },
        ))
    }

    /// Keeps the file: it is wanted now.
    pub fn keep(mut self) {
        self.id = None;
    }
}

impl Drop for CreatedFile {
    fn drop(&mut self) {
        if self.id.is_some() && identity(&self.path) == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
