//! Helpers for the tests that run `vdcache serve` (and nbdkit, the emulated
//! storage server) as real processes and talk to them with real NBD
//! clients (qemu-io, qemu-img, nbdinfo, nbdcopy, fio).
//!
//! Every server is a [`Proc`]: its output goes to a log file in the test's
//! scratch directory, readiness is detected by polling `connect()` on its
//! socket with a bounded deadline (never a sleep), and it is killed when the
//! guard is dropped, so a failing test never leaves a server behind.
//! A test module that uses this one also declares `mod common;`.

#![allow(dead_code)]

use crate::common::Scratch;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a server may take to start listening or to stop.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The NBD URI of `export` on a Unix socket.
pub fn uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// A background server process, killed (SIGKILL) when dropped.
pub struct Proc {
    child: Option<Child>,
    pub desc: String,
    pub log: PathBuf,
    pub socket: PathBuf,
}

impl Proc {
    /// Starts `cmd` with its stdout and stderr in `log`.
    pub fn spawn(mut cmd: Command, socket: &Path, log: PathBuf) -> Proc {
        let desc = crate::common::describe(&cmd);
        let f = File::create(&log).expect("create server log");
        let f2 = f.try_clone().expect("clone log handle");
        cmd.stdin(Stdio::null()).stdout(f).stderr(f2);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {desc}: {e} (these tests never skip)"));
        Proc {
            child: Some(child),
            desc,
            log,
            socket: socket.to_path_buf(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// What the process printed so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Has the process exited? (Reaps it if so.)
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
    }

    /// Waits until the socket accepts connections; fails if the process
    /// exits first or the deadline passes.
    pub fn wait_ready(&mut self) {
        let start = Instant::now();
        loop {
            if let Some(st) = self.exited() {
                panic!(
                    "{} exited ({st}) before listening on {}\n--- log ---\n{}",
                    self.desc,
                    self.socket.display(),
                    self.log_text()
                );
            }
            if UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{} did not listen on {} within {DEADLINE:?}\n--- log ---\n{}",
                self.desc,
                self.socket.display(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (bounded) for the process to exit by itself.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.exited() {
                self.child = None;
                return st;
            }
            if start.elapsed() > DEADLINE {
                let log = self.log_text();
                panic!(
                    "{} did not exit within {DEADLINE:?}\n--- log ---\n{log}",
                    self.desc
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends SIGTERM and waits for the process to exit; returns its
    /// status and log.
    pub fn terminate(mut self) -> (ExitStatus, String) {
        let pid = self.pid().to_string();
        let st = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -TERM {pid} failed");
        let st = self.wait_exit();
        (st, self.log_text())
    }

    /// SIGTERM, then asserts a clean exit (status 0, no panic).
    pub fn stop_clean(self) -> String {
        let desc = self.desc.clone();
        let (st, log) = self.terminate();
        assert!(
            st.success() && !log.contains("panicked"),
            "{desc} did not stop cleanly on SIGTERM ({st})\n--- log ---\n{log}"
        );
        log
    }

    /// SIGKILL (kill -9), reaped; returns the log.
    pub fn kill9(mut self) -> String {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.log_text()
    }

    /// Asserts the process is still running.
    pub fn assert_alive(&mut self) {
        if let Some(st) = self.exited() {
            panic!(
                "{} died ({st})\n--- log ---\n{}",
                self.desc,
                self.log_text()
            );
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `vdcache serve --socket SOCKET ARGS...`, started and listening.
pub fn serve(s: &Scratch, socket: &Path, args: &[&str]) -> Proc {
    let mut cmd = s.vdcache();
    cmd.arg("serve").arg("--socket").arg(socket).args(args);
    start(s, cmd, socket)
}

/// `vdcache serve --config FILE`, listening on `socket`.
pub fn serve_config(s: &Scratch, config: &Path, socket: &Path) -> Proc {
    let mut cmd = s.vdcache();
    cmd.arg("serve").arg("--config").arg(config);
    start(s, cmd, socket)
}

fn start(s: &Scratch, cmd: Command, socket: &Path) -> Proc {
    let name = socket
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut n = 0;
    let log = loop {
        let p = s.root().join(format!("{name}.{n}.log"));
        if !p.exists() {
            break p;
        }
        n += 1;
    };
    let mut p = Proc::spawn(cmd, socket, log);
    p.wait_ready();
    p
}

/// Starts `vdcache serve --socket SOCKET ARGS...`: Ok once it listens,
/// Err(its output) if it exits first (with an error status, no panic).
pub fn try_serve(s: &Scratch, socket: &Path, args: &[&str]) -> Result<Proc, String> {
    let mut cmd = s.vdcache();
    cmd.arg("serve").arg("--socket").arg(socket).args(args);
    match try_start(s, cmd, socket) {
        Ok(p) => Ok(p),
        Err((st, log)) => {
            assert!(
                !st.success() && st.code().is_some() && st.code() != Some(101),
                "the server should have failed with an error, got {st}\n{log}"
            );
            assert!(!log.contains("panicked"), "{log}");
            crate::common::assert_messages_read_well(&log, "vdcache serve");
            Err(log)
        }
    }
}

/// Starts a server `cmd` that listens on `socket`: Ok once it accepts
/// connections, Err(exit status, output) if it exits first; fails the test
/// if it does neither within [`DEADLINE`].
pub fn try_start(s: &Scratch, cmd: Command, socket: &Path) -> Result<Proc, (ExitStatus, String)> {
    let mut n = 0;
    let log = loop {
        let p = s.root().join(format!("try-serve.{n}.log"));
        if !p.exists() {
            break p;
        }
        n += 1;
    };
    let mut p = Proc::spawn(cmd, socket, log);
    let start = Instant::now();
    loop {
        if let Some(st) = p.exited() {
            return Err((st, p.log_text()));
        }
        if UnixStream::connect(socket).is_ok() {
            return Ok(p);
        }
        assert!(start.elapsed() < DEADLINE, "{} hung", p.desc);
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `vdcache serve --socket SOCKET ARGS...` expecting it to refuse to
/// start: returns its output. Fails if it starts listening instead.
pub fn serve_refused(s: &Scratch, socket: &Path, args: &[&str]) -> String {
    match try_serve(s, socket, args) {
        Err(log) => log,
        Ok(p) => panic!(
            "{} started serving but should have been refused\n{}",
            p.desc,
            p.log_text()
        ),
    }
}

/// nbdkit's file plugin exporting every file of `dir` (exports are file
/// names), on a Unix socket.
pub fn nbdkit(s: &Scratch, socket: &Path, dir: &Path) -> Proc {
    nbdkit_with(s, socket, dir, &[])
}

/// [`nbdkit`] with extra arguments before the plugin (filters, e.g.
/// `--filter=delay`) and after it (their parameters, `key=value`). Each
/// start logs to a new file; a socket left by a killed server is removed.
pub fn nbdkit_with(s: &Scratch, socket: &Path, dir: &Path, args: &[&str]) -> Proc {
    let (filters, params): (Vec<&str>, Vec<&str>) = args.iter().partition(|a| a.starts_with("--"));
    let _ = std::fs::remove_file(socket);
    let mut cmd = s.cmd("nbdkit");
    cmd.arg("--unix")
        .arg(socket)
        .args(["--foreground", "--exit-with-parent"])
        .args(filters)
        .arg("file")
        .arg(format!("dir={}", dir.display()))
        .args(params);
    let mut n = 0;
    let log = loop {
        let name = if n == 0 {
            "nbdkit.log".to_string()
        } else {
            format!("nbdkit.{n}.log")
        };
        let p = s.root().join(name);
        if !p.exists() {
            break p;
        }
        n += 1;
    };
    let mut p = Proc::spawn(cmd, socket, log);
    p.wait_ready();
    p
}

/// The storage directory with base.qcow2 (`size`, two patterned areas),
/// written with qemu-io before nbdkit exports it.
pub fn storage_dir(s: &Scratch, size: u64) -> PathBuf {
    let dir = s.path("storage");
    std::fs::create_dir(&dir).expect("mkdir storage");
    let base = dir.join("base.qcow2");
    qcow2(s, &base, size, None);
    qemu_io(
        s,
        "qcow2",
        base.to_str().expect("utf-8"),
        &["write -P 0x11 0 6M".into(), "write -P 0x22 10M 2M".into()],
    );
    dir
}

/// `src` (format `fmt`) converted to raw at `dst`, and its bytes.
pub fn raw_of(s: &Scratch, fmt: &str, src: &str, dst: &Path) -> Vec<u8> {
    crate::common::ok(
        s.qemu_img()
            .args(["convert", "-f", fmt, "-O", "raw", src])
            .arg(dst),
    );
    std::fs::read(dst).expect("read converted image")
}

/// `vdcache stats --socket S --json`, parsed.
pub fn stats(s: &Scratch, socket: &Path) -> serde_json::Value {
    let out = crate::common::ok(
        s.vdcache()
            .args(["stats", "--json", "--socket"])
            .arg(socket),
    );
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("stats --json is not JSON: {e}\n{}", out.stdout))
}

/// A child process whose combined stdout and stderr is read line by line
/// while it runs (for workloads the test reacts to), killed on drop.
pub struct Streamed {
    child: Option<Child>,
    pub desc: String,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Streamed {
    pub fn spawn(mut cmd: Command) -> Streamed {
        let desc = crate::common::describe(&cmd);
        let (r, w) = std::io::pipe().expect("pipe");
        let w2 = w.try_clone().expect("clone pipe");
        cmd.stdin(Stdio::null()).stdout(w).stderr(w2);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {desc}: {e} (these tests never skip)"));
        // The parent's copies of the write end are gone with `cmd`.
        drop(cmd);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Streamed {
            child: Some(child),
            desc,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits until `count` lines satisfying `pred` have been printed
    /// (bounded by [`DEADLINE`]); false if the output ended first.
    pub fn wait_for(&mut self, count: usize, pred: impl Fn(&str) -> bool) -> bool {
        let start = Instant::now();
        loop {
            if self.seen.iter().filter(|l| pred(l)).count() >= count {
                return true;
            }
            let left = DEADLINE.saturating_sub(start.elapsed());
            assert!(
                !left.is_zero(),
                "{}: no progress within {DEADLINE:?}; output so far:\n{}",
                self.desc,
                self.seen.join("\n")
            );
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
    }

    /// Waits (bounded) for the process to end; returns its status and
    /// every line it printed.
    pub fn finish(mut self) -> (ExitStatus, Vec<String>) {
        let start = Instant::now();
        let mut child = self.child.take().expect("running");
        let status = loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                break st;
            }
            if start.elapsed() > DEADLINE {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} did not finish within {DEADLINE:?}", self.desc);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // The reader ends at EOF once the child (the last writer) is gone.
        while let Ok(l) = self.lines.recv_timeout(DEADLINE) {
            self.seen.push(l);
        }
        (status, std::mem::take(&mut self.seen))
    }
}

impl Drop for Streamed {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `qemu-img create -f qcow2 [-o OPTS] [-b BACKING -F qcow2] PATH SIZE`.
pub fn qcow2(s: &Scratch, path: &Path, size: u64, backing: Option<&str>) {
    let mut cmd = s.qemu_img();
    cmd.args(["create", "-q", "-f", "qcow2"]);
    if let Some(b) = backing {
        cmd.args(["-b", b, "-F", "qcow2"]);
    }
    cmd.arg(path).arg(size.to_string());
    crate::common::ok(&mut cmd);
}

/// Runs qemu-io commands on `target` (`-f FMT`); fails on any failed
/// command (qemu-io prints "... failed" and exits non-zero).
pub fn qemu_io(s: &Scratch, fmt: &str, target: &str, cmds: &[String]) -> String {
    qemu_io_opts(s, &["-f", fmt], target, cmds)
}

/// [`qemu_io`] with any options (e.g. `-r` for a read-only export).
pub fn qemu_io_opts(s: &Scratch, opts: &[&str], target: &str, cmds: &[String]) -> String {
    let mut cmd = s.qemu_io();
    cmd.args(opts);
    for c in cmds {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(target);
    let out = crate::common::exec(&mut cmd);
    let all = out.all();
    assert!(
        out.success() && !all.contains("failed"),
        "qemu-io reported a failure\n{}",
        out.report()
    );
    all
}

/// A deterministic byte pattern (not a qemu-io -P byte): the first `len`
/// bytes of a stream seeded with `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng as _, SeedableRng};
    let mut v = vec![0u8; len];
    rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// The incompatible-features dirty bit (bit 0) of a qcow2 v3 header.
pub fn qcow2_dirty_bit(path: &Path) -> bool {
    use std::io::Read;
    let mut h = [0u8; 80];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut h))
        .expect("read the qcow2 header");
    let version = crate::common::be32(&h, 4);
    version >= 3 && crate::common::be64(&h, 72) & 1 == 1
}

/// One operation of a crash workload.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// `write -P byte off len` (`byte` 0 is sent as `write -z`).
    Write { off: u64, len: u64, byte: u8 },
    /// `flush`, followed by a marker command (`length`) whose output shows
    /// that the flush completed.
    Flush,
}

/// A seeded workload of writes with flushes, sent by one qemu-io while the
/// server is killed: which writes were flushed is read from qemu-io's own
/// output (a flush is confirmed when the marker after it was printed
/// before any command failed).
pub struct CrashWorkload {
    pub size: u64,
    pub ops: Vec<Op>,
}

impl CrashWorkload {
    /// `groups` groups of `per_group` writes each followed by a flush, then
    /// `per_group` more writes that are never flushed.
    pub fn generate(seed: u64, size: u64, groups: usize, per_group: usize) -> CrashWorkload {
        use rand::{RngExt, SeedableRng};
        use rand_xoshiro::Xoshiro256PlusPlus;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut ops = Vec::new();
        for g in 0..=groups {
            for _ in 0..per_group {
                let (off, len) = if rng.random_bool(0.5) {
                    let len = [512u64, 4096, 65536, 131072, 98304 + 512][rng.random_range(0..5)];
                    (rng.random_range(0..size / 512) * 512, len)
                } else {
                    (rng.random_range(0..size), rng.random_range(1..150_000))
                };
                let len = len.min(size - off).max(1);
                let off = off.min(size - len);
                let byte = if rng.random_bool(0.1) {
                    0
                } else {
                    rng.random_range(1..=255u8)
                };
                ops.push(Op::Write { off, len, byte });
            }
            if g < groups {
                ops.push(Op::Flush);
            }
        }
        CrashWorkload { size, ops }
    }

    /// What qemu-io's `length` prints for this disk.
    pub fn marker(&self) -> String {
        assert_eq!(self.size % (1 << 20), 0, "size must be whole MiB");
        format!("{} MiB", self.size >> 20)
    }

    /// The qemu-io commands, one `-c` each.
    pub fn commands(&self) -> Vec<String> {
        let mut out = Vec::new();
        for op in &self.ops {
            match *op {
                Op::Write { off, len, byte: 0 } => out.push(format!("write -z {off} {len}")),
                Op::Write { off, len, byte } => out.push(format!("write -P {byte} {off} {len}")),
                Op::Flush => {
                    out.push("flush".into());
                    out.push("length".into());
                }
            }
        }
        out
    }

    /// The number of flushes qemu-io saw complete.
    pub fn confirmed_flushes(&self, lines: &[String]) -> usize {
        let marker = self.marker();
        let mut n = 0;
        for l in lines {
            if l.contains("failed") || l.contains("error") || l.contains("Error") {
                break;
            }
            if l.trim() == marker {
                n += 1;
            }
        }
        n
    }

    /// Index in `ops` just past the `flushes`-th flush.
    fn cut(&self, flushes: usize) -> usize {
        if flushes == 0 {
            return 0;
        }
        let mut seen = 0;
        for (i, op) in self.ops.iter().enumerate() {
            if matches!(op, Op::Flush) {
                seen += 1;
                if seen == flushes {
                    return i + 1;
                }
            }
        }
        panic!("the workload has fewer than {flushes} flushes");
    }

    /// The content every reader must see for the first `flushes` flushes.
    pub fn durable(&self, base: &[u8], flushes: usize) -> Vec<u8> {
        let mut m = base.to_vec();
        for op in &self.ops[..self.cut(flushes)] {
            if let Op::Write { off, len, byte } = *op {
                m[off as usize..(off + len) as usize].fill(byte);
            }
        }
        m
    }

    /// The writes after the `flushes`-th flush: each may or may not have
    /// landed.
    pub fn unflushed(&self, flushes: usize) -> Vec<(u64, u64, u8)> {
        self.ops[self.cut(flushes)..]
            .iter()
            .filter_map(|op| match *op {
                Op::Write { off, len, byte } => Some((off, len, byte)),
                Op::Flush => None,
            })
            .collect()
    }

    /// Checks `actual` after a crash: flushed bytes exactly, every other
    /// byte either its flushed value or the value of an unflushed write
    /// covering it (old or new, never garbage).
    pub fn check(&self, what: &str, base: &[u8], flushes: usize, actual: &[u8]) {
        assert_eq!(actual.len() as u64, self.size, "{what}: size");
        let durable = self.durable(base, flushes);
        let later = self.unflushed(flushes);
        let mut ok: Vec<bool> = durable.iter().zip(actual).map(|(d, a)| d == a).collect();
        let mut touched = vec![false; actual.len()];
        for &(off, len, byte) in &later {
            for i in off as usize..(off + len) as usize {
                touched[i] = true;
                if actual[i] == byte {
                    ok[i] = true;
                }
            }
        }
        if let Some(i) = ok.iter().position(|&b| !b) {
            let bad = ok.iter().filter(|&&b| !b).count();
            let covering: Vec<_> = later
                .iter()
                .filter(|&&(o, l, _)| (o..o + l).contains(&(i as u64)))
                .collect();
            panic!(
                "{what}: byte {i} (0x{i:x}) reads {:#04x}; the data flushed before the crash \
                 ({flushes} flushes confirmed) is {:#04x}{}; {bad} bad bytes in total. \
                 Unflushed writes covering it (off, len, byte): {covering:?}",
                actual[i],
                durable[i],
                if touched[i] {
                    " (an unflushed write may also have landed there)"
                } else {
                    " and no later write touched it: flushed data was lost or corrupted"
                }
            );
        }
    }
}
