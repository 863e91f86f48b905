//! Operator integration: who may connect to the data sockets
//! (`--socket-mode`, `--socket-owner`, `--socket-group`, checked with a
//! real NBD client run as another uid), the libvirt domain examples in
//! contrib/libvirt (virt-xml-validate, and their sockets agree with
//! contrib/vdcache.toml), and the systemd unit contrib/vdcache.service
//! (`systemd-analyze verify`; then its ExecStart, KillSignal and
//! TimeoutStopSec are carried out as systemd would: start, stop cleanly
//! leaving no dirty image, start again with the data intact). This
//! machine's PID 1 is not systemd, so the test plays the service manager.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::serving;

use common::{Scratch, exec, ok};
use serving::{Proc, qcow2, qemu_io, serve, uri};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// `nbdinfo --size URI` run as `uid`:`gid` with no other groups.
fn nbdinfo_as(uid: u32, gid: u32, target: &str) -> common::Out {
    exec(
        Command::new("setpriv")
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={gid}"))
            .arg("--clear-groups")
            .args(["nbdinfo", "--size", target]),
    )
}

/// A scratch directory another user can reach (sockets inside it are
/// then guarded by their own mode only).
fn open_scratch() -> Scratch {
    let s = Scratch::new();
    std::fs::set_permissions(s.root(), std::fs::Permissions::from_mode(0o755)).unwrap();
    s
}

const NOBODY: u32 = 65534;
const OTHER_UID: u32 = 54321;

#[test]
fn data_sockets_admit_another_user_only_when_configured() {
    let s = open_scratch();
    let image = s.path("disk.qcow2");
    qcow2(&s, &image, 8 << 20, None);
    let image = image.to_str().unwrap().to_string();
    let sock = s.path("nbd.sock");
    let target = uri(&sock, "");

    // Default: 0600, root's.
    let server = serve(&s, &sock, &[&image]);
    let denied = nbdinfo_as(NOBODY, NOBODY, &target);
    assert!(
        !denied.success() && denied.all().contains("Permission denied"),
        "a 0600 root socket let uid {NOBODY} in:\n{}",
        denied.report()
    );
    let control = std::fs::metadata(s.path("nbd.sock.control")).unwrap();
    assert_eq!(
        (control.mode() & 0o777, control.uid()),
        (0o600, 0),
        "the control socket stays root's"
    );
    server.stop_clean();

    // Given to the user.
    let server = serve(&s, &sock, &["--socket-owner", "nobody", &image]);
    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (NOBODY, 0o600));
    let out = nbdinfo_as(NOBODY, NOBODY, &target);
    assert!(out.success(), "{}", out.report());
    assert_eq!(out.stdout.trim(), (8u64 << 20).to_string());
    server.stop_clean();

    // Given to a group: a member gets in, another user does not.
    let server = serve(
        &s,
        &sock,
        &[
            "--socket-group",
            &NOBODY.to_string(),
            "--socket-mode",
            "0660",
            &image,
        ],
    );
    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!((meta.gid(), meta.mode() & 0o777), (NOBODY, 0o660));
    let member = nbdinfo_as(OTHER_UID, NOBODY, &target);
    assert!(member.success(), "{}", member.report());
    let stranger = nbdinfo_as(OTHER_UID, OTHER_UID, &target);
    assert!(
        !stranger.success() && stranger.all().contains("Permission denied"),
        "{}",
        stranger.report()
    );
    server.stop_clean();

    // A second server on a vhost-user socket in use is refused, and the
    // first keeps serving.
    let vhost = s.path("vm.vhost");
    let vhost_arg = vhost.to_str().unwrap();
    let first = serve(&s, &sock, &["--vhost-user-blk", vhost_arg, &image]);
    let other = s.path("other.qcow2");
    qcow2(&s, &other, 8 << 20, None);
    let log = serving::serve_refused(
        &s,
        &s.path("other.sock"),
        &["--vhost-user-blk", vhost_arg, other.to_str().unwrap()],
    );
    assert!(
        log.contains("vhost-user-blk socket") && log.contains("in use by a running server"),
        "{log}"
    );
    assert!(
        nbdinfo_as(0, 0, &target).success(),
        "the first server stopped serving"
    );
    first.stop_clean();
    assert!(!vhost.exists(), "the socket stays after a clean stop");

    // Mistakes are refused before anything is served, in words.
    for (args, word) in [
        (
            vec!["--socket-owner", "no-such-user-vdcache"],
            "no-such-user-vdcache",
        ),
        (
            vec!["--socket-group", "no-such-group-vdcache"],
            "no-such-group-vdcache",
        ),
        (vec!["--socket-mode", "0644x"], "0644x"),
        (vec!["--socket-mode", "0066"], "0066"),
    ] {
        let log = serving::serve_refused(
            &s,
            &s.path("refused.sock"),
            &[args.as_slice(), &[image.as_str()]].concat(),
        );
        assert!(
            log.contains(word) && !log.contains("panicked"),
            "{args:?}: {log}"
        );
    }
    s.finish();
}

#[test]
fn libvirt_domain_examples_validate_and_match_the_example_config() {
    let config = std::fs::read_to_string(repo_file("contrib/vdcache.toml")).unwrap();
    for (file, socket) in [
        ("contrib/libvirt/vm1-nbd.xml", "/run/vdcache/vdcache.sock"),
        (
            "contrib/libvirt/vm1-vhost-user.xml",
            "/run/vdcache/vm1.vhost",
        ),
    ] {
        let path = repo_file(file);
        let out = exec(Command::new("virt-xml-validate").arg(&path).arg("domain"));
        assert!(out.success(), "{file}:\n{}", out.report());
        let xml = std::fs::read_to_string(&path).unwrap();
        assert!(
            xml.contains(&format!("'{socket}'")),
            "{file} names {socket}"
        );
        assert!(
            config.contains(&format!("\"{socket}\"")),
            "contrib/vdcache.toml names {socket}"
        );
        // The validator can fail: a misspelt element is refused.
        let bad = std::env::temp_dir().join(format!("vdcache-bad-{}.xml", std::process::id()));
        std::fs::write(&bad, xml.replace("<target dev=", "<targt dev=")).unwrap();
        let refused = exec(Command::new("virt-xml-validate").arg(&bad).arg("domain"));
        let _ = std::fs::remove_file(&bad);
        assert!(!refused.success(), "a broken {file} validated");
    }
}

/// `Key=value` of the unit's [Service] section.
fn unit_value(unit: &str, key: &str) -> String {
    unit.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("the unit has no {key}"))
        .trim()
        .to_string()
}

/// systemd's time span ("30min", "90s", "infinity"), as a test bound.
fn timespan(text: &str) -> Duration {
    let (num, unit): (String, String) = text.chars().partition(char::is_ascii_digit);
    let n: u64 = num.parse().unwrap_or(u64::MAX);
    match unit.as_str() {
        "min" => Duration::from_secs(n.saturating_mul(60)),
        "s" | "" => Duration::from_secs(n),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => Duration::MAX,
    }
}

#[test]
fn systemd_unit_starts_stops_cleanly_and_restarts() {
    let s = Scratch::new();
    let unit = std::fs::read_to_string(repo_file("contrib/vdcache.service")).unwrap();
    let exec_start = unit_value(&unit, "ExecStart");
    let mut words = exec_start.split_whitespace();
    let program = words.next().unwrap();
    let args: Vec<&str> = words.collect();
    assert_eq!(unit_value(&unit, "KillSignal"), "SIGTERM");
    let stop_timeout = timespan(&unit_value(&unit, "TimeoutStopSec"));
    assert!(
        stop_timeout >= Duration::from_secs(60),
        "room for the write-back"
    );

    // The unit with this build's binary and this test's config verifies.
    let bin = env!("CARGO_BIN_EXE_vdcache");
    let config = s.path("vdcache.toml");
    let installed = s.path("vdcache.service");
    let config_arg = args.last().copied().unwrap();
    std::fs::write(
        &installed,
        unit.replace(program, bin)
            .replace(config_arg, config.to_str().unwrap()),
    )
    .unwrap();
    // --man=no: the unit's man page is not installed on a build machine.
    let verify = exec(
        Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&installed),
    );
    assert!(
        verify.success() && !verify.all().contains(&installed.display().to_string()),
        "systemd-analyze verify:\n{}",
        verify.report()
    );

    let base = s.path("base.qcow2");
    let delta = s.path("delta.qcow2");
    qcow2(&s, &base, 32 << 20, None);
    qcow2(&s, &delta, 32 << 20, Some(base.to_str().unwrap()));
    let sock = s.path("vd.sock");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\n[cache]\npath = \"{}\"\nsize = \"32M\"\n[[export]]\nname = \"vm1\"\nimage = \"{}\"\n",
            sock.display(),
            s.path("flash.cache").display(),
            delta.display()
        ),
    )
    .unwrap();
    let start = || {
        let mut cmd = Command::new(bin);
        cmd.args(&args[..args.len() - 1]).arg(&config);
        let mut p = Proc::spawn(
            cmd,
            &sock,
            s.path(&format!(
                "unit-{}.log",
                s.root().read_dir().unwrap().count()
            )),
        );
        p.wait_ready();
        p
    };
    let target = uri(&sock, "vm1");
    let server = start();
    qemu_io(
        &s,
        "raw",
        &target,
        &["write -P 0x5a 1M 2M".into(), "flush".into()],
    );
    // systemctl stop: KillSignal, then up to TimeoutStopSec.
    let log = server.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    assert!(
        !serving::qcow2_dirty_bit(&delta),
        "the image was left dirty"
    );
    let check = ok(s.qemu_img().arg("check").arg(&delta));
    assert!(
        check.stdout.contains("No errors were found"),
        "{}",
        check.all()
    );
    // systemctl start again: the data is there.
    let server = start();
    qemu_io(
        &s,
        "raw",
        &target,
        &["read -P 0x5a 1M 2M".into(), "read -P 0 0 1M".into()],
    );
    let log = server.stop_clean();
    assert!(log.contains("stopped cleanly"), "{log}");
    s.finish();
}
