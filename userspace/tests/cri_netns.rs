//! Finding pods' network namespaces through the container runtime: the
//! real [`CriResolver`] (tonic over a unix socket) against an in-test CRI
//! server answering as containerd does (`support/fake_cri.rs`), pointing at
//! real network namespaces of a `shunt-testbed` topology. No traffic is
//! sent; every wait is bounded.

#[path = "support/fake_cri.rs"]
mod fake_cri;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use fake_cri::{FakeCri, Sandbox};
use shunt::{
    control::kube::{
        ChainResolver, CriOptions, CriResolver, NetnsResolver, PodRef, ProcScanResolver,
        cri::{CriError, NetnsSource, SandboxNetns},
    },
    state::WorkloadKey,
};
use shunt_testbed::{Topology, require_root};

const NODE: &str = "node-a";

/// Short deadlines: the tests that wait for them stay quick.
fn options() -> CriOptions {
    CriOptions {
        call_timeout: Duration::from_millis(500),
        batch_timeout: Duration::from_millis(1500),
        concurrency: 4,
    }
}

fn uid(n: u32) -> String {
    format!("{:08x}-c41a-4000-8000-{n:012x}", std::process::id())
}

/// A network namespace of the test's own (`ip netns add`), deleted when
/// dropped: for the one that must disappear mid-test.
struct ExtraNetns(String);

impl ExtraNetns {
    fn add(name: String) -> Self {
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip netns add");
        assert!(status.success(), "ip netns add {name}");
        Self(name)
    }

    fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.0)
    }

    fn delete(&self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

impl Drop for ExtraNetns {
    fn drop(&mut self) {
        self.delete();
    }
}

struct Case {
    cri: FakeCri,
    resolver: CriResolver,
    _dir: tempfile::TempDir,
    // Dropped last: deletes the netns the fake runtime points at.
    topo: Topology,
}

impl Case {
    async fn new(test: &str, pods: &[&str]) -> Self {
        require_root().expect("these tests create network namespaces: run as root");
        let mut topo = Topology::new(test).expect("topology");
        topo.add_node(NODE).expect("node");
        for pod in pods {
            topo.add_pod(NODE, pod).expect("pod");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let cri = FakeCri::start(&dir.path().join("cri.sock")).await;
        let resolver = CriResolver::new(cri.socket(), tokio::runtime::Handle::current(), options())
            .expect("resolver");
        Self {
            cri,
            resolver,
            _dir: dir,
            topo,
        }
    }

    fn netns(&self, pod: &str) -> PathBuf {
        self.topo.pod(pod).expect("testbed pod").netns_path()
    }
}

/// `resolve` on a blocking thread, as the Kubernetes source calls it.
async fn resolve(
    resolver: impl NetnsResolver,
    pods: Vec<(WorkloadKey, String)>,
) -> std::collections::HashMap<String, PathBuf> {
    tokio::task::spawn_blocking(move || {
        let refs: Vec<PodRef<'_>> = pods.iter().map(|(key, uid)| PodRef { key, uid }).collect();
        resolver.resolve(&refs)
    })
    .await
    .expect("resolve")
}

async fn lookup(
    resolver: &CriResolver,
    pods: Vec<(WorkloadKey, String)>,
) -> std::collections::HashMap<String, Result<SandboxNetns, CriError>> {
    let resolver = resolver.clone();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<PodRef<'_>> = pods.iter().map(|(key, uid)| PodRef { key, uid }).collect();
        resolver.lookup(&refs)
    })
    .await
    .expect("lookup")
}

fn key(name: &str) -> WorkloadKey {
    WorkloadKey::new("shop", name)
}

/// The READY sandbox's netns is found (the newest when a pod has two); a
/// pod with only a NOTREADY sandbox, a pod the runtime does not know and a
/// hostNetwork pod are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_sandboxes_lead_to_their_real_netns_and_nothing_else_does() {
    let case = Case::new("cri-ready", &["web", "old"]).await;
    let (web, stopped, unknown, host) = (uid(1), uid(2), uid(3), uid(4));
    case.cri.add(Sandbox::ready(
        "sb-web-old",
        &web,
        "shop",
        "web",
        &case.netns("old"),
    ));
    case.cri.add(Sandbox {
        created_at: 1_800_000_000_000_000_000,
        ..Sandbox::ready("sb-web", &web, "shop", "web", &case.netns("web"))
    });
    case.cri.add(Sandbox {
        ready: false,
        ..Sandbox::ready(
            "sb-stopped",
            &stopped,
            "shop",
            "stopped",
            &case.netns("old"),
        )
    });
    case.cri.add(Sandbox {
        netns: None,
        ..Sandbox::ready("sb-host", &host, "shop", "host", Path::new("/"))
    });
    let pods = vec![
        (key("web"), web.clone()),
        (key("stopped"), stopped.clone()),
        (key("unknown"), unknown.clone()),
        (key("host"), host.clone()),
    ];

    let answers = lookup(&case.resolver, pods.clone()).await;
    assert_eq!(
        answers.get(&web).map(|a| a.as_ref().ok()),
        Some(Some(&SandboxNetns::Path(case.netns("web")))),
        "the newest READY sandbox's netns"
    );
    assert!(matches!(
        answers.get(&stopped),
        Some(Ok(SandboxNetns::NotReady))
    ));
    assert!(matches!(
        answers.get(&unknown),
        Some(Ok(SandboxNetns::NotReady))
    ));
    assert!(matches!(
        answers.get(&host),
        Some(Ok(SandboxNetns::HostNetwork))
    ));

    let found = resolve(case.resolver.clone(), pods).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found.get(&web), Some(&case.netns("web")));
    let web_key = key("web");
    assert!(case.resolver.still_valid(
        PodRef {
            key: &web_key,
            uid: &web
        },
        &case.netns("web")
    ));
    // Each pod: one list; a status only for pods with a READY sandbox.
    let (lists, statuses) = case.cri.calls();
    assert_eq!((lists, statuses), (8, 4));
}

/// A netns path stays valid while the runtime's netns is mounted there and
/// stops being valid once it is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_netns_is_no_longer_valid() {
    let case = Case::new("cri-gone", &[]).await;
    let extra = ExtraNetns::add(format!("{}-cri-gone", case.topo.prefix()));
    let pod_uid = uid(10);
    case.cri.add(Sandbox::ready(
        "sb-gone",
        &pod_uid,
        "shop",
        "gone",
        &extra.path(),
    ));
    let found = resolve(case.resolver.clone(), vec![(key("gone"), pod_uid.clone())]).await;
    assert_eq!(found.get(&pod_uid), Some(&extra.path()));
    let k = key("gone");
    let pod = PodRef {
        key: &k,
        uid: &pod_uid,
    };
    assert!(case.resolver.still_valid(pod, &extra.path()));
    extra.delete();
    assert!(!case.resolver.still_valid(pod, &extra.path()));
}

/// An `info` the resolver cannot read is an error naming the sandbox, the
/// pod and what is missing; the chain then tries /proc (which does not know
/// this pod either) and nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_info_is_a_clear_error_and_the_chain_moves_on() {
    let case = Case::new("cri-bad", &["web"]).await;
    let cases = [
        ("sb-notjson", "{\"runtimeSpec\": ", "not the expected JSON"),
        ("sb-nospec", r#"{"pid": 1}"#, "no runtimeSpec"),
        (
            "sb-nolinux",
            r#"{"runtimeSpec": {"ociVersion": "1.1.0"}}"#,
            "no runtimeSpec.linux.namespaces",
        ),
        (
            "sb-nopath",
            r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "network"}]}}}"#,
            "network namespace has no path",
        ),
        (
            "sb-notnetns",
            r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/shunt-no-such-netns"}]}}}"#,
            "is not a network namespace here",
        ),
    ];
    let mut pods = Vec::new();
    for (n, (sandbox, info, _)) in cases.iter().enumerate() {
        let pod_uid = uid(20 + n as u32);
        case.cri.add(Sandbox {
            info: Some((*info).to_owned()),
            ..Sandbox::ready(sandbox, &pod_uid, "shop", sandbox, &case.netns("web"))
        });
        pods.push((key(sandbox), pod_uid));
    }
    let answers = lookup(&case.resolver, pods.clone()).await;
    for ((sandbox, _, what), (pod, pod_uid)) in cases.iter().zip(&pods) {
        let error = match answers.get(pod_uid) {
            Some(Err(error)) => error,
            other => panic!("{sandbox}: expected an error, got {other:?}"),
        };
        assert!(!error.is_unreachable());
        let message = error.to_string();
        assert!(
            message.contains(&format!("sandbox {sandbox} of pod {pod}")) && message.contains(what),
            "{sandbox}: {message}"
        );
    }
    let chain = ChainResolver::new(Some(case.resolver.clone()), ProcScanResolver::default());
    let found = tokio::task::spawn_blocking(move || {
        let refs: Vec<PodRef<'_>> = pods.iter().map(|(key, uid)| PodRef { key, uid }).collect();
        chain.resolve_with_source(&refs)
    })
    .await
    .expect("chain");
    assert!(found.is_empty(), "{found:?}");
}

/// A socket nobody listens on (missing, or a file left by a dead runtime)
/// is "unreachable", fast; the chain then finds the pod through /proc —
/// here this test's own process, whose cgroup path is the pod UID's stand-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_socket_is_unreachable_and_the_chain_falls_back_to_proc() {
    let dir = tempfile::tempdir().expect("temp dir");
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    for socket in [dir.path().join("missing.sock"), stale] {
        let resolver = CriResolver::new(&socket, tokio::runtime::Handle::current(), options())
            .expect("resolver");
        let started = Instant::now();
        let answers = lookup(&resolver, vec![(key("web"), uid(30))]).await;
        let error = match answers.get(&uid(30)) {
            Some(Err(error)) => error,
            other => panic!("{}: expected an error, got {other:?}", socket.display()),
        };
        assert!(error.is_unreachable(), "{error}");
        assert!(
            error.to_string().contains(&socket.display().to_string()),
            "{error}"
        );
        assert!(started.elapsed() < options().batch_timeout, "fails fast");
    }

    // /proc: a fake tree whose one process is a pod's, with a real netns
    // file (this process's own, which is not PID 1's).
    let proc_dir = tempfile::tempdir().expect("temp dir");
    let pod_uid = uid(31);
    let pid_dir = proc_dir.path().join("77");
    std::fs::create_dir_all(pid_dir.join("ns")).expect("mkdir");
    std::fs::create_dir_all(proc_dir.path().join("1/ns")).expect("mkdir");
    std::fs::write(proc_dir.path().join("1/ns/net"), "").expect("host netns stand-in");
    std::fs::write(
        pid_dir.join("cgroup"),
        format!("0::/kubepods/besteffort/pod{pod_uid}/c\n"),
    )
    .expect("cgroup");
    std::os::unix::fs::symlink("/proc/self/ns/net", pid_dir.join("ns/net")).expect("symlink");
    let resolver = CriResolver::new(
        dir.path().join("missing.sock"),
        tokio::runtime::Handle::current(),
        options(),
    )
    .expect("resolver");
    let chain = ChainResolver::new(Some(resolver), ProcScanResolver::new(proc_dir.path()));
    let refs_uid = pod_uid.clone();
    let found = tokio::task::spawn_blocking(move || {
        let k = key("web");
        chain.resolve_with_source(&[PodRef {
            key: &k,
            uid: &refs_uid,
        }])
    })
    .await
    .expect("chain");
    assert_eq!(
        found.get(&pod_uid),
        Some(&(pid_dir.join("ns/net"), NetnsSource::Proc))
    );
}

/// A runtime that accepts but never answers costs at most the batch
/// deadline, however many pods are asked about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_runtime_is_bounded_by_the_batch_deadline() {
    let case = Case::new("cri-hung", &["web"]).await;
    let pods: Vec<(WorkloadKey, String)> = (0..20)
        .map(|n| {
            let pod_uid = uid(40 + n);
            case.cri.add(Sandbox::ready(
                &format!("sb-{n}"),
                &pod_uid,
                "shop",
                "web",
                &case.netns("web"),
            ));
            (key(&format!("web-{n}")), pod_uid)
        })
        .collect();
    case.cri.hang(true);
    let started = Instant::now();
    let answers = lookup(&case.resolver, pods.clone()).await;
    let took = started.elapsed();
    assert!(
        took < options().batch_timeout + Duration::from_millis(500),
        "took {took:?}"
    );
    // The first calls timed out (each after the call deadline); the rest
    // were never answered.
    assert!(
        answers
            .values()
            .all(|a| matches!(a, Err(e @ CriError::Timeout { .. }) if e.is_unreachable())),
        "{answers:?}"
    );
    assert!(answers.len() < pods.len());

    case.cri.hang(false);
    let found = resolve(case.resolver.clone(), pods[..1].to_vec()).await;
    assert_eq!(
        found.get(&pods[0].1),
        Some(&case.netns("web")),
        "answers again"
    );
}
