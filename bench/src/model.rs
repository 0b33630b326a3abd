//! What a benchmark run is made of, as the harness records it and the
//! report reads it: the paths, placements and workloads, one measurement
//! ([`Record`]) and a whole run ([`RunResults`], the raw JSON beside each
//! report). Types only: measuring is `measure`, rendering is `report`.

use serde::{Deserialize, Serialize};

use crate::{
    client::{ClientReport, WorkloadKind},
    sys::{CpuTimes, Machine},
};

/// Where every server pod's `shunt-bench server` echoes, and where it sinks
/// the stream.
pub const ECHO_PORT: u16 = 9000;
pub const SINK_PORT: u16 = 9001;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Direct,
    Iptables,
    /// eBPF redirection, splice off.
    Ebpf,
    /// eBPF redirection with the sk_msg splice (`--splice on`).
    EbpfSplice,
    /// eBPF redirection with the fast path (`--fast-path on`): passthrough
    /// destinations (flow 1) and the same-node mesh server, carried in the
    /// kernel (flow 2, `ebpf-fastpath/same/hbone`: no HBONE despite the
    /// id's `Dest`); cross-node mesh is the eBPF+proxy path.
    EbpfFastPath,
    /// A stock Istio ztunnel per mesh pod (dedicated mode, iptables
    /// capture in the pod): the reference dataplane, run only when the
    /// harness is given its binary (`--ztunnel`).
    Ztunnel,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Iptables => "iptables",
            Mode::Ebpf => "ebpf",
            Mode::EbpfSplice => "ebpf-splice",
            Mode::EbpfFastPath => "ebpf-fastpath",
            Mode::Ztunnel => "ztunnel",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Locality {
    Same,
    Cross,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dest {
    /// Destination outside the mesh: plain TCP passthrough.
    Plain,
    /// Destination in the mesh: HBONE between the proxies.
    Hbone,
}

/// One way from the client to a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PathSpec {
    pub mode: Mode,
    pub locality: Locality,
    pub dest: Dest,
}

impl PathSpec {
    /// Every path, in report order.
    pub fn all() -> Vec<PathSpec> {
        let mut paths = Vec::new();
        for locality in [Locality::Same, Locality::Cross] {
            paths.push(PathSpec {
                mode: Mode::Direct,
                locality,
                dest: Dest::Plain,
            });
        }
        for mode in [Mode::Iptables, Mode::Ebpf, Mode::EbpfSplice] {
            for locality in [Locality::Same, Locality::Cross] {
                for dest in [Dest::Plain, Dest::Hbone] {
                    paths.push(PathSpec {
                        mode,
                        locality,
                        dest,
                    });
                }
            }
        }
        for locality in [Locality::Same, Locality::Cross] {
            paths.push(PathSpec {
                mode: Mode::EbpfFastPath,
                locality,
                dest: Dest::Plain,
            });
        }
        // Same node, mesh to mesh, carried in the kernel (flow 2).
        paths.push(PathSpec {
            mode: Mode::EbpfFastPath,
            locality: Locality::Same,
            dest: Dest::Hbone,
        });
        paths
    }

    /// The ztunnel paths (`--ztunnel`): the same four client-to-server
    /// ways as a proxy mode's.
    pub fn ztunnel() -> Vec<PathSpec> {
        let mut paths = Vec::new();
        for locality in [Locality::Same, Locality::Cross] {
            for dest in [Dest::Plain, Dest::Hbone] {
                paths.push(PathSpec {
                    mode: Mode::Ztunnel,
                    locality,
                    dest,
                });
            }
        }
        paths
    }

    /// e.g. `ebpf/cross/hbone`, `direct/same`.
    pub fn id(&self) -> String {
        let locality = match self.locality {
            Locality::Same => "same",
            Locality::Cross => "cross",
        };
        match self.mode {
            Mode::Direct => format!("direct/{locality}"),
            mode => {
                let dest = match self.dest {
                    Dest::Plain => "plain",
                    Dest::Hbone => "hbone",
                };
                format!("{}/{locality}/{dest}", mode.name())
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Every process of the path (client, server, agents) on one CPU.
    Pinned,
    /// Left to the scheduler, on every CPU.
    Scheduler,
}

impl Placement {
    pub fn name(self) -> &'static str {
        match self {
            Placement::Pinned => "pinned",
            Placement::Scheduler => "scheduler",
        }
    }
}

/// One workload as run on every path.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Workload {
    pub id: String,
    pub title: String,
    pub kind: WorkloadKind,
    pub size: usize,
    pub conns: usize,
    pub rate: f64,
    pub seconds: f64,
    pub warmup: f64,
}

pub fn workloads(quick: bool) -> Vec<Workload> {
    let (short, long, warm) = if quick {
        (0.25, 0.4, 0.05)
    } else {
        (2.0, 3.0, 0.3)
    };
    let w = |id: &str, title: &str, kind, size, conns, rate, seconds| Workload {
        id: id.into(),
        title: title.into(),
        kind,
        size,
        conns,
        rate,
        seconds,
        warmup: warm,
    };
    vec![
        w(
            "rr1",
            "request/response 1 B, 1 connection",
            WorkloadKind::Rr,
            1,
            1,
            0.0,
            short,
        ),
        w(
            "rr1k",
            "request/response 1 KiB, 1 connection",
            WorkloadKind::Rr,
            1024,
            1,
            0.0,
            short,
        ),
        w(
            "crr",
            "new connection per 1 B request",
            WorkloadKind::Crr,
            1,
            1,
            0.0,
            short,
        ),
        w(
            "stream",
            "bulk stream, 64 KiB writes",
            WorkloadKind::Stream,
            64 * 1024,
            1,
            0.0,
            short,
        ),
        w(
            "rate",
            "fixed 1000 req/s over 16 connections, 1 KiB",
            WorkloadKind::Rate,
            1024,
            16,
            1000.0,
            long,
        ),
        w(
            "idle10k",
            "10,000 idle connections (one 1 B exchange each, then held)",
            WorkloadKind::Idle,
            1,
            if quick { 200 } else { 10_000 },
            0.0,
            // Held 5 s: memory read at the end, the agents' wake-ups counted
            // over the last 4 (client.rs, `idle`).
            if quick { 0.1 } else { 5.0 },
        ),
    ]
}

/// The agents' proxy counters around one measurement.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProxyCheck {
    /// Connections (passthrough) or streams (HBONE) the client-side proxy
    /// completed.
    pub client_side: u64,
    /// HBONE streams the destination's proxy completed (0 for passthrough).
    pub server_side: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub refused: u64,
    pub failed: u64,
    /// Payload bytes spliced between the client and its proxy (kernel
    /// counter of the client pod).
    #[serde(default)]
    pub spliced_bytes: u64,
}

/// One measurement: one workload over one path in one placement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub path: PathSpec,
    pub path_id: String,
    pub workload: String,
    pub placement: Placement,
    pub rep: usize,
    pub report: ClientReport,
    pub proxy: Option<ProxyCheck>,
    /// VmRSS of each agent of the path's topology after the run, KiB.
    pub agent_rss_kib: Vec<u64>,
    pub agent_hwm_kib: Vec<u64>,
    pub load_average: String,
    /// Everything checked out: the load generator's bytes and content, and
    /// the proxy saw every connection and byte (mesh paths).
    pub verified: bool,
    pub problems: Vec<String>,
    /// With `--policies`: how many AuthorizationPolicies guarded the
    /// destination during this measurement (`None`: the run did not vary
    /// them, and the agents had none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policies: Option<usize>,
}

/// Everything one run produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResults {
    pub name: String,
    pub quick: bool,
    pub started_unix: u64,
    pub duration_s: f64,
    pub machine: Machine,
    pub shunt_binary: String,
    pub reps: usize,
    pub pin_cpu: usize,
    pub placements: Vec<Placement>,
    pub workloads: Vec<Workload>,
    pub paths: Vec<PathSpec>,
    pub load_average_start: String,
    pub load_average_end: String,
    /// Whole-machine CPU over the whole run (ticks), for steal and load.
    pub machine_cpu: CpuTimes,
    pub records: Vec<Record>,
    /// What the operator noted about the run (`shunt-bench render --note`).
    #[serde(default)]
    pub notes: Vec<String>,
    /// `--policies`: the numbers of AuthorizationPolicies on the
    /// destination each repetition was measured with (empty: not varied).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<usize>,
}
