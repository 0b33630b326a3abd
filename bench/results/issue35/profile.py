"""Per-transaction (per-connection for crr) syscalls and context switches of
each proxy process, from counts.sh's outputs: NAME.counts (counts.py),
NAME.json (the run's raw results: transactions) and NAME.log (which pid is
which: the order the harness printed them in). Counts cover the whole run
(startup and warm-up included), so they are divided by the transactions
of the measured window scaled by (seconds + warm-up) / seconds; startup
shows as the fractional rest (e.g. bpf, socket for the pods' listeners).
usage: profile.py DIR NAME..."""
import json, re, sys

ROLES = {'ebpf': ['node-a agent (client side)', 'node-b agent (server side)'],
         'iptables': ['node-a agent (client side)', 'node-b agent (server side)'],
         'ztunnel': ['client pod ztunnel', 'same-mesh pod ztunnel', 'cross-mesh pod ztunnel']}
SHOW = ['ctxsw', 'futex', 'epoll_wait', 'epoll_ctl', 'recvfrom', 'read', 'sendto', 'writev',
        'write', 'accept4', 'socket', 'setsockopt', 'getsockopt', 'bind', 'getsockname',
        'getpeername', 'connect', 'shutdown', 'close', 'getrandom', 'setns', 'bpf']

d, names = sys.argv[1], sys.argv[2:]
for name in names:
    run = json.load(open(f'{d}/{name}.json'))
    roles = {}
    for line in open(f'{d}/{name}.log'):
        m = re.search(r'shunt-bench: (\S+) topology ready .*proxy pids: ([\d ]+)', line)
        if m:
            for pid, role in zip(m.group(2).split(), ROLES.get(m.group(1), [])):
                roles[int(pid)] = f'{m.group(1)} {role}'
    txns = 0.0
    for r in run['records']:
        w = next(w for w in run['workloads'] if w['id'] == r['workload'])
        txns += r['report']['txns'] * (w['seconds'] + w['warmup']) / w['seconds']
    print(f'\n## {name}: {", ".join(sorted({r["path_id"] for r in run["records"]}))}, '
          f'{", ".join(sorted({r["workload"] for r in run["records"]}))}, ~{txns:.0f} transactions '
          f'(incl. warm-up); per transaction:')
    procs = [json.loads(l) for l in open(f'{d}/{name}.counts')]
    procs = [p for p in procs if p['pid'] in roles]
    if all(r['workload'] == 'crr' for r in run['records']):
        # A connection per transaction: exactly one connect(2) to the
        # server app by the destination's proxy per connection.
        connects = max(p['counts'].get('connect', 0) for p in procs)
        print(f'   (per connection: divided by the {connects} connect calls of the destination\'s proxy instead)')
        txns = connects
    print(f'{"":14s}' + ''.join(f'{roles[p["pid"]][:34]:>36s}' for p in procs))
    for k in SHOW:
        if any(p['counts'].get(k, 0) for p in procs):
            print(f'{k:14s}' + ''.join(f'{p["counts"].get(k, 0) / txns:36.2f}' for p in procs))
    tot = [sum(v for n, v in p['counts'].items() if n != 'ctxsw') for p in procs]
    print(f'{"all syscalls":14s}' + ''.join(f'{t / txns:36.2f}' for t in tot))
    for p in procs:
        by = ', '.join(f'{t} {n / txns:.2f}' for t, n in p.get('switches_by_thread', {}).items() if n / txns >= 0.05)
        print(f'  switches by thread, {roles[p["pid"]]}: {by}')
