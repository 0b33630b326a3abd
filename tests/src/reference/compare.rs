//! Runs a table on one peer and lists the rows that differ from it.

use super::{
    bed::{Bed, Peer, Run},
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
    out
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
