import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
# per (pid,tid): list of (t, total)
series = collections.defaultdict(list); names = {}
for t, pid, tid, name, v, nv in rows:
    series[(pid, tid)].append((t, v + nv)); names[(pid, tid)] = name
pids = sorted({p for p, _ in series})
for pid in pids:
    keys = [k for k in series if k[0] == pid]
    t0 = min(series[k][0][0] for k in keys); t1 = max(series[k][-1][0] for k in keys)
    print(f"pid {pid}: {t1-t0:.1f}s")
    # sliding 3 s windows: per-thread rate; print the window with the lowest total
    best = None
    ts = sorted({t for k in keys for t, _ in series[k]})
    for i, a in enumerate(ts):
        b = next((x for x in ts[i:] if x - a >= 3.0), None)
        if b is None: break
        tot = 0; per = {}
        for k in keys:
            s = dict(series[k])
            if a in s and b in s:
                per[k] = (s[b] - s[a]) / (b - a); tot += per[k]
        if best is None or tot < best[0]: best = (tot, a, b, per)
    if best:
        tot, a, b, per = best
        print(f"  quietest 3 s window at +{a-t0:.1f}s: {tot:.1f} wake-ups/s")
        agg = collections.Counter()
        for k, r in per.items(): agg[names[k]] += r
        for n, r in agg.most_common(): print(f"    {n:20s} {r:6.1f}/s")
