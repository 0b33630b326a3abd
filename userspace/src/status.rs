//! `shunt status`: what a running agent has enrolled, read from its admin API.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use crate::{
    api::{NodeStatus, PodState, PodStatus},
    cli::StatusArgs,
};

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(
        "no shunt agent answers on {addr} ({reason}); is `shunt agent` running in this network namespace? (start it, or pass --admin-addr)"
    )]
    NoAgent { addr: SocketAddr, reason: String },
    #[error("the agent on {addr} answered with something unexpected: {reason}")]
    BadAnswer { addr: SocketAddr, reason: String },
}

/// Fetches the status from the agent's admin API.
pub fn fetch(addr: SocketAddr) -> Result<NodeStatus, StatusError> {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .new_agent();
    let mut response = agent
        .get(format!("http://{addr}/status"))
        .call()
        .map_err(|e| match e {
            ureq::Error::StatusCode(code) => StatusError::BadAnswer {
                addr,
                reason: format!("HTTP {code}"),
            },
            other => StatusError::NoAgent {
                addr,
                reason: other.to_string(),
            },
        })?;
    response
        .body_mut()
        .read_json::<NodeStatus>()
        .map_err(|e| StatusError::BadAnswer {
            addr,
            reason: e.to_string(),
        })
}

pub fn run(args: &StatusArgs) -> Result<(), StatusError> {
    let status = fetch(args.admin_addr)?;
    if args.json {
        // Serialising our own derived type cannot fail.
        println!(
            "{}",
            serde_json::to_string_pretty(&status).unwrap_or_default()
        );
    } else {
        print!("{}", render_table(&status));
    }
    Ok(())
}

/// The human view: one line per pod of the node.
pub fn render_table(status: &NodeStatus) -> String {
    render_table_at(status, std::time::SystemTime::now())
}

/// [`render_table`] with certificate lifetimes counted from `now`.
pub fn render_table_at(status: &NodeStatus, now: std::time::SystemTime) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node {}  mode {}  trust domain {}  pods {}",
        status.node,
        status.mode,
        status.trust_domain,
        status.pods.len()
    );
    if let Some(p) = &status.proxy {
        let _ = writeln!(
            out,
            "proxy: hbone out {} in {}, passthrough {}, plaintext in {}, refused {}, failed {}, active {}, pooled {}, bytes out {} in {}",
            p.outbound_hbone,
            p.inbound_hbone,
            p.outbound_passthrough,
            p.inbound_plaintext,
            p.refused,
            p.failed,
            p.active,
            p.pooled_connections,
            p.bytes_out,
            p.bytes_in
        );
        let refusals: Vec<String> = p
            .refusals
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        if !refusals.is_empty() {
            let _ = writeln!(out, "refusals: {}", refusals.join(", "));
        }
    }
    if let Some(x) = &status.xds {
        let since = x
            .connected_since
            .map(|t| format!("connected for {}s", crate::metrics::unix_seconds(now) - t))
            .unwrap_or_else(|| "not connected".into());
        let _ = writeln!(
            out,
            "istiod {}: {since}, {}; workloads {} services {} policies {}{}{}",
            x.address,
            if x.synced { "synced" } else { "not synced" },
            x.workloads,
            x.services,
            x.policies,
            x.last_error
                .as_deref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default(),
            x.last_nack
                .as_deref()
                .map(|n| format!("; last NACK: {n}"))
                .unwrap_or_default(),
        );
    }
    const HEADER: [&str; 14] = [
        "POD",
        "IP",
        "STATE",
        "MODE",
        "HOOKS",
        "PKTS IN",
        "BYTES IN",
        "PKTS OUT",
        "BYTES OUT",
        "REDIRECTED OUT/IN",
        "FAIL-CLOSED OUT/IN",
        "SPLICED/FALLBACKS",
        "IDENTITY",
        "CERT EXPIRES",
    ];
    /// Columns right-aligned (numbers).
    const NUMERIC: std::ops::Range<usize> = 5..12;
    let mut rows: Vec<[String; 14]> = Vec::new();
    for pod in &status.pods {
        let enrolled = pod.state == PodState::Enrolled;
        let state = match &pod.state {
            PodState::Enrolled => "enrolled".to_string(),
            PodState::NotInMesh => "not in mesh".to_string(),
            PodState::Pending(reason) => format!("pending: {reason}"),
            PodState::Error(reason) => format!("error: {reason}"),
        };
        let mode = if enrolled || pod.counters.is_some() {
            status.mode.clone()
        } else {
            "-".to_string()
        };
        let hooks = if pod.hooks.is_empty() {
            "-".to_string()
        } else {
            let present = pod.hooks.iter().filter(|h| h.present).count();
            let missing: Vec<&str> = pod
                .hooks
                .iter()
                .filter(|h| !h.present)
                .map(|h| h.name.as_str())
                .collect();
            if missing.is_empty() {
                format!("{present}/{}", pod.hooks.len())
            } else {
                format!(
                    "{present}/{} MISSING: {}",
                    pod.hooks.len(),
                    missing.join(", ")
                )
            }
        };
        let counters: [String; 7] = match pod.counters {
            Some(c) => [
                c.packets_in.to_string(),
                c.bytes_in.to_string(),
                c.packets_out.to_string(),
                c.bytes_out.to_string(),
                format!("{}/{}", c.outbound_redirected, c.inbound_redirected),
                format!("{}/{}", c.outbound_fail_closed, c.inbound_fail_closed),
                format!("{}/{}", c.spliced_bytes, c.splice_fallbacks),
            ],
            None => std::array::from_fn(|_| "-".to_string()),
        };
        let ips = pod
            .ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let expires = match &pod.certificate {
            Some(cert) => lifetime(crate::api::seconds_until(cert.not_after, now)),
            None => "-".to_string(),
        };
        let [pi, bi, po, bo, redirected, fail_closed, spliced] = counters;
        rows.push([
            format!("{}/{}", pod.namespace, pod.name),
            ips,
            state,
            mode,
            hooks,
            pi,
            bi,
            po,
            bo,
            redirected,
            fail_closed,
            spliced,
            pod.identity.clone(),
            expires,
        ]);
    }
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut line = |cells: &[String]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if NUMERIC.contains(&i) {
                let _ = write!(text, "{cell:>w$}  ");
            } else {
                let _ = write!(text, "{cell:<w$}  ");
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    };
    line(&HEADER.map(String::from));
    for row in &rows {
        line(row);
    }
    // Which authorization policies guard each pod: below the table, whose
    // columns are per-pod numbers.
    let guarded: Vec<&PodStatus> = status
        .pods
        .iter()
        .filter(|p| !p.policies.is_empty())
        .collect();
    if !guarded.is_empty() {
        let _ = writeln!(out, "authorization policies:");
        for pod in guarded {
            let _ = writeln!(
                out,
                "  {}/{}: {}",
                pod.namespace,
                pod.name,
                pod.policies.join(", ")
            );
        }
    }
    // The kernel's authorization point: what it holds, and what it refused.
    if let Some(kernel) = &status.kernel_authz {
        let _ = writeln!(
            out,
            "kernel authorization: {} entries from {} policies, {} pairs left to the proxy{}",
            kernel.entries,
            kernel.policies.len(),
            kernel.left_to_proxy,
            kernel
                .error
                .as_ref()
                .map(|e| format!("; write error: {e}"))
                .unwrap_or_default()
        );
    }
    render_fast_path(&mut out, status);
    let refused: Vec<&PodStatus> = status
        .pods
        .iter()
        .filter(|p| !p.kernel_denials.is_empty())
        .collect();
    if !refused.is_empty() {
        let _ = writeln!(out, "connects refused in the kernel (EPERM):");
        for pod in refused {
            let counts: Vec<String> = pod
                .kernel_denials
                .iter()
                .map(|d| format!("{} {}", d.policy, d.connects))
                .collect();
            let _ = writeln!(
                out,
                "  {}/{}: {}",
                pod.namespace,
                pod.name,
                counts.join(", ")
            );
        }
    }
    out
}

/// The fast path (eBPF mode): flow 1's table and flow 2's switch, the
/// connections each carried, the events lost, and the pods that opted out.
fn render_fast_path(out: &mut String, status: &NodeStatus) {
    let Some(fast) = &status.fast_path else {
        return;
    };
    if !fast.enabled {
        let _ = writeln!(
            out,
            "fast path: off (--fast-path off): every connection of an enrolled pod goes through the proxy"
        );
        return;
    }
    let table = if fast.table_valid && fast.ranges > 0 {
        format!(
            "table valid, {} destinations, {} address ranges",
            fast.destinations, fast.ranges
        )
    } else if fast.table_valid {
        format!("table valid, {} destinations", fast.destinations)
    } else {
        "table NOT valid (every connect goes to the proxy)".to_string()
    };
    let mesh = match &fast.mesh_local_off_reason {
        None if fast.mesh_local_on => "on".to_string(),
        None => "off".to_string(),
        Some(reason) => format!("off ({reason})"),
    };
    let _ = writeln!(
        out,
        "fast path: passthrough {table}, {} connections direct; same-node mesh {mesh}, {} connections in the kernel; events lost {}",
        fast.passthrough_connections, fast.mesh_local_connections, fast.events_dropped
    );
    let opted_out: Vec<String> = status
        .pods
        .iter()
        .filter(|p| p.fast_path_opt_out)
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .collect();
    if !opted_out.is_empty() {
        let _ = writeln!(
            out,
            "fast path opted out (through the proxy): {}",
            opted_out.join(", ")
        );
    }
    let counted: Vec<String> = status
        .pods
        .iter()
        .filter_map(|p| {
            let c = p.fast_path?;
            Some(format!(
                "  {}/{}: {}, {}, {}",
                p.namespace, p.name, c.passthrough, c.mesh_outbound, c.mesh_inbound
            ))
        })
        .collect();
    if !counted.is_empty() {
        let _ = writeln!(
            out,
            "fast path connections per pod (direct, mesh out, mesh in):"
        );
        for line in counted {
            let _ = writeln!(out, "{line}");
        }
    }
}

/// `in 23h59m`, `in 4m10s`, or `EXPIRED 5m ago`.
fn lifetime(seconds: i64) -> String {
    let span = |s: u64| {
        let (d, h, m, sec) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
        if d > 0 {
            format!("{d}d{h}h")
        } else if h > 0 {
            format!("{h}h{m}m")
        } else {
            format!("{m}m{sec}s")
        }
    };
    if seconds >= 0 {
        format!("in {}", span(seconds as u64))
    } else {
        format!("EXPIRED {} ago", span(seconds.unsigned_abs()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::api::{CertificateStatus, Counters, KernelAuthzStatus, KernelDenial};

    #[test]
    fn table_shows_every_column_per_pod() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let status = NodeStatus {
            node: "node-a".into(),
            mode: "ebpf".into(),
            trust_domain: "cluster.local".into(),
            synced: true,
            proxy: None,
            xds: None,
            kernel_authz: Some(KernelAuthzStatus {
                policies: vec!["default/allow-client".into()],
                entries: 2,
                left_to_proxy: 0,
                error: None,
            }),
            verify_passes: 3,
            fast_path: Some(crate::api::FastPathStatus {
                enabled: true,
                table_valid: true,
                destinations: 7,
                ranges: 0,
                mesh_local_on: false,
                mesh_local_off_reason: Some("--fast-path off".into()),
                passthrough_connections: 5,
                mesh_local_connections: 0,
                events_dropped: 0,
            }),
            pods: vec![
                PodStatus {
                    namespace: "default".into(),
                    name: "client".into(),
                    ips: vec!["198.18.1.2".parse().unwrap()],
                    service_account: "sleep".into(),
                    identity: "spiffe://cluster.local/ns/default/sa/sleep".into(),
                    dataplane_mode: "ambient".into(),
                    state: PodState::Enrolled,
                    netns: None,
                    netns_cookie: Some(1),
                    hooks: vec![
                        crate::redirect::Hook {
                            name: "tc ingress".into(),
                            attachment: String::new(),
                            present: true,
                        },
                        crate::redirect::Hook {
                            name: "tc egress".into(),
                            attachment: String::new(),
                            present: false,
                        },
                    ],
                    counters: Some(Counters {
                        packets_in: 12,
                        outbound_redirected: 3,
                        inbound_fail_closed: 1,
                        ..Default::default()
                    }),
                    certificate: Some(CertificateStatus {
                        not_before: 0,
                        not_after: 1_000_000 + 2 * 3600 + 60,
                    }),
                    policies: vec!["default/allow-client".into()],
                    kernel_denials: vec![KernelDenial {
                        policy: "default/allow-client".into(),
                        connects: 4,
                    }],
                    fast_path_opt_out: false,
                    fast_path: Some(crate::api::PodFastPath {
                        passthrough: 5,
                        mesh_outbound: 2,
                        mesh_inbound: 0,
                    }),
                },
                PodStatus {
                    namespace: "default".into(),
                    name: "outsider".into(),
                    ips: vec!["198.18.1.3".parse().unwrap()],
                    service_account: "default".into(),
                    identity: "spiffe://cluster.local/ns/default/sa/default".into(),
                    dataplane_mode: "none".into(),
                    state: PodState::NotInMesh,
                    netns: None,
                    netns_cookie: None,
                    hooks: vec![],
                    counters: None,
                    certificate: None,
                    policies: vec![],
                    kernel_denials: vec![],
                    fast_path_opt_out: true,
                    fast_path: None,
                },
            ],
        };
        let table = render_table_at(&status, now);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[1].starts_with("POD "), "{table}");
        for column in [
            "MODE",
            "HOOKS",
            "IDENTITY",
            "CERT EXPIRES",
            "REDIRECTED OUT/IN",
        ] {
            assert!(lines[1].contains(column), "{table}");
        }
        let client = lines[2];
        for cell in [
            "default/client",
            "198.18.1.2",
            "enrolled",
            " ebpf ",
            "1/2 MISSING: tc egress",
            " 12 ",
            "3/0",
            "0/1",
            "spiffe://cluster.local/ns/default/sa/sleep",
            "in 2h1m",
        ] {
            assert!(client.contains(cell), "{cell:?} not in {client:?}");
        }
        let outsider = lines[3];
        assert!(outsider.contains("not in mesh"), "{outsider}");
        assert!(outsider.trim_end().ends_with('-'), "{outsider}");
        assert_eq!(lines[4], "authorization policies:", "{table}");
        assert_eq!(
            lines[5], "  default/client: default/allow-client",
            "{table}"
        );
        assert_eq!(
            lines[6], "kernel authorization: 2 entries from 1 policies, 0 pairs left to the proxy",
            "{table}"
        );
        assert_eq!(
            lines[7],
            "fast path: passthrough table valid, 7 destinations, 5 connections direct; same-node mesh off (--fast-path off), 0 connections in the kernel; events lost 0",
            "{table}"
        );
        assert_eq!(
            lines[8], "fast path opted out (through the proxy): default/outsider",
            "{table}"
        );
        assert_eq!(
            lines[9],
            "fast path connections per pod (direct, mesh out, mesh in):"
        );
        assert_eq!(lines[10], "  default/client: 5, 2, 0", "{table}");
        assert_eq!(lines[11], "connects refused in the kernel (EPERM):");
        assert_eq!(
            lines[12], "  default/client: default/allow-client 4",
            "{table}"
        );
        assert_eq!(
            lines.len(),
            13,
            "only pods with policies or refusals are listed: {table}"
        );
        assert_eq!(lifetime(-300), "EXPIRED 5m0s ago");
        assert_eq!(lifetime(90_000), "in 1d1h");
    }
}
