//! The testbed's own tests: real namespaces, real traffic, all in 198.18/15.
//! Each test builds its own topology, so they run in parallel.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::unix::fs::MetadataExt,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use shunt_testbed::{
    Cgroup, Pod, TestbedError, Topology, cgroup2_mount, require_root, sweep_stale,
};

const TIMEOUT: Duration = Duration::from_secs(5);

fn netns_list() -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    assert!(out.status.success(), "ip netns list: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

fn remaining_netns(prefix: &str) -> Vec<String> {
    let owned = format!("{prefix}-");
    netns_list()
        .into_iter()
        .filter(|n| n.starts_with(&owned))
        .collect()
}

/// Two nodes, two pods each.
fn two_by_two(test: &str) -> Topology {
    require_root().expect("root");
    let mut topo = Topology::new(test).expect("topology");
    topo.add_node("n1").expect("node n1");
    topo.add_node("n2").expect("node n2");
    topo.add_pod("n1", "a1").expect("pod a1");
    topo.add_pod("n1", "a2").expect("pod a2");
    topo.add_pod("n2", "b1").expect("pod b1");
    topo.add_pod("n2", "b2").expect("pod b2");
    topo
}

/// Serves one connection on `server`, echoing until EOF, and checks that
/// `client` gets its bytes back.
fn echo(client: &Pod, server: &Pod, port: u16) {
    let addr = SocketAddr::from((server.ip(), port));
    let listener = server.listen_tcp(addr).expect("listen");
    let echo = thread::spawn(move || {
        let (mut conn, peer) = listener.accept().expect("accept");
        conn.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut buf = [0u8; 4096];
        let mut total = 0;
        loop {
            let n = conn.read(&mut buf).expect("server read");
            if n == 0 {
                break;
            }
            conn.write_all(&buf[..n]).expect("server write");
            total += n;
        }
        (peer, total)
    });

    let mut conn = client.connect_tcp(addr, TIMEOUT).expect("connect");
    conn.set_read_timeout(Some(TIMEOUT)).unwrap();
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let writer = {
        let mut conn = conn.try_clone().unwrap();
        let payload = payload.clone();
        thread::spawn(move || {
            conn.write_all(&payload).expect("client write");
            conn.shutdown(std::net::Shutdown::Write).unwrap();
        })
    };
    let mut back = Vec::new();
    conn.read_to_end(&mut back).expect("client read");
    writer.join().unwrap();
    let (peer, total) = echo.join().unwrap();
    assert_eq!(total, payload.len());
    assert_eq!(back, payload);
    // No NAT anywhere: the server sees the client pod's own address.
    assert_eq!(peer.ip(), client.ip());
}

#[test]
fn addresses_follow_the_plan() {
    let topo = two_by_two("addresses_follow_the_plan");
    let n1 = topo.node("n1").unwrap();
    let n2 = topo.node("n2").unwrap();
    assert_eq!((n1.index(), n2.index()), (1, 2));
    assert_eq!(n1.ip(), Ipv4Addr::new(198, 19, 0, 1));
    assert_eq!(n2.gateway(), Ipv4Addr::new(198, 18, 2, 1));
    assert_eq!(n2.pod_cidr().to_string(), "198.18.2.0/24");
    assert_eq!(topo.pod("a1").unwrap().ip(), Ipv4Addr::new(198, 18, 1, 10));
    assert_eq!(topo.pod("b2").unwrap().ip(), Ipv4Addr::new(198, 18, 2, 11));
    for name in topo.netns_names() {
        assert!(name.starts_with(&format!("shunt-t{}-", std::process::id())));
        assert!(Path::new("/var/run/netns").join(name).exists(), "{name}");
    }
    let a1 = topo.pod("a1").unwrap();
    assert_eq!(
        a1.netns_path(),
        Path::new("/var/run/netns").join(a1.netns_name())
    );
    assert_eq!(a1.netns_name(), format!("{}-a1", topo.prefix()));

    // Node forwards, and nothing speaks IPv6. Read through `command` to
    // check it enters the right netns.
    let read = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    assert_eq!(
        read(n1.command("cat").arg("/proc/sys/net/ipv4/ip_forward")),
        "1"
    );
    assert_eq!(
        read(
            a1.command("cat")
                .arg("/proc/sys/net/ipv6/conf/all/disable_ipv6")
        ),
        "1"
    );
    let addrs = read(
        a1.command("ip")
            .args(["-4", "-o", "addr", "show", "dev", "eth0"]),
    );
    assert!(addrs.contains("198.18.1.10/24"), "{addrs}");
    let routes = read(n1.command("ip").args(["route", "show", "198.18.2.0/24"]));
    assert!(routes.contains("via 198.19.0.2"), "{routes}");

    // Invalid requests fail without side effects on the topology.
    let mut topo = topo;
    assert!(matches!(
        topo.add_pod("nope", "x"),
        Err(TestbedError::Invalid(_))
    ));
    assert!(matches!(topo.add_node("n1"), Err(TestbedError::Invalid(_))));
    assert!(matches!(
        topo.add_pod("n1", "a1"),
        Err(TestbedError::Invalid(_))
    ));
    assert!(matches!(
        topo.add_pod_with_ip("n1", "c", Ipv4Addr::new(198, 18, 2, 50)),
        Err(TestbedError::Invalid(_))
    ));
    let c = topo
        .add_pod_with_ip("n1", "c", Ipv4Addr::new(198, 18, 1, 77))
        .expect("pod with chosen ip");
    assert_eq!(c.ip(), Ipv4Addr::new(198, 18, 1, 77));
}

#[test]
fn tcp_passes_same_node_and_cross_node() {
    let topo = two_by_two("tcp_passes_same_node_and_cross_node");
    let [a1, a2, b1, b2] = ["a1", "a2", "b1", "b2"].map(|n| topo.pod(n).unwrap().clone());
    echo(&a1, &a2, 8080); // same node
    echo(&a1, &b1, 8080); // cross node
    echo(&b2, &a2, 9090); // cross node, the other way
    echo(&b2, &b1, 9090); // same node on the second node

    // A pod reaches a node's gateway and another node's fabric address.
    let node2 = topo.node("n2").unwrap();
    let listener = node2
        .listen_tcp(SocketAddr::from((node2.ip(), 7000)))
        .unwrap();
    let _conn = a1
        .connect_tcp(SocketAddr::from((node2.ip(), 7000)), TIMEOUT)
        .expect("pod to remote node");
    let (_, peer) = listener.accept().unwrap();
    assert_eq!(peer.ip(), a1.ip());
}

#[test]
fn sockets_work_from_any_thread_and_addresses_are_guarded() {
    let topo = two_by_two("sockets_work_from_any_thread");
    let a1 = topo.pod("a1").unwrap();
    // Loopback inside the pod is its own: a listener there is not visible
    // from the node.
    let listener = a1.listen_tcp("127.0.0.1:5000".parse().unwrap()).unwrap();
    let inside = a1.connect_tcp("127.0.0.1:5000".parse().unwrap(), TIMEOUT);
    assert!(inside.is_ok());
    drop(listener);
    let refused = topo
        .node("n1")
        .unwrap()
        .connect_tcp("127.0.0.1:5000".parse().unwrap(), TIMEOUT);
    assert!(refused.is_err());

    // Addresses outside the test range are refused before any packet.
    let forbidden = a1.connect_tcp("192.0.2.1:80".parse().unwrap(), TIMEOUT);
    assert!(matches!(
        forbidden,
        Err(TestbedError::ForbiddenAddress { .. })
    ));

    // `run` executes inside the netns (the pod's cookie differs from ours).
    let ours = shunt::netns::NetNs::current().unwrap().cookie().unwrap();
    let pods = a1
        .run(shunt::netns::netns_cookie_of_current_thread)
        .unwrap()
        .unwrap();
    assert_ne!(ours, pods);
    assert_eq!(a1.netns().unwrap().cookie().unwrap(), pods);
}

fn proc_cgroup(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        .unwrap()
}

#[test]
fn process_starts_in_cgroup_and_pod_netns() {
    let topo = two_by_two("process_starts_in_cgroup");
    let root = topo.cgroup_root().unwrap();
    assert!(root.starts_with(cgroup2_mount().unwrap()));
    assert!(root.ends_with(topo.prefix()));
    let cg = Cgroup::create(&topo, "app").expect("cgroup");
    assert_eq!(cg.path(), root.join("app"));
    assert!(cg.id().unwrap() > 1);

    let a1 = topo.pod("a1").unwrap();
    let mut cmd = a1.command("sleep");
    cmd.arg("30").stdin(Stdio::null());
    let mut child = cg.place(&mut cmd).spawn().expect("spawn sleep");
    let pid = child.id();
    assert_eq!(proc_cgroup(pid), cg.hierarchy_path());
    assert_eq!(cg.pids().unwrap(), vec![pid]);
    // nsenter enters the netns after it starts, then execs sleep: wait for
    // the exec before comparing namespaces.
    let deadline = Instant::now() + TIMEOUT;
    while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap() != "sleep\n" {
        assert!(Instant::now() < deadline, "nsenter never exec'd sleep");
        thread::sleep(Duration::from_millis(5));
    }
    let netns_ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
    assert_eq!(
        netns_ino(Path::new(&format!("/proc/{pid}/ns/net"))),
        netns_ino(&a1.netns_path())
    );

    // Dropping the cgroup kills the process it started and removes the dir.
    let path = cg.path().to_path_buf();
    drop(cg);
    assert!(!path.exists());
    let status = child.wait().unwrap();
    assert!(!status.success());
}

#[test]
fn cgroup_drop_returns_moved_processes() {
    require_root().unwrap();
    let topo = Topology::new("cgroup_drop_returns_moved_processes").unwrap();
    let cg = Cgroup::create(&topo, "moved").unwrap();
    // Started outside the cgroup, then moved in: on drop it must survive and
    // go back where it was.
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id();
    let before = proc_cgroup(pid);
    cg.add_pid(pid).unwrap();
    assert_eq!(proc_cgroup(pid), cg.hierarchy_path());
    drop(cg);
    assert_eq!(proc_cgroup(pid), before);
    assert!(
        child.try_wait().unwrap().is_none(),
        "moved-in process was killed"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn drop_removes_namespaces_and_cgroups() {
    let topo = two_by_two("drop_removes_namespaces_and_cgroups");
    let prefix = topo.prefix().to_string();
    let names = topo.netns_names().to_vec();
    assert_eq!(names.len(), 7); // fabric, 2 nodes, 4 pods
    assert_eq!(remaining_netns(&prefix).len(), 7);
    let cg = Cgroup::create(&topo, "leftover").unwrap();
    let root = topo.cgroup_root().unwrap();
    // A cgroup that outlives its topology (leaked here) is still removed,
    // and so is a nested dir an agent might make below the root.
    std::fs::create_dir(root.join("agent-made")).unwrap();
    std::mem::forget(cg);
    drop(topo);
    assert_eq!(remaining_netns(&prefix), Vec::<String>::new());
    assert!(!root.exists());
}

#[test]
fn drop_during_panic_cleans_up() {
    require_root().unwrap();
    let mut seen = None;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut topo = Topology::new("drop_during_panic_cleans_up").unwrap();
        topo.add_node("n1").unwrap();
        topo.add_pod("n1", "p").unwrap();
        let root = topo.cgroup_root().unwrap();
        seen = Some((topo.prefix().to_string(), root));
        panic!("test body fails");
    }));
    assert!(result.is_err());
    let (prefix, root) = seen.unwrap();
    assert_eq!(remaining_netns(&prefix), Vec::<String>::new());
    assert!(!root.exists());
}

/// A PID that no process has, searched from the top of the PID space, where
/// the kernel is least likely to hand it out during the test.
fn dead_pid() -> u32 {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (1..10_000)
        .map(|i| max - i)
        .find(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        .expect("a free pid")
}

#[test]
fn stale_namespaces_and_cgroups_are_swept() {
    require_root().unwrap();
    let pid = dead_pid();
    // The counter field carries our own PID so concurrent runs of this test
    // in other processes (which may pick the same dead PID) never collide.
    let n = std::process::id();
    let name = format!("shunt-t{pid}-{n}-x");
    // `ip netns add` creates the file before bind-mounting onto it; a sweep in
    // a concurrent test process may delete the (rightly stale-looking) name
    // in between, so retry a few times.
    let mut created = None;
    for _ in 0..20 {
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .unwrap();
        if out.status.success() {
            created = Some(out);
            break;
        }
        let _ = Command::new("ip").args(["netns", "delete", &name]).output();
        thread::sleep(Duration::from_millis(20));
    }
    assert!(created.is_some(), "cannot create {name}");
    let stale_cg = cgroup2_mount()
        .unwrap()
        .join("shunt-test")
        .join(format!("shunt-t{pid}-{n}"));
    std::fs::create_dir_all(stale_cg.join("app")).unwrap();

    // Something that only looks similar is left alone.
    let not_ours = format!("shunt-tx{pid}-{n}-x");
    let out = Command::new("ip")
        .args(["netns", "add", &not_ours])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    // Creating a topology sweeps; parallel tests may have swept first, so
    // only the outcome is checked, not who did it.
    let topo = Topology::new("stale_namespaces_are_swept").unwrap();
    let after = netns_list();
    assert!(!after.contains(&name), "stale netns {name} survived");
    assert!(!stale_cg.exists(), "stale cgroup survived");
    assert!(after.contains(&not_ours));
    let _ = Command::new("ip")
        .args(["netns", "delete", &not_ours])
        .status();

    // A live topology is never swept.
    let mut topo = topo;
    topo.add_node("n1").unwrap();
    let report = sweep_stale().unwrap();
    assert!(!report.netns.iter().any(|n| n.starts_with(topo.prefix())));
    assert_eq!(remaining_netns(topo.prefix()).len(), 2);
}

#[test]
fn parallel_topologies_do_not_collide() {
    require_root().unwrap();
    let start = Instant::now();
    let prefixes: Vec<String> = thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                scope.spawn(move || {
                    let mut topo = Topology::new(&format!("parallel-{i}")).unwrap();
                    topo.add_node("n").unwrap();
                    let p = topo.add_pod("n", "p").unwrap();
                    let q = topo.add_pod("n", "q").unwrap();
                    let listener = q.listen_tcp(SocketAddr::from((q.ip(), 80))).unwrap();
                    let _c: TcpStream = p
                        .connect_tcp(SocketAddr::from((q.ip(), 80)), TIMEOUT)
                        .unwrap();
                    listener.accept().unwrap();
                    topo.prefix().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut unique = prefixes.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), prefixes.len());
    for prefix in &prefixes {
        assert!(remaining_netns(prefix).is_empty());
    }
    assert!(start.elapsed() < Duration::from_secs(60));
}
