//! Types and constants shared by the eBPF programs (`shunt-ebpf`) and the
//! userspace agent (`shunt`). Everything here is `#[repr(C)]` plain old data
//! without padding: the same bytes are read by the kernel and by userspace.
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
/// The DNS proxy inside each pod's netns (127.0.0.1 and ::1, UDP and TCP),
/// where DNS capture sends the pod's queries (Istio's 15053).
pub const PORT_DNS_PROXY: u16 = 15053;
/// The DNS port a pod's queries are captured on.
pub const PORT_DNS: u16 = 53;

/// `SO_MARK` carried by every socket the proxy opens; such sockets are never
/// captured.
pub const PROXY_MARK: u32 = 0x539;

/// Only the low 12 bits of the packet mark are the mesh's to match and set
/// (as Istio's), leaving the rest to the CNI and other software in the pod.
pub const MARK_MASK: u32 = 0xfff;

/// Mark of the application's replies to the proxy's transparent inbound
/// connections (Istio's 0x111): the pod's policy route sends packets with it
/// to `lo`, where the proxy's socket bound to the client's address gets them.
pub const REPLY_MARK: u32 = 0x111;

/// Istio's kubelet health-probe source address: probes from it reach the
/// application directly. 169.254.7.127.
pub const DEFAULT_PROBE_SOURCE_V4: [u8; 4] = [169, 254, 7, 127];

/// Largest number of pods one agent can enrol (size of the enrolment map and
/// of the per-pod arrays).
pub const MAX_PODS: u32 = 4096;

/// Excluded ports per pod and direction (fixed size: the programs loop over
/// them with a bound).
pub const MAX_EXCLUDED_PORTS: usize = 8;
/// Excluded outbound IPv4 CIDRs per pod.
pub const MAX_EXCLUDED_CIDRS: usize = 4;

/// Original destinations remembered at once (LRU: the proxy reads an entry
/// right after accept; old ones are evicted, never leak).
pub const MAX_ORIGINAL_DSTS: u32 = 65536;

/// Connection ends tracked for splicing at once (LRU: an evicted flow
/// simply stops splicing, see `SpliceFlow`).
pub const MAX_SPLICE_SOCKETS: u32 = 65536;

/// Compiled authorization verdicts the connect programs can hold (hash,
/// allocated as used). An entry is one (source pod, destination pod IP,
/// port or "any other port") whose verdict differs from "allow"; 131,072
/// cover every pair of 110 pods (the kubelet's default maximum per node)
/// with ten named ports each. A full map only loses the early refusal:
/// the proxy still enforces (see `docs/authz.md`).
pub const MAX_POLICY_VERDICTS: u32 = 131072;

/// (source pod, policy) pairs whose kernel denials are counted at once.
pub const MAX_POLICY_DENIAL_COUNTERS: u32 = 16384;

/// Destinations the proxy must see, at most (mesh workload IPs and service
/// VIPs, both families): the size of [`maps::FAST_PATH_DESTS`]. A view with
/// more turns the fast path off (every flow back through the proxy).
pub const MAX_FAST_PATH_DESTINATIONS: u32 = 65536;

/// Fast-path connections tracked at once, from connect() to close (LRU: an
/// entry left by a connect that never reached the SYN is evicted, never
/// leaks; see `ebpf/src/passthrough.rs`).
pub const MAX_FAST_PATH_SOCKETS: u32 = 65536;

/// Sockets whose DNS server is remembered at once (LRU, by socket cookie;
/// see [`maps::DNS_SERVERS`]). An entry is needed only from the query to
/// its answer (a resolver's timeout, 5 s by default); the sendmsg hook
/// writes it again on every query. 65,536 entries keep that window for
/// more than 13,000 new resolver sockets per second on a node.
pub const MAX_DNS_SOCKETS: u32 = 65536;

/// Size of the fast path's event ring buffer: 256 KiB, about 2,000 events
/// (128 bytes each with the ring's header) in flight before new ones are
/// dropped (and counted).
pub const FAST_PATH_EVENTS_BYTES: u32 = 256 * 1024;

/// Same-node mesh destinations the kernel may carry to (flow 2 of the fast
/// path: enrolled pods' addresses): [`maps::MESH_LOCAL_DESTS`]. Two
/// addresses (IPv4 and IPv6) for every pod slot.
pub const MAX_MESH_LOCAL_DESTS: u32 = 2 * MAX_PODS;

/// Same-node mesh connections between their connect() and their close
/// ([`maps::MESH_LOCAL_FLOWS`]); as many as the fast path's connection
/// records, which each of them also holds.
pub const MAX_MESH_LOCAL_FLOWS: u32 = MAX_FAST_PATH_SOCKETS;

/// Service ports (VIP and port) flow 2 may carry to a same-node endpoint
/// ([`maps::MESH_LOCAL_SERVICES`]): two VIPs (one per family) of up to
/// 4,096 service ports whose every ready endpoint is an eligible pod of
/// this node. At about 420 bytes an entry, allocated as used: 3.4 MiB at
/// most. A service port beyond it is left to the proxy.
pub const MAX_MESH_LOCAL_SERVICES: u32 = 8192;

/// Most ready endpoints of one service port that flow 2 carries through
/// its VIP ([`MeshService::endpoints`]); a service port with more goes
/// through the proxy.
pub const MAX_MESH_SERVICE_ENDPOINTS: usize = 16;

/// Same-node mesh connections made through a service VIP, between their
/// connect() and their close ([`maps::MESH_LOCAL_SERVICE_SOCKS`]); as many
/// as the fast path's connection records, which each of them also holds.
pub const MAX_MESH_SERVICE_SOCKETS: u32 = MAX_FAST_PATH_SOCKETS;

/// Names of the maps, as they appear in the ELF object and under the pin dir.
pub mod maps {
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

    /// `HashMap<FastPathDest, u32>`: every destination the proxy must see
    /// (mesh workload IPs, service VIPs); an enrolled pod's connect to any
    /// other goes direct when the fast path is on and the table valid.
    /// Written only by the agent's fast-path table writer.
    pub const FAST_PATH_DESTS: &str = "SHUNT_FP_DESTS";
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

    /// Every map the agent pins (and every pod's program instance shares).
    pub const ALL: [&str; 26] = [
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
        FAST_PATH_DESTS,
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
    ];
}

/// Names of the globals the agent sets when it loads the programs.
pub mod globals {
    /// `u8`: the most verbose aya-log level the programs emit.
    pub const LOG_LEVEL: &str = "AYA_LOG_LEVEL";
    /// `u8`: non-zero to log connection starts (debug level) from TC egress.
    pub const LOG_CONNECTIONS: &str = "LOG_CONNECTIONS";
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
    /// `cgroup/connect4` on the cgroup root.
    pub const CONNECT4: &str = "shunt_connect4";
    /// `cgroup/connect6` on the cgroup root.
    pub const CONNECT6: &str = "shunt_connect6";
    /// `sockops` on the cgroup root.
    pub const SOCKOPS: &str = "shunt_sockops";
    /// `cgroup/getsockopt` on the cgroup root: answers `SO_ORIGINAL_DST`.
    pub const GETSOCKOPT: &str = "shunt_getsockopt";
    /// `cgroup/getpeername4` on the cgroup root: the service VIP a flow-2
    /// connection was dialled to (`ebpf/src/mesh_service.rs`).
    pub const GETPEERNAME4: &str = "shunt_getpeername4";
    /// `cgroup/getpeername6` on the cgroup root (as [`GETPEERNAME4`]).
    pub const GETPEERNAME6: &str = "shunt_getpeername6";
    /// `sk_msg` verdict on [`super::maps::SPLICE_SOCKS`].
    pub const SPLICE_MSG: &str = "shunt_splice_msg";
    /// Raw tracepoint on `sock_recv_length`: counts bytes read by spliced
    /// sockets.
    pub const SPLICE_RECV: &str = "shunt_splice_recv";
    /// `cgroup/sendmsg4` on the cgroup root: a pod's UDP DNS query to the
    /// DNS proxy (`ebpf/src/dns.rs`).
    pub const DNS_SENDMSG4: &str = "shunt_dns_sendmsg4";
    /// `cgroup/sendmsg6` on the cgroup root.
    pub const DNS_SENDMSG6: &str = "shunt_dns_sendmsg6";
    /// `cgroup/recvmsg4` on the cgroup root: the answer's source back to
    /// the server the pod asked.
    pub const DNS_RECVMSG4: &str = "shunt_dns_recvmsg4";
    /// `cgroup/recvmsg6` on the cgroup root.
    pub const DNS_RECVMSG6: &str = "shunt_dns_recvmsg6";
    /// The tracepoint [`SPLICE_RECV`] attaches to (Linux 6.3+).
    pub const SPLICE_RECV_TARGET: &str = "sock_recv_length";
}

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
    /// [`PodConfig::REPLY_TO_PROXY`] | [`PodConfig::NO_SPLICE`].
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

/// Settings of the whole agent (one entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalConfig {
    /// Health-probe source whose traffic is never steered (network order).
    pub probe_source_v4: u32,
    /// [`GlobalConfig::SPLICE`].
    pub flags: u32,
    /// Most bytes spliced into a socket and not yet read by it before that
    /// direction of the connection falls back to the TCP stack for good.
    pub splice_backlog: u32,
    /// Reserved (zero).
    pub reserved: u32,
}

impl GlobalConfig {
    /// New app ⇄ proxy connections are spliced (sockops joins them to
    /// [`maps::SPLICE_SOCKS`]).
    pub const SPLICE: u32 = 1;
}

/// Default of [`GlobalConfig::splice_backlog`]: 1 MiB, about what the TCP
/// stack itself lets a loopback connection buffer before the sender blocks.
pub const DEFAULT_SPLICE_BACKLOG: u32 = 1 << 20;

/// One end of an app ⇄ proxy connection inside a pod's netns: the key of
/// the splice maps. Addresses in network order (IPv4 in `[0]`; a
/// v4-mapped IPv6 address is keyed as IPv4, as its peer sees it), ports in
/// host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SpliceKey {
    pub netns_cookie: u64,
    pub local_addr: [u32; 4],
    pub remote_addr: [u32; 4],
    pub local_port: u32,
    pub remote_port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
    /// Reserved (zero), so the key has no padding.
    pub reserved: u32,
}

impl SpliceKey {
    /// The key of the other end of the same connection.
    pub fn peer(&self) -> SpliceKey {
        SpliceKey {
            netns_cookie: self.netns_cookie,
            local_addr: self.remote_addr,
            remote_addr: self.local_addr,
            local_port: self.remote_port,
            remote_port: self.local_port,
            family: self.family,
            reserved: 0,
        }
    }
}

/// The splice state of one direction of a connection, kept for its
/// receiving end. `spliced` is written only by the sender's sk_msg program
/// (under the sender's socket lock) and `consumed` only by the receive hook
/// (under the receiver's), so neither needs atomics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpliceFlow {
    /// Bytes redirected into the receiver's queue.
    pub spliced: u64,
    /// Bytes the receiver has read from that queue.
    pub consumed: u64,
    /// The pod's slot (for its counters).
    pub slot: u32,
    /// Non-zero once this direction fell back to the TCP stack. Never
    /// cleared: after bytes took the TCP path, splicing again could let
    /// later bytes overtake them.
    pub fallen_back: u32,
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

/// Where an application's connection was going before connect() was
/// rewritten. Addresses in network order (IPv4 in `addr[0]`), port in host
/// order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OriginalDst {
    pub addr: [u32; 4],
    pub port: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
}

/// A socket's local end inside a netns: how the proxy finds the original
/// destination of a connection it accepted (the peer of the accepted socket
/// is the application's local end).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockKey {
    pub netns_cookie: u64,
    /// Network order; IPv4 in `addr[0]`, the rest zero.
    pub addr: [u32; 4],
    /// Host order.
    pub port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
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

/// Key of [`maps::POLICY_VERDICTS`]: a connect from the pod in `slot` to
/// `addr`:`port`. Addresses in network order (IPv4 in `addr[0]`, the rest
/// zero; a v4-mapped IPv6 destination is keyed as IPv4), port in host
/// order; port [`PolicyVerdictKey::ANY_OTHER_PORT`] holds the verdict of
/// every port no entry of its own names.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyVerdictKey {
    pub slot: u32,
    pub port: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
    pub addr: [u32; 4],
}

impl PolicyVerdictKey {
    /// The port of the entry that holds "every other port" (no connect
    /// goes to port 0).
    pub const ANY_OTHER_PORT: u16 = 0;
}

/// Value of [`maps::POLICY_VERDICTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyVerdict {
    /// [`PolicyVerdict::ALLOW`] or [`PolicyVerdict::DENY`].
    pub action: u32,
    /// The deciding policy's number (the agent's own numbering; 0: none),
    /// the key of the denial counter.
    pub policy: u32,
}

impl PolicyVerdict {
    /// The connect goes on to the proxy as without an entry (an allowed
    /// port under a denying "any other port").
    pub const ALLOW: u32 = 0;
    /// connect() fails with EPERM, counted in [`maps::POLICY_DENIALS`].
    pub const DENY: u32 = 1;
}

/// Key of [`maps::POLICY_DENIALS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyDenialKey {
    pub slot: u32,
    pub policy: u32,
}

/// A key of [`maps::FAST_PATH_DESTS`]: an address in network order, IPv4 as
/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`), as connect6 sees a dual-stack
/// socket's IPv4 destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FastPathDest {
    pub addr: [u32; 4],
}

impl FastPathDest {
    /// The key of an IPv4 address given in network order.
    pub fn v4(addr_be: u32) -> Self {
        Self {
            addr: [0, 0, 0xffffu32.to_be(), addr_be],
        }
    }
}

/// The one entry of [`maps::FAST_PATH_STATE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathState {
    /// [`FastPathState::VALID`].
    pub flags: u32,
    /// How many times the table was made valid (for logs and tests).
    pub generation: u32,
}

impl FastPathState {
    /// The destination table holds every destination the proxy must see:
    /// a destination missing from it may go direct. Off, every connect of
    /// an enrolled pod goes to the proxy as without the fast path.
    pub const VALID: u32 = 1;
}

/// What connect() left for sockops about a connect that went direct
/// (value of [`maps::FAST_PATH_SOCKS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathSock {
    pub netns_cookie: u64,
    /// `bytes_acked` and `bytes_received` when the connection became
    /// established (the SYN's sequence number, if the kernel counts it).
    pub acked_base: u64,
    pub received_base: u64,
    /// `bpf_ktime_get_ns` at connect.
    pub started_ns: u64,
    pub slot: u32,
    /// `FastPathSock::*` state bits.
    pub flags: u32,
    /// `rcv_nxt` when the socket entered FIN_WAIT2 (to tell a peer's FIN
    /// from a local close at the move to CLOSE).
    pub rcv_nxt_fin_wait2: u32,
    /// With [`FastPathSock::MESH_LOCAL`]: the destination pod's slot;
    /// otherwise zero.
    pub peer_slot: u32,
}

impl FastPathSock {
    /// The connection was established (an opened event was sent).
    pub const ESTABLISHED: u32 = 1;
    /// The peer's FIN was received (it counts one in `bytes_received`).
    pub const PEER_FIN: u32 = 2;
    /// Our FIN was acknowledged (it counts one in `bytes_acked`).
    pub const FIN_ACKED: u32 = 4;
    /// The application closed the socket while in FIN_WAIT2.
    pub const CLOSED_IN_FIN_WAIT2: u32 = 8;
    /// A same-node mesh connection carried in the kernel (flow 2): its
    /// 4-tuple is in [`maps::MESH_LOCAL_FLOWS`] from the SYN to the close.
    pub const MESH_LOCAL: u32 = 16;
    /// Flow 2 through a service VIP: the VIP dialled is in
    /// [`maps::MESH_LOCAL_SERVICE_SOCKS`] under the socket's cookie.
    pub const VIA_SERVICE: u32 = 32;
}

/// One event of [`maps::FAST_PATH_EVENTS`]: a fast-path connection opened
/// or closed. Addresses in network order (IPv4 in `[0]`), ports in host
/// order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathEvent {
    /// [`FastPathEvent::OPENED`] or [`FastPathEvent::CLOSED`].
    pub kind: u32,
    pub slot: u32,
    pub netns_cookie: u64,
    pub socket_cookie: u64,
    pub src_addr: [u32; 4],
    pub dst_addr: [u32; 4],
    pub src_port: u32,
    pub dst_port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
    /// [`FastPathEvent::FAILED`] on a close.
    pub flags: u32,
    /// Payload bytes the pod's socket sent and the peer acknowledged.
    pub bytes_sent: u64,
    /// Payload bytes the pod's socket received.
    pub bytes_received: u64,
    /// From connect() to this event.
    pub duration_ns: u64,
    /// The service VIP the application dialled (flow 2 through a VIP;
    /// `dst_addr` is then the endpoint chosen), as `dst_addr`; zero
    /// otherwise.
    pub service_addr: [u32; 4],
    /// The service port dialled (host order); zero without a service.
    pub service_port: u32,
    /// `AF_INET` or `AF_INET6` with a service; zero without.
    pub service_family: u32,
}

impl FastPathEvent {
    pub const OPENED: u32 = 1;
    pub const CLOSED: u32 = 2;
    /// The connection never became established (refused, timed out).
    pub const FAILED: u32 = 1;
    /// A same-node mesh connection (flow 2): the destination is an
    /// enrolled mesh pod of this node, reported by both ends.
    pub const MESH_LOCAL: u32 = 2;
}

/// Value of [`maps::MESH_LOCAL_DESTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalDest {
    /// The destination pod's slot.
    pub slot: u32,
    /// Reserved (zero).
    pub flags: u32,
}

/// Key of [`maps::MESH_LOCAL_FLOWS`]: a connection as the destination's TC
/// ingress sees its SYN. Addresses and ports in network order (IPv4 in
/// `[0]`, the rest zero).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MeshFlowKey {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
}

/// Value of [`maps::MESH_LOCAL_FLOWS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshFlow {
    pub src_slot: u32,
    /// Only the TC instance of this slot lets the SYN through.
    pub dst_slot: u32,
}

/// Key of [`maps::MESH_LOCAL_SERVICES`]: a service VIP (network order,
/// IPv4 mapped into IPv6 as [`FastPathDest`]) and port (host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MeshServiceKey {
    pub addr: [u32; 4],
    pub port: u32,
}

/// One endpoint of a [`MeshService`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshServiceEndpoint {
    /// The endpoint's address (network order, IPv4 mapped into IPv6 as
    /// [`FastPathDest`]).
    pub addr: [u32; 4],
    /// Its target port for the service port (host order).
    pub port: u32,
    /// Its share of connections (the workload's capacity; at least 1).
    pub weight: u32,
}

/// Value of [`maps::MESH_LOCAL_SERVICES`]: every ready endpoint of the
/// service port (all eligible flow-2 destinations of this node).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshService {
    /// Endpoints used, `1..=MAX_MESH_SERVICE_ENDPOINTS`.
    pub count: u32,
    /// The sum of their weights (non-zero).
    pub total_weight: u32,
    pub endpoints: [MeshServiceEndpoint; MAX_MESH_SERVICE_ENDPOINTS],
}

/// Value of [`maps::MESH_LOCAL_SERVICE_SOCKS`]: the VIP and port a flow-2
/// connection was dialled to, as the application gave it (network-order
/// address, IPv4 in `[0]`; port in host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshServiceSock {
    pub addr: [u32; 4],
    pub port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
}

/// Flow 2's kernel counters (one entry, per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalStats {
    /// Same-node mesh connects carried in the kernel.
    pub carried: u64,
    /// Same-node mesh connects sent to the proxy because flow 2 was off
    /// (verdicts incomplete, or not compiled yet).
    pub off: u64,
    /// Same-node mesh connects sent to the proxy because their record
    /// could not be kept.
    pub untracked: u64,
    /// SYNs whose flow entry could not be written (a full map): the
    /// destination's proxy gets them as inbound plaintext.
    pub flows_unrecorded: u64,
}

impl MeshLocalStats {
    pub fn add(&mut self, other: &MeshLocalStats) {
        self.carried += other.carried;
        self.off += other.off;
        self.untracked += other.untracked;
        self.flows_unrecorded += other.flows_unrecorded;
    }
}

/// The fast path's kernel counters (one entry, per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathStats {
    /// Connects of enrolled pods that went direct.
    pub direct: u64,
    /// Connects that went to the proxy because the table was not valid.
    pub table_invalid: u64,
    /// Connects that went to the proxy because their record could not be
    /// kept.
    pub untracked: u64,
    /// Events lost because the ring buffer was full.
    pub events_dropped: u64,
}

impl FastPathStats {
    pub fn add(&mut self, other: &FastPathStats) {
        self.direct += other.direct;
        self.table_invalid += other.table_invalid;
        self.untracked += other.untracked;
        self.events_dropped += other.events_dropped;
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: each type is `#[repr(C)]`, contains only integers (or arrays
    // and structs of them) laid out without padding, so any bit pattern is a
    // valid value.
    unsafe impl aya::Pod for super::PodSlot {}
    unsafe impl aya::Pod for super::PodCounters {}
    unsafe impl aya::Pod for super::PodConfig {}
    unsafe impl aya::Pod for super::PodAddrs {}
    unsafe impl aya::Pod for super::Cidr4 {}
    unsafe impl aya::Pod for super::GlobalConfig {}
    unsafe impl aya::Pod for super::OriginalDst {}
    unsafe impl aya::Pod for super::SockKey {}
    unsafe impl aya::Pod for super::PodRecord {}
    unsafe impl aya::Pod for super::SpliceKey {}
    unsafe impl aya::Pod for super::SpliceFlow {}
    unsafe impl aya::Pod for super::PolicyVerdictKey {}
    unsafe impl aya::Pod for super::PolicyVerdict {}
    unsafe impl aya::Pod for super::PolicyDenialKey {}
    unsafe impl aya::Pod for super::FastPathDest {}
    unsafe impl aya::Pod for super::FastPathState {}
    unsafe impl aya::Pod for super::FastPathSock {}
    unsafe impl aya::Pod for super::FastPathEvent {}
    unsafe impl aya::Pod for super::FastPathStats {}
    unsafe impl aya::Pod for super::MeshLocalDest {}
    unsafe impl aya::Pod for super::MeshFlowKey {}
    unsafe impl aya::Pod for super::MeshFlow {}
    unsafe impl aya::Pod for super::MeshLocalStats {}
    unsafe impl aya::Pod for super::MeshServiceKey {}
    unsafe impl aya::Pod for super::MeshServiceEndpoint {}
    unsafe impl aya::Pod for super::MeshService {}
    unsafe impl aya::Pod for super::MeshServiceSock {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(core::mem::size_of::<PodSlot>(), 8);
        assert_eq!(core::mem::size_of::<PodCounters>(), 10 * 8);
        assert_eq!(core::mem::size_of::<GlobalConfig>(), 16);
        assert_eq!(core::mem::size_of::<SpliceKey>(), 56);
        assert_eq!(core::mem::size_of::<SpliceFlow>(), 24);
        assert_eq!(core::mem::size_of::<Cidr4>(), 8);
        assert_eq!(
            core::mem::size_of::<PodConfig>(),
            8 + 2 * 2 * MAX_EXCLUDED_PORTS + 8 * MAX_EXCLUDED_CIDRS
        );
        assert_eq!(core::mem::size_of::<OriginalDst>(), 20);
        assert_eq!(core::mem::size_of::<PodAddrs>(), 20);
        assert_eq!(core::mem::size_of::<SockKey>(), 32);
        assert_eq!(core::mem::size_of::<PolicyVerdictKey>(), 24);
        assert_eq!(core::mem::size_of::<PolicyVerdict>(), 8);
        assert_eq!(core::mem::size_of::<PolicyDenialKey>(), 8);
        assert_eq!(core::mem::size_of::<FastPathDest>(), 16);
        assert_eq!(core::mem::size_of::<FastPathState>(), 8);
        assert_eq!(core::mem::size_of::<FastPathSock>(), 48);
        assert_eq!(core::mem::size_of::<FastPathEvent>(), 120);
        assert_eq!(core::mem::size_of::<FastPathStats>(), 32);
        assert_eq!(core::mem::size_of::<MeshLocalDest>(), 8);
        assert_eq!(core::mem::size_of::<MeshFlowKey>(), 40);
        assert_eq!(core::mem::size_of::<MeshFlow>(), 8);
        assert_eq!(core::mem::size_of::<MeshLocalStats>(), 32);
        assert_eq!(core::mem::size_of::<MeshServiceKey>(), 20);
        assert_eq!(core::mem::size_of::<MeshServiceEndpoint>(), 24);
        assert_eq!(
            core::mem::size_of::<MeshService>(),
            8 + 24 * MAX_MESH_SERVICE_ENDPOINTS
        );
        assert_eq!(core::mem::size_of::<MeshServiceSock>(), 24);
    }

    #[test]
    fn cidr_matches_by_prefix() {
        let net = Cidr4 {
            addr: u32::from_be_bytes([198, 18, 0, 0]).to_be(),
            mask: u32::from_be_bytes([255, 254, 0, 0]).to_be(),
        };
        assert!(net.contains(u32::from_be_bytes([198, 19, 3, 4]).to_be()));
        assert!(!net.contains(u32::from_be_bytes([198, 20, 0, 1]).to_be()));
    }
}
