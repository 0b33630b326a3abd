//! `sockops` on the cgroup root: once a redirected connection is established
//! its local address and port are known, so the original destination that
//! `connect4/6` recorded by socket cookie is re-keyed by (netns, local
//! address, local port) — the peer address the proxy sees on accept.

use aya_ebpf::{
    bindings::BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::sock_ops,
    programs::SockOpsContext,
};
use shunt_common::SockKey;

use crate::maps::{ORIGINAL_DST, ORIGINAL_DST_BY_COOKIE};

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// Hook: `sockops` on the cgroup root. Matches the active side of a TCP
/// connection becoming established whose socket cookie has a recorded
/// original destination; moves that record to `SHUNT_ORIG_DST`. Miss path
/// (any other op or socket): nothing, returns 1.
#[sock_ops]
pub fn shunt_sockops(ctx: SockOpsContext) -> u32 {
    if ctx.op() != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        return 1;
    }
    // SAFETY: the helpers only read the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    // SAFETY: plain value copied out of the map.
    let Some(original) = (unsafe { ORIGINAL_DST_BY_COOKIE.get(&cookie) }).copied() else {
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
    let _ = ORIGINAL_DST.insert(&key, &original, 0);
    let _ = ORIGINAL_DST_BY_COOKIE.remove(&cookie);
    1
}
