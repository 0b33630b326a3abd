//! Tests of the workloads file's parsing and validation (`super`).

use std::net::IpAddr;

use super::*;
use crate::state::{DataplaneMode, Endpoint, ServicePort, WorkloadType};

const GOOD: &str = "\
trustDomain: example.org
workloads:
  - name: client
    namespace: default
    serviceAccount: sleep
    ips: [\"198.18.1.2\"]
    node: node-a
    netns: /var/run/netns/client
    dataplaneMode: ambient
  - name: server
    namespace: default
    serviceAccount: httpbin
    ips: [\"198.18.2.2\", \"2001:db8::2\"]
    node: node-b
    dataplaneMode: none
  - name: db
    namespace: data
    serviceAccount: db
    ips: [198.18.2.3]
    node: node-b
";

fn file() -> &'static Path {
    Path::new("workloads.yaml")
}

fn error(text: &str) -> String {
    match parse(file(), text) {
        Ok(parsed) => panic!("accepted bad input {text:?}: {parsed:?}"),
        Err(e) => e.to_string(),
    }
}

/// One entry; `extra` lines are appended, `drop` names a field to omit
/// and `set` overrides one field's line.
fn entry(name: &str, ip: &str, set: Option<&str>, drop: Option<&str>) -> String {
    let mut fields = vec![
        format!("name: {name}"),
        "namespace: default".to_owned(),
        "serviceAccount: sa".to_owned(),
        format!("ips: [\"{ip}\"]"),
        "node: node-a".to_owned(),
        "dataplaneMode: none".to_owned(),
    ];
    if let Some(set) = set {
        let key = set.split(':').next().unwrap_or_default();
        fields.retain(|f| !f.starts_with(&format!("{key}:")));
        fields.push(set.to_owned());
    }
    if let Some(drop) = drop {
        fields.retain(|f| !f.starts_with(&format!("{drop}:")));
    }
    let mut text = String::new();
    for (i, f) in fields.iter().enumerate() {
        text += if i == 0 { "  - " } else { "    " };
        text += f;
        text += "\n";
    }
    text
}

/// A file whose entry 1 (`default/second`) is changed by `set`/`drop`.
fn with_second(set: Option<&str>, drop: Option<&str>) -> String {
    format!(
        "workloads:\n{}{}",
        entry("first", "198.18.1.1", None, None),
        entry("second", "198.18.1.2", set, drop)
    )
}

#[test]
fn good_file_parses_to_workloads() {
    let parsed = parse(file(), GOOD).expect("good file");
    assert_eq!(parsed.source, file());
    assert_eq!(parsed.trust_domain.as_str(), "example.org");
    let ip = |s: &str| s.parse::<IpAddr>().expect("test IP");
    assert_eq!(
        parsed.workloads,
        [
            Workload {
                name: "client".into(),
                namespace: "default".into(),
                service_account: "sleep".into(),
                ips: vec![ip("198.18.1.2")],
                node: "node-a".into(),
                netns: Some("/var/run/netns/client".into()),
                dataplane_mode: DataplaneMode::Ambient,
                splice: None,
                ..Default::default()
            },
            Workload {
                name: "server".into(),
                namespace: "default".into(),
                service_account: "httpbin".into(),
                ips: vec![ip("198.18.2.2"), ip("2001:db8::2")],
                node: "node-b".into(),
                netns: None,
                dataplane_mode: DataplaneMode::None,
                splice: None,
                ..Default::default()
            },
            Workload {
                name: "db".into(),
                namespace: "data".into(),
                service_account: "db".into(),
                ips: vec![ip("198.18.2.3")],
                node: "node-b".into(),
                netns: None,
                dataplane_mode: DataplaneMode::None,
                splice: None,
                ..Default::default()
            },
        ]
    );
    assert_eq!(
        parsed.workloads[0].identity(&parsed.trust_domain).as_str(),
        "spiffe://example.org/ns/default/sa/sleep"
    );
}

#[test]
fn fast_path_gives_the_workloads_own_say() {
    let parsed = parse(file(), &with_second(Some("fastPath: false"), None)).expect("valid");
    assert_eq!(parsed.workloads[1].fast_path, Some(false));
    assert_eq!(
        parsed.workloads[0].fast_path, None,
        "as --fast-path by default"
    );
    let typo = error(&with_second(Some("fastPath: nope"), None));
    assert!(
        typo.contains("workloads[1] (default/second): field `fastPath`"),
        "{typo}"
    );
}

#[test]
fn dns_capture_gives_the_workloads_own_say() {
    let parsed = parse(file(), &with_second(Some("dnsCapture: false"), None)).expect("valid");
    assert_eq!(parsed.workloads[1].dns_capture, Some(false));
    assert_eq!(
        parsed.workloads[0].dns_capture, None,
        "as --dns-capture by default"
    );
}

#[test]
fn splice_gives_the_workloads_own_say() {
    let parsed = parse(file(), &with_second(Some("splice: false"), None)).expect("valid");
    assert_eq!(parsed.workloads[1].splice, Some(false));
    assert_eq!(parsed.workloads[0].splice, None, "as --splice by default");
    let typo = error(&with_second(Some("splice: nope"), None));
    assert!(
        typo.contains("workloads[1] (default/second): field `splice`"),
        "{typo}"
    );
}

#[test]
fn defaults() {
    let parsed = parse(file(), &with_second(None, Some("dataplaneMode"))).expect("valid");
    assert_eq!(parsed.trust_domain, TrustDomain::default());
    assert_eq!(parsed.workloads[1].dataplane_mode, DataplaneMode::None);
    let empty = parse(file(), "workloads: []").expect("no workloads is valid");
    assert!(empty.workloads.is_empty());
}

#[test]
fn load_reads_the_fixture_and_names_unreadable_files() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/workloads/two-nodes.yaml");
    // No pod on node-c, so no netns needs to exist on this machine.
    let loaded = load(&fixture, "node-c", "cluster.local").expect("fixture is valid");
    assert_eq!(loaded.workloads.len(), 3);
    assert_eq!(loaded.services.len(), 1);
    assert_eq!(loaded.services[0].endpoints.len(), 2);

    let missing = Path::new("/nonexistent/shunt/workloads.yaml");
    let err = load(missing, "node-a", "cluster.local")
        .expect_err("missing file")
        .to_string();
    assert!(
        err.starts_with("/nonexistent/shunt/workloads.yaml: cannot read the workloads file: "),
        "{err}"
    );
}

/// (case, file text, fragments the one-line message must contain). Every
/// message must also start with the file name.
#[test]
fn bad_files_get_messages_naming_file_entry_and_field() {
    let e1 = "workloads[1] (default/second): ";
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "unknown field",
            with_second(Some("serviceAcount: sa"), None),
            vec![
                e1,
                "field `serviceAcount`: unknown field; expected one of `name`",
                "(line 14, column 5)",
            ],
        ),
        (
            "unknown top-level field",
            format!("trustdomain: x\n{}", with_second(None, None)),
            vec![
                "workloads.yaml: field `trustdomain`: unknown field; expected one of `trustDomain`, `workloads`, `services`, `authorizationPolicies`, `namespaces`, `waypoints` (line 1, column 1)",
            ],
        ),
        (
            "missing field",
            with_second(None, Some("node")),
            vec![e1, "field `node`: required, but missing", "(line"],
        ),
        (
            "missing name: entry named by index only",
            with_second(None, Some("name")),
            vec!["workloads.yaml: workloads[1]: field `name`: required, but missing"],
        ),
        (
            "missing workloads",
            "trustDomain: cluster.local\n".into(),
            vec!["workloads.yaml: field `workloads`: required, but missing"],
        ),
        (
            "duplicate field",
            with_second(Some("node: node-b"), None) + "    node: node-c\n",
            // The document is not a valid `Value` then, so the entry has no label.
            vec!["workloads.yaml: workloads[1]: field `node`: given twice (line"],
        ),
        (
            "wrong type",
            with_second(Some("ips: 198.18.1.2"), None),
            vec![
                e1,
                "field `ips`: invalid type: string \"198.18.1.2\", expected a sequence",
                "(line",
            ],
        ),
        (
            "wrong type in a list",
            with_second(Some("ips: [[1]]"), None),
            vec![
                e1,
                "field `ips[0]`: invalid type: sequence, expected a string",
            ],
        ),
        (
            "entry is not a mapping",
            "workloads:\n  - just-a-name\n".into(),
            vec![
                "workloads.yaml: workloads[0]: invalid type: string \"just-a-name\", expected a workload (a mapping)",
            ],
        ),
        (
            "file is not a mapping",
            "- a\n".into(),
            vec!["workloads.yaml: invalid type: sequence, expected a mapping with `workloads`"],
        ),
        (
            "invalid YAML",
            "workloads:\n  - name: a\n   namespace: b\n".into(),
            vec!["workloads.yaml: invalid YAML: ", "(line 3, column"],
        ),
        (
            "empty file",
            "".into(),
            vec!["workloads.yaml: field `workloads`: required, but missing"],
        ),
        (
            "bad IP",
            with_second(Some("ips: [\"198.18.1.300\"]"), None),
            vec![e1, "field `ips`: \"198.18.1.300\" is not an IP address"],
        ),
        (
            "empty ips",
            with_second(Some("ips: []"), None),
            vec![e1, "field `ips`: must list at least one IP address"],
        ),
        (
            "IP of another entry",
            with_second(Some("ips: [\"198.18.1.1\"]"), None),
            vec![
                e1,
                "field `ips`: 198.18.1.1 is already used by workloads[0] (default/first)",
            ],
        ),
        (
            "IP twice in one entry",
            with_second(Some("ips: [\"198.18.1.2\", \"198.18.1.2\"]"), None),
            vec![e1, "field `ips`: 198.18.1.2 is listed twice"],
        ),
        (
            "loopback IP",
            with_second(Some("ips: [\"127.0.0.1\"]"), None),
            vec![
                e1,
                "field `ips`: 127.0.0.1 cannot be a pod address (loopback)",
            ],
        ),
        (
            "unknown dataplane mode",
            with_second(Some("dataplaneMode: ambiant"), None),
            vec![
                e1,
                "field `dataplaneMode`: unknown value \"ambiant\"; expected ambient or none",
            ],
        ),
        (
            "empty name",
            with_second(Some("name: \"\""), None),
            vec!["workloads.yaml: workloads[1]: field `name`: must not be empty"],
        ),
        (
            "empty service account",
            with_second(Some("serviceAccount: \"\""), None),
            vec![e1, "field `serviceAccount`: must not be empty"],
        ),
        (
            "empty node",
            with_second(Some("node: \"\""), None),
            vec![e1, "field `node`: must not be empty"],
        ),
        (
            "empty namespace",
            with_second(Some("namespace: \"\""), None),
            vec!["workloads.yaml: workloads[1]: field `namespace`: must not be empty"],
        ),
        (
            "namespace not a label",
            with_second(Some("namespace: my.ns"), None),
            vec![
                "workloads[1] (my.ns/second): field `namespace`: \"my.ns\" is not a DNS-1123 label",
            ],
        ),
        (
            "name not a subdomain",
            with_second(Some("name: Second_1"), None),
            vec![
                "workloads[1] (default/Second_1): field `name`: \"Second_1\" is not a DNS-1123 subdomain",
            ],
        ),
        (
            "duplicate namespace/name",
            with_second(Some("name: first"), None),
            vec![
                "workloads[1] (default/first): field `name`: default/first is already defined by workloads[0]",
            ],
        ),
        (
            "relative netns",
            with_second(Some("netns: netns/second"), None),
            vec![e1, "field `netns`: netns/second must be an absolute path"],
        ),
        (
            "invalid trust domain",
            format!("trustDomain: Cluster.Local\n{}", with_second(None, None)),
            vec![
                "workloads.yaml: field `trustDomain`: \"Cluster.Local\" is not a valid trust domain",
            ],
        ),
    ];
    for (case, text, fragments) in cases {
        let message = error(&text);
        assert!(message.starts_with("workloads.yaml: "), "{case}: {message}");
        assert_eq!(message.lines().count(), 1, "{case}: {message}");
        for fragment in fragments {
            assert!(
                message.contains(fragment),
                "{case}: {message:?} lacks {fragment:?}"
            );
        }
    }
}

#[test]
fn all_value_problems_are_reported_at_once() {
    let text = format!(
        "trustDomain: \"\"\nworkloads:\n{}{}{}",
        entry("a", "198.18.1.300", None, None),
        entry("b", "198.18.1.2", Some("dataplaneMode: on"), None),
        entry("c", "198.18.1.2", None, None),
    );
    let Err(WorkloadsFileError::Invalid { problems, .. }) = parse(file(), &text) else {
        panic!("expected problems");
    };
    let lines: Vec<String> = problems.iter().map(Problem::to_string).collect();
    assert_eq!(
        lines,
        [
            "field `trustDomain`: \"\" is not a valid trust domain: it is empty",
            "workloads[0] (default/a): field `ips`: \"198.18.1.300\" is not an IP address",
            "workloads[1] (default/b): field `dataplaneMode`: unknown value \"on\"; expected ambient or none",
            "workloads[2] (default/c): field `ips`: 198.18.1.2 is already used by workloads[1] (default/b)",
        ]
    );
    assert_eq!(error(&text).lines().count(), 4);
}

#[test]
fn netns_is_checked_for_this_nodes_ambient_pods_only() {
    let dir = std::env::temp_dir().join(format!("shunt-local-test-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("temp dir");
    let gone = dir.join("no-such-netns");
    let text = format!(
        "workloads:\n{}{}{}{}{}",
        entry("here", "198.18.1.1", Some("dataplaneMode: ambient"), None)
            + "    netns: /proc/self/ns/net\n",
        entry("gone", "198.18.1.2", Some("dataplaneMode: ambient"), None)
            + &format!("    netns: {}\n", gone.display()),
        entry("unset", "198.18.1.3", Some("dataplaneMode: ambient"), None),
        entry("opted-out", "198.18.1.4", None, None),
        entry("elsewhere", "198.18.1.5", Some("node: node-b"), None)
            .replace("dataplaneMode: none", "dataplaneMode: ambient"),
    );
    let parsed = parse(file(), &text);
    let _ = fs::remove_dir_all(&dir);
    let parsed = parsed.expect("node-independent checks pass");

    let err = validate_for_node(&parsed, "node-a").expect_err("netns problems");
    let why = "(the pod runs on this node, node-a, and opts into the mesh, so its network namespace is required)";
    assert_eq!(
        err.to_string(),
        format!(
            "workloads.yaml: workloads[1] (default/gone): field `netns`: {} does not exist {why}\n\
                 workloads.yaml: workloads[2] (default/unset): field `netns`: missing {why}",
            gone.display()
        )
    );
    let err = validate_for_node(&parsed, "node-b").expect_err("node-b's pod lacks a netns");
    assert!(
        err.to_string().starts_with(
            "workloads.yaml: workloads[4] (default/elsewhere): field `netns`: missing ("
        ),
        "{err}"
    );
    validate_for_node(&parsed, "node-c").expect("nothing on node-c");
}

const SERVICES: &str = "\
services:
  - name: web
    namespace: default
    clusterIPs: [\"198.19.100.1\"]
    ports:
      - port: 80
        targetPort: 8080
      - port: 8443
    endpoints: [server, 198.18.9.9, 198.18.2.3]
";

#[test]
fn services_resolve_pods_and_ips() {
    let parsed = parse(file(), &format!("{GOOD}{SERVICES}")).expect("good file");
    let [web] = parsed.services.as_slice() else {
        panic!("{:?}", parsed.services)
    };
    assert_eq!(web.key(), WorkloadKey::new("default", "web"));
    let ip = |s: &str| s.parse::<IpAddr>().expect("test IP");
    assert_eq!(web.vips, [ip("198.19.100.1")]);
    assert_eq!(
        web.ports,
        [
            ServicePort {
                port: 80,
                target_port: Some(8080)
            },
            ServicePort {
                port: 8443,
                target_port: Some(8443)
            },
        ]
    );
    let server = Some(WorkloadKey::new("default", "server"));
    assert_eq!(
        web.endpoints,
        [
            Endpoint::new(ip("198.18.2.2"), server.clone()),
            Endpoint::new(ip("2001:db8::2"), server),
            Endpoint::new(ip("198.18.9.9"), None),
            // An IP of a workload of another namespace is that workload.
            Endpoint::new(ip("198.18.2.3"), Some(WorkloadKey::new("data", "db"))),
        ]
    );
    let none = parse(file(), GOOD).expect("services are optional");
    assert!(none.services.is_empty());
}

#[test]
fn bad_services_get_messages_naming_file_entry_and_field() {
    let s0 = "workloads.yaml: services[0] (default/web): ";
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "typo in a field",
            SERVICES.replace("clusterIPs", "clusterIps"),
            "field `clusterIps`: unknown field; expected one of `name`, `namespace`, `clusterIPs`",
        ),
        (
            "typo in a port field",
            SERVICES.replace("targetPort", "targetport"),
            "field `ports[0].targetport`: unknown field; expected `port` or `targetPort`",
        ),
        (
            "port out of range",
            SERVICES.replace("port: 80\n", "port: 70000\n"),
            "field `ports[0].port`: invalid value: integer `70000`, expected u16",
        ),
        (
            "missing ports",
            SERVICES.replace(
                "    ports:\n      - port: 80\n        targetPort: 8080\n      - port: 8443\n",
                "",
            ),
            "field `ports`: required, but missing",
        ),
        (
            "bad VIP",
            SERVICES.replace("198.19.100.1", "198.19.100.300"),
            "field `clusterIPs[0]`: \"198.19.100.300\" is not an IP address",
        ),
        (
            "VIP of a workload",
            SERVICES.replace("198.19.100.1", "198.18.2.2"),
            "field `clusterIPs[0]`: 198.18.2.2 is the address of workload default/server",
        ),
        (
            "unknown pod",
            SERVICES.replace("[server,", "[sever,"),
            "field `endpoints[0]`: no workload default/sever (an endpoint is the name of a pod",
        ),
        (
            "endpoint twice",
            SERVICES.replace("198.18.9.9", "198.18.2.2"),
            "field `endpoints[1]`: 198.18.2.2 is listed twice",
        ),
        (
            "port twice",
            SERVICES.replace("port: 8443", "port: 80"),
            "field `ports[1].port`: 80 is listed twice",
        ),
        (
            "target port 0",
            SERVICES.replace("targetPort: 8080", "targetPort: 0"),
            "field `ports[0].targetPort`: must not be 0",
        ),
        (
            "VIP and port of another service",
            SERVICES.to_owned()
                + &SERVICES
                    .replace("services:\n", "")
                    .replace("name: web", "name: web2")
                    .replace("      - port: 8443\n", ""),
            "workloads.yaml: services[1] (default/web2): field `ports[0].port`: 198.19.100.1:80 is already served by services[0] (default/web)",
        ),
    ];
    for (case, services, fragment) in cases {
        let message = error(&format!("{GOOD}{services}"));
        assert!(message.starts_with("workloads.yaml: "), "{case}: {message}");
        assert_eq!(message.lines().count(), 1, "{case}: {message}");
        assert!(
            message.contains(fragment),
            "{case}: {message:?} lacks {fragment:?}"
        );
        if !fragment.starts_with("workloads.yaml") {
            assert!(message.starts_with(s0), "{case}: {message}");
        }
    }
}

#[test]
fn serde_yaml_error_format_is_as_expected() {
    // structure_problem relies on it: `PATH: MESSAGE at line L column C`.
    let err = serde_yaml::from_str::<RawFile>("workloads:\n  - nme: x\n")
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        err.as_deref(),
        Some(
            "workloads[0]: unknown field `nme`, expected one of `name`, `namespace`, \
                 `serviceAccount`, `ips`, `node`, `netns`, `dataplaneMode`, `splice`, `fastPath`, `dnsCapture`, `labels`, `workloadName`, `workloadType`, `hostname`, `subdomain`, `capacity` at line 2 column 5"
        )
    );
}

#[test]
fn owner_hostname_and_capacity_are_the_workloads_own() {
    let parsed = parse(
        file(),
        &with_second(
            Some(
                "workloadName: ratings-v1\n    workloadType: deployment\n    hostname: r0\n    subdomain: ratings\n    capacity: 3",
            ),
            None,
        ),
    )
    .expect("valid");
    let second = &parsed.workloads[1];
    assert_eq!(second.owner(), (WorkloadType::Deployment, "ratings-v1"));
    assert_eq!(
        (second.pod_hostname.as_str(), second.pod_subdomain.as_str()),
        ("r0", "ratings")
    );
    assert_eq!(second.capacity, 3);
    let first = &parsed.workloads[0];
    assert_eq!(
        first.owner(),
        (WorkloadType::Pod, "first"),
        "the pod by default"
    );
    assert_eq!(first.capacity, 1, "capacity 1 by default");

    let cases = [
        (
            "workloadType: statefulset\n    workloadName: db",
            "field `workloadType`: \"statefulset\" is not one of deployment, cronjob, job, pod",
        ),
        (
            "workloadType: deployment",
            "field `workloadType`: names the owner's kind: give `workloadName` too",
        ),
        ("workloadName: Ratings", "field `workloadName`: "),
        ("hostname: a.b", "field `hostname`: "),
    ];
    for (set, want) in cases {
        let e = error(&with_second(Some(set), None));
        assert!(
            e.contains(&format!("workloads[1] (default/second): {want}")),
            "{set}: {e}"
        );
    }
}
