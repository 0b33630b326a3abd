//! The redirection datapath on the real kernel. The cases every mode must
//! pass run against both the eBPF and the iptables redirector, with the same
//! assertions; the eBPF-only ones (kernel counters, fail-closed counting,
//! pinned state) follow. Until the proxy is
//! wired into the agent, test listeners stand in for it on 15001/15006 inside
//! the pod's netns and report what they accepted. Applications are real
//! processes (`shunt-testapp`) placed in a cgroup below the redirector's
//! cgroup root, as a pod's containers are below a node's.

use std::{
    net::{Ipv4Addr, TcpListener},
    sync::Arc,
    thread,
    time::Duration,
};

use serde_json::Value;
use shunt::{
    redirect::{
        Capture, OriginalDst, PodTarget, Redirector,
        ebpf::{EbpfOptions, EbpfOriginalDst, EbpfRedirector},
        iptables::{IptablesOptions, IptablesRedirector},
    },
    state::WorkloadKey,
};
use shunt_common::PodCounters;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, PinDir, WorkloadSpec, workloads_yaml},
    apps::{EchoServer, TestApp, ok},
    inspect, require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(20);

struct Bed {
    topo: Topology,
    pods: Vec<Pod>,
    apps: Cgroup,
    pin: PinDir,
}

fn bed(test: &str, pods: &[&str]) -> Bed {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node(test, pods).expect("topology");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let pin = PinDir::new(&topo, "redirect");
    Bed {
        topo,
        pods,
        apps,
        pin,
    }
}

/// A redirection mode under test.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Ebpf,
    Iptables,
}

impl Bed {
    /// A redirector of `mode`, as the agent would build it.
    fn mode_redirector(&self, mode: Mode, probe_source: Option<Ipv4Addr>) -> Box<dyn Redirector> {
        match mode {
            Mode::Ebpf => Box::new(self.redirector(probe_source)),
            Mode::Iptables => {
                // An owner unique to the topology: parallel tests never
                // clean up each other's pods.
                let mut options = IptablesOptions::new(self.topo.prefix());
                if let Some(probe) = probe_source {
                    options.probe_source = probe;
                }
                Box::new(IptablesRedirector::new(options).expect("iptables redirector"))
            }
        }
    }

    fn redirector(&self, probe_source: Option<Ipv4Addr>) -> EbpfRedirector {
        let mut options = EbpfOptions::new(self.pin.path());
        options.cgroup_root = Some(self.topo.cgroup_root().expect("cgroup root"));
        if let Some(probe) = probe_source {
            options.probe_source = probe;
        }
        EbpfRedirector::load(&options).expect("load redirector")
    }

    /// Runs `shunt-testapp ARGS` as a process in `pod`'s netns and in the
    /// apps cgroup; returns its JSON report.
    fn app(&self, pod: &Pod, args: &[&str]) -> Value {
        TestApp::new(TESTAPP, &self.apps).run(pod, args)
    }
}

fn target(pod: &Pod, capture: Capture) -> PodTarget {
    PodTarget {
        key: WorkloadKey::new("default", pod.name()),
        netns: pod.netns_path(),
        ips: vec![pod.ip().into()],
        capture,
    }
}

fn counters(redirector: &dyn Redirector, pod: &Pod) -> PodCounters {
    redirector
        .list()
        .into_iter()
        .find(|p| p.key.name == pod.name())
        .map(|p| p.counters)
        .unwrap_or_else(|| panic!("pod {} not enrolled", pod.name()))
}

fn listen(pod: &Pod, addr: &str) -> TcpListener {
    pod.listen_tcp(addr.parse().expect("addr")).expect("listen")
}

#[test]
fn outbound_connects_land_on_the_proxy_with_their_original_destination_ebpf() {
    outbound_connects_land_on_the_proxy(Mode::Ebpf);
}

#[test]
fn outbound_connects_land_on_the_proxy_with_their_original_destination_iptables() {
    outbound_connects_land_on_the_proxy(Mode::Iptables);
}

fn outbound_connects_land_on_the_proxy(mode: Mode) {
    let bed = bed("outbound", &["client", "server"]);
    let [client, server] = [&bed.pods[0], &bed.pods[1]];
    let mut redirector = bed.mode_redirector(mode, None);
    redirector
        .enrol(&target(client, Capture::all()))
        .expect("enrol");
    let resolver = redirector.original_dst_resolver();
    let proxy = EchoServer::start(listen(client, "127.0.0.1:15001"), Some(resolver));
    let real = EchoServer::start(listen(server, "0.0.0.0:8080"), None);

    let to = format!("{}:8080", server.ip());
    let report = bed.app(client, &["connect", &to, "--send", "100000"]);
    assert!(ok(&report), "{report}");
    // Dual-stack socket to a v4-mapped address: connect6's path.
    let mapped = format!("[::ffff:{}]:8080", server.ip());
    let report6 = bed.app(client, &["connect", &mapped, "--send", "5000"]);
    assert!(ok(&report6), "{report6}");

    let accepted = proxy.accepted();
    assert_eq!(accepted.len(), 2, "{accepted:?}");
    for a in &accepted {
        assert_eq!(a.original, Some(to.parse().expect("addr")), "{a:?}");
        assert_eq!(a.local, "127.0.0.1:15001".parse().expect("addr"));
    }
    assert!(
        real.accepted().is_empty(),
        "the real server was reached directly"
    );
    if let Mode::Ebpf = mode {
        let c = counters(redirector.as_ref(), client);
        assert_eq!(c.outbound_redirected, 2, "{c:?}");
        assert_eq!(c.outbound_fail_closed, 0, "{c:?}");
    }
}

/// Native IPv6 on the kernel, eBPF mode. (ip6tables' rules are checked by
/// the unit tests in `redirect/iptables/rules.rs`: on the kernel they would
/// need IPv6 on the pod's `eth0`, whose router solicitations and DAD probes
/// would leave the test's address range.)
#[test]
fn native_ipv6_connects_land_on_the_proxy_with_their_original_destination_ebpf() {
    let bed = bed("outbound6", &["client", "server"]);
    let [client, server] = [&bed.pods[0], &bed.pods[1]];
    client
        .enable_ipv6_loopback()
        .expect("::1 on the client's lo");
    let mut redirector = bed.mode_redirector(Mode::Ebpf, None);
    redirector
        .enrol(&target(client, Capture::all()))
        .expect("enrol");
    let resolver = redirector.original_dst_resolver();
    // Only the IPv6 proxy listener: connect6 must send a native IPv6
    // connect to [::1]:15001.
    let proxy = EchoServer::start(listen(client, "[::1]:15001"), Some(resolver));

    // No packet is ever addressed to it: connect6 rewrites the connect to
    // [::1]:15001 before a SYN exists, and the client has IPv6 on `lo`
    // only, so an unredirected connect would fail locally (ENETUNREACH).
    let to = std::net::SocketAddr::new(server.nat64_ip().into(), 8080);
    let report = bed.app(client, &["connect", &to.to_string(), "--send", "20000"]);
    assert!(ok(&report), "{report}");
    let accepted = proxy.accepted();
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    assert_eq!(accepted[0].original, Some(to), "{:?}", accepted[0]);
    assert_eq!(
        accepted[0].local,
        "[::1]:15001".parse().expect("addr"),
        "{:?}",
        accepted[0]
    );
    let c = counters(redirector.as_ref(), client);
    assert_eq!(c.outbound_redirected, 1, "{c:?}");
    assert_eq!(c.outbound_fail_closed, 0, "{c:?}");

    // No IPv6 listener: failed closed and counted, never sent.
    drop(proxy);
    let refused = bed.app(client, &["connect", &to.to_string(), "--send", "10"]);
    assert!(!ok(&refused), "{refused}");
    // connect() refused by a cgroup program fails with EPERM.
    assert_eq!(refused["errno"], 1, "{refused}");
    let c = counters(redirector.as_ref(), client);
    assert_eq!(c.outbound_fail_closed, 1, "{c:?}");
}

#[test]
fn unenrolled_marked_and_excluded_connects_go_direct_ebpf() {
    unenrolled_marked_and_excluded_connects_go_direct(Mode::Ebpf);
}

#[test]
fn unenrolled_marked_and_excluded_connects_go_direct_iptables() {
    unenrolled_marked_and_excluded_connects_go_direct(Mode::Iptables);
}

fn unenrolled_marked_and_excluded_connects_go_direct(mode: Mode) {
    let bed = bed("direct", &["client", "outsider", "server"]);
    let [client, outsider, server] = [&bed.pods[0], &bed.pods[1], &bed.pods[2]];
    let mut redirector = bed.mode_redirector(mode, None);
    let mut capture = Capture::all();
    capture.excluded_outbound_ports = vec![9090];
    redirector.enrol(&target(client, capture)).expect("enrol");
    let proxy = EchoServer::start(listen(client, "127.0.0.1:15001"), None);
    let real = EchoServer::start(listen(server, "0.0.0.0:8080"), None);
    let excluded = EchoServer::start(listen(server, "0.0.0.0:9090"), None);

    let to = format!("{}:8080", server.ip());
    // A pod that is not enrolled, though in the same cgroup tree.
    assert!(ok(&bed.app(outsider, &["connect", &to])));
    // The proxy's own sockets carry mark 0x539.
    assert!(ok(&bed.app(client, &["connect", &to, "--mark", "0x539"])));
    // An excluded destination port.
    let to_excluded = format!("{}:9090", server.ip());
    assert!(ok(&bed.app(client, &["connect", &to_excluded])));
    // Loopback destinations stay in the pod.
    let local = EchoServer::start(listen(client, "127.0.0.1:7777"), None);
    assert!(ok(&bed.app(client, &["connect", "127.0.0.1:7777"])));

    assert!(proxy.accepted().is_empty(), "{:?}", proxy.accepted());
    assert_eq!(real.accepted().len(), 2);
    assert_eq!(excluded.accepted().len(), 1);
    assert_eq!(local.accepted().len(), 1);
    if let Mode::Ebpf = mode {
        assert_eq!(counters(redirector.as_ref(), client).outbound_redirected, 0);
    }
}

#[test]
fn inbound_plaintext_lands_on_15006_with_the_original_destination_ebpf() {
    inbound_plaintext_lands_on_15006(Mode::Ebpf);
}

#[test]
fn inbound_plaintext_lands_on_15006_with_the_original_destination_iptables() {
    inbound_plaintext_lands_on_15006(Mode::Iptables);
}

fn inbound_plaintext_lands_on_15006(mode: Mode) {
    let bed = bed("inbound", &["server", "client", "prober"]);
    let [server, client, prober] = [&bed.pods[0], &bed.pods[1], &bed.pods[2]];
    // The probe source is configurable; tests use an address of the test
    // range for it (Istio's default, 169.254.7.127, is outside it).
    let mut redirector = bed.mode_redirector(mode, Some(prober.ip()));
    let mut capture = Capture::all();
    capture.excluded_inbound_ports = vec![9090];
    redirector.enrol(&target(server, capture)).expect("enrol");
    let resolver = redirector.original_dst_resolver();
    let proxy = EchoServer::start(listen(server, "0.0.0.0:15006"), Some(resolver));
    let app = EchoServer::start(listen(server, "0.0.0.0:8080"), None);
    let hbone = EchoServer::start(listen(server, "0.0.0.0:15008"), None);
    let excluded = EchoServer::start(listen(server, "0.0.0.0:9090"), None);

    let to = format!("{}:8080", server.ip());
    assert!(ok(&bed.app(client, &["connect", &to, "--send", "50000"])));
    let accepted = proxy.accepted();
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    // As the proxy does: the local address is the original destination
    // (sk_assign keeps it); after a REDIRECT it is 15006 and the
    // redirector's record has it.
    let original = match accepted[0].local.port() {
        15006 => accepted[0].original,
        _ => Some(accepted[0].local),
    };
    assert_eq!(original, Some(to.parse().expect("addr")), "{accepted:?}");
    if let Mode::Ebpf = mode {
        assert_eq!(
            accepted[0].local,
            to.parse().expect("addr"),
            "sk_assign keeps the destination"
        );
    }
    assert_eq!(accepted[0].peer.ip(), std::net::IpAddr::V4(client.ip()));
    assert!(
        app.accepted().is_empty(),
        "the app was reached around the proxy"
    );

    // Never steered: HBONE, the probe source, excluded ports.
    assert!(ok(
        &bed.app(client, &["connect", &format!("{}:15008", server.ip())])
    ));
    assert!(ok(&bed.app(prober, &["connect", &to])));
    assert!(ok(
        &bed.app(client, &["connect", &format!("{}:9090", server.ip())])
    ));
    assert_eq!(hbone.accepted().len(), 1);
    assert_eq!(app.accepted().len(), 1, "probe reaches the app directly");
    assert_eq!(excluded.accepted().len(), 1);
    assert_eq!(proxy.accepted().len(), 1);
    if let Mode::Ebpf = mode {
        assert_eq!(counters(redirector.as_ref(), server).inbound_redirected, 1);
    }
}

#[test]
fn missing_proxy_listeners_fail_closed_and_are_counted_ebpf() {
    missing_proxy_listeners_fail_closed(Mode::Ebpf);
}

#[test]
fn missing_proxy_listeners_fail_closed_iptables() {
    missing_proxy_listeners_fail_closed(Mode::Iptables);
}

/// Without the proxy's listeners nothing gets through in plaintext: eBPF
/// refuses the connect (EPERM) and drops the SYN, counting both; iptables'
/// REDIRECT to a closed port is answered with a reset.
fn missing_proxy_listeners_fail_closed(mode: Mode) {
    let bed = bed("failclosed", &["client", "server"]);
    let [client, server] = [&bed.pods[0], &bed.pods[1]];
    let mut redirector = bed.mode_redirector(mode, None);
    redirector
        .enrol(&target(client, Capture::all()))
        .expect("enrol");
    redirector
        .enrol(&target(server, Capture::all()))
        .expect("enrol");
    let app = EchoServer::start(listen(server, "0.0.0.0:8080"), None);
    let to = format!("{}:8080", server.ip());

    // No 15001 in the client: connect() is refused, nothing leaves.
    let report = bed.app(client, &["connect", &to]);
    assert_eq!(report["ok"], Value::Bool(false), "{report}");
    let refused = match mode {
        Mode::Ebpf => libc::EPERM,
        Mode::Iptables => libc::ECONNREFUSED,
    };
    assert_eq!(report["errno"], Value::from(refused), "{report}");
    assert!(
        app.accepted().is_empty(),
        "plaintext left the pod around the proxy"
    );
    if let Mode::Ebpf = mode {
        assert_eq!(
            counters(redirector.as_ref(), client).outbound_fail_closed,
            1
        );
    }

    // No 15006 in the server: the SYN is dropped, the app never sees it.
    let report = bed.app(
        &bed.pods[0],
        &["connect", &to, "--mark", "0x539", "--timeout-ms", "1500"],
    );
    assert_eq!(report["ok"], Value::Bool(false), "{report}");
    assert!(
        app.accepted().is_empty(),
        "plaintext reached the app around the proxy"
    );
    if let Mode::Ebpf = mode {
        assert!(counters(redirector.as_ref(), server).inbound_fail_closed >= 1);
    }
}

#[test]
fn killed_agent_keeps_flows_and_a_restarted_agent_keeps_redirecting() {
    let bed = bed("agentrestart", &["client", "server"]);
    let [client, server] = [&bed.pods[0], &bed.pods[1]];
    let node = bed.topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(server, false),
    ]);
    // The test's listeners stand in for the proxy, so that a kill -9 of the
    // agent shows what redirection alone keeps.
    let args = ["--capture", "on", "--proxy", "external"];
    let mut agent = Agent::start(&bed.topo, node, &yaml, &args).expect("agent");
    agent
        .wait_for("client enrolled", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| p.name == client.name() && p.counters.is_some())
        })
        .expect("enrolled");
    let resolver: Arc<dyn OriginalDst> =
        Arc::new(EbpfOriginalDst::open(agent.pin_dir()).expect("open pinned map"));
    // The apps cgroup must sit below the agent's cgroup root.
    assert!(bed.apps.path().starts_with(agent.cgroup_root()));
    let proxy = EchoServer::start(listen(client, "127.0.0.1:15001"), Some(resolver));
    let _real = EchoServer::start(listen(server, "0.0.0.0:8080"), None);
    let to = format!("{}:8080", server.ip());

    // A long-lived flow, running across the kill and the restart.
    let mut hold = client.command(TESTAPP);
    hold.args(["hold", &to, "--seconds", "4"]);
    bed.apps.place(&mut hold);
    let hold = hold
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("hold");
    thread::sleep(Duration::from_millis(500));

    agent.kill().expect("kill -9");
    // Nothing was cleaned up: a new connect is still redirected.
    assert!(ok(&bed.app(client, &["connect", &to])));
    agent.restart(&args).expect("restart");
    agent
        .wait_for("client enrolled again", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| p.name == client.name() && p.counters.is_some())
        })
        .expect("re-enrolled");
    assert!(ok(&bed.app(client, &["connect", &to])));

    let out = hold.wait_with_output().expect("hold output");
    let report: Value = serde_json::from_slice(&out.stdout).expect("hold report");
    assert_eq!(report["ok"], Value::Bool(true), "the flow broke: {report}");
    assert!(report["rounds"].as_u64().unwrap_or(0) > 20, "{report}");
    let accepted = proxy.accepted();
    assert_eq!(accepted.len(), 3, "{accepted:?}");
    assert!(
        accepted
            .iter()
            .all(|a| a.original == Some(to.parse().expect("addr")))
    );
    let links = agent.pin_dir().join("links");
    for name in [
        "shunt_connect4",
        "shunt_connect6",
        "shunt_sockops",
        "shunt_getsockopt",
    ] {
        assert!(links.join(name).exists(), "link {name} not pinned");
    }
}

#[test]
fn two_hundred_pods_enrol_and_unenrol_leaving_nothing_behind() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("manypods").expect("topology");
    topo.add_node("node-a").expect("node");
    // A /24 per node: 200 pods fit (from .10).
    let pods: Vec<Pod> = (0..200)
        .map(|i| topo.add_pod("node-a", &format!("p{i}")).expect("pod"))
        .collect();
    let pin = PinDir::new(&topo, "many");
    let mut options = EbpfOptions::new(pin.path());
    options.cgroup_root = Some(topo.cgroup_root().expect("cgroup root"));
    let mut redirector = EbpfRedirector::load(&options).expect("load");
    for pod in &pods {
        redirector
            .enrol(&target(pod, Capture::all()))
            .expect("enrol");
    }
    assert_eq!(
        inspect::enrolled_entries(pin.path()).expect("map").len(),
        200
    );
    for pod in pods.iter().step_by(37) {
        let filters = inspect::tc_filters(&pod.netns_path(), "eth0", "ingress").expect("tc");
        assert_eq!(filters.len(), 1, "{}: {filters:?}", pod.name());
    }
    for pod in &pods {
        redirector
            .unenrol(&WorkloadKey::new("default", pod.name()))
            .expect("unenrol");
    }
    assert!(
        inspect::enrolled_entries(pin.path())
            .expect("map")
            .is_empty()
    );
    assert!(redirector.list().is_empty());
    for pod in &pods {
        for hook in ["ingress", "egress"] {
            let filters = inspect::tc_filters(&pod.netns_path(), "eth0", hook).expect("tc");
            assert!(filters.is_empty(), "{} {hook}: {filters:?}", pod.name());
        }
    }
    let records = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(pin.path().join("SHUNT_POD_RECORDS"))
        .output()
        .expect("bpftool");
    let records: Value = serde_json::from_slice(&records.stdout).expect("bpftool json");
    assert_eq!(
        records.as_array().map(Vec::len),
        Some(0),
        "per-pod records left behind"
    );
}

#[test]
fn a_new_agent_removes_what_a_dead_one_left_for_pods_no_longer_enrolled() {
    let bed = bed("stale", &["kept", "gone"]);
    let [kept, gone] = [&bed.pods[0], &bed.pods[1]];
    {
        // The "previous agent": enrols both, then dies without cleaning up.
        let mut previous = bed.redirector(None);
        previous
            .enrol(&target(kept, Capture::all()))
            .expect("enrol");
        previous
            .enrol(&target(gone, Capture::all()))
            .expect("enrol");
    }
    assert_eq!(
        inspect::enrolled_entries(bed.pin.path())
            .expect("map")
            .len(),
        2
    );
    let filters = |pod: &Pod| {
        inspect::tc_filters(&pod.netns_path(), "eth0", "ingress")
            .expect("tc")
            .len()
    };
    assert_eq!(filters(gone), 1);

    // The new agent is told only about `kept`.
    let mut next = bed.redirector(None);
    next.enrol(&target(kept, Capture::all())).expect("enrol");
    assert_eq!(next.remove_stale(), 1);
    assert_eq!(
        inspect::enrolled_entries(bed.pin.path())
            .expect("map")
            .len(),
        1
    );
    assert_eq!(
        filters(gone),
        0,
        "the stale pod's TC programs were left attached"
    );
    assert_eq!(filters(kept), 1, "the kept pod lost its programs");
}

/// Creates a BPF array map with `value_size`-byte values and pins it at
/// `path`, as an older agent with another layout would have.
fn pin_array_map(path: &std::path::Path, value_size: u32) {
    // bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size,
    // max_entries (the rest zero).
    let mut create = [0u32; 32];
    create[..4].copy_from_slice(&[2 /* BPF_MAP_TYPE_ARRAY */, 4, value_size, 4]);
    // SAFETY: bpf(2) reads a zero-padded bpf_attr of the size given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0, /* BPF_MAP_CREATE */
            create.as_ptr(),
            std::mem::size_of_val(&create),
        )
    };
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    let pathname = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // bpf_attr for BPF_OBJ_PIN: pathname (u64), bpf_fd (u32), file_flags.
    let mut pin = [0u64; 16];
    pin[0] = pathname.as_ptr() as u64;
    pin[1] = fd as u64;
    // SAFETY: as above; `pathname` outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            6, /* BPF_OBJ_PIN */
            pin.as_ptr(),
            std::mem::size_of_val(&pin),
        )
    };
    assert_eq!(rc, 0, "BPF_OBJ_PIN: {}", std::io::Error::last_os_error());
    // SAFETY: our fd; the pin keeps the map.
    unsafe { libc::close(fd as i32) };
}

/// A pinned map whose layout this release cannot migrate (the enrolment
/// map, which the pods' adoption needs as it is) stops the load with an
/// error naming it and what differs, before anything is attached; one the
/// agent rebuilds from its own state (a pod's config) is recreated.
#[test]
fn pinned_maps_of_another_layout_are_refused_or_recreated() {
    let bed = bed("oldpins", &["client"]);
    std::fs::create_dir_all(bed.pin.path()).expect("pin dir");
    let stale = bed.pin.path().join(shunt_common::maps::ENROLLED);
    pin_array_map(&stale, 4);

    let mut options = EbpfOptions::new(bed.pin.path());
    options.cgroup_root = Some(bed.topo.cgroup_root().expect("cgroup root"));
    let error = match EbpfRedirector::load(&options) {
        Ok(_) => panic!("an agent adopted a pinned enrolment map of another layout"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains(&stale.display().to_string()), "{error}");
    assert!(
        error.contains("cannot be migrated") && error.contains("type Array → Hash,"),
        "{error}"
    );
    // Nothing was attached on the way to the error.
    assert!(
        !bed.pin.path().join("links").exists()
            || std::fs::read_dir(bed.pin.path().join("links"))
                .map(|mut d| d.next().is_none())
                .unwrap_or(true),
        "links were pinned before the check"
    );

    std::fs::remove_file(&stale).expect("unpin the enrolment map");
    let config = bed.pin.path().join(shunt_common::maps::POD_CONFIG);
    let wrong = std::mem::size_of::<shunt_common::PodConfig>() as u32 - 20;
    pin_array_map(&config, wrong);
    if let Err(e) = EbpfRedirector::load(&options) {
        panic!("a pod-config map of another layout was not recreated: {e}");
    }
}
