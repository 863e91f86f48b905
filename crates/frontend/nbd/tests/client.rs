//! The NBD client (`vdcache_backend::nbd`) against nbdkit (memory and file
//! plugins) and against this crate's server: data integrity with many
//! threads in flight, sparse reads, block status, errors with their names.
//! These tests live with the server, not the client: the backend crate
//! must not depend on a front end, not even for its tests, and they share
//! this crate's test helpers (in-process servers, nbdkit, tools).
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::sync::Arc;

use common::*;
use vdcache_backend::nbd::{ClientError, ClientOptions, NbdClient};
use vdcache_nbd_proto::{NbdUri, proto};
use vdcache_nbd_server::{BlockSizes, Export, ExportError, MemExport, ZeroFlags};

/// Many threads write disjoint regions with different sizes, then read them
/// back (also through other threads) and compare.
fn hammer(c: &NbdClient, region: u64, threads: u64) {
    std::thread::scope(|sc| {
        for t in 0..threads {
            sc.spawn(move || {
                let base = t * region;
                let mut off = 0u64;
                let mut i = 0u64;
                while off < region {
                    let len = [512u64, 4096, 65536, 3 * 4096 + 512, 1 << 20][(i % 5) as usize]
                        .min(region - off);
                    let data = pattern(len as usize, base + off);
                    c.write_at(base + off, &data, i.is_multiple_of(7)).unwrap();
                    off += len;
                    i += 1;
                }
            });
        }
    });
    c.flush().unwrap();
    std::thread::scope(|sc| {
        for t in 0..threads {
            sc.spawn(move || {
                // Read another thread's region, in one big request.
                let other = (t + 1) % threads;
                let base = other * region;
                let mut buf = vec![0u8; region as usize];
                c.read_at(base, &mut buf).unwrap();
                let mut off = 0u64;
                let mut i = 0u64;
                while off < region {
                    let len = [512u64, 4096, 65536, 3 * 4096 + 512, 1 << 20][(i % 5) as usize]
                        .min(region - off);
                    assert!(
                        buf[off as usize..(off + len) as usize]
                            == pattern(len as usize, base + off)[..],
                        "mismatch in region {other} at {off}"
                    );
                    off += len;
                    i += 1;
                }
            });
        }
    });
}

#[test]
fn client_against_nbdkit_memory() {
    let k = Nbdkit::start(&["memory", "64M"]);
    let c = NbdClient::connect(&k.uri()).unwrap();
    assert_eq!(c.size(), 64 << 20);
    assert!(c.structured_replies());
    hammer(&c, 4 << 20, 8);

    // Larger than one request: split and pipelined.
    let big = pattern(40 << 20, 99);
    c.write_at(20 << 20, &big, false).unwrap();
    let mut back = vec![0u8; 40 << 20];
    c.read_at(20 << 20, &mut back).unwrap();
    assert!(back == big);

    // Zeroing and trimming.
    c.write_zeroes(20 << 20, 1 << 20, ZeroFlags::default())
        .unwrap();
    let mut z = vec![1u8; 1 << 20];
    c.read_at(20 << 20, &mut z).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    c.trim(21 << 20, 1 << 20, false).unwrap();
    c.write_zeroes(
        22 << 20,
        1 << 20,
        ZeroFlags {
            no_hole: true,
            fua: true,
            ..Default::default()
        },
    )
    .unwrap();
    c.read_at(22 << 20, &mut z).unwrap();
    assert!(z.iter().all(|&b| b == 0));

    // Block status: nbdkit memory reports holes for never-written areas.
    if c.supports_block_status() {
        let ext = c.block_status(0, 64 << 20).unwrap();
        assert!(!ext.is_empty());
        assert!(!ext[0].hole, "{ext:?}");
    }

    // Out of range is refused before anything is sent.
    let mut b = [0u8; 2];
    assert!(matches!(
        c.read_at((64 << 20) - 1, &mut b),
        Err(ClientError::OutOfRange { .. })
    ));
    c.disconnect().unwrap();
}

#[test]
fn client_writes_nbdkit_file_and_qemu_io_reads_it() {
    require_tool("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("disk.raw");
    std::fs::write(&file, vec![0u8; 16 << 20]).unwrap();
    let k = Nbdkit::start(&["file", file.to_str().unwrap()]);
    let c = NbdClient::connect(&k.uri()).unwrap();
    let a = vec![0x5au8; 1 << 20];
    c.write_at(3 << 20, &a, true).unwrap();
    let b = pattern(777_777, 3);
    c.write_at(9 << 20, &b, false).unwrap();
    c.flush().unwrap();

    // qemu-io through nbdkit sees the client's writes.
    let out = run(Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "read -P 0x5a 3M 1M",
            "-c",
            "read -P 0 0 3M",
        ])
        .arg(k.uri()));
    assert!(!out.contains("failed"), "{out}");
    // qemu-io writes, the client reads.
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x77 12M 512k"])
        .arg(k.uri()));
    let mut buf = vec![0u8; 512 << 10];
    c.read_at(12 << 20, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0x77));
    drop(c);
    drop(k);
    // And the file itself holds the data.
    let disk = std::fs::read(&file).unwrap();
    assert!(disk[3 << 20..4 << 20].iter().all(|&x| x == 0x5a));
    assert!(disk[9 << 20..(9 << 20) + b.len()] == b[..]);
}

#[test]
fn client_against_own_server_with_and_without_structured_replies() {
    let (s, disk) = mem_server(32 << 20);
    for structured in [true, false] {
        let opts = ClientOptions {
            structured_replies: structured,
            ..Default::default()
        };
        let c = NbdClient::connect_with(&NbdUri::parse(&s.uri("")).unwrap(), &opts).unwrap();
        assert_eq!(c.structured_replies(), structured);
        assert_eq!(c.supports_block_status(), structured);
        hammer(&c, 1 << 20, 6);
        // Sparse read across data and holes (exercises hole chunks).
        c.write_zeroes(0, 32 << 20, ZeroFlags::default()).unwrap();
        c.write_at(100 << 10, &[9u8; 5000], false).unwrap();
        c.write_at(1 << 20, &[8u8; 4096], false).unwrap();
        let mut buf = vec![0xffu8; 2 << 20];
        c.read_at(0, &mut buf).unwrap();
        assert!(buf[..100 << 10].iter().all(|&x| x == 0));
        assert!(buf[100 << 10..(100 << 10) + 5000].iter().all(|&x| x == 9));
        assert!(buf[(100 << 10) + 5000..1 << 20].iter().all(|&x| x == 0));
        assert!(buf[1 << 20..(1 << 20) + 4096].iter().all(|&x| x == 8));
        assert!(buf[(1 << 20) + 4096..].iter().all(|&x| x == 0));
        if structured {
            let ext = c.block_status(0, 32 << 20).unwrap();
            assert_eq!(ext[0].length, 100 << 10, "{ext:?}");
            assert!(ext[0].hole && ext[0].zero);
            assert!(!ext[1].hole);
            let one = c.block_status(0, 4096).unwrap();
            assert!(one.iter().map(|e| e.length).sum::<u64>() <= 4096 || one.len() == 1);
        } else {
            assert!(matches!(
                c.block_status(0, 4096),
                Err(ClientError::Unsupported(_))
            ));
        }
        assert_eq!(disk.contents()[1 << 20], 8);
    }
    let st = s.server.stats();
    assert!(
        st.exports[0].io.bytes_written > 0 && st.exports[0].io.errors == 0,
        "{st:?}"
    );
}

/// An export that fails every write with ENOSPC and reads at 0 with EIO.
struct Failing(MemExport);

impl Export for Failing {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            minimum: 512,
            preferred: 4096,
            maximum: 1 << 20,
        }
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        if offset == 0 {
            return Err(std::io::Error::from_raw_os_error(5).into());
        }
        self.0.read(offset, buf)
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
        Err(ExportError::NoSpace("backing store full".into()))
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
        panic!("export bug")
    }
    fn write_zeroes(&self, o: u64, l: u64, f: ZeroFlags) -> Result<(), ExportError> {
        self.0.write_zeroes(o, l, f)
    }
}

#[test]
fn client_reports_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens.
    let uri = format!("nbd+unix:///?socket={}", dir.path().join("none").display());
    assert!(matches!(
        NbdClient::connect(&uri),
        Err(ClientError::ConnectionRefused { .. } | ClientError::Connect { .. })
    ));
    let stale = dir.path().join("stale");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let uri = format!("nbd+unix:///?socket={}", stale.display());
    assert!(matches!(
        NbdClient::connect(&uri),
        Err(ClientError::ConnectionRefused { .. })
    ));
    assert!(matches!(
        NbdClient::connect("nbd+unix:///x"),
        Err(ClientError::InvalidUri(_))
    ));

    let ro = Arc::new(MemExport::new(1 << 20).read_only(true));
    let failing = Arc::new(Failing(MemExport::new(4 << 20)));
    let s = TestServer::start(vec![("ro", ro as Arc<dyn Export>), ("bad", failing)]);
    match NbdClient::connect(&s.uri("missing")) {
        Err(ClientError::ExportNotFound { export, .. }) => assert_eq!(export, "missing"),
        other => panic!("expected ExportNotFound, got {:?}", other.map(|_| ())),
    }
    let c = NbdClient::connect(&s.uri("ro")).unwrap();
    assert!(c.read_only());
    assert!(matches!(
        c.write_at(0, &[1], false),
        Err(ClientError::ReadOnly)
    ));

    for structured in [true, false] {
        let opts = ClientOptions {
            structured_replies: structured,
            ..Default::default()
        };
        let c = NbdClient::connect_with(&NbdUri::parse(&s.uri("bad")).unwrap(), &opts).unwrap();
        assert_eq!(c.block_sizes().minimum, 512);
        let e = c.write_at(4096, &[0u8; 4096], false).unwrap_err();
        assert_eq!(e.errno().map(|e| e.name()), Some("ENOSPC"), "{e}");
        if structured {
            assert!(e.to_string().contains("backing store full"), "{e}");
        }
        let mut buf = vec![0u8; 8192];
        let e = c.read_at(0, &mut buf).unwrap_err();
        assert_eq!(e.errno().map(|e| e.0), Some(proto::EIO), "{e}");
        // The connection survives errors, even a panicking export.
        let e = c.trim(0, 4096, false).unwrap_err();
        assert_eq!(e.errno().map(|e| e.0), Some(proto::EIO), "{e}");
        c.read_at(4096, &mut buf).unwrap();
        assert!(matches!(
            c.read_at(1, &mut buf[..512]),
            Err(ClientError::Unaligned { .. })
        ));
        let io: std::io::Error = e.into();
        assert!(io.to_string().contains("EIO"), "{io}");
    }
    let st = s.server.stats();
    let bad = st.exports.iter().find(|e| e.name == "bad").unwrap();
    assert_eq!(bad.io.errors, 6, "{st:?}");
}

/// Makes a memory export's writes take a millisecond (a store's round
/// trip) and notes the name of the server thread that ran each.
#[derive(Default)]
struct SlowWrites {
    ran_on: std::sync::Mutex<Vec<String>>,
}

impl Hook for SlowWrites {
    fn before_write(&self) {
        let name = std::thread::current().name().unwrap_or("").to_string();
        self.ran_on.lock().unwrap().push(name);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// How many of the export's writes ran on the connection's own thread,
/// and how many on workers.
fn placed(export: &SlowWrites) -> (usize, usize) {
    let names = std::mem::take(&mut *export.ran_on.lock().unwrap());
    let inline = names.iter().filter(|n| n.starts_with("nbd-conn-")).count();
    (inline, names.len() - inline)
}

#[test]
fn slow_requests_of_a_waiting_client_run_on_the_connection_thread() {
    let export = Arc::new(Hooked {
        mem: MemExport::new(1 << 20),
        hook: SlowWrites::default(),
    });
    let server = TestServer::start(vec![("", export.clone() as Arc<dyn Export>)]);
    let c = NbdClient::connect(&server.uri("")).unwrap();
    let data = pattern(4096, 1);

    // One request at a time, as a guest's fsync at queue depth 1: handing
    // each to a worker would only add two thread switches.
    for i in 0..20 {
        c.write_at(i * 4096, &data, false).unwrap();
        c.flush().unwrap();
    }
    assert_eq!(placed(&export), (20, 0), "requests a client waited for");

    // Eight in flight: the slow ones must not wait behind each other on
    // the reading thread.
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let (c, data) = (&c, &data);
            sc.spawn(move || {
                for i in 0..10 {
                    c.write_at((t * 10 + i) * 4096, data, false).unwrap();
                }
            });
        }
    });
    let (inline, workers) = placed(&export);
    assert!(
        workers > inline,
        "pipelined slow requests: {inline} on the connection thread, {workers} on workers"
    );
    let mut back = vec![0u8; 4096];
    c.read_at(79 * 4096, &mut back).unwrap();
    assert!(back == data);
}
