//! Flow 2 of the fast path over IPv6 (issue 18): two mesh pods of one
//! node with IPv6 on `eth0` (their 198.18 addresses in the NAT64 prefix
//! `64:ff9b::/96`, on-link between the pods of the node's bridge, inside
//! the test's namespaces only); a connect6 to the server's IPv6 address,
//! and to a service's IPv6 VIP whose endpoint is that server, is carried in
//! the kernel: the proxy copies nothing, the server sees the client's own
//! IPv6 address, `getpeername` answers the VIP dialled, and both ends
//! report it with the bytes moved.

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{WorkloadSpec, start_enrolled, workloads_yaml},
    apps::{HalfEcho, TestApp},
    fast_path::{assert_direct, assert_istio_tcp_counted, principal, proxy_work, vips_written},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const FAST: [&str; 4] = ["--redirect", "ebpf", "--fast-path", "on"];

/// The VIP of service `web6`: 198.19.100.6 in the NAT64 prefix (no
/// interface holds it).
fn vip6() -> Ipv6Addr {
    "64:ff9b::c613:6406".parse().expect("vip")
}

/// IPv6 on the pod's `eth0`, with nothing that would talk to a router or
/// probe for duplicates: its NAT64 address, on-link for the node's pods.
fn enable_ipv6(pod: &Pod) {
    let run = |program: &str, args: &[&str]| {
        let out = pod
            .command(program)
            .args(args)
            .output()
            .expect("run in the pod");
        assert!(
            out.status.success(),
            "{program} {args:?} in {}: {}",
            pod.name(),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(
        "sysctl",
        &[
            "-qw",
            "net.ipv6.conf.eth0.accept_ra=0",
            "net.ipv6.conf.eth0.router_solicitations=0",
            "net.ipv6.conf.eth0.addr_gen_mode=1",
            "net.ipv6.conf.eth0.accept_dad=0",
            "net.ipv6.conf.eth0.disable_ipv6=0",
        ],
    );
    let addr = format!("{}/96", pod.nat64_ip());
    run("ip", &["-6", "addr", "add", &addr, "dev", "eth0", "nodad"]);
}

#[test]
fn ipv6_same_node_mesh_flows_are_carried_in_the_kernel() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("fpmesh6").expect("topology");
    topo.add_node("node-a").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    // Both addresses of each pod; the service's IPv6 VIP.
    let mut yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
    ]);
    for pod in [&client, &server] {
        yaml = yaml.replace(
            &format!("ips: [\"{}\"]", pod.ip()),
            &format!("ips: [\"{}\", \"{}\"]", pod.ip(), pod.nat64_ip()),
        );
    }
    yaml += &format!(
        "services:\n  - name: web6\n    namespace: default\n    clusterIPs: [\"{}\"]\n    ports: [{{port: 80, targetPort: 8080}}]\n    endpoints: [\"server\"]\n",
        vip6()
    );
    // Before the agent: the proxy binds each pod address's 15008.
    for pod in [&client, &server] {
        enable_ipv6(pod);
    }
    let node = topo.node("node-a").expect("node").clone();
    let [mut agent] =
        start_enrolled(&topo, [&node], &yaml, &FAST, TIMEOUT).expect("agent enrolled");
    // The IPv6 VIP written.
    vips_written(&node, &agent, 1);
    let server6 = SocketAddr::new(IpAddr::V6(server.nat64_ip()), 8080);
    let half = HalfEcho::on_addr(&server, server6);

    // The pod's own IPv6 address, then the VIP: each carried in the kernel.
    const BYTES: usize = 262_144;
    let vip = SocketAddr::new(IpAddr::V6(vip6()), 80);
    for (n, to) in [server6, vip].into_iter().enumerate() {
        let before = proxy_work(&agent);
        let report = apps.run(
            &client,
            &["connect", &to.to_string(), "--send", &BYTES.to_string()],
        );
        let local = assert_direct(&report, IpAddr::V6(client.nat64_ip()), BYTES, &agent);
        assert_eq!(
            report["peer"].as_str(),
            Some(to.to_string().as_str()),
            "getpeername answers the address dialled: {report}"
        );
        assert!(
            half.peers().contains(&local),
            "the server saw the client's own address {local}"
        );
        let (client_id, server_id) = (principal(&client, "default"), principal(&server, "default"));
        let service = if to == vip { "web6" } else { "unknown" };
        let labels = [
            ("reporter", "source"),
            ("source_workload", "client"),
            ("source_principal", client_id.as_str()),
            ("destination_workload", "server"),
            ("destination_principal", server_id.as_str()),
            ("destination_service_name", service),
        ];
        assert_istio_tcp_counted(
            &node,
            &agent,
            &labels,
            BYTES,
            BYTES / 2,
            &format!("IPv6 connection {n}"),
        );
        assert_eq!(proxy_work(&agent), before, "the proxy carried nothing");
    }
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}
