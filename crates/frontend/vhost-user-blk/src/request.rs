//! One virtio-blk request: its header, data and status byte, parsed from a
//! descriptor chain and carried out on a [`BlockDevice`] (virtio 1.2,
//! section 5.2.6).
//!
//! Owns: the request layout, the bounds checks and the status each outcome
//! gets. Must not: touch the virtqueue (the caller pops the chain and adds
//! it to the used ring) or trust anything the guest wrote: every length,
//! sector and segment is checked before the disk sees it.

use std::io::{Read, Write};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::{DescriptorChain, Reader, Writer};
use vm_memory::GuestMemoryMmap;

/// virtio-blk addresses the disk in 512-byte sectors, whatever its block size.
pub const SECTOR: u64 = 512;
/// Largest data transfer one request may ask for (the guest is told
/// `seg_max` and `size_max`, but a guest need not obey).
pub const MAX_TRANSFER: usize = 32 << 20;
/// Most discard / write-zeroes segments one request may carry.
pub const MAX_SEGMENTS: u32 = 64;

/// What a request does to the disk.
pub trait BlockDevice {
    fn size(&self) -> u64;
    fn read_only(&self) -> bool;
    fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()>;
    fn flush(&self) -> std::io::Result<()>;
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()>;
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> std::io::Result<()>;
    /// The serial the guest reads with GET_ID (at most 20 bytes used).
    fn id(&self) -> &[u8];
}

/// Why a request got no OK.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("descriptor chain unusable: {0}")]
    Chain(String),
    #[error("request header short or unreadable")]
    Header,
    #[error("no room for the status byte")]
    NoStatus,
    #[error("request type {0} not supported")]
    Unsupported(u32),
    #[error(
        "{what} of {len} bytes at sector {sector} is outside the {size}-byte disk or not whole sectors"
    )]
    OutOfRange {
        what: &'static str,
        sector: u64,
        len: u64,
        size: u64,
    },
    #[error("{0} bytes in one request: more than vdcache takes ({MAX_TRANSFER})")]
    TooLarge(usize),
    #[error("write to a read-only disk")]
    ReadOnly,
    #[error("{0} segments: more than vdcache takes ({MAX_SEGMENTS})")]
    TooManySegments(u64),
    #[error("{0} bytes of segments: not whole 16-byte segments")]
    PartialSegment(u64),
    #[error("unknown flags {0:#x} in a segment")]
    BadFlags(u32),
    #[error("disk: {0}")]
    Disk(#[from] std::io::Error),
}

impl RequestError {
    /// The status byte the guest gets.
    pub fn status(&self) -> u8 {
        match self {
            // virtio 1.2, 5.2.6.2: unknown segment flags are UNSUPP too.
            RequestError::Unsupported(_) | RequestError::BadFlags(_) => VIRTIO_BLK_S_UNSUPP as u8,
            _ => VIRTIO_BLK_S_IOERR as u8,
        }
    }
}

/// Carries out the request of `chain` on `disk`; returns the bytes written
/// into the guest's buffers, the status byte included (what the used ring
/// says), and the outcome.
pub fn serve<M>(
    disk: &dyn BlockDevice,
    chain: DescriptorChain<M>,
) -> (u32, Result<Kind, RequestError>)
where
    M: std::ops::Deref<Target = GuestMemoryMmap> + Clone,
{
    let mem: &GuestMemoryMmap = chain.memory();
    let (mut reader, mut writer) = match (chain.clone().reader(mem), chain.clone().writer(mem)) {
        (Ok(r), Ok(w)) => (r, w),
        (Err(e), _) | (_, Err(e)) => return (0, Err(RequestError::Chain(e.to_string()))),
    };
    let Some(status_at) = writer.available_bytes().checked_sub(1) else {
        return (0, Err(RequestError::NoStatus));
    };
    let mut status = match writer.split_at(status_at) {
        Ok(s) => s,
        Err(e) => return (0, Err(RequestError::Chain(e.to_string()))),
    };
    let outcome = execute(disk, &mut reader, &mut writer);
    let code = match &outcome {
        Ok(_) => VIRTIO_BLK_S_OK as u8,
        Err(e) => e.status(),
    };
    let data = writer.bytes_written() as u32;
    match status.write_all(&[code]) {
        Ok(()) => (data + 1, outcome),
        Err(e) => (data, Err(RequestError::Chain(e.to_string()))),
    }
}

/// What a request was, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Read(u64),
    Write(u64),
    Flush,
    GetId,
    Discard,
    WriteZeroes,
}

fn execute(
    disk: &dyn BlockDevice,
    reader: &mut Reader<'_>,
    writer: &mut Writer<'_>,
) -> Result<Kind, RequestError> {
    let mut header = [0u8; 16];
    reader
        .read_exact(&mut header)
        .map_err(|_| RequestError::Header)?;
    let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or([0; 8]));
    match kind {
        VIRTIO_BLK_T_IN => {
            let len = writer.available_bytes();
            let off = range(disk, "read", sector, len as u64)?;
            let mut buf = vec![0u8; checked_len(len)?];
            disk.read(off, &mut buf)?;
            writer.write_all(&buf)?;
            Ok(Kind::Read(len as u64))
        }
        VIRTIO_BLK_T_OUT => {
            if disk.read_only() {
                return Err(RequestError::ReadOnly);
            }
            let len = reader.available_bytes();
            let off = range(disk, "write", sector, len as u64)?;
            let mut buf = vec![0u8; checked_len(len)?];
            reader.read_exact(&mut buf)?;
            disk.write(off, &buf)?;
            Ok(Kind::Write(len as u64))
        }
        VIRTIO_BLK_T_FLUSH => {
            disk.flush()?;
            Ok(Kind::Flush)
        }
        VIRTIO_BLK_T_GET_ID => {
            // A NUL-padded string of up to 20 bytes (virtio 1.2, 5.2.6).
            let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
            let given = disk.id();
            let n = given.len().min(id.len());
            id[..n].copy_from_slice(&given[..n]);
            let room = id.len().min(writer.available_bytes());
            writer.write_all(&id[..room])?;
            Ok(Kind::GetId)
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            if disk.read_only() {
                return Err(RequestError::ReadOnly);
            }
            let zeroes = kind == VIRTIO_BLK_T_WRITE_ZEROES;
            for (off, len, unmap) in segments(disk, reader, zeroes)? {
                if zeroes {
                    disk.write_zeroes(off, len, unmap)?;
                } else {
                    disk.discard(off, len)?;
                }
            }
            Ok(if zeroes {
                Kind::WriteZeroes
            } else {
                Kind::Discard
            })
        }
        other => Err(RequestError::Unsupported(other)),
    }
}

fn checked_len(len: usize) -> Result<usize, RequestError> {
    if len > MAX_TRANSFER {
        return Err(RequestError::TooLarge(len));
    }
    Ok(len)
}

/// The byte offset of `len` bytes at `sector`, if they are whole sectors
/// inside the disk.
fn range(
    disk: &dyn BlockDevice,
    what: &'static str,
    sector: u64,
    len: u64,
) -> Result<u64, RequestError> {
    let bad = || RequestError::OutOfRange {
        what,
        sector,
        len,
        size: disk.size(),
    };
    let off = sector.checked_mul(SECTOR).ok_or_else(bad)?;
    let end = off.checked_add(len).ok_or_else(bad)?;
    if !len.is_multiple_of(SECTOR) || end > disk.size() {
        return Err(bad());
    }
    Ok(off)
}

/// The (offset, length, unmap) of each discard / write-zeroes segment,
/// all checked before any is carried out.
fn segments(
    disk: &dyn BlockDevice,
    reader: &mut Reader<'_>,
    zeroes: bool,
) -> Result<Vec<(u64, u64, bool)>, RequestError> {
    let bytes = reader.available_bytes() as u64;
    if !bytes.is_multiple_of(16) {
        return Err(RequestError::PartialSegment(bytes));
    }
    let count = bytes / 16;
    if count > u64::from(MAX_SEGMENTS) {
        return Err(RequestError::TooManySegments(count));
    }
    let what = if zeroes { "write-zeroes" } else { "discard" };
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let mut seg = [0u8; 16];
        reader.read_exact(&mut seg)?;
        let sector = u64::from_le_bytes(seg[0..8].try_into().unwrap_or([0; 8]));
        let sectors = u32::from_le_bytes(seg[8..12].try_into().unwrap_or([0; 4]));
        let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap_or([0; 4]));
        let known = if zeroes {
            VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
        } else {
            0
        };
        if flags & !known != 0 {
            return Err(RequestError::BadFlags(flags));
        }
        let len = u64::from(sectors) * SECTOR;
        let off = range(disk, what, sector, len)?;
        out.push((off, len, flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0));
    }
    Ok(out)
}
