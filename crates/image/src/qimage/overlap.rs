//! Where an image's metadata lives, so that nothing is written over it
//! (QEMU's overlap checks, "cached" mode): the header, the active L1 and
//! L2 tables, the refcount table and blocks, the snapshot table and the
//! snapshots' L1 tables, the bitmap directory and tables. Every write is
//! checked against it: guest data may land on no metadata at all, and a
//! table only on clusters that hold the same table or nothing yet. A data
//! cluster that an L2 entry points into metadata is refused when read too.
//!
//! The map is built when the image opens (metadata that overlaps other
//! metadata makes the image unwritable) and kept current where tables are
//! allocated, moved and freed. It costs one hash lookup per cluster an I/O
//! touches.
//!
//! Must not: decide what happens to a corrupt image (`Locked::corruption`
//! does) or do I/O.

use super::Meta;
use crate::hostio::MetaTable;
use std::collections::HashMap;
use vdcache_qcow2::entries::L1Entry;
use vdcache_qcow2::{Geometry, snapshot};

/// What a metadata cluster holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MetaKind {
    Header,
    ActiveL1,
    /// An active L2 table, with the L1 index that points to it.
    ActiveL2(u64),
    RefcountTable,
    /// A refcount block, with its refcount table index.
    RefcountBlock(u64),
    SnapshotTable,
    InactiveL1,
    BitmapDirectory,
    BitmapTable,
    /// vdcache's metadata journal area.
    Journal,
}

impl MetaKind {
    /// QEMU's words for it, for messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            MetaKind::Header => "qcow2 header",
            MetaKind::ActiveL1 => "active L1 table",
            MetaKind::ActiveL2(_) => "active L2 table",
            MetaKind::RefcountTable => "refcount table",
            MetaKind::RefcountBlock(_) => "refcount block",
            MetaKind::SnapshotTable => "snapshot table",
            MetaKind::InactiveL1 => "inactive L1 table",
            MetaKind::BitmapDirectory => "bitmap directory",
            MetaKind::BitmapTable => "bitmap table",
            MetaKind::Journal => "vdcache metadata journal",
        }
    }

    /// Whether a write of `table` may land on a cluster of this kind.
    fn accepts(self, table: MetaTable) -> bool {
        matches!(
            (self, table),
            (MetaKind::Header, MetaTable::Header)
                | (MetaKind::ActiveL1, MetaTable::L1)
                | (MetaKind::ActiveL2(_), MetaTable::L2)
                | (MetaKind::RefcountTable, MetaTable::RefcountTable)
                | (MetaKind::RefcountBlock(_), MetaTable::RefcountBlock)
                | (MetaKind::SnapshotTable, MetaTable::SnapshotTable)
                | (MetaKind::Journal, MetaTable::Journal)
                | (
                    MetaKind::BitmapDirectory | MetaKind::BitmapTable,
                    MetaTable::Bitmap
                )
        )
    }
}

/// Two structures found on one cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Overlap {
    pub cluster: u64,
    pub existing: MetaKind,
    pub new: MetaKind,
}

impl Overlap {
    /// Whether a refcount table or block is one of the two: rebuilding
    /// the refcount structure elsewhere resolves it.
    pub(crate) fn involves_refcounts(&self) -> bool {
        [self.existing, self.new]
            .iter()
            .any(|k| matches!(k, MetaKind::RefcountTable | MetaKind::RefcountBlock(_)))
    }
}

impl std::fmt::Display for Overlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the {} at cluster {} overlaps the {}",
            self.new.describe(),
            self.cluster,
            self.existing.describe()
        )
    }
}

/// Host clusters holding metadata.
#[derive(Debug, Default)]
pub(crate) struct MetaMap {
    clusters: HashMap<u64, MetaKind>,
}

impl MetaMap {
    /// Records `len` bytes from `offset` as `kind`; an overlap with other
    /// metadata is reported (and the cluster keeps its first kind).
    pub(crate) fn insert(
        &mut self,
        g: &Geometry,
        offset: u64,
        len: u64,
        kind: MetaKind,
    ) -> Result<(), Overlap> {
        let mut first = Ok(());
        for cluster in g.clusters_touched(offset, len.max(1)) {
            match self.clusters.get(&cluster) {
                Some(&existing) if existing != kind => {
                    if first.is_ok() {
                        first = Err(Overlap {
                            cluster,
                            existing,
                            new: kind,
                        });
                    }
                }
                Some(_) => {}
                None => {
                    self.clusters.insert(cluster, kind);
                }
            }
        }
        first
    }

    /// Forgets clusters that no longer hold `kind`.
    pub(crate) fn remove(&mut self, g: &Geometry, offset: u64, len: u64, kind: MetaKind) {
        for cluster in g.clusters_touched(offset, len.max(1)) {
            if self.clusters.get(&cluster) == Some(&kind) {
                self.clusters.remove(&cluster);
            }
        }
    }

    /// What cluster `cluster` holds, if metadata.
    pub(crate) fn kind_at(&self, cluster: u64) -> Option<MetaKind> {
        self.clusters.get(&cluster).copied()
    }

    /// Forgets a freed cluster, whatever it held.
    pub(crate) fn forget(&mut self, cluster: u64) {
        self.clusters.remove(&cluster);
    }

    /// The metadata a write of `len` bytes at `offset` would land on:
    /// guest data (`table` None) may land on none, a table on clusters of
    /// its own kind or on none.
    pub(crate) fn conflict(
        &self,
        g: &Geometry,
        offset: u64,
        len: u64,
        table: Option<MetaTable>,
    ) -> Option<(u64, MetaKind)> {
        if self.clusters.is_empty() || len == 0 {
            return None;
        }
        g.clusters_touched(offset, len).find_map(|c| {
            let kind = *self.clusters.get(&c)?;
            let allowed = table.is_some_and(|t| kind.accepts(t));
            (!allowed).then_some((c, kind))
        })
    }
}

/// The name of a table a write is for, for messages.
pub(crate) fn table_name(table: MetaTable) -> &'static str {
    match table {
        MetaTable::Header => "qcow2 header",
        MetaTable::L1 => "L1 table",
        MetaTable::L2 => "L2 table",
        MetaTable::RefcountTable => "refcount table",
        MetaTable::RefcountBlock => "refcount block",
        MetaTable::SnapshotTable => "snapshot table",
        MetaTable::Bitmap => "bitmap directory",
        MetaTable::Journal => "metadata journal",
    }
}

/// The map of an image's metadata as read at open, and every overlap of
/// two structures found on the way.
pub(crate) fn build(g: &Geometry, m: &Meta) -> (MetaMap, Vec<Overlap>) {
    let h = &m.header;
    let cs = g.cluster_size();
    let mut places: Vec<(u64, u64, MetaKind)> = vec![
        (0, cs, MetaKind::Header),
        (
            h.l1_table_offset,
            u64::from(h.l1_size) * 8,
            MetaKind::ActiveL1,
        ),
        (
            h.refcount_table_offset,
            h.refcount_table_bytes(),
            MetaKind::RefcountTable,
        ),
    ];
    if h.nb_snapshots > 0 {
        let len = snapshot::encode_table(&m.snapshots).len() as u64;
        places.push((h.snapshots_offset, len, MetaKind::SnapshotTable));
    }
    for s in &m.snapshots {
        places.push((
            s.l1_table_offset,
            u64::from(s.l1_size) * 8,
            MetaKind::InactiveL1,
        ));
    }
    if let Some(b) = h.extensions.bitmaps {
        places.push((
            b.directory_offset,
            b.directory_size,
            MetaKind::BitmapDirectory,
        ));
        for t in &m.bitmaps {
            places.push((
                t.table_offset,
                u64::from(t.table_size) * 8,
                MetaKind::BitmapTable,
            ));
        }
    }
    if let Some(j) = h.extensions.meta_journal {
        places.push((j.offset, j.size, MetaKind::Journal));
    }
    for (i, &block) in m.reftable.iter().enumerate() {
        if block != 0 && g.is_cluster_aligned(block) {
            places.push((block, cs, MetaKind::RefcountBlock(i as u64)));
        }
    }
    for (i, &raw) in m.l1.iter().enumerate() {
        if let Ok(L1Entry {
            l2_offset: Some(table),
            ..
        }) = L1Entry::decode(raw, g)
        {
            places.push((table.0, cs, MetaKind::ActiveL2(i as u64)));
        }
    }
    let mut map = MetaMap::default();
    let mut overlaps = Vec::new();
    for (offset, len, kind) in places.into_iter().filter(|p| p.1 > 0) {
        if let Err(o) = map.insert(g, offset, len, kind) {
            overlaps.push(o);
        }
    }
    (map, overlaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_lands_on_no_metadata_and_tables_on_their_own() {
        let g = Geometry::new(16, false, 4).unwrap();
        let cs = g.cluster_size();
        let mut m = MetaMap::default();
        m.insert(&g, 0, cs, MetaKind::Header).unwrap();
        m.insert(&g, 3 * cs, 8, MetaKind::ActiveL1).unwrap();
        m.insert(&g, 5 * cs, cs, MetaKind::ActiveL2(0)).unwrap();
        assert_eq!(m.conflict(&g, 4 * cs, cs, None), None);
        assert_eq!(
            m.conflict(&g, 4 * cs, cs + 1, None),
            Some((5, MetaKind::ActiveL2(0)))
        );
        assert_eq!(m.conflict(&g, 5 * cs + 8, 8, Some(MetaTable::L2)), None);
        assert_eq!(
            m.conflict(&g, 3 * cs, 512, Some(MetaTable::RefcountBlock)),
            Some((3, MetaKind::ActiveL1))
        );
        assert_eq!(m.conflict(&g, 512, 8, None), Some((0, MetaKind::Header)));
        // A refcount block placed on the L1 table is an overlap.
        let e = m
            .insert(&g, 3 * cs, cs, MetaKind::RefcountBlock(0))
            .unwrap_err();
        assert_eq!(e.existing, MetaKind::ActiveL1);
        assert!(
            e.to_string().contains("overlaps the active L1 table"),
            "{e}"
        );
        // Two L1 entries sharing one L2 table are one too.
        assert!(m.insert(&g, 5 * cs, cs, MetaKind::ActiveL2(1)).is_err());
        m.remove(&g, 5 * cs, cs, MetaKind::ActiveL2(0));
        assert_eq!(m.conflict(&g, 5 * cs, 8, None), None);
    }
}
