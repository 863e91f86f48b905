//! Write routing: where a write goes (into flash dirty, through to the
//! backend keeping a clean copy, around the cache, or past it), as a pure
//! function of the disk's policy, what the write is made of, and the
//! sequential run it continues.
//!
//! It owns the decision only: it holds no state, observes no run (the
//! caller's run detector does), and performs no I/O. Every place that
//! decides a write's mode asks here, so the table below is the one
//! statement of the write policy.

use crate::admission::Run;
use crate::config::{CowMode, DiskPolicy, WriteMode};

/// A sequential run of smaller writes than this (lately, on average) stays in
/// flash: such writes are bound by latency (a log appended by small
/// synchronous writes), which flash answers far sooner than the backend.
/// Measured in host writes, which the COW layer cuts where clusters are
/// not contiguous in the image (at 64 KiB by default), and an unaligned
/// write at its first and last cluster.
pub(crate) const BYPASS_MEAN_REQUEST: u64 = 32 << 10;

/// Which blocks of a write to the backend a cache keeps a clean copy of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    Nothing,
    Everything,
    /// Everything but copy-on-write filler, metadata written as zeros (a
    /// table just created: the COW layer knows it is empty without reading
    /// it, so a flash copy would only cost flash writes), and metadata
    /// journal records (read only to recover from a crash; a copy would
    /// cost flash writes, and dropping it durably a cache device sync,
    /// when the next record takes its place).
    NotFiller,
}

/// What a write is made of, as far as routing cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct WriteClass {
    /// Only copy-on-write filler (no guest data, no metadata).
    pub filler_only: bool,
    /// Whole 512-byte sectors of L2 tables or refcount blocks only.
    pub table_sectors: bool,
    /// At least half its blocks are cached: bypassing would cost more than
    /// it saves (each dirty run written in flash anyway, as their only
    /// current copies, and each clean copy forgotten durably, a device
    /// sync, before the backend write), and the write adds little to what
    /// flash holds, so the whole write goes to flash instead.
    pub mostly_cached: bool,
}

/// Where a write goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Into flash, dirty, written back later; by the sector when
    /// `sectors` (cow-aware metadata). Falls back to the backend, keeping
    /// nothing, when flash has no room.
    WriteBack { sectors: bool },
    /// To the backend, keeping clean copies of what `Keep` says.
    WriteThrough(Keep),
    /// To the backend, dropping cached copies (the disk's mode).
    WriteAround,
    /// To the backend, dropping cached copies, though the disk is in
    /// write-back mode: filler never enters a cow-aware cache, and a long
    /// sequential run would only pass through flash at twice the traffic.
    Bypass,
}

/// Whether the disk's blocks may be left partially valid (decoupled
/// copy-on-write): cow-aware write-back only.
pub(crate) fn decouples(policy: DiskPolicy) -> bool {
    policy.cow == CowMode::CowAware && policy.mode == WriteMode::WriteBack
}

/// Whether a write that continues sequential run `run` (none: not
/// observed, e.g. no guest data) is a long run to bypass flash with.
/// Metadata stays in flash however it is written.
pub(crate) fn long_run(policy: DiskPolicy, run: Option<Run>) -> bool {
    let cutoff = policy.sequential_write_cutoff;
    cutoff > 0 && run.is_some_and(|r| r.bytes >= cutoff && r.recent_request >= BYPASS_MEAN_REQUEST)
}

/// Where a write of class `class` continuing run `run` goes on a disk
/// with `policy`.
pub(crate) fn route(policy: DiskPolicy, class: WriteClass, run: Option<Run>) -> Route {
    if policy.cache_only {
        return Route::WriteBack { sectors: false };
    }
    let bypass = (policy.cow == CowMode::CowAware && class.filler_only)
        || (long_run(policy, run) && !class.mostly_cached);
    match policy.mode {
        WriteMode::WriteBack if !bypass => Route::WriteBack {
            sectors: decouples(policy) && class.table_sectors,
        },
        WriteMode::WriteBack => Route::Bypass,
        WriteMode::WriteAround => Route::WriteAround,
        // Copy-on-write filler is never admitted in cow-aware mode.
        WriteMode::WriteThrough => Route::WriteThrough(match policy.cow {
            CowMode::Stacked => Keep::Everything,
            CowMode::CowAware => Keep::NotFiller,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUTOFF: u64 = 1 << 20;

    fn policy(mode: WriteMode, cow: CowMode) -> DiskPolicy {
        DiskPolicy {
            mode,
            cow,
            sequential_write_cutoff: CUTOFF,
            ..DiskPolicy::default()
        }
    }

    fn run(bytes: u64, recent_request: u64) -> Option<Run> {
        Some(Run {
            bytes,
            requests: 1,
            recent_request,
        })
    }

    const DATA: WriteClass = WriteClass {
        filler_only: false,
        table_sectors: false,
        mostly_cached: false,
    };
    const CACHED_DATA: WriteClass = WriteClass {
        mostly_cached: true,
        ..DATA
    };
    const FILLER: WriteClass = WriteClass {
        filler_only: true,
        table_sectors: false,
        mostly_cached: false,
    };
    const TABLES: WriteClass = WriteClass {
        filler_only: false,
        table_sectors: true,
        mostly_cached: false,
    };
    const LONG: u64 = CUTOFF;
    const BIG: u64 = BYPASS_MEAN_REQUEST;

    #[test]
    fn the_table() {
        use CowMode::{CowAware, Stacked};
        use WriteMode::{WriteAround, WriteBack, WriteThrough};
        let wb = |sectors| Route::WriteBack { sectors };
        let cases = [
            // (mode, cow, class, run, route)
            (WriteBack, Stacked, DATA, None, wb(false)),
            (WriteBack, Stacked, FILLER, None, wb(false)),
            (WriteBack, Stacked, TABLES, None, wb(false)),
            (WriteBack, CowAware, DATA, None, wb(false)),
            (WriteBack, CowAware, TABLES, None, wb(true)),
            (WriteBack, CowAware, FILLER, None, Route::Bypass),
            (WriteBack, Stacked, DATA, run(LONG, BIG), Route::Bypass),
            (WriteBack, CowAware, DATA, run(LONG, BIG), Route::Bypass),
            // A long run over blocks mostly cached stays in flash.
            (WriteBack, CowAware, CACHED_DATA, run(LONG, BIG), wb(false)),
            // Short run, or a long one of small requests: stays in flash.
            (WriteBack, Stacked, DATA, run(LONG - 1, BIG), wb(false)),
            (WriteBack, Stacked, DATA, run(LONG, BIG - 1), wb(false)),
            (
                WriteThrough,
                Stacked,
                DATA,
                None,
                Route::WriteThrough(Keep::Everything),
            ),
            (
                WriteThrough,
                Stacked,
                FILLER,
                None,
                Route::WriteThrough(Keep::Everything),
            ),
            (
                WriteThrough,
                CowAware,
                DATA,
                None,
                Route::WriteThrough(Keep::NotFiller),
            ),
            (
                WriteThrough,
                CowAware,
                FILLER,
                None,
                Route::WriteThrough(Keep::NotFiller),
            ),
            // A long run does not change write-through's copies.
            (
                WriteThrough,
                Stacked,
                DATA,
                run(LONG, BIG),
                Route::WriteThrough(Keep::Everything),
            ),
            (WriteAround, Stacked, DATA, None, Route::WriteAround),
            (WriteAround, CowAware, TABLES, None, Route::WriteAround),
            (
                WriteAround,
                CowAware,
                FILLER,
                run(LONG, BIG),
                Route::WriteAround,
            ),
        ];
        for (mode, cow, class, r, want) in cases {
            assert_eq!(
                route(policy(mode, cow), class, r),
                want,
                "{mode:?} {cow:?} {class:?} {r:?}"
            );
        }
    }

    #[test]
    fn a_cache_only_disk_always_stays_in_flash() {
        for mode in [
            WriteMode::WriteBack,
            WriteMode::WriteThrough,
            WriteMode::WriteAround,
        ] {
            for class in [DATA, FILLER, TABLES] {
                for r in [None, run(LONG, BIG)] {
                    let mut p = policy(mode, CowMode::CowAware);
                    p.cache_only = true;
                    assert_eq!(
                        route(p, class, r),
                        Route::WriteBack { sectors: false },
                        "{mode:?} {class:?} {r:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_zero_cutoff_never_bypasses() {
        let mut p = policy(WriteMode::WriteBack, CowMode::Stacked);
        p.sequential_write_cutoff = 0;
        assert!(!long_run(p, run(u64::MAX, u64::MAX)));
        assert_eq!(
            route(p, DATA, run(u64::MAX, u64::MAX)),
            Route::WriteBack { sectors: false }
        );
    }

    #[test]
    fn only_cow_aware_write_back_decouples() {
        assert!(decouples(policy(WriteMode::WriteBack, CowMode::CowAware)));
        assert!(!decouples(policy(WriteMode::WriteBack, CowMode::Stacked)));
        assert!(!decouples(policy(
            WriteMode::WriteThrough,
            CowMode::CowAware
        )));
        assert!(!decouples(policy(
            WriteMode::WriteAround,
            CowMode::CowAware
        )));
    }
}
