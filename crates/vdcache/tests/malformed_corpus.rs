//! The malformed corpus (tests/data/malformed): every image, every command.
//!
//! MANIFEST.toml says what is wrong with each image and what each command
//! must do; this file checks it. Each vdcache command runs on a copy of the
//! image under a 1 GiB address-space limit (`prlimit --as`, so a table
//! sized by an unchecked field cannot be allocated) and a timeout; it must
//! not panic, die from a signal or hang, must answer as the manifest says
//! (an error naming the field), and must leave the file unchanged (serve:
//! except the corrupt bit where the manifest expects it). QEMU's own tools
//! confirm each image is really malformed, and `vdcache check -r all` is
//! compared with what `qemu-img check` finds afterwards.
//!
//! The whole corpus runs in one test that lists every failing (image,
//! command) pair at the end, so one run shows everything that is wrong.
//! `VDCACHE_CORPUS_ONLY=substring` limits the runs to matching images.

use crate::common;
use crate::malformed_gen;
use crate::qcow2_patch;
use crate::serving;

use common::{Out, Scratch, exec_within};
use qcow2_patch::{INCOMPAT_CORRUPT, INCOMPATIBLE_FEATURES, OUTSIDE, names_problem};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The address-space limit of every vdcache command.
const MEMORY_LIMIT: u64 = 1 << 30;
/// How long one command may run before it is killed (a failure).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// Images run in parallel (the machine has 2 cores).
const WORKERS: usize = 2;
/// At least this many images, and at most this many bytes in all.
const MIN_IMAGES: usize = 30;
const MAX_CORPUS_BYTES: u64 = 2 << 20;
/// Images the corpus must hold: metadata that overlaps other metadata or
/// points into the header, unaligned and past-the-end entries.
const REQUIRED: &[&str] = &[
    "l2_entry_on_l1.qcow2",
    "l2_entry_into_header.qcow2",
    "l2_entry_on_refcount_table.qcow2",
    "l2_entry_on_refcount_block.qcow2",
    "refcount_block_on_l1.qcow2",
    "refcount_block_offset_zero.qcow2",
    "l1_entry_on_l1.qcow2",
    "l1_entry_into_header.qcow2",
    "snapshot_table_on_l1.qcow2",
    "l2_entry_unaligned.qcow2",
    "l2_entry_past_eof.qcow2",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    image: Vec<Entry>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
enum Open {
    Refused,
    Ok,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
enum Outcome {
    Ok,
    Fails,
    Any,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
enum Serve {
    Starts,
    Any,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
enum Repair {
    Repaired,
    Honest,
}

/// One image of the manifest (see the comment at its top).
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
struct Entry {
    file: String,
    class: String,
    wrong: String,
    qemu: String,
    open: Open,
    words: Vec<Vec<String>>,
    check_words: Option<Vec<Vec<String>>>,
    info: Option<Outcome>,
    check: Option<i32>,
    read: Option<Outcome>,
    convert: Option<Outcome>,
    serve: Option<Serve>,
    #[serde(default)]
    ops: Vec<String>,
    corrupt_bit: Option<bool>,
    repair: Option<Repair>,
    #[serde(default)]
    companions: Vec<String>,
    secret: Option<String>,
    /// Not in the manifest: serve may rewrite the image (the unpatched
    /// bitmap base: a server marks persistent bitmaps in use, as QEMU
    /// does); qemu-img check must then still pass.
    #[serde(skip)]
    serve_rewrites: bool,
}

/// What each command must do, resolved from an entry.
struct Want {
    info: Outcome,
    check: i32,
    read: Outcome,
    convert: Outcome,
    /// None: serve must refuse.
    serve: Option<Serve>,
    ops: Vec<(String, Outcome)>,
    corrupt_bit: bool,
}

impl Entry {
    fn want(&self) -> Result<Want, String> {
        let ctx = |what: &str| format!("{}: {what}", self.file);
        match self.open {
            Open::Refused => {
                let extra = self.info.is_some()
                    || self.check.is_some()
                    || self.read.is_some()
                    || self.convert.is_some()
                    || self.serve.is_some()
                    || !self.ops.is_empty()
                    || self.corrupt_bit.is_some()
                    || self.repair.is_some();
                if extra {
                    return Err(ctx("open = \"refused\" takes no per-command fields"));
                }
                Ok(Want {
                    info: Outcome::Fails,
                    check: 1,
                    read: Outcome::Fails,
                    convert: Outcome::Fails,
                    serve: None,
                    ops: Vec::new(),
                    corrupt_bit: false,
                })
            }
            Open::Ok => {
                let mut ops = Vec::new();
                for op in &self.ops {
                    let (cmd, want) = op
                        .split_once("=>")
                        .ok_or_else(|| ctx(&format!("op '{op}' has no '=>'")))?;
                    let want = match want.trim() {
                        "ok" => Outcome::Ok,
                        "fails" => Outcome::Fails,
                        "any" => Outcome::Any,
                        other => return Err(ctx(&format!("op outcome '{other}'"))),
                    };
                    ops.push((cmd.trim().to_string(), want));
                }
                Ok(Want {
                    info: self.info.ok_or_else(|| ctx("info missing"))?,
                    check: self.check.ok_or_else(|| ctx("check missing"))?,
                    read: self.read.ok_or_else(|| ctx("read missing"))?,
                    convert: self.convert.ok_or_else(|| ctx("convert missing"))?,
                    serve: Some(self.serve.ok_or_else(|| ctx("serve missing"))?),
                    ops,
                    corrupt_bit: self.corrupt_bit.ok_or_else(|| ctx("corrupt_bit missing"))?,
                })
            }
        }
    }

    fn words(&self) -> Vec<Vec<String>> {
        expand(&self.words)
    }

    fn check_words(&self) -> Vec<Vec<String>> {
        expand(self.check_words.as_ref().unwrap_or(&self.words))
    }
}

/// Replaces "@outside" in word groups by the OUTSIDE words.
fn expand(groups: &[Vec<String>]) -> Vec<Vec<String>> {
    groups
        .iter()
        .map(|g| {
            g.iter()
                .flat_map(|w| {
                    if w == "@outside" {
                        OUTSIDE.iter().map(|s| s.to_string()).collect()
                    } else {
                        vec![w.clone()]
                    }
                })
                .collect()
        })
        .collect()
}

fn named(text: &str, groups: &[Vec<String>]) -> bool {
    let g: Vec<Vec<&str>> = groups
        .iter()
        .map(|g| g.iter().map(String::as_str).collect())
        .collect();
    let g: Vec<&[&str]> = g.iter().map(Vec::as_slice).collect();
    names_problem(text, &g)
}

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/malformed")
}

fn manifest() -> Vec<Entry> {
    let path = corpus_dir().join("MANIFEST.toml");
    let text = std::fs::read_to_string(&path).expect("read MANIFEST.toml");
    let m: Manifest = toml::from_str(&text).unwrap_or_else(|e| panic!("MANIFEST.toml: {e}"));
    for e in &m.image {
        if let Err(err) = e.want() {
            panic!("MANIFEST.toml: {err}");
        }
        assert!(
            !e.class.is_empty() && !e.wrong.is_empty() && !e.words.is_empty(),
            "MANIFEST.toml: {} needs class, wrong and words",
            e.file
        );
    }
    m.image
}

/// The entries selected by VDCACHE_CORPUS_ONLY (all by default).
fn selected(all: Vec<Entry>) -> Vec<Entry> {
    match std::env::var("VDCACHE_CORPUS_ONLY") {
        Ok(only) => all.into_iter().filter(|e| e.file.contains(&only)).collect(),
        Err(_) => all,
    }
}

/// `prlimit --as=1GiB -- PROGRAM`.
fn limited(s: &Scratch, program: &str) -> Command {
    let mut c = s.cmd("prlimit");
    c.arg(format!("--as={MEMORY_LIMIT}")).arg("--").arg(program);
    c
}

/// `prlimit --as=1GiB -- vdcache`.
fn vdcache_limited(s: &Scratch) -> Command {
    limited(s, env!("CARGO_BIN_EXE_vdcache"))
}

/// Why a vdcache run crashed (panic, signal, abort on allocation), if it did.
fn crashed(o: &Out) -> Option<String> {
    let all = o.all();
    if all.contains("panicked") {
        return Some("panicked".into());
    }
    if all.contains("memory allocation of") {
        return Some("aborted: an allocation above the memory limit".into());
    }
    match o.code() {
        None => Some(format!("killed by a signal ({})", o.status)),
        Some(101) => Some("exit 101 (Rust panic)".into()),
        Some(_) => None,
    }
}

/// Compares a command's result with what it must do.
fn judge(o: &Out, want: Outcome, groups: &[Vec<String>]) -> Result<(), String> {
    if let Some(c) = crashed(o) {
        return Err(c);
    }
    let failed_named = o.code() == Some(1) && named(&o.all(), groups);
    match want {
        Outcome::Ok if o.success() => Ok(()),
        Outcome::Ok => Err(format!("must succeed, exit {}", o.status)),
        Outcome::Fails if failed_named => Ok(()),
        Outcome::Any if o.success() || failed_named => Ok(()),
        Outcome::Fails | Outcome::Any if o.code() == Some(1) => {
            Err(format!("the error does not name the problem ({groups:?})"))
        }
        Outcome::Fails => Err(format!(
            "must fail (exit 1) naming the problem, exit {}",
            o.status
        )),
        Outcome::Any => Err(format!(
            "must succeed or fail with exit 1, exit {}",
            o.status
        )),
    }
}

/// The last lines of what a command printed, for the failure list.
fn excerpt(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.contains("ops/sec"))
        .collect();
    let start = lines.len().saturating_sub(3);
    let s = lines[start..].join(" | ");
    if s.len() > 400 {
        let mut i = 400;
        while !s.is_char_boundary(i) {
            i += 1;
        }
        format!("{}...", &s[..i])
    } else {
        s
    }
}

/// Failures of one image, as (command, what happened).
#[derive(Default)]
struct Failures(Vec<(String, String)>);

impl Failures {
    fn add(&mut self, cmd: &str, what: impl Into<String>) {
        self.0.push((cmd.to_string(), what.into()));
    }
}

/// The corpus images' bytes, by file name.
fn corpus_bytes() -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    for entry in std::fs::read_dir(corpus_dir()).expect("read corpus dir") {
        let entry = entry.expect("dir entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".qcow2") {
            m.insert(name, std::fs::read(entry.path()).expect("read image"));
        }
    }
    m
}

/// Copies the image (and its companions) into the scratch directory.
fn stage(s: &Scratch, e: &Entry, corpus: &BTreeMap<String, Vec<u8>>) -> (PathBuf, Vec<u8>) {
    for f in std::iter::once(&e.file).chain(&e.companions) {
        let b = corpus
            .get(f)
            .unwrap_or_else(|| panic!("{f} is not in the corpus"));
        std::fs::write(s.path(f), b).expect("stage image");
    }
    (s.path(&e.file), corpus[&e.file].clone())
}

/// The image with the corrupt bit cleared (v3 headers only).
fn mask_corrupt(b: &[u8]) -> Vec<u8> {
    let mut m = b.to_vec();
    if m.len() >= INCOMPATIBLE_FEATURES + 8 && common::be32(&m, 4) >= 3 {
        m[INCOMPATIBLE_FEATURES + 7] &= !(INCOMPAT_CORRUPT as u8);
    }
    m
}

/// What serving changed beyond what it may: the corrupt bit, and the cache
/// mark a server with a cache stamps into the header (its extension and
/// feature names, the bits that go with it, and where the extension area
/// and the backing file name lie in the first cluster). Everything after
/// the first cluster, and every other header field, must be unchanged.
fn changed_beyond_marks(before: &[u8], after: &[u8]) -> Option<String> {
    use vdcache_qcow2::Header;
    use vdcache_qcow2::features::{autoclear, incompatible};
    if mask_corrupt(before) == mask_corrupt(after) {
        return None;
    }
    let what = || {
        Some(format!(
            "MODIFIED the image beyond the corrupt bit and cache mark: {}",
            difference(before, after)
        ))
    };
    let (Ok(mut a), Ok(mut b)) = (Header::parse(before), Header::parse(after)) else {
        return what();
    };
    let cs = a.cluster_size() as usize;
    if before.len() != after.len() || before.get(cs..) != after.get(cs..) {
        return what();
    }
    for h in [&mut a, &mut b] {
        h.incompatible_features &= !(incompatible::CORRUPT | incompatible::IN_CACHE);
        h.autoclear_features &= !autoclear::CACHE_COHERENT;
        h.header_length = 0;
        h.backing_file_offset = 0;
        h.unknown_fields.clear();
        h.extensions.cache_mark = None;
        h.extensions.feature_names.clear();
    }
    if a != b {
        return what();
    }
    None
}

fn corrupt_bit_set(b: &[u8]) -> bool {
    b.len() >= INCOMPATIBLE_FEATURES + 8
        && common::be32(b, 4) >= 3
        && common::be64(b, INCOMPATIBLE_FEATURES) & INCOMPAT_CORRUPT != 0
}

/// One image being put through the commands, and what went wrong so far.
struct Run<'a> {
    s: &'a Scratch,
    e: &'a Entry,
    img: PathBuf,
    orig: Vec<u8>,
    f: Failures,
}

impl Run<'_> {
    /// The image must be byte for byte what it was.
    fn unchanged(&mut self, cmd: &str) {
        match std::fs::read(&self.img) {
            Ok(now) if now == self.orig => {}
            Ok(now) => {
                let what = format!("MODIFIED the image: {}", difference(&self.orig, &now));
                self.f.add(cmd, what);
                // Later commands start from the original again.
                std::fs::write(&self.img, &self.orig).expect("restore image");
            }
            Err(e) => self.f.add(cmd, format!("image unreadable afterwards: {e}")),
        }
    }

    fn leaks_secret(&mut self, label: &str, text: &str) {
        if let Some(secret) = &self.e.secret
            && text.contains(secret.as_str())
        {
            let what = format!("printed the host file's content ('{secret}')");
            self.f.add(label, what);
        }
    }

    /// Runs `vdcache ARGS IMAGE [EXTRA]` (limited); None if it timed out.
    fn vdcache(&mut self, label: &str, args: &[&str], extra: Option<&Path>) -> Option<Out> {
        let mut c = vdcache_limited(self.s);
        c.args(args).arg(&self.img);
        if let Some(x) = extra {
            c.arg(x);
        }
        match exec_within(&mut c, COMMAND_TIMEOUT) {
            Err(t) => {
                self.f.add(label, excerpt(&t));
                None
            }
            Ok(o) => {
                self.leaks_secret(label, &o.all());
                Some(o)
            }
        }
    }

    /// A command that must answer `want`, naming the problem with `words`.
    fn cli(&mut self, label: &str, args: &[&str], want: Outcome) {
        if let Some(o) = self.vdcache(label, args, None)
            && let Err(why) = judge(&o, want, &self.e.words())
        {
            self.f.add(label, format!("{why}: {}", excerpt(&o.all())));
        }
        self.unchanged(label);
    }

    fn check(&mut self, want: i32) {
        let label = "check";
        let words = self.e.check_words();
        if let Some(o) = self.vdcache(label, &["check"], None) {
            let why = if let Some(c) = crashed(&o) {
                Some(c)
            } else if o.code() != Some(want) {
                Some(format!("exit {} (want {want})", o.status))
            } else if want != 0 && !named(&o.all(), &words) {
                Some(format!("does not name the problem ({words:?})"))
            } else {
                None
            };
            if let Some(why) = why {
                self.f.add(label, format!("{why}: {}", excerpt(&o.all())));
            }
        }
        self.unchanged(label);
    }

    fn convert(&mut self, want: Outcome) {
        let label = "convert -O raw";
        let dst = self.s.path("converted.raw");
        if let Some(o) = self.vdcache(label, &["convert", "-O", "raw"], Some(&dst))
            && let Err(why) = judge(&o, want, &self.e.words())
        {
            self.f.add(label, format!("{why}: {}", excerpt(&o.all())));
        }
        if let (Some(secret), Ok(out)) = (&self.e.secret, std::fs::read(&dst))
            && out.windows(secret.len()).any(|w| w == secret.as_bytes())
        {
            self.f
                .add(label, "copied the host file's content into the output");
        }
        let _ = std::fs::remove_file(&dst);
        self.unchanged(label);
    }

    /// `vdcache serve` with a cache on a Unix socket, the ops over NBD, a
    /// clean stop, then the image's bytes.
    fn serve(&mut self, w: &Want) {
        let label = "serve";
        let socket = self.s.path("nbd.sock");
        let cache = self.s.path("cache.img");
        let mut cmd = vdcache_limited(self.s);
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--cache")
            .arg(&cache)
            .args(["--cache-size", "16M"])
            .arg(&self.img);
        let words = self.e.words();
        let mut p = match serving::try_start(self.s, cmd, &socket) {
            Ok(p) => p,
            Err((st, log)) => {
                let why =
                    if log.contains("panicked") || st.code().is_none() || st.code() == Some(101) {
                        Some(format!("crashed at start ({st})"))
                    } else if w.serve == Some(Serve::Starts) {
                        Some(format!("must start serving, exited {st}"))
                    } else if st.code() != Some(1) || !named(&log, &words) {
                        Some(format!(
                            "refused ({st}) without naming the problem ({words:?})"
                        ))
                    } else {
                        None
                    };
                if let Some(why) = why {
                    self.f.add(label, format!("{why}: {}", excerpt(&log)));
                }
                self.leaks_secret(label, &log);
                self.unchanged(label);
                return;
            }
        };
        if w.serve.is_none() {
            self.f
                .add(label, "started serving an image that must be refused");
        }
        let uri = serving::uri(&socket, "");
        let mut any_failed = false;
        for (op, want) in &w.ops {
            let mut c = self.s.qemu_io();
            c.args(["-f", "raw", "-c", op]).arg(&uri);
            let what = format!("serve: qemu-io -c '{op}'");
            match exec_within(&mut c, COMMAND_TIMEOUT) {
                Err(t) => self.f.add(&what, excerpt(&t)),
                Ok(o) => {
                    let failed = !o.success() || o.all().contains("failed");
                    any_failed |= failed;
                    let why = match (want, failed) {
                        (Outcome::Ok, true) => "must succeed",
                        (Outcome::Fails, false) => "must fail (nothing may land on metadata)",
                        _ => continue,
                    };
                    self.f.add(&what, format!("{why}: {}", excerpt(&o.all())));
                }
            }
        }
        if let Some(st) = p.exited() {
            let what = format!(
                "the server died during the ops ({st}): {}",
                excerpt(&p.log_text())
            );
            self.f.add(label, what);
        } else {
            let (st, log) = p.terminate();
            if !st.success() || log.contains("panicked") {
                let what = format!("did not stop cleanly on SIGTERM ({st}): {}", excerpt(&log));
                self.f.add(label, what);
            }
            if any_failed && !named(&log, &words) {
                let what = format!(
                    "an NBD request failed but the server's log does not name the problem ({words:?}): {}",
                    excerpt(&log)
                );
                self.f.add(label, what);
            }
            self.leaks_secret(label, &log);
        }
        self.after_serve(w);
    }

    /// The image after serving: unchanged but for the corrupt bit, which
    /// is set exactly when the manifest says so.
    fn after_serve(&mut self, w: &Want) {
        let label = "serve";
        let now = std::fs::read(&self.img).expect("read image after serve");
        let set = corrupt_bit_set(&now);
        if self.e.serve_rewrites {
            let mut q = self.s.qemu_img();
            q.arg("check").arg(&self.img);
            match exec_within(&mut q, COMMAND_TIMEOUT) {
                Ok(o) if o.success() => {}
                Ok(o) => self.f.add(
                    label,
                    format!("left an image qemu-img check flags: {}", excerpt(&o.all())),
                ),
                Err(t) => self.f.add(label, excerpt(&t)),
            }
        } else if let Some(what) = changed_beyond_marks(&self.orig, &now) {
            self.f.add(label, what);
        }
        if set && !w.corrupt_bit {
            self.f.add(label, "set the corrupt bit");
        }
        if !set && w.corrupt_bit {
            self.f.add(label, "did not set the corrupt bit");
        }
    }
}

/// Sizes and the first differing offset of two versions of a file.
fn difference(before: &[u8], after: &[u8]) -> String {
    let first = before.iter().zip(after).position(|(a, b)| a != b);
    format!(
        "{} -> {} bytes, first difference at {}",
        before.len(),
        after.len(),
        first.map_or("the end".to_string(), |i| format!("{i:#x}"))
    )
}

/// Every command on one image; returns what went wrong.
fn run_image(e: &Entry, corpus: &BTreeMap<String, Vec<u8>>) -> Failures {
    let w = match e.want() {
        Ok(w) => w,
        Err(err) => {
            let mut f = Failures::default();
            f.add("manifest", err);
            return f;
        }
    };
    let s = Scratch::new();
    let (img, orig) = stage(&s, e, corpus);
    let mut r = Run {
        s: &s,
        e,
        img,
        orig,
        f: Failures::default(),
    };
    r.cli("info", &["info"], w.info);
    r.cli("info --json", &["info", "--json"], w.info);
    r.check(w.check);
    r.cli(
        "io -r -c 'read 0 64k'",
        &["io", "-r", "-c", "read 0 64k"],
        w.read,
    );
    r.convert(w.convert);
    r.serve(&w);
    let f = r.f;
    s.finish();
    f
}

/// Runs `job` on every entry, WORKERS at a time; a panic inside a job is
/// a failure of that entry.
fn for_each_image(
    entries: &[Entry],
    job: impl Fn(&Entry) -> Failures + Sync,
) -> Vec<(String, Failures)> {
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        for _ in 0..WORKERS {
            sc.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(e) = entries.get(i) else { break };
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(e)));
                    let f = r.unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        let mut f = Failures::default();
                        f.add("harness", format!("panicked: {}", excerpt(&msg)));
                        f
                    });
                    results.lock().expect("results").push((e.file.clone(), f));
                }
            });
        }
    });
    let mut r = results.into_inner().expect("results");
    r.sort_by(|a, b| a.0.cmp(&b.0));
    r
}

/// Fails with every (image, command, what happened) at once.
fn report(what: &str, results: Vec<(String, Failures)>) {
    let mut lines = Vec::new();
    let mut images = 0;
    for (file, f) in &results {
        if f.0.is_empty() {
            continue;
        }
        images += 1;
        for (cmd, why) in &f.0 {
            lines.push(format!("{file} | {cmd} | {why}"));
        }
    }
    assert!(
        lines.is_empty(),
        "{what}: {} failures on {images} of {} images (image | command | what happened):\n{}",
        lines.len(),
        results.len(),
        lines.join("\n")
    );
}

#[test]
fn every_command_on_every_image() {
    let entries = selected(manifest());
    let corpus = corpus_bytes();
    let results = for_each_image(&entries, |e| run_image(e, &corpus));
    report("vdcache on the malformed corpus", results);
}

/// QEMU confirms each image is malformed as the manifest says.
#[test]
fn qemu_agrees_every_image_is_malformed() {
    let entries = selected(manifest());
    let corpus = corpus_bytes();
    let results = for_each_image(&entries, |e| {
        let mut f = Failures::default();
        let s = Scratch::new();
        let (img, _) = stage(&s, e, &corpus);
        let mut c = s.qemu_img();
        c.args(["info", "--backing-chain"]).arg(&img);
        let info = exec_within(&mut c, COMMAND_TIMEOUT);
        let verdict = match info {
            Err(t) => format!("qemu-img info hung: {}", excerpt(&t)),
            Ok(o) if !o.success() => "refuses".to_string(),
            Ok(_) => {
                let mut c = s.qemu_img();
                c.arg("check").arg(&img);
                match exec_within(&mut c, COMMAND_TIMEOUT) {
                    Err(t) => format!("qemu-img check hung: {}", excerpt(&t)),
                    Ok(o) => format!("check {}", o.code().unwrap_or(-1)),
                }
            }
        };
        if verdict != e.qemu {
            f.add(
                "qemu",
                format!("QEMU says '{verdict}', the manifest '{}'", e.qemu),
            );
        }
        s.finish();
        f
    });
    report("QEMU's verdicts", results);
}

/// `vdcache check -r all` repairs what QEMU repairs, tells the truth about
/// what it leaves, and keeps the guest's data.
#[test]
fn repair_matches_qemu() {
    let entries: Vec<Entry> = selected(manifest())
        .into_iter()
        .filter(|e| e.repair.is_some())
        .collect();
    assert!(!entries.is_empty() || std::env::var("VDCACHE_CORPUS_ONLY").is_ok());
    let corpus = corpus_bytes();
    let results = for_each_image(&entries, |e| {
        let mut f = Failures::default();
        let s = Scratch::new();
        let (img, orig) = stage(&s, e, &corpus);
        let reference = s.path("original.qcow2");
        std::fs::write(&reference, &orig).expect("write reference");
        let label = "check -r all";
        let mut c = vdcache_limited(&s);
        c.args(["check", "-r", "all"]).arg(&img);
        let code = match exec_within(&mut c, COMMAND_TIMEOUT) {
            Err(t) => {
                f.add(label, excerpt(&t));
                return f;
            }
            Ok(o) => {
                if let Some(c) = crashed(&o) {
                    f.add(label, format!("{c}: {}", excerpt(&o.all())));
                }
                (o.code(), excerpt(&o.all()))
            }
        };
        let mut q = s.qemu_img();
        q.arg("check").arg(&img);
        let qo = exec_within(&mut q, COMMAND_TIMEOUT).expect("qemu-img check hung");
        match e.repair {
            Some(Repair::Repaired) if code.0 != Some(0) || qo.code() != Some(0) => f.add(
                label,
                format!(
                    "must repair: vdcache exit {:?} ({}), then qemu-img check exit {:?}: {}",
                    code.0,
                    code.1,
                    qo.code(),
                    excerpt(&qo.all())
                ),
            ),
            Some(Repair::Honest) if code.0 != qo.code() => f.add(
                label,
                format!(
                    "exit {:?} ({}) but qemu-img check then exits {:?}: {}",
                    code.0,
                    code.1,
                    qo.code(),
                    excerpt(&qo.all())
                ),
            ),
            _ => {}
        }
        let mut cmp = s.qemu_img();
        cmp.arg("compare").arg(&reference).arg(&img);
        let co = exec_within(&mut cmp, COMMAND_TIMEOUT).expect("qemu-img compare hung");
        if co.code() != Some(0) {
            f.add(
                label,
                format!(
                    "changed the guest's data: qemu-img compare: {}",
                    excerpt(&co.all())
                ),
            );
        }
        s.finish();
        f
    });
    report("vdcache check -r all", results);
}

/// The directory holds exactly the manifest's images, as the generator
/// names them, with the recorded SHA-256 sums, enough of them, small.
#[test]
fn corpus_matches_manifest() {
    let entries = manifest();
    let mut listed: Vec<&str> = entries.iter().map(|e| e.file.as_str()).collect();
    listed.sort_unstable();
    let before = listed.len();
    listed.dedup();
    assert_eq!(before, listed.len(), "an image is listed twice");
    let corpus = corpus_bytes();
    let files: Vec<&str> = corpus.keys().map(String::as_str).collect();
    assert_eq!(files, listed, "corpus files vs MANIFEST.toml");
    assert_eq!(malformed_gen::names(), listed, "generator vs MANIFEST.toml");
    assert!(listed.len() >= MIN_IMAGES, "only {} images", listed.len());
    for r in REQUIRED {
        assert!(listed.contains(r), "the corpus lacks {r}");
    }
    let total: u64 = corpus.values().map(|b| b.len() as u64).sum();
    assert!(
        total <= MAX_CORPUS_BYTES,
        "the corpus is {total} bytes (at most {MAX_CORPUS_BYTES})"
    );
    let s = Scratch::new();
    let mut c = s.cmd("sha256sum");
    c.args(["--check", "--strict", "SHA256SUMS"])
        .current_dir(corpus_dir());
    let o = common::exec(&mut c);
    assert!(
        o.success(),
        "the corpus differs from SHA256SUMS\n{}",
        o.report()
    );
    let sums = std::fs::read_to_string(corpus_dir().join("SHA256SUMS")).expect("read sums");
    assert_eq!(sums.lines().count(), listed.len(), "SHA256SUMS lines");
    for e in &entries {
        for c in &e.companions {
            assert!(corpus.contains_key(c), "{}: companion {c} missing", e.file);
        }
    }
    s.finish();
}

/// The committed images are exactly what the generator makes (with the
/// QEMU installed here: if a new QEMU lays images out differently, check
/// the manifest still holds and regenerate).
#[test]
fn generator_reproduces_corpus() {
    let s = Scratch::new();
    let dir = s.path("generated");
    std::fs::create_dir(&dir).expect("mkdir");
    malformed_gen::generate(&s, &dir);
    let corpus = corpus_bytes();
    let mut differ = Vec::new();
    for (name, committed) in &corpus {
        match std::fs::read(dir.join(name)) {
            Ok(b) if &b == committed => {}
            Ok(b) => differ.push(format!("{name}: {}", difference(committed, &b))),
            Err(e) => differ.push(format!("{name}: not generated ({e})")),
        }
    }
    assert!(
        differ.is_empty(),
        "the generator no longer makes the committed corpus (regenerate with \
         `cargo test --release -p vdcache --test integration -- --ignored regenerate_corpus`):\n{}",
        differ.join("\n")
    );
    s.finish();
}

/// The bases the corpus is made from, unpatched, are accepted by every
/// command (so the refusals above are about the patches, and the harness
/// can tell success from failure).
#[test]
fn unpatched_bases_are_accepted() {
    let s = Scratch::new();
    let dir = s.path("bases");
    std::fs::create_dir(&dir).expect("mkdir");
    let names = malformed_gen::generate_bases(&s, &dir);
    let entries: Vec<Entry> = names
        .iter()
        .map(|n| Entry {
            file: n.to_string(),
            class: "valid".into(),
            wrong: "nothing".into(),
            qemu: "check 0".into(),
            open: Open::Ok,
            words: vec![vec!["(none)".into()]],
            check_words: None,
            info: Some(Outcome::Ok),
            check: Some(0),
            read: Some(Outcome::Ok),
            convert: Some(Outcome::Ok),
            serve: Some(Serve::Starts),
            ops: vec!["read 0 2k => ok".into()],
            corrupt_bit: Some(false),
            repair: None,
            companions: Vec::new(),
            secret: None,
            serve_rewrites: n.contains("bitmap"),
        })
        .collect();
    let mut bytes = BTreeMap::new();
    for n in &names {
        bytes.insert(
            n.to_string(),
            std::fs::read(dir.join(n)).expect("read base"),
        );
    }
    let results = for_each_image(&entries, |e| run_image(e, &bytes));
    s.finish();
    report("unpatched bases", results);
}

/// The limit really applies to the commands (1 GiB = 1048576 KiB).
#[test]
fn commands_run_under_the_memory_limit() {
    let s = Scratch::new();
    let mut c = limited(&s, "sh");
    c.args(["-c", "ulimit -v"]);
    let o = common::ok(&mut c);
    assert_eq!(o.stdout.trim(), (MEMORY_LIMIT >> 10).to_string());
    s.finish();
}

#[test]
#[ignore = "rewrites the committed corpus; run by hand after changing malformed_gen"]
fn regenerate_corpus() {
    let s = Scratch::new();
    let dir = corpus_dir();
    for old in corpus_bytes().keys() {
        std::fs::remove_file(dir.join(old)).expect("remove old image");
    }
    malformed_gen::generate(&s, &dir);
    let mut c = s.cmd("sh");
    c.args(["-c", "sha256sum -- *.qcow2 > SHA256SUMS"])
        .current_dir(&dir);
    common::ok(&mut c);
    s.finish();
}
