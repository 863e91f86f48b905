//! A read whose missing blocks lie a few cached blocks apart is fetched
//! from the image with one request spanning them; the cached blocks in
//! between must still come from flash. Here they are dirty (newer than
//! the image), so bytes taken from the spanning read would be old ones.
//! Read back whole with nbdcopy (large requests) and compared byte for
//! byte; the storage counters show the misses were merged.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::serving;

use common::{Scratch, ok};
use serving::{qemu_io, serve, stats, uri};

const SIZE: u64 = 4 << 20;
const BLOCK: u64 = 4096;

#[test]
fn merged_miss_reads_keep_the_cached_blocks_between_them() {
    let s = Scratch::new();
    let img = s.path("disk.raw");
    std::fs::File::create(&img).unwrap().set_len(SIZE).unwrap();
    qemu_io(
        &s,
        "raw",
        img.to_str().unwrap(),
        &[format!("write -P 0x11 0 {SIZE}")],
    );
    let sock = s.path("vd.sock");
    let cache = s.path("cache.img");
    let server = serve(
        &s,
        &sock,
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "64M",
            "-f",
            "raw",
            img.to_str().unwrap(),
        ],
    );
    let target = uri(&sock, "");
    // Every fourth block rewritten: dirty in flash, three missing blocks
    // between each two.
    let writes: Vec<String> = (0..SIZE / BLOCK)
        .step_by(4)
        .map(|b| format!("write -P 0x22 {} 4k", b * BLOCK))
        .collect();
    qemu_io(&s, "raw", &target, &writes);
    let before = stats(&s, &sock)["cache"]["total"]["backend_bytes_read"]
        .as_u64()
        .unwrap();
    let out = s.path("out.raw");
    ok(s.cmd("nbdcopy").arg(&target).arg(&out));
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len() as u64, SIZE);
    for (b, chunk) in got.chunks(BLOCK as usize).enumerate() {
        let want = if b % 4 == 0 { 0x22 } else { 0x11 };
        assert!(
            chunk.iter().all(|&x| x == want),
            "block {b} reads {:#x}, not {want:#x}",
            chunk[0]
        );
    }
    // The misses (three quarters of the disk) were read in spans that
    // include the cached blocks between them.
    let read = stats(&s, &sock)["cache"]["total"]["backend_bytes_read"]
        .as_u64()
        .unwrap()
        - before;
    assert!(read > SIZE * 3 / 4, "{read} bytes read: no span was merged");
    server.stop_clean();
    s.finish();
}
