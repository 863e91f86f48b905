//! A first pass over a trace: how many requests (for progress and ETA),
//! how big each disk must be, and the working set (distinct 4 KiB blocks
//! read or written), which cache sizes are quoted against. Memory is one
//! bit per 4 KiB of the disks' address space, whatever the trace's length.

use std::collections::BTreeMap;
use std::path::Path;
use vdcache_eval::trace::CONTENT_BLOCK;
use vdcache_eval::{Format, Op, TraceError, open_trace};

/// What one disk of the trace touches.
#[derive(Debug, Clone, Default)]
pub struct DiskScan {
    /// End of the furthest request (bytes).
    pub end: u64,
    /// Distinct 4 KiB blocks read or written.
    pub blocks: u64,
    seen: Vec<u64>,
}

impl DiskScan {
    fn mark(&mut self, block: u64) {
        let word = (block / 64) as usize;
        if word >= self.seen.len() {
            self.seen.resize(word + 1, 0);
        }
        let bit = 1u64 << (block % 64);
        if self.seen[word] & bit == 0 {
            self.seen[word] |= bit;
            self.blocks += 1;
        }
    }
}

/// The whole trace.
#[derive(Debug, Clone, Default)]
pub struct TraceScan {
    pub records: u64,
    pub disks: BTreeMap<u32, DiskScan>,
}

impl TraceScan {
    /// Working set in bytes over all disks.
    pub fn working_set_bytes(&self) -> u64 {
        self.disks.values().map(|d| d.blocks * CONTENT_BLOCK).sum()
    }
}

/// Reads the whole trace once.
pub fn scan_trace(path: &Path, format: Option<Format>) -> Result<TraceScan, TraceError> {
    let mut scan = TraceScan::default();
    for rec in open_trace(path, format)? {
        let rec = rec?;
        scan.records += 1;
        let disk = scan.disks.entry(rec.disk).or_default();
        disk.end = disk.end.max(rec.end());
        if matches!(rec.op, Op::Read | Op::Write) {
            for b in rec.blocks(CONTENT_BLOCK) {
                disk.mark(b);
            }
        }
    }
    for d in scan.disks.values_mut() {
        d.seen = Vec::new();
    }
    Ok(scan)
}
