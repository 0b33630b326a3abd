"""Counts syscalls (by name) and context switches per proxy process from
`perf script -F comm,pid,tid,event,trace` on stdin. The proxies are the
pids the harness printed ("proxy pids: ..." in the run's log, argv[1]).
Prints one JSON object per proxy process."""
import collections, json, re, sys

proxies = set()
for line in open(sys.argv[1]):
    m = re.search(r'topology ready .*proxy pids: ([\d ]+)', line)
    if m:
        proxies.update(m.group(1).split())

NAMES = {0: 'read', 1: 'write', 3: 'close', 7: 'poll', 16: 'ioctl', 19: 'readv', 20: 'writev',
         41: 'socket', 42: 'connect', 43: 'accept', 44: 'sendto', 45: 'recvfrom', 46: 'sendmsg',
         47: 'recvmsg', 48: 'shutdown', 49: 'bind', 51: 'getsockname', 52: 'getpeername',
         54: 'setsockopt', 55: 'getsockopt', 202: 'futex', 228: 'clock_gettime', 232: 'epoll_wait',
         233: 'epoll_ctl', 281: 'epoll_pwait', 288: 'accept4', 308: 'setns', 441: 'epoll_pwait2',
         24: 'sched_yield', 13: 'rt_sigaction', 14: 'rt_sigprocmask', 9: 'mmap', 11: 'munmap',
         10: 'mprotect', 28: 'madvise', 318: 'getrandom', 257: 'openat', 262: 'newfstatat',
         290: 'eventfd2', 284: 'eventfd', 321: 'bpf', 435: 'clone3', 56: 'clone'}
counts = collections.defaultdict(collections.Counter)
comms = collections.defaultdict(set)
# Context switches by thread name, per process.
by_thread = collections.defaultdict(collections.Counter)
for line in sys.stdin:
    m = re.match(r'\s*(\S.*?)\s+(\d+)/(\d+)\s+(\S+):\s*(.*)', line)
    if not m:
        continue
    comm, pid, tid, ev, trace = m.groups()
    comms[pid].add(comm)
    if ev.startswith('raw_syscalls:sys_enter'):
        n = int(re.search(r'NR (\d+)', trace).group(1))
        counts[pid][NAMES.get(n, 'nr%d' % n)] += 1
    elif ev.startswith('sched:sched_switch'):
        # Counted on the thread leaving the CPU.
        if re.search(r'prev_pid=%s\b' % tid, trace) or 'prev_pid' not in trace:
            counts[pid]['ctxsw'] += 1
            by_thread[pid][comm] += 1

def kind(pid, names):
    if pid not in proxies:
        return None
    return 'ztunnel' if any(n.startswith('ztunnel') for n in names) else 'shunt'

for pid, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
    k = kind(pid, comms[pid])
    if k is None:
        continue
    print(json.dumps({'pid': int(pid), 'kind': k, 'threads': sorted(comms[pid]),
                      'total': sum(v for n, v in c.items() if n != 'ctxsw'), 'counts': dict(c.most_common()),
                      'switches_by_thread': dict(by_thread[pid].most_common())}))
