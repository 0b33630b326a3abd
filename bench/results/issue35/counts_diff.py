"""Per connection (crr) or per transaction (rr1) syscalls and context
switches of each proxy from two counts.sh runs with different repetitions:
the difference of the counts over the difference of the connections
(the destination proxy's connect calls) or transactions, so startup,
readiness polling and teardown cancel out. usage: counts_diff.py DIR FEW MORE"""
import json, re, sys

SHOW = ['ctxsw', 'futex', 'epoll_wait', 'epoll_ctl', 'recvfrom', 'read', 'sendto', 'writev',
        'write', 'accept4', 'socket', 'setsockopt', 'getsockopt', 'bind', 'getsockname',
        'getpeername', 'connect', 'shutdown', 'close', 'getrandom', 'setns', 'bpf']

def load(d, name):
    roles = []
    for line in open(f'{d}/{name}.log'):
        m = re.search(r'topology ready .*proxy pids: ([\d ]+)', line)
        if m:
            roles = [int(p) for p in m.group(1).split()]
    procs = {json.loads(l)['pid']: json.loads(l) for l in open(f'{d}/{name}.counts')}
    # In the order the harness printed: client side, then server side.
    ordered = [procs[p] for p in roles if p in procs]
    run = json.load(open(f'{d}/{name}.json'))
    crr = all(r['workload'] == 'crr' for r in run['records'])
    if crr:
        units = max(p['counts'].get('connect', 0) for p in ordered)
    else:
        units = sum(r['report']['txns'] * (w['seconds'] + w['warmup']) / w['seconds']
                    for r in run['records']
                    for w in run['workloads'] if w['id'] == r['workload'])
    return ordered, units, crr

d, few, more = sys.argv[1:4]
p1, u1, crr = load(d, few)
p3, u3, _ = load(d, more)
du = u3 - u1
unit = 'connection' if crr else 'transaction'
print(f'{few} → {more}: {du:.0f} more {unit}s; per {unit}:')
print(f'{"":14s}{"client side":>16s}{"server side":>16s}')
for k in SHOW + ['all syscalls']:
    vals = []
    for a, b in zip(p1, p3):
        if k == 'all syscalls':
            x = sum(v for n, v in a['counts'].items() if n != 'ctxsw')
            y = sum(v for n, v in b['counts'].items() if n != 'ctxsw')
        else:
            x, y = a['counts'].get(k, 0), b['counts'].get(k, 0)
        vals.append((y - x) / du)
    if any(abs(v) >= 0.005 for v in vals):
        print(f'{k:14s}' + ''.join(f'{v:16.2f}' for v in vals))
for a, b in zip(p1, p3):
    ta, tb = a.get('switches_by_thread', {}), b.get('switches_by_thread', {})
    by = ', '.join(f'{t} {(tb.get(t, 0) - ta.get(t, 0)) / du:.2f}' for t in sorted(set(ta) | set(tb))
                   if abs(tb.get(t, 0) - ta.get(t, 0)) / du >= 0.05)
    print(f'  switches by thread: {by}')
