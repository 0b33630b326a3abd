import sys
txt=open(sys.argv[1]).read().split('\n\n')
stacks=[]
for s in txt:
    lines=[l.strip() for l in s.strip().split('\n')[1:] if l.strip()]
    if lines: stacks.append(' '.join(lines))
n=len(stacks)
probes=[('TLS (rustls/tokio-rustls, incl. its syscalls)','rustls'),
('AES-GCM (ring)','ring_core'),
('h2 connection/stream code (incl. TLS below it)','h2::'),
('kernel TCP send path (tcp_sendmsg)','tcp_sendmsg'),
('kernel TCP receive syscalls (tcp_recvmsg)','tcp_recvmsg'),
('epoll_wait (incl. sleeping/wake)','epoll_wait'),
('tokio scheduler bookkeeping (poll-time stats: Instant/pow)','Instant>::elapsed'),
('tracing span enter/exit','tracing_subscriber'),
('malloc/free','malloc'),
('memcpy (userspace)','__memmove_avx'),
('copy_bidirectional / relay','copy_bidirectional'),
('relay','relay::'),
('futex','futex'),
('context switch (schedule)','__schedule'),
]
print(f"samples: {n}")
for name,p in probes:
    c=sum(1 for s in stacks if p in s)
    print(f"| {name} | {100*c/n:.1f}% |")
