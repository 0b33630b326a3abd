use shunt_proto::cri::{LinuxPodSandboxStatus, Namespace, NamespaceOption, PodSandboxStatus};

use super::*;

fn response(info: Option<&str>, network: NamespaceMode) -> PodSandboxStatusResponse {
    PodSandboxStatusResponse {
        status: Some(PodSandboxStatus {
            id: "sb".into(),
            state: PodSandboxState::SandboxReady as i32,
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network: network as i32,
                        ..Default::default()
                    }),
                }),
            }),
            ..Default::default()
        }),
        info: info
            .map(|i| HashMap::from([("info".to_owned(), i.to_owned())]))
            .unwrap_or_default(),
    }
}

fn parse(info: Option<&str>) -> Result<SandboxNetns, CriError> {
    netns_from_status(
        &WorkloadKey::new("shop", "web"),
        "sb",
        &response(info, NamespaceMode::Pod),
    )
}

fn sandbox_error(info: Option<&str>) -> String {
    match parse(info) {
        Err(error @ CriError::Sandbox { .. }) => error.to_string(),
        other => panic!("expected a sandbox error, got {other:?}"),
    }
}

#[test]
fn the_hosts_own_netns_file_is_a_netns_and_a_plain_file_is_not() {
    assert!(is_netns(Path::new("/proc/self/ns/net")));
    assert!(!is_netns(Path::new("/proc/self/status")));
    assert!(!is_netns(Path::new("/no/such/netns")));
}

#[test]
fn malformed_info_names_the_sandbox_the_pod_and_what_is_missing() {
    let none = sandbox_error(None);
    assert!(none.contains("sandbox sb of pod shop/web"), "{none}");
    assert!(none.contains("no \"info\" entry"), "{none}");
    let not_json = sandbox_error(Some("{not json"));
    assert!(not_json.contains("not the expected JSON"), "{not_json}");
    let no_spec = sandbox_error(Some(r#"{"pid": 7}"#));
    assert!(no_spec.contains("no runtimeSpec"), "{no_spec}");
    let no_ns = sandbox_error(Some(r#"{"runtimeSpec": {"linux": {}}}"#));
    assert!(no_ns.contains("runtimeSpec.linux.namespaces"), "{no_ns}");
    let wrong_type = sandbox_error(Some(r#"{"runtimeSpec": {"linux": {"namespaces": 3}}}"#));
    assert!(wrong_type.contains("not the expected JSON"), "{wrong_type}");
    let no_path = sandbox_error(Some(
        r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "network"}]}}}"#,
    ));
    assert!(no_path.contains("no path"), "{no_path}");
    let not_netns = sandbox_error(Some(
        r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "network", "path": "/proc/self/status"}]}}}"#,
    ));
    assert!(
        not_netns.contains("/proc/self/status is not a network namespace"),
        "{not_netns}"
    );
}

#[test]
fn host_network_closed_and_netns_sandboxes() {
    let host = netns_from_status(
        &WorkloadKey::new("shop", "web"),
        "sb",
        &response(None, NamespaceMode::Node),
    );
    assert_eq!(host.ok(), Some(SandboxNetns::HostNetwork));
    // A spec without a network namespace shares the runtime's (the node's).
    let no_network = parse(Some(
        r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "pid"}]}}}"#,
    ));
    assert_eq!(no_network.ok(), Some(SandboxNetns::HostNetwork));
    let closed = parse(Some(r#"{"netNamespaceClosed": true}"#));
    assert_eq!(closed.ok(), Some(SandboxNetns::NotReady));
    let found = parse(Some(
        r#"{"pid": 1, "runtimeSpec": {"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/proc/self/ns/net"}]}}}"#,
    ));
    assert_eq!(
        found.ok(),
        Some(SandboxNetns::Path(PathBuf::from("/proc/self/ns/net")))
    );
}
