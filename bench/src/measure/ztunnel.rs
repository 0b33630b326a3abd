//! A stock Istio ztunnel as the reference dataplane (`--ztunnel PATH`):
//! one ztunnel per mesh pod in dedicated mode, inside the pod's netns, as
//! ztunnel's own namespaced tests run it. No istiod and no CA: a static
//! `LOCAL_XDS_PATH` file the harness writes names every pod, and
//! `FAKE_CA=true` has each ztunnel sign its own certificate with the
//! built-in test root (the same root everywhere, so mTLS verifies both
//! ways). Capture is iptables in the pod: the pod's outgoing TCP not on
//! `lo` and not carrying ztunnel's mark (`PACKET_MARK=1337`) is
//! REDIRECTed to its 15001; HBONE reaches the peer's 15008 directly.

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow, bail};
use shunt_testbed::Pod;

use super::bed::Owned;
use crate::{client::ClientReport, model::ProxyCheck};

/// ztunnel's mark on its own sockets (what the REDIRECT skips).
const MARK: u32 = 1337;
/// ztunnel's stats port (Prometheus), bound in the pod's netns.
const STATS_PORT: u16 = 15020;
/// Its readiness port: `/healthz/ready` answers 200 once it serves.
const READY_PORT: u16 = 15021;

/// The pods of the ztunnel topology: (name, node, in the mesh).
pub(super) struct ZtunnelPod<'a> {
    pub pod: &'a Pod,
    pub mesh: bool,
}

/// ztunnel's `LocalConfig` YAML (its `xds.rs`): every pod as a workload,
/// mesh pods speaking HBONE, the others plain TCP.
pub(super) fn local_config(pods: &[ZtunnelPod]) -> String {
    let mut yaml = String::from("workloads:\n");
    for p in pods {
        let name = p.pod.name();
        yaml.push_str(&format!(
            "- uid: Kubernetes//Pod/default/{name}\n  name: {name}\n  namespace: default\n  serviceAccount: sa-{name}\n  trustDomain: cluster.local\n  workloadIps: [\"{ip}\"]\n  protocol: {protocol}\n  node: {node}\n  network: \"\"\n  services: {{}}\n",
            ip = p.pod.ip(),
            protocol = if p.mesh { "HBONE" } else { "TCP" },
            node = p.pod.node().name(),
        ));
    }
    yaml.push_str("policies: []\nservices: []\n");
    yaml
}

/// Starts ztunnel for `pod` (a mesh pod) in its netns with the capture
/// rule in place, and waits (bounded) until it reports ready.
pub(super) fn start(
    binary: &Path,
    pod: &Pod,
    config: &Path,
    log_filter: &str,
    log_file: &Path,
) -> anyhow::Result<Owned> {
    capture(pod)?;
    let log = std::fs::File::create(log_file)
        .with_context(|| format!("creating {}", log_file.display()))?;
    let mut cmd = pod.command(binary);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("PROXY_MODE", "dedicated")
        .env(
            "PROXY_WORKLOAD_INFO",
            format!("default/{0}/sa-{0}", pod.name()),
        )
        .env("FAKE_CA", "true")
        .env("LOCAL_XDS_PATH", config)
        // Empty: no istiod to connect to (the local file is the config).
        .env("XDS_ADDRESS", "")
        .env("PACKET_MARK", MARK.to_string())
        // As ztunnel's own dedicated-mode tests: no original source. In
        // dedicated mode nothing routes the app's replies to a spoofed
        // client address back into the pod's ztunnel (shunt's reply path
        // does that for its `IP_TRANSPARENT` delivery), so the connect
        // to the app would time out.
        .env("ENABLE_ORIG_SRC", "false")
        .env("NODE_NAME", pod.node().name())
        .env("CLUSTER_ID", "Kubernetes")
        // No DNS capture in the bench: its proxy would only sit idle.
        .env("ISTIO_META_DNS_CAPTURE", "false")
        .env("RUST_LOG", log_filter)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let mut child = Owned(
        cmd.spawn()
            .with_context(|| format!("starting ztunnel in {}", pod.name()))?,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = SocketAddr::new(pod.ip().into(), READY_PORT);
    // Bounded by the deadline.
    loop {
        if let Ok((200, _)) = http_get(pod, ready, "/healthz/ready") {
            return Ok(child);
        }
        let exited = child.0.try_wait().ok().flatten();
        if exited.is_some() || Instant::now() >= deadline {
            let text = std::fs::read_to_string(log_file).unwrap_or_default();
            // FAKE_CA is compiled in only with ztunnel's `testing` feature.
            let hint = if text.contains("requires --features testing") {
                " (build ztunnel with `--features testing` as well: FAKE_CA needs it)"
            } else {
                ""
            };
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            bail!(
                "ztunnel in {} {}{hint}; the end of its log:\n{}",
                pod.name(),
                match exited {
                    Some(status) => format!("exited ({status})"),
                    None => "was not ready within 30 s".to_string(),
                },
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops a ztunnel as its pod's shutdown would (SIGTERM, then a bounded
/// wait for its drain), so that it exits by itself: a profiler wrapped
/// around it (valgrind) writes its output only then. Dropping the
/// [`Owned`] kills whatever is left.
pub(super) fn stop(child: &mut std::process::Child) -> anyhow::Result<()> {
    let pid = libc::pid_t::try_from(child.id()).context("pid out of range")?;
    // SAFETY: kill(2) on the pid of a child we own and have not reaped.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        bail!("SIGTERM: {}", std::io::Error::last_os_error());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    // Bounded by the deadline.
    while Instant::now() < deadline {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("still running 20 s after SIGTERM")
}

/// The dedicated-mode capture (ztunnel's `scripts/ztunnel-redirect.sh`):
/// outgoing TCP that does not leave by `lo` and is not ztunnel's own goes
/// to its 15001.
fn capture(pod: &Pod) -> anyhow::Result<()> {
    let mark = format!("{MARK:#x}/0xfff");
    let out = pod
        .command("iptables")
        .args([
            "-w",
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "!",
            "-o",
            "lo",
            "-m",
            "mark",
            "!",
            "--mark",
            &mark,
            "-j",
            "REDIRECT",
            "--to-ports",
            "15001",
        ])
        .output()
        .context("running iptables")?;
    if !out.status.success() {
        bail!(
            "iptables in {}: {}",
            pod.name(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The connections the ztunnel of `pod` has opened as the source
/// (`istio_tcp_connections_opened_total{reporter="source"}`, summed).
pub(super) fn source_connections(pod: &Pod) -> anyhow::Result<u64> {
    let (status, body) = http_get(
        pod,
        SocketAddr::new(pod.ip().into(), STATS_PORT),
        "/metrics",
    )?;
    if status != 200 {
        bail!("ztunnel's /metrics in {} answered {status}", pod.name());
    }
    Ok(sum_metric(
        &body,
        "istio_tcp_connections_opened_total",
        "reporter=\"source\"",
    ))
}

/// The client's ztunnel must have opened a connection as the source for
/// every connection of the run (what its own metrics count).
pub(super) fn check(
    client: &Pod,
    before: Option<anyhow::Result<u64>>,
    report: &ClientReport,
    problems: &mut Vec<String>,
) -> ProxyCheck {
    let after = source_connections(client);
    let (Some(Ok(before)), Ok(after)) = (before, after) else {
        problems.push("cannot read the client ztunnel's metrics".into());
        return ProxyCheck::default();
    };
    let opened = after.saturating_sub(before);
    if opened < report.connections {
        problems.push(format!(
            "the client's ztunnel opened {opened} connections for {}: traffic went around it",
            report.connections
        ));
    }
    ProxyCheck {
        client_side: opened,
        ..ProxyCheck::default()
    }
}

/// Sums the samples of `name` whose labels contain `label`.
fn sum_metric(body: &str, name: &str, label: &str) -> u64 {
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next())
        .filter_map(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// A plain HTTP/1.0 GET from inside the pod (its own address: not
/// captured, the REDIRECT skips `lo`).
fn http_get(pod: &Pod, addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream = pod.connect_tcp(addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP status from {addr}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// `--ztunnel` given but the binary is not there: say so before building
/// anything.
pub(super) fn check_binary(binary: &Path) -> anyhow::Result<()> {
    let out = Command::new(binary)
        .arg("version")
        .output()
        .with_context(|| format!("running {} version", binary.display()))?;
    if !out.status.success() {
        bail!(
            "{} version failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::sum_metric;

    #[test]
    fn sums_only_the_named_metric_with_the_label() {
        let body = "# TYPE istio_tcp_connections_opened_total counter\n\
istio_tcp_connections_opened_total{reporter=\"source\",a=\"1\"} 3\n\
istio_tcp_connections_opened_total{reporter=\"destination\"} 7\n\
istio_tcp_connections_opened_total{reporter=\"source\",a=\"2\"} 4\n\
istio_tcp_connections_opened_total_other{reporter=\"source\"} 100\n";
        assert_eq!(
            sum_metric(
                body,
                "istio_tcp_connections_opened_total",
                "reporter=\"source\""
            ),
            7
        );
    }
}
