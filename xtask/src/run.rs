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

mod agents;
mod cluster;
mod hbone;
mod kubectl;
mod samples;
mod tools;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Args;

use self::{
    agents::{apply_agent, wait_for_agents},
    cluster::{build_image, ca_secret, cluster, cluster_exists},
    hbone::{check_hbone, look_around},
    kubectl::{first_line, quiet},
    samples::{apply_samples, wait_for_enrolment},
    tools::{
        DOCKER, KIND, KUBECTL, OPENSSL, docker_daemon_version, docker_ready, host_warnings,
        require_tools,
    },
};
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

fn delete() -> anyhow::Result<()> {
    eprintln!("removing what `cargo xtask run` made:");
    phase("tools", || require_tools(&[DOCKER, KIND]))?;
    phase("docker daemon", || {
        let out = docker_daemon_version()?;
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
