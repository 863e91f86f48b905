//! Recent writes: a numbered record of the last writes to each image, so
//! that a read miss does not admit data a write overtook while the read
//! ran. Write numbers also mark write-through data in the durability
//! ledger (numbered across images and never reused).
//!
//! It owns the numbering and the bounded record only; it never decides
//! what to admit or sync.

use std::collections::VecDeque;

/// Writes remembered; older history is assumed to overlap everything.
const RECENT_WRITES: usize = 4096;

/// A recent write of `[start, end)` of an image.
#[derive(Debug, Clone, Copy)]
struct RecentWrite {
    seq: u64,
    image: u16,
    start: u64,
    end: u64,
}

#[derive(Debug, Default)]
pub(crate) struct WriteHistory {
    recent: VecDeque<RecentWrite>,
    seq: u64,
}

impl WriteHistory {
    /// The number of the last write (0: none yet).
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Records a write of `[start, end)` of an image; returns its number.
    pub(crate) fn note(&mut self, image: u16, start: u64, end: u64) -> u64 {
        self.seq += 1;
        self.recent.push_back(RecentWrite {
            seq: self.seq,
            image,
            start,
            end,
        });
        if self.recent.len() > RECENT_WRITES {
            self.recent.pop_front();
        }
        self.seq
    }

    /// Whether a write overlapping the range happened after write `since`.
    pub(crate) fn written_since(&self, since: u64, image: u16, start: u64, end: u64) -> bool {
        if self.recent.front().is_some_and(|w| w.seq > since + 1) && self.seq > since {
            // History was trimmed past the read: assume the worst.
            return true;
        }
        self.recent
            .iter()
            .rev()
            .take_while(|w| w.seq > since)
            .any(|w| w.image == image && w.start < end && start < w.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_overlapping_later_writes_of_the_image_count() {
        let mut h = WriteHistory::default();
        assert_eq!(h.note(1, 0, 4096), 1);
        let since = h.seq();
        assert_eq!(h.note(1, 8192, 12288), 2);
        assert_eq!(h.note(2, 0, 4096), 3);
        assert!(!h.written_since(since, 1, 0, 4096), "before, or elsewhere");
        assert!(h.written_since(since, 1, 4096, 8193));
        assert!(!h.written_since(since, 1, 4096, 8192), "end is exclusive");
        assert!(h.written_since(since, 2, 4095, 4096));
        assert!(!h.written_since(h.seq(), 2, 0, 4096));
    }

    #[test]
    fn trimmed_history_assumes_the_worst() {
        let mut h = WriteHistory::default();
        h.note(1, 0, 1);
        for _ in 0..RECENT_WRITES + 1 {
            h.note(9, 1 << 40, (1 << 40) + 1);
        }
        assert!(h.written_since(1, 1, 0, 1));
        // Nothing written since the last write: nothing overtook it.
        assert!(!h.written_since(h.seq(), 1, 0, 1));
    }
}
