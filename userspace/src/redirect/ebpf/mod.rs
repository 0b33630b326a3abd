//! The eBPF redirection mode.
//!
//! One [`EbpfRedirector`] per agent owns the pinned maps, the socket programs
//! on its cgroup root, and the per-pod TC attachments. Enrolling a pod:
//!
//! 1. reads the pod netns's cookie and gives the pod a slot; with source
//!    preservation on (`--preserve-source`) it turns `tcp_fwmark_accept` on
//!    there in the same step, so that the application's end of every
//!    connection from the proxy is marked and TC egress need not look up
//!    unmarked packets (pod flag `REPLY_BY_MARK`, `reply.rs` says when it is
//!    safe);
//! 2. writes the pod's capture settings to `SHUNT_POD_CONFIG[slot]`, zeroes
//!    its counters, and records `cookie → slot` in `SHUNT_ENROLLED` — from
//!    then on `connect4/6` capture the pod's outbound connects;
//! 3. loads the pod's own instance of the TC programs with the slot baked in
//!    (`ebpf/src/tc_pod.rs` says why) and attaches them to its `eth0`;
//! 4. with source preservation on (`--preserve-source`), installs the reply
//!    path (`reply.rs`): the policy route for mark 0x111 ([`route`], shared
//!    with the iptables mode) and `accept_local` on `lo`; the TC egress
//!    program turns the application's replies to the proxy's transparent
//!    sockets back in through `lo` with that mark;
//! 5. records the pod's name and netns path in `SHUNT_POD_RECORDS`, so a
//!    later agent can clean up after a pod it never heard of.
//!
//! With the builtin proxy, the reconciler also hands it the authorization
//! verdicts compiled for connects between enrolled pods of this node
//! ([`policy`], checked by `ebpf/src/policy.rs`).
//!
//! Everything the datapath needs is the kernel's: TC filters belong to the
//! qdisc, socket programs to pinned links, state to pinned maps. An agent
//! that dies leaves redirection working; the next one adopts it.

mod cgroup;
mod enrol;
mod fastpath;
mod host_probe;
mod load;
mod mesh_local;
mod original_dst;
mod pin_report;
mod pins;
mod policy;
mod reply;
mod settings;
mod slots;
mod splice;
mod sys;
mod tc;
mod uninstall;
mod upgrade;

use std::{
    collections::{BTreeMap, HashSet},
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuValues},
    util::nr_cpus,
};
pub use cgroup::cgroup2_mount;
pub use fastpath::{
    DestinationTable, FastPathCounters, FastPathEvents, ProxyDestinations, SyncReport, TableError,
    key_of as fast_path_key,
};
pub use load::{EbpfOptions, LoadError};
pub use original_dst::EbpfOriginalDst;
pub use pin_report::{LinkReport, MapReport, PinReport, Unreadable, pin_report};
use shunt_common::{
    DEFAULT_SPLICE_BACKLOG, GlobalConfig, MAX_PODS, PodAddrs, PodConfig, PodCounters, PodRecord,
    PodSlot, globals, maps,
};
pub use splice::SpliceMode;
pub use tc::{TC_HANDLE, TC_PRIORITY};
use tracing::{info, warn};
pub use upgrade::{ProgramChange, UpgradeReport};

use super::{
    EnrolledPod, Hook, OriginalDst, PodTarget, RedirectError, RedirectMode, Redirector,
    Verification, route,
};
use crate::{netns::NetNs, state::WorkloadKey};

/// The compiled programs, built by `build.rs`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/shunt-ebpf"));

/// A pod this redirector enrolled. The open netns keeps the namespace (and
/// so its attachments) reachable for unenrolment.
struct Enrolment {
    netns: NetNs,
    cookie: u64,
    slot: u32,
    config: PodConfig,
    addrs: PodAddrs,
}

/// The eBPF redirector. See the module docs.
pub struct EbpfRedirector {
    /// The agent's instance of the object: holds the socket programs and the
    /// aya-log ring buffer.
    ebpf: Ebpf,
    enrolled_map: BpfHashMap<MapData, u64, PodSlot>,
    counters_map: PerCpuArray<MapData, PodCounters>,
    config_map: Array<MapData, PodConfig>,
    addrs_map: Array<MapData, PodAddrs>,
    records_map: BpfHashMap<MapData, u64, PodRecord>,
    /// The slots `enrolled_map`'s entries name, kept beside it.
    slots: slots::SlotTable,
    /// The kernel's authorization table and its denial counters.
    policy: policy::PolicyMaps,
    /// Flow 2 of the fast path: its sources, destinations and switch.
    mesh_local: mesh_local::MeshLocalMaps,
    pods: BTreeMap<WorkloadKey, Enrolment>,
    pin_dir: PathBuf,
    cgroup_root: PathBuf,
    original_dst: Arc<EbpfOriginalDst>,
    /// Which pods' new app ⇄ proxy connections are spliced.
    splice: SpliceMode,
    /// Whether pods get the reply path of source preservation.
    preserve_source: bool,
    /// Whether `tcp_fwmark_accept` was on in a netns when
    /// [`Redirector::before_serving`] first looked, until its enrolment
    /// takes the answer (`reply.rs`). The entry of a pod that is never
    /// enrolled stays: a few bytes, and should its namespace id be reused
    /// it can only make an adoption more careful (flag off), never less.
    fwmark_before_serving: std::sync::Mutex<std::collections::HashMap<crate::netns::NsId, bool>>,
    /// `--fast-path`: whether pods (but those that opt out) get
    /// [`PodConfig::FAST_PATH`].
    fast_path: bool,
    /// Kubelet's probes: the node netns and the enrolled pods' addresses.
    host_probes: host_probe::HostProbeMaps,
}

pub(crate) fn kernel(
    pod: &WorkloadKey,
    what: &'static str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> RedirectError {
    RedirectError::Kernel {
        pod: pod.clone(),
        what,
        source: Box::new(source),
    }
}

fn missing(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("program {name} is not in the object"),
    )
}
