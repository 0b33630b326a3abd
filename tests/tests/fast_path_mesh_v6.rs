//! Flow 2 of the fast path over IPv6 (issue 18): two mesh pods of one
//! node with IPv6 on `eth0` (their 198.18 addresses in the NAT64 prefix
//! `64:ff9b::/96`, on-link between the pods of the node's bridge, inside
//! the test's namespaces only); a connect6 to the server's IPv6 address,
//! and to a service's IPv6 VIP whose endpoint is that server, is carried in
//! the kernel: the proxy copies nothing, the server sees the client's own
//! IPv6 address, `getpeername` answers the VIP dialled, and both ends
//! report it with the bytes moved.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt_common::maps;
use shunt_testbed::{
    Cgroup, Node, Pod, Topology,
    agent::{Agent, WorkloadSpec, http, start_enrolled, workloads_yaml},
    apps::{TestApp, local_of},
    require_root,
    scrape::{sample, wait_metrics},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const FAST: [&str; 4] = ["--redirect", "ebpf", "--fast-path", "on"];

fn proxy_work(agent: &Agent) -> (u64, u64, u64, u64, u64, u64) {
    let p = agent.status().expect("status").proxy.expect("a proxy");
    (
        p.outbound_hbone,
        p.inbound_hbone,
        p.outbound_passthrough,
        p.inbound_plaintext,
        p.bytes_out,
        p.bytes_in,
    )
}

fn principal(pod: &Pod) -> String {
    format!("spiffe://cluster.local/ns/default/sa/sa-{}", pod.name())
}

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

/// Entries of the agent's pinned map `name`, from `GET /debug/bpf`.
fn map_entries(node: &Node, agent: &Agent, name: &str) -> Option<u64> {
    let admin = agent.endpoints().admin.port();
    let (code, body) = http(node, "GET", admin, "/debug/bpf").ok()?;
    if code != 200 {
        return None;
    }
    let dump: Value = serde_json::from_str(&body).ok()?;
    dump["pinned"]["maps"]
        .as_array()?
        .iter()
        .find(|m| m["pin"].as_str().is_some_and(|p| p.ends_with(name)))?["entries"]
        .as_u64()
}

/// A server on `addr` in `pod`: reads each connection to its end, answers
/// half of it; remembers its peers.
fn half_echo(pod: &Pod, addr: SocketAddr) -> Arc<Mutex<Vec<SocketAddr>>> {
    let listener = pod.listen_tcp(addr).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let peers = Arc::new(Mutex::new(Vec::new()));
    let seen = peers.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(120) {
            let Ok((mut stream, peer)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            seen.lock().expect("peers").push(peer);
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let mut all = Vec::new();
            if stream.read_to_end(&mut all).is_ok() {
                let _ = stream.write_all(&all[..all.len() / 2]);
            }
        }
    });
    peers
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
    wait_metrics(&node, &agent, "the same-node mesh fast path on", |m| {
        sample(m, "shunt_fast_path_mesh_enabled", &[]) == Some(1.0)
    });
    let start = Instant::now();
    while map_entries(&node, &agent, maps::MESH_LOCAL_SERVICES) != Some(1) {
        assert!(
            start.elapsed() < TIMEOUT,
            "the IPv6 VIP never written: {}",
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let server6 = SocketAddr::new(IpAddr::V6(server.nat64_ip()), 8080);
    let peers = half_echo(&server, server6);

    // The pod's own IPv6 address, then the VIP: each carried in the kernel.
    const BYTES: usize = 262_144;
    let vip = SocketAddr::new(IpAddr::V6(vip6()), 80);
    for (n, to) in [server6, vip].into_iter().enumerate() {
        let before = proxy_work(&agent);
        let report = apps.run(
            &client,
            &["connect", &to.to_string(), "--send", &BYTES.to_string()],
        );
        assert_eq!(
            report["ok"],
            Value::Bool(true),
            "{report}\n{}",
            agent.logs()
        );
        assert_eq!(
            report["received"].as_u64(),
            Some(BYTES as u64 / 2),
            "{report}"
        );
        let local = local_of(&report);
        assert_eq!(
            local.ip(),
            IpAddr::V6(client.nat64_ip()),
            "not via the proxy: {report}"
        );
        assert_eq!(
            report["peer"].as_str(),
            Some(to.to_string().as_str()),
            "getpeername answers the address dialled: {report}"
        );
        assert!(
            peers.lock().expect("peers").contains(&local),
            "the server saw the client's own address {local}"
        );
        let (client_id, server_id) = (principal(&client), principal(&server));
        let service = if to == vip { "web6" } else { "unknown" };
        let labels = [
            ("reporter", "source"),
            ("source_workload", "client"),
            ("source_principal", client_id.as_str()),
            ("destination_workload", "server"),
            ("destination_principal", server_id.as_str()),
            ("destination_service_name", service),
        ];
        let text = wait_metrics(&node, &agent, "the IPv6 connection closed", |m| {
            sample(m, "istio_tcp_connections_closed_total", &labels) == Some(1.0)
        });
        assert_eq!(
            sample(&text, "istio_tcp_received_bytes_total", &labels),
            Some(BYTES as f64),
            "connection {n}: {text}"
        );
        assert_eq!(
            sample(&text, "istio_tcp_sent_bytes_total", &labels),
            Some((BYTES / 2) as f64),
            "connection {n}: {text}"
        );
        assert_eq!(proxy_work(&agent), before, "the proxy carried nothing");
    }
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}
