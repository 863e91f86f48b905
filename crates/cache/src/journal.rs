//! The metadata zone: a ring of checksummed journal batches recording every
//! change to the index, and the two alternating checkpoint slots holding a
//! full copy of it. Replay applies batches in sequence order and stops at
//! the first torn batch, so what survives a crash is always a prefix of
//! what was written.
//!
//! Every batch also says how far the journal was known durable when it was
//! written (the sequence below which every batch was synced) and which
//! checkpoint was durable. A batch that does not verify although a later
//! one says it was durable was damaged after it landed, not torn by the
//! crash: [`scan_claims`] reads those claims from the whole ring, of every
//! epoch since the checkpoint recovery loaded, so that recovery tells
//! damage from a torn tail (the seal, `crate::seal`, speaks for the
//! newest batches, which no later one claims).
//!
//! This module encodes, writes and reads; it does not interpret entries.

use crate::error::{CacheError, Result};
use crate::layout::{BLOCK, Layout};
use vdcache_backend::{Backend, StoreIdentity};
use vdcache_contract::{ImageIdentity, MarkIdentity};

const BATCH_MAGIC: u32 = 0x5644_4a52; // "VDJR"
const CHECKPOINT_MAGIC: u32 = 0x5644_434b; // "VDCK"
const HEADER: usize = 56;

/// One change to the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Block `slot` of line `key` now lives in cache block `cbn`; `crc` is
    /// the checksum of its content, verified on replay.
    Map {
        key: u64,
        slot: u8,
        cbn: u32,
        guest: u64,
        dirty: bool,
        crc: u32,
    },
    /// The block is no longer cached.
    Unmap { key: u64, slot: u8 },
    /// The block (still in `cbn`) reached the backend.
    Clean { key: u64, slot: u8, cbn: u32 },
    /// Image `id` is `name`.
    Image {
        id: u16,
        name: String,
        identity: ImageIdentity,
    },
    /// The partially valid (dcow) bitmap of a line, and the guest cluster
    /// it was allocated for (`u64::MAX`: unchanged).
    Partial { key: u64, mask: u16, guest: u64 },
    /// The 512-byte sectors of partially valid block `slot` of line `key`
    /// that hold the guest's bytes (bit per sector; 0: none).
    ValidSectors { key: u64, slot: u8, sectors: u8 },
    /// A dirty 512-byte sector of qcow2 metadata of image `image` at byte
    /// `offset`, held by the cache (not yet on the backend).
    MetaSector {
        image: u16,
        offset: u64,
        data: Box<[u8]>,
    },
    /// `sectors` dirty metadata sectors from `offset` hold zeros (a new
    /// table).
    MetaZero {
        image: u16,
        offset: u64,
        sectors: u32,
    },
    /// The sector reached the backend, or newer bytes replaced it.
    MetaClean { image: u16, offset: u64 },
    /// Dirty block `slot` of line `key` lost its only copy (`lost`; the
    /// device damaged it), or was written whole again (not `lost`).
    Lost { key: u64, slot: u8, lost: bool },
}

/// Bytes of qcow2 metadata one [`Entry::MetaSector`] carries.
pub const META_SECTOR: usize = 512;

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// A bounds-checked reader over a payload.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let s = self
            .buf
            .get(self.pos..self.pos.saturating_add(n))
            .ok_or_else(|| CacheError::Corrupt("journal entry is truncated".into()))?;
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

impl Entry {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Entry::Map {
                key,
                slot,
                cbn,
                guest,
                dirty,
                crc,
            } => {
                out.push(1);
                put64(out, *key);
                out.push(*slot);
                put32(out, *cbn);
                put64(out, *guest);
                out.push(u8::from(*dirty));
                put32(out, *crc);
            }
            Entry::Unmap { key, slot } => {
                out.push(2);
                put64(out, *key);
                out.push(*slot);
            }
            Entry::Clean { key, slot, cbn } => {
                out.push(3);
                put64(out, *key);
                out.push(*slot);
                put32(out, *cbn);
            }
            Entry::Image { id, name, identity } => {
                out.push(4);
                put16(out, *id);
                let n = name.as_bytes();
                let n = &n[..n.len().min(4096)];
                put16(out, n.len() as u16);
                out.extend_from_slice(n);
                encode_identity(out, identity);
            }
            Entry::Partial { key, mask, guest } => {
                out.push(5);
                put64(out, *key);
                put16(out, *mask);
                put64(out, *guest);
            }
            Entry::ValidSectors { key, slot, sectors } => {
                out.push(9);
                put64(out, *key);
                out.push(*slot);
                out.push(*sectors);
            }
            Entry::MetaSector {
                image,
                offset,
                data,
            } => {
                out.push(6);
                put16(out, *image);
                put64(out, *offset);
                let mut sector = [0u8; META_SECTOR];
                let n = data.len().min(META_SECTOR);
                sector[..n].copy_from_slice(&data[..n]);
                out.extend_from_slice(&sector);
            }
            Entry::MetaClean { image, offset } => {
                out.push(7);
                put16(out, *image);
                put64(out, *offset);
            }
            Entry::Lost { key, slot, lost } => {
                out.push(10);
                put64(out, *key);
                out.push(*slot);
                out.push(u8::from(*lost));
            }
            Entry::MetaZero {
                image,
                offset,
                sectors,
            } => {
                out.push(8);
                put16(out, *image);
                put64(out, *offset);
                put32(out, *sectors);
            }
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Result<Entry> {
        Ok(match r.u8()? {
            1 => Entry::Map {
                key: r.u64()?,
                slot: r.u8()?,
                cbn: r.u32()?,
                guest: r.u64()?,
                dirty: r.u8()? != 0,
                crc: r.u32()?,
            },
            2 => Entry::Unmap {
                key: r.u64()?,
                slot: r.u8()?,
            },
            3 => Entry::Clean {
                key: r.u64()?,
                slot: r.u8()?,
                cbn: r.u32()?,
            },
            4 => {
                let id = r.u16()?;
                let len = r.u16()? as usize;
                let name = String::from_utf8_lossy(r.take(len)?).into_owned();
                Entry::Image {
                    id,
                    name,
                    identity: decode_identity(r)?,
                }
            }
            5 => Entry::Partial {
                key: r.u64()?,
                mask: r.u16()?,
                guest: r.u64()?,
            },
            6 => Entry::MetaSector {
                image: r.u16()?,
                offset: r.u64()?,
                data: r.take(META_SECTOR)?.into(),
            },
            7 => Entry::MetaClean {
                image: r.u16()?,
                offset: r.u64()?,
            },
            8 => Entry::MetaZero {
                image: r.u16()?,
                offset: r.u64()?,
                sectors: r.u32()?,
            },
            9 => Entry::ValidSectors {
                key: r.u64()?,
                slot: r.u8()?,
                sectors: r.u8()?,
            },
            10 => Entry::Lost {
                key: r.u64()?,
                slot: r.u8()?,
                lost: r.u8()? != 0,
            },
            t => {
                return Err(CacheError::Corrupt(format!(
                    "unknown journal entry type {t}"
                )));
            }
        })
    }
}

/// An image's identity: flags (bit 0: a cache mark follows; bit 1: the
/// mark is coherent; bit 2: opened writable), the mark (image id,
/// generation, cache id), then the store's six facts.
fn encode_identity(out: &mut Vec<u8>, identity: &ImageIdentity) {
    let mark = identity.mark.unwrap_or_default();
    let flags = u8::from(identity.mark.is_some())
        | u8::from(mark.coherent) << 1
        | u8::from(identity.writable) << 2;
    out.push(flags);
    if identity.mark.is_some() {
        out.extend_from_slice(&mark.image_id);
        put64(out, mark.generation);
        out.extend_from_slice(&mark.cache_id);
    }
    let s = &identity.store;
    for v in [s.dev, s.ino, s.birth_ns, s.size, s.mtime_ns, s.ctime_ns] {
        put64(out, v);
    }
}

fn decode_identity(r: &mut Reader<'_>) -> Result<ImageIdentity> {
    let flags = r.u8()?;
    let mark = if flags & 1 != 0 {
        let mut image_id = [0u8; 16];
        image_id.copy_from_slice(r.take(16)?);
        let generation = r.u64()?;
        let mut cache_id = [0u8; 16];
        cache_id.copy_from_slice(r.take(16)?);
        Some(MarkIdentity {
            image_id,
            generation,
            cache_id,
            coherent: flags & 2 != 0,
        })
    } else {
        None
    };
    Ok(ImageIdentity {
        mark,
        store: StoreIdentity {
            dev: r.u64()?,
            ino: r.u64()?,
            birth_ns: r.u64()?,
            size: r.u64()?,
            mtime_ns: r.u64()?,
            ctime_ns: r.u64()?,
        },
        writable: flags & 4 != 0,
    })
}

fn uuid_tag(uuid: &[u8; 16]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&uuid[..8]);
    u64::from_le_bytes(a)
}

/// The tag of journal batches written after checkpoint `generation`:
/// replay from that checkpoint accepts no batch of an earlier epoch (a
/// tail a crash left behind, or batches of the run before a recovery).
fn batch_tag(uuid: &[u8; 16], generation: u64) -> u64 {
    uuid_tag(uuid) ^ generation.rotate_left(29)
}

/// The epoch a batch tag of cache `uuid` names (the inverse of
/// [`batch_tag`]; another cache's tag gives a number far from this one's).
fn tag_epoch(uuid: &[u8; 16], tag: u64) -> u64 {
    (tag ^ uuid_tag(uuid)).rotate_right(29)
}

/// Epochs past the loaded checkpoint whose batches [`scan_claims`] reads:
/// far more than any run takes between two recoveries, and a vanishing
/// share of the numbers another cache's tags decode to.
const EPOCH_WINDOW: u64 = 1 << 20;

/// A framed, checksummed header shared by batches and checkpoints:
/// magic, cache tag, sequence, position, payload length and checksum, and
/// (batches) what was durable when it was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Frame {
    magic: u32,
    tag: u64,
    seq: u64,
    pos: u64,
    len: u32,
    payload_crc: u32,
    /// Every batch numbered below this was durable.
    durable_below: u64,
    /// The newest durable checkpoint's generation.
    checkpoint: u64,
}

impl Frame {
    fn encode(&self) -> [u8; HEADER] {
        let mut h = Vec::with_capacity(HEADER);
        put32(&mut h, self.magic);
        put64(&mut h, self.tag);
        put64(&mut h, self.seq);
        put64(&mut h, self.pos);
        put32(&mut h, self.len);
        put32(&mut h, self.payload_crc);
        put64(&mut h, self.durable_below);
        put64(&mut h, self.checkpoint);
        let crc = crc32c::crc32c(&h);
        put32(&mut h, crc);
        let mut out = [0u8; HEADER];
        out.copy_from_slice(&h);
        out
    }

    fn decode(buf: &[u8], magic: u32, tag: u64) -> Option<Frame> {
        Frame::decode_any_tag(buf, magic).filter(|f| f.tag == tag)
    }

    /// A frame with a valid header of any cache or epoch.
    fn decode_any_tag(buf: &[u8], magic: u32) -> Option<Frame> {
        let h = buf.get(..HEADER)?;
        let mut r = Reader::new(h);
        let f = Frame {
            magic: r.u32().ok()?,
            tag: r.u64().ok()?,
            seq: r.u64().ok()?,
            pos: r.u64().ok()?,
            len: r.u32().ok()?,
            payload_crc: r.u32().ok()?,
            durable_below: r.u64().ok()?,
            checkpoint: r.u64().ok()?,
        };
        let crc = r.u32().ok()?;
        (f.magic == magic && crc32c::crc32c(&h[..HEADER - 4]) == crc).then_some(f)
    }
}

/// Appends batches to the ring.
///
/// Two marks bound what the ring may overwrite: replay starts at the mark
/// of the newest *durable* checkpoint, so nothing written since it may be
/// overwritten; a new checkpoint is due once the journal since the newest
/// *started* one reaches the checkpoint interval. While a checkpoint is
/// being written, batches carry the next epoch's tag; replay from the older
/// checkpoint follows them into that epoch (see [`read_batches`]).
#[derive(Debug)]
pub struct JournalWriter {
    uuid: [u8; 16],
    tag: u64,
    offset: u64,
    capacity: u64,
    /// Sequence number of the next batch.
    pub next_seq: u64,
    /// Ring position (bytes into the zone) of the next batch.
    pub pos: u64,
    /// Ring bytes used since the mark of the newest checkpoint started.
    since_started: u64,
    /// Ring bytes used since the mark of the newest durable checkpoint:
    /// replay may still need every one of them.
    since_durable: u64,
    /// Entries not yet written.
    pending: Vec<u8>,
    /// Entry bytes pushed since the writer was made, and of those, the
    /// ones written or dropped: `pending` holds the difference.
    pushed: u64,
    consumed: u64,
    /// What the next batch claims was durable (see [`Frame`]).
    durable_below: u64,
    checkpoint: u64,
}

impl JournalWriter {
    /// A writer appending after checkpoint `generation`.
    pub fn new(
        layout: &Layout,
        uuid: &[u8; 16],
        generation: u64,
        next_seq: u64,
        pos: u64,
    ) -> JournalWriter {
        JournalWriter {
            uuid: *uuid,
            tag: batch_tag(uuid, generation),
            offset: layout.journal_offset,
            capacity: layout.journal_bytes,
            next_seq,
            pos,
            since_started: 0,
            since_durable: 0,
            pending: Vec::new(),
            pushed: 0,
            consumed: 0,
            durable_below: next_seq,
            checkpoint: generation,
        }
    }

    /// Every batch numbered below `seq` is durable (a sync covered it).
    pub fn note_durable(&mut self, seq: u64) {
        self.durable_below = self.durable_below.max(seq);
    }

    pub fn push(&mut self, e: &Entry) {
        let before = self.pending.len();
        e.encode(&mut self.pending);
        self.pushed += (self.pending.len() - before) as u64;
    }

    /// How far entries were pushed: a position [`Self::write_pending_through`]
    /// takes.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Checkpoint `generation` starts here: later batches belong to its
    /// epoch.
    pub fn start_epoch(&mut self, generation: u64) {
        self.tag = batch_tag(&self.uuid, generation);
        self.since_started = 0;
    }

    /// Checkpoint `generation`, the one started last, is durable: replay
    /// starts at its mark.
    pub fn checkpoint_durable(&mut self, generation: u64) {
        self.since_durable = self.since_started;
        self.checkpoint = self.checkpoint.max(generation);
    }

    /// Drops pending entries: a checkpoint written before any later batch
    /// has captured their effect.
    pub fn drop_pending(&mut self) {
        self.pending.clear();
        self.consumed = self.pushed;
    }

    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Ring bytes writing the pending entries takes: the batch, rounded to
    /// blocks, plus the end of the ring skipped when it does not fit there.
    fn next_batch_bytes(&self) -> u64 {
        self.batch_bytes(self.pending.len())
    }

    /// Ring bytes a batch of `len` payload bytes takes.
    fn batch_bytes(&self, len: usize) -> u64 {
        let total = ((HEADER + len) as u64).div_ceil(BLOCK) * BLOCK;
        let skipped = if self.pos + total > self.capacity {
            self.capacity - self.pos
        } else {
            0
        };
        total + skipped
    }

    /// Whether the journal since the newest started checkpoint, with the
    /// pending entries, exceeds `interval` bytes.
    pub fn needs_checkpoint(&self, interval: u64) -> bool {
        self.since_started + self.next_batch_bytes() > interval
    }

    /// Whether the pending entries can be written without overwriting
    /// anything replay from the newest durable checkpoint still needs.
    pub fn has_room(&self) -> bool {
        self.since_durable + self.next_batch_bytes() + BLOCK <= self.capacity
    }

    /// Writes the pending entries as one batch (not synced). Returns false
    /// when there was nothing to write. The caller checks [`Self::has_room`].
    pub fn write_pending(&mut self, device: &dyn Backend) -> Result<bool> {
        self.write_pending_through(device, self.pushed)
    }

    /// Writes the pending entries pushed before position `through` (see
    /// [`Self::pushed`]) as one batch; later ones stay pending.
    pub fn write_pending_through(&mut self, device: &dyn Backend, through: u64) -> Result<bool> {
        let due = through
            .saturating_sub(self.consumed)
            .min(self.pending.len() as u64) as usize;
        if due == 0 {
            return Ok(false);
        }
        let used = self.batch_bytes(due);
        let total = ((HEADER + due) as u64).div_ceil(BLOCK) * BLOCK;
        if total > self.capacity / 2 {
            return Err(CacheError::Config(format!(
                "a journal batch of {total} bytes exceeds half the metadata zone"
            )));
        }
        let payload = &self.pending[..due];
        let pos = if self.pos + total > self.capacity {
            0
        } else {
            self.pos
        };
        let frame = Frame {
            magic: BATCH_MAGIC,
            tag: self.tag,
            seq: self.next_seq,
            pos,
            len: payload.len() as u32,
            payload_crc: crc32c::crc32c(payload),
            durable_below: self.durable_below,
            checkpoint: self.checkpoint,
        };
        let mut buf = Vec::with_capacity(total as usize);
        buf.extend_from_slice(&frame.encode());
        buf.extend_from_slice(payload);
        buf.resize(total as usize, 0);
        // A batch that failed to be written keeps its entries pending: the
        // next commit writes them, so no flush succeeds without them.
        device
            .write_at(&buf, self.offset + pos)
            .map_err(CacheError::device("write journal"))?;
        self.pending.drain(..due);
        self.consumed += due as u64;
        self.next_seq += 1;
        self.pos = pos + total;
        self.since_started += used;
        self.since_durable += used;
        Ok(true)
    }
}

/// What replay found in the ring after a checkpoint's mark.
#[derive(Debug, Default)]
pub struct JournalTail {
    /// Payloads of the good batches, in order (the first numbered by the
    /// mark's sequence).
    pub batches: Vec<Vec<u8>>,
    /// Where each of them lies: (ring position, bytes taken).
    pub places: Vec<(u64, u64)>,
    /// Position and sequence number after the last good batch.
    pub pos: u64,
    pub seq: u64,
    /// Replay went on past the mark of a newer checkpoint that never
    /// landed.
    pub entered_next_epoch: bool,
}

/// Reads batches from the mark with consecutive sequence numbers, until
/// the first missing or torn one.
///
/// Batches carry the epoch of checkpoint `mark.generation` and, from the
/// mark of the next checkpoint on, that one's epoch: a checkpoint written
/// in the background may not have landed while the journal went on.
/// Recovery starts every run two epochs past the checkpoint it loaded, so
/// no older run's batches carry the next epoch's tag.
pub fn read_batches(
    device: &dyn Backend,
    layout: &Layout,
    uuid: &[u8; 16],
    mark: CheckpointMark,
) -> Result<JournalTail> {
    let mut tag = batch_tag(uuid, mark.generation);
    let mut next_epoch = Some(batch_tag(uuid, mark.generation + 1));
    let mut seq = mark.journal_seq;
    let mut pos = mark.journal_pos;
    let mut out = Vec::new();
    let mut places = Vec::new();
    let mut header = [0u8; HEADER];
    let mut scanned = 0u64;
    loop {
        if scanned > layout.journal_bytes {
            break;
        }
        let mut frame = None;
        for candidate in [pos, 0] {
            if candidate + BLOCK > layout.journal_bytes {
                continue;
            }
            device
                .read_at(&mut header, layout.journal_offset + candidate)
                .map_err(CacheError::device("read journal"))?;
            let found = |tag| {
                Frame::decode(&header, BATCH_MAGIC, tag)
                    .filter(|f| f.seq == seq && f.pos == candidate)
            };
            if let Some(f) = found(tag) {
                frame = Some(f);
                break;
            }
            if let Some(f) = next_epoch.and_then(found) {
                tag = f.tag;
                next_epoch = None;
                frame = Some(f);
                break;
            }
        }
        let Some(f) = frame else { break };
        let total =
            ((HEADER as u64 + u64::from(f.len)).div_ceil(BLOCK) * BLOCK).min(layout.journal_bytes);
        let mut buf = vec![0u8; total as usize];
        device
            .read_at(&mut buf, layout.journal_offset + f.pos)
            .map_err(CacheError::device("read journal"))?;
        let Some(payload) = buf.get(HEADER..HEADER + f.len as usize) else {
            break;
        };
        if crc32c::crc32c(payload) != f.payload_crc {
            break;
        }
        out.push(payload.to_vec());
        places.push((f.pos, total));
        scanned += total
            + if f.pos != pos {
                layout.journal_bytes - pos
            } else {
                0
            };
        pos = f.pos + total;
        seq += 1;
    }
    Ok(JournalTail {
        batches: out,
        places,
        pos,
        seq,
        entered_next_epoch: next_epoch.is_none(),
    })
}

/// What the batches in the ring claim was durable when they were
/// written (see [`Frame`]), and the batches after some sequence that
/// verify.
#[derive(Debug, Default)]
pub struct Claims {
    /// Every batch numbered below this was durable (claimed by batches of
    /// the loaded checkpoint's epoch or the next: the same run's numbers).
    pub durable_below: u64,
    /// The newest checkpoint a batch saw durable.
    pub checkpoint: u64,
    /// The newest epoch a batch of this cache was written in.
    pub newest_epoch: u64,
    /// (sequence, payload) of the batches that verify and follow the
    /// replayed ones: of the loaded checkpoint's run numbered at least the
    /// `from` of [`scan_claims`], and every one of later epochs.
    pub later: Vec<(u64, Vec<u8>)>,
}

/// Reads every batch header in the ring written after checkpoint
/// `generation` (in its epoch or any later one), a chunk at a time.
///
/// A batch of an epoch two or more past `generation` was written after a
/// newer checkpoint was made durable (a run's journal moves to the next
/// epoch when a checkpoint starts, and to the one after only once it
/// landed; a recovery writes its checkpoint before its first batch), and
/// says which one: a damaged newest checkpoint is found however many
/// epochs it is ahead.
pub fn scan_claims(
    device: &dyn Backend,
    layout: &Layout,
    uuid: &[u8; 16],
    generation: u64,
    from: u64,
) -> Result<Claims> {
    const CHUNK: u64 = 1 << 20;
    let mut claims = Claims::default();
    let mut buf = vec![0u8; CHUNK as usize];
    let mut at = 0;
    while at < layout.journal_bytes {
        let n = (layout.journal_bytes - at).min(CHUNK) as usize;
        device
            .read_at(&mut buf[..n], layout.journal_offset + at)
            .map_err(CacheError::device("read journal"))?;
        for block in (0..n).step_by(BLOCK as usize) {
            let Some(f) = Frame::decode_any_tag(&buf[block..n], BATCH_MAGIC)
                .filter(|f| f.pos == at + block as u64)
            else {
                continue;
            };
            let epoch = tag_epoch(uuid, f.tag);
            if epoch < generation || epoch - generation > EPOCH_WINDOW {
                continue;
            }
            let same_run = epoch <= generation + 1;
            if same_run {
                claims.durable_below = claims.durable_below.max(f.durable_below);
            }
            claims.checkpoint = claims.checkpoint.max(f.checkpoint);
            claims.newest_epoch = claims.newest_epoch.max(epoch);
            if f.seq >= from || !same_run {
                let mut payload = vec![0u8; f.len as usize];
                device
                    .read_at(&mut payload, layout.journal_offset + f.pos + HEADER as u64)
                    .map_err(CacheError::device("read journal"))?;
                if crc32c::crc32c(&payload) == f.payload_crc {
                    claims.later.push((f.seq, payload));
                }
            }
        }
        at += n as u64;
    }
    claims.later.sort_by_key(|(seq, _)| *seq);
    Ok(claims)
}

/// Decodes every entry of a batch payload.
pub fn decode_entries(payload: &[u8]) -> Result<Vec<Entry>> {
    let mut r = Reader::new(payload);
    let mut out = Vec::new();
    while !r.done() {
        out.push(Entry::decode(&mut r)?);
    }
    Ok(out)
}

/// Where replay starts after a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointMark {
    /// Checkpoint generation (the newer valid slot wins).
    pub generation: u64,
    /// Which of the two slots holds it.
    pub slot: usize,
    pub journal_seq: u64,
    pub journal_pos: u64,
}

/// Writes a checkpoint payload into its slot (not synced).
pub fn write_checkpoint(
    device: &dyn Backend,
    layout: &Layout,
    uuid: &[u8; 16],
    mark: CheckpointMark,
    payload: &[u8],
) -> Result<()> {
    let slot = mark.slot;
    if (HEADER + 8 + payload.len()) as u64 > layout.checkpoint_slot_bytes {
        return Err(CacheError::Corrupt(format!(
            "checkpoint of {} bytes does not fit its slot of {} bytes",
            payload.len(),
            layout.checkpoint_slot_bytes
        )));
    }
    let frame = Frame {
        magic: CHECKPOINT_MAGIC,
        tag: uuid_tag(uuid),
        seq: mark.generation,
        pos: mark.journal_pos,
        len: u32::try_from(payload.len())
            .map_err(|_| CacheError::Corrupt("checkpoint too large".into()))?,
        payload_crc: crc32c::crc32c(payload),
        durable_below: 0,
        checkpoint: 0,
    };
    let mut buf = Vec::with_capacity(HEADER + 8 + payload.len());
    buf.extend_from_slice(&frame.encode());
    put64(&mut buf, mark.journal_seq);
    buf.extend_from_slice(payload);
    buf.resize(buf.len().div_ceil(BLOCK as usize) * BLOCK as usize, 0);
    device
        .write_at(&buf, layout.slot_offset(slot))
        .map_err(CacheError::device("write checkpoint"))
}

/// The newest generation of a checkpoint frame in either slot, whatever
/// cache wrote it: a device with one is a cache even when its superblock
/// is gone.
pub fn stray_checkpoint_generation(device: &dyn Backend, layout: &Layout) -> Result<Option<u64>> {
    let mut newest = None;
    for slot in 0..2 {
        let mut head = [0u8; HEADER];
        device
            .read_at(&mut head, layout.slot_offset(slot))
            .map_err(CacheError::device("read checkpoint"))?;
        if let Some(f) = Frame::decode_any_tag(&head, CHECKPOINT_MAGIC) {
            newest = newest.max(Some(f.seq));
        }
    }
    Ok(newest)
}

/// The payload length the checkpoint frame in `slot` gives, if its header
/// verifies (whatever cache wrote it; the payload is not checked).
pub fn checkpoint_payload_len(
    device: &dyn Backend,
    layout: &Layout,
    slot: usize,
) -> Result<Option<u64>> {
    let mut head = [0u8; HEADER];
    device
        .read_at(&mut head, layout.slot_offset(slot))
        .map_err(CacheError::device("read checkpoint"))?;
    Ok(Frame::decode_any_tag(&head, CHECKPOINT_MAGIC).map(|f| u64::from(f.len)))
}

/// Bytes of a checkpoint slot before its payload: the frame and the
/// journal sequence of its mark.
pub const CHECKPOINT_PAYLOAD_AT: u64 = HEADER as u64 + 8;
/// Bytes of a journal batch before its payload.
pub const BATCH_PAYLOAD_AT: u64 = HEADER as u64;

/// Reads the newest valid checkpoint.
pub fn read_checkpoint(
    device: &dyn Backend,
    layout: &Layout,
    uuid: &[u8; 16],
) -> Result<(CheckpointMark, Vec<u8>)> {
    let tag = uuid_tag(uuid);
    let mut best: Option<(CheckpointMark, Vec<u8>)> = None;
    for slot in 0..2 {
        let mut head = [0u8; HEADER + 8];
        device
            .read_at(&mut head, layout.slot_offset(slot))
            .map_err(CacheError::device("read checkpoint"))?;
        let Some(f) = Frame::decode(&head, CHECKPOINT_MAGIC, tag) else {
            continue;
        };
        if (HEADER + 8) as u64 + u64::from(f.len) > layout.checkpoint_slot_bytes {
            continue;
        }
        let mut payload = vec![0u8; f.len as usize];
        device
            .read_at(
                &mut payload,
                layout.slot_offset(slot) + CHECKPOINT_PAYLOAD_AT,
            )
            .map_err(CacheError::device("read checkpoint"))?;
        if crc32c::crc32c(&payload) != f.payload_crc {
            continue;
        }
        let mut r = Reader::new(&head[HEADER..]);
        let journal_seq = r.u64()?;
        let mark = CheckpointMark {
            generation: f.seq,
            slot,
            journal_seq,
            journal_pos: f.pos,
        };
        if best
            .as_ref()
            .is_none_or(|(b, _)| b.generation < mark.generation)
        {
            best = Some((mark, payload));
        }
    }
    best.ok_or_else(|| CacheError::Corrupt("no valid checkpoint in either slot".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdcache_backend::MemBackend;

    fn setup() -> (MemBackend, Layout, [u8; 16]) {
        let l = Layout::compute(64 << 20, 1 << 20).unwrap();
        (
            MemBackend::new("dev", vec![0; l.device_bytes as usize]),
            l,
            [7u8; 16],
        )
    }

    /// A writer appending after checkpoint 5, and that checkpoint's mark.
    fn after_checkpoint_5(l: &Layout, uuid: &[u8; 16]) -> (JournalWriter, CheckpointMark) {
        let mark = CheckpointMark {
            generation: 5,
            slot: 0,
            journal_seq: 1,
            journal_pos: 0,
        };
        (JournalWriter::new(l, uuid, 5, 1, 0), mark)
    }

    #[test]
    fn a_batch_through_a_position_leaves_later_entries_pending() {
        let (dev, l, uuid) = setup();
        let (mut w, mark) = after_checkpoint_5(&l, &uuid);
        w.push(&Entry::Unmap { key: 1, slot: 0 });
        let through = w.pushed();
        w.push(&Entry::Unmap { key: 2, slot: 0 });
        assert!(w.write_pending_through(&dev, through).unwrap());
        // Nothing before the position is left; the rest goes next.
        assert!(!w.write_pending_through(&dev, through).unwrap());
        assert!(w.write_pending(&dev).unwrap());
        let JournalTail { batches, .. } = read_batches(&dev, &l, &uuid, mark).unwrap();
        let entries: Vec<Vec<Entry>> = batches.iter().map(|b| decode_entries(b).unwrap()).collect();
        assert_eq!(
            entries,
            [
                vec![Entry::Unmap { key: 1, slot: 0 }],
                vec![Entry::Unmap { key: 2, slot: 0 }]
            ]
        );
        // Dropped entries count as consumed: a later position is exact.
        w.push(&Entry::Unmap { key: 3, slot: 0 });
        w.drop_pending();
        w.push(&Entry::Unmap { key: 4, slot: 0 });
        let through = w.pushed();
        w.push(&Entry::Unmap { key: 5, slot: 0 });
        assert!(w.write_pending_through(&dev, through).unwrap());
        assert_eq!(w.pending_bytes(), w.pushed() as usize - through as usize);
    }

    #[test]
    fn a_batch_that_failed_to_be_written_keeps_its_entries_pending() {
        let (dev, l, uuid) = setup();
        let dev = std::sync::Arc::new(dev);
        let (mut w, mark) = after_checkpoint_5(&l, &uuid);
        let full = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let flag = full.clone();
        let failing =
            vdcache_backend::inject::HookedBackend::new(dev.clone()).on_write(move || {
                match flag.load(std::sync::atomic::Ordering::SeqCst) {
                    true => Err(std::io::Error::from_raw_os_error(28)),
                    false => Ok(()),
                }
            });
        w.push(&Entry::Unmap { key: 1, slot: 0 });
        assert!(w.write_pending(&failing).is_err());
        full.store(false, std::sync::atomic::Ordering::SeqCst);
        w.push(&Entry::Unmap { key: 2, slot: 0 });
        assert!(w.write_pending(&failing).unwrap());
        let JournalTail { batches, .. } = read_batches(&*dev, &l, &uuid, mark).unwrap();
        let entries: Vec<Vec<Entry>> = batches.iter().map(|b| decode_entries(b).unwrap()).collect();
        assert_eq!(
            entries,
            [vec![
                Entry::Unmap { key: 1, slot: 0 },
                Entry::Unmap { key: 2, slot: 0 }
            ]]
        );
    }

    #[test]
    fn batches_replay_in_order_and_stop_at_a_torn_one() {
        let (dev, l, uuid) = setup();
        let (mut w, mark) = after_checkpoint_5(&l, &uuid);
        for i in 0..5u64 {
            w.push(&Entry::Unmap { key: i, slot: 1 });
            w.push(&Entry::Map {
                key: i,
                slot: 2,
                cbn: 9,
                guest: 3,
                dirty: true,
                crc: 11,
            });
            assert!(w.write_pending(&dev).unwrap());
        }
        let JournalTail { batches, seq, .. } = read_batches(&dev, &l, &uuid, mark).unwrap();
        assert_eq!(batches.len(), 5);
        assert_eq!(seq, 6);
        assert_eq!(
            decode_entries(&batches[2]).unwrap()[0],
            Entry::Unmap { key: 2, slot: 1 }
        );
        // Tear the third batch: replay keeps only the first two.
        dev.write_at(&[0xff; 8], l.journal_offset + 2 * BLOCK + HEADER as u64)
            .unwrap();
        let batches = read_batches(&dev, &l, &uuid, mark).unwrap().batches;
        assert_eq!(batches.len(), 2);
        // Another cache's batches, or another epoch's, are not replayed.
        let batches = read_batches(&dev, &l, &[8u8; 16], mark).unwrap().batches;
        assert!(batches.is_empty());
        let later = CheckpointMark {
            generation: 6,
            ..mark
        };
        let batches = read_batches(&dev, &l, &uuid, later).unwrap().batches;
        assert!(batches.is_empty());
    }

    #[test]
    fn replay_follows_the_journal_into_the_next_epoch_only() {
        let (dev, l, uuid) = setup();
        let (mut w, mark) = after_checkpoint_5(&l, &uuid);
        let batch = |w: &mut JournalWriter, key| {
            w.push(&Entry::Unmap { key, slot: 0 });
            assert!(w.write_pending(&dev).unwrap());
        };
        batch(&mut w, 1);
        // Checkpoint 6 starts (and never lands); the journal goes on.
        w.start_epoch(6);
        batch(&mut w, 2);
        batch(&mut w, 3);
        let JournalTail { batches, seq, .. } = read_batches(&dev, &l, &uuid, mark).unwrap();
        assert_eq!(batches.len(), 3);
        assert_eq!(seq, 4);
        // Two epochs on is a later run's journal: not this checkpoint's.
        w.start_epoch(8);
        batch(&mut w, 4);
        let batches = read_batches(&dev, &l, &uuid, mark).unwrap().batches;
        assert_eq!(batches.len(), 3);
    }

    /// Issue 43: a checkpoint made durable more than one epoch past the
    /// loaded one is found from the batches written after it.
    #[test]
    fn claims_of_every_later_epoch_are_read() {
        let (dev, l, uuid) = setup();
        let (mut w, mark) = after_checkpoint_5(&l, &uuid);
        w.push(&Entry::Unmap { key: 1, slot: 0 });
        assert!(w.write_pending(&dev).unwrap());
        // A later run, after checkpoint 8 (a restart writes two epochs on).
        let mut later = JournalWriter::new(&l, &uuid, 8, 1, BLOCK);
        later.push(&Entry::Unmap { key: 2, slot: 0 });
        assert!(later.write_pending(&dev).unwrap());
        // Another cache's batch, and one of an earlier epoch.
        let mut other = JournalWriter::new(&l, &[8u8; 16], 9, 1, 2 * BLOCK);
        other.push(&Entry::Unmap { key: 3, slot: 0 });
        assert!(other.write_pending(&dev).unwrap());
        let mut earlier = JournalWriter::new(&l, &uuid, 3, 1, 3 * BLOCK);
        earlier.push(&Entry::Unmap { key: 4, slot: 0 });
        assert!(earlier.write_pending(&dev).unwrap());
        let claims = scan_claims(&dev, &l, &uuid, mark.generation, 2).unwrap();
        assert_eq!(claims.checkpoint, 8);
        assert_eq!(claims.newest_epoch, 8);
        // Durability is claimed in this run's numbers only.
        assert_eq!(claims.durable_below, 1);
        let later: Vec<Vec<Entry>> = claims
            .later
            .iter()
            .map(|(_, p)| decode_entries(p).unwrap())
            .collect();
        assert_eq!(later, [vec![Entry::Unmap { key: 2, slot: 0 }]]);
    }

    #[test]
    fn room_is_kept_for_replay_from_the_durable_checkpoint() {
        let (dev, l, uuid) = setup();
        let mut w = JournalWriter::new(&l, &uuid, 1, 1, 0);
        let mut written = 0u64;
        let fill = |w: &mut JournalWriter| {
            for _ in 0..100 {
                w.push(&Entry::Unmap { key: 9, slot: 0 });
            }
        };
        fill(&mut w);
        while w.has_room() {
            assert!(w.write_pending(&dev).unwrap());
            written += BLOCK;
            fill(&mut w);
        }
        assert!(written + BLOCK > l.journal_bytes - BLOCK);
        assert!(w.needs_checkpoint(l.journal_bytes / 2));
        // Starting a checkpoint frees nothing; its landing does.
        w.start_epoch(2);
        assert!(!w.has_room());
        assert!(!w.needs_checkpoint(l.journal_bytes / 2));
        w.checkpoint_durable(2);
        assert!(w.has_room());
    }

    #[test]
    fn ring_wraps_and_replay_follows() {
        let (dev, l, uuid) = setup();
        let start = l.journal_bytes - 2 * BLOCK;
        let mut w = JournalWriter::new(&l, &uuid, 1, 40, start);
        for i in 0..4u64 {
            for _ in 0..200 {
                w.push(&Entry::Unmap { key: i, slot: 0 });
            }
            w.write_pending(&dev).unwrap();
        }
        let mark = CheckpointMark {
            generation: 1,
            slot: 0,
            journal_seq: 40,
            journal_pos: start,
        };
        let JournalTail { batches, pos, .. } = read_batches(&dev, &l, &uuid, mark).unwrap();
        assert_eq!(batches.len(), 4);
        assert!(pos < start);
    }

    #[test]
    fn newest_valid_checkpoint_wins() {
        let (dev, l, uuid) = setup();
        for g in 1..=3u64 {
            let mark = CheckpointMark {
                generation: g,
                slot: (g % 2) as usize,
                journal_seq: g * 10,
                journal_pos: g * BLOCK,
            };
            write_checkpoint(&dev, &l, &uuid, mark, &[g as u8; 100]).unwrap();
        }
        let (mark, payload) = read_checkpoint(&dev, &l, &uuid).unwrap();
        assert_eq!(mark.generation, 3);
        assert_eq!(payload, vec![3u8; 100]);
        // Tear generation 3 (slot 1): generation 2 in slot 0 is used.
        dev.write_at(&[0u8; 16], l.slot_offset(1) + 50).unwrap();
        assert_eq!(read_checkpoint(&dev, &l, &uuid).unwrap().0.generation, 2);
    }
}
