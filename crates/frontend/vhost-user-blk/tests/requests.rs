//! `request::serve` against an in-memory disk, with descriptor chains built
//! by virtio-queue's mock driver: the bytes each request moves, the status
//! byte and used length the guest gets, and that every malformed or
//! oversized request is refused before the disk sees it.

#![allow(clippy::unwrap_used)]

use std::io;
use std::sync::Mutex;
use vdcache_vhost_user_blk::request::{
    self, BlockDevice, Kind, MAX_SEGMENTS, MAX_TRANSFER, RequestError, SECTOR,
};
use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// Guest memory of most tests; the mock queue's rings sit below `HDR`.
const MEM_SIZE: usize = 0x10_0000;
const HDR: u64 = 0x1_0000;
const DATA: u64 = 0x2_0000;
const DATA2: u64 = 0x6_0000;
const STATUS: u64 = 0xF_F000;
/// Byte an untouched guest buffer holds.
const FILL: u8 = 0xEE;

const DISK_SIZE: usize = 1 << 20;
const DISK_SECTORS: u64 = DISK_SIZE as u64 / SECTOR;

// ---------------------------------------------------------------------------
// An in-memory disk that records every call.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Read { offset: u64, len: usize },
    Write { offset: u64, len: usize },
    Flush,
    Discard { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64, unmap: bool },
}

struct MemDisk {
    bytes: Mutex<Vec<u8>>,
    read_only: bool,
    id: Vec<u8>,
    /// When set, every call fails with an error of this kind (after being
    /// recorded).
    fail: Mutex<Option<io::ErrorKind>>,
    calls: Mutex<Vec<Call>>,
}

impl MemDisk {
    /// A disk of `size` bytes holding `pattern(size, 1)`.
    fn new(size: usize) -> MemDisk {
        MemDisk::with_bytes(pattern(size, 1))
    }

    fn zeroed(size: usize) -> MemDisk {
        MemDisk::with_bytes(vec![0; size])
    }

    fn with_bytes(bytes: Vec<u8>) -> MemDisk {
        MemDisk {
            bytes: Mutex::new(bytes),
            read_only: false,
            id: b"vdcache-test".to_vec(),
            fail: Mutex::new(None),
            calls: Mutex::new(Vec::new()),
        }
    }

    fn read_only(mut self) -> MemDisk {
        self.read_only = true;
        self
    }

    fn with_id(mut self, id: &[u8]) -> MemDisk {
        self.id = id.to_vec();
        self
    }

    fn failing(self, kind: io::ErrorKind) -> MemDisk {
        *self.fail.lock().unwrap() = Some(kind);
        self
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn contents(&self) -> Vec<u8> {
        self.bytes.lock().unwrap().clone()
    }

    fn writes(&self) -> usize {
        self.count(|c| matches!(c, Call::Write { .. }))
    }

    fn flushes(&self) -> usize {
        self.count(|c| matches!(c, Call::Flush))
    }

    fn count(&self, f: impl Fn(&Call) -> bool) -> usize {
        self.calls.lock().unwrap().iter().filter(|c| f(c)).count()
    }

    /// Records `call`, then fails if told to.
    fn enter(&self, call: Call) -> io::Result<()> {
        self.calls.lock().unwrap().push(call);
        match *self.fail.lock().unwrap() {
            Some(kind) => Err(io::Error::new(kind, "injected fault")),
            None => Ok(()),
        }
    }

    fn span(&self, offset: u64, len: u64) -> io::Result<std::ops::Range<usize>> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the test disk was asked for bytes past its end",
            )),
        }
    }
}

impl BlockDevice for MemDisk {
    fn size(&self) -> u64 {
        self.bytes.lock().unwrap().len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.enter(Call::Read {
            offset,
            len: buf.len(),
        })?;
        let r = self.span(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.bytes.lock().unwrap()[r]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.enter(Call::Write {
            offset,
            len: data.len(),
        })?;
        let r = self.span(offset, data.len() as u64)?;
        self.bytes.lock().unwrap()[r].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.enter(Call::Flush)
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.enter(Call::Discard { offset, len })?;
        self.span(offset, len).map(drop)
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        self.enter(Call::WriteZeroes {
            offset,
            len,
            unmap: may_unmap,
        })?;
        let r = self.span(offset, len)?;
        self.bytes.lock().unwrap()[r].fill(0);
        Ok(())
    }
    fn id(&self) -> &[u8] {
        &self.id
    }
}

/// Bytes that differ from their neighbours and from one sector to the next,
/// so a misplaced offset shows.
fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + i / 512 * 7 + seed * 17) % 251) as u8)
        .collect()
}

// ---------------------------------------------------------------------------
// The driver side: guest memory and descriptor chains.

#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    writable: bool,
}

/// A descriptor the device reads.
fn ro(addr: u64, len: u32) -> Desc {
    Desc {
        addr,
        len,
        writable: false,
    }
}

/// A descriptor the device writes.
fn wo(addr: u64, len: u32) -> Desc {
    Desc {
        addr,
        len,
        writable: true,
    }
}

fn header(kind: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[4..8].copy_from_slice(&0xA5A5_A5A5u32.to_le_bytes()); // reserved: ignored
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}

/// Discard / write-zeroes segments: (sector, num_sectors, flags).
fn segments(segs: &[(u64, u32, u32)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(sector, num, flags) in segs {
        out.extend_from_slice(&sector.to_le_bytes());
        out.extend_from_slice(&num.to_le_bytes());
        out.extend_from_slice(&flags.to_le_bytes());
    }
    out
}

type Served = (u32, Result<Kind, RequestError>);

struct Guest {
    mem: GuestMemoryMmap,
}

impl Guest {
    fn new() -> Guest {
        Guest::with_size(MEM_SIZE)
    }

    fn with_size(size: usize) -> Guest {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), size)]).unwrap();
        let guest = Guest { mem };
        // The status byte starts as neither OK, IOERR nor UNSUPP.
        guest.put(STATUS, &[0xFF]);
        guest
    }

    fn put(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    }

    fn fill(&self, addr: u64, len: usize) {
        self.put(addr, &vec![FILL; len]);
    }

    fn get(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        buf
    }

    fn status(&self) -> u8 {
        self.get(STATUS, 1)[0]
    }

    /// Queues `descs` as one chain, pops it as the device would, and
    /// serves it on `disk`.
    fn serve(&self, disk: &MemDisk, descs: &[Desc]) -> Served {
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let last = i + 1 == descs.len();
                let mut flags = if d.writable { VRING_DESC_F_WRITE } else { 0 } as u16;
                let mut next = 0;
                if !last {
                    flags |= VRING_DESC_F_NEXT as u16;
                    next = i as u16 + 1;
                }
                RawDescriptor::from(Descriptor::new(d.addr, d.len, flags, next))
            })
            .collect();
        let mock = MockSplitQueue::new(&self.mem, 256);
        mock.add_desc_chains(&raw, 0).unwrap();
        let mut queue: Queue = mock.create_queue().unwrap();
        let chain = queue.pop_descriptor_chain(&self.mem).unwrap();
        assert_eq!(chain.head_index(), 0);
        request::serve(disk, chain)
    }

    /// Serves a request of header `hdr`, readable `payload` (segments or
    /// data, in one descriptor at DATA, none if empty) and a 1-byte status.
    fn serve_out(&self, disk: &MemDisk, hdr: [u8; 16], payload: &[u8]) -> Served {
        self.put(HDR, &hdr);
        let mut descs = vec![ro(HDR, 16)];
        if !payload.is_empty() {
            self.put(DATA, payload);
            descs.push(ro(DATA, payload.len() as u32));
        }
        descs.push(wo(STATUS, 1));
        self.serve(disk, &descs)
    }

    /// Serves a request of header `hdr` with `len` writable data bytes at
    /// DATA (filled with FILL first) and a 1-byte status.
    fn serve_in(&self, disk: &MemDisk, hdr: [u8; 16], len: u32) -> Served {
        self.put(HDR, &hdr);
        self.fill(DATA, len as usize + 16);
        self.serve(disk, &[ro(HDR, 16), wo(DATA, len), wo(STATUS, 1)])
    }
}

/// The request was answered with `status` alone (used length 1), the disk
/// saw no call and holds what it held; returns the error.
fn refused(
    guest: &Guest,
    disk: &MemDisk,
    before: &[u8],
    served: Served,
    status: u8,
) -> RequestError {
    let (used, outcome) = served;
    let err = match outcome {
        Ok(kind) => panic!("served as {kind:?}, expected a refusal"),
        Err(e) => e,
    };
    assert_eq!(err.status(), status, "status() of {err}");
    assert_eq!(guest.status(), status, "status byte for {err}");
    assert_eq!(used, 1, "used length for {err}");
    assert_eq!(disk.calls(), vec![], "disk calls for {err}");
    assert!(disk.contents() == before, "disk contents changed by {err}");
    err
}

// ---------------------------------------------------------------------------
// Requests that succeed.

#[test]
fn read_of_8_sectors_at_sector_2_lands_in_the_guest_buffer() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let (used, outcome) = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, 2), 4096);

    assert_eq!(outcome.unwrap(), Kind::Read(4096));
    assert_eq!(used, 4096 + 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(guest.get(DATA, 4096), disk.contents()[1024..1024 + 4096]);
    // Nothing past the data descriptor was written.
    assert_eq!(guest.get(DATA + 4096, 16), vec![FILL; 16]);
    assert_eq!(
        disk.calls(),
        vec![Call::Read {
            offset: 1024,
            len: 4096
        }]
    );
}

#[test]
fn read_over_several_descriptors_puts_the_status_in_the_last_byte() {
    // Data in two writable descriptors, the second one also holding the
    // status byte at its end (a layout the spec allows).
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    guest.put(HDR, &header(VIRTIO_BLK_T_IN, 10));
    guest.fill(DATA, 1024);
    guest.fill(DATA2, 1024);
    let (used, outcome) = guest.serve(
        &disk,
        &[ro(HDR, 16), wo(DATA, 512), wo(DATA2, 512 + 512 + 1)],
    );

    assert_eq!(outcome.unwrap(), Kind::Read(1536));
    assert_eq!(used, 1536 + 1);
    let want = &disk.contents()[5120..5120 + 1536];
    assert_eq!(guest.get(DATA, 512), want[..512]);
    assert_eq!(guest.get(DATA2, 1024), want[512..]);
    assert_eq!(guest.get(DATA2 + 1024, 1), vec![OK]);
    assert_eq!(guest.get(DATA + 512, 1), vec![FILL]);
}

#[test]
fn read_up_to_the_last_sector_is_served() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let sector = DISK_SECTORS - 8;
    let (used, outcome) = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, sector), 4096);

    assert_eq!(outcome.unwrap(), Kind::Read(4096));
    assert_eq!(used, 4097);
    assert_eq!(guest.status(), OK);
    assert_eq!(guest.get(DATA, 4096), disk.contents()[DISK_SIZE - 4096..]);
}

#[test]
fn read_only_disk_still_serves_reads_and_flushes() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).read_only();
    let (used, outcome) = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, 0), 512);
    assert_eq!(outcome.unwrap(), Kind::Read(512));
    assert_eq!(used, 513);
    assert_eq!(guest.get(DATA, 512), disk.contents()[..512]);

    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_FLUSH, 0), &[]);
    assert_eq!(outcome.unwrap(), Kind::Flush);
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(disk.flushes(), 1);
}

#[test]
fn write_of_4096_bytes_over_two_descriptors_reaches_the_disk() {
    let guest = Guest::new();
    let disk = MemDisk::zeroed(DISK_SIZE);
    let data = pattern(4096, 9);
    guest.put(HDR, &header(VIRTIO_BLK_T_OUT, 5));
    guest.put(DATA, &data[..1024]);
    guest.put(DATA2, &data[1024..]);
    let (used, outcome) = guest.serve(
        &disk,
        &[ro(HDR, 16), ro(DATA, 1024), ro(DATA2, 3072), wo(STATUS, 1)],
    );

    assert_eq!(outcome.unwrap(), Kind::Write(4096));
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(
        disk.calls(),
        vec![Call::Write {
            offset: 5 * 512,
            len: 4096
        }]
    );
    let mut want = vec![0u8; DISK_SIZE];
    want[2560..2560 + 4096].copy_from_slice(&data);
    assert!(disk.contents() == want, "disk differs from the write");
}

#[test]
fn write_with_header_split_over_two_descriptors_is_served() {
    let guest = Guest::new();
    let disk = MemDisk::zeroed(DISK_SIZE);
    let hdr = header(VIRTIO_BLK_T_OUT, 7);
    let data = pattern(512, 3);
    guest.put(HDR, &hdr[..8]);
    guest.put(HDR + 0x100, &hdr[8..]);
    guest.put(DATA, &data);
    let (used, outcome) = guest.serve(
        &disk,
        &[ro(HDR, 8), ro(HDR + 0x100, 8), ro(DATA, 512), wo(STATUS, 1)],
    );

    assert_eq!(outcome.unwrap(), Kind::Write(512));
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(disk.contents()[7 * 512..8 * 512], data[..]);
    assert_eq!(disk.writes(), 1);
}

#[test]
fn write_of_exactly_max_transfer_is_served() {
    const MEM: usize = 0x300_0000;
    const BIG: u64 = 0x10_0000;
    let guest = Guest::with_size(MEM);
    let disk = MemDisk::zeroed(MAX_TRANSFER + (1 << 20));
    let data = pattern(MAX_TRANSFER, 5);
    guest.put(HDR, &header(VIRTIO_BLK_T_OUT, 8));
    guest.put(BIG, &data);
    let (used, outcome) = guest.serve(
        &disk,
        &[ro(HDR, 16), ro(BIG, MAX_TRANSFER as u32), wo(STATUS, 1)],
    );

    assert_eq!(outcome.unwrap(), Kind::Write(MAX_TRANSFER as u64));
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(
        disk.calls(),
        vec![Call::Write {
            offset: 4096,
            len: MAX_TRANSFER
        }]
    );
    assert!(disk.contents()[4096..4096 + MAX_TRANSFER] == data[..]);
}

#[test]
fn flush_calls_the_disk_flush_once() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_FLUSH, 0), &[]);

    assert_eq!(outcome.unwrap(), Kind::Flush);
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(disk.calls(), vec![Call::Flush]);
    assert!(disk.contents() == before);
}

#[test]
fn get_id_writes_the_id_bytes() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).with_id(b"vdcache-disk-7");
    guest.put(HDR, &header(VIRTIO_BLK_T_GET_ID, 0));
    guest.put(DATA, &[0u8; 20]);
    let (used, outcome) = guest.serve(&disk, &[ro(HDR, 16), wo(DATA, 20), wo(STATUS, 1)]);

    assert_eq!(outcome.unwrap(), Kind::GetId);
    // The whole NUL-padded 20-byte string, then the status.
    assert_eq!(used, 20 + 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(guest.get(DATA, 20), b"vdcache-disk-7\0\0\0\0\0\0");
    assert_eq!(disk.calls(), vec![]);
}

#[test]
fn get_id_longer_than_20_bytes_is_cut_to_20() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).with_id(b"0123456789abcdefghijKLMNOP");
    guest.put(HDR, &header(VIRTIO_BLK_T_GET_ID, 0));
    guest.fill(DATA, 32);
    let (used, outcome) = guest.serve(&disk, &[ro(HDR, 16), wo(DATA, 32), wo(STATUS, 1)]);

    assert_eq!(outcome.unwrap(), Kind::GetId);
    assert_eq!(used, VIRTIO_BLK_ID_BYTES + 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(guest.get(DATA, 20), b"0123456789abcdefghij");
    assert_eq!(guest.get(DATA + 20, 12), vec![FILL; 12]);
}

#[test]
fn get_id_into_a_short_buffer_writes_what_fits() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).with_id(b"vdcache-disk-7");
    guest.put(HDR, &header(VIRTIO_BLK_T_GET_ID, 0));
    guest.fill(DATA, 16);
    let (used, outcome) = guest.serve(&disk, &[ro(HDR, 16), wo(DATA, 4), wo(STATUS, 1)]);

    assert_eq!(outcome.unwrap(), Kind::GetId);
    assert_eq!(used, 4 + 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(guest.get(DATA, 5), b"vdca\xEE");
}

/// virtio 1.2 §5.2.6: "The device ID string is a NUL-padded ASCII string up
/// to 20 bytes long." request.rs writes only the id's own bytes and leaves
/// the rest of the guest's buffer as it was.
#[test]
fn get_id_pads_a_short_id_with_nul() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).with_id(b"short");
    guest.put(HDR, &header(VIRTIO_BLK_T_GET_ID, 0));
    guest.fill(DATA, 20);
    let (_, outcome) = guest.serve(&disk, &[ro(HDR, 16), wo(DATA, 20), wo(STATUS, 1)]);

    assert_eq!(outcome.unwrap(), Kind::GetId);
    assert_eq!(guest.get(DATA, 20), b"short\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
}

#[test]
fn discard_of_two_segments_reaches_the_disk() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let segs = segments(&[(8, 16, 0), (100, 4, 0)]);
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_DISCARD, 0), &segs);

    assert_eq!(outcome.unwrap(), Kind::Discard);
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(
        disk.calls(),
        vec![
            Call::Discard {
                offset: 8 * 512,
                len: 16 * 512
            },
            Call::Discard {
                offset: 100 * 512,
                len: 4 * 512
            },
        ]
    );
}

#[test]
fn write_zeroes_of_two_segments_passes_the_unmap_flag() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let segs = segments(&[
        (0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP),
        (DISK_SECTORS - 8, 8, 0),
    ]);
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_WRITE_ZEROES, 0), &segs);

    assert_eq!(outcome.unwrap(), Kind::WriteZeroes);
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    assert_eq!(
        disk.calls(),
        vec![
            Call::WriteZeroes {
                offset: 0,
                len: 4096,
                unmap: true
            },
            Call::WriteZeroes {
                offset: DISK_SIZE as u64 - 4096,
                len: 4096,
                unmap: false
            },
        ]
    );
    let mut want = pattern(DISK_SIZE, 1);
    want[..4096].fill(0);
    want[DISK_SIZE - 4096..].fill(0);
    assert!(disk.contents() == want);
}

#[test]
fn segments_in_the_header_descriptor_are_read() {
    // Header and both segments in one readable descriptor.
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let mut bytes = header(VIRTIO_BLK_T_DISCARD, 0).to_vec();
    bytes.extend(segments(&[(1, 1, 0), (3, 2, 0)]));
    guest.put(HDR, &bytes);
    let (used, outcome) = guest.serve(&disk, &[ro(HDR, 48), wo(STATUS, 1)]);

    assert_eq!(outcome.unwrap(), Kind::Discard);
    assert_eq!(used, 1);
    assert_eq!(
        disk.calls(),
        vec![
            Call::Discard {
                offset: 512,
                len: 512
            },
            Call::Discard {
                offset: 1536,
                len: 1024
            },
        ]
    );
}

#[test]
fn exactly_max_segments_are_served() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let segs: Vec<_> = (0..u64::from(MAX_SEGMENTS))
        .map(|i| (i * 2, 1, 0))
        .collect();
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_DISCARD, 0), &segments(&segs));

    assert_eq!(outcome.unwrap(), Kind::Discard);
    assert_eq!(used, 1);
    assert_eq!(guest.status(), OK);
    let want: Vec<_> = (0..u64::from(MAX_SEGMENTS))
        .map(|i| Call::Discard {
            offset: i * 1024,
            len: 512,
        })
        .collect();
    assert_eq!(disk.calls(), want);
}

// ---------------------------------------------------------------------------
// Bad input: refused, the disk untouched.

#[test]
fn read_past_the_end_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    // Two sectors starting at the last one.
    let served = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, DISK_SECTORS - 1), 1024);
    let err = refused(&guest, &disk, &before, served, IOERR);
    assert!(
        matches!(err, RequestError::OutOfRange { what: "read", .. }),
        "{err}"
    );
    assert_eq!(guest.get(DATA, 1024), vec![FILL; 1024]);

    // Wholly past the end.
    let served = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, DISK_SECTORS), 512);
    refused(&guest, &disk, &before, served, IOERR);
}

#[test]
fn write_past_the_end_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    let served = guest.serve_out(
        &disk,
        header(VIRTIO_BLK_T_OUT, DISK_SECTORS - 1),
        &pattern(1024, 4),
    );
    let err = refused(&guest, &disk, &before, served, IOERR);
    assert!(
        matches!(err, RequestError::OutOfRange { what: "write", .. }),
        "{err}"
    );
}

#[test]
fn length_not_a_multiple_of_512_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    for len in [1usize, 511, 513, 1000] {
        let served = guest.serve_out(&disk, header(VIRTIO_BLK_T_OUT, 0), &pattern(len, 2));
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(
            matches!(err, RequestError::OutOfRange { .. }),
            "{len}: {err}"
        );

        let served = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, 0), len as u32);
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(
            matches!(err, RequestError::OutOfRange { .. }),
            "{len}: {err}"
        );
        assert_eq!(guest.get(DATA, len), vec![FILL; len]);
    }
}

#[test]
fn sector_overflowing_u64_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    // sector * 512 overflows; the last two overflow only once the length
    // is added.
    let first_overflowing = u64::MAX / SECTOR + 1;
    for sector in [first_overflowing, u64::MAX, 1 << 55, u64::MAX / SECTOR] {
        let served = guest.serve_out(&disk, header(VIRTIO_BLK_T_OUT, sector), &pattern(1024, 2));
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(
            matches!(err, RequestError::OutOfRange { .. }),
            "{sector}: {err}"
        );

        let served = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, sector), 1024);
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(
            matches!(err, RequestError::OutOfRange { .. }),
            "{sector}: {err}"
        );

        let segs = segments(&[(sector, 2, 0)]);
        let served = guest.serve_out(&disk, header(VIRTIO_BLK_T_DISCARD, 0), &segs);
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(
            matches!(err, RequestError::OutOfRange { .. }),
            "{sector}: {err}"
        );
    }
}

#[test]
fn writes_to_a_read_only_disk_are_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).read_only();
    let before = disk.contents();

    let served = guest.serve_out(&disk, header(VIRTIO_BLK_T_OUT, 0), &pattern(512, 3));
    let err = refused(&guest, &disk, &before, served, IOERR);
    assert!(matches!(err, RequestError::ReadOnly), "{err}");

    let segs = segments(&[(0, 8, 0)]);
    let served = guest.serve_out(&disk, header(VIRTIO_BLK_T_DISCARD, 0), &segs);
    let err = refused(&guest, &disk, &before, served, IOERR);
    assert!(matches!(err, RequestError::ReadOnly), "{err}");

    let served = guest.serve_out(&disk, header(VIRTIO_BLK_T_WRITE_ZEROES, 0), &segs);
    let err = refused(&guest, &disk, &before, served, IOERR);
    assert!(matches!(err, RequestError::ReadOnly), "{err}");
}

/// Unknown segment flags: refused as a whole, even when an earlier segment
/// was valid. (The status code itself is checked by
/// `unknown_segment_flags_get_unsupp`.)
#[test]
fn segments_with_unknown_flags_are_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    let cases = [
        // UNMAP is a write-zeroes flag only.
        (VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP),
        (VIRTIO_BLK_T_DISCARD, 2),
        (VIRTIO_BLK_T_DISCARD, 0x8000_0000),
        (VIRTIO_BLK_T_WRITE_ZEROES, 2),
        (VIRTIO_BLK_T_WRITE_ZEROES, 3),
    ];
    for (kind, flags) in cases {
        let segs = segments(&[(0, 8, 0), (16, 8, flags)]);
        let (used, outcome) = guest.serve_out(&disk, header(kind, 0), &segs);
        let err = outcome.unwrap_err();
        assert!(
            matches!(err, RequestError::BadFlags(f) if f == flags),
            "{err}"
        );
        assert_ne!(guest.status(), OK);
        assert_eq!(guest.status(), err.status());
        assert_eq!(used, 1);
        assert_eq!(disk.calls(), vec![], "type {kind} flags {flags:#x}");
        assert!(disk.contents() == before);
    }
}

/// virtio 1.2 §5.2.6.2: "The device MUST set the status byte to
/// VIRTIO_BLK_S_UNSUPP for discard, secure erase and write zeroes commands
/// if any unknown flag is set. Furthermore, the device MUST set the status
/// byte to VIRTIO_BLK_S_UNSUPP for discard commands if the unmap flag is
/// set." request.rs answers IOERR.
#[test]
fn unknown_segment_flags_get_unsupp() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    for (kind, flags) in [
        (VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP),
        (VIRTIO_BLK_T_WRITE_ZEROES, 2),
    ] {
        let segs = segments(&[(0, 8, flags)]);
        let (_, outcome) = guest.serve_out(&disk, header(kind, 0), &segs);
        assert!(matches!(outcome, Err(RequestError::BadFlags(_))));
        assert_eq!(guest.status(), UNSUPP, "type {kind} flags {flags:#x}");
    }
}

#[test]
fn a_segment_past_the_end_refuses_the_whole_request() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    for kind in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
        let segs = segments(&[(0, 8, 0), (DISK_SECTORS - 4, 8, 0)]);
        let served = guest.serve_out(&disk, header(kind, 0), &segs);
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(matches!(err, RequestError::OutOfRange { .. }), "{err}");
    }
}

#[test]
fn more_than_max_segments_are_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    let n = u64::from(MAX_SEGMENTS) + 1;
    let segs: Vec<_> = (0..n).map(|i| (i * 2, 1, 0)).collect();
    for kind in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
        let served = guest.serve_out(&disk, header(kind, 0), &segments(&segs));
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(
            matches!(err, RequestError::TooManySegments(c) if c == n),
            "{err}"
        );
    }
}

#[test]
fn a_header_shorter_than_16_bytes_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    for len in [0u32, 1, 8, 15] {
        guest.put(HDR, &header(VIRTIO_BLK_T_FLUSH, 0));
        let mut descs = vec![wo(STATUS, 1)];
        if len > 0 {
            descs.insert(0, ro(HDR, len));
        }
        let served = guest.serve(&disk, &descs);
        let err = refused(&guest, &disk, &before, served, IOERR);
        assert!(matches!(err, RequestError::Header), "{len}: {err}");
    }
}

#[test]
fn a_chain_without_a_writable_status_byte_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    guest.put(DATA, &pattern(512, 8));
    let cases: [(u32, &[Desc]); 4] = [
        (VIRTIO_BLK_T_FLUSH, &[ro(HDR, 16)]),
        (VIRTIO_BLK_T_OUT, &[ro(HDR, 16)]),
        (VIRTIO_BLK_T_OUT, &[ro(HDR, 16), ro(DATA, 512)]),
        // A writable descriptor of no bytes holds no status either.
        (
            VIRTIO_BLK_T_OUT,
            &[ro(HDR, 16), ro(DATA, 512), wo(STATUS, 0)],
        ),
    ];
    for (kind, descs) in cases {
        guest.put(HDR, &header(kind, 0));
        let (used, outcome) = guest.serve(&disk, descs);
        assert!(
            matches!(outcome, Err(RequestError::NoStatus)),
            "{outcome:?}"
        );
        assert_eq!(used, 0);
        assert_eq!(guest.status(), 0xFF);
        assert_eq!(disk.calls(), vec![]);
        assert!(disk.contents() == before);
    }
}

#[test]
fn an_unknown_request_type_is_unsupported() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    let before = disk.contents();
    // GET_LIFETIME, SECURE_ERASE, a zone report, and nonsense.
    for kind in [10u32, 14, 16, 0xDEAD_BEEF] {
        let served = guest.serve_out(&disk, header(kind, 0), &pattern(512, 1));
        let err = refused(&guest, &disk, &before, served, UNSUPP);
        assert!(
            matches!(err, RequestError::Unsupported(k) if k == kind),
            "{err}"
        );
    }
}

#[test]
fn a_descriptor_outside_guest_memory_is_refused() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE);
    guest.put(HDR, &header(VIRTIO_BLK_T_IN, 0));
    for descs in [
        [ro(HDR, 16), wo(MEM_SIZE as u64, 512), wo(STATUS, 1)],
        [ro(HDR, 16), ro(MEM_SIZE as u64 - 256, 512), wo(STATUS, 1)],
    ] {
        let (used, outcome) = guest.serve(&disk, &descs);
        assert!(
            matches!(outcome, Err(RequestError::Chain(_))),
            "{outcome:?}"
        );
        assert_eq!(used, 0);
        assert_eq!(guest.status(), 0xFF);
        assert_eq!(disk.calls(), vec![]);
    }
}

// ---------------------------------------------------------------------------
// Disk errors.

#[test]
fn a_disk_error_on_write_is_ioerr_and_returned() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).failing(io::ErrorKind::StorageFull);
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_OUT, 4), &pattern(1024, 6));

    match outcome {
        Err(RequestError::Disk(e)) => {
            assert_eq!(e.kind(), io::ErrorKind::StorageFull);
            assert_eq!(e.to_string(), "injected fault");
        }
        other => panic!("expected a disk error, got {other:?}"),
    }
    assert_eq!(used, 1);
    assert_eq!(guest.status(), IOERR);
    assert_eq!(
        disk.calls(),
        vec![Call::Write {
            offset: 2048,
            len: 1024
        }]
    );
}

#[test]
fn a_disk_error_on_read_is_ioerr_and_writes_no_data() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).failing(io::ErrorKind::Other);
    let (used, outcome) = guest.serve_in(&disk, header(VIRTIO_BLK_T_IN, 0), 2048);

    assert!(matches!(outcome, Err(RequestError::Disk(_))), "{outcome:?}");
    assert_eq!(used, 1);
    assert_eq!(guest.status(), IOERR);
    assert_eq!(guest.get(DATA, 2048), vec![FILL; 2048]);
    assert_eq!(
        disk.calls(),
        vec![Call::Read {
            offset: 0,
            len: 2048
        }]
    );
}

#[test]
fn a_disk_error_on_flush_or_discard_is_ioerr() {
    let guest = Guest::new();
    let disk = MemDisk::new(DISK_SIZE).failing(io::ErrorKind::Other);
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_FLUSH, 0), &[]);
    assert!(matches!(outcome, Err(RequestError::Disk(_))), "{outcome:?}");
    assert_eq!((used, guest.status()), (1, IOERR));
    assert_eq!(disk.calls(), vec![Call::Flush]);

    // The first failing segment stops the request.
    let disk = MemDisk::new(DISK_SIZE).failing(io::ErrorKind::Other);
    let segs = segments(&[(0, 8, 0), (16, 8, 0)]);
    let (used, outcome) = guest.serve_out(&disk, header(VIRTIO_BLK_T_DISCARD, 0), &segs);
    assert!(matches!(outcome, Err(RequestError::Disk(_))), "{outcome:?}");
    assert_eq!((used, guest.status()), (1, IOERR));
    assert_eq!(
        disk.calls(),
        vec![Call::Discard {
            offset: 0,
            len: 4096
        }]
    );
}

// ---------------------------------------------------------------------------
// Oversized requests.

#[test]
fn a_request_larger_than_max_transfer_is_refused() {
    // Guest memory and disk both large enough that only the size limit
    // can refuse it.
    const MEM: usize = 0x300_0000;
    const BIG: u64 = 0x10_0000;
    let len = MAX_TRANSFER + SECTOR as usize;
    let guest = Guest::with_size(MEM);
    let disk = MemDisk::zeroed(MAX_TRANSFER + (1 << 20));

    guest.put(HDR, &header(VIRTIO_BLK_T_IN, 0));
    guest.fill(BIG, 4096);
    let (used, outcome) = guest.serve(&disk, &[ro(HDR, 16), wo(BIG, len as u32), wo(STATUS, 1)]);
    assert!(
        matches!(outcome, Err(RequestError::TooLarge(n)) if n == len),
        "{outcome:?}"
    );
    assert_eq!(used, 1);
    assert_eq!(guest.status(), IOERR);
    assert_eq!(guest.get(BIG, 4096), vec![FILL; 4096]);
    assert_eq!(disk.calls(), vec![]);

    guest.put(HDR, &header(VIRTIO_BLK_T_OUT, 0));
    guest.put(STATUS, &[0xFF]);
    let (used, outcome) = guest.serve(&disk, &[ro(HDR, 16), ro(BIG, len as u32), wo(STATUS, 1)]);
    assert!(
        matches!(outcome, Err(RequestError::TooLarge(n)) if n == len),
        "{outcome:?}"
    );
    assert_eq!(used, 1);
    assert_eq!(guest.status(), IOERR);
    assert_eq!(disk.calls(), vec![]);
}
