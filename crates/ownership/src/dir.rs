//! Directories a command fills with files of its own (`vdcache demo
//! --dir DIR`). Such a directory carries a marker file; vdcache writes
//! into a directory that is new, empty, or carries its marker and holds
//! nothing but the command's own files, never into one holding a file of
//! someone else's.

use crate::{OwnershipError, Result, describe};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// A directory vdcache may fill.
#[derive(Debug)]
pub struct OwnedDir {
    path: PathBuf,
    /// Made by this run (so removing all of it is removing only ours).
    created: bool,
}

impl OwnedDir {
    /// Claims `path`: created (with its parents) if missing; an existing
    /// directory only if it is empty, or marked with `marker` and holding
    /// only files named in `own`. The marker file (holding `note`, for
    /// whoever finds it) is written either way.
    pub fn claim(path: &Path, marker: &str, note: &str, own: &[&str]) -> Result<OwnedDir> {
        let created = match std::fs::metadata(path) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                std::fs::create_dir_all(path).map_err(OwnershipError::io("create", path))?;
                true
            }
            Err(e) => return Err(OwnershipError::io("look at", path)(e)),
            Ok(m) if !m.is_dir() => {
                return Err(OwnershipError::NotAFile {
                    path: path.to_path_buf(),
                    what: describe(m.file_type()),
                });
            }
            Ok(_) => {
                check_ours(path, marker, own)?;
                false
            }
        };
        std::fs::write(path.join(marker), note)
            .map_err(OwnershipError::io("write", &path.join(marker)))?;
        Ok(OwnedDir {
            path: path.to_path_buf(),
            created,
        })
    }

    /// A fresh directory under the system's temporary directory, named
    /// `prefix` and a number; never one that existed before.
    pub fn fresh_temp(prefix: &str) -> Result<OwnedDir> {
        let base = std::env::temp_dir();
        let pid = std::process::id();
        for n in 0..1000u32 {
            let path = base.join(format!("{prefix}-{pid}-{n}"));
            match std::fs::create_dir(&path) {
                Ok(()) => {
                    return Ok(OwnedDir {
                        path,
                        created: true,
                    });
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(OwnershipError::io("create", &path)(e)),
            }
        }
        Err(OwnershipError::io("create a directory in", &base)(
            ErrorKind::AlreadyExists.into(),
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this run made the directory.
    pub fn created(&self) -> bool {
        self.created
    }

    /// Removes the directory and everything in it, only if this run made
    /// it; a directory that was there before is left.
    pub fn remove_if_created(self) -> std::io::Result<bool> {
        if !self.created {
            return Ok(false);
        }
        std::fs::remove_dir_all(&self.path).map(|()| true)
    }
}

/// An existing directory is ours when it is empty, or marked and holding
/// only the files named in `own`.
fn check_ours(path: &Path, marker: &str, own: &[&str]) -> Result<()> {
    let marked = path.join(marker).is_file();
    let entries = std::fs::read_dir(path).map_err(OwnershipError::io("read", path))?;
    for e in entries {
        let name = e
            .map_err(OwnershipError::io("read", path))?
            .file_name()
            .to_string_lossy()
            .into_owned();
        if !(marked && (name == marker || own.contains(&name.as_str()))) {
            return Err(OwnershipError::ForeignDir {
                path: path.to_path_buf(),
                first: name,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_new_empty_and_marked_directories_only() {
        let top = tempfile::tempdir().unwrap();
        let new = top.path().join("a/b");
        let own = ["base.qcow2"];
        let d = OwnedDir::claim(&new, ".mine", "x", &own).unwrap();
        assert!(d.created());
        std::fs::write(new.join("base.qcow2"), b"demo").unwrap();
        // Marked: claimed again, not created by this run, not removed.
        let again = OwnedDir::claim(&new, ".mine", "x", &own).unwrap();
        assert!(!again.created());
        assert!(!again.remove_if_created().unwrap());
        assert!(new.join("base.qcow2").exists());
        // A file of someone else's in a marked directory: refused.
        std::fs::write(new.join("vm1.qcow2"), b"over base").unwrap();
        let e = OwnedDir::claim(&new, ".mine", "x", &own)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vm1.qcow2"), "{e}");
        let theirs = top.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::write(theirs.join("base.qcow2"), b"data").unwrap();
        let e = OwnedDir::claim(&theirs, ".mine", "x", &own)
            .unwrap_err()
            .to_string();
        assert!(e.contains("base.qcow2"), "{e}");
        assert!(!theirs.join(".mine").exists());
        let t = OwnedDir::fresh_temp("ownership-test").unwrap();
        let p = t.path().to_path_buf();
        assert!(t.remove_if_created().unwrap());
        assert!(!p.exists());
    }
}
