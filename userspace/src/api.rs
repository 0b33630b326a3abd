//! The admin API's wire types, shared by the server (`admin.rs`) and its
//! client (`shunt status`, the testbed): what `GET /status` answers.

use std::{
    net::IpAddr,
    path::PathBuf,
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
    pub pods: Vec<PodStatus>,
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
