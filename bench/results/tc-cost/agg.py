import json,sys
last={}
for line in open(sys.argv[1]):
    line=line.strip()
    if not line: continue
    try: progs=json.loads(line)
    except Exception: continue
    for p in progs:
        n=p.get('name','')
        if n.startswith(('shunt_tc', 'shunt_sock', 'shunt_conn', 'shunt_getp')):
            last[p['id']]=(n,p.get('run_cnt',0),p.get('run_time_ns',0))
agg={}
for i,(n,c,t) in last.items():
    a=agg.setdefault(n,[0,0]); a[0]+=c; a[1]+=t
for n,(c,t) in sorted(agg.items()):
    print(f"{n:28s} runs {c:>10d}  ns/run {t/max(c,1):7.1f}  total ms {t/1e6:8.1f}")
