#!/usr/bin/env python3
"""User and kernel samples of two groups of proxy pids, over the 100 ms
bins where each group was busy (startup and idle spells left out).
usage: usplit.py TRACE SHUNT_PIDS ZTUNNEL_PIDS [MIN_SAMPLES_PER_BIN]
TRACE: `perf script -F pid,time,ip` of `perf record -C CPU -e cpu-clock
-F 2000` (no call graphs) around a pinned run of both paths."""
import collections
import sys

groups = {"shunt": {int(p) for p in sys.argv[2].split(",")},
          "ztunnel": {int(p) for p in sys.argv[3].split(",")}}
busy = int(sys.argv[4]) if len(sys.argv) > 4 else 130
bins = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 3:
        continue
    pid = int(f[0].split("/")[0])
    for name, pids in groups.items():
        if pid in pids:
            side = "kernel" if int(f[2], 16) >= 0xFFFF800000000000 else "user"
            bins[(name, int(float(f[1].rstrip(":")) * 10))][side] += 1
for name in groups:
    kept = [c for (g, _), c in bins.items() if g == name and c["user"] + c["kernel"] >= busy]
    user = sum(c["user"] for c in kept)
    kernel = sum(c["kernel"] for c in kept)
    secs = len(kept) / 10
    print(f"{name}: {secs:.1f} s busy, user {user / secs:.0f} samples/s, kernel {kernel / secs:.0f} samples/s, "
          f"user share {100 * user / (user + kernel):.1f} %")
