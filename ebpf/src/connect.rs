//! Outbound capture: `cgroup/connect4` and `cgroup/connect6` on the cgroup
//! root. A TCP connect() from an enrolled pod is rewritten, before the SYN
//! exists, to the proxy's outbound listener in the same netns; the original
//! destination is remembered by socket cookie (`sockops` re-keys it by the
//! socket's local address once that is known).

use aya_ebpf::{
    bindings::{BPF_F_CURRENT_NETNS, BPF_TCP_LISTEN, bpf_sock_tuple},
    helpers::{
        bpf_bind, bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_sk_lookup_tcp, bpf_sk_release,
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use aya_log_ebpf::debug;
use shunt_common::{FastPathDest, OriginalDst, PORT_OUTBOUND, PROXY_MARK, PodConfig};

use crate::{
    maps::{ENROLLED, ORIGINAL_DST_BY_COOKIE, POD_ADDRS, POD_CONFIG, counters},
    passthrough,
    sockopt::{SockaddrIn, SockaddrIn6},
};

/// connect() proceeds (with whatever address the program left).
const ALLOW: i32 = 1;
/// connect() fails with EPERM.
const REJECT: i32 = 0;

const SOCK_STREAM: u32 = 1;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const LOOPBACK_V4: u32 = u32::from_be_bytes([127, 0, 0, 1]);

/// Hook: `cgroup/connect4` on the cgroup root. Matches TCP connects from a
/// socket in an enrolled netns, without the proxy's mark, to a non-loopback,
/// non-excluded destination. Rewrites the destination to 127.0.0.1:15001,
/// binds the socket to the pod's own address (as a `REDIRECT` leaves it)
/// and records the original — unless the fast path lets it go direct (a
/// same-node mesh pod, `mesh_local.rs`, or a service VIP whose endpoints
/// all are, rewritten to one of them, `mesh_service.rs`; a destination
/// outside the mesh, `passthrough.rs`); if no proxy listens there, refuses the
/// connect (fail closed). DNS (TCP or UDP to port 53) is decided first, by
/// `dns::connect4`. Miss path: `ALLOW` unchanged.
#[cgroup_sock_addr(connect4)]
pub fn shunt_connect4(ctx: SockAddrContext) -> i32 {
    crate::fixture::previous_release_marker();
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    let Some((slot, config)) = pod_of(&ctx) else {
        return ALLOW;
    };
    if let Some(verdict) = crate::dns::connect4(&ctx, &config) {
        return verdict;
    }
    if addr.type_ != SOCK_STREAM || config.flags & PodConfig::REDIRECT_OUTBOUND == 0 {
        return ALLOW;
    }
    let dst = addr.user_ip4;
    let port = u16::from_be(addr.user_port as u16);
    if u32::from_be(dst) >> 24 == 127 || is_proxy_socket(addr) || excluded(&config, dst, port) {
        return ALLOW;
    }
    if crate::policy::denied(slot, dst, port) {
        return REJECT;
    }
    if let Some(verdict) = crate::mesh_service::connect4(&ctx, slot, &config, dst, port) {
        return verdict;
    }
    if crate::mesh_local::carried_in_kernel(&ctx, slot, &config, &FastPathDest::v4(dst), port, 0)
        || passthrough::goes_direct(&ctx, slot, &config, &FastPathDest::v4(dst))
    {
        return ALLOW;
    }
    let original = OriginalDst {
        addr: [dst, 0, 0, 0],
        port,
        family: AF_INET,
    };
    if !claim(&ctx, slot, proxy_listening_v4(&ctx), &original) {
        return REJECT;
    }
    addr.user_ip4 = LOOPBACK_V4.to_be();
    addr.user_port = u32::from(PORT_OUTBOUND.to_be());
    if let Some(own) = POD_ADDRS.get(slot)
        && own.ipv4 != 0
    {
        let mut source = SockaddrIn {
            family: AF_INET,
            port: 0,
            addr: own.ipv4,
            zero: [0; 8],
        };
        bind_source(&ctx, &mut source);
    }
    ALLOW
}

/// Hook: `cgroup/connect6` on the cgroup root. As `connect4`, for IPv6
/// sockets: a v4-mapped destination (`::ffff:a.b.c.d`, a dual-stack socket
/// reaching IPv4) goes to `::ffff:127.0.0.1`:15001, bound to the pod's
/// IPv4 address v4-mapped, a native IPv6 one to `[::1]`:15001, bound to
/// the pod's IPv6 address. Miss path: `ALLOW` unchanged.
#[cgroup_sock_addr(connect6)]
pub fn shunt_connect6(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    let Some((slot, config)) = pod_of(&ctx) else {
        return ALLOW;
    };
    if let Some(verdict) = crate::dns::connect6(&ctx, &config) {
        return verdict;
    }
    if addr.type_ != SOCK_STREAM || config.flags & PodConfig::REDIRECT_OUTBOUND == 0 {
        return ALLOW;
    }
    let dst = [
        addr.user_ip6[0],
        addr.user_ip6[1],
        addr.user_ip6[2],
        addr.user_ip6[3],
    ];
    let port = u16::from_be(addr.user_port as u16);
    let v4_mapped = dst[0] == 0 && dst[1] == 0 && u32::from_be(dst[2]) == 0xffff;
    let loopback = if v4_mapped {
        u32::from_be(dst[3]) >> 24 == 127
    } else {
        dst[0] == 0 && dst[1] == 0 && dst[2] == 0 && u32::from_be(dst[3]) == 1
    };
    if loopback || is_proxy_socket(addr) {
        return ALLOW;
    }
    if v4_mapped && excluded(&config, dst[3], port) || !v4_mapped && port_excluded(&config, port) {
        return ALLOW;
    }
    if crate::policy::denied_v6(slot, dst, port) {
        return REJECT;
    }
    if let Some(verdict) = crate::mesh_service::connect6(&ctx, slot, &config, dst, port) {
        return verdict;
    }
    let dest = FastPathDest { addr: dst };
    if crate::mesh_local::carried_in_kernel(&ctx, slot, &config, &dest, port, 0)
        || passthrough::goes_direct(&ctx, slot, &config, &dest)
    {
        return ALLOW;
    }
    let proxy = if v4_mapped {
        [0, 0, 0xffffu32.to_be(), LOOPBACK_V4.to_be()]
    } else {
        [0, 0, 0, 1u32.to_be()]
    };
    // A v4-mapped connect becomes an IPv4 connection: look for the IPv4
    // listener.
    let listening = if v4_mapped {
        proxy_listening_v4(&ctx)
    } else {
        proxy_listening_v6(&ctx, proxy)
    };
    let original = OriginalDst {
        addr: dst,
        port,
        family: AF_INET6,
    };
    if !claim(&ctx, slot, listening, &original) {
        return REJECT;
    }
    addr.user_ip6 = proxy;
    addr.user_port = u32::from(PORT_OUTBOUND.to_be());
    if let Some(own) = POD_ADDRS.get(slot) {
        let (source, known) = if v4_mapped {
            ([0, 0, 0xffffu32.to_be(), own.ipv4], own.ipv4 != 0)
        } else {
            (own.ipv6, own.ipv6 != [0; 4])
        };
        if known {
            let mut source = SockaddrIn6 {
                family: AF_INET6,
                port: 0,
                flowinfo: 0,
                addr: source,
                scope_id: 0,
            };
            bind_source(&ctx, &mut source);
        }
    }
    ALLOW
}

/// Binds the connecting socket to `source` with port 0, so the port is
/// still chosen at connect (`BIND_FORCE_ADDRESS_NO_PORT`). The proxy then
/// sees the application's connection from the pod's address, as behind
/// istio-cni's `REDIRECT`, not from loopback (ztunnel logs it as
/// `src.addr` and sends it in `Forwarded`). Best effort: a socket the
/// application bound already keeps its address (the helper's EINVAL is
/// ignored) and comes from loopback.
#[inline(always)]
fn bind_source<T>(ctx: &SockAddrContext, source: &mut T) {
    // SAFETY: `source` is a complete sockaddr of its family on the stack,
    // its size passed with it.
    unsafe {
        bpf_bind(
            ctx.sock_addr,
            (source as *mut T).cast(),
            core::mem::size_of::<T>() as i32,
        )
    };
}

/// Takes the connect for the proxy: records where it was going and counts
/// it. False (the connect must be refused, and is counted as failed
/// closed) when no proxy listens or the record cannot be kept, since the
/// proxy could not forward it.
#[inline(always)]
fn claim(ctx: &SockAddrContext, slot: u32, listening: bool, original: &OriginalDst) -> bool {
    let Some(stats) = counters(slot) else {
        return false;
    };
    if !listening {
        stats.outbound_fail_closed += 1;
        debug!(
            ctx,
            "pod slot {}: no outbound listener; connect refused", slot
        );
        return false;
    }
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    if ORIGINAL_DST_BY_COOKIE.insert(cookie, original, 0).is_err() {
        stats.outbound_fail_closed += 1;
        return false;
    }
    stats.outbound_redirected += 1;
    true
}

/// The enrolled pod owning the connecting socket's netns, with its settings.
#[inline(always)]
fn pod_of(ctx: &SockAddrContext) -> Option<(u32, PodConfig)> {
    // SAFETY: the helper only reads the socket's netns.
    let netns = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    // SAFETY: plain values copied out of the maps.
    let pod = unsafe { ENROLLED.get(netns) }.copied()?;
    let config = POD_CONFIG.get(pod.slot).copied()?;
    Some((pod.slot, config))
}

/// The proxy's own sockets carry `PROXY_MARK` and are never captured.
#[inline(always)]
fn is_proxy_socket(addr: &aya_ebpf::bindings::bpf_sock_addr) -> bool {
    // SAFETY: `sk` is always set for connect hooks; the verifier checks the
    // field access.
    let sk = unsafe { addr.__bindgen_anon_1.sk };
    if sk.is_null() {
        return false;
    }
    // SAFETY: non-null socket pointer from the context.
    unsafe { (*sk).mark == PROXY_MARK }
}

#[inline(always)]
fn excluded(config: &PodConfig, dst_be: u32, port: u16) -> bool {
    if port_excluded(config, port) {
        return true;
    }
    let count = config.excluded_cidr_count as usize;
    for (i, cidr) in config.excluded_cidrs_v4.iter().enumerate() {
        if i < count && cidr.contains(dst_be) {
            return true;
        }
    }
    false
}

#[inline(always)]
fn port_excluded(config: &PodConfig, port: u16) -> bool {
    config
        .excluded_outbound_ports
        .iter()
        .any(|&p| p != 0 && p == port)
}

/// True if a TCP socket listens on 127.0.0.1:15001 in the caller's netns.
#[inline(always)]
fn proxy_listening_v4(ctx: &SockAddrContext) -> bool {
    // SAFETY: zeroed is a valid tuple; the union member written is the one
    // the size says the helper reads.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    tuple.__bindgen_anon_1.ipv4.daddr = LOOPBACK_V4.to_be();
    tuple.__bindgen_anon_1.ipv4.dport = PORT_OUTBOUND.to_be();
    let size =
        core::mem::size_of::<aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>();
    listening(ctx, &mut tuple, size as u32)
}

#[inline(always)]
fn proxy_listening_v6(ctx: &SockAddrContext, proxy: [u32; 4]) -> bool {
    // SAFETY: as above.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    tuple.__bindgen_anon_1.ipv6.daddr = proxy;
    tuple.__bindgen_anon_1.ipv6.dport = PORT_OUTBOUND.to_be();
    let size =
        core::mem::size_of::<aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>();
    listening(ctx, &mut tuple, size as u32)
}

#[inline(always)]
fn listening(ctx: &SockAddrContext, tuple: &mut bpf_sock_tuple, size: u32) -> bool {
    // SAFETY: the tuple lives on the stack for the call; a returned socket
    // is released before returning.
    unsafe {
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
