//! Real ext4 file systems on loop devices, for the tests that need the
//! kernel's own file system and journal: whether they can run here, loop
//! devices and mounts released by guards (also when a test fails),
//! `mkfs.ext4` and a clean `e2fsck`.
// Each test file uses its own subset.
#![allow(dead_code)]
#![allow(clippy::unwrap_used)]

use crate::common::{exec, ok};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why these tests cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    if rustix_euid() != 0 {
        return Some("not root (FUSE mounts and loop devices need root)".into());
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Some(format!("/dev/fuse cannot be opened: {e}"));
    }
    match Command::new("losetup").arg("-f").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "no free loop device: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run losetup: {e}")),
    }
}

fn rustix_euid() -> u32 {
    let out = Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

macro_rules! require_fuse_and_loop {
    () => {
        if let Some(why) = $crate::ext4::unavailable() {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
}

/// A loop device over a file, detached when dropped.
pub struct Loop(pub String);

impl Loop {
    pub fn attach(file: &Path) -> Loop {
        let out = ok(Command::new("losetup").args(["-f", "--show"]).arg(file));
        Loop(out.stdout.trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// A mounted file system, unmounted (lazily if it must) when dropped.
pub struct Mounted(pub PathBuf);

impl Mounted {
    pub fn mount(dev: &str, dir: &Path, opts: &str) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        ok(Command::new("mount")
            .args(["-t", "ext4", "-o", opts, dev])
            .arg(dir));
        Mounted(dir.to_path_buf())
    }

    pub fn unmount(self) {
        ok(Command::new("umount").arg(&self.0));
        std::mem::forget(self);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let clean = Command::new("umount").arg(&self.0).status();
        if !clean.is_ok_and(|s| s.success()) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

pub fn mkfs(args: &[&str], dev: &str) {
    ok(Command::new("mkfs.ext4").arg("-q").args(args).arg(dev));
}

/// `e2fsck -fn` must find nothing to fix (exit 0).
pub fn fsck_clean(dev: &str, journal: Option<&str>) {
    let mut cmd = Command::new("e2fsck");
    cmd.arg("-fn");
    if let Some(j) = journal {
        cmd.args(["-j", j]);
    }
    let out = exec(cmd.arg(dev));
    assert_eq!(
        out.code(),
        Some(0),
        "e2fsck -fn is not clean\n{}",
        out.report()
    );
}

/// The physical blocks of a file, from `filefrag -v` (in fs blocks).
pub fn file_blocks(path: &Path) -> Vec<u64> {
    let out = ok(Command::new("filefrag").args(["-v", "-b4096"]).arg(path));
    let mut blocks = Vec::new();
    for line in out.stdout.lines() {
        let cols: Vec<&str> = line.split(':').map(str::trim).collect();
        if cols.len() < 4 || cols[0].parse::<u32>().is_err() {
            continue;
        }
        let range = |c: &str| -> (u64, u64) {
            let (a, b) = c.split_once("..").unwrap();
            (a.trim().parse().unwrap(), b.trim().parse().unwrap())
        };
        let (p0, p1) = range(cols[2]);
        blocks.extend(p0..=p1);
    }
    blocks
}
