//! The server against real clients: nbdinfo, qemu-io, qemu-img, nbdcopy and
//! fio's nbd engine, each connecting to an in-process server over a Unix
//! socket; contents are checked both through the tool and in the export.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::sync::Arc;

use common::*;
use vdcache_backend::nbd::NbdClient;
use vdcache_nbd_server::{Export, MemExport, Server};

#[test]
fn nbdinfo_lists_exports_and_maps_allocation() {
    require_tool("nbdinfo");
    let disk = Arc::new(MemExport::new(8 << 20));
    let ro = Arc::new(MemExport::with_data(&pattern(1 << 20, 7)).read_only(true));
    let b = Server::builder()
        .export("", disk.clone())
        .export_with_description("golden", "read-only base image", ro);
    let s = TestServer::start_with(b);

    // Data at 1 MiB..1.5 MiB, everything else a hole.
    let c = NbdClient::connect(&s.uri("")).unwrap();
    c.write_at(1 << 20, &pattern(512 << 10, 1), false).unwrap();
    drop(c);

    let info = run(Command::new("nbdinfo").arg(s.uri("")));
    assert!(info.contains("export-size: 8388608"), "{info}");
    assert!(info.contains("can_multi_conn: true"), "{info}");
    assert!(info.contains("can_fua: true"), "{info}");
    assert!(info.contains("base:allocation"), "{info}");

    let info = run(Command::new("nbdinfo").arg(s.uri("golden")));
    assert!(info.contains("is_read_only: true"), "{info}");
    assert!(info.contains("read-only base image"), "{info}");

    let list = run(Command::new("nbdinfo").arg("--list").arg(s.uri("")));
    assert!(list.contains("export=\"\""), "{list}");
    assert!(list.contains("export=\"golden\""), "{list}");

    let map = run(Command::new("nbdinfo").arg("--map").arg(s.uri("")));
    let rows: Vec<(u64, u64, u32)> = map
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (0, 1 << 20, 3),
            (1 << 20, 512 << 10, 0),
            (3 << 19, (8 << 20) - (3 << 19), 3)
        ],
        "{map}"
    );

    let missing = output(Command::new("nbdinfo").arg(s.uri("nope")));
    assert!(!missing.status.success());
}

#[test]
fn qemu_io_writes_and_verifies_patterns() {
    require_tool("qemu-io");
    let (s, disk) = mem_server(16 << 20);
    let out = qemu_io(
        &s.uri(""),
        &[
            "write -P 0xab 0 1M",
            "write -P 0xcd 4095k 66k",
            "write -P 0x11 -f 12M 64k",
            "aio_write -P 0x22 8M 256k",
            "aio_write -P 0x33 9M 256k",
            "aio_flush",
            "flush",
            "read -P 0xab 0 1M",
            "read -P 0xcd 4095k 66k",
            "read -P 0x11 12M 64k",
            "read -P 0x22 8M 256k",
            "read -P 0x33 9M 256k",
            "read -P 0 2M 1M",
            "write -z 0 64k",
            "read -P 0 0 64k",
            "discard 12M 64k",
        ],
    );
    assert!(!out.contains("failed"), "{out}");
    let c = disk.contents();
    assert!(c[..64 << 10].iter().all(|&b| b == 0));
    assert!(c[64 << 10..1 << 20].iter().all(|&b| b == 0xab));
    assert!(c[4095 << 10..(4095 + 66) << 10].iter().all(|&b| b == 0xcd));
    assert!(
        c[8 << 20..(8 << 20) + (256 << 10)]
            .iter()
            .all(|&b| b == 0x22)
    );

    // A wrong pattern must be noticed (the check above can fail).
    let bad = output(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read -P 0x99 0 1M"])
            .arg(s.uri("")),
    );
    let text =
        String::from_utf8_lossy(&bad.stdout).into_owned() + &String::from_utf8_lossy(&bad.stderr);
    assert!(
        text.contains("verification failed") || !bad.status.success(),
        "{text}"
    );
}

/// Write payload buffers are reused across requests: a short write into
/// a buffer a long one used writes only its own bytes, and a long one
/// after short ones all of its bytes.
#[test]
fn writes_of_changing_sizes_write_exactly_their_bytes() {
    require_tool("qemu-io");
    let (s, disk) = mem_server(16 << 20);
    let out = qemu_io(
        &s.uri(""),
        &[
            "write -P 0x44 0 1M",
            "write -P 0x55 2M 4k",
            "write -P 0x66 3M 512",
            "write -P 0x77 4M 2M",
            "write -P 0x88 7M 4k",
        ],
    );
    assert!(!out.contains("failed"), "{out}");
    let c = disk.contents();
    let mib = 1 << 20;
    let expect = |from: usize, to: usize, byte: u8| {
        let first = c[from..to].iter().position(|&b| b != byte);
        assert_eq!(first, None, "[{from}, {to}) should hold {byte:#x}");
    };
    expect(0, mib, 0x44);
    expect(mib, 2 * mib, 0);
    expect(2 * mib, 2 * mib + 4096, 0x55);
    expect(2 * mib + 4096, 3 * mib, 0);
    expect(3 * mib, 3 * mib + 512, 0x66);
    expect(3 * mib + 512, 4 * mib, 0);
    expect(4 * mib, 6 * mib, 0x77);
    expect(6 * mib, 7 * mib, 0);
    expect(7 * mib, 7 * mib + 4096, 0x88);
    expect(7 * mib + 4096, 16 * mib, 0);
}

#[test]
fn qemu_io_sees_read_only_export_errors() {
    require_tool("qemu-io");
    let ro = Arc::new(MemExport::with_data(&pattern(1 << 20, 3)).read_only(true));
    let s = TestServer::start(vec![("ro", ro as Arc<dyn Export>)]);
    let out = output(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write -P 1 0 4k"])
            .arg(s.uri("ro")),
    );
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            || text.contains("ermission")
            || text.contains("read-only")
            || text.contains("read only"),
        "{text}"
    );
}

#[test]
fn qemu_img_compare_against_a_local_file() {
    require_tool("qemu-img");
    let (s, _disk) = mem_server(8 << 20);
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("ref.raw");
    let mut data = vec![0u8; 8 << 20];
    data[100..300_000].copy_from_slice(&pattern(299_900, 5));
    data[5 << 20..6 << 20].copy_from_slice(&pattern(1 << 20, 6));
    std::fs::write(&file, &data).unwrap();
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&file)
        .arg(s.uri("")));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&file)
        .arg(s.uri("")));
    // One changed byte must make compare fail (exit 1).
    let c = NbdClient::connect(&s.uri("")).unwrap();
    c.write_at(7 << 20, &[1], false).unwrap();
    drop(c);
    let out = output(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&file)
            .arg(s.uri("")),
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

#[test]
fn nbdcopy_in_and_out() {
    require_tool("nbdcopy");
    let (s, disk) = mem_server(32 << 20);
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.raw");
    let dst = tmp.path().join("dst.raw");
    let mut data = vec![0u8; 32 << 20];
    for (i, chunk) in data.chunks_mut(1 << 20).enumerate() {
        if i % 3 != 1 {
            chunk.copy_from_slice(&pattern(1 << 20, i as u64));
        }
    }
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(s.uri("")));
    assert!(disk.contents() == data, "nbdcopy in: contents differ");
    std::fs::write(&dst, []).unwrap();
    run(Command::new("nbdcopy").arg(s.uri("")).arg(&dst));
    assert!(
        std::fs::read(&dst).unwrap() == data,
        "nbdcopy out: contents differ"
    );
    // Multi-connection copy (the export advertises multi-conn).
    let dst2 = tmp.path().join("dst2.raw");
    std::fs::write(&dst2, []).unwrap();
    run(Command::new("nbdcopy")
        .args(["--connections=4", "--requests=16"])
        .arg(s.uri(""))
        .arg(&dst2));
    assert!(
        std::fs::read(&dst2).unwrap() == data,
        "nbdcopy multi-conn: contents differ"
    );
}

#[test]
fn fio_nbd_engine_with_crc32c_verification() {
    require_tool("fio");
    let (s, _disk) = mem_server(64 << 20);
    let tmp = tempfile::tempdir().unwrap();
    let job = tmp.path().join("verify.fio");
    std::fs::write(
        &job,
        format!(
            "[global]\nioengine=nbd\nuri={}\niodepth=32\nverify=crc32c\ndo_verify=1\nverify_fatal=1\n\
             [rand4k]\nrw=randwrite\nbs=4k\nsize=16m\noffset=0\n\
             [seq64k]\nrw=write\nbs=64k\nsize=16m\noffset=32m\n",
            s.uri("")
        ),
    )
    .unwrap();
    let out = run(Command::new("fio")
        .current_dir(tmp.path())
        .arg("--output-format=terse")
        .arg(&job));
    // Terse format: field 5 is the error code of each job.
    for line in out.lines().filter(|l| l.starts_with("3;")) {
        let f: Vec<&str> = line.split(';').collect();
        assert_eq!(f[4], "0", "fio job failed: {line}");
    }
    let st = s.server.stats();
    assert!(st.exports[0].io.bytes_written >= 32 << 20, "{st:?}");
    assert!(st.exports[0].io.bytes_read >= 32 << 20, "{st:?}");
}

#[test]
fn tcp_listener_serves_tools_and_client() {
    require_tool("nbdinfo");
    require_tool("qemu-io");
    let disk = Arc::new(MemExport::new(4 << 20));
    let server = Server::builder().export("t", disk.clone()).build().unwrap();
    let addr = server.listen_tcp("127.0.0.1:0").unwrap();
    let uri = format!("nbd://127.0.0.1:{}/t", addr.port());
    let c = NbdClient::connect(&uri).unwrap();
    c.write_at(65536, &[0x3cu8; 65536], true).unwrap();
    drop(c);
    let info = run(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("export-size: 4194304"), "{info}");
    let out = run(Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "read -P 0x3c 64k 64k",
            "-c",
            "write -P 0x3d 1M 4k",
        ])
        .arg(&uri));
    assert!(!out.contains("failed"), "{out}");
    assert_eq!(disk.contents()[1 << 20], 0x3d);
    server.shutdown();
    assert!(NbdClient::connect(&uri).is_err());
}

/// Once shutdown returns, the server holds no export: what an export holds
/// (for vdcache, a cache device and its lock) can be opened again at once.
/// Connections that qemu-io has just closed race the shutdown here, many
/// times over.
#[test]
fn shutdown_returns_with_every_export_released() {
    for round in 0..20 {
        let disk = Arc::new(MemExport::new(1 << 20));
        let s = TestServer::start(vec![("", disk.clone() as Arc<dyn Export>)]);
        let uri = s.uri("");
        let clients: Vec<_> = (0..4)
            .map(|_| {
                Command::new("qemu-io")
                    .args(["-r", "-f", "raw", "-c", "read 0 4k"])
                    .arg(&uri)
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut c in clients {
            c.wait().unwrap();
        }
        s.server.shutdown();
        drop(s);
        assert_eq!(
            Arc::strong_count(&disk),
            1,
            "round {round}: the stopped server still holds its export"
        );
    }
}
