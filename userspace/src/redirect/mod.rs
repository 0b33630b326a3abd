//! Redirection: putting a pod's traffic in the kernel's hands.
//!
//! A [`Redirector`] enrols a pod (attaches what it needs inside the pod's
//! network namespace), verifies it is still in place, reports counters, and
//! unenrols it leaving nothing behind. The eBPF mode lives in [`ebpf`]; the
//! iptables mode will implement the same trait.

pub mod ebpf;
pub mod probe;
pub mod tc_dump;

use std::{fmt, path::PathBuf};

use serde::Serialize;
use shunt_common::PodCounters;

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
    #[error("pod {pod}: {what}: {source}")]
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
    #[error("pod {pod}: network namespace {netns} is already enrolled as pod {other}")]
    NetNsTaken {
        pod: WorkloadKey,
        netns: PathBuf,
        other: WorkloadKey,
    },
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
    /// Removes everything `enrol` attached for the pod.
    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError>;
    /// Checks that the pod's hooks are still in place.
    fn verify(&self, pod: &WorkloadKey) -> Result<Verification, RedirectError>;
    /// Every enrolled pod with its hooks and counters.
    fn list(&self) -> Vec<EnrolledPod>;
}
