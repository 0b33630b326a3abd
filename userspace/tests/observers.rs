//! Observers never wait on the reconciler: with 200 pods enrolled, a
//! `/metrics` scrape, a readiness probe and the admin API's status answer
//! while the reconciler is held busy, show the 200 pods, and enter no
//! network namespace.
//!
//! The configuration is the cheapest real one that proves it: 200 testbed
//! pods (real network namespaces with an `eth0`), enrolled by the real eBPF
//! redirector with capture off (pods are only counted: TC programs and
//! counters in each pod, no proxy listeners), the agent's own reconciler
//! thread, and the agent's own HTTP endpoints (`app::Observers`). The one
//! test seam is [`GatedRedirector`]: it hands every call to the real
//! redirector, but can hold the reconciler thread inside its next call —
//! the reconciler is then busy mid-verify, owning everything it owns.
//!
//! Every wait is bounded; the endpoints listen on 127.0.0.1 only.

use std::{
    path::PathBuf,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use shunt::{
    agent::{NodeAgent, Reconciler, ReconcilerInputs},
    api::{NodeStatus, PodState},
    app::{AgentSink, ObserverAddrs, Observers},
    control::{NodePods, SourceSink},
    redirect::{
        Capture, EnrolledPod, OriginalDst, PodTarget, RedirectError, RedirectMode, Redirector,
        Verification,
        ebpf::{EbpfOptions, EbpfRedirector},
    },
    snapshot::SnapshotReader,
    state::{DataplaneMode, TrustDomain, Workload, WorkloadKey},
};
use shunt_testbed::{Topology, require_root};
use tokio::sync::watch;

const NODE: &str = "node-a";
const PODS: usize = 200;
/// Upper bound for setting up and enrolling 200 pods on a loaded machine.
const SETUP: Duration = Duration::from_secs(300);
/// Upper bound for anything else.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Where the reconciler thread can be held.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    closed: bool,
    /// Whether a call is waiting at the closed gate.
    held: bool,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called at the start of every redirector call: waits while closed.
    fn pass(&self) {
        let mut state = self.lock();
        while state.closed {
            state.held = true;
            self.changed.notify_all();
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.held = false;
    }

    fn close(&self) {
        self.lock().closed = true;
    }

    fn open(&self) {
        self.lock().closed = false;
        self.changed.notify_all();
    }

    /// Waits (bounded) until a call is held at the gate.
    fn wait_held(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut state = self.lock();
        while !state.held {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    fn held(&self) -> bool {
        self.lock().held
    }
}

/// The real eBPF redirector behind a [`Gate`].
struct GatedRedirector {
    inner: EbpfRedirector,
    gate: Arc<Gate>,
}

impl Redirector for GatedRedirector {
    fn mode(&self) -> RedirectMode {
        self.inner.mode()
    }
    fn enrol(&mut self, pod: &PodTarget) -> Result<(), RedirectError> {
        self.gate.pass();
        self.inner.enrol(pod)
    }
    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        self.gate.pass();
        self.inner.unenrol(pod)
    }
    fn verify(&self, pod: &WorkloadKey) -> Result<Verification, RedirectError> {
        self.gate.pass();
        self.inner.verify(pod)
    }
    fn list(&self) -> Vec<EnrolledPod> {
        self.gate.pass();
        self.inner.list()
    }
    fn inspect(&self, pod: &WorkloadKey) -> Option<EnrolledPod> {
        self.gate.pass();
        self.inner.inspect(pod)
    }
    fn is_enrolled(&self, pod: &WorkloadKey) -> bool {
        self.inner.is_enrolled(pod)
    }
    fn remove_stale(&mut self) -> usize {
        self.gate.pass();
        self.inner.remove_stale()
    }
    fn original_dst_resolver(&self) -> Arc<dyn OriginalDst> {
        self.inner.original_dst_resolver()
    }
}

/// Removes the test's pin dir when dropped.
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `GET http://addr/path` with a bounded wait: (status, body).
fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(TIMEOUT))
        .http_status_as_error(false)
        .build()
        .new_agent();
    let mut response = agent
        .get(format!("http://{addr}{path}"))
        .call()
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|e| panic!("GET {path}: body: {e}"));
    (status, body)
}

/// The value of the exposition's sample `line_start` (name and labels).
fn sample(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_answer_from_the_snapshot_while_the_reconciler_is_busy() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("obs-busy").expect("topology");
    topo.add_node(NODE).expect("node");
    let mut workloads = Vec::with_capacity(PODS);
    for i in 0..PODS {
        let pod = topo.add_pod(NODE, &format!("p{i:03}")).expect("pod");
        workloads.push(Workload {
            name: format!("p{i:03}"),
            namespace: "load".into(),
            service_account: "sa".into(),
            ips: vec![pod.ip().into()],
            node: NODE.into(),
            netns: Some(pod.netns_path()),
            dataplane_mode: DataplaneMode::Ambient,
            ..Default::default()
        });
    }
    let pin_dir = PinDir(PathBuf::from(format!("/sys/fs/bpf/{}-obs", topo.prefix())));
    let options = EbpfOptions {
        cgroup_root: Some(topo.cgroup_root().expect("topology cgroup")),
        ..EbpfOptions::new(&pin_dir.0)
    };
    let gate = Arc::new(Gate::default());
    let redirector = GatedRedirector {
        inner: EbpfRedirector::load(&options).expect("load eBPF"),
        gate: gate.clone(),
    };
    // Capture off: each pod is enrolled (TC programs, counters) but its
    // traffic is only counted, so no proxy is needed.
    let agent = NodeAgent::new(
        NODE.into(),
        TrustDomain::default(),
        Box::new(redirector),
        Capture::default(),
    );
    let (pods, pods_rx) = watch::channel(None);
    let reconciler = Reconciler::spawn(
        agent,
        ReconcilerInputs {
            pods: pods_rx,
            store_applied: None,
            verify_every: Duration::from_secs(1),
        },
        tokio::runtime::Handle::current(),
    )
    .expect("reconcile thread");
    let sink = AgentSink::new(pods, None);
    let loopback = "127.0.0.1:0".parse().expect("address");
    let addrs = Observers {
        reader: SnapshotReader::new(reconciler.snapshots(), None),
        store: None,
        metrics: shunt::metrics::Metrics::new(),
        bpf_pin_dir: pin_dir.0.clone(),
    }
    .serve(ObserverAddrs {
        admin: loopback,
        metrics: loopback,
        readiness: loopback,
    })
    .await
    .expect("observers");

    sink.node_pods(NodePods {
        trust_domain: TrustDomain::default(),
        pods: workloads,
    });
    // Every pod enrolled, and a verify pass since (hooks read in each).
    let mut snapshots = reconciler.snapshots();
    let started = Instant::now();
    // (The borrow `wait_for` returns is dropped at once: holding it would
    // keep the reconciler from publishing.)
    let enrolled = tokio::time::timeout(SETUP, async {
        snapshots
            .wait_for(|s| {
                s.verify_passes >= 1
                    && s.pods.len() == PODS
                    && s.pods.iter().all(|p| {
                        p.state == PodState::Enrolled
                            && p.kernel
                                .as_ref()
                                .is_some_and(|k| k.hooks.iter().all(|h| h.present))
                    })
            })
            .await
            .is_ok()
    })
    .await;
    assert_eq!(
        enrolled,
        Ok(true),
        "{PODS} pods not enrolled within {SETUP:?}"
    );
    println!(
        "{PODS} pods enrolled and verified after {:?}",
        started.elapsed()
    );

    // Hold the reconciler inside its next redirector call (the next verify
    // pass, within a second).
    gate.close();
    let held = {
        let gate = gate.clone();
        tokio::task::spawn_blocking(move || gate.wait_held(TIMEOUT))
            .await
            .expect("gate")
    };
    assert!(held, "the reconciler never reached the gate");
    let entries = shunt::netns::entries();

    let scrapes = tokio::task::spawn_blocking(move || {
        (
            get(addrs.metrics, "/metrics"),
            get(addrs.readiness, "/healthz/ready"),
            get(addrs.admin, "/status"),
        )
    });
    let ((metrics_code, metrics), (ready_code, ready), (status_code, status)) =
        tokio::time::timeout(TIMEOUT, scrapes)
            .await
            .expect("the observers answered while the reconciler was busy")
            .expect("scrapes");

    assert!(gate.held(), "the reconciler was held the whole time");
    assert_eq!(
        shunt::netns::entries(),
        entries,
        "answering entered a network namespace"
    );
    assert_eq!(metrics_code, 200, "{metrics}");
    assert_eq!(
        sample(&metrics, "shunt_pods{state=\"enrolled\"}"),
        Some(PODS as f64),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "shunt_enrolled_pods{mode=\"ebpf\"}"),
        Some(PODS as f64)
    );
    assert_eq!(sample(&metrics, "shunt_pods_not_redirected"), Some(0.0));
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.starts_with("shunt_pod_packets_total{") && l.contains("direction=\"out\""))
            .count(),
        PODS,
        "one packet counter per pod and direction"
    );
    assert_eq!(ready_code, 200, "{ready}");
    assert!(
        ready.contains(&format!("{PODS} mesh pod(s) of this node enrolled")),
        "{ready}"
    );
    assert_eq!(status_code, 200, "{status}");
    let status: NodeStatus = serde_json::from_str(&status).expect("status JSON");
    assert_eq!(status.pods.len(), PODS);
    assert!(
        status
            .pods
            .iter()
            .all(|p| p.state == PodState::Enrolled && !p.hooks.is_empty() && p.counters.is_some()),
        "every pod enrolled, with its hooks and counters"
    );

    gate.open();
    reconciler.stop(true).await;
    drop(pin_dir);
    drop(topo);
}
