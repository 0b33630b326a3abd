//! DNS capture: an enrolled pod's DNS (UDP and TCP to port 53) goes to the
//! agent's DNS proxy bound inside the same netns on 127.0.0.1:15053 and
//! [::1]:15053, as Istio's iptables rules send it to ztunnel's.
//!
//! - Unconnected UDP (`sendto`/`sendmsg` with an address): `cgroup/sendmsg4`
//!   and `cgroup/sendmsg6` rewrite the datagram's destination and remember
//!   the server the application asked, by socket cookie
//!   (`SHUNT_DNS_SERVERS`); `cgroup/recvmsg4` and `cgroup/recvmsg6` rewrite
//!   the source of the answer (the proxy's address) back to that server
//!   and port 53, because resolvers drop answers from an address they did
//!   not ask (glibc, musl, Go all check it).
//! - TCP and connected UDP: `connect4`/`connect6` call [`connect4`] and
//!   [`connect6`] first, before the policy check and the fast path: the
//!   connect is rewritten to the DNS proxy and the server remembered: for
//!   recvmsg (UDP) and for getpeername (`peername.rs`, TCP).
//!
//! Gating is connect.rs's: the socket's netns cookie is enrolled, the pod's
//! `PodConfig::DNS_CAPTURE` is set, the socket is not the proxy's own
//! (`PROXY_MARK`: the DNS proxy's forwarder sockets in the pod), the
//! destination is not loopback (a local resolver, as Istio's `! -o lo` and
//! `! -d 127.0.0.1/32`). And the DNS proxy must be there: the rewrite
//! happens only when a socket is bound on the proxy's address in the pod's
//! netns (a socket lookup); otherwise the query goes to the server it was
//! meant for. DNS fails open, unlike TCP capture: it carries no mesh
//! traffic, and a stock ztunnel with its DNS proxy off binds nothing there.

use aya_ebpf::{
    bindings::{BPF_F_CURRENT_NETNS, BPF_TCP_LISTEN, bpf_sock_addr, bpf_sock_tuple},
    helpers::{
        bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_sk_lookup_tcp, bpf_sk_lookup_udp,
        bpf_sk_release,
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use shunt_common::{OriginalDst, PORT_DNS, PORT_DNS_PROXY, PROXY_MARK, PodConfig};

use crate::maps::{DNS_SERVERS, ENROLLED, POD_CONFIG};

/// The call proceeds (with whatever address the program left). sendmsg and
/// recvmsg hooks must return it (recvmsg cannot refuse).
const ALLOW: i32 = 1;

const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const LOOPBACK_V4: u32 = u32::from_be_bytes([127, 0, 0, 1]);

/// Hook: `cgroup/sendmsg4` on the cgroup root. Matches a UDP datagram sent
/// with a destination address (unconnected socket) to port 53 of a
/// non-loopback IPv4 address, from an enrolled pod with DNS capture on,
/// not the proxy's own socket, while a UDP socket is bound on
/// 127.0.0.1:15053 in the pod's netns. Rewrites the destination to
/// 127.0.0.1:15053 and remembers the server by socket cookie. Miss path:
/// `ALLOW` unchanged (the datagram goes where it was sent).
#[cgroup_sock_addr(sendmsg4)]
pub fn shunt_dns_sendmsg4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if addr.type_ != SOCK_DGRAM || u16::from_be(addr.user_port as u16) != PORT_DNS {
        return ALLOW;
    }
    let dst = addr.user_ip4;
    if u32::from_be(dst) >> 24 == 127 || !captures(&ctx) || is_proxy_socket(addr) {
        return ALLOW;
    }
    if !proxy_bound_v4(&ctx, SOCK_DGRAM) || !remember(&ctx, [dst, 0, 0, 0], AF_INET) {
        return ALLOW;
    }
    addr.user_ip4 = LOOPBACK_V4.to_be();
    addr.user_port = u32::from(PORT_DNS_PROXY.to_be());
    ALLOW
}

/// Hook: `cgroup/sendmsg6` on the cgroup root. As `sendmsg4` for IPv6
/// sockets: a native IPv6 server goes to [::1]:15053 (a UDP socket bound
/// there), a v4-mapped one (`::ffff:a.b.c.d`, a dual-stack socket reaching
/// IPv4) to `::ffff:127.0.0.1`:15053 (the IPv4 socket). Miss path: `ALLOW`
/// unchanged.
#[cgroup_sock_addr(sendmsg6)]
pub fn shunt_dns_sendmsg6(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if addr.type_ != SOCK_DGRAM || u16::from_be(addr.user_port as u16) != PORT_DNS {
        return ALLOW;
    }
    let dst = user_ip6(addr);
    if is_loopback6(dst) || !captures(&ctx) || is_proxy_socket(addr) {
        return ALLOW;
    }
    let (proxy, bound) = proxy_for6(&ctx, dst, SOCK_DGRAM);
    if !bound || !remember(&ctx, dst, AF_INET6) {
        return ALLOW;
    }
    set_user_ip6(addr, proxy);
    addr.user_port = u32::from(PORT_DNS_PROXY.to_be());
    ALLOW
}

/// Hook: `cgroup/recvmsg4` on the cgroup root (UDP only; runs when the
/// application asks for the sender's address). Matches a datagram from
/// 127.0.0.1:15053 on a socket with a server remembered in
/// `SHUNT_DNS_SERVERS` (by sendmsg4 or connect4). Rewrites the source the
/// application sees to that server and port 53. Miss path: `ALLOW`
/// unchanged (recvmsg hooks cannot refuse).
#[cgroup_sock_addr(recvmsg4)]
pub fn shunt_dns_recvmsg4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if addr.user_port != u32::from(PORT_DNS_PROXY.to_be()) || addr.user_ip4 != LOOPBACK_V4.to_be() {
        return ALLOW;
    }
    let Some(server) = remembered(&ctx) else {
        return ALLOW;
    };
    if server.family != AF_INET {
        return ALLOW;
    }
    addr.user_ip4 = server.addr[0];
    addr.user_port = u32::from(PORT_DNS.to_be());
    ALLOW
}

/// Hook: `cgroup/recvmsg6` on the cgroup root. As `recvmsg4` for IPv6
/// sockets: a datagram from [::1]:15053 or `::ffff:127.0.0.1`:15053 on a
/// socket with a remembered server gets that server (as it was asked:
/// native or v4-mapped) and port 53 as its source. Miss path: `ALLOW`
/// unchanged.
#[cgroup_sock_addr(recvmsg6)]
pub fn shunt_dns_recvmsg6(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if addr.user_port != u32::from(PORT_DNS_PROXY.to_be()) {
        return ALLOW;
    }
    let src = user_ip6(addr);
    let from_proxy =
        src == [0, 0, 0, 1u32.to_be()] || src == [0, 0, 0xffffu32.to_be(), LOOPBACK_V4.to_be()];
    if !from_proxy {
        return ALLOW;
    }
    let Some(server) = remembered(&ctx) else {
        return ALLOW;
    };
    if server.family != AF_INET6 {
        return ALLOW;
    }
    set_user_ip6(addr, server.addr);
    addr.user_port = u32::from(PORT_DNS.to_be());
    ALLOW
}

/// Called first by `connect4` for an enrolled pod (`slot`, `config`).
/// Matches a TCP or UDP connect to port 53 of a non-loopback address, DNS
/// capture on for the pod, not the proxy's socket, the DNS proxy bound (TCP:
/// listening) on 127.0.0.1:15053. Rewrites the destination there and
/// remembers the server: for recvmsg4 (UDP) and getpeername (TCP).
/// `Some(verdict)`: the connect is decided; `None` (the miss path):
/// connect4 carries on as without DNS.
#[inline(always)]
pub fn connect4(ctx: &SockAddrContext, config: &PodConfig) -> Option<i32> {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if config.flags & PodConfig::DNS_CAPTURE == 0
        || u16::from_be(addr.user_port as u16) != PORT_DNS
        || (addr.type_ != SOCK_STREAM && addr.type_ != SOCK_DGRAM)
    {
        return None;
    }
    let dst = addr.user_ip4;
    if u32::from_be(dst) >> 24 == 127 || is_proxy_socket(addr) {
        return None;
    }
    if !proxy_bound_v4(ctx, addr.type_) {
        return None;
    }
    if !remember(ctx, [dst, 0, 0, 0], AF_INET) {
        return None;
    }
    addr.user_ip4 = LOOPBACK_V4.to_be();
    addr.user_port = u32::from(PORT_DNS_PROXY.to_be());
    Some(ALLOW)
}

/// As [`connect4`], called first by `connect6`: a native IPv6 server goes
/// to [::1]:15053, a v4-mapped one to `::ffff:127.0.0.1`:15053.
#[inline(always)]
pub fn connect6(ctx: &SockAddrContext, config: &PodConfig) -> Option<i32> {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    if config.flags & PodConfig::DNS_CAPTURE == 0
        || u16::from_be(addr.user_port as u16) != PORT_DNS
        || (addr.type_ != SOCK_STREAM && addr.type_ != SOCK_DGRAM)
    {
        return None;
    }
    let dst = user_ip6(addr);
    if is_loopback6(dst) || is_proxy_socket(addr) {
        return None;
    }
    let (proxy, bound) = proxy_for6(ctx, dst, addr.type_);
    if !bound {
        return None;
    }
    if !remember(ctx, dst, AF_INET6) {
        return None;
    }
    set_user_ip6(addr, proxy);
    addr.user_port = u32::from(PORT_DNS_PROXY.to_be());
    Some(ALLOW)
}

/// Whether the sending socket's netns is an enrolled pod with DNS capture
/// on (the sendmsg hooks' gating; connect4/6 pass their pod's settings).
#[inline(always)]
fn captures(ctx: &SockAddrContext) -> bool {
    // SAFETY: the helper only reads the socket's netns.
    let netns = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    // SAFETY: plain values copied out of the maps.
    let Some(pod) = (unsafe { ENROLLED.get(netns) }).copied() else {
        return false;
    };
    POD_CONFIG
        .get(pod.slot)
        .is_some_and(|config| config.flags & PodConfig::DNS_CAPTURE != 0)
}

/// Remembers the server the socket asked (port 53), for the recvmsg
/// hooks. False when the map refused the entry: then the query is not
/// rewritten, since its answer could not be given the server's address.
#[inline(always)]
fn remember(ctx: &SockAddrContext, server: [u32; 4], family: u16) -> bool {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let server = OriginalDst {
        addr: server,
        port: PORT_DNS,
        family,
    };
    DNS_SERVERS.insert(cookie, &server, 0).is_ok()
}

/// The server the socket asked, if a DNS query of it was captured.
#[inline(always)]
pub fn remembered(ctx: &SockAddrContext) -> Option<OriginalDst> {
    // SAFETY: as above.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    // SAFETY: a plain value copied out of the map.
    unsafe { DNS_SERVERS.get(&cookie) }.copied()
}

#[inline(always)]
fn user_ip6(addr: &bpf_sock_addr) -> [u32; 4] {
    [
        addr.user_ip6[0],
        addr.user_ip6[1],
        addr.user_ip6[2],
        addr.user_ip6[3],
    ]
}

/// Writes an IPv6 address into the context one 32-bit word at a time: the
/// verifier refuses the byte-wise copy a whole-array assignment from a map
/// value compiles to.
#[inline(always)]
fn set_user_ip6(addr: &mut bpf_sock_addr, ip: [u32; 4]) {
    addr.user_ip6[0] = ip[0];
    addr.user_ip6[1] = ip[1];
    addr.user_ip6[2] = ip[2];
    addr.user_ip6[3] = ip[3];
}

#[inline(always)]
fn is_v4_mapped(dst: [u32; 4]) -> bool {
    dst[0] == 0 && dst[1] == 0 && u32::from_be(dst[2]) == 0xffff
}

#[inline(always)]
fn is_loopback6(dst: [u32; 4]) -> bool {
    if is_v4_mapped(dst) {
        u32::from_be(dst[3]) >> 24 == 127
    } else {
        dst[0] == 0 && dst[1] == 0 && dst[2] == 0 && u32::from_be(dst[3]) == 1
    }
}

/// The DNS proxy's address for an IPv6 socket going to `dst`, and whether
/// it is bound: a v4-mapped destination becomes an IPv4 datagram or
/// connection, so it is the IPv4 socket that must be there.
#[inline(always)]
fn proxy_for6(ctx: &SockAddrContext, dst: [u32; 4], kind: u32) -> ([u32; 4], bool) {
    if is_v4_mapped(dst) {
        (
            [0, 0, 0xffffu32.to_be(), LOOPBACK_V4.to_be()],
            proxy_bound_v4(ctx, kind),
        )
    } else {
        let proxy = [0, 0, 0, 1u32.to_be()];
        (proxy, proxy_bound_v6(ctx, proxy, kind))
    }
}

/// The proxy's own sockets carry `PROXY_MARK` and are never captured.
#[inline(always)]
fn is_proxy_socket(addr: &bpf_sock_addr) -> bool {
    // SAFETY: `sk` is always set for sock_addr hooks; the verifier checks
    // the field access.
    let sk = unsafe { addr.__bindgen_anon_1.sk };
    if sk.is_null() {
        return false;
    }
    // SAFETY: non-null socket pointer from the context.
    unsafe { (*sk).mark == PROXY_MARK }
}

/// True if a socket of `kind` (UDP: bound; TCP: listening) is on
/// 127.0.0.1:15053 in the caller's netns.
#[inline(always)]
fn proxy_bound_v4(ctx: &SockAddrContext, kind: u32) -> bool {
    // SAFETY: zeroed is a valid tuple; the union member written is the one
    // the size says the helper reads.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    tuple.__bindgen_anon_1.ipv4.daddr = LOOPBACK_V4.to_be();
    tuple.__bindgen_anon_1.ipv4.dport = PORT_DNS_PROXY.to_be();
    let size =
        core::mem::size_of::<aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>();
    bound(ctx, &mut tuple, size as u32, kind)
}

#[inline(always)]
fn proxy_bound_v6(ctx: &SockAddrContext, proxy: [u32; 4], kind: u32) -> bool {
    // SAFETY: as above.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    tuple.__bindgen_anon_1.ipv6.daddr = proxy;
    tuple.__bindgen_anon_1.ipv6.dport = PORT_DNS_PROXY.to_be();
    let size =
        core::mem::size_of::<aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>();
    bound(ctx, &mut tuple, size as u32, kind)
}

#[inline(always)]
fn bound(ctx: &SockAddrContext, tuple: &mut bpf_sock_tuple, size: u32, kind: u32) -> bool {
    // SAFETY: the tuple lives on the stack for the call; a returned socket
    // is released before returning.
    unsafe {
        if kind == SOCK_DGRAM {
            let sk = bpf_sk_lookup_udp(
                ctx.sock_addr.cast(),
                tuple,
                size,
                BPF_F_CURRENT_NETNS as u64,
                0,
            );
            if sk.is_null() {
                return false;
            }
            bpf_sk_release(sk.cast());
            true
        } else {
            let sk = bpf_sk_lookup_tcp(
                ctx.sock_addr.cast(),
                tuple,
                size,
                BPF_F_CURRENT_NETNS as u64,
                0,
            );
            if sk.is_null() {
                return false;
            }
            let listening = (*sk).state == BPF_TCP_LISTEN;
            bpf_sk_release(sk.cast());
            listening
        }
    }
}
