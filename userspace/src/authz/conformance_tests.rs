//! The conformance table ([`super::conformance::CASES`]) through shunt's
//! path for istiod's resources: the xDS translation, then the engine.

use std::{collections::BTreeMap, net::SocketAddr};

use super::conformance::{CASES, Case, DST_IP, DST_NAMESPACE};
use crate::{
    authz::{Connection, Destination, PolicySet},
    xds::authorization::translate,
};

/// Every probe of `case`, as `(probe, allowed)`; an untranslatable row is
/// a failure naming its field.
fn run(case: &Case) -> Result<Vec<bool>, String> {
    let mut policies = Vec::new();
    for resource in case.resources() {
        let name = format!("{}/{}", resource.namespace, resource.name);
        policies.push(translate(resource).map_err(|e| e.in_resource(&name).to_string())?);
    }
    let set = PolicySet::new(policies);
    let labels = BTreeMap::new();
    let bound = case.bound();
    let destination = Destination {
        namespace: DST_NAMESPACE,
        labels: &labels,
        authorization_policies: &bound,
    };
    case.probes
        .iter()
        .map(|probe| {
            let connection = Connection {
                src_ip: probe
                    .src_ip
                    .parse()
                    .map_err(|e| format!("{probe:?}: {e}"))?,
                src_identity: probe.identity,
                dst: SocketAddr::new(
                    DST_IP.parse().map_err(|e| format!("{DST_IP}: {e}"))?,
                    probe.port,
                ),
            };
            Ok(set.check(&connection, destination).is_allowed())
        })
        .collect()
}

#[test]
fn shunt_agrees_with_ztunnels_table() {
    let mut failures = Vec::new();
    let mut probes = 0;
    for case in CASES {
        match run(case) {
            Ok(verdicts) => {
                for (probe, allowed) in case.probes.iter().zip(verdicts) {
                    probes += 1;
                    if allowed != probe.allowed {
                        failures.push(format!(
                            "{}: {probe:?} was {}",
                            case.name,
                            if allowed { "allowed" } else { "denied" }
                        ));
                    }
                }
            }
            Err(e) => failures.push(format!("{}: {e}", case.name)),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(probes > 80, "the table holds {probes} probes");
}
