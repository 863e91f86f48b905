//! Checking one crash state: recover through the target, read the whole
//! guest disk and judge it against the guest model (invariants 1 and 2),
//! close cleanly, check the top image's structure (invariant 3: no
//! corruption; leaks counted), reopen the closed images without the target
//! and read them again (what recovery made durable must persist), and
//! optionally run the real `qemu-img check` on them.
//!
//! This module owns those steps. It must not modify the crash state it is
//! given, nor excuse any finding.

use crate::harness::ViolationKind;
use crate::model::{GuestHistory, PointView};
use crate::target::CrashTarget;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use vdcache_backend::recording::CrashState;
use vdcache_image::{ImageFormat, Layer, MemFiles, OpenOptions, VirtualDisk, open_chain};

#[derive(Debug, Clone, Copy)]
pub(crate) struct CheckOptions {
    pub(crate) reopen: bool,
    pub(crate) qemu_img: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) violations: Vec<ViolationKind>,
    pub(crate) leaks: usize,
    pub(crate) qemu_checked: bool,
}

fn read_all(disk: &VirtualDisk) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; disk.size() as usize];
    disk.read(0, &mut buf).map_err(|e| e.to_string())?;
    Ok(buf)
}

/// Every layer's file contents, top first.
fn layer_bytes(disk: &VirtualDisk) -> Result<Vec<(String, Vec<u8>)>, String> {
    disk.layers()
        .iter()
        .map(|l| {
            let b = &l.handle().backend;
            let len = b.len().map_err(|e| format!("{}: {e}", l.name()))?;
            let mut buf = vec![0u8; len as usize];
            b.read_at(&mut buf, 0)
                .map_err(|e| format!("{}: {e}", l.name()))?;
            Ok((l.name().to_string(), buf))
        })
        .collect()
}

pub(crate) fn check_state(
    target: &dyn CrashTarget,
    guest: &GuestHistory,
    state: &CrashState,
    view: &PointView,
    opts: CheckOptions,
) -> Outcome {
    let mut out = Outcome::default();
    let disk = match target.recover(state) {
        Ok(d) => d,
        Err(e) => {
            out.violations
                .push(ViolationKind::RecoveryFailed(e.to_string()));
            return out;
        }
    };
    if disk.size() != guest.model.size() {
        out.violations.push(ViolationKind::SizeChanged {
            expected: guest.model.size(),
            found: disk.size(),
        });
        return out;
    }
    let recovered = match read_all(&disk) {
        Ok(b) => b,
        Err(e) => {
            out.violations.push(ViolationKind::ReadFailed(e));
            return out;
        }
    };
    if let Some(m) = guest.check(&recovered, view) {
        out.violations.push(ViolationKind::Data(m));
    }
    if let Err(e) = disk.close() {
        out.violations
            .push(ViolationKind::CloseFailed(e.to_string()));
        return out;
    }
    if let Some(Layer::Qcow2(img)) = disk.layers().first() {
        match img.check() {
            Ok(r) => {
                out.leaks = r.leaks.len();
                if !r.corruptions.is_empty() {
                    out.violations
                        .push(ViolationKind::Corruption(r.corruptions));
                }
            }
            Err(e) => out
                .violations
                .push(ViolationKind::CheckFailed(e.to_string())),
        }
    }
    let layers = match layer_bytes(&disk) {
        Ok(l) => l,
        Err(e) => {
            out.violations.push(ViolationKind::ReopenFailed(e));
            return out;
        }
    };
    drop(disk);
    if opts.qemu_img {
        out.qemu_checked = true;
        match qemu_img_check(&layers) {
            Ok((Some(0 | 3), _)) => {}
            Ok((code, output)) => out.violations.push(ViolationKind::QemuImg { code, output }),
            Err(e) => out.violations.push(ViolationKind::QemuImg {
                code: None,
                output: format!("could not run qemu-img: {e}"),
            }),
        }
    }
    if opts.reopen
        && let Some(v) = reopen_and_compare(layers, &recovered)
    {
        out.violations.push(v);
    }
    out
}

/// Opens the closed images on their own (no target, read-only) and
/// compares the guest content with what recovery read.
fn reopen_and_compare(layers: Vec<(String, Vec<u8>)>, recovered: &[u8]) -> Option<ViolationKind> {
    let files = MemFiles::new();
    let top = layers.first()?.0.clone();
    for (name, bytes) in layers {
        files.insert(&name, bytes);
    }
    let disk = match open_chain(
        &top,
        &OpenOptions {
            read_only: true,
            format: Some(ImageFormat::Qcow2),
            opener: files,
            ..OpenOptions::default()
        },
    ) {
        Ok(d) => d,
        Err(e) => return Some(ViolationKind::ReopenFailed(e.to_string())),
    };
    match read_all(&disk) {
        Err(e) => Some(ViolationKind::ReopenFailed(e)),
        Ok(again) if again == recovered => None,
        Ok(again) => again
            .iter()
            .zip(recovered)
            .position(|(a, b)| a != b)
            .map(|d| ViolationKind::ReopenDiffers { offset: d as u64 }),
    }
}

/// A relative path that stays inside the temporary directory.
fn safe_path(name: &str) -> PathBuf {
    Path::new(name)
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s),
            _ => None,
        })
        .collect()
}

/// Writes the images to a temporary directory and runs `qemu-img check`
/// on the top one. Returns its exit code and output.
pub(crate) fn qemu_img_check(
    layers: &[(String, Vec<u8>)],
) -> std::io::Result<(Option<i32>, String)> {
    let dir = tempfile::tempdir()?;
    let mut top = None;
    for (name, bytes) in layers {
        let path = dir.path().join(safe_path(name));
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, bytes)?;
        top.get_or_insert(path);
    }
    let Some(top) = top else {
        return Ok((Some(0), String::new()));
    };
    let out = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&top)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.code(), text))
}
