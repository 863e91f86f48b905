//! The seal: a small record saying what the last completed sync of the
//! cache device made durable (every journal batch numbered below
//! `durable_below`, and checkpoint `checkpoint`), so that recovery can tell
//! metadata the device damaged from a tail a crash tore. Nothing else can
//! speak for the newest batches: a batch's own claims are read from the
//! batches after it, and the last batch before a crash has none.
//!
//! A seal is written after each successful sync and before the flush that
//! sync serves is acknowledged. It is not synced itself (the next sync
//! carries it), so it costs no sync: a process that dies keeps it (it
//! reached the file), and a power cut may lose the newest one, leaving an
//! older seal that claims less. A seal never claims more than was durable.
//!
//! Two copies alternate, each in its own 512-byte sector of the second
//! half of the superblock's block (see [`crate::layout::SEAL_AREA`]), so a
//! torn seal write leaves the other; the one with the higher counter that
//! verifies wins. An area of zeros (a cache formatted before seals
//! existed) holds no seal, and recovery then checks what it can without.
//!
//! This module owns the record's format, its places and the order of its
//! writes; it must not decide what a seal means for recovery (that is
//! `tier::recover`) nor sync the device.

use crate::error::{CacheError, Result};
use crate::layout::SEAL_AREA;
use std::sync::{Mutex, MutexGuard};
use vdcache_backend::Backend;

const MAGIC: &[u8; 8] = b"VDSEAL01";
/// Bytes of one seal write: one sector.
pub const SEAL_BYTES: usize = 512;
/// Bytes of the record inside its sector (the rest is zeros).
const RECORD: usize = 52;

/// Device offsets of the two copies.
pub fn seal_offsets() -> [u64; 2] {
    [SEAL_AREA, SEAL_AREA + 2 * SEAL_BYTES as u64]
}

/// What a sync made durable, as a seal records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seal {
    /// Numbers the seal writes of a cache; the higher copy is the newer.
    pub counter: u64,
    /// Every journal batch numbered below this was durable.
    pub durable_below: u64,
    /// The newest durable checkpoint's generation.
    pub checkpoint: u64,
}

impl Seal {
    fn encode(&self, uuid: &[u8; 16]) -> [u8; SEAL_BYTES] {
        let mut out = [0u8; SEAL_BYTES];
        out[..8].copy_from_slice(MAGIC);
        out[8..24].copy_from_slice(uuid);
        out[24..32].copy_from_slice(&self.counter.to_le_bytes());
        out[32..40].copy_from_slice(&self.durable_below.to_le_bytes());
        out[40..48].copy_from_slice(&self.checkpoint.to_le_bytes());
        let crc = crc32c::crc32c(&out[..48]);
        out[48..RECORD].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// The seal in `buf` if it is one of cache `uuid`'s and verifies.
    fn decode(buf: &[u8], uuid: &[u8; 16]) -> Option<Seal> {
        let b = buf.get(..RECORD)?;
        let u64_at = |at: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(a)
        };
        let mut crc = [0u8; 4];
        crc.copy_from_slice(&b[48..RECORD]);
        (&b[..8] == MAGIC
            && &b[8..24] == uuid
            && crc32c::crc32c(&b[..48]) == u32::from_le_bytes(crc))
        .then(|| Seal {
            counter: u64_at(24),
            durable_below: u64_at(32),
            checkpoint: u64_at(40),
        })
    }
}

/// The newest seal of cache `uuid` on `device`, if either copy verifies.
pub fn read_seal(device: &dyn Backend, uuid: &[u8; 16]) -> Result<Option<Seal>> {
    let mut newest: Option<Seal> = None;
    let mut buf = [0u8; SEAL_BYTES];
    for at in seal_offsets() {
        device
            .read_at(&mut buf, at)
            .map_err(CacheError::device("read the seal"))?;
        if let Some(s) = Seal::decode(&buf, uuid)
            && newest.is_none_or(|n| n.counter < s.counter)
        {
            newest = Some(s);
        }
    }
    Ok(newest)
}

/// Writes the seals of one run of a cache, one at a time.
#[derive(Debug)]
pub(crate) struct Sealer {
    uuid: [u8; 16],
    /// A leaf lock, held across its own one-sector write (two writers
    /// must not land out of order on the same copy); taken under the
    /// state lock or alone.
    state: Mutex<SealState>,
}

#[derive(Debug)]
struct SealState {
    /// The counter of the last seal written (or found at open).
    counter: u64,
    /// What the next seal says, and what the last one written said.
    wanted: (u64, u64),
    written: (u64, u64),
}

impl Sealer {
    /// A run after the seal `found` (none on a new cache), starting from
    /// durable checkpoint `checkpoint`.
    pub(crate) fn new(uuid: [u8; 16], found: Option<Seal>, checkpoint: u64) -> Sealer {
        let start = (0, checkpoint);
        Sealer {
            uuid,
            state: Mutex::new(SealState {
                counter: found.map_or(0, |s| s.counter),
                wanted: start,
                written: start,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SealState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what a completed sync made durable and writes the seal
    /// saying so, unless one already said as much. Returns once the seal
    /// reached the device (not synced).
    pub(crate) fn seal(
        &self,
        device: &dyn Backend,
        durable_below: u64,
        checkpoint: u64,
    ) -> Result<()> {
        let mut s = self.lock();
        s.wanted = (s.wanted.0.max(durable_below), s.wanted.1.max(checkpoint));
        if s.wanted == s.written {
            return Ok(());
        }
        let seal = Seal {
            counter: s.counter + 1,
            durable_below: s.wanted.0,
            checkpoint: s.wanted.1,
        };
        let at = seal_offsets()[(seal.counter % 2) as usize];
        // A failed write may have torn this copy: the next seal goes to
        // the other one either way.
        s.counter = seal.counter;
        device
            .write_at(&seal.encode(&self.uuid), at)
            .map_err(CacheError::device("write the seal"))?;
        s.written = s.wanted;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdcache_backend::MemBackend;

    const UUID: [u8; 16] = [7; 16];

    fn device() -> MemBackend {
        MemBackend::new("dev", vec![0; 8192])
    }

    #[test]
    fn no_seal_on_zeros_and_the_newest_copy_wins() {
        let dev = device();
        assert_eq!(read_seal(&dev, &UUID).unwrap(), None);
        let sealer = Sealer::new(UUID, None, 3);
        sealer.seal(&dev, 10, 3).unwrap();
        sealer.seal(&dev, 12, 4).unwrap();
        let s = read_seal(&dev, &UUID).unwrap().unwrap();
        assert_eq!((s.counter, s.durable_below, s.checkpoint), (2, 12, 4));
        // Nothing new: no write (the counter stays).
        sealer.seal(&dev, 11, 4).unwrap();
        assert_eq!(read_seal(&dev, &UUID).unwrap().unwrap().counter, 2);
        // Another cache's seals are not this one's.
        assert_eq!(read_seal(&dev, &[8; 16]).unwrap(), None);
    }

    #[test]
    fn a_torn_copy_leaves_the_other() {
        let dev = device();
        let sealer = Sealer::new(UUID, None, 1);
        sealer.seal(&dev, 5, 1).unwrap();
        sealer.seal(&dev, 9, 1).unwrap();
        // The newer copy (counter 2, the first place) does not verify.
        dev.write_at(&[0xff; 4], seal_offsets()[0] + 33).unwrap();
        let s = read_seal(&dev, &UUID).unwrap().unwrap();
        assert_eq!((s.counter, s.durable_below), (1, 5));
    }

    #[test]
    fn a_new_run_numbers_its_seals_after_the_last_one_found() {
        let dev = device();
        let first = Sealer::new(UUID, None, 1);
        for n in 1..=3 {
            first.seal(&dev, n * 10, 1).unwrap();
        }
        let found = read_seal(&dev, &UUID).unwrap();
        let next = Sealer::new(UUID, found, 3);
        next.seal(&dev, 2, 3).unwrap();
        let s = read_seal(&dev, &UUID).unwrap().unwrap();
        assert_eq!((s.counter, s.durable_below, s.checkpoint), (4, 2, 3));
    }
}
