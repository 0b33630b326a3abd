//! Names of the maps, as they appear in the ELF object and under the pin
//! dir.

/// `HashMap<u64 netns cookie, PodSlot>`: which network namespaces are
/// enrolled, and which slot each owns. The socket programs key on it.
pub const ENROLLED: &str = "SHUNT_ENROLLED";
/// `PerCpuArray<PodCounters>` indexed by `PodSlot::slot`.
pub const POD_COUNTERS: &str = "SHUNT_POD_COUNTERS";
/// `Array<PodConfig>` indexed by `PodSlot::slot`.
pub const POD_CONFIG: &str = "SHUNT_POD_CONFIG";
/// `Array<GlobalConfig>` with one entry.
pub const CONFIG: &str = "SHUNT_CONFIG";
/// `Array<PodAddrs>` indexed by `PodSlot::slot`.
pub const POD_ADDRS: &str = "SHUNT_POD_ADDRS";
/// `LruHashMap<u64 socket cookie, OriginalDst>`: written at connect,
/// moved to [`ORIGINAL_DST`] once the socket's local port is known.
pub const ORIGINAL_DST_BY_COOKIE: &str = "SHUNT_ORIG_BY_COOKIE";
/// `LruHashMap<SockKey, OriginalDst>`: where the connection that the
/// proxy accepted from `SockKey` was going.
pub const ORIGINAL_DST: &str = "SHUNT_ORIG_DST";

/// `HashMap<u64 netns cookie, PodRecord>`: which pod and netns path
/// each enrolment is, so that a later agent can clean up after a pod it
/// never heard of. Userspace only (bpffs holds no plain files).
pub const POD_RECORDS: &str = "SHUNT_POD_RECORDS";

/// `SockHash<SpliceKey>`: both ends of every app ⇄ proxy loopback
/// connection being spliced; the sk_msg program is attached to it.
pub const SPLICE_SOCKS: &str = "SHUNT_SPLICE_SOCKS";
/// `LruHashMap<SpliceKey, SpliceFlow>`: per receiving socket, the bytes
/// spliced into it and the bytes it has read (the splice's backlog).
pub const SPLICE_FLOWS: &str = "SHUNT_SPLICE_FLOWS";
/// `LruHashMap<u64 socket address, SpliceKey>`: how the receive hook,
/// which only has the kernel's socket pointer, finds its flow.
pub const SPLICE_KEYS: &str = "SHUNT_SPLICE_KEYS";

/// `HashMap<PolicyVerdictKey, PolicyVerdict>`: the authorization
/// verdicts compiled for connects between this node's enrolled pods,
/// checked by connect4/6 (`ebpf/src/policy.rs`).
pub const POLICY_VERDICTS: &str = "SHUNT_POLICY_VERDICTS";
/// `PerCpuHashMap<PolicyDenialKey, u64>`: connects the kernel refused,
/// per source pod and deciding policy.
pub const POLICY_DENIALS: &str = "SHUNT_POLICY_DENIALS";
/// `RingBuf` of `PolicyRefusal`s: each connect the kernel refused, for the
/// agent's access log.
pub const POLICY_REFUSALS: &str = "SHUNT_POLICY_REFUSALS";

/// `HashMap<FastPathDest, u32>`: every destination the proxy must see
/// (mesh workload IPs, service VIPs); an enrolled pod's connect to any
/// other goes direct when the fast path is on and the table valid.
/// Written only by the agent's fast-path table writer.
pub const FAST_PATH_DESTS: &str = "SHUNT_FP_DESTS";
/// `LpmTrie<FastPathDest, u32>`: every address range the proxy must see
/// (a ServiceEntry's CIDR; IPv4 as IPv4-mapped IPv6, its prefix + 96);
/// a connect into one goes to the proxy. Same single writer as
/// [`FAST_PATH_DESTS`].
pub const FAST_PATH_RANGES: &str = "SHUNT_FP_RANGES";
/// `Array<FastPathState>` with one entry: whether the destination table
/// is complete (`FastPathState::VALID`). Same single writer.
pub const FAST_PATH_STATE: &str = "SHUNT_FP_STATE";
/// `LruHashMap<u64 socket cookie, FastPathSock>`: the connects that went
/// direct, from connect() to close (sockops reports them).
pub const FAST_PATH_SOCKS: &str = "SHUNT_FP_SOCKS";
/// `RingBuf` of `FastPathEvent`s (opened, closed) for the agent.
pub const FAST_PATH_EVENTS: &str = "SHUNT_FP_EVENTS";
/// `PerCpuArray<FastPathStats>` with one entry.
pub const FAST_PATH_STATS: &str = "SHUNT_FP_STATS";

// Flow 2 of the fast path: same node, mesh to mesh, carried in the
// kernel (`ebpf/src/mesh_local.rs`).
/// `HashMap<FastPathDest, MeshLocalDest>`: this node's enrolled mesh
/// pods a connect may reach directly (no waypoint, HBONE, verdicts
/// exact). Written only by the reconciler (through the redirector).
pub const MESH_LOCAL_DESTS: &str = "SHUNT_FP_MESH_DESTS";
/// `HashMap<u32 slot, u32>`: source pods whose verdicts the last
/// complete compile holds. Same single writer.
pub const MESH_LOCAL_SOURCES: &str = "SHUNT_FP_MESH_SRCS";
/// `Array<FastPathState>` with one entry: whether flow 2 may be used
/// (the verdict table complete). Same single writer; off at load.
pub const MESH_LOCAL_STATE: &str = "SHUNT_FP_MESH_STATE";
/// `LruHashMap<MeshFlowKey, MeshFlow>`: the 4-tuples of authorised
/// same-node mesh connections, from the SYN's creation (sockops) to the
/// client socket's close (sockops); the destination's TC ingress lets
/// their SYN through to the application.
pub const MESH_LOCAL_FLOWS: &str = "SHUNT_FP_MESH_FLOWS";
/// `PerCpuArray<MeshLocalStats>` with one entry.
pub const MESH_LOCAL_STATS: &str = "SHUNT_FP_MESH_STATS";
/// `HashMap<MeshServiceKey, MeshService>`: service VIPs and ports whose
/// every ready endpoint is an eligible flow-2 destination of this node,
/// with those endpoints; connect4/6 pick one and connect to it
/// directly. Written only by the reconciler, with the maps above.
pub const MESH_LOCAL_SERVICES: &str = "SHUNT_FP_MESH_VIPS";
/// `LruHashMap<u64 socket cookie, MeshServiceSock>`: the VIP a flow-2
/// connection was dialled to, from connect() to close (getpeername
/// answers it; the events name the service). Programs only.
pub const MESH_LOCAL_SERVICE_SOCKS: &str = "SHUNT_FP_MESH_VIP_SOCKS";

/// `LruHashMap<u64 socket cookie, OriginalDst>`: the DNS server a pod's
/// UDP socket asked before sendmsg4/6 (or connect4/6) sent its query to
/// the DNS proxy on 15053; recvmsg4/6 give the answers that server's
/// address. Written and read by the programs only.
pub const DNS_SERVERS: &str = "SHUNT_DNS_SERVERS";

// Kubelet's probes (`ebpf/src/host_probe.rs`).
/// `Array<HostProbeNode>` with one entry: the node netns's cookie,
/// written by the agent at load (`--node-netns`; 0: off).
pub const HOST_PROBE_NODE: &str = "SHUNT_HOST_PROBE_NODE";
/// `HashMap<u32 IPv4, u32>`: enrolled pods' addresses; the reconciler
/// writes them at enrolment (through the redirector).
pub const PROBE_TARGETS: &str = "SHUNT_PROBE_TARGETS";
/// `LruHashMap<HostProbeKey, HostProbe>`: the node's connections to
/// enrolled pods, from connect (sockops) to close (sockops).
pub const HOST_PROBES: &str = "SHUNT_HOST_PROBES";
/// `PerCpuArray<HostProbeStats>` with one entry.
pub const HOST_PROBE_STATS: &str = "SHUNT_HOST_PROBE_STATS";

/// Every map the agent pins (and every pod's program instance shares).
pub const ALL: [&str; 32] = [
    ENROLLED,
    POD_COUNTERS,
    POD_CONFIG,
    CONFIG,
    POD_ADDRS,
    ORIGINAL_DST_BY_COOKIE,
    ORIGINAL_DST,
    POD_RECORDS,
    SPLICE_SOCKS,
    SPLICE_FLOWS,
    SPLICE_KEYS,
    POLICY_VERDICTS,
    POLICY_DENIALS,
    POLICY_REFUSALS,
    FAST_PATH_DESTS,
    FAST_PATH_RANGES,
    FAST_PATH_STATE,
    FAST_PATH_SOCKS,
    FAST_PATH_EVENTS,
    FAST_PATH_STATS,
    MESH_LOCAL_DESTS,
    MESH_LOCAL_SOURCES,
    MESH_LOCAL_STATE,
    MESH_LOCAL_FLOWS,
    MESH_LOCAL_STATS,
    MESH_LOCAL_SERVICES,
    MESH_LOCAL_SERVICE_SOCKS,
    DNS_SERVERS,
    HOST_PROBE_NODE,
    PROBE_TARGETS,
    HOST_PROBES,
    HOST_PROBE_STATS,
];

/// aya-log's ring buffer, pinned so that every pod's instance of the
/// programs writes into the one buffer the agent reads.
pub const LOG_MAP: &str = "AYA_LOGS";
