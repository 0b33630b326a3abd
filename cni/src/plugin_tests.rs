//! The plugin against an in-test agent: a unix socket that records what
//! it is asked and answers as told.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    os::unix::net::UnixListener,
    path::Path,
    sync::mpsc,
    thread,
};

use super::*;

const PREV: &str = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"address":"198.18.0.5/24","gateway":"198.18.0.1","interface":0}],"dns":{}}"#;

fn conf(socket: &Path, extra: &str) -> Vec<u8> {
    format!(
        r#"{{"cniVersion":"1.0.0","name":"pods","type":"shunt-cni","agent_socket":"{}"{extra},"prevResult":{PREV}}}"#,
        socket.display()
    )
    .into_bytes()
}

fn env(command: &str, args: &str) -> BTreeMap<String, String> {
    [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", "sandbox-1"),
        ("CNI_NETNS", "/var/run/netns/x"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", args),
        ("CNI_PATH", "/opt/cni/bin"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

const POD_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=sandbox-1;K8S_POD_UID=u-1";

/// An agent answering one request with `reply`; what it was asked comes
/// back on the channel.
fn agent(socket: &Path, reply: Reply) -> mpsc::Receiver<Request> {
    let listener = UnixListener::bind(socket).unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut body = Vec::new();
        stream.read_to_end(&mut body).unwrap();
        tx.send(serde_json::from_slice(&body).unwrap()).unwrap();
        stream
            .write_all(&serde_json::to_vec(&reply).unwrap())
            .unwrap();
    });
    rx
}

#[test]
fn version_lists_what_is_spoken() {
    let out = run(&env("VERSION", ""), b"");
    assert_eq!(out.exit_code, 0);
    let value: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(value["supportedVersions"][3], "1.0.0");
}

#[test]
fn add_asks_the_agent_and_passes_prev_result_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cni.sock");
    let asked = agent(&socket, Reply::Captured);
    let out = run(&env("ADD", POD_ARGS), &conf(&socket, ""));
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_eq!(out.stdout, PREV, "prevResult byte for byte");
    let request = asked.recv().unwrap();
    assert_eq!(request.command, Command::Add);
    assert_eq!(
        (request.pod_namespace.as_str(), request.pod_name.as_str()),
        ("shop", "web")
    );
    assert_eq!(request.netns, "/var/run/netns/x");
    assert_eq!(request.container_id, "sandbox-1");
    assert_eq!(request.pod_uid.as_deref(), Some("u-1"));
    assert_eq!(request.ips[0].address, "198.18.0.5/24");
}

#[test]
fn a_failed_capture_fails_add_with_a_cni_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cni.sock");
    let _asked = agent(&socket, Reply::Failed("no listener".into()));
    let out = run(&env("ADD", POD_ARGS), &conf(&socket, ""));
    assert_eq!(out.exit_code, 1);
    let error: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(error["code"], code::CAPTURE_FAILED);
    assert_eq!(error["cniVersion"], "1.0.0");
    assert!(error["msg"].as_str().unwrap().contains("shop/web"));
    assert_eq!(error["details"], "no listener");
}

#[test]
fn unreachable_agent_fails_add_but_not_its_own_pod_nor_del() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = run(&env("ADD", POD_ARGS), &conf(&socket, ""));
    assert_eq!(out.exit_code, 1);
    let error: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(error["code"], code::TRY_AGAIN_LATER);

    let own = r#","agent_namespace":"shunt-system","agent_pod_prefix":"shunt-agent-""#;
    let args = "K8S_POD_NAMESPACE=shunt-system;K8S_POD_NAME=shunt-agent-x7k2p";
    let out = run(&env("ADD", args), &conf(&socket, own));
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, PREV));

    let mut del = env("DEL", POD_ARGS);
    del.insert("CNI_NETNS".into(), String::new());
    let out = run(&del, &conf(&socket, ""));
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, ""));
}

#[test]
fn excluded_namespaces_and_other_containers_pass_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let excluded = r#","exclude_namespaces":["kube-system"]"#;
    let args = "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1";
    let out = run(&env("ADD", args), &conf(&socket, excluded));
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, PREV));
    let out = run(&env("ADD", ""), &conf(&socket, ""));
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, PREV));
}

#[test]
fn bad_input_is_a_cni_error_not_a_panic() {
    let out = run(&env("ADD", POD_ARGS), b"{not json");
    assert_eq!(out.exit_code, 1);
    let error: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(error["code"], code::DECODING_FAILURE);
    let old = br#"{"cniVersion":"0.2.0","type":"shunt-cni","agent_socket":"/x"}"#;
    let error: serde_json::Value =
        serde_json::from_str(&run(&env("ADD", POD_ARGS), old).stdout).unwrap();
    assert_eq!(error["code"], code::INCOMPATIBLE_VERSION);
}

#[test]
fn check_asks_the_agent_and_fails_for_a_pod_not_captured() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cni.sock");
    let asked = agent(&socket, Reply::Captured);
    let out = run(&env("CHECK", POD_ARGS), &conf(&socket, ""));
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, ""));
    assert_eq!(asked.recv().unwrap().command, Command::Check);

    let socket = dir.path().join("cni2.sock");
    let _asked = agent(
        &socket,
        Reply::Failed("pod shop/web is not captured: pending".into()),
    );
    let out = run(&env("CHECK", POD_ARGS), &conf(&socket, ""));
    assert_eq!(out.exit_code, 1);
    let error: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(error["code"], code::CAPTURE_FAILED);
}

#[test]
fn del_tells_the_agent_even_without_a_netns() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cni.sock");
    let asked = agent(&socket, Reply::Released);
    let mut del = env("DEL", POD_ARGS);
    del.insert("CNI_NETNS".into(), String::new());
    let out = run(&del, &conf(&socket, ""));
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, ""));
    let request = asked.recv().unwrap();
    assert_eq!(
        (request.command, request.netns.as_str()),
        (Command::Del, "")
    );
    assert_eq!(request.container_id, "sandbox-1");
}
