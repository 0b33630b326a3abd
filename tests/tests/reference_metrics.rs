//! `/metrics` against ztunnel's for the same xDS and the same probes
//! (`shunt_testbed::reference::metrics`): each case on a fresh shunt
//! agent, the server proxy's Istio families (types, every series' labels
//! and their values) against those recorded from the real ztunnel; and,
//! when `SHUNT_ZTUNNEL_BIN` names the binary, ztunnel's live ones against
//! the record (skipped, with the reason printed, otherwise).
//! `SHUNT_RECORD_METRICS=1` with the binary writes the records anew.
//!
//! Run as root: `SHUNT_BIN=… [SHUNT_ZTUNNEL_BIN=…] cargo test -p
//! shunt-testbed --test reference_metrics`.

use std::collections::BTreeSet;

use shunt_testbed::{
    reference::{
        bed::{Bed, Peer},
        cases::{Case, authz},
        metrics::{mismatches, normalise, record_path},
        ztunnel_peer::ztunnel_binary,
    },
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");

/// Mutual-TLS streams from three identities and a plaintext connection,
/// allowed and denied by a policy; in the second, the workloads are pods
/// of Deployments with a locality (the labels name the owner, the
/// canonical service and revision, the region and zone).
fn cases() -> Vec<Case> {
    let names = [
        "ALLOW serviceAccounts [default/sleep]",
        "DENY serviceAccounts [default/sleep]",
    ];
    authz::cases()
        .into_iter()
        .filter(|c| names.contains(&c.name))
        .map(|mut c| {
            c.deployed = c.name.starts_with("DENY");
            c
        })
        .collect()
}

fn read_record(case: &Case) -> BTreeSet<String> {
    let path = record_path(case.name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_istio_families_are_ztunnels() {
    require_root().expect("kernel tests need root");
    let ztunnel = ztunnel_binary();
    if let Err(why) = &ztunnel {
        println!("the ztunnel side is skipped: {why}");
    }
    let record = std::env::var_os("SHUNT_RECORD_METRICS").is_some();
    let bed = Bed::new("ref-metrics", std::path::Path::new(TESTAPP)).expect("the bed");
    let cases = cases();
    assert_eq!(cases.len(), 2, "both cases found");
    let mut failures = Vec::new();
    for case in cases {
        if let Ok(binary) = &ztunnel {
            let run = bed
                .run(Peer::Ztunnel, Some(binary), &case)
                .await
                .expect("run");
            let live = normalise(&run.metrics.expect("ztunnel's /metrics")).expect("parses");
            if record {
                let text: String = live.iter().map(|l| format!("{l}\n")).collect();
                std::fs::write(record_path(case.name), text).expect("writing the record");
            }
            if live != read_record(&case) {
                failures.push(format!(
                    "{}: ztunnel's metrics are no longer the record; SHUNT_RECORD_METRICS=1 writes it anew",
                    case.name
                ));
            }
        }
        let recorded = read_record(&case);
        let run = bed.run(Peer::Shunt, None, &case).await.expect("run");
        let got = normalise(&run.metrics.expect("shunt's /metrics")).expect("parses");
        failures.extend(
            mismatches(&recorded, &got)
                .into_iter()
                .map(|m| format!("{}: {m}", case.name)),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
