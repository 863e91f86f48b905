//! Checking one crash state: recover through the target, read the whole
//! guest disk and judge it against the guest model (invariants 1 and 2),
//! close cleanly, check the top image's structure (invariant 3: no
//! corruption; leaks counted), reopen the closed images without the target
//! and read them again (what recovery made durable must persist), and
//! optionally run the real `qemu-img check` on them. The stores, image
//! copies and reads live in buffers the worker reuses (`buffers`).
//!
//! This module owns those steps. It must not modify the crash state it is
//! given, nor excuse any finding.

use crate::buffers::Buffers;
use crate::harness::ViolationKind;
use crate::model::{GuestHistory, PointView};
use crate::target::CrashTarget;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
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

/// Every layer's file contents, top first.
type LayerBytes = Vec<(String, Vec<u8>)>;

fn read_all(disk: &VirtualDisk, bufs: &mut Buffers) -> Result<Vec<u8>, String> {
    // A read fills every byte it is given (zeros where nothing is mapped).
    let mut buf = bufs.for_overwrite(disk.size() as usize);
    match disk.read(0, &mut buf) {
        Ok(()) => Ok(buf),
        Err(e) => {
            bufs.give(buf);
            Err(e.to_string())
        }
    }
}

/// The closed layers' file contents, top first, taken out of `files`
/// (moved when the recovered disk, now dropped, held the last other
/// reference to a store; copied otherwise).
fn take_layers(
    files: &MemFiles,
    names: &[String],
    bufs: &mut Buffers,
) -> Result<LayerBytes, String> {
    let mut layers = Vec::new();
    for name in names {
        let store = files
            .remove(name)
            .ok_or_else(|| format!("{name}: not among the crash state's files"))?;
        let bytes = match Arc::try_unwrap(store) {
            Ok(store) => store.into_data(),
            Err(shared) => bufs.copy_of(&shared.snapshot()),
        };
        layers.push((name.clone(), bytes));
    }
    Ok(layers)
}

/// Checks one crash state. `bufs` lends the worker's reused buffers.
pub(crate) fn check_state(
    target: &dyn CrashTarget,
    guest: &GuestHistory,
    state: &CrashState,
    view: &PointView,
    opts: CheckOptions,
    bufs: &mut Buffers,
) -> Outcome {
    let mut out = Outcome::default();
    let files = bufs.mem_files(state);
    let checked = recover_and_check(target, guest, state, view, &files, bufs, &mut out).and_then(
        |(recovered, names)| match take_layers(&files, &names, bufs) {
            Ok(layers) => Some((recovered, layers)),
            Err(e) => {
                out.violations.push(ViolationKind::ReopenFailed(e));
                bufs.give(recovered);
                None
            }
        },
    );
    // The recovered disk is gone: its stores' buffers come back.
    bufs.reclaim(files, state.devices.iter().map(|d| d.name.as_str()));
    let Some((recovered, layers)) = checked else {
        return out;
    };
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
    if opts.reopen {
        if let Some(v) = reopen_and_compare(layers, &recovered, bufs) {
            out.violations.push(v);
        }
    } else {
        layers.into_iter().for_each(|(_, b)| bufs.give(b));
    }
    bufs.give(recovered);
    out
}

/// Recovers through the target from `files`, reads the whole disk and
/// judges it, closes it and checks the top image. Returns what recovery
/// read and the closed layers' names, or `None` when a violation ends the
/// check. The recovered disk is dropped on return.
fn recover_and_check(
    target: &dyn CrashTarget,
    guest: &GuestHistory,
    state: &CrashState,
    view: &PointView,
    files: &Arc<MemFiles>,
    bufs: &mut Buffers,
    out: &mut Outcome,
) -> Option<(Vec<u8>, Vec<String>)> {
    let disk = match target.recover_from(state, files.clone()) {
        Ok(d) => d,
        Err(e) => {
            out.violations
                .push(ViolationKind::RecoveryFailed(e.to_string()));
            return None;
        }
    };
    if disk.size() != guest.model.size() {
        out.violations.push(ViolationKind::SizeChanged {
            expected: guest.model.size(),
            found: disk.size(),
        });
        return None;
    }
    let recovered = match read_all(&disk, bufs) {
        Ok(b) => b,
        Err(e) => {
            out.violations.push(ViolationKind::ReadFailed(e));
            return None;
        }
    };
    if let Some(m) = guest.check(&recovered, view) {
        out.violations.push(ViolationKind::Data(m));
    }
    if let Err(e) = disk.close() {
        out.violations
            .push(ViolationKind::CloseFailed(e.to_string()));
        return None;
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
    Some((
        recovered,
        disk.layers().iter().map(|l| l.name().to_string()).collect(),
    ))
}

/// Opens the closed images on their own (no target, read-only) and
/// compares the guest content with what recovery read. The layers'
/// buffers go back to `bufs`.
fn reopen_and_compare(
    layers: LayerBytes,
    recovered: &[u8],
    bufs: &mut Buffers,
) -> Option<ViolationKind> {
    let files = MemFiles::new();
    let top = layers.first()?.0.clone();
    let names: Vec<String> = layers.iter().map(|(name, _)| name.clone()).collect();
    for (name, bytes) in layers {
        files.insert(&name, bytes);
    }
    let found = read_reopened(&top, files.clone(), recovered, bufs);
    bufs.reclaim(files, names.iter().map(String::as_str));
    found
}

/// Opens the chain `top` from `files` read-only and compares its guest
/// content with `recovered`.
fn read_reopened(
    top: &str,
    files: Arc<MemFiles>,
    recovered: &[u8],
    bufs: &mut Buffers,
) -> Option<ViolationKind> {
    let disk = match open_chain(
        top,
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
    let again = match read_all(&disk, bufs) {
        Ok(again) => again,
        Err(e) => return Some(ViolationKind::ReopenFailed(e)),
    };
    let found = first_difference(&again, recovered)
        .map(|d| ViolationKind::ReopenDiffers { offset: d as u64 });
    bufs.give(again);
    found
}

/// The first offset where `a` and `b` differ, over their common length.
/// Compares blocks at memory speed first: a byte-by-byte scan of a whole
/// disk cost a sizeable share of a state.
pub(crate) fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    const BLOCK: usize = 4096;
    a.chunks(BLOCK)
        .zip(b.chunks(BLOCK))
        .position(|(x, y)| x != y)
        .and_then(|block| {
            let (a, b) = (&a[block * BLOCK..], &b[block * BLOCK..]);
            a.iter()
                .zip(b)
                .position(|(x, y)| x != y)
                .map(|at| block * BLOCK + at)
        })
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

#[cfg(test)]
mod tests {
    use super::first_difference;

    #[test]
    fn first_difference_is_the_first_differing_byte_of_the_common_length() {
        let a = vec![5u8; 10_000];
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b[9_000] = 6;
        b[7_000] = 6;
        assert_eq!(first_difference(&a, &b), Some(7_000));
        // Only the common length counts.
        assert_eq!(first_difference(&a[..5_000], &b), None);
        assert_eq!(first_difference(&a, &b[..7_001]), Some(7_000));
    }
}
