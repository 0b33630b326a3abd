//! Redirection: putting a pod's traffic in the kernel's hands.
//!
//! A [`Redirector`] enrols a pod (attaches what it needs inside the pod's
//! network namespace), verifies it is still in place, reports counters, and
//! unenrols it leaving nothing behind. The eBPF mode lives in [`ebpf`], the
//! iptables mode in [`iptables`]; `--redirect auto` picks eBPF when the
//! kernel [`probe`] finds every hook it needs.

pub mod ebpf;
pub mod iptables;
mod mesh_local;
pub mod probe;
pub mod route;
pub mod tc_dump;

use std::{fmt, path::PathBuf};

use serde::Serialize;
use shunt_common::PodCounters;

pub use mesh_local::{MeshLocalTable, MeshLocalWritten};

use crate::state::WorkloadKey;

/// The interface a pod's traffic leaves and enters by, inside its netns (as
/// every CNI names it).
pub const POD_INTERFACE: &str = "eth0";

/// How pods are redirected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RedirectMode {
    /// Probe the kernel and use eBPF when every hook is available.
    Auto,
    /// eBPF programs in each pod's netns (no iptables rules).
    Ebpf,
    /// netfilter rules in each pod's netns, for older kernels.
    Iptables,
}

impl fmt::Display for RedirectMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RedirectMode::Auto => "auto",
            RedirectMode::Ebpf => "ebpf",
            RedirectMode::Iptables => "iptables",
        })
    }
}

/// What a redirector needs to know to enrol a pod.
#[derive(Clone, Debug)]
pub struct PodTarget {
    pub key: WorkloadKey,
    /// Path of the pod's network namespace (e.g. `/var/run/netns/NAME`).
    pub netns: PathBuf,
    /// The pod's own addresses (where the proxy delivers inbound
    /// connections).
    pub ips: Vec<std::net::IpAddr>,
    /// What to send to the proxy.
    pub capture: Capture,
}

/// Which of a pod's traffic goes to the proxy. With neither direction on, an
/// enrolled pod is only counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capture {
    /// TCP connects out of the pod go to the proxy's 15001.
    pub outbound: bool,
    /// New inbound plaintext TCP connections go to the proxy's 15006.
    pub inbound: bool,
    /// Destination ports that outbound connects keep.
    pub excluded_outbound_ports: Vec<u16>,
    /// Local ports that inbound connections reach directly.
    pub excluded_inbound_ports: Vec<u16>,
    /// IPv4 destinations that outbound connects keep (address, prefix length).
    pub excluded_outbound_cidrs: Vec<(std::net::Ipv4Addr, u8)>,
    /// The pod's own say on splicing ([`crate::state::Workload::splice`]);
    /// the eBPF redirector's splice mode decides with it. Nothing else
    /// splices.
    pub splice: Option<bool>,
    /// The pod's own say on the passthrough fast path
    /// ([`crate::state::Workload::fast_path`]); `--fast-path` decides with
    /// it (eBPF mode only).
    pub fast_path: Option<bool>,
    /// The pod's DNS (UDP and TCP to port 53) goes to the DNS proxy on
    /// 15053 in its netns: decided by the reconciler from `--dns-capture`
    /// and the pod's own say ([`crate::state::Workload::dns_capture`]).
    pub dns: bool,
}

impl Capture {
    /// Both directions, nothing excluded.
    pub fn all() -> Self {
        Self {
            outbound: true,
            inbound: true,
            ..Self::default()
        }
    }
}

/// A hook (program attachment or rule set) that a pod's enrolment put in place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Hook {
    /// e.g. `tc ingress`, `tc egress`.
    pub name: String,
    /// How it is attached, e.g. `netlink clsact filter on eth0, priority 49, handle 0:1`.
    pub attachment: String,
    /// Whether it was found in place the last time it was checked.
    pub present: bool,
}

/// A pod as a redirector sees it.
#[derive(Clone, Debug)]
pub struct EnrolledPod {
    pub key: WorkloadKey,
    pub netns: PathBuf,
    pub netns_cookie: u64,
    pub mode: RedirectMode,
    pub hooks: Vec<Hook>,
    pub counters: PodCounters,
}

/// The outcome of checking an enrolled pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verification {
    /// Every hook is in place.
    Redirected,
    /// Something is missing; the list says what.
    Missing(Vec<String>),
}

/// Errors from enrolling, verifying or unenrolling a pod.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error(transparent)]
    NetNs(#[from] crate::netns::NetNsError),
    #[error("pod {pod}: {what}: {}", crate::error::chain(source.as_ref()))]
    Kernel {
        pod: WorkloadKey,
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("pod {pod}: no interface {interface} in its network namespace {netns}")]
    NoInterface {
        pod: WorkloadKey,
        interface: &'static str,
        netns: PathBuf,
    },
    #[error("pod {0} is not enrolled")]
    NotEnrolled(WorkloadKey),
    #[error("cannot enrol pod {pod}: all {max} pod slots are in use")]
    Full { pod: WorkloadKey, max: u32 },
    #[error("pod {pod}: {problem}")]
    InvalidCapture { pod: WorkloadKey, problem: String },
    #[error("pod {pod}: network namespace {netns} is already enrolled as pod {other}")]
    NetNsTaken {
        pod: WorkloadKey,
        netns: PathBuf,
        other: WorkloadKey,
    },
}

/// Why a node-wide part could not be removed at uninstall.
#[derive(Debug, thiserror::Error)]
pub enum NodeCleanupError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {detail}")]
    Command { what: &'static str, detail: String },
}

/// Puts pods' traffic into the mesh and takes it out again.
///
/// Implementations own every kernel object they create; callers only hand
/// them pods. Enrolling an enrolled pod is a no-op (or a repair); unenrolling
/// leaves nothing behind.
pub trait Redirector: Send {
    /// The mode this redirector implements.
    fn mode(&self) -> RedirectMode;
    /// Attaches redirection for `pod`. Idempotent.
    fn enrol(&mut self, pod: &PodTarget) -> Result<(), RedirectError>;
    /// Readies the pod's netns for a proxy about to bind its listeners
    /// there (the builtin proxy, or ztunnel once handed the netns): what
    /// must hold before a proxy accepts any connection for the pod, which
    /// can happen before [`Redirector::enrol`] (a peer dials podIP:15008
    /// directly). Default: nothing.
    fn before_serving(
        &self,
        _pod: &WorkloadKey,
        _netns: &std::path::Path,
    ) -> Result<(), RedirectError> {
        Ok(())
    }
    /// Removes everything `enrol` attached for the pod.
    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError>;
    /// Checks that the pod's hooks are still in place.
    fn verify(&self, pod: &WorkloadKey) -> Result<Verification, RedirectError>;
    /// Every enrolled pod with its hooks and counters (enters every
    /// enrolled pod's netns: the reconciler's verify pass calls it, never
    /// an observer).
    fn list(&self) -> Vec<EnrolledPod>;
    /// One enrolled pod with its hooks and counters (enters its netns only).
    fn inspect(&self, pod: &WorkloadKey) -> Option<EnrolledPod> {
        self.list().into_iter().find(|p| &p.key == pod)
    }
    /// Whether `pod` is enrolled (cheap: no kernel round trip needed).
    fn is_enrolled(&self, pod: &WorkloadKey) -> bool {
        self.list().iter().any(|p| &p.key == pod)
    }
    /// Removes kernel state that a previous agent left for pods this agent
    /// was not handed (call once the pod source has listed every pod).
    /// Returns how many pods' leftovers were removed.
    fn remove_stale(&mut self) -> usize;
    /// Uninstall, after every pod was unenrolled: removes what the mode
    /// keeps for the whole node (eBPF: the socket programs on the cgroup
    /// root and every pin). Default: nothing node-wide.
    fn remove_node_state(&mut self) -> Result<(), NodeCleanupError> {
        Ok(())
    }
    /// A handle the proxy uses to recover where a redirected connection was
    /// going (what `SO_ORIGINAL_DST` answers in the iptables mode).
    fn original_dst_resolver(&self) -> std::sync::Arc<dyn OriginalDst>;

    // The kernel's authorization point (docs/authz.md). Only the eBPF mode
    // has one: the iptables mode keeps these defaults and the proxy alone
    // enforces.

    /// The enrolment slot the kernel knows `pod` by, in modes with slots.
    fn slot(&self, _pod: &WorkloadKey) -> Option<u32> {
        None
    }
    /// Makes `table` the kernel's compiled authorization verdicts; `None`:
    /// this mode has no kernel enforcement point.
    fn write_verdicts(
        &mut self,
        _table: &crate::authz::kernel::VerdictTable,
    ) -> Option<VerdictsWritten> {
        None
    }
    /// Flow 2 of the fast path (same node, mesh to mesh, in the kernel):
    /// `None` turns it off, `Some` writes its sources and destinations and
    /// turns it on. `None` returned: this mode has no fast path.
    fn write_mesh_local(&mut self, _table: Option<&MeshLocalTable>) -> Option<MeshLocalWritten> {
        None
    }
    /// Connects the kernel refused, per enrolled pod and deciding policy.
    fn policy_denials(
        &self,
    ) -> std::collections::BTreeMap<WorkloadKey, Vec<(crate::authz::PolicyKey, u64)>> {
        Default::default()
    }
    /// An fd that turns readable when the kernel has refused connects
    /// since [`Redirector::kernel_refusals`] last took them; `None`: this
    /// mode has no kernel authorization point.
    fn kernel_refusals_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// The connects the kernel refused since the last call, oldest first.
    fn kernel_refusals(&mut self) -> Vec<KernelRefusal> {
        Vec::new()
    }
}

/// One connect the kernel refused on an authorization policy's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelRefusal {
    /// The enrolled pod that connected.
    pub pod: WorkloadKey,
    pub dst: std::net::SocketAddr,
    /// The DENY policy the verdict was compiled from.
    pub policy: crate::authz::PolicyKey,
}

/// What [`Redirector::write_verdicts`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerdictsWritten {
    /// Entries in the kernel's table now.
    pub entries: usize,
    pub inserted: usize,
    pub deleted: usize,
    /// (source, destination) pairs the table could not hold (full): they
    /// were emptied, the proxy decides them.
    pub failed_pairs: usize,
    /// The first write error, when some failed.
    pub error: Option<String>,
}

/// Recovers the destination an application connected to, for a connection
/// the proxy accepted on its outbound listener (15001).
pub trait OriginalDst: Send + Sync {
    fn original_dst(
        &self,
        accepted: &std::net::TcpStream,
    ) -> Result<std::net::SocketAddr, OriginalDstError>;
}

/// Why the original destination of a connection is not known.
#[derive(Debug, thiserror::Error)]
pub enum OriginalDstError {
    #[error("connection from {peer} was not redirected (no original destination recorded)")]
    NotRedirected { peer: std::net::SocketAddr },
    #[error("reading the original destination: {0}")]
    Io(#[from] std::io::Error),
}
