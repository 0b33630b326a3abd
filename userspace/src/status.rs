//! `shunt status`: what a running agent has enrolled, read from its admin API.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use crate::{
    admin::{NodeStatus, PodState},
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
    }
    let header = [
        "POD",
        "IP",
        "STATE",
        "HOOKS",
        "PKTS IN",
        "BYTES IN",
        "PKTS OUT",
        "BYTES OUT",
        "IDENTITY",
    ];
    let mut rows: Vec<[String; 9]> = Vec::new();
    for pod in &status.pods {
        let state = match &pod.state {
            PodState::Enrolled => "enrolled".to_string(),
            PodState::NotInMesh => "not in mesh".to_string(),
            PodState::Pending(reason) => format!("pending: {reason}"),
            PodState::Error(reason) => format!("error: {reason}"),
        };
        let hooks = if pod.hooks.is_empty() {
            "-".to_string()
        } else {
            pod.hooks
                .iter()
                .map(|h| {
                    if h.present {
                        h.name.clone()
                    } else {
                        format!("{} (MISSING)", h.name)
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (pi, bi, po, bo) = match pod.counters {
            Some(c) => (
                c.packets_in.to_string(),
                c.bytes_in.to_string(),
                c.packets_out.to_string(),
                c.bytes_out.to_string(),
            ),
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        let ips = pod
            .ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        rows.push([
            format!("{}/{}", pod.namespace, pod.name),
            ips,
            state,
            hooks,
            pi,
            bi,
            po,
            bo,
            pod.identity.clone(),
        ]);
    }
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut line = |cells: &[String]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // Counters right-aligned, text left-aligned.
            if (4..8).contains(&i) {
                let _ = write!(text, "{cell:>w$}  ");
            } else {
                let _ = write!(text, "{cell:<w$}  ");
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    };
    line(&header.map(String::from));
    for row in &rows {
        line(row);
    }
    out
}
