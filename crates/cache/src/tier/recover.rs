//! Formatting a cache device, and opening one: fast recovery (the newest
//! valid checkpoint, then the journal replayed up to the first batch or
//! block that does not verify) and full recovery (every dirty block
//! written back to its image, leaving the images standalone).

use super::checkpoint::decode_checkpoint;
use super::{FlashCache, ImageRecord, State};
use crate::config::{CacheConfig, Dedup};
use crate::error::{CacheError, Result};
use crate::journal::{self, CheckpointMark, Claims, Entry, JournalWriter};
use crate::layout::{BLOCK, Layout, Superblock, host_identity, random_uuid};
use crate::seal::{Seal, Sealer};
use std::sync::Arc;
use vdcache_backend::BackendRef;

/// What fast recovery found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecoveryReport {
    pub batches_replayed: u64,
    pub entries_replayed: u64,
    /// Replay stopped at a record whose data did not verify.
    pub stopped_at_torn_block: bool,
    /// The journal went on past a checkpoint that never landed, and replay
    /// followed it.
    pub entered_next_epoch: bool,
    /// Blocks written and synced that no longer verify (the device damaged
    /// them): never served nor written back.
    pub damaged_blocks: u64,
    /// Damaged metadata was accepted (salvage): writes were lost.
    pub salvaged: bool,
}

/// The images a damage may have cost writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Affected {
    /// Those whose names the records that verify still give.
    pub names: Vec<String>,
    /// How many more there are whose names went with the damaged records.
    pub unnamed: usize,
}

impl std::fmt::Display for Affected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.names.is_empty() && self.unnamed == 0 {
            return write!(f, "no image has data in the cache that its file lacks");
        }
        write!(f, "{}", self.names.join(", "))?;
        if self.unnamed > 0 {
            write!(
                f,
                "{}{} image(s) whose names went with the damaged records (every image still marked as needing this cache is one)",
                if self.names.is_empty() { "" } else { "; " },
                self.unnamed
            )?;
        }
        Ok(())
    }
}

/// What opening a device gives the cache beside its state.
pub(crate) struct Opened {
    pub report: RecoveryReport,
    /// Writes this run's seals, numbered after the last one found.
    pub sealer: Sealer,
    /// What a salvage gave up, if the device was damaged.
    pub salvaged: Option<Affected>,
}

impl FlashCache {
    /// Formats `device` (all of it) as an empty cache and opens it.
    pub fn format(device: BackendRef, config: CacheConfig) -> Result<Arc<FlashCache>> {
        config.validate()?;
        let len = device.len().map_err(CacheError::device("stat"))?;
        let layout = Layout::compute_for(len, config.region_bytes, config.dedup != Dedup::Off)?;
        let sb = Superblock {
            uuid: random_uuid(),
            host: config.host.clone().unwrap_or_else(host_identity),
            layout,
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        // Forget whatever the device held before: the data zone is
        // discarded and the checkpoint slots zeroed. An empty checkpoint is
        // durable before the superblock makes the device a cache, so a
        // crash during formatting leaves either no cache or an empty one.
        let _ = device.discard(layout.data_offset, layout.device_bytes - layout.data_offset);
        let zero = vec![0u8; BLOCK as usize];
        for slot in 0..2 {
            device
                .write_at(&zero, layout.slot_offset(slot))
                .map_err(CacheError::device("write checkpoint"))?;
        }
        // No images (u32), no lines (u64), no metadata sectors (u64), no
        // lost blocks (u64).
        let empty_index = [0u8; 28];
        let mark = CheckpointMark {
            generation: 1,
            slot: 1,
            journal_seq: 1,
            journal_pos: 0,
        };
        journal::write_checkpoint(&*device, &layout, &sb.uuid, mark, &empty_index)?;
        device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        sb.write(&*device)?;
        device
            .flush()
            .map_err(CacheError::device("sync cache device"))?;
        let journal = JournalWriter::new(
            &layout,
            &sb.uuid,
            mark.generation,
            mark.journal_seq,
            mark.journal_pos,
        );
        let state = Self::new_state(&layout, &config, journal, mark, mark.generation);
        let opened = Opened {
            report: RecoveryReport::default(),
            sealer: Sealer::new(sb.uuid, None, mark.generation),
            salvaged: None,
        };
        let cache = Self::assemble(device, sb, config, state, opened);
        Self::start_threads(&cache);
        Ok(cache)
    }

    /// Opens a formatted cache device, recovering its index.
    pub fn open(device: BackendRef, config: CacheConfig) -> Result<Arc<FlashCache>> {
        config.validate()?;
        let sb = Superblock::read(&*device)?;
        let this = config.host.clone().unwrap_or_else(host_identity);
        if sb.host != this && !config.force_foreign {
            return Err(CacheError::ForeignHost {
                owner: sb.host,
                this,
            });
        }
        if config.dedup != Dedup::Off && !sb.layout.has_dedup_room() {
            tracing::warn!(
                "dedup is on, but this cache was formatted without it: its checkpoints have room for fewer \
                 addresses sharing blocks, and blocks past that room are stored as copies (`no_room` in \
                 `vdcache stats --json`); for the full room, stop the server cleanly (every dirty block is \
                 written back), remove the cache file and start again with dedup on"
            );
        }
        let (state, opened) = recover_state(&*device, &sb, &config)?;
        let report = opened.report;
        tracing::info!(
            batches = report.batches_replayed,
            entries = report.entries_replayed,
            torn = report.stopped_at_torn_block,
            next_epoch = report.entered_next_epoch,
            "cache recovered"
        );
        let cache = Self::assemble(device, sb, config, state, opened);
        {
            // Consolidate before anything else writes: the replayed state
            // becomes the new checkpoint, so a torn journal tail can never
            // be read again.
            let mut st = cache.lock();
            cache.checkpoint(&mut st)?;
        }
        Self::start_threads(&cache);
        Ok(cache)
    }

    /// Opens the device if it holds a cache; formats it if it holds
    /// nothing (all zeros where a cache keeps its superblock, checkpoints
    /// and journal) or only what a format cut short left. Anything else
    /// without a valid superblock is refused, never formatted: it may be a
    /// cache whose superblock was damaged (with dirty data behind it) or a
    /// file given by mistake.
    pub fn open_or_format(device: BackendRef, config: CacheConfig) -> Result<Arc<FlashCache>> {
        match Self::open(device.clone(), config.clone()) {
            Err(CacheError::NotACache) => match blank_state(&*device)? {
                Blank::Empty | Blank::FormatCutShort => Self::format(device, config),
                Blank::Holds(what) => Err(CacheError::NotBlank {
                    device: device.name().to_string(),
                    what,
                }),
            },
            other => other,
        }
    }

    /// Formats `device` whatever cache it held, as `--format-cache` asks:
    /// a cache that opens and still holds dirty data is refused (its
    /// images need it; `recover --full` writes it back first), a clean one
    /// or one too damaged to open is formatted. Whether the device may be
    /// formatted at all (what else it holds) is the caller's to check.
    pub fn format_over(device: BackendRef, config: CacheConfig) -> Result<Arc<FlashCache>> {
        match Self::open(device.clone(), config.clone()) {
            Ok(old) => {
                let dirty: Vec<String> = old
                    .images()
                    .into_iter()
                    .filter(|(_, d)| *d > 0)
                    .map(|(name, _)| name)
                    .collect();
                old.shutdown(true)?;
                drop(old);
                if !dirty.is_empty() {
                    return Err(CacheError::HoldsDirty {
                        device: device.name().to_string(),
                        images: dirty.join(", "),
                    });
                }
            }
            Err(e @ CacheError::ForeignHost { .. }) => return Err(e),
            Err(e) => tracing::warn!(
                "formatting {} over a cache that does not open: {e}",
                device.name()
            ),
        }
        Self::format(device, config)
    }

    /// What `device` holds, for a caller deciding whether to format it.
    pub fn probe_content(device: &dyn vdcache_backend::Backend) -> Result<DeviceContent> {
        if Superblock::read(device).is_ok() {
            return Ok(DeviceContent::Cache);
        }
        let mut magic = [0u8; 8];
        device
            .read_at(&mut magic, 0)
            .map_err(CacheError::device("read"))?;
        if crate::layout::is_cache_magic(&magic) {
            return Ok(DeviceContent::DamagedCache);
        }
        Ok(match blank_state(device)? {
            Blank::Empty | Blank::FormatCutShort => DeviceContent::Blank,
            Blank::Holds(_) if has_stray_checkpoint(device)? => DeviceContent::DamagedCache,
            Blank::Holds(_) => DeviceContent::Other,
        })
    }

    /// What a salvage gave up when the cache opened: the images the
    /// damage may have cost writes (none: the device verified).
    pub fn salvaged(&self) -> Option<&Affected> {
        self.salvaged.as_ref()
    }

    /// Images the cache knows, with dirty bytes each.
    pub fn images(&self) -> Vec<(String, u64)> {
        let st = self.lock();
        let mut dirty = vec![0u64; st.catalog.images.len()];
        for l in st.index.lines() {
            if let Some(d) = dirty.get_mut(crate::index::key_image(l.key) as usize) {
                *d += u64::from(l.dirty.count_ones()) * BLOCK;
            }
        }
        for (img, _, _) in st.meta.dirty_sectors() {
            if let Some(d) = dirty.get_mut(img as usize) {
                *d += super::metastore::SECTOR;
            }
        }
        st.catalog
            .images
            .iter()
            .map(|r| r.name.clone())
            .zip(dirty)
            .collect()
    }

    /// Images with partially valid clusters (each the top of a chain whose
    /// backing files must fill them).
    pub fn partial_images(&self) -> Vec<String> {
        let st = self.lock();
        let mut ids: Vec<u16> = st
            .index
            .lines()
            .filter(|l| l.partial != 0)
            .map(|l| crate::index::key_image(l.key))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter()
            .filter_map(|id| st.catalog.images.get(id as usize).map(|r| r.name.clone()))
            .collect()
    }
}

/// What a device holds, as far as formatting it is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceContent {
    /// A cache that opens (its superblock, or its copy, verifies).
    Cache,
    /// What is left of a cache: its magic or a checkpoint, no superblock.
    DamagedCache,
    /// Nothing (zeros), or what a format cut short left.
    Blank,
    /// Something else.
    Other,
}

/// What a device without a valid superblock holds.
enum Blank {
    Empty,
    /// The empty checkpoint of a format that crashed before its superblock.
    FormatCutShort,
    /// Something else, described for the error.
    Holds(String),
}

/// Bytes from the start of a device that must be blank before it may be
/// formatted without asking.
const BLANK_PROBE: u64 = 1 << 20;

fn is_zero(buf: &[u8]) -> bool {
    buf.iter().all(|&b| b == 0)
}

/// Classifies a device whose superblock does not decode. The metadata
/// zone's place depends on the device size (and whether it was formatted
/// for dedup) only, so it can be probed without a superblock.
fn blank_state(device: &dyn vdcache_backend::Backend) -> Result<Blank> {
    let len = device.len().map_err(CacheError::device("stat"))?;
    let mut head = vec![0u8; len.min(BLANK_PROBE) as usize];
    device
        .read_at(&mut head, 0)
        .map_err(CacheError::device("read"))?;
    // A cache's checkpoints lie where the device's size puts them, which
    // may be past the bytes probed for blankness.
    for layout in Layout::candidates(len, BLOCK) {
        if let Some(generation) = journal::stray_checkpoint_generation(device, &layout)? {
            if generation == 1 && format_cut_short(device, &layout, &head)? {
                return Ok(Blank::FormatCutShort);
            }
            return Ok(Blank::Holds(format!(
                "a vdcache checkpoint (generation {generation}) but no valid superblock: a cache whose superblock was damaged"
            )));
        }
    }
    if is_zero(&head) {
        return Ok(Blank::Empty);
    }
    Ok(Blank::Holds("data that is not a vdcache cache".into()))
}

/// Whether a checkpoint of a cache lies where a device of this size
/// would keep one.
fn has_stray_checkpoint(device: &dyn vdcache_backend::Backend) -> Result<bool> {
    let len = device.len().map_err(CacheError::device("stat"))?;
    for layout in Layout::candidates(len, BLOCK) {
        if journal::stray_checkpoint_generation(device, &layout)?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the device holds exactly what [`FlashCache::format`] writes
/// before its superblock: nothing in the superblock block or the first
/// journal block.
fn format_cut_short(
    device: &dyn vdcache_backend::Backend,
    layout: &Layout,
    head: &[u8],
) -> Result<bool> {
    let superblock = head.get(..BLOCK as usize).unwrap_or(&[]);
    let mut journal_start = vec![0u8; BLOCK as usize];
    device
        .read_at(&mut journal_start, layout.journal_offset)
        .map_err(CacheError::device("read journal"))?;
    Ok(is_zero(superblock) && is_zero(&journal_start))
}

/// Rebuilds the state from the newest checkpoint and the journal.
fn recover_state(
    device: &dyn vdcache_backend::Backend,
    sb: &Superblock,
    config: &CacheConfig,
) -> Result<(State, Opened)> {
    let layout = sb.layout;
    let (mark, payload) = journal::read_checkpoint(device, &layout, &sb.uuid)?;
    let seal = crate::seal::read_seal(device, &sb.uuid)?;
    let (images, lines, sectors, lost) = decode_checkpoint(&payload)?;
    // The journal's epoch is chosen once replay has weighed what the
    // device says was durable (see below).
    let journal = writer_after(sb, mark, mark.generation + 2);
    let mut st = FlashCache::new_state(&layout, config, journal, mark, mark.generation + 2);
    for e in images {
        apply(&mut st, &layout, e)?;
    }
    for l in lines {
        for (slot, cbn, crc) in l.cbn {
            check_cbn(&layout, cbn)?;
            let dirty = l.dirty & (1 << slot) != 0;
            restore_mapping(&mut st, l.key, l.guest, slot, cbn, dirty, crc);
            if dirty {
                st.dirty.lines.insert(l.key);
            }
        }
        if l.partial != 0 {
            st.index.set_partial(l.key, Some(l.guest), l.partial);
            for (slot, sectors) in l.valid_sectors {
                st.index.set_valid_sectors(l.key, slot, sectors);
            }
        }
    }
    for e in sectors.into_iter().chain(lost) {
        apply(&mut st, &layout, e)?;
    }
    let (report, salvaged, evidence) = replay(device, sb, config, &mut st, mark, seal)?;
    // The crashed run may have started the next epoch; this run writes in
    // one past every epoch and checkpoint the device names (two past the
    // loaded checkpoint unless a salvage skipped newer ones), so none of
    // the earlier runs' batches can follow its own, and their seals are
    // told from its own.
    let epoch = evidence.next_epoch(mark.generation);
    st.journal = writer_after(sb, mark, epoch);
    st.epochs = super::epochs::Epochs::new(mark, epoch);
    st.regions.finish_recovery();
    // Summaries of the regions recovery filled are written at the first
    // commit; what it recorded for regions it freed is void.
    for region in st.index.summaries().pending_regions() {
        if !st.regions.is_settled_full(region) {
            st.index.summaries().forget(region);
        }
    }
    let ends: Vec<(u16, u64)> = st
        .index
        .lines()
        .filter(|l| l.dirty != 0)
        .map(|l| {
            let last = 15 - l.dirty.leading_zeros() as u64;
            let end = crate::index::key_line(l.key) * crate::layout::LINE + (last + 1) * BLOCK;
            (crate::index::key_image(l.key), end)
        })
        .collect();
    let meta_ends: Vec<(u16, u64)> = st.meta.image_ends().into_iter().collect();
    for (id, end) in ends.into_iter().chain(meta_ends) {
        if let Some(rec) = st.catalog.images.get_mut(id as usize) {
            rec.end = rec.end.max(end);
        }
    }
    let opened = Opened {
        report,
        sealer: Sealer::new(sb.uuid, seal, mark.generation),
        salvaged,
    };
    Ok((st, opened))
}

/// A journal writer appending from checkpoint `mark`'s place, in `epoch`.
fn writer_after(sb: &Superblock, mark: CheckpointMark, epoch: u64) -> JournalWriter {
    JournalWriter::new(
        &sb.layout,
        &sb.uuid,
        epoch,
        mark.journal_seq,
        mark.journal_pos,
    )
}

/// What the device says was made durable, beside what verifies: the
/// claims of its journal batches and its seal.
struct Evidence {
    /// The newest checkpoint said to be durable.
    checkpoint: u64,
    /// Every batch numbered below this (in the loaded checkpoint's run)
    /// was said to be durable.
    durable_below: u64,
    /// The newest epoch a batch was written in.
    newest_epoch: u64,
    /// Batches past the replayed ones that verify (see [`Claims::later`]).
    later: Vec<(u64, Vec<u8>)>,
}

impl Evidence {
    /// Weighs the claims and the seal against checkpoint `loaded`. A seal
    /// of one checkpoint before it is this run's (a checkpoint landed and
    /// its seal did not follow yet); one two or more before is an earlier
    /// run's, whose batch numbers this run reuses (a recovery skips an
    /// epoch), and says nothing about this run.
    fn weigh(claims: Claims, seal: Option<Seal>, loaded: u64, config: &CacheConfig) -> Evidence {
        let seal = seal.filter(|s| s.checkpoint + 1 >= loaded);
        let mut checkpoint = claims.checkpoint.max(seal.map_or(0, |s| s.checkpoint));
        if config.test_open_past_bad_checkpoint {
            checkpoint = checkpoint.min(loaded);
        }
        let seal_below = seal
            .filter(|s| s.checkpoint <= loaded)
            .map_or(0, |s| s.durable_below);
        Evidence {
            checkpoint,
            durable_below: claims.durable_below.max(seal_below),
            newest_epoch: claims.newest_epoch,
            later: claims.later,
        }
    }

    /// What does not verify although it was made durable, replay having
    /// stopped before batch `stop`.
    fn damage(&self, loaded: u64, stop: u64) -> Vec<String> {
        let mut damage = Vec::new();
        if self.checkpoint > loaded {
            damage.push(format!(
                "checkpoint {} was written and synced but does not verify (only the older checkpoint {loaded} does, whose journal may be overwritten)",
                self.checkpoint
            ));
        }
        if self.durable_below > stop {
            damage.push(format!(
                "journal batch {stop} does not verify, although it was synced (batches up to {} were)",
                self.durable_below - 1
            ));
        }
        damage
    }

    /// The epoch the next run writes in, after checkpoint `loaded`.
    fn next_epoch(&self, loaded: u64) -> u64 {
        (loaded.max(self.checkpoint) + 2).max(self.newest_epoch + 1)
    }
}

/// Maps a slot as a checkpoint or a journal record says. A block counts
/// as live in its region once, however many slots share it (journal-aware
/// caching maps a file-system block onto its journal copy's block).
fn restore_mapping(
    st: &mut State,
    key: u64,
    guest: u64,
    slot: usize,
    cbn: u32,
    dirty: bool,
    crc: u32,
) {
    let newly_live = !st.index.is_referenced(cbn);
    if let Some((old, r)) = st.map_block(key, guest, slot, cbn, dirty, crc)
        && st.index.release(old, r)
    {
        st.regions.release_block(old);
    }
    if newly_live {
        st.regions.restore_block(cbn);
    }
}

/// A run of metadata sectors a record names must be plausible.
fn check_sectors(st: &State, image: u16, offset: u64, sectors: u32) -> Result<()> {
    let sector = super::metastore::SECTOR;
    if usize::from(image) >= st.catalog.images.len()
        || !offset.is_multiple_of(sector)
        || sectors == 0
        || sectors > 1 << 16
        || offset.checked_add(u64::from(sectors) * sector).is_none()
    {
        return Err(CacheError::Corrupt(format!(
            "implausible metadata sector record: image {image}, offset {offset}, {sectors} sectors"
        )));
    }
    Ok(())
}

fn check_cbn(layout: &Layout, cbn: u32) -> Result<()> {
    if !layout.is_data_block(cbn) {
        return Err(CacheError::Corrupt(format!(
            "block number {cbn} is not a data block (data zone of {} blocks, {} of every {} hold data)",
            layout.data_blocks(),
            layout.data_blocks_per_region(),
            layout.blocks_per_region()
        )));
    }
    Ok(())
}

/// Applies the journal after the checkpoint. Its tail may not have been
/// synced: a Map record whose block does not match its checksum, while
/// that mapping is still the live one and no later batch says its batch
/// was durable, proves the log was cut there (a sync after the record would
/// have made the block durable), so replay keeps only the records before
/// it. A mapping superseded later in the replayed log may legitimately
/// point at reused space and is not checked.
///
/// What a later batch says was durable but does not verify was damaged
/// after it landed: a journal batch or a checkpoint (the device is refused
/// with the images affected, unless salvaging), or a block (kept mapped
/// with its checksum, so a dirty one is never served nor written back, and
/// dropped if clean).
fn replay(
    device: &dyn vdcache_backend::Backend,
    sb: &Superblock,
    config: &CacheConfig,
    st: &mut State,
    mark: CheckpointMark,
    seal: Option<Seal>,
) -> Result<(RecoveryReport, Option<Affected>, Evidence)> {
    let layout = sb.layout;
    let mut report = RecoveryReport::default();
    let tail = journal::read_batches(device, &layout, &sb.uuid, mark)?;
    report.entered_next_epoch = tail.entered_next_epoch;
    let mut log: Vec<(u64, Entry)> = Vec::new();
    for (i, payload) in tail.batches.iter().enumerate() {
        let seq = mark.journal_seq + i as u64;
        match journal::decode_entries(payload) {
            Ok(e) => log.extend(e.into_iter().map(|e| (seq, e))),
            Err(e) => {
                tracing::warn!("journal batch {seq} does not decode ({e}); replay stops there");
                break;
            }
        }
        report.batches_replayed += 1;
    }
    let stop = mark.journal_seq + report.batches_replayed;
    let claims = journal::scan_claims(device, &layout, &sb.uuid, mark.generation, stop)?;
    let evidence = Evidence::weigh(claims, seal, mark.generation, config);
    let damage = evidence.damage(mark.generation, stop);
    let end = if config.test_index_before_data {
        log.len()
    } else {
        verify_live_blocks(device, &layout, &log, evidence.durable_below, &mut report)?
    };
    let mut salvaged = None;
    if !damage.is_empty() {
        let affected = affected_images(st, &log[..end], &evidence.later);
        if !config.salvage {
            return Err(CacheError::Damaged {
                device: device.name().to_string(),
                what: damage.join("; "),
                affected: affected.to_string(),
            });
        }
        tracing::error!(
            "salvaging a damaged cache: {}; affected: {affected}",
            damage.join("; ")
        );
        report.salvaged = true;
        salvaged = Some(affected);
    }
    for (_, e) in log.into_iter().take(end) {
        apply(st, &layout, e)?;
        report.entries_replayed += 1;
    }
    Ok((report, salvaged, evidence))
}

/// Checks the blocks of the live Map records of the replayed log against
/// their checksums; returns how much of the log to keep. A failing record
/// in a batch numbered below `durable_below` is damage, counted and kept
/// (its checksum then fails reads); a failing one past it is the torn end
/// of the log, which is cut there.
fn verify_live_blocks(
    device: &dyn vdcache_backend::Backend,
    layout: &Layout,
    log: &[(u64, Entry)],
    durable_below: u64,
    report: &mut RecoveryReport,
) -> Result<usize> {
    let mut end = log.len();
    let mut verified: std::collections::HashMap<usize, bool> = std::collections::HashMap::new();
    let mut block = vec![0u8; BLOCK as usize];
    loop {
        let mut live: std::collections::HashMap<(u64, u8), Option<usize>> =
            std::collections::HashMap::new();
        for (i, (_, e)) in log[..end].iter().enumerate() {
            match e {
                Entry::Map { key, slot, .. } => {
                    live.insert((*key, *slot), Some(i));
                }
                Entry::Unmap { key, slot } => {
                    live.insert((*key, *slot), None);
                }
                _ => {}
            }
        }
        let mut candidates: Vec<usize> = live.values().flatten().copied().collect();
        candidates.sort_unstable();
        let mut cut = None;
        for i in candidates {
            let (
                seq,
                Entry::Map {
                    key,
                    slot,
                    cbn,
                    crc,
                    ..
                },
            ) = &log[i]
            else {
                continue;
            };
            check_cbn(layout, *cbn)?;
            let ok = match verified.get(&i) {
                Some(&ok) => ok,
                None => {
                    device
                        .read_at(&mut block, layout.block_offset(*cbn))
                        .map_err(CacheError::device("read block"))?;
                    let ok = crc32c::crc32c(&block) == *crc;
                    if !ok && *seq < durable_below {
                        report.damaged_blocks += 1;
                        tracing::error!(
                            image = crate::index::key_image(*key),
                            offset = crate::index::key_line(*key) * crate::layout::LINE
                                + u64::from(*slot) * BLOCK,
                            "a cache block written and synced does not verify: the device damaged it"
                        );
                    }
                    verified.insert(i, ok || *seq < durable_below);
                    ok || *seq < durable_below
                }
            };
            if !ok {
                cut = Some(i);
                break;
            }
        }
        match cut {
            Some(i) => {
                end = i;
                report.stopped_at_torn_block = true;
            }
            None => return Ok(end),
        }
    }
}

/// The images a damage may have cost writes: those named by records after
/// it (which recovery cannot apply), and those holding data the files
/// lack, by name.
fn affected_images(st: &State, log: &[(u64, Entry)], later: &[(u64, Vec<u8>)]) -> Affected {
    let mut names: std::collections::BTreeMap<u16, String> = st
        .catalog
        .images
        .iter()
        .enumerate()
        .map(|(i, r)| (i as u16, r.name.clone()))
        .collect();
    for (_, e) in log {
        if let Entry::Image { id, name, .. } = e {
            names.insert(*id, name.clone());
        }
    }
    let mut touched = std::collections::BTreeSet::new();
    for (_, payload) in later {
        for e in journal::decode_entries(payload).unwrap_or_default() {
            match e {
                Entry::Image { id, name, .. } => {
                    names.insert(id, name);
                    touched.insert(id);
                }
                Entry::Map { key, .. }
                | Entry::Unmap { key, .. }
                | Entry::Clean { key, .. }
                | Entry::Partial { key, .. }
                | Entry::ValidSectors { key, .. }
                | Entry::Lost { key, .. } => {
                    touched.insert(crate::index::key_image(key));
                }
                Entry::MetaSector { image, .. }
                | Entry::MetaZero { image, .. }
                | Entry::MetaClean { image, .. } => {
                    touched.insert(image);
                }
            }
        }
    }
    for l in st.index.lines().filter(|l| l.dirty != 0 || l.partial != 0) {
        touched.insert(crate::index::key_image(l.key));
    }
    for (image, _, _) in st.meta.dirty_sectors() {
        touched.insert(image);
    }
    let mut affected = Affected::default();
    for id in touched {
        match names.get(&id) {
            Some(name) => affected.names.push(name.clone()),
            None => affected.unnamed += 1,
        }
    }
    affected
}

fn apply(st: &mut State, layout: &Layout, e: Entry) -> Result<()> {
    match e {
        Entry::Map {
            key,
            slot,
            cbn,
            guest,
            dirty,
            crc,
        } => {
            check_cbn(layout, cbn)?;
            let slot = usize::from(slot) % crate::layout::LINE_BLOCKS as usize;
            restore_mapping(st, key, guest, slot, cbn, dirty, crc);
            if dirty {
                st.dirty.lines.insert(key);
            } else if st.index.get(key).is_none_or(|l| l.dirty == 0) {
                st.dirty.lines.remove(&key);
            }
        }
        Entry::Unmap { key, slot } => {
            let slot = usize::from(slot) % crate::layout::LINE_BLOCKS as usize;
            if let Some((cbn, _, r)) = st.index.unmap(key, slot)
                && st.index.release(cbn, r)
            {
                st.regions.release_block(cbn);
            }
            if st.index.get(key).is_none_or(|l| l.dirty == 0) {
                st.dirty.lines.remove(&key);
            }
        }
        Entry::Clean { key, slot, cbn } => {
            let slot = usize::from(slot) % crate::layout::LINE_BLOCKS as usize;
            st.index.mark_clean(key, slot, cbn);
            if st.index.get(key).is_none_or(|l| l.dirty == 0) {
                st.dirty.lines.remove(&key);
            }
        }
        Entry::Image { id, name, identity } => {
            let i = id as usize;
            if i > st.catalog.images.len() {
                return Err(CacheError::Corrupt(format!(
                    "image id {id} recorded out of order"
                )));
            }
            let rec = ImageRecord {
                name: name.clone(),
                identity,
                backend: None,
                disk: vdcache_contract::DiskId::default(),
                shared_by_disks: false,
                end: 0,
                backend_syncs: Default::default(),
            };
            if i == st.catalog.images.len() {
                st.catalog.images.push(rec);
            } else {
                st.catalog.by_name.remove(&st.catalog.images[i].name);
                st.catalog.images[i] = rec;
            }
            st.catalog.by_name.insert(name, id);
        }
        Entry::Partial { key, mask, guest } => {
            st.index
                .set_partial(key, (guest != u64::MAX).then_some(guest), mask);
        }
        Entry::ValidSectors { key, slot, sectors } => {
            let slot = usize::from(slot) % crate::layout::LINE_BLOCKS as usize;
            st.index.set_valid_sectors(key, slot, sectors);
        }
        Entry::MetaSector {
            image,
            offset,
            data,
        } => {
            check_sectors(st, image, offset, 1)?;
            st.meta.insert(image, offset, &data);
        }
        Entry::MetaZero {
            image,
            offset,
            sectors,
        } => {
            check_sectors(st, image, offset, sectors)?;
            st.meta.insert_zeros(image, offset, u64::from(sectors));
        }
        Entry::MetaClean { image, offset } => {
            st.meta.remove(image, offset);
        }
        Entry::Lost { key, slot, lost } => {
            if lost {
                st.integrity.unreadable.insert((key, slot));
            } else {
                st.integrity.unreadable.remove(&(key, slot));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seal(checkpoint: u64, durable_below: u64) -> Option<Seal> {
        Some(Seal {
            counter: 1,
            durable_below,
            checkpoint,
        })
    }

    fn weigh(claims: Claims, seal: Option<Seal>, loaded: u64) -> Evidence {
        Evidence::weigh(claims, seal, loaded, &CacheConfig::default())
    }

    #[test]
    fn a_seal_of_this_run_speaks_for_the_last_batches() {
        // Replay stopped before batch 10; the seal says 12 were synced.
        let e = weigh(Claims::default(), seal(5, 12), 5);
        assert_eq!(e.damage(5, 10).len(), 1, "{:?}", e.damage(5, 10));
        assert!(e.damage(5, 12).is_empty());
        // One checkpoint behind: its seal did not follow it yet.
        let e = weigh(Claims::default(), seal(4, 12), 5);
        assert_eq!(e.durable_below, 12);
        // Two behind: an earlier run's, whose numbers this run reuses.
        let e = weigh(Claims::default(), seal(3, 12), 5);
        assert!(e.damage(5, 1).is_empty());
    }

    #[test]
    fn a_newer_durable_checkpoint_than_the_loaded_one_is_damage() {
        let e = weigh(Claims::default(), seal(7, 40), 5);
        let damage = e.damage(5, 1);
        assert_eq!(damage.len(), 1, "{damage:?}");
        assert!(damage[0].contains("checkpoint 7"), "{damage:?}");
        let claims = Claims {
            checkpoint: 9,
            newest_epoch: 9,
            ..Claims::default()
        };
        assert!(!weigh(claims, None, 5).damage(5, 1).is_empty());
        // The mutation opens past it.
        let broken = CacheConfig {
            test_open_past_bad_checkpoint: true,
            ..CacheConfig::default()
        };
        assert!(
            Evidence::weigh(Claims::default(), seal(7, 40), 5, &broken)
                .damage(5, 1)
                .is_empty()
        );
    }

    #[test]
    fn the_next_run_writes_past_every_epoch_the_device_names() {
        assert_eq!(weigh(Claims::default(), seal(5, 3), 5).next_epoch(5), 7);
        let claims = Claims {
            newest_epoch: 6,
            ..Claims::default()
        };
        assert_eq!(weigh(claims, None, 5).next_epoch(5), 7);
        // A salvage past checkpoint 9, whose batches reached epoch 11.
        let claims = Claims {
            checkpoint: 9,
            newest_epoch: 11,
            ..Claims::default()
        };
        assert_eq!(weigh(claims, seal(9, 3), 5).next_epoch(5), 12);
    }
}
