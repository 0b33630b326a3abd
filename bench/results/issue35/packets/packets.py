"""Per transaction counts from two packets.sh runs (REPS 1 and 3) of one
path. usage: packets.py DIR NAME_FEW NAME_MORE"""
import json, sys

def txns(d, name):
    run = json.load(open(f'{d}/{name}.json'))
    t = 0.0
    for r in run['records']:
        w = next(w for w in run['workloads'] if w['id'] == r['workload'])
        t += r['report']['txns'] * (w['seconds'] + w['warmup']) / w['seconds']
    return t

def stat(d, name):
    counts = {}
    for line in open(f'{d}/{name}.stat'):
        fields = line.split(',')
        if line.startswith('#') or len(fields) < 3:
            continue
        counts[fields[2]] = int(fields[0])
    return counts

d, few, more = sys.argv[1:4]
dt = txns(d, more) - txns(d, few)
a, b = stat(d, few), stat(d, more)
print(f'{few} -> {more}: {dt:.0f} more transactions')
for event in a:
    print(f'  {event}: {(b[event] - a[event]) / dt:.2f} per transaction')
