//! L2 lookups and updates through the slice cache, and making an L2 table
//! writable (allocating it, or copying it when a snapshot shares it).

use super::Locked;
use super::overlap::MetaKind;
use crate::error::{ImageError, Result};
use crate::hostio::{IoTag, MetaTable};
use crate::meta_cache::{Probe, SliceCache, Slot};
use vdcache_qcow2::bytes::{be64_at, put_be64_at};
use vdcache_qcow2::entries::{COPIED, L1Entry, L2Mapping};

/// Whether a lookup may read a table it does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableReads {
    Allowed,
    /// Answer from the tables in memory only (for hints, which are not
    /// worth a read).
    Forbidden,
}

/// The two kinds of sliced tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sliced {
    L2,
    Refblock,
}

impl Sliced {
    fn describe(self) -> &'static str {
        match self {
            Sliced::L2 => "L2 table",
            Sliced::Refblock => "refcount block",
        }
    }

    fn table(self) -> MetaTable {
        match self {
            Sliced::L2 => MetaTable::L2,
            Sliced::Refblock => MetaTable::RefcountBlock,
        }
    }
}

impl Locked<'_> {
    pub(crate) fn cache(&mut self, kind: Sliced) -> &mut SliceCache {
        match kind {
            Sliced::L2 => &mut self.m.l2,
            Sliced::Refblock => &mut self.m.refblocks,
        }
    }

    /// Makes the slice starting at `start` resident; returns nothing, the
    /// caller then reads it with `peek_mut`.
    pub(crate) fn load_slice(&mut self, kind: Sliced, start: u64, tag: IoTag) -> Result<()> {
        let found = self.cache(kind).probe(start);
        if found == Probe::Resident {
            return Ok(());
        }
        // Tables are one cluster: tell the layer below which one this is.
        let cs = self.img.geometry.cluster_size();
        let tag = IoTag {
            unit: Some((vdcache_qcow2::HostOffset(start & !(cs - 1)), cs as u32)),
            ..tag
        };
        let size = self.cache(kind).slice_size() as usize;
        // A table pointer past the end of the file is corruption; reading
        // (or later writing) there would conjure a table out of nothing.
        let file_len = self.m.file_end;
        if start
            .checked_add(size as u64)
            .is_none_or(|end| end > file_len)
        {
            return Err(self.corruption(format!(
                "{} at {start:#x} lies past the end of the image file ({file_len} bytes)",
                kind.describe()
            )));
        }
        self.make_room(kind)?;
        let mut data = vec![0u8; size].into_boxed_slice();
        if found == Probe::Missing {
            self.read_meta(start, &mut data, tag)?;
        }
        self.cache(kind).insert(start, Slot { data, dirty: false });
        Ok(())
    }

    /// Evicts the least recently used slice if the cache is full, writing it
    /// back first (with the ordering its kind needs).
    fn make_room(&mut self, kind: Sliced) -> Result<()> {
        if let Some((victim, dirty)) = self.cache(kind).next_victim() {
            if dirty {
                self.cache(kind).stats.dirty_evictions += 1;
                match kind {
                    Sliced::L2 => self.write_back_l2_slice(victim)?,
                    Sliced::Refblock => self.write_back_slice(Sliced::Refblock, victim)?,
                }
            }
            self.cache(kind).remove(victim);
        }
        Ok(())
    }

    /// Writes one dirty slice as it is and marks it clean. Ordering is the
    /// caller's business.
    pub(crate) fn write_back_slice(&mut self, kind: Sliced, start: u64) -> Result<()> {
        let data = match self.cache(kind).peek_mut(start) {
            Some(s) if s.dirty => {
                s.dirty = false;
                s.data.clone()
            }
            _ => return Ok(()),
        };
        self.write_meta(kind.table(), start, &data)
    }

    fn l2_tag(&self, guest_cluster: u64) -> IoTag {
        let mut t = self.tag(MetaTable::L2);
        t.guest_cluster = Some(vdcache_contract::GuestCluster(guest_cluster));
        t
    }

    /// Host offset of the L2 table covering `guest_cluster`, if allocated.
    /// An entry that does not decode, has flags but no table, or points at
    /// other metadata is corruption.
    fn l2_table_of(&mut self, guest_cluster: u64) -> Result<Option<(u64, bool)>> {
        let g = self.img.geometry;
        let l1i = g.l1_index(guest_cluster) as usize;
        let Some(&raw) = self.m.l1.get(l1i) else {
            return Ok(None);
        };
        let e = match L1Entry::decode(raw, &g) {
            Ok(e) => e,
            Err(e) => return Err(self.corruption(format!("L1 entry {l1i}: {e}"))),
        };
        let Some(table) = e.l2_offset else {
            if raw != 0 {
                return Err(self.corruption(format!(
                    "L1 entry {l1i} is {raw:#018x}: COPIED is set but there is no L2 table (offset 0 is the header)"
                )));
            }
            return Ok(None);
        };
        let cluster = g.host_cluster(table);
        match self.m.map.kind_at(cluster) {
            None => {}
            Some(MetaKind::ActiveL2(i)) if i == l1i as u64 => {}
            Some(kind) => {
                return Err(self.corruption(format!(
                    "the L2 table of L1 entry {l1i} at {:#x} overlaps the {} at cluster {cluster} (metadata overlap{})",
                    table.0,
                    kind.describe(),
                    if matches!(kind, MetaKind::ActiveL2(_)) {
                        ": one L2 table shared by two L1 entries"
                    } else {
                        ""
                    }
                )));
            }
        }
        Ok(Some((table.0, e.copied)))
    }

    /// (slice start, byte offset of the entry inside the slice).
    fn entry_position(&self, table: u64, guest_cluster: u64) -> (u64, usize) {
        let g = &self.img.geometry;
        let byte = g.l2_index(guest_cluster) * g.l2_entry_size();
        let slice = self.m.l2.slice_size();
        (table + (byte & !(slice - 1)), (byte & (slice - 1)) as usize)
    }

    /// The mapping of one guest cluster in this image.
    pub(crate) fn l2_entry(&mut self, guest_cluster: u64) -> Result<L2Mapping> {
        Ok(self
            .l2_entry_if(guest_cluster, TableReads::Allowed)?
            .unwrap_or(L2Mapping::UNALLOCATED))
    }

    /// The mapping of one guest cluster; None when that needs a table
    /// read and `reads` forbids it.
    pub(crate) fn l2_entry_if(
        &mut self,
        guest_cluster: u64,
        reads: TableReads,
    ) -> Result<Option<L2Mapping>> {
        let Some((table, _)) = self.l2_table_of(guest_cluster)? else {
            return Ok(Some(L2Mapping::UNALLOCATED));
        };
        let (start, at) = self.entry_position(table, guest_cluster);
        if reads == TableReads::Forbidden && !self.m.l2.holds(start) {
            return Ok(None);
        }
        let tag = self.l2_tag(guest_cluster);
        self.load_slice(Sliced::L2, start, tag)?;
        let extended = self.img.geometry.extended_l2();
        let (raw, bitmap) = match self.m.l2.peek_mut(start) {
            Some(s) => (
                be64_at(&s.data, at / 8),
                if extended {
                    be64_at(&s.data, at / 8 + 1)
                } else {
                    0
                },
            ),
            None => {
                return Err(ImageError::corrupt(
                    self.name(),
                    "L2 slice vanished from the cache",
                ));
            }
        };
        let mapping = match L2Mapping::decode(raw, bitmap, &self.img.format) {
            Ok(m) => m,
            Err(e) => {
                return Err(self.corruption(format!(
                    "L2 entry of guest cluster {guest_cluster} (table at {table:#x}): {e}"
                )));
            }
        };
        self.check_within_file(guest_cluster, &mapping)?;
        self.check_not_on_metadata(guest_cluster, &mapping)?;
        Ok(Some(mapping))
    }

    /// Refuses mappings whose data lies on metadata: reading would return
    /// table bytes as guest data, writing would destroy the table.
    fn check_not_on_metadata(&mut self, guest_cluster: u64, mapping: &L2Mapping) -> Result<()> {
        if self.img.external_data {
            return Ok(());
        }
        let g = self.img.geometry;
        let (start, len) = match mapping {
            L2Mapping::Standard(s) => match s.host {
                Some(h) => (h.0, g.cluster_size()),
                None => return Ok(()),
            },
            L2Mapping::Compressed(d) => d.sector_range(),
        };
        match self.m.map.conflict(&g, start, len, None) {
            None => Ok(()),
            Some((cluster, kind)) => Err(self.corruption(format!(
                "the data of guest cluster {guest_cluster} at {start:#x} overlaps the {} at cluster {cluster} (metadata overlap)",
                kind.describe()
            ))),
        }
    }

    /// Refuses mappings whose data lies past the end of the image file:
    /// reading there would return bytes nobody wrote.
    fn check_within_file(&mut self, guest_cluster: u64, mapping: &L2Mapping) -> Result<()> {
        if self.img.external_data {
            return Ok(());
        }
        // The last cluster may be partly written (subclusters), so only its
        // start must lie inside the file.
        let start = match mapping {
            L2Mapping::Standard(s) => match s.host {
                Some(h) => h.0,
                None => return Ok(()),
            },
            L2Mapping::Compressed(d) => d.offset,
        };
        if start >= self.m.file_end {
            let end = self.m.file_end;
            return Err(self.corruption(format!(
                "L2 entry of guest cluster {guest_cluster} points at {start:#x}, past the end of the image file ({end} bytes)"
            )));
        }
        Ok(())
    }

    /// Updates the entry of a guest cluster whose table is writable
    /// (see [`Self::ensure_l2_writable`]).
    pub(crate) fn set_l2_entry(&mut self, guest_cluster: u64, mapping: &L2Mapping) -> Result<()> {
        let entry = self.place_entry(guest_cluster, mapping)?;
        let s = self.loaded_slice(entry.start)?;
        entry.put(&mut s.data);
        s.dirty = true;
        Ok(())
    }

    /// The whole L2 slices that setting `mappings` (guest cluster, entry)
    /// would leave, by slice start, as a write-back would log them; the
    /// cache is left as it was.
    pub(crate) fn l2_slices_with(
        &mut self,
        mappings: &[(u64, L2Mapping)],
    ) -> Result<super::journal::Slices> {
        let mut slices: super::journal::Slices = Vec::new();
        for (guest_cluster, mapping) in mappings {
            let entry = self.place_entry(*guest_cluster, mapping)?;
            let i = match slices.iter().position(|(s, _)| *s == entry.start) {
                Some(i) => i,
                None => {
                    let data = self.loaded_slice(entry.start)?.data.to_vec();
                    slices.push((entry.start, data));
                    slices.len() - 1
                }
            };
            entry.put(&mut slices[i].1);
        }
        slices.sort_by_key(|(start, _)| *start);
        Ok(slices)
    }

    /// Encodes `mapping` and finds (and loads) the slice its entry goes in.
    fn place_entry(&mut self, guest_cluster: u64, mapping: &L2Mapping) -> Result<PlacedEntry> {
        let (raw, bitmap) = mapping
            .encode(&self.img.format)
            .map_err(|e| ImageError::format(self.name(), e))?;
        let Some((table, true)) = self.l2_table_of(guest_cluster)? else {
            return Err(ImageError::corrupt(
                self.name(),
                format!("L2 table of guest cluster {guest_cluster} is not writable"),
            ));
        };
        let (start, at) = self.entry_position(table, guest_cluster);
        let tag = self.l2_tag(guest_cluster);
        self.load_slice(Sliced::L2, start, tag)?;
        Ok(PlacedEntry {
            start,
            at,
            raw,
            bitmap: self.img.geometry.extended_l2().then_some(bitmap),
        })
    }

    fn loaded_slice(&mut self, start: u64) -> Result<&mut crate::meta_cache::Slot> {
        let img = self.img;
        self.m
            .l2
            .peek_mut(start)
            .ok_or_else(|| ImageError::corrupt(img.name(), "L2 slice vanished from the cache"))
    }

    /// Makes the L2 table covering `guest_cluster` exclusively owned by the
    /// active L1 table: allocates a zeroed table, or copies one a snapshot
    /// shares. The new table is written before the L1 entry changes.
    pub(crate) fn ensure_l2_writable(&mut self, guest_cluster: u64) -> Result<()> {
        let g = self.img.geometry;
        let l1i = g.l1_index(guest_cluster);
        if l1i as usize >= self.m.l1.len() {
            return Err(ImageError::corrupt(
                self.name(),
                format!("guest cluster {guest_cluster} lies beyond the L1 table"),
            ));
        }
        let old = self.l2_table_of(guest_cluster)?;
        if let Some((_, true)) = old {
            return Ok(());
        }
        let cs = g.cluster_size();
        let content = match old {
            Some((table, _)) => self.read_whole_l2(table, guest_cluster)?,
            None => vec![0u8; cs as usize],
        };
        let new_cluster = self.alloc_clusters(1)?;
        let new_off = g.cluster_offset(new_cluster);
        self.write_meta(MetaTable::L2, new_off, &content)?;
        if old.is_none() {
            self.m.l2.mark_zero(new_off, cs);
        }
        self.mark_unsynced();
        if let Some((table, _)) = old {
            self.m.pending_frees.push(table / cs);
            self.m.map.remove(&g, table, cs, MetaKind::ActiveL2(l1i));
        }
        if let Err(o) = self.m.map.insert(&g, new_off, cs, MetaKind::ActiveL2(l1i)) {
            return Err(self.corruption(format!("a new L2 table: {o}")));
        }
        self.m.l1[l1i as usize] = new_off | COPIED;
        self.m.l1_dirty.insert(l1i);
        Ok(())
    }

    /// A whole L2 table, taking resident slices from the cache.
    pub(crate) fn read_whole_l2(&mut self, table: u64, guest_cluster: u64) -> Result<Vec<u8>> {
        let cs = self.img.geometry.cluster_size() as usize;
        let mut content = vec![0u8; cs];
        let tag = self.l2_tag(guest_cluster);
        self.read_meta(table, &mut content, tag)?;
        let slice = self.m.l2.slice_size() as usize;
        for (i, chunk) in content.chunks_mut(slice).enumerate() {
            if let Some(s) = self.m.l2.peek_mut(table + (i * slice) as u64) {
                chunk.copy_from_slice(&s.data);
            }
        }
        Ok(content)
    }
}

/// An encoded L2 entry and where it goes.
struct PlacedEntry {
    /// The slice's start in the image file.
    start: u64,
    /// The entry's byte offset inside the slice.
    at: usize,
    raw: u64,
    /// The subcluster bitmap, in images with extended L2 entries.
    bitmap: Option<u64>,
}

impl PlacedEntry {
    fn put(&self, slice: &mut [u8]) {
        put_be64_at(slice, self.at / 8, self.raw);
        if let Some(bitmap) = self.bitmap {
            put_be64_at(slice, self.at / 8 + 1, bitmap);
        }
    }
}
