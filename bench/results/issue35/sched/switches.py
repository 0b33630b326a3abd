"""How the proxies' threads leave the CPU: asleep (prev_state S, they
waited for I/O) or preempted (R, a task woken on the same CPU took it).
usage: perf record -e sched:sched_switch -a -o X.data -- shunt-bench run ... > X.log;
       perf script -i X.data -F comm,pid,tid,event,trace | python3 switches.py X.log"""
import collections, re, sys

pids = [int(p) for p in re.search(r'proxy pids: ([\d ]+)', open(sys.argv[1]).read()).group(1).split()]
out = collections.Counter()
for line in sys.stdin:
    m = re.search(r'(\d+)/\d+\s+sched:sched_switch: prev_comm=(.*?) prev_pid=\d+ '
                  r'prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=', line)
    if m and int(m.group(1)) in pids:
        out[(int(m.group(1)), m.group(2), m.group(3), m.group(4))] += 1
print('count  proxy pid  thread  state  next task')
for (pid, thread, state, nxt), n in sorted(out.items(), key=lambda kv: -kv[1]):
    if n >= 100:
        print(f'{n:6}  {pid}  {thread}  {state}  {nxt}')
