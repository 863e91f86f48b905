//! Issue 43, items 2 and 3 and three of its messages, with the real
//! server: `vdcache serve` with a 32 MiB write-back cache over a qcow2
//! chain made by qemu-img, `qemu-io` over NBD writes 8 MiB and flushes,
//! the server is killed (kill -9), the cache file is damaged at rest as
//! the issue did it, and the server restarts on it. A damaged checkpoint
//! header, a zeroed journal or a damaged last journal batch gets the cache
//! refused, naming the image, which stays marked as needing the cache
//! (qemu-img refuses it): never served stale, never unmarked. A damaged
//! data block the last batch names fails its reads (the batch is not
//! dropped as a torn tail) and is never written back; the stop then says
//! so instead of "complete without it". `recover --full --salvage`
//! after a damaged first batch does not claim success while the image
//! still needs the cache, and `--format-cache` keeps a cache whose
//! superblock its copy repairs.

use crate::common;
use crate::serving;

use common::{Scratch, exec, ok};
use serving::{Proc, Streamed, qcow2, qemu_io, serve, serve_refused, uri};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use vdcache_cache::sites::{Site, metadata_sites};

const M: u64 = 1 << 20;
/// What the base image holds, and what the guest wrote over it.
const BASE: u8 = 0x11;
const WRITTEN: u8 = 0xab;

/// A chain (base with [`BASE`], an empty top), a cache, a socket.
struct Chain {
    s: Scratch,
    top: PathBuf,
    cache: PathBuf,
    sock: PathBuf,
}

impl Chain {
    fn new() -> Chain {
        let s = Scratch::new();
        let base = s.path("base.qcow2");
        qcow2(&s, &base, 32 * M, None);
        qemu_io(
            &s,
            "qcow2",
            base.to_str().expect("utf-8"),
            &[format!("write -P {BASE} 0 16M")],
        );
        let top = s.path("d.qcow2");
        qcow2(&s, &top, 32 * M, Some("base.qcow2"));
        Chain {
            top,
            cache: s.path("d.cache"),
            sock: s.path("d.sock"),
            s,
        }
    }

    fn args(&self) -> Vec<&str> {
        vec![
            "--cache",
            self.cache.to_str().expect("utf-8"),
            "--cache-size",
            "32M",
            "--cache-mode",
            "writeback",
            "--no-idle-fill",
            self.top.to_str().expect("utf-8"),
        ]
    }

    fn serve(&self) -> Proc {
        serve(&self.s, &self.sock, &self.args())
    }

    fn uri(&self) -> String {
        uri(&self.sock, "")
    }

    /// Serve, `write -P 0xab 0 8M`, flush, kill -9.
    fn crashed_after_flush(self) -> Chain {
        let server = self.serve();
        qemu_io(
            &self.s,
            "raw",
            &self.uri(),
            &[format!("write -P {WRITTEN} 0 8M"), "flush".into()],
        );
        server.kill9();
        self
    }

    /// The cache's metadata sites of `kind` whose description contains
    /// `what`, as the crashed cache file holds them.
    fn site(&self, kind: &str, what: &str) -> Site {
        let bytes = std::fs::read(&self.cache).expect("read the cache");
        let dev = vdcache_backend::MemBackend::new("cache", bytes);
        let sites = metadata_sites(&dev).expect("sites");
        sites
            .iter()
            .find(|s| s.kind == kind && s.what.contains(what))
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} site '{what}' among {sites:#?}"))
    }

    /// Damages the cache file at `site`, in place.
    fn damage(&self, site: &Site) {
        let mut bytes = std::fs::read(&self.cache).expect("read the cache");
        site.apply(&mut bytes);
        let range = site.offset as usize..(site.offset + site.len) as usize;
        write_at(&self.cache, site.offset, &bytes[range]);
    }

    /// A restart on the damaged cache is refused naming the damage and
    /// the image; the image stays marked as needing the cache.
    fn assert_refused(&self, damage: &str) -> String {
        let out = serve_refused(&self.s, &self.sock, &self.args());
        assert!(
            out.contains("is damaged")
                && out.contains(damage)
                && out.contains(self.top.to_str().expect("utf-8")),
            "the refusal must name the damage ({damage}) and the image\n{out}"
        );
        self.assert_still_marked();
        out
    }

    /// qemu-img refuses the image, naming vdcache's recovery: its newest
    /// data is still in the cache.
    fn assert_still_marked(&self) {
        let chk = exec(self.s.qemu_img().arg("check").arg(&self.top));
        assert!(
            !chk.success() && chk.stderr.contains("vdcache recover"),
            "the image lost its needs-cache mark\n{}",
            chk.report()
        );
    }
}

fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open the cache");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(bytes).expect("write");
}

/// Item 2: one byte flipped in the first 16 of checkpoint slot 1 (the
/// newest checkpoint: the one the restart before the crash wrote).
#[test]
fn a_damaged_checkpoint_header_gets_the_cache_refused() {
    let c = Chain::new().crashed_after_flush();
    c.damage(&c.site("checkpoint header", "slot 1"));
    c.assert_refused("checkpoint");
    c.s.finish();
}

/// Item 2: a zeroed journal.
#[test]
fn a_zeroed_journal_gets_the_cache_refused() {
    let c = Chain::new().crashed_after_flush();
    c.damage(&c.site("journal", "whole journal"));
    c.assert_refused("does not verify");
    c.s.finish();
}

/// Item 3: four bytes flipped in the last journal block.
#[test]
fn a_damaged_last_journal_batch_gets_the_cache_refused() {
    let c = Chain::new().crashed_after_flush();
    c.damage(&c.site("journal batch", "last"));
    c.assert_refused("does not verify");
    c.s.finish();
}

/// Item 3: one byte flipped in a data block the last data batch names
/// (the client still connected at the kill, so no later sync's batch
/// records that one as synced: only the seal does). The cache opens; that block's reads fail, every other
/// reads what was flushed; the stop says the cache still holds it, and
/// the image stays marked.
#[test]
fn a_damaged_data_block_of_the_last_batch_fails_its_reads_and_the_stop_says_so() {
    let c = Chain::new();
    let server = c.serve();
    // Line-buffered, so the marker shows while qemu-io stays connected.
    let mut cmd = c.s.cmd("stdbuf");
    cmd.args(["-oL", "qemu-io", "-f", "raw"]);
    for command in [
        format!("write -q -P {WRITTEN} 0 8M"),
        "flush".into(),
        "length".into(),
        "sleep 60000".into(),
    ] {
        cmd.arg("-c").arg(command);
    }
    cmd.arg(c.uri());
    let mut qio = Streamed::spawn(cmd);
    assert!(
        qio.wait_for(1, |l| l.trim() == "32 MiB"),
        "the flush did not complete:\n{}",
        qio.seen.join("\n")
    );
    server.kill9();
    // Killed on drop: it sleeps on, connected to nothing.
    drop(qio);
    let bytes = std::fs::read(&c.cache).expect("read the cache");
    let at = last_batch_data_block(&bytes);
    write_at(&c.cache, at + 100, &[!WRITTEN]);
    let server = c.serve();
    let mut cmd = c.s.qemu_io();
    cmd.args(["-f", "raw"]);
    for block in 0..(8 * M / 4096) {
        cmd.arg("-c")
            .arg(format!("read -q -P {WRITTEN} {} 4096", block * 4096));
    }
    let out = exec(cmd.arg(c.uri()));
    let all = out.all();
    assert_eq!(
        all.matches("read failed").count(),
        1,
        "exactly the damaged block must fail to read\n{all}"
    );
    assert!(
        !all.contains("Pattern verification failed"),
        "a block read other bytes than were flushed\n{all}"
    );
    let (status, log) = server.terminate();
    assert!(
        !status.success()
            && log.contains("still holds")
            && log.contains("damaged")
            && !log.contains("complete without it"),
        "the stop must say the cache still holds data it could not write back ({status})\n{log}"
    );
    c.assert_still_marked();
    c.s.finish();
}

/// The device offset of a block of guest data ([`WRITTEN`]) named by the
/// last journal batch replay reads that names any (only the image's
/// metadata records follow it, made durable by the same sync).
fn last_batch_data_block(device: &[u8]) -> u64 {
    use vdcache_cache::journal::{Entry, decode_entries, read_batches, read_checkpoint};
    let dev = vdcache_backend::MemBackend::new("cache", device.to_vec());
    let sb = vdcache_cache::layout::Superblock::peek(&dev).expect("a superblock");
    let (mark, _) = read_checkpoint(&dev, &sb.layout, &sb.uuid).expect("a checkpoint");
    let tail = read_batches(&dev, &sb.layout, &sb.uuid, mark).expect("the journal");
    let is_data = |at: u64| {
        device[at as usize..at as usize + 4096]
            .iter()
            .all(|&b| b == WRITTEN)
    };
    tail.batches
        .iter()
        .rev()
        .find_map(|b| {
            decode_entries(b)
                .expect("entries")
                .into_iter()
                .filter_map(|e| match e {
                    Entry::Map { cbn, .. } => Some(sb.layout.block_offset(cbn)),
                    _ => None,
                })
                .find(|&at| is_data(at))
        })
        .expect("a batch names a block of the guest's data")
}

/// Message: `recover --full --salvage` after a damaged first journal batch
/// exited 0 having written nothing back while the image still needed the
/// cache. Now the image is left standalone with what verified, and the
/// loss is reported naming it.
#[test]
fn salvage_after_a_damaged_first_batch_leaves_the_image_standalone_and_says_so() {
    let c = Chain::new().crashed_after_flush();
    c.damage(&c.site("journal batch", "first"));
    c.assert_refused("does not verify");
    let out = ok(c
        .s
        .vdcache()
        .args(["recover", "--full", "--salvage", "--cache"])
        .arg(&c.cache));
    let top = c.top.to_str().expect("utf-8");
    assert!(
        out.stdout.contains(&format!("written back: {top}"))
            && out.stderr.contains(&format!("{top}: salvaged"))
            && out.stderr.contains("lost"),
        "salvage must leave the image standalone and report the loss\n{}",
        out.report()
    );
    // No longer marked: qemu-img opens it.
    ok(c.s.qemu_img().arg("check").arg(&c.top));
    c.s.finish();
}

/// Message: `--format-cache` on a cache whose superblock is damaged but
/// whose copy is good, with dirty data: refused, and the data kept.
#[test]
fn format_cache_keeps_a_cache_its_superblock_copy_repairs() {
    let c = Chain::new().crashed_after_flush();
    write_at(&c.cache, 0, &[0u8; 64]);
    let mut args = c.args();
    args.insert(0, "--format-cache");
    let out = serve_refused(&c.s, &c.sock, &args);
    assert!(
        out.contains("still holds data not written back"),
        "--format-cache must refuse a cache holding dirty data\n{out}"
    );
    let server = c.serve();
    let read = qemu_io(
        &c.s,
        "raw",
        &c.uri(),
        &[format!("read -q -P {WRITTEN} 0 8M")],
    );
    assert!(!read.contains("failed"), "{read}");
    server.stop_clean();
    c.s.finish();
}
