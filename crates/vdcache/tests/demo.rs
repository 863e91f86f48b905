//! The README's first command: `vdcache demo` builds a chain, serves it
//! through a flash cache, recovers, stops clean and checks the images with
//! vdcache and qemu-img. It must pass on a fresh machine.

use std::process::Command;

#[test]
fn demo_passes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_vdcache"))
        .args(["demo", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run vdcache demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("demo passed"), "{stdout}");
    assert!(
        stdout.contains("clean"),
        "qemu-img check did not run: {stdout}"
    );
}
