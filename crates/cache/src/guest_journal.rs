//! Journal awareness (JCache, paper 002, section III): what a guest's ext4
//! journal, written to its virtual journal device, says about the blocks
//! of the disk it journals for. Each journal device is linked to its data
//! disk; the blocks written to the device are parsed as JBD2 (superblock,
//! descriptor, commit and revoke blocks), and each descriptor's tags say
//! which file-system block the journal blocks after it hold a copy of. An
//! in-place write of file-system block B then asks which journal block
//! holds B's newest logged copy: its cache block may already hold the very
//! bytes being written (logical caching).
//!
//! Owns: the links between journal devices and data disks, each device's
//! parsed superblock, its logged-copy map, and its parse counters.
//! Must not: do I/O, touch the index, or decide that two blocks hold the
//! same bytes: it only names candidates, which the cache compares byte for
//! byte before sharing a block. A stale, torn or malformed log can then
//! cost a missed sharing, never a wrong mapping.

use std::collections::HashMap;
use vdcache_contract::DiskId;
use vdcache_jbd2::{self as jbd2, Jbd2Error};

/// The only file-system block size logical caching maps: the cache's own
/// block (a file system of smaller blocks is cached like any disk).
pub(crate) const FS_BLOCK: u32 = crate::layout::BLOCK as u32;

/// What parsing one journal device found so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct JournalCounts {
    /// Descriptor blocks parsed.
    pub descriptors: u64,
    pub commits: u64,
    pub revokes: u64,
    /// Journal blocks recorded as a logged copy of a file-system block.
    pub logged_blocks: u64,
    /// Logged copies left out because the kernel escaped them (their
    /// first bytes differ from the file-system block's).
    pub escaped: u64,
    /// Malformed journal blocks (bad checksum, impossible fields), and
    /// superblocks logical caching cannot use: each left out, logged.
    pub errors: u64,
}

/// A journal block that may hold the bytes of an in-place write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// The journal device's image in the cache.
    pub image: u16,
    pub journal_block: u32,
}

/// One journal device.
#[derive(Debug)]
struct Tracker {
    data: DiskId,
    /// Cluster size of the data disk's top image (guest offsets of its
    /// writes are computed from the guest cluster and the host offset).
    data_cluster_bits: u32,
    /// The device's image id, once it was written through the cache.
    image: Option<u16>,
    sb: Option<jbd2::Superblock>,
    /// Journal block → the file-system block it holds a copy of.
    logged: HashMap<u32, u64>,
    /// File-system block → the journal block of its newest copy.
    newest: HashMap<u64, u32>,
    counts: JournalCounts,
}

impl Tracker {
    fn forget(&mut self, at: u32) {
        if let Some(target) = self.logged.remove(&at)
            && self.newest.get(&target) == Some(&at)
        {
            self.newest.remove(&target);
        }
    }

    fn record(&mut self, at: u32, target: u64) {
        self.forget(at);
        self.logged.insert(at, target);
        self.newest.insert(target, at);
        self.counts.logged_blocks += 1;
    }

    /// Takes a superblock in, if logical caching can use it.
    fn take_superblock(&mut self, block: &[u8]) -> Result<(), Jbd2Error> {
        let sb = jbd2::Superblock::parse(block)?;
        if sb.block_size != FS_BLOCK {
            self.sb = None;
            return Err(Jbd2Error::Superblock(format!(
                "block size {}: logical caching maps {FS_BLOCK}-byte blocks only",
                sb.block_size
            )));
        }
        self.sb = Some(sb);
        Ok(())
    }

    /// One whole block written at journal block `at`.
    fn observe(&mut self, at: u32, block: &[u8]) -> Result<(), Jbd2Error> {
        let Some(header) = jbd2::Header::of(block) else {
            // A data block: a copy if a descriptor named its place.
            return Ok(());
        };
        // A metadata block holds no copy.
        self.forget(at);
        match header.block_type {
            jbd2::SUPERBLOCK_V1 | jbd2::SUPERBLOCK_V2 => self.take_superblock(block),
            jbd2::DESCRIPTOR => self.descriptor(at, block),
            jbd2::COMMIT => {
                self.counts.commits += 1;
                match &self.sb {
                    Some(sb) if !jbd2::commit_checksum_ok(sb, block) => Err(Jbd2Error::Block {
                        block: at,
                        reason: "commit block checksum does not match".into(),
                    }),
                    _ => Ok(()),
                }
            }
            jbd2::REVOKE => {
                self.counts.revokes += 1;
                // Revoked copies need nothing here: a copy is only ever
                // shared when its bytes equal the in-place write's.
                match &self.sb {
                    Some(sb) => jbd2::parse_revoke(sb, at, block).map(|_| ()),
                    None => Ok(()),
                }
            }
            other => Err(Jbd2Error::Block {
                block: at,
                reason: format!("unknown block type {other}"),
            }),
        }
    }

    fn descriptor(&mut self, at: u32, block: &[u8]) -> Result<(), Jbd2Error> {
        let Some(sb) = self.sb.clone() else {
            return Err(Jbd2Error::Block {
                block: at,
                reason: "a descriptor before any journal superblock was seen".into(),
            });
        };
        if !(sb.first..sb.log_end()).contains(&at) {
            return Err(Jbd2Error::Block {
                block: at,
                reason: format!(
                    "a descriptor outside the log {}..{}",
                    sb.first,
                    sb.log_end()
                ),
            });
        }
        let tags = jbd2::parse_descriptor(&sb, at, block)?;
        self.counts.descriptors += 1;
        let mut pos = at;
        for tag in tags {
            pos = sb.next(pos);
            if tag.escaped() {
                self.counts.escaped += 1;
                self.forget(pos);
            } else {
                self.record(pos, tag.target);
            }
        }
        Ok(())
    }
}

/// Every linked journal device.
#[derive(Debug, Default)]
pub(crate) struct GuestJournals {
    /// By journal device.
    devices: HashMap<DiskId, Tracker>,
    /// Data disk → its journal device.
    by_data: HashMap<DiskId, DiskId>,
}

impl GuestJournals {
    /// Links journal device `journal` to data disk `data`, whose top
    /// image has clusters of `1 << data_cluster_bits` bytes. `superblock`:
    /// the device's JBD2 superblock block as it is now, if known (the
    /// kernel rewrites it only now and then).
    pub(crate) fn link(
        &mut self,
        journal: DiskId,
        data: DiskId,
        data_cluster_bits: u32,
        superblock: Option<&[u8]>,
    ) -> Result<(), Jbd2Error> {
        if let Some(old) = self.devices.remove(&journal) {
            self.by_data.remove(&old.data);
        }
        let mut t = Tracker {
            data,
            data_cluster_bits,
            image: None,
            sb: None,
            logged: HashMap::new(),
            newest: HashMap::new(),
            counts: JournalCounts::default(),
        };
        let result = match superblock {
            Some(b) if jbd2::Header::of(b).is_some() => t.take_superblock(b),
            _ => Ok(()),
        };
        self.by_data.insert(data, journal);
        self.devices.insert(journal, t);
        result
    }

    /// Whether disk `disk` is a linked journal device.
    pub(crate) fn is_journal(&self, disk: DiskId) -> bool {
        self.devices.contains_key(&disk)
    }

    /// Whether disk `disk` has a linked journal device.
    pub(crate) fn has_journal(&self, disk: DiskId) -> bool {
        self.by_data.contains_key(&disk)
    }

    /// Journal device `journal` (image `image` in the cache) took a whole
    /// block at journal block `at`. An error names a block left out.
    pub(crate) fn observe(
        &mut self,
        journal: DiskId,
        image: u16,
        at: u32,
        block: &[u8],
    ) -> Result<(), Jbd2Error> {
        let Some(t) = self.devices.get_mut(&journal) else {
            return Ok(());
        };
        t.image = Some(image);
        let result = t.observe(at, block);
        if result.is_err() {
            t.counts.errors += 1;
        }
        result
    }

    /// Journal block `at` of `journal` changed in part, or was discarded:
    /// what it held is no longer known.
    pub(crate) fn forget(&mut self, journal: DiskId, at: u32) {
        if let Some(t) = self.devices.get_mut(&journal) {
            t.forget(at);
        }
    }

    /// The file-system block a guest-data block of data disk `data` is:
    /// the block at host offset `host` of a write segment that starts at
    /// host offset `start` and serves guest cluster `cluster` (a segment
    /// is contiguous in both spaces). `None` when it is not one whole
    /// file-system block.
    pub(crate) fn fs_block(
        &self,
        data: DiskId,
        cluster: u64,
        start: u64,
        host: u64,
    ) -> Option<u64> {
        let journal = self.by_data.get(&data)?;
        let bits = self.devices.get(journal)?.data_cluster_bits;
        let cluster_bytes = 1u64.checked_shl(bits)?;
        let guest = cluster
            .checked_mul(cluster_bytes)?
            .checked_add(start & (cluster_bytes - 1))?
            .checked_add(host.checked_sub(start)?)?;
        guest
            .is_multiple_of(u64::from(FS_BLOCK))
            .then_some(guest / u64::from(FS_BLOCK))
    }

    /// The journal block holding the newest logged copy of file-system
    /// block `fs_block` of data disk `data`, if the log names one.
    pub(crate) fn candidate(&self, data: DiskId, fs_block: u64) -> Option<Candidate> {
        let t = self.devices.get(self.by_data.get(&data)?)?;
        t.sb.as_ref()?;
        let at = *t.newest.get(&fs_block)?;
        (t.logged.get(&at) == Some(&fs_block)).then_some(Candidate {
            image: t.image?,
            journal_block: at,
        })
    }

    /// Counters of journal device `journal`.
    pub(crate) fn counts(&self, journal: DiskId) -> Option<JournalCounts> {
        self.devices.get(&journal).map(|t| t.counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdcache_jbd2::build::Writer;

    const JOURNAL: DiskId = DiskId(9);
    const DATA: DiskId = DiskId(1);
    const IMAGE: u16 = 3;

    /// A journal of `blocks` 4 KiB blocks with csum v3 and 64-bit tags
    /// (superblock in block 0, the log from block 1).
    fn writer(blocks: u32) -> Writer {
        Writer::new(
            2,
            FS_BLOCK,
            blocks,
            jbd2::FEATURE_CSUM_V3 | jbd2::FEATURE_64BIT,
            1,
            7,
        )
    }

    fn block(image: &[u8], at: u32) -> &[u8] {
        let b = FS_BLOCK as usize;
        &image[at as usize * b..(at as usize + 1) * b]
    }

    fn linked(image: &[u8]) -> GuestJournals {
        let mut g = GuestJournals::default();
        g.link(JOURNAL, DATA, 16, Some(block(image, 0)))
            .expect("the writer's superblock is usable");
        g
    }

    fn feed(g: &mut GuestJournals, image: &[u8], range: std::ops::Range<u32>) {
        for at in range {
            let _ = g.observe(JOURNAL, IMAGE, at, block(image, at));
        }
    }

    #[test]
    fn descriptor_tags_name_the_blocks_after_it() {
        let mut w = writer(64);
        let start = w.position();
        let placed = w.transaction(&[(100, vec![1u8; 4096]), (205, vec![2u8; 4096])], &[], true);
        assert_eq!(
            placed,
            vec![start + 1, start + 2],
            "right after the descriptor"
        );
        let image = w.finish();
        let mut g = linked(&image);
        feed(&mut g, &image, 1..64);
        let c = g.candidate(DATA, 100).expect("block 100 is logged");
        assert_eq!(c.image, IMAGE);
        assert_eq!(c.journal_block, start + 1);
        assert_eq!(
            g.candidate(DATA, 205).map(|c| c.journal_block),
            Some(start + 2)
        );
        assert_eq!(g.candidate(DATA, 101), None);
        assert_eq!(g.candidate(DiskId(2), 100), None, "another disk");
        let n = g.counts(JOURNAL).unwrap_or_default();
        assert_eq!((n.descriptors, n.commits, n.logged_blocks), (1, 1, 2));
        assert_eq!(n.errors, 0);
    }

    #[test]
    fn the_newest_copy_wins_and_a_reused_place_forgets_the_old_one() {
        let mut w = writer(64);
        w.transaction(&[(100, vec![1u8; 4096])], &[], true);
        let second = w.transaction(&[(100, vec![3u8; 4096]), (7, vec![4u8; 4096])], &[], true);
        let image = w.finish();
        let mut g = linked(&image);
        feed(&mut g, &image, 1..64);
        assert_eq!(
            g.candidate(DATA, 100).map(|c| c.journal_block),
            Some(second[0])
        );
        // The place of block 7's copy is overwritten by a commit block of
        // a later lap: no longer a copy.
        let commit = block(&image, second[1] + 1).to_vec();
        assert!(g.observe(JOURNAL, IMAGE, second[1], &commit).is_ok());
        assert_eq!(g.candidate(DATA, 7), None);
    }

    #[test]
    fn escaped_copies_and_malformed_descriptors_map_nothing() {
        let mut w = writer(64);
        let start = w.position();
        let mut magic = vec![5u8; 4096];
        magic[..4].copy_from_slice(&jbd2::MAGIC.to_be_bytes());
        w.transaction(&[(300, magic), (301, vec![6u8; 4096])], &[], true);
        let image = w.finish();
        let mut g = linked(&image);
        feed(&mut g, &image, 1..64);
        assert_eq!(g.candidate(DATA, 300), None, "escaped: bytes differ");
        assert!(g.candidate(DATA, 301).is_some());
        assert_eq!(g.counts(JOURNAL).unwrap_or_default().escaped, 1);

        let mut other = linked(&image);
        let mut bad = block(&image, start).to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        assert!(other.observe(JOURNAL, IMAGE, start, &bad).is_err());
        assert_eq!(other.candidate(DATA, 301), None);
        assert_eq!(other.counts(JOURNAL).unwrap_or_default().errors, 1);
    }

    #[test]
    fn nothing_maps_without_a_usable_superblock() {
        let mut w = writer(64);
        w.transaction(&[(10, vec![1u8; 4096])], &[], true);
        let image = w.finish();
        let mut g = GuestJournals::default();
        g.link(JOURNAL, DATA, 16, None).expect("link");
        feed(&mut g, &image, 1..64);
        assert_eq!(g.candidate(DATA, 10), None);
        assert!(g.counts(JOURNAL).unwrap_or_default().errors > 0);
        // The superblock arrives (the kernel rewrote it): descriptors
        // written from then on map.
        feed(&mut g, &image, 0..64);
        assert!(g.candidate(DATA, 10).is_some());
    }

    #[test]
    fn guest_blocks_come_from_the_cluster_and_the_offset_in_it() {
        let mut g = GuestJournals::default();
        g.link(JOURNAL, DATA, 16, None).expect("link");
        // Guest cluster 3 stored at host cluster 9: a segment from 4 KiB
        // into it, its block 8 KiB into the cluster.
        let seg = 9 * 65536 + 4096;
        assert_eq!(g.fs_block(DATA, 3, seg, seg + 4096), Some(3 * 16 + 2));
        assert_eq!(g.fs_block(DATA, 3, seg, seg + 512), None, "unaligned");
        // A raw image's one segment spans clusters: the cluster is that of
        // the segment's start.
        assert_eq!(g.fs_block(DATA, 0, 0, 5 * 65536), Some(5 * 16));
        assert_eq!(g.fs_block(DATA, 3, seg, seg - 4096), None, "before it");
        assert_eq!(g.fs_block(DiskId(5), 3, 0, 0), None, "no journal");
    }
}
