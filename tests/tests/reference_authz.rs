//! The authorization table (`shunt_testbed::reference::cases::authz`) on
//! both peers: every case on a fresh shunt agent (always) and on a fresh
//! real ztunnel (when `SHUNT_ZTUNNEL_BIN` names the binary; skipped, with
//! the reason printed, otherwise), fed the same resources by the in-test
//! istiod; each row's outcome must be the table's (ztunnel's).
//!
//! Run as root: `SHUNT_BIN=… SHUNT_ZTUNNEL_BIN=/path/to/ztunnel cargo test
//! -p shunt-testbed --test reference_authz`.

use shunt_testbed::{
    reference::{
        bed::{Bed, Peer, Run},
        cases::{Case, authz},
        ztunnel_peer::ztunnel_binary,
    },
    require_root,
};

/// The rows of `run` that differ from the table, one line each.
fn mismatches(peer: Peer, case: &Case, run: &Run) -> Vec<String> {
    let mut out = Vec::new();
    for answer in [&run.addresses, &run.authorizations] {
        if let Some(error) = &answer.error {
            out.push(format!(
                "{peer:?} | {} | NACKed {}: {error}",
                case.name, answer.type_url
            ));
        }
    }
    for (row, seen) in &run.observed {
        if seen.outcome != row.expect {
            out.push(format!(
                "{peer:?} | {} | {} -> :{} | expected {:?}, got {:?} ({})",
                case.name, row.caller, row.port, row.expect, seen.outcome, seen.detail
            ));
        }
    }
    out
}

async fn check(peer: Peer, test_name: &str) {
    require_root().expect("kernel tests need root");
    let ztunnel = match peer {
        Peer::Shunt => None,
        Peer::Ztunnel => match ztunnel_binary() {
            Ok(path) => Some(path),
            Err(why) => {
                println!("skipping the ztunnel side: {why}");
                return;
            }
        },
    };
    let bed = Bed::new(test_name).expect("bed");
    let mut failures = Vec::new();
    for case in authz::cases() {
        let run = bed
            .run(peer, ztunnel.as_deref(), &case)
            .await
            .unwrap_or_else(|e| panic!("{peer:?} | {}: {e}", case.name));
        for (row, seen) in &run.observed {
            println!(
                "{peer:?} | {} | {} -> :{} | {:?} ({})",
                case.name, row.caller, row.port, seen.outcome, seen.detail
            );
        }
        let wrong = mismatches(peer, &case, &run);
        if !wrong.is_empty() && std::env::var_os("REFERENCE_LOGS").is_some() {
            println!("--- {peer:?} log for {}:\n{}", case.name, run.logs);
        }
        failures.extend(wrong);
    }
    assert!(
        failures.is_empty(),
        "{} rows differ from ztunnel's outcomes:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authorization_table_holds_on_the_real_ztunnel() {
    check(Peer::Ztunnel, "ref-authz-zt").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authorization_table_holds_on_shunt() {
    check(Peer::Shunt, "ref-authz-sh").await;
}
