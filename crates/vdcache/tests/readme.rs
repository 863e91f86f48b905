//! Every shell command in the README runs, in order, and succeeds.
//!
//! The README's ```sh blocks are joined into one bash script (`set -e`,
//! `pipefail`), so a walkthrough's later commands see what its earlier ones
//! made, and run against a scratch directory: `/tmp/vdcache-try` is a
//! directory of the test's, `HOME` is another, the metrics port is a free
//! one, and `vdcache` is the binary under test (also for `cargo run ... --`).
//! A few commands are not run, each for a reason printed here: the full
//! suite (this test is part of it), installing system packages, building
//! the project again, and starting a VM. Everything else must pass.

use crate::common;

use common::Scratch;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Commands the test does not run, by how their line starts, and why.
const NOT_RUN: [(&str, &str); 5] = [
    (
        "./scripts/test-all.sh",
        "runs the whole suite, of which this test is part",
    ),
    ("sudo apt-get", "installs system packages"),
    (
        "cargo install",
        "builds a second copy of the project (the test runs the binary cargo test built)",
    ),
    (
        "cargo build",
        "builds the project (the test runs the binary cargo test built)",
    ),
    (
        "qemu-system-x86_64",
        "boots a virtual machine (needs a guest image and KVM); qemu-io attaches the same way above it",
    ),
];

fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    std::fs::read_to_string(&path).expect("read README.md")
}

/// The README's ```sh blocks, in order.
fn shell_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match &mut current {
            None if line.trim_start() == "```sh" => current = Some(String::new()),
            Some(b) if line.trim_start() == "```" => {
                blocks.push(std::mem::take(b));
                current = None;
            }
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            None => {}
        }
    }
    assert!(
        current.is_none(),
        "a ```sh block of the README is not closed"
    );
    blocks
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn installed(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The script the README's blocks make, with the commands not run
/// replaced by a note, and the skipped commands with their reasons.
fn script(blocks: &[String], try_dir: &Path, port: u16) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut skipped = Vec::new();
    for block in blocks {
        for line in block.lines() {
            let t = line.trim_start();
            let reason = NOT_RUN
                .iter()
                .find(|(start, _)| t.starts_with(start))
                .map(|(_, why)| (*why).to_string())
                .or_else(|| {
                    // A client tool this machine lacks (curl is not one of
                    // the suite's dependencies): said, not failed.
                    (t.starts_with("curl ") && !installed("curl"))
                        .then(|| "curl is not installed".to_string())
                });
            match reason {
                Some(why) => {
                    assert!(
                        !line.trim_end().ends_with('\\'),
                        "a command not run must fit on one line: {line}"
                    );
                    skipped.push(format!("{t}  ({why})"));
                    out.push_str(": not run\n");
                }
                None => {
                    let line = line
                        .replace("cargo run --release -p vdcache --", "vdcache")
                        .replace("/tmp/vdcache-try", &try_dir.display().to_string())
                        .replace("127.0.0.1:9187", &format!("127.0.0.1:{port}"));
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
    }
    (out, skipped)
}

#[test]
fn every_readme_command_runs() {
    let s = Scratch::new();
    let blocks = shell_blocks(&readme());
    assert!(
        blocks.len() >= 8,
        "the README has {} sh blocks",
        blocks.len()
    );
    let try_dir = s.root().join("try");
    let home = s.root().join("home");
    std::fs::create_dir_all(&home).expect("mkdir home");
    let (body, skipped) = script(&blocks, &try_dir, free_port());
    for line in &skipped {
        eprintln!("README command not run: {line}");
    }
    assert!(skipped.len() <= NOT_RUN.len() + 1, "{skipped:?}");
    let bin = Path::new(env!("CARGO_BIN_EXE_vdcache"));
    let path = format!(
        "{}:{}",
        bin.parent().expect("binary dir").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let script_path = s.root().join("readme.sh");
    std::fs::write(
        &script_path,
        format!("set -euo pipefail -x\n{body}\necho README-DONE\n"),
    )
    .expect("write script");
    let out = common::exec_within(
        s.cmd("bash")
            .arg(&script_path)
            .env("HOME", &home)
            .env("PATH", path)
            .env_remove("RUST_LOG"),
        Duration::from_secs(240),
    )
    .unwrap_or_else(|e| panic!("the README's commands hung: {e}"));
    assert!(
        out.success() && out.stdout.contains("README-DONE"),
        "a README command failed\n{}",
        out.report()
    );
    // What the walkthrough promises it shows.
    let all = out.all();
    for said in [
        "demo passed",
        "formatted (new cache file of 256 MiB)",
        "fast-recovered",
        "stopped cleanly",
        "EXPORT",
        "vdcache_cache_read_hit_blocks_total",
        "written back",
        "No errors were found on the image.",
    ] {
        if said.starts_with("vdcache_cache") && !installed("curl") {
            continue;
        }
        assert!(
            all.contains(said),
            "the README run never said '{said}'\n{}",
            out.report()
        );
    }
    assert!(
        home.join(".local/share/man/man1/vdcache-serve.1").exists(),
        "man pages were not written"
    );
    assert!(
        !try_dir.exists(),
        "the README's clean-up left {}",
        try_dir.display()
    );
    s.finish();
}
