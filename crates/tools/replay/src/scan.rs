//! A first pass over a trace: how many requests (for progress and ETA),
//! how big each disk must be, and the working set (distinct 4 KiB blocks
//! read or written), which cache sizes are quoted against.
//!
//! It refuses, naming the line, a trace a replay cannot hold: a read or
//! write larger than [`MAX_REQUEST_BYTES`], a request ending past
//! [`MAX_DISK_BYTES`], more than [`MAX_DISKS`] disks, or blocks spread so
//! thin that counting them would take more than [`MAX_FOOTPRINT_BYTES`]
//! (one bit per 4 KiB block touched, in pages of 16 MiB of a disk).

use crate::blocks::BlockSet;
use std::collections::BTreeMap;
use std::path::Path;
use vdcache_eval::trace::{CONTENT_BLOCK, LineProblem};
use vdcache_eval::{Format, Op, TraceError, TraceRecord, open_trace};

/// Largest read or write a replay takes (one buffer of its size is
/// allocated); a discard may cover a whole disk.
pub const MAX_REQUEST_BYTES: u64 = 64 << 20;
/// Largest disk a replay models (16 TiB, ext4's largest file): no request
/// may end past it.
pub const MAX_DISK_BYTES: u64 = 16 << 40;
/// Most disks one trace may address (each is an open chain with its own
/// metadata cache).
pub const MAX_DISKS: usize = 1024;
/// Most memory the scan may take to count the blocks a trace touches.
pub const MAX_FOOTPRINT_BYTES: u64 = 1 << 30;

/// What one disk of the trace touches.
#[derive(Debug, Clone, Default)]
pub struct DiskScan {
    /// End of the furthest request (bytes).
    pub end: u64,
    /// Distinct 4 KiB blocks read or written.
    pub blocks: u64,
    seen: BlockSet,
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

/// Why a replay cannot take `rec`, if it cannot: a read or write larger
/// than [`MAX_REQUEST_BYTES`], or a request ending past
/// [`MAX_DISK_BYTES`].
pub fn beyond_bounds(rec: &TraceRecord) -> Option<String> {
    if matches!(rec.op, Op::Read | Op::Write) && rec.len > MAX_REQUEST_BYTES {
        return Some(format!(
            "a {} of {} bytes is larger than a replay takes (at most {MAX_REQUEST_BYTES} bytes, 64 MiB, per read or write)",
            rec.op, rec.len
        ));
    }
    if rec.end() > MAX_DISK_BYTES {
        return Some(format!(
            "the {} at offset {} of {} bytes ends past the largest disk a replay models ({MAX_DISK_BYTES} bytes, 16 TiB)",
            rec.op, rec.offset, rec.len
        ));
    }
    None
}

/// The error for a record of line `line` a replay cannot take.
pub fn refused(line: u64, why: String) -> TraceError {
    TraceError::Line {
        line,
        problem: LineProblem::Other(why),
    }
}

/// Reads the whole trace once.
pub fn scan_trace(path: &Path, format: Option<Format>) -> Result<TraceScan, TraceError> {
    let mut scan = TraceScan::default();
    let mut footprint = 0u64;
    let mut reader = open_trace(path, format)?;
    while let Some(rec) = reader.next() {
        let rec = rec?;
        if let Some(why) = beyond_bounds(&rec) {
            return Err(refused(reader.line(), why));
        }
        if !scan.disks.contains_key(&rec.disk) && scan.disks.len() >= MAX_DISKS {
            return Err(refused(
                reader.line(),
                format!(
                    "disk {} is one more than a replay takes ({MAX_DISKS} disks)",
                    rec.disk
                ),
            ));
        }
        scan.records += 1;
        let disk = scan.disks.entry(rec.disk).or_default();
        disk.end = disk.end.max(rec.end());
        if matches!(rec.op, Op::Read | Op::Write) {
            let before = disk.seen.memory_bytes();
            for b in rec.blocks(CONTENT_BLOCK) {
                disk.seen.insert(b);
            }
            disk.blocks = disk.seen.len();
            footprint += disk.seen.memory_bytes() - before;
            if footprint > MAX_FOOTPRINT_BYTES {
                return Err(refused(
                    reader.line(),
                    format!(
                        "the blocks the trace touches up to here are spread so thin that counting them takes more than {MAX_FOOTPRINT_BYTES} bytes (1 GiB) of memory"
                    ),
                ));
            }
        }
    }
    for d in scan.disks.values_mut() {
        d.seen = BlockSet::default();
    }
    Ok(scan)
}
