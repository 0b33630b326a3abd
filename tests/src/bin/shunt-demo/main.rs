//! `shunt-demo`, the driver behind `cargo xtask demo`: builds one node with
//! three pods in network namespaces, runs the real `shunt agent` on it, sends
//! echo traffic between the pods while showing the agent's live status table,
//! then tears everything down (also on Ctrl-C / SIGTERM) and checks what it saw.
//!
//! Exit status: 0 when every check passed, 1 when one failed (the agent's log is
//! kept and its path printed), 128+N when stopped by signal N after a clean
//! teardown.

mod checks;
mod show;
mod signals;
mod traffic;

use std::{
    fs,
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::{Context as _, bail};
use clap::Parser;
use shunt::api::{NodeStatus, PodState, PodStatus};
use shunt_testbed::{
    Cgroup, NETNS_DIR, Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
};

use self::{
    checks::{check_counters, check_filters_removed, check_traffic, keep_log, tc_filters},
    show::{first_line, indent, live_table, print_intro, summary},
    signals::{catch_stop_signals, interrupted},
    traffic::Traffic,
};

const NODE: &str = "node-a";
const CLIENT: &str = "client";
const SERVER: &str = "server";
const OUTSIDER: &str = "outsider";
/// How long the agent gets to enrol the mesh pods.
const ENROL_TIMEOUT: Duration = Duration::from_secs(20);

/// `cargo xtask demo`'s driver: a local node in network namespaces, the shunt
/// agent at work on it, and live traffic between its pods.
#[derive(Parser)]
#[command(name = "shunt-demo")]
struct Args {
    /// The `shunt` binary to run as the agent.
    #[arg(long)]
    shunt: PathBuf,
    /// How long to show live traffic, in seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let shunt = match args.shunt.canonicalize() {
        Ok(path) => path,
        Err(e) => {
            eprintln!(
                "shunt-demo: the shunt binary {} is not usable ({e}); build it with `cargo build -p shunt`",
                args.shunt.display()
            );
            return ExitCode::from(2);
        }
    };
    // SAFETY: no other thread exists yet (the signal thread and every traffic
    // thread are spawned below), so nothing can read the environment while it
    // changes. The testbed's `Agent` reads SHUNT_BIN to find the agent binary.
    unsafe { std::env::set_var("SHUNT_BIN", &shunt) };
    if let Err(e) = catch_stop_signals() {
        eprintln!("shunt-demo: {e:#}");
        return ExitCode::FAILURE;
    }
    match demo(&shunt, Duration::from_secs(args.seconds)) {
        Ok(()) => match interrupted() {
            Some(signal) => ExitCode::from(128 + signal as u8),
            None => ExitCode::SUCCESS,
        },
        Err(e) => {
            eprintln!("shunt-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn demo(shunt: &Path, duration: Duration) -> anyhow::Result<()> {
    let mut topo = Topology::new("demo").context("cannot create the demo topology")?;
    let node = topo.add_node(NODE).context("cannot create the node")?;
    let client = topo
        .add_pod(NODE, CLIENT)
        .context("cannot create pod client")?;
    let server = topo
        .add_pod(NODE, SERVER)
        .context("cannot create pod server")?;
    let outsider = topo
        .add_pod(NODE, OUTSIDER)
        .context("cannot create pod outsider")?;
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    // Declared after `topo`, so dropped before it on every path: the agent
    // goes before its namespaces do.
    // The library runs the agent with `--cgroup-root` set to the topology's
    // own cgroup, so its socket programs affect nothing else on the machine.
    let mut agent = Agent::start(&topo, &node, &yaml, &[]).context("cannot start the agent")?;

    let mut problems: Vec<String> = Vec::new();
    let mut last_status = None;
    match agent.wait_for(
        "pods client and server to be enrolled",
        ENROL_TIMEOUT,
        |status| {
            [CLIENT, SERVER]
                .iter()
                .all(|name| pod_status(status, name).is_some_and(|p| p.state == PodState::Enrolled))
        },
    ) {
        Ok(status) => last_status = Some(status),
        Err(e) => problems.push(first_line(&e.to_string())),
    }

    let pods = Pods {
        client,
        server,
        outsider,
    };
    let mut traffic = None;
    let mut tc_before = None;
    // The demo's own threads play the pods' applications, so the demo
    // process joins a cgroup below the agent's cgroup root, as a pod's
    // containers sit below a node's: the socket programs then see its
    // connects (and act on those made from enrolled pods only). The
    // topology moves it back when dropped.
    let apps = Cgroup::create(&topo, "apps").context("cannot create the apps cgroup")?;
    apps.add_pid(std::process::id())
        .context("cannot join the apps cgroup")?;
    if problems.is_empty() && interrupted().is_none() {
        print_intro(&topo, &agent, &pods, shunt, duration);
        match Traffic::start(&pods, duration) {
            Ok(t) => {
                live_table(&agent, &t, duration, &mut last_status, &mut problems);
                traffic = Some(t);
            }
            Err(e) => problems.push(format!("{e:#}")),
        }
        tc_before = Some(tc_filters(&pods.client));
    }

    // Teardown, whatever happened above.
    match interrupted() {
        Some(signal) => println!("\n== {signal}: stopping traffic and tearing down =="),
        None => println!("\n== teardown =="),
    }
    let flows = traffic.map(Traffic::stop).unwrap_or_default();
    let final_status = agent.status().ok().or(last_status);
    let counted_traffic = !flows.is_empty() && interrupted().is_none();
    check_traffic(&flows, counted_traffic, &mut problems);
    check_counters(final_status.as_ref(), counted_traffic, &mut problems);

    if let Some(before) = &tc_before {
        println!(
            "tc filters on client eth0 while enrolled:\n{}",
            indent(match before.as_deref() {
                Ok("") => "(none: already unenrolled)",
                Ok(text) => text,
                Err(_) => "(could not list them)",
            })
        );
    }
    match agent.stop() {
        Ok(status) if status.success() => println!("agent stopped (SIGTERM): {status}"),
        Ok(status) => problems.push(format!("the agent exited with {status} on SIGTERM")),
        Err(e) => problems.push(format!(
            "stopping the agent: {}",
            first_line(&e.to_string())
        )),
    }
    check_filters_removed(&[&pods.client, &pods.server], &mut problems);
    match fs::read_dir(agent.pin_dir()) {
        Ok(entries) => {
            let names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            println!(
                "pin dir {} after stop: {} (removed with the demo)",
                agent.pin_dir().display(),
                if names.is_empty() {
                    "empty".to_string()
                } else {
                    names.join(", ")
                }
            );
        }
        Err(_) => println!("pin dir {}: gone", agent.pin_dir().display()),
    }

    let kept_log = if problems.is_empty() {
        None
    } else {
        Some(keep_log(&agent))
    };
    drop(agent);
    let netns: Vec<String> = topo.netns_names().to_vec();
    drop(topo);
    let left: Vec<&String> = netns
        .iter()
        .filter(|name| Path::new(NETNS_DIR).join(name).exists())
        .collect();
    if left.is_empty() {
        println!(
            "deleted {} network namespaces: {}",
            netns.len(),
            netns.join(" ")
        );
    } else {
        problems.push(format!("network namespaces left behind: {left:?}"));
    }

    if !problems.is_empty() {
        let mut message = format!("demo FAILED:\n  - {}", problems.join("\n  - "));
        if let Some(log) = kept_log {
            message.push_str(&format!("\nagent log: {log}"));
        }
        bail!(message);
    }
    println!("{}", summary(&flows, final_status.as_ref()));
    Ok(())
}

struct Pods {
    client: Pod,
    server: Pod,
    outsider: Pod,
}

fn pod_status<'a>(status: &'a NodeStatus, name: &str) -> Option<&'a PodStatus> {
    status.pods.iter().find(|p| p.name == name)
}
