//! A recovery killed in mid-flight: a [`HostIo`] that lets a number of
//! writes, flushes and discards through and then fails every later one,
//! while reads go on. What it let through stays (a kill -9 loses nothing
//! the process wrote), nothing after it lands. A second recovery over the
//! same files must then reach a state the invariants accept, as if the
//! first had never run.
//!
//! For crash sweeps only: it never touches a real disk.

use std::sync::atomic::{AtomicU64, Ordering};
use vdcache_image::DirectIo;
use vdcache_image::hostio::{FlushKind, HostError, HostIo, ImageHandle, IoTag, WriteSegment};
use vdcache_qcow2::HostOffset;

/// Direct I/O that dies after `left` changes.
#[derive(Debug)]
pub struct DiesAfter {
    inner: DirectIo,
    left: AtomicU64,
}

impl DiesAfter {
    pub fn new(changes: u64) -> DiesAfter {
        DiesAfter {
            inner: DirectIo::default(),
            left: AtomicU64::new(changes),
        }
    }

    /// Takes one change from the allowance, or fails once it is spent.
    fn spend(&self) -> Result<(), HostError> {
        self.left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
            .map(|_| ())
            .map_err(|_| {
                HostError::Io(std::io::Error::other(
                    "the recovering process was killed (crash sweep)",
                ))
            })
    }
}

impl HostIo for DiesAfter {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> Result<(), HostError> {
        self.inner.read(image, offset, buf, tag)
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> Result<(), HostError> {
        self.spend()?;
        self.inner.write(image, offset, segments)
    }

    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        tag: IoTag,
    ) -> Result<(), HostError> {
        self.spend()?;
        self.inner.discard(image, offset, len, tag)
    }

    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> Result<(), HostError> {
        self.spend()?;
        self.inner.flush(image, kind)
    }
}
