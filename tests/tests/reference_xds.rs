//! The address-feed table (`shunt_testbed::reference::cases::xds`: hostNetwork pods, an undecodable resource, LEGACY_ISTIO_MTLS, a WorkloadEntry named like a pod, two ServiceEntry hosts) the sync table (`cases::sync`: inbound before the first update) the routing table (`cases::routing`: STRICT and FAILOVER by node, an endpoint on another network without and behind an east-west gateway, a waypoint behind one, another network's pod at the server's address, a weighted set of waypoints) and DNS by network (`cases::dns`) on
//! both peers: every case on a fresh shunt agent (always) and on a fresh
//! real ztunnel (when `SHUNT_ZTUNNEL_BIN` names the binary; skipped, with
//! the reason printed, otherwise), fed the same resources by the in-test
//! istiod; each row's outcome must be the table's (ztunnel's).
//!
//! And double HBONE across the two implementations, both ways (with the
//! real ztunnel only).
//!
//! Run as root: `SHUNT_BIN=… SHUNT_ZTUNNEL_BIN=/path/to/ztunnel cargo test
//! -p shunt-testbed --test reference_xds` (`REFERENCE_LOGS=1` prints
//! the peer's log of a case that differs).

use shunt_testbed::{
    reference::{
        bed::{Bed, Peer},
        cases::{dns, routing, sync, xds},
        compare::{check_table, mismatches},
        ztunnel_peer::ztunnel_binary,
    },
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");

async fn check(peer: Peer, test_name: &str) {
    require_root().expect("kernel tests need root");
    let failures = check_table(
        peer,
        test_name,
        std::path::Path::new(TESTAPP),
        &[xds::cases(), sync::cases(), routing::cases(), dns::cases()].concat(),
    )
    .await
    .expect("the comparison bed");
    if let Some(failures) = failures {
        assert!(
            failures.is_empty(),
            "{} rows differ from ztunnel's outcomes:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_address_table_holds_on_the_real_ztunnel() {
    check(Peer::Ztunnel, "ref-xds-zt").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_address_table_holds_on_shunt() {
    check(Peer::Shunt, "ref-xds-sh").await;
}

/// Double HBONE across implementations, through the bed's east-west
/// gateway: shunt's client to the real ztunnel's server (ztunnel
/// terminates shunt's inner HBONE) and ztunnel's client to shunt's server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_hbone_interoperates_with_the_real_ztunnel_both_ways() {
    require_root().expect("kernel tests need root");
    let ztunnel = match ztunnel_binary() {
        Ok(path) => path,
        Err(why) => {
            println!("skipping: {why}");
            return;
        }
    };
    let bed = Bed::new("ref-dh-mix", std::path::Path::new(TESTAPP)).expect("the bed");
    let case = routing::through_known_gateway();
    let mut failures = Vec::new();
    for (server, client) in [(Peer::Ztunnel, Peer::Shunt), (Peer::Shunt, Peer::Ztunnel)] {
        let run = bed
            .run_pair(server, client, Some(&ztunnel), &case)
            .await
            .expect("the run");
        let label = format!("{client:?} client, {server:?} server");
        failures.extend(
            mismatches(client, &case, &run)
                .into_iter()
                .map(|m| format!("{label}: {m}")),
        );
        if std::env::var_os("REFERENCE_LOGS").is_some() {
            println!("--- {label}:\n{}", run.logs);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
