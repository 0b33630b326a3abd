# usage: ratios.py RUN.json — the agents' CPU per transaction (rr1) and per connection (crr),
# shunt's ebpf/cross/hbone over ztunnel/cross/hbone paired per repetition, and the rate ratios.
import json,statistics,sys
d=json.load(open(sys.argv[1]))
r=d['records']
def per(path, wl):
    out={}
    for x in r:
        if x['path_id']==path and x['workload']==wl:
            rep=x['report']; c=rep['cost']
            out[x['rep']]=(rep['txns'], c['agents_usec'])
    return out
for wl in ('rr1','crr'):
    s=per('ebpf/cross/hbone',wl); z=per('ztunnel/cross/hbone',wl)
    ratios=[]; rates=[]
    for k in s:
        if k in z:
            ratios.append((s[k][1]/s[k][0])/(z[k][1]/z[k][0]))
            rates.append(s[k][0]/z[k][0])
    print(wl, 'cpu/unit ratios', [round(x,4) for x in sorted(ratios)], 'median', round(statistics.median(ratios),4), 'rate median', round(statistics.median(rates),4))
