//! The command line: `shunt agent` and `shunt status`.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::redirect::RedirectMode;

#[derive(Parser, Debug)]
#[command(
    name = "shunt",
    version,
    about = "eBPF-accelerated node dataplane for a sidecarless service mesh",
    long_about = "shunt runs on every node (as a DaemonSet, or locally for a demo). It learns which \
pods on its node join the mesh (label istio.io/dataplane-mode=ambient on the pod or its namespace, \
or dataplaneMode: ambient in a local workloads file), attaches eBPF programs inside each such \
pod's network namespace, and leaves every other pod untouched."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the node agent: enrol this node's mesh pods and keep them enrolled
    /// until SIGINT/SIGTERM, which unenrols them cleanly.
    Agent(AgentArgs),
    /// Show the pods a running agent knows about: enrolment, hooks, counters.
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// This node's name: pods whose node is this name are enrolled here.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Read workloads from this YAML file instead of the Kubernetes API (the
    /// embedded default, no cluster needed). Edits to the file are picked up.
    /// Format: trustDomain and a list of workloads with name, namespace,
    /// serviceAccount, ips, node, netns and dataplaneMode.
    #[arg(long, value_name = "FILE")]
    pub workloads: Option<PathBuf>,

    /// How to redirect pod traffic: `ebpf` (programs in each pod's netns),
    /// `iptables` (rules in each pod's netns), or `auto` (eBPF when the
    /// kernel has every hook it needs).
    #[arg(long, value_enum, default_value_t = RedirectMode::Auto)]
    pub redirect: RedirectMode,

    /// Where this agent pins its eBPF programs and maps. Pinned state
    /// survives agent restarts. Give each agent on one kernel its own.
    #[arg(long, value_name = "PATH", default_value = "/sys/fs/bpf/shunt")]
    pub bpf_pin_dir: PathBuf,

    /// cgroup v2 directory where socket-level programs attach; pods'
    /// processes live below it. Default: the cgroup v2 mount root.
    #[arg(long, value_name = "PATH")]
    pub cgroup_root: Option<PathBuf>,

    /// Send enrolled pods' TCP traffic to the proxy's listeners (outbound to
    /// 127.0.0.1:15001, new inbound connections to 15006). A pod whose
    /// listener is missing then fails closed. `off` enrols and counts only.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub capture: OnOff,

    /// Health-probe source address (kubelet probes, as Istio's
    /// 169.254.7.127) whose inbound traffic always reaches the application.
    #[arg(long, value_name = "IP", default_value = "169.254.7.127")]
    pub probe_source: std::net::Ipv4Addr,

    /// Admin API address (status, debugging). Keep it on loopback.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:15000")]
    pub admin_addr: SocketAddr,

    /// How often to re-check the workloads file for edits, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 2)]
    pub reload_interval: u64,

    #[command(flatten)]
    pub log: LogArgs,
}

#[derive(Args, Debug)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `shunt=debug,shunt_ebpf=debug` (RUST_LOG
    /// overrides it). Kernel-side messages come from the `shunt_ebpf` target.
    #[arg(long, value_name = "FILTER", default_value = "info")]
    pub log_level: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl From<OnOff> for crate::redirect::Capture {
    fn from(value: OnOff) -> Self {
        match value {
            OnOff::On => Self::all(),
            OnOff::Off => Self::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print JSON (for scripts) instead of a table.
    #[arg(long)]
    pub json: bool,

    /// The agent's admin API address.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:15000")]
    pub admin_addr: SocketAddr,
}
