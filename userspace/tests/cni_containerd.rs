//! The CNI plugin end to end, with real node parts: containerd (its own
//! root, state, socket and configuration), runc, the reference CNI plugins
//! and shunt-cni chained by the agent; pod sandboxes and containers made
//! through the CRI as the kubelet makes them; the agent's pods from the
//! in-test API server. Installed by `cargo xtask setup`.
//!
//! Proves, in each redirection mode: a container whose very first action
//! is a connect is captured (its bytes reach the peer as HBONE, with the
//! pod's identity) because RunPodSandbox returned only once the pod was
//! captured; the watch, seeing the same pod, does not enrol it again; a pod
//! outside the mesh is untouched (its connect goes direct) and is later
//! enrolled by the watch with its netns found through the CRI of the real
//! containerd; DEL is answered (twice: StopPodSandbox, RemovePodSandbox);
//! the agent's exit with `--on-exit unenrol` takes shunt-cni out of the
//! CNI configuration. A pod (and its namespace) the watches have not shown
//! yet at ADD is read from the API server by name and captured all the
//! same. And a capture that fails fails the ADD.

#[path = "support/cni_bed.rs"]
mod cni_bed;
#[path = "support/containerd.rs"]
mod containerd;
#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use cni_bed::{CniBed, MESH_NS, PLAIN_NS, agent_args};
use serde_json::json;
use shunt::state::PodState;
use shunt_proto::istio::zds::workload_request::Payload;
use shunt_testbed::ztunnel::{InPodProxy, Options, ZdsClient};

/// The sandbox's IP, from the netns containerd made (as CNI's result gave
/// it): what `shunt status` lists for the pod.
fn sandbox_ip(bed: &CniBed, ns: &str, name: &str) -> String {
    bed.pod_status(ns, name)
        .and_then(|p| p.ips.first().map(|ip| ip.to_string()))
        .expect("the pod's IP in the agent's status")
}

/// The first line of `log` that has every one of `parts`.
fn line_of(log: &str, parts: &[&str]) -> Option<usize> {
    log.lines()
        .position(|line| parts.iter().all(|p| line.contains(p)))
}

async fn first_connect_is_captured(test: &str, mode: &str) {
    let mut bed = CniBed::start(test, &agent_args(mode)).await;
    let peer = bed.peer_addr().to_string();

    // An ambient pod: ADD waits for its capture. The pod watch lags (as it
    // can when the kubelet is quick): the agent reads the pod by name.
    bed.api.hold_watches(fake_apiserver::Kind::Pod);
    let uid = bed.add_pod(MESH_NS, "web", json!({}));
    let config = bed.sandbox_config(MESH_NS, "web", &uid);
    let started = Instant::now();
    let sandbox = match bed.ctd().run_sandbox(&config).await {
        Ok(id) => id,
        Err(status) => panic!(
            "RunPodSandbox: {status}\nagent log:\n{}\ncontainerd log:\n{}",
            bed.log(),
            bed.ctd().log()
        ),
    };
    eprintln!(
        "RunPodSandbox (ambient, captured) took {:?}",
        started.elapsed()
    );
    let reads = bed.reads_by_name();
    assert!(
        reads
            .iter()
            .any(|r| r == "/api/v1/namespaces/shop/pods/web"),
        "the pod the watch had not shown was read by name; reads: {reads:?}"
    );
    bed.api.release_watches();
    let web = bed
        .pod_status(MESH_NS, "web")
        .expect("web in the agent's status");
    assert_eq!(
        web.state,
        PodState::Enrolled,
        "captured before RunPodSandbox returned"
    );
    let info = bed.ctd().sandbox_info(&sandbox).await;
    let netns = web.netns.clone().expect("web's netns");
    // Causally, in the agent's own log: the pod was enrolled in the
    // sandbox's netns before the plugin got its answer.
    let log = bed.log();
    let enrolled_at = line_of(&log, &["pod enrolled", &netns.display().to_string()]);
    let answered_at = line_of(&log, &["CNI plugin answered", "shop/web"]);
    assert!(
        matches!((enrolled_at, answered_at), (Some(e), Some(a)) if e < a),
        "enrolled (line {enrolled_at:?}) before the ADD's answer (line {answered_at:?}); log:\n{log}"
    );
    assert!(
        info.contains(&netns.display().to_string()),
        "the netns enrolled is the sandbox's ({}), containerd says: {info}",
        netns.display()
    );
    let container = bed
        .ctd()
        .run_container(&sandbox, &config, &["connect", &peer, "hello"])
        .await;
    let (exit, output) = bed.ctd().wait_exited(&container, &config).await;
    assert_eq!(exit, 0, "the container's connect: {output}");
    assert!(
        output.contains("captured:hello"),
        "answered over HBONE: {output}"
    );
    let received = tokio::time::timeout(Duration::from_secs(10), bed.received.recv())
        .await
        .expect("the peer's HBONE terminator saw the CONNECT")
        .expect("a CONNECT");
    assert_eq!(received.authority, peer);
    assert_eq!(received.bytes, b"hello");
    assert_eq!(
        received.client_identity.as_deref(),
        Some("spiffe://cluster.local/ns/shop/sa/sleep")
    );

    // The kubelet reports the IP; the watch now lists the pod too: it stays
    // enrolled in the same netns (one pod, not two enrolments).
    let ip = sandbox_ip(&bed, MESH_NS, "web");
    bed.report_ip(MESH_NS, "web", &ip);
    bed.wait_verify_passes("two verify passes after the watch saw web's IP")
        .await;
    let web = bed.pod_status(MESH_NS, "web").expect("web");
    assert_eq!(web.state, PodState::Enrolled);
    assert_eq!(
        web.netns.as_ref(),
        Some(&netns),
        "still the CNI sandbox's netns"
    );
    assert_eq!(
        bed.log()
            .matches("CNI ADD: capturing before the sandbox starts")
            .count(),
        1,
        "one ADD"
    );

    // A pod outside the mesh: ADD passes at once, its connect goes direct.
    let uid = bed.add_pod(PLAIN_NS, "other", json!({}));
    let config = bed.sandbox_config(PLAIN_NS, "other", &uid);
    let other = bed
        .ctd()
        .run_sandbox(&config)
        .await
        .expect("RunPodSandbox (not in mesh)");
    let container = bed
        .ctd()
        .run_container(&other, &config, &["connect", &peer, "plain"])
        .await;
    let (exit, output) = bed.ctd().wait_exited(&container, &config).await;
    assert_eq!(exit, 0, "{output}");
    assert!(output.contains("direct:plain"), "not captured: {output}");
    let state = bed.pod_status(PLAIN_NS, "other").map(|p| p.state);
    assert!(
        matches!(state, None | Some(PodState::NotInMesh)),
        "untouched: {state:?}"
    );

    // Labelled ambient afterwards, with its IP reported: the watch enrols
    // it, its netns found through containerd's CRI.
    let info = bed.ctd().sandbox_info(&other).await;
    let ip = {
        // The address host-local gave it, from containerd's view of the
        // sandbox: the CNI result in its verbose status.
        let value: serde_json::Value = serde_json::from_str(&info).expect("sandbox info JSON");
        value["cniResult"]["Interfaces"]["eth0"]["IPConfigs"][0]["IP"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no CNI result in the sandbox's status: {info}"))
    };
    bed.report_ip(PLAIN_NS, "other", &ip);
    bed.api
        .update(fake_apiserver::Kind::Pod, PLAIN_NS, "other", |pod| {
            pod["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "ambient"})
        });
    bed.wait("other enrolled by the watch", |bed| {
        bed.pod_status(PLAIN_NS, "other")
            .is_some_and(|p| p.state == PodState::Enrolled)
    })
    .await;
    let enrolled = bed.pod_status(PLAIN_NS, "other").expect("other");
    let found = enrolled.netns.expect("other's netns").display().to_string();
    assert!(
        info.contains(&found),
        "the netns the CRI gave ({found}) is the sandbox's: {info}"
    );
    assert!(
        bed.log().contains("found through the container runtime") || bed.log().contains("CRI"),
        "found through the CRI"
    );

    // DEL (StopPodSandbox, RemovePodSandbox; the second with an empty
    // netns) is answered, and the agent forgets the sandbox once.
    bed.ctd().remove_sandbox(&sandbox).await;
    bed.wait("the agent forgot web's sandbox", |bed| {
        line_of(&bed.log(), &["CNI DEL: the sandbox is gone", &sandbox]).is_some()
    })
    .await;
    assert_eq!(
        bed.log().matches("CNI DEL: the sandbox is gone").count(),
        1,
        "forgotten once, whichever DEL comes"
    );
    // Exit with --on-exit unenrol: shunt-cni leaves the configuration.
    bed.stop_agent().await;
    let conflist = bed.conflist();
    assert!(!conflist.contains("shunt-cni"), "entry removed: {conflist}");
    assert!(conflist.contains("\"bridge\""), "the rest kept: {conflist}");
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ebpf_first_connect_of_a_containerd_sandbox_is_captured() {
    first_connect_is_captured("cni-ebpf", "ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_first_connect_of_a_containerd_sandbox_is_captured() {
    first_connect_is_captured("cni-ipt", "iptables").await;
}

/// A namespace labelled ambient and a pod in it created at once, the ADD
/// coming before either watch shows them (they lag): the agent reads both
/// by name, captures the pod before RunPodSandbox returns, and once the
/// watches catch up keeps that one enrolment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_of_a_namespace_no_watch_has_shown_is_read_and_captured() {
    let mut bed = CniBed::start("cni-fresh", &agent_args("ebpf")).await;
    bed.api.hold_watches(fake_apiserver::Kind::Namespace);
    bed.api.hold_watches(fake_apiserver::Kind::Pod);
    bed.api.apply(
        fake_apiserver::Kind::Namespace,
        fake_apiserver::namespace("fresh", json!({"istio.io/dataplane-mode": "ambient"})),
    );
    let uid = bed.add_pod("fresh", "web", json!({}));
    let config = bed.sandbox_config("fresh", "web", &uid);
    if let Err(status) = bed.ctd().run_sandbox(&config).await {
        panic!("RunPodSandbox: {status}\nagent log:\n{}", bed.log());
    }
    let web = bed
        .pod_status("fresh", "web")
        .expect("web in the agent's status");
    assert_eq!(
        web.state,
        PodState::Enrolled,
        "captured before RunPodSandbox returned"
    );
    let reads = bed.reads_by_name();
    for path in [
        "/api/v1/namespaces/fresh/pods/web",
        "/api/v1/namespaces/fresh",
    ] {
        assert!(
            reads.iter().any(|r| r == path),
            "{path} read by name; reads: {reads:?}"
        );
    }

    bed.api.release_watches();
    bed.wait_verify_passes("two verify passes after the watches caught up")
        .await;
    let after = bed.pod_status("fresh", "web").expect("web");
    assert_eq!(after.state, PodState::Enrolled);
    assert_eq!(after.netns, web.netns, "the same enrolment");
    bed.shutdown().await;
}

/// `--proxy ztunnel`: while no ztunnel acknowledges the pod, its ADD fails
/// (the capture failed: the runtime retries, and nothing of the sandbox
/// is left); once a ztunnel serves ZDS, the retried sandbox is handed to
/// it before RunPodSandbox returns, and the container's first connect
/// reaches ztunnel's listener in the pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_capture_failure_fails_add_and_the_retry_is_handed_to_ztunnel() {
    let mut args = agent_args("ztunnel");
    args.extend(["--cni-timeout".to_owned(), "3".to_owned()]);
    let mut bed = CniBed::start("cni-zt", &args).await;
    let peer = bed.peer_addr();

    let uid = bed.add_pod(MESH_NS, "web", json!({}));
    let config = bed.sandbox_config(MESH_NS, "web", &uid);
    let error = bed
        .ctd()
        .run_sandbox(&config)
        .await
        .expect_err("no ztunnel: the capture cannot complete, so ADD fails");
    let message = error.message().to_owned();
    assert!(
        message.contains("could not capture pod shop/web")
            && message.contains("not captured within"),
        "the plugin's error names the pod and the wait: {message}"
    );

    // A ztunnel (the stand-in) connects and serves every pod it is given.
    let proxies: Arc<Mutex<Vec<InPodProxy>>> = Arc::default();
    let socket = bed.dir.path().join("zds.sock");
    let cgroup = bed.pods_cgroup().to_owned();
    let served = proxies.clone();
    std::thread::spawn(move || {
        let zds = ZdsClient::connect(&socket).expect("connect to the agent's ZDS socket");
        zds.hello().expect("hello");
        // Ends when the agent closes the connection (its exit).
        while let Ok((payload, mut fds)) = zds.recv() {
            if let Payload::Add(_) = payload {
                let proxy =
                    InPodProxy::start_with(fds.remove(0), Options::new(Some(cgroup.clone())))
                        .expect("bind in the pod");
                served.lock().unwrap_or_else(|p| p.into_inner()).push(proxy);
            }
            if zds.ack().is_err() {
                break;
            }
        }
    });

    // The kubelet's retry: a new attempt of the sandbox.
    let mut config = config;
    if let Some(meta) = config.metadata.as_mut() {
        meta.attempt = 1;
    }
    let sandbox = match bed.ctd().run_sandbox(&config).await {
        Ok(id) => id,
        Err(status) => panic!(
            "RunPodSandbox with ztunnel: {status}\nagent log:\n{}",
            bed.log()
        ),
    };
    assert_eq!(
        bed.pod_status(MESH_NS, "web").map(|p| p.state),
        Some(PodState::Enrolled),
        "acknowledged by ztunnel before RunPodSandbox returned"
    );
    assert_eq!(proxies.lock().unwrap_or_else(|p| p.into_inner()).len(), 1);
    let container = bed
        .ctd()
        .run_container(&sandbox, &config, &["connect", &peer.to_string(), "hello"])
        .await;
    let (exit, output) = bed.ctd().wait_exited(&container, &config).await;
    assert_eq!(exit, 0, "{output}");
    let outbound = proxies.lock().unwrap_or_else(|p| p.into_inner())[0].outbound();
    assert_eq!(
        outbound.len(),
        1,
        "the first connect went to ztunnel: {outbound:?}"
    );
    assert_eq!(
        outbound[0].original,
        Ok(peer),
        "with its original destination"
    );
    assert!(
        output.contains("direct:hello"),
        "relayed by ztunnel: {output}"
    );
    bed.shutdown().await;
}
