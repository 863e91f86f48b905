//! Admission filters: lazy promotion of reads (a block enters the cache on
//! its second miss within a window, like SVD's CLOCK-based promotion) and
//! detection of sequential runs to bypass. Each admission policy sits
//! behind [`AdmissionPolicy`]; [`Admissions`] holds one of each (their
//! state is shared by the disks that choose them) and hands out the one a
//! disk's policy names.
//!
//! It owns the filters' memory only: it never reads the index or decides
//! where a write goes (see `routing`).

use crate::config::Admission;
use std::collections::HashMap;

/// Remembers recently missed blocks in a fixed direct-mapped table; a
/// block found there on its next miss is hot.
#[derive(Debug)]
pub struct HotFilter {
    slots: Vec<u64>,
}

impl HotFilter {
    pub fn new(entries: usize) -> HotFilter {
        HotFilter {
            slots: vec![u64::MAX; entries.max(1)],
        }
    }

    fn slot(&self, block: u64) -> usize {
        // A multiplicative hash spreads neighbouring blocks over the table.
        (block.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) as usize % self.slots.len()
    }

    /// Records a miss; true when the block missed recently before.
    pub fn missed(&mut self, block: u64) -> bool {
        let i = self.slot(block);
        if self.slots[i] == block {
            self.slots[i] = u64::MAX;
            true
        } else {
            self.slots[i] = block;
            false
        }
    }
}

/// Streams one disk's detector follows at a time.
const STREAMS: usize = 4;
/// A request continues a stream when it starts within this many of its
/// own lengths of the stream's end: with several requests in flight they
/// reach the cache a little out of order.
const REORDER: u64 = 8;

/// One stream: where it ends and how long it has run.
#[derive(Debug, Default, Clone, Copy)]
struct Stream {
    end: u64,
    run: Run,
    used: u64,
}

/// How long a stream has run, in bytes and requests, and how large its
/// recent requests were.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub bytes: u64,
    pub requests: u64,
    /// Request size, averaged with weight 1/4 on the newest: the run's
    /// present, not its start.
    pub recent_request: u64,
}

impl Run {
    fn add(&mut self, len: u64) {
        self.bytes = self.bytes.saturating_add(len);
        self.recent_request = if self.requests == 0 {
            len
        } else {
            (self.recent_request * 3 / 4).saturating_add(len / 4)
        };
        self.requests += 1;
    }
}

/// Detects sequential streams of one disk (a few at once, as from several
/// guest threads), tolerating requests that overtake each other.
#[derive(Debug, Default, Clone)]
pub struct SequentialRuns {
    streams: [Stream; STREAMS],
    clock: u64,
}

impl SequentialRuns {
    /// Feeds a request of `len` bytes; returns the length of the run it
    /// continues (its own length when it starts a new one).
    pub fn observe(&mut self, offset: u64, len: u64) -> u64 {
        self.observe_at(offset, len, len).bytes
    }

    /// [`Self::observe`] with the position in other units than bytes (such
    /// as guest clusters): the request spans `[offset, offset + span)`.
    pub fn observe_at(&mut self, offset: u64, span: u64, len: u64) -> Run {
        self.clock += 1;
        let slack = span.saturating_mul(REORDER);
        let near = |s: &Stream| {
            s.run.requests > 0
                && offset.saturating_add(slack) >= s.end
                && offset <= s.end.saturating_add(slack)
        };
        let i = match self.streams.iter().position(near) {
            Some(i) => i,
            None => {
                let lru = (0..STREAMS)
                    .min_by_key(|&i| self.streams[i].used)
                    .unwrap_or(0);
                self.streams[lru] = Stream::default();
                lru
            }
        };
        let s = &mut self.streams[i];
        s.run.add(len);
        s.end = s.end.max(offset.saturating_add(span));
        s.used = self.clock;
        s.run
    }
}

/// A read miss, as an admission policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadMiss {
    pub disk: u32,
    /// First block missed (in cache blocks of the image) and how many.
    pub first_block: u64,
    pub blocks: u64,
    /// Bytes of consecutive misses after which a sequential run is not
    /// admitted (the disk's `sequential_threshold`).
    pub sequential_threshold: u64,
    /// The checksum of the block's bytes, for a miss of one block in a
    /// cache that deduplicates. A policy that remembers misses keys them by
    /// content then: clones reading the same bytes at their own addresses
    /// (or from bases that differ in name only) miss the same block, and
    /// it is hot on its second miss by any of them.
    pub content: Option<u32>,
}

/// Decides whether blocks read from a backend enter the cache.
pub trait AdmissionPolicy: std::fmt::Debug + Send {
    /// Called once per miss, in the order they reach the cache.
    fn admits(&mut self, miss: &ReadMiss) -> bool;
}

/// Admits every miss.
#[derive(Debug, Default)]
pub struct AdmitAll;

impl AdmissionPolicy for AdmitAll {
    fn admits(&mut self, _miss: &ReadMiss) -> bool {
        true
    }
}

/// Marks a hot filter's key as content: addresses have bit 63 clear
/// (a disk number below 128 in the top byte; a larger one only makes a
/// rare false second miss, which admits one block early).
const CONTENT_KEY: u64 = 1 << 63;

impl AdmissionPolicy for HotFilter {
    fn admits(&mut self, miss: &ReadMiss) -> bool {
        self.missed(match miss.content {
            Some(checksum) => CONTENT_KEY | u64::from(checksum),
            None => (u64::from(miss.disk) << 56) ^ miss.first_block,
        })
    }
}

/// Admits misses until they form a long sequential run on their disk.
#[derive(Debug, Default)]
pub struct SequentialBypass {
    runs: HashMap<u32, SequentialRuns>,
}

impl AdmissionPolicy for SequentialBypass {
    fn admits(&mut self, miss: &ReadMiss) -> bool {
        const BLOCK: u64 = crate::layout::BLOCK;
        let run = self
            .runs
            .entry(miss.disk)
            .or_default()
            .observe(miss.first_block * BLOCK, miss.blocks * BLOCK);
        run < miss.sequential_threshold
    }
}

/// One instance of each admission policy, chosen per disk by name.
/// Per disk, the sequential streams of its guest writes (in guest
/// clusters: a qcow2 image allocates host clusters for every writer
/// alike, so a guest's stream is not one on the host), which write routing
/// reads; read misses' streams, in host offsets, are the admission
/// policy's own.
#[derive(Debug, Default)]
pub struct WriteStreams {
    runs: HashMap<u32, SequentialRuns>,
}

impl WriteStreams {
    /// Feeds disk `disk`'s write of `clusters` guest clusters from
    /// `first`, `bytes` long; returns the run it continues.
    pub fn observe(&mut self, disk: u32, first: u64, clusters: u64, bytes: u64) -> Run {
        self.runs
            .entry(disk)
            .or_default()
            .observe_at(first, clusters, bytes)
    }
}

#[derive(Debug)]
pub struct Admissions {
    all: AdmitAll,
    hot: HotFilter,
    sequential: SequentialBypass,
}

impl Admissions {
    /// With a hot filter of `hot_entries` slots.
    pub fn new(hot_entries: usize) -> Admissions {
        Admissions {
            all: AdmitAll,
            hot: HotFilter::new(hot_entries),
            sequential: SequentialBypass::default(),
        }
    }

    /// The policy `which` names.
    pub fn policy(&mut self, which: Admission) -> &mut dyn AdmissionPolicy {
        match which {
            Admission::All => &mut self.all,
            Admission::Hot => &mut self.hot,
            Admission::SequentialBypass => &mut self.sequential,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_streams_are_per_disk() {
        let mut w = WriteStreams::default();
        assert_eq!(w.observe(1, 0, 1, 4096).bytes, 4096);
        assert_eq!(
            w.observe(1, 1, 1, 4096).bytes,
            8192,
            "continues disk 1's run"
        );
        assert_eq!(
            w.observe(2, 2, 1, 4096).bytes,
            4096,
            "disk 2 starts its own run at the same place"
        );
        assert_eq!(w.observe(1, 2, 1, 4096).requests, 3);
    }

    #[test]
    fn second_miss_promotes() {
        let mut h = HotFilter::new(1024);
        assert!(!h.missed(42));
        assert!(h.missed(42));
        assert!(!h.missed(42));
    }

    #[test]
    fn runs_grow_only_when_consecutive() {
        let mut s = SequentialRuns::default();
        assert_eq!(s.observe(0, 4096), 4096);
        assert_eq!(s.observe(4096, 4096), 8192);
        assert_eq!(s.observe(1 << 30, 4096), 4096);
        assert_eq!(s.observe(8192, 4096), 12288);
    }

    #[test]
    fn requests_that_overtake_each_other_stay_in_their_stream() {
        let mut s = SequentialRuns::default();
        let mb = 1 << 20;
        for (i, at) in [0, 2, 1, 3, 5, 4, 7, 6].into_iter().enumerate() {
            assert_eq!(s.observe(at * mb, mb), (i as u64 + 1) * mb);
        }
    }

    #[test]
    fn streams_interleave_and_the_least_recent_gives_way() {
        let mut s = SequentialRuns::default();
        let gb = 1 << 30;
        for i in 0..4 {
            for stream in 0..STREAMS as u64 {
                assert_eq!(s.observe(stream * gb + i * 4096, 4096), (i + 1) * 4096);
            }
        }
        // A fifth stream replaces the first, which then starts over; the
        // others go on.
        assert_eq!(s.observe(9 * gb, 4096), 4096);
        assert_eq!(s.observe(2 * gb + 4 * 4096, 4096), 5 * 4096);
        assert_eq!(s.observe(4 * 4096, 4096), 4096);
    }

    #[test]
    fn runs_in_clusters_count_bytes() {
        let mut s = SequentialRuns::default();
        // Four 16 KiB writes in cluster 7, then two clusters from 8.
        for i in 1..=4 {
            assert_eq!(s.observe_at(7, 1, 16 << 10).bytes, i * (16 << 10));
        }
        let run = s.observe_at(8, 2, 128 << 10);
        assert_eq!((run.bytes, run.requests), (192 << 10, 5));
        // 16 KiB requests, then one of 128 KiB: a quarter of the way there.
        assert_eq!(run.recent_request, (12 << 10) + (32 << 10));
        assert_eq!(s.observe_at(1000, 1, 4096).requests, 1);
    }

    #[test]
    fn scattered_small_requests_do_not_make_a_run() {
        let mut s = SequentialRuns::default();
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0x2545_f491);
        let mut longest = 0;
        for _ in 0..10_000 {
            let block = rng.random_range(0..64u64 << 8); // a 64 MiB working set of 4 KiB blocks
            longest = longest.max(s.observe(block * 4096, 4096));
        }
        assert!(longest < 64 << 10, "random writes ran to {longest} bytes");
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;

    fn miss(disk: u32, first_block: u64) -> ReadMiss {
        ReadMiss {
            disk,
            first_block,
            blocks: 1,
            sequential_threshold: 3 * crate::layout::BLOCK,
            content: None,
        }
    }

    #[test]
    fn each_name_selects_its_policy() {
        let mut a = Admissions::new(1024);
        assert!(a.policy(Admission::All).admits(&miss(0, 5)));
        assert!(a.policy(Admission::All).admits(&miss(0, 5)));
        // Hot: the second miss of a block within the window.
        assert!(!a.policy(Admission::Hot).admits(&miss(0, 5)));
        assert!(a.policy(Admission::Hot).admits(&miss(0, 5)));
        assert!(!a.policy(Admission::Hot).admits(&miss(1, 5)), "per disk");
        // Sequential bypass: a run stops being admitted at the threshold.
        let seq: Vec<bool> = (0..4)
            .map(|b| a.policy(Admission::SequentialBypass).admits(&miss(0, b)))
            .collect();
        assert_eq!(seq, vec![true, true, false, false]);
        assert!(a.policy(Admission::SequentialBypass).admits(&miss(1, 2)));
    }

    #[test]
    fn hot_content_is_hot_on_its_second_miss_by_any_disk_at_any_address() {
        let mut a = Admissions::new(1024);
        let hot = a.policy(Admission::Hot);
        let with = |disk, block, crc| ReadMiss {
            content: Some(crc),
            ..miss(disk, block)
        };
        assert!(!hot.admits(&with(0, 5, 0xabcd)));
        assert!(hot.admits(&with(3, 900, 0xabcd)), "same bytes elsewhere");
        assert!(
            !hot.admits(&with(0, 5, 0x1234)),
            "other bytes, same address"
        );
        assert!(!hot.admits(&miss(0, 7)), "addresses and contents apart");
        assert!(!hot.admits(&with(1, 7, 7)));
    }
}
