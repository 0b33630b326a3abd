import sys,re
for f in sys.argv[1:]:
    s=open(f).read().split('\n')
    main={}; cost={}
    sec=None
    for l in s:
        if l.startswith('## All on one CPU'): sec='main'
        if l.startswith('### Cost (pinned)'): sec='cost'
        if l.startswith('<details>'): sec=None
        if l.startswith('| ') and not l.startswith('| path') and not l.startswith('|---'):
            c=[x.strip() for x in l.strip('|').split('|')]
            if sec=='main' and len(c)>=8: main[c[0]]=c
            if sec=='cost' and len(c)>=4: cost[c[0]]=c
    print('==',f)
    for p in main:
        m=main[p]; k=cost.get(p,['']*4)
        print(f"{p[:40]:40s} rr1 {m[1]:>12s} conn {m[5]:>12s} stream {m[6]:>12s} | cpu/rr {k[1]:>14s} cpu/conn {k[2]:>16s} s/GB {k[3]}")
