//! DNS capture and the DNS proxy on the real kernel.
//!
//! End to end (the agent binary, its builtin proxy and DNS server): a
//! mesh pod resolves a Service name, short and long, to its VIP without
//! asking the upstream (which does not know it, or never answers); other
//! names are forwarded to the upstream resolver in another pod and
//! answered, the application seeing the answer come from the server it
//! asked; an upstream that never answers gives SERVFAIL; a large answer
//! comes over TCP; with capture off (node flag, or the pod's
//! `dnsCapture: false`) port 53 reaches the upstream itself.
//!
//! The capture alone (the redirectors as a library, both modes): a test
//! DNS server stands in for the DNS proxy on 127.0.0.1:15053 inside the
//! client pod, another one is the upstream resolver on another pod's
//! 198.18.x.y:53, and `shunt-dig` (a real stub resolver's exchange, run as
//! the pod's application) asks the upstream. Captured, the stand-in
//! answers, and the application sees the answer come from the upstream's
//! address and port 53 (eBPF: the recvmsg4 rewrite; iptables: conntrack's
//! reverse NAT) — over unconnected UDP, connected UDP and TCP. Not
//! captured (the pod's capture off; eBPF: no DNS proxy bound yet), the
//! upstream itself answers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde_json::Value;
use shunt::{
    redirect::{
        Capture, PodTarget, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector},
        iptables::{IptablesOptions, IptablesRedirector},
    },
    state::WorkloadKey,
};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{
        Agent, PinDir, ServiceSpec, WorkloadSpec, mesh_pods_enrolled, services_yaml, workloads_yaml,
    },
    apps::TestApp,
    dns::{DnsResponder, Transport, Zone},
    require_root,
};

const DIG: &str = env!("CARGO_BIN_EXE_shunt-dig");

/// What the upstream resolver answers for [`NAME`], and what the stand-in
/// DNS proxy answers: which of the two answered is in the answer.
const NAME: &str = "outside.example";
const FROM_UPSTREAM: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 7);
const FROM_PROXY: Ipv4Addr = Ipv4Addr::new(198, 18, 250, 9);

fn zone(answer: Ipv4Addr) -> Zone {
    [(NAME.to_string(), vec![IpAddr::V4(answer)])].into()
}

fn target(pod: &Pod, dns: bool) -> PodTarget {
    PodTarget {
        key: WorkloadKey::new("default", pod.name()),
        netns: pod.netns_path(),
        ips: vec![pod.ip().into()],
        capture: Capture {
            dns,
            ..Capture::all()
        },
    }
}

struct Bed {
    topo: Topology,
    client: Pod,
    apps: Cgroup,
    upstream: DnsResponder,
    pin: PinDir,
    cgroup_root: std::path::PathBuf,
}

fn bed(test: &str) -> Bed {
    require_root().expect("kernel tests need root");
    let (topo, mut pods) = Topology::single_node(test, &["client", "resolver"]).expect("topology");
    let resolver = pods.pop().expect("resolver pod");
    let client = pods.pop().expect("client pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let upstream = DnsResponder::start(
        &resolver,
        SocketAddr::new(resolver.ip().into(), 53),
        zone(FROM_UPSTREAM),
        false,
    )
    .expect("upstream resolver");
    let pin = PinDir::new(&topo, "dns");
    let cgroup_root = topo.cgroup_root().expect("cgroup root");
    Bed {
        topo,
        client,
        apps,
        upstream,
        pin,
        cgroup_root,
    }
}

impl Bed {
    fn dig(&self, extra: &[&str]) -> Value {
        let server = self.upstream.addr().to_string();
        let mut args = vec![server.as_str(), NAME, "--timeout-ms", "5000"];
        args.extend_from_slice(extra);
        TestApp::new(DIG, &self.apps).run(&self.client, &args)
    }

    /// The stand-in for the DNS proxy, on 127.0.0.1:15053 in the client.
    fn proxy(&self) -> DnsResponder {
        DnsResponder::start(
            &self.client,
            "127.0.0.1:15053".parse().expect("addr"),
            zone(FROM_PROXY),
            false,
        )
        .expect("stand-in DNS proxy")
    }
}

/// Asserts `report` is an answer `answer` that the application saw come
/// from the upstream's address and port 53.
fn assert_answer(report: &Value, answer: Ipv4Addr, upstream: SocketAddr, transport: &str) {
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(report["rcode"], "NoError", "{report}");
    assert_eq!(
        report["answers"],
        serde_json::json!([answer.to_string()]),
        "{report}"
    );
    assert_eq!(report["transport"], transport, "{report}");
    // UDP: the answer's source (recvmsg); TCP: the peer (getpeername).
    assert_eq!(
        report["from"],
        upstream.to_string(),
        "the answer must look as if it came from the server asked: {report}"
    );
}

fn captured_queries_reach_the_proxy_and_answers_carry_the_servers_address(
    bed: &Bed,
    redirector: &mut dyn Redirector,
) {
    let upstream = bed.upstream.addr();
    let upstream_before = bed.upstream.seen_for(NAME).len();
    redirector.enrol(&target(&bed.client, true)).expect("enrol");
    let proxy = bed.proxy();
    for (extra, transport, kind) in [
        (&[][..], "udp", Transport::Udp),
        (&["--connected"][..], "udp", Transport::Udp),
        (&["--tcp"][..], "tcp", Transport::Tcp),
    ] {
        let before = proxy.seen_for(NAME).len();
        let report = bed.dig(extra);
        assert_answer(&report, FROM_PROXY, upstream, transport);
        let seen = proxy.seen_for(NAME);
        assert_eq!(seen.len(), before + 1, "{extra:?}: {seen:?}");
        assert_eq!(seen[before].transport, kind, "{extra:?}");
    }
    assert_eq!(
        bed.upstream.seen_for(NAME).len(),
        upstream_before,
        "captured queries never reach the upstream: {:?}",
        bed.upstream.seen()
    );

    // The pod's DNS capture off: port 53 is left alone.
    redirector
        .unenrol(&WorkloadKey::new("default", bed.client.name()))
        .expect("unenrol");
    redirector
        .enrol(&target(&bed.client, false))
        .expect("enrol");
    let before = proxy.seen().len();
    assert_answer(&bed.dig(&[]), FROM_UPSTREAM, upstream, "udp");
    assert_eq!(bed.upstream.seen_for(NAME).len(), upstream_before + 1);
    assert_eq!(proxy.seen().len(), before, "not captured");
}

#[test]
fn dns_capture_ebpf() {
    let bed = bed("dns-cap-ebpf");
    let mut options = EbpfOptions::new(bed.pin.path());
    options.cgroup_root = Some(bed.cgroup_root.clone());
    let mut redirector = EbpfRedirector::load(&options).expect("load redirector");
    let upstream = bed.upstream.addr();

    // Captured, but no DNS proxy bound in the pod (yet): DNS fails open,
    // the query goes to the server it was sent to.
    redirector.enrol(&target(&bed.client, true)).expect("enrol");
    assert_answer(&bed.dig(&[]), FROM_UPSTREAM, upstream, "udp");
    assert_eq!(bed.upstream.seen_for(NAME).len(), 1);
    redirector
        .unenrol(&WorkloadKey::new("default", bed.client.name()))
        .expect("unenrol");
    captured_queries_reach_the_proxy_and_answers_carry_the_servers_address(&bed, &mut redirector);
    redirector
        .unenrol(&WorkloadKey::new("default", bed.client.name()))
        .expect("unenrol");
}

#[test]
fn dns_capture_iptables() {
    let bed = bed("dns-cap-ipt");
    // An owner unique to the topology: parallel tests never clean up each
    // other's pods.
    let options = IptablesOptions::new(bed.topo.prefix());
    let mut redirector = IptablesRedirector::new(options).expect("iptables redirector");
    captured_queries_reach_the_proxy_and_answers_carry_the_servers_address(&bed, &mut redirector);
    redirector
        .unenrol(&WorkloadKey::new("default", bed.client.name()))
        .expect("unenrol");
}

// --- End to end: the agent, its proxy and its DNS server. ---

const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// A service VIP no interface holds.
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 1);
const WEB_LONG: &str = "web.default.svc.cluster.local";
/// A name only the upstream knows, with more A records than fit in 512
/// bytes.
const BIG: &str = "big.example";
const BIG_COUNT: u8 = 100;

fn upstream_zone() -> Zone {
    let mut zone = zone(FROM_UPSTREAM);
    zone.insert(
        BIG.to_string(),
        (0..BIG_COUNT)
            .map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, 201, i)))
            .collect(),
    );
    zone
}

/// A node with a mesh client, a mesh pod whose DNS is not captured
/// (`dnsCapture: false`), the service `web` (on a mesh pod), and the
/// upstream resolver in a pod outside the mesh (silent: never answers);
/// the agent forwards to it (`--dns-resolv-conf`).
struct Mesh {
    topo: Topology,
    client: Pod,
    quiet: Pod,
    apps: Cgroup,
    upstream: DnsResponder,
    agent: Agent,
    resolv_conf: std::path::PathBuf,
}

impl Mesh {
    fn start(test: &str, mode: &str, silent_upstream: bool, extra: &[&str]) -> Mesh {
        require_root().expect("kernel tests need root");
        let mut topo = Topology::new(test).expect("topology");
        topo.add_node("node-a").expect("node");
        let client = topo.add_pod("node-a", "client").expect("pod");
        let quiet = topo.add_pod("node-a", "quiet").expect("pod");
        let server = topo.add_pod("node-a", "server").expect("pod");
        let resolver = topo.add_pod("node-a", "resolver").expect("pod");
        let apps = Cgroup::create(&topo, "apps").expect("cgroup");
        let upstream = DnsResponder::start(
            &resolver,
            SocketAddr::new(resolver.ip().into(), 53),
            upstream_zone(),
            silent_upstream,
        )
        .expect("upstream resolver");
        let resolv_conf = std::env::temp_dir().join(format!("{}-resolv.conf", topo.prefix()));
        std::fs::write(&resolv_conf, format!("nameserver {}\n", resolver.ip()))
            .expect("resolv.conf");
        let yaml = workloads_yaml(&[
            WorkloadSpec::for_pod(&client, true),
            WorkloadSpec {
                dns_capture: Some(false),
                ..WorkloadSpec::for_pod(&quiet, true)
            },
            WorkloadSpec::for_pod(&server, true),
            WorkloadSpec::for_pod(&resolver, false),
        ]) + &services_yaml(&[ServiceSpec {
            name: "web".into(),
            namespace: "default".into(),
            vip: WEB_VIP,
            port: 80,
            target_port: 8080,
            endpoints: vec!["server".into()],
        }]);
        let resolv_arg = resolv_conf.display().to_string();
        let mut args = vec![
            "--redirect",
            mode,
            "--dns-resolv-conf",
            &resolv_arg,
            "--dns-upstream-timeout",
            "1s",
        ];
        args.extend_from_slice(extra);
        let node = topo.node("node-a").expect("node").clone();
        let mut agent = Agent::start(&topo, &node, &yaml, &args).expect("agent");
        agent
            .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
            .expect("enrolled");
        Mesh {
            topo,
            client,
            quiet,
            apps,
            upstream,
            agent,
            resolv_conf,
        }
    }

    /// `shunt-dig` in `pod`, asking the upstream resolver (the server the
    /// pod's resolv.conf would name).
    fn dig(&self, pod: &Pod, name: &str, extra: &[&str]) -> Value {
        let server = self.upstream.addr().to_string();
        let mut args = vec![server.as_str(), name, "--timeout-ms", "8000"];
        args.extend_from_slice(extra);
        TestApp::new(DIG, &self.apps).run(pod, &args)
    }

    /// Asks until the DNS server has the service's name (the names are
    /// published after the store applied the view: a moment after
    /// enrolment), bounded.
    fn dig_until_answered(&self, pod: &Pod, name: &str, extra: &[&str]) -> Value {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            let report = self.dig(pod, name, extra);
            if report["answers"].as_array().is_some_and(|a| !a.is_empty())
                || std::time::Instant::now() > deadline
            {
                return report;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    fn stop(mut self) {
        let exit = self.agent.stop().expect("stop");
        assert!(exit.success(), "{}", self.agent.logs());
        let _ = std::fs::remove_file(&self.resolv_conf);
        drop(self.topo);
    }
}

/// A service name, long and short, resolves to the VIP in the pod, never
/// asking the upstream; the answer comes from the server asked.
fn mesh_names_resolve_in_the_pod(mesh: &Mesh) {
    let upstream = mesh.upstream.addr();
    let report = mesh.dig_until_answered(&mesh.client, WEB_LONG, &[]);
    assert_answer(&report, WEB_VIP, upstream, "udp");
    for short in ["web", "web.default", "web.default.svc"] {
        assert_answer(
            &mesh.dig(&mesh.client, short, &[]),
            WEB_VIP,
            upstream,
            "udp",
        );
    }
    assert_answer(
        &mesh.dig(&mesh.client, WEB_LONG, &["--connected"]),
        WEB_VIP,
        upstream,
        "udp",
    );
    assert_answer(
        &mesh.dig(&mesh.client, WEB_LONG, &["--tcp"]),
        WEB_VIP,
        upstream,
        "tcp",
    );
    let asked: Vec<_> = mesh
        .upstream
        .seen()
        .into_iter()
        .filter(|s| s.name.starts_with("web"))
        .collect();
    assert!(
        asked.is_empty(),
        "mesh names never reach the upstream: {asked:?}"
    );
}

/// `pod`'s DNS is not captured: the upstream itself gets the query (from
/// the pod's own address) and answers (it does not know the service).
fn port_53_is_left_alone(mesh: &Mesh, pod: &Pod) {
    let before = mesh.upstream.seen_for(WEB_LONG).len();
    let report = mesh.dig(pod, WEB_LONG, &[]);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(
        report["rcode"], "NXDomain",
        "the upstream answered: {report}"
    );
    assert_eq!(report["from"], mesh.upstream.addr().to_string(), "{report}");
    let seen = mesh.upstream.seen_for(WEB_LONG);
    assert_eq!(seen.len(), before + 1, "{seen:?}");
    assert_eq!(seen[before].from.ip(), IpAddr::V4(pod.ip()), "{seen:?}");
}

/// `istio_dns_upstream_requests_total`, summed over its labels, from the
/// agent's `/metrics`.
fn upstream_requests(agent: &Agent) -> u64 {
    let (code, body) = agent.metrics().expect("GET /metrics");
    assert_eq!(code, 200, "{body}");
    body.lines()
        .filter(|l| l.starts_with("istio_dns_upstream_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn dns_end_to_end(mode: &str) {
    let mesh = Mesh::start(&format!("dns-e2e-{mode}"), mode, false, &[]);
    let upstream = mesh.upstream.addr();
    mesh_names_resolve_in_the_pod(&mesh);

    // A name the mesh does not know: forwarded by the agent's DNS server
    // (from the pod's netns, as ztunnel's in-pod forwarder) to the
    // upstream, answered, and the answer seen as coming from the server the
    // application asked.
    let upstream_requests_before = upstream_requests(&mesh.agent);
    assert_answer(
        &mesh.dig(&mesh.client, NAME, &[]),
        FROM_UPSTREAM,
        upstream,
        "udp",
    );
    assert_answer(
        &mesh.dig(&mesh.client, NAME, &["--connected"]),
        FROM_UPSTREAM,
        upstream,
        "udp",
    );
    let forwarded = mesh.upstream.seen_for(NAME);
    assert!(!forwarded.is_empty(), "the upstream was asked");
    // Forwarded by the DNS proxy (its upstream counter moved: the captured
    // query never went out itself), from the pod's own IP: the proxy made
    // its upstream socket in the pod's netns, not in the agent's.
    assert!(
        upstream_requests(&mesh.agent) >= upstream_requests_before + 2,
        "the DNS proxy forwarded both queries"
    );
    assert!(
        forwarded
            .iter()
            .all(|s| s.from.ip() == IpAddr::V4(mesh.client.ip())),
        "forwarded from the pod's own IP (its netns), not the agent's: {forwarded:?}"
    );

    // A large answer over TCP (and over UDP however the proxy delivers it).
    for extra in [&["--tcp"][..], &[][..]] {
        let report = mesh.dig(&mesh.client, BIG, extra);
        assert_eq!(report["ok"], Value::Bool(true), "{extra:?}: {report}");
        assert_eq!(
            report["answers"].as_array().map(Vec::len),
            Some(usize::from(BIG_COUNT)),
            "{extra:?}: {report}"
        );
    }

    // The pod with `dnsCapture: false`.
    port_53_is_left_alone(&mesh, &mesh.quiet);
    mesh.stop();
}

#[test]
fn dns_end_to_end_ebpf() {
    dns_end_to_end("ebpf");
}

#[test]
fn dns_end_to_end_iptables() {
    dns_end_to_end("iptables");
}

#[test]
fn an_upstream_that_never_answers_gives_servfail_and_mesh_names_still_resolve_ebpf() {
    let mesh = Mesh::start("dns-silent", "ebpf", true, &[]);
    mesh_names_resolve_in_the_pod(&mesh);
    let report = mesh.dig(&mesh.client, NAME, &[]);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(report["rcode"], "ServFail", "{report}");
    assert_eq!(report["from"], mesh.upstream.addr().to_string(), "{report}");
    assert!(!mesh.upstream.seen_for(NAME).is_empty(), "it was asked");
    mesh.stop();
}

#[test]
fn dns_capture_off_on_the_node_leaves_port_53_alone_ebpf() {
    let mesh = Mesh::start("dns-off", "ebpf", false, &["--dns-capture", "off"]);
    port_53_is_left_alone(&mesh, &mesh.client);
    let status = mesh.agent.status().expect("status");
    let client = status
        .pods
        .iter()
        .find(|p| p.name == mesh.client.name())
        .expect("client");
    assert!(
        !client.hooks.iter().any(|h| h.name.starts_with("dns_")),
        "{:?}",
        client.hooks
    );
    mesh.stop();
}
