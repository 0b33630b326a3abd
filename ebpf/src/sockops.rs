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

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::sock_ops,
    programs::SockOpsContext,
};
use shunt_common::SockKey;

use crate::{
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
/// connection whose splice was started: joins it; (4) a spliced socket
/// closing: forgets it. Miss path (any other op or socket): nothing,
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
            return 1;
        }
        BPF_SOCK_OPS_STATE_CB => {
            splice::leave_on_close(&ctx);
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
