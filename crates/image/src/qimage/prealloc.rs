//! Adaptive preallocation (paper 003): when allocation reaches space the
//! image file never held, zeros are written ahead of it, so the allocating
//! writes that follow are plain overwrites for the file system below and
//! a guest flush does not pay for its block allocation. The step grows
//! while the disk grows fast and shrinks when it grows slowly.
//!
//! Preallocated space is free space to qcow2 (no refcount, nothing maps
//! it), so it is never reported as data; a clean close cuts the file back
//! to the last cluster in use when the store can shrink.
//!
//! Must not: allocate clusters or touch refcounts.

use super::Locked;
use crate::error::{ImageError, Result};
use crate::hostio::{IoClass, IoTag, WriteSegment};
use std::time::{Duration, Instant};
use vdcache_qcow2::HostOffset;

const MIN_STEP: u64 = 1 << 20;
const MAX_STEP: u64 = 64 << 20;
/// Steps closer together than this double the next one; farther apart
/// than `SLOW` halve it.
const FAST: Duration = Duration::from_secs(1);
const SLOW: Duration = Duration::from_secs(10);

/// The preallocation state of an open image.
#[derive(Debug)]
pub(crate) struct Prealloc {
    /// Bytes of the file up to here hold written zeros or data.
    end: u64,
    step: u64,
    last: Instant,
    /// End of the last allocation seen.
    used_end: u64,
    /// Bytes written ahead, for statistics and tests.
    pub(crate) written: u64,
}

impl Prealloc {
    pub(crate) fn new() -> Prealloc {
        Prealloc {
            end: 0,
            step: MIN_STEP,
            last: Instant::now(),
            used_end: 0,
            written: 0,
        }
    }

    /// How far ahead of an allocation ending at `needed` to write zeros
    /// (`None`: written space already reaches past it), adapting the step
    /// to how soon this came after the last one.
    fn step_past(&mut self, needed: u64) -> Option<u64> {
        if needed <= self.end {
            return None;
        }
        let since = self.last.elapsed();
        self.step = if since < FAST {
            (self.step * 2).min(MAX_STEP)
        } else if since > SLOW {
            (self.step / 2).max(MIN_STEP)
        } else {
            self.step
        };
        self.last = Instant::now();
        Some(self.step)
    }
}

impl Locked<'_> {
    /// At a clean close: cuts a growable file back to its last cluster in
    /// use, when preallocated zeros lie past it.
    pub(crate) fn trim_preallocation(&mut self) -> Result<()> {
        let Some(p) = self.m.prealloc.take() else {
            return Ok(());
        };
        let backend = &self.img.handle.backend;
        let len = backend
            .len()
            .map_err(|e| ImageError::io(self.name(), "stat", e))?;
        if !backend.can_grow() || p.end < len || p.end <= p.used_end {
            return Ok(());
        }
        let cs = self.img.geometry.cluster_size();
        let mut cut = p.end;
        while cut > p.used_end && self.refcount(cut / cs - 1)? == 0 {
            cut -= cs;
        }
        self.img
            .handle
            .backend
            .set_len(cut)
            .map_err(|e| ImageError::io(self.name(), "trim preallocated space", e))?;
        self.m.file_end = cut;
        Ok(())
    }

    /// After an allocation ending at `needed`: writes zeros over the free
    /// clusters right after it (up to a step), unless an earlier step
    /// already did. Only clusters the refcounts call free are written.
    pub(crate) fn preallocate_past(&mut self, needed: u64) -> Result<()> {
        if self.img.read_only || self.img.external_data {
            return Ok(());
        }
        let limit = if self.img.handle.backend.can_grow() {
            u64::MAX
        } else {
            self.m.file_end
        };
        let Some(step) = self.m.prealloc.as_mut().and_then(|p| p.step_past(needed)) else {
            return Ok(());
        };
        let cs = self.img.geometry.cluster_size();
        let start = needed;
        let mut end = start;
        while end < start.saturating_add(step) && end < limit && self.refcount(end / cs)? == 0 {
            end += cs;
        }
        if let Some(p) = self.m.prealloc.as_mut() {
            p.end = end.max(needed);
            p.used_end = p.used_end.max(needed);
            p.written += end - start;
        }
        let zeros = vec![0u8; MIN_STEP as usize];
        let tag = IoTag {
            class: IoClass::Reclaim,
            disk: self.img.disk,
            guest_cluster: None,
            unit: None,
        };
        let mut at = start;
        while at < end {
            let len = (end - at).min(MIN_STEP) as usize;
            self.img
                .io
                .write(
                    &self.img.handle,
                    HostOffset(at),
                    &[WriteSegment {
                        data: &zeros[..len],
                        tag,
                    }],
                )
                .map_err(|e| ImageError::io(self.name(), "preallocate", e))?;
            at += len as u64;
        }
        self.m.file_end = self.m.file_end.max(end);
        Ok(())
    }
}
