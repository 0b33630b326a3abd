//! Every rendered object checked against the Kubernetes OpenAPI schemas of
//! each release the manifests support, strictly (an unknown field is an
//! error), by PyPI's kubernetes-validate (`.tools/kubernetes-validate`,
//! installed by `cargo xtask setup`): what the API server's own validation
//! would refuse fails here, without a cluster.

use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use super::root;

/// The Kubernetes releases deploy/ supports: from the first with
/// `securityContext.appArmorProfile` (1.30; Chart.yaml's kubeVersion) to the
/// newest the pinned kubectl (1.33) and Istio's current releases support.
pub const SUPPORTED: &[&str] = &["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"];

/// Validates a multi-document YAML stream against each of `versions`'
/// schemas (one validator process per release, run at once): the findings
/// of each release that refuses it.
pub fn validate_all(text: &str, versions: &[&str]) -> Vec<(String, String)> {
    let validator = root().join(".tools/kubernetes-validate");
    let children: Vec<_> = versions
        .iter()
        .map(|version| {
            let child = Command::new(&validator)
                .args(["--strict", "--quiet", "--kubernetes-version", version, "-"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .and_then(|mut child| {
                    child
                        .stdin
                        .take()
                        .ok_or_else(|| std::io::Error::other("no stdin"))?
                        .write_all(text.as_bytes())?;
                    Ok(child)
                });
            (version.to_string(), child)
        })
        .collect();
    let mut refused = Vec::new();
    for (version, child) in children {
        let output = child.and_then(|c| c.wait_with_output());
        match output {
            Ok(o) if o.status.success() => {}
            Ok(o) => refused.push((
                version,
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
            )),
            Err(e) => refused.push((
                version,
                format!(
                    "running {}: {e} (run `cargo xtask setup`, which installs it)",
                    validator.display()
                ),
            )),
        }
    }
    refused
}

/// One release: Ok, or the validator's findings.
pub fn validate(text: &str, version: &str) -> Result<(), String> {
    match validate_all(text, &[version]).pop() {
        None => Ok(()),
        Some((_, findings)) => Err(findings),
    }
}

/// Panics naming `what` and every supported release whose schemas refuse
/// `text`.
pub fn assert_valid(text: &str, what: &str) {
    let problems: Vec<String> = validate_all(text, SUPPORTED)
        .into_iter()
        .map(|(v, e)| format!("Kubernetes {v}: {e}"))
        .collect();
    assert!(
        problems.is_empty(),
        "{what} does not validate:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_validator_refuses_what_the_api_server_would() {
    let bad = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n  bogus: 1\n";
    let err = validate(bad, "1.30.0").expect_err("an unknown field");
    assert!(err.contains("bogus"), "{err}");
    // appArmorProfile came in 1.30: the same container is refused by 1.29.
    let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec:\n  containers:\n  - name: c\n    image: i\n    securityContext:\n      appArmorProfile:\n        type: Unconfined\n";
    assert!(validate(pod, "1.30.0").is_ok());
    let err = validate(pod, "1.29.0").expect_err("1.29 has no appArmorProfile");
    assert!(err.contains("appArmorProfile"), "{err}");
}
