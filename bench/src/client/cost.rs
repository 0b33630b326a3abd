//! What a workload costs, read around its load window: CPU of the machine,
//! of the placed CPUs and of the path's cgroups, `ksoftirqd`, the agents'
//! context switches and memory, and the kernel's TCP memory at its peak.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use super::ClientArgs;
use crate::sys::{self, CpuTimes};

/// CPU over the load window.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Cost {
    /// Whole machine (`/proc/stat`), in clock ticks: includes whatever else
    /// runs on the machine.
    pub machine: CpuTimes,
    /// Only the CPUs the path was placed on, in clock ticks.
    pub placed: CpuTimes,
    /// CPU of the apps cgroup (the load generator and the servers), µs, from
    /// its `cpu.stat` (includes softirq work done in their context).
    pub apps_usec: u64,
    /// CPU of the agents' cgroup, µs.
    pub agents_usec: u64,
    /// CPU of the `ksoftirqd` threads (softirq work deferred off the
    /// processes), in clock ticks.
    pub ksoftirqd_ticks: u64,
    pub clock_ticks: u64,
    /// Context switches of the agents' threads (voluntary and not), a
    /// count that contention barely moves.
    #[serde(default)]
    pub agents_switches: u64,
}

impl Cost {
    /// CPU the path itself used, seconds: its processes (agents, client,
    /// server) plus deferred softirq work.
    pub fn path_seconds(&self) -> f64 {
        (self.apps_usec + self.agents_usec) as f64 / 1e6
            + self.ksoftirqd_ticks as f64 / self.clock_ticks.max(1) as f64
    }

    pub fn agent_seconds(&self) -> f64 {
        self.agents_usec as f64 / 1e6
    }
}

pub(super) struct Snapshot {
    machine: Option<CpuTimes>,
    placed: Option<CpuTimes>,
    apps_usec: Option<u64>,
    agents_usec: Option<u64>,
    ksoftirqd: u64,
    agents_switches: HashMap<(u32, u32), u64>,
}

pub(super) struct Watch {
    cpus: Vec<usize>,
    apps_cgroup: Option<PathBuf>,
    agents_cgroup: Option<PathBuf>,
    ksoftirqd: Vec<u32>,
}

impl Watch {
    pub(super) fn new(args: &ClientArgs) -> Watch {
        Watch {
            cpus: args
                .cpus
                .clone()
                .unwrap_or_else(|| (0..sys::cpu_count()).collect()),
            apps_cgroup: args.apps_cgroup.clone(),
            agents_cgroup: args.agents_cgroup.clone(),
            ksoftirqd: sys::ksoftirqd_pids(),
        }
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        Snapshot {
            machine: sys::parse_proc_stat(&stat),
            placed: sys::parse_proc_stat_cpus(&stat, &self.cpus),
            apps_usec: self.apps_cgroup.as_deref().and_then(sys::cgroup_usage_usec),
            agents_usec: self
                .agents_cgroup
                .as_deref()
                .and_then(sys::cgroup_usage_usec),
            ksoftirqd: self
                .ksoftirqd
                .iter()
                .filter_map(|&pid| sys::process_cpu_ticks(pid))
                .sum(),
            agents_switches: agents_context_switches(self.agents_cgroup.as_deref())
                .unwrap_or_default(),
        }
    }
}

impl Snapshot {
    pub(super) fn cost_since(&self, earlier: &Snapshot) -> Cost {
        let delta = |a: Option<CpuTimes>, b: Option<CpuTimes>| match (a, b) {
            (Some(now), Some(then)) => now.delta(&then),
            _ => CpuTimes::default(),
        };
        let usec = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(now), Some(then)) => now.saturating_sub(then),
            _ => 0,
        };
        Cost {
            machine: delta(self.machine, earlier.machine),
            placed: delta(self.placed, earlier.placed),
            apps_usec: usec(self.apps_usec, earlier.apps_usec),
            agents_usec: usec(self.agents_usec, earlier.agents_usec),
            ksoftirqd_ticks: self.ksoftirqd.saturating_sub(earlier.ksoftirqd),
            clock_ticks: sys::clock_ticks(),
            agents_switches: context_switches_between(
                &earlier.agents_switches,
                &self.agents_switches,
            ),
        }
    }
}

/// Samples kernel TCP memory on its own thread until dropped.
pub(super) struct TcpMemSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TcpMemSampler {
    pub(super) fn start() -> TcpMemSampler {
        let peak = Arc::new(AtomicU64::new(sys::tcp_mem_pages().unwrap_or(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                // Bounded: one hour of samples at most.
                for _ in 0..(3600 * 40) {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Some(pages) = sys::tcp_mem_pages() {
                        peak.fetch_max(pages, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(25));
                }
            })
        };
        TcpMemSampler {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    pub(super) fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

/// The summed VmRSS (KiB) of the processes in the agents' cgroup (0 for a
/// path without agents).
pub(super) fn agents_rss_kib(cgroup: Option<&std::path::Path>) -> anyhow::Result<u64> {
    let Some(cgroup) = cgroup else {
        return Ok(0);
    };
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .with_context(|| format!("reading {}/cgroup.procs", cgroup.display()))?;
    Ok(procs
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .filter_map(sys::process_memory_kib)
        .map(|(rss, _)| rss)
        .sum())
}

/// The agents' threads' context switches, by (pid, tid) (empty for a path
/// without agents).
pub(super) fn agents_context_switches(
    cgroup: Option<&std::path::Path>,
) -> anyhow::Result<HashMap<(u32, u32), u64>> {
    let Some(cgroup) = cgroup else {
        return Ok(Default::default());
    };
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .with_context(|| format!("reading {}/cgroup.procs", cgroup.display()))?;
    Ok(procs
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .flat_map(|pid| {
            sys::thread_context_switches(pid)
                .into_iter()
                .map(move |(tid, n)| ((pid, tid), n))
        })
        .collect())
}

/// Context switches between two counts: each thread's growth, a thread
/// started meanwhile counted whole (one that ended meanwhile is lost).
pub(super) fn context_switches_between(
    before: &HashMap<(u32, u32), u64>,
    after: &HashMap<(u32, u32), u64>,
) -> u64 {
    after
        .iter()
        .map(|(thread, n)| n.saturating_sub(before.get(thread).copied().unwrap_or(0)))
        .sum()
}
