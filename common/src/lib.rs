//! Types and constants shared by the eBPF programs (`shunt-ebpf`) and the
//! userspace agent (`shunt`). Everything here is `#[repr(C)]` and plain old
//! data: the same bytes are read by the kernel and by userspace.
#![no_std]

/// Proxy listener for traffic a pod sends out (cgroup connect redirects here).
pub const PORT_OUTBOUND: u16 = 15001;
/// Transparent listener for plaintext traffic arriving at a pod.
pub const PORT_INBOUND_PLAINTEXT: u16 = 15006;
/// HBONE (HTTP/2 CONNECT over mTLS) listener on the pod's IP.
pub const PORT_HBONE: u16 = 15008;
/// Admin API (loopback only, in the agent's netns).
pub const PORT_ADMIN: u16 = 15000;
/// Prometheus metrics.
pub const PORT_METRICS: u16 = 15020;
/// Readiness (`/healthz/ready`).
pub const PORT_READINESS: u16 = 15021;

/// `SO_MARK` carried by every socket the proxy opens; such sockets are never
/// captured.
pub const PROXY_MARK: u32 = 0x539;

/// Largest number of pods one agent can enrol (size of the enrolment map and
/// of the counter array).
pub const MAX_PODS: u32 = 4096;

/// Names of the maps, as they appear in the ELF object and under the pin dir.
pub mod maps {
    /// `HashMap<u64 netns cookie, PodSlot>`: which network namespaces are
    /// enrolled, and which counter slot each owns (the agent's record; the
    /// socket-level programs key on it).
    pub const ENROLLED: &str = "SHUNT_ENROLLED";
    /// `PerCpuArray<PodCounters>` indexed by `PodSlot::slot`.
    pub const POD_COUNTERS: &str = "SHUNT_POD_COUNTERS";
}

/// Names of the globals the agent sets when it loads a pod's instance.
pub mod globals {
    /// `u32`: the pod's counter slot, baked into its TC programs.
    pub const POD_SLOT: &str = "POD_SLOT";
    /// `u8`: the most verbose aya-log level the programs emit.
    pub const LOG_LEVEL: &str = "AYA_LOG_LEVEL";
}

/// aya-log's ring buffer, pinned so that every pod's instance of the
/// programs writes into the one buffer the agent reads.
pub const LOG_MAP: &str = "AYA_LOGS";

/// Names of the programs in the ELF object.
pub mod programs {
    /// TC ingress classifier on a pod's `eth0`.
    pub const TC_POD_INGRESS: &str = "shunt_tc_ingress";
    /// TC egress classifier on a pod's `eth0`.
    pub const TC_POD_EGRESS: &str = "shunt_tc_egress";
}

/// Value of the enrolment map: where this pod's counters live.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSlot {
    /// Index into [`maps::POD_COUNTERS`]; below [`MAX_PODS`].
    pub slot: u32,
    /// Reserved flags (zero today); keeps the struct 8-byte sized and lets
    /// redirection options grow without changing the key.
    pub flags: u32,
}

/// Per-pod traffic counters kept by the TC programs on the pod's `eth0`.
/// "in" is traffic arriving at the pod, "out" traffic leaving it; bytes are
/// whole L2 frames as the device sees them (`skb->len`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
}

impl PodCounters {
    /// Sum of per-CPU values.
    pub fn add(&mut self, other: &PodCounters) {
        self.packets_in += other.packets_in;
        self.bytes_in += other.bytes_in;
        self.packets_out += other.packets_out;
        self.bytes_out += other.bytes_out;
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: both types are `#[repr(C)]`, contain only integers, and have no
    // padding, so any bit pattern is valid.
    unsafe impl aya::Pod for super::PodSlot {}
    unsafe impl aya::Pod for super::PodCounters {}
}
