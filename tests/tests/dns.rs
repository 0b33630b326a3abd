//! DNS capture on the real kernel.
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
    agent::PinDir,
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
        topo: topo,
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
    if transport == "udp" {
        assert_eq!(
            report["from"],
            upstream.to_string(),
            "the answer must look as if it came from the server asked: {report}"
        );
    }
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
    redirector.enrol(&target(&bed.client, false)).expect("enrol");
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
