//! Splice on the real kernel: payload between an application and the proxy
//! inside its pod moves by sk_msg, skipping the TCP stack, and stays bounded
//! when a reader falls behind (`ebpf/src/splice.rs`). The application is the
//! real testapp in a pod, the proxy the real agent's; the far end is an echo
//! server outside the mesh (passthrough), so every byte crosses the splice
//! twice, once each way.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::Duration,
};

use serde_json::Value;
use shunt::api::{Counters, NodeStatus, PodState};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, MeshNode, WorkloadSpec, workloads_yaml},
    apps::{EchoServer, TestApp, ok},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const GIB: u64 = 1 << 30;

/// A node with a mesh client and a non-mesh echo server, and an agent with
/// `splice_args`.
struct Node {
    agent: Agent,
    client: Pod,
    server: Pod,
    _echo: EchoServer,
    to_server: String,
    // Last: the namespaces go after everything in them.
    apps_cgroup: Cgroup,
    _topology: Topology,
}

/// A node; the client has IPv6 on its `lo` (only there), so its proxy
/// serves [::1]:15001 too.
fn node(test: &str, splice_args: &[&str]) -> Node {
    node_with(test, splice_args, None)
}

/// As [`node`], the client having its own say on splicing (`splice:` in
/// the workloads file, as the `shunt.io/splice` annotation).
fn node_with(test: &str, splice_args: &[&str], client_splice: Option<bool>) -> Node {
    require_root().expect("kernel tests need root");
    let (topology, pods) = Topology::single_node(test, &["client", "server"]).expect("topology");
    let (client, server) = (pods[0].clone(), pods[1].clone());
    client
        .enable_ipv6_loopback()
        .expect("::1 on the client's lo");
    let yaml = workloads_yaml(&[
        WorkloadSpec {
            splice: client_splice,
            ..WorkloadSpec::for_pod(&client, true)
        },
        WorkloadSpec::for_pod(&server, false),
    ]);
    let node = topology.node("node-a").expect("node").clone();
    let mut args = vec!["--redirect", "ebpf"];
    args.extend_from_slice(splice_args);
    let mut agent = Agent::start(&topology, &node, &yaml, &args).expect("agent");
    agent
        .wait_for("the client enrolled", TIMEOUT, |s| enrolled(s, &client))
        .expect("enrolled");
    let echo = EchoServer::on(&server, 8080).expect("echo");
    let apps_cgroup = Cgroup::create(&topology, "apps").expect("cgroup");
    Node {
        agent,
        to_server: format!("{}:8080", server.ip()),
        client,
        server,
        _echo: echo,
        apps_cgroup,
        _topology: topology,
    }
}

impl Node {
    /// Runs the testapp in the client pod.
    fn run(&self, args: &[&str]) -> Value {
        TestApp::new(TESTAPP, &self.apps_cgroup).run(&self.client, args)
    }
}

fn enrolled(status: &NodeStatus, pod: &Pod) -> bool {
    status
        .pods
        .iter()
        .any(|p| p.name == pod.name() && p.state == PodState::Enrolled)
}

fn counters(node: &Node) -> Counters {
    let status = node.agent.status_after_verify(TIMEOUT).expect("status");
    status
        .pods
        .iter()
        .find(|p| p.name == node.client.name())
        .and_then(|p| p.counters)
        .expect("client counters")
}

fn as_u64(report: &Value, field: &str) -> u64 {
    report[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {report}"))
}

#[test]
fn spliced_payload_skips_the_tcp_stack_and_unspliced_does_not() {
    // Below the backlog bound in total, so neither direction can fall back
    // however the threads are scheduled.
    let payload = 512 << 10;
    let send = payload.to_string();

    let on = node("splice-on", &["--splice", "on"]);
    let report = on.run(&["connect", &on.to_server, "--send", &send, "--poll"]);
    assert!(ok(&report), "{report}\n{}", on.agent.logs());
    // The app's socket sent nothing through TCP: sk_msg moved every byte.
    assert_eq!(as_u64(&report, "tcp_bytes_sent"), 0, "{report}");
    // ... and received at most the proxy's FIN (which counts as one byte).
    assert!(as_u64(&report, "tcp_bytes_received") <= 1, "{report}");
    let c = counters(&on);
    assert!(
        c.spliced_bytes >= 2 * payload,
        "both directions spliced: {c:?}"
    );
    assert_eq!(c.splice_fallbacks, 0, "{c:?}");

    // An IPv6 socket reaching IPv4 (v4-mapped, as dual-stack clients do):
    // connect6 sends it to the proxy's IPv4 listener; both ends are keyed
    // as IPv4, so it splices too.
    let mapped = on
        .to_server
        .replace("198.", "[::ffff:198.")
        .replace(":8080", "]:8080");
    let report = on.run(&["connect", &mapped, "--send", &send, "--poll"]);
    assert!(ok(&report), "{report}\n{}", on.agent.logs());
    assert_eq!(as_u64(&report, "tcp_bytes_sent"), 0, "{report}");
    assert!(counters(&on).spliced_bytes >= 4 * payload);
    drop(on);

    let off = node("splice-off", &["--splice", "off"]);
    let report = off.run(&["connect", &off.to_server, "--send", &send, "--poll"]);
    assert!(ok(&report), "{report}\n{}", off.agent.logs());
    assert!(as_u64(&report, "tcp_bytes_sent") >= payload, "{report}");
    assert!(as_u64(&report, "tcp_bytes_received") >= payload, "{report}");
    assert_eq!(counters(&off).spliced_bytes, 0);
}

/// `TCP: ... mem N` of /proc/net/sockstat: pages the whole kernel has
/// allocated for TCP.
fn tcp_mem_pages() -> u64 {
    let sockstat = std::fs::read_to_string("/proc/net/sockstat").expect("sockstat");
    sockstat
        .lines()
        .find(|l| l.starts_with("TCP:"))
        .and_then(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let at = fields.iter().position(|f| *f == "mem")?;
            fields.get(at + 1)?.parse().ok()
        })
        .expect("TCP mem in /proc/net/sockstat")
}

/// Runs a 1 GiB echo through the node with a reader that falls behind,
/// sampling kernel TCP memory meanwhile; returns the report and the peak
/// growth over the level before, in pages.
fn transfer_gib(node: &Node) -> (Value, u64) {
    let baseline = tcp_mem_pages();
    let peak = Arc::new(AtomicU64::new(baseline));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        thread::spawn(move || {
            // Bounded: the transfer has its own timeout; 20 min at most.
            for _ in 0..240_000 {
                if done.load(Ordering::Relaxed) {
                    break;
                }
                peak.fetch_max(tcp_mem_pages(), Ordering::Relaxed);
                thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let send = GIB.to_string();
    let report = node.run(&[
        "connect",
        &node.to_server,
        "--send",
        &send,
        // 20 ms asleep per MiB read: long enough for the bytes in flight
        // on the other legs to pile up at the client past the bound.
        "--slow-read-ms",
        "20",
        "--timeout-ms",
        "180000",
        // Event-loop style: see `--splice` in `shunt agent --help`.
        "--poll",
    ]);
    done.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");
    (
        report,
        peak.load(Ordering::Relaxed).saturating_sub(baseline),
    )
}

#[test]
fn a_gib_through_a_slow_reader_stays_bounded_with_splice_on() {
    let off = node("splice-gib-off", &["--splice", "off"]);
    let (report_off, peak_off) = transfer_gib(&off);
    assert!(ok(&report_off), "{report_off}\n{}", off.agent.logs());
    drop(off);

    // A backlog bound a quarter of the default: the reader's pauses must
    // leave it behind by more than the bound whatever the machine's speed
    // (at the default 1 MiB and 2 ms pauses an idle machine's reader
    // sometimes kept up and never tripped it).
    let on = node(
        "splice-gib-on",
        &["--splice", "on", "--splice-backlog", "262144"],
    );
    let (report_on, peak_on) = transfer_gib(&on);
    // Complete, in order (the testapp checks the pattern byte by byte) and
    // no write failed (ENOMEM would end the run with ok: false).
    assert!(ok(&report_on), "{report_on}\n{}", on.agent.logs());
    assert_eq!(as_u64(&report_on, "received"), GIB, "{report_on}");
    let c = counters(&on);
    assert!(c.spliced_bytes > 0, "{c:?}");
    assert!(
        c.splice_fallbacks >= 1,
        "the slow reader must have tripped the backlog bound: {c:?}"
    );
    eprintln!(
        "peak kernel TCP memory growth: splice off {peak_off} pages, splice on {peak_on} pages; {c:?}"
    );
    // What the README claims: bounded, within twice splice off's peak for
    // the same transfer (runs have measured a quarter of it and a third
    // more than it: the claim is the bound, not a saving).
    assert!(
        peak_on <= 2 * peak_off.max(256),
        "splice on peaked at {peak_on} pages of TCP memory, over twice splice off's {peak_off}"
    );
}

#[test]
fn splicing_survives_a_kill_9_and_restart_of_the_agent() {
    let args = ["--redirect", "ebpf", "--splice", "on"];
    let mut on = node("splice-restart", &args[2..]);
    let send = (64 << 10).to_string();
    let connect = ["connect", &on.to_server, "--send", &send, "--poll"];
    let before = on.run(&connect);
    assert!(ok(&before), "{before}");
    assert_eq!(as_u64(&before, "tcp_bytes_sent"), 0, "{before}");

    on.agent.kill().expect("kill -9");
    on.agent.restart(&args).expect("restart");
    let client = on.client.clone();
    on.agent
        .wait_for("the client enrolled again", TIMEOUT, |s| {
            enrolled(s, &client)
        })
        .expect("enrolled");
    // The new agent adopted the pinned receive hook and the splice map
    // with its program: new connections are spliced as before.
    assert!(
        on.agent.logs().contains(
            "splice receive hook attached by a previous agent is this release's; keeping it"
        ),
        "{}",
        on.agent.logs()
    );
    let after = on.run(&connect);
    assert!(ok(&after), "{after}\n{}", on.agent.logs());
    assert_eq!(as_u64(&after, "tcp_bytes_sent"), 0, "{after}");
    assert!(counters(&on).spliced_bytes >= 2 * (64 << 10));
}

#[test]
fn native_ipv6_sockets_are_spliced_to_the_proxys_ipv6_listener() {
    let payload = 256 << 10;
    let send = payload.to_string();
    let on = node("splice-v6", &["--splice", "on"]);
    // The server's 198.18/15 address in the well-known NAT64 prefix
    // (RFC 6052), made local to the client pod, with an echo server there:
    // the app's connect goes to the proxy's [::1]:15001 (connect6), the
    // proxy's passthrough connect is delivered inside the same netns. No
    // packet leaves the pod (IPv6 is on its `lo` only).
    on.client
        .make_ipv6_prefix_local("64:ff9b::/96")
        .expect("local NAT64 prefix");
    let vip = on.server.nat64_ip();
    let listener = on
        .client
        .listen_tcp("[::]:8080".parse().expect("addr"))
        .expect("listen in the client pod");
    let _echo6 = EchoServer::start(listener, None);

    let to = format!("[{vip}]:8080");
    let report = on.run(&["connect", &to, "--send", &send, "--poll"]);
    assert!(ok(&report), "{report}\n{}", on.agent.logs());
    assert_eq!(as_u64(&report, "received"), payload, "{report}");
    // The app's socket is a native IPv6 socket on ::1, and sk_msg moved
    // its bytes to the proxy's IPv6 listener.
    assert!(
        report["local"]
            .as_str()
            .is_some_and(|l| l.starts_with("[::1]:")),
        "{report}"
    );
    assert_eq!(as_u64(&report, "tcp_bytes_sent"), 0, "{report}");
    let c = counters(&on);
    assert!(c.spliced_bytes >= 2 * payload, "{c:?}");
    assert_eq!(c.splice_fallbacks, 0, "{c:?}");
}

/// Runs the testapp in the client pod like [`Node::run`], killing it (by
/// its PID) if it has not finished within `TIMEOUT`.
fn run_bounded(node: &Node, args: &[&str]) -> Value {
    let mut child = TestApp::new(TESTAPP, &node.apps_cgroup)
        .command(&node.client, args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the testapp");
    let start = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the testapp did not finish within {TIMEOUT:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut out, &mut stdout);
    }
    serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("the testapp printed {stdout:?}: {e}"))
}

#[test]
fn a_blocking_read_on_a_spliced_socket_returns_eagain_spuriously() {
    // Why blocking readers must stay off the splice (README, "Splice"): on
    // a spliced socket the kernel's sockmap receive path ends a blocking
    // read woken without data with EAGAIN instead of waiting on. The
    // testapp's reader blocks (no read timeout, so no EAGAIN is legitimate)
    // while its writer thread sends 1 byte and shuts down its side; it
    // counts the EAGAINs and reads on, so the transfer still completes.
    let on = node("splice-eagain", &["--splice", "on"]);
    // Most runs show it on 6.18 (24 of 25 alone when this was written; a
    // CI run beside other tests once saw 5 in a row without): run until
    // one does, at most EAGAIN_TRIES times. One proves the behaviour.
    let mut eagains = Vec::new();
    while eagains.len() < EAGAIN_TRIES && !eagains.iter().any(|&n| n >= 1) {
        let report = run_bounded(
            &on,
            &["connect", &on.to_server, "--send", "1", "--retry-eagain"],
        );
        assert!(ok(&report), "{report}\n{}", on.agent.logs());
        assert_eq!(as_u64(&report, "tcp_bytes_sent"), 0, "spliced: {report}");
        eagains.push(as_u64(&report, "eagain"));
    }
    eprintln!("EAGAINs per run on a spliced blocking socket: {eagains:?}");
    assert!(
        eagains.iter().any(|&n| n >= 1),
        "no EAGAIN in {EAGAIN_TRIES} runs on a spliced blocking socket: {eagains:?}"
    );

    // The same application in a pod that opted out: not one.
    let off = node_with("splice-eagain-optout", &["--splice", "on"], Some(false));
    for _ in 0..EAGAIN_RUNS {
        let report = run_bounded(
            &off,
            &["connect", &off.to_server, "--send", "1", "--retry-eagain"],
        );
        assert!(ok(&report), "{report}\n{}", off.agent.logs());
        assert!(
            as_u64(&report, "tcp_bytes_sent") >= 1,
            "not spliced: {report}"
        );
        assert_eq!(as_u64(&report, "eagain"), 0, "{report}");
    }
}

/// Runs of the blocking-read test's opted-out half (none may see EAGAIN).
const EAGAIN_RUNS: usize = 5;
/// At most this many runs of its spliced half, until one sees EAGAIN.
const EAGAIN_TRIES: usize = 25;

#[test]
fn a_pod_that_opts_out_is_never_spliced_and_its_blocking_reads_work() {
    // Blocking sockets, the writer thread shutting down its side while the
    // reader waits (`transfer_threaded` in the testapp, 1 byte): on a
    // spliced socket the kernel's sockmap receive path can end that wait
    // with EAGAIN (see `ebpf/src/splice.rs`). Such a pod opts out.
    let node = node_with("splice-optout", &["--splice", "on"], Some(false));
    for size in ["1", "100000"] {
        for run in 0..3 {
            let report = node.run(&["connect", &node.to_server, "--send", size]);
            assert!(
                ok(&report),
                "{size} B, run {run}: {report}\n{}",
                node.agent.logs()
            );
            assert!(as_u64(&report, "tcp_bytes_sent") >= 1, "{report}");
        }
    }
    // Event-loop sockets of the pod are not spliced either.
    let report = node.run(&["connect", &node.to_server, "--send", "65536", "--poll"]);
    assert!(ok(&report), "{report}");
    assert!(as_u64(&report, "tcp_bytes_sent") >= 65536, "{report}");
    let c = counters(&node);
    assert_eq!(c.spliced_bytes, 0, "{c:?}");
    assert!(c.outbound_redirected >= 7, "still redirected: {c:?}");
}

#[test]
fn with_splice_opt_in_only_pods_that_opt_in_are_spliced() {
    let payload = 65536u64;
    let send = payload.to_string();
    for (client_says, spliced) in [(None, false), (Some(false), false), (Some(true), true)] {
        let node = node_with("splice-optin", &["--splice", "opt-in"], client_says);
        let report = node.run(&["connect", &node.to_server, "--send", &send, "--poll"]);
        assert!(
            ok(&report),
            "{client_says:?}: {report}\n{}",
            node.agent.logs()
        );
        // `shunt status` shows the splice hook for spliced pods only.
        let status = node.agent.status().expect("status");
        let client = status
            .pods
            .iter()
            .find(|p| p.name == node.client.name())
            .expect("client in the status");
        assert_eq!(
            client.hooks.iter().any(|h| h.name == "splice" && h.present),
            spliced,
            "{client_says:?}: {:?}",
            client.hooks
        );
        let c = counters(&node);
        if spliced {
            assert_eq!(as_u64(&report, "tcp_bytes_sent"), 0, "{report}");
            assert!(c.spliced_bytes >= 2 * payload, "{c:?}");
        } else {
            assert!(as_u64(&report, "tcp_bytes_sent") >= payload, "{report}");
            assert_eq!(c.spliced_bytes, 0, "{client_says:?}: {c:?}");
        }
    }
}

/// The spliced bytes the agent counted for `pod`.
fn spliced_bytes(agent: &Agent, pod: &Pod) -> u64 {
    let status = agent.status_after_verify(TIMEOUT).expect("status");
    status
        .pods
        .iter()
        .find(|p| p.name == pod.name())
        .and_then(|p| p.counters)
        .map(|c| c.spliced_bytes)
        .unwrap_or_else(|| panic!("no counters for {}", pod.name()))
}

/// Starts the testapp's echo server (`serve`) in `node`'s server pod for
/// `conns` connections; returns once it listens. An application process in
/// the apps cgroup, as a pod's containers are, so the socket programs see
/// its accepted sockets.
fn serve(node: &MeshNode, conns: usize) -> Server {
    let addr = format!("{}:8080", node.server.ip());
    let conns = conns.to_string();
    let mut child = TestApp::new(TESTAPP, &node.apps)
        .command(
            &node.server,
            &["serve", &addr, "--conns", &conns, "--timeout-ms", "20000"],
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the echo server");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert!(first.contains("listening"), "the server said {first:?}");
    Server { child, lines }
}

/// A running `shunt-testapp serve`.
struct Server {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Server {
    /// Waits for the server's report (it exits after its connections).
    fn report(mut self) -> Value {
        let last = self.lines.by_ref().map_while(Result::ok).last();
        let _ = self.child.wait();
        last.and_then(|l| serde_json::from_str(&l).ok())
            .unwrap_or_else(|| serde_json::json!({"ok": false, "error": "no report"}))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Ours, by PID; a no-op once it exited.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn inbound_deliveries_to_the_application_are_spliced_too() {
    let payload = 256u64 << 10;
    let send = payload.to_string();
    require_root().expect("kernel tests need root");
    let node =
        MeshNode::start("splice-inbound", &["--redirect", "ebpf", "--splice", "on"]).expect("node");
    let run = |pod: &Pod, args: &[&str]| TestApp::new(TESTAPP, &node.apps).run(pod, args);
    let to_server = format!("{}:8080", node.server.ip());

    // Over HBONE: the client's leg to 15001 and the server's leg from the
    // proxy to the application both splice, each both ways.
    let server = serve(&node, 1);
    let report = run(
        &node.client,
        &["connect", &to_server, "--send", &send, "--poll"],
    );
    assert!(ok(&report), "{report}\n{}", node.agent.logs());
    assert_eq!(as_u64(&report, "received"), payload, "{report}");
    assert_eq!(as_u64(&report, "tcp_bytes_sent"), 0, "{report}");
    let served = server.report();
    assert_eq!(served["ok"], true, "{served}");
    assert_eq!(as_u64(&served, "echoed"), payload, "{served}");
    // The application's accepted socket sent its echo through sk_msg.
    assert_eq!(as_u64(&served, "tcp_bytes_sent"), 0, "{served}");
    let server_after_hbone = spliced_bytes(&node.agent, &node.server);
    assert!(
        server_after_hbone >= 2 * payload,
        "the server's inbound leg spliced {server_after_hbone} bytes"
    );

    // Plaintext from outside the mesh (15006): the delivery leg splices,
    // from the client's own address (source preservation is on).
    let server = serve(&node, 1);
    let report = run(&node.outsider, &["connect", &to_server, "--send", &send]);
    assert!(ok(&report), "{report}\n{}", node.agent.logs());
    assert_eq!(as_u64(&report, "received"), payload, "{report}");
    let served = server.report();
    assert_eq!(as_u64(&served, "echoed"), payload, "{served}");
    assert_eq!(as_u64(&served, "tcp_bytes_sent"), 0, "{served}");
    let server_after_plaintext = spliced_bytes(&node.agent, &node.server);
    assert!(
        server_after_plaintext >= server_after_hbone + 2 * payload,
        "the plaintext delivery spliced {} bytes",
        server_after_plaintext - server_after_hbone
    );
}
