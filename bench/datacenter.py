"""The emulated datacenter the bench scripts share (a library, not a script).

A storage server (nbdkit: file plugin over a directory of image files,
delay filter adding network latency, stats filter counting the bytes and
flushes it serves) holds the qcow2 images; a contender (qemu-nbd, or
vdcache serve with or without a flash cache) serves a chain from it over a
Unix socket; fio's nbd engine drives the contender.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def parse_size(s):
    m = re.fullmatch(r"(\d+)([kKmMgGtT]?)", s)
    if not m:
        raise SystemExit(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]


def require_tools(vdcache, tools=("nbdkit", "qemu-nbd", "qemu-img", "qemu-io", "fio")):
    import shutil
    for tool in tools:
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing (apt-get install -y qemu-utils nbdkit fio)")
    if not Path(vdcache).exists():
        log("building vdcache (release)")
        subprocess.run(["cargo", "build", "--release", "-p", "vdcache"], cwd=REPO, check=True)


def wait_for_socket(path, proc, what, timeout=30):
    """Waits until something accepts connections on a Unix socket."""
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

    def __init__(self, work, images, delay_ms, name="storage", request_log=None):
        """request_log: a file for nbdkit's log filter (one line per request
        as it arrives, with a timestamp), or None (no log filter)."""
        self.sock = str(work / f"{name}.sock")
        self.stats = work / f"{name}-stats.txt"
        self.images = images
        self.delay_ms = delay_ms
        self.request_log = request_log
        self.proc = None

    def uri(self, name):
        return f"nbd+unix:///{name}?socket={self.sock}"

    def start(self):
        if self.stats.exists():
            self.stats.unlink()
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        logging = []
        if self.request_log:
            Path(self.request_log).unlink(missing_ok=True)
            logging = ["--filter=log", f"logfile={self.request_log}"]
        self.proc = subprocess.Popen(
            ["nbdkit", "--foreground", "--unix", self.sock, "--threads", "64", *logging[:1],
             "--filter=stats", "--filter=delay", "file", f"dir={self.images}",
             f"rdelay={self.delay_ms}ms", f"wdelay={self.delay_ms}ms", f"statsfile={self.stats}",
             *logging[1:]],
            stderr=subprocess.PIPE, text=True)
        wait_for_socket(self.sock, self.proc, "nbdkit")

    def stop(self):
        """Stops the server and returns (bytes read, bytes written, flushes)."""
        c = self.stop_counts()
        return c["bytes"]["read"], c["bytes"]["write"] + c["bytes"]["zero"], c["ops"].get("flush", 0)

    def stop_counts(self):
        """Stops the server and returns what it served, per request kind:
        {"ops": {kind: requests}, "bytes": {kind: bytes}, "requests": all
        requests} (kinds as the stats filter names them: read, write, zero,
        trim, flush, extents...)."""
        stop(self.proc)
        text = self.stats.read_text() if self.stats.exists() else ""
        ops = {}
        out = {"read": 0.0, "write": 0.0, "zero": 0.0, "trim": 0.0}
        for line in text.splitlines():
            m = re.match(r"(\w+): (\d+) ops, [\d.]+ s, ([\d.]+) (\w+)", line)
            if not m or m.group(1) == "total":
                continue
            op, n, val, unit = m.group(1), int(m.group(2)), float(m.group(3)), m.group(4)
            ops[op] = n
            if op in out:
                out[op] = val * UNITS.get(unit, 1)
        return {"ops": ops, "bytes": out, "requests": sum(ops.values())}


class Contender:
    """qemu-nbd (name "qemu-nbd"), nbdkit's memory plugin (name
    "ram-ceiling": no image, no storage server; what the client reaches
    against a server that only copies memory), or vdcache serve with `args`
    (cache flags, --cow, metadata cache sizes...); a new cache file per
    start."""

    def __init__(self, name, work, vdcache, args=()):
        self.name = name
        self.sock = str(work / f"{name}.sock")
        self.work = work
        self.vdcache = vdcache
        self.args = list(args)
        self.proc = None

    @property
    def cache_file(self):
        return self.work / f"{self.name}-flash.img"

    def start(self, image_uri):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        if self.name == "qemu-nbd":
            cmd = ["qemu-nbd", "-k", self.sock, "-t", "-f", "qcow2", "--cache=writeback",
                   "--discard=unmap", image_uri]
        elif self.name == "ram-ceiling":
            cmd = ["nbdkit", "-f", "-U", self.sock, "memory", *self.args]
        else:
            if self.cache_file.exists():
                self.cache_file.unlink()
            args = [str(self.cache_file) if a == "{cache}" else a for a in self.args]
            cmd = [str(self.vdcache), "serve", "--socket", self.sock, "-f", "qcow2", *args, image_uri]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        wait_for_socket(self.sock, self.proc, self.name)

    def stats(self):
        """The server's statistics (vdcache only), or None."""
        if self.name in ("qemu-nbd", "ram-ceiling"):
            return None
        out = run([str(self.vdcache), "stats", "--json", "--socket", self.sock]).stdout
        return json.loads(out)

    def stop(self, timeout=600):
        stop(self.proc, signal.SIGTERM, timeout=timeout)

    def uri(self):
        return f"nbd+unix:///?socket={self.sock}"


def fio_job(uri, rw, bs, depth, size, runtime, cwd, extra=()):
    """Runs one fio job; returns its JSON result (fio's "jobs"[0])."""
    cmd = ["fio", "--name=row", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={depth}", f"--size={size}", "--randrepeat=1", "--random_generator=tausworthe64",
           "--output-format=json", *extra]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    out = run(cmd, cwd=cwd).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]


def fio(uri, rw, bs, depth, size, runtime, cwd, extra=()):
    """Runs one fio job; returns (IOPS, p99 ms, guest bytes, writes, reads)."""
    job = fio_job(uri, rw, bs, depth, size, runtime, cwd, extra)
    r, w = job["read"], job["write"]
    iops = r["iops"] + w["iops"]
    side = w if w["io_bytes"] >= r["io_bytes"] else r
    p99 = side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e6
    return iops, p99, r["io_bytes"] + w["io_bytes"], w["total_ios"], r["total_ios"]


def fresh_delta(images, storage, name, size, backing="base.qcow2", room=None, extended_l2=False):
    """A new, empty delta (backing file on the storage server, or none);
    extended_l2: with QEMU's 32 subclusters per cluster."""
    p = images / name
    if p.exists():
        p.unlink()
    cmd = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if extended_l2:
        cmd += ["-o", "extended_l2=on"]
    if backing:
        cmd += ["-u", "-b", storage.uri(backing), "-F", "qcow2"]
    run(cmd + [str(p), str(size)])
    # An NBD export cannot grow: give the file room for every cluster and
    # its metadata (the zeroed tail is free space to qcow2).
    os.truncate(p, room if room is not None else size + size // 8 + (64 << 20))
    return name


def plot(vdcache, spec, out_prefix):
    """Draws a chart (see `vdcache plot --help`) to OUT.svg and OUT.png."""
    spec_path = Path(str(out_prefix) + ".json")
    spec_path.write_text(json.dumps(spec, indent=1))
    run([str(vdcache), "plot", str(spec_path), "--out", str(out_prefix)])
