#!/usr/bin/env python3
"""Sync amplification: storage-server syncs per guest flush (a benchmark, not a test).

The emulated datacenter of nbd_bench.py: nbdkit's file plugin over a
directory of images, the delay filter adding --delay ms to every read and
write, the stats filter counting bytes and flushes, and the log filter
timestamping every request. The delay filter cannot delay flushes: a flush
costs what the file plugin's own fdatasync costs, so the image directory
must be on a disk-backed file system, not tmpfs. The work directory is a
new one under /work/bench-work (a real disk here) unless --work DIR names
one; the script refuses tmpfs.

Each contender serves the same fresh qcow2 delta (64 KiB clusters) over a
full base (every byte written), recreated per contender per row:

  qemu-nbd             straight from the storage server (--cache=writeback,
                       as flush_bench.py)
  vd-nocache           vdcache serve, no cache, its defaults (the metadata
                       journal on: --metadata-journal auto)
  vd-nocache-j-off     the same with --metadata-journal off
  vd-wt                vdcache serve, 1 GiB flash cache in writethrough mode,
                       its defaults (journal on)
  vd-wt-j-off          the same with --metadata-journal off

Rows:

  fsync-qd1  fio nbd engine, 4 KiB random writes over the whole disk,
             --fsync=1, queue depth 1, one job, --runtime seconds
  fsync-qd8  the same at queue depth 8. fio then does not wait for the
             writes in flight before a flush: it issues a flush whenever
             the writes it has issued are a multiple of 1 (so after each
             write, and sometimes several in a row), with up to 8 writes
             and flushes in flight together; an NBD flush covers only
             writes completed before it. fio reports about one flush per
             write.
  varmail    filebench's varmail over a raw disk, emulated with libnbd on
             one connection (--users concurrent "threads", fixed --seed):
             the disk is carved into 1000 file slots of 32 KiB and a 4 KiB
             "inode" block per slot. One op is one file's life: create
             (inode block + first 16 KiB, then a flush), append (next 8 KiB
             + inode block, then a flush), read the whole 24 KiB, delete
             (trim the file's range + rewrite its inode block, then a
             flush). Ops/s counts whole lives; p99 is a life's latency.

Per row and contender: IOPS (fio's write IOPS; varmail: ops/s), p99 in ms,
the ratio to qemu-nbd's IOPS in the same run, guest flushes, storage-server
syncs per guest flush and server bytes written per guest byte written, both
counted by the log filter between the start and the end of the workload (the
contender's own start and stop are not in them; the flushes they cost are in
the "start+stop syncs" column: the stats filter's total minus the timed part),
and the contender's CPU time (user and system, from /proc) per guest flush.

Tables (Markdown and JSON) go to --out (default results/sync/): sync.md,
sync.json.

Usage: bench/sync_bench.py [--rows fsync-qd1,fsync-qd8,varmail] [--runtime S]
                           [--size SIZE] [--delay MS] [--vdcache PATH]
                           [--work DIR] [--quick] [--out DIR]
"""

import argparse
import json
import os
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from datacenter import REPO, Contender, StorageServer, fio_job, fresh_delta, log, parse_size, require_tools, run

ROWS = ("fsync-qd1", "fsync-qd8", "varmail")
WORK = Path("/work/bench-work")
KIB = 1 << 10
SLOT, INODE, FILES = 32 * KIB, 4 * KIB, 1000


def stamp():
    """Now, as nbdkit's log filter writes it (local time): comparable as text."""
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def window(request_log, t0, t1):
    """Requests the storage server received between t0 and t1 (stamps):
    {"flushes", "written" (write and zero bytes), "read"}."""
    out = {"flushes": 0, "written": 0, "read": 0}
    pat = re.compile(r"(\S+ \S+) connection=\d+ (\w+) id=\d+(?: offset=0x[0-9a-f]+ count=0x([0-9a-f]+))?")
    for line in Path(request_log).read_text().splitlines():
        m = pat.match(line)
        if not m or not t0 <= m.group(1) <= t1:
            continue
        kind, count = m.group(2), int(m.group(3) or "0", 16)
        if kind == "Flush":
            out["flushes"] += 1
        elif kind in ("Write", "Zero"):
            out["written"] += count
        elif kind == "Read":
            out["read"] += count
    return out


def cpu_seconds(pid):
    """User plus system CPU time of process `pid` so far (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fsync_row(uri, depth, size, runtime, cwd):
    job = fio_job(uri, "randwrite", "4k", depth, size, runtime, cwd, ["--fsync=1"])
    w = job["write"]
    p99 = w["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e6
    return {"iops": w["iops"], "p99_ms": p99, "guest_flushes": job.get("sync", {}).get("total_ios", 0),
            "guest_written": w["io_bytes"]}


def import_nbd():
    try:
        import nbd
    except ImportError:
        # Debian's python3-libnbd, under another build of the same Python.
        sys.path.append("/usr/lib/python3/dist-packages")
        try:
            import nbd
        except ImportError:
            raise SystemExit("the libnbd Python bindings are missing (apt-get install -y python3-libnbd)")
    return nbd


def varmail(uri, size, runtime, users, seed):
    """The varmail emulation (see the docstring) on one NBD connection,
    `users` file lives in flight at a time."""
    nbd = import_nbd()
    h = nbd.NBD()
    h.connect_uri(uri)
    data = -(-FILES * INODE // (1 << 20)) << 20
    files = min(FILES, (size - data) // SLOT)
    if files < users:
        raise SystemExit(f"image too small for varmail ({files} file slots)")
    rng = random.Random(seed)
    buf = lambda n: nbd.Buffer.from_bytearray(bytearray(rng.randbytes(n)))
    first, append, reads = buf(16 * KIB), buf(8 * KIB), [nbd.Buffer(24 * KIB) for _ in range(users)]
    inodes = [buf(INODE) for _ in range(users)]
    trim = h.can_trim()
    free = list(range(files))
    n = {"ops": 0, "flushes": 0, "written": 0}
    lat = []

    def life(u, slot):
        ino, off = slot * INODE, data + slot * SLOT
        yield [("w", inodes[u], ino), ("w", first, off)]
        yield [("f",)]
        yield [("w", append, off + 16 * KIB), ("w", inodes[u], ino)]
        yield [("f",)]
        yield [("r", reads[u], off)]
        yield [("t" if trim else "z", 24 * KIB, off), ("w", inodes[u], ino)]
        yield [("f",)]

    def issue(cmd):
        kind = cmd[0]
        if kind == "w":
            n["written"] += len(cmd[1])
            return h.aio_pwrite(cmd[1], cmd[2])
        if kind == "f":
            n["flushes"] += 1
            return h.aio_flush()
        if kind == "r":
            return h.aio_pread(cmd[1], cmd[2])
        return (h.aio_trim if kind == "t" else h.aio_zero)(cmd[1], cmd[2])

    state = [None] * users  # per user: [generator, cookies in flight, start, slot]
    t0 = time.monotonic()
    deadline = t0 + runtime
    while True:
        busy = False
        for u in range(users):
            st = state[u]
            if st is not None:
                st[1] = [c for c in st[1] if not h.aio_command_completed(c)]
                if st[1]:
                    busy = True
                    continue
                cmds = next(st[0], None)
                if cmds is None:
                    n["ops"] += 1
                    lat.append(time.monotonic() - st[2])
                    free.append(st[3])
                    state[u] = st = None
            if st is None:
                if time.monotonic() >= deadline:
                    continue
                slot = free.pop(rng.randrange(len(free)))
                st = state[u] = [life(u, slot), [], time.monotonic(), slot]
                cmds = next(st[0])
            st[1] = [issue(c) for c in cmds]
            busy = True
        if not busy:
            break
        if h.aio_in_flight():
            h.poll(-1)
    elapsed = time.monotonic() - t0
    h.shutdown()
    lat.sort()
    return {"iops": n["ops"] / elapsed, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3 if lat else 0.0,
            "guest_flushes": n["flushes"], "guest_written": n["written"], "ops": n["ops"], "trim": trim}


def cell(a, storage, c, row, images, work, size):
    image = fresh_delta(images, storage, "delta.qcow2", size, backing="base.qcow2")
    os.sync()
    storage.start()
    c.start(storage.uri(image))
    try:
        t0 = stamp()
        cpu0 = cpu_seconds(c.proc.pid)
        if row == "varmail":
            r = varmail(c.uri(), size, a.runtime, a.users, a.seed)
        else:
            r = fsync_row(c.uri(), 1 if row == "fsync-qd1" else 8, size, a.runtime, work)
        t1 = stamp()
        r["server_cpu_s"] = cpu_seconds(c.proc.pid) - cpu0
        stats = c.stats()
    finally:
        c.stop()
        total = storage.stop_counts()
    w = window(storage.request_log, t0, t1)
    r.update(row=row, contender=c.name, server_flushes=w["flushes"], server_written=w["written"],
             server_read=w["read"], total_flushes=total["ops"].get("flush", 0),
             startstop_flushes=total["ops"].get("flush", 0) - w["flushes"],
             cache_device=((stats or {}).get("cache") or {}).get("device"),
             journal=[d.get("journal") for d in (stats or {}).get("disks", [])])
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="rows to run, comma-separated")
    ap.add_argument("--runtime", type=int, help="seconds per cell (default 6; --quick: 2)")
    ap.add_argument("--size", default="256m", help="image size")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency per read and write in ms")
    ap.add_argument("--users", type=int, default=16, help="varmail: file lives in flight at a time")
    ap.add_argument("--seed", type=int, default=1, help="varmail: random seed")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (2 s per cell)")
    ap.add_argument("--work", help=f"scratch directory on a disk-backed file system, kept afterwards "
                                   f"(default: a new one under {WORK}, removed afterwards)")
    ap.add_argument("--out", default=str(REPO / "results" / "sync"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    # Leaves out --metadata-journal off (for a vdcache without the flag): the
    # default and j-off contenders are then the same server.
    ap.add_argument("--no-journal-flag", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.runtime = a.runtime or (2 if a.quick else 6)
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"unknown row {r!r}; rows: {', '.join(ROWS)}")
    size = parse_size(a.size)
    require_tools(a.vdcache)
    if "varmail" in rows:
        import_nbd()
    if not a.no_journal_flag and "--metadata-journal" not in run([a.vdcache, "serve", "--help"]).stdout:
        raise SystemExit(f"{a.vdcache} serve has no --metadata-journal: rebuild it, or pass --no-journal-flag "
                         "to measure without the flag (journal on and off the same)")
    if a.work:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        WORK.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="sync-", dir=WORK))
    fs = run(["stat", "-f", "-c", "%T", str(work)]).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        raise SystemExit(f"{work} is on {fs}: flushes would cost nothing; use --work on a disk")
    images = work / "images"
    images.mkdir(exist_ok=True)
    storage = StorageServer(work, images, a.delay, request_log=work / "requests.log")
    log(f"writing the base image ({size >> 20} MiB) in {work}")
    base = images / "base.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), str(size)])
    run(["qemu-io", "-c", f"write -P 0x5a 0 {size}", str(base)])
    off = [] if a.no_journal_flag else ["--metadata-journal", "off"]
    cache = ["--cache", "{cache}", "--cache-size", "1g", "--cache-mode", "writethrough"]
    contenders = [Contender("qemu-nbd", work, a.vdcache),
                  Contender("vd-nocache", work, a.vdcache),
                  Contender("vd-nocache-j-off", work, a.vdcache, off),
                  Contender("vd-wt", work, a.vdcache, cache),
                  Contender("vd-wt-j-off", work, a.vdcache, cache + off)]
    results = []
    try:
        for row in rows:
            for c in contenders:
                r = cell(a, storage, c, row, images, work, size)
                results.append(r)
                log(f"{row:10} {c.name:17} {r['iops']:8.0f} IOPS  p99 {r['p99_ms']:8.3f} ms  "
                    f"{r['guest_flushes']:6} flushes  {r['server_flushes'] / max(r['guest_flushes'], 1):.2f} syncs/flush  "
                    f"start+stop {r['startstop_flushes']}")
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    command = shlex.join(sys.argv)
    lines = [f"Command: `{command}`", "",
             f"Storage server: nbdkit file plugin on a disk-backed file system ({fs}, {work.parent if not a.work else work}), "
             f"delay filter {a.delay} ms per read and write (flushes cost the file plugin's fdatasync), stats and "
             f"log filters; image {a.size}, a fresh delta (64 KiB clusters) over a full base per cell; {a.runtime} s "
             "per cell. IOPS: fio's write IOPS (varmail: file lives per second, see the script); p99: write "
             "completion (varmail: a whole life). Server syncs per flush and bytes written per guest byte: what "
             "the storage server received between the start and the end of the workload; start+stop syncs: "
             "the flushes of the contender's start and stop (stats filter total minus the timed part). Server CPU: "
             "the contender's user and system time during the workload (/proc), per guest flush (at fsync rows, per "
             "guest write and its flush).", ""]
    if a.no_journal_flag:
        lines += ["**--no-journal-flag: `--metadata-journal off` was not passed; the default and j-off "
                  "contenders are the same server.**", ""]
    lines += ["| row | contender | IOPS | p99 ms | vs qemu-nbd | guest flushes | server syncs / flush | "
              "start+stop syncs | server written / guest byte | server CPU us / guest flush |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        q = next((x for x in results if x["row"] == r["row"] and x["contender"] == "qemu-nbd"), None)
        vs = "-" if r["contender"] == "qemu-nbd" or not q else f"{r['iops'] / max(q['iops'], 1e-9):.2f}"
        lines.append(f"| {r['row']} | {r['contender']} | {r['iops']:.0f} | {r['p99_ms']:.3f} | {vs} | "
                     f"{r['guest_flushes']} | {r['server_flushes'] / max(r['guest_flushes'], 1):.3f} | "
                     f"{r['startstop_flushes']} | {r['server_written'] / max(r['guest_written'], 1):.3f} | "
                     f"{r['server_cpu_s'] * 1e6 / max(r['guest_flushes'], 1):.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync.md").write_text(table)
    (out / "sync.json").write_text(json.dumps({"command": command, "args": vars(a), "cells": results}, indent=1))
    log(f"tables written to {out / 'sync.md'} and {out / 'sync.json'}")


if __name__ == "__main__":
    main()
