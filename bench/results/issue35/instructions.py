"""Instructions per transaction of the proxies from two instructions.sh
runs of one path and workload with different repetitions: the difference
of their totals over the difference of their transactions (each scaled by
(seconds + warm-up) / seconds, the warm-up's share, as the proxies work
through it too). usage: instructions.py DIR NAME_FEW NAME_MORE"""
import json, sys

def load(d, name):
    run = json.load(open(f'{d}/{name}.json'))
    txns = 0.0
    for r in run['records']:
        w = next(w for w in run['workloads'] if w['id'] == r['workload'])
        txns += r['report']['txns'] * (w['seconds'] + w['warmup']) / w['seconds']
    ir = [json.loads(l)['instructions'] for l in open(f'{d}/{name}.instructions')]
    return txns, ir

d, few, more = sys.argv[1:4]
t1, i1 = load(d, few)
t3, i3 = load(d, more)
dt = t3 - t1
print(f'{few} → {more}: {dt:.0f} more transactions (warm-up included)')
print(f'  per proxy (sorted), instructions per transaction: '
      + ', '.join(f'{(b - a) / dt:,.0f}' for a, b in zip(sorted(i1), sorted(i3))))
print(f'  all proxies: {(sum(i3) - sum(i1)) / dt:,.0f} instructions per transaction')
