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
    /// until SIGINT/SIGTERM (which unenrols them cleanly, or leaves them to
    /// the next agent with --on-exit keep).
    Agent(Box<AgentArgs>),
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
    /// serviceAccount, ips, node, netns and dataplaneMode; optionally a list
    /// of services with name, namespace, clusterIPs, ports (port, targetPort)
    /// and endpoints (pod names of the service's namespace, or IPs), so that a
    /// connection to clusterIP:port goes to one of the endpoints. Without it,
    /// pods and services come from the Kubernetes API (in-cluster service
    /// account, else KUBECONFIG or ~/.kube/config), pods' netns found through
    /// /proc.
    #[arg(long, value_name = "FILE")]
    pub workloads: Option<PathBuf>,

    /// The SPIFFE trust domain of the mesh's identities, when pods come from
    /// Kubernetes (a workloads file names its own `trustDomain`).
    #[arg(long, value_name = "DOMAIN", default_value = "cluster.local")]
    pub trust_domain: crate::state::TrustDomain,

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

    /// Send enrolled pods' TCP traffic through the proxy: outbound connects
    /// to its 127.0.0.1:15001, new inbound plaintext connections to its
    /// 15006, HBONE on podIP:15008 (all bound inside each pod's netns). A pod
    /// whose listener is missing fails closed. `off` runs no proxy and only
    /// enrols and counts.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub capture: OnOff,

    /// Which proxy the captured traffic goes to: `builtin` (this agent's own,
    /// the default) or `external` (another process binds the listeners in
    /// each pod's netns and reads original destinations from the pinned
    /// SHUNT_ORIG_DST map; shunt only redirects).
    #[arg(long, value_enum, default_value_t = ProxyKind::Builtin)]
    pub proxy: ProxyKind,

    /// What SIGINT/SIGTERM does to the pods: `unenrol` takes every pod out of
    /// the mesh cleanly (nothing left behind); `keep` leaves redirection in
    /// place for the next agent (a DaemonSet rolling update: no pod flaps,
    /// pods fail closed until the new agent's proxy listens).
    #[arg(long, value_enum, default_value_t = OnExit::Unenrol)]
    pub on_exit: OnExit,

    /// How often every enrolled pod is checked (programs or rules present,
    /// proxy listening) and repaired, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub verify_interval: u64,

    /// How long in-flight connections may finish after SIGTERM, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 5)]
    pub drain_seconds: u64,

    /// Health-probe source address (kubelet probes, as Istio's
    /// 169.254.7.127) whose inbound traffic always reaches the application.
    #[arg(long, value_name = "IP", default_value = "169.254.7.127")]
    pub probe_source: std::net::Ipv4Addr,

    /// Admin API address (status, debugging). Keep it on loopback.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:15000")]
    pub admin_addr: SocketAddr,

    /// Prometheus metrics address (`/metrics`, Istio's TCP metrics and
    /// shunt's own).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:15020")]
    pub metrics_addr: SocketAddr,

    /// Readiness probe address (`/healthz/ready`).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:15021")]
    pub readiness_addr: SocketAddr,

    /// How often to re-check the workloads file for edits, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 2)]
    pub reload_interval: u64,

    /// Where workload certificates come from: `builtin` (a CA inside the
    /// agent, its files in --ca-dir) or `istio` (istiod's CA over gRPC at
    /// --ca-address, as ztunnel uses it).
    #[arg(long, value_enum, default_value_t = crate::identity::CaKind::Builtin)]
    pub ca: crate::identity::CaKind,

    /// The built-in CA's directory, in Istio's plug-in CA layout
    /// (ca-cert.pem, ca-key.pem, root-cert.pem, cert-chain.pem): put an
    /// existing mesh's files there to join its trust root; when empty, a new
    /// root is generated and kept there. Only for --ca builtin.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/shunt/ca")]
    pub ca_dir: PathBuf,

    /// The Istio CA's gRPC address (https; a bare host:port means https).
    /// Its serving certificate is checked against --ca-root-cert for this
    /// host name. Only for --ca istio.
    #[arg(
        long,
        value_name = "URL",
        default_value = "https://istiod.istio-system.svc:15012"
    )]
    pub ca_address: String,

    /// PEM root certificate(s) of the mesh: the Istio CA's serving
    /// certificate must chain to them, and so must the workload certificates
    /// it issues (peers check against the same roots). Only for --ca istio.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/var/run/secrets/istio/root-cert.pem"
    )]
    pub ca_root_cert: PathBuf,

    /// File with the bearer token sent to the Istio CA (a service account
    /// token with the istio-ca audience), re-read for every request so
    /// rotated tokens are picked up. Only for --ca istio.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/var/run/secrets/tokens/istio-token"
    )]
    pub ca_token_file: PathBuf,

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
pub enum OnExit {
    Unenrol,
    Keep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProxyKind {
    Builtin,
    External,
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
