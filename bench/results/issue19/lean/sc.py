import sys, re, collections
NAMES={45:'recvfrom',232:'epoll_wait',20:'writev',44:'sendto',202:'futex',1:'write',0:'read',233:'epoll_ctl',281:'epoll_pwait',441:'epoll_pwait2'}
counts=collections.Counter(); comms={}
for line in sys.stdin:
    m=re.match(r'\s*(\S.*?)\s+(\d+)/(\d+)\s+(\S+):\s*(.*)', line)
    if not m: continue
    comm,pid,tid,ev,trace=m.groups()
    if comm not in ('tokio-rt-worker','shunt','shunt-log'): continue
    if ev.startswith('raw_syscalls:sys_enter'):
        n=int(re.search(r'NR (\d+)',trace).group(1)); counts[(pid,NAMES.get(n,'nr%d'%n))]+=1
    elif ev.startswith('sched:sched_switch'):
        counts[(pid,'ctxsw')]+=1
    comms.setdefault(pid,set()).add(comm)
per=collections.Counter()
for (pid,k),v in counts.items(): per[pid]+=v
agents=[p for p,_ in per.most_common(2)]
for pid in agents:
    tx=counts[(pid,'writev')] or 1
    row={k:v for (p,k),v in counts.items() if p==pid}
    print(f"pid {pid} ({','.join(sorted(comms[pid]))}): {tx} writev (~transactions)")
    top=sorted(row.items(), key=lambda kv:-kv[1])[:14]
    for k,v in top:
        print(f"   {k:12s} {v:8d}  {v/tx:6.2f} per transaction")
    if 'write' not in dict(top):
        print(f"   {'write':12s} {row.get('write',0):8d}  {row.get('write',0)/tx:6.2f} per transaction")
