//! `vdcache create` of a delta (issue 25): extended L2 entries by default,
//! so guest writes allocate subclusters and copy nothing from the backing
//! file; `-o extended_l2=off` and options that rule them out still give a
//! standard delta; QEMU writes and checks the default delta.

use crate::common;

use common::{Scratch, ok};
use serde_json::Value;
use std::path::Path;

fn extended_l2(s: &Scratch, img: &Path) -> Option<bool> {
    let out = ok(s.qemu_img().args(["info", "-U", "--output=json"]).arg(img));
    let v: Value = serde_json::from_str(&out.stdout).expect("qemu-img info json");
    v["format-specific"]["data"]["extended-l2"].as_bool()
}

#[test]
fn a_delta_gets_extended_l2_unless_told_or_ruled_out() {
    let s = Scratch::new();
    let base = s.path("base.qcow2");
    ok(s.vdcache()
        .args(["create", "-f", "qcow2"])
        .arg(&base)
        .arg("16M"));
    assert_eq!(extended_l2(&s, &base), Some(false), "a standalone image");
    let cases: [(&str, &[&str], Option<bool>); 4] = [
        ("default.qcow2", &[], Some(true)),
        ("off.qcow2", &["-o", "extended_l2=off"], Some(false)),
        ("small.qcow2", &["-o", "cluster_size=4k"], Some(false)),
        ("v2.qcow2", &["-o", "compat=0.10"], None),
    ];
    for (name, opts, want) in cases {
        let delta = s.path(name);
        ok(s.vdcache()
            .args(["create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2"])
            .args(opts)
            .arg(&delta));
        assert_eq!(extended_l2(&s, &delta), want, "{name}");
    }
    let delta = s.path("default.qcow2");
    ok(s.cmd("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x5c 4096 4096"])
        .arg(&delta));
    ok(s.qemu_img().arg("check").arg(&delta));
    ok(s.cmd("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-r",
            "-c",
            "read -P 0x5c 4096 4096",
            "-c",
            "read -P 0 0 4096",
        ])
        .arg(&delta));
    s.finish();
}
