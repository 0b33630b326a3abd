//! A pod's enrolment as the programs see it: its slot, what its
//! redirection does, its own addresses, who it is (for a later agent) and
//! the per-pod counters the programs keep; with the bounds of the per-pod
//! maps.

// Only the documentation links to it.
#[cfg(doc)]
use crate::REPLY_MARK;

/// Largest number of pods one agent can enrol (size of the enrolment map and
/// of the per-pod arrays).
pub const MAX_PODS: u32 = 4096;

/// Excluded ports per pod and direction (fixed size: the programs loop over
/// them with a bound).
pub const MAX_EXCLUDED_PORTS: usize = 8;
/// Excluded outbound IPv4 CIDRs per pod.
pub const MAX_EXCLUDED_CIDRS: usize = 4;

/// Value of the enrolment map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSlot {
    /// Index into the per-pod arrays; below [`MAX_PODS`].
    pub slot: u32,
    /// Reserved (zero).
    pub flags: u32,
}

/// What a pod's redirection does; indexed by slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodConfig {
    /// [`PodConfig::REDIRECT_OUTBOUND`] | [`PodConfig::REDIRECT_INBOUND`] |
    /// [`PodConfig::REPLY_TO_PROXY`] | [`PodConfig::NO_SPLICE`] |
    /// [`PodConfig::FAST_PATH`] | [`PodConfig::DNS_CAPTURE`] |
    /// [`PodConfig::REPLY_BY_MARK`]. A bit set: a new bit keeps the pinned
    /// map's layout (an earlier agent's programs ignore it).
    pub flags: u32,
    /// Number of valid entries in `excluded_cidrs_v4`.
    pub excluded_cidr_count: u32,
    /// Destination ports an outbound connect keeps (host order, 0 = unused).
    pub excluded_outbound_ports: [u16; MAX_EXCLUDED_PORTS],
    /// Local ports inbound traffic reaches directly (host order, 0 = unused).
    pub excluded_inbound_ports: [u16; MAX_EXCLUDED_PORTS],
    /// Outbound destinations that are not redirected.
    pub excluded_cidrs_v4: [Cidr4; MAX_EXCLUDED_CIDRS],
}

impl PodConfig {
    /// Outbound TCP connects go to the proxy's 15001.
    pub const REDIRECT_OUTBOUND: u32 = 1;
    /// Inbound plaintext TCP goes to the proxy's 15006.
    pub const REDIRECT_INBOUND: u32 = 2;
    /// The application's packets to the proxy's transparent inbound
    /// sockets (bound to a client's address) are turned back in through `lo`
    /// with [`REPLY_MARK`] by the TC egress program, instead of leaving
    /// through `eth0` (`--preserve-source on`).
    pub const REPLY_TO_PROXY: u32 = 4;
    /// The pod's connections never join the splice (its annotation
    /// `shunt.io/splice: off`).
    pub const NO_SPLICE: u32 = 8;
    /// The pod's connects to destinations outside the fast-path table go
    /// direct (`--fast-path on` and no `shunt.io/fast-path: "off"`).
    pub const FAST_PATH: u32 = 16;
    /// The pod's DNS (UDP and TCP to port 53) goes to the DNS proxy on
    /// 15053 in its netns (`--dns-capture on` and no
    /// `ambient.istio.io/dns-capture: "false"`; `ebpf/src/dns.rs`).
    pub const DNS_CAPTURE: u32 = 32;
    /// With [`PodConfig::REPLY_TO_PROXY`]: the application's end of every
    /// connection the proxy opened to it carries a non-zero mark, because
    /// `net.ipv4.tcp_fwmark_accept` was on in the pod's netns before the
    /// proxy's first such connection (an accepted socket then takes the mark
    /// of the SYN that created it: the proxy's 0x539). So only packets with a
    /// mark, a SYN or an RST can be replies to the proxy, and TC egress looks
    /// up only those; without the bit, every TCP packet the pod sends.
    pub const REPLY_BY_MARK: u32 = 64;
}

/// An IPv4 prefix, both fields in network byte order as the kernel gives
/// addresses to the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr4 {
    pub addr: u32,
    pub mask: u32,
}

impl Cidr4 {
    pub fn contains(&self, addr_be: u32) -> bool {
        addr_be & self.mask == self.addr & self.mask
    }
}

/// A pod's own addresses, where the proxy delivers inbound connections: a
/// proxy connection to one of them is spliced. Kept apart from
/// [`PodConfig`] so that maps pinned by an earlier agent keep their layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodAddrs {
    /// The pod's IPv4 address (network order; 0: none).
    pub ipv4: u32,
    /// The pod's IPv6 address (network order; all zero: none).
    pub ipv6: [u32; 4],
}

/// Who an enrolment belongs to: `namespace/name` and the netns path,
/// NUL-padded UTF-8 (longer values are cut).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodRecord {
    pub pod: [u8; 128],
    pub netns: [u8; 256],
}

impl Default for PodRecord {
    fn default() -> Self {
        Self {
            pod: [0; 128],
            netns: [0; 256],
        }
    }
}

/// Per-pod counters kept by the programs. "in" is traffic arriving at the
/// pod, "out" traffic leaving it; bytes are whole frames as `eth0` sees
/// them (`skb->len`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    /// Outbound connects rewritten to the proxy.
    pub outbound_redirected: u64,
    /// Inbound connections (SYNs) steered to the proxy.
    pub inbound_redirected: u64,
    /// Outbound connects refused because no proxy listener was there.
    pub outbound_fail_closed: u64,
    /// Inbound packets dropped because no proxy listener was there.
    pub inbound_fail_closed: u64,
    /// Payload bytes moved between app and proxy sockets by sk_msg.
    pub spliced_bytes: u64,
    /// Connection directions that stopped splicing (reader too far behind,
    /// or the peer socket not spliceable) and use the TCP stack instead.
    pub splice_fallbacks: u64,
}

impl PodCounters {
    /// Adds `other` (per-CPU values are summed this way).
    pub fn add(&mut self, other: &PodCounters) {
        self.packets_in += other.packets_in;
        self.bytes_in += other.bytes_in;
        self.packets_out += other.packets_out;
        self.bytes_out += other.bytes_out;
        self.outbound_redirected += other.outbound_redirected;
        self.inbound_redirected += other.inbound_redirected;
        self.outbound_fail_closed += other.outbound_fail_closed;
        self.inbound_fail_closed += other.inbound_fail_closed;
        self.spliced_bytes += other.spliced_bytes;
        self.splice_fallbacks += other.splice_fallbacks;
    }
}
