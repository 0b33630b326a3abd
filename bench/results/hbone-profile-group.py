# Groups `perf script -F ip,sym,dso` lines by symbol family (self time) for bench/results/hbone-profile.txt.
import re,collections,sys
c=collections.Counter(); tot=0; top=collections.Counter()
for line in open(sys.argv[1]):
    m=re.match(r'\s*[0-9a-f]+\s+(.*)\s+\((.*)\)\s*$',line)
    if not m: continue
    sym,dso=m.group(1),m.group(2)
    tot+=1
    top[sym[:100]]+=1
    s=sym
    if 'kallsyms' in dso or 'bpf_prog' in s:
        if re.search(r'entry_SYSCALL|syscall_|__x64_sys|do_syscall|syscall_exit|exit_to_user|__sys_',s): k='kernel: syscall entry/exit'
        elif re.search(r'epoll|ep_',s): k='kernel: epoll'
        elif re.search(r'copy_user|copy_to|copy_from|memcpy|memmove|_copy_|csum',s): k='kernel: copies'
        elif re.search(r'schedule|futex|wake|enqueue|dequeue|finish_task|pick_next|__switch|update_curr|ttwu|sched|idle',s): k='kernel: scheduler/futex/wakeups'
        elif re.search(r'tcp|ip_|inet|sk_|sock|skb|netif|net_|veth|br_|nf_|fib|eth_|dev_|bbr|tc_|cls_|bpf|napi|neigh|qdisc|rt_|dst_|raw_|udp|ipv4|__ip|ipt_|nft|conntrack|kfree_skb|alloc_skb|kmem|slab|kmalloc|kfree|page|folio',s): k='kernel: network stack (incl. skb alloc)'
        else: k='kernel: other'
    else:
        if re.search(r'aes|gcm|ghash|gfmul|p256|sha|ecp_|x25519|ring_core|aws_lc|chacha|poly1305',s,re.I): k='user: crypto (AES-GCM records; handshakes)'
        elif 'rustls' in s: k='user: rustls (record layer, buffers)'
        elif 'h2::' in s: k='user: h2 (framing, flow control, streams)'
        elif 'tracing' in s: k='user: tracing spans/events'
        elif re.search(r'malloc|free|_int_|realloc|calloc|cfree|arena|tcache|alloc::alloc|__rust_alloc|__rust_dealloc|sdallocx|je_',s): k='user: allocator'
        elif re.search(r'memcpy|memmove|memset',s): k='user: memcpy/memset'
        elif 'tokio' in s or 'mio::' in s: k='user: tokio runtime + I/O driver'
        elif 'shunt::' in s: k='user: shunt proxy code'
        elif re.search(r'writev|__libc|read|write|recv|send|epoll_wait|syscall|pthread|__GI',s): k='user: libc syscall stubs'
        elif re.search(r'core::|futures|alloc::|bytes::|smallvec|hashbrown|std::',s): k='user: futures/core/collections glue'
        else: k='user: other'
    c[k]+=1
for k,v in c.most_common(): print(f"{100*v/tot:5.1f}%  {k}")
print(tot,"samples")
print("--- top 25 symbols")
for k,v in top.most_common(25): print(f"{100*v/tot:5.1f}%  {k}")
