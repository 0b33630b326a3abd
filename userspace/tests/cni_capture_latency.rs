//! Issue 36's closing figure: how long after the kubelet's RunPodSandbox a
//! mesh pod is captured, with the CNI plugin (capture is part of
//! RunPodSandbox: it returns only once the pod is captured) beside today's
//! watch-driven capture (RunPodSandbox returns, the kubelet reports the
//! pod's IP, the agent's pod watch sees it and enrols it). Real containerd,
//! runc, CNI chain and agent, as in `cni_containerd.rs`; N sandboxes one
//! after another (`SHUNT_CNI_BENCH_N`, default 100), each removed after it
//! is measured.
//!
//! Ignored by default (a measurement, it asserts nothing about time):
//! `cargo test -p shunt --test cni_capture_latency -- --ignored --nocapture`.
//! Prints p50/p99 and writes the raw samples to
//! `bench/results/issue36/capture-latency-<mode>.txt`.
//!
//! The watch path's time leaves out the kubelet's own delay before it
//! reports the IP (the test reports it the moment RunPodSandbox returns),
//! so it is a lower bound of what a node sees.

#[path = "support/cni_bed.rs"]
mod cni_bed;
#[path = "support/containerd.rs"]
mod containerd;
#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use cni_bed::{CniBed, MESH_NS, TIMEOUT, agent_args};
use serde_json::json;
use shunt::{api::NodeStatus, state::PodState};

fn samples() -> usize {
    std::env::var("SHUNT_CNI_BENCH_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100)
}

/// Whether the agent's `/status` shows `ns/name` enrolled (read over HTTP:
/// no process per poll).
fn enrolled(bed: &CniBed, name: &str) -> Option<String> {
    let url = format!("http://{}/status", bed.admin);
    let status: NodeStatus = ureq::get(&url).call().ok()?.body_mut().read_json().ok()?;
    let pod = status
        .pods
        .into_iter()
        .find(|p| p.namespace == MESH_NS && p.name == name)?;
    (pod.state == PodState::Enrolled)
        .then(|| pod.ips.first().map(|ip| ip.to_string()).unwrap_or_default())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// Measures one path; returns the samples (RunPodSandbox start → captured)
/// and RunPodSandbox's own durations.
async fn measure(mode: &str, cni: bool) -> (Vec<Duration>, Vec<Duration>) {
    let test = if cni { "cni-lat" } else { "cni-latw" };
    let mut bed = CniBed::start_with(test, &agent_args(mode), cni).await;
    let mut captured = Vec::new();
    let mut run = Vec::new();
    for i in 0..samples() {
        let name = format!("web-{i}");
        let uid = bed.add_pod(MESH_NS, &name, json!({}));
        let config = bed.sandbox_config(MESH_NS, &name, &uid);
        // The watch has the pod before its sandbox, as on a node (the
        // kubelet acts on the API's pod).
        let start = Instant::now();
        let sandbox = bed.ctd().run_sandbox(&config).await.expect("RunPodSandbox");
        let returned = start.elapsed();
        run.push(returned);
        if cni {
            // Captured before RunPodSandbox returned: its duration is the
            // time to captured.
            assert!(enrolled(&bed, &name).is_some(), "{name} captured at return");
            captured.push(returned);
        } else {
            let info = bed.ctd().sandbox_info(&sandbox).await;
            let value: serde_json::Value = serde_json::from_str(&info).expect("sandbox info");
            let ip = value["cniResult"]["Interfaces"]["eth0"]["IPConfigs"][0]["IP"]
                .as_str()
                .expect("the sandbox's IP")
                .to_owned();
            bed.report_ip(MESH_NS, &name, &ip);
            let done = tokio::task::block_in_place(|| {
                loop {
                    if enrolled(&bed, &name).is_some() {
                        break start.elapsed();
                    }
                    assert!(
                        start.elapsed() < TIMEOUT,
                        "{name} not enrolled by the watch"
                    );
                    std::thread::sleep(Duration::from_millis(2));
                }
            });
            captured.push(done);
        }
        bed.ctd().remove_sandbox(&sandbox).await;
        bed.api.delete(fake_apiserver::Kind::Pod, MESH_NS, &name);
    }
    bed.shutdown().await;
    (captured, run)
}

fn summary(label: &str, samples: &[Duration]) -> String {
    let mut sorted = samples.to_vec();
    sorted.sort();
    format!(
        "{label}: n={} p50={:.1}ms p99={:.1}ms min={:.1}ms max={:.1}ms",
        sorted.len(),
        percentile(&sorted, 0.50).as_secs_f64() * 1e3,
        percentile(&sorted, 0.99).as_secs_f64() * 1e3,
        sorted[0].as_secs_f64() * 1e3,
        sorted[sorted.len() - 1].as_secs_f64() * 1e3,
    )
}

async fn figure(mode: &str) {
    let (cni, cni_run) = measure(mode, true).await;
    let (watch, watch_run) = measure(mode, false).await;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# issue 36: RunPodSandbox -> captured, {mode} mode, builtin proxy"
    );
    let _ = writeln!(
        out,
        "# {}",
        summary("cni   (RunPodSandbox -> captured)", &cni)
    );
    let _ = writeln!(
        out,
        "# {}",
        summary("watch (RunPodSandbox -> captured)", &watch)
    );
    let _ = writeln!(
        out,
        "# {}",
        summary("watch (RunPodSandbox alone)", &watch_run)
    );
    let _ = writeln!(
        out,
        "# {}",
        summary("cni   (RunPodSandbox alone)", &cni_run)
    );
    let _ = writeln!(out, "# raw samples, ms: path sample");
    for (path, samples) in [("cni", &cni), ("watch", &watch)] {
        for sample in samples {
            let _ = writeln!(out, "{path} {:.3}", sample.as_secs_f64() * 1e3);
        }
    }
    print!("{out}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results/issue36");
    std::fs::create_dir_all(&dir).expect("results dir");
    std::fs::write(dir.join(format!("capture-latency-{mode}.txt")), out).expect("results");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn capture_latency_ebpf() {
    figure("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn capture_latency_iptables() {
    figure("iptables").await;
}
