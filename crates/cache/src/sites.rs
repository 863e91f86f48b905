//! Where a cache device keeps each of its metadata structures, for tests
//! and fault injectors that damage them one at a time (the crash
//! harness's damaged-metadata sweep, the end-to-end tests of a damaged
//! cache): the superblock and its copy, the seal, each checkpoint slot's
//! header and payload, the journal batches replay reads (the first, one in
//! the middle, the last), the data blocks those batches name, and the
//! journal as a whole.
//!
//! This module only reads. It must not judge what a damage means (that is
//! recovery's) nor write the device.

use crate::error::Result;
use crate::journal::{self, Entry};
use crate::layout::{BLOCK, Superblock};
use crate::seal;
use vdcache_backend::Backend;

/// How a site is damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// Every byte of the range inverted.
    Flip,
    /// The range zeroed.
    Zero,
}

/// One place to damage: a range of device bytes inside one structure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// The kind of structure ("checkpoint header"), the same for every
    /// cache and state.
    pub kind: &'static str,
    /// The structure itself, in words ("checkpoint slot 1 header").
    pub what: String,
    pub offset: u64,
    pub len: u64,
    pub damage: Damage,
}

impl Site {
    fn flip(kind: &'static str, what: impl Into<String>, offset: u64, len: u64) -> Site {
        Site {
            kind,
            what: what.into(),
            offset,
            len,
            damage: Damage::Flip,
        }
    }

    /// Damages `device` (a whole device's bytes) at this site.
    pub fn apply(&self, device: &mut [u8]) {
        let start = (self.offset as usize).min(device.len());
        let end = (self.offset.saturating_add(self.len) as usize).min(device.len());
        for b in &mut device[start..end] {
            *b = match self.damage {
                Damage::Flip => !*b,
                Damage::Zero => 0,
            };
        }
    }
}

/// The metadata sites of the cache on `device`, in a fixed order. A
/// device without a superblock (or its copy) has none.
pub fn metadata_sites(device: &dyn Backend) -> Result<Vec<Site>> {
    let Some(sb) = Superblock::peek(device) else {
        return Ok(Vec::new());
    };
    let l = sb.layout;
    let mut sites = vec![
        Site::flip("superblock", "superblock", 40, 1),
        Site::flip(
            "superblock copy",
            "superblock copy",
            l.backup_superblock_offset() + 40,
            1,
        ),
    ];
    if let Some(s) = seal::read_seal(device, &sb.uuid)? {
        let at = seal::seal_offsets()[(s.counter % 2) as usize];
        sites.push(Site::flip("seal", "seal (newest copy)", at + 33, 1));
    }
    for slot in 0..2 {
        let Some(len) = journal::checkpoint_payload_len(device, &l, slot)? else {
            continue;
        };
        let at = l.slot_offset(slot);
        sites.push(Site::flip(
            "checkpoint header",
            format!("checkpoint slot {slot} header"),
            at + 5,
            1,
        ));
        if len > 0 {
            sites.push(Site::flip(
                "checkpoint payload",
                format!("checkpoint slot {slot} payload"),
                at + journal::CHECKPOINT_PAYLOAD_AT + len / 2,
                1,
            ));
        }
    }
    let Ok((mark, _)) = journal::read_checkpoint(device, &l, &sb.uuid) else {
        return Ok(sites);
    };
    let tail = journal::read_batches(device, &l, &sb.uuid, mark)?;
    let live = live_blocks(&tail.batches);
    let n = tail.batches.len();
    let chosen = match n {
        0 => vec![],
        1 => vec![(0, "first and last")],
        2 => vec![(0, "first"), (1, "last")],
        _ => vec![(0, "first"), (n / 2, "middle"), (n - 1, "last")],
    };
    for (i, which) in chosen {
        let seq = mark.journal_seq + i as u64;
        let (pos, _) = tail.places[i];
        let len = tail.batches[i].len() as u64;
        // Four bytes at the end of the payload: its last block.
        let at = l.journal_offset + pos + journal::BATCH_PAYLOAD_AT + len.saturating_sub(4);
        sites.push(Site::flip(
            "journal batch",
            format!("journal batch {seq} ({which} replayed)"),
            at,
            4.min(len),
        ));
        if let Some(cbn) = live.get(i).copied().flatten() {
            sites.push(Site::flip(
                "data block",
                format!("data block {cbn} named by journal batch {seq}"),
                l.block_offset(cbn) + BLOCK / 4,
                1,
            ));
        }
    }
    sites.push(Site {
        kind: "journal",
        what: "the whole journal".into(),
        offset: l.journal_offset,
        len: l.journal_bytes,
        damage: Damage::Zero,
    });
    Ok(sites)
}

/// Per batch, the block of its first Map record that no later record of
/// the replayed batches replaces or unmaps (a block replay checks).
fn live_blocks(batches: &[Vec<u8>]) -> Vec<Option<u32>> {
    let entries: Vec<Vec<Entry>> = batches
        .iter()
        .map(|b| journal::decode_entries(b).unwrap_or_default())
        .collect();
    let mut last: std::collections::HashMap<(u64, u8), (usize, usize)> =
        std::collections::HashMap::new();
    for (b, es) in entries.iter().enumerate() {
        for (i, e) in es.iter().enumerate() {
            match e {
                Entry::Map { key, slot, .. } | Entry::Unmap { key, slot } => {
                    last.insert((*key, *slot), (b, i));
                }
                _ => {}
            }
        }
    }
    entries
        .iter()
        .enumerate()
        .map(|(b, es)| {
            es.iter().enumerate().find_map(|(i, e)| match e {
                Entry::Map { key, slot, cbn, .. } if last.get(&(*key, *slot)) == Some(&(b, i)) => {
                    Some(*cbn)
                }
                _ => None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheConfig, FlashCache};
    use std::sync::Arc;
    use vdcache_backend::MemBackend;

    #[test]
    fn a_new_cache_has_its_structures_and_damage_lands_on_them() {
        let dev = Arc::new(MemBackend::fixed("dev", 32 << 20));
        let config = CacheConfig {
            inline_background: true,
            host: Some("h".into()),
            ..CacheConfig::default()
        };
        FlashCache::format(dev.clone(), config.clone())
            .unwrap()
            .shutdown(true)
            .unwrap();
        let sites = metadata_sites(&*dev).unwrap();
        let kinds: Vec<&str> = sites.iter().map(|s| s.kind).collect();
        for kind in [
            "superblock",
            "superblock copy",
            "seal",
            "checkpoint header",
            "checkpoint payload",
            "journal",
        ] {
            assert!(kinds.contains(&kind), "{kind} missing from {sites:#?}");
        }
        let mut bytes = dev.snapshot();
        let before = bytes.clone();
        let header = sites
            .iter()
            .find(|s| s.kind == "checkpoint header")
            .unwrap();
        header.apply(&mut bytes);
        let changed: Vec<usize> = (0..bytes.len())
            .filter(|&i| bytes[i] != before[i])
            .collect();
        assert_eq!(changed, [header.offset as usize]);
        assert!(header.offset % 4096 < 16, "in the frame's first bytes");
    }
}
