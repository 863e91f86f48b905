//! vdcache-guest-io: the I/O a benchmark guest runs on its own disk (the VM
//! bench puts it, statically linked, in a busybox initramfs; fio's
//! dependencies would make the initramfs 80 MiB). Direct I/O (O_DIRECT,
//! 4 KiB-aligned buffers) so the guest's page cache measures nothing.
//!
//! Usage: vdcache-guest-io MODE DEVICE SPAN_MIB [THREADS] [SECONDS]
//!   seq-read | seq-write    1 MiB requests over the first SPAN_MIB MiB, once
//!   rand-read | rand-write  4 KiB requests at random 4 KiB offsets of the
//!                           span, THREADS at once (the queue depth), for SECONDS
//! Prints one line: `RESULT mode=... bytes=N seconds=S mbps=M iops=I`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::{Duration, Instant};

const O_DIRECT: i32 = 0o40000;
const ALIGN: usize = 4096;

/// A zero-filled buffer of `len` bytes at a 4 KiB-aligned address (direct
/// I/O needs one), carved out of a larger vector without unsafe code.
struct Aligned {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize, fill: u8) -> Aligned {
        let storage = vec![fill; len + ALIGN];
        let start = storage.as_ptr().align_offset(ALIGN);
        Aligned {
            storage,
            start,
            len,
        }
    }
    fn buf(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

fn open(dev: &str, write: bool) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(O_DIRECT)
        .open(dev)
        .map_err(|e| format!("cannot open {dev}: {e}"))
}

/// One pass of 1 MiB requests over `span` bytes.
fn sequential(dev: &str, span: u64, write: bool) -> Result<(u64, u64, Duration), String> {
    let f = open(dev, write)?;
    let mut b = Aligned::new(1 << 20, 0x5a);
    let started = Instant::now();
    let mut at = 0;
    while at < span {
        let r = if write {
            f.write_all_at(b.buf(), at)
        } else {
            f.read_exact_at(b.buf(), at)
        };
        r.map_err(|e| format!("{dev} at {at}: {e}"))?;
        at += 1 << 20;
    }
    if write {
        f.sync_all().map_err(|e| format!("{dev}: flush: {e}"))?;
    }
    Ok((span, span >> 20, started.elapsed()))
}

/// `threads` threads of 4 KiB requests at random offsets for `secs`.
fn random(
    dev: &str,
    span: u64,
    write: bool,
    threads: u32,
    secs: f64,
) -> Result<(u64, u64, Duration), String> {
    let blocks = (span / ALIGN as u64).max(1);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let dev = dev.to_string();
            std::thread::spawn(move || -> Result<u64, String> {
                let f = open(&dev, write)?;
                let mut b = Aligned::new(ALIGN, 0xa5);
                let mut x: u64 =
                    0x9e37_79b9_7f4a_7c15 ^ (u64::from(t) + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                let mut n = 0u64;
                while Instant::now() < deadline {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let at = (x % blocks) * ALIGN as u64;
                    let r = if write {
                        f.write_all_at(b.buf(), at)
                    } else {
                        f.read_exact_at(b.buf(), at)
                    };
                    r.map_err(|e| format!("{dev} at {at}: {e}"))?;
                    n += 1;
                }
                Ok(n)
            })
        })
        .collect();
    let mut ios = 0;
    for w in workers {
        ios += w.join().map_err(|_| "a worker panicked".to_string())??;
    }
    Ok((ios * ALIGN as u64, ios, started.elapsed()))
}

fn run(args: &[String]) -> Result<String, String> {
    let usage = "usage: vdcache-guest-io seq-read|seq-write|rand-read|rand-write DEVICE SPAN_MIB [THREADS] [SECONDS]";
    let (Some(mode), Some(dev), Some(span)) = (args.get(1), args.get(2), args.get(3)) else {
        return Err(usage.into());
    };
    let span: u64 = span
        .parse()
        .map_err(|_| format!("SPAN_MIB '{span}' is not a number"))?;
    let span = span << 20;
    let threads: u32 = args
        .get(4)
        .map_or(Ok(1), |t| t.parse())
        .map_err(|_| usage.to_string())?;
    let secs: f64 = args
        .get(5)
        .map_or(Ok(5.0), |t| t.parse())
        .map_err(|_| usage.to_string())?;
    let (bytes, ios, took) = match mode.as_str() {
        "seq-read" => sequential(dev, span, false)?,
        "seq-write" => sequential(dev, span, true)?,
        "rand-read" => random(dev, span, false, threads.max(1), secs)?,
        "rand-write" => random(dev, span, true, threads.max(1), secs)?,
        other => return Err(format!("unknown mode '{other}'\n{usage}")),
    };
    let s = took.as_secs_f64().max(1e-9);
    Ok(format!(
        "RESULT mode={mode} bytes={bytes} seconds={s:.3} mbps={:.1} iops={:.0}",
        bytes as f64 / s / 1e6,
        ios as f64 / s
    ))
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vdcache-guest-io: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
