//! `cargo xtask run`: shunt on a local kind cluster, the way users meet it.
//!
//! 1. checks for docker (with a daemon and BuildKit), kind, kubectl and
//!    openssl, naming whatever is missing and how to get it;
//! 2. creates the kind cluster `shunt` from deploy/kind/cluster.yaml, or
//!    reuses it;
//! 3. creates the mesh's CA Secret (once: a rerun keeps the root);
//! 4. builds the image from deploy/Dockerfile and loads it into kind;
//! 5. applies deploy/ (`kubectl apply -k`) and waits for an agent to be
//!    ready on every node, showing progress and, if one fails, why;
//! 6. deploys deploy/samples/ (a client and a server in the namespace
//!    `shunt-demo`, labelled `istio.io/dataplane-mode=ambient`) and waits
//!    until the agent has annotated both `ambient.istio.io/redirection=enabled`;
//! 7. curls the server from the client and shows, from the agents' own
//!    counters (`shunt status --json`) and metrics, that the requests went
//!    through HBONE; then prints how to look around.
//!
//! `cargo xtask run --delete` removes the cluster (and all that runs in it)
//! and the image.
//!
//! Every kubectl call names the context `kind-shunt`, so whatever context
//! the user's kubeconfig has selected is never touched.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::{DirBuilderExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Args;

use crate::util;

/// The kind cluster's name (also in deploy/kind/cluster.yaml).
const CLUSTER: &str = "shunt";
/// The kubeconfig context kind writes for it.
const CONTEXT: &str = "kind-shunt";
/// The image the DaemonSet runs (deploy/base/daemonset.yaml).
const IMAGE: &str = "shunt:dev";
const AGENT_NAMESPACE: &str = "shunt-system";
const DAEMONSET: &str = "shunt";
const AGENT_SELECTOR: &str = "app.kubernetes.io/name=shunt";
/// The mesh's CA, mounted by the DaemonSet at --ca-dir.
const CA_SECRET: &str = "shunt-ca";
const DEMO_NAMESPACE: &str = "shunt-demo";
/// The sample server's port (deploy/samples/server.yaml).
const SERVER_PORT: u16 = 8080;
/// How many requests the HBONE check sends (each its own connection).
const REQUESTS: u64 = 3;
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(300);
const ENROLMENT_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Args)]
pub struct RunArgs {
    /// Remove what `cargo xtask run` made: the kind cluster `shunt`, with
    /// everything deployed in it, and the image shunt:dev.
    #[arg(long)]
    delete: bool,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    if args.delete {
        return delete();
    }
    let root = util::workspace_root();
    eprintln!("shunt on a local kind cluster:");
    phase("tools", || require_tools(&[DOCKER, KIND, KUBECTL, OPENSSL]))?;
    phase("docker daemon and BuildKit", docker_ready)?;
    host_warnings();
    phase("kind cluster `shunt`", || cluster(&root))?;
    phase("the mesh's CA (Secret shunt-system/shunt-ca)", || {
        ca_secret(&root)
    })?;
    phase(
        "image shunt:dev from deploy/Dockerfile (the first build takes about 10 minutes)",
        || build_image(&root),
    )?;
    phase("load the image into the kind nodes", || {
        util::run(Command::new("kind").args(["load", "docker-image", IMAGE, "--name", CLUSTER]))
    })?;
    phase("apply deploy/", || apply_agent(&root))?;
    phase("an agent ready on every node", wait_for_agents)?;
    phase(
        "samples: client and server in namespace shunt-demo (ambient)",
        || apply_samples(&root),
    )?;
    let (client, server) = phase("both sample pods enrolled", wait_for_enrolment)?;
    let agents = phase("client → server through HBONE", || {
        check_hbone(&client, &server)
    })?;
    look_around(&client, &server, &agents);
    Ok(())
}

/// Prints the phase, runs it, prints how long it took.
fn phase<T>(name: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    eprintln!("==> {name}");
    let start = Instant::now();
    let result = f().with_context(|| format!("cargo xtask run: {name}"));
    if result.is_ok() {
        eprintln!("    done ({:.0}s)", start.elapsed().as_secs_f64());
    }
    result
}

// ---------------------------------------------------------------- tools

/// A program `cargo xtask run` needs, what for, and how to get it.
struct Tool {
    name: &'static str,
    why: &'static str,
    how: &'static str,
}

const DOCKER: Tool = Tool {
    name: "docker",
    why: "builds the image and runs kind's nodes as containers",
    how: "install Docker Engine (https://docs.docker.com/engine/install/) with its buildx plugin, or Docker Desktop",
};
const KIND: Tool = Tool {
    name: "kind",
    why: "creates the local Kubernetes cluster",
    how: "`go install sigs.k8s.io/kind@latest`, or a release binary from https://kind.sigs.k8s.io/docs/user/quick-start/#installation",
};
const KUBECTL: Tool = Tool {
    name: "kubectl",
    why: "applies deploy/ and talks to the cluster",
    how: "see https://kubernetes.io/docs/tasks/tools/#kubectl (a release binary, or the pkgs.k8s.io apt repository)",
};
const OPENSSL: Tool = Tool {
    name: "openssl",
    why: "creates the mesh's CA certificate and key",
    how: "`apt-get install openssl` (or your system's package)",
};

/// Fails naming every missing tool at once.
fn require_tools(tools: &[Tool]) -> anyhow::Result<()> {
    let mut missing = Vec::new();
    for tool in tools {
        match find_in_path(tool.name) {
            Some(path) => eprintln!("    {:<8} {}", tool.name, path.display()),
            None => missing.push(tool),
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut message = format!(
        "missing: {}",
        missing
            .iter()
            .map(|t| t.name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    for tool in missing {
        message.push_str(&format!(
            "\n  {}: not found on PATH; it {}. Install: {}",
            tool.name, tool.why, tool.how
        ));
    }
    bail!(message)
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The docker CLI alone is not enough: its daemon must answer, and the
/// Dockerfile's cache mounts need BuildKit (buildx).
fn docker_ready() -> anyhow::Result<()> {
    let out = quiet(Command::new("docker").args(["version", "--format", "{{.Server.Version}}"]))?;
    if !out.status.success() {
        bail!(
            "docker is installed but its daemon does not answer: {}\n  \
             Start it (`sudo systemctl start docker`, or Docker Desktop), or check DOCKER_HOST \
             and your access to /var/run/docker.sock (the `docker` group).",
            first_line(&out.stderr)
        );
    }
    eprintln!(
        "    docker daemon {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    let buildx = quiet(Command::new("docker").args(["buildx", "version"]))?;
    if !buildx.status.success() {
        bail!(
            "docker's buildx plugin (BuildKit) is missing: deploy/Dockerfile uses BuildKit cache mounts.\n  \
             Install docker-buildx-plugin from Docker's apt repository (or use Docker Desktop)."
        );
    }
    Ok(())
}

/// kind's nodes run on this machine's kernel: say early what will bite.
fn host_warnings() {
    let remote = std::env::var("DOCKER_HOST").is_ok_and(|h| !h.starts_with("unix://"));
    if remote {
        return;
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        eprintln!(
            "    warning: this kernel has no BTF (/sys/kernel/btf/vmlinux); kind's nodes share it and shunt's eBPF programs need it"
        );
    }
    // kind's known-issues page: multi-node clusters exhaust the default
    // inotify instances ("too many open files" in kubelet or pods).
    let instances = fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    if instances.is_some_and(|n| n < 512) {
        eprintln!(
            "    warning: fs.inotify.max_user_instances is {}; kind recommends 512 for multi-node clusters (`sudo sysctl fs.inotify.max_user_instances=512`)",
            instances.unwrap_or_default()
        );
    }
}

// ---------------------------------------------------------------- cluster

fn kubectl() -> Command {
    let mut cmd = Command::new("kubectl");
    cmd.args(["--context", CONTEXT]);
    cmd
}

/// Runs `cmd` with its output captured, whatever its exit status.
fn quiet(cmd: &mut Command) -> anyhow::Result<Output> {
    cmd.output()
        .with_context(|| format!("cannot start {}", util::describe(cmd)))
}

fn first_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_string()
}

fn cluster_exists() -> anyhow::Result<bool> {
    let clusters = util::stdout(Command::new("kind").args(["get", "clusters"]))?;
    Ok(clusters.lines().any(|l| l.trim() == CLUSTER))
}

fn cluster(root: &Path) -> anyhow::Result<()> {
    if cluster_exists()? {
        eprintln!("    reusing the existing cluster (context {CONTEXT})");
        // Restores the context if the kubeconfig lost it.
        util::output(Command::new("kind").args(["export", "kubeconfig", "--name", CLUSTER]))?;
        let nodes = quiet(kubectl().args(["get", "nodes", "-o", "name"]))?;
        if !nodes.status.success() {
            bail!(
                "the kind cluster `{CLUSTER}` exists but its API server does not answer ({}).\n  \
                 Its node containers may be stopped (`docker ps -a --filter label=io.x-k8s.kind.cluster={CLUSTER}`, \
                 then `docker start` them), or start over: `cargo xtask run --delete`.",
                first_line(&nodes.stderr)
            );
        }
    } else {
        util::run(
            Command::new("kind")
                .args(["create", "cluster", "--name", CLUSTER, "--config"])
                .arg(root.join("deploy/kind/cluster.yaml"))
                .args(["--wait", "5m"]),
        )?;
    }
    util::run(kubectl().args([
        "wait",
        "--for=condition=Ready",
        "node",
        "--all",
        "--timeout=300s",
    ]))
}

// ---------------------------------------------------------------- CA

/// The Secret with the mesh's CA in Istio's plug-in layout, created once: an
/// existing one is kept, so reruns keep the trust root.
fn ca_secret(root: &Path) -> anyhow::Result<()> {
    util::run(
        kubectl()
            .args(["apply", "-f"])
            .arg(root.join("deploy/base/namespace.yaml")),
    )?;
    let existing = quiet(kubectl().args([
        "get",
        "secret",
        CA_SECRET,
        "-n",
        AGENT_NAMESPACE,
        "-o",
        "name",
    ]))?;
    if existing.status.success() {
        eprintln!("    kept the existing Secret (the mesh keeps its root)");
        return Ok(());
    }
    let dir = PrivateDir::new()?;
    let d = dir.path();
    util::output(
        Command::new("openssl")
            .args([
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
            ])
            .arg(d.join("ca-key.pem")),
    )?;
    util::output(
        Command::new("openssl")
            .args(["req", "-x509", "-new", "-sha256", "-days", "3650", "-key"])
            .arg(d.join("ca-key.pem"))
            .args([
                "-subj",
                "/O=cluster.local/CN=shunt root CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                "-out",
            ])
            .arg(d.join("ca-cert.pem")),
    )?;
    fs::copy(d.join("ca-cert.pem"), d.join("root-cert.pem")).context("copying the root")?;
    let from_file = |name: &str| format!("--from-file={name}={}", d.join(name).display());
    util::output(
        kubectl()
            .args([
                "create",
                "secret",
                "generic",
                CA_SECRET,
                "-n",
                AGENT_NAMESPACE,
            ])
            .arg(from_file("ca-cert.pem"))
            .arg(from_file("ca-key.pem"))
            .arg(from_file("root-cert.pem")),
    )?;
    eprintln!("    created a new root (ECDSA P-256, 10 years) for trust domain cluster.local");
    Ok(())
}

/// A mode-0700 temporary directory, removed (with the key in it) on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new() -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(format!("shunt-ca-{}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------- image

fn build_image(root: &Path) -> anyhow::Result<()> {
    util::run(
        Command::new("docker")
            .args(["build", "-f"])
            .arg(root.join("deploy/Dockerfile"))
            .args(["-t", IMAGE])
            .arg(root)
            .env("DOCKER_BUILDKIT", "1"),
    )
}

// ---------------------------------------------------------------- agent

fn apply_agent(root: &Path) -> anyhow::Result<()> {
    let existed = quiet(kubectl().args(["get", "daemonset", DAEMONSET, "-n", AGENT_NAMESPACE]))?
        .status
        .success();
    util::run(kubectl().arg("apply").arg("-k").arg(root.join("deploy")))?;
    if existed {
        // Same tag, new image: running pods would keep the old one.
        eprintln!("    restarting the agents so that they run the image just loaded");
        util::run(kubectl().args([
            "rollout",
            "restart",
            "daemonset",
            DAEMONSET,
            "-n",
            AGENT_NAMESPACE,
        ]))?;
    }
    Ok(())
}

/// Waits until every node runs an updated, ready agent (what `kubectl
/// rollout status` waits for), printing progress, and stops early with the
/// agent's logs if one cannot start.
fn wait_for_agents() -> anyhow::Result<()> {
    let deadline = Instant::now() + ROLLOUT_TIMEOUT;
    let mut last = String::new();
    loop {
        let fields = util::stdout(kubectl().args([
            "get",
            "daemonset",
            DAEMONSET,
            "-n",
            AGENT_NAMESPACE,
            "-o",
            "jsonpath={.metadata.generation} {.status.observedGeneration} {.status.desiredNumberScheduled} {.status.updatedNumberScheduled} {.status.numberAvailable} {.status.numberReady}",
        ]))?;
        let n: Vec<u64> = fields
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .chain(std::iter::repeat(0))
            .take(6)
            .collect();
        let (generation, observed, desired, updated, available, ready) =
            (n[0], n[1], n[2], n[3], n[4], n[5]);
        let line = format!(
            "{ready}/{desired} agents ready, {updated}/{desired} running the current version"
        );
        if line != last {
            eprintln!("    {line}");
            last = line;
        }
        if observed >= generation && desired > 0 && updated == desired && available == desired {
            return Ok(());
        }
        if let Some(problem) = failing_agent()? {
            diagnose_agents();
            bail!("{problem}");
        }
        if Instant::now() > deadline {
            diagnose_agents();
            bail!(
                "the agents are not all ready after {}s ({last}); see the pods, events and logs above",
                ROLLOUT_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_secs(2));
    }
}

/// Waiting reasons that will not go away by waiting.
const HOPELESS: &[&str] = &[
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// An agent pod stuck for good, if any.
fn failing_agent() -> anyhow::Result<Option<String>> {
    let pods = util::stdout(kubectl().args([
        "get",
        "pods",
        "-n",
        AGENT_NAMESPACE,
        "-l",
        AGENT_SELECTOR,
        "-o",
        "jsonpath={range .items[*]}{.metadata.name}{\"\\t\"}{.spec.nodeName}{\"\\t\"}{range .status.initContainerStatuses[*]}{.state.waiting.reason}{\" \"}{end}{range .status.containerStatuses[*]}{.state.waiting.reason}{\" \"}{end}{\"\\n\"}{end}",
    ]))?;
    for line in pods.lines() {
        let mut fields = line.split('\t');
        let (Some(pod), Some(node), reasons) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if let Some(reason) = reasons
            .unwrap_or_default()
            .split_whitespace()
            .find(|r| HOPELESS.contains(r))
        {
            return Ok(Some(format!(
                "agent pod {pod} on node {node}: {reason} (its logs and events are above)"
            )));
        }
    }
    Ok(None)
}

/// Prints what explains a stuck rollout: pods, recent events, each agent's
/// readiness answer and last log lines. Best effort.
fn diagnose_agents() {
    eprintln!("---- agent pods");
    show(kubectl().args(["get", "pods", "-n", AGENT_NAMESPACE, "-o", "wide"]));
    eprintln!("---- recent events in {AGENT_NAMESPACE}");
    if let Ok(out) = quiet(kubectl().args([
        "get",
        "events",
        "-n",
        AGENT_NAMESPACE,
        "--sort-by=.lastTimestamp",
    ])) {
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(15)..] {
            eprintln!("    {line}");
        }
    }
    for (node, pod) in agent_pods().unwrap_or_default() {
        eprintln!("---- {pod} (node {node}): readiness (15021 /healthz/ready)");
        show(kubectl().args([
            "get",
            "--raw",
            &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/pods/{pod}:15021/proxy/healthz/ready"),
        ]));
        eprintln!("---- {pod}: init container log");
        show(kubectl().args(["logs", "-n", AGENT_NAMESPACE, &pod, "-c", "mount-bpffs"]));
        eprintln!("---- {pod}: agent log (last 25 lines; and of the previous run, if any)");
        show(kubectl().args([
            "logs",
            "-n",
            AGENT_NAMESPACE,
            &pod,
            "-c",
            "agent",
            "--tail=25",
        ]));
        show(kubectl().args([
            "logs",
            "-n",
            AGENT_NAMESPACE,
            &pod,
            "-c",
            "agent",
            "--tail=25",
            "--previous",
        ]));
    }
}

/// Runs `cmd` and prints its output indented, whatever happens.
fn show(cmd: &mut Command) {
    match cmd.output() {
        Ok(out) => {
            for line in String::from_utf8_lossy(&out.stdout)
                .lines()
                .chain(String::from_utf8_lossy(&out.stderr).lines())
            {
                eprintln!("    {line}");
            }
        }
        Err(e) => eprintln!("    ({}: {e})", util::describe(cmd)),
    }
}

/// The current (not terminating) agent pod of each node.
fn agent_pods() -> anyhow::Result<BTreeMap<String, String>> {
    let pods = util::stdout(kubectl().args([
        "get",
        "pods",
        "-n",
        AGENT_NAMESPACE,
        "-l",
        AGENT_SELECTOR,
        "-o",
        "jsonpath={range .items[*]}{.spec.nodeName}{\"\\t\"}{.metadata.name}{\"\\t\"}{.metadata.deletionTimestamp}{\"\\n\"}{end}",
    ]))?;
    Ok(pods
        .lines()
        .filter_map(|line| {
            let mut f = line.split('\t');
            let (node, pod, deleting) = (f.next()?, f.next()?, f.next().unwrap_or_default());
            (deleting.is_empty() && !node.is_empty()).then(|| (node.to_string(), pod.to_string()))
        })
        .collect())
}

// ---------------------------------------------------------------- samples

fn apply_samples(root: &Path) -> anyhow::Result<()> {
    util::run(
        kubectl()
            .arg("apply")
            .arg("-k")
            .arg(root.join("deploy/samples")),
    )?;
    for deployment in ["server", "client"] {
        util::run(kubectl().args([
            "rollout",
            "status",
            "deployment",
            deployment,
            "-n",
            DEMO_NAMESPACE,
            "--timeout=300s",
        ]))?;
    }
    Ok(())
}

/// A sample pod as the API shows it.
#[derive(Clone, Debug)]
struct SamplePod {
    name: String,
    node: String,
    ip: String,
    /// The `ambient.istio.io/redirection` annotation the agent maintains.
    redirection: String,
}

/// The current client and server pods.
fn sample_pods() -> anyhow::Result<BTreeMap<String, SamplePod>> {
    let pods = util::stdout(kubectl().args([
        "get",
        "pods",
        "-n",
        DEMO_NAMESPACE,
        "-o",
        "jsonpath={range .items[*]}{.metadata.labels.app}{\"\\t\"}{.metadata.name}{\"\\t\"}{.spec.nodeName}{\"\\t\"}{.status.podIP}{\"\\t\"}{.metadata.deletionTimestamp}{\"\\t\"}{.metadata.annotations.ambient\\.istio\\.io/redirection}{\"\\n\"}{end}",
    ]))?;
    let mut out = BTreeMap::new();
    for line in pods.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 6 || !f[4].is_empty() {
            continue;
        }
        out.insert(
            f[0].to_string(),
            SamplePod {
                name: f[1].to_string(),
                node: f[2].to_string(),
                ip: f[3].to_string(),
                redirection: f[5].to_string(),
            },
        );
    }
    Ok(out)
}

/// Waits until the agent has annotated both pods
/// `ambient.istio.io/redirection=enabled` (it does once their redirection
/// is in place).
fn wait_for_enrolment() -> anyhow::Result<(SamplePod, SamplePod)> {
    let deadline = Instant::now() + ENROLMENT_TIMEOUT;
    let mut last = String::new();
    loop {
        let pods = sample_pods()?;
        let line = ["client", "server"]
            .iter()
            .map(|app| match pods.get(*app) {
                Some(p) => format!(
                    "{} on {}: redirection={}",
                    p.name,
                    p.node,
                    if p.redirection.is_empty() {
                        "(none yet)"
                    } else {
                        &p.redirection
                    }
                ),
                None => format!("{app}: no pod yet"),
            })
            .collect::<Vec<_>>()
            .join("; ");
        if line != last {
            eprintln!("    {line}");
            last = line;
        }
        if let (Some(client), Some(server)) = (pods.get("client"), pods.get("server"))
            && client.redirection == "enabled"
            && server.redirection == "enabled"
        {
            return Ok((client.clone(), server.clone()));
        }
        if Instant::now() > deadline {
            let agents = agent_pods().unwrap_or_default();
            for pod in pods.values() {
                if let Some(agent) = agents.get(&pod.node) {
                    eprintln!("---- agent {agent} on {}: shunt status", pod.node);
                    show(kubectl().args([
                        "exec",
                        "-n",
                        AGENT_NAMESPACE,
                        agent,
                        "-c",
                        "agent",
                        "--",
                        "shunt",
                        "status",
                    ]));
                }
            }
            bail!(
                "the sample pods are not both annotated ambient.istio.io/redirection=enabled after {}s ({last}); the agents' view is above",
                ENROLMENT_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_secs(2));
    }
}

// ---------------------------------------------------------------- HBONE

/// The agent's proxy counters (`shunt status --json`, field `proxy`).
fn proxy_counter(agent: &str, field: &str) -> anyhow::Result<u64> {
    let status = util::stdout(kubectl().args([
        "exec",
        "-n",
        AGENT_NAMESPACE,
        agent,
        "-c",
        "agent",
        "--",
        "shunt",
        "status",
        "--json",
    ]))?;
    json_u64(&status, field).with_context(|| {
        format!(
            "agent {agent}: `shunt status --json` has no proxy counter {field} (is --capture off in deploy/base/configmap.yaml?)"
        )
    })
}

/// The number after `"key":` in a JSON text (the status is flat enough for
/// this; xtask has no JSON parser).
fn json_u64(text: &str, key: &str) -> Option<u64> {
    let quoted = format!("\"{key}\"");
    let at = text.find(&quoted)? + quoted.len();
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Curls the server's pod IP from the client, then checks that the
/// client's node's proxy sent them as HBONE and the server's node's proxy
/// received them as HBONE. Returns the agent pods by node.
fn check_hbone(client: &SamplePod, server: &SamplePod) -> anyhow::Result<BTreeMap<String, String>> {
    let agents = agent_pods()?;
    let agent_of = |node: &str| {
        agents
            .get(node)
            .cloned()
            .with_context(|| format!("no agent pod on node {node}"))
    };
    let (client_agent, server_agent) = (agent_of(&client.node)?, agent_of(&server.node)?);
    let out_before = proxy_counter(&client_agent, "outbound_hbone")?;
    let passthrough_before = proxy_counter(&client_agent, "outbound_passthrough")?;
    let in_before = proxy_counter(&server_agent, "inbound_hbone")?;

    let url = format!("http://{}:{SERVER_PORT}/hostname", server.ip);
    for i in 1..=REQUESTS {
        let answer = util::stdout(kubectl().args([
            "exec",
            "-n",
            DEMO_NAMESPACE,
            &client.name,
            "-c",
            "client",
            "--",
            "curl",
            "-sS",
            "--max-time",
            "10",
            &url,
        ]))?;
        eprintln!("    {} $ curl {url} → {answer}", client.name);
        if answer != server.name {
            bail!(
                "request {i} answered {answer:?}; the server pod is {}",
                server.name
            );
        }
    }

    // The proxy counts a connection as it is set up; allow a moment anyway.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (out, passthrough, inbound) = loop {
        // Saturating: an agent that restarted meanwhile starts from zero.
        let out = proxy_counter(&client_agent, "outbound_hbone")?.saturating_sub(out_before);
        let passthrough = proxy_counter(&client_agent, "outbound_passthrough")?
            .saturating_sub(passthrough_before);
        let inbound = proxy_counter(&server_agent, "inbound_hbone")?.saturating_sub(in_before);
        if (out >= REQUESTS && inbound >= REQUESTS) || Instant::now() > deadline {
            break (out, passthrough, inbound);
        }
        thread::sleep(Duration::from_secs(1));
    };
    eprintln!(
        "    {client_agent} (node {}): +{out} outbound HBONE, +{passthrough} passthrough",
        client.node
    );
    eprintln!(
        "    {server_agent} (node {}): +{inbound} inbound HBONE",
        server.node
    );
    if out < REQUESTS || inbound < REQUESTS {
        bail!(
            "{REQUESTS} requests reached the server, but the proxies counted {out} outbound and {inbound} inbound HBONE connections \
             ({passthrough} went out as plain TCP): the traffic did not go through HBONE. \
             `kubectl --context {CONTEXT} -n {AGENT_NAMESPACE} logs {client_agent} -c agent` has the access log."
        );
    }
    // The same seen in the agent's Prometheus metrics (best effort: shown,
    // not checked), through the API server's proxy to the agent's 15020.
    if let Ok(metrics) = util::stdout(kubectl().args([
        "get",
        "--raw",
        &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/pods/{server_agent}:15020/proxy/metrics"),
    ])) {
        for line in metrics.lines().filter(|l| {
            l.starts_with("istio_tcp_connections_opened_total") && l.contains(DEMO_NAMESPACE)
        }) {
            eprintln!("    metrics: {line}");
        }
    }
    eprintln!("---- shunt status on node {}", server.node);
    show(kubectl().args([
        "exec",
        "-n",
        AGENT_NAMESPACE,
        &server_agent,
        "-c",
        "agent",
        "--",
        "shunt",
        "status",
    ]));
    Ok(agents)
}

fn look_around(client: &SamplePod, server: &SamplePod, agents: &BTreeMap<String, String>) {
    let agent = agents
        .get(&server.node)
        .map(String::as_str)
        .unwrap_or("<agent pod>");
    let k = format!("kubectl --context {CONTEXT}");
    eprintln!(
        "
shunt runs on every node of the kind cluster `{CLUSTER}`; {client} and {server} talk through HBONE.
Look around:

  {k} -n {AGENT_NAMESPACE} get pods -o wide                      # one agent per node
  {k} -n {AGENT_NAMESPACE} exec {agent} -- shunt status          # enrolled pods, hooks, counters
  {k} -n {AGENT_NAMESPACE} logs {agent} -c agent -f              # one access-log line per connection
  {k} -n {DEMO_NAMESPACE} exec {client} -- curl -sS http://{ip}:{SERVER_PORT}/hostname
  {k} -n {DEMO_NAMESPACE} exec {client} -- curl -sS http://server.{DEMO_NAMESPACE}/hostname   # a Service IP: plain TCP (not resolved yet)
  {k} -n {DEMO_NAMESPACE} get pods -o custom-columns=POD:.metadata.name,NODE:.spec.nodeName,REDIRECTION:.metadata.annotations.ambient\\.istio\\.io/redirection
  {k} get --raw /api/v1/namespaces/{AGENT_NAMESPACE}/pods/{agent}:15020/proxy/metrics   # Prometheus metrics
  {k} -n {AGENT_NAMESPACE} port-forward {agent} 15000   # then: curl localhost:15000/status, /config_dump, /debug/bpf
  {k} label namespace default istio.io/dataplane-mode=ambient   # enrol another namespace
  {k} -n {AGENT_NAMESPACE} edit configmap shunt-config && {k} -n {AGENT_NAMESPACE} rollout restart daemonset/shunt

Remove it all: cargo xtask run --delete",
        client = client.name,
        server = server.name,
        ip = server.ip,
    );
}

// ---------------------------------------------------------------- delete

fn delete() -> anyhow::Result<()> {
    eprintln!("removing what `cargo xtask run` made:");
    phase("tools", || require_tools(&[DOCKER, KIND]))?;
    phase("docker daemon", || {
        let out =
            quiet(Command::new("docker").args(["version", "--format", "{{.Server.Version}}"]))?;
        if !out.status.success() {
            bail!(
                "docker's daemon does not answer ({}); kind needs it to remove the cluster's node containers",
                first_line(&out.stderr)
            );
        }
        Ok(())
    })?;
    phase("kind cluster `shunt`", || {
        if cluster_exists()? {
            // Removes the node containers, and with them everything deployed,
            // the programs and pins the agents left in the kernel, and the
            // kubeconfig context.
            util::run(Command::new("kind").args(["delete", "cluster", "--name", CLUSTER]))
        } else {
            eprintln!("    no cluster named `{CLUSTER}`; nothing to remove");
            Ok(())
        }
    })?;
    phase("image shunt:dev", || {
        let present = quiet(Command::new("docker").args(["image", "inspect", IMAGE]))?
            .status
            .success();
        if present {
            util::output(Command::new("docker").args(["image", "rm", IMAGE]))?;
            eprintln!("    removed (BuildKit's cache stays: `docker builder prune` drops it)");
        } else {
            eprintln!("    no image {IMAGE}; nothing to remove");
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_numbers_from_the_status_json() {
        let status = r#"{"node":"n","proxy":{"outbound_hbone": 12,"inbound_hbone":3}}"#;
        assert_eq!(json_u64(status, "outbound_hbone"), Some(12));
        assert_eq!(json_u64(status, "inbound_hbone"), Some(3));
        assert_eq!(json_u64(status, "refused"), None);
        assert_eq!(json_u64(r#"{"proxy":null}"#, "outbound_hbone"), None);
    }

    #[test]
    fn missing_tools_are_all_named_with_how_to_get_them() {
        let absent = Tool {
            name: "shunt-no-such-tool",
            why: "is needed",
            how: "somehow",
        };
        let also = Tool {
            name: "shunt-no-such-tool-2",
            why: "is needed too",
            how: "some other way",
        };
        let message = require_tools(&[absent, also]).unwrap_err().to_string();
        assert!(message.starts_with("missing: shunt-no-such-tool, shunt-no-such-tool-2"));
        assert!(message.contains("Install: somehow"));
        assert!(message.contains("Install: some other way"));
    }
}
