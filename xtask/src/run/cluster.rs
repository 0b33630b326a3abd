//! The cluster's own parts, each made once and reused on a rerun: the kind
//! cluster, the mesh's CA Secret (a rerun keeps the root), and the image.

use std::{
    fs,
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::{
    AGENT_NAMESPACE, CA_SECRET, CLUSTER, CONTEXT, IMAGE,
    kubectl::{first_line, kubectl, quiet},
};
use crate::util;

pub(super) fn cluster_exists() -> anyhow::Result<bool> {
    let clusters = util::stdout(Command::new("kind").args(["get", "clusters"]))?;
    Ok(clusters.lines().any(|l| l.trim() == CLUSTER))
}

pub(super) fn cluster(root: &Path) -> anyhow::Result<()> {
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

/// The Secret with the mesh's CA in Istio's plug-in layout, created once: an
/// existing one is kept, so reruns keep the trust root.
pub(super) fn ca_secret(root: &Path) -> anyhow::Result<()> {
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

pub(super) fn build_image(root: &Path) -> anyhow::Result<()> {
    util::run(
        Command::new("docker")
            .args(["build", "-f"])
            .arg(root.join("deploy/Dockerfile"))
            .args(["-t", IMAGE])
            .arg(root)
            .env("DOCKER_BUILDKIT", "1"),
    )
}
