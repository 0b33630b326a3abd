//! `/config_dump` against ztunnel's for the same xDS
//! (`shunt_testbed::reference::config_dump`): each case on a fresh shunt
//! agent, its dump against the one recorded from the real ztunnel; and,
//! when `SHUNT_ZTUNNEL_BIN` names the binary, ztunnel's live dump against
//! the record (skipped, with the reason printed, otherwise).
//! `SHUNT_RECORD_DUMPS=1` with the binary writes the records anew.
//!
//! Run as root: `SHUNT_BIN=… [SHUNT_ZTUNNEL_BIN=…] cargo test -p
//! shunt-testbed --test reference_config_dump`.

use shunt_testbed::{
    reference::{
        bed::{Bed, Peer},
        cases::{Case, authz, routing, xds},
        config_dump::{mismatches, normalise, record_path},
        ztunnel_peer::ztunnel_binary,
    },
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");

/// A workload with a network gateway and a service with SANs; a weighted
/// set of waypoints; a ServiceEntry's CIDR; policies; hostNetwork pods.
fn cases() -> Vec<Case> {
    let by_name = |cases: Vec<Case>, name: &str| {
        cases
            .into_iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no case {name:?}"))
    };
    vec![
        routing::through_known_gateway(),
        by_name(
            routing::cases(),
            "a weighted set of waypoints, all on the canary",
        ),
        by_name(
            routing::cases(),
            "an address in a ServiceEntry's CIDR, bound to a waypoint",
        ),
        by_name(authz::cases(), "ALLOW serviceAccounts [default/sleep]"),
        by_name(xds::cases(), "two hostNetwork pods on the node's IP"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dump_carries_what_ztunnels_does() {
    require_root().expect("kernel tests need root");
    let ztunnel = ztunnel_binary();
    if let Err(why) = &ztunnel {
        println!("the ztunnel side is skipped: {why}");
    }
    let record = std::env::var_os("SHUNT_RECORD_DUMPS").is_some();
    let bed = Bed::new("ref-dump", std::path::Path::new(TESTAPP)).expect("the bed");
    let mut failures = Vec::new();
    for case in cases() {
        let path = record_path(case.name);
        if let Ok(binary) = &ztunnel {
            let run = bed
                .run(Peer::Ztunnel, Some(binary), &case)
                .await
                .expect("run");
            let live = normalise(&run.config_dump.expect("ztunnel's /config_dump"));
            if record {
                let text = serde_json::to_string_pretty(&live).expect("JSON") + "\n";
                std::fs::write(&path, text).expect("writing the record");
            }
            let recorded: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).expect("the record"))
                    .expect("the record is JSON");
            if live != recorded {
                failures.push(format!(
                    "{}: ztunnel's dump is no longer the record ({}); SHUNT_RECORD_DUMPS=1 writes it anew",
                    case.name,
                    path.display()
                ));
            }
        }
        let recorded: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .expect("the record is JSON");
        let run = bed.run(Peer::Shunt, None, &case).await.expect("run");
        let got = normalise(&run.config_dump.expect("shunt's /config_dump"));
        failures.extend(
            mismatches(&recorded, &got)
                .into_iter()
                .map(|m| format!("{}: {m}", case.name)),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
