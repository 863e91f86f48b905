#!/usr/bin/env python3
"""A real VM on each server (issue 23, done-when item 1; a benchmark, not a
test): boot time and the guest's own disk throughput over vhost-user-blk,
vdcache with a flash cache against qemu-storage-daemon, same chain, same
run.

The emulated datacenter of datacenter.py: a storage server (nbdkit, --delay
ms per request) holds a base image full of data (--disk-size) and a fresh
qcow2 delta over it. Each contender serves the delta over vhost-user-blk:

  qsd      qemu-storage-daemon: nbd blockdev -> qcow2 -> vhost-user-blk export
  vdcache  vdcache serve with a write-back flash cache (--cache-size)

qemu-system-x86_64 (TCG: /dev/kvm stalled on these machines) boots Debian's
cloud kernel with the busybox initramfs of scripts/vm-assets.sh plus
vdcache-guest-io (crates/tools/eval, linked statically), which measures in
the guest with O_DIRECT: sequential read and write MB/s (1 MiB requests over
--span-mib), and 4 KiB random read and write IOPS (--threads at once, for
--seconds each). Each contender's VM boots twice against the same server:
cold (nothing cached) and warm (vdcache's cache holds what the first boot
read and wrote; qsd has no cache). Boot time: from qemu's start to the
guest's first line (init reached, disk found).

The table (Markdown, JSON) goes to --out; the aims: vdcache >= 1.0x qsd cold,
>= 3x warm.

Usage: bench/vm_bench.py [--disk-size 1g] [--span-mib 256] [--cache-size 2g]
                         [--delay 1] [--threads 8] [--seconds 5] [--out results/vm]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from datacenter import REPO, StorageServer, fresh_delta, log, parse_size, run, stop, wait_for_socket

MARK = "VDCACHE-GUEST "


def guest_tool():
    """vdcache-guest-io, statically linked and stripped."""
    target = REPO / "target" / "guest"
    env = dict(os.environ, RUSTFLAGS="-C target-feature=+crt-static")
    run(["cargo", "build", "--release", "-q", "-p", "vdcache-eval", "--bin", "vdcache-guest-io",
         "--target", "x86_64-unknown-linux-gnu", "--target-dir", str(target)], cwd=REPO, env=env)
    out = target / "vdcache-guest-io.stripped"
    shutil.copy(target / "x86_64-unknown-linux-gnu" / "release" / "vdcache-guest-io", out)
    run(["strip", str(out)])
    return out


def initrd(work, assets, tool, a):
    """The base initramfs plus /test.sh and /bin/vdcache-guest-io."""
    root = work / "extra"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(tool, root / "bin" / "vdcache-guest-io")
    io = "/bin/vdcache-guest-io"
    span, thr, sec = a.span_mib, a.threads, a.seconds
    script = "\n".join([
        "#!/bin/sh",
        f'echo "{MARK}start"',
        f'{io} seq-read /dev/vda {span} | sed "s/^/{MARK}/"',
        f'{io} rand-read /dev/vda {span} {thr} {sec} | sed "s/^/{MARK}/"',
        f'{io} rand-write /dev/vda {span} {thr} {sec} | sed "s/^/{MARK}/"',
        f'{io} seq-write /dev/vda {span} | sed "s/^/{MARK}/"',
        "",
    ])
    (root / "test.sh").write_text(script)
    os.chmod(root / "test.sh", 0o755)
    extra = work / "extra.cpio"
    subprocess.run(f"find . | cpio -o -H newc --quiet > {extra}", shell=True, cwd=root, check=True)
    data = (assets / "initramfs.cpio.gz").read_bytes()
    data += b"\0" * (-len(data) % 512)
    out = work / "initrd"
    out.write_bytes(data + extra.read_bytes())
    return out


def boot(assets, initrd_path, sock, timeout):
    """Boots the guest on vhost-user socket `sock`; returns (boot seconds,
    {mode: result dict}, console)."""
    cmd = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "512M", "-smp", "2",
           "-display", "none", "-no-reboot", "-nodefaults", "-serial", "stdio", "-monitor", "none",
           "-kernel", str(assets / "vmlinuz"), "-initrd", str(initrd_path),
           "-append", "console=ttyS0 quiet panic=-1",
           "-object", "memory-backend-memfd,id=mem,size=512M,share=on", "-machine", "memory-backend=mem",
           "-chardev", f"socket,id=vub,path={sock}", "-device", "vhost-user-blk-pci,chardev=vub,num-queues=2"]
    started = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    booted = None
    results = {}
    lines = []
    deadline = started + timeout
    for line in p.stdout:
        lines.append(line.rstrip())
        if MARK not in line:
            continue
        rest = line[line.index(MARK) + len(MARK):].strip()
        if rest.startswith("booted") and booted is None:
            booted = time.monotonic() - started
        if rest.startswith("RESULT"):
            kv = dict(x.split("=", 1) for x in rest.split()[1:])
            results[kv["mode"]] = {k: float(v) for k, v in kv.items() if k != "mode"}
        if time.monotonic() > deadline:
            p.kill()
            break
    p.wait()
    if len(results) < 4:
        raise SystemExit("the guest did not finish its measurements:\n" + "\n".join(lines[-30:]))
    return booted, results, lines


def contender(name, a, work, storage, assets, initrd_path):
    vsock = work / f"{name}.vhost"
    if vsock.exists():
        vsock.unlink()
    logf = open(work / f"{name}.log", "w")
    if name == "qsd":
        cmd = ["qemu-storage-daemon",
               "--blockdev", f"driver=nbd,node-name=file,server.type=unix,server.path={storage.sock},"
                             f"export=delta.qcow2",
               "--blockdev", "driver=qcow2,node-name=disk,file=file",
               "--export", f"type=vhost-user-blk,id=e,node-name=disk,addr.type=unix,addr.path={vsock},"
                           f"writable=on,num-queues=2"]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=logf)
        wait_for_socket(str(vsock), proc, "qemu-storage-daemon")
    else:
        cache = work / "cache.img"
        if cache.exists():
            cache.unlink()
        nbd = work / "vd.sock"
        conf = work / "vdcache.toml"
        conf.write_text(
            f'[server]\nsocket = "{nbd}"\n[cache]\npath = "{cache}"\nsize = "{a.cache_size}"\n'
            f'[[export]]\nname = "vm"\nimage = "{storage.uri("delta.qcow2")}"\nvhost_user_blk = "{vsock}"\n')
        proc = subprocess.Popen([a.vdcache, "serve", "--config", str(conf)], stdout=logf, stderr=logf)
        wait_for_socket(str(nbd), proc, "vdcache")
    rows = []
    try:
        for phase in ("cold", "warm"):
            booted, results, _ = boot(assets, initrd_path, vsock, a.timeout)
            log(f"{name} {phase}: boot {booted:.2f} s, " + ", ".join(
                f"{m} {r['mbps']:.1f} MB/s {r['iops']:.0f} IOPS" for m, r in results.items()))
            rows.append({"server": name, "phase": phase, "boot_seconds": booted, "results": results})
    finally:
        stop(proc)
        logf.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--disk-size", default="1g")
    ap.add_argument("--span-mib", type=int, default=256, help="MiB of the disk the guest's I/O covers")
    ap.add_argument("--cache-size", default="2g")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency, ms per request")
    ap.add_argument("--threads", type=int, default=8, help="the guest's random I/O queue depth")
    ap.add_argument("--seconds", type=float, default=5.0, help="each random I/O run")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one boot may take")
    ap.add_argument("--out", default=str(REPO / "results" / "vm"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    for tool in ("qemu-system-x86_64", "qemu-storage-daemon", "nbdkit", "qemu-img", "cpio", "strip"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing (the README's test command installs what this needs)")
    if not Path(a.vdcache).exists():
        run(["cargo", "build", "--release", "-q", "-p", "vdcache"], cwd=REPO)
    assets = REPO / "target" / "vm-assets"
    run(["bash", str(REPO / "scripts" / "vm-assets.sh"), str(assets)])
    tool = guest_tool()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vdcache-vm-") as tmp:
        work = Path(tmp)
        images = work / "images"
        images.mkdir()
        size = parse_size(a.disk_size)
        base = images / "base.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), str(size)])
        run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x3c 0 {size}", str(base)])
        ird = initrd(work, assets, tool, a)
        for name in ("qsd", "vdcache"):
            storage = StorageServer(work, images, a.delay)
            fresh_delta(images, storage, "delta.qcow2", size)
            storage.start()
            try:
                rows += contender(name, a, work, storage, assets, ird)
            finally:
                storage.stop()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    by = {(r["server"], r["phase"]): r for r in rows}
    modes = ("seq-read", "seq-write", "rand-read", "rand-write")
    lines = ["# A real VM over vhost-user-blk: vdcache (flash cache) against qemu-storage-daemon", "",
             f"Storage server: nbdkit, {a.delay} ms per request; base {a.disk_size} of data, fresh qcow2 delta. "
             f"Guest: TCG, 2 vCPUs, 512 MiB, Debian cloud kernel, busybox; vdcache-guest-io with O_DIRECT over "
             f"the first {a.span_mib} MiB (sequential: 1 MiB requests; random: 4 KiB, {a.threads} threads, "
             f"{a.seconds} s). vdcache cache {a.cache_size}, write-back. Cold: first boot; warm: second boot, same server.",
             "",
             "Command: `python3 bench/vm_bench.py --disk-size " + a.disk_size + f" --span-mib {a.span_mib} --delay {a.delay}"
             f" --threads {a.threads} --seconds {a.seconds}`", "",
             "| phase | server | boot s | seq read MB/s | seq write MB/s | rand read IOPS | rand write IOPS |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for phase in ("cold", "warm"):
        for server in ("qsd", "vdcache"):
            r = by[(server, phase)]
            res = r["results"]
            lines.append(f"| {phase} | {server} | {r['boot_seconds']:.2f} | {res['seq-read']['mbps']:.1f} "
                         f"| {res['seq-write']['mbps']:.1f} | {res['rand-read']['iops']:.0f} | {res['rand-write']['iops']:.0f} |")
        q, v = by[("qsd", phase)]["results"], by[("vdcache", phase)]["results"]
        ratios = {m: v[m]["mbps"] / q[m]["mbps"] if q[m]["mbps"] else 0.0 for m in modes}
        lines.append(f"| {phase} | **vdcache / qsd** | {by[('qsd', phase)]['boot_seconds'] / by[('vdcache', phase)]['boot_seconds']:.2f}x faster "
                     + "".join(f"| **{ratios[m]:.2f}x** " for m in modes) + "|")
        for r in (by[("qsd", phase)], by[("vdcache", phase)]):
            r["ratios_vs_qsd"] = ratios if r["server"] == "vdcache" else None
    lines += ["", "Aims: vdcache >= 1.0x qsd cold, >= 3x warm (each column)."]
    (out / "vm.md").write_text("\n".join(lines) + "\n")
    (out / "vm.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
