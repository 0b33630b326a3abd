//! The command line: `shunt agent` and `shunt status`.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::redirect::{RedirectMode, ebpf::SpliceMode};

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
    /// the container runtime (--cri-socket) or, failing that, /proc.
    #[arg(long, value_name = "FILE")]
    pub workloads: Option<PathBuf>,

    /// The SPIFFE trust domain of the mesh's identities, when pods come from
    /// Kubernetes (a workloads file names its own `trustDomain`). With
    /// --xds-address, the trust domain istiod gives each workload wins, as
    /// in ztunnel; this is the fallback where istiod names none.
    #[arg(long, value_name = "DOMAIN", default_value = "cluster.local")]
    pub trust_domain: crate::state::TrustDomain,

    /// Without istiod: give every workload a waypoint serves an ALLOW policy
    /// for the waypoint's identity, as istiod does with
    /// PILOT_AUTO_ALLOW_WAYPOINT_POLICY=true (off by default there too).
    /// With istiod, istiod decides and sends the policy.
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::Off)]
    pub auto_allow_waypoint_policy: OnOff,

    /// Namespaces whose pods are never enrolled, whatever their labels
    /// (istio-cni's `excludeNamespaces`; its default keeps kube-system out),
    /// comma-separated; empty: none. Pods from Kubernetes only.
    #[arg(
        long,
        value_name = "NS,...",
        value_delimiter = ',',
        default_value = crate::control::kube::enablement::DEFAULT_EXCLUDED_NAMESPACES
    )]
    pub exclude_namespaces: Vec<String>,

    /// Which pods join the mesh, as istio-cni's
    /// `ambient.enablementSelectors`: a YAML or JSON list of
    /// `{podSelector, namespaceSelector}` label selectors, any of which
    /// enrols a pod (podSelector on the pod's labels, namespaceSelector on
    /// its namespace's; an empty one matches all). The default is Istio's:
    /// the pod labelled `istio.io/dataplane-mode=ambient`, or its namespace
    /// labelled so and the pod not `none`. Pods from Kubernetes only.
    #[arg(
        long,
        value_name = "YAML",
        default_value = crate::control::kube::enablement::ISTIO_DEFAULT_SELECTORS
    )]
    pub enablement_selectors: String,

    /// The container runtime's CRI socket, asked for each pod's network
    /// namespace (the sandbox's pinned netns path) when pods come from
    /// Kubernetes. Default: the first that exists of
    /// /run/containerd/containerd.sock and /var/run/crio/crio.sock. `none`
    /// asks no runtime. Pods the runtime cannot place (unreachable, no
    /// answer within 2 s, a runtime other than containerd or CRI-O) are
    /// found by scanning /proc/*/cgroup for the pod's UID (needs hostPID).
    #[arg(long, value_name = "PATH|none")]
    pub cri_socket: Option<CriSocket>,

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
    /// processes live below it, and so must the agent itself for its end of
    /// app ⇄ proxy connections to be spliced. Default: the cgroup v2 mount
    /// root.
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
    /// the default), `external` (another process binds the listeners in
    /// each pod's netns and reads original destinations from the pinned
    /// SHUNT_ORIG_DST map; shunt only redirects), or `ztunnel` (a stock
    /// Istio ztunnel: shunt serves it ZDS on --zds-socket, as istio-cni
    /// does, handing it each mesh pod's netns, and redirects a pod only
    /// once ztunnel acknowledged it; until then the pod is pending).
    #[arg(long, value_enum, default_value_t = ProxyKind::Builtin)]
    pub proxy: ProxyKind,

    /// With --proxy ztunnel: the unix socket (SOCK_SEQPACKET) shunt listens
    /// on for ztunnel's ZDS connection (ztunnel's INPOD_UDS). Share its
    /// directory with the ztunnel pod.
    #[arg(long, value_name = "PATH", default_value = crate::inpod::DEFAULT_SOCKET)]
    pub zds_socket: PathBuf,

    /// eBPF mode: move payload between each application and the proxy
    /// inside its pod with sk_msg, skipping the TCP stack, both ways and
    /// on both legs (the app's connect to 15001, the proxy's delivery of an
    /// inbound connection) (needs
    /// sk_msg and the sock_recv_length tracepoint, Linux 6.3+). Bounded: a
    /// direction whose reader falls more than --splice-backlog bytes behind
    /// returns to the TCP stack for the rest of the connection. `on`: every
    /// pod but those annotated `shunt.io/splice: "off"`; `opt-in`: only pods
    /// annotated `shunt.io/splice: "on"` (`splice: true|false` in a
    /// workloads file). Off by default: an application that blocks in
    /// read() on a spliced socket can get EAGAIN when woken without data
    /// (the kernel's sockmap read path, e.g. after shutdown(SHUT_WR) from
    /// another thread); event-loop applications (non-blocking sockets: Go,
    /// tokio, Netty, nginx, Envoy) are unaffected. Keep pods with blocking
    /// readers, clients or servers, off the splice.
    #[arg(long, value_name = "on|opt-in|off", default_value_t = SpliceMode::Off)]
    pub splice: SpliceMode,

    /// With --splice: the most bytes one direction of a connection may have
    /// spliced but not yet read before it falls back to the TCP stack.
    #[arg(long, value_name = "BYTES", default_value_t = shunt_common::DEFAULT_SPLICE_BACKLOG)]
    pub splice_backlog: u32,

    // --- The passthrough fast path (issue 18; `fastpath/`, ebpf/src/passthrough.rs) ---
    /// eBPF mode with the builtin proxy: an enrolled pod's connect to a
    /// destination that is neither a mesh workload nor a service VIP goes
    /// direct instead of through the proxy (decided at connect() from a
    /// table of every destination the proxy must see, which the agent keeps
    /// from the cluster view; while the table is not known complete, every
    /// connect goes to the proxy). Such connections are still counted in
    /// Istio's TCP metrics and logged, from kernel events. The proxy adds
    /// nothing to them (no mTLS: the destination is outside the mesh), so
    /// the default is `on`. `off` keeps every flow on the proxy path, as
    /// does the annotation `shunt.io/fast-path: "off"` on a pod or its
    /// namespace (`fastPath: false` in a workloads file).
    ///
    /// Same-node mesh traffic (issue 18 flow 2; ebpf/src/mesh_local.rs): a
    /// connect from one enrolled mesh pod to another pod of this node (its
    /// IP, no waypoint) that the authorization policies allow — as the
    /// kernel's compiled verdicts say, which must be complete
    /// (--kernel-authz on) — also skips the proxy: it goes pod to pod in
    /// the kernel WITHOUT mTLS (it never leaves the node), still reported
    /// with both identities (connection_security_policy="none"). Users who
    /// want mTLS between pods of one node set `--fast-path off` or annotate
    /// either pod `shunt.io/fast-path: "off"`. Denied connects fail at
    /// connect() with EPERM. A Service VIP whose every ready endpoint is
    /// such a pod (no waypoint) is carried the same way, to one endpoint
    /// chosen at connect() (getpeername() still answers the VIP); IPv4 and
    /// IPv6. Mesh traffic to another node always takes the proxy and HBONE
    /// (mTLS). The iptables mode has no fast path.
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    pub fast_path: OnOff,

    /// With --fast-path on: the most destinations (mesh workload IPs plus
    /// service VIPs) the fast-path table holds; a cluster view with more
    /// turns the fast path off (logged, counted in
    /// shunt_fast_path_table_invalidations_total): every flow goes back
    /// through the proxy until a view fits.
    #[arg(long, value_name = "N", default_value_t = shunt_common::MAX_FAST_PATH_DESTINATIONS,
        value_parser = clap::value_parser!(u32).range(0..=i64::from(shunt_common::MAX_FAST_PATH_DESTINATIONS)))]
    pub fast_path_max_destinations: u32,

    // --- DNS capture (issue 22; ebpf/src/dns.rs, proxy/dns_sockets.rs) ---
    /// An enrolled pod's DNS (UDP and TCP to port 53, not to a loopback
    /// resolver) goes to the DNS proxy inside its netns on 127.0.0.1:15053
    /// and [::1]:15053, which answers the names the mesh knows and forwards
    /// the rest; the application sees the answer come from the server it
    /// asked. With the builtin proxy shunt serves it; with `--proxy
    /// ztunnel`, ztunnel's DNS proxy does. The pod annotation
    /// `ambient.istio.io/dns-capture: "false"` (or `"true"`) wins over this
    /// default, as in istio-cni (`dnsCapture:` in a workloads file). Off:
    /// port 53 reaches the pod's resolvers untouched.
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    pub dns_capture: OnOff,

    // --- The DNS proxy's server (dns/): where it forwards, how long it
    // waits, which domain the short names expand into. Capture is
    // --dns-capture's.
    /// The resolv.conf whose `nameserver`s get the DNS queries the mesh
    /// does not answer (the agent's own: in a cluster, the cluster DNS, as
    /// ztunnel forwards).
    #[arg(long, value_name = "FILE", default_value = "/etc/resolv.conf")]
    pub dns_resolv_conf: PathBuf,

    /// How long the upstream resolvers have to answer a forwarded DNS query
    /// before the pod gets SERVFAIL (`5s`, `500ms`; a bare number is
    /// seconds).
    #[arg(long, value_name = "DURATION", default_value = "5s",
        value_parser = crate::dns::parse_timeout)]
    pub dns_upstream_timeout: std::time::Duration,

    /// The cluster's DNS domain: `web` asked in namespace `ns` means
    /// `web.ns.svc.<domain>`.
    #[arg(
        long,
        env = "CLUSTER_DOMAIN",
        value_name = "DOMAIN",
        default_value = crate::control::waypoint::DEFAULT_CLUSTER_DOMAIN
    )]
    pub cluster_domain: String,
    // --- end of the DNS server's flags.
    /// What SIGINT/SIGTERM does to the pods: `unenrol` takes every pod out of
    /// the mesh cleanly; `keep` leaves redirection in place for the next
    /// agent (a DaemonSet rolling update: no pod flaps, pods fail closed
    /// until the new agent's proxy listens); `uninstall` unenrols every pod
    /// and removes the node's programs, pins and rules; `auto` (the
    /// manifests') asks the API server at exit, as istio-cni does: `keep`
    /// while the agent's DaemonSet (--daemonset-name,
    /// --daemonset-namespace) is present and still selects this node,
    /// `uninstall` when it is gone, being deleted or no longer selects the
    /// node.
    #[arg(long, value_enum, default_value_t = OnExit::Unenrol)]
    pub on_exit: OnExit,

    /// Serve the CNI plugin (`shunt-cni`) on this unix socket: a sandbox's
    /// ADD waits until the agent captured the pod (or found it outside the
    /// mesh), so a mesh pod's first packet is captured. Needs the
    /// Kubernetes source (no `--workloads`). Off when unset.
    #[arg(long, env = "SHUNT_CNI_SOCKET", value_name = "PATH")]
    pub cni_socket: Option<PathBuf>,

    /// How long an ADD waits for the pod's capture (with `--proxy ztunnel`,
    /// for ztunnel's acknowledgement) before it fails, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub cni_timeout: u64,

    /// Add shunt-cni to the primary CNI configuration list in this
    /// directory (the node's /etc/cni/net.d, mounted) once the agent serves
    /// `--cni-socket`; removed again when the agent's exit
    /// takes the pods out of the mesh (`--on-exit unenrol|uninstall`, or
    /// `auto` deciding an uninstall).
    #[arg(
        long,
        env = "SHUNT_CNI_CONF_DIR",
        value_name = "DIR",
        requires = "cni_socket"
    )]
    pub cni_conf_dir: Option<PathBuf>,

    /// Copy the plugin binary into this directory (the node's /opt/cni/bin,
    /// mounted) before adding its entry.
    #[arg(
        long,
        env = "SHUNT_CNI_BIN_DIR",
        value_name = "DIR",
        requires = "cni_conf_dir"
    )]
    pub cni_bin_dir: Option<PathBuf>,

    /// The plugin binary `--cni-bin-dir` gets (default: `shunt-cni` beside
    /// this agent's own executable).
    #[arg(long, value_name = "FILE")]
    pub cni_plugin: Option<PathBuf>,

    /// The agent's own pods (this namespace, names with
    /// `--cni-agent-pod-prefix`) pass the plugin while no agent answers.
    /// Default: the namespace of the agent's service account.
    #[arg(long, env = "POD_NAMESPACE", value_name = "NS")]
    pub cni_agent_namespace: Option<String>,

    #[arg(long, value_name = "PREFIX", default_value = "shunt-")]
    pub cni_agent_pod_prefix: String,

    /// The DaemonSet this agent runs in: `--on-exit auto` reads it at exit.
    #[arg(long, env = "DAEMONSET_NAME", value_name = "NAME")]
    pub daemonset_name: Option<String>,

    /// The DaemonSet's namespace (the Downward API's `metadata.namespace`);
    /// default: --pod-namespace.
    #[arg(long, env = "DAEMONSET_NAMESPACE", value_name = "NAMESPACE")]
    pub daemonset_namespace: Option<String>,

    /// How often every enrolled pod is checked (programs or rules present,
    /// proxy listening) and repaired, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub verify_interval: u64,

    /// After SIGTERM the agent stops accepting at once (a new agent started
    /// beside it with the same --bpf-pin-dir takes the new connections: its
    /// listeners share the ports through SO_REUSEPORT) and gives connections
    /// in flight this many seconds to finish before cutting them.
    #[arg(long, value_name = "SECONDS", default_value_t = 5)]
    pub drain_seconds: u64,

    /// What happens to plaintext connections from outside the mesh to an
    /// enrolled pod (captured on 15006): `allow` delivers them to the
    /// application, `deny` resets them. Either way each is counted and
    /// logged. Mesh (HBONE) traffic is not affected.
    #[arg(long, value_enum, value_name = "POLICY", default_value_t = crate::proxy::InboundPlaintextPolicy::Allow)]
    pub inbound_plaintext: crate::proxy::InboundPlaintextPolicy,

    /// Whether inbound connections (HBONE and plaintext) reach the
    /// application from the client's own address, as with ztunnel: the
    /// proxy connects with IP_TRANSPARENT bound to the client's IP, and the
    /// pod gets a reply path that brings the application's answers back to
    /// the proxy (iptables mode: CONNMARK 0x111 and a policy route; eBPF
    /// mode: the policy route and the TC egress program on eth0). `off`:
    /// the application sees its own pod's address as the peer. Where the
    /// client's address cannot be bound, the pod's own is used (logged once
    /// per pod).
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    pub preserve_source: OnOff,

    // Kernel authorization (issue 15, docs/authz.md).
    /// The kernel's authorization point (eBPF mode, builtin proxy): the
    /// authorization policies' verdicts for connects between enrolled pods
    /// of this node, compiled into a pinned map that connect4/6 check, so a
    /// denied connect fails at once with EPERM (counted per pod and policy
    /// in `shunt_pod_policy_denials_total`). The proxy enforces either way:
    /// `off` leaves every decision to it (a 401 or a reset instead of
    /// EPERM, with its access log line).
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    pub kernel_authz: OnOff,

    // Limits a hostile peer cannot exhaust (proxy/limits.rs).
    /// Inbound connections (15008 and 15006 together, every pod of the
    /// node together) open at once from one source IP. The next one is
    /// reset at accept, counted (`shunt_proxy_refusals_total{reason=
    /// "source_limit"}`) and logged (rate-limited). 0: no limit.
    #[arg(long, value_name = "N", default_value_t = crate::proxy::DEFAULT_MAX_CONNECTIONS_PER_SOURCE)]
    pub max_connections_per_source: u32,

    /// File descriptors kept free for the listeners' own work. With fewer
    /// free, a new inbound connection sheds the oldest HBONE connection
    /// still in its handshake, or is reset when there is none. 0: a
    /// sixteenth of the open-files limit, between 64 and 4096. (The agent
    /// raises its soft open-files limit to the hard one at start.)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub fd_reserve: u64,

    /// An inbound HBONE connection must finish its TLS and HTTP/2
    /// handshakes and send its first CONNECT within this many seconds of
    /// being accepted, else it is closed (idle and half-open handshakes are
    /// shed); outbound handshakes have the same bound.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub handshake_timeout: u64,

    /// Certificate revocation lists (PEM, or one DER list), as ztunnel's
    /// `CRL_PATH` (Istio's `istio-ca-crl`): a peer whose chain a list
    /// revokes fails the handshake, both ways, and open HBONE connections
    /// to or from it are closed when a list names it. Read at start (a
    /// missing or unusable file revokes nothing until a good one appears,
    /// logged) and again when it changes (a bad one keeps the last good
    /// lists). Unset: no revocation check.
    #[arg(long, env = "CRL_PATH", value_name = "FILE")]
    pub crl_path: Option<PathBuf>,

    /// Health-probe source address (kubelet probes, as Istio's
    /// 169.254.7.127) whose inbound traffic always reaches the application.
    #[arg(long, value_name = "IP", default_value = "169.254.7.127")]
    pub probe_source: std::net::Ipv4Addr,

    /// The node's network namespace, where kubelet runs and its probes
    /// start (the DaemonSet: `/proc/1/ns/net`, with hostPID): TCP that a
    /// socket of that namespace opens to an enrolled pod's IPv4 address
    /// gets --probe-source as its source, as istio-cni's node rule does,
    /// so probes reach the application whatever the pod's policy (iptables
    /// mode: a SNAT rule per enrolled pod in the node's nat table; eBPF
    /// mode: the node's sockets recorded by sockops, the source rewritten by
    /// the pod's TC programs). Unset: probes are not rewritten and meet the
    /// pod's policy like any plaintext client.
    #[arg(long, value_name = "PATH")]
    pub node_netns: Option<PathBuf>,

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
    /// it issues (peers check against the same roots). Looked at every 5 s:
    /// a changed file (a root rotation) applies to the next call to the CA
    /// and to new handshakes; a bad one keeps the roots in force. Only for
    /// --ca istio.
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

    /// istiod's xDS address (`host:port`, istiod serves it on 15012): take
    /// the cluster-wide view (every workload, service and authorization
    /// policy) from istiod over delta xDS, as ztunnel does, instead of
    /// watching Services and pods of other nodes (or the file's other
    /// entries). This node's pods (enrolment, netns) still come from the pod
    /// watch or --workloads. The agent is not ready until istiod has sent
    /// both workloads and policies once.
    #[arg(long, env = "XDS_ADDRESS", value_name = "HOST:PORT")]
    pub xds_address: Option<String>,

    /// PEM root certificate(s) istiod's serving certificate must chain to
    /// (the mesh root; the istio-ca-root-cert ConfigMap), read again for
    /// every (re)connect. Only with --xds-address.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/var/run/secrets/istio/root-cert.pem"
    )]
    pub xds_root_cert: PathBuf,

    /// File with the bearer token sent to istiod (a service account token
    /// with the istio-ca audience), re-read on every (re)connect so rotated
    /// tokens are picked up. Only with --xds-address.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/var/run/secrets/tokens/istio-token"
    )]
    pub xds_token: PathBuf,

    /// Istio's cluster id of this cluster (istiod's CLUSTER_ID), sent in the
    /// xDS node metadata.
    #[arg(
        long,
        env = "CLUSTER_ID",
        value_name = "ID",
        default_value = "Kubernetes"
    )]
    pub cluster_id: String,

    /// This node's Istio network (ztunnel's NETWORK; the cluster's
    /// `topology.istio.io/network`). Empty: the default network. Where
    /// workloads of two networks claim one address, the one on this
    /// network is the one the address names.
    #[arg(long, env = "NETWORK", value_name = "NAME", default_value = "")]
    pub network: String,

    /// This agent's pod name, namespace and IP (from the downward API), from
    /// which the xDS node id `ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local`
    /// is made. The IP is required with --xds-address.
    #[arg(long, env = "POD_NAME", value_name = "NAME", default_value = "shunt")]
    pub pod_name: String,

    #[arg(
        long,
        env = "POD_NAMESPACE",
        value_name = "NAMESPACE",
        default_value = "istio-system"
    )]
    pub pod_namespace: String,

    #[arg(long, env = "INSTANCE_IP", value_name = "IP")]
    pub instance_ip: Option<std::net::IpAddr>,

    // Proxy efficiency (issue 19, docs/BENCHMARKS.md "Proxy efficiency").
    /// Worker threads of the data path (its shards), where the proxy's
    /// listeners and connections run, each pod on one (the control plane
    /// has two threads of its own). 0: one per CPU the agent may run on.
    #[arg(
        long,
        env = "SHUNT_WORKER_THREADS",
        value_name = "N",
        default_value_t = 0
    )]
    pub worker_threads: usize,

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

    // issue 19: the batched log writer.
    /// How long a log line may wait in memory for others to join its batch
    /// (one write to stderr per batch, not per line). The admin, metrics
    /// and readiness endpoints, and the agent's exit, write what waits.
    #[arg(long, value_name = "MS", default_value_t = 50)]
    pub log_batch_interval_ms: u64,
}

/// `--cri-socket`: a socket path, or `none`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CriSocket {
    None,
    Path(PathBuf),
}

impl std::str::FromStr for CriSocket {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" => Err("an empty path (use `none` to ask no container runtime)".into()),
            "none" => Ok(Self::None),
            path => Ok(Self::Path(PathBuf::from(path))),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnExit {
    Unenrol,
    Keep,
    Uninstall,
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProxyKind {
    Builtin,
    External,
    Ztunnel,
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
