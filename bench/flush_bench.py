#!/usr/bin/env python3
"""Guest flushes under load (a benchmark, not a test).

The emulated datacenter of nbd_bench.py (nbdkit storage server with a delay
and byte and flush counting), one image, and two workloads where guests
flush often:

  fsync-writers       four writers, 4 KiB random writes at queue depth 1,
                      each followed by a flush (a database's commits)
  reads-beside-fsync  a writer as above at queue depth 4, and a reader of
                      a warm 64 MiB working set at queue depth 8 beside it

Contenders: qemu-nbd straight from the storage server, and vdcache serve
with a flash cache in writeback and in writethrough mode. Per row and
contender: IOPS and p99 of each job, and syncs per guest flush of the
storage server and of the cache device.

Usage: bench/flush_bench.py [--runtime S] [--size SIZE] [--delay MS]
                            [--vdcache PATH] [--out FILE]
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from datacenter import REPO, Contender, StorageServer, log, parse_size, require_tools, run

ROWS = ("fsync-writers", "reads-beside-fsync")


def jobs(row, runtime):
    """fio job options (after the global ones) for a row."""
    timed = ["--time_based", f"--runtime={runtime}"]
    if row == "fsync-writers":
        return ["--name=writers", "--rw=randwrite", "--iodepth=1", "--fsync=1", "--numjobs=4",
                "--group_reporting", *timed]
    return ["--name=warm", "--rw=read", "--bs=1m", "--iodepth=4", "--size=64m",
            "--name=writer", "--stonewall", "--rw=randwrite", "--iodepth=4", "--fsync=1",
            "--offset=128m", "--size=64m", *timed,
            "--name=reader", "--rw=randread", "--iodepth=8", "--size=64m", *timed]


def run_fio(uri, row, runtime, cwd):
    """Returns {job: (IOPS, p99 ms)} and the number of guest flushes."""
    cmd = ["fio", "--ioengine=nbd", f"--uri={uri}", "--bs=4k", "--size=64m", "--randrepeat=1",
           "--output-format=json", *jobs(row, runtime)]
    out = run(cmd, cwd=cwd).stdout
    result, flushes = {}, 0
    for job in json.loads(out[out.index("{"):])["jobs"]:
        if job["jobname"] == "warm":
            continue
        side = job["write"] if job["write"]["total_ios"] else job["read"]
        p99 = side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e6
        result[job["jobname"]] = (side["iops"], p99)
        flushes += job.get("sync", {}).get("total_ios", 0)
    return result, flushes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=8, help="seconds per row and contender")
    ap.add_argument("--size", default="256m", help="image size")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--out", default=str(REPO / "results" / "flush-bench.md"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    require_tools(a.vdcache)
    size = parse_size(a.size)
    work = Path(tempfile.mkdtemp(prefix="vdcache-flush-bench-"))
    images = work / "images"
    images.mkdir()
    log(f"creating the image ({size >> 20} MiB)")
    image = images / "disk.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), str(size)])
    run(["qemu-io", "-c", f"write -P 0xab 0 {size}", str(image)])
    storage = StorageServer(work, images, a.delay)
    cache = ["--cache", "{cache}", "--cache-size", "1g", "--cache-mode"]
    contenders = [Contender("qemu-nbd", work, a.vdcache),
                  Contender("vdcache-writeback", work, a.vdcache, cache + ["writeback"]),
                  Contender("vdcache-writethrough", work, a.vdcache, cache + ["writethrough"])]
    lines = [f"Storage server: nbdkit file plugin, {a.delay} ms delay per request; client: fio nbd "
             f"engine; {a.runtime} s per cell; image {a.size}. Syncs per guest flush: flushes the "
             "storage server received (including a clean stop's), and syncs of the cache device, "
             "per flush fio issued.", "",
             "| row | contender | job | IOPS | p99 ms | server syncs / flush | cache syncs / flush |",
             "|---|---|---|---:|---:|---:|---:|"]
    for row in ROWS:
        for c in contenders:
            os.sync()
            storage.start()
            c.start(storage.uri("disk.qcow2"))
            try:
                result, flushes = run_fio(c.uri(), row, a.runtime, work)
                stats = c.stats()
            finally:
                c.stop()
                _, _, server_syncs = storage.stop()
            flushes = max(flushes, 1)
            cache_syncs = "-" if stats is None else f"{stats['cache']['device']['syncs'] / flushes:.2f}"
            for job, (iops, p99) in result.items():
                log(f"{row:20} {c.name:22} {job:8} {iops:9.0f} IOPS  p99 {p99:8.3f} ms")
                lines.append(f"| {row} | {c.name} | {job} | {iops:.0f} | {p99:.3f} "
                             f"| {server_syncs / flushes:.2f} | {cache_syncs} |")
    table = "\n".join(lines) + "\n"
    print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(table)
    log(f"table written to {a.out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
