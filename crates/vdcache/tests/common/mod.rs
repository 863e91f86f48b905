//! Shared helpers for the integration tests that run vdcache next to the
//! real qemu-img and qemu-io.
//!
//! Every test works in a [`Scratch`] directory. Child processes run with an
//! empty working directory (`<scratch>/cwd`) and `TMPDIR=<scratch>/tmp`, and
//! are given absolute paths, so a tool that resolves a name against its
//! working directory, or leaves a temporary file behind, is caught by
//! [`Scratch::finish`], which also looks for the test's file names in the
//! crate directory, the workspace root and the system temp directory.
//!
//! QEMU's tools are required: a missing `qemu-img` or `qemu-io` fails the
//! test (it never skips).

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long any one child process may run before the test fails.
pub const TIMEOUT: Duration = Duration::from_secs(120);

/// The result of one child process.
pub struct Out {
    pub desc: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// stdout and stderr together, for keyword searches.
    pub fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }

    pub fn report(&self) -> String {
        format!(
            "command: {}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.desc,
            self.status,
            tail(&self.stdout),
            tail(&self.stderr)
        )
    }
}

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(4000);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// A shell-like rendering of a command, for failure messages.
pub fn describe(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    for a in cmd.get_args() {
        let a = a.to_string_lossy();
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || "'\"$\\".contains(c)) {
            parts.push(format!("'{}'", a.replace('\'', "'\\''")));
        } else {
            parts.push(a.into_owned());
        }
    }
    let program = Path::new(&parts[0]);
    if program.file_name().is_some_and(|n| n == "vdcache") {
        parts[0] = "vdcache".to_string();
    }
    parts.join(" ")
}

/// Runs `cmd` to completion (or fails the test after [`TIMEOUT`]).
pub fn exec(cmd: &mut Command) -> Out {
    exec_within(cmd, TIMEOUT).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `cmd` to completion; after `limit` it is killed and the answer is
/// Err (saying so, with what it printed until then).
pub fn exec_within(cmd: &mut Command, limit: Duration) -> Result<Out, String> {
    let desc = describe(cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let prog = cmd.get_program().to_string_lossy().into_owned();
            panic!(
                "cannot run {prog}: {e}. These tests need the real QEMU tools \
                 (Debian package qemu-utils) and never skip without them."
            )
        }
    };
    let mut so = child.stdout.take().expect("piped stdout");
    let mut se = child.stderr.take().expect("piped stderr");
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                timed_out = true;
                match child.wait() {
                    Ok(st) => break st,
                    Err(e) => panic!("waiting for {desc}: {e}"),
                }
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("waiting for {desc}: {e}"),
        }
    };
    let stdout = String::from_utf8_lossy(&t_out.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&t_err.join().unwrap_or_default()).into_owned();
    let out = Out {
        desc,
        status,
        stdout,
        stderr,
    };
    if timed_out {
        return Err(format!(
            "timed out after {limit:?} (killed)\n{}",
            out.report()
        ));
    }
    if out.desc.starts_with("vdcache ") && !out.success() {
        assert_messages_read_well(&out.stderr, &out.desc);
    }
    Ok(out)
}

/// What is wrong with the error lines of a failed vdcache run, if anything:
/// a cause said twice, or a Rust `Debug` form (`Some(..)`, `Os { .. }`)
/// where words belong. Error lines are the final `vdcache: ...` line and
/// logged `ERROR` lines.
pub fn message_faults(stderr: &str) -> Vec<String> {
    let mut faults = Vec::new();
    for line in stderr.lines() {
        let is_error = line.starts_with("vdcache: ")
            || line.starts_with("vdcache check: ")
            || line.contains(" ERROR ");
        if !is_error {
            continue;
        }
        for debug in ["Some(", "None)", "{ ", "Os {", "kind: ", "Custom {"] {
            if line.contains(debug) {
                faults.push(format!("Debug form '{debug}' in: {line}"));
            }
        }
        let parts: Vec<&str> = line.split(": ").map(str::trim).collect();
        for (i, p) in parts.iter().enumerate() {
            if p.len() >= 8 && parts[i + 1..].contains(p) {
                faults.push(format!("'{p}' said twice in: {line}"));
            }
        }
    }
    faults
}

/// Fails the test if a failed vdcache run's error reads badly (see
/// [`message_faults`]); every failing run of the suite passes through it.
pub fn assert_messages_read_well(stderr: &str, desc: &str) {
    let faults = message_faults(stderr);
    assert!(
        faults.is_empty(),
        "{desc}: its error message repeats a cause or shows a Debug form:\n{}\n--- stderr ---\n{stderr}",
        faults.join("\n")
    );
}

/// Runs `cmd` and fails the test unless it exits 0.
pub fn ok(cmd: &mut Command) -> Out {
    let out = exec(cmd);
    assert!(out.success(), "command failed\n{}", out.report());
    out
}

/// Asserts a vdcache run did not panic or die from a signal.
pub fn assert_no_panic(out: &Out) {
    assert!(
        !out.stderr.contains("panicked") && !out.stdout.contains("panicked"),
        "vdcache panicked\n{}",
        out.report()
    );
    assert!(
        out.code().is_some(),
        "vdcache was killed by a signal\n{}",
        out.report()
    );
    assert_ne!(
        out.code(),
        Some(101),
        "vdcache exited 101 (Rust panic)\n{}",
        out.report()
    );
}

struct Baseline {
    dirs: Vec<(PathBuf, BTreeSet<String>)>,
}

fn list(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The directories a misbehaving tool could leave files in, listed once
/// per test process before any test has run a command.
fn baseline() -> &'static Baseline {
    static B: OnceLock<Baseline> = OnceLock::new();
    B.get_or_init(|| {
        let mut dirs = vec![manifest_dir()];
        if let Some(ws) = manifest_dir().parent().and_then(Path::parent) {
            dirs.push(ws.to_path_buf());
        }
        dirs.push(std::env::temp_dir());
        if let Ok(cwd) = std::env::current_dir() {
            dirs.push(cwd);
        }
        dirs.dedup();
        Baseline {
            dirs: dirs
                .into_iter()
                .map(|d| {
                    let l = list(&d);
                    (d, l)
                })
                .collect(),
        }
    })
}

/// A per-test directory; see the module comment.
pub struct Scratch {
    dir: tempfile::TempDir,
    names: Mutex<BTreeSet<String>>,
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

impl Scratch {
    pub fn new() -> Scratch {
        baseline();
        let dir = tempfile::Builder::new()
            .prefix("vdcache-it-")
            .tempdir()
            .expect("create temp dir");
        std::fs::create_dir(dir.path().join("cwd")).expect("mkdir cwd");
        std::fs::create_dir(dir.path().join("tmp")).expect("mkdir tmp");
        Scratch {
            dir,
            names: Mutex::new(BTreeSet::new()),
        }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// The absolute path of `rel` inside the scratch directory; the name is
    /// remembered for the leak check.
    pub fn path(&self, rel: &str) -> PathBuf {
        let mut names = self.names.lock().expect("names lock");
        for comp in Path::new(rel).components() {
            let c = comp.as_os_str().to_string_lossy().into_owned();
            if c.len() >= 4 {
                names.insert(c);
            }
        }
        self.root().join(rel)
    }

    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.current_dir(self.root().join("cwd"))
            .env("TMPDIR", self.root().join("tmp"));
        c
    }

    pub fn vdcache(&self) -> Command {
        self.cmd(env!("CARGO_BIN_EXE_vdcache"))
    }

    pub fn qemu_img(&self) -> Command {
        self.cmd("qemu-img")
    }

    pub fn qemu_io(&self) -> Command {
        self.cmd("qemu-io")
    }

    /// Fails the test if any tool left a file outside this scratch
    /// directory (or in its private cwd/tmp), then removes the directory.
    pub fn finish(self) {
        for sub in ["cwd", "tmp"] {
            let left = list(&self.root().join(sub));
            assert!(
                left.is_empty(),
                "files left in the working/TMPDIR directory of the child processes \
                 ({}): {left:?}",
                self.root().join(sub).display()
            );
        }
        let names = self.names.lock().expect("names lock").clone();
        let mine = self
            .root()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        for (dir, before) in &baseline().dirs {
            for entry in list(dir).difference(before) {
                if Some(entry) == mine.as_ref() || entry.starts_with("vdcache-it-") {
                    continue;
                }
                let named = names.iter().any(|n| entry.contains(n.as_str()));
                assert!(
                    !(named || *dir == manifest_dir()),
                    "a test left '{entry}' in {} (outside its temp dir {})",
                    dir.display(),
                    self.root().display()
                );
            }
        }
    }
}

/// Fails with the first difference between two byte strings.
pub fn assert_same_bytes(what: &str, expected: &[u8], actual: &[u8]) {
    if expected == actual {
        return;
    }
    let n = expected.len().min(actual.len());
    let first = (0..n).find(|&i| expected[i] != actual[i]);
    let differing = (0..n).filter(|&i| expected[i] != actual[i]).count();
    match first {
        Some(i) => {
            let end = (i + 16).min(n);
            panic!(
                "{what}: contents differ; first difference at byte {i} (0x{i:x}), {differing} \
                 differing bytes in total, lengths {} (expected) vs {} (actual)\n\
                 expected[{i}..{end}] = {:02x?}\nactual  [{i}..{end}] = {:02x?}",
                expected.len(),
                actual.len(),
                &expected[i..end],
                &actual[i..end]
            )
        }
        None => panic!(
            "{what}: lengths differ: {} (expected) vs {} (actual); the common prefix is equal",
            expected.len(),
            actual.len()
        ),
    }
}

/// Reads a big-endian u64 from `b` at `off`.
pub fn be64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(a)
}

/// Reads a big-endian u32 from `b` at `off`.
pub fn be32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_be_bytes(a)
}

pub fn put_be64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_be_bytes());
}

pub fn put_be32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}
