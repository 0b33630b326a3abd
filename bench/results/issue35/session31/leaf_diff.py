#!/usr/bin/env python3
"""Leaf functions of two proxies' samples, per transaction, side by side.
usage: leaf_diff.py TRACE SHUNT_PIDS ZTUNNEL_PIDS SHUNT_TXNS ZTUNNEL_TXNS
TRACE: `perf script -F pid,tid,ip,sym,dso` of a `perf record -g -F 8000`
recording; pids comma-separated; samples inside bpf() and execve()
(agent startup) are left out. Prints µs per transaction: shunt, ztunnel,
difference."""
import sys,collections,re
def load(path,pids):
    pids={int(x) for x in pids.split(',')}
    c=collections.Counter(); n=0
    for b in open(path).read().split('\n\n'):
        ls=[l for l in b.strip().split('\n') if l.strip()]
        if not ls: continue
        m=re.match(r'\s*(\d+)/(\d+)',ls[0])
        if not m or int(m.group(1)) not in pids: continue
        syms=[]
        for l in ls[1:]:
            p=l.strip().split(None,1)
            syms.append(p[1] if len(p)>1 else '?')
        if any('sys_bpf' in s for s in syms) or any('execve' in s for s in syms): continue
        n+=1
        s=syms[0] if syms else '?'
        if '[kernel' not in s: s='[user] '+s.split(' (')[-1]
        else: s=s.rsplit(' (',1)[0]
        c[s]+=1
    return c,n
a,na=load(sys.argv[1],sys.argv[2]); b,nb=load(sys.argv[1],sys.argv[3])
ta=float(sys.argv[4]); tb=float(sys.argv[5]); us=1e6/8000
print('shunt %.2f us/txn, ztunnel %.2f us/txn'%(na*us/ta, nb*us/tb))
keys=set(a)|set(b)
rows=sorted(keys,key=lambda k:-(abs(a[k]*us/ta-b[k]*us/tb)))
for k in rows[:45]:
    print('%7.3f %7.3f %+7.3f  %s'%(a[k]*us/ta,b[k]*us/tb,a[k]*us/ta-b[k]*us/tb,k[:90]))
