//! Kubelet's probes in the eBPF mode (`ebpf/src/host_probe.rs`): the TCP
//! connections a socket of the node's network namespace opens to an
//! enrolled pod, recorded by sockops at connect, so that the pod's TC
//! programs give them the probe source (169.254.7.127) on the way in and
//! the node's address back on the way out.

/// Key of `SHUNT_HOST_PROBES`: a connection from the node to a pod, as the
/// pod's side sees it (network order). Both the pod's arriving packets
/// (source: the node) and its replies (destination: the probe source)
/// name these three.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostProbeKey {
    pub pod_addr: u32,
    pub pod_port: u16,
    pub node_port: u16,
}

/// Value of `SHUNT_HOST_PROBES`: the node's own source address, which the
/// replies get back.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostProbe {
    pub node_addr: u32,
    pub reserved: u32,
}

/// Value of `SHUNT_HOST_PROBE_NODE` (one entry): the node netns's cookie
/// (0: probes are not rewritten).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostProbeNode {
    pub netns_cookie: u64,
}

/// Counters of `SHUNT_HOST_PROBE_STATS` (one per-CPU entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostProbeStats {
    /// Connections from the node to an enrolled pod recorded at connect.
    pub connections: u64,
    /// Packets whose address the pods' TC programs rewrote (both ways).
    pub packets_rewritten: u64,
}

/// Probe connections in flight at once (LRU: the oldest go first).
pub const MAX_HOST_PROBES: u32 = 16384;
/// Enrolled pods' IPv4 addresses the node's connects are checked against.
pub const MAX_PROBE_TARGETS: u32 = crate::MAX_PODS * 2;
