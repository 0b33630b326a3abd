//! `--policies N`: the workloads file with N generated `AuthorizationPolicy`
//! objects guarding the mesh server pods, for measuring what the check
//! costs as policies pile up.
//!
//! Every policy is an ALLOW selecting the server pods (label
//! `app: bench-server`) by principal; only the last one names the client's
//! identity. The engine looks at every policy that applies to the
//! destination on every connection (the verdict names the deciding one in
//! key order), so N policies are N evaluations per connection, and the
//! client is still let in (each measurement's checks prove it: a denied
//! connection moves no byte).

use std::fmt::Write as _;

/// The label the policies select the server pods by.
pub(super) const SERVER_LABEL: (&str, &str) = ("app", "bench-server");

/// `base` (a workloads file as `workloads_yaml` writes it) with the label
/// on the entries of `servers` and `count` policies appended.
pub(super) fn workloads_with_policies(
    base: &str,
    servers: &[&str],
    client_principal: &str,
    count: usize,
) -> String {
    let mut yaml = String::with_capacity(base.len() + count * 320);
    for line in base.lines() {
        yaml.push_str(line);
        yaml.push('\n');
        // Each entry opens with its name (see `workloads_yaml`).
        if let Some(name) = line.strip_prefix("  - name: ")
            && servers.contains(&name.trim())
        {
            let (key, value) = SERVER_LABEL;
            let _ = writeln!(yaml, "    labels: {{{key}: {value}}}");
        }
    }
    if count == 0 {
        return yaml;
    }
    yaml.push_str("authorizationPolicies:\n");
    for i in 0..count {
        let principal = if i + 1 == count {
            client_principal.to_string()
        } else {
            format!("cluster.local/ns/default/sa/not-the-client-{i:04}")
        };
        let (key, value) = SERVER_LABEL;
        let _ = write!(
            yaml,
            "  - apiVersion: security.istio.io/v1\n    kind: AuthorizationPolicy\n    metadata: {{name: bench-{i:04}, namespace: default}}\n    spec:\n      selector: {{matchLabels: {{{key}: {value}}}}}\n      action: ALLOW\n      rules: [{{from: [{{source: {{principals: [\"{principal}\"]}}}}]}}]\n"
        );
    }
    yaml
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_the_servers_and_only_the_last_policy_names_the_client() {
        let base = "trustDomain: cluster.local\nworkloads:\n  - name: client\n    namespace: default\n  - name: same-mesh\n    namespace: default\n";
        let yaml = workloads_with_policies(
            base,
            &["same-mesh"],
            "cluster.local/ns/default/sa/sa-client",
            3,
        );
        assert!(yaml.contains("  - name: same-mesh\n    labels: {app: bench-server}\n"));
        assert!(!yaml.contains("  - name: client\n    labels"));
        assert_eq!(yaml.matches("kind: AuthorizationPolicy").count(), 3);
        assert_eq!(yaml.matches("sa/sa-client").count(), 1);
        assert!(
            yaml.trim_end()
                .ends_with("principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]}]")
        );
        assert_eq!(workloads_with_policies(base, &[], "x", 0), base);
    }
}
