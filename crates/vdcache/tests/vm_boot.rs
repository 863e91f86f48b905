//! A real VM on a vdcache disk: qemu-system-x86_64 (TCG) boots Debian's
//! cloud kernel with a busybox initramfs (`scripts/vm-assets.sh`); its data
//! disk is a qcow2 delta over a base, served by `vdcache serve` through a
//! flash cache, once over vhost-user-blk and once over NBD. The guest makes
//! an ext4 and writes files with fsync while vdcache is killed with -9 and
//! restarted (QEMU's client reconnects and resends what was in flight),
//! trims, reads them back after dropping its caches and powers off; then
//! `qemu-img check` must be clean and every file the guest fsynced must
//! read the same out of the image as the guest wrote it.
//!
//! Needs qemu-system-x86_64, busybox-static, cpio and apt-get (the README's
//! test command installs them); these tests never skip.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::serving;

use common::{Scratch, ok};
use serving::{Proc, Streamed, qcow2, qemu_io, serve_config};
use std::path::{Path, PathBuf};
use std::process::Command;

const DISK: u64 = 256 << 20;
/// What the guest prints before everything the host reads.
const MARK: &str = "VDCACHE-GUEST ";

/// One VM at a time: TCG guests share the machine's two cores.
static ONE_VM: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_vm() -> std::sync::MutexGuard<'static, ()> {
    ONE_VM
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The kernel and base initramfs, made once per target directory.
fn assets() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vm-assets");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vm-assets.sh");
    ok(Command::new("bash").arg(script).arg(&dir));
    dir
}

/// The base initramfs with `script` appended as /test.sh (the kernel
/// unpacks concatenated cpio archives in order).
fn initrd(s: &Scratch, script: &str) -> PathBuf {
    let dir = s.path("guest");
    std::fs::create_dir_all(&dir).unwrap();
    let test = dir.join("test.sh");
    std::fs::write(&test, script).unwrap();
    ok(Command::new("chmod").arg("755").arg(&test));
    let extra = s.path("test.cpio");
    ok(Command::new("sh").current_dir(&dir).arg("-c").arg(format!(
        "echo test.sh | cpio -o -H newc --quiet > {}",
        extra.display()
    )));
    let mut bytes = std::fs::read(assets().join("initramfs.cpio.gz")).unwrap();
    // The kernel finds the next archive after zero padding, at a 4-byte
    // boundary.
    bytes.resize(bytes.len().next_multiple_of(512), 0);
    bytes.extend(std::fs::read(&extra).unwrap());
    let out = s.path("initrd");
    std::fs::write(&out, bytes).unwrap();
    ok(Command::new("chmod").arg("644").arg(&out));
    out
}

/// How the guest's disk reaches vdcache.
#[derive(Clone, Copy, Debug)]
enum Transport {
    VhostUser,
    Nbd,
}

/// A base with content, a delta over it, and a config serving the delta as
/// export `vm` through a flash cache, over NBD and over vhost-user-blk.
struct Setup {
    s: Scratch,
    config: PathBuf,
    nbd: PathBuf,
    vhost: PathBuf,
    delta: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        Setup::with_server_lines("")
    }

    /// A setup whose `[server]` section also has `server_lines`.
    fn with_server_lines(server_lines: &str) -> Setup {
        let s = Scratch::new();
        let base = s.path("base.qcow2");
        let delta = s.path("delta.qcow2");
        qcow2(&s, &base, DISK, None);
        // Base content the guest's mkfs partly overwrites.
        let writes: Vec<String> = (0..16)
            .map(|i| format!("write -P {} {} 1M", 0x40 + i, i * (16 << 20)))
            .collect();
        qemu_io(&s, "qcow2", base.to_str().unwrap(), &writes);
        qcow2(&s, &delta, DISK, Some(base.to_str().unwrap()));
        let (nbd, vhost, config) = (s.path("nbd.sock"), s.path("vub.sock"), s.path("serve.toml"));
        std::fs::write(
            &config,
            format!(
                "[server]\nsocket = \"{}\"\n{server_lines}[cache]\npath = \"{}\"\nsize = \"128M\"\n[[export]]\nname = \"vm\"\nimage = \"{}\"\nvhost_user_blk = \"{}\"\n",
                nbd.display(),
                s.path("cache.img").display(),
                delta.display(),
                vhost.display()
            ),
        )
        .unwrap();
        Setup {
            s,
            config,
            nbd,
            vhost,
            delta,
        }
    }

    fn serve(&self) -> Proc {
        serve_config(&self.s, &self.config, &self.nbd)
    }

    /// qemu-system-x86_64 booting the guest with `script` as its test, its
    /// disk over `transport`; the console is streamed.
    fn boot(&self, transport: Transport, script: &str) -> Streamed {
        self.boot_as(None, transport, script)
    }

    /// [`Setup::boot`], QEMU running as `uid` (its group too) when given.
    fn boot_as(&self, uid: Option<u32>, transport: Transport, script: &str) -> Streamed {
        let a = assets();
        let mut cmd = match uid {
            Some(uid) => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={uid}"))
                    .arg(format!("--regid={uid}"))
                    .args(["--clear-groups", "qemu-system-x86_64"]);
                c
            }
            None => Command::new("qemu-system-x86_64"),
        };
        cmd.args([
            "-machine", "q35", "-accel", "tcg", "-m", "512M", "-smp", "2",
        ])
        .args(["-display", "none", "-no-reboot", "-nodefaults"])
        .args(["-serial", "stdio", "-monitor", "none"])
        .arg("-kernel")
        .arg(self.readable_copy(&a.join("vmlinuz")))
        .arg("-initrd")
        .arg(initrd(&self.s, script))
        .args(["-append", "console=ttyS0 quiet panic=-1"]);
        match transport {
            Transport::VhostUser => {
                cmd.args([
                    "-object",
                    "memory-backend-memfd,id=mem,size=512M,share=on",
                    "-machine",
                    "memory-backend=mem",
                    "-chardev",
                ])
                .arg(format!(
                    "socket,id=vub,path={},reconnect-ms=500",
                    self.vhost.display()
                ))
                .args(["-device", "vhost-user-blk-pci,chardev=vub,num-queues=2"]);
            }
            Transport::Nbd => {
                cmd.arg("-blockdev")
                    .arg(format!(
                        "driver=nbd,node-name=disk,server.type=unix,server.path={},export=vm,reconnect-delay=30",
                        self.nbd.display()
                    ))
                    .args(["-device", "virtio-blk-pci,drive=disk"]);
            }
        }
        Streamed::spawn(cmd)
    }

    /// `file` copied into the scratch directory, readable by anyone (QEMU
    /// may run as another user).
    fn readable_copy(&self, file: &Path) -> PathBuf {
        let copy = self.s.path(&format!(
            "readable-{}",
            file.file_name().unwrap().to_string_lossy()
        ));
        std::fs::copy(file, &copy).unwrap();
        ok(Command::new("chmod").arg("644").arg(&copy));
        copy
    }

    /// The content of `/name` in the delta's ext4, read on the host.
    fn file_digest(&self, name: &str) -> String {
        let raw = self.s.path("delta.raw");
        if !raw.exists() {
            ok(self
                .s
                .qemu_img()
                .args(["convert", "-O", "raw"])
                .arg(&self.delta)
                .arg(&raw));
        }
        let out = self.s.path(&format!("{name}.out"));
        ok(Command::new("debugfs")
            .arg("-R")
            .arg(format!("dump /{name} {}", out.display()))
            .arg(&raw));
        sha256(&out)
    }

    /// `qemu-img check` of the delta, which must be clean.
    fn check_clean(&self) {
        let out = ok(self.s.qemu_img().arg("check").arg(&self.delta));
        assert!(
            out.stdout.contains("No errors were found"),
            "qemu-img check: {}",
            out.all()
        );
    }
}

fn sha256(path: &Path) -> String {
    let out = ok(Command::new("sha256sum").arg(path));
    out.stdout
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The guest's marked lines, without the marker (the console may put
/// escape sequences before it on the same line).
fn guest_lines(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| l.find(MARK).map(|i| l[i + MARK.len()..].trim().to_string()))
        .collect()
}

/// Waits for the guest to power off; asserts that QEMU exited cleanly and
/// the guest's test succeeded (`what` says which run failed). Returns the
/// guest's marked lines and the whole console.
fn finished(vm: Streamed, what: &str) -> (Vec<String>, Vec<String>) {
    let (status, lines) = vm.finish();
    let guest = guest_lines(&lines);
    assert!(
        status.success() && guest.iter().any(|l| l == "exit 0"),
        "{what}: qemu exited {status}, the guest's test did not succeed:\n{}",
        lines.join("\n")
    );
    (guest, lines)
}

/// (file, digest) of every `WORD file digest` line.
fn files(lines: &[String], word: &str) -> Vec<(String, String)> {
    lines
        .iter()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some(word))
                .then(|| (w.next().unwrap_or("").into(), w.next().unwrap_or("").into()))
        })
        .collect()
}

/// Makes an ext4 and writes twelve files one after another, each fsynced
/// before its line (the host kills the server with -9 meanwhile); then
/// trims its free space, drops the page cache, remounts and reads every
/// file back.
const WRITE_SYNCED_THEN_REREAD: &str = r#"#!/bin/sh
set -e
/opt/mkfs.ext4 -q -t ext4 /dev/vda
mount -t ext4 /dev/vda /mnt
for i in 1 2 3 4 5 6 7 8 9 10 11 12; do
  dd if=/dev/urandom of=/mnt/f$i bs=64k count=8 conv=fsync 2>/dev/null
  echo "VDCACHE-GUEST synced f$i $(sha256sum /mnt/f$i | cut -d' ' -f1)"
done
# Discards reach the server too (ext4's free space, as fstrim sends it).
dd if=/dev/urandom of=/mnt/scratch bs=64k count=32 conv=fsync 2>/dev/null
rm /mnt/scratch
sync
fstrim /mnt
echo "VDCACHE-GUEST trimmed"
umount /mnt
echo 3 > /proc/sys/vm/drop_caches
mount -t ext4 /dev/vda /mnt
for i in 1 2 3 4 5 6 7 8 9 10 11 12; do
  echo "VDCACHE-GUEST reread f$i $(sha256sum /mnt/f$i | cut -d' ' -f1)"
done
umount /mnt
"#;

#[test]
fn guest_makes_ext4_and_its_fsynced_files_survive_kill_9_over_nbd() {
    guest_makes_ext4_through_kill_9(Transport::Nbd);
}

#[test]
fn guest_makes_ext4_and_its_fsynced_files_survive_kill_9_over_vhost_user() {
    guest_makes_ext4_through_kill_9(Transport::VhostUser);
}

/// One boot checks the whole life of a disk: the server is killed with -9
/// while the guest writes, restarted, and every file the guest fsynced
/// must read back the same (in the guest after a remount, and out of the
/// image after a clean stop, which `qemu-img check` must find clean).
fn guest_makes_ext4_through_kill_9(transport: Transport) {
    let _vm = one_vm();
    let setup = Setup::new();
    let server = setup.serve();
    let mut vm = setup.boot(transport, WRITE_SYNCED_THEN_REREAD);
    assert!(
        vm.wait_for(3, |l| l.contains("VDCACHE-GUEST synced")),
        "the guest stopped early:\n{}",
        vm.seen.join("\n")
    );
    let synced_before = vm
        .seen
        .iter()
        .filter(|l| l.contains("VDCACHE-GUEST synced"))
        .count();
    assert!(
        synced_before < 12,
        "the guest finished before the kill: nothing was tested"
    );
    let killed_log = server.kill9();
    let restarted = setup.serve();
    let (guest, lines) = finished(
        vm,
        &format!("{transport:?}, across the restart (first server:\n{killed_log})"),
    );
    let synced = files(&guest, "synced");
    assert_eq!(synced.len(), 12, "{}", lines.join("\n"));
    assert!(
        guest.iter().any(|l| l == "trimmed"),
        "{transport:?}: fstrim failed"
    );
    assert_eq!(
        synced,
        files(&guest, "reread"),
        "{transport:?}: reread differs"
    );
    if let Transport::VhostUser = transport {
        // What the guest asked the restarted server over vhost-user is
        // counted, per export.
        let report = serving::stats(&setup.s, &setup.nbd);
        let v = &report["disks"][0]["vhost_user"];
        let count = |k: &str| v[k].as_u64().unwrap_or(0);
        assert!(
            ["writes", "reads", "flushes", "discards"]
                .iter()
                .all(|k| count(k) > 0),
            "{v}"
        );
        assert_eq!(count("errors"), 0, "{v}");
    }
    let log = restarted.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    if let Transport::VhostUser = transport {
        assert!(
            log.contains("a front end connected"),
            "QEMU did not reconnect to the restarted server: {log}"
        );
    }
    setup.check_clean();
    for (name, digest) in &synced {
        assert_eq!(
            &setup.file_digest(name),
            digest,
            "{transport:?}: {name} after kill -9 and restart"
        );
    }
}

/// Reads the first MiB of the disk (the base's pattern 0x40).
const READ_FIRST_MIB: &str = r#"#!/bin/sh
set -e
echo "VDCACHE-GUEST first $(dd if=/dev/vda bs=1M count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
"#;

#[test]
fn a_non_root_qemu_boots_from_a_vhost_user_socket_given_to_its_user() {
    const NOBODY: u32 = 65534;
    let _vm = one_vm();
    let setup = Setup::with_server_lines("socket_owner = \"nobody\"\n");
    ok(Command::new("chmod").arg("755").arg(setup.s.root()));
    let server = setup.serve();
    let vm = setup.boot_as(Some(NOBODY), Transport::VhostUser, READ_FIRST_MIB);
    let (guest, lines) = finished(vm, &format!("QEMU as uid {NOBODY}"));
    let expected = setup.s.path("expected");
    std::fs::write(&expected, vec![0x40u8; 1 << 20]).unwrap();
    let want = format!("first {}", sha256(&expected));
    assert!(
        guest.contains(&want),
        "the guest of a QEMU run as uid {NOBODY} did not read the disk:\n{}",
        lines.join("\n")
    );
    server.stop_clean();
}
