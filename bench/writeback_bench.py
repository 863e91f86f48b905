#!/usr/bin/env python3
"""Write-back that keeps up (issue 25; a benchmark, not a test).

The emulated datacenter of datacenter.py, with the base image and the
deltas on two storage servers (two nbdkit instances over the same image
directory, the same --delay each, one counting the base's traffic and one
the delta's), so base reads are counted apart. Every cell gets a fresh
delta over the same full base. Contenders, measured in the same run:

  qemu-nbd           the delta straight from the storage server
  qemu-nbd-xl2       the same on a delta created with extended_l2=on
  vdcache-wb         vdcache serve, flash cache in write-back mode
  vdcache-wb-xl2     the same on an extended-L2 delta

Experiments (--experiments):

  sustained   4 KiB random writes at queue depth 16 for --runtime seconds
              with a cache (--cache-size) well below the data written, IOPS
              logged every second; then a clean stop (SIGTERM: vdcache
              writes everything back), timed. Per contender: mean IOPS, IOPS
              over the last seconds, drain time at the stop, and storage-
              server requests and bytes per guest write counted through the
              drain; plot of IOPS over time.
  drain       --drain-mib MiB of 4 KiB random writes (the same offsets for
              every contender) into a fresh delta. qemu-nbd: the time it
              takes inline plus its stop; vdcache (cache large enough to
              hold it all, so nothing is written back meanwhile): the time
              of `vdcache flush` plus the stop.
  foreground  vdcache with --fg-mib MiB dirty: 4 KiB random reads at queue
              depth 16 of data not in the cache, idle, then (a fresh cell
              with the same dirty data) while `vdcache flush` drains it.

Tables (Markdown and JSON) go to --out and stdout; each ends with the
issue's acceptance checks and whether this run met them.

Usage: bench/writeback_bench.py [--experiments sustained,drain,foreground]
                                [--runtime S] [--size SIZE] [--cache-size SIZE]
                                [--delay MS] [--drain-mib N] [--vdcache PATH]
                                [--label NAME] [--out DIR] [--quick]
"""

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from datacenter import (REPO, Contender, StorageServer, fio_job, fresh_delta, log, parse_size, plot,
                        require_tools, run)

MIB = 1 << 20
EXPERIMENTS = ("sustained", "drain", "foreground")
# Issue 25's done-when figures.
SUSTAINED_MIN = {False: 2.0, True: 1.5}
DRAIN_MAX = 1.2
XL2_WRITTEN_MAX = 1.1
FOREGROUND_MIN = 0.5


def kind(xl2):
    return "extended L2" if xl2 else "standard"


def verdict(ok):
    return "met" if ok else "NOT met"


class Spec:
    """One contender: qemu-nbd or vdcache write-back, on a standard or an
    extended-L2 delta."""

    def __init__(self, vdcache, xl2):
        self.vdcache = vdcache
        self.xl2 = xl2
        self.label = ("vdcache-wb" if vdcache else "qemu-nbd") + ("-xl2" if xl2 else "")


SPECS = [Spec(False, False), Spec(False, True), Spec(True, False), Spec(True, True)]


def read_iops_log(path):
    """fio's averaged IOPS log: [(seconds since the job started, IOPS)]."""
    points = []
    for line in path.read_text().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 2 and f[0].isdigit():
            points.append((int(f[0]) / 1000, float(f[1])))
    return points


def read_completions(path):
    """Completion times (seconds since the job started) from fio's
    per-I/O latency log."""
    out = []
    for line in path.read_text().splitlines():
        f = line.split(",", 1)
        if f[0].strip().isdigit():
            out.append(int(f[0]) / 1000)
    return out


def per_second(times):
    """[(second, completions in it)]."""
    counts = {}
    for t in times:
        counts[int(t)] = counts.get(int(t), 0) + 1
    return [(k, counts.get(k, 0)) for k in range(int(max(times, default=0)) + 1)]


def p99(ms):
    # fio's latency histogram ends at about 17.2 s: a p99 there means "at least".
    return f">= {ms:.0f} (fio's last bucket)" if ms >= 17000 else f"{ms:.2f}"


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


class Bench:
    def __init__(self, a, work):
        self.a = a
        self.work = work
        self.images = work / "images"
        self.images.mkdir(parents=True, exist_ok=True)
        self.delta_srv = StorageServer(work, self.images, a.delay, name="delta-server")
        self.base_srv = StorageServer(work, self.images, a.delay, name="base-server")
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.sections = []
        self.data = {}

    # -- cells -------------------------------------------------------------
    def base(self):
        """A full base image (every cluster written), once per run."""
        p = self.images / "base.qcow2"
        if not p.exists():
            log(f"writing the base image ({self.a.size_bytes >> 20} MiB)")
            run(["qemu-img", "create", "-q", "-f", "qcow2", str(p), str(self.a.size_bytes)])
            run(["qemu-io", "-c", f"write -P 0xab 0 {self.a.size_bytes}", str(p)])
        return "base.qcow2"

    def serve(self, spec, cache_size, extra=()):
        """Starts both storage servers and the contender on a fresh delta."""
        os.sync()
        base = self.base()
        self.base_srv.start()
        self.delta_srv.start()
        image = fresh_delta(self.images, self.base_srv, "delta.qcow2", self.a.size_bytes, backing=base,
                            extended_l2=spec.xl2)
        if spec.vdcache:
            # The base lives on a storage server of its own: allowed by name.
            args = ["--cache", "{cache}", "--cache-size", cache_size, "--cache-mode", "writeback",
                    "--allow-backing", self.base_srv.uri(""), *self.a.vdcache_args, *extra]
            c = Contender(spec.label, self.work, self.a.vdcache, args)
        else:
            c = Contender("qemu-nbd", self.work, self.a.vdcache)
        try:
            c.start(self.delta_srv.uri(image))
        except BaseException:
            self.servers_stop()
            raise
        return c

    def servers_stop(self):
        """Stops both storage servers; returns what they served."""
        base = self.base_srv.stop_counts()
        delta = self.delta_srv.stop_counts()
        return {"requests": base["requests"] + delta["requests"],
                "base_requests": base["requests"], "delta_requests": delta["requests"],
                "base_read": base["bytes"]["read"], "delta_read": delta["bytes"]["read"],
                "read": base["bytes"]["read"] + delta["bytes"]["read"],
                "written": sum(s["bytes"][k] for s in (base, delta) for k in ("write", "zero")),
                "ops": {"base": base["ops"], "delta": delta["ops"]}}

    def timed_stop(self, c):
        """SIGTERM and wait (vdcache writes every dirty block back first);
        returns (seconds, exit code, stderr tail). A stop that outlasts
        --stop-timeout is killed and shows exit code -9."""
        t = time.monotonic()
        c.stop(timeout=self.a.stop_timeout)
        secs = time.monotonic() - t
        err = c.proc.stderr.read() if c.proc.stderr else ""
        if c.proc.returncode != 0:
            log(f"{c.name} exited with {c.proc.returncode}: {err[-2000:]}")
        return secs, c.proc.returncode, err[-2000:]

    def flush_cmd(self, c):
        return [str(self.a.vdcache), "flush", "--socket", c.sock]

    def finish(self, name, title, lines, rows):
        text = f"## {title}\n\n" + "\n".join(lines) + "\n"
        print(text, flush=True)
        self.sections.append(text)
        self.data[name] = rows
        self.save()

    def prefix(self, name):
        return self.out / (f"{self.a.label}-{name}" if self.a.label else name)

    def save(self):
        """Writes the report so far (after every experiment, so a later
        failure keeps the earlier tables)."""
        a = self.a
        stem = self.out / (a.label or "writeback")
        head = [f"# Write-back that keeps up (issue 25){' — ' + a.label if a.label else ''}", "",
                f"`bench/writeback_bench.py {' '.join(a.argv)}`", "",
                f"- vdcache: `{a.vdcache}` ({a.version}, sha256 {a.sha[:12]})",
                f"- storage servers: nbdkit file plugin, {a.delay} ms delay per request, base and delta "
                "on two instances so base reads are counted apart; server figures count every request "
                "both served while the contender ran, including its stop",
                f"- base image {a.size} (full, pattern), a fresh delta per cell; guest: fio nbd engine, "
                f"4 KiB, queue depth {a.depth}",
                f"- vdcache serve `--cache-mode writeback` {' '.join(a.vdcache_args)}".rstrip(),
                f"- machine: {os.cpu_count()} CPUs, load at start {a.load}; {time.strftime('%Y-%m-%d %H:%M')}",
                ""]
        stem.with_suffix(".md").write_text("\n".join(head) + "\n" + "\n".join(self.sections))
        meta = {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, list))}
        stem.with_suffix(".json").write_text(json.dumps({"params": meta, **self.data}, indent=1))

    # -- sustained ---------------------------------------------------------
    def sustained(self):
        a = self.a
        rows, series = [], []
        for spec in SPECS:
            c = self.serve(spec, a.cache_size)
            logp = self.work / f"iops-{spec.label}"
            stats = None
            try:
                job = fio_job(c.uri(), "randwrite", "4k", a.depth, a.size, a.runtime, self.work,
                              [f"--write_iops_log={logp}", "--log_avg_msec=1000"])
                stats = c.stats()
            finally:
                drain, rc, err = self.timed_stop(c)
                srv = self.servers_stop()
            points = read_iops_log(Path(f"{logp}_iops.1.log"))
            end = max((t for t, _ in points), default=0)
            tail = mean([v for t, v in points if t > end - a.tail])
            w = job["write"]
            writes, guest = w["total_ios"], w["io_bytes"]
            total = ((stats or {}).get("cache") or {}).get("total") or {}
            row = {"contender": spec.label, "xl2": spec.xl2, "iops": w["iops"], "tail_iops": tail,
                   "runtime_s": job.get("job_runtime", w["runtime"]) / 1000, "guest_writes": writes,
                   "guest_bytes": guest, "drain_s": drain, "exit": rc,
                   "effective_iops": writes / max(job.get("job_runtime", w["runtime"]) / 1000 + drain, 1e-9),
                   "dirty_at_end": ((stats or {}).get("cache") or {}).get("dirty_bytes"),
                   "written_back_during_run": total.get("backend_bytes_written"),
                   "server": srv, "iops_log": points}
            if rc != 0:
                row["stderr"] = err
            rows.append(row)
            series.append({"name": spec.label, "points": [[t, v] for t, v in points]})
            g = max(guest, 1)
            log(f"sustained {spec.label:15} {w['iops']:8.0f} IOPS, last {a.tail} s {tail:8.0f}, drain {drain:7.1f} s, "
                f"server requests/write {srv['requests'] / max(writes, 1):6.2f}, read/guest {srv['read'] / g:6.2f}, "
                f"written/guest {srv['written'] / g:6.2f}")
        lines = [f"4 KiB random writes, queue depth {a.depth}, {a.runtime} s (fio time_based) over the "
                 f"{a.size} image; vdcache cache {a.cache_size}. Drain: the clean stop after fio "
                 "(SIGTERM until exit; vdcache writes every dirty block back). Effective IOPS: guest "
                 "writes / (fio run + drain). Server figures count through the drain; requests are per "
                 "guest write, bytes per guest byte. Dirty at end: vdcache's dirty bytes when fio ended; "
                 "written back: its backend bytes written during fio.", "",
                 f"| contender | delta | IOPS (mean) | IOPS last {a.tail} s | vs qemu-nbd (mean / last) | "
                 "drain s | effective IOPS | server requests / write | server read / guest byte | base read / "
                 "guest byte | server written / guest byte | dirty at end MiB | written back during run MiB |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            q = next(x for x in rows if x["contender"] == ("qemu-nbd-xl2" if r["xl2"] else "qemu-nbd"))
            g, s = max(r["guest_bytes"], 1), r["server"]
            ratio = "" if r is q else (f"{r['iops'] / max(q['iops'], 1e-9):.2f} / "
                                       f"{r['tail_iops'] / max(q['tail_iops'], 1e-9):.2f}")
            mib = lambda v: "-" if v is None else f"{v / MIB:.1f}"
            lines.append(f"| {r['contender']} | {kind(r['xl2'])} | {r['iops']:.0f} | {r['tail_iops']:.0f} | {ratio} | "
                         f"{r['drain_s']:.1f}{'' if r['exit'] == 0 else ' (exit ' + str(r['exit']) + ')'} | "
                         f"{r['effective_iops']:.0f} | {s['requests'] / max(r['guest_writes'], 1):.2f} | "
                         f"{s['read'] / g:.3f} | {s['base_read'] / g:.3f} | {s['written'] / g:.3f} | "
                         f"{mib(r['dirty_at_end'])} | {mib(r['written_back_during_run'])} |")
        lines += ["", "Checks (issue 25: sustained vdcache write-back IOPS >= 2x qemu-nbd on a standard delta, "
                      ">= 1.5x on an extended-L2 delta; taken over the whole run and over its last "
                      f"{a.tail} s, both must hold):"]
        for xl2 in (False, True):
            v = next(x for x in rows if x["contender"] == ("vdcache-wb-xl2" if xl2 else "vdcache-wb"))
            q = next(x for x in rows if x["contender"] == ("qemu-nbd-xl2" if xl2 else "qemu-nbd"))
            m, t = v["iops"] / max(q["iops"], 1e-9), v["tail_iops"] / max(q["tail_iops"], 1e-9)
            need = SUSTAINED_MIN[xl2]
            lines.append(f"- {kind(xl2)} delta: mean {m:.2f}x, last {a.tail} s {t:.2f}x (need >= {need}): "
                         f"{verdict(m >= need and t >= need)}; drain at stop {v['drain_s']:.1f} s"
                         f"{'' if v['exit'] == 0 else ', stop did not end cleanly (exit ' + str(v['exit']) + ')'}")
        self.finish("sustained", "Sustained random writes", lines, rows)
        plot(a.vdcache, {"kind": "line", "title": f"4 KiB random writes QD{a.depth}, cache {a.cache_size}, "
                                                  f"storage {a.delay} ms",
                         "x_label": "time (s)", "y_label": "IOPS (1 s average)", "series": series},
             self.prefix("sustained"))

    # -- drain -------------------------------------------------------------
    def drain(self):
        a = self.a
        rows = []
        for spec in SPECS:
            # What opening and closing the chain alone costs the servers (headers,
            # tables): the base reads beyond it are reads of base data.
            self.timed_stop(self.serve(spec, a.drain_cache))
            opened = self.servers_stop()
            c = self.serve(spec, a.drain_cache)
            before = after = None
            flush_s = 0.0
            try:
                t0 = time.monotonic()
                job = fio_job(c.uri(), "randwrite", "4k", a.depth, a.size, None, self.work,
                              [f"--io_size={a.drain_mib}m"])
                fio_wall = time.monotonic() - t0
                if spec.vdcache:
                    before = c.stats()
                    t1 = time.monotonic()
                    run(self.flush_cmd(c))
                    flush_s = time.monotonic() - t1
                    after = c.stats()
            finally:
                stop_s, rc, err = self.timed_stop(c)
                srv = self.servers_stop()
            w = job["write"]
            fio_s = job.get("job_runtime", w["runtime"]) / 1000
            cache = (before or {}).get("cache") or {}
            row = {"contender": spec.label, "xl2": spec.xl2, "guest_writes": w["total_ios"],
                   "guest_bytes": w["io_bytes"], "fio_s": fio_s, "fio_wall_s": fio_wall, "iops": w["iops"],
                   "flush_s": flush_s, "stop_s": stop_s, "exit": rc,
                   # qemu-nbd writes inline: its time is the writes plus the stop's flush;
                   # vdcache's is the write-back alone.
                   "time_s": flush_s + stop_s if spec.vdcache else fio_s + stop_s,
                   "dirty_before_flush": cache.get("dirty_bytes"),
                   "written_back_during_fio": (cache.get("total") or {}).get("backend_bytes_written"),
                   "dirty_after_flush": ((after or {}).get("cache") or {}).get("dirty_bytes"),
                   "server": srv, "open_only": opened,
                   "base_read_beyond_open": srv["base_read"] - opened["base_read"]}
            if rc != 0:
                row["stderr"] = err
            rows.append(row)
            g = max(row["guest_bytes"], 1)
            log(f"drain {spec.label:15} fio {fio_s:6.2f} s flush {flush_s:6.2f} s stop {stop_s:6.2f} s -> {row['time_s']:6.2f} s, "
                f"requests {srv['requests']}, read/guest {srv['read'] / g:6.3f} (base {srv['base_read'] / g:6.3f}), "
                f"written/guest {srv['written'] / g:6.3f}")
        lines = [f"{a.drain_mib} MiB of 4 KiB random writes (fio --io_size, queue depth {a.depth}, the same offsets "
                 f"for every contender) into a fresh delta over the full {a.size} base. qemu-nbd: fio's run plus "
                 f"the stop (its final flush). vdcache (cache {a.drain_cache}, so nothing is written back while "
                 "fio runs): `vdcache flush` (writes every dirty block back) plus the stop. Server figures "
                 "count the whole cell (fio, flush, stop). Base bytes read beyond open: the base server's "
                 "bytes read less what a cell that only starts and stops the same contender reads (headers "
                 "and tables of the chain).", "",
                 "| contender | delta | fio s | flush s | stop s | time s | vs qemu-nbd | server requests | "
                 "requests vs qemu-nbd | server read / guest byte | base read / guest byte | "
                 "base bytes read beyond open | server written / guest byte | dirty before flush MiB | "
                 "written back during fio MiB |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            q = next(x for x in rows if x["contender"] == ("qemu-nbd-xl2" if r["xl2"] else "qemu-nbd"))
            g, s = max(r["guest_bytes"], 1), r["server"]
            mib = lambda v: "-" if v is None else f"{v / MIB:.2f}"
            vs = "" if r is q else f"{r['time_s'] / max(q['time_s'], 1e-9):.2f}"
            req = "" if r is q else f"{s['requests'] / max(q['server']['requests'], 1):.2f}"
            lines.append(f"| {r['contender']} | {kind(r['xl2'])} | {r['fio_s']:.2f} | "
                         f"{r['flush_s']:.2f} | {r['stop_s']:.2f} | {r['time_s']:.2f} | {vs} | {s['requests']} | {req} | "
                         f"{s['read'] / g:.3f} | {s['base_read'] / g:.3f} | {r['base_read_beyond_open']:.0f} | "
                         f"{s['written'] / g:.3f} | {mib(r['dirty_before_flush'])} | {mib(r['written_back_during_fio'])} |")
        lines += ["", f"Checks (issue 25: drain <= {DRAIN_MAX}x qemu-nbd's inline time with no more server requests; "
                      f"on extended L2, server bytes written per guest byte <= {XL2_WRITTEN_MAX} and no base reads):"]
        for xl2 in (False, True):
            v = next(x for x in rows if x["contender"] == ("vdcache-wb-xl2" if xl2 else "vdcache-wb"))
            q = next(x for x in rows if x["contender"] == ("qemu-nbd-xl2" if xl2 else "qemu-nbd"))
            t = v["time_s"] / max(q["time_s"], 1e-9)
            req = v["server"]["requests"] / max(q["server"]["requests"], 1)
            line = (f"- {kind(xl2)} delta: drain {t:.2f}x inline (need <= {DRAIN_MAX}): {verdict(t <= DRAIN_MAX)}; "
                    f"requests {v['server']['requests']} vs {q['server']['requests']} ({req:.2f}x, need <= 1): "
                    f"{verdict(req <= 1)}")
            if xl2:
                wr = v["server"]["written"] / max(v["guest_bytes"], 1)
                br = v["base_read_beyond_open"]
                line += (f"; written / guest byte {wr:.3f} (need <= {XL2_WRITTEN_MAX}): {verdict(wr <= XL2_WRITTEN_MAX)}; "
                         f"base bytes read beyond opening the chain {br:.0f} (need 0): {verdict(br <= 0)}")
            lines.append(line)
        self.finish("drain", "Drain", lines, rows)
        plot(a.vdcache, {"kind": "bar", "title": f"Writing {a.drain_mib} MiB of 4 KiB random writes back",
                         "x_label": "delta", "y_label": "seconds",
                         "categories": [kind(False), kind(True)],
                         "series": [{"name": "qemu-nbd inline + stop",
                                     "values": [r["time_s"] for r in rows if not r["contender"].startswith("vdcache")]},
                                    {"name": "vdcache flush + stop",
                                     "values": [r["time_s"] for r in rows if r["contender"].startswith("vdcache")]}]},
             self.prefix("drain"))

    # -- foreground --------------------------------------------------------
    def foreground(self):
        a = self.a
        rows = []
        for spec in (s for s in SPECS if s.vdcache):
            cells = {}
            for phase in ("idle", "drain"):
                # --keep-dirty: the stop after the measurement need not write anything back.
                c = self.serve(spec, a.drain_cache, ["--keep-dirty"])
                logp = self.work / f"fg-{spec.label}-{phase}"
                flush = None
                flush_s = None
                try:
                    fio_job(c.uri(), "randwrite", "4k", a.depth, a.size, None, self.work, [f"--io_size={a.fg_mib}m"])
                    dirty = ((c.stats() or {}).get("cache") or {}).get("dirty_bytes")
                    if phase == "drain":
                        t0 = time.monotonic()
                        flush = subprocess.Popen(self.flush_cmd(c), stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)
                    # Another seed than the writes': reads of data the cache does not hold
                    # (but for the share of blocks the writes made dirty). Every completion
                    # is logged, so the reads done while the flush ran can be counted.
                    job = fio_job(c.uri(), "randread", "4k", a.depth, a.size, a.fg_runtime, self.work,
                                  ["--randseed=4242", f"--write_lat_log={logp}"])
                    if flush:
                        out, err = flush.communicate(timeout=a.stop_timeout)
                        flush_s = time.monotonic() - t0
                        if flush.returncode != 0:
                            raise SystemExit(f"vdcache flush failed ({flush.returncode}): {err}")
                finally:
                    if flush and flush.poll() is None:
                        flush.kill()
                        flush.wait()
                    stop_s, rc, _ = self.timed_stop(c)
                    self.servers_stop()
                done = read_completions(Path(f"{logp}_clat.1.log"))
                r = job["read"]
                run_s = job.get("job_runtime", r["runtime"]) / 1000
                cell = {"iops": r["iops"], "p99_ms": r["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e6,
                        "dirty": dirty, "flush_s": flush_s, "stop_s": stop_s, "exit": rc, "fio_s": run_s,
                        "per_second": per_second(done)}
                if flush_s is not None:
                    # The reads completed while the flush ran (fio starts just after it).
                    window = min(flush_s, run_s)
                    cell["window_s"] = window
                    cell["during_iops"] = (sum(1 for t in done if t <= window) / window) if window >= 0.5 else None
                cells[phase] = cell
                log(f"foreground {spec.label:15} {phase:5} {r['iops']:8.0f} IOPS over {run_s:.1f} s"
                    + (f", flush {flush_s:.1f} s, IOPS while it ran {cell['during_iops'] or float('nan'):.0f}"
                       if flush_s is not None else ""))
            idle, dr = cells["idle"], cells["drain"]
            during = dr["during_iops"]
            rows.append({"contender": spec.label, "xl2": spec.xl2, "idle_iops": idle["iops"],
                         "idle_p99_ms": idle["p99_ms"], "drain_window_iops": dr["iops"], "drain_p99_ms": dr["p99_ms"],
                         "during_iops": during, "flush_s": dr["flush_s"], "window_s": dr["window_s"],
                         "ratio": None if during is None else during / max(idle["iops"], 1e-9),
                         "dirty": dr["dirty"], "cells": cells})
        lines = [f"vdcache with {a.fg_mib} MiB of 4 KiB random writes dirty in its cache ({a.drain_cache}); then "
                 f"4 KiB random reads, queue depth {a.depth}, {a.fg_runtime} s (time-based), of blocks the cache does not hold "
                 "(another seed than the writes'), read from the storage server: idle, and in a second cell with "
                 "the same dirty data (served with --keep-dirty, which only changes the stop) while `vdcache flush` (started with fio) writes it back. IOPS during "
                 "drain: reads completed while the flush ran / the time it ran (or fio's run, if shorter); "
                 "whole run: fio's figures for its whole run in that cell (it ends late when reads stall: "
                 "time-based fio waits for the reads in flight).", "",
                 "| contender | delta | dirty MiB | idle IOPS | idle p99 ms | flush s | seconds measured | "
                 "IOPS during drain | during / idle | whole run IOPS | whole run p99 ms | whole run s |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            during = "-" if r["during_iops"] is None else f"{r['during_iops']:.0f}"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            lines.append(f"| {r['contender']} | {kind(r['xl2'])} | {(r['dirty'] or 0) / MIB:.1f} | {r['idle_iops']:.0f} | "
                         f"{r['idle_p99_ms']:.2f} | {r['flush_s']:.1f} | {r['window_s']:.1f} | {during} | {ratio} | "
                         f"{r['drain_window_iops']:.0f} | {p99(r['drain_p99_ms'])} | {r['cells']['drain']['fio_s']:.1f} |")
        lines += ["", f"Checks (issue 25: foreground reads during a drain >= {FOREGROUND_MIN} of idle):"]
        for r in rows:
            if r["ratio"] is None:
                lines.append(f"- {kind(r['xl2'])} delta: not measured, the drain ({r['flush_s']:.1f} s) was too "
                             "short; raise --fg-mib")
            else:
                lines.append(f"- {kind(r['xl2'])} delta: {r['ratio']:.2f} of idle over {r['window_s']:.1f} s "
                             f"(need >= {FOREGROUND_MIN}): {verdict(r['ratio'] >= FOREGROUND_MIN)}")
        self.finish("foreground", "Foreground reads during a drain", lines, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiments", default=",".join(EXPERIMENTS))
    ap.add_argument("--runtime", type=int, help="seconds of the sustained run (default 150; quick 20)")
    ap.add_argument("--tail", type=int, help="the last seconds of the sustained run reported apart (default 30; quick 10)")
    ap.add_argument("--size", help="base image and delta size (default 1g; quick 256m)")
    ap.add_argument("--cache-size", help="vdcache cache in the sustained run (default 256m; quick 64m)")
    ap.add_argument("--drain-cache", default="2g",
                    help="vdcache cache in the drain and foreground cells: holds all their writes")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--depth", type=int, default=16, help="fio queue depth")
    ap.add_argument("--drain-mib", type=int, help="MiB written in the drain experiment (default 32; quick 8)")
    ap.add_argument("--fg-mib", type=int, help="MiB dirty in the foreground experiment (default 128; quick 32)")
    ap.add_argument("--fg-runtime", type=int, help="seconds of foreground reads (default 8; quick 4)")
    ap.add_argument("--stop-timeout", type=int, default=1800,
                    help="seconds a stop or flush may take before it is killed (and reported)")
    ap.add_argument("--vdcache-args", default="", help="more `vdcache serve` arguments (one shell-quoted string)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--label", default="",
                    help="name of the report (OUT/LABEL.md, .json, LABEL-*.svg; default writeback.md, sustained.svg...)")
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(REPO / "results" / "writeback"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    a.argv = sys.argv[1:]
    q = a.quick
    for name, full, quick in (("runtime", 150, 20), ("tail", 30, 10), ("size", "1g", "256m"),
                              ("cache_size", "256m", "64m"), ("drain_mib", 32, 8), ("fg_mib", 128, 32),
                              ("fg_runtime", 8, 4)):
        if getattr(a, name) is None:
            setattr(a, name, quick if q else full)
    a.size_bytes = parse_size(a.size)
    for s in (a.cache_size, a.drain_cache):
        parse_size(s)
    if a.tail > a.runtime:
        raise SystemExit(f"--tail {a.tail} is longer than --runtime {a.runtime}")
    if (a.drain_mib << 20) > a.size_bytes or (a.fg_mib << 20) > a.size_bytes:
        raise SystemExit("--drain-mib and --fg-mib must fit in --size")
    a.vdcache_args = shlex.split(a.vdcache_args)
    chosen = [e for e in a.experiments.split(",") if e]
    for e in chosen:
        if e not in EXPERIMENTS:
            raise SystemExit(f"unknown experiment {e!r}; experiments: {', '.join(EXPERIMENTS)}")
    require_tools(a.vdcache)
    a.vdcache = str(Path(a.vdcache).resolve())
    a.version = run([a.vdcache, "--version"]).stdout.strip()
    a.sha = hashlib.sha256(Path(a.vdcache).read_bytes()).hexdigest()
    a.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    work = Path(a.workdir or tempfile.mkdtemp(prefix="vdcache-wb-bench-"))
    bench = Bench(a, work)
    try:
        for e in chosen:
            getattr(bench, e)()
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    log(f"report: {bench.out / (a.label or 'writeback')}.md")


if __name__ == "__main__":
    main()
