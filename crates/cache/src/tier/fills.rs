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

use super::copyback::Piece;
use super::space::DirtyBlock;
use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::index::{Cbn, NO_BLOCK, key_image, key_line};
use crate::journal::Entry;
use crate::layout::{BLOCK, LINE, LINE_BLOCKS};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use vdcache_contract::{BackingFill, GuestCluster};
use vdcache_qcow2::HostOffset;

const SECTOR: u64 = 512;

/// A partially valid line as it was when it was chosen for filling. Its
/// backing bytes are read by the first copy worker that needs them, so
/// reading one line's filler overlaps writing another's.
pub(crate) struct LineFill {
    pub key: u64,
    partial: u16,
    valid: [u8; LINE_BLOCKS as usize],
    cbns: [Cbn; LINE_BLOCKS as usize],
    guest: u32,
    filler: Weak<dyn BackingFill>,
    /// Held across the COW layer's read of the backing chain, which may
    /// take the state lock: never taken with the state lock held (see the
    /// lock order in the tier's module doc).
    base: Mutex<BaseRead>,
}

/// What reading a line's backing bytes gave.
enum BaseRead {
    NotYet,
    /// The COW layer could not supply them (the image closed, or the
    /// cluster no longer serves the guest cluster): the line is left to
    /// the COW layer's own fill.
    Unavailable,
    /// The backing chain's bytes from `start` (line-relative) on.
    Read {
        start: u64,
        bytes: Vec<u8>,
    },
}

impl std::fmt::Debug for LineFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineFill")
            .field("key", &self.key)
            .field("partial", &self.partial)
            .finish_non_exhaustive()
    }
}

impl LineFill {
    /// The image range the fill writes.
    pub(crate) fn range(&self) -> (u16, u64, u64) {
        let at = key_line(self.key) * LINE;
        (key_image(self.key), at, at + LINE)
    }

    /// Whether the line is still as it was chosen.
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

    /// Whether its backing bytes were read (and so went out with the
    /// line's blocks).
    pub(crate) fn was_read(&self) -> bool {
        matches!(*self.lock_base(), BaseRead::Read { .. })
    }

    /// Sectors of block `slot` taken from the backing chain.
    fn sectors_from_base(&self, slot: usize) -> u8 {
        if self.partial & (1 << slot) == 0 {
            0
        } else {
            !self.valid[slot]
        }
    }

    fn lock_base(&self) -> std::sync::MutexGuard<'_, BaseRead> {
        self.base.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the backing bytes unless done already; returns how long the
    /// read took (None when nothing was read now).
    pub(crate) fn read(&self) -> Result<Option<(usize, Duration)>> {
        let mut base = self.lock_base();
        if !matches!(*base, BaseRead::NotYet) {
            return Ok(None);
        }
        let began = Instant::now();
        *base = self.read_backing()?;
        Ok(match &*base {
            BaseRead::Read { bytes, .. } => Some((bytes.len(), began.elapsed())),
            _ => None,
        })
    }

    /// Copies the backing bytes under block `slot`'s not yet valid
    /// sectors into `block`; returns how many bytes, or None when the
    /// line's backing bytes could not be read.
    pub(crate) fn copy_base(&self, slot: usize, block: &mut [u8]) -> Option<u64> {
        let base = self.lock_base();
        let BaseRead::Read { start, bytes } = &*base else {
            return None;
        };
        let sectors = self.sectors_from_base(slot);
        let mut copied = 0;
        for s in 0..(BLOCK / SECTOR) as usize {
            let at = (slot as u64 * BLOCK + s as u64 * SECTOR).checked_sub(*start);
            if sectors & (1 << s) != 0
                && let Some(from) = at.and_then(|a| bytes.get(a as usize..(a + SECTOR) as usize))
            {
                block[s * SECTOR as usize..(s + 1) * SECTOR as usize].copy_from_slice(from);
                copied += SECTOR;
            }
        }
        Some(copied)
    }

    /// Reads the backing chain's bytes under the line's not yet valid
    /// sectors.
    fn read_backing(&self) -> Result<BaseRead> {
        let Some(filler) = self.filler.upgrade() else {
            return Ok(BaseRead::Unavailable);
        };
        let mut first = None;
        let mut end = 0;
        for slot in 0..LINE_BLOCKS as usize {
            let sectors = self.sectors_from_base(slot);
            if sectors == 0 {
                continue;
            }
            let lo = slot as u64 * BLOCK + u64::from(sectors.trailing_zeros()) * SECTOR;
            let hi = slot as u64 * BLOCK + u64::from(8 - sectors.leading_zeros()) * SECTOR;
            first.get_or_insert(lo);
            end = hi;
        }
        let Some(start) = first else {
            return Ok(BaseRead::Unavailable);
        };
        let mut bytes = vec![0u8; (end - start) as usize];
        let host = HostOffset(key_line(self.key) * LINE + start);
        let read = filler
            .backing_bytes(host, GuestCluster(u64::from(self.guest)), &mut bytes)
            .map_err(|e| {
                CacheError::device("read the backing chain to fill a cluster")(
                    std::io::Error::from(e),
                )
            })?;
        Ok(if read {
            BaseRead::Read { start, bytes }
        } else {
            BaseRead::Unavailable
        })
    }
}

/// The partially valid lines of the batch that can be filled now, with
/// nothing read yet.
pub(crate) fn partial_lines(st: &State, batch: &[DirtyBlock]) -> Vec<Arc<LineFill>> {
    let mut out: Vec<Arc<LineFill>> = Vec::new();
    for &(key, _, _) in batch {
        if out.last().is_some_and(|f| f.key == key) {
            continue;
        }
        let Some(l) = st.index.get(key).filter(|l| l.partial != 0) else {
            continue;
        };
        let Some(filler) = st.catalog.fillers.get(&key_image(key)) else {
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
            out.push(Arc::new(LineFill {
                key,
                partial: l.partial,
                valid,
                cbns,
                guest: l.guest,
                filler: filler.clone(),
                base: Mutex::new(BaseRead::NotYet),
            }));
        }
    }
    out
}

/// The pieces to copy: the batch's dirty blocks, with the backing bytes
/// of their not yet valid sectors, and the blocks of filled lines that
/// hold nothing valid yet.
pub(crate) fn pieces(batch: &[DirtyBlock], crcs: &[u32], fills: &[Arc<LineFill>]) -> Vec<Piece> {
    let fill_of = |key: u64| fills.iter().find(|f| f.key == key);
    let mut out = FlashCache::flash_pieces(batch, crcs);
    for p in &mut out {
        if let Some(((key, slot, _), _)) = p.flash
            && let Some(f) = fill_of(key)
            && f.sectors_from_base(slot) != 0
        {
            p.base = Some(f.clone());
        }
    }
    for f in fills {
        for slot in 0..LINE_BLOCKS as usize {
            if f.partial & (1 << slot) != 0 && f.valid[slot] == 0 {
                out.push(Piece {
                    image: key_image(f.key),
                    pos: key_line(f.key) * LINE + slot as u64 * BLOCK,
                    flash: None,
                    base: Some(f.clone()),
                });
            }
        }
    }
    out
}

impl FlashCache {
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
