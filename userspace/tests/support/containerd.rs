//! A real containerd for the CNI plugin's tests, as a kubelet's node has
//! one: started by the test inside a testbed node's netns and a cgroup of
//! the test's topology, with its own root, state, socket and configuration
//! under a temp dir; the CRI plugin runs the CNI chain (the reference
//! `bridge` and `host-local` plugins, then shunt-cni once the agent has
//! chained it) on the node's bridge; images are OCI archives made here
//! (one static binary, `cni_app.rs`) and imported, used as the sandbox
//! image without any pull. Sandboxes and containers are made through the
//! CRI, as the kubelet makes them.
//!
//! What works here (Debian's containerd 1.6, runc 1.1):
//! `restrict_oom_score_adj = true` (no CAP_SYS_RESOURCE: without it runc
//! fails with "can't get final child's PID from pipe"),
//! `netns_mounts_under_state_dir = true` (sandbox netns stay out of `ip
//! netns`), overlayfs, one CNI `bin_dir` of symlinks. Left behind by
//! containerd and cleaned up here: the shims' sockets under
//! /run/containerd/s and the CNI cache under /var/lib/cni/results (both
//! named after the sandboxes this harness made, and only those).
#![allow(dead_code)]

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use shunt_proto::cri::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatusRequest,
    CreateContainerRequest, ImageSpec, LinuxPodSandboxConfig, PodSandboxConfig, PodSandboxMetadata,
    PodSandboxStatusRequest, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopPodSandboxRequest, runtime_service_client::RuntimeServiceClient,
};
use shunt_testbed::{Cgroup, Node};
use tonic::transport::{Channel, Endpoint};

/// The image every sandbox and container runs (`cni_app.rs`).
pub const IMAGE: &str = "docker.io/library/shunt-cni-testapp:1";
/// The CNI network's name (and so the CNI cache's file prefix).
pub const NETWORK: &str = "shunt-test";
/// Bounds every wait on containerd.
const STEP: Duration = Duration::from_secs(30);

/// The addresses host-local hands out on the node's bridge: a part of the
/// node's pod subnet no testbed pod uses.
#[derive(Clone, Debug)]
pub struct CniNetwork {
    pub bridge: String,
    pub gateway: Ipv4Addr,
    pub first: Ipv4Addr,
    pub last: Ipv4Addr,
}

impl CniNetwork {
    /// `198.18.<node>.200`–`.250` on the node's `br0`, gateway `.1` (the
    /// node's own address there).
    pub fn on(node: &Node) -> Self {
        let [a, b, c, _] = node.gateway().octets();
        Self {
            bridge: "br0".into(),
            gateway: node.gateway(),
            first: Ipv4Addr::new(a, b, c, 200),
            last: Ipv4Addr::new(a, b, c, 250),
        }
    }
}

pub struct Containerd {
    dir: tempfile::TempDir,
    child: Option<Child>,
    pub socket: PathBuf,
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    client: RuntimeServiceClient<Channel>,
    /// Every sandbox made (for the cleanup of what containerd leaves).
    sandboxes: Vec<String>,
    removed: Vec<String>,
}

impl Containerd {
    /// Starts containerd in `node`'s netns and in `cgroup` (so that the
    /// sandboxes' processes are below the agent's `--cgroup-root`), with
    /// `network` as its CNI configuration, and imports the test image.
    pub async fn start(node: &Node, cgroup: &Cgroup, network: &CniNetwork) -> Containerd {
        let dir = tempfile::Builder::new()
            .prefix("shunt-ctd-")
            .tempdir()
            .expect("temp dir");
        let root = dir.path();
        let socket = root.join("containerd.sock");
        let conf_dir = root.join("cni-conf");
        let bin_dir = root.join("cni-bin");
        for d in [&conf_dir, &bin_dir, &root.join("logs")] {
            std::fs::create_dir_all(d).expect("containerd dirs");
        }
        for plugin in ["bridge", "host-local", "loopback"] {
            std::os::unix::fs::symlink(reference_plugin(plugin), bin_dir.join(plugin))
                .expect("CNI plugin symlink");
        }
        std::fs::write(conf_dir.join("10-pods.conflist"), conflist(network, root))
            .expect("conflist");
        std::fs::write(
            root.join("config.toml"),
            config(root, &socket, &conf_dir, &bin_dir),
        )
        .expect("containerd config");
        let image = build_image(root);
        let log = std::fs::File::create(root.join("containerd.log")).expect("containerd log");
        let mut cmd = node.command("containerd");
        cmd.arg("--config")
            .arg(root.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        cgroup.place(&mut cmd);
        let child = cmd
            .spawn()
            .expect("start containerd (installed by `cargo xtask setup`)");
        let endpoint = Endpoint::from_shared(format!("unix:{}", socket.display()))
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(2));
        let mut this = Containerd {
            client: RuntimeServiceClient::new(endpoint.connect_lazy()),
            dir,
            child: Some(child),
            socket,
            conf_dir,
            bin_dir,
            sandboxes: Vec::new(),
            removed: Vec::new(),
        };
        let start = Instant::now();
        while !this.socket.exists() {
            assert!(
                start.elapsed() < STEP,
                "containerd did not listen within {STEP:?}:\n{}",
                this.log()
            );
            if let Some(Some(exit)) = this.child.as_mut().map(|c| c.try_wait().ok().flatten()) {
                panic!("containerd exited ({exit}):\n{}", this.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let imported = Command::new("ctr")
            .arg("--address")
            .arg(&this.socket)
            .args(["--namespace", "k8s.io", "images", "import"])
            .arg(&image)
            .output()
            .expect("run ctr");
        assert!(
            imported.status.success(),
            "ctr images import: {}",
            String::from_utf8_lossy(&imported.stderr)
        );
        this
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// A pod's sandbox configuration as the kubelet writes it (the parts
    /// containerd needs), its processes under `cgroup_parent` (relative to
    /// the cgroup mount).
    pub fn sandbox_config(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        cgroup_parent: &str,
    ) -> PodSandboxConfig {
        let logs = self.dir.path().join("logs").join(uid);
        std::fs::create_dir_all(&logs).expect("log dir");
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: uid.into(),
                namespace: namespace.into(),
                attempt: 0,
            }),
            hostname: name.into(),
            log_directory: logs.display().to_string(),
            labels: HashMap::from([
                ("io.kubernetes.pod.name".to_owned(), name.to_owned()),
                (
                    "io.kubernetes.pod.namespace".to_owned(),
                    namespace.to_owned(),
                ),
                ("io.kubernetes.pod.uid".to_owned(), uid.to_owned()),
            ]),
            annotations: HashMap::new(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: cgroup_parent.into(),
            }),
        }
    }

    /// RunPodSandbox: containerd creates the netns and runs the CNI chain's
    /// ADD before it answers.
    pub async fn run_sandbox(
        &mut self,
        config: &PodSandboxConfig,
    ) -> Result<String, tonic::Status> {
        let request = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        };
        let mut client = self.client.clone();
        let id = tokio::time::timeout(STEP * 2, client.run_pod_sandbox(request))
            .await
            .map_err(|_| tonic::Status::deadline_exceeded("RunPodSandbox took too long"))??
            .into_inner()
            .pod_sandbox_id;
        self.sandboxes.push(id.clone());
        Ok(id)
    }

    /// The sandbox's netns path, from its status (as the agent's CRI
    /// discovery reads it).
    pub async fn sandbox_info(&self, id: &str) -> String {
        let mut client = self.client.clone();
        let status = client
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.into(),
                verbose: true,
            })
            .await
            .expect("PodSandboxStatus")
            .into_inner();
        status.info.get("info").cloned().unwrap_or_default()
    }

    /// Creates and starts a container running `cni_app` with `args` in the
    /// sandbox. Returns its id.
    pub async fn run_container(
        &self,
        sandbox: &str,
        config: &PodSandboxConfig,
        args: &[&str],
    ) -> String {
        let mut client = self.client.clone();
        let request = CreateContainerRequest {
            pod_sandbox_id: sandbox.into(),
            config: Some(ContainerConfig {
                metadata: Some(ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                image: Some(ImageSpec {
                    image: IMAGE.into(),
                }),
                command: vec!["/app".into()],
                args: args.iter().map(|a| a.to_string()).collect(),
                labels: HashMap::new(),
                annotations: HashMap::new(),
                log_path: "app.log".into(),
            }),
            sandbox_config: Some(config.clone()),
        };
        let id = client
            .create_container(request)
            .await
            .expect("CreateContainer")
            .into_inner()
            .container_id;
        client
            .start_container(StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .expect("StartContainer");
        id
    }

    /// Waits (bounded) for the container to exit; its exit code and what
    /// it printed (the CRI log of `config`'s log directory).
    pub async fn wait_exited(&self, container: &str, config: &PodSandboxConfig) -> (i32, String) {
        let mut client = self.client.clone();
        let start = Instant::now();
        loop {
            let status = client
                .container_status(ContainerStatusRequest {
                    container_id: container.into(),
                    verbose: false,
                })
                .await
                .expect("ContainerStatus")
                .into_inner()
                .status
                .expect("a status");
            if status.state == ContainerState::ContainerExited as i32 {
                let log = std::fs::read_to_string(Path::new(&config.log_directory).join("app.log"))
                    .unwrap_or_default();
                return (status.exit_code, log);
            }
            assert!(
                start.elapsed() < STEP,
                "container {container} still running after {STEP:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// StopPodSandbox then RemovePodSandbox, as the kubelet does (CNI DEL
    /// runs at both).
    pub async fn remove_sandbox(&mut self, id: &str) {
        self.try_remove_sandbox(id)
            .await
            .expect("remove the sandbox");
    }

    async fn try_remove_sandbox(&mut self, id: &str) -> Result<(), tonic::Status> {
        let mut client = self.client.clone();
        client
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await?;
        client
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await?;
        self.removed.push(id.to_owned());
        Ok(())
    }

    /// Removes every sandbox made and not removed yet, then stops
    /// containerd.
    pub async fn shutdown(mut self) {
        for id in self.sandboxes.clone() {
            if self.removed.contains(&id) {
                continue;
            }
            if let Err(status) = self.try_remove_sandbox(&id).await {
                eprintln!("cleanup: sandbox {id}: {status}");
            }
        }
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Our own child, by PID.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let start = Instant::now();
            while matches!(child.try_wait(), Ok(None)) && start.elapsed() < STEP {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        for id in &self.sandboxes {
            // The shim's socket: containerd names it after its own address,
            // the namespace and the sandbox id (runtime v2 `SocketAddress`).
            let path = format!("{}/k8s.io/{id}", self.socket.display());
            let digest = ring::digest::digest(&ring::digest::SHA256, path.as_bytes());
            let _ = std::fs::remove_file(Path::new("/run/containerd/s").join(hex(digest.as_ref())));
            // The CNI cache: our network's result, and the loopback
            // network containerd sets up itself.
            for cached in [
                format!("{NETWORK}-{id}-eth0"),
                format!("cni-loopback-{id}-lo"),
            ] {
                let _ = std::fs::remove_file(Path::new("/var/lib/cni/results").join(cached));
            }
        }
        // Mounts a failed test may have left (sandbox rootfs, netns pins).
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let ours = self.dir.path().display().to_string();
        let mut points: Vec<&str> = mountinfo
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| p.starts_with(&ours))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for point in points {
            let _ = Command::new("umount").args(["-l", point]).status();
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where Debian's containernetworking-plugins put `plugin`.
fn reference_plugin(plugin: &str) -> PathBuf {
    ["/usr/lib/cni", "/opt/cni/bin", "/usr/libexec/cni"]
        .iter()
        .map(|d| Path::new(d).join(plugin))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("CNI plugin {plugin} not found: run `cargo xtask setup`"))
}

fn conflist(network: &CniNetwork, root: &Path) -> String {
    let [a, b, c, _] = network.gateway.octets();
    let subnet = format!("{a}.{b}.{c}.0/24");
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "plugins": [{
            "type": "bridge",
            "bridge": network.bridge,
            "isGateway": true,
            "ipam": {
                "type": "host-local",
                "dataDir": root.join("ipam").display().to_string(),
                "ranges": [[{
                    "subnet": subnet,
                    "rangeStart": network.first.to_string(),
                    "rangeEnd": network.last.to_string(),
                    "gateway": network.gateway.to_string(),
                }]],
                "routes": [{ "dst": "0.0.0.0/0" }],
            },
        }],
    })
    .to_string()
}

fn config(root: &Path, socket: &Path, conf_dir: &Path, bin_dir: &Path) -> String {
    format!(
        r#"version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
"#,
        root = root.display(),
        socket = socket.display(),
        bin = bin_dir.display(),
        conf = conf_dir.display(),
    )
}

/// The OCI archive of the test image: `cni_app.rs` built statically with
/// the host's rustc as `/app`, entrypoint `/app` (the sandbox's pause).
fn build_image(root: &Path) -> PathBuf {
    let work = root.join("image");
    let layer_dir = work.join("layer");
    let blobs = work.join("oci/blobs/sha256");
    std::fs::create_dir_all(&layer_dir).expect("image dirs");
    std::fs::create_dir_all(&blobs).expect("image dirs");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/cni_app.rs");
    let built = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args([
            "--edition",
            "2024",
            "-O",
            "-C",
            "strip=symbols",
            "-C",
            "target-feature=+crt-static",
            "-o",
        ])
        .arg(layer_dir.join("app"))
        .arg(&source)
        .output()
        .expect("run rustc");
    assert!(
        built.status.success(),
        "building the test image's binary: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let layer = work.join("layer.tar");
    let tarred = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-cf"])
        .arg(&layer)
        .arg("-C")
        .arg(&layer_dir)
        .arg("app")
        .status()
        .expect("run tar");
    assert!(tarred.success(), "tar of the image layer");
    let blob = |bytes: &[u8]| -> (String, usize) {
        let digest = hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
        std::fs::write(blobs.join(&digest), bytes).expect("blob");
        (format!("sha256:{digest}"), bytes.len())
    };
    let (layer_digest, layer_size) = blob(&std::fs::read(&layer).expect("layer"));
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": ["/app"] },
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
    });
    let (config_digest, config_size) = blob(config.to_string().as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer_size,
        }],
    });
    let (manifest_digest, manifest_size) = blob(manifest.to_string().as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": {
                "io.containerd.image.name": IMAGE,
                "org.opencontainers.image.ref.name": "1",
            },
        }],
    });
    std::fs::write(work.join("oci/index.json"), index.to_string()).expect("index");
    std::fs::write(
        work.join("oci/oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .expect("oci-layout");
    let archive = work.join("image.tar");
    let tarred = Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(work.join("oci"))
        .arg(".")
        .status()
        .expect("run tar");
    assert!(tarred.success(), "tar of the OCI archive");
    archive
}
