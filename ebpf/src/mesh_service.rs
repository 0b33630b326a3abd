//! Flow 2 of the fast path through a Service VIP: an enrolled pod's connect
//! to a service's clusterIP and port whose every ready endpoint is an
//! eligible flow-2 destination of this node (`SHUNT_FP_MESH_VIPS`, written
//! by the reconciler only) is sent straight to one of those endpoints, as
//! Cilium's socket load balancer does, instead of to the proxy — which
//! would have picked an endpoint and carried the bytes over HBONE.
//!
//! - `cgroup/connect4` ([`connect4`]), after the policy check of the VIP
//!   itself (it has no verdicts): picks an endpoint (random, weighted by
//!   capacity), checks the compiled verdict of the REAL destination (a
//!   DENY: EPERM, counted per policy as for a direct connect), then hands
//!   it to flow 2 (`mesh_local::carried_in_kernel`, every check of a
//!   direct connect: the endpoint still eligible, flow 2 on, "allow") and
//!   rewrites the destination to the endpoint. The VIP dialled is kept by
//!   socket cookie (`SHUNT_FP_MESH_VIP_SOCKS`) until the socket closes.
//! - `cgroup/getpeername4/6` (`peername.rs`): the application asks
//!   its peer; it gets the VIP and port it dialled, not the endpoint.
//! - sockops (`passthrough.rs`): the events of such a connection name the
//!   VIP (the agent reports the service, as the proxy would); the record
//!   goes at the close ([`forget`]).
//!
//! Never fail open: a VIP not in the map, flow 2 off, an endpoint no longer
//! eligible, a record that cannot be kept — the connect goes to the proxy
//! as before. Cost per connect to a VIP: one hash lookup (the VIP), one
//! random number, the flow-2 checks of a direct connect and one more LRU
//! insert (the VIP record); per getpeername of a socket in an enrolled
//! pod: one LRU lookup; of any other socket: one lookup of its netns in
//! `SHUNT_ENROLLED`.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie},
    macros::map,
    maps::{HashMap, LruHashMap},
    programs::SockAddrContext,
};
use shunt_common::{
    FastPathDest, FastPathSock, MAX_MESH_LOCAL_SERVICES, MAX_MESH_SERVICE_SOCKETS, MeshService,
    MeshServiceEndpoint, MeshServiceKey, MeshServiceSock, PodConfig,
};

/// connect() proceeds (with whatever address the program left).
const ALLOW: i32 = 1;
/// connect() fails with EPERM.
const REJECT: i32 = 0;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// VIP and port → the service port's endpoints, all eligible flow-2
/// destinations of this node. Written by the reconciler only.
#[map(name = "SHUNT_FP_MESH_VIPS")]
pub static MESH_SERVICES: HashMap<MeshServiceKey, MeshService> =
    HashMap::with_max_entries(MAX_MESH_LOCAL_SERVICES, BPF_F_NO_PREALLOC);

/// Socket cookie → the VIP its connect dialled (flow 2 through a VIP), from
/// connect to close. LRU: a socket whose close was never seen (its connect
/// failed before the SYN) cannot keep its entry for ever.
#[map(name = "SHUNT_FP_MESH_VIP_SOCKS")]
pub static MESH_SERVICE_SOCKS: LruHashMap<u64, MeshServiceSock> =
    LruHashMap::with_max_entries(MAX_MESH_SERVICE_SOCKETS, 0);

/// Called by connect4 after the VIP's own policy check: `None` when
/// `vip_be`:`port` is not a service flow 2 carries (or flow 2 declines
/// this connect): the caller goes on as before. `Some(REJECT)`: the
/// chosen endpoint's verdict is DENY (counted). `Some(ALLOW)`: the connect
/// now goes to the endpoint, carried in the kernel.
#[inline(always)]
pub fn connect4(
    ctx: &SockAddrContext,
    slot: u32,
    config: &PodConfig,
    vip_be: u32,
    port: u16,
) -> Option<i32> {
    let dialled = MeshServiceSock {
        addr: [vip_be, 0, 0, 0],
        port: u32::from(port),
        family: AF_INET,
    };
    let endpoint = connect(ctx, slot, config, &FastPathDest::v4(vip_be), &dialled)?;
    let Some(endpoint) = endpoint else {
        return Some(REJECT);
    };
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    addr.user_ip4 = endpoint.addr[3];
    addr.user_port = u32::from((endpoint.port as u16).to_be());
    Some(ALLOW)
}

/// As [`connect4`] for an IPv6 socket: a native IPv6 VIP, or a dual-stack
/// socket's v4-mapped one (its endpoints are then v4-mapped too: the
/// reconciler writes a VIP's endpoints of its own family).
#[inline(always)]
pub fn connect6(
    ctx: &SockAddrContext,
    slot: u32,
    config: &PodConfig,
    vip_be: [u32; 4],
    port: u16,
) -> Option<i32> {
    let dialled = MeshServiceSock {
        addr: vip_be,
        port: u32::from(port),
        family: AF_INET6,
    };
    let endpoint = connect(ctx, slot, config, &FastPathDest { addr: vip_be }, &dialled)?;
    let Some(endpoint) = endpoint else {
        return Some(REJECT);
    };
    set_ip6(ctx, endpoint.addr);
    // SAFETY: the context pointer is valid for the program's run.
    let addr = unsafe { &mut *ctx.sock_addr };
    addr.user_port = u32::from((endpoint.port as u16).to_be());
    Some(ALLOW)
}

/// Both families: `None` when flow 2 does not take the connect to `vip`
/// (keyed as the destination map keys addresses); `Some(None)` when the
/// endpoint chosen is denied; `Some(Some(endpoint))` when it is carried
/// to `endpoint` (the caller rewrites the destination).
#[inline(always)]
fn connect(
    ctx: &SockAddrContext,
    slot: u32,
    config: &PodConfig,
    vip: &FastPathDest,
    dialled: &MeshServiceSock,
) -> Option<Option<MeshServiceEndpoint>> {
    if config.flags & PodConfig::FAST_PATH == 0 {
        return None;
    }
    let key = MeshServiceKey {
        addr: vip.addr,
        port: dialled.port,
    };
    // SAFETY: the value is read in place; the writer replaces whole
    // elements (an update swaps in a new element under RCU).
    let service = unsafe { MESH_SERVICES.get(&key) }?;
    // Flow 2 off (or this pod's verdicts not compiled): the verdict table
    // is not to be trusted, the proxy decides.
    if !crate::mesh_local::source_on(slot) {
        return None;
    }
    let endpoint = pick(service)?;
    let dst = FastPathDest {
        addr: endpoint.addr,
    };
    let dst_port = endpoint.port as u16;
    // The verdicts key a v4-mapped address as IPv4 (`denied_v6`).
    if crate::policy::denied_v6(slot, dst.addr, dst_port) {
        return Some(None);
    }
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    // Kept before the connection's record: a connection carried must name
    // its VIP to getpeername and to the reports.
    if MESH_SERVICE_SOCKS.insert(cookie, dialled, 0).is_err() {
        return None;
    }
    if !crate::mesh_local::carried_in_kernel(
        ctx,
        slot,
        config,
        &dst,
        dst_port,
        FastPathSock::VIA_SERVICE,
    ) {
        let _ = MESH_SERVICE_SOCKS.remove(&cookie);
        return None;
    }
    Some(Some(endpoint))
}

/// One endpoint, at random, each with its weight's share.
#[inline(always)]
fn pick(service: &MeshService) -> Option<MeshServiceEndpoint> {
    if service.total_weight == 0 {
        return None;
    }
    // SAFETY: no argument.
    let mut left = unsafe { bpf_get_prandom_u32() } % service.total_weight;
    for (i, endpoint) in service.endpoints.iter().enumerate() {
        if i as u32 >= service.count {
            break;
        }
        if left < endpoint.weight {
            return Some(*endpoint);
        }
        left -= endpoint.weight;
    }
    None
}

/// The VIP a flow-2 socket dialled (sockops, for its events).
#[inline(always)]
pub fn dialled(cookie: u64) -> Option<MeshServiceSock> {
    // SAFETY: plain value copied out of the map.
    unsafe { MESH_SERVICE_SOCKS.get(&cookie) }.copied()
}

/// sockops, the socket's move to CLOSE: its VIP record goes.
#[inline(always)]
pub fn forget(cookie: u64, record: &FastPathSock) {
    if record.flags & FastPathSock::VIA_SERVICE != 0 {
        let _ = MESH_SERVICE_SOCKS.remove(&cookie);
    }
}

/// Writes `user_ip6` one word at a time: the verifier refuses a copy of a
/// map value into the context (compiled to a byte loop through a moved
/// context pointer).
#[inline(always)]
pub fn set_ip6(ctx: &SockAddrContext, words: [u32; 4]) {
    use core::ptr::{addr_of_mut, write_volatile};
    let sa = ctx.sock_addr;
    // SAFETY: in-bounds, writable fields of the context, written as the
    // verifier allows (4-byte stores at fixed offsets).
    unsafe {
        write_volatile(addr_of_mut!((*sa).user_ip6[0]), words[0]);
        write_volatile(addr_of_mut!((*sa).user_ip6[1]), words[1]);
        write_volatile(addr_of_mut!((*sa).user_ip6[2]), words[2]);
        write_volatile(addr_of_mut!((*sa).user_ip6[3]), words[3]);
    }
}
