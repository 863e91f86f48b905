//! The FUSE file system itself: a root directory holding one fixed-size
//! regular file per disk, and every file operation mapped onto the disk.
//!
//! Must not: cache or buffer disk data (the kernel's page cache and the
//! flash cache below are the caches), or acknowledge an fsync before the
//! disk's flush has returned.

use crate::{FuseError, FuseExport};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};
use vdcache_image::{HostError, ImageError, VirtualDisk, ZeroFlags};

/// How long the kernel may keep names and attributes: they never change
/// while mounted.
const TTL: Duration = Duration::from_secs(3600);

/// The file name of an export: its name, or `default` for the default
/// export `""` (NBD's nameless export).
pub fn file_name(export: &str) -> String {
    if export.is_empty() {
        "default".to_string()
    } else {
        export.to_string()
    }
}

/// The errno a file operation reports for a disk error.
pub fn to_errno(e: &ImageError) -> Errno {
    match e {
        ImageError::ReadOnly { .. } => Errno::EROFS,
        ImageError::OutOfRange { .. } => Errno::EINVAL,
        ImageError::NoSpace { .. }
        | ImageError::Io {
            cause: HostError::NoSpace(_),
            ..
        } => Errno::ENOSPC,
        _ => Errno::EIO,
    }
}

fn fail(op: &str, name: &str, e: &ImageError) -> Errno {
    let errno = to_errno(e);
    if errno == Errno::EIO {
        tracing::error!("FUSE {op} on '{name}': {e}");
    }
    errno
}

struct DiskFile {
    /// The file's name ([`file_name`] of the export's).
    name: String,
    export: String,
    disk: Arc<VirtualDisk>,
}

pub(crate) struct DiskFs {
    files: Vec<DiskFile>,
    uid: u32,
    gid: u32,
    mounted_at: SystemTime,
    /// Disk requests served (reads, writes, syncs, fallocates), for the
    /// server's idle detection.
    requests: Arc<AtomicU64>,
}

const FIRST_FILE: u64 = 2;

impl DiskFs {
    pub(crate) fn new(exports: Vec<FuseExport>) -> Result<DiskFs, FuseError> {
        let mut files: Vec<DiskFile> = Vec::with_capacity(exports.len());
        for e in exports {
            let name = file_name(&e.name);
            let bad = |reason| FuseError::BadName {
                name: e.name.clone(),
                reason,
            };
            if name == "." || name == ".." {
                return Err(bad("'.' and '..' are taken"));
            }
            if name.contains('/') || name.contains('\0') {
                return Err(bad("it holds '/' or NUL"));
            }
            if name.len() > 255 {
                return Err(bad("longer than 255 bytes"));
            }
            if let Some(f) = files.iter().find(|f| f.name == name) {
                return Err(FuseError::SameFile {
                    first: f.export.clone(),
                    second: e.name,
                    file: name,
                });
            }
            files.push(DiskFile {
                name,
                export: e.name,
                disk: e.disk,
            });
        }
        Ok(DiskFs {
            files,
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
            mounted_at: SystemTime::now(),
            requests: Arc::default(),
        })
    }

    /// The counter of disk requests served.
    pub(crate) fn requests(&self) -> Arc<AtomicU64> {
        self.requests.clone()
    }

    /// The file `ino` for a disk request, counted.
    fn file_io(&self, ino: INodeNo) -> Option<&DiskFile> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.file(ino)
    }

    fn file(&self, ino: INodeNo) -> Option<&DiskFile> {
        let i = ino.0.checked_sub(FIRST_FILE)?;
        self.files.get(usize::try_from(i).ok()?)
    }

    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, size, perm, nlink) = if ino == INodeNo::ROOT {
            (FileType::Directory, 0, 0o755, 2)
        } else {
            let f = self.file(ino)?;
            let perm = if f.disk.read_only() { 0o400 } else { 0o600 };
            (FileType::RegularFile, f.disk.size(), perm, 1)
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: self.mounted_at,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

/// Bit values of fallocate(2)'s mode.
const FALLOC_KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
const FALLOC_PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE;
const FALLOC_ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE;

impl Filesystem for DiskFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = (parent == INodeNo::ROOT)
            .then(|| self.files.iter().position(|f| OsStr::new(&f.name) == name))
            .flatten();
        match found.and_then(|i| self.attr(INodeNo(FIRST_FILE + i as u64))) {
            Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        // A disk keeps its size and owner; times are accepted and ignored
        // (`touch` works), so tools that set them do not fail.
        if size.is_some_and(|s| s != attr.size) {
            return reply.error(Errno::EPERM);
        }
        if mode.is_some_and(|m| m & 0o7777 != u32::from(attr.perm))
            || uid.is_some_and(|u| u != attr.uid)
            || gid.is_some_and(|g| g != attr.gid)
        {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&TTL, &attr)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let Some(f) = self.file(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if f.disk.read_only() && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::empty())
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(f) = self.file_io(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let end = offset.saturating_add(u64::from(size)).min(f.disk.size());
        if offset >= end {
            return reply.data(&[]);
        }
        let mut buf = vec![0u8; (end - offset) as usize];
        match f.disk.read(offset, &mut buf) {
            Ok(()) => reply.data(&buf),
            Err(e) => reply.error(fail("read", &f.name, &e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(f) = self.file_io(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let Ok(len) = u32::try_from(data.len()) else {
            return reply.error(Errno::EINVAL);
        };
        if offset
            .checked_add(u64::from(len))
            .is_none_or(|e| e > f.disk.size())
        {
            // The file cannot grow: writing past the end is a full disk.
            return reply.error(Errno::ENOSPC);
        }
        let fua = flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0;
        match f.disk.write(offset, data, fua) {
            Ok(()) => reply.written(len),
            Err(e) => reply.error(fail("write", &f.name, &e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) promises no durability; fsync does.
        reply.ok()
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some(f) = self.file_io(ino) else {
            return reply.error(Errno::ENOENT);
        };
        match f.disk.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(fail("fsync", &f.name, &e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok()
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
        ]
        .into_iter()
        .chain(self.files.iter().enumerate().map(|(i, f)| {
            (
                INodeNo(FIRST_FILE + i as u64),
                FileType::RegularFile,
                f.name.as_str(),
            )
        }));
        for (i, (ino, kind, name)) in entries.enumerate().skip(offset as usize) {
            if reply.add(ino, i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bytes: u64 = self.files.iter().map(|f| f.disk.size()).sum();
        let files = self.files.len() as u64 + 1;
        reply.statfs(bytes.div_ceil(4096), 0, 0, files, 0, 4096, 255, 4096)
    }

    // No extended attributes: ENOSYS tells the kernel to stop asking.
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::ENOSYS)
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS)
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let Some(f) = self.file_io(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let size = f.disk.size();
        let Some(end) = offset.checked_add(length) else {
            return reply.error(Errno::EFBIG);
        };
        if mode & !(FALLOC_KEEP_SIZE | FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE) != 0
            || mode & FALLOC_PUNCH_HOLE != 0 && mode & FALLOC_ZERO_RANGE != 0
        {
            return reply.error(Errno::EOPNOTSUPP);
        }
        if end > size && mode & FALLOC_KEEP_SIZE == 0 {
            // It would grow the file.
            return reply.error(Errno::ENOSPC);
        }
        let end = end.min(size);
        if mode & (FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE) == 0 || offset >= end {
            // Plain preallocation: every byte of a disk file exists already.
            return reply.ok();
        }
        // A punched hole must read back as zeros, which a discard does
        // not promise on a partial cluster: it is a zero write that may
        // unmap (what a discard becomes where it can).
        let flags = ZeroFlags {
            may_unmap: mode & FALLOC_PUNCH_HOLE != 0,
            fua: false,
        };
        match f.disk.write_zeroes(offset, end - offset, flags) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(fail("fallocate", &f.name, &e)),
        }
    }
}
