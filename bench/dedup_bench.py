#!/usr/bin/env python3
"""Eight clones sharing one deduplicating flash cache (issue 21, done-when
item 2; a benchmark, not a test).

The emulated datacenter of datacenter.py: one storage server (nbdkit, file
plugin, --delay ms per request, byte counts) holds an empty base image and
one fresh qcow2 delta over it per clone; ONE `vdcache serve --config` serves
the --clones deltas as exports clone0, clone1... through ONE write-back
flash cache (--cache-size, big enough to hold every write, so nothing is
evicted or written back while fio runs). fio's nbd engine is the guest:
4 KiB random writes at queue depth --depth per clone, every block of the
range written once (fio's random map), then the same blocks read back at
the same depth (--flush: each clone's writes end with a guest flush, and
its time includes it). The clones run one after another (--parallel: all at once,
one fio process per clone), so each clone's writes can find the blocks of
the clones before it. The base stays empty so every block entering flash is a
guest write (dedup of base reads is the replay sweep's business).

Phases (each its own cells):

  duplicates  every clone writes the SAME --size-mib MiB of content (fio's
              buffers from one --randseed), clone i at offset
              i * (size/2 + 1 MiB): the same blocks at other addresses of
              other disks.
  unique      each clone writes its own content (one seed per clone).

Modes, each with a fresh cache and fresh deltas: dedup off, dedup on, dedup
on with --dedup-verify (bytes compared before sharing). Every (phase, mode)
cell runs --repeat times, the modes' order rotated each time; IOPS are the
medians (a clone's run lasts a fraction of a second on this 2-CPU machine
shared with others: single runs are noisy, and the quick run's tens of
milliseconds only show that everything works).

fio's buffers (refill_buffers, scramble_buffers=0) depend only on the seed
and the queue depth, not on timing or the engine: the script writes each
seed's content once to nbdkit's memory plugin and hashes it (sha256 of the
range, and the 4 KiB blocks it holds). Verification compares each clone's
range read through vdcache after the writes (what the guest sees) and,
after vdcache's clean stop wrote every dirty block back, the range of its
delta on the storage server (what survives), with that reference.

Per cell: write and read-back IOPS (guest I/Os / the fio runs' seconds),
flash data bytes written (cache.device.data_bytes_written, also in copies
of --size-mib), vdcache's dedup ratio and blocks shared, BLAKE3 ns per
4 KiB block (hash_nanos / hashed_blocks), index and signature-table memory
per cached byte, storage-server bytes (including the stop's write-back),
the stop's seconds, warnings and errors in vdcache's log. Tables
(Markdown and JSON) and plots go to --out; each table ends with the
issue's checks and whether this run met them.

Usage: bench/dedup_bench.py [--size-mib N] [--clones N] [--cache-size SIZE]
                            [--delay MS] [--depth N] [--repeat N] [--parallel] [--flush] [--quick]
                            [--label NAME] [--out DIR] [--vdcache PATH]
                            [--workdir DIR]
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from datacenter import REPO, StorageServer, fresh_delta, log, parse_size, plot, require_tools, run, stop, \
    wait_for_socket

MIB = 1 << 20
BLOCK = 4096
PHASES = ("duplicates", "unique")
# mode -> [cache] keys
MODES = {"off": {"dedup": "off"}, "on": {"dedup": "on"}, "verify": {"dedup": "on", "dedup_verify": True}}
# Issue 21, done-when item 2.
FLASH_COPIES_MAX = 1.3
IOPS_MIN = {"unique": 0.9, "duplicates": 1.0}  # unique: >= 0.9x; duplicates: > 1x
MEMORY_MAX = 0.0035  # index memory with dedup per cached byte (a Build aim)
SEEDS = {"duplicates": lambda i: 1000, "unique": lambda i: 2000 + i}

# Every process the script started and has not stopped yet: ended on any exit.
PROCS = []


def verdict(ok):
    return "met" if ok else "NOT met"


def spawn(cmd, **kw):
    p = subprocess.Popen(cmd, **kw)
    PROCS.append(p)
    return p


def interrupted(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the finally blocks stop what runs


def fio_args(a, rw, offset, seed):
    """One fio job's options. fio fills every write buffer anew from its
    buffer generator (seeded by --randseed) and scrambles nothing (its
    default scramble writes the offset and a timestamp into each buffer,
    which would defeat dedup): the same seed and queue depth give the same
    bytes at the same place of the range, whatever the timing."""
    flush = ["--end_fsync=1"] if a.flush and rw == "randwrite" else []
    return [f"--rw={rw}", "--bs=4k", f"--iodepth={a.depth}", f"--size={a.size_mib}m", f"--offset={offset}",
            f"--randseed={seed}", "--random_generator=tausworthe64", "--refill_buffers=1",
            "--scramble_buffers=0", *flush]


def fio_cmd(name, uri, opts):
    return ["fio", "--ioengine=nbd", "--output-format=json", f"--name={name}", f"--uri={uri}", *opts]


def fio_result(out):
    """fio's JSON job, with the time its process reported (ms since the epoch)."""
    d = json.loads(out[out.index("{"):])
    return {**d["jobs"][0], "end_ms": d["timestamp_ms"]}


def run_fio(jobs, cwd):
    """Runs fio jobs [(name, uri, options)] at once, one fio process each
    (fio multiplies --randseed by a job's number within its process: jobs
    sharing one would get different buffers); returns each job's JSON."""
    procs = [spawn(fio_cmd(*j), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for j in jobs]
    outs = []
    for p in procs:
        out, err = p.communicate()
        PROCS.remove(p)
        if p.returncode != 0:
            raise RuntimeError(f"fio failed ({p.returncode}): {err}")
        outs.append(fio_result(out))
    return outs


def digest(cmd, blocks=False):
    """sha256 of the bytes an NBD export gives (nbdcopy, source `cmd`: a URI,
    or a server command in nbdcopy's [ ... ] form), and with `blocks` the set
    of its 4 KiB blocks (16-byte BLAKE2b each)."""
    p = spawn(["nbdcopy", "--", *cmd, "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    whole, found, n, rest = hashlib.sha256(), set(), 0, b""
    for chunk in iter(lambda: p.stdout.read(1 << 20), b""):
        whole.update(chunk)
        n += len(chunk)
        if not blocks:
            continue
        buf = rest + chunk
        cut = len(buf) - len(buf) % BLOCK
        found.update(hashlib.blake2b(buf[i:i + BLOCK], digest_size=16).digest() for i in range(0, cut, BLOCK))
        rest = buf[cut:]
    err = p.stderr.read().decode()
    p.wait()
    PROCS.remove(p)
    if p.returncode != 0:
        raise RuntimeError(f"nbdcopy {' '.join(cmd)} failed: {err}")
    return whole.hexdigest(), found, n


def stats_of(vdcache, sock):
    return json.loads(run([vdcache, "stats", "--json", "--socket", sock]).stdout)


def cpu_seconds(pid):
    """User + system CPU time of a process, all its threads."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def log_problems(path):
    """vdcache's warnings and errors (text log lines)."""
    if not path.exists():
        return []
    return [l.strip() for l in path.read_text(errors="replace").splitlines()
            if " WARN " in l or " ERROR " in l or "panicked" in l]


class Bench:
    def __init__(self, a, work):
        self.a = a
        self.work = work
        self.images = work / "images"
        self.images.mkdir(parents=True, exist_ok=True)
        self.storage = StorageServer(work, self.images, a.delay)
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.refs = {}
        self.rows = []
        self.summaries = {}
        self.sections = []

    def offset(self, i):
        return i * (self.a.size_mib // 2 + 1) * MIB

    # -- reference contents ------------------------------------------------
    def reference(self, seed):
        """(sha256, block set) of what fio writes with `seed`: once, into
        nbdkit's memory plugin."""
        if seed not in self.refs:
            sock = str(self.work / "ref.sock")
            Path(sock).unlink(missing_ok=True)
            p = spawn(["nbdkit", "--foreground", "--unix", sock, "memory", f"{self.a.size_mib}M"],
                      stderr=subprocess.PIPE)
            try:
                wait_for_socket(sock, p, "nbdkit memory")
                uri = f"nbd+unix:///?socket={sock}"
                run_fio([("ref", uri, fio_args(self.a, "randwrite", 0, seed))], self.work)
                sha, blocks, _ = digest([uri], blocks=True)
            finally:
                stop(p)
                PROCS.remove(p)
            self.refs[seed] = (sha, blocks)
        return self.refs[seed]

    # -- one cell ----------------------------------------------------------
    def config(self, mode, cache, sock):
        """A vdcache config: one cache, one export per clone."""
        keys = {"path": str(cache), "size": self.a.cache_size, "mode": "writeback",
                # Every write enters flash: no sequential run may bypass it (fio's random
                # map leaves short sequential runs near the end of a range).
                "sequential_write_cutoff": "0", **MODES[mode]}
        toml = [f'[server]\nsocket = "{sock}"\n', "[cache]"]
        toml += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
        for i in range(self.a.clones):
            toml += ["", "[[export]]", f'name = "clone{i}"', f'image = "{self.storage.uri(f"clone{i}.qcow2")}"',
                     'format = "qcow2"']
        path = self.work / f"vdcache-{mode}.toml"
        path.write_text("\n".join(toml) + "\n")
        return path

    def cell(self, phase, mode, rep):
        a = self.a
        seeds = [SEEDS[phase](i) for i in range(a.clones)]
        refs = [self.reference(s) for s in seeds]
        os.sync()
        self.storage.start()
        deltas = [fresh_delta(self.images, self.storage, f"clone{i}.qcow2", a.image_bytes) for i in range(a.clones)]
        sock = str(self.work / "vdcache.sock")
        cache = self.work / "flash.img"
        for p in (Path(sock), cache):
            if p.exists():
                p.unlink()
        vlog = self.work / f"vdcache-{phase}-{mode}-{rep}.log"
        with open(vlog, "w") as f:
            v = spawn([a.vdcache, "serve", "--config", str(self.config(mode, cache, sock))], stderr=f)
        row = {"phase": phase, "mode": mode, "repeat": rep, "seeds": seeds}
        try:
            try:
                wait_for_socket(sock, v, "vdcache")
            except SystemExit as e:
                raise SystemExit(f"{e}; its log:\n{vlog.read_text()[-3000:]}") from None
            uris = [f"nbd+unix:///clone{i}?socket={sock}" for i in range(a.clones)]
            # vdcache's CPU time per guest write: steadier than IOPS on a shared machine, and
            # what fingerprinting adds (and a skipped flash write saves) on the write path.
            cpu = cpu_seconds(v.pid)
            row["write"] = self.guest(uris, "randwrite", seeds)
            row["write"]["cpu_us_per_io"] = (cpu_seconds(v.pid) - cpu) * 1e6 / max(row["write"]["ios"], 1)
            after_writes = stats_of(a.vdcache, sock)
            row["read"] = self.guest(uris, "randread", seeds)
            # The guest's view: each clone's range through vdcache, against the reference.
            row["read_back_ok"] = [
                digest(["[", "nbdkit", "--exit-with-parent", "--filter=offset", "nbd", f"socket={sock}",
                        f"export=clone{i}", f"offset={self.offset(i)}", f"range={a.size_mib}M", "]"])[0] == refs[i][0]
                for i in range(a.clones)]
            final = stats_of(a.vdcache, sock)
        finally:
            t = time.monotonic()
            stop(v, timeout=a.stop_timeout)  # a clean stop writes every dirty block back
            row["stop_s"] = time.monotonic() - t
            row["exit"] = v.returncode
            PROCS.remove(v)
            row["server"] = self.storage.stop_counts()
        # What survives: each delta's range on the storage server (read from its file;
        # every cluster of the range was written, so the empty base is not needed).
        row["delta_ok"] = [
            digest(["[", "qemu-nbd", "json:" + json.dumps(
                {"driver": "raw", "offset": self.offset(i), "size": a.size_mib * MIB,
                 "file": {"driver": "qcow2", "backing": None,
                          "file": {"driver": "file", "filename": str(self.images / d)}}}), "]"])[0]
            == refs[i][0] for i, d in enumerate(deltas)]
        row["log_problems"] = log_problems(vlog)
        row["ideal_unique_blocks"] = len(set().union(*(r[1] for r in refs)))
        self.measure(row, after_writes, final)
        cache.unlink(missing_ok=True)
        return row

    def guest(self, uris, rw, seeds):
        """fio on every clone's range (one after another, or all at once with
        --parallel); returns I/Os, seconds (the runs' sum, or from the first
        parallel job's start to the last one's end) and IOPS."""
        a = self.a
        jobs = [(f"clone{i}", u, fio_args(a, rw, self.offset(i), seeds[i])) for i, u in enumerate(uris)]
        if a.parallel:
            res = run_fio(jobs, self.work)
            # From the first job's start to the last one's end (the processes start apart).
            secs = (max(j["end_ms"] for j in res) - min(j["end_ms"] - j["job_runtime"] for j in res)) / 1000
        else:
            res = [run_fio([j], self.work)[0] for j in jobs]
            secs = sum(j["job_runtime"] for j in res) / 1000
        side = "write" if rw == "randwrite" else "read"
        ios = sum(j[side]["total_ios"] for j in res)
        return {"ios": ios, "secs": secs, "iops": ios / max(secs, 1e-9),
                "per_clone_iops": [j[side]["iops"] for j in res]}

    def measure(self, row, after_writes, final):
        a = self.a
        c, cw = final["cache"], after_writes["cache"]
        total, dd = c.get("total") or {}, c.get("dedup") or {}
        cached = max(c.get("cached_bytes") or 0, 1)
        row.update({
            "flash_data_bytes": c["device"]["data_bytes_written"],
            "flash_data_bytes_after_writes": cw["device"]["data_bytes_written"],
            "flash_copies": c["device"]["data_bytes_written"] / (a.size_mib * MIB),
            "guest_write_bytes": total.get("guest_write_bytes"),
            "dedup_ratio": dd.get("ratio"), "unique_blocks": dd.get("unique_blocks"),
            "signatures": dd.get("signatures"), "dedup_counts": dd.get("counts"),
            "blocks_shared": total.get("dedup_blocks_shared", 0),
            "hashed_blocks": total.get("hashed_blocks", 0),
            "hash_ns_per_block": total["hash_nanos"] / total["hashed_blocks"] if total.get("hashed_blocks") else None,
            "cached_bytes": c.get("cached_bytes"),
            # vdcache's own figure: index memory beyond its fixed part, per cached byte.
            "index_memory_ratio": c.get("index_memory_ratio"),
            "table_memory_per_cached_byte": (dd.get("table_memory_bytes") or 0) / cached,
            "stats": final,
        })

    # -- report ------------------------------------------------------------
    def summary(self, phase, mode):
        """One mode's cells over the repeats: the median IOPS and stop, the
        largest flash figure (the check's worst case), the other figures of
        the first repeat, verification and log lines of all."""
        cells = [r for r in self.rows if r["phase"] == phase and r["mode"] == mode]
        med = lambda xs: statistics.median(xs)
        worst = max(cells, key=lambda r: r["flash_data_bytes"])
        return {**cells[0], "repeats": len(cells),
                "write_iops": med([r["write"]["iops"] for r in cells]),
                "read_iops": med([r["read"]["iops"] for r in cells]),
                "write_runs": [r["write"]["iops"] for r in cells], "read_runs": [r["read"]["iops"] for r in cells],
                "runs": {r["repeat"]: {"write": r["write"]["iops"], "read": r["read"]["iops"]} for r in cells},
                "cpu_us_per_write": med([r["write"]["cpu_us_per_io"] for r in cells]),
                "stop_s": med([r["stop_s"] for r in cells]), "exits": [r["exit"] for r in cells],
                "flash_data_bytes": worst["flash_data_bytes"], "flash_copies": worst["flash_copies"],
                "hash_ns_per_block": None if cells[0]["hash_ns_per_block"] is None
                else med([r["hash_ns_per_block"] for r in cells]),
                "read_back_ok": [ok for r in cells for ok in r["read_back_ok"]],
                "delta_ok": [ok for r in cells for ok in r["delta_ok"]],
                "log_problems": [l for r in cells for l in r["log_problems"]]}

    def table(self, phase):
        a = self.a
        rows = [self.summary(phase, m) for m in MODES]
        self.summaries[phase] = rows
        off = rows[0]
        for r in rows:
            # Against dedup off in the same repeat (cells minutes apart share the machine's load):
            # the median of those ratios.
            r["vs_off"] = {k: statistics.median(r["runs"][n][k] / max(off["runs"][n][k], 1e-9) for n in r["runs"])
                           for k in ("write", "read")}
        vs = lambda r, k: "" if r is off else f"{r['vs_off'][k]:.2f}"
        pct = lambda v: "-" if v is None else f"{100 * v:.3f}"
        spread = lambda r, k: f" ({min(r[k]):.0f}-{max(r[k]):.0f})" if a.repeat > 1 else ""
        ideal = rows[0]["ideal_unique_blocks"]
        what = ("the same content at a different offset" if phase == "duplicates" else "its own content")
        lines = [f"{a.clones} clones (one vdcache, one {a.cache_size} write-back cache, {a.clones} exports), each "
                 f"writing {a.size_mib} MiB of {what}: 4 KiB random writes, queue depth {a.depth}, clones "
                 f"{'all at once' if a.parallel else 'one after another'}"
                 f"{', each ending with a flush (counted in its time)' if a.flush else ''}; then the same blocks "
                 "read back. "
                 f"{a.repeat} repeat(s), the modes' order rotated each time. IOPS: guest I/Os over the fio runs' "
                 "seconds, median (and range) over the repeats; vs off: the median over the repeats of the ratio to "
                 "dedup off in the same repeat. vdcache CPU: its user + system time over the writes per guest write "
                 "(median). Flash: cache data bytes written (whole cell; the "
                 f"largest of the repeats), and in copies of {a.size_mib} MiB. Ratio: cached addresses per distinct "
                 f"flash block (distinct 4 KiB blocks the clones wrote: {ideal}, best ratio "
                 f"{a.clones * a.size_mib * MIB // BLOCK / max(ideal, 1):.2f}). Hash: BLAKE3 ns per 4 KiB block "
                 "fingerprinted. Memory: vdcache's index memory beyond its fixed part (signature table included) "
                 "and the signature table alone, per cached byte (cached addresses, shared or not). Server: "
                 "storage-server bytes, the stop's write-back included. Stop: the clean stop's seconds (it writes "
                 "every dirty block back; median). Verified: clone ranges read through vdcache / read from the "
                 "delta after the stop that match the reference, over all repeats.", "",
                 "| dedup | write IOPS | vs off | vdcache CPU µs / write | read IOPS | vs off | flash MiB | copies | ratio | blocks shared | "
                 "hash ns / block | index mem % | table mem % | server read MiB | server written MiB | stop s | "
                 "verified read / delta | log warnings |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in rows:
            s = r["server"]["bytes"]
            ns = "-" if r["hash_ns_per_block"] is None else f"{r['hash_ns_per_block']:.0f}"
            exits = [e for e in r["exits"] if e != 0]
            lines.append(
                f"| {r['mode']} | {r['write_iops']:.0f}{spread(r, 'write_runs')} | {vs(r, 'write')} | "
                f"{r['cpu_us_per_write']:.1f} | {r['read_iops']:.0f}{spread(r, 'read_runs')} | {vs(r, 'read')} | "
                f"{r['flash_data_bytes'] / MIB:.1f} | {r['flash_copies']:.2f} | "
                f"{'-' if r['dedup_ratio'] is None else format(r['dedup_ratio'], '.2f')} | {r['blocks_shared']} | {ns} | "
                f"{pct(r['index_memory_ratio'])} | {pct(r['table_memory_per_cached_byte'])} | "
                f"{s['read'] / MIB:.1f} | {(s['write'] + s['zero']) / MIB:.1f} | {r['stop_s']:.1f}"
                f"{'' if not exits else ' (exit ' + ','.join(map(str, exits)) + ')'} | "
                f"{sum(r['read_back_ok'])}/{len(r['read_back_ok'])} / {sum(r['delta_ok'])}/{len(r['delta_ok'])} | "
                f"{len(r['log_problems'])} |")
        lines += ["", f"Checks (issue 21, done-when 2: flash data bytes written <= {FLASH_COPIES_MAX}x one copy "
                      "with dedup on; guest IOPS dedup on / off >= 0.9 on unique data, > 1 on duplicates; every "
                      "read-back verified):"]
        need = IOPS_MIN[phase]
        for r in rows[1:]:
            w = r["vs_off"]["write"]
            ok = w >= need if phase == "unique" else w > need
            # The aims are dedup on's; verify (a flash read per shared block) is shown beside it.
            line = (f"- {'' if r['mode'] == 'on' else '(for information) '}dedup {r['mode']}: write IOPS {w:.2f}x "
                    f"off (need {'>=' if phase == 'unique' else '>'} {need}): {verdict(ok)}")
            if phase == "duplicates":
                line += (f"; flash {r['flash_copies']:.2f} copies (need <= {FLASH_COPIES_MAX}): "
                         f"{verdict(r['flash_copies'] <= FLASH_COPIES_MAX)}")
            lines.append(line)
        for r in rows[1:]:
            lines.append(f"- (issue 21's Build aim, not a done-when item) index memory with dedup {r['mode']}: "
                         f"{pct(r['index_memory_ratio'])}% of cached bytes (aim <= {MEMORY_MAX:.2%}): "
                         f"{verdict(r['index_memory_ratio'] <= MEMORY_MAX)}")
        bad = [r["mode"] for r in rows if not all(r["read_back_ok"]) or not all(r["delta_ok"])]
        lines.append(f"- every read-back verified (through vdcache and in the deltas after write-back), all modes: "
                     f"{verdict(not bad)}{'' if not bad else ' (failed: ' + ', '.join(bad) + ')'}")
        for r in rows:
            if r["log_problems"] or any(r["exits"]):
                lines.append(f"- vdcache log, dedup {r['mode']} (exit {r['exits']}): "
                             + "; ".join(f"`{l[:200]}`" for l in r["log_problems"][:3]))
        text = f"## {phase.capitalize()}\n\n" + "\n".join(lines) + "\n"
        print(text, flush=True)
        self.sections.append(text)

    def save(self):
        a = self.a
        stem = self.out / (a.label or "dedup")
        head = [f"# {a.clones} clones, one deduplicating cache (issue 21){' — ' + a.label if a.label else ''}", "",
                f"`bench/dedup_bench.py {' '.join(a.argv)}`", "",
                f"- vdcache: `{a.vdcache}` ({a.version}, sha256 {a.sha[:12]})",
                f"- storage server: nbdkit file plugin, {a.delay} ms delay per request; an empty "
                f"{a.image_bytes >> 20} MiB qcow2 base, a fresh delta per clone and cell",
                f"- {a.clones} clones, {a.size_mib} MiB each, clone i at offset i * {a.size_mib // 2 + 1} MiB; "
                f"guest: fio nbd engine, 4 KiB, queue depth {a.depth}, clones "
                f"{'in parallel' if a.parallel else 'in sequence'}"
                f"{', each clone ending its writes with a flush' if a.flush else ''}",
                f"- vdcache serve --config: [cache] mode = writeback, size = {a.cache_size}, "
                "sequential_write_cutoff = 0, dedup per cell",
                f"- machine: {os.cpu_count()} CPUs, load at start {a.load}; {time.strftime('%Y-%m-%d %H:%M')}", ""]
        stem.with_suffix(".md").write_text("\n".join(head) + "\n" + "\n".join(self.sections))
        meta = {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, list))}
        stem.with_suffix(".json").write_text(json.dumps({"params": meta, "cells": self.rows}, indent=1))

    def plots(self):
        a = self.a
        prefix = lambda n: self.out / (f"{a.label}-{n}" if a.label else n)
        cell = {(p, r["mode"]): r for p, rows in self.summaries.items() for r in rows}
        for name, title, label, val in (
                ("flash", "Flash data written", f"copies of {a.size_mib} MiB", lambda r: r["flash_copies"]),
                ("iops", "Guest 4 KiB write IOPS", "IOPS", lambda r: r["write_iops"])):
            plot(a.vdcache, {"kind": "bar", "title": f"{title}, {a.clones} clones, one cache",
                             "x_label": "content", "y_label": label, "categories": list(PHASES),
                             "series": [{"name": f"dedup {m}", "values": [val(cell[(p, m)]) for p in PHASES]}
                                        for m in MODES]},
                 prefix(f"dedup-{name}"))

    def main(self):
        a = self.a
        base = self.images / "base.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), str(a.image_bytes)])
        modes = list(MODES)
        for phase in PHASES:
            for rep in range(a.repeat):
                # Each mode takes each place in the order once per len(MODES) repeats: a cell's
                # place (after the previous cell's cache file, say) biases no mode.
                for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                    log(f"{phase} / dedup {mode} (repeat {rep + 1}/{a.repeat})")
                    r = self.cell(phase, mode, rep)
                    self.rows.append(r)
                    log(f"  write {r['write']['iops']:.0f} IOPS, read {r['read']['iops']:.0f} IOPS, flash "
                        f"{r['flash_data_bytes'] / MIB:.1f} MiB ({r['flash_copies']:.2f} copies), shared "
                        f"{r['blocks_shared']}, stop {r['stop_s']:.1f} s, verified {sum(r['read_back_ok'])}+"
                        f"{sum(r['delta_ok'])}/{2 * a.clones}, log problems {len(r['log_problems'])}")
                    self.save()
            self.table(phase)
            self.save()
        self.plots()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, help="MiB each clone writes (default 128; quick 16)")
    ap.add_argument("--clones", type=int, help="clones, each an export of the one vdcache (default 8; quick 4)")
    ap.add_argument("--cache-size", help="the shared cache: holds every write (default 3g; quick 512m)")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--depth", type=int, default=16, help="fio queue depth per clone")
    ap.add_argument("--repeat", type=int, help="cells per phase and mode, the modes' order rotated (default 3; quick 1)")
    ap.add_argument("--parallel", action="store_true", help="run the clones' fio jobs at once, not one after another")
    ap.add_argument("--flush", action="store_true",
                    help="end each clone's writes with a guest flush (fio end_fsync): its time counts making them "
                         "durable, so the cache device's writes are paid in the run, not later by the kernel")
    ap.add_argument("--stop-timeout", type=int, default=1800, help="seconds vdcache's stop (write-back) may take")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--label", default="", help="name of the report (OUT/LABEL.md, .json; default dedup.md)")
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(REPO / "results" / "dedup"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    a.argv = sys.argv[1:]
    for name, full, quick in (("size_mib", 128, 16), ("clones", 8, 4), ("cache_size", "3g", "512m"),
                              ("repeat", 3, 1)):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    if a.size_mib < 2 or a.size_mib % 2 or a.clones < 2 or a.repeat < 1:
        raise SystemExit("--size-mib must be even and at least 2; --clones at least 2; --repeat at least 1")
    parse_size(a.cache_size)
    # The base and deltas: 1 GiB, or more when the last clone's range needs it.
    need = (a.clones - 1) * (a.size_mib // 2 + 1) * MIB + a.size_mib * MIB
    a.image_bytes = max(1 << 30, -(-need // (1 << 30)) << 30)
    require_tools(a.vdcache, ("nbdkit", "nbdcopy", "qemu-nbd", "qemu-img", "fio"))
    a.vdcache = str(Path(a.vdcache).resolve())
    a.version = run([a.vdcache, "--version"]).stdout.strip()
    a.sha = hashlib.sha256(Path(a.vdcache).read_bytes()).hexdigest()
    a.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also when started in the background (SIGINT ignored)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="vdcache-dedup-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(a, work)
    started = time.monotonic()
    try:
        bench.main()
    finally:
        for p in PROCS + [bench.storage.proc]:  # whatever an error or Ctrl-C left running
            if p:
                stop(p, timeout=30)
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    log(f"report: {bench.out / (a.label or 'dedup')}.md ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
