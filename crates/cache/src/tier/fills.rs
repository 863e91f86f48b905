//! Filling partially valid clusters as they are written back (decoupled
//! copy-on-write, completed): the COW layer reads the backing chain's
//! bytes under a line's not yet valid sectors (see [`BackingFill`]), the
//! write-back writes them together with the line's dirty blocks, and the
//! line stops being partially valid. The filler never enters flash and
//! the cluster is written once, where filling it through the cache first
//! would write it to flash, read it back, and write it again.
//!
//! A line is filled only when every not yet valid sector's neighbours are
//! at hand: each partially valid block either holds nothing valid yet or
//! has its dirty copy in the batch. Anything else (a clean copy of a half
//! written block, a line changed meanwhile) is left to the COW layer's own
//! fill, which reads through the cache.

use super::copyback::{BaseBytes, Piece};
use super::space::DirtyBlock;
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::index::{Cbn, NO_BLOCK, key_image, key_line};
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE, LINE_BLOCKS};
use std::sync::{Arc, Mutex, Weak};
use vdcache_image::BackingFill;
use vdcache_qcow2::HostOffset;

const SECTOR: u64 = 512;

/// A partially valid line as it was when its filler was read.
pub(crate) struct LineFill {
    pub key: u64,
    partial: u16,
    valid: [u8; LINE_BLOCKS as usize],
    cbns: [Cbn; LINE_BLOCKS as usize],
    guest: u32,
    filler: Weak<dyn BackingFill>,
    /// The backing chain's bytes from `start` (line-relative) on.
    start: u64,
    bytes: Arc<[u8]>,
}

impl LineFill {
    /// The image range the fill writes.
    pub(crate) fn range(&self) -> (u16, u64, u64) {
        let at = key_line(self.key) * LINE;
        (key_image(self.key), at, at + LINE)
    }

    /// Whether the line is still as its filler was read for.
    pub(crate) fn unchanged(&self, st: &State) -> bool {
        let Some(l) = st.index.get(self.key) else {
            return false;
        };
        l.partial == self.partial
            && l.guest == self.guest
            && (0..LINE_BLOCKS as usize).all(|s| {
                self.partial & (1 << s) == 0
                    || (st.index.valid_sectors(self.key, s) == self.valid[s]
                        && l.cbn(s) == self.cbns[s])
            })
    }

    /// Sectors of block `slot` taken from the backing chain.
    fn sectors_from_base(&self, slot: usize) -> u8 {
        if self.partial & (1 << slot) == 0 {
            0
        } else {
            !self.valid[slot]
        }
    }

    /// The backing bytes as seen from block `slot`.
    fn base_block(&self, slot: usize) -> BaseBytes {
        BaseBytes {
            bytes: self.bytes.clone(),
            block_at: (slot as u64 * BLOCK) as i64 - self.start as i64,
        }
    }
}

/// The partially valid lines of the batch that can be filled now, with
/// nothing read yet.
pub(crate) fn partial_lines(st: &State, batch: &[DirtyBlock]) -> Vec<LineFill> {
    let mut out: Vec<LineFill> = Vec::new();
    for &(key, _, _) in batch {
        if out.last().is_some_and(|f| f.key == key) {
            continue;
        }
        let Some(l) = st.index.get(key).filter(|l| l.partial != 0) else {
            continue;
        };
        let Some(filler) = st.fillers.get(&key_image(key)) else {
            continue;
        };
        let mut valid = [0u8; LINE_BLOCKS as usize];
        let mut cbns = [NO_BLOCK; LINE_BLOCKS as usize];
        let mut fillable = true;
        for s in 0..LINE_BLOCKS as usize {
            if l.partial & (1 << s) == 0 {
                continue;
            }
            valid[s] = st.index.valid_sectors(key, s);
            cbns[s] = l.cbn(s);
            // The batch is in (line, slot) order.
            let in_batch = batch
                .binary_search_by_key(&(key, s), |&(k, sl, _)| (k, sl))
                .is_ok_and(|i| batch[i].2 == cbns[s]);
            // Valid sectors must come from a copy being written now; a
            // block with none valid must have no copy at all.
            fillable &= if valid[s] == 0 {
                cbns[s] == NO_BLOCK
            } else {
                in_batch
            };
        }
        if fillable {
            out.push(LineFill {
                key,
                partial: l.partial,
                valid,
                cbns,
                guest: l.guest,
                filler: filler.clone(),
                start: 0,
                bytes: Arc::from(Vec::new()),
            });
        }
    }
    out
}

/// The pieces to copy: the batch's dirty blocks, with the backing bytes
/// of their not yet valid sectors, and the blocks of filled lines that
/// hold nothing valid yet.
pub(crate) fn pieces(batch: &[DirtyBlock], crcs: &[u32], fills: &[LineFill]) -> Vec<Piece> {
    let fill_of = |key: u64| fills.iter().find(|f| f.key == key);
    let mut out = FlashCache::flash_pieces(batch, crcs);
    for p in &mut out {
        if let Some(((key, slot, _), _)) = p.flash
            && let Some(f) = fill_of(key)
        {
            p.from_base = f.sectors_from_base(slot);
            if p.from_base != 0 {
                p.base = Some(f.base_block(slot));
            }
        }
    }
    for f in fills {
        for slot in 0..LINE_BLOCKS as usize {
            if f.partial & (1 << slot) != 0 && f.valid[slot] == 0 {
                out.push(Piece {
                    image: key_image(f.key),
                    pos: key_line(f.key) * LINE + slot as u64 * BLOCK,
                    flash: None,
                    from_base: u8::MAX,
                    base: Some(f.base_block(slot)),
                });
            }
        }
    }
    out
}

impl FlashCache {
    /// Reads the backing bytes of every line's not yet valid sectors, many
    /// lines at once; lines whose filler is gone or which no longer serve
    /// their guest cluster are dropped.
    pub(crate) fn read_fills(&self, lines: Vec<LineFill>) -> Result<Vec<LineFill>> {
        if lines.is_empty() {
            return Ok(lines);
        }
        let done: Mutex<Vec<LineFill>> = Mutex::new(Vec::new());
        let timing = Mutex::new(Vec::new());
        let slots: Vec<Mutex<Option<LineFill>>> =
            lines.into_iter().map(|l| Mutex::new(Some(l))).collect();
        self.run_parallel(&slots, |slot| {
            let Some(mut f) = slot.lock().ok().and_then(|mut s| s.take()) else {
                return Ok(());
            };
            let began = std::time::Instant::now();
            if read_fill(&mut f)? {
                let took = (f.bytes.len(), began.elapsed());
                timing.lock().unwrap_or_else(|p| p.into_inner()).push(took);
                done.lock().unwrap_or_else(|p| p.into_inner()).push(f);
            }
            Ok(())
        })?;
        self.record_latencies(&timing.into_inner().unwrap_or_else(|p| p.into_inner()));
        let mut out = done.into_inner().unwrap_or_else(|p| p.into_inner());
        out.sort_unstable_by_key(|f| f.key);
        Ok(out)
    }

    /// After the line's bytes landed and were synced: it is whole in its
    /// image. Copies of half-written blocks are dropped (their other
    /// sectors in flash hold nothing), and the line leaves the partially
    /// valid map, unless it changed meanwhile.
    pub(crate) fn complete_fill(&self, st: &mut State, f: &LineFill) {
        if !f.unchanged(st) {
            return;
        }
        for slot in 0..LINE_BLOCKS as usize {
            let half_written = f.partial & (1 << slot) != 0 && f.valid[slot] != 0;
            let clean = st
                .index
                .get(f.key)
                .is_some_and(|l| l.present & !l.dirty & (1 << slot) != 0);
            if half_written && clean {
                self.unmap_block(st, f.key, slot);
            }
        }
        st.index.set_partial(f.key, None, 0);
        st.journal.push(&Entry::Partial {
            key: f.key,
            mask: 0,
            guest: u64::MAX,
        });
    }
}

/// Reads one line's filler; false when the COW layer cannot supply it.
fn read_fill(f: &mut LineFill) -> Result<bool> {
    let Some(filler) = f.filler.upgrade() else {
        return Ok(false);
    };
    let mut first = None;
    let mut end = 0;
    for slot in 0..LINE_BLOCKS as usize {
        let sectors = f.sectors_from_base(slot);
        if sectors == 0 {
            continue;
        }
        let lo = slot as u64 * BLOCK + u64::from(sectors.trailing_zeros()) * SECTOR;
        let hi = slot as u64 * BLOCK + u64::from(8 - sectors.leading_zeros()) * SECTOR;
        first.get_or_insert(lo);
        end = hi;
    }
    let Some(start) = first else {
        return Ok(false);
    };
    let mut bytes = vec![0u8; (end - start) as usize];
    let host = HostOffset(key_line(f.key) * LINE + start);
    let read = filler
        .backing_bytes(host, u64::from(f.guest), &mut bytes)
        .map_err(CacheError::device(
            "read the backing chain to fill a cluster",
        ))?;
    f.start = start;
    f.bytes = Arc::from(bytes);
    Ok(read)
}
