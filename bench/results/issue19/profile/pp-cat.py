import sys,re,subprocess,collections
data=sys.argv[1]
out=subprocess.run(['perf','report','-i',data,'--no-children','-g','none','--sort','dso,sym','-q','--percent-limit','0'],capture_output=True,text=True).stdout
cats=collections.OrderedDict()
rules=[
 ('TLS crypto (ring AES-GCM)', r'aes|gcm|ghash|ring_core|ring::|chacha|poly1305|clmul'),
 ('TLS record layer (rustls, tokio-rustls)', r'rustls'),
 ('HTTP/2 framing, flow control, stream state (h2)', r'\bh2::|<h2::'),
 ('tokio runtime (scheduler, reactor, wakers)', r'tokio::runtime|tokio::sync|parking_lot|mio::|tokio::util|std::sys::sync|tokio::task'),
 ('tokio I/O glue & copy loop', r'tokio::io|tokio::net|copy_bidirectional|CopyBuffer'),
 ('tracing (spans, access log)', r'tracing'),
 ('allocation (malloc/free)', r'malloc|free|_int_|cfree|realloc|tcache|arena|calloc'),
 ('memcpy/memmove (userspace)', r'__memmove|__memcpy|memcpy|memmove|memset'),
 ('shunt proxy code', r'shunt::'),
 ('other userspace', r'.'),
]
krules=[
 ('kernel: scheduler, context switches, futex', r'schedule|switch|pick_next|enqueue|dequeue|update_curr|update_load|futex|wake_up|try_to_wake|ttwu|select_task|finish_task|set_next|put_prev|psi_|rseq|cpuacct|update_rq|sched|idle|hrtick|reweight|place_entity|__cgroup_account|newidle|load_balance|task_tick|account_'),
 ('kernel: epoll', r'ep_|epoll|__fput|fdget'),
 ('kernel: syscall entry/exit', r'entry_SYSCALL|syscall_exit|do_syscall|syscall_return|__x64_sys|exit_to_user|fpregs|restore_fpregs|switch_fpu|srso|retbleed|untrain|clear_bhb|x64_sys_call|syscall_enter'),
 ('kernel: TCP/IP stack, loopback and veth, softirq', r'tcp|ip_|inet|sk_|skb|sock|net_|napi|netif|dev_|veth|__dev|nf_|ipt|fib|dst_|neigh|csum|raw_spin|_raw|lock_sock|release_sock|bpf|softirq|__local_bh|kmem_cache|kmalloc|kfree|page_frag|__alloc|slab|memcg|copy_user|_copy_|iov_iter|rep_movs|memcpy|memset|check_heap|__check_object|refill_obj|mod_memcg|obj_cgroup|__build_skb|eth_|loopback|validate_xmit|qdisc|rcu|__rcu|percpu|rb_|lock|_find|ktime|read_tsc|clock|irq'),
 ('kernel: other', r'.'),
]
for line in out.splitlines():
    m=re.match(r'\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)$',line)
    if not m: continue
    pct=float(m.group(1)); dso=m.group(2); kind=m.group(3); sym=m.group(4)
    if kind=='k':
        for name,rx in krules:
            if re.search(rx,sym): cats[name]=cats.get(name,0)+pct; break
    else:
        for name,rx in rules:
            if re.search(rx,sym) or (name.startswith('allocation') and 'libc' in dso and re.search(r'malloc|free|_int_',sym)):
                cats[name]=cats.get(name,0)+pct; break
tot=sum(cats.values())
for k,v in sorted(cats.items(),key=lambda x:-x[1]):
    print(f"| {k} | {v:.1f}% |")
print(f"| total | {tot:.1f}% |")
