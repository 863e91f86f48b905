#!/usr/bin/env python3
"""The emulated datacenter benchmark (a benchmark, not a test).

A storage server (nbdkit: file plugin over a directory of image files,
delay filter adding network latency, stats filter counting the bytes it
serves) holds the qcow2 images; contenders serve them to fio (nbd engine)
over a Unix socket, one at a time, in one run:

  qemu-nbd        the chain straight from the storage server (no flash)
  vdcache         vdcache serve through its NBD client backend, no cache
  vdcache+cache   vdcache serve with a flash cache file (--with-cache)
  ram-ceiling     nbdkit's memory plugin, no image and no storage server
                  (--with-ceiling): the most this client reaches on this
                  machine, against a server that only copies memory

For every workload row it reports IOPS, p99 completion latency, and
storage-server bytes read and written per guest byte, with the ratio of
each vdcache contender to qemu-nbd measured in the same run. Results go to
a Markdown table on stdout and to --out.

Usage: bench/nbd_bench.py [--runtime S] [--size SIZE] [--delay MS]
                          [--with-cache] [--cache-mode MODE] [--admission POLICY]
                          [--with-ceiling]
                          [--rows a,b,...]
                          [--out FILE]
"""

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from datacenter import (REPO, Contender, StorageServer, fio, fresh_delta, log, parse_size,
                        require_tools, run)

ROWS = {
    # name: (fio rw, block size, queue depth, image, working set or None
    # for the whole image, warm the working set up first[, connections])
    "randread-4k-qd1": ("randread", "4k", 1, "disk", None, False),
    "randread-4k-qd16": ("randread", "4k", 16, "disk", None, False),
    "randwrite-4k-qd1": ("randwrite", "4k", 1, "disk", None, False),
    "randwrite-4k-qd16": ("randwrite", "4k", 16, "disk", None, False),
    "seqread-1m-qd4": ("read", "1m", 4, "disk", None, False),
    "seqwrite-1m-qd4": ("write", "1m", 4, "disk", None, False),
    "cow-randwrite-4k-qd16": ("randwrite", "4k", 16, "delta", None, False),
    # A working set that fits the flash cache, read once before measuring.
    "warm-randread-4k-qd16": ("randread", "4k", 16, "disk", "64m", True),
    # Overwrites of a working set that is cached: in write-through every
    # one supersedes a clean flash copy.
    "warm-randwrite-4k-qd16": ("randwrite", "4k", 16, "disk", "64m", True),
    # The same 16 requests in flight over two connections (as a multi-conn
    # client): one fio nbd connection is bound by its own CPU on 2 cores.
    "warm-randread-4k-2x8": ("randread", "4k", 8, "disk", "64m", True, 2),
}

def make_images(images, size):
    log(f"creating images ({size >> 20} MiB each)")
    for name in ("disk.qcow2", "base.qcow2"):
        p = images / name
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(p), str(size)])
        run(["qemu-io", "-c", f"write -P 0xab 0 {size}", str(p)])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per row and contender")
    ap.add_argument("--size", default="1g", help="image size")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--with-cache", action="store_true", help="also run vdcache with a flash cache")
    ap.add_argument("--with-ceiling", action="store_true",
                    help="also run nbdkit's memory plugin: the client's ceiling on this machine")
    ap.add_argument("--cache-size", default="2g")
    ap.add_argument("--cache-mode", default="writeback",
                    choices=["writeback", "writethrough", "writearound"],
                    help="write mode of the cached contender")
    ap.add_argument("--admission", default="all",
                    help="admission policy of the cached contender (all, hot, sequential-bypass)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(REPO / "results" / "nbd-bench.md"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    require_tools(a.vdcache)
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
        contenders.append(Contender("vdcache+cache", work, a.vdcache,
                                    ["--cache", "{cache}", "--cache-size", a.cache_size,
                                     "--cache-mode", a.cache_mode, "--admission", a.admission]))
    if a.with_ceiling:
        contenders.append(Contender("ram-ceiling", work, a.vdcache, [str(size)]))
    results = {}
    for row in rows:
        rw, bs, depth, image, working_set, warm, *conns = ROWS[row]
        connections = conns[0] if conns else 1
        spread = ("--numjobs", str(connections), "--group_reporting") if connections > 1 else ()
        span = working_set or a.size
        for c in contenders:
            # Start every contender without the previous one's dirty pages
            # still being written out under it.
            os.sync()
            storage.start()
            name = "disk.qcow2" if image == "disk" else fresh_delta(images, storage, f"delta-{c.name}.qcow2", size)
            c.start(storage.uri(name))
            flash = None
            try:
                warm_bytes = 0
                if warm:
                    # The warm-up's traffic stays in the server's counts and
                    # its bytes count as guest bytes too.
                    warm_bytes = fio(c.uri(), "read", "1m", 4, span, None, work)[2]
                iops, p99, guest, _, _ = fio(c.uri(), rw, bs, depth, span, a.runtime, work, spread)
                guest += warm_bytes
                flash = flash_written(c.stats())
            finally:
                c.stop()
                sread, swrite, flushes = storage.stop()
            g = max(guest, 1)
            results[(row, c.name)] = (iops, p99, sread / g, swrite / g, None if flash is None else flash / g)
            log(f"{row:24} {c.name:14} {iops:10.0f} IOPS  p99 {p99:8.3f} ms  server read/guest {sread / g:6.3f}  "
                f"written/guest {swrite / g:6.3f}  flash/guest {'-' if flash is None else f'{flash / g:6.3f}'}")
    table = render(rows, contenders, results, a)
    print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(table)
    log(f"table written to {a.out}; scratch in {work}")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


def flash_written(stats):
    """Bytes the flash cache wrote to its device (data and metadata zones),
    or None without a cache."""
    cache = (stats or {}).get("cache")
    if not cache:
        return None
    dev = cache["device"]
    return dev["data_bytes_written"] + dev["meta_bytes_written"]


def render(rows, contenders, results, a):
    lines = [f"Storage server: nbdkit file plugin, {a.delay} ms delay per request; client: fio nbd engine; "
             f"{a.runtime} s per cell; image {a.size}. Server bytes per guest byte count everything the "
             "storage server served while the contender ran (including a warm-up read of the working set "
             "for warm-* rows, whose bytes also count as guest bytes, and the write-back at a clean stop). "
             "Flash written / guest byte: everything the cache wrote to its device (data zone, journal, "
             "checkpoints) until the end of the run, before the write-back at the stop.", "",
             "IOPS vs vdcache: the cached contender against vdcache without a cache in the same run.",
             "", "| row | contender | IOPS | p99 ms | server read / guest byte | server written / guest byte "
             "| flash written / guest byte | IOPS vs qemu-nbd | IOPS vs vdcache |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(iops, base):
        return f"{iops / base[0]:.2f}" if base and base[0] else ""

    for row in rows:
        peer = results.get((row, "qemu-nbd"))
        uncached = results.get((row, "vdcache"))
        for c in contenders:
            iops, p99, r, w, f = results[(row, c.name)]
            flash = "-" if f is None else f"{f:.3f}"
            cached = ratio(iops, uncached) if c.name == "vdcache+cache" else ""
            lines.append(f"| {row} | {c.name} | {iops:.0f} | {p99:.3f} | {r:.3f} | {w:.3f} | {flash} "
                         f"| {ratio(iops, peer)} | {cached} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
