//! Consistency check and refcount repair of one qcow2 image, as `qemu-img
//! check` does it: every reference from the header, L1/L2 tables (active
//! and snapshots), refcount structures, snapshot table and bitmaps is
//! counted and compared with the stored refcounts; COPIED flags of the
//! active tables are compared with refcount 1.
//!
//! Metadata that overlaps other metadata, and data clusters that lie on
//! metadata, are reported by name.
//!
//! Repair sets every refcount to the counted value (leaks and missing
//! references alike) and fixes COPIED flags in tables the image owns. It is
//! how an image left dirty by lazy refcounts is made consistent on open.
//! Refcount blocks that overlap other metadata or lie past the end of the
//! file are not written at all: the whole refcount structure is rebuilt
//! after the end of the file, and the header switched to it once it is
//! durable. Damage refcounts cannot describe (an L2 entry on metadata, a
//! bad entry) is reported and left alone.

use crate::error::{ImageError, Result};
use crate::hostio::{IoTag, MetaTable};
use crate::qimage::{Locked, Qcow2Image};
use std::ops::Range;
use vdcache_qcow2::bitmap;
use vdcache_qcow2::bytes::be64_at;
use vdcache_qcow2::entries::{COPIED, L1Entry, L2Mapping};
use vdcache_qcow2::header::field_offset;
use vdcache_qcow2::{Geometry, HostOffset};

/// What a check found.
#[derive(Debug, Clone, Default)]
pub struct CheckReport {
    /// Problems that lose or may lose data (exit code 2).
    pub corruptions: Vec<String>,
    /// Clusters with refcounts higher than their references (exit code 3).
    pub leaks: Vec<String>,
    /// Guest clusters allocated in this image.
    pub allocated_clusters: u64,
    /// Guest clusters the virtual size spans.
    pub total_clusters: u64,
    /// End of the last used cluster.
    pub image_end: u64,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.corruptions.is_empty() && self.leaks.is_empty()
    }

    /// qemu-img check's exit code: 0 clean, 2 corruptions, 3 leaks only.
    pub fn exit_code(&self) -> i32 {
        if !self.corruptions.is_empty() {
            2
        } else if !self.leaks.is_empty() {
            3
        } else {
            0
        }
    }
}

/// An entry of the active tables whose COPIED flag is checked.
#[derive(Debug, Clone, Copy)]
enum Entry {
    L1(usize),
    L2 { guest: u64 },
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Entry::L1(i) => write!(f, "L1 entry {i}"),
            Entry::L2 { guest } => write!(f, "L2 entry of guest cluster {guest}"),
        }
    }
}

/// References counted per host cluster.
struct Tally {
    refs: Vec<u32>,
    file_clusters: u64,
    /// (host cluster, COPIED flag, entry) of entries reachable from the
    /// active L1 table.
    copied_flags: Vec<(u64, bool, Entry)>,
    report: CheckReport,
    /// Corruptions that repair cannot fix.
    unrepairable: usize,
    /// The refcount structure itself is damaged: it is rebuilt elsewhere.
    rebuild_structure: bool,
    /// Clusters of the refcount table and blocks (dropped by a rebuild).
    refcount_structure: Vec<u64>,
    /// Active L1 entries with flags but no L2 table (zeroed by repair).
    stray_l1: Vec<usize>,
}

impl Tally {
    /// A corruption repair leaves alone.
    fn damage(&mut self, msg: String) {
        self.report.corruptions.push(msg);
        self.unrepairable += 1;
    }

    /// Damage of the refcount structure: repair rebuilds it.
    fn refcount_damage(&mut self, msg: String) {
        self.report.corruptions.push(msg);
        self.rebuild_structure = true;
    }

    fn add_range(&mut self, what: &str, offset: u64, len: u64, g: &Geometry) {
        if len == 0 {
            return;
        }
        for c in g.clusters_touched(offset, len) {
            self.add(what, c);
        }
    }

    fn add(&mut self, what: &str, cluster: u64) {
        if cluster >= self.file_clusters {
            self.damage(format!(
                "ERROR {what} at cluster {cluster} lies past the end of the image file"
            ));
            return;
        }
        let r = &mut self.refs[cluster as usize];
        *r = r.saturating_add(1);
    }
}

impl Qcow2Image {
    /// Checks the image; the image must not be written meanwhile.
    pub fn check(&self) -> Result<CheckReport> {
        let mut l = self.lock();
        let mut tally = l.tally()?;
        l.compare(&mut tally)?;
        Ok(tally.report)
    }

    /// Repairs refcounts, the refcount structure and COPIED flags, then
    /// reports what remains. Damage it cannot fix leaves the image as it
    /// was.
    pub fn repair(&self) -> Result<CheckReport> {
        if self.read_only {
            return Err(ImageError::ReadOnly {
                image: self.name().to_string(),
            });
        }
        let mut l = self.lock();
        let mut tally = l.tally()?;
        l.compare(&mut tally)?;
        if tally.unrepairable > 0 {
            // Structural damage (bad entries, data on metadata, references
            // past the end) is beyond refcount repair.
            return Ok(tally.report);
        }
        if tally.rebuild_structure {
            l.rebuild_refcount_structure(&tally)?;
        } else {
            l.rebuild_refcounts(&tally)?;
        }
        l.clear_stray_l1_flags(&tally.stray_l1);
        l.fix_copied_flags(&tally)?;
        l.flush_all(true)?;
        l.m.free_hint = 0;
        let mut tally = l.tally()?;
        l.compare(&mut tally)?;
        Ok(tally.report)
    }

    /// Whether a crash may have left refcounts inconsistent: the dirty bit
    /// is set (lazy refcounts, or a session through a cache), or a metadata
    /// journal is still named in the header (a clean close removes it; a
    /// free whose refcount update had not committed yet is a leak).
    pub(crate) fn is_dirty(&self) -> bool {
        let l = self.lock();
        l.m.dirty_on_disk || l.m.header.extensions.meta_journal.is_some()
    }

    /// Rebuilds refcounts of an image a crash left dirty, then clears the
    /// dirty bit (unless this session keeps it), as QEMU does when it opens
    /// such an image.
    pub(crate) fn repair_dirty(&self, keep_dirty_bit: bool) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        tracing::info!(
            image = self.name(),
            "image was not closed cleanly: rebuilding refcounts"
        );
        let report = self.repair()?;
        if !report.corruptions.is_empty() {
            return Err(ImageError::corrupt(
                self.name(),
                format!(
                    "dirty image could not be repaired: {}",
                    report.corruptions.join("; ")
                ),
            ));
        }
        let mut l = self.lock();
        if keep_dirty_bit || !l.m.dirty_on_disk {
            return Ok(());
        }
        l.set_dirty_bit(false)
    }
}

impl Locked<'_> {
    fn tally(&mut self) -> Result<Tally> {
        let g = self.img.geometry;
        let cs = g.cluster_size();
        let file_len = self
            .img
            .io
            .len(&self.img.handle)
            .map_err(|e| self.io_error("stat", e))?;
        let file_clusters = file_len.div_ceil(cs);
        let mut t = Tally {
            refs: vec![0; file_clusters as usize],
            file_clusters,
            copied_flags: Vec::new(),
            report: CheckReport {
                total_clusters: self.img.size.div_ceil(cs),
                ..CheckReport::default()
            },
            unrepairable: 0,
            rebuild_structure: false,
            refcount_structure: Vec::new(),
            stray_l1: Vec::new(),
        };
        t.add("header", 0);
        let h = self.m.header.clone();
        t.add_range("L1 table", h.l1_table_offset, u64::from(h.l1_size) * 8, &g);
        let active = self.m.l1.clone();
        self.tally_l1(&mut t, &active, true)?;
        if h.nb_snapshots > 0 {
            let table_len = vdcache_qcow2::snapshot::encode_table(&self.m.snapshots).len() as u64;
            t.add_range("snapshot table", h.snapshots_offset, table_len, &g);
            for s in self.m.snapshots.clone() {
                t.add_range(
                    "snapshot L1 table",
                    s.l1_table_offset,
                    u64::from(s.l1_size) * 8,
                    &g,
                );
                let l1 =
                    self.read_u64_table(s.l1_table_offset, u64::from(s.l1_size), MetaTable::L1)?;
                self.tally_l1(&mut t, &l1, false)?;
            }
        }
        t.add_range(
            "refcount table",
            h.refcount_table_offset,
            h.refcount_table_bytes(),
            &g,
        );
        t.refcount_structure
            .extend(g.clusters_touched(h.refcount_table_offset, h.refcount_table_bytes()));
        for (i, &b) in self.m.reftable.iter().enumerate() {
            if b == 0 {
                continue;
            }
            let cluster = g.host_cluster(HostOffset(b));
            if !g.is_cluster_aligned(b) {
                t.refcount_damage(format!(
                    "ERROR refcount block {i} at {b:#x} is not cluster aligned"
                ));
            } else if cluster >= t.file_clusters {
                t.refcount_damage(format!(
                    "ERROR refcount block {i} at {b:#x} lies past the end of the image file"
                ));
            } else {
                t.add("refcount block", cluster);
                t.refcount_structure.push(cluster);
            }
        }
        self.tally_bitmaps(&mut t)?;
        self.tally_journal(&mut t);
        for o in crate::qimage::overlap_report(&g, &self.m) {
            if o.involves_refcounts() {
                t.refcount_damage(format!("ERROR metadata overlap: {o}"));
            } else {
                t.damage(format!("ERROR metadata overlap: {o}"));
            }
        }
        t.report.image_end = t
            .refs
            .iter()
            .rposition(|&r| r > 0)
            .map_or(0, |c| (c as u64 + 1) * cs);
        Ok(t)
    }

    fn read_u64_table(&self, offset: u64, entries: u64, table: MetaTable) -> Result<Vec<u64>> {
        let mut raw = vec![0u8; (entries * 8) as usize];
        self.img
            .io
            .read(
                &self.img.handle,
                HostOffset(offset),
                &mut raw,
                IoTag::meta(table, self.img.disk),
            )
            .map_err(|e| self.io_error("read table", e))?;
        Ok((0..entries as usize).map(|i| be64_at(&raw, i)).collect())
    }

    fn tally_l1(&mut self, t: &mut Tally, l1: &[u64], active: bool) -> Result<()> {
        let g = self.img.geometry;
        let entry_size = g.l2_entry_size() as usize;
        for (i, &raw) in l1.iter().enumerate() {
            let e = match L1Entry::decode(raw, &g) {
                Ok(e) => e,
                Err(err) => {
                    t.damage(format!("ERROR L1 entry {i}: {err}"));
                    continue;
                }
            };
            let Some(table) = e.l2_offset else {
                if raw != 0 && active {
                    t.report.corruptions.push(format!(
                        "ERROR L1 entry {i} is {raw:#018x}: COPIED is set but there is no L2 table (offset 0 is the header)"
                    ));
                    t.stray_l1.push(i);
                }
                continue;
            };
            let table_cluster = g.host_cluster(table);
            if table_cluster >= t.file_clusters {
                t.damage(format!(
                    "ERROR L2 table of L1 entry {i} at {:#x} lies past the end of the file",
                    table.0
                ));
                continue;
            }
            t.add("L2 table", table_cluster);
            if active {
                t.copied_flags.push((table_cluster, e.copied, Entry::L1(i)));
            }
            let content = self.read_whole_l2(table.0, i as u64 * g.l2_entries())?;
            for j in 0..g.l2_entries() as usize {
                let raw = be64_at(&content, j * entry_size / 8);
                let bitmap = if g.extended_l2() {
                    be64_at(&content, j * entry_size / 8 + 1)
                } else {
                    0
                };
                let guest = i as u64 * g.l2_entries() + j as u64;
                match L2Mapping::decode(raw, bitmap, &self.img.format) {
                    Err(err) => t.damage(format!("ERROR L2 entry of guest cluster {guest}: {err}")),
                    Ok(L2Mapping::Compressed(d)) => {
                        if active {
                            t.report.allocated_clusters += 1;
                        }
                        let (start, len) = d.sector_range();
                        t.add_range("compressed cluster", start, len, &g);
                    }
                    Ok(L2Mapping::Standard(s)) => {
                        if active && s.alloc != 0 {
                            t.report.allocated_clusters += 1;
                        }
                        let Some(h) = s.host else { continue };
                        if self.img.external_data {
                            continue;
                        }
                        if let Some((c, kind)) =
                            self.m.map.conflict(&g, h.0, g.cluster_size(), None)
                        {
                            t.damage(format!(
                                "ERROR L2 entry of guest cluster {guest}: its data cluster {c} overlaps the {} (metadata overlap)",
                                kind.describe()
                            ));
                        }
                        t.add("data cluster", g.host_cluster(h));
                        if active {
                            t.copied_flags
                                .push((g.host_cluster(h), s.copied, Entry::L2 { guest }));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// vdcache's metadata journal area, while the header names it.
    fn tally_journal(&mut self, t: &mut Tally) {
        if let Some(j) = self.m.header.extensions.meta_journal {
            t.add_range("metadata journal", j.offset, j.size, &self.img.geometry);
        }
    }

    fn tally_bitmaps(&mut self, t: &mut Tally) -> Result<()> {
        let g = self.img.geometry;
        let Some(ext) = self.m.header.extensions.bitmaps else {
            return Ok(());
        };
        if self.m.header.autoclear_features & vdcache_qcow2::features::autoclear::BITMAPS == 0 {
            return Ok(());
        }
        t.add_range(
            "bitmap directory",
            ext.directory_offset,
            ext.directory_size,
            &g,
        );
        for b in self.m.bitmaps.clone() {
            t.add_range(
                "bitmap table",
                b.table_offset,
                u64::from(b.table_size) * 8,
                &g,
            );
            let table =
                self.read_u64_table(b.table_offset, u64::from(b.table_size), MetaTable::Bitmap)?;
            let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_be_bytes()).collect();
            match bitmap::table_data_clusters(&bytes, &g) {
                Ok(clusters) => {
                    for off in clusters {
                        t.add("bitmap data", g.host_cluster(HostOffset(off)));
                    }
                }
                Err(e) => t
                    .report
                    .corruptions
                    .push(format!("ERROR bitmap '{}': {e}", b.name)),
            }
        }
        Ok(())
    }

    /// The clusters whose refcounts are compared: those the file holds, as
    /// QEMU does. A refcount past the end of the file describes no data,
    /// and counting up to the last refcount block the table names would
    /// let a crafted table (many entries, 1-bit refcounts) make the check
    /// run for hours.
    fn clusters_to_compare(&self, t: &Tally) -> Range<u64> {
        0..t.file_clusters
    }

    /// Adds what the stored refcounts say against the counted ones.
    fn compare(&mut self, t: &mut Tally) -> Result<()> {
        let per_block = self.img.geometry.refcount_block_entries();
        let mut clusters = self.clusters_to_compare(t);
        while let Some(c) = clusters.next() {
            let expected = t.refs.get(c as usize).copied().map_or(0, u64::from);
            let stored = match self.refcount(c) {
                Ok(v) => v,
                Err(e) => {
                    t.refcount_damage(format!(
                        "ERROR the refcounts of clusters {c}.. cannot be read: {e}"
                    ));
                    // The rest of that refcount block reads no better.
                    let next = (c / per_block + 1) * per_block;
                    clusters = next.max(c + 1)..clusters.end;
                    continue;
                }
            };
            if stored < expected {
                t.report.corruptions.push(format!(
                    "ERROR cluster {c} refcount={stored} reference={expected}"
                ));
            } else if stored > expected {
                t.report.leaks.push(format!(
                    "Leaked cluster {c} refcount={stored} reference={expected}"
                ));
            }
        }
        for &(cluster, copied, what) in &t.copied_flags {
            let Ok(stored) = self.refcount(cluster) else {
                continue;
            };
            if (stored == 1) != copied {
                t.report.corruptions.push(format!(
                    "ERROR OFLAG_COPIED {what}: host cluster {cluster} refcount={stored} but COPIED is {}",
                    if copied { "set" } else { "clear" }
                ));
            }
        }
        Ok(())
    }

    /// Zeroes active L1 entries that carry flags but no L2 table.
    fn clear_stray_l1_flags(&mut self, entries: &[usize]) {
        for &i in entries {
            if let Some(e) = self.m.l1.get_mut(i) {
                *e = 0;
                self.m.l1_dirty.insert(i as u64);
            }
        }
    }

    /// Writes a new refcount table and blocks after the end of the file,
    /// describing the counted references (the old structure's clusters
    /// become free), makes them durable, then points the header at them.
    /// A crash before the header write leaves the old structure in use.
    fn rebuild_refcount_structure(&mut self, t: &Tally) -> Result<()> {
        let g = self.img.geometry;
        let cs = g.cluster_size();
        let per_block = g.refcount_block_entries();
        let mut refs: Vec<u64> = t.refs.iter().map(|&r| u64::from(r)).collect();
        for &c in &t.refcount_structure {
            if let Some(r) = refs.get_mut(c as usize) {
                *r = r.saturating_sub(1);
            }
        }
        let start = t.file_clusters.max(1);
        let (mut table, mut blocks) = (1u64, 1u64);
        loop {
            let need_blocks = (start + table + blocks).div_ceil(per_block);
            let need_table = (need_blocks * 8).div_ceil(cs);
            if need_blocks <= blocks && need_table <= table {
                break;
            }
            blocks = blocks.max(need_blocks);
            table = table.max(need_table);
        }
        if table * cs > vdcache_qcow2::header::MAX_REFCOUNT_TABLE_BYTES {
            return Err(ImageError::corrupt(
                self.name(),
                "a rebuilt refcount table would exceed 8 MiB",
            ));
        }
        let end = start + table + blocks;
        refs.resize(end as usize, 0);
        refs[start as usize..].fill(1);
        self.check_capacity(end)?;
        let order = g.refcount_order();
        let name = self.img.handle.name.clone();
        let blocks_start = start + table;
        for b in 0..blocks {
            let mut block = vec![0u8; cs as usize];
            let first = (b * per_block) as usize;
            let last = (first + per_block as usize).min(refs.len());
            for (i, &r) in refs[first.min(last)..last].iter().enumerate() {
                if r > 0 {
                    vdcache_qcow2::refcount::set(&mut block, i as u64, order, r)
                        .map_err(|e| ImageError::format(&name, e))?;
                }
            }
            self.write_meta(
                MetaTable::RefcountBlock,
                g.cluster_offset(blocks_start + b),
                &block,
            )?;
        }
        let entries: Vec<u64> = (0..table * cs / 8)
            .map(|i| {
                if i < blocks {
                    g.cluster_offset(blocks_start + i)
                } else {
                    0
                }
            })
            .collect();
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.write_meta(MetaTable::RefcountTable, g.cluster_offset(start), &bytes)?;
        self.sync(crate::hostio::FlushKind::Durable)?;
        let mut fields = Vec::with_capacity(12);
        fields.extend_from_slice(&g.cluster_offset(start).to_be_bytes());
        fields.extend_from_slice(&(table as u32).to_be_bytes());
        self.write_header_field(field_offset::REFCOUNT_TABLE_OFFSET, &fields)?;
        self.sync(crate::hostio::FlushKind::Durable)?;
        tracing::info!(
            image = self.name(),
            "rebuilt the refcount structure: {table} table and {blocks} block clusters at cluster {start}"
        );
        self.m.header.refcount_table_offset = g.cluster_offset(start);
        self.m.header.refcount_table_clusters = table as u32;
        self.m.reftable = entries;
        self.m.reftable_dirty.clear();
        self.m.reftable_moved_from = None;
        self.m.refblocks.clear();
        self.m.free_hint = 0;
        self.m.map = crate::qimage::metadata_map(&g, &self.m);
        Ok(())
    }

    fn rebuild_refcounts(&mut self, t: &Tally) -> Result<()> {
        // New refcount blocks must land past everything referenced.
        self.m.free_hint = t.file_clusters.max(1);
        let mut missing = Vec::new();
        for c in self.clusters_to_compare(t) {
            let expected = t.refs.get(c as usize).copied().map_or(0, u64::from);
            if self.refcount(c)? == expected {
                continue;
            }
            match self.set_refcount(c, expected) {
                Ok(()) => {}
                Err(ImageError::Corrupt { .. }) if expected > 0 => missing.push((c, expected)),
                Err(e) => return Err(e),
            }
        }
        for (c, expected) in missing {
            self.ensure_refcount_blocks(c..c + 1)?;
            self.set_refcount(c, expected)?;
        }
        Ok(())
    }

    fn fix_copied_flags(&mut self, t: &Tally) -> Result<()> {
        let g = self.img.geometry;
        for i in 0..self.m.l1.len() {
            let raw = self.m.l1[i];
            let Ok(L1Entry {
                l2_offset: Some(table),
                copied,
            }) = L1Entry::decode(raw, &g)
            else {
                continue;
            };
            let want = self.refcount(g.host_cluster(table))? == 1;
            if want != copied {
                self.m.l1[i] = if want { raw | COPIED } else { raw & !COPIED };
                self.m.l1_dirty.insert(i as u64);
            }
        }
        for &(cluster, copied, entry) in &t.copied_flags {
            let Entry::L2 { guest } = entry else { continue };
            let want = self.refcount(cluster)? == 1;
            if want == copied {
                continue;
            }
            let table_owned = self
                .m
                .l1
                .get(g.l1_index(guest) as usize)
                .is_some_and(|&e| e & COPIED != 0);
            if !table_owned {
                continue;
            }
            if let L2Mapping::Standard(mut s) = self.l2_entry(guest)? {
                s.copied = want;
                self.set_l2_entry(guest, &L2Mapping::Standard(s))?;
            }
        }
        Ok(())
    }
}
