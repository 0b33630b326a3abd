//! Kubelet's probes in the eBPF mode: what istio-cni's node rule does
//! (`-m owner --socket-exists -d <enrolled pod> -j SNAT --to-source
//! 169.254.7.127` in the node's nat table), without a rule in the node.
//!
//! - sockops, `TCP_CONNECT_CB` (before the SYN leaves), on the cgroup root:
//!   a TCP socket of the node's netns (`SHUNT_HOST_PROBE_NODE`) connecting
//!   to an enrolled pod's IPv4 address (`SHUNT_PROBE_TARGETS`) is recorded
//!   in `SHUNT_HOST_PROBES` — only a local socket can be, as with
//!   `--socket-exists`: forwarded traffic (a NodePort's kube-proxy SNAT,
//!   another node's) has none — and asks for its state changes, so that
//!   its close deletes the record;
//! - the pod's TC ingress: a packet of a recorded connection gets the probe
//!   source as its source address (IPv4 and TCP checksums fixed), so the
//!   pod's own rules let it through to the application as Istio's probes;
//! - the pod's TC egress: the application's answer to the probe source
//!   gets the node's address back.
//!
//! Limitations: IPv4 only; the node's sockets must live below the cgroup
//! root the programs are attached to (kubelet does on a node: the root is
//! the node's); a pod's late retransmission after the node's socket closed
//! is not rewritten back (the node drops it, as it would a stale segment).

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE},
    helpers::bpf_get_netns_cookie,
    programs::{SockOpsContext, TcContext},
};
use shunt_common::{HostProbe, HostProbeKey};

use crate::maps::{CONFIG, HOST_PROBE_NODE, HOST_PROBE_STATS, HOST_PROBES, PROBE_TARGETS};

const AF_INET: u32 = 2;
const ETH_HDR_LEN: usize = 14;
/// Offsets in the IPv4 header (no options: the callers' parse guarantees
/// the TCP offset they pass).
const IPV4_CSUM: usize = ETH_HDR_LEN + 10;
const IPV4_SADDR: usize = ETH_HDR_LEN + 12;
const IPV4_DADDR: usize = ETH_HDR_LEN + 16;
/// The TCP checksum's offset in the TCP header.
const TCP_CSUM: usize = 16;

/// The node netns's cookie; 0 when probes are not rewritten.
#[inline(always)]
pub fn node_netns() -> u64 {
    HOST_PROBE_NODE.get(0).map_or(0, |node| node.netns_cookie)
}

#[inline(always)]
fn key_of(ctx: &SockOpsContext) -> HostProbeKey {
    HostProbeKey {
        pod_addr: ctx.remote_ip4(),
        // `remote_port` holds the network-order port in its upper 16 bits;
        // `local_port` is in host order.
        pod_port: (ctx.remote_port() >> 16) as u16,
        node_port: (ctx.local_port() as u16).to_be(),
    }
}

/// Whether the socket behind `ctx` is an IPv4 socket of the node's netns.
#[inline(always)]
fn node_socket(ctx: &SockOpsContext) -> bool {
    let node = node_netns();
    // SAFETY: the helper only reads the socket behind the context.
    node != 0 && ctx.family() == AF_INET && unsafe { bpf_get_netns_cookie(ctx.ops.cast()) } == node
}

/// sockops `TCP_CONNECT_CB`: records a node socket's connect to an enrolled
/// pod (see the module docs).
#[inline(always)]
pub fn on_connect(ctx: &SockOpsContext) {
    if !node_socket(ctx) {
        return;
    }
    let key = key_of(ctx);
    // SAFETY: only the presence of the value is read.
    if unsafe { PROBE_TARGETS.get(&key.pod_addr) }.is_none() {
        return;
    }
    let probe = HostProbe {
        node_addr: ctx.local_ip4(),
        reserved: 0,
    };
    if HOST_PROBES.insert(&key, &probe, 0).is_ok() {
        if let Some(stats) = HOST_PROBE_STATS.get_ptr_mut(0) {
            // SAFETY: per-CPU value, this CPU's only writer now.
            unsafe { (*stats).connections += 1 };
        }
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    }
}

/// sockops `STATE_CB`: a recorded node socket closing takes its record.
#[inline(always)]
pub fn on_state(ctx: &SockOpsContext) {
    if ctx.arg(1) != BPF_TCP_CLOSE || !node_socket(ctx) {
        return;
    }
    let _ = HOST_PROBES.remove(&key_of(ctx));
}

/// The pod's TC ingress, an IPv4 TCP packet (addresses and ports in network
/// order, `l4` the TCP header's offset): a recorded node connection's
/// packet gets the probe source. Returns whether it was one (rewritten).
#[inline(always)]
pub fn from_node(
    ctx: &TcContext,
    saddr: u32,
    daddr: u32,
    sport_be: u16,
    dport_be: u16,
    l4: usize,
) -> bool {
    let key = HostProbeKey {
        pod_addr: daddr,
        pod_port: dport_be,
        node_port: sport_be,
    };
    // SAFETY: plain value copied out of the map.
    let Some(probe) = (unsafe { HOST_PROBES.get(&key) }).copied() else {
        return false;
    };
    let probe_source = CONFIG.get(0).map_or(0, |c| c.probe_source_v4);
    if probe.node_addr != saddr || probe_source == 0 {
        return false;
    }
    rewrite(ctx, IPV4_SADDR, saddr, probe_source, l4)
}

/// The pod's TC egress, an IPv4 TCP packet: the application's answer to
/// the probe source gets the node's address back. Returns whether it was
/// one (rewritten).
#[inline(always)]
pub fn to_node(
    ctx: &TcContext,
    saddr: u32,
    daddr: u32,
    sport_be: u16,
    dport_be: u16,
    l4: usize,
) -> bool {
    let probe_source = CONFIG.get(0).map_or(0, |c| c.probe_source_v4);
    if probe_source == 0 || daddr != probe_source {
        return false;
    }
    let key = HostProbeKey {
        pod_addr: saddr,
        pod_port: sport_be,
        node_port: dport_be,
    };
    // SAFETY: plain value copied out of the map.
    let Some(probe) = (unsafe { HOST_PROBES.get(&key) }).copied() else {
        return false;
    };
    rewrite(ctx, IPV4_DADDR, daddr, probe.node_addr, l4)
}

/// Replaces the IPv4 address at `at` (`old` → `new`, network order),
/// fixing the TCP checksum (pseudo-header) and the IPv4 header's.
#[inline(always)]
fn rewrite(ctx: &TcContext, at: usize, old: u32, new: u32, l4: usize) -> bool {
    let done = ctx
        .l4_csum_replace(
            l4 + TCP_CSUM,
            u64::from(old),
            u64::from(new),
            u64::from(BPF_F_PSEUDO_HDR) | 4,
        )
        .is_ok()
        && ctx
            .l3_csum_replace(IPV4_CSUM, u64::from(old), u64::from(new), 4)
            .is_ok()
        && ctx.store(at, &new, 0).is_ok();
    if done && let Some(stats) = HOST_PROBE_STATS.get_ptr_mut(0) {
        // SAFETY: per-CPU value, this CPU's only writer now.
        unsafe { (*stats).packets_rewritten += 1 };
    }
    done
}
