//! The iptables redirection mode on the real kernel, in network namespaces:
//! pods enrolled with [`IptablesRedirector`] in-process (and once through the
//! real `shunt agent --redirect iptables`), with test listeners standing in
//! for the proxy on 127.0.0.1:15001 and 0.0.0.0:15006 inside the pod.
//!
//! The test process makes the connections itself, from a thread inside the
//! pod's netns: netfilter rules are per netns, so the pod's nat OUTPUT rules
//! apply to them exactly as to the pod's own processes.
//!
//! Datapath and removal cases run against both iptables backends (nft and
//! legacy); the others against the one the redirector picks (nft).

use std::{
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsRawFd,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use nix::sys::{
    socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt,
    },
    time::TimeVal,
};
use shunt::{
    api::PodState,
    redirect::{
        Capture, PodTarget, RedirectMode, Redirector, Verification,
        iptables::{Backend, CHAIN_OUTPUT, CHAIN_PREROUTING, IptablesOptions, IptablesRedirector},
    },
    state::WorkloadKey,
};
use shunt_testbed::{
    Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(10);
/// How long a listener must stay empty to count as "got nothing" (checked
/// only after the connection has landed somewhere else).
const QUIET: Duration = Duration::from_millis(300);
const PROXY_MARK: u32 = 0x539;
const APP_PORT: u16 = 8080;

fn topology(test: &str, pods: &[&str]) -> (Topology, Vec<Pod>) {
    require_root().expect("kernel tests need root");
    Topology::single_node(test, pods).expect("topology")
}

/// An owner unique to this topology, so that tests running in parallel (and
/// their `remove_stale`) never touch each other's pods.
fn owner(topo: &Topology) -> String {
    format!("{}-node-a", topo.prefix())
}

fn redirector(topo: &Topology, backend: Option<Backend>) -> IptablesRedirector {
    let mut options = IptablesOptions::new(owner(topo));
    options.backend = backend;
    IptablesRedirector::new(options).expect("iptables redirector")
}

fn key(pod: &Pod) -> WorkloadKey {
    WorkloadKey::new("default", pod.name())
}

fn target(pod: &Pod) -> PodTarget {
    PodTarget {
        key: key(pod),
        netns: pod.netns_path(),
        ips: vec![pod.ip().into()],
        capture: Capture::all(),
    }
}

fn backend_binary(backend: Backend, tool: &str) -> String {
    match (backend, tool) {
        (Backend::Nft, "") => "iptables-nft".into(),
        (Backend::Legacy, "") => "iptables-legacy".into(),
        (Backend::Nft, tool) => format!("iptables-nft-{tool}"),
        (Backend::Legacy, tool) => format!("iptables-legacy-{tool}"),
    }
}

/// Runs `program args…` in the pod's netns, failing the test on error.
fn run_in(pod: &Pod, program: &str, args: &[&str]) -> String {
    let out = pod
        .command(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} in {}: {}",
        args.join(" "),
        pod.name(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Accepts one connection within `timeout`, or `None`.
fn accept_within(listener: &TcpListener, timeout: Duration) -> Option<(TcpStream, SocketAddr)> {
    listener.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                stream.set_nonblocking(false).expect("blocking");
                return Some((stream, peer));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return None;
                }
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Sends a line from `from` and checks `to` receives it: the accepted
/// socket really is the other end of the client's connection.
fn check_bytes_flow(from: &mut TcpStream, to: &mut TcpStream) {
    let payload = b"hello through the mesh\n";
    from.write_all(payload).expect("write");
    to.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut got = vec![0u8; payload.len()];
    to.read_exact(&mut got).expect("read");
    assert_eq!(&got, payload);
}

/// A TCP connection from inside `pod` made by a raw socket: with `mark` as
/// its `SO_MARK`, and bound first to `source` (with `IP_TRANSPARENT`, which
/// lets it be a foreign address) when given.
fn connect_raw(pod: &Pod, to: SocketAddrV4, mark: u32, source: Option<Ipv4Addr>) -> TcpStream {
    pod.run(move || -> nix::Result<TcpStream> {
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        setsockopt(&fd, sockopt::Mark, &mark)?;
        // A blocking connect gives up after SO_SNDTIMEO.
        setsockopt(&fd, sockopt::SendTimeout, &TimeVal::new(5, 0))?;
        if let Some(source) = source {
            setsockopt(&fd, sockopt::IpTransparent, &true)?;
            bind(
                fd.as_raw_fd(),
                &SockaddrIn::from(SocketAddrV4::new(source, 0)),
            )?;
        }
        connect(fd.as_raw_fd(), &SockaddrIn::from(to))?;
        Ok(TcpStream::from(fd))
    })
    .expect("enter pod netns")
    .unwrap_or_else(|e| panic!("connect from {} to {to}: {e}", pod.name()))
}

fn app_addr(pod: &Pod) -> SocketAddrV4 {
    SocketAddrV4::new(pod.ip(), APP_PORT)
}

/// Listeners standing in for the proxy inside a pod.
struct StandIn {
    outbound: TcpListener,
    inbound: TcpListener,
}

impl StandIn {
    fn start(pod: &Pod) -> StandIn {
        StandIn {
            outbound: pod
                .listen_tcp(SocketAddr::from((Ipv4Addr::LOCALHOST, 15001)))
                .expect("listen 15001"),
            inbound: pod
                .listen_tcp(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 15006)))
                .expect("listen 15006"),
        }
    }
}

fn shunt_chains(pod: &Pod, backend: Backend) -> Vec<String> {
    let mut found = Vec::new();
    for save in [
        backend_binary(backend, "save"),
        backend_binary(backend, "save").replacen("iptables", "ip6tables", 1),
    ] {
        found.extend(
            run_in(pod, &save, &[])
                .lines()
                .filter(|l| l.contains("SHUNT_"))
                .map(str::to_string),
        );
    }
    found
}

/// What a pod's netns holds for netfilter and policy routing, comparable
/// before and after: `iptables-save`/`ip6tables-save` without counters and
/// comments, with tables that hold nothing (only built-in chains with
/// ACCEPT policy, no rule) left out; `ip rule` and every routing table.
fn snapshot(pod: &Pod, backend: Backend) -> String {
    let mut snapshot = String::new();
    for save in [
        backend_binary(backend, "save"),
        backend_binary(backend, "save").replacen("iptables", "ip6tables", 1),
    ] {
        snapshot.push_str(&format!("== {save}\n"));
        let text = run_in(pod, &save, &[]);
        let mut table: Vec<String> = Vec::new();
        let mut meaningful = false;
        for line in text.lines() {
            if line.starts_with('#') {
                continue;
            }
            if line.starts_with('*') {
                table.clear();
                meaningful = false;
            }
            let line = match line.find(" [") {
                Some(i) if line.starts_with(':') => line[..i].to_string(),
                _ => line.to_string(),
            };
            let builtin_accept = line.starts_with(':') && line.ends_with(" ACCEPT");
            if !(line.starts_with('*') || line == "COMMIT" || builtin_accept) {
                meaningful = true;
            }
            table.push(line.clone());
            if line == "COMMIT" && meaningful {
                snapshot.push_str(&table.join("\n"));
                snapshot.push('\n');
            }
        }
    }
    for args in [
        &["rule", "show"][..],
        &["-6", "rule", "show"],
        &["route", "show", "table", "all"],
        &["-6", "route", "show", "table", "all"],
    ] {
        snapshot.push_str(&format!("== ip {}\n", args.join(" ")));
        snapshot.push_str(&run_in(pod, "ip", args));
    }
    snapshot
}

/// Runs `$body(backend)` as one test per iptables backend.
macro_rules! for_both_backends {
    ($($name:ident => $body:ident;)*) => {
        mod nft {
            $( #[test] fn $name() { super::$body(super::Backend::Nft) } )*
        }
        mod legacy {
            $( #[test] fn $name() { super::$body(super::Backend::Legacy) } )*
        }
    };
}

for_both_backends! {
    outbound_lands_on_15001_and_original_dst_recovers_the_destination => outbound_redirected;
    unenrolled_pod_connects_directly => unenrolled_direct;
    socket_marked_0x539_connects_directly => marked_direct;
    inbound_plaintext_lands_on_15006_and_original_dst_recovers_the_port => inbound_redirected;
    port_15008_is_not_redirected => hbone_not_redirected;
    removal_leaves_no_rule_chain_or_route_behind => removal_leaves_nothing;
}

fn outbound_redirected(backend: Backend) {
    let (topo, pods) = topology("ipt-out", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let proxy = StandIn::start(client);
    let mut redirector = redirector(&topo, Some(backend));
    redirector.enrol(&target(client)).expect("enrol");
    assert_eq!(
        redirector.verify(&key(client)).expect("verify"),
        Verification::Redirected
    );

    let mut conn = client
        .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
        .expect("connect");
    let (mut accepted, peer) =
        accept_within(&proxy.outbound, TIMEOUT).expect("the connection reached 15001");
    // REDIRECT rewrites the destination only: the peer is the pod's
    // address, the local end the proxy's loopback listener.
    assert_eq!(peer.ip(), client.ip());
    assert_eq!(
        accepted.local_addr().expect("local"),
        SocketAddr::from((Ipv4Addr::LOCALHOST, 15001))
    );
    let original = redirector
        .original_dst_resolver()
        .original_dst(&accepted)
        .expect("original destination");
    assert_eq!(original, SocketAddr::V4(app_addr(server)));
    check_bytes_flow(&mut conn, &mut accepted);
    assert!(
        accept_within(&app, QUIET).is_none(),
        "the app was reached directly"
    );

    // Counters: nat sees each connection's first packet only.
    let listed = redirector.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].mode, RedirectMode::Iptables);
    assert_eq!(
        listed[0].counters.packets_out, 1,
        "{:?}",
        listed[0].counters
    );
    assert!(listed[0].counters.bytes_out > 0);
    assert_eq!(listed[0].counters.packets_in, 0);
    assert!(
        listed[0].hooks.iter().all(|h| h.present),
        "{:?}",
        listed[0].hooks
    );
    assert!(
        listed[0].hooks.iter().any(|h| h.name == "ipv4 nat OUTPUT"),
        "{:?}",
        listed[0].hooks
    );

    // A connection straight to the proxy's port was not redirected: the
    // resolver says so instead of answering with the proxy itself.
    let _direct = client
        .connect_tcp(SocketAddr::from((Ipv4Addr::LOCALHOST, 15001)), TIMEOUT)
        .expect("direct connect");
    let (direct, _) = accept_within(&proxy.outbound, TIMEOUT).expect("accepted");
    let err = redirector
        .original_dst_resolver()
        .original_dst(&direct)
        .expect_err("a direct connection has no original destination");
    assert!(err.to_string().contains("not redirected"), "{err}");

    redirector.unenrol(&key(client)).expect("unenrol");
    assert!(shunt_chains(client, backend).is_empty());
}

fn unenrolled_direct(backend: Backend) {
    let (topo, pods) = topology("ipt-plain", &["meshed", "outsider", "server"]);
    let [meshed, outsider, server] = [&pods[0], &pods[1], &pods[2]];
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let proxy = StandIn::start(outsider);
    let mut redirector = redirector(&topo, Some(backend));
    redirector.enrol(&target(meshed)).expect("enrol");

    let mut conn = outsider
        .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
        .expect("connect");
    let (mut accepted, peer) = accept_within(&app, TIMEOUT).expect("the app got it directly");
    assert_eq!(peer.ip(), outsider.ip());
    check_bytes_flow(&mut conn, &mut accepted);
    assert!(accept_within(&proxy.outbound, QUIET).is_none());
    assert!(
        shunt_chains(outsider, backend).is_empty(),
        "the outsider was touched"
    );
    redirector.unenrol(&key(meshed)).expect("unenrol");
}

fn marked_direct(backend: Backend) {
    let (topo, pods) = topology("ipt-mark", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let proxy = StandIn::start(client);
    let mut redirector = redirector(&topo, Some(backend));
    redirector.enrol(&target(client)).expect("enrol");

    let mut conn = connect_raw(client, app_addr(server), PROXY_MARK, None);
    let (mut accepted, peer) = accept_within(&app, TIMEOUT).expect("the app got it directly");
    assert_eq!(peer.ip(), client.ip());
    check_bytes_flow(&mut conn, &mut accepted);
    assert!(accept_within(&proxy.outbound, QUIET).is_none());
    // Not counted as redirected either.
    assert_eq!(redirector.list()[0].counters.packets_out, 0);

    // The same connect without the mark is redirected (the rules are live).
    let _conn = connect_raw(client, app_addr(server), 0, None);
    assert!(accept_within(&proxy.outbound, TIMEOUT).is_some());
    redirector.unenrol(&key(client)).expect("unenrol");
}

fn inbound_redirected(backend: Backend) {
    let (topo, pods) = topology("ipt-in", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let proxy = StandIn::start(server);
    let mut redirector = redirector(&topo, Some(backend));
    redirector.enrol(&target(server)).expect("enrol");

    let mut conn = client
        .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
        .expect("connect");
    let (mut accepted, peer) =
        accept_within(&proxy.inbound, TIMEOUT).expect("the connection reached 15006");
    assert_eq!(peer.ip(), client.ip(), "the client's address is kept");
    // REDIRECT rewrites the destination to the pod's own address on the
    // listener's port; the original port comes from SO_ORIGINAL_DST.
    assert_eq!(
        accepted.local_addr().expect("local"),
        SocketAddr::from((server.ip(), 15006))
    );
    let original = redirector
        .original_dst_resolver()
        .original_dst(&accepted)
        .expect("original destination");
    assert_eq!(original, SocketAddr::V4(app_addr(server)));
    check_bytes_flow(&mut conn, &mut accepted);
    // The client still sees the address it connected to.
    assert_eq!(
        conn.peer_addr().expect("peer"),
        SocketAddr::V4(app_addr(server))
    );
    assert!(
        accept_within(&app, QUIET).is_none(),
        "the app was reached directly"
    );
    let counters = redirector.list()[0].counters;
    assert_eq!(counters.packets_in, 1, "{counters:?}");
    assert_eq!(counters.packets_out, 0, "{counters:?}");
    redirector.unenrol(&key(server)).expect("unenrol");
}

fn hbone_not_redirected(backend: Backend) {
    let (topo, pods) = topology("ipt-hbone", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let hbone_addr = SocketAddr::from((server.ip(), 15008));
    let hbone = server.listen_tcp(hbone_addr).expect("15008");
    let proxy = StandIn::start(server);
    let mut redirector = redirector(&topo, Some(backend));
    redirector.enrol(&target(server)).expect("enrol");

    let mut conn = client.connect_tcp(hbone_addr, TIMEOUT).expect("connect");
    let (mut accepted, _) = accept_within(&hbone, TIMEOUT).expect("15008 got it directly");
    assert_eq!(accepted.local_addr().expect("local"), hbone_addr);
    check_bytes_flow(&mut conn, &mut accepted);
    assert!(accept_within(&proxy.inbound, QUIET).is_none());
    redirector.unenrol(&key(server)).expect("unenrol");
}

fn removal_leaves_nothing(backend: Backend) {
    let (topo, pods) = topology("ipt-clean", &["pod"]);
    let pod = &pods[0];
    // Make the pod's IPv6 loopback usable, so the IPv6 policy route is
    // installed (and must be removed) too. No IPv6 traffic is sent.
    run_in(pod, "sysctl", &["-qw", "net.ipv6.conf.lo.disable_ipv6=0"]);
    let before = snapshot(pod, backend);
    let mut redirector = redirector(&topo, Some(backend));
    redirector.enrol(&target(pod)).expect("enrol");
    let during = snapshot(pod, backend);
    for expected in [
        ":SHUNT_OUTPUT -",
        "-j SHUNT_PRERT",
        "REDIRECT --to-ports 15001",
        "lookup 1337",
        "local default dev lo table 1337",
    ] {
        assert!(during.contains(expected), "no {expected:?} in:\n{during}");
    }
    assert!(
        during.matches("lookup 1337").count() == 2,
        "an IPv4 and an IPv6 rule:\n{during}"
    );
    // Enrolling again changes nothing.
    redirector.enrol(&target(pod)).expect("enrol again");
    assert_eq!(snapshot(pod, backend), during);
    assert_eq!(redirector.repairs(&key(pod)), Some(0));

    redirector.unenrol(&key(pod)).expect("unenrol");
    assert_eq!(snapshot(pod, backend), before, "something was left behind");
    // Unenrolling twice is an error, not a crash.
    assert!(redirector.unenrol(&key(pod)).is_err());
}

#[test]
fn drift_is_reported_and_enrol_repairs_it() {
    let (topo, pods) = topology("ipt-drift", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let proxy = StandIn::start(client);
    let mut redirector = redirector(&topo, None);
    let backend = redirector.backend();
    let iptables = backend_binary(backend, "");
    redirector.enrol(&target(client)).expect("enrol");

    // Someone deletes the REDIRECT rule by hand.
    run_in(
        client,
        &iptables,
        &[
            "-t",
            "nat",
            "-D",
            CHAIN_OUTPUT,
            "!",
            "-d",
            "127.0.0.1/32",
            "-p",
            "tcp",
            "-j",
            "REDIRECT",
            "--to-ports",
            "15001",
        ],
    );
    let Verification::Missing(missing) = redirector.verify(&key(client)).expect("verify") else {
        panic!("verify did not notice the deleted rule");
    };
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(
        missing[0].contains("REDIRECT --to-ports 15001"),
        "{missing:?}"
    );
    // Traffic now escapes the proxy: that is what drift costs.
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let _escaped = client
        .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
        .expect("connect");
    assert!(accept_within(&app, TIMEOUT).is_some());

    redirector.enrol(&target(client)).expect("repair");
    assert_eq!(redirector.repairs(&key(client)), Some(1));
    assert_eq!(
        redirector.verify(&key(client)).expect("verify"),
        Verification::Redirected
    );
    let _conn = client
        .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
        .expect("connect");
    assert!(
        accept_within(&proxy.outbound, TIMEOUT).is_some(),
        "redirected again"
    );

    // Now the jump, a mangle chain and the policy rule.
    let comment = redirector.owner_comment().to_string();
    run_in(
        client,
        &iptables,
        &[
            "-t",
            "nat",
            "-D",
            "OUTPUT",
            "-m",
            "comment",
            "--comment",
            &comment,
            "-j",
            CHAIN_OUTPUT,
        ],
    );
    run_in(client, &iptables, &["-t", "mangle", "-F", CHAIN_PREROUTING]);
    run_in(client, "ip", &["rule", "del", "pref", "32764"]);
    let Verification::Missing(missing) = redirector.verify(&key(client)).expect("verify") else {
        panic!("verify did not notice");
    };
    assert_eq!(missing.len(), 3, "{missing:?}");
    let all = missing.join("\n");
    for needle in [
        "jump OUTPUT -> SHUNT_OUTPUT",
        "mangle rule -A SHUNT_PRERT",
        "ip rule",
    ] {
        assert!(all.contains(needle), "no {needle:?} in {missing:?}");
    }
    redirector.enrol(&target(client)).expect("repair");
    assert_eq!(redirector.repairs(&key(client)), Some(2));
    assert_eq!(
        redirector.verify(&key(client)).expect("verify"),
        Verification::Redirected
    );
    redirector.unenrol(&key(client)).expect("unenrol");
}

#[test]
fn rules_already_in_the_pod_are_never_disturbed() {
    let (topo, pods) = topology("ipt-coexist", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let mut redirector = redirector(&topo, None);
    let backend = redirector.backend();
    let iptables = backend_binary(backend, "");
    // Someone else's rules: a chain of their own in nat, a DNAT in nat
    // OUTPUT, a mark in mangle, a filter rule.
    let decoy = Ipv4Addr::new(198, 18, 1, 250);
    let dnat_to = app_addr(server).to_string();
    let decoy_s = decoy.to_string();
    for args in [
        &["-t", "nat", "-N", "POD_CUSTOM"][..],
        &[
            "-t",
            "nat",
            "-A",
            "POD_CUSTOM",
            "-p",
            "udp",
            "--dport",
            "53",
            "-j",
            "RETURN",
        ],
        &["-t", "nat", "-A", "OUTPUT", "-p", "udp", "-j", "POD_CUSTOM"],
        &[
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-d",
            &decoy_s,
            "--dport",
            "9999",
            "-j",
            "DNAT",
            "--to-destination",
            &dnat_to,
        ],
        &[
            "-t",
            "mangle",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "--dport",
            "7777",
            "-j",
            "MARK",
            "--set-mark",
            "0x7000",
        ],
        &["-A", "INPUT", "-p", "tcp", "--dport", "9", "-j", "DROP"],
    ] {
        run_in(client, &iptables, args);
    }
    let theirs = |pod: &Pod| -> Vec<String> {
        run_in(pod, &backend_binary(backend, "save"), &[])
            .lines()
            .filter(|l| l.starts_with("-A") && !l.contains("SHUNT_"))
            .map(str::to_string)
            .collect()
    };
    let before = theirs(client);
    assert_eq!(before.len(), 5, "{before:?}");
    let snapshot_before = snapshot(client, backend);

    redirector.enrol(&target(client)).expect("enrol");
    assert_eq!(
        theirs(client),
        before,
        "enrolment changed someone else's rules"
    );
    assert_eq!(
        redirector.verify(&key(client)).expect("verify"),
        Verification::Redirected
    );

    // Traffic we do not redirect still meets their rules: the proxy's own
    // (marked) connect to the decoy is DNATed to the app by their rule,
    // because ours RETURN rather than ACCEPT.
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let _conn = connect_raw(client, SocketAddrV4::new(decoy, 9999), PROXY_MARK, None);
    assert!(
        accept_within(&app, TIMEOUT).is_some(),
        "their DNAT no longer applied to traffic we leave alone"
    );

    redirector.unenrol(&key(client)).expect("unenrol");
    assert_eq!(
        theirs(client),
        before,
        "unenrolment changed someone else's rules"
    );
    assert_eq!(snapshot(client, backend), snapshot_before);
}

#[test]
fn replies_to_transparent_inbound_connections_are_routed_back_to_the_proxy() {
    let (topo, pods) = topology("ipt-tproxy", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let app = server
        .listen_tcp(SocketAddr::V4(app_addr(server)))
        .expect("app");
    let mut redirector = redirector(&topo, None);
    redirector.enrol(&target(server)).expect("enrol");

    // The proxy's inbound connection to the app, from the original client's
    // address (a foreign address in this netns), with the proxy's mark. The
    // app's replies go to the client's address: only the connmark and the
    // policy route bring them back to this socket instead of out of eth0.
    let mut conn = connect_raw(server, app_addr(server), PROXY_MARK, Some(client.ip()));
    let (mut accepted, peer) = accept_within(&app, TIMEOUT).expect("the app accepted");
    assert_eq!(peer.ip(), client.ip(), "the app sees the original client");
    check_bytes_flow(&mut conn, &mut accepted);
    check_bytes_flow(&mut accepted, &mut conn);
    redirector.unenrol(&key(server)).expect("unenrol");
}

#[test]
fn a_new_agent_adopts_rules_in_place_and_removes_only_its_own_stale_ones() {
    let (topo, pods) = topology("ipt-stale", &["kept", "gone", "other", "server"]);
    let [kept, gone, other, server] = [&pods[0], &pods[1], &pods[2], &pods[3]];
    let backend = {
        let mut first = redirector(&topo, None);
        first.enrol(&target(kept)).expect("enrol");
        first.enrol(&target(gone)).expect("enrol");
        let _proxy = StandIn::start(kept);
        let _conn = kept
            .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
            .expect("connect");
        first.backend()
        // Dropped without unenrolling: what a killed agent leaves.
    };
    // Another node's agent on the same kernel.
    let mut other_agent =
        IptablesRedirector::new(IptablesOptions::new(format!("{}-node-b", topo.prefix())))
            .expect("redirector");
    other_agent.enrol(&target(other)).expect("enrol");

    let mut second = redirector(&topo, None);
    // `kept` is still handed to the new agent: adopted as is, counters too.
    second.enrol(&target(kept)).expect("adopt");
    assert_eq!(second.list()[0].counters.packets_out, 1);
    assert_eq!(second.remove_stale(), 1, "exactly `gone` was stale");
    assert!(shunt_chains(gone, backend).is_empty());
    assert!(!shunt_chains(kept, backend).is_empty());
    assert!(
        !shunt_chains(other, backend).is_empty(),
        "another agent's pod was touched"
    );
    assert_eq!(second.remove_stale(), 0);

    second.unenrol(&key(kept)).expect("unenrol");
    other_agent.unenrol(&key(other)).expect("unenrol");
}

#[test]
fn agent_binary_in_iptables_mode_enrols_reports_and_cleans_up() {
    let (topo, pods) = topology("ipt-agent", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(server, false),
    ]);
    let proxy = StandIn::start(client);
    let mut agent = Agent::start(
        &topo,
        node,
        &yaml,
        // The test's listener stands in for the proxy.
        &[
            "--redirect",
            "iptables",
            "--capture",
            "on",
            "--proxy",
            "external",
        ],
    )
    .expect("agent");
    let status = agent
        .wait_for("client enrolled", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| p.name == client.name() && p.state == PodState::Enrolled)
        })
        .expect("enrolled");
    assert_eq!(status.mode, "iptables");
    let pod = status
        .pods
        .iter()
        .find(|p| p.name == client.name())
        .expect("client in status");
    assert!(
        !pod.hooks.is_empty() && pod.hooks.iter().all(|h| h.present),
        "{:?}",
        pod.hooks
    );

    let _conn = client
        .connect_tcp(SocketAddr::V4(app_addr(server)), TIMEOUT)
        .expect("connect");
    assert!(
        accept_within(&proxy.outbound, TIMEOUT).is_some(),
        "not redirected"
    );
    let status = agent
        .wait_for("the redirect counted", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| p.name == client.name() && p.counters.is_some_and(|c| c.packets_out == 1))
        })
        .expect("counted");
    assert_eq!(status.mode, "iptables");

    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "agent exit: {exit}\n{}", agent.logs());
    let backend = if Command::new("iptables-nft-save").output().is_ok() {
        Backend::Nft
    } else {
        Backend::Legacy
    };
    assert!(shunt_chains(client, backend).is_empty(), "{}", agent.logs());
    assert!(!run_in(client, "ip", &["rule", "show"]).contains("1337"));
}
