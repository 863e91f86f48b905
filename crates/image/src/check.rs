//! Consistency check and refcount repair of one qcow2 image, as `qemu-img
//! check` does it: every reference from the header, L1/L2 tables (active
//! and snapshots), refcount structures, snapshot table and bitmaps is
//! counted and compared with the stored refcounts; COPIED flags of the
//! active tables are compared with refcount 1.
//!
//! Repair sets every refcount to the counted value (leaks and missing
//! references alike) and fixes COPIED flags in tables the image owns. It is
//! how an image left dirty by lazy refcounts is made consistent on open.

use crate::error::{ImageError, Result};
use crate::hostio::{IoTag, MetaTable};
use crate::qimage::{Locked, Qcow2Image};
use std::ops::Range;
use vdcache_qcow2::bitmap;
use vdcache_qcow2::bytes::be64_at;
use vdcache_qcow2::entries::{COPIED, L1Entry, L2Mapping};
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
}

impl Tally {
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
            self.report.corruptions.push(format!(
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
        let tally = l.tally()?;
        l.compare(tally)
    }

    /// Repairs refcounts and COPIED flags, then reports what remains.
    pub fn repair(&self) -> Result<CheckReport> {
        if self.read_only {
            return Err(ImageError::ReadOnly {
                image: self.name().to_string(),
            });
        }
        let mut l = self.lock();
        let tally = l.tally()?;
        if !tally.report.corruptions.is_empty() {
            // Structural damage (bad entries, references past the end) is
            // beyond refcount repair.
            return Ok(tally.report);
        }
        l.rebuild_refcounts(&tally)?;
        l.fix_copied_flags(&tally)?;
        l.flush_all(true)?;
        l.m.free_hint = 0;
        let tally = l.tally()?;
        l.compare(tally)
    }

    /// Rebuilds refcounts of an image a crash left dirty (lazy refcounts),
    /// then clears the dirty bit, as QEMU does when it opens such an image.
    pub(crate) fn repair_if_dirty(&self) -> Result<()> {
        if self.read_only || !self.lock().m.dirty_on_disk {
            return Ok(());
        }
        tracing::info!(image = self.name(), "image is dirty: rebuilding refcounts");
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
        for (i, &b) in self.m.reftable.iter().enumerate() {
            if b != 0 {
                if !g.is_cluster_aligned(b) {
                    t.report
                        .corruptions
                        .push(format!("ERROR refcount block {i} is not cluster aligned"));
                    continue;
                }
                t.add("refcount block", g.host_cluster(HostOffset(b)));
            }
        }
        self.tally_bitmaps(&mut t)?;
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
                    t.report
                        .corruptions
                        .push(format!("ERROR L1 entry {i}: {err}"));
                    continue;
                }
            };
            let Some(table) = e.l2_offset else { continue };
            let table_cluster = g.host_cluster(table);
            if table_cluster >= t.file_clusters {
                t.report.corruptions.push(format!(
                    "ERROR L2 table of L1 entry {i} lies past the end of the file"
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
                    Err(err) => t
                        .report
                        .corruptions
                        .push(format!("ERROR L2 entry of guest cluster {guest}: {err}")),
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
                        if !g.is_cluster_aligned(h.0) {
                            t.report
                                .corruptions
                                .push(format!("ERROR L2 entry of guest cluster {guest}: host offset {:#x} is not cluster aligned", h.0));
                            continue;
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

    /// Clusters the refcount structures can describe or the file holds.
    fn clusters_to_compare(&self, t: &Tally) -> Range<u64> {
        let per_block = self.img.geometry.refcount_block_entries();
        let covered = self
            .m
            .reftable
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |i| (i as u64 + 1) * per_block);
        0..covered.max(t.file_clusters)
    }

    fn compare(&mut self, mut t: Tally) -> Result<CheckReport> {
        for c in self.clusters_to_compare(&t) {
            let expected = t.refs.get(c as usize).copied().map_or(0, u64::from);
            let stored = self.refcount(c)?;
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
        for (cluster, copied, what) in std::mem::take(&mut t.copied_flags) {
            let stored = self.refcount(cluster)?;
            if (stored == 1) != copied {
                t.report.corruptions.push(format!(
                    "ERROR OFLAG_COPIED {what}: host cluster {cluster} refcount={stored} but COPIED is {}",
                    if copied { "set" } else { "clear" }
                ));
            }
        }
        Ok(t.report)
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
