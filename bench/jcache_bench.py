#!/usr/bin/env python3
"""Journal-aware caching (issue 22; a benchmark, not a test).

A real ext4 with data=journal and its journal on an external journal device,
both disks coming from one emulated storage server (datacenter.py: nbdkit
file plugin, --delay ms per request; here with nbdkit's log filter too, so
the bytes it serves can be counted per image and per phase of a cell). On
the server: an empty 1 GiB qcow2 base, a fresh qcow2 delta over it per cell
(the data disk) and a raw journal image, zeroed per cell (the journal
device's home for every contender). Contenders, in the same run:

  jcache           vdcache serve (config file, FUSE) with a flash cache and
                   journal_size/journal_image/journal_aware = true: the
                   journal device's blocks live only in flash (cache-only
                   logging) and ext4's in-place writes share their logged
                   copies (logical caching)
  journal-unaware  the same with journal_aware = false: the journal device is
                   cached like any disk (its home the same raw image)
  no-cache         qemu-storage-daemon serving the delta (qcow2 over an nbd
                   node) and the journal (raw over an nbd node) straight from
                   the storage server, as FUSE exports (--no-cache vdcache:
                   vdcache serve without [cache] instead)

Both vdcache contenders run once per --cache-modes entry; no-cache once.
With vdcache's default sequential_write_cutoff (4 MiB), journal-unaware's
sequential log bypasses flash for the storage server even in write-back
mode; --sequential-write-cutoff 0 keeps it in flash (a stronger baseline).

A cell: start the storage server and the contender; a loop device on each
disk file; mkfs.ext4 -O journal_dev on the journal, mkfs.ext4 -J device= on
the data disk; mount -o data=journal,journal_path=; prefill --prefill files
and sync (setup, not timed); then the Varmail-like workload: --threads
threads for --runtime s, each looping { create a file, write 16 KiB, fsync;
append 8 KiB to a random file, fsync; read a random file whole; delete the
oldest file while more than --files exist } (4 ops an iteration, as
filebench counts them); then umount, e2fsck -fn -j (while the contender
still serves), detach the loops and stop the contender cleanly (SIGTERM;
vdcache writes dirty blocks back), timed. Every mount, loop device and
process is undone on the way out, on failure and on Ctrl-C or SIGTERM too.

Figures: ops/s, fsyncs/s; flash bytes written (vdcache's cache device, data
+ metadata, from the start of the workload to just before the stop),
journal copies shared and bytes held; storage-server bytes written (Write
payload; zeroing and trim requests carry none and are counted apart), read
and requests from the start of the workload through the stop, split into
data disk / journal and with the stop's own share; per guest byte (bytes
the workload wrote into files). Tables (Markdown and JSON) go to --out and
stdout; each ends with issue 22's aims and whether this run met them.

Usage: bench/jcache_bench.py [--runtime S] [--threads N] [--files N]
                             [--prefill N] [--delay MS] [--cache-size SIZE]
                             [--cache-modes writethrough,writeback]
                             [--journal-size SIZE] [--sequential-write-cutoff SIZE]
                             [--no-cache qsd|vdcache|none] [--quick] [--label NAME]
                             [--workdir DIR] [--out DIR] [--vdcache PATH]
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from datacenter import REPO, StorageServer, fresh_delta, log, parse_size, plot, run, stop, wait_for_socket

MIB = 1 << 20
DISK = 1 << 30
# Issue 22's aims, journal-aware against journal-unaware in the same mode.
FLASH_MAX, BACKEND_MAX, THROUGHPUT_MIN = 0.60, 0.50, 2.0
PHASES = ("setup", "workload", "unmount", "stop")  # what the log marks split


def verdict(ok):
    return "met" if ok else "NOT met"


def mib(v):
    return "-" if v is None else f"{v / MIB:.1f}"


def interrupted(*_):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: every cell's undo stack runs


class LoggedServer(StorageServer):
    """The datacenter's storage server with nbdkit's log filter on top: its
    file, written as requests arrive, can be cut at any moment (the stats
    filter only reports at exit), and names the export of each connection."""

    def start(self):
        self.logfile = Path(str(self.stats).replace("-stats.txt", "-requests.log"))
        for p in (self.stats, self.logfile, Path(self.sock)):
            if p.exists():
                p.unlink()
        self.proc = subprocess.Popen(
            ["nbdkit", "--foreground", "--unix", self.sock, "--threads", "64", "--filter=log",
             "--filter=stats", "--filter=delay", "file", f"dir={self.images}", f"rdelay={self.delay_ms}ms",
             f"wdelay={self.delay_ms}ms", f"statsfile={self.stats}", f"logfile={self.logfile}"],
            stderr=subprocess.PIPE, text=True)
        wait_for_socket(self.sock, self.proc, "nbdkit")

    def mark(self):
        return self.logfile.stat().st_size

    def phases(self, marks):
        """Requests per phase (log lines up to each mark, then the rest):
        [{image: {"requests", "read", "write", "zero", "trim", "flush"}}]."""
        out = [dict() for _ in range(len(marks) + 1)]
        export, pos = {}, 0
        req = re.compile(rb"connection=(\d+) (Read|Write|Zero|Trim|Flush|Extents|Cache) id=\d+(?: offset=\S+ count=0x([0-9a-f]+))?")
        with open(self.logfile, "rb") as f:
            for line in f:
                phase = sum(1 for m in marks if pos >= m)
                pos += len(line)
                m = req.search(line)
                if not m:
                    c = re.search(rb"connection=(\d+) Connect export=(\S+)", line)
                    if c:
                        export[c.group(1)] = c.group(2).decode().strip('"')
                    continue
                img = export.get(m.group(1), "?")
                d = out[phase].setdefault(img, {"requests": 0, "read": 0, "write": 0, "zero": 0, "trim": 0, "flush": 0})
                d["requests"] += 1
                op = m.group(2).decode().lower()
                if op in d:
                    d[op] += int(m.group(3), 16) if m.group(3) else 1
        return out


def total(phases, images=None):
    """Sums per-image counts over some phases (and some images)."""
    s = {"requests": 0, "read": 0, "write": 0, "zero": 0, "trim": 0, "flush": 0}
    for ph in phases:
        for img, d in ph.items():
            if images is None or img in images:
                for k in s:
                    s[k] += d[k]
    return s


class Varmail:
    """A Varmail-like mail server in Python threads (the system calls let go
    of the GIL). One directory, files named in creation order."""

    def __init__(self, root, threads, files, seed, file_size=16384, append_size=8192):
        self.root, self.threads, self.max_files = Path(root), threads, files
        # Varmail's sizes by default; larger files make the journal carry
        # mostly data (filebench's Createfiles), less metadata per byte.
        self.file_size, self.append_size = file_size, append_size
        self.live, self.lock, self.next = [], threading.Lock(), 0
        self.stop = threading.Event()
        rng = random.Random(seed)
        # Distinct contents (slices of a random pool), so nothing compresses
        # or deduplicates by accident.
        self.pool = rng.randbytes(max(1 << 20, 2 * file_size))
        self.seed = seed

    def data(self, rng, n):
        o = rng.randrange(0, len(self.pool) - n)
        return self.pool[o:o + n]

    def create(self, rng, size, sync=True):
        with self.lock:
            name = self.root / f"m{self.next:08d}"
            self.next += 1
        fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        try:
            os.write(fd, self.data(rng, size))
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        with self.lock:
            self.live.append(name)

    def prefill(self, n):
        rng = random.Random(self.seed - 1)
        for _ in range(n):
            self.create(rng, self.file_size, sync=False)
        os.sync()

    def worker(self, k, deadline, res):
        rng = random.Random(self.seed * 1000 + k)
        n = dict(iterations=0, guest_bytes=0, fsyncs=0, read_bytes=0, missed=0)
        try:
            while time.monotonic() < deadline and not self.stop.is_set():
                self.create(rng, self.file_size)
                n["guest_bytes"] += self.file_size
                n["fsyncs"] += 1
                try:  # (another thread may delete the file meanwhile)
                    if self.append_size:
                        with self.lock:
                            victim = rng.choice(self.live)
                        fd = os.open(victim, os.O_WRONLY | os.O_APPEND)
                        try:
                            n["guest_bytes"] += os.write(fd, self.data(rng, self.append_size))
                            os.fsync(fd)
                            n["fsyncs"] += 1
                        finally:
                            os.close(fd)
                    with self.lock:
                        victim = rng.choice(self.live)
                    with open(victim, "rb") as f:
                        n["read_bytes"] += len(f.read())
                except FileNotFoundError:
                    n["missed"] += 1
                with self.lock:
                    old = self.live.pop(0) if len(self.live) > self.max_files else None
                if old:
                    os.unlink(old)
                n["iterations"] += 1
        except OSError as e:  # (an I/O error: the contender failed; reported, not hidden)
            n["error"] = repr(e)
        res[k] = n

    def run(self, runtime):
        res = {}
        t0 = time.monotonic()
        ts = [threading.Thread(target=self.worker, args=(k, t0 + runtime, res), daemon=True)
              for k in range(self.threads)]
        for t in ts:
            t.start()
        try:
            for t in ts:
                t.join(timeout=runtime + 300)
                if t.is_alive():
                    raise RuntimeError("a workload thread hangs (contender wedged?)")
        finally:
            self.stop.set()  # (on Ctrl-C: let the threads leave the file system before it goes)
            for t in ts:
                t.join(timeout=10)
        secs = time.monotonic() - t0
        errors = [r["error"] for r in res.values() if "error" in r]
        if errors:
            raise RuntimeError(f"the workload failed: {errors}")
        out = {k: sum(r[k] for r in res.values()) for k in res[0]}
        out.update(seconds=secs, ops=4 * out["iterations"], ops_s=4 * out["iterations"] / secs,
                   fsyncs_s=out["fsyncs"] / secs, live_files=len(self.live))
        return out


def mounted(path):
    return any(l.split(" ")[1] == str(path) for l in Path("/proc/self/mounts").read_text().splitlines())


class Bench:
    def __init__(self, a, work):
        self.a, self.work = a, work
        self.images = work / "images"
        self.images.mkdir(parents=True, exist_ok=True)
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(self.images / "base.qcow2"), str(DISK)])
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows = []

    # -- contenders --------------------------------------------------------
    def start(self, contender, mode, tag, srv, err):
        """Starts a contender; returns (process, data disk file, journal
        device file, socket for `vdcache stats` or None, FUSE mounts)."""
        if contender == "no-cache" and self.a.no_cache == "qsd":
            data, jdev = self.work / f"{tag}-vm", self.work / f"{tag}-vm-journal"
            for p in (data, jdev):
                p.touch()  # a FUSE export's mountpoint is an existing regular file
            nbd = f"driver=nbd,server.type=unix,server.path={srv.sock}"
            proc = subprocess.Popen(
                ["qemu-storage-daemon",
                 "--blockdev", f"{nbd},node-name=dfile,export=delta.qcow2",
                 "--blockdev", "driver=qcow2,node-name=data,file=dfile",  # backing: the URI in its header
                 "--blockdev", f"{nbd},node-name=jfile,export=journal.raw",
                 "--blockdev", "driver=raw,node-name=journal,file=jfile",
                 "--export", f"type=fuse,id=d,node-name=data,mountpoint={data},writable=on",
                 "--export", f"type=fuse,id=j,node-name=journal,mountpoint={jdev},writable=on"], stderr=err)
            return proc, data, jdev, None, [data, jdev]
        sock, fuse, cache = self.work / f"{tag}.sock", self.work / f"{tag}-disks", self.work / f"{tag}-flash.img"
        for p in cache.parent.glob(cache.name + "*"):
            p.unlink()
        vm = f'[[export]]\nname = "vm"\nimage = "{srv.uri("delta.qcow2")}"\nformat = "qcow2"\n'
        if contender == "no-cache":  # vdcache without flash: two plain exports
            disks = vm + f'[[export]]\nname = "vm-journal"\nimage = "{srv.uri("journal.raw")}"\nformat = "raw"\n'
        else:
            cutoff = self.a.sequential_write_cutoff
            disks = (f'[cache]\npath = "{cache}"\nsize = "{self.a.cache_size}"\nmode = "{mode}"\n' +
                     (f'sequential_write_cutoff = "{cutoff}"\n' if cutoff else '') + vm +
                     f'journal_size = "{self.a.journal_bytes}"\njournal_image = "{srv.uri("journal.raw")}"\n'
                     f'journal_aware = {"true" if contender == "jcache" else "false"}\n')
        cfg = self.work / f"{tag}.toml"
        cfg.write_text(f'[server]\nsocket = "{sock}"\nfuse = "{fuse}"\n' + disks)
        proc = subprocess.Popen([self.a.vdcache, "serve", "--config", str(cfg)], stderr=err)
        return proc, fuse / "vm", fuse / "vm-journal", None if contender == "no-cache" else str(sock), [fuse]

    def stats(self, sock):
        if not sock:
            return None
        return json.loads(run([self.a.vdcache, "stats", "--json", "--socket", sock]).stdout)

    # -- one cell ----------------------------------------------------------
    def cell(self, contender, mode):
        a = self.a
        tag = f"{contender}-{mode}" if mode else contender
        log(f"cell {tag}")
        srv = LoggedServer(self.work, self.images, a.delay, name=f"storage-{tag}")
        fresh_delta(self.images, srv, "delta.qcow2", DISK)
        jraw = self.images / "journal.raw"
        if jraw.exists():
            jraw.unlink()
        jraw.touch()
        os.truncate(jraw, a.journal_bytes)
        errpath = self.work / f"{tag}.stderr"
        row = {"contender": contender, "mode": mode, "stderr_file": str(errpath)}
        marks, snaps = [], {}
        with contextlib.ExitStack() as undo, open(errpath, "w") as err:
            srv.start()
            undo.callback(lambda: row.setdefault("server_total", srv.stop_counts()))
            proc, data, jdev, sock, fuse = self.start(contender, mode, tag, srv, err)

            def stop_contender():
                t = time.monotonic()
                stop(proc, timeout=a.stop_timeout)
                row.update(stop_s=time.monotonic() - t, exit=proc.returncode)
                for p in fuse:  # never leave a (dead) FUSE mount behind
                    if mounted(p):
                        subprocess.run(["umount", "-l", str(p)])
            undo.callback(stop_contender)
            deadline = time.time() + 60
            while not all(p.exists() and p.stat().st_size > 0 for p in (data, jdev)):
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"{tag} did not show its disks: {errpath.read_text()[-2000:]}")
                time.sleep(0.05)
            loops = {}
            undo.callback(lambda: [subprocess.run(["losetup", "-d", d]) for d in loops.values()])
            for name, path in (("journal", jdev), ("data", data)):
                loops[name] = run(["losetup", "-f", "--show", str(path)]).stdout.strip()
            run(["mkfs.ext4", "-q", "-b", "4096", "-O", "journal_dev", loops["journal"]])
            run(["mkfs.ext4", "-q", "-b", "4096", "-J", f"device={loops['journal']}", loops["data"]])
            mnt = self.work / f"{tag}-mnt"
            mnt.mkdir(exist_ok=True)
            run(["mount", "-o", f"data=journal,journal_path={loops['journal']}", loops["data"], str(mnt)])
            undo.callback(lambda: mounted(mnt) and subprocess.run(["umount", "-l", str(mnt)]))
            (mnt / "mail").mkdir()
            wl = Varmail(mnt / "mail", a.threads, a.files, a.seed, a.file_size_bytes, a.append_size_bytes)
            wl.prefill(a.prefill)
            marks.append(srv.mark())
            snaps["start"] = self.stats(sock)
            row["workload"] = wl.run(a.runtime)
            snaps["end"] = self.stats(sock)
            marks.append(srv.mark())
            t = time.monotonic()
            run(["umount", str(mnt)])  # the last checkpoint: in-place writes of the journalled blocks
            row["umount_s"] = time.monotonic() - t
            fsck = subprocess.run(["e2fsck", "-fn", "-j", loops["journal"], loops["data"]],
                                  capture_output=True, text=True)
            row["fsck"] = {"exit": fsck.returncode, "output": (fsck.stdout + fsck.stderr)[-1500:]}
            for name in ("data", "journal"):
                run(["losetup", "-d", loops.pop(name)])
            snaps["before_stop"] = self.stats(sock)
            marks.append(srv.mark())
            # The rest of the cell (the stop, then the server's) is unwound here.
        row["server"] = dict(zip(PHASES, srv.phases(marks)))
        text = errpath.read_text()
        row["log_problems"] = [l for l in text.splitlines() if re.search(r"\b(WARN|ERROR)\b|panick", l)][:20]
        row["log_tail"] = text[-1500:]
        row["stop_log"] = [l for l in text.splitlines() if "stopped" in l or "kept in flash" in l]
        if sock:
            c0, c1 = snaps["start"]["cache"], snaps["before_stop"]["cache"]
            dev = lambda c: c["device"]["data_bytes_written"] + c["device"]["meta_bytes_written"]
            row["flash"] = {"written": dev(c1) - dev(c0), "written_cell": dev(c1),
                            "data_written": c1["device"]["data_bytes_written"] - c0["device"]["data_bytes_written"],
                            "journal_copies_shared": c1["total"]["journal_copies_shared"] - c0["total"]["journal_copies_shared"],
                            "journal_copy_mismatches": c1["total"]["journal_copy_mismatches"],
                            "held_bytes": c1["held_bytes"], "dirty_before_stop": c1["dirty_bytes"],
                            "journal": next((d["journal"] for d in snaps["before_stop"]["disks"]
                                             if d["export"] == "vm-journal"), None)}
            row["stats"] = snaps
        row["figures"] = self.figures(row)
        self.report_cell(row)
        self.rows.append(row)
        return row

    def report_cell(self, r):
        w, s = r["workload"], r["server"]
        run_w = total([s["workload"], s["unmount"], s["stop"]])
        f = r.get("flash") or {}
        log(f"  {w['ops_s']:.0f} ops/s, {w['fsyncs_s']:.0f} fsyncs/s; server written {run_w['write'] / MIB:.1f} MiB "
            f"(stop {total([s['stop']])['write'] / MIB:.1f}), read {run_w['read'] / MIB:.1f} MiB, "
            f"{run_w['requests']} requests; flash {f.get('written', 0) / MIB:.1f} MiB, shared "
            f"{f.get('journal_copies_shared', '-')}; umount {r['umount_s']:.1f} s, stop {r['stop_s']:.1f} s "
            f"(exit {r['exit']}), e2fsck exit {r['fsck']['exit']}, {len(r['log_problems'])} log warnings")

    # -- report ------------------------------------------------------------
    @staticmethod
    def figures(r):
        """A cell's headline figures; bytes per guest byte (bytes the
        workload wrote into files) make time-based runs of different
        speeds comparable."""
        w, s, f = r["workload"], r["server"], r.get("flash")
        g = max(w["guest_bytes"], 1)
        t = total([s["workload"], s["unmount"], s["stop"]])
        jw = total([s["workload"], s["unmount"], s["stop"]], {"journal.raw"})["write"]
        return {"ops_s": w["ops_s"], "server": t, "journal_written": jw, "stop_written": total([s["stop"]])["write"],
                "written_per_guest": t["write"] / g, "flash_per_guest": f and f["written"] / g}

    def table(self, mode, nocache):
        rows = [r for r in self.rows if r["mode"] == mode] + ([nocache] if nocache else [])
        fig = {r["contender"]: self.figures(r) for r in rows}
        lines = [f"### Cache mode {mode}", "",
                 "| contender | ops/s | fsyncs/s | vs journal-unaware | vs no-cache | flash written MiB | "
                 "flash / guest byte | journal copies shared | held MiB | server written MiB (data / journal) | "
                 "server written / guest byte | of it at stop MiB | server zeroed MiB | server read MiB | "
                 "server requests | umount s | stop s | e2fsck | log warnings |", "|---|" + "---:|" * 18]
        for r in rows:
            w, f, x = r["workload"], r.get("flash"), fig[r["contender"]]
            t, jw = x["server"], x["journal_written"]
            ratio = lambda other: (f"{w['ops_s'] / fig[other]['ops_s']:.2f}"
                                   if other in fig and other != r["contender"] else "")
            lines.append(
                f"| {r['contender']} | {w['ops_s']:.0f} | {w['fsyncs_s']:.0f} | {ratio('journal-unaware')} | "
                f"{ratio('no-cache')} | {mib(f and f['written'])} | "
                f"{'-' if not f else format(x['flash_per_guest'], '.2f')} | "
                f"{f['journal_copies_shared'] if f else '-'} | {mib(f and f['held_bytes'])} | "
                f"{t['write'] / MIB:.1f} ({(t['write'] - jw) / MIB:.1f} / {jw / MIB:.1f}) | "
                f"{x['written_per_guest']:.2f} | {x['stop_written'] / MIB:.1f} | {t['zero'] / MIB:.1f} | "
                f"{t['read'] / MIB:.1f} | {t['requests']} | {r['umount_s']:.1f} | "
                f"{r['stop_s']:.1f}{'' if r['exit'] == 0 else ' (exit ' + str(r['exit']) + ')'} | "
                f"{'clean' if r['fsck']['exit'] == 0 else 'exit ' + str(r['fsck']['exit'])} | {len(r['log_problems'])} |")
        lines += ["", f"Checks (issue 22: journal-aware against journal-unaware, {mode}: flash bytes written <= "
                      f"{FLASH_MAX}x, storage-server bytes written <= {BACKEND_MAX}x, ops/s >= {THROUGHPUT_MIN}x; "
                      "bytes compared per guest byte, as the runs are timed and do different amounts of work):"]
        j, u = fig.get("jcache"), fig.get("journal-unaware")
        if j and u:
            fr = j["flash_per_guest"] / max(u["flash_per_guest"], 1e-9)
            br = j["written_per_guest"] / max(u["written_per_guest"], 1e-9)
            tr = j["ops_s"] / max(u["ops_s"], 1e-9)
            lines += [f"- flash bytes written: {fr:.2f} (need <= {FLASH_MAX}): {verdict(fr <= FLASH_MAX)}",
                      f"- storage-server bytes written: {br:.2f} (need <= {BACKEND_MAX}): {verdict(br <= BACKEND_MAX)}",
                      f"- throughput: {tr:.2f}x (need >= {THROUGHPUT_MIN}): {verdict(tr >= THROUGHPUT_MIN)}"]
        bad = [r["contender"] for r in rows if r["fsck"]["exit"] != 0 or r["exit"] != 0]
        lines.append(f"- every file system clean (e2fsck -fn) and every stop clean: {verdict(not bad)}"
                     + (f" ({', '.join(bad)})" if bad else ""))
        return lines

    def save(self):
        a = self.a
        nocache = next((r for r in self.rows if r["contender"] == "no-cache"), None)
        modes = [m for m in a.modes if any(r["mode"] == m for r in self.rows)]
        body = [f"# Journal-aware caching (issue 22){' — ' + a.label if a.label else ''}", "",
                f"`bench/jcache_bench.py {' '.join(a.argv)}`", "",
                f"- vdcache: `{a.vdcache}` ({a.version}, sha256 {a.sha[:12]})",
                f"- storage server: nbdkit file plugin, {a.delay} ms delay per request; a fresh qcow2 delta over "
                f"an empty 1 GiB qcow2 base per cell, and a zeroed raw journal image of {a.journal_size}",
                f"- ext4 -b 4096, external journal on the journal device, data=journal; {a.prefill} files of "
                f"{a.file_size} prefilled (not counted), then {a.threads} threads for {a.runtime} s: "
                f"create+{a.file_size}+fsync, append {a.append_size}+fsync (0: none), read a file, delete the "
                f"oldest beyond {a.files} files (4 ops)",
                f"- vdcache: cache {a.cache_size} (fresh per cell), sequential_write_cutoff "
                f"{a.sequential_write_cutoff or 'default (4 MiB)'}; no-cache: {a.nocache_label}",
                f"- machine: {os.cpu_count()} CPUs, load at start {a.load}; {time.strftime('%Y-%m-%d %H:%M')}",
                "", "Server figures count from the start of the workload through the stop (umount's last "
                "checkpoint and vdcache's write-back included; mkfs and the prefill, the same for every "
                "contender, are in the JSON as the setup phase); written: Write payload bytes (zeroing requests "
                "carry none and are shown apart); data / journal: the delta (and base) vs the journal image. "
                "Flash written: vdcache's cache device (data and metadata) from the start of the workload to "
                "just before the stop; journal copies shared over the same span; held: bytes held for the "
                "journal before the stop. Per guest byte: per byte the workload wrote into files (the "
                "checks compare these, not totals: each run does as much work as it can in its time). Reads of whole files mostly hit the guest's page cache.", ""]
        for m in modes:
            body += self.table(m, nocache) + [""]
        text = "\n".join(body) + "\n"
        stem = self.out / (a.label or "jcache")
        stem.with_suffix(".md").write_text(text)
        meta = {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, list))}
        stem.with_suffix(".json").write_text(json.dumps({"params": meta, "cells": self.rows}, indent=1))
        return text, modes, nocache


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, help="seconds of the workload per cell (default 60; quick 15)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--files", type=int, default=1000, help="the oldest file is deleted beyond this many")
    ap.add_argument("--file-size", default="16k", help="bytes of each new file (Varmail: 16k)")
    ap.add_argument("--append-size", default="8k", help="bytes appended to a file per iteration (0: none)")
    ap.add_argument("--prefill", type=int, help="files made before the workload (default 500; quick 200)")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--cache-size", default="2g")
    ap.add_argument("--cache-modes", default="writethrough,writeback", help="vdcache cache modes, one row pair each")
    ap.add_argument("--journal-size", default="128m")
    ap.add_argument("--sequential-write-cutoff", help="[cache] sequential_write_cutoff of both vdcache contenders "
                    "(default: vdcache's, 4 MiB: journal-unaware's sequential log then bypasses flash; 0: never)")
    ap.add_argument("--no-cache", choices=("qsd", "vdcache", "none"), default="qsd",
                    help="the no-cache contender: qemu-storage-daemon (vdcache without [cache] if it is not "
                         "installed), vdcache without [cache], or none")
    ap.add_argument("--stop-timeout", type=int, default=1800, help="seconds a stop may take before it is killed")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--label", default="", help="name of the report (OUT/LABEL.md, .json; default jcache)")
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one, removed at the end)")
    ap.add_argument("--out", default=str(REPO / "results" / "jcache"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    a.argv = sys.argv[1:]
    a.runtime = a.runtime or (15 if a.quick else 60)
    a.prefill = a.prefill if a.prefill is not None else (200 if a.quick else 500)
    a.modes = [m for m in a.cache_modes.split(",") if m]
    if not a.modes:
        raise SystemExit("--cache-modes names no mode")
    a.journal_bytes = parse_size(a.journal_size)
    a.file_size_bytes, a.append_size_bytes = parse_size(a.file_size), parse_size(a.append_size)
    if a.file_size_bytes == 0:
        raise SystemExit("--file-size must not be 0")
    parse_size(a.cache_size)
    if a.prefill > a.files or a.journal_bytes % 4096:
        raise SystemExit("--prefill must not exceed --files; --journal-size must be a multiple of 4 KiB")
    for tool in ("nbdkit", "qemu-img", "mkfs.ext4", "e2fsck", "losetup"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing")
    if not Path(a.vdcache).exists():
        raise SystemExit(f"{a.vdcache} is missing (cargo build --release -p vdcache)")
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse (FUSE files, loop devices, mount)")
    if a.no_cache == "qsd" and not shutil.which("qemu-storage-daemon"):
        log("qemu-storage-daemon is missing: no-cache is vdcache without a flash cache")
        a.no_cache = "vdcache"
    a.nocache_label = {"qsd": "qemu-storage-daemon (qcow2 and raw nodes over nbd nodes, FUSE exports)",
                       "vdcache": "vdcache serve without [cache] (no flash), two plain exports",
                       "none": "not run"}[a.no_cache]
    a.vdcache = str(Path(a.vdcache).resolve())
    a.version = run([a.vdcache, "--version"]).stdout.strip()
    a.sha = hashlib.sha256(Path(a.vdcache).read_bytes()).hexdigest()
    a.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also when started in the background (SIGINT ignored)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="vdcache-jcache-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(a, work)
    t0 = time.monotonic()
    try:
        if a.no_cache != "none":
            bench.cell("no-cache", None)
        for mode in a.modes:
            for contender in ("journal-unaware", "jcache"):
                bench.cell(contender, mode)
                bench.save()
        text, modes, nocache = bench.save()
        print(text, flush=True)
        if modes:
            series = [{"name": c, "values": [next(r["workload"]["ops_s"] for r in bench.rows
                                                  if r["contender"] == c and r["mode"] == m) for m in modes]}
                      for c in ("jcache", "journal-unaware")]
            if nocache:
                series.append({"name": "no-cache", "values": [nocache["workload"]["ops_s"]] * len(modes)})
            plot(a.vdcache, {"kind": "bar", "title": f"Varmail-like on ext4 data=journal, storage {a.delay} ms",
                             "x_label": "vdcache cache mode", "y_label": "ops/s", "categories": modes,
                             "series": series}, bench.out / f"{a.label or 'jcache'}-ops")
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    log(f"report: {bench.out / (a.label or 'jcache')}.md ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
