//! TC programs on an enrolled pod's `eth0` (inside the pod's netns): they
//! count the pod's traffic, steer inbound plaintext TCP to the proxy, and
//! turn the application's replies to the proxy's transparent inbound sockets
//! back into the pod (source-address preservation).
//!
//! One instance of these programs, loaded and verified once by the agent,
//! serves every enrolled pod: each pod's filter carries the pod's slot in its
//! `classid` (minor = slot + 1), which `cls_bpf` copies into the packet's
//! `tc_classid` before running the program. A per-packet map lookup cannot
//! find the pod instead: `bpf_get_netns_cookie()` on an skb answers for the
//! packet's socket, and arriving packets have none yet (measured: it returned
//! the wrong namespace on ingress), while ifindexes repeat across pod
//! namespaces. The classid costs nothing per packet and no program load per
//! pod (an earlier release loaded one instance per pod with the slot baked
//! in; filters it left behind keep working until their pod is unenrolled).

use aya_ebpf::{
    Global,
    bindings::{
        BPF_F_CURRENT_NETNS, BPF_F_INGRESS, BPF_TCP_LISTEN, BPF_TCP_NEW_SYN_RECV, TC_ACT_OK,
        TC_ACT_SHOT, bpf_sock, bpf_sock_tuple,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 as Tuple4,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 as Tuple6,
    },
    helpers::{bpf_redirect, bpf_sk_assign, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};
use aya_log_ebpf::debug;
use shunt_common::{
    MARK_MASK, PORT_HBONE, PORT_INBOUND_PLAINTEXT, PodConfig, PodCounters, REPLY_MARK,
};

use crate::maps::{CONFIG, POD_CONFIG, counters};

/// Non-zero when the agent logs kernel debug lines: only then does egress
/// parse headers to log connection starts (nothing extra per packet
/// otherwise).
#[unsafe(no_mangle)]
static LOG_CONNECTIONS: Global<u8> = Global::new(0);

const ETH_HDR_LEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_RST: u8 = 0x04;
const TCP_FLAG_ACK: u8 = 0x10;
/// `lo` is ifindex 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// Hook: TC ingress (clsact) on an enrolled pod's `eth0` — packets arriving
/// at the pod. Counts every packet. When the pod's inbound redirection is on,
/// a TCP SYN to the pod that belongs to no existing connection (a new
/// connection) is assigned to the proxy's 15006 listener with
/// `bpf_sk_assign`, keeping its destination, so the accepted socket's local
/// address is the original one. Never steered: port 15008 (HBONE, the proxy
/// binds it), the health-probe source, excluded ports, the SYN of a
/// same-node mesh connection the kernel carries (`mesh_local.rs`). No proxy listener:
/// the packet is dropped and counted (fail closed). Cost: a socket lookup
/// per arriving SYN (two when it is steered), nothing but the counters and
/// a header parse for every other packet. Miss path: `TC_ACT_OK`.
#[classifier]
pub fn shunt_tc_ingress(ctx: TcContext) -> i32 {
    crate::fixture::previous_release_marker();
    let slot = pod_slot(&ctx);
    // Out of range (including "no pod") fails the lookup: the miss path.
    let Some(stats) = counters(slot) else {
        return TC_ACT_OK;
    };
    stats.packets_in += 1;
    stats.bytes_in += u64::from(ctx.len());
    let Some(config) = POD_CONFIG.get(slot) else {
        return TC_ACT_OK;
    };
    if config.flags & PodConfig::REDIRECT_INBOUND == 0 {
        return TC_ACT_OK;
    }
    match parse_tcp(&ctx) {
        // Kubelet's probe (a node socket's connection): the probe source,
        // then straight to the application like any probe.
        Some(packet)
            if !packet.v6
                && crate::host_probe::node_netns() != 0
                && crate::host_probe::from_node(
                    &ctx,
                    packet.saddr[0],
                    packet.daddr[0],
                    packet.sport_be,
                    packet.dport_be,
                    packet.l4,
                ) =>
        {
            TC_ACT_OK
        }
        Some(packet) => steer_inbound(&ctx, slot, config, stats, &packet),
        None => TC_ACT_OK,
    }
}

/// Hook: TC egress (clsact) on an enrolled pod's `eth0` — packets the pod
/// sends. Counts every packet that leaves (and logs connection starts at
/// debug level).
///
/// Reply path of source preservation (pod flag `REPLY_TO_PROXY`): the proxy
/// connects to the application from the client's address (`IP_TRANSPARENT`),
/// so the application answers a foreign address and routing sends the answer
/// here. Match: a TCP packet for which a non-listening socket of this netns
/// has the packet's destination as its local address (looked up as an
/// arriving packet would be: `bpf_skc_lookup_tcp` with the packet's own
/// tuple) — only a transparent socket can own a non-local address, and the
/// proxy's are the only ones. With pod flag `REPLY_BY_MARK` only packets
/// that can be such replies are looked up: a non-zero `skb->mark` (the
/// application's end of a proxy connection took the proxy's SYN's mark,
/// `tcp_fwmark_accept`; so do its time-wait ACKs), or SYN or RST set (a
/// SYN-ACK leaves a request socket with the listener's mark, an RST the
/// netns's control socket, possibly with none); any other packet — mark 0,
/// neither flag: the fast path's and every direct connection's — is let
/// through after the header parse, with no lookup.
///
/// Action: the packet gets mark 0x111 (low 12 bits; the rest kept), zero
/// MAC addresses (`lo`'s, or the stack drops it as another host's) and is
/// redirected into `lo`'s ingress; there the policy route (fwmark 0x111 →
/// local table 1337) delivers it to the proxy's socket. The mark survives:
/// the redirect stays in this netns, and only a netns crossing scrubs it.
/// The handshake's SYN-ACK takes this path too. Such packets are not
/// counted as the pod's outbound traffic.
///
/// Packets to or from port 15008 (HBONE) are never looked up (see
/// [`may_reply_to_proxy`]).
///
/// Cost (`kernel.bpf_stats_enabled`, docs/BENCHMARKS.md): one socket
/// lookup per packet looked up — most of a run when every TCP packet was
/// (≈ 500 ns per leaving packet on the fast path); with `REPLY_BY_MARK` a
/// packet of a direct connection pays the counters and the header parse
/// only (≈ 165 ns). No parse at all when `REPLY_TO_PROXY` is off. Miss
/// path: `TC_ACT_OK`.
#[classifier]
pub fn shunt_tc_egress(ctx: TcContext) -> i32 {
    crate::fixture::previous_release_marker();
    let slot = pod_slot(&ctx);
    let Some(stats) = counters(slot) else {
        return TC_ACT_OK;
    };
    let flags = POD_CONFIG.get(slot).map_or(0, |config| config.flags);
    let reply_to_proxy = flags & PodConfig::REPLY_TO_PROXY != 0;
    let log = LOG_CONNECTIONS.load() != 0;
    let probes = crate::host_probe::node_netns() != 0;
    let packet = if reply_to_proxy || log || probes {
        parse_tcp(&ctx)
    } else {
        None
    };
    // The application's answer to kubelet's probe: back to the node's
    // address (`host_probe.rs`).
    if probes
        && let Some(packet) = &packet
        && !packet.v6
        && crate::host_probe::to_node(
            &ctx,
            packet.saddr[0],
            packet.daddr[0],
            packet.sport_be,
            packet.dport_be,
            packet.l4,
        )
    {
        stats.packets_out += 1;
        stats.bytes_out += u64::from(ctx.len());
        return TC_ACT_OK;
    }
    if let Some(packet) = &packet
        && reply_to_proxy
        && may_reply_to_proxy(&ctx, flags, packet)
        && to_transparent_socket(&ctx, packet)
    {
        // Not counted: it never crosses eth0 (the counters match the
        // interface's own).
        return turn_back_to_proxy(&ctx);
    }
    stats.packets_out += 1;
    stats.bytes_out += u64::from(ctx.len());
    if log
        && let Some(packet) = &packet
        && packet.flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    {
        debug!(
            &ctx,
            "pod slot {}: new TCP connection out to port {}", slot, packet.dport
        );
    }
    TC_ACT_OK
}

/// The slot of the pod whose filter runs this program: the filter's classid
/// minor minus one (`cls_bpf` writes it into `tc_classid` before every run; see
/// the module docs). A filter without a classid gives `u32::MAX`, which no
/// per-pod array holds: the miss path.
#[inline(always)]
fn pod_slot(ctx: &TcContext) -> u32 {
    // SAFETY: the context's skb; `tc_classid` is readable by TC programs.
    let classid = unsafe { (*ctx.skb.skb).tc_classid };
    (classid & 0xffff).wrapping_sub(1)
}

/// Whether `packet` can be a reply to one of the proxy's transparent
/// sockets, before any lookup: never to or from port 15008, else always,
/// unless the pod has `REPLY_BY_MARK` (see [`shunt_tc_egress`]); then only
/// with a mark, a SYN or an RST.
///
/// Port 15008 is the HBONE connections' (the proxy's, every record of a
/// cross-node request and its answer), and no reply to a transparent socket
/// uses it: such a reply leaves from the port a delivery connected to, and
/// the proxy never delivers to its own ports (`PROXY_PORTS`: CONNECTs to
/// them are refused, TC ingress never steers them); it goes to the
/// delivery socket's own port, never 15008 either, because the pod's HBONE
/// listener holds that port in this netns (`connect` never picks a bound
/// port) and `bind_except` refuses it (`proxy/socket.rs`).
#[inline(always)]
fn may_reply_to_proxy(ctx: &TcContext, flags: u32, packet: &TcpPacket) -> bool {
    if packet.sport_be == PORT_HBONE.to_be() || packet.dport_be == PORT_HBONE.to_be() {
        return false;
    }
    if flags & PodConfig::REPLY_BY_MARK == 0 || packet.flags & (TCP_FLAG_SYN | TCP_FLAG_RST) != 0 {
        return true;
    }
    // SAFETY: the context's skb, readable field.
    unsafe { (*ctx.skb.skb).mark != 0 }
}

/// Whether a socket of this netns, not a listener or a request, owns the
/// packet's destination as its local address (see [`shunt_tc_egress`]).
/// Listeners are excluded: a wildcard listener on the destination port would
/// match any address. Time-wait sockets count, so that the application's
/// late FIN/ACK still reach the proxy's closed end.
#[inline(always)]
fn to_transparent_socket(ctx: &TcContext, packet: &TcpPacket) -> bool {
    let mut tuple = tuple_of(packet, packet.dport_be);
    let found = lookup(ctx, &mut tuple, packet.v6);
    if found.is_null() {
        return false;
    }
    // SAFETY: non-null socket from the lookup, released right after.
    let state = unsafe { (*found).state };
    unsafe { bpf_sk_release(found.cast()) };
    state != BPF_TCP_LISTEN && state != BPF_TCP_NEW_SYN_RECV
}

/// Marks the packet for the policy route and sends it into `lo`'s ingress.
#[inline(always)]
fn turn_back_to_proxy(ctx: &TcContext) -> i32 {
    // `lo`'s address is all zeros: a packet addressed to another MAC would be
    // dropped as PACKET_OTHERHOST.
    if ctx.store(0, &[0u8; 12], 0).is_err() {
        return TC_ACT_OK;
    }
    // SAFETY: the context's skb, readable field.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark((mark & !MARK_MASK) | REPLY_MARK);
    // SAFETY: helper call with plain arguments; returns TC_ACT_REDIRECT or
    // TC_ACT_SHOT.
    unsafe { bpf_redirect(LOOPBACK_IFINDEX, u64::from(BPF_F_INGRESS)) as i32 }
}

/// The fields of a TCP packet the programs act on. Addresses and ports in
/// network order, as the socket lookup wants them.
struct TcpPacket {
    v6: bool,
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport_be: u16,
    dport_be: u16,
    /// Host order, for comparisons and logs.
    dport: u16,
    flags: u8,
    /// Offset of the TCP header.
    l4: usize,
}

/// Parses Ethernet + IPv4/IPv6 (no extension headers) + TCP.
///
/// Reads the headers in place (direct packet access) when the skb's linear
/// part holds them — every TCP packet a veth carries in practice — and only
/// otherwise copies them out field by field ([`parse_tcp_copied`]). Why: this
/// runs for every packet an enrolled pod sends or receives, and each
/// `bpf_skb_load_bytes` is a helper call; the seven of a parse were most of
/// these programs' time per packet (`kernel.bpf_stats_enabled`,
/// docs/BENCHMARKS.md).
#[inline(always)]
fn parse_tcp(ctx: &TcContext) -> Option<TcpPacket> {
    // Every read is at a constant offset from the packet's start: the
    // verifier accepts a read at a variable offset only through the very
    // register it bounds-checked, which the compiler does not promise to
    // keep. So IPv4 with options (TCP at a variable offset) and headers
    // outside the linear part take the copying parse.
    const V4_TCP: usize = ETH_HDR_LEN + 20;
    const V6_TCP: usize = ETH_HDR_LEN + 40;
    // TCP up to its flags byte.
    const TCP_LEN: usize = 14;
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + V4_TCP + TCP_LEN > end {
        return parse_tcp_copied(ctx);
    }
    // SAFETY (every read below): an unaligned read of a plain integer inside
    // the range checked against `data_end` on the way to it.
    let read_u8 = |at: usize| unsafe { core::ptr::read_unaligned((start + at) as *const u8) };
    let read_u16 = |at: usize| unsafe { core::ptr::read_unaligned((start + at) as *const u16) };
    let read_u32 = |at: usize| unsafe { core::ptr::read_unaligned((start + at) as *const u32) };
    let packet = |v6, saddr, daddr, l4: usize| {
        let dport_be = read_u16(l4 + 2);
        TcpPacket {
            v6,
            saddr,
            daddr,
            sport_be: read_u16(l4),
            dport_be,
            dport: u16::from_be(dport_be),
            flags: read_u8(l4 + 13),
            l4,
        }
    };
    match u16::from_be(read_u16(12)) {
        ETH_P_IP => {
            if read_u8(ETH_HDR_LEN) & 0x0f != 5 {
                return parse_tcp_copied(ctx);
            }
            if read_u8(ETH_HDR_LEN + 9) != IPPROTO_TCP {
                return None;
            }
            let saddr = [read_u32(ETH_HDR_LEN + 12), 0, 0, 0];
            let daddr = [read_u32(ETH_HDR_LEN + 16), 0, 0, 0];
            Some(packet(false, saddr, daddr, V4_TCP))
        }
        ETH_P_IPV6 => {
            if start + V6_TCP + TCP_LEN > end {
                return parse_tcp_copied(ctx);
            }
            if read_u8(ETH_HDR_LEN + 6) != IPPROTO_TCP {
                return None;
            }
            let addr = |at: usize| {
                [
                    read_u32(at),
                    read_u32(at + 4),
                    read_u32(at + 8),
                    read_u32(at + 12),
                ]
            };
            Some(packet(
                true,
                addr(ETH_HDR_LEN + 8),
                addr(ETH_HDR_LEN + 24),
                V6_TCP,
            ))
        }
        _ => None,
    }
}

/// [`parse_tcp`] by copying each field out of the skb (`bpf_skb_load_bytes`):
/// for packets whose headers are not all in the linear part.
#[inline(always)]
fn parse_tcp_copied(ctx: &TcContext) -> Option<TcpPacket> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).ok()?);
    let (v6, proto, saddr, daddr, l4) = match ethertype {
        ETH_P_IP => {
            let ver_ihl = ctx.load::<u8>(ETH_HDR_LEN).ok()?;
            let proto = ctx.load::<u8>(ETH_HDR_LEN + 9).ok()?;
            let saddr = ctx.load::<u32>(ETH_HDR_LEN + 12).ok()?;
            let daddr = ctx.load::<u32>(ETH_HDR_LEN + 16).ok()?;
            let l4 = ETH_HDR_LEN + usize::from(ver_ihl & 0x0f) * 4;
            (false, proto, [saddr, 0, 0, 0], [daddr, 0, 0, 0], l4)
        }
        ETH_P_IPV6 => {
            let proto = ctx.load::<u8>(ETH_HDR_LEN + 6).ok()?;
            let saddr = ctx.load::<[u32; 4]>(ETH_HDR_LEN + 8).ok()?;
            let daddr = ctx.load::<[u32; 4]>(ETH_HDR_LEN + 24).ok()?;
            (true, proto, saddr, daddr, ETH_HDR_LEN + 40)
        }
        _ => return None,
    };
    if proto != IPPROTO_TCP {
        return None;
    }
    let sport_be = ctx.load::<u16>(l4).ok()?;
    let dport_be = ctx.load::<u16>(l4 + 2).ok()?;
    let flags = ctx.load::<u8>(l4 + 13).ok()?;
    Some(TcpPacket {
        v6,
        saddr,
        daddr,
        sport_be,
        dport_be,
        dport: u16::from_be(dport_be),
        flags,
        l4,
    })
}

#[inline(always)]
fn steer_inbound(
    ctx: &TcContext,
    slot: u32,
    config: &PodConfig,
    stats: &mut PodCounters,
    packet: &TcpPacket,
) -> i32 {
    // Only a SYN can start a connection; anything else is either part of an
    // existing one or without a socket, the kernel's to refuse. Tested before
    // the socket lookup below, so that a connection's data and ACKs — every
    // packet but its first — cost no lookup here (the kernel does its own).
    if packet.flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) != TCP_FLAG_SYN {
        return TC_ACT_OK;
    }
    if packet.dport == PORT_HBONE || packet.dport == PORT_INBOUND_PLAINTEXT {
        return TC_ACT_OK;
    }
    if config
        .excluded_inbound_ports
        .iter()
        .any(|&p| p != 0 && p == packet.dport)
    {
        return TC_ACT_OK;
    }
    if !packet.v6
        && let Some(global) = CONFIG.get(0)
        && global.probe_source_v4 != 0
        && packet.saddr[0] == global.probe_source_v4
    {
        return TC_ACT_OK;
    }
    // A SYN of an existing connection (a retransmission, a handshake in
    // progress) is left to the kernel's own lookup, which finds the same
    // socket.
    let mut tuple = tuple_of(packet, packet.dport_be);
    let existing = lookup(ctx, &mut tuple, packet.v6);
    if !existing.is_null() {
        // SAFETY: non-null socket from the lookup, released right after.
        let state = unsafe { (*existing).state };
        unsafe { bpf_sk_release(existing.cast()) };
        if state != BPF_TCP_LISTEN {
            return TC_ACT_OK;
        }
    }
    // A new connection: hand it to the proxy's listener.
    // An authorised same-node mesh connection goes to the application.
    if crate::mesh_local::admits(
        slot,
        packet.v6,
        packet.saddr,
        packet.daddr,
        packet.sport_be,
        packet.dport_be,
    ) {
        return TC_ACT_OK;
    }
    let mut tuple = tuple_of(packet, PORT_INBOUND_PLAINTEXT.to_be());
    let proxy = lookup(ctx, &mut tuple, packet.v6);
    if proxy.is_null() {
        stats.inbound_fail_closed += 1;
        debug!(
            ctx,
            "pod slot {}: no inbound listener; dropped SYN to port {}", slot, packet.dport
        );
        return TC_ACT_SHOT;
    }
    // SAFETY: non-null socket from the lookup; released on every path.
    let assigned = unsafe {
        let listening = (*proxy).state == BPF_TCP_LISTEN;
        let result = if listening {
            bpf_sk_assign(ctx.skb.skb.cast(), proxy.cast(), 0)
        } else {
            -1
        };
        bpf_sk_release(proxy.cast());
        result == 0
    };
    if !assigned {
        stats.inbound_fail_closed += 1;
        return TC_ACT_SHOT;
    }
    stats.inbound_redirected += 1;
    TC_ACT_OK
}

#[inline(always)]
fn tuple_of(packet: &TcpPacket, dport_be: u16) -> bpf_sock_tuple {
    // SAFETY: zeroed is a valid tuple; the union member written matches the
    // size passed to the lookup.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    if packet.v6 {
        tuple.__bindgen_anon_1.ipv6 = Tuple6 {
            saddr: packet.saddr,
            daddr: packet.daddr,
            sport: packet.sport_be,
            dport: dport_be,
        };
    } else {
        tuple.__bindgen_anon_1.ipv4 = Tuple4 {
            saddr: packet.saddr[0],
            daddr: packet.daddr[0],
            sport: packet.sport_be,
            dport: dport_be,
        };
    }
    tuple
}

/// A TCP socket (full, request or listener) in this netns matching `tuple`;
/// the caller must release a non-null result.
#[inline(always)]
fn lookup(ctx: &TcContext, tuple: &mut bpf_sock_tuple, v6: bool) -> *mut bpf_sock {
    let size = if v6 {
        core::mem::size_of::<Tuple6>()
    } else {
        core::mem::size_of::<Tuple4>()
    };
    // SAFETY: the tuple lives on the stack for the call.
    unsafe {
        bpf_skc_lookup_tcp(
            ctx.skb.skb.cast(),
            tuple,
            size as u32,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    }
}
