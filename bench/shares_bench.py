#!/usr/bin/env python3
"""Two VMs on one flash cache: does B's scan flush A's hot set? (issue 23,
done-when item 2; a benchmark, not a test.)

One `vdcache serve` with a write-back cache of --cache-size serves two
exports (raw images on local files): A reads a hot set of --hot percent of
the cache over and over (fio, 64 KiB sequential reads, --passes passes),
while B reads --scan times the cache size once, sequentially. Both run at
once (fio processes side by side), after A's hot set was read once to warm
the cache. A's read hit ratio over the measured passes comes from vdcache's
own counters (`vdcache stats --json`: the export's read_hit_blocks and
read_miss_blocks, a difference of two snapshots), so it is exact.

Modes, each with a fresh cache: A alone; A with B, shares off; A with B,
shares on (`[cache] shares = true`). The table (Markdown and JSON) goes to
--out, with A's hit ratio in each mode, its ratio to alone, and the check
of the issue's aim (shares on: at least 90% of alone).

Usage: bench/shares_bench.py [--cache-size 256m] [--hot 30] [--scan 2]
                             [--passes 6] [--out results/shares] [--vdcache PATH]
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from datacenter import REPO, log, parse_size, require_tools, run, stop, wait_for_socket

BLOCK = 4096
AIM = 0.9
SCENARIOS = ("concurrent", "idle during scan")


def stats(vdcache, sock):
    out = run([vdcache, "stats", "--json", "--socket", str(sock)]).stdout
    return json.loads(out)


def export_counts(report, name):
    """(read_hit_blocks, read_miss_blocks) of export `name`."""
    cache = report["cache"]
    for e in report["disks"]:
        if e["export"] == name:
            disk = e["disk"]
            break
    else:
        raise SystemExit(f"no export {name} in the stats")
    for d, s in cache["disks"]:
        if d == disk:
            return s["read_hit_blocks"], s["read_miss_blocks"]
    return 0, 0


def fio_read(uri, size, passes, name):
    return ["fio", "--ioengine=nbd", f"--uri={uri}", f"--name={name}", "--rw=read", "--bs=64k",
            "--iodepth=4", f"--size={size}", f"--loops={passes}", "--output-format=json"]


def cell(a, work, scenario, mode):
    cache_bytes = parse_size(a.cache_size)
    hot = cache_bytes * a.hot // 100 // (1 << 20) * (1 << 20)
    scan = cache_bytes * a.scan
    for name, size in (("a", hot), ("b", scan)):
        img = work / f"{name}.img"
        img.unlink(missing_ok=True)
        with open(img, "wb") as f:
            f.truncate(size)
        # Data, not holes: fio reads what a guest would.
        run(["qemu-io", "-f", "raw", "-c", f"write -P 0x{ord(name):x} 0 {size}", str(img)])
    sock = work / "vd.sock"
    cache = work / "cache.img"
    cache.unlink(missing_ok=True)
    conf = work / f"{mode}.toml"
    shares = "true" if mode == "shares on" else "false"
    conf.write_text(
        f'[server]\nsocket = "{sock}"\n[cache]\npath = "{cache}"\nsize = "{a.cache_size}"\n'
        f'shares = {shares}\nidle_fill = false\n'
        f'[[export]]\nname = "a"\nimage = "{work / "a.img"}"\nformat = "raw"\n'
        f'[[export]]\nname = "b"\nimage = "{work / "b.img"}"\nformat = "raw"\n')
    logf = open(work / f"{mode}.log", "w")
    v = subprocess.Popen([a.vdcache, "serve", "--config", str(conf)], stderr=logf, stdout=logf)
    try:
        wait_for_socket(str(sock), v, "vdcache")
        uri = lambda n: f"nbd+unix:///{n}?socket={sock}"
        run(fio_read(uri("a"), hot, 1, "warm"))
        before = export_counts(stats(a.vdcache, sock), "a")
        scan_job = fio_read(uri("b"), scan, 1, "scan")
        if scenario == "concurrent":
            # A re-reads its hot set for as long as B scans.
            hot_job = subprocess.Popen(fio_read(uri("a"), hot, 1000000, "hot"), stdout=subprocess.DEVNULL)
            if mode != "alone":
                run(scan_job)
            else:
                time.sleep(a.alone_seconds)
            report = stats(a.vdcache, sock)
            hot_job.terminate()
            hot_job.wait()
        else:
            # A is idle while B scans (a nightly backup), then comes back.
            if mode != "alone":
                run(scan_job)
            run(fio_read(uri("a"), hot, a.passes, "hot"))
            report = stats(a.vdcache, sock)
        after = export_counts(report, "a")
        hits, misses = after[0] - before[0], after[1] - before[1]
        shares_report = report["cache"].get("shares")
    finally:
        stop(v)
        logf.close()
    ratio = hits / (hits + misses) if hits + misses else 0.0
    log(f"{scenario}, {mode}: A's read hit ratio {ratio:.4f} ({hits} hits, {misses} misses)")
    return {"scenario": scenario, "mode": mode, "hit_blocks": hits, "miss_blocks": misses, "hit_ratio": ratio,
            "hot_bytes": hot, "scan_bytes": scan, "shares": shares_report}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-size", default="256m")
    ap.add_argument("--hot", type=int, default=30, help="A's hot set, percent of the cache")
    ap.add_argument("--scan", type=int, default=2, help="B's scan, times the cache size")
    ap.add_argument("--passes", type=int, default=6, help="A's measured passes over its hot set")
    ap.add_argument("--alone-seconds", type=float, default=3.0,
                    help="concurrent scenario, A alone: how long A re-reads its hot set")
    ap.add_argument("--out", default=str(REPO / "results" / "shares"))
    ap.add_argument("--vdcache", default=str(REPO / "target" / "release" / "vdcache"))
    a = ap.parse_args()
    require_tools(a.vdcache, tools=("fio", "qemu-io"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="vdcache-shares-") as tmp:
        for scenario in SCENARIOS:
            for mode in ("alone", "shares off", "shares on"):
                rows.append(cell(a, Path(tmp), scenario, mode))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Two exports on one cache: A's hot set against B's scan",
        "",
        f"Cache {a.cache_size}; A's hot set is {a.hot}% of it, B scans {a.scan}x the cache once (64 KiB reads, QD4, "
        "raw images on local files). A's read hit ratio comes from vdcache's counters, from the end of A's warm-up "
        "pass to the end of the scenario, so it is exact.",
        "",
        "- concurrent: A re-reads its hot set for as long as B scans (alone: for --alone-seconds).",
        f"- idle during scan: A is idle while B scans (a nightly backup), then reads its hot set {a.passes} times.",
        "",
        "Command: `python3 bench/shares_bench.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("cache_size", a.cache_size), ("hot", a.hot),
                                                         ("scan", a.scan), ("passes", a.passes))) + "`",
        "",
        "| scenario | mode | A read hits | A read misses | A hit ratio | vs alone |",
        "|---|---|---:|---:|---:|---:|",
    ]
    verdicts = []
    for scenario in SCENARIOS:
        cells = [r for r in rows if r["scenario"] == scenario]
        alone = cells[0]["hit_ratio"] or 1.0
        for r in cells:
            r["vs_alone"] = r["hit_ratio"] / alone
            lines.append(f"| {scenario} | {r['mode']} | {r['hit_blocks']} | {r['miss_blocks']} "
                         f"| {r['hit_ratio']:.4f} | {r['vs_alone']:.3f} |")
        on = cells[2]["vs_alone"]
        verdicts.append(f"- {scenario}: {'met' if on >= AIM else 'NOT met'} ({on:.3f}); "
                        f"shares off keeps {cells[1]['vs_alone']:.3f}.")
    lines += ["", f"Aim (shares on keeps at least {AIM:.0%} of A's hit ratio alone):", *verdicts]
    (out / "shares.md").write_text("\n".join(lines) + "\n")
    (out / "shares.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
