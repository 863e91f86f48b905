#!/usr/bin/env python3
"""COW-aware caching against a stacked cache and qemu-nbd (a benchmark, not a test).

Every experiment runs against the emulated storage server (nbdkit, file
plugin, --delay ms per request, byte and flush counts) with fio's nbd engine
as the guest, and measures, in the same run: vdcache with a flash cache in
its COW layer (--cow cow-aware), the same code as a stacked cache (--cow
stacked: host I/O only, whole metadata tables, filler cached), and qemu-nbd
serving the chain straight from the storage server.

  metadata  COWCache Table 1 / Fig. 9: random 64 KiB cluster-aligned writes
            over a 1 TiB sparse delta, L2 memory cache swept from 1/128 of
            the L2 tables touched to all of them: throughput, L2 memory hit
            ratio, metadata flash reads and writes.
  dcow      Fig. 10: random writes of 4-64 KiB, aligned and unaligned, into
            a fresh delta over a full base, both write modes: throughput,
            flash bytes written, storage-server bytes.
  cowratio  Fig. 11: 4 KiB random I/O at write:read 2:1 and 1:2 into deltas
            where 40-80% of the clusters are not yet allocated.
  fsync     a write+fsync loop: backend (storage-server) syncs per guest
            flush.

Tables (Markdown and JSON) and plots (SVG and PNG, drawn by `vdcache plot`)
go to --out (default results/cow/); each table ends with the issue's
acceptance checks and whether this run met them.

Usage: bench/cow_bench.py [--experiments metadata,dcow,cowratio,fsync]
                          [--runtime S] [--delay MS] [--quick] [--out DIR]
                          [--modes writeback,writethrough[,nocache]]
                          [--metadata-journal auto|on|off] [--preallocate]
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from datacenter import (REPO, Contender, StorageServer, fio, fresh_delta, log, parse_size, plot,
                        require_tools, run)

MIB = 1 << 20
CLUSTER = 64 << 10
EXPERIMENTS = ("metadata", "dcow", "cowratio", "fsync")


def vdcache_contender(work, a, cow, mode, extra=()):
    journal = ["--metadata-journal", a.metadata_journal] if a.metadata_journal else []
    if mode == "nocache":
        prealloc = ["--preallocate"] if a.preallocate else []
        return Contender("nocache", work, a.vdcache, [*journal, *prealloc, *extra])
    name = f"{cow}-{'wb' if mode == 'writeback' else 'wt'}"
    args = ["--cache", "{cache}", "--cache-size", a.cache_size, "--cache-mode", mode, "--cow", cow,
            "--keep-dirty", *extra, *journal]
    return Contender(name, work, a.vdcache, args)


def cow_kinds(mode):
    """The COW placements a mode is measured with (none without a cache)."""
    return ("stacked", "cow-aware") if mode != "nocache" else ("none",)


def cache_of(stats):
    return (stats or {}).get("cache") or {}


def flash_written(stats):
    dev = cache_of(stats).get("device") or {}
    return dev.get("data_bytes_written", 0) + dev.get("meta_bytes_written", 0)


class Bench:
    def __init__(self, a, work):
        self.a = a
        self.work = work
        self.images = work / "images"
        self.images.mkdir(parents=True, exist_ok=True)
        self.storage = StorageServer(work, self.images, a.delay)
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def cell(self, contender, image, fio_args, before=None):
        """Serves `image` from the storage server with `contender` and runs
        fio; returns the measurements."""
        self.storage.start()
        contender.start(self.storage.uri(image))
        try:
            if before:
                before(contender)
            rw, bs, depth, size, runtime, extra = fio_args
            iops, p99, guest, writes, reads = fio(contender.uri(), rw, bs, depth, size, runtime,
                                                  self.work, extra)
            stats = contender.stats()
        finally:
            contender.stop()
            sread, swrite, sflush = self.storage.stop()
        return {"iops": iops, "p99_ms": p99, "guest_bytes": guest, "writes": writes, "reads": reads,
                "server_read": sread, "server_written": swrite, "server_flushes": sflush, "stats": stats}

    def write(self, name, table, data):
        md = self.out / f"{name}.md"
        md.write_text(table)
        (self.out / f"{name}.json").write_text(json.dumps(data, indent=1))
        print(table)
        log(f"{name}: {md}")

    def base(self):
        """A full 1 GiB base image (every cluster written)."""
        p = self.images / "base.qcow2"
        if not p.exists():
            log("writing the base image")
            run(["qemu-img", "create", "-q", "-f", "qcow2", str(p), "1G"])
            run(["qemu-io", "-c", "write -P 0xab 0 1G", str(p)])
        return "base.qcow2"

    # -- metadata (Table 1, Fig. 9) --------------------------------------
    def metadata(self):
        a = self.a
        writes = a.meta_writes
        # 1 TiB of 64 KiB clusters: 2048 L2 tables of 64 KiB, all touched by
        # this many uniform random writes (expected untouched: 2048 e^-N/2048).
        tables = 2048
        sizes = [1, 32, 64, 96, 128] if not a.quick else [1, 128]
        rows = []
        for mode in a.modes:
            for cow in ("stacked", "cow-aware"):
                for mib in sizes:
                    c = vdcache_contender(self.work, a, cow, mode, ["--l2-cache-size", f"{mib}M"])
                    image = fresh_delta(self.images, self.storage, "sparse.qcow2", 1 << 40, backing=None,
                                        room=writes * CLUSTER * 11 // 10 + (512 << 20))
                    r = self.cell(c, image, ("randwrite", "64k", a.depth, "1t", None,
                                             [f"--number_ios={writes}", "--blockalign=64k"]))
                    total = cache_of(r["stats"]).get("total", {})
                    disks = (r["stats"] or {}).get("disks") or [{}]
                    row = {"mode": mode, "cow": cow, "l2_mib": mib, "l2_fraction": mib * MIB / (tables * CLUSTER),
                           "iops": r["iops"], "mib_s": r["iops"] * CLUSTER / MIB,
                           "l2_hit_ratio": disks[0].get("l2_hit_ratio") or 0.0,
                           "meta_flash_read": total.get("meta_flash_bytes_read", 0),
                           "meta_flash_written": total.get("meta_flash_bytes_written", 0),
                           "writes": r["writes"]}
                    rows.append(row)
                    log(f"metadata {mode} {cow:9} L2 {mib:4} MiB: {row['mib_s']:7.1f} MiB/s hit {row['l2_hit_ratio']:.3f} "
                        f"meta flash r {row['meta_flash_read'] / MIB:8.1f} MiB w {row['meta_flash_written'] / MIB:8.1f} MiB")
        lines = [f"{writes} random 64 KiB cluster-aligned writes (fio, queue depth {a.depth}) over a fresh 1 TiB "
                 f"sparse delta on the storage server ({a.delay} ms), flash cache {a.cache_size}; L2 memory cache "
                 f"from 1/128 of the {tables} L2 tables touched (1 MiB) to all of them (128 MiB). Metadata flash "
                 "writes: whole tables and blocks written to flash plus, cow-aware, the journal records of dirty "
                 "sectors; reads: metadata read from flash. L2 hit ratio: L2 lookups served from memory, "
                 "counting slices known to be zero (a table created in this run), which load without I/O "
                 "in both configurations.", "",
                 "| mode | L2 memory MiB | cow | MiB/s | L2 hit ratio | meta flash read MiB | meta flash written MiB |",
                 "|---|---:|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['mode']} | {r['l2_mib']} | {r['cow']} | {r['mib_s']:.1f} | {r['l2_hit_ratio']:.3f} | "
                         f"{r['meta_flash_read'] / MIB:.2f} | {r['meta_flash_written'] / MIB:.2f} |")
        lines += ["", "Checks at the smallest memory cache:"]
        for mode in a.modes:
            s = next(r for r in rows if r["mode"] == mode and r["cow"] == "stacked" and r["l2_mib"] == sizes[0])
            c = next(r for r in rows if r["mode"] == mode and r["cow"] == "cow-aware" and r["l2_mib"] == sizes[0])
            hit = c["l2_hit_ratio"] / max(s["l2_hit_ratio"], 1e-9)
            wr = c["meta_flash_written"] / max(s["meta_flash_written"], 1)
            lines.append(f"- {mode}: hit ratio cow-aware/stacked {hit:.2f} (need >= 2: {'met' if hit >= 2 else 'NOT met'}); "
                         f"metadata flash writes cow-aware/stacked {wr:.4f} (need <= 0.05: {'met' if wr <= 0.05 else 'NOT met'})")
        self.write("metadata", "\n".join(lines) + "\n", rows)
        for key, label, scale in (("l2_hit_ratio", "L2 memory hit ratio", 1),
                                  ("meta_flash_written", "metadata flash writes (MiB)", MIB),
                                  ("meta_flash_read", "metadata flash reads (MiB)", MIB),
                                  ("mib_s", "guest write throughput (MiB/s)", 1)):
            series = [{"name": f"{cow} {mode}",
                       "points": [[r["l2_mib"], r[key] / scale] for r in rows if r["cow"] == cow and r["mode"] == mode]}
                      for mode in a.modes for cow in ("stacked", "cow-aware")]
            plot(a.vdcache, {"kind": "line", "title": f"{label} vs L2 memory cache", "x_label": "L2 memory cache (MiB)",
                             "y_label": label, "series": series}, self.out / f"metadata-{key}")

    # -- decoupled COW (Fig. 10) -----------------------------------------
    def dcow(self):
        a = self.a
        base = self.base()
        sizes = ["4k", "8k", "16k", "32k", "64k"] if not a.quick else ["4k", "64k"]
        contenders = [Contender("qemu-nbd", self.work, a.vdcache)]
        for mode in a.modes:
            contenders += [vdcache_contender(self.work, a, cow, mode) for cow in cow_kinds(mode)]
        rows = []
        for bs in sizes:
            for aligned in (True, False):
                for c in contenders:
                    image = fresh_delta(self.images, self.storage, "delta.qcow2", 1 << 30, backing=base)
                    extra = [] if aligned else ["--blockalign=512"]
                    # The same writes for every contender: a time limit would give faster
                    # ones more writes into clusters already copied, so less COW per byte.
                    r = self.cell(c, image, ("randwrite", bs, a.depth, "1g", None,
                                             extra + [f"--number_ios={a.dcow_writes}"]))
                    g = max(r["guest_bytes"], 1)
                    row = {"bs": bs, "aligned": aligned, "contender": c.name, "iops": r["iops"],
                           "flash_written": flash_written(r["stats"]),
                           "server_read": r["server_read"], "server_written": r["server_written"],
                           "guest_bytes": r["guest_bytes"]}
                    rows.append(row)
                    log(f"dcow {bs:>4} {'aligned' if aligned else 'unaligned':9} {c.name:13} {r['iops']:9.0f} IOPS "
                        f"flash/guest {row['flash_written'] / g:6.2f} server r/guest {r['server_read'] / g:6.2f} "
                        f"w/guest {r['server_written'] / g:6.2f}")
        lines = [f"Random writes into a fresh delta over a full 1 GiB base (fio, queue depth {a.depth}, the same "
                 f"{a.dcow_writes} writes per cell), storage server {a.delay} ms; unaligned writes start at 512-byte multiples. Flash "
                 "written: everything the cache wrote to its device (data zone, journal, checkpoints). Server "
                 "bytes: what the storage server served during the run (vdcache stops with --keep-dirty, so the "
                 "deferred fill and write-back are not in them).", "",
                 "| size | aligned | contender | IOPS | vs qemu-nbd | flash written / guest byte | "
                 "server read / guest byte | server written / guest byte |",
                 "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            g = max(r["guest_bytes"], 1)
            q = next(x for x in rows if x["bs"] == r["bs"] and x["aligned"] == r["aligned"] and x["contender"] == "qemu-nbd")
            flash = "-" if r["contender"] == "qemu-nbd" else f"{r['flash_written'] / g:.3f}"
            lines.append(f"| {r['bs']} | {'yes' if r['aligned'] else 'no'} | {r['contender']} | {r['iops']:.0f} | "
                         f"{r['iops'] / max(q['iops'], 1e-9):.2f} | {flash} | {r['server_read'] / g:.3f} | "
                         f"{r['server_written'] / g:.3f} |")
        if "writeback" in a.modes:
            lines += ["", "Checks at 4 KiB write-back:"]
            for aligned in (True, False):
                pick = {x["contender"]: x for x in rows if x["bs"] == "4k" and x["aligned"] == aligned}
                s, c, q = pick["stacked-wb"], pick["cow-aware-wb"], pick["qemu-nbd"]
                per = lambda x: x["flash_written"] / max(x["guest_bytes"], 1)
                fr = per(c) / max(per(s), 1e-12)
                ts, tq = c["iops"] / max(s["iops"], 1e-9), c["iops"] / max(q["iops"], 1e-9)
                lines.append(f"- {'aligned' if aligned else 'unaligned'}: flash bytes per guest byte cow-aware/stacked "
                             f"{fr:.3f} (need <= 0.1: {'met' if fr <= 0.1 else 'NOT met'}); throughput vs stacked "
                             f"{ts:.2f} (need >= 2: {'met' if ts >= 2 else 'NOT met'}); vs qemu-nbd {tq:.2f} "
                             f"(need >= 3: {'met' if tq >= 3 else 'NOT met'})")
        self.write("dcow", "\n".join(lines) + "\n", rows)
        cats = [f"{bs}{'' if al else ' u'}" for bs in sizes for al in (True, False)]
        names = [c.name for c in contenders]
        for key, label, f in (("iops", "IOPS", lambda r: r["iops"]),
                              ("flash", "flash bytes written per guest byte",
                               lambda r: r["flash_written"] / max(r["guest_bytes"], 1))):
            series = [{"name": n, "values": [f(r) for bs in sizes for al in (True, False)
                                             for r in rows if r["bs"] == bs and r["aligned"] == al and r["contender"] == n]}
                      for n in names if not (key == "flash" and n == "qemu-nbd")]
            plot(a.vdcache, {"kind": "bar", "title": f"Decoupled COW: {label}", "x_label": "write size (u: unaligned)",
                             "y_label": label, "categories": cats, "series": series}, self.out / f"dcow-{key}")

    # -- COW ratio (Fig. 11) ---------------------------------------------
    def prefilled_delta(self, base, cow_percent):
        """A delta over the base where (100 - cow_percent)% of the clusters
        (spread evenly) are already allocated."""
        name = f"prefill-{cow_percent}.qcow2"
        p = self.images / name
        if not p.exists():
            clusters = (1 << 30) // CLUSTER
            keep = [i for i in range(clusters) if (i * 100 // clusters + i) % 100 >= cow_percent]
            run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(self.images / base), "-F", "qcow2", str(p), "1G"])
            cmds = []
            for i in keep:
                cmds += ["-c", f"write -P 0xcd {i * CLUSTER} 64k"]
            run(["qemu-io", *cmds, str(p)])
            run(["qemu-img", "rebase", "-u", "-b", self.storage.uri(base), "-F", "qcow2", str(p)])
            os.truncate(p, (1 << 30) + (1 << 30) // 8 + (64 << 20))
        return name

    def cowratio(self):
        a = self.a
        base = self.base()
        ratios = [40, 60, 80] if not a.quick else [40, 80]
        mixes = [("2:1", 67), ("1:2", 33)]
        contenders = [Contender("qemu-nbd", self.work, a.vdcache)]
        for mode in a.modes:
            contenders += [vdcache_contender(self.work, a, cow, mode) for cow in ("stacked", "cow-aware")]
        rows = []
        for label, write_pct in mixes:
            for pct in ratios:
                src = self.prefilled_delta(base, pct)
                for c in contenders:
                    shutil.copyfile(self.images / src, self.images / "delta.qcow2")
                    # The same I/Os for every contender (see dcow).
                    r = self.cell(c, "delta.qcow2", ("randrw", "4k", a.depth, "1g", None,
                                                     [f"--rwmixwrite={write_pct}",
                                                      f"--number_ios={a.cowratio_ios}"]))
                    rows.append({"mix": label, "cow_percent": pct, "contender": c.name, "iops": r["iops"]})
                    log(f"cowratio w:r {label} COW {pct}% {c.name:13} {r['iops']:9.0f} IOPS")
        lines = [f"4 KiB random reads and writes (fio randrw, queue depth {a.depth}, the same {a.cowratio_ios} I/Os per cell) into a "
                 "delta over a full 1 GiB base whose not-yet-allocated clusters are the COW ratio (the first write "
                 f"to one copies on write); storage server {a.delay} ms.", "",
                 "| write:read | COW ratio | contender | IOPS | vs stacked (same mode) |", "|---|---:|---|---:|---:|"]
        worst = None
        for r in rows:
            ratio = ""
            if r["contender"].startswith("cow-aware"):
                s = next(x for x in rows if x["mix"] == r["mix"] and x["cow_percent"] == r["cow_percent"]
                         and x["contender"] == r["contender"].replace("cow-aware", "stacked"))
                v = r["iops"] / max(s["iops"], 1e-9)
                worst = v if worst is None else min(worst, v)
                ratio = f"{v:.2f}"
            lines.append(f"| {r['mix']} | {r['cow_percent']}% | {r['contender']} | {r['iops']:.0f} | {ratio} |")
        if worst is not None:
            lines += ["", f"Check: cow-aware at least matches stacked everywhere: lowest ratio {worst:.2f} "
                          f"({'met' if worst >= 1.0 else 'NOT met'})"]
        self.write("cowratio", "\n".join(lines) + "\n", rows)
        series = [{"name": f"{c.name} w:r {label}",
                   "points": [[r["cow_percent"], r["iops"]] for r in rows if r["contender"] == c.name and r["mix"] == label]}
                  for c in contenders for label, _ in mixes]
        plot(a.vdcache, {"kind": "line", "title": "IOPS vs COW ratio (4 KiB)", "x_label": "COW ratio (%)",
                         "y_label": "IOPS", "series": series}, self.out / "cowratio")

    # -- fsync-heavy ------------------------------------------------------
    def fsync(self):
        a = self.a
        base = self.base()
        contenders = [Contender("qemu-nbd", self.work, a.vdcache)]
        contenders += [vdcache_contender(self.work, a, cow, "writeback") for cow in ("stacked", "cow-aware")]
        rows = []
        for c in contenders:
            image = fresh_delta(self.images, self.storage, "delta.qcow2", 1 << 30, backing=base)
            r = self.cell(c, image, ("randwrite", "4k", 1, "1g", a.runtime, ["--fsync=1"]))
            total = cache_of(r["stats"]).get("total")
            if total:
                flushes, syncs = total["guest_flushes"], total["backend_syncs"]
            else:
                # fio --fsync=1 flushes after every write; every storage-server
                # flush came from the contender.
                flushes, syncs = r["writes"], r["server_flushes"]
            rows.append({"contender": c.name, "iops": r["iops"], "guest_flushes": flushes, "backend_syncs": syncs,
                         "server_flushes": r["server_flushes"]})
            log(f"fsync {c.name:13} {r['iops']:8.0f} IOPS, {flushes} guest flushes, {syncs} backend syncs")
        lines = [f"4 KiB random writes, each followed by a flush (fio --fsync=1, queue depth 1, {a.runtime} s) into a "
                 f"fresh delta over a full base; storage server {a.delay} ms. vdcache counts guest flushes and the "
                 "syncs it sends to the storage server; for qemu-nbd, every write is followed by a flush and the "
                 "storage server counts the flushes it receives.", "",
                 "| contender | IOPS | guest flushes | backend syncs | backend syncs per guest flush |",
                 "|---|---:|---:|---:|---:|"]
        for r in rows:
            per = r["backend_syncs"] / max(r["guest_flushes"], 1)
            lines.append(f"| {r['contender']} | {r['iops']:.0f} | {r['guest_flushes']} | {r['backend_syncs']} | {per:.3f} |")
        self.write("fsync", "\n".join(lines) + "\n", rows)
        plot(a.vdcache, {"kind": "bar", "title": "Backend syncs per guest flush", "x_label": "contender",
                         "y_label": "backend syncs per guest flush", "categories": [r["contender"] for r in rows],
                         "series": [{"name": "syncs per flush", "values": [
                             r["backend_syncs"] / max(r["guest_flushes"], 1) for r in rows]}]},
             self.out / "fsync")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiments", default=",".join(EXPERIMENTS))
    ap.add_argument("--runtime", type=int, default=8, help="seconds per timed cell")
    ap.add_argument("--delay", type=float, default=1.0, help="storage server latency in ms")
    ap.add_argument("--depth", type=int, default=16, help="fio queue depth")
    ap.add_argument("--meta-writes", type=int, default=20000, help="writes per metadata cell")
    ap.add_argument("--dcow-writes", type=int, default=8192, help="writes per decoupled-COW cell")
    ap.add_argument("--cowratio-ios", type=int, default=40000, help="I/Os per COW-ratio cell")
    ap.add_argument("--modes", default="writeback,writethrough",
                    help="cache write modes; dcow also takes nocache (vdcache without a cache)")
    ap.add_argument("--preallocate", action="store_true",
                    help="nocache contender: --preallocate (needs --metadata-journal on)")
    ap.add_argument("--cache-size", default="4g")
    ap.add_argument("--metadata-journal", choices=("auto", "on", "off"),
                    help="vdcache's metadata journal (default: vdcache's own, auto)")
    ap.add_argument("--quick", action="store_true", help="fewer points per experiment (a smoke run)")
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(REPO / "results" / "cow"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    a.modes = [m for m in a.modes.split(",") if m]
    for m in a.modes:
        if m not in ("writeback", "writethrough", "nocache"):
            raise SystemExit(f"unknown mode {m!r}")
    parse_size(a.cache_size)
    chosen = [e for e in a.experiments.split(",") if e]
    if "nocache" in a.modes and chosen != ["dcow"]:
        raise SystemExit("mode nocache is measured by the dcow experiment only (--experiments dcow)")
    if a.preallocate and a.metadata_journal != "on":
        raise SystemExit("--preallocate needs --metadata-journal on")
    for e in chosen:
        if e not in EXPERIMENTS:
            raise SystemExit(f"unknown experiment {e!r}; experiments: {', '.join(EXPERIMENTS)}")
    require_tools(a.vdcache)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="vdcache-cow-bench-"))
    bench = Bench(a, work)
    try:
        for e in chosen:
            getattr(bench, e)()
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
