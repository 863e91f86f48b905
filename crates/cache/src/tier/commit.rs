//! Making the cache's state durable: journal commits (what a guest flush
//! costs: one batch write and one sync of the cache device, plus a backend
//! sync only for images that took write-through data) and checkpoints.

use super::{FlashCache, State};
use crate::error::{CacheError, Result};
use crate::journal::{CheckpointMark, Reader, write_checkpoint};
use crate::layout::LINE_BLOCKS;
use crate::stats::bump;
use vdcache_image::{FlushKind, ImageHandle};

impl FlashCache {
    /// Syncs images holding write-through data: journal records of their
    /// clean copies must never outlive the data on the backend.
    pub(crate) fn sync_backends(&self, st: &mut State) -> Result<()> {
        for id in std::mem::take(&mut st.unsynced) {
            let Some(rec) = st.images.get(id as usize) else {
                continue;
            };
            if let Some(b) = &rec.backend {
                b.flush().map_err(CacheError::device("sync backend"))?;
                bump(&self.stats.disk(rec.disk).backend_syncs, 1);
            }
        }
        Ok(())
    }

    /// Writes pending journal entries and syncs the cache device.
    pub(crate) fn commit(&self, st: &mut State) -> Result<()> {
        self.sync_backends(st)?;
        st.uncommitted_dirty = false;
        // Summaries ride along with this commit's sync (they need none).
        self.write_summaries(st)?;
        if st.journal.needs_checkpoint() {
            return self.checkpoint(st);
        }
        st.journal.write_pending(&*self.device)?;
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))
    }

    /// Writes the whole index into the older checkpoint slot; replay then
    /// starts from here.
    pub(crate) fn checkpoint(&self, st: &mut State) -> Result<()> {
        self.sync_backends(st)?;
        st.uncommitted_dirty = false;
        // Every block the checkpoint names must be durable before it.
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        let payload = encode_checkpoint(st);
        let mark = CheckpointMark {
            generation: st.generation + 1,
            journal_seq: st.journal.next_seq,
            journal_pos: st.journal.pos,
        };
        write_checkpoint(&*self.device, &self.layout, &self.sb.uuid, mark, &payload)?;
        self.device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        st.generation = mark.generation;
        st.journal.checkpointed(mark.generation);
        Ok(())
    }

    /// Makes recorded dirty blocks durable before a write that bypasses the
    /// log reaches a backend: the bypassing write may depend on them (an L2
    /// entry written back must not outlive the data it points to).
    pub(crate) fn commit_before_bypass(&self, st: &mut State) -> Result<()> {
        if st.uncommitted_dirty {
            self.commit(st)?;
        }
        Ok(())
    }

    /// A flush from the COW layer.
    pub(crate) fn flush_image(&self, image: &ImageHandle, kind: FlushKind) -> Result<()> {
        let mut st = self.lock();
        let id = st.by_name.get(&*image.name).copied();
        match kind {
            FlushKind::Barrier => {
                // The journal keeps order by itself; only data that went to
                // the backend needs the backend's own barrier.
                if let Some(id) = id.filter(|id| st.unsynced.contains(id)) {
                    st.unsynced.remove(&id);
                    image
                        .backend
                        .flush()
                        .map_err(CacheError::device("sync backend"))?;
                    let disk = st.images[id as usize].disk;
                    bump(&self.stats.disk(disk).backend_syncs, 1);
                }
                Ok(())
            }
            FlushKind::Durable => {
                if let Some(id) = id {
                    bump(
                        &self.stats.disk(st.images[id as usize].disk).guest_flushes,
                        1,
                    );
                }
                self.commit(&mut st)
            }
        }
    }
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(bytes);
}

/// Checkpoint payload: the image registry, then every line with the block
/// numbers of its present blocks (and, for a partially valid line, which
/// of its blocks have valid sectors and their bitmaps).
fn encode_checkpoint(st: &State) -> Vec<u8> {
    let mut out = Vec::new();
    put(&mut out, &(st.images.len() as u32).to_le_bytes());
    for (id, r) in st.images.iter().enumerate() {
        crate::journal::Entry::Image {
            id: id as u16,
            name: r.name.clone(),
            identity: r.identity,
        }
        .encode(&mut out);
    }
    put(&mut out, &(st.index.line_count() as u64).to_le_bytes());
    for l in st.index.lines() {
        put(&mut out, &l.key.to_le_bytes());
        put(&mut out, &u64::from(l.guest).to_le_bytes());
        put(&mut out, &l.present.to_le_bytes());
        put(&mut out, &l.dirty.to_le_bytes());
        put(&mut out, &l.partial.to_le_bytes());
        for (_, cbn) in l.blocks() {
            put(&mut out, &cbn.to_le_bytes());
        }
        if l.partial != 0 {
            let sectors: Vec<(usize, u8)> = (0..LINE_BLOCKS as usize)
                .map(|slot| (slot, st.index.valid_sectors(l.key, slot)))
                .filter(|&(_, v)| v != 0)
                .collect();
            let with: u16 = sectors.iter().fold(0, |m, &(slot, _)| m | 1 << slot);
            put(&mut out, &with.to_le_bytes());
            out.extend(sectors.iter().map(|&(_, v)| v));
        }
    }
    put(&mut out, &(st.meta.dirty_len() as u64).to_le_bytes());
    for (image, offset, data) in st.meta.dirty_sectors() {
        match data {
            Some(data) => crate::journal::Entry::MetaSector {
                image,
                offset,
                data: data.into(),
            },
            None => crate::journal::Entry::MetaZero {
                image,
                offset,
                sectors: 1,
            },
        }
        .encode(&mut out);
    }
    out
}

/// A line as a checkpoint stores it.
pub(crate) struct SavedLine {
    pub key: u64,
    pub guest: u64,
    pub dirty: u16,
    pub partial: u16,
    pub cbn: Vec<(usize, u32)>,
    /// (slot, valid sectors) of partially valid blocks with some.
    pub valid_sectors: Vec<(usize, u8)>,
}

/// A decoded checkpoint: image entries, lines, metadata sector entries.
type Checkpoint = (
    Vec<crate::journal::Entry>,
    Vec<SavedLine>,
    Vec<crate::journal::Entry>,
);

/// Decodes a checkpoint payload.
pub(crate) fn decode_checkpoint(payload: &[u8]) -> Result<Checkpoint> {
    let mut r = Reader::new(payload);
    let images = r.u32()?;
    let mut entries = Vec::with_capacity((images as usize).min(65536));
    for _ in 0..images {
        entries.push(crate::journal::Entry::decode(&mut r)?);
    }
    let count = r.u64()?;
    let mut lines = Vec::with_capacity((count as usize).min(payload.len() / 30 + 1));
    for _ in 0..count {
        let key = r.u64()?;
        let guest = r.u64()?;
        let present = r.u16()?;
        let dirty = r.u16()?;
        let partial = r.u16()?;
        let mut cbn = Vec::with_capacity(present.count_ones() as usize);
        for slot in 0..LINE_BLOCKS as usize {
            if present & (1 << slot) != 0 {
                cbn.push((slot, r.u32()?));
            }
        }
        let mut valid_sectors = Vec::new();
        if partial != 0 {
            let with = r.u16()?;
            for slot in 0..LINE_BLOCKS as usize {
                if with & (1 << slot) != 0 {
                    valid_sectors.push((slot, r.u8()?));
                }
            }
        }
        lines.push(SavedLine {
            key,
            guest,
            dirty: dirty & present,
            partial,
            cbn,
            valid_sectors,
        });
    }
    let count = r.u64()?;
    let mut sectors = Vec::with_capacity((count as usize).min(payload.len() / 512 + 1));
    for _ in 0..count {
        let e = crate::journal::Entry::decode(&mut r)?;
        if !matches!(
            e,
            crate::journal::Entry::MetaSector { .. } | crate::journal::Entry::MetaZero { .. }
        ) {
            return Err(CacheError::Corrupt(
                "checkpoint holds a non-sector entry among metadata sectors".into(),
            ));
        }
        sectors.push(e);
    }
    Ok((entries, lines, sectors))
}
