//! The maps every program shares. All are pinned by the agent (see
//! `shunt_common::maps`), so every pod's program instance and every agent
//! restart sees the same ones.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf, SockHash},
};
use shunt_common::{
    FAST_PATH_EVENTS_BYTES, FastPathDest, FastPathSock, FastPathState, FastPathStats, GlobalConfig,
    HostProbe, HostProbeKey, HostProbeNode, HostProbeStats, MAX_DNS_SOCKETS,
    MAX_FAST_PATH_DESTINATIONS, MAX_FAST_PATH_RANGES, MAX_FAST_PATH_SOCKETS, MAX_HOST_PROBES,
    MAX_ORIGINAL_DSTS, MAX_PODS, MAX_PROBE_TARGETS, MAX_SPLICE_SOCKETS, OriginalDst, PodAddrs,
    PodConfig, PodCounters, PodRecord, PodSlot, SockKey, SpliceFlow, SpliceKey,
};

/// netns cookie → slot: which namespaces are enrolled.
#[map(name = "SHUNT_ENROLLED")]
pub static ENROLLED: HashMap<u64, PodSlot> = HashMap::with_max_entries(ENROLLED_ENTRIES, 0);

/// `MAX_PODS`; half of it in the upgrade test's "previous release"
/// (`fixture.rs`), a map an upgrade must migrate.
const ENROLLED_ENTRIES: u32 = if cfg!(feature = "previous-release-fixture") {
    MAX_PODS / 2
} else {
    MAX_PODS
};

/// Per-pod counters, per CPU (no atomics on the BPF target).
#[map(name = "SHUNT_POD_COUNTERS")]
pub static POD_COUNTERS: PerCpuArray<PodCounters> = PerCpuArray::with_max_entries(MAX_PODS, 0);

/// Per-pod redirection settings, by slot.
#[map(name = "SHUNT_POD_CONFIG")]
pub static POD_CONFIG: Array<PodConfig> = Array::with_max_entries(MAX_PODS, 0);

/// Per-pod own addresses, by slot.
#[map(name = "SHUNT_POD_ADDRS")]
pub static POD_ADDRS: Array<PodAddrs> = Array::with_max_entries(MAX_PODS, 0);

/// Agent-wide settings (one entry).
#[map(name = "SHUNT_CONFIG")]
pub static CONFIG: Array<GlobalConfig> = Array::with_max_entries(1, 0);

/// socket cookie → original destination, from connect() until the socket
/// is established and its local port known.
#[map(name = "SHUNT_ORIG_BY_COOKIE")]
pub static ORIGINAL_DST_BY_COOKIE: LruHashMap<u64, OriginalDst> =
    LruHashMap::with_max_entries(MAX_ORIGINAL_DSTS, 0);

/// (netns, local address, local port) → original destination: what the
/// proxy looks up for the peer of a connection it accepted.
#[map(name = "SHUNT_ORIG_DST")]
pub static ORIGINAL_DST: LruHashMap<SockKey, OriginalDst> =
    LruHashMap::with_max_entries(MAX_ORIGINAL_DSTS, 0);

/// netns cookie → which pod and netns path: the agent's notes for a later
/// agent, kept in bpffs. No program reads it.
#[map(name = "SHUNT_POD_RECORDS")]
pub static POD_RECORDS: HashMap<u64, PodRecord> = HashMap::with_max_entries(MAX_PODS, 0);

/// Both ends of the app ⇄ proxy connections being spliced; the sk_msg
/// program runs on every send of a socket in here.
#[map(name = "SHUNT_SPLICE_SOCKS")]
pub static SPLICE_SOCKS: SockHash<SpliceKey> = SockHash::with_max_entries(MAX_SPLICE_SOCKETS, 0);

/// Receiving end → its direction's splice backlog (see `SpliceFlow`).
#[map(name = "SHUNT_SPLICE_FLOWS")]
pub static SPLICE_FLOWS: LruHashMap<SpliceKey, SpliceFlow> =
    LruHashMap::with_max_entries(MAX_SPLICE_SOCKETS, 0);

/// Socket (kernel address) → its splice key, for the receive hook.
#[map(name = "SHUNT_SPLICE_KEYS")]
pub static SPLICE_KEYS: LruHashMap<u64, SpliceKey> =
    LruHashMap::with_max_entries(MAX_SPLICE_SOCKETS, 0);

/// Destinations the proxy must see (see `passthrough.rs`). A plain hash:
/// nothing may be evicted from it.
#[map(name = "SHUNT_FP_DESTS")]
pub static FAST_PATH_DESTS: HashMap<FastPathDest, u32> =
    HashMap::with_max_entries(MAX_FAST_PATH_DESTINATIONS, 0);

/// Address ranges the proxy must see (see `passthrough.rs`): the longest
/// prefix holding a destination. Allocated per entry (the kernel requires
/// it of this map type), so an unused table costs no memory.
#[map(name = "SHUNT_FP_RANGES")]
pub static FAST_PATH_RANGES: LpmTrie<FastPathDest, u32> =
    LpmTrie::with_max_entries(MAX_FAST_PATH_RANGES, 0);

/// Whether the destination table may be used (one entry).
#[map(name = "SHUNT_FP_STATE")]
pub static FAST_PATH_STATE: Array<FastPathState> = Array::with_max_entries(1, 0);

/// socket cookie → the fast-path connection's record, connect to close.
#[map(name = "SHUNT_FP_SOCKS")]
pub static FAST_PATH_SOCKS: LruHashMap<u64, FastPathSock> =
    LruHashMap::with_max_entries(MAX_FAST_PATH_SOCKETS, 0);

/// Opened and closed events for the agent.
#[map(name = "SHUNT_FP_EVENTS")]
pub static FAST_PATH_EVENTS: RingBuf = RingBuf::with_byte_size(FAST_PATH_EVENTS_BYTES, 0);

/// The fast path's counters.
#[map(name = "SHUNT_FP_STATS")]
pub static FAST_PATH_STATS: PerCpuArray<FastPathStats> = PerCpuArray::with_max_entries(1, 0);

/// socket cookie → the DNS server a pod's UDP socket asked, from the query
/// the DNS capture rewrote to its answer (`dns.rs`).
#[map(name = "SHUNT_DNS_SERVERS")]
pub static DNS_SERVERS: LruHashMap<u64, OriginalDst> =
    LruHashMap::with_max_entries(MAX_DNS_SOCKETS, 0);

/// The node netns's cookie (one entry; 0: kubelet's probes not rewritten).
#[map(name = "SHUNT_HOST_PROBE_NODE")]
pub static HOST_PROBE_NODE: Array<HostProbeNode> = Array::with_max_entries(1, 0);

/// Enrolled pods' IPv4 addresses (network order): the node's connects to
/// them are probes.
#[map(name = "SHUNT_PROBE_TARGETS")]
pub static PROBE_TARGETS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_PROBE_TARGETS, 0);

/// The node's connections to enrolled pods (see `host_probe.rs`).
#[map(name = "SHUNT_HOST_PROBES")]
pub static HOST_PROBES: LruHashMap<HostProbeKey, HostProbe> =
    LruHashMap::with_max_entries(MAX_HOST_PROBES, 0);

/// Kubelet's probes' counters.
#[map(name = "SHUNT_HOST_PROBE_STATS")]
pub static HOST_PROBE_STATS: PerCpuArray<HostProbeStats> = PerCpuArray::with_max_entries(1, 0);

/// The agent-wide settings.
#[inline(always)]
pub fn global_config() -> Option<GlobalConfig> {
    CONFIG.get(0).copied()
}

/// The counters of `slot` on this CPU, if the slot is valid.
#[inline(always)]
pub fn counters(slot: u32) -> Option<&'static mut PodCounters> {
    let ptr = POD_COUNTERS.get_ptr_mut(slot)?;
    // SAFETY: per-CPU value; only this CPU writes it while the program runs.
    Some(unsafe { &mut *ptr })
}
