#!/usr/bin/env python3
"""The emulated datacenter benchmark (a benchmark, not a test).

A storage server (nbdkit: file plugin over a directory of image files,
delay filter adding network latency, stats filter counting the bytes it
serves) holds the qcow2 images; contenders serve them to fio (nbd engine)
over a Unix socket, one at a time, in one run:

  qemu-nbd        the chain straight from the storage server (no flash)
  vdcache         vdcache serve through its NBD client backend, no cache
  vdcache+cache   vdcache serve with a flash cache file (--with-cache)

For every workload row it reports IOPS, p99 completion latency, and
storage-server bytes read and written per guest byte, with the ratio of
each vdcache contender to qemu-nbd measured in the same run. Results go to
a Markdown table on stdout and to --out.

Usage: bench/nbd_bench.py [--runtime S] [--size SIZE] [--delay MS]
                          [--with-cache] [--rows a,b,...] [--out FILE]
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ROWS = {
    # name: (fio rw, block size, queue depth, image, working set or None
    # for the whole image, warm the working set up first)
    "randread-4k-qd1": ("randread", "4k", 1, "disk", None, False),
    "randread-4k-qd16": ("randread", "4k", 16, "disk", None, False),
    "randwrite-4k-qd1": ("randwrite", "4k", 1, "disk", None, False),
    "randwrite-4k-qd16": ("randwrite", "4k", 16, "disk", None, False),
    "seqread-1m-qd4": ("read", "1m", 4, "disk", None, False),
    "seqwrite-1m-qd4": ("write", "1m", 4, "disk", None, False),
    "cow-randwrite-4k-qd16": ("randwrite", "4k", 16, "delta", None, False),
    # A working set that fits the flash cache, read once before measuring.
    "warm-randread-4k-qd16": ("randread", "4k", 16, "disk", "64m", True),
}

UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def parse_size(s):
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", s)
    if not m:
        raise SystemExit(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def wait_for_socket(path, proc, what, timeout=30):
    """Waits until something accepts connections on a Unix socket."""
    import socket
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                return
            except OSError:
                pass
            finally:
                s.close()
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise SystemExit(f"{what} did not create {path}")


def stop(proc, sig=signal.SIGTERM, timeout=120):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class StorageServer:
    """nbdkit exporting a directory of images, with latency and byte counts."""

    def __init__(self, work, images, delay_ms):
        self.sock = str(work / "storage.sock")
        self.stats = work / "storage-stats.txt"
        self.images = images
        self.delay_ms = delay_ms
        self.proc = None

    def uri(self, name):
        return f"nbd+unix:///{name}?socket={self.sock}"

    def start(self):
        if self.stats.exists():
            self.stats.unlink()
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.proc = subprocess.Popen(
            ["nbdkit", "--foreground", "--unix", self.sock, "--threads", "64",
             "--filter=stats", "--filter=delay", "file", f"dir={self.images}",
             f"rdelay={self.delay_ms}ms", f"wdelay={self.delay_ms}ms", f"statsfile={self.stats}"],
            stderr=subprocess.PIPE, text=True)
        wait_for_socket(self.sock, self.proc, "nbdkit")

    def stop(self):
        """Stops the server and returns (bytes read, bytes written, flushes)."""
        stop(self.proc)
        text = self.stats.read_text() if self.stats.exists() else ""
        out = {"read": 0.0, "write": 0.0, "zero": 0.0, "trim": 0.0}
        flushes = 0
        for line in text.splitlines():
            m = re.match(r"(\w+): (\d+) ops, [\d.]+ s, ([\d.]+) (\w+)", line)
            if not m:
                continue
            op, ops, val, unit = m.group(1), int(m.group(2)), float(m.group(3)), m.group(4)
            if op in out:
                out[op] = val * UNITS.get(unit, 1)
            if op == "flush":
                flushes = ops
        return out["read"], out["write"] + out["zero"], flushes


class Contender:
    def __init__(self, name, work, vdcache, cache_size=None):
        self.name = name
        self.sock = str(work / f"{name}.sock")
        self.work = work
        self.vdcache = vdcache
        self.cache_size = cache_size
        self.proc = None

    def start(self, image_uri):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        if self.name == "qemu-nbd":
            cmd = ["qemu-nbd", "-k", self.sock, "-t", "-f", "qcow2", "--cache=writeback",
                   "--discard=unmap", image_uri]
        else:
            cmd = [str(self.vdcache), "serve", "--socket", self.sock, "-f", "qcow2"]
            if self.cache_size:
                cache = self.work / "flash-cache.img"
                if cache.exists():
                    cache.unlink()
                cmd += ["--cache", str(cache), "--cache-size", self.cache_size, "--cache-mode", "writeback"]
            cmd.append(image_uri)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        wait_for_socket(self.sock, self.proc, self.name)

    def stop(self):
        stop(self.proc, signal.SIGTERM, timeout=600)

    def uri(self):
        return f"nbd+unix:///?socket={self.sock}"


def fio(uri, rw, bs, depth, size, runtime, cwd):
    cmd = ["fio", "--name=row", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={depth}", f"--size={size}", "--randrepeat=1", "--random_generator=tausworthe64",
           "--output-format=json"]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    out = run(cmd, cwd=cwd).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] else job["write"]
    pct = side["clat_ns"].get("percentile", {})
    p99 = pct.get("99.000000", 0) / 1e6
    return side["iops"], p99, job["read"]["io_bytes"] + job["write"]["io_bytes"]


def make_images(images, size):
    log(f"creating images ({size >> 20} MiB each)")
    for name in ("disk.qcow2", "base.qcow2"):
        p = images / name
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(p), str(size)])
        run(["qemu-io", "-c", f"write -P 0xab 0 {size}", str(p)])


def fresh_delta(images, storage, name, size):
    """A new, empty delta whose backing file is the base on the storage server."""
    p = images / name
    if p.exists():
        p.unlink()
    run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", storage.uri("base.qcow2"), "-F", "qcow2",
         str(p), str(size)])
    # An NBD export cannot grow: give the file room for every cluster and
    # its metadata (the zeroed tail is free space to qcow2).
    os.truncate(p, size + size // 8 + (64 << 20))
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per row and contender")
    ap.add_argument("--size", default="1g", help="image size")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--with-cache", action="store_true", help="also run vdcache with a flash cache")
    ap.add_argument("--cache-size", default="2g")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(REPO / "results" / "nbd-bench.md"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    for tool in ("nbdkit", "qemu-nbd", "qemu-img", "qemu-io", "fio"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing (apt-get install -y qemu-utils nbdkit fio)")
    if not Path(a.vdcache).exists():
        log("building vdcache (release)")
        subprocess.run(["cargo", "build", "--release", "-p", "vdcache"], cwd=REPO, check=True)
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"unknown row {r!r}; rows: {', '.join(ROWS)}")
    size = parse_size(a.size)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="vdcache-bench-"))
    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    make_images(images, size)
    storage = StorageServer(work, images, a.delay)
    contenders = [Contender("qemu-nbd", work, a.vdcache), Contender("vdcache", work, a.vdcache)]
    if a.with_cache:
        contenders.append(Contender("vdcache+cache", work, a.vdcache, a.cache_size))
    results = {}
    for row in rows:
        rw, bs, depth, image, working_set, warm = ROWS[row]
        span = working_set or a.size
        for c in contenders:
            storage.start()
            name = "disk.qcow2" if image == "disk" else fresh_delta(images, storage, f"delta-{c.name}.qcow2", size)
            c.start(storage.uri(name))
            try:
                warm_bytes = 0
                if warm:
                    # The warm-up's traffic stays in the server's counts and
                    # its bytes count as guest bytes too.
                    warm_bytes = fio(c.uri(), "read", "1m", 4, span, None, work)[2]
                iops, p99, guest = fio(c.uri(), rw, bs, depth, span, a.runtime, work)
                guest += warm_bytes
            finally:
                c.stop()
                sread, swrite, flushes = storage.stop()
            results[(row, c.name)] = (iops, p99, sread / max(guest, 1), swrite / max(guest, 1))
            log(f"{row:24} {c.name:14} {iops:10.0f} IOPS  p99 {p99:8.3f} ms  server read/guest {sread / max(guest, 1):6.3f}  written/guest {swrite / max(guest, 1):6.3f}")
    table = render(rows, contenders, results, a)
    print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(table)
    log(f"table written to {a.out}; scratch in {work}")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


def render(rows, contenders, results, a):
    lines = [f"Storage server: nbdkit file plugin, {a.delay} ms delay per request; client: fio nbd engine; "
             f"{a.runtime} s per cell; image {a.size}. Server bytes per guest byte count everything the "
             "storage server served while the contender ran (including a warm-up read of the working set "
             "for warm-* rows, whose bytes also count as guest bytes, and the write-back at a clean stop).", "",
             "| row | contender | IOPS | p99 ms | server read / guest byte | server written / guest byte | IOPS vs qemu-nbd |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        base = results.get((row, "qemu-nbd"))
        for c in contenders:
            iops, p99, r, w = results[(row, c.name)]
            ratio = f"{iops / base[0]:.2f}" if base and base[0] else ""
            lines.append(f"| {row} | {c.name} | {iops:.0f} | {p99:.3f} | {r:.3f} | {w:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
