//! What `kubectl apply -k` applies: `kubectl kustomize` (kubectl's built-in
//! kustomize, the pinned kubectl that `cargo xtask setup` links at
//! `.tools/kubectl`) run on a directory of deploy/, its output validated
//! against the Kubernetes schemas (schemas.rs) and parsed strictly into the
//! typed objects.

use std::{path::Path, process::Command};

use serde::Deserialize;
use serde_json::Value;

use super::{Object, parse_object, root, schemas};

/// `kubectl kustomize DIR`: its output, or kubectl's error.
pub fn try_build(dir: &Path) -> Result<String, String> {
    let kubectl = root().join(".tools/kubectl");
    let output = Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .map_err(|e| {
            format!(
                "running `{} kustomize {}`: {e} (run `cargo xtask setup`, which installs it)",
                kubectl.display(),
                dir.display()
            )
        })?;
    if !output.status.success() {
        return Err(format!(
            "kubectl kustomize {}: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    String::from_utf8(output.stdout).map_err(|e| format!("kubectl printed non-UTF-8: {e}"))
}

/// The objects `kubectl kustomize deploy/<dir>` builds, in its order,
/// each valid against every supported Kubernetes release's schema.
pub fn build(dir: &str) -> Vec<Object> {
    let text = try_build(&root().join("deploy").join(dir)).unwrap_or_else(|e| panic!("{e}"));
    let what = format!("kubectl kustomize deploy/{dir}");
    schemas::assert_valid(&text, &what);
    parse_stream(&text, &what)
}

/// Every object of a multi-document YAML stream, parsed strictly; panics
/// naming `what` and the document for any that does not parse.
pub fn parse_stream(text: &str, what: &str) -> Vec<Object> {
    let mut problems = Vec::new();
    let mut objects = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc).unwrap_or_else(|e| panic!("{what} document {i}: {e}"));
        if value.is_null() {
            continue;
        }
        match parse_object(&value) {
            Ok(object) => objects.push(object),
            Err(e) => problems.push(format!("{what} document {i}: {e}")),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    objects
}

/// (kind, namespace, name) of an object: what identifies it to the API.
pub fn key(object: &Object) -> (String, String, String) {
    let (kind, meta) = match object {
        Object::Namespace(o) => ("Namespace", &o.metadata),
        Object::ServiceAccount(o) => ("ServiceAccount", &o.metadata),
        Object::ConfigMap(o) => ("ConfigMap", &o.metadata),
        Object::Service(o) => ("Service", &o.metadata),
        Object::DaemonSet(o) => ("DaemonSet", &o.metadata),
        Object::Deployment(o) => ("Deployment", &o.metadata),
        Object::ClusterRole(o) => ("ClusterRole", &o.metadata),
        Object::ClusterRoleBinding(o) => ("ClusterRoleBinding", &o.metadata),
        Object::ResourceQuota(o) => ("ResourceQuota", &o.metadata),
    };
    (
        kind.to_string(),
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

#[test]
fn the_kustomize_build_of_deploy_is_the_base_manifests_as_written() {
    // The file-by-file checks of the base (in this test's main file) hold
    // for what `kubectl apply -k deploy/` applies: kustomize changes
    // nothing in them (their namespace is written out).
    let mut built = build("");
    let mut written = super::all_objects();
    built.sort_by_key(key);
    written.sort_by_key(key);
    assert_eq!(built.len(), written.len(), "the same objects");
    for (b, w) in built.iter().zip(&written) {
        assert_eq!(key(b), key(w));
        assert!(
            b == w,
            "{:?}: kustomize changed it:\n{}",
            key(b),
            super::chart::diff(w, b)
        );
    }
}
