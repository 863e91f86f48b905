//! Files a command writes its results to (a trace, a report, a chart, a
//! man page). A new file is written under a temporary name and appears
//! whole or not at all; an existing one is replaced only when it is empty
//! or the user said so, and then through any symbolic link (the link
//! stays, its target gets the new content); a pipe, a terminal or another
//! device (`/dev/stdout`) is written in place, never replaced by a file.

use crate::{OwnershipError, Result, describe, parent_of, publish_new_file, sync_dir};
use std::fs::File;
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};

/// Where the bytes go until [`Output::commit`].
#[derive(Debug)]
enum Target {
    /// A device or pipe, written in place.
    Stream,
    /// A temporary file renamed to `dest` at commit; `replace` when a file
    /// is already there (the user's choice, or an empty file).
    Staged {
        tmp: PathBuf,
        dest: PathBuf,
        replace: bool,
    },
}

/// An output file being written.
#[derive(Debug)]
pub struct Output {
    file: Option<BufWriter<File>>,
    target: Target,
    name: PathBuf,
}

impl Output {
    /// Opens `path` for a command's result. An existing regular file with
    /// content is refused unless `replace` (the command's `--force`).
    pub fn create(path: &Path, replace: bool) -> Result<Output> {
        let (file, target) = match std::fs::metadata(path) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if std::fs::symlink_metadata(path).is_ok() {
                    return Err(OwnershipError::NotAFile {
                        path: path.to_path_buf(),
                        what: "a symbolic link to nothing",
                    });
                }
                staged(path, path.to_path_buf(), false)?
            }
            Err(e) => return Err(OwnershipError::io("look at", path)(e)),
            Ok(m) if m.is_dir() => {
                return Err(OwnershipError::NotAFile {
                    path: path.to_path_buf(),
                    what: describe(m.file_type()),
                });
            }
            Ok(m) if m.is_file() => {
                if m.len() > 0 && !replace {
                    return Err(OwnershipError::Exists {
                        path: path.to_path_buf(),
                        bytes: m.len(),
                        hint: " (give --force to replace it)",
                    });
                }
                let dest =
                    std::fs::canonicalize(path).map_err(OwnershipError::io("resolve", path))?;
                staged(path, dest, true)?
            }
            Ok(_) => {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(OwnershipError::io("open", path))?;
                (f, Target::Stream)
            }
        };
        Ok(Output {
            file: Some(BufWriter::new(file)),
            target,
            name: path.to_path_buf(),
        })
    }

    /// The path the user named.
    pub fn name(&self) -> &Path {
        &self.name
    }

    /// Whether the output is a pipe or device written as it goes.
    pub fn is_stream(&self) -> bool {
        matches!(self.target, Target::Stream)
    }

    /// Finishes the file: flushed, synced and put in place.
    pub fn commit(mut self) -> Result<()> {
        let Some(w) = self.file.take() else {
            return Ok(());
        };
        let f = w
            .into_inner()
            .map_err(|e| OwnershipError::io("write", &self.name)(e.into_error()))?;
        let Target::Staged { tmp, dest, replace } = &self.target else {
            return Ok(());
        };
        f.sync_all()
            .map_err(OwnershipError::io("write", &self.name))?;
        drop(f);
        let placed = if *replace {
            std::fs::rename(tmp, dest).and_then(|()| sync_dir(parent_of(dest)))
        } else {
            publish_new_file(tmp, dest)
        };
        placed.map_err(OwnershipError::io("put in place", &self.name))
    }
}

impl Write for Output {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.file {
            Some(f) => f.write(buf),
            None => Err(ErrorKind::BrokenPipe.into()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.file {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        // Not committed: the temporary file goes, the destination stays
        // as it was.
        if let (Some(_), Target::Staged { tmp, .. }) = (self.file.take(), &self.target) {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// A temporary file next to `dest` for `path`'s new content.
fn staged(path: &Path, dest: PathBuf, replace: bool) -> Result<(File, Target)> {
    let name = dest.file_name().ok_or_else(|| OwnershipError::NotAFile {
        path: path.to_path_buf(),
        what: "a directory name",
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".partial.{}", std::process::id()));
    let tmp = dest.with_file_name(tmp_name);
    let f = File::create_new(&tmp).map_err(OwnershipError::io("create", &tmp))?;
    Ok((f, Target::Staged { tmp, dest, replace }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, replace: bool, text: &str) -> Result<()> {
        let mut o = Output::create(path, replace)?;
        o.write_all(text.as_bytes()).unwrap();
        o.commit()
    }

    #[test]
    fn new_files_appear_whole_existing_ones_need_force() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        let mut o = Output::create(&p, false).unwrap();
        o.write_all(b"half").unwrap();
        drop(o);
        assert!(!p.exists(), "an unfinished output appears");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        write(&p, false, "one").unwrap();
        let e = write(&p, false, "two").unwrap_err().to_string();
        assert!(e.contains("--force"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "one");
        write(&p, true, "two").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "two");
    }

    #[test]
    fn links_stay_links_and_devices_are_written_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("real.csv");
        std::fs::write(&target, b"").unwrap();
        let link = dir.path().join("link.csv");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        write(&link, false, "via link").unwrap();
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "via link");
        let o = Output::create(Path::new("/dev/null"), false).unwrap();
        assert!(o.is_stream());
        o.commit().unwrap();
        assert!(
            !std::fs::metadata("/dev/null")
                .unwrap()
                .file_type()
                .is_file()
        );
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
        assert!(Output::create(&dangling, true).is_err());
        assert!(Output::create(dir.path(), true).is_err());
    }
}
