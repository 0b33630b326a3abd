import sys, collections, re
def load(path, pids, conns):
    c = collections.Counter()
    for line in open(path):
        parts = line.split(None, 4)
        if len(parts) < 4: continue
        pid = parts[1].split('/')[0]
        if pid not in pids: continue
        rest = line.split(None, 3)[3] if len(line.split(None,3))>3 else ''
        sym = re.sub(r'\+0x[0-9a-f]+', '', rest.strip())
        sym = re.sub(r'^[0-9a-f]+ ', '', sym)
        c[sym] += 1
    us = 1e6/2999
    return {k: v*us/conns for k, v in c.items()}
d = load('dleaf.txt', {'12607','12617','12611'}, (4.87+3.53)*1000*2.3)
f = load('leaf.txt', {'11936','11955','11945'}, (3.14+3.83)*1000*2.3)
keys = set(d)|set(f)
rows = sorted(((f.get(k,0)-d.get(k,0), d.get(k,0), f.get(k,0), k) for k in keys), reverse=True)
print("total direct %.1f fast %.1f" % (sum(d.values()), sum(f.values())))
for r in rows[:45]: print("%+6.2f %6.2f %6.2f %s" % r)
print('...')
for r in rows[-10:]: print("%+6.2f %6.2f %6.2f %s" % r)
