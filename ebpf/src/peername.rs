//! What an application of an enrolled pod sees as its peer: `getpeername`
//! answers the address it dialled, as a `REDIRECT` or a socket load
//! balancer leaves it, not where the kernel connected the socket.
//!
//! - A connect flow 2 carried through a service VIP
//!   (`mesh_service.rs`): the VIP and port, not the endpoint.
//! - A connect `connect4/6` redirected to the proxy (`connect.rs`): the
//!   original destination, not the proxy's 15001 on loopback (a Go program
//!   calls `getpeername` at every connect for its `RemoteAddr`). Found in
//!   `SHUNT_ORIG_DST` by the socket's own end, as the proxy finds it; the
//!   record lives until the proxy's end closes, after which the loopback
//!   peer shows again.
//! - A TCP DNS query captured to the DNS proxy on 15053 (`dns.rs`): the
//!   server asked, port 53, from `SHUNT_DNS_SERVERS`.
//!
//! Cost per getpeername of a socket of an enrolled pod: one LRU lookup
//! (the VIP records), and one more when its peer is the proxy or the DNS
//! proxy; of any
//! other socket: one lookup of its netns in `SHUNT_ENROLLED`. accept()
//! asks for the peer too, so this runs for every connection a server on
//! the node accepts (≈ 1 µs each in the bench's profile,
//! docs/BENCHMARKS.md).

use core::ptr::addr_of;

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use shunt_common::{MeshServiceSock, OriginalDst, PORT_DNS_PROXY, PORT_OUTBOUND, SockKey};

use crate::maps::{ENROLLED, ORIGINAL_DST};

/// The only value the getpeername hooks may return.
const ALLOW: i32 = 1;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
const LOOPBACK_V4: u32 = u32::from_be_bytes([127, 0, 0, 1]);

/// Hook: `cgroup/getpeername4` on the cgroup root (Linux 5.8+). Matches an
/// IPv4 socket of an enrolled pod whose connect flow 2 carried through a
/// service VIP, or whose connect was redirected to the proxy's
/// 127.0.0.1:15001 or to the DNS proxy's 127.0.0.1:15053. Does: answers
/// the VIP, the original destination or the DNS server, and its port.
/// Miss path (any other socket): the peer address unchanged; returns 1.
#[cgroup_sock_addr(getpeername4)]
pub fn shunt_getpeername4(ctx: SockAddrContext) -> i32 {
    let Some(netns) = enrolled_netns(&ctx) else {
        return ALLOW;
    };
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if let Some(dialled) = dialled(&ctx)
        && dialled.family == AF_INET
    {
        addr.user_ip4 = dialled.addr[0];
        addr.user_port = u32::from((dialled.port as u16).to_be());
        return ALLOW;
    }
    if addr.user_ip4 != LOOPBACK_V4.to_be() {
        return ALLOW;
    }
    if let Some(original) = behind_a_proxy(&ctx, netns, addr.user_port)
        && u32::from(original.family) == AF_INET
    {
        addr.user_ip4 = original.addr[0];
        addr.user_port = u32::from(original.port.to_be());
    }
    ALLOW
}

/// Hook: `cgroup/getpeername6` on the cgroup root (Linux 5.8+). As
/// [`shunt_getpeername4`] for IPv6 sockets: a VIP (a dual-stack socket's
/// v4-mapped one included), or the original destination of a connect
/// redirected to `[::1]` or `::ffff:127.0.0.1`, port 15001 or 15053.
/// Miss path: the peer address unchanged; returns 1.
#[cgroup_sock_addr(getpeername6)]
pub fn shunt_getpeername6(ctx: SockAddrContext) -> i32 {
    let Some(netns) = enrolled_netns(&ctx) else {
        return ALLOW;
    };
    if let Some(dialled) = dialled(&ctx)
        && dialled.family == AF_INET6
    {
        set_peer6(&ctx, dialled.addr, dialled.port as u16);
        return ALLOW;
    }
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &*ctx.sock_addr };
    let peer = addr.user_ip6;
    let v4_mapped = peer[0] == 0 && peer[1] == 0 && u32::from_be(peer[2]) == 0xffff;
    let proxy = if v4_mapped {
        peer[3] == LOOPBACK_V4.to_be()
    } else {
        peer[0] == 0 && peer[1] == 0 && peer[2] == 0 && u32::from_be(peer[3]) == 1
    };
    if !proxy {
        return ALLOW;
    }
    if let Some(original) = behind_a_proxy(&ctx, netns, addr.user_port)
        && u32::from(original.family) == AF_INET6
    {
        set_peer6(&ctx, original.addr, original.port);
    }
    ALLOW
}

/// The socket's netns cookie, if that netns is an enrolled pod's. Every
/// other socket (the host's, pods outside the mesh) stops at this lookup —
/// a handful of keys, so a cached entry — instead of one in the records
/// below, keyed by ever-new cookies and addresses.
#[inline(always)]
fn enrolled_netns(ctx: &SockAddrContext) -> Option<u64> {
    // SAFETY: the helper only reads the socket's netns.
    let netns = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    // SAFETY: only the presence of the value is read.
    unsafe { ENROLLED.get(netns) }?;
    Some(netns)
}

/// The VIP the socket dialled, if flow 2 carried its connect through one.
#[inline(always)]
fn dialled(ctx: &SockAddrContext) -> Option<MeshServiceSock> {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    crate::mesh_service::dialled(cookie)
}

/// What a socket whose peer is loopback port `port_be` (network order, as
/// the context holds it) dialled: the original destination if that is
/// the proxy's 15001, the DNS server if the DNS proxy's 15053.
#[inline(always)]
fn behind_a_proxy(ctx: &SockAddrContext, netns: u64, port_be: u32) -> Option<OriginalDst> {
    if port_be == u32::from(PORT_OUTBOUND.to_be()) {
        original_of(ctx, netns)
    } else if port_be == u32::from(PORT_DNS_PROXY.to_be()) {
        crate::dns::remembered(ctx)
    } else {
        None
    }
}

/// The original destination recorded for the socket's own end (keyed as
/// `sockops` keyed it at establishment: a v4-mapped end as IPv4).
#[inline(always)]
fn original_of(ctx: &SockAddrContext, netns: u64) -> Option<OriginalDst> {
    // SAFETY: the context pointer is valid for the program's run.
    let sk = unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk };
    if sk.is_null() {
        return None;
    }
    // Every field is read, unconditionally, at its fixed offset: the
    // verifier allows no pointer arithmetic on a socket, which a pointer
    // chosen by branch (IPv4 or IPv6 address) would compile to.
    let field = |at: *const u32| {
        // SAFETY: a field of the non-null socket from the context; the
        // verifier checks the access.
        unsafe { core::ptr::read_volatile(at) }
    };
    // SAFETY (each `addr_of!`): a field address of that socket; nothing is
    // dereferenced but by `field`.
    let (family, port, ip4) = unsafe {
        (
            field(addr_of!((*sk).family)),
            field(addr_of!((*sk).src_port)),
            field(addr_of!((*sk).src_ip4)),
        )
    };
    // SAFETY: as above.
    let ip6 = unsafe {
        [
            field(addr_of!((*sk).src_ip6[0])),
            field(addr_of!((*sk).src_ip6[1])),
            field(addr_of!((*sk).src_ip6[2])),
            field(addr_of!((*sk).src_ip6[3])),
        ]
    };
    let (family, addr) = if family == AF_INET {
        (AF_INET, [ip4, 0, 0, 0])
    } else if ip6[0] == 0 && ip6[1] == 0 && u32::from_be(ip6[2]) == 0xffff {
        (AF_INET, [ip6[3], 0, 0, 0])
    } else {
        (AF_INET6, ip6)
    };
    let key = SockKey {
        netns_cookie: netns,
        addr,
        port,
        family,
    };
    // SAFETY: plain value copied out of the map.
    unsafe { ORIGINAL_DST.get(&key) }.copied()
}

/// Writes the peer's IPv6 address (as the verifier allows) and port.
#[inline(always)]
fn set_peer6(ctx: &SockAddrContext, words: [u32; 4], port: u16) {
    crate::mesh_service::set_ip6(ctx, words);
    // SAFETY: the context pointer is valid for the program's run.
    unsafe { (*ctx.sock_addr).user_port = u32::from(port.to_be()) };
}
