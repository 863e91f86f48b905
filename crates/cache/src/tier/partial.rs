//! Partially valid clusters (decoupled copy-on-write): the blocks of a
//! freshly allocated delta cluster that hold no data yet, kept in each
//! line's dcow bitmap and journaled, so the COW layer reads them from the
//! base and a crash never makes them look valid. A whole-block write (or
//! a discard) of such a block makes it valid again.

use super::{FlashCache, State};
use crate::error::Result;
use crate::index::line_key;
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE, LINE_BLOCKS};
use vdcache_image::{ImageHandle, IoTag, PartialRange};

/// Bit mask of the blocks `[first, end)` (line-relative) a range covers.
fn line_masks(off: u64, len: u64) -> Vec<(u64, u16)> {
    let mut out = Vec::new();
    let first = off / BLOCK;
    let end = (off + len) / BLOCK;
    let mut b = first;
    while b < end {
        let line = b / LINE_BLOCKS;
        let line_end = ((line + 1) * LINE_BLOCKS).min(end);
        let lo = (b % LINE_BLOCKS) as u32;
        let n = (line_end - b) as u32;
        let mask = if n >= 16 {
            u16::MAX
        } else {
            (((1u32 << n) - 1) << lo) as u16
        };
        out.push((line, mask));
        b = line_end;
    }
    out
}

impl FlashCache {
    /// Sets or clears the not-yet-valid bits of whole blocks in a range.
    pub(crate) fn set_invalid_range(
        &self,
        image: &ImageHandle,
        off: u64,
        len: u64,
        invalid: bool,
        tag: IoTag,
    ) -> Result<()> {
        let id = self.image_id(image, tag.disk)?;
        let mut st = self.lock();
        for (line, mask) in line_masks(off, len) {
            let key = line_key(id, line);
            if invalid {
                // Whatever the cache held for these blocks belongs to an
                // earlier use of the cluster.
                for slot in 0..LINE_BLOCKS as usize {
                    if mask & (1 << slot) != 0 {
                        self.unmap_block(&mut st, key, slot);
                    }
                }
            }
            let old = st.index.get(key).map_or(0, |l| l.partial);
            let new = if invalid { old | mask } else { old & !mask };
            if new != old {
                // Marking blocks invalid is an allocation for this guest
                // cluster: the line now serves it.
                let guest = if invalid { tag.guest_cluster } else { None };
                st.index.set_partial(key, guest, new);
                st.journal.push(&Entry::Partial {
                    key,
                    mask: new,
                    guest: guest.unwrap_or(u64::MAX),
                });
                st.uncommitted_dirty = true;
            }
        }
        Ok(())
    }

    /// Makes whole blocks valid after they were written.
    pub(crate) fn clear_invalid_blocks(&self, st: &mut State, id: u16, off: u64, len: u64) {
        let first = off.div_ceil(BLOCK) * BLOCK;
        let end = (off + len) / BLOCK * BLOCK;
        if first >= end {
            return;
        }
        for (line, mask) in line_masks(first, end - first) {
            let key = line_key(id, line);
            let Some(l) = st.index.get(key) else { continue };
            if l.partial & mask == 0 {
                continue;
            }
            let new = l.partial & !mask;
            st.index.set_partial(key, None, new);
            st.journal.push(&Entry::Partial {
                key,
                mask: new,
                guest: u64::MAX,
            });
        }
    }

    /// Not yet valid ranges inside `[off, off+len)`.
    pub(crate) fn invalid_ranges_of(
        &self,
        image: &ImageHandle,
        off: u64,
        len: u64,
    ) -> Vec<(u64, u64)> {
        let st = self.lock();
        let Some(&id) = st.by_name.get(&*image.name) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        let end = off + len;
        let mut line = off / LINE;
        while line * LINE < end {
            if let Some(l) = st.index.get(line_key(id, line)).filter(|l| l.partial != 0) {
                for slot in 0..LINE_BLOCKS {
                    if l.partial & (1 << slot) == 0 {
                        continue;
                    }
                    let s = (line * LINE + slot * BLOCK).max(off);
                    let e = (line * LINE + (slot + 1) * BLOCK).min(end);
                    if s >= e {
                        continue;
                    }
                    match out.last_mut() {
                        Some((ls, ll)) if *ls + *ll == s => *ll += e - s,
                        _ => out.push((s, e - s)),
                    }
                }
            }
            line += 1;
        }
        out
    }

    /// Every not yet valid range of an image.
    pub(crate) fn partial_ranges_of(&self, image: &ImageHandle) -> Vec<PartialRange> {
        let st = self.lock();
        let Some(&id) = st.by_name.get(&*image.name) else {
            return Vec::new();
        };
        let mut out: Vec<PartialRange> = Vec::new();
        let mut lines: Vec<(u64, u16, u64)> = st
            .index
            .lines()
            .filter(|l| l.partial != 0 && crate::index::key_image(l.key) == id)
            .map(|l| (crate::index::key_line(l.key), l.partial, u64::from(l.guest)))
            .collect();
        lines.sort_unstable();
        for (line, mask, guest) in lines {
            for slot in 0..LINE_BLOCKS {
                if mask & (1 << slot) == 0 {
                    continue;
                }
                let s = line * LINE + slot * BLOCK;
                match out.last_mut() {
                    Some(r) if r.offset + r.len == s && r.guest_cluster == guest => r.len += BLOCK,
                    _ => out.push(PartialRange {
                        offset: s,
                        len: BLOCK,
                        guest_cluster: guest,
                    }),
                }
            }
        }
        out
    }

    /// Whether the disk's blocks may be left partially valid.
    pub(crate) fn decoupled_for(&self, disk: vdcache_image::DiskId) -> bool {
        let p = self.lock().policy(disk, self.config.default_policy);
        p.cow == crate::config::CowMode::CowAware && p.mode == crate::config::WriteMode::WriteBack
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_split_by_line() {
        assert_eq!(line_masks(0, LINE), vec![(0, u16::MAX)]);
        assert_eq!(line_masks(BLOCK, 2 * BLOCK), vec![(0, 0b110)]);
        assert_eq!(
            line_masks(LINE - BLOCK, 2 * BLOCK),
            vec![(0, 1 << 15), (1, 1)]
        );
    }
}
