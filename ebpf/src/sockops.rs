//! `sockops` on the cgroup root, at the two moments a TCP connection
//! becomes established:
//!
//! - the application's end of a connect that `connect4/6` redirected (the
//!   active side): its local address and port are now known, so the original
//!   destination recorded by socket cookie is re-keyed by (netns, local
//!   address, local port) — the peer address the proxy sees on accept — and
//!   the connection starts splicing (`splice.rs`);
//! - the proxy's end of such a connection (the passive side): it joins the
//!   splice;
//! - the proxy's connection delivering an inbound connection to its pod's
//!   application (active, the proxy's mark, to the pod's own address): it
//!   starts splicing, and the application's accepted end (passive) joins;
//!
//! and when a spliced socket closes (its splice state is dropped).
//!
//! The original destination recorded for a redirected connection
//! (`SHUNT_ORIG_DST`) is deleted here, in the kernel, when the proxy's
//! accepted end of that connection closes — not by userspace after it read
//! the entry, and not when the application's end closes. Why: the entry is
//! asked about on the accepted socket (the builtin proxy's lookup right
//! after accept, a stock ztunnel's `getsockopt(SO_ORIGINAL_DST)`, whenever
//! it calls it), so it is needed exactly as long as that socket lives; a
//! stock proxy's reads are invisible to the agent, so userspace could not
//! delete for it, and a read-then-delete would add a syscall to every
//! connection. The application's end may reach `TCP_CLOSE` before the
//! proxy accepted (a client that sends and closes: its orphaned socket
//! skips to `TIME_WAIT` as soon as its FIN is acked), which would delete
//! an entry still to be read. Until this, the LRU kept every closed
//! connection's entry, and under churn dead entries could evict live ones.
//! Cost: one hash lookup at the passive establishment of a connection on
//! port 15001 (the accepted socket then gets state callbacks, as spliced
//! sockets do) and one delete at its close.

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        BPF_TCP_CLOSE,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::sock_ops,
    programs::SockOpsContext,
};
use shunt_common::{PORT_OUTBOUND, SockKey};

use crate::{
    host_probe,
    maps::{ORIGINAL_DST, ORIGINAL_DST_BY_COOKIE},
    passthrough, splice,
};

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// Hook: `sockops` on the cgroup root. Matches (1) the active side of a TCP
/// connection becoming established whose socket cookie has a recorded
/// original destination: moves that record to `SHUNT_ORIG_DST` and starts
/// the connection's splice; (2) any other active side: starts splicing if
/// it is the proxy delivering to its pod, and if it is connected to
/// loopback:15001 without a redirect, forgets a stale record under its
/// local address (`sockopt.rs`); (0, first) every op of a socket whose
/// connect went direct (`passthrough.rs`: reported, then done); (3) the
/// passive side of a
/// connection whose splice was started: joins it; (3b) the passive side of
/// a connection accepted on 15001 whose peer has an original destination
/// recorded: asks for its state changes; (4) a spliced socket closing:
/// forgets it; (4b) a socket accepted on 15001 closing: deletes its peer's
/// `SHUNT_ORIG_DST` entry; (5) a socket of the node's netns connecting to
/// an enrolled pod (before its SYN) and closing: kubelet's probes
/// (`host_probe.rs`). Miss path (any other op or socket): nothing,
/// returns 1.
#[sock_ops]
pub fn shunt_sockops(ctx: SockOpsContext) -> u32 {
    if passthrough::on_sock_ops(&ctx) {
        return 1;
    }
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {}
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            splice::join_passive_end(&ctx);
            watch_accepted(&ctx);
            return 1;
        }
        BPF_SOCK_OPS_STATE_CB => {
            splice::leave_on_close(&ctx);
            forget_on_close(&ctx);
            host_probe::on_state(&ctx);
            return 1;
        }
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            host_probe::on_connect(&ctx);
            return 1;
        }
        _ => return 1,
    }
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    // SAFETY: plain value copied out of the map.
    let Some(original) = (unsafe { ORIGINAL_DST_BY_COOKIE.get(cookie) }).copied() else {
        crate::sockopt::forget_unredirected(&ctx);
        splice::join_delivery_end(&ctx);
        return 1;
    };
    // SAFETY: as above.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    let (family, addr) = if ctx.family() == AF_INET {
        (AF_INET, [ctx.local_ip4(), 0, 0, 0])
    } else {
        let ip6 = ctx.local_ip6();
        // A dual-stack socket reaching IPv4 (::ffff:a.b.c.d): the listener
        // that accepted it sees an IPv4 peer, so key it as IPv4.
        if ip6[0] == 0 && ip6[1] == 0 && u32::from_be(ip6[2]) == 0xffff {
            (AF_INET, [ip6[3], 0, 0, 0])
        } else {
            (AF_INET6, ip6)
        }
    };
    let key = SockKey {
        netns_cookie,
        addr,
        port: ctx.local_port(),
        family,
    };
    let _ = ORIGINAL_DST.insert(key, original, 0);
    let _ = ORIGINAL_DST_BY_COOKIE.remove(cookie);
    splice::join_application_end(&ctx, netns_cookie);
    1
}

/// The `SHUNT_ORIG_DST` key of the connection a socket accepted on the
/// outbound listener serves: its peer (the application's end) in its
/// netns, keyed as the application's end was (v4-mapped as IPv4). `None`
/// for a socket on any other local port.
#[inline(always)]
fn accepted_key(ctx: &SockOpsContext) -> Option<SockKey> {
    if ctx.local_port() != u32::from(PORT_OUTBOUND) {
        return None;
    }
    let (family, addr) = if ctx.family() == AF_INET {
        (AF_INET, [ctx.remote_ip4(), 0, 0, 0])
    } else {
        let ip6 = ctx.remote_ip6();
        if ip6[0] == 0 && ip6[1] == 0 && u32::from_be(ip6[2]) == 0xffff {
            (AF_INET, [ip6[3], 0, 0, 0])
        } else {
            (AF_INET6, ip6)
        }
    };
    // SAFETY: the helper only reads the socket behind the context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    Some(SockKey {
        netns_cookie,
        addr,
        // `remote_port` holds the network-order port in its upper 16 bits.
        port: u32::from(u16::from_be((ctx.remote_port() >> 16) as u16)),
        family,
    })
}

/// The passive end of a redirected connection (accepted on 15001, its
/// peer's original destination recorded at the active end's
/// establishment, which comes first): asks for its state changes, keeping
/// any other callbacks asked for, so that its close deletes the entry.
#[inline(always)]
fn watch_accepted(ctx: &SockOpsContext) {
    let Some(key) = accepted_key(ctx) else {
        return;
    };
    // SAFETY: only the presence of the value is read.
    if unsafe { ORIGINAL_DST.get(&key) }.is_some() {
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    }
}

/// A socket accepted on 15001 closing: nobody can ask about its
/// connection's original destination any more; its entry goes.
#[inline(always)]
fn forget_on_close(ctx: &SockOpsContext) {
    if ctx.arg(1) != BPF_TCP_CLOSE {
        return;
    }
    if let Some(key) = accepted_key(ctx) {
        let _ = ORIGINAL_DST.remove(&key);
    }
}
