//! The workloads file (`--workloads FILE`): YAML from disk.

use std::path::Path;

use proptest::prelude::*;

use super::{edits, mutate};
use crate::control::local::{WorkloadsFileError, parse};

const SEED: &str = r#"trustDomain: cluster.local
workloads:
  - name: client
    namespace: default
    serviceAccount: sleep
    ips: ["198.18.1.2"]
    node: node-a
    netns: /var/run/netns/client
    dataplaneMode: ambient
    splice: false
  - name: server
    namespace: default
    serviceAccount: httpbin
    ips: ["198.18.2.3", "fd00::3"]
    node: node-b
    dataplaneMode: ambient
  - name: waypoint-0
    namespace: default
    serviceAccount: waypoint
    ips: ["198.18.2.4"]
    node: node-b
    labels: {gateway.istio.io/managed: istio.io-mesh-controller}
services:
  - name: web
    namespace: default
    clusterIPs: ["198.19.100.1"]
    ports:
      - port: 80
        targetPort: 8080
    endpoints: [server, 198.18.9.9]
    labels: {istio.io/use-waypoint: waypoint}
  - name: waypoint
    namespace: default
    clusterIPs: ["198.19.100.2"]
    ports: [{port: 15008}]
    endpoints: [waypoint-0]
namespaces:
  - name: default
    labels: {istio.io/use-waypoint: waypoint, istio.io/use-waypoint-namespace: default}
waypoints:
  - name: waypoint
    namespace: default
    for: all
authorizationPolicies:
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata:
      name: allow-sleep
      namespace: default
    spec:
      action: ALLOW
      rules:
        - from:
            - source:
                principals: ["cluster.local/ns/default/sa/sleep"]
                ipBlocks: ["198.18.0.0/16"]
          to:
            - operation:
                ports: ["8080"]
"#;

const PATH: &str = "/etc/shunt/workloads.yaml";

#[test]
fn the_seed_is_valid() {
    let parsed = parse(Path::new(PATH), SEED).expect("the seed parses");
    assert_eq!(parsed.workloads.len(), 3);
    let bound = |w: &crate::state::Workload| w.waypoint.is_some();
    assert_eq!(
        parsed.workloads.iter().map(bound).collect::<Vec<_>>(),
        [true, true, false],
        "the waypoint's own pod is not bound"
    );
    assert!(parsed.services[0].waypoint.is_some());
    assert!(parsed.services[1].waypoint.is_none(), "nor its service");
}

proptest! {
    /// Never a panic; a refusal names the file and, for each problem, what
    /// is wrong; a file with any bad entry is refused whole (parse returns
    /// no partial result, and the running agent keeps the previous file).
    #[test]
    fn a_mutated_workloads_file_is_parsed_or_refused_by_name(edits in edits()) {
        let bytes = mutate(SEED.as_bytes(), &edits);
        // The file is read as UTF-8 text first; invalid UTF-8 never gets here.
        let Ok(text) = std::str::from_utf8(&bytes) else { return Ok(()) };
        match parse(Path::new(PATH), text) {
            Ok(_) => {}
            Err(e) => {
                let message = e.to_string();
                prop_assert!(message.contains(PATH), "unnamed file: {message}");
                if let WorkloadsFileError::Invalid { problems, .. } = &e {
                    prop_assert!(!problems.is_empty(), "refused without a problem");
                    for p in problems {
                        prop_assert!(!p.message.trim().is_empty(), "a problem without a message: {message}");
                    }
                }
            }
        }
    }
}
