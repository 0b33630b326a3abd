//! Observability end to end, against the real agent binary: Prometheus
//! metrics on 15020 (parsed strictly as OpenMetrics text; Istio's TCP
//! metrics moved by a real connection through the mesh), readiness on
//! 15021, the admin API's `/config_dump`, `/debug/bpf` and `/logging`, and
//! `shunt status` with and without an agent.

use std::{
    collections::BTreeMap,
    process::Stdio,
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde_json::Value;
use shunt::api::{NodeStatus, PodState};
use shunt_testbed::{
    Cgroup, Node, Topology,
    agent::{Agent, WorkloadSpec, http, mesh_pods_enrolled, shunt_binary, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const METRICS_PORT: u16 = 15020;
const READINESS_PORT: u16 = 15021;
const ADMIN_PORT: u16 = 15000;

// ---------------------------------------------------------------------------
// A strict OpenMetrics text parser: every line must be a well-formed
// descriptor or sample of the family declared last, each family declared
// once, label values properly escaped, and the exposition must end in EOF.

#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug, Default)]
struct MetricFamily {
    kind: String,
    help: Option<String>,
    samples: Vec<Sample>,
}

#[derive(Debug, Default)]
struct Exposition {
    families: BTreeMap<String, MetricFamily>,
}

impl Exposition {
    /// Sum of the samples named `name` whose labels include `labels`.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let matching: Vec<f64> = self
            .families
            .values()
            .flat_map(|f| &f.samples)
            .filter(|s| s.name == name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .collect();
        (!matching.is_empty()).then(|| matching.iter().sum())
    }

    fn samples(&self, name: &str) -> Vec<&Sample> {
        self.families
            .values()
            .flat_map(|f| &f.samples)
            .filter(|s| s.name == name)
            .collect()
    }
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_value(text: &str) -> Result<f64, String> {
    match text {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => text
            .parse::<f64>()
            .map_err(|e| format!("bad value {text:?}: {e}")),
    }
}

/// Parses `{a="x",b="y"}` starting at `text` (which begins with `{`);
/// returns the labels and the rest after `}`.
fn parse_labels(text: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = &text[1..];
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let eq = rest.find('=').ok_or("label without '='")?;
        let name = &rest[..eq];
        if !valid_name(name) || name.contains(':') {
            return Err(format!("bad label name {name:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or_else(|| format!("label {name} value not quoted"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?} in label {name}")),
                },
                Some((i, '"')) => break i,
                Some((_, '\n')) | None => return Err(format!("unterminated label {name}")),
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} repeated"));
        }
        rest = &rest[end + 1..];
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return Err(format!("expected ',' or '}}' after label {name}"));
        }
    }
}

fn suffixes(kind: &str) -> &'static [&'static str] {
    match kind {
        "counter" => &["_total", "_created"],
        "histogram" | "gaugehistogram" => {
            &["_bucket", "_count", "_sum", "_created", "_gcount", "_gsum"]
        }
        "summary" => &["", "_count", "_sum", "_created"],
        "info" => &["_info"],
        _ => &[""],
    }
}

fn parse_openmetrics(text: &str) -> Result<Exposition, String> {
    let body = text
        .strip_suffix("# EOF\n")
        .ok_or("the exposition does not end with `# EOF`")?;
    let mut exposition = Exposition::default();
    let mut current: Option<String> = None;
    for (n, line) in body.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.is_empty() {
            return Err(at("empty line".into()));
        }
        if let Some(comment) = line.strip_prefix("# ") {
            let mut parts = comment.splitn(3, ' ');
            let (keyword, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let rest = parts.next().unwrap_or("");
            if !valid_name(name) {
                return Err(at(format!("bad metric name {name:?}")));
            }
            match keyword {
                "TYPE" => {
                    if !matches!(
                        rest,
                        "counter"
                            | "gauge"
                            | "histogram"
                            | "gaugehistogram"
                            | "summary"
                            | "info"
                            | "stateset"
                            | "unknown"
                    ) {
                        return Err(at(format!("unknown type {rest:?}")));
                    }
                    let family = exposition.families.entry(name.to_string()).or_default();
                    if !family.kind.is_empty() || !family.samples.is_empty() {
                        return Err(at(format!("family {name} declared twice")));
                    }
                    if current.as_deref() != Some(name) && family.help.is_some() {
                        return Err(at(format!("family {name} described apart")));
                    }
                    family.kind = rest.to_string();
                    current = Some(name.to_string());
                }
                "HELP" | "UNIT" => {
                    // Descriptors come before TYPE in prometheus-client's
                    // output; either order is valid, same family only.
                    let family = exposition.families.entry(name.to_string()).or_default();
                    if !family.samples.is_empty() {
                        return Err(at(format!("{keyword} after the samples of {name}")));
                    }
                    if keyword == "HELP" {
                        if family.help.is_some() {
                            return Err(at(format!("second HELP for {name}")));
                        }
                        family.help = Some(rest.to_string());
                    }
                    current = Some(name.to_string());
                }
                _ => return Err(at(format!("unknown descriptor {keyword:?}"))),
            }
            continue;
        }
        if line.starts_with('#') {
            return Err(at("malformed comment".into()));
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        if !valid_name(name) {
            return Err(at(format!("bad sample name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(at)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let rest = rest
            .strip_prefix(' ')
            .ok_or_else(|| at("no space before the value".into()))?;
        if rest.contains(' ') {
            return Err(at("timestamps and exemplars are not expected".into()));
        }
        let value = parse_value(rest).map_err(at)?;
        let family_name = current
            .as_ref()
            .ok_or_else(|| at("sample before any TYPE".into()))?;
        let family = exposition
            .families
            .get_mut(family_name)
            .ok_or_else(|| at("sample of an undeclared family".into()))?;
        if family.kind.is_empty() {
            return Err(at(format!("family {family_name} has no TYPE")));
        }
        let suffix = name
            .strip_prefix(family_name.as_str())
            .ok_or_else(|| at(format!("sample outside family {family_name}")))?;
        if !suffixes(&family.kind).contains(&suffix) {
            return Err(at(format!(
                "suffix {suffix:?} not allowed for a {} family",
                family.kind
            )));
        }
        if family.kind == "counter" && suffix == "_total" && value < 0.0 {
            return Err(at("negative counter".into()));
        }
        if suffix == "_bucket" && !labels.contains_key("le") {
            return Err(at("bucket without le".into()));
        }
        if family
            .samples
            .iter()
            .any(|s| s.name == name && s.labels == labels)
        {
            return Err(at("duplicate sample".into()));
        }
        family.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    if let Some((name, _)) = exposition.families.iter().find(|(_, f)| f.kind.is_empty()) {
        return Err(format!("family {name} has a HELP but no TYPE"));
    }
    Ok(exposition)
}

#[test]
fn the_strict_parser_rejects_malformed_expositions() {
    let good = "# HELP a_b A thing.\n# TYPE a_b counter\na_b_total{x=\"1\\\"q\"} 3\n# EOF\n";
    let parsed = parse_openmetrics(good).expect("valid");
    assert_eq!(parsed.sum("a_b_total", &[("x", "1\"q")]), Some(3.0));
    for bad in [
        "# TYPE a counter\na_total 1\n",                // no EOF
        "# TYPE a counter\na 1\n# EOF\n",               // counter without _total
        "# TYPE a gauge\na{x=\"1} 1\n# EOF\n",          // unterminated label
        "# TYPE a gauge\na{x=1} 1\n# EOF\n",            // unquoted
        "# TYPE a gauge\na one\n# EOF\n",               // bad value
        "# TYPE a gauge\n# TYPE a gauge\na 1\n# EOF\n", // declared twice
        "# TYPE a gauge\nb 1\n# EOF\n",                 // outside the family
        "# TYPE a gauge\na 1\na 2\n# EOF\n",            // duplicate sample
        "# TYPE a histogram\na_bucket 1\n# EOF\n",      // bucket without le
    ] {
        assert!(parse_openmetrics(bad).is_err(), "accepted {bad:?}");
    }
}

// ---------------------------------------------------------------------------
// HTTP inside a node's netns (plain HTTP/1.0: no chunking, close at end).

fn get(node: &Node, port: u16, path: &str) -> (u16, String) {
    http(node, "GET", port, path).unwrap_or_else(|e| panic!("GET {path} on {port}: {e}"))
}

fn metrics(node: &Node) -> Exposition {
    let (code, body) = get(node, METRICS_PORT, "/metrics");
    assert_eq!(code, 200, "{body}");
    parse_openmetrics(&body).unwrap_or_else(|e| panic!("{e}\n{body}"))
}

/// Polls `f` until it returns `Some`, bounded by [`TIMEOUT`].
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>, last: impl Fn() -> String) -> T {
    let start = Instant::now();
    while start.elapsed() < TIMEOUT {
        if let Some(v) = f() {
            return v;
        }
        thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}; last: {}", last())
}

// ---------------------------------------------------------------------------
// An echo server in a pod and the test application.

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

// ---------------------------------------------------------------------------

/// A real connection from a mesh pod on node-a to one on node-b moves
/// Istio's TCP metrics on both nodes, with Istio's labels: reporter
/// `source` on node-a, `destination` on node-b; request bytes as received,
/// echoed bytes as sent. shunt's own metrics show the pods, their kernel
/// counters and their certificates.
#[test]
fn a_mesh_connection_moves_istio_tcp_metrics_on_both_nodes() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("obs-metrics").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    // A mesh pod whose HBONE port the client's network drops.
    let guarded = topo.add_pod("node-b", "guarded").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&guarded, true),
    ]);
    let args = ["--redirect", "ebpf"];
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let mut agent_a = Agent::start(&topo, &node_a, &yaml, &args).expect("agent a");
    let mut agent_b = Agent::start(&topo, &node_b, &yaml, &args).expect("agent b");
    for agent in [&mut agent_a, &mut agent_b] {
        agent
            .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
            .expect("enrolled");
    }
    let _server_app = EchoServer::on(&server, 8080).expect("echo");

    let client_id = "spiffe://cluster.local/ns/default/sa/sa-client";
    let server_id = "spiffe://cluster.local/ns/default/sa/sa-server";
    let connection = [
        ("source_workload", "client"),
        ("source_workload_namespace", "default"),
        ("source_principal", client_id),
        ("destination_workload", "server"),
        ("destination_workload_namespace", "default"),
        ("destination_principal", server_id),
        ("connection_security_policy", "mutual_tls"),
        ("request_protocol", "tcp"),
    ];
    let as_source = [&connection[..], &[("reporter", "source")]].concat();
    let as_destination = [&connection[..], &[("reporter", "destination")]].concat();

    // Before any traffic: no series for this flow (an empty family is not
    // written at all).
    let before = metrics(&node_a);
    assert_eq!(
        before.sum("istio_tcp_connections_opened_total", &as_source),
        None
    );

    const SENT: usize = 300_000;
    let to_server = format!("{}:8080", server.ip());
    let report = apps.run(
        &client,
        &["connect", &to_server, "--send", &SENT.to_string()],
    );
    assert_eq!(report["intact"], Value::Bool(true), "{report}");

    for (node, labels, agent) in [
        (&node_a, &as_source, &agent_a),
        (&node_b, &as_destination, &agent_b),
    ] {
        // Counted at close: the proxy sees the end shortly after the app.
        let m = eventually(
            "the connection to be counted closed",
            || {
                let m = metrics(node);
                (m.sum("istio_tcp_connections_closed_total", labels) == Some(1.0)).then_some(m)
            },
            || {
                format!(
                    "{:#?}\n{}",
                    metrics(node).samples("istio_tcp_connections_closed_total"),
                    agent.logs()
                )
            },
        );
        for family in [
            "istio_tcp_connections_opened",
            "istio_tcp_connections_closed",
            "istio_tcp_sent_bytes",
            "istio_tcp_received_bytes",
        ] {
            assert_eq!(m.families[family].kind, "counter", "{family}");
        }
        assert_eq!(
            m.sum("istio_tcp_connections_opened_total", labels),
            Some(1.0)
        );
        assert_eq!(
            m.sum(
                "istio_tcp_connections_closed_total",
                &[&labels[..], &[("response_flags", "-")]].concat()
            ),
            Some(1.0)
        );
        assert_eq!(
            m.sum("istio_tcp_received_bytes_total", labels),
            Some(SENT as f64),
            "request bytes"
        );
        assert_eq!(
            m.sum("istio_tcp_sent_bytes_total", labels),
            Some(SENT as f64),
            "echoed bytes"
        );
        // Every Istio standard label is there on every series.
        for sample in m.samples("istio_tcp_connections_opened_total") {
            for label in [
                "reporter",
                "source_workload",
                "source_canonical_service",
                "source_canonical_revision",
                "source_workload_namespace",
                "source_principal",
                "source_app",
                "source_version",
                "source_cluster",
                "destination_service",
                "destination_service_namespace",
                "destination_service_name",
                "destination_workload",
                "destination_canonical_service",
                "destination_canonical_revision",
                "destination_workload_namespace",
                "destination_principal",
                "destination_app",
                "destination_version",
                "destination_cluster",
                "request_protocol",
                "response_flags",
                "connection_security_policy",
            ] {
                assert!(sample.labels.contains_key(label), "{label} in {sample:?}");
            }
        }
    }

    // A long connection's bytes count as they move, as ztunnel's do, not
    // at its close: while a second connection to the server lives, each
    // node's series shows two opens, one close and more bytes each way
    // than the first connection moved.
    let mut hold = apps
        .command(&client, &["hold", &to_server, "--seconds", "120"])
        .stdout(Stdio::null())
        .spawn()
        .expect("hold");
    for (node, labels, agent) in [
        (&node_a, &as_source, &agent_a),
        (&node_b, &as_destination, &agent_b),
    ] {
        let m = eventually(
            "the open connection's bytes to be counted",
            || {
                let m = metrics(node);
                let moved = |family| m.sum(family, labels) > Some(SENT as f64);
                (m.sum("istio_tcp_connections_opened_total", labels) == Some(2.0)
                    && moved("istio_tcp_received_bytes_total")
                    && moved("istio_tcp_sent_bytes_total"))
                .then_some(m)
            },
            || {
                let m = metrics(node);
                format!(
                    "{:#?}\n{:#?}\n{}",
                    m.samples("istio_tcp_connections_opened_total"),
                    m.samples("istio_tcp_received_bytes_total"),
                    agent.logs()
                )
            },
        );
        assert_eq!(
            m.sum("istio_tcp_connections_closed_total", labels),
            Some(1.0),
            "the second connection is still open"
        );
    }
    // ztunnel's open sockets: the client's application socket, on its
    // node; on the server's, the HBONE connection it rides on (ztunnel
    // counts its 15008 accepts too; others may still be pooled).
    let open_sockets = |node: &Node, reporter| {
        metrics(node).sum("istio_tcp_sockets_open", &[("reporter", reporter)])
    };
    eventually(
        "the held socket alone to be counted open",
        || (open_sockets(&node_a, "source") == Some(1.0)).then_some(()),
        || format!("{:?}", open_sockets(&node_a, "source")),
    );
    let hbone = open_sockets(&node_b, "destination");
    assert!(hbone.is_some_and(|n| n >= 1.0), "{hbone:?}");
    // Ours, by PID.
    let _ = hold.kill();
    let _ = hold.wait();
    eventually(
        "the held socket to be counted closed",
        || (open_sockets(&node_a, "source") == Some(0.0)).then_some(()),
        || format!("{:?}", open_sockets(&node_a, "source")),
    );

    // A connect to a peer whose HBONE port is dropped (what a
    // NetworkPolicy without 15008 does) times out, and ztunnel names that
    // failure NETWORK_POLICY (its pool: a timed-out connect to 15008).
    let drop_hbone = client
        .command("iptables")
        .args(["-A", "OUTPUT", "-p", "tcp", "--dport", "15008", "-d"])
        .arg(guarded.ip().to_string())
        .args(["-j", "DROP"])
        .status()
        .expect("iptables");
    assert!(drop_hbone.success(), "iptables -A OUTPUT … -j DROP");
    let to_guarded = format!("{}:8080", guarded.ip());
    let report = apps.run(
        &client,
        &[
            "connect",
            &to_guarded,
            "--send",
            "10",
            "--timeout-ms",
            "30000",
        ],
    );
    assert_eq!(report["ok"], Value::Bool(false), "{report}");
    let blocked = [
        ("reporter", "source"),
        ("destination_workload", "guarded"),
        ("response_flags", "NETWORK_POLICY"),
    ];
    eventually(
        "the timed-out connect to be counted NETWORK_POLICY",
        || {
            let m = metrics(&node_a);
            (m.sum("istio_tcp_connections_closed_total", &blocked) == Some(1.0)
                && m.sum("istio_tcp_connections_failed_total", &blocked) == Some(1.0))
            .then_some(())
        },
        || {
            format!(
                "{:#?}\n{}",
                metrics(&node_a).samples("istio_tcp_connections_closed_total"),
                agent_a.logs()
            )
        },
    );

    // shunt's own, on node-a (kernel counters as a verify pass after the
    // connection read them).
    agent_a.status_after_verify(TIMEOUT).expect("a verify pass");
    let m = metrics(&node_a);
    assert_eq!(m.sum("shunt_enrolled_pods", &[("mode", "ebpf")]), Some(1.0));
    assert_eq!(m.sum("shunt_pods", &[("state", "enrolled")]), Some(1.0));
    assert_eq!(m.sum("shunt_pods_not_redirected", &[]), Some(0.0));
    let pod = [("namespace", "default"), ("pod", "client")];
    let out = [&pod[..], &[("direction", "out")]].concat();
    assert!(
        m.sum("shunt_pod_redirected_connections_total", &out) >= Some(1.0),
        "{:?}",
        m.samples("shunt_pod_redirected_connections_total")
    );
    assert!(m.sum("shunt_pod_bytes_total", &out) >= Some(SENT as f64));
    assert_eq!(
        m.sum("shunt_pod_fail_closed_total", &out),
        Some(0.0),
        "nothing failed closed"
    );
    let expiry = m
        .sum(
            "shunt_certificate_expiry_timestamp_seconds",
            &[("identity", client_id)],
        )
        .expect("client certificate expiry");
    assert!(expiry > now_unix(), "expiry {expiry} is in the past");
    assert!(m.sum("shunt_enrolment_duration_seconds_count", &[]) >= Some(1.0));
    assert_eq!(
        m.families["shunt_enrolment_duration_seconds"].kind,
        "histogram"
    );
    assert_eq!(m.sum("shunt_redirection_repairs_total", &[]), Some(0.0));
    assert_eq!(m.sum("shunt_pod_source_synced", &[]), Some(1.0));
    assert_eq!(m.sum("shunt_ready", &[]), Some(1.0));

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

/// Readiness names a mesh pod that cannot be enrolled (without turning 503:
/// one broken pod must not stall a rollout), and is 200 with every check ok
/// once it is (redirection in place, certificate issued, source synced); a
/// hook removed behind the agent's back is repaired by the next verify pass,
/// and counted.
#[test]
fn readiness_follows_redirection_and_names_pending_pods() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("obs-ready").expect("topology");
    topo.add_node("node-a").expect("node");
    let pod = topo.add_pod("node-a", "web").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    // A file where a netns is expected: it passes the file's validation
    // but cannot be entered, so the pod stays pending.
    struct Removed(std::path::PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let not_a_netns = std::env::temp_dir().join(format!("{}-not-a-netns", topo.prefix()));
    std::fs::write(&not_a_netns, b"").expect("placeholder");
    let _placeholder = Removed(not_a_netns.clone());
    let mut spec = WorkloadSpec::for_pod(&pod, true);
    spec.netns = Some(not_a_netns.clone());
    let mut agent = Agent::start(
        &topo,
        &node,
        &workloads_yaml(&[spec]),
        &["--redirect", "ebpf"],
    )
    .expect("agent");
    agent
        .wait_for("the pod to be pending", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| matches!(p.state, PodState::Pending(_)))
        })
        .expect("pending");
    // A pod that cannot be enrolled is named, but does not make the agent
    // unready (a DaemonSet rollout must not stall on one broken pod).
    let (code, body) = get(&node, READINESS_PORT, "/healthz/ready");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("not enrolled yet: default/web"), "{body}");

    agent
        .write_workloads(&workloads_yaml(&[WorkloadSpec::for_pod(&pod, true)]))
        .expect("rewrite");
    agent
        .wait_for("the pod to be enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    let body = eventually(
        "readiness with every pod enrolled",
        || match get(&node, READINESS_PORT, "/healthz/ready") {
            (200, body) if !body.contains("not enrolled yet") => Some(body),
            _ => None,
        },
        || {
            format!(
                "{:?}\n{}",
                get(&node, READINESS_PORT, "/healthz/ready"),
                agent.logs()
            )
        },
    );
    assert!(body.starts_with("ready\n"), "{body}");
    for check in ["redirection: ok", "pods: ok", "certificates: ok"] {
        assert!(body.contains(check), "{check} in {body}");
    }
    let status = agent.status().expect("status");
    assert!(mesh_pods_enrolled(&status), "{status:?}");
    assert_eq!(
        metrics(&node).sum("shunt_redirection_repairs_total", &[]),
        Some(0.0)
    );

    // Someone removes the pod's TC ingress filter: the next verify pass
    // (every second in the testbed) finds it missing, repairs it and counts
    // the repair; readiness and the metrics show the hook in place again.
    // (A hook found missing and not repaired turns readiness 503: the unit
    // tests of `health.rs` show that answer.)
    let out = pod
        .command("tc")
        .args(["filter", "del", "dev", "eth0", "ingress", "pref", "49"])
        .output()
        .expect("tc");
    assert!(out.status.success(), "{out:?}");
    eventually(
        "the repair, counted",
        || (metrics(&node).sum("shunt_redirection_repairs_total", &[]) == Some(1.0)).then_some(()),
        || agent.logs(),
    );
    let status = agent.status_after_verify(TIMEOUT).expect("status");
    assert!(
        status.pods[0].hooks.iter().all(|h| h.present),
        "{:?}",
        status.pods[0].hooks
    );
    let (code, body) = get(&node, READINESS_PORT, "/healthz/ready");
    assert_eq!(code, 200, "{body}");
    let m = metrics(&node);
    assert_eq!(m.sum("shunt_redirection_repairs_total", &[]), Some(1.0));
    assert_eq!(m.sum("shunt_pods_not_redirected", &[]), Some(0.0));

    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

/// `/config_dump`, `/debug/bpf` and `/logging` on the admin port, with the
/// agent logging JSON.
#[test]
fn admin_dumps_config_and_bpf_and_changes_the_log_level() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("obs-admin").expect("topology");
    topo.add_node("node-a").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let outsider = topo.add_pod("node-a", "outsider").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    let mut agent = Agent::start(
        &topo,
        &node,
        &yaml,
        &["--redirect", "ebpf", "--log-format", "json"],
    )
    .expect("agent");
    agent
        .wait_for("the pod enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    let client_id = "spiffe://cluster.local/ns/default/sa/sa-client";

    // /config_dump, in ztunnel's shape (what `istioctl ztunnel-config`
    // reads), shunt's own facts under `shunt`.
    let dump: Value = eventually(
        "the client's certificate in /config_dump",
        || {
            let (code, body) = get(&node, ADMIN_PORT, "/config_dump");
            assert_eq!(code, 200, "{body}");
            let dump: Value = serde_json::from_str(&body).expect("json");
            let has_cert = dump["certificates"]
                .as_array()?
                .iter()
                .any(|c| c["identity"] == client_id && c["state"] == "Available");
            has_cert.then_some(dump)
        },
        || get(&node, ADMIN_PORT, "/config_dump").1,
    );
    let shunt = &dump["shunt"];
    assert_eq!(shunt["node"], "node-a");
    assert_eq!(shunt["mode"], "ebpf");
    assert_eq!(shunt["trustDomain"], "cluster.local");
    assert_eq!(shunt["synced"], true);
    assert_eq!(shunt["sources"]["pods"], "workloads-file", "{dump}");
    assert!(shunt["logFilter"].is_string(), "{dump}");
    let workloads = dump["workloads"].as_array().expect("workloads");
    let by_name = |name: &str| {
        workloads
            .iter()
            .find(|w| w["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {dump}"))
    };
    let client_dump = by_name("client");
    assert_eq!(client_dump["shunt"]["identity"], client_id);
    assert_eq!(client_dump["serviceAccount"], "sa-client");
    assert_eq!(client_dump["protocol"], "HBONE");
    assert_eq!(client_dump["status"], "Healthy");
    assert_eq!(client_dump["node"], "node-a");
    assert_eq!(client_dump["shunt"]["dataplaneMode"], "ambient");
    assert_eq!(client_dump["shunt"]["state"]["state"], "enrolled");
    assert_eq!(
        by_name("outsider")["shunt"]["state"]["state"],
        "not-in-mesh"
    );
    assert_eq!(client_dump["workloadIps"][0], client.ip().to_string());
    // The enrolled pod's state, by uid, as ztunnel lists its pods.
    let uid = client_dump["uid"].as_str().expect("uid");
    let state = &dump["workloadState"][uid];
    assert_eq!(state["state"], "Up", "{dump}");
    assert_eq!(state["info"]["serviceAccount"], "sa-client", "{dump}");
    assert!(
        dump["workloadState"]
            .as_object()
            .is_some_and(|m| m.len() == 1),
        "only the captured pod: {dump}"
    );
    let certificate = dump["certificates"]
        .as_array()
        .expect("certificates")
        .iter()
        .find(|c| c["identity"] == client_id)
        .expect("client identity");
    let leaf = &certificate["certChain"][0];
    assert!(
        leaf["pem"]
            .as_str()
            .is_some_and(|p| p.starts_with("-----BEGIN CERTIFICATE-----")),
        "{certificate}"
    );
    assert!(
        leaf["serialNumber"]
            .as_str()
            .is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())),
        "{certificate}"
    );
    let expires = leaf["expirationTime"].as_str().expect("expirationTime");
    assert!(
        expires.len() == 20
            && expires.ends_with('Z')
            && expires > leaf["validFrom"].as_str().expect("validFrom"),
        "{certificate}"
    );
    let enrolled = shunt["enrolled"].as_array().expect("enrolled");
    assert_eq!(enrolled.len(), 1, "{dump}");
    assert_eq!(enrolled[0]["name"], "client");
    let hooks = enrolled[0]["hooks"].as_array().expect("hooks");
    assert!(hooks.len() >= 2, "{dump}");
    assert!(hooks.iter().all(|h| h["present"] == true), "{dump}");
    assert_eq!(shunt["proxied"], serde_json::json!(["default/client"]));

    // /debug/bpf
    let (code, body) = get(&node, ADMIN_PORT, "/debug/bpf");
    assert_eq!(code, 200, "{body}");
    let bpf: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(bpf["mode"], "ebpf");
    assert_eq!(
        bpf["pinned"]["pin_dir"],
        agent.pin_dir().display().to_string()
    );
    let maps = bpf["pinned"]["maps"].as_array().expect("maps");
    let map = |name: &str| {
        maps.iter()
            .find(|m| m["pin"].as_str().is_some_and(|p| p.ends_with(name)))
            .unwrap_or_else(|| panic!("{name} in {body}"))
    };
    let enrolled_map = map("SHUNT_ENROLLED");
    assert_eq!(enrolled_map["entries"], 1, "{enrolled_map}");
    assert!(enrolled_map["max_entries"].as_u64() >= Some(1));
    assert!(enrolled_map["key_size"] == 8, "{enrolled_map}");
    assert!(enrolled_map["fill_percent"].as_f64() > Some(0.0));
    assert_eq!(map("SHUNT_POD_RECORDS")["entries"], 1);
    assert!(
        map("SHUNT_POD_COUNTERS")["map_type"]
            .as_str()
            .is_some_and(|t| t.contains("Array"))
    );
    let links = bpf["pinned"]["links"].as_array().expect("links");
    assert!(
        links
            .iter()
            .any(|l| l["link_type"] == "Cgroup" && l["program_name"].is_string()),
        "{body}"
    );
    assert!(
        bpf["pinned"]["unreadable"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "{body}"
    );
    assert_eq!(bpf["pods"][0]["name"], "client");

    // /logging: a debug line of the admin API appears after the filter
    // lets it through, not before.
    let admin_debug_lines = |log: &str| {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["level"] == "DEBUG" && l["fields"]["message"] == "admin request")
            .count()
    };
    let (code, body) = http(&node, "POST", ADMIN_PORT, "/logging?level=info").expect("logging");
    assert_eq!(code, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(answer["filter"], "info");
    let before = agent.logs().len();
    let _ = get(&node, ADMIN_PORT, "/status");
    // The next filter change is logged (at info) after /status was answered:
    // once its line is in the log, a debug line of /status would be too.
    let (code, body) = http(
        &node,
        "POST",
        ADMIN_PORT,
        "/logging?level=info,shunt::admin=debug",
    )
    .expect("logging");
    assert_eq!(code, 200, "{body}");
    let is_change_to_debug = |l: &Value| {
        l["fields"]["message"] == "log filter changed through the admin API"
            && l["fields"]["filter"] == "info,shunt::admin=debug"
    };
    let tail = eventually(
        "the filter change in the log",
        || {
            let tail = agent.logs()[before..].to_string();
            let marker = tail.lines().position(|l| {
                serde_json::from_str::<Value>(l).is_ok_and(|l| is_change_to_debug(&l))
            })?;
            Some(tail.lines().take(marker).collect::<Vec<_>>().join("\n"))
        },
        || agent.logs()[before..].to_string(),
    );
    assert_eq!(admin_debug_lines(&tail), 0, "debug logged at info:\n{tail}");

    let (code, body) = get(&node, ADMIN_PORT, "/logging");
    assert_eq!(code, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("json")["filter"],
        "info,shunt::admin=debug"
    );
    let before = agent.logs().len();
    let _ = get(&node, ADMIN_PORT, "/status");
    let tail = eventually(
        "a debug line after the level change",
        || {
            let tail = agent.logs()[before..].to_string();
            (admin_debug_lines(&tail) >= 1).then_some(tail)
        },
        || agent.logs()[before..].to_string(),
    );
    assert!(tail.contains("\"target\":\"shunt::admin\""), "{tail}");

    let (code, body) =
        http(&node, "POST", ADMIN_PORT, "/logging?level=shunt=nonsense[").expect("logging");
    assert_eq!(code, 400, "{body}");
    let (code, body) = http(&node, "POST", ADMIN_PORT, "/logging?reset").expect("logging");
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("json")["filter"],
        "info,shunt=debug,shunt_ebpf=debug",
        "back to the filter the agent started with"
    );

    // --log-format json: every line the agent wrote is a JSON object.
    let logs = agent.logs();
    for line in logs.lines().filter(|l| !l.trim().is_empty()) {
        let value: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            value["level"].is_string() && value["timestamp"].is_string(),
            "{line}"
        );
    }

    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

/// The iptables mode: `/debug/bpf` reports each pod's chains instead of
/// maps; metrics and readiness name the mode.
#[test]
fn iptables_mode_reports_rules_metrics_and_readiness() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("obs-ipt").expect("topology");
    topo.add_node("node-a").expect("node");
    let pod = topo.add_pod("node-a", "web").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(&pod, true)]);
    let mut agent = Agent::start(&topo, &node, &yaml, &["--redirect", "iptables"]).expect("agent");
    agent
        .wait_for("the pod enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");

    let (code, body) = get(&node, ADMIN_PORT, "/debug/bpf");
    assert_eq!(code, 200, "{body}");
    let bpf: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(bpf["mode"], "iptables");
    assert!(bpf["pinned"].is_null(), "{body}");
    let hooks = bpf["pods"][0]["hooks"].as_array().expect("hooks");
    assert!(
        hooks.iter().any(
            |h| h["name"].as_str().is_some_and(|n| n.contains("nat OUTPUT"))
                && h["attachment"]
                    .as_str()
                    .is_some_and(|a| a.contains("rules"))
        ),
        "{body}"
    );
    assert!(hooks.iter().all(|h| h["present"] == true), "{body}");

    let m = metrics(&node);
    assert_eq!(
        m.sum("shunt_enrolled_pods", &[("mode", "iptables")]),
        Some(1.0)
    );
    let body = eventually(
        "readiness",
        || match get(&node, READINESS_PORT, "/healthz/ready") {
            (200, body) => Some(body),
            _ => None,
        },
        || get(&node, READINESS_PORT, "/healthz/ready").1,
    );
    assert!(body.contains("redirection: ok (iptables loaded"), "{body}");

    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

/// `shunt status` against the running agent (table and JSON), and the
/// message when no agent answers.
#[test]
fn shunt_status_with_and_without_an_agent() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("obs-status").expect("topology");
    topo.add_node("node-a").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let outsider = topo.add_pod("node-a", "outsider").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let binary = shunt_binary().expect("binary");

    // No agent yet in the node's netns.
    let out = node
        .command(&binary)
        .arg("status")
        .output()
        .expect("shunt status");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no shunt agent answers on 127.0.0.1:15000")
            && stderr.contains("is `shunt agent` running"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());

    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    let mut agent = Agent::start(&topo, &node, &yaml, &["--redirect", "ebpf"]).expect("agent");
    agent
        .wait_for("the pod enrolled with its certificate", TIMEOUT, |s| {
            mesh_pods_enrolled(s) && s.pods.iter().any(|p| p.certificate.is_some())
        })
        .expect("enrolled");

    let out = node
        .command(&binary)
        .arg("status")
        .output()
        .expect("shunt status");
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("node node-a  mode ebpf"), "{table}");
    let header = lines
        .iter()
        .find(|l| l.starts_with("POD "))
        .unwrap_or_else(|| panic!("{table}"));
    for column in [
        "IP",
        "STATE",
        "MODE",
        "HOOKS",
        "PKTS IN",
        "BYTES OUT",
        "REDIRECTED OUT/IN",
        "FAIL-CLOSED OUT/IN",
        "IDENTITY",
        "CERT EXPIRES",
    ] {
        assert!(header.contains(column), "{column} in {header}");
    }
    let row = lines
        .iter()
        .find(|l| l.starts_with("default/client "))
        .unwrap_or_else(|| panic!("{table}"));
    let hooks = agent.status().expect("status").pods[0].hooks.len();
    for cell in [
        client.ip().to_string(),
        "enrolled".into(),
        " ebpf ".into(),
        format!(" {hooks}/{hooks} "),
        "spiffe://cluster.local/ns/default/sa/sa-client".into(),
        " in ".into(),
    ] {
        assert!(row.contains(&cell), "{cell:?} in {row:?}");
    }
    let row = lines
        .iter()
        .find(|l| l.starts_with("default/outsider "))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("not in mesh"), "{row}");

    let out = node
        .command(&binary)
        .args(["status", "--json"])
        .output()
        .expect("shunt status --json");
    assert!(out.status.success(), "{out:?}");
    let status: NodeStatus = serde_json::from_slice(&out.stdout).expect("status JSON");
    assert_eq!(status.node, "node-a");
    let pod = status
        .pods
        .iter()
        .find(|p| p.name == "client")
        .expect("client");
    assert_eq!(pod.state, PodState::Enrolled);
    assert!(pod.counters.is_some());
    assert!(pod.certificate.as_ref().expect("certificate").not_after as f64 > now_unix());

    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}
