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
services:
  - name: web
    namespace: default
    clusterIPs: ["198.19.100.1"]
    ports:
      - port: 80
        targetPort: 8080
    endpoints: [server, 198.18.9.9]
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
    assert_eq!(parsed.workloads.len(), 2);
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
