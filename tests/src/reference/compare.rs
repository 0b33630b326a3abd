//! Runs a table on one peer and lists the rows that differ from it.

use super::{
    bed::{Bed, CLIENT_IP, CLIENT_SA, Peer, Run},
    cases::{Case, XdsAnswer},
    istiod::Answer,
    ztunnel_peer::ztunnel_binary,
};
use crate::Result;

/// Whether `answer` is what `expected` says.
fn answer_matches(expected: XdsAnswer, answer: &Answer) -> bool {
    match (expected, &answer.error) {
        (XdsAnswer::Ack, None) => true,
        (XdsAnswer::NackNaming(name), Some(message)) => message.contains(name),
        _ => false,
    }
}

/// The lines of `run` that differ from `case`, one per row.
pub fn mismatches(peer: Peer, case: &Case, run: &Run) -> Vec<String> {
    let mut out = Vec::new();
    if !answer_matches(case.addresses_answer, &run.addresses) {
        out.push(format!(
            "{peer:?} | {} | addresses: expected {:?}, got {:?}",
            case.name, case.addresses_answer, run.addresses.error
        ));
    }
    if let Some(error) = run.then_addresses.as_ref().and_then(|a| a.error.as_ref()) {
        out.push(format!(
            "{peer:?} | {} | the second address response NACKed: {error}",
            case.name
        ));
    }
    if let Some(error) = &run.authorizations.error {
        out.push(format!(
            "{peer:?} | {} | authorizations NACKed: {error}",
            case.name
        ));
    }
    for (row, seen) in &run.observed {
        if seen.outcome != row.expect {
            out.push(format!(
                "{peer:?} | {} | {} -> {} | expected {:?}, got {:?} ({})",
                case.name,
                row.caller,
                target(row),
                row.expect,
                seen.outcome,
                seen.detail
            ));
        }
        // ztunnel answers a CONNECT with the destination workload's
        // baggage (its ENABLE_RESPONSE_BAGGAGE, on by default).
        let mesh = matches!(row.caller, super::probe::Caller::Mesh { .. });
        if mesh
            && seen.outcome == super::probe::Outcome::Allowed
            && seen.answer_baggage.as_deref() != Some(server_baggage(case))
        {
            out.push(format!(
                "{peer:?} | {} | {} -> {} | the 200's baggage {:?}, expected {:?}",
                case.name,
                row.caller,
                target(row),
                seen.answer_baggage,
                server_baggage(case)
            ));
        }
    }
    for (row, seen) in &run.before_sync {
        if seen.outcome != row.expect {
            out.push(format!(
                "{peer:?} | {} | before the first sync: {} -> {} | expected {:?}, got {:?} ({})",
                case.name,
                row.caller,
                target(row),
                row.expect,
                seen.outcome,
                seen.detail
            ));
        }
    }
    for (row, answer) in &run.dns {
        let expected: Vec<std::net::Ipv4Addr> = row.expect.iter().map(|a| (*a).into()).collect();
        let got = answer.as_ref().map(|a| a.as_slice()).unwrap_or_default();
        if got != expected.as_slice() {
            out.push(format!(
                "{peer:?} | {} | DNS {} | expected {expected:?}, got {answer:?}",
                case.name, row.name
            ));
        }
    }
    for (row, seen) in &run.outbound {
        if seen.outcome != row.expect {
            out.push(format!(
                "{peer:?} | {} | client -> {:?}:{} | expected {:?}, got {:?} ({})",
                case.name, row.dst, row.port, row.expect, seen.outcome, seen.detail
            ));
        }
    }
    out.extend(gateway_mismatches(peer, case, run));
    out
}

/// The server workload's `baggage`, as ztunnel writes it: istiod sends
/// the server as a pod of `default` whose canonical name is its name, or
/// (`Case::deployed`) as a pod of Deployment `httpbin` with a locality.
fn server_baggage(case: &Case) -> &'static str {
    if case.deployed {
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=httpbin,service.name=httpbin,service.version=v2,cloud.region=region-a,cloud.availability_zone=zone-a2"
    } else {
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.pod.name=server,service.name=server,service.version=latest"
    }
}

/// The client workload's, likewise (Deployment `sleep`).
fn client_baggage(case: &Case) -> &'static str {
    if case.deployed {
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=sleep,service.name=sleep,service.version=v1,cloud.region=region-a,cloud.availability_zone=zone-a1"
    } else {
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.pod.name=client,service.name=client,service.version=latest"
    }
}

/// What the east-west gateway got against what the case expects: one
/// outer CONNECT per allowed outbound row, for the case's authority, from
/// the client's identity, forwarded.
fn gateway_mismatches(peer: Peer, case: &Case, run: &Run) -> Vec<String> {
    let client = format!("spiffe://cluster.local/ns/default/sa/{CLIENT_SA}");
    let expected = match case.gateway_authority {
        None => 0,
        Some(_) => case
            .outbound
            .iter()
            .filter(|r| r.expect == super::probe::Outcome::Allowed)
            .count(),
    };
    let mut out = Vec::new();
    if run.through_gateway.len() != expected {
        out.push(format!(
            "{peer:?} | {} | the gateway got {} CONNECTs, expected {expected}: {:?}",
            case.name,
            run.through_gateway.len(),
            run.through_gateway
        ));
    }
    for seen in &run.through_gateway {
        let right = Some(seen.authority.as_str()) == case.gateway_authority
            && seen.peer_identity.as_deref() == Some(client.as_str())
            && seen.forwarded;
        if !right {
            out.push(format!(
                "{peer:?} | {} | the gateway got {seen:?}, expected a forwarded CONNECT {:?} from {client}",
                case.name, case.gateway_authority
            ));
        }
        if let Some(wrong) = connect_headers_differ(seen, case.forwarded_host, client_baggage(case))
        {
            out.push(format!("{peer:?} | {} | {wrong}", case.name));
        }
    }
    out
}

/// How the outer CONNECT's headers differ from ztunnel's, if they do:
/// `baggage` naming the client workload (`baggage`), `forwarded` its
/// address and port quoted and the service's host (`host`, else the
/// authority's), `traceparent` version 00, not sampled.
fn connect_headers_differ(
    seen: &crate::waypoint::Received,
    host: Option<&str>,
    baggage: &str,
) -> Option<String> {
    let host = host.unwrap_or_else(|| seen.authority.rsplit_once(':').map_or("", |(h, _)| h));
    let forwarded = seen.header("forwarded").unwrap_or_default();
    let forwarded_right = forwarded
        .strip_prefix(&format!("for=\"{CLIENT_IP}:"))
        .and_then(|rest| rest.strip_suffix(&format!("\";host={host}")))
        .is_some_and(|port| port.parse::<u16>().is_ok());
    let traceparent = seen.header("traceparent").unwrap_or_default();
    let trace_right =
        traceparent.len() == 55 && traceparent.starts_with("00-") && traceparent.ends_with("-00");
    if seen.header("baggage") == Some(baggage) && forwarded_right && trace_right {
        return None;
    }
    Some(format!(
        "the gateway's CONNECT headers are not ztunnel's: {:?}",
        seen.headers
    ))
}

/// Runs every case of `cases` on a fresh `peer` in a bed named
/// `test_name`, printing each outcome; returns the mismatches. `Ok(None)`
/// when the peer is ztunnel and `SHUNT_ZTUNNEL_BIN` does not name it
/// (the reason printed). With `REFERENCE_LOGS` set, a mismatching case
/// prints the peer's log.
pub async fn check_table(
    peer: Peer,
    test_name: &str,
    testapp: &std::path::Path,
    cases: &[Case],
) -> Result<Option<Vec<String>>> {
    let ztunnel = match peer {
        Peer::Shunt => None,
        Peer::Ztunnel => match ztunnel_binary() {
            Ok(path) => Some(path),
            Err(why) => {
                println!("skipping the ztunnel side: {why}");
                return Ok(None);
            }
        },
    };
    let bed = Bed::new(test_name, testapp)?;
    let mut failures = Vec::new();
    for case in cases {
        let run = bed.run(peer, ztunnel.as_deref(), case).await?;
        println!(
            "{peer:?} | {} | addresses {}{} | authorizations {} | {}",
            case.name,
            describe(&run.addresses),
            run.then_addresses
                .as_ref()
                .map(|a| format!(", then {}", describe(a)))
                .unwrap_or_default(),
            describe(&run.authorizations),
            if run.ready { "ready" } else { "not ready" }
        );
        for (row, seen) in &run.observed {
            println!(
                "{peer:?} | {} | {} -> {} | {:?} ({})",
                case.name,
                row.caller,
                target(row),
                seen.outcome,
                seen.detail
            );
        }
        for (row, seen) in &run.before_sync {
            println!(
                "{peer:?} | {} | before the first sync: {} -> {} | {:?} ({})",
                case.name,
                row.caller,
                target(row),
                seen.outcome,
                seen.detail
            );
        }
        for (row, answer) in &run.dns {
            println!("{peer:?} | {} | DNS {} | {answer:?}", case.name, row.name);
        }
        for (row, seen) in &run.outbound {
            println!(
                "{peer:?} | {} | client -> {:?}:{} | {:?} ({})",
                case.name, row.dst, row.port, seen.outcome, seen.detail
            );
        }
        for seen in &run.through_gateway {
            println!(
                "{peer:?} | {} | the gateway got CONNECT {} from {:?} (forwarded: {}; headers {:?})",
                case.name, seen.authority, seen.peer_identity, seen.forwarded, seen.headers
            );
        }
        let wrong = mismatches(peer, case, &run);
        if !wrong.is_empty() && std::env::var_os("REFERENCE_LOGS").is_some() {
            println!("--- {peer:?} log for {}:\n{}", case.name, run.logs);
        }
        failures.extend(wrong);
    }
    Ok(Some(failures))
}

fn describe(answer: &Answer) -> String {
    match &answer.error {
        None => "ACK".into(),
        Some(message) => format!("NACK ({message})"),
    }
}

/// Where a row connects, as printed: `:port` or `host:port`.
fn target(row: &super::cases::Row) -> String {
    format!("{}:{}", row.host.unwrap_or_default(), row.port)
}
