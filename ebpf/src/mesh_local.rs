//! Flow 2 of the fast path: same node, mesh to mesh, carried in the kernel.
//!
//! An enrolled pod's connect to another enrolled mesh pod of this node, that
//! the compiled authorization verdicts allow, is not redirected to the
//! proxy: it goes to the destination pod's own address, without TLS, HTTP/2
//! or a proxy copy, and is reported by sockops (`passthrough.rs`: the same
//! record, events and byte accounting, marked `MESH_LOCAL`) so that the
//! agent reports it as both proxies would have.
//!
//! Three hooks take part, each through one call from its program:
//!
//! - `cgroup/connect4` and `cgroup/connect6` ([`carried_in_kernel`]),
//!   after the policy check
//!   (a denied connect was already refused): the source pod allows the
//!   fast path and its verdicts are compiled (`SHUNT_FP_MESH_SRCS`); the
//!   destination address is an eligible pod of this node
//!   (`SHUNT_FP_MESH_DESTS`: no waypoint, HBONE, its verdicts exact) whose
//!   slot is still enrolled with inbound capture and the fast path; flow 2
//!   is on (`SHUNT_FP_MESH_STATE`, off while the verdict table is
//!   incomplete); and the verdict for this port is "allow". Then the
//!   connection's record is kept (`SHUNT_FP_SOCKS`) with the destination's
//!   slot. Any miss: `false`, the connect goes to the proxy as before.
//! - `sockops`, at `TCP_CONNECT_CB` (the source port is known, the SYN not
//!   sent yet; [`on_connect`]): the 4-tuple is written to
//!   `SHUNT_FP_MESH_FLOWS`; at the client socket's move to CLOSE
//!   ([`on_close`]) it is deleted. The entry lives exactly as long as the
//!   client socket.
//! - TC ingress on the destination pod's `eth0` ([`admits`]): a SYN that no
//!   socket owns yet, whose 4-tuple is in the flows map for this very pod's
//!   slot, is left to the kernel (delivered to the application's listener)
//!   instead of being assigned to the proxy's 15006 listener.
//!
//! Never fail open: every lookup that misses sends the connect to the
//! proxy. One case cannot: a flow entry that cannot be written at the SYN
//! (the LRU map full of live flows) — the SYN then reaches the destination
//! pod's proxy as inbound plaintext, which applies the destination's
//! policy as for any client outside the mesh (counted,
//! `flows_unrecorded`). Both families: connect4, and connect6 for native
//! IPv6 destinations and a dual-stack socket's v4-mapped ones (whose SYN
//! is IPv4).

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::{SockAddrContext, SockOpsContext},
};
use shunt_common::{
    FastPathDest, FastPathSock, FastPathState, MAX_MESH_LOCAL_DESTS, MAX_MESH_LOCAL_FLOWS,
    MAX_PODS, MeshFlow, MeshFlowKey, MeshLocalDest, MeshLocalStats, PORT_HBONE,
    PORT_INBOUND_PLAINTEXT, PodConfig, PolicyVerdict, PolicyVerdictKey,
};

use crate::{
    maps::{FAST_PATH_SOCKS, POD_CONFIG},
    policy::POLICY_VERDICTS,
};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// Destination address → its pod's slot. Written by the reconciler only.
#[map(name = "SHUNT_FP_MESH_DESTS")]
pub static MESH_LOCAL_DESTS: HashMap<FastPathDest, MeshLocalDest> =
    HashMap::with_max_entries(MAX_MESH_LOCAL_DESTS, BPF_F_NO_PREALLOC);

/// Source slots whose verdicts are compiled. Written by the reconciler only.
#[map(name = "SHUNT_FP_MESH_SRCS")]
pub static MESH_LOCAL_SOURCES: HashMap<u32, u32> =
    HashMap::with_max_entries(MAX_PODS, BPF_F_NO_PREALLOC);

/// Whether flow 2 may be used (one entry).
#[map(name = "SHUNT_FP_MESH_STATE")]
pub static MESH_LOCAL_STATE: Array<FastPathState> = Array::with_max_entries(1, 0);

/// Authorised same-node connections, by the 4-tuple of their SYN. LRU: an
/// entry whose socket's close was never seen cannot stay for ever.
#[map(name = "SHUNT_FP_MESH_FLOWS")]
pub static MESH_LOCAL_FLOWS: LruHashMap<MeshFlowKey, MeshFlow> =
    LruHashMap::with_max_entries(MAX_MESH_LOCAL_FLOWS, 0);

/// Flow 2's counters.
#[map(name = "SHUNT_FP_MESH_STATS")]
pub static MESH_LOCAL_STATS: PerCpuArray<MeshLocalStats> = PerCpuArray::with_max_entries(1, 0);

/// Called by connect4 after its policy check, for a connect it would
/// otherwise hand on: true when the kernel carries it (see the module
/// docs); the connect then proceeds to `dst_be`:`port` (the caller's,
/// `mesh_service.rs`, rewrites a VIP to it). `flags` go into the
/// connection's record besides `MESH_LOCAL`.
#[inline(always)]
pub fn carried_in_kernel(
    ctx: &SockAddrContext,
    slot: u32,
    config: &PodConfig,
    dst: &FastPathDest,
    port: u16,
    flags: u32,
) -> bool {
    if config.flags & PodConfig::FAST_PATH == 0 {
        return false;
    }
    // SAFETY: plain value copied out of the map.
    let Some(dest) = (unsafe { MESH_LOCAL_DESTS.get(dst) }).copied() else {
        // Not an eligible pod of this node: the proxy's (or passthrough's).
        return false;
    };
    let Some(stats) = stats() else {
        return false;
    };
    if !source_on(slot) {
        return false;
    }
    // The mesh's own ports stay the proxy's.
    if port == PORT_HBONE || port == PORT_INBOUND_PLAINTEXT {
        return false;
    }
    // The destination slot must still be an enrolled pod that takes inbound
    // capture and allows the fast path (unenrolment resets its settings
    // before anything else).
    let Some(dst_config) = POD_CONFIG.get(dest.slot) else {
        return false;
    };
    let wanted = PodConfig::REDIRECT_INBOUND | PodConfig::FAST_PATH;
    if dst_config.flags & wanted != wanted
        || dst_config
            .excluded_inbound_ports
            .iter()
            .any(|&p| p != 0 && p == port)
    {
        return false;
    }
    if !allowed(slot, dst, port) {
        return false;
    }
    // SAFETY: the helpers only read the socket behind the context.
    let (cookie, netns_cookie) = unsafe {
        (
            bpf_get_socket_cookie(ctx.sock_addr.cast()),
            bpf_get_netns_cookie(ctx.sock_addr.cast()),
        )
    };
    let record = FastPathSock {
        netns_cookie,
        // SAFETY: no argument.
        started_ns: unsafe { bpf_ktime_get_ns() },
        slot,
        flags: FastPathSock::MESH_LOCAL | flags,
        peer_slot: dest.slot,
        ..FastPathSock::default()
    };
    if FAST_PATH_SOCKS.insert(cookie, &record, 0).is_err() {
        stats.untracked += 1;
        return false;
    }
    stats.carried += 1;
    true
}

/// Whether flow 2 is on and `slot`'s verdicts are compiled (its connects
/// may be decided here); counted when it is not.
#[inline(always)]
pub fn source_on(slot: u32) -> bool {
    let on = MESH_LOCAL_STATE
        .get(0)
        .is_some_and(|s| s.flags & FastPathState::VALID != 0);
    // SAFETY: plain value read out of the map.
    if on && unsafe { MESH_LOCAL_SOURCES.get(&slot) }.is_some() {
        return true;
    }
    if let Some(stats) = stats() {
        stats.off += 1;
    }
    false
}

/// The compiled verdict is "allow": no entry for the port nor for "any
/// other port", or an ALLOW entry. (A DENY was refused before; anything
/// else the kernel does not know is left to the proxy.)
#[inline(always)]
fn allowed(slot: u32, dst: &FastPathDest, port: u16) -> bool {
    // The verdicts key IPv4 as IPv4 (a dual-stack socket's v4-mapped
    // destination included), IPv6 as IPv6.
    let (family, addr) = if is_v4_mapped(&dst.addr) {
        (AF_INET, [dst.addr[3], 0, 0, 0])
    } else {
        (AF_INET6, dst.addr)
    };
    let mut key = PolicyVerdictKey {
        slot,
        port,
        family,
        addr,
    };
    // SAFETY: plain values copied out of the map.
    let verdict = match unsafe { POLICY_VERDICTS.get(&key) } {
        Some(v) => Some(*v),
        None => {
            key.port = PolicyVerdictKey::ANY_OTHER_PORT;
            // SAFETY: as above.
            unsafe { POLICY_VERDICTS.get(&key) }.copied()
        }
    };
    verdict.is_none_or(|v| v.action == PolicyVerdict::ALLOW)
}

/// sockops, `TCP_CONNECT_CB` of a recorded socket: for a same-node mesh
/// connection, writes its 4-tuple for the destination's TC ingress. A full
/// map is counted; the SYN then meets the destination's proxy.
#[inline(always)]
pub fn on_connect(ctx: &SockOpsContext, record: &FastPathSock) {
    if record.flags & FastPathSock::MESH_LOCAL == 0 {
        return;
    }
    let flow = MeshFlow {
        src_slot: record.slot,
        dst_slot: record.peer_slot,
    };
    if MESH_LOCAL_FLOWS.insert(&flow_key(ctx), &flow, 0).is_err()
        && let Some(stats) = stats()
    {
        stats.flows_unrecorded += 1;
    }
}

/// sockops, the client socket's move to CLOSE: its flow entry goes.
#[inline(always)]
pub fn on_close(ctx: &SockOpsContext, record: &FastPathSock) {
    if record.flags & FastPathSock::MESH_LOCAL != 0 {
        let _ = MESH_LOCAL_FLOWS.remove(&flow_key(ctx));
    }
}

/// The connection's 4-tuple as the destination sees its SYN (network
/// order): a dual-stack socket reaching IPv4 (v4-mapped addresses) sends
/// an IPv4 SYN.
#[inline(always)]
fn flow_key(ctx: &SockOpsContext) -> MeshFlowKey {
    let (saddr, daddr, family) = if ctx.family() == u32::from(AF_INET) {
        (
            [ctx.local_ip4(), 0, 0, 0],
            [ctx.remote_ip4(), 0, 0, 0],
            AF_INET,
        )
    } else {
        let (local, remote) = crate::passthrough::ip6_of(ctx);
        if is_v4_mapped(&remote) {
            ([local[3], 0, 0, 0], [remote[3], 0, 0, 0], AF_INET)
        } else {
            (local, remote, AF_INET6)
        }
    };
    MeshFlowKey {
        saddr,
        daddr,
        // Host order in sock_ops; network order on the wire.
        sport: (ctx.local_port() as u16).to_be(),
        // Network order in the upper half of the field.
        dport: (ctx.remote_port() >> 16) as u16,
        family: u32::from(family),
    }
}

/// `::ffff:a.b.c.d` (network-order words).
#[inline(always)]
pub fn is_v4_mapped(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && u32::from_be(addr[2]) == 0xffff
}

/// TC ingress of the destination pod in `slot`, for a SYN that no socket
/// owns yet: true when it starts an authorised same-node mesh connection
/// to this pod (deliver it to the application, not to the proxy).
#[inline(always)]
pub fn admits(
    slot: u32,
    v6: bool,
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport_be: u16,
    dport_be: u16,
) -> bool {
    let key = MeshFlowKey {
        saddr,
        daddr,
        sport: sport_be,
        dport: dport_be,
        family: u32::from(if v6 { AF_INET6 } else { AF_INET }),
    };
    // SAFETY: plain value read out of the map.
    unsafe { MESH_LOCAL_FLOWS.get(&key) }.is_some_and(|flow| flow.dst_slot == slot)
}

#[inline(always)]
fn stats() -> Option<&'static mut MeshLocalStats> {
    let ptr = MESH_LOCAL_STATS.get_ptr_mut(0)?;
    // SAFETY: per-CPU value; only this CPU writes it while the program runs.
    Some(unsafe { &mut *ptr })
}
