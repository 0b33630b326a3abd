//! `/metrics` against ztunnel's for the same xDS and the same probes
//! (`shunt_testbed::reference::metrics`): each case on a fresh shunt
//! agent, Istio's families (types, every series' labels and their
//! values) of the server's proxy, and of the client's for a case with
//! outbound rows, against those recorded from the real ztunnel; and, when
//! `SHUNT_ZTUNNEL_BIN` names the binary, ztunnel's live ones against the
//! record (skipped, with the reason printed, otherwise). The rows'
//! outcomes and baggage are checked as the reference tables check them
//! (in two cases the workloads are Deployments' pods with a locality).
//! The access lines are held the same way
//! (`shunt_testbed::reference::access_lines`: who talked to whom, by
//! ztunnel's names). `SHUNT_RECORD_METRICS=1` with the binary writes the
//! records anew.
//!
//! Run as root: `SHUNT_BIN=… [SHUNT_ZTUNNEL_BIN=…] cargo test -p
//! shunt-testbed --test reference_metrics`.

use std::collections::BTreeSet;

use shunt_testbed::reference::{
    access_lines,
    bed::{Bed, Peer, Run},
    cases::{Case, authz, dns, hostname, routing, sync, xds},
    compare,
    metrics::{Side, mismatches, normalise, record_path},
    probe::Outcome,
    ztunnel_peer::ztunnel_binary,
};
use shunt_testbed::require_root;

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");

/// Mutual-TLS streams from three identities and a plaintext connection,
/// allowed and denied by a policy; in the second, the workloads are pods
/// of Deployments with a locality (the labels name the owner, the
/// canonical service and revision, the region and zone); every routing
/// case (a client's connections through its own proxy, whose metrics are
/// compared too, `reporter="source"`: to service VIPs by locality, across
/// networks and their gateways, through waypoints — the destination named
/// as the waypoint — to a DNS-resolved ServiceEntry,
/// `istio_on_demand_dns_total`, and refused before any target, ztunnel's
/// early deny: no TCP series), and the first of them failing on a dropped
/// HBONE port; DNS questions to the client's proxy
/// (`istio_dns_requests_total`); and every other table's case (policies,
/// istiod's odd input, before the first sync, hostname CONNECTs: the
/// server's `destination_service` guessed as ztunnel's inbound guesses it).
fn cases() -> Vec<Case> {
    let names = [
        "ALLOW serviceAccounts [default/sleep]",
        "DENY serviceAccounts [default/sleep]",
    ];
    let mut cases: Vec<Case> = authz::cases()
        .into_iter()
        .filter(|c| names.contains(&c.name))
        .map(|mut c| {
            c.deployed = c.name.starts_with("DENY");
            c
        })
        .collect();
    let routing = routing::cases();
    // The first routing case's connection when the server's HBONE port is
    // dropped on the way: `response_flags="NETWORK_POLICY"` on the
    // client's proxy.
    let mut dropped = routing[0].clone();
    assert_eq!(
        dropped.name,
        "no load balancing: the endpoint on the other node"
    );
    dropped.name = "the server's HBONE port dropped on the way";
    dropped.hbone_port_dropped = true;
    for row in &mut dropped.outbound {
        row.expect = Outcome::Refused;
    }
    // Every other table's case but one: ztunnel's inbound names, of the
    // services a target backs, the first on the port in its hash map's
    // order, and the server backs two ServiceEntry hosts on one port there
    // (shunt takes the first by name).
    let others = authz::cases()
        .into_iter()
        .filter(|c| !names.contains(&c.name))
        .chain(xds::cases())
        .chain(sync::cases())
        .chain(hostname::cases())
        .filter(|c| c.name != "two ServiceEntry hosts as Services default/ext");
    cases.extend(
        routing
            .into_iter()
            .chain([dropped])
            .chain(dns::cases())
            .chain(others)
            .map(|mut c| {
                c.deployed = true;
                c
            }),
    );
    cases
}

fn read_record(case: &Case, side: Side) -> BTreeSet<String> {
    read_lines(&record_path(case.name, side))
}

fn read_lines(path: &std::path::Path) -> BTreeSet<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The sides a run compares, with their expositions.
fn sides(run: Run) -> Vec<(Side, Result<String, String>)> {
    let mut sides = vec![(Side::Server, run.metrics)];
    if let Some(client) = run.client_metrics {
        sides.push((Side::Client, client));
    }
    sides
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_istio_families_and_access_lines_are_ztunnels() {
    require_root().expect("kernel tests need root");
    let ztunnel = ztunnel_binary();
    if let Err(why) = &ztunnel {
        println!("the ztunnel side is skipped: {why}");
    }
    let record = std::env::var_os("SHUNT_RECORD_METRICS").is_some();
    let bed = Bed::new("ref-metrics", std::path::Path::new(TESTAPP)).expect("the bed");
    let cases = cases();
    assert_eq!(cases.len(), 37, "every case found");
    let mut failures = Vec::new();
    for case in cases {
        if let Ok(binary) = &ztunnel {
            let run = bed
                .run(Peer::Ztunnel, Some(binary), &case)
                .await
                .expect("run");
            // The rows' outcomes and the baggage as the tables expect.
            failures.extend(compare::mismatches(Peer::Ztunnel, &case, &run));
            let lines = access_lines::normalise(&run.logs).expect("ztunnel's access lines");
            let path = access_lines::record_path(case.name);
            if record {
                let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
                std::fs::write(&path, text).expect("writing the record");
            }
            if lines != read_lines(&path) {
                failures.push(format!(
                    "{}: ztunnel's access lines are no longer the record; SHUNT_RECORD_METRICS=1 writes it anew",
                    case.name
                ));
            }
            for (side, text) in sides(run) {
                let live = normalise(&text.expect("ztunnel's /metrics")).expect("parses");
                if record {
                    let text: String = live.iter().map(|l| format!("{l}\n")).collect();
                    std::fs::write(record_path(case.name, side), text).expect("writing the record");
                }
                if live != read_record(&case, side) {
                    failures.push(format!(
                        "{} ({side:?}): ztunnel's metrics are no longer the record; SHUNT_RECORD_METRICS=1 writes it anew",
                        case.name
                    ));
                }
            }
        }
        let run = bed.run(Peer::Shunt, None, &case).await.expect("run");
        failures.extend(compare::mismatches(Peer::Shunt, &case, &run));
        // The access lines name both ends as ztunnel's do. The metrics are
        // scraped before the log is read, and the agent writes a line
        // before it counts the close: a close the metrics show is in it.
        let lines = access_lines::normalise(&run.logs).expect("shunt's access lines");
        let recorded = read_lines(&access_lines::record_path(case.name));
        failures.extend(
            mismatches(&recorded, &lines)
                .into_iter()
                .map(|m| format!("{} (access lines): {m}", case.name)),
        );
        let got = sides(run);
        let expected_sides = if case.outbound.is_empty() && case.dns.is_empty() {
            1
        } else {
            2
        };
        assert_eq!(got.len(), expected_sides, "{}", case.name);
        for (side, text) in got {
            let got = normalise(&text.expect("shunt's /metrics")).expect("parses");
            failures.extend(
                mismatches(&read_record(&case, side), &got)
                    .into_iter()
                    .map(|m| format!("{} ({side:?}): {m}", case.name)),
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
