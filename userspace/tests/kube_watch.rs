//! The Kubernetes pod source against an in-test API server
//! (`support/fake_apiserver.rs`), with the real kube-rs client and watcher
//! and the real eBPF redirector enrolling pods that are network namespaces
//! of a `shunt-testbed` topology. The bulk tests, without the kernel, are
//! in `kube_watch_bulk.rs`.
//!
//! The testbed's pods have no processes, so their netns cannot be found by
//! scanning `/proc` (the agent's resolver, unit-tested on a fake `/proc`):
//! these tests hand the source a `MapResolver` that knows each pod's netns
//! path, as a test-only stand-in for discovery.
//!
//! Every wait is bounded; the API server listens on 127.0.0.1 only.

// By path, not through `support/mod.rs`: other test files share `support/`
// with modules of their own.
#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;
#[path = "support/fake_cri.rs"]
mod fake_cri;
#[path = "support/kube_agent.rs"]
mod kube_agent;
#[path = "support/kube_harness.rs"]
mod kube_harness;

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use fake_apiserver::{FakeApiServer, Kind, authorization_policy, namespace, pod};
use kube_agent::{Agent, AgentProcess, ChildGuard, PinDir};
use kube_harness::{http_get, wait_for};
use serde_json::{Value, json};
use shunt::{
    agent::NodeAgent,
    control::kube::{
        ChainResolver, CriOptions, CriResolver, Enablement, KubeOptions, KubeSource, MapResolver,
        NetnsResolver, ProcScanResolver, pod::REDIRECTION_ANNOTATION,
    },
    redirect::{
        Capture,
        ebpf::{EbpfOptions, EbpfRedirector, SpliceMode},
    },
    state::{PodState, TrustDomain, WorkloadKey},
};
use shunt_testbed::{Cgroup, Pod, Topology, inspect, poll::eventually, require_root};

const NODE: &str = "node-a";
/// Upper bound for anything the agent should do after a change.
const TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------- logging

#[path = "support/captured_logs.rs"]
mod captured_logs;
use captured_logs::{log_lines_with, logged};

fn init_logging() {
    captured_logs::init_logging("info,shunt=debug,kube=info");
}

// ---------------------------------------------------------------- harness

struct Harness {
    server: FakeApiServer,
    resolver: MapResolver,
    dir: tempfile::TempDir,
    // Dropped last: the topology deletes the pods' netns.
    pin_dir: PinDir,
    topo: Topology,
}

impl Harness {
    async fn new(test: &str, pods: &[&str]) -> Self {
        init_logging();
        require_root().expect("kernel tests need root");
        let mut topo = Topology::new(test).expect("topology");
        topo.add_node(NODE).expect("node");
        let resolver = MapResolver::new();
        for name in pods {
            topo.add_pod(NODE, name).expect("pod");
        }
        let pin_dir = PinDir(PathBuf::from(format!("/sys/fs/bpf/{}-kube", topo.prefix())));
        let server = FakeApiServer::start().await;
        let dir = tempfile::tempdir().expect("temp dir");
        Self {
            server,
            resolver,
            dir,
            pin_dir,
            topo,
        }
    }

    fn pod(&self, name: &str) -> &Pod {
        self.topo.pod(name).expect("testbed pod")
    }

    /// Serves testbed pod `name` in namespace `ns` (with its IP) and tells
    /// the resolver its netns.
    fn serve_pod(&self, ns: &str, name: &str, labels: Value) {
        let pod_ = self.pod(name);
        self.resolver
            .insert(WorkloadKey::new(ns, name), pod_.netns_path());
        self.server.apply(
            Kind::Pod,
            pod(ns, name, NODE, Some(&pod_.ip().to_string()), labels),
        );
    }

    /// Starts an agent (a fresh eBPF redirector on this test's pin dir) with
    /// a Kubernetes source talking to the fake server.
    async fn start_agent(&self, options: impl FnOnce(&mut KubeOptions)) -> Agent {
        self.start_agent_with(Arc::new(self.resolver.clone()), options)
            .await
    }

    /// Starts an agent whose resolver asks the CRI on `socket`, then /proc
    /// (the agent's own chain).
    async fn start_agent_with_cri(&self, socket: &std::path::Path) -> Agent {
        let cri = CriResolver::new(
            socket,
            tokio::runtime::Handle::current(),
            CriOptions::default(),
        )
        .expect("CRI resolver");
        let chain = ChainResolver::new(Some(cri), ProcScanResolver::default());
        self.start_agent_with(Arc::new(chain), |_| {}).await
    }

    async fn start_agent_with(
        &self,
        resolver: Arc<dyn NetnsResolver>,
        options: impl FnOnce(&mut KubeOptions),
    ) -> Agent {
        self.start_agent_spliced(resolver, SpliceMode::Off, options)
            .await
    }

    async fn start_agent_spliced(
        &self,
        resolver: Arc<dyn NetnsResolver>,
        splice: SpliceMode,
        options: impl FnOnce(&mut KubeOptions),
    ) -> Agent {
        // Socket programs attach to this topology's cgroup only; pods are
        // only counted (no proxy runs in these tests).
        let ebpf_options = EbpfOptions {
            cgroup_root: Some(self.topo.cgroup_root().expect("topology cgroup")),
            splice,
            ..EbpfOptions::new(&self.pin_dir.0)
        };
        let redirector = EbpfRedirector::load(&ebpf_options).expect("load eBPF");
        let agent = NodeAgent::new(
            NODE.into(),
            TrustDomain::default(),
            Box::new(redirector),
            Capture::default(),
        );
        let client = self.server.client(self.dir.path()).await;
        let mut opts = KubeOptions::new(NODE);
        options(&mut opts);
        // The reconciler verifies (and repairs) as often as the source
        // resyncs: a test that shortens one shortens both.
        let verify_every = opts.resync;
        Agent::start(agent, KubeSource::new(client, opts, resolver), verify_every)
    }

    /// The `shunt agent` binary on this harness's API server, pin dir and
    /// topology cgroup ([`kube_agent::spawn_agent_binary`]).
    fn spawn_agent_binary(&self, extra: &[&str]) -> AgentProcess {
        let kubeconfig = self.server.write_kubeconfig(self.dir.path());
        kube_agent::spawn_agent_binary(
            NODE,
            &kubeconfig,
            &self.pin_dir.0,
            &self.topo.cgroup_root().expect("topology cgroup"),
            self.dir.path(),
            extra,
        )
    }

    /// Starts a process for testbed pod `name` (see [`PodProcess`]) and
    /// serves the pod, with the UID in that process's cgroup path, in
    /// namespace `ns` labelled ambient.
    async fn pod_process(&self, ns: &str, name: &str) -> PodProcess {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let uid = format!("{:08x}-5eed-4000-8000-{:012x}", std::process::id(), nanos);
        let cgroup = Cgroup::create(&self.topo, &format!("pod{uid}")).expect("pod cgroup");
        let mut command = self.pod(name).command("sleep");
        command.arg("60");
        let child = ChildGuard(
            cgroup
                .place(&mut command)
                .spawn()
                .expect("start sleep in the pod"),
        );
        let pid = child.0.id();
        // nsenter enters the netns, then execs sleep under the same PID.
        let pod_netns = std::fs::metadata(self.pod(name).netns_path()).expect("pod netns");
        wait_for("the process is in the pod's netns", TIMEOUT, || {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|m| m.ino() == pod_netns.ino() && m.dev() == pod_netns.dev())
        })
        .await;
        self.server.apply(Kind::Namespace, namespace(ns, ambient()));
        let ip = self.pod(name).ip().to_string();
        let mut object = pod(ns, name, NODE, Some(&ip), json!({}));
        object["metadata"]["uid"] = json!(uid);
        self.server.apply(Kind::Pod, object);
        PodProcess {
            pid,
            _child: child,
            _cgroup: cgroup,
        }
    }

    /// Replaces a served pod's labels, keeping the rest (annotations).
    fn label_pod(&self, ns: &str, name: &str, labels: Value) {
        self.server.update(Kind::Pod, ns, name, |pod| {
            pod["metadata"]["labels"] = labels
        });
    }

    fn annotation(&self, ns: &str, name: &str) -> Option<String> {
        self.server.object(Kind::Pod, ns, name).and_then(|p| {
            p["metadata"]["annotations"][REDIRECTION_ANNOTATION]
                .as_str()
                .map(str::to_owned)
        })
    }

    fn patches_for(&self, ns: &str, name: &str) -> Vec<Value> {
        self.server
            .patches()
            .into_iter()
            .filter(|p| p.namespace == ns && p.name == name)
            .map(|p| p.body)
            .collect()
    }

    /// Whether shunt's TC filters are on the pod's eth0 (both directions),
    /// as `tc filter show` reports them.
    fn tc_attached(&self, name: &str) -> bool {
        let netns = self.pod(name).netns_path();
        ["ingress", "egress"].iter().all(|hook| {
            inspect::tc_filters(&netns, "eth0", hook)
                .map(|filters| !filters.is_empty())
                .unwrap_or(false)
        })
    }

    fn tc_detached(&self, name: &str) -> bool {
        let netns = self.pod(name).netns_path();
        ["ingress", "egress"].iter().all(|hook| {
            inspect::tc_filters(&netns, "eth0", hook)
                .map(|filters| filters.is_empty())
                .unwrap_or(false)
        })
    }
}

fn ambient() -> Value {
    json!({"istio.io/dataplane-mode": "ambient"})
}

fn opt_out() -> Value {
    json!({"istio.io/dataplane-mode": "none"})
}

// ---------------------------------------------------------------- tests

/// A pod labelled ambient is enrolled once it has an IP (annotated
/// `pending` before, `enabled` after), and unenrolled when deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_added_is_enrolled_and_annotated_then_unenrolled_when_deleted() {
    let h = Harness::new("kube-add", &["web"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", json!({})));
    let agent = h.start_agent(|_| {}).await;

    // Created before the CNI gave it an IP: wants the mesh, cannot be
    // redirected yet.
    h.resolver
        .insert(WorkloadKey::new("shop", "web"), h.pod("web").netns_path());
    h.server
        .apply(Kind::Pod, pod("shop", "web", NODE, None, ambient()));
    wait_for("web pending", TIMEOUT, || {
        matches!(agent.state("web", "shop"), Some(PodState::Pending(_)))
            && h.annotation("shop", "web").as_deref() == Some("pending")
    })
    .await;
    assert!(
        h.tc_detached("web"),
        "nothing attached before the pod has an IP"
    );

    // The IP arrives.
    let ip = h.pod("web").ip().to_string();
    h.server.update(Kind::Pod, "shop", "web", |pod| {
        pod["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
    });
    wait_for("web enrolled and annotated enabled", TIMEOUT, || {
        agent.enrolled("web", "shop") && h.annotation("shop", "web").as_deref() == Some("enabled")
    })
    .await;
    assert!(h.tc_attached("web"), "TC programs on web's eth0");
    let patches = h.patches_for("shop", "web");
    assert_eq!(
        patches,
        vec![
            json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: "pending"}}}),
            json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: "enabled"}}}),
        ],
        "one merge patch per state change, nothing else touched"
    );
    assert!(
        h.server
            .patches()
            .iter()
            .all(|p| p.content_type == "application/merge-patch+json")
    );

    h.server.delete(Kind::Pod, "shop", "web");
    wait_for("web unenrolled", TIMEOUT, || {
        agent.state("web", "shop").is_none()
    })
    .await;
    wait_for("web's TC filters gone", TIMEOUT, || h.tc_detached("web")).await;
    assert_eq!(
        h.patches_for("shop", "web").len(),
        2,
        "a deleted pod is not patched"
    );
    agent.stop(true).await;
}

/// Label flips on a pod and on its namespace move pods in and out; the
/// annotation follows and is removed on unenrolment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_flips_on_pod_and_namespace_enrol_and_unenrol() {
    let h = Harness::new("kube-flip", &["web", "db"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", json!({})));
    h.serve_pod("shop", "web", json!({}));
    h.serve_pod("shop", "db", json!({}));
    let agent = h.start_agent(|_| {}).await;
    wait_for("both pods known, not in the mesh", TIMEOUT, || {
        agent.state("web", "shop") == Some(PodState::NotInMesh)
            && agent.state("db", "shop") == Some(PodState::NotInMesh)
    })
    .await;

    // Pod label: web joins.
    h.label_pod("shop", "web", ambient());
    wait_for("web enrolled", TIMEOUT, || {
        agent.enrolled("web", "shop") && h.annotation("shop", "web").as_deref() == Some("enabled")
    })
    .await;
    assert!(h.tc_attached("web"));
    assert_eq!(agent.state("db", "shop"), Some(PodState::NotInMesh));

    // Namespace label: db joins too.
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    wait_for("db enrolled through its namespace", TIMEOUT, || {
        agent.enrolled("db", "shop") && h.annotation("shop", "db").as_deref() == Some("enabled")
    })
    .await;
    assert!(h.tc_attached("db"));

    // Pod label flips to none: web opts out although its namespace is in.
    h.label_pod("shop", "web", opt_out());
    wait_for("web opted out, annotation removed", TIMEOUT, || {
        agent.state("web", "shop") == Some(PodState::NotInMesh)
            && h.annotation("shop", "web").is_none()
    })
    .await;
    assert!(h.tc_detached("web"), "web's programs detached");
    assert_eq!(
        h.patches_for("shop", "web").last(),
        Some(&json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: null}}})),
        "removed with a merge patch"
    );

    // Namespace label removed: db leaves.
    h.server
        .apply(Kind::Namespace, namespace("shop", json!({})));
    wait_for("db unenrolled", TIMEOUT, || {
        agent.state("db", "shop") == Some(PodState::NotInMesh)
            && h.annotation("shop", "db").is_none()
    })
    .await;
    assert!(h.tc_detached("db"));
    assert!(!agent.enrolled("web", "shop"));
    agent.stop(true).await;
}

/// The pod's `shunt.io/splice` annotation, changed on a running pod, moves
/// it off the splice and back (`--splice on`): the agent re-enrols it with
/// the new setting, which `shunt status` shows as its splice hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn splice_annotation_changes_take_effect_on_a_running_pod() {
    let h = Harness::new("kube-splice", &["web"]).await;
    h.serve_pod("shop", "web", ambient());
    let agent = h
        .start_agent_spliced(Arc::new(h.resolver.clone()), SpliceMode::On, |_| {})
        .await;
    let spliced = |agent: &Agent| {
        agent
            .snapshots
            .borrow()
            .pod(&WorkloadKey::new("shop", "web"))
            .and_then(|p| p.kernel.as_ref())
            .is_some_and(|k| k.hooks.iter().any(|hook| hook.name == "splice"))
    };
    wait_for("web enrolled and spliced", TIMEOUT, || {
        agent.enrolled("web", "shop") && spliced(&agent)
    })
    .await;

    let annotate = |value: Value| {
        h.server.update(Kind::Pod, "shop", "web", |pod| {
            pod["metadata"]["annotations"]["shunt.io/splice"] = value
        })
    };
    annotate(json!("off"));
    wait_for("web kept off the splice", TIMEOUT, || {
        agent.enrolled("web", "shop") && !spliced(&agent)
    })
    .await;
    annotate(json!("on"));
    wait_for("web spliced again", TIMEOUT, || {
        agent.enrolled("web", "shop") && spliced(&agent)
    })
    .await;
    agent.stop(true).await;
}

/// Opted-out and host-network pods are never enrolled nor annotated, even in
/// an ambient namespace; pods of other nodes never reach the agent (the
/// field selector is sent and honoured).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opted_out_host_network_and_other_node_pods_are_never_touched() {
    let h = Harness::new("kube-never", &["web", "optout", "hostnet"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    h.serve_pod("shop", "web", json!({}));
    h.serve_pod("shop", "optout", opt_out());
    let mut host = pod("shop", "hostnet", NODE, Some("198.19.0.1"), ambient());
    host["spec"]["hostNetwork"] = json!(true);
    h.resolver.insert(
        WorkloadKey::new("shop", "hostnet"),
        h.pod("hostnet").netns_path(),
    );
    h.server.apply(Kind::Pod, host);
    h.server.apply(
        Kind::Pod,
        pod(
            "shop",
            "elsewhere",
            "node-b",
            Some("198.18.2.10"),
            ambient(),
        ),
    );
    let agent = h.start_agent(|_| {}).await;
    wait_for("web enrolled", TIMEOUT, || {
        agent.enrolled("web", "shop") && h.annotation("shop", "web").as_deref() == Some("enabled")
    })
    .await;
    // A few more syncs for the others to be mis-handled in: each flip of
    // web's splice annotation changes web's workload, so each is reconciled
    // (the reconcile counter moves once it was).
    for i in 0..3 {
        let before = agent
            .stats
            .reconciles
            .load(std::sync::atomic::Ordering::Relaxed);
        let splice = if i % 2 == 0 { "off" } else { "on" };
        h.server.update(Kind::Pod, "shop", "web", |pod| {
            pod["metadata"]["annotations"]["shunt.io/splice"] = json!(splice)
        });
        wait_for("the churn on web reconciled", TIMEOUT, || {
            agent
                .stats
                .reconciles
                .load(std::sync::atomic::Ordering::Relaxed)
                > before
        })
        .await;
    }
    for name in ["optout", "hostnet"] {
        assert_eq!(
            agent.state(name, "shop"),
            Some(PodState::NotInMesh),
            "{name}"
        );
        assert!(h.tc_detached(name), "{name} untouched in the kernel");
        assert!(
            h.patches_for("shop", name).is_empty(),
            "{name} never annotated"
        );
    }
    assert_eq!(
        agent.state("elsewhere", "shop"),
        None,
        "other node's pod unknown"
    );
    assert!(h.patches_for("shop", "elsewhere").is_empty());
    let pod_requests: Vec<_> = h
        .server
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path == "/api/v1/pods")
        .collect();
    assert!(!pod_requests.is_empty());
    for request in &pod_requests {
        assert_eq!(
            request.query.get("fieldSelector").map(String::as_str),
            Some("spec.nodeName=node-a"),
            "{request:?}"
        );
    }
    assert!(
        pod_requests
            .iter()
            .any(|r| r.query.get("watch").is_some_and(|w| w == "true")
                && r.query
                    .get("allowWatchBookmarks")
                    .is_some_and(|b| b == "true")),
        "watches ask for bookmarks"
    );
    let web_patches = h.patches_for("shop", "web").len();
    let before = agent
        .stats
        .reconciles
        .load(std::sync::atomic::Ordering::Relaxed);
    h.server.bookmark();
    // A change the watch delivers after the bookmark, to another pod: once
    // it is reconciled, the bookmark was handled too.
    h.server.update(Kind::Pod, "shop", "optout", |pod| {
        pod["metadata"]["annotations"]["shunt.io/splice"] = json!("on")
    });
    wait_for("a change after the bookmark reconciled", TIMEOUT, || {
        agent
            .stats
            .reconciles
            .load(std::sync::atomic::Ordering::Relaxed)
            > before
    })
    .await;
    assert!(agent.enrolled("web", "shop"), "a bookmark changes nothing");
    assert_eq!(
        h.patches_for("shop", "web").len(),
        web_patches,
        "web's annotation never flapped"
    );
    agent.stop(true).await;
}

/// istio-cni's `excludeNamespaces` and `ambient.enablementSelectors`: by
/// default kube-system is never enrolled, whatever its labels; custom
/// selectors and exclusions decide instead of the dataplane-mode labels.
/// The annotation goes through `pods/status` (the fake server refuses a
/// patch of the whole pod, as RBAC would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excluded_namespaces_and_enablement_selectors_decide_who_joins() {
    let h = Harness::new("kube-select", &["web", "sys", "team"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    h.server
        .apply(Kind::Namespace, namespace("kube-system", ambient()));
    h.server.apply(Kind::Namespace, namespace("lab", json!({})));
    h.serve_pod("shop", "web", json!({}));
    h.serve_pod("kube-system", "sys", ambient());
    h.serve_pod("lab", "team", json!({"team": "mesh"}));

    // Istio's defaults: the labels decide, kube-system is left out.
    let agent = h.start_agent(|_| {}).await;
    wait_for("web enrolled and annotated", TIMEOUT, || {
        agent.enrolled("web", "shop") && h.annotation("shop", "web").as_deref() == Some("enabled")
    })
    .await;
    for (ns, name) in [("kube-system", "sys"), ("lab", "team")] {
        assert_eq!(agent.state(name, ns), Some(PodState::NotInMesh), "{name}");
        assert!(h.tc_detached(name), "{name} untouched in the kernel");
        assert!(h.patches_for(ns, name).is_empty(), "{name} never annotated");
    }
    let patch_paths: Vec<String> = h
        .server
        .requests()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .map(|r| r.path)
        .collect();
    assert_eq!(
        patch_paths,
        ["/api/v1/namespaces/shop/pods/web/status"],
        "the annotation through the status subresource only"
    );
    agent.stop(true).await;

    // Custom rules: pods labelled team=mesh anywhere, shop excluded.
    let selectors = Enablement::new(
        "[{podSelector: {matchLabels: {team: mesh}}}]",
        ["shop".to_string()],
    )
    .expect("selectors parse");
    let agent = h.start_agent(|o| o.enablement = Arc::new(selectors)).await;
    wait_for("team enrolled and annotated", TIMEOUT, || {
        agent.enrolled("team", "lab") && h.annotation("lab", "team").as_deref() == Some("enabled")
    })
    .await;
    wait_for("web out of the mesh, annotation cleared", TIMEOUT, || {
        agent.state("web", "shop") == Some(PodState::NotInMesh)
            && h.annotation("shop", "web").is_none()
    })
    .await;
    assert!(h.tc_detached("web"), "web's redirection removed");
    assert_eq!(agent.state("sys", "kube-system"), Some(PodState::NotInMesh));
    assert!(h.patches_for("kube-system", "sys").is_empty());
    agent.stop(true).await;
}

/// `410 Gone` — as an ERROR event on a live watch, and for a watch resuming
/// from compacted history after a dropped connection — makes the watcher
/// relist; the relist never makes enrolled pods flap, and catches up with
/// what changed while the watch was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_410_forces_a_relist_that_catches_up_without_flapping() {
    let h = Harness::new("kube-gone", &["a", "b", "c"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    h.serve_pod("shop", "a", json!({}));
    h.serve_pod("shop", "b", json!({}));
    let agent = h.start_agent(|_| {}).await;
    wait_for("a and b enrolled", TIMEOUT, || {
        agent.enrolled("a", "shop") && agent.enrolled("b", "shop")
    })
    .await;
    let pod_lists = || {
        h.server
            .requests()
            .iter()
            .filter(|r| r.path == "/api/v1/pods" && !r.query.contains_key("watch"))
            .count()
    };
    let lists_before = pod_lists();
    wait_for("watches open", TIMEOUT, || h.server.open_watches() >= 2).await;

    // 1. An ERROR 410 event on the live watches: relist, nothing changes.
    h.server.send_gone();
    wait_for("pods relisted after the 410 event", TIMEOUT, || {
        pod_lists() > lists_before
    })
    .await;
    wait_for("watches reopened", TIMEOUT, || h.server.open_watches() >= 2).await;
    assert!(agent.enrolled("a", "shop") && agent.enrolled("b", "shop"));
    assert!(h.tc_attached("a") && h.tc_attached("b"));

    // 2. The watches drop; meanwhile b goes, c comes, and history is
    //    compacted: resuming from the last version seen gets 410.
    let lists_before = pod_lists();
    h.server.drop_watches();
    h.server.delete(Kind::Pod, "shop", "b");
    h.serve_pod("shop", "c", json!({}));
    h.server.compact();
    wait_for("relisted after the 410 on resume", TIMEOUT, || {
        pod_lists() > lists_before
    })
    .await;
    wait_for("c enrolled, b unenrolled", TIMEOUT, || {
        agent.enrolled("c", "shop") && agent.state("b", "shop").is_none()
    })
    .await;
    assert!(h.tc_attached("c") && h.tc_detached("b"));
    assert!(
        agent.enrolled("a", "shop"),
        "a stayed enrolled through both relists"
    );
    assert_eq!(
        h.patches_for("shop", "a").len(),
        1,
        "a's annotation never flapped"
    );
    assert!(
        agent
            .stats
            .watch_errors
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
    agent.stop(true).await;
}

/// Objects that do not parse are logged with their name and skipped: the
/// list still delivers the other pods, a pod that turns malformed keeps its
/// last good state, and the loop keeps going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_objects_are_logged_by_name_and_skipped() {
    let h = Harness::new("kube-malformed", &["good", "later"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    h.serve_pod("shop", "good", json!({}));
    let mut broken = pod(
        "shop",
        "broken-at-list",
        NODE,
        Some("198.18.1.250"),
        json!({}),
    );
    broken["spec"]["containers"] = json!("not a list");
    h.server.apply(Kind::Pod, broken);
    // A namespace whose labels are not a map.
    h.server.apply(
        Kind::Namespace,
        json!({"metadata": {"name": "weird-ns", "labels": ["x"]}}),
    );
    let agent = h.start_agent(|_| {}).await;
    wait_for(
        "good enrolled despite its malformed neighbour",
        TIMEOUT,
        || agent.enrolled("good", "shop"),
    )
    .await;
    assert!(
        logged("shop/broken-at-list"),
        "the malformed pod is named in the log"
    );
    assert!(
        logged("weird-ns"),
        "the malformed namespace is named in the log"
    );
    assert_eq!(agent.state("broken-at-list", "shop"), None);

    // good turns malformed in a watch event: logged, its last good version
    // stays, so it stays enrolled.
    let mut bad = h.server.object(Kind::Pod, "shop", "good").expect("good");
    bad["status"]["podIPs"] = json!(42);
    h.server.apply(Kind::Pod, bad);
    wait_for("the malformed update is logged", TIMEOUT, || {
        !log_lines_with(&["malformed object skipped", "shop/good"]).is_empty()
    })
    .await;
    assert!(agent.enrolled("good", "shop") && h.tc_attached("good"));

    // The loop goes on.
    h.serve_pod("shop", "later", json!({}));
    wait_for("later enrolled", TIMEOUT, || {
        agent.enrolled("later", "shop")
    })
    .await;
    // And a malformed pod can still be deleted by name.
    h.server.delete(Kind::Pod, "shop", "good");
    wait_for("good unenrolled on delete", TIMEOUT, || {
        agent.state("good", "shop").is_none()
    })
    .await;
    assert!(h.tc_detached("good"));
    agent.stop(true).await;
}

/// The API server goes away for 10 s: every enrolled pod stays redirected
/// the whole time (sampled in the kernel), and once it is back the agent
/// catches up with what changed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_outage_keeps_pods_enrolled_and_the_agent_catches_up() {
    let h = Harness::new("kube-outage", &["a", "b", "c"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    h.serve_pod("shop", "a", json!({}));
    h.serve_pod("shop", "b", json!({}));
    // A short resync (and verify interval) so that several verify passes
    // happen during the outage: they must keep (repair), not drop, what is
    // enrolled.
    let agent = h.start_agent(|o| o.resync = Duration::from_secs(2)).await;
    wait_for("a and b enrolled", TIMEOUT, || {
        agent.enrolled("a", "shop") && agent.enrolled("b", "shop")
    })
    .await;

    h.server.stop();
    let outage = Instant::now();
    let mut samples = 0;
    while outage.elapsed() < Duration::from_secs(10) {
        assert!(
            agent.enrolled("a", "shop") && agent.enrolled("b", "shop"),
            "enrolled pods stay enrolled during the outage"
        );
        assert!(
            h.tc_attached("a") && h.tc_attached("b"),
            "and redirected in the kernel"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(samples >= 15);
    assert!(
        agent
            .stats
            .watch_errors
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "the outage was noticed"
    );
    // What changed while the agent could not see it.
    h.server.delete(Kind::Pod, "shop", "b");
    h.serve_pod("shop", "c", json!({}));
    h.server.resume().await;

    // kube-rs' backoff may be at several seconds by now.
    wait_for(
        "caught up: b gone, c enrolled and annotated",
        Duration::from_secs(60),
        || {
            agent.state("b", "shop").is_none()
                && agent.enrolled("c", "shop")
                && h.annotation("shop", "c").as_deref() == Some("enabled")
        },
    )
    .await;
    assert!(h.tc_detached("b") && h.tc_attached("c") && h.tc_attached("a"));
    assert_eq!(
        h.patches_for("shop", "a").len(),
        1,
        "a's annotation never flapped"
    );
    agent.stop(true).await;
}

/// The agent restarts mid-stream (its process dies, the pinned kernel state
/// stays) while pods keep changing: a new source against the same server
/// lists, re-adopts what is enrolled without detaching it, patches nothing
/// that is already right, removes what was left for a pod deleted while no
/// agent ran, and enrols the pod added meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restart_mid_stream_picks_up_state_without_flapping() {
    let h = Harness::new("kube-restart", &["a", "b", "c", "d"]).await;
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    for name in ["a", "b", "d"] {
        h.serve_pod("shop", name, json!({}));
    }
    let first = h.start_agent(|_| {}).await;
    wait_for("a, b and d enrolled and annotated", TIMEOUT, || {
        ["a", "b", "d"].iter().all(|name| {
            first.enrolled(name, "shop") && h.annotation("shop", name).as_deref() == Some("enabled")
        })
    })
    .await;
    let entries_before = inspect::enrolled_entries(&h.pin_dir.0).expect("pinned map");
    assert_eq!(entries_before.len(), 3);
    let patches_before = h.server.patches().len();

    // The agent dies without cleaning up; changes keep coming meanwhile.
    first.stop(false).await;
    assert!(
        ["a", "b", "d"].iter().all(|name| h.tc_attached(name)),
        "the datapath outlives the agent"
    );
    h.server.delete(Kind::Pod, "shop", "d");
    h.serve_pod("shop", "c", json!({}));
    h.label_pod("shop", "a", json!({"rev": "2"}));

    let second = h.start_agent(|_| {}).await;
    let restart = Instant::now();
    // Sample the kernel while the new agent comes up: nothing detaches.
    while restart.elapsed() < Duration::from_secs(3) {
        assert!(
            h.tc_attached("a") && h.tc_attached("b"),
            "no flap while restarting"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_for("a, b and c enrolled by the new agent", TIMEOUT, || {
        second.enrolled("a", "shop")
            && second.enrolled("b", "shop")
            && second.enrolled("c", "shop")
            && h.annotation("shop", "c").as_deref() == Some("enabled")
    })
    .await;
    let d_cookie = h
        .pod("d")
        .netns()
        .expect("d's netns")
        .cookie()
        .expect("d's cookie");
    // d was deleted while no agent ran: its enrolment entry is stale.
    // (Detaching its TC filters too is the redirector's job, from a record
    // it keeps per pod; not asserted here.)
    wait_for("d's enrolment entry removed", TIMEOUT, || {
        inspect::enrolled_entries(&h.pin_dir.0).is_ok_and(|e| !e.contains_key(&d_cookie))
    })
    .await;
    let entries_after = inspect::enrolled_entries(&h.pin_dir.0).expect("pinned map");
    assert_eq!(entries_after.len(), 3, "a, b and c");
    for (cookie, slot) in entries_before.iter().filter(|(c, _)| **c != d_cookie) {
        assert_eq!(
            entries_after.get(cookie),
            Some(slot),
            "a and b kept their entries and slots"
        );
    }
    let new_patches: Vec<_> = h.server.patches()[patches_before..]
        .iter()
        .map(|p| p.name.clone())
        .collect();
    assert_eq!(
        new_patches,
        ["c"],
        "only the new pod was annotated after the restart"
    );
    second.stop(true).await;
}

/// The production netns discovery on the real kernel: a process of the pod
/// (here `sleep`, started in the pod's netns and in a cgroup named like a
/// kubelet's, `pod<uid>`) is found by scanning `/proc/*/cgroup` for the
/// pod's UID, and the pod is enrolled through its `/proc/PID/ns/net`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proc_scan_finds_a_real_pods_netns_by_its_uid() {
    let h = Harness::new("kube-procscan", &["web"]).await;
    let process = h.pod_process("shop", "web").await;
    let pid = process.pid;
    let agent = h
        .start_agent_with(Arc::new(ProcScanResolver::default()), |_| {})
        .await;
    wait_for("web enrolled through /proc", TIMEOUT, || {
        agent.enrolled("web", "shop")
    })
    .await;
    assert_eq!(
        agent.netns_of("web").await,
        Some(PathBuf::from(format!("/proc/{pid}/ns/net")))
    );
    assert!(
        h.tc_attached("web"),
        "attached in the pod's netns, seen through its testbed path"
    );
    agent.stop(true).await;
    assert!(h.tc_detached("web"));
}

/// The agent's resolver with a container runtime: the pod (which has no
/// process, so /proc cannot place it) is enrolled in the netns the
/// runtime's READY sandbox names, found by the pod's UID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cri_runtime_places_the_pod_end_to_end() {
    let h = Harness::new("kube-cri", &["web"]).await;
    let cri = fake_cri::FakeCri::start(&h.dir.path().join("cri.sock")).await;
    let uid = format!("{:08x}-c41a-4000-8000-00000000e2e0", std::process::id());
    cri.add(fake_cri::Sandbox::ready(
        "sb-web",
        &uid,
        "shop",
        "web",
        &h.pod("web").netns_path(),
    ));
    h.server
        .apply(Kind::Namespace, namespace("shop", ambient()));
    let ip = h.pod("web").ip().to_string();
    let mut object = pod("shop", "web", NODE, Some(&ip), json!({}));
    object["metadata"]["uid"] = json!(uid);
    h.server.apply(Kind::Pod, object);
    let agent = h.start_agent_with_cri(cri.socket()).await;
    wait_for("web enrolled through the CRI", TIMEOUT, || {
        agent.enrolled("web", "shop")
    })
    .await;
    assert_eq!(agent.netns_of("web").await, Some(h.pod("web").netns_path()));
    assert!(h.tc_attached("web"));
    assert!(
        !log_lines_with(&["shop/web", "found by the container runtime"]).is_empty(),
        "the source is logged with the pod"
    );
    let (lists, statuses) = cri.calls();
    assert!(lists >= 1 && statuses >= 1);
    agent.stop(true).await;
    assert!(h.tc_detached("web"));
}

/// A CRI socket nobody listens on: the agent says so (once) and finds the
/// pod's netns through /proc instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_cri_socket_falls_back_to_the_proc_scan() {
    let h = Harness::new("kube-cri-dead", &["web"]).await;
    let socket = h.dir.path().join("dead-cri.sock");
    let process = h.pod_process("shop", "web").await;
    let agent = h.start_agent_with_cri(&socket).await;
    wait_for("web enrolled through /proc", TIMEOUT, || {
        agent.enrolled("web", "shop")
    })
    .await;
    assert_eq!(
        agent.netns_of("web").await,
        Some(PathBuf::from(format!("/proc/{}/ns/net", process.pid)))
    );
    let socket = socket.display().to_string();
    assert_eq!(
        log_lines_with(&["the container runtime is unreachable", &socket]).len(),
        1,
        "warned once"
    );
    assert!(!log_lines_with(&["shop/web", "found by scanning /proc"]).is_empty());
    agent.stop(true).await;
}

/// The `shunt agent` binary without `--workloads` takes its pods from the
/// Kubernetes API named by `KUBECONFIG`, finds the pod's netns through
/// `/proc`, enrols and annotates it, and unenrols it on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shunt_agent_binary_without_workloads_watches_kubernetes() {
    let h = Harness::new("kube-binary", &["web"]).await;
    let _process = h.pod_process("shop", "web").await;
    let mut agent = h.spawn_agent_binary(&[]);
    let start = Instant::now();
    while !(h.annotation("shop", "web").as_deref() == Some("enabled") && h.tc_attached("web")) {
        assert!(
            start.elapsed() < TIMEOUT,
            "the agent did not enrol web within {TIMEOUT:?}; its log:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_shunt"))
        .args(["status", "--json", "--admin-addr", &agent.admin.to_string()])
        .output()
        .expect("shunt status");
    let status: shunt::api::NodeStatus =
        serde_json::from_slice(&status.stdout).expect("status JSON");
    let web = status
        .pods
        .iter()
        .find(|p| p.name == "web")
        .expect("web listed");
    assert_eq!(web.state, PodState::Enrolled);
    assert_eq!(web.identity, "spiffe://cluster.local/ns/shop/sa/sleep");

    let pid = nix::unistd::Pid::from_raw(agent.child.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let start = Instant::now();
    let exit = loop {
        if let Some(exit) = agent.child.0.try_wait().expect("wait") {
            break exit;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "agent still running after SIGTERM:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exit.success(), "agent exit {exit:?}; log:\n{}", agent.log());
    assert!(h.tc_detached("web"), "SIGTERM unenrols");
}

/// An `AuthorizationPolicy` served by the API server reaches the kernel:
/// the agent binary, given only a kubeconfig, makes a denied connect
/// between two of its pods fail with EPERM (no proxy sees it), lets a port
/// the policy does not name through, counts each refusal under the client
/// pod and the policy in `/metrics`, and writes an access-log line for
/// each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_policy_from_the_api_server_refuses_the_connect_in_the_kernel() {
    let h = Harness::new("kube-kdeny", &["web", "client"]).await;
    let _web = h.pod_process("shop", "web").await;
    let _client = h.pod_process("shop", "client").await;
    h.label_pod("shop", "web", json!({"app": "web"}));
    h.server.apply(
        Kind::AuthorizationPolicy,
        authorization_policy(
            "shop",
            "deny-8080",
            json!({"selector": {"matchLabels": {"app": "web"}},
                   "action": "DENY",
                   "rules": [{"from": [{"source": {"principals": ["cluster.local/ns/shop/sa/sleep"]}}],
                              "to": [{"operation": {"ports": ["8080"]}}]}]}),
        ),
    );
    // Verify passes (which read the kernel's counters) every second.
    let agent = h.spawn_agent_binary(&["--verify-interval", "1"]);
    // The client's connects: bash's /dev/tcp, in the client's netns and in
    // the topology's cgroup, where the socket programs are attached.
    let cgroup = Cgroup::create(&h.topo, "client-probe").expect("probe cgroup");
    let web_ip = h.pod("web").ip();
    let connect = |port: u16| {
        let mut command = h.pod("client").command("bash");
        command.args(["-c", &format!("exec 3<>/dev/tcp/{web_ip}/{port}")]);
        let out = cgroup.place(&mut command).output().expect("run bash");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let enrolled = |name: &str| {
        h.annotation("shop", name).as_deref() == Some("enabled") && h.tc_attached(name)
    };
    let agent_log = || agent.log();
    eventually(
        "the agent enrols both pods",
        TIMEOUT,
        || (enrolled("web") && enrolled("client")).then_some(()),
        agent_log,
    )
    .await;
    // Until the reconciler has compiled the policy, a connect goes to the
    // proxy; from then on the kernel refuses it.
    eventually(
        "EPERM on web:8080",
        TIMEOUT,
        || {
            connect(8080)
                .1
                .contains("Operation not permitted")
                .then_some(())
        },
        agent_log,
    )
    .await;
    let mut refusals = 1u64;
    let (connected, stderr) = connect(8080);
    assert!(
        !connected && stderr.contains("Operation not permitted"),
        "a second connect to web:8080: connected {connected}, {stderr:?}"
    );
    refusals += 1;
    // Not denied: the connect leaves the client (to the proxy, or pod to
    // pod on the same-node fast path, where nothing listens on 9090).
    let (connected, stderr) = connect(9090);
    assert!(
        connected || stderr.contains("Connection refused"),
        "web:9090 is not denied: connected {connected}, {stderr:?}"
    );

    let line = format!(
        "shunt_pod_policy_denials_total{{namespace=\"shop\",pod=\"client\",policy=\"shop/deny-8080\"}} {refusals}"
    );
    let metrics = || {
        http_get(agent.metrics, "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    eventually(
        &format!("{line:?} in /metrics"),
        TIMEOUT,
        || metrics().lines().any(|l| l == line).then_some(()),
        || {
            metrics()
                .lines()
                .filter(|l| l.contains("policy_denials"))
                .collect::<Vec<_>>()
                .join("\n")
        },
    )
    .await;

    let dst = format!("dst.addr={web_ip}:8080");
    let refusal_lines = |log: &str| {
        log.lines()
            .filter(|l| {
                l.contains("shunt::access")
                    && l.contains("connection refused")
                    && l.contains("pod=shop/client")
                    && l.contains("src.identity=\"spiffe://cluster.local/ns/shop/sa/sleep\"")
                    && l.contains(&dst)
                    && l.contains("policy=shop/deny-8080")
                    && l.contains("refused in the kernel at connect (EPERM)")
            })
            .count() as u64
    };
    eventually(
        &format!("{refusals} access lines of kernel refusals"),
        TIMEOUT,
        || (refusal_lines(&agent.log()) == refusals).then_some(()),
        agent_log,
    )
    .await;
}

/// A process of a testbed pod, as the kubelet would leave one: `sleep`,
/// in the pod's netns and in a cgroup named `pod<uid>`. Killed when dropped.
struct PodProcess {
    pid: u32,
    // Dropped in this order: the process, then its cgroup.
    _child: ChildGuard,
    _cgroup: Cgroup,
}
