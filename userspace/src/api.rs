//! The admin API's wire types, shared by the server (`admin.rs`) and its
//! client (`shunt status`, the testbed): what `GET /status` answers, and
//! `GET /config_dump` in ztunnel's shape ([`config_dump`]).

pub mod config_dump;

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

pub use crate::state::PodState;
use crate::{proxy::ProxyStats, redirect::Hook};

/// `GET /status`: the node and every pod of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    /// Redirection mode in use (`ebpf` or `iptables`).
    pub mode: String,
    pub trust_domain: String,
    /// Whether the pod source has handed over its first complete list and it
    /// was reconciled: before that, `pods` is empty for want of a list, not
    /// because the node has none.
    #[serde(default)]
    pub synced: bool,
    /// The builtin proxy's counters (absent without one).
    #[serde(default)]
    pub proxy: Option<ProxyStats>,
    /// How many verify passes have read the pods' hooks and counters so far:
    /// a client that wants counters read after some moment waits until this
    /// has grown by two (one pass may have been under way at that moment).
    #[serde(default)]
    pub verify_passes: u64,
    /// The istiod connection, with `--xds-address`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds: Option<XdsSummary>,
    /// The kernel's authorization point (eBPF mode with the builtin
    /// proxy), as its last compile left it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_authz: Option<KernelAuthzStatus>,
    /// The fast path (eBPF mode), as its tasks last published it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<FastPathStatus>,
    pub pods: Vec<PodStatus>,
}

/// The fast path (`--fast-path`): flow 1 (passthrough connects go direct)
/// and flow 2 (same-node mesh connects carried in the kernel).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FastPathStatus {
    /// `--fast-path on` (with capture and the builtin proxy).
    pub enabled: bool,
    /// Flow 1: the destination table is complete and in use.
    pub table_valid: bool,
    /// Destinations (mesh workload IPs, service VIPs) in flow 1's table.
    pub destinations: u64,
    /// Address ranges (ServiceEntry CIDRs) in flow 1's table.
    #[serde(default)]
    pub ranges: u64,
    /// Flow 2 is on.
    pub mesh_local_on: bool,
    /// Why flow 2 is off (absent while it is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_local_off_reason: Option<String>,
    /// Connects that went direct (flow 1), since the agent started.
    pub passthrough_connections: u64,
    /// Connects carried in the kernel between this node's mesh pods (flow 2).
    pub mesh_local_connections: u64,
    /// Connection events the kernel could not hand over (ring buffer
    /// full): those connections are missing from the metrics.
    pub events_dropped: u64,
}

/// The authorization verdicts compiled into the kernel (`docs/authz.md`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelAuthzStatus {
    /// The policies the table was compiled from (`namespace/name`, dry-run
    /// ones left out), sorted.
    pub policies: Vec<String>,
    /// Entries in the kernel's table.
    pub entries: usize,
    /// (source pod, destination address) pairs the kernel cannot know
    /// exactly or could not hold: the proxy alone decides them.
    pub left_to_proxy: usize,
    /// The last write error, if the table could not be written whole.
    #[serde(default)]
    pub error: Option<String>,
}

/// Connects from a pod that the kernel refused, for one policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelDenial {
    /// `namespace/name` of the deciding policy.
    pub policy: String,
    pub connects: u64,
}

/// One pod of this node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodStatus {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub service_account: String,
    pub identity: String,
    pub dataplane_mode: String,
    pub state: PodState,
    pub netns: Option<PathBuf>,
    pub netns_cookie: Option<u64>,
    /// As the last verify pass (or the enrolment) found them.
    pub hooks: Vec<Hook>,
    /// Kernel counters as the last verify pass read them; present while the
    /// pod is enrolled.
    pub counters: Option<Counters>,
    /// The current certificate of the pod's identity (with the builtin
    /// proxy, once issued).
    #[serde(default)]
    pub certificate: Option<CertificateStatus>,
    /// The authorization policies that apply to it (`namespace/name`).
    #[serde(default)]
    pub policies: Vec<String>,
    /// Its connects the kernel refused (EPERM), per policy, as the last
    /// verify pass read them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernel_denials: Vec<KernelDenial>,
    /// The pod opted out of the fast path (`shunt.io/fast-path: "off"` on it
    /// or its namespace; `fastPath: false`): its connections take the proxy.
    #[serde(default)]
    pub fast_path_opt_out: bool,
    /// Its connections the kernel carried (the fast path), since the agent
    /// started; absent for a pod with none (vip).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<PodFastPath>,
}

/// One pod's connections carried by the fast path, counted from the
/// kernel's events (opened) by the agent's reporter (`fastpath::report`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodFastPath {
    /// Its connects that went direct (flow 1, passthrough).
    pub passthrough: u64,
    /// Its connects to a same-node mesh pod (or VIP) carried in the kernel.
    pub mesh_outbound: u64,
    /// Connections from a same-node mesh pod to it carried in the kernel.
    pub mesh_inbound: u64,
}

/// A workload certificate's validity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertificateStatus {
    /// Seconds since the epoch.
    pub not_before: i64,
    pub not_after: i64,
}

impl From<&crate::identity::WorkloadCert> for CertificateStatus {
    fn from(cert: &crate::identity::WorkloadCert) -> Self {
        Self {
            not_before: unix_seconds(cert.not_before()),
            not_after: unix_seconds(cert.not_after()),
        }
    }
}

/// Per-pod traffic counters as the TC programs on `eth0` saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    /// Outbound connects rewritten to the proxy (eBPF mode).
    #[serde(default)]
    pub outbound_redirected: u64,
    /// Inbound connections steered to the proxy (eBPF mode).
    #[serde(default)]
    pub inbound_redirected: u64,
    /// Outbound connects refused because the proxy listener was missing.
    #[serde(default)]
    pub outbound_fail_closed: u64,
    /// Inbound packets dropped because the proxy listener was missing.
    #[serde(default)]
    pub inbound_fail_closed: u64,
    /// Payload bytes moved between app and proxy sockets by sk_msg.
    #[serde(default)]
    pub spliced_bytes: u64,
    /// Connection directions that stopped splicing (reader too far behind,
    /// or no peer to splice into) and went on over the TCP stack.
    #[serde(default)]
    pub splice_fallbacks: u64,
}

impl From<shunt_common::PodCounters> for Counters {
    fn from(c: shunt_common::PodCounters) -> Self {
        Self {
            packets_in: c.packets_in,
            bytes_in: c.bytes_in,
            packets_out: c.packets_out,
            bytes_out: c.bytes_out,
            outbound_redirected: c.outbound_redirected,
            inbound_redirected: c.inbound_redirected,
            outbound_fail_closed: c.outbound_fail_closed,
            inbound_fail_closed: c.inbound_fail_closed,
            spliced_bytes: c.spliced_bytes,
            splice_fallbacks: c.splice_fallbacks,
        }
    }
}

/// Seconds since the epoch (negative before it).
pub fn unix_seconds(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs() as i64),
    }
}

/// Seconds from `now` until `unix` (negative when past).
pub fn seconds_until(unix: i64, now: SystemTime) -> i64 {
    unix - unix_seconds(now)
}

// --- The istiod connection (`--xds-address`; written by `xds::client`) ---

/// The last accepted response of a type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckRecord {
    pub nonce: String,
    pub system_version_info: String,
    /// Seconds since the epoch.
    pub at: i64,
}

/// The last rejected response of a type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NackRecord {
    pub nonce: String,
    pub reason: String,
    pub at: i64,
}

/// One type's exchange.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeStatus {
    pub type_url: String,
    /// Resources held now.
    pub resources: usize,
    /// Whether a response of this type was applied since the start.
    pub received: bool,
    pub last_ack: Option<AckRecord>,
    pub last_nack: Option<NackRecord>,
}

/// One held resource: where a workload, service or policy came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceStatus {
    /// `workload`, `service` or `authorization`.
    pub kind: String,
    /// The xDS resource name (a workload's uid, `namespace/hostname`,
    /// `namespace/name`).
    pub name: String,
    pub version: String,
}

impl ResourceStatus {
    pub const WORKLOAD: &str = "workload";
    pub const SERVICE: &str = "service";
    pub const AUTHORIZATION: &str = "authorization";
}

/// The istiod connection and what it sent, for `/config_dump` and
/// `shunt status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdsStatus {
    pub address: String,
    pub node_id: String,
    pub connected: bool,
    /// Seconds since the epoch when the current stream opened.
    pub connected_since: Option<i64>,
    /// Streams opened since the start.
    pub connections: u64,
    /// Why the last stream ended or could not open.
    pub last_error: Option<String>,
    /// Both types received once (readiness).
    pub synced: bool,
    pub types: Vec<TypeStatus>,
    /// What could not be resolved across resources (a workload naming a
    /// service istiod has not sent, an address claimed twice).
    pub warnings: Vec<String>,
    pub resources: ResourceList,
}

/// The held resources as `/config_dump` lists them: the address resources
/// by name, then the authorization policies by name (serialized as that
/// list). A persistent map: the xDS client changes only the entries a
/// response touched, and publishing it after every response shares the
/// tree instead of copying a mesh's worth of names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceList {
    /// Keys and values behind `Arc`s: a change to a shared tree copies the
    /// nodes on its path, and so clones their entries.
    entries: imbl::OrdMap<(ResourceGroup, Arc<str>), Arc<ResourceStatus>>,
    /// Entries per kind: [workload, service, authorization].
    counts: [usize; 3],
}

/// The two xDS types, in the list's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ResourceGroup {
    Address,
    Authorization,
}

impl ResourceList {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &ResourceStatus> {
        self.into_iter()
    }

    /// How many of `kind` (`workload`, `service`, `authorization`).
    pub fn count(&self, kind: &str) -> usize {
        Self::slot(kind).map_or(0, |slot| self.counts[slot])
    }

    /// Adds `status`, or replaces the one of its type and name (a
    /// workload that became a service included).
    pub(crate) fn set(&mut self, status: ResourceStatus) {
        let key = (Self::group(&status.kind), Arc::from(status.name.as_str()));
        if let Some(slot) = Self::slot(&status.kind) {
            self.counts[slot] += 1;
        }
        if let Some(old) = self.entries.insert(key, Arc::new(status)) {
            self.uncount(&old.kind);
        }
    }

    /// Removes the resource `name` of `kind`'s type (`workload` and
    /// `service` are both address resources).
    pub(crate) fn remove(&mut self, kind: &str, name: &str) {
        if let Some(old) = self.entries.remove(&(Self::group(kind), Arc::from(name))) {
            self.uncount(&old.kind);
        }
    }

    fn uncount(&mut self, kind: &str) {
        if let Some(slot) = Self::slot(kind) {
            self.counts[slot] -= 1;
        }
    }

    fn group(kind: &str) -> ResourceGroup {
        match kind {
            ResourceStatus::AUTHORIZATION => ResourceGroup::Authorization,
            _ => ResourceGroup::Address,
        }
    }

    fn slot(kind: &str) -> Option<usize> {
        match kind {
            ResourceStatus::WORKLOAD => Some(0),
            ResourceStatus::SERVICE => Some(1),
            ResourceStatus::AUTHORIZATION => Some(2),
            _ => None,
        }
    }
}

impl FromIterator<ResourceStatus> for ResourceList {
    fn from_iter<I: IntoIterator<Item = ResourceStatus>>(iter: I) -> Self {
        let mut list = ResourceList::default();
        for status in iter {
            list.set(status);
        }
        list
    }
}

impl<'a> IntoIterator for &'a ResourceList {
    type Item = &'a ResourceStatus;
    type IntoIter = std::iter::Map<
        imbl::ordmap::Values<
            'a,
            (ResourceGroup, Arc<str>),
            Arc<ResourceStatus>,
            imbl::shared_ptr::DefaultSharedPtr,
        >,
        fn(&Arc<ResourceStatus>) -> &ResourceStatus,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.values().map(|status| &**status)
    }
}

impl Serialize for ResourceList {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for ResourceList {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Vec::<ResourceStatus>::deserialize(deserializer)?
            .into_iter()
            .collect())
    }
}

/// The istiod connection in one line's worth (`shunt status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdsSummary {
    pub address: String,
    pub connected: bool,
    pub connected_since: Option<i64>,
    pub synced: bool,
    pub last_error: Option<String>,
    pub workloads: usize,
    pub services: usize,
    pub policies: usize,
    /// The reason of the latest NACK of any type.
    pub last_nack: Option<String>,
    pub warnings: usize,
}

/// A shared, read-only view of the status; the client is its one writer.
#[derive(Clone, Debug, Default)]
pub struct XdsStatusHandle(std::sync::Arc<std::sync::RwLock<XdsStatus>>);

impl XdsStatusHandle {
    pub fn snapshot(&self) -> XdsStatus {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether both types were received once (cheap: no copy).
    pub fn is_synced(&self) -> bool {
        self.0.read().unwrap_or_else(|p| p.into_inner()).synced
    }

    /// The connection and counts, without the resource list (`shunt
    /// status`, readiness).
    pub fn summary(&self) -> XdsSummary {
        let status = self.0.read().unwrap_or_else(|p| p.into_inner());
        let count = |kind: &str| status.resources.count(kind);
        XdsSummary {
            address: status.address.clone(),
            connected: status.connected,
            connected_since: status.connected_since,
            synced: status.synced,
            last_error: status.last_error.clone(),
            workloads: count("workload"),
            services: count("service"),
            policies: count("authorization"),
            last_nack: status
                .types
                .iter()
                .filter_map(|t| t.last_nack.as_ref())
                .max_by_key(|n| n.at)
                .map(|n| n.reason.clone()),
            warnings: status.warnings.len(),
        }
    }

    pub(crate) fn set(&self, status: XdsStatus) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = status;
    }
}
