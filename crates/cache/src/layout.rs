//! The cache device's on-flash layout: superblock | checkpoint area (two
//! alternating slots) | metadata zone (a ring of journal records) | a copy
//! of the superblock | data zone (regions the size of a flash erase block,
//! filled append-only). Everything before the data zone is placed by the
//! device's size alone, so the superblock's copy is found without it.
//!
//! This module computes and validates the layout and reads and writes the
//! superblock; it knows nothing about what the index or journal contain.

use crate::error::{CacheError, Result};
use vdcache_backend::Backend;

/// Cache block size: the unit of caching and of flash allocation.
pub const BLOCK: u64 = 4096;
/// Blocks per index line (one virtual cache map entry covers 64 KiB of an
/// image: one cluster at qcow2's default cluster size).
pub const LINE_BLOCKS: u64 = 16;
/// Bytes per index line.
pub const LINE: u64 = BLOCK * LINE_BLOCKS;
/// Default region (erase block) size.
pub const DEFAULT_REGION: u64 = 2 << 20;
/// Smallest device the layout accepts.
pub const MIN_DEVICE: u64 = 16 << 20;

const MAGIC: &[u8; 8] = b"VDCACHE1";

/// Whether `head` (a device's first bytes) starts like a cache's superblock.
pub fn is_cache_magic(head: &[u8]) -> bool {
    head.starts_with(MAGIC)
}
/// 3: regions end with a summary block (regions of 64 blocks or more).
/// 4: partially valid blocks may have valid 512-byte sectors (journal
/// entry 9, and a field of partially valid lines in checkpoints).
/// 5: images are recorded with their cache mark and store identity.
const VERSION: u32 = 5;
const SUPERBLOCK_BYTES: u64 = BLOCK;
/// The second half of the superblock's block holds the seal (see
/// `crate::seal`): the superblock's encoding ends well before it, and a
/// repair of the superblock writes only the first half.
pub const SEAL_AREA: u64 = SUPERBLOCK_BYTES / 2;
/// Room reserved in a checkpoint for the image registry.
pub const REGISTRY_BYTES: u64 = 1 << 20;
/// Checkpoint bytes per data block in the worst case (one line per block:
/// key, guest line, three bitmaps, one block number and its checksum).
const CHECKPOINT_BYTES_PER_BLOCK: u64 = 36;
/// Checkpoint bytes per data block on a cache formatted for dedup: room
/// for about ten addresses per block in full lines (some 9.5 bytes each),
/// or three in lines of their own. Sharing that would outgrow it stores
/// copies instead (see `tier::sharing`).
const CHECKPOINT_BYTES_PER_BLOCK_DEDUP: u64 = 96;
/// Checkpoint bytes per dirty metadata sector (image, offset, 512 bytes).
const CHECKPOINT_BYTES_PER_SECTOR: u64 = 528;

/// Where everything lives on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub device_bytes: u64,
    pub region_bytes: u64,
    pub regions: u32,
    pub checkpoint_offset: u64,
    pub checkpoint_slot_bytes: u64,
    pub journal_offset: u64,
    pub journal_bytes: u64,
    pub data_offset: u64,
}

impl Layout {
    /// Computes a layout for a device of `device_bytes` with regions of
    /// `region_bytes` (a multiple of the block size, at least 64 KiB).
    pub fn compute(device_bytes: u64, region_bytes: u64) -> Result<Layout> {
        Layout::compute_for(device_bytes, region_bytes, false)
    }

    /// As [`Self::compute`]; `dedup`: the checkpoint slots have room for
    /// many addresses sharing each block (about 4.7% of the device for the
    /// two slots, against 1.8%).
    pub fn compute_for(device_bytes: u64, region_bytes: u64, dedup: bool) -> Result<Layout> {
        if region_bytes < BLOCK || !region_bytes.is_multiple_of(BLOCK) {
            return Err(CacheError::Config(format!(
                "region size {region_bytes} must be a non-zero multiple of {BLOCK}"
            )));
        }
        if device_bytes < MIN_DEVICE {
            return Err(CacheError::Config(format!(
                "cache size {device_bytes} is below the minimum of {MIN_DEVICE} bytes"
            )));
        }
        let round = |v: u64| v.div_ceil(BLOCK) * BLOCK;
        let journal_bytes = round((device_bytes / 128).clamp(4 << 20, 256 << 20));
        let estimate_blocks = device_bytes / BLOCK;
        let slot = round(
            BLOCK
                + REGISTRY_BYTES
                + estimate_blocks
                    * if dedup {
                        CHECKPOINT_BYTES_PER_BLOCK_DEDUP
                    } else {
                        CHECKPOINT_BYTES_PER_BLOCK
                    }
                + meta_store_sectors(device_bytes) * CHECKPOINT_BYTES_PER_SECTOR,
        );
        let checkpoint_offset = SUPERBLOCK_BYTES;
        let journal_offset = checkpoint_offset + 2 * slot;
        let data_offset = round(journal_offset + journal_bytes + SUPERBLOCK_BYTES)
            .div_ceil(region_bytes)
            * region_bytes;
        if data_offset >= device_bytes {
            return Err(CacheError::Config(format!(
                "cache size {device_bytes} leaves no room for data after {data_offset} bytes of metadata"
            )));
        }
        let regions = (device_bytes - data_offset) / region_bytes;
        if regions < 4 {
            return Err(CacheError::Config(format!(
                "cache size {device_bytes} holds only {regions} regions of {region_bytes} bytes; at least 4 are needed"
            )));
        }
        let regions = u32::try_from(regions).map_err(|_| {
            CacheError::Config(format!(
                "{regions} regions are too many; use larger regions"
            ))
        })?;
        Ok(Layout {
            device_bytes,
            region_bytes,
            regions,
            checkpoint_offset,
            checkpoint_slot_bytes: slot,
            journal_offset,
            journal_bytes,
            data_offset,
        })
    }

    /// Dirty 512-byte metadata sectors the cache may hold (cow-aware
    /// write-back) before it must write them back: a checkpoint has room
    /// for all of them.
    pub fn meta_store_sectors(&self) -> u64 {
        meta_store_sectors(self.device_bytes)
    }

    /// Bytes of a checkpoint slot reserved for the lines of the virtual
    /// cache map: what remains beside the frame, the image registry and
    /// the dirty metadata sectors (at least [`CHECKPOINT_BYTES_PER_BLOCK`]
    /// per block of the device).
    pub fn checkpoint_lines_room(&self) -> u64 {
        self.checkpoint_slot_bytes.saturating_sub(
            BLOCK + REGISTRY_BYTES + self.meta_store_sectors() * CHECKPOINT_BYTES_PER_SECTOR,
        )
    }

    /// The layouts a device of `device_bytes` may have: formatted without
    /// and with room for dedup.
    pub fn candidates(device_bytes: u64, region_bytes: u64) -> Vec<Layout> {
        [false, true]
            .into_iter()
            .filter_map(|dedup| Layout::compute_for(device_bytes, region_bytes, dedup).ok())
            .collect()
    }

    /// Whether the checkpoint slots were sized for dedup.
    pub fn has_dedup_room(&self) -> bool {
        Layout::compute_for(self.device_bytes, self.region_bytes, true).is_ok_and(|l| l == *self)
    }

    pub fn blocks_per_region(&self) -> u32 {
        (self.region_bytes / BLOCK) as u32
    }

    pub fn data_blocks(&self) -> u64 {
        u64::from(self.regions) * u64::from(self.blocks_per_region())
    }

    /// Blocks of a region that hold cached data (the rest, its summary).
    pub fn data_blocks_per_region(&self) -> u32 {
        let bpr = self.blocks_per_region();
        bpr - crate::summary::summary_blocks(bpr)
    }

    /// Blocks the cache can hold data in.
    pub fn cacheable_blocks(&self) -> u64 {
        u64::from(self.regions) * u64::from(self.data_blocks_per_region())
    }

    /// True when `cbn` is a data block (not past the zone, not a summary).
    pub fn is_data_block(&self, cbn: u32) -> bool {
        u64::from(cbn) < self.data_blocks()
            && cbn % self.blocks_per_region() < self.data_blocks_per_region()
    }

    /// Device offset of a region's summary.
    pub fn summary_offset(&self, region: u32) -> u64 {
        self.block_offset(region * self.blocks_per_region() + self.data_blocks_per_region())
    }

    /// Device offset of data block `cbn`.
    pub fn block_offset(&self, cbn: u32) -> u64 {
        self.data_offset + u64::from(cbn) * BLOCK
    }

    pub fn region_of(&self, cbn: u32) -> u32 {
        cbn / self.blocks_per_region()
    }

    pub fn region_offset(&self, region: u32) -> u64 {
        self.data_offset + u64::from(region) * self.region_bytes
    }

    /// Where the superblock's copy lives: right after the journal.
    pub fn backup_superblock_offset(&self) -> u64 {
        self.journal_offset + self.journal_bytes
    }

    pub fn slot_offset(&self, slot: usize) -> u64 {
        self.checkpoint_offset + slot as u64 * self.checkpoint_slot_bytes
    }
}

/// 1/512 of the device, between 256 KiB and 32 MiB of sectors.
fn meta_store_sectors(device_bytes: u64) -> u64 {
    (device_bytes / 512).clamp(256 << 10, 32 << 20) / 512
}

/// The superblock: identity and layout of a cache device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub uuid: [u8; 16],
    pub host: String,
    pub layout: Layout,
    pub created_unix: u64,
}

/// Longest host name a superblock records: its encoding (at most 380
/// bytes) then stays clear of [`SEAL_AREA`].
const MAX_HOST: usize = 256;

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn u64(&mut self) -> Result<u64> {
        let b = self
            .buf
            .get(self.pos..self.pos + 8)
            .ok_or_else(|| CacheError::Corrupt("superblock is truncated".into()))?;
        self.pos += 8;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(SUPERBLOCK_BYTES as usize);
        out.extend_from_slice(MAGIC);
        put(&mut out, u64::from(VERSION));
        out.extend_from_slice(&self.uuid);
        let l = &self.layout;
        for v in [
            l.device_bytes,
            l.region_bytes,
            u64::from(l.regions),
            l.checkpoint_offset,
            l.checkpoint_slot_bytes,
            l.journal_offset,
            l.journal_bytes,
            l.data_offset,
            self.created_unix,
        ] {
            put(&mut out, v);
        }
        let host = self.host.as_bytes();
        let host = &host[..host.len().min(MAX_HOST)];
        put(&mut out, host.len() as u64);
        out.extend_from_slice(host);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out.resize(SUPERBLOCK_BYTES as usize, 0);
        out
    }

    /// Parses and validates a superblock; a torn or foreign one is an error.
    pub fn decode(buf: &[u8]) -> Result<Superblock> {
        if buf.len() < 64 || &buf[..8] != MAGIC {
            return Err(CacheError::NotACache);
        }
        let mut c = Cursor { buf, pos: 8 };
        let version = c.u64()?;
        if version != u64::from(VERSION) {
            return Err(CacheError::Corrupt(format!(
                "superblock version {version} is not supported (expected {VERSION}): the cache was formatted by another vdcache version; write its dirty data back with that version's `vdcache recover --full`, then remove it"
            )));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&buf[16..32]);
        c.pos = 32;
        let mut f = [0u64; 9];
        for v in &mut f {
            *v = c.u64()?;
        }
        let host_len = c.u64()? as usize;
        if host_len > MAX_HOST {
            return Err(CacheError::Corrupt(
                "superblock host name is too long".into(),
            ));
        }
        let host_end = c.pos + host_len;
        let crc_end = host_end + 4;
        if crc_end > buf.len() {
            return Err(CacheError::Corrupt("superblock is truncated".into()));
        }
        let host = String::from_utf8_lossy(&buf[c.pos..host_end]).into_owned();
        let mut crc = [0u8; 4];
        crc.copy_from_slice(&buf[host_end..crc_end]);
        if crc32c::crc32c(&buf[..host_end]) != u32::from_le_bytes(crc) {
            return Err(CacheError::Corrupt(
                "superblock checksum mismatch (torn or overwritten superblock)".into(),
            ));
        }
        let regions =
            u32::try_from(f[2]).map_err(|_| CacheError::Corrupt("region count".into()))?;
        let layout = Layout {
            device_bytes: f[0],
            region_bytes: f[1],
            regions,
            checkpoint_offset: f[3],
            checkpoint_slot_bytes: f[4],
            journal_offset: f[5],
            journal_bytes: f[6],
            data_offset: f[7],
        };
        if !Layout::candidates(layout.device_bytes, layout.region_bytes).contains(&layout) {
            return Err(CacheError::Corrupt(
                "superblock layout is inconsistent with its device size".into(),
            ));
        }
        Ok(Superblock {
            uuid,
            host,
            layout,
            created_unix: f[8],
        })
    }

    /// Reads the superblock, from its copy when the first one is damaged
    /// (then written again from the copy, which is reported); a copy that
    /// disagrees with a good superblock is written again too.
    pub fn read(device: &dyn Backend) -> Result<Superblock> {
        let len = device.len().map_err(CacheError::device("stat"))?;
        let primary = read_at(device, 0).and_then(|b| Superblock::decode(&b));
        let sb = match primary {
            Ok(sb) => {
                let backup = sb.layout.backup_superblock_offset();
                if read_at(device, backup).ok() != Some(sb.encode()) && backup < len {
                    tracing::warn!("the cache's superblock copy was damaged: written again");
                    sb.write_copy(device)?;
                }
                sb
            }
            Err(e @ (CacheError::NotACache | CacheError::Corrupt(_))) => {
                let Some(sb) = backup_of(device, len) else {
                    return Err(e);
                };
                tracing::warn!("the cache's superblock was damaged ({e}); restored from its copy");
                device
                    .write_at(&sb.encode()[..SEAL_AREA as usize], 0)
                    .and_then(|()| device.flush())
                    .map_err(CacheError::device("repair superblock"))?;
                sb
            }
            Err(e) => return Err(e),
        };
        if len < sb.layout.device_bytes {
            return Err(CacheError::Corrupt(format!(
                "the cache device is {len} bytes but its superblock describes {} bytes: it was truncated",
                sb.layout.device_bytes
            )));
        }
        Ok(sb)
    }

    /// The superblock, or its copy when the first one is damaged, without
    /// writing anything (for a look at a device another process may own).
    pub fn peek(device: &dyn Backend) -> Option<Superblock> {
        let len = device.len().ok()?;
        read_at(device, 0)
            .and_then(|b| Superblock::decode(&b))
            .ok()
            .or_else(|| backup_of(device, len))
    }

    /// Writes the superblock and its copy (not synced).
    pub fn write(&self, device: &dyn Backend) -> Result<()> {
        self.write_copy(device)?;
        device
            .write_at(&self.encode(), 0)
            .map_err(CacheError::device("write superblock"))
    }

    fn write_copy(&self, device: &dyn Backend) -> Result<()> {
        device
            .write_at(&self.encode(), self.layout.backup_superblock_offset())
            .map_err(CacheError::device("write superblock copy"))
    }

    pub fn uuid_hex(&self) -> String {
        self.uuid.iter().map(|b| format!("{b:02x}")).collect()
    }
}

fn read_at(device: &dyn Backend, offset: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; SUPERBLOCK_BYTES as usize];
    device
        .read_at(&mut buf, offset)
        .map_err(CacheError::device("read superblock"))?;
    Ok(buf)
}

/// The superblock's copy, where a device of `len` bytes keeps it (its
/// place depends on the device size alone), if it decodes.
fn backup_of(device: &dyn Backend, len: u64) -> Option<Superblock> {
    Layout::candidates(len, BLOCK)
        .into_iter()
        .find_map(|probe| {
            let at = probe.backup_superblock_offset();
            let sb = Superblock::decode(&read_at(device, at).ok()?).ok()?;
            (sb.layout.backup_superblock_offset() == at).then_some(sb)
        })
}

/// This host's identity: /etc/machine-id, else the host name.
pub fn host_identity() -> String {
    if let Ok(id) = std::fs::read_to_string("/etc/machine-id") {
        let id = id.trim();
        if !id.is_empty() {
            return id.to_string();
        }
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

/// A random 128-bit identifier (from the kernel's random source).
pub fn random_uuid() -> [u8; 16] {
    let mut u = [0u8; 16];
    if let Ok(bytes) = std::fs::read("/proc/sys/kernel/random/uuid") {
        let hex: Vec<u8> = bytes
            .iter()
            .copied()
            .filter(u8::is_ascii_hexdigit)
            .collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let s = std::str::from_utf8(pair).unwrap_or("0");
            u[i] = u8::from_str_radix(s, 16).unwrap_or(0);
        }
    }
    if u == [0u8; 16] {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        u = (t ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    u
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_fits_and_superblock_round_trips() {
        let l = Layout::compute(1 << 30, DEFAULT_REGION).unwrap();
        assert!(l.data_offset.is_multiple_of(l.region_bytes));
        assert!(l.data_offset + u64::from(l.regions) * l.region_bytes <= l.device_bytes);
        assert!(l.checkpoint_slot_bytes >= l.data_blocks() * CHECKPOINT_BYTES_PER_BLOCK);
        let sb = Superblock {
            uuid: random_uuid(),
            host: "host-a".into(),
            layout: l,
            created_unix: 7,
        };
        let mut bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
        bytes[100] ^= 1;
        assert!(matches!(
            Superblock::decode(&bytes),
            Err(CacheError::Corrupt(_))
        ));
        assert!(matches!(
            Superblock::decode(&[0u8; 4096]),
            Err(CacheError::NotACache)
        ));
        assert!(Layout::compute(1 << 20, DEFAULT_REGION).is_err());
        // A device of layout version 2 (regions without summaries) is refused.
        let mut old = sb.encode();
        old[8..16].copy_from_slice(&2u64.to_le_bytes());
        let e = Superblock::decode(&old).unwrap_err().to_string();
        assert!(e.contains("version 2 is not supported"), "{e}");
    }

    /// A cache formatted for dedup has larger checkpoint slots; its
    /// superblock is accepted, and found from its copy when damaged, as a
    /// plain cache's is.
    #[test]
    fn a_cache_formatted_for_dedup_has_room_for_shared_addresses() {
        let device = 256u64 << 20;
        let plain = Layout::compute(device, DEFAULT_REGION).unwrap();
        let dedup = Layout::compute_for(device, DEFAULT_REGION, true).unwrap();
        assert!(!plain.has_dedup_room() && dedup.has_dedup_room());
        assert!(
            dedup.checkpoint_lines_room() >= (device / BLOCK) * CHECKPOINT_BYTES_PER_BLOCK_DEDUP
        );
        assert!(plain.checkpoint_lines_room() >= (device / BLOCK) * CHECKPOINT_BYTES_PER_BLOCK);
        assert!(dedup.regions < plain.regions);
        for layout in [plain, dedup] {
            let sb = Superblock {
                uuid: random_uuid(),
                host: "host-a".into(),
                layout,
                created_unix: 7,
            };
            let dev = vdcache_backend::MemBackend::new("dev", vec![0; device as usize]);
            sb.write(&dev).unwrap();
            assert_eq!(Superblock::read(&dev).unwrap(), sb);
            dev.write_at(&[0xa5; 64], 0).unwrap();
            assert_eq!(
                Superblock::read(&dev).unwrap(),
                sb,
                "restored from its copy"
            );
        }
        // A slot of neither size is refused.
        let mut odd = dedup;
        odd.checkpoint_slot_bytes += BLOCK;
        let sb = Superblock {
            uuid: random_uuid(),
            host: "host-a".into(),
            layout: odd,
            created_unix: 7,
        };
        let e = Superblock::decode(&sb.encode()).unwrap_err().to_string();
        assert!(e.contains("inconsistent"), "{e}");
    }

    /// A superblock restored from its copy leaves the seal beside it.
    #[test]
    fn repairing_the_superblock_keeps_the_seal() {
        let l = Layout::compute(64 << 20, DEFAULT_REGION).unwrap();
        let sb = Superblock {
            uuid: random_uuid(),
            host: "h".repeat(MAX_HOST + 10),
            layout: l,
            created_unix: 7,
        };
        assert!(sb.encode()[SEAL_AREA as usize..].iter().all(|&b| b == 0));
        let dev = vdcache_backend::MemBackend::new("dev", vec![0; l.device_bytes as usize]);
        sb.write(&dev).unwrap();
        let sealer = crate::seal::Sealer::new(sb.uuid, None, 1);
        sealer.seal(&dev, 9, 1).unwrap();
        dev.write_at(&[0xa5; 64], 0).unwrap();
        assert_eq!(Superblock::read(&dev).unwrap().uuid, sb.uuid);
        let seal = crate::seal::read_seal(&dev, &sb.uuid).unwrap().unwrap();
        assert_eq!(seal.durable_below, 9);
    }

    #[test]
    fn summary_blocks_are_not_data_blocks() {
        let l = Layout::compute(64 << 20, DEFAULT_REGION).unwrap();
        assert_eq!(l.data_blocks_per_region(), 511);
        assert!(l.is_data_block(510));
        assert!(!l.is_data_block(511), "the summary block of region 0");
        assert!(l.is_data_block(512));
        assert!(!l.is_data_block(l.data_blocks() as u32));
        assert_eq!(l.summary_offset(1), l.block_offset(1023));
    }
}
