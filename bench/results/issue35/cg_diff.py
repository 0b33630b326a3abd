"""Self instructions per function, the difference of two callgrind outputs
(more repetitions minus fewer) over a number of transactions, grouped
also by crate. usage: cg_diff.py FEW.out MORE.out TRANSACTIONS [TOP]"""
import collections, re, subprocess, sys

def per_function(path):
    text = subprocess.run(['callgrind_annotate', '--inclusive=no', '--threshold=100', path],
                          capture_output=True, text=True).stdout
    out = {}
    for line in text.splitlines():
        m = re.match(r'\s*([\d,]+)\s+\([^)]*\)\s+(?:\?\?\?|[./][^:]*):(.*)', line)
        if m and '[' in line:
            ir = int(m.group(1).replace(',', ''))
            name = re.sub(r'\s*\[[^\]]*\]\s*$', '', m.group(2)).strip()
            out[name] = out.get(name, 0) + ir
    return out

def crate(name):
    n = name.lstrip('<').replace('&', '').replace('mut ', '')
    m = re.match(r'([a-z_][a-z0-9_]*)::', n)
    if m:
        return m.group(1)
    return 'libc/other' if not n.startswith('0x') else 'unknown'

few, more, txns = per_function(sys.argv[1]), per_function(sys.argv[2]), float(sys.argv[3])
top = int(sys.argv[4]) if len(sys.argv) > 4 else 30
diff = {k: (more.get(k, 0) - few.get(k, 0)) / txns for k in set(few) | set(more)}
total = sum(diff.values())
print(f'{total:,.0f} instructions per transaction (self, all functions)')
by = collections.Counter()
for k, v in diff.items():
    by[crate(k)] += v
print('by crate:')
for c, v in by.most_common(15):
    print(f'  {v:10,.0f}  {v / total * 100:5.1f} %  {c}')
print('top functions:')
for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
    print(f'  {v:10,.0f}  {k[:150]}')
