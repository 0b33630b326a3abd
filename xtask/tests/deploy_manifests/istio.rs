//! deploy/istio/: the agent in place of ztunnel and istio-cni, as
//! `kustomize build deploy/istio/` builds it. Everything the base's
//! DaemonSet is checked for holds here too (same checks, on these objects);
//! on top, what istiod needs: the node proxy account it trusts, the mesh
//! root and the istio-ca token mounted where the flags read them, the flags
//! pointing at istiod, and nothing else changed from the base.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec, Volume};

use super::{
    Object, agent_container, check_agent_needs, check_args, check_rbac, check_rolling_update,
    daemonset_in, effective_agent_args, kustomize, pod_spec, read,
};

/// Where istiod runs, and the account it trusts as a node proxy by default
/// (its CA_TRUSTED_NODE_ACCOUNTS is istio-system/ztunnel).
const ISTIO_NAMESPACE: &str = "istio-system";
const NODE_PROXY_ACCOUNT: &str = "ztunnel";
/// istiod's CA and xDS port (both on one gRPC server).
const ISTIOD: &str = "istiod.istio-system.svc:15012";
/// The ConfigMap istiod publishes in every namespace, and its key.
const ROOT_CERT_CONFIG_MAP: &str = "istio-ca-root-cert";
const ROOT_CERT_KEY: &str = "root-cert.pem";
/// The audience istiod accepts tokens for.
const TOKEN_AUDIENCE: &str = "istio-ca";
/// The identity ztunnel tells istiod (xDS node id and metadata), by env var:
/// (name, downward API field or None for a literal value).
const NODE_PROXY_ENV: &[(&str, Option<&str>)] = &[
    ("POD_NAME", Some("metadata.name")),
    ("POD_NAMESPACE", Some("metadata.namespace")),
    ("INSTANCE_IP", Some("status.podIP")),
    ("SERVICE_ACCOUNT", Some("spec.serviceAccountName")),
    ("CLUSTER_ID", None),
];

pub fn overlay() -> Vec<Object> {
    kustomize::build(super::ISTIO_OVERLAY)
}

/// The mount of the directory holding the file `flag` names, and its volume.
fn mounted<'a>(
    spec: &'a PodSpec,
    agent: &Container,
    args: &BTreeMap<String, String>,
    flag: &str,
) -> (&'a Volume, String) {
    let file = Path::new(
        args.get(flag)
            .unwrap_or_else(|| panic!("{flag} has no value")),
    );
    let dir = file.parent().expect("a file in a directory");
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a file name")
        .to_string();
    let mount = agent
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir)
        .unwrap_or_else(|| {
            panic!(
                "{flag} {}: nothing is mounted at {}",
                file.display(),
                dir.display()
            )
        });
    assert!(
        mount.sub_path.is_none(),
        "{flag}: a directory mount (a subPath never sees rotations)"
    );
    assert_eq!(mount.read_only, Some(true), "{flag}: read-only");
    (super::volume(spec, &mount.name), name)
}

/// --ca istio (and the xDS client): the mesh root from istiod's ConfigMap
/// and a projected istio-ca token, at the paths the flags name.
pub fn check_istiod_files(spec: &PodSpec, agent: &Container, args: &BTreeMap<String, String>) {
    for flag in ["--ca-root-cert", "--xds-root-cert"] {
        let (volume, file) = mounted(spec, agent, args, flag);
        let map = volume
            .config_map
            .as_ref()
            .unwrap_or_else(|| panic!("{flag}: the {ROOT_CERT_CONFIG_MAP} ConfigMap"));
        assert_eq!(map.name, ROOT_CERT_CONFIG_MAP, "{flag}");
        assert_ne!(map.optional, Some(true), "{flag}: no root, no mesh");
        match &map.items {
            None => assert_eq!(
                file, ROOT_CERT_KEY,
                "{flag}: the ConfigMap's key is the file"
            ),
            Some(items) => assert!(
                items
                    .iter()
                    .any(|i| i.key == ROOT_CERT_KEY && i.path == file),
                "{flag}: {ROOT_CERT_KEY} mapped to {file}"
            ),
        }
    }
    for flag in ["--ca-token-file", "--xds-token"] {
        let (volume, file) = mounted(spec, agent, args, flag);
        let token = volume
            .projected
            .as_ref()
            .and_then(|p| p.sources.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|s| s.service_account_token.as_ref())
            .find(|t| t.path == file)
            .unwrap_or_else(|| panic!("{flag}: a projected service account token {file}"));
        assert_eq!(token.audience.as_deref(), Some(TOKEN_AUDIENCE), "{flag}");
    }
    // One root and one token for both of istiod's services, where ztunnel
    // has them.
    assert_eq!(args["--ca-root-cert"], args["--xds-root-cert"]);
    assert_eq!(args["--ca-token-file"], args["--xds-token"]);
    assert_eq!(
        args["--ca-root-cert"],
        "/var/run/secrets/istio/root-cert.pem"
    );
    assert_eq!(
        args["--ca-token-file"],
        "/var/run/secrets/tokens/istio-token"
    );
}

#[test]
fn istio_overlay_keeps_everything_the_agent_needs() {
    let objects = overlay();
    check_args(&objects);
    check_agent_needs(&objects);
    check_rolling_update(&objects);
    check_rbac(&objects);
}

#[test]
fn istio_overlay_runs_as_the_node_proxy_istiod_trusts() {
    let objects = overlay();
    // istio-system is istiod's: created by no one here, so that `kubectl
    // delete -k deploy/istio/` can never delete it.
    for object in &objects {
        let (kind, namespace, name) = kustomize::key(object);
        assert_ne!(kind, "Namespace", "the overlay creates namespace {name}");
        if !kind.starts_with("Cluster") {
            assert_eq!(namespace, ISTIO_NAMESPACE, "{kind} {name}");
        }
    }
    let accounts: Vec<String> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ServiceAccount(sa) => sa.metadata.name.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(accounts, vec![NODE_PROXY_ACCOUNT.to_string()]);
    let ds = daemonset_in(&objects);
    let spec = pod_spec(&ds);
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some(NODE_PROXY_ACCOUNT)
    );
    assert_ne!(spec.automount_service_account_token, Some(false));
    // The binding's subject follows (check_rbac: the DaemonSet's account,
    // in the DaemonSet's namespace).
    check_rbac(&objects);
    // Like ztunnel's pods: never a mesh workload itself.
    let labels = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    assert_eq!(
        labels.get("sidecar.istio.io/inject").map(String::as_str),
        Some("false")
    );
    assert_eq!(
        labels.get("istio.io/dataplane-mode").map(String::as_str),
        Some("none")
    );
    // An operator who keeps another account tells istiod about it: the
    // doc says how.
    let doc = read("docs/ISTIO.md");
    assert!(
        doc.contains("CA_TRUSTED_NODE_ACCOUNTS"),
        "docs/ISTIO.md names istiod's CA_TRUSTED_NODE_ACCOUNTS"
    );
}

fn env_by_name(container: &Container) -> BTreeMap<String, EnvVar> {
    container
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.clone()))
        .collect()
}

#[test]
fn istio_overlay_points_the_agent_at_istiod_and_changes_nothing_else() {
    let objects = overlay();
    let base = super::all_objects();
    let (ds, base_ds) = (daemonset_in(&objects), daemonset_in(&base));
    let (spec, base_spec) = (pod_spec(&ds), pod_spec(&base_ds));
    let (agent, base_agent) = (agent_container(&spec), agent_container(&base_spec));

    // The flags: istiod as CA and as xDS server; the base's others kept.
    let args = effective_agent_args(&agent);
    assert_eq!(args["--ca"], "istio");
    assert_eq!(args["--ca-address"], ISTIOD);
    assert_eq!(args["--xds-address"], ISTIOD);
    let set = |c: &Container| -> BTreeSet<String> { c.args.iter().flatten().cloned().collect() };
    let (now, before) = (set(&agent), set(&base_agent));
    let flag_names = |args: &BTreeSet<String>| -> BTreeSet<String> {
        args.iter()
            .map(|a| a.split('=').next().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(
        flag_names(&before.difference(&now).cloned().collect()),
        ["--ca", "--ca-dir"].map(String::from).into(),
        "the overlay replaces the base's built-in CA and nothing else"
    );
    assert_eq!(
        flag_names(&now.difference(&before).cloned().collect()),
        [
            "--ca",
            "--ca-address",
            "--ca-root-cert",
            "--ca-token-file",
            "--crl-path",
            "--xds-address",
            "--xds-root-cert",
            "--xds-token"
        ]
        .map(String::from)
        .into(),
    );

    // The env: the base's, plus who this node proxy is.
    let (env, base_env) = (env_by_name(&agent), env_by_name(&base_agent));
    for (name, var) in &base_env {
        assert_eq!(env.get(name), Some(var), "{name} as in the base");
    }
    let added: BTreeSet<&str> = env
        .keys()
        .filter(|k| !base_env.contains_key(*k))
        .map(String::as_str)
        .collect();
    assert_eq!(added, NODE_PROXY_ENV.iter().map(|(n, _)| *n).collect());
    for (name, field) in NODE_PROXY_ENV {
        let var = &env[*name];
        match field {
            Some(path) => assert_eq!(
                var.value_from
                    .as_ref()
                    .and_then(|f| f.field_ref.as_ref())
                    .map(|f| f.field_path.as_str()),
                Some(*path),
                "{name}"
            ),
            None => assert!(
                var.value.as_deref().is_some_and(|v| !v.is_empty()),
                "{name}"
            ),
        }
    }

    // The volumes: the built-in CA's Secret gone, istiod's root, its
    // revocation lists (optional) and the token in.
    let names = |s: &PodSpec| -> BTreeSet<String> {
        s.volumes.iter().flatten().map(|v| v.name.clone()).collect()
    };
    let (vols, base_vols) = (names(&spec), names(&base_spec));
    assert_eq!(
        base_vols
            .difference(&vols)
            .cloned()
            .collect::<BTreeSet<_>>(),
        ["ca".to_string()].into()
    );
    assert_eq!(
        vols.difference(&base_vols)
            .cloned()
            .collect::<BTreeSet<_>>(),
        ["istiod-ca-cert", "istio-ca-crl", "istio-token"]
            .map(String::from)
            .into(),
        "root cert, revocation lists and token"
    );
    assert!(
        !spec.volumes.iter().flatten().any(|v| v.secret.is_some()),
        "no Secret: istiod signs, no CA key on the nodes"
    );

    // Everything else is the base's, field for field.
    let strip = |ds: &k8s_openapi::api::apps::v1::DaemonSet| {
        let mut v = serde_json::to_value(ds).expect("json");
        v["metadata"]["namespace"] = serde_json::Value::Null;
        let template = &mut v["spec"]["template"];
        template["metadata"]["labels"] = serde_json::Value::Null;
        let pod = &mut template["spec"];
        for field in ["serviceAccountName", "volumes"] {
            pod[field] = serde_json::Value::Null;
        }
        for field in ["args", "env", "volumeMounts"] {
            pod["containers"][0][field] = serde_json::Value::Null;
        }
        v
    };
    assert_eq!(
        strip(&ds),
        strip(&base_ds),
        "the DaemonSet beyond what the overlay says"
    );
    let others = |objects: &[Object]| -> Vec<(String, String, serde_json::Value)> {
        let mut out: Vec<_> = objects
            .iter()
            .filter(|o| {
                !matches!(
                    o,
                    Object::DaemonSet(_)
                        | Object::Namespace(_)
                        | Object::ServiceAccount(_)
                        | Object::ClusterRoleBinding(_)
                        | Object::ClusterRole(_)
                )
            })
            .map(|o| {
                let (kind, _, name) = kustomize::key(o);
                let mut v = match o {
                    Object::ConfigMap(c) => serde_json::to_value(c),
                    other => panic!("the overlay has {other:?}: say what it is"),
                }
                .expect("json");
                v["metadata"]["namespace"] = serde_json::Value::Null;
                (kind, name, v)
            })
            .collect();
        out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        out
    };
    assert_eq!(
        others(&objects),
        others(&base),
        "nothing else changed from the base"
    );
    // The ClusterRole: the base's first rules (this node's pods, namespaces,
    // pods/status), without the builtin proxy's discovery (check_rbac
    // checks the exact grants).
    let rules = |objects: &[Object]| {
        objects
            .iter()
            .find_map(|o| match o {
                Object::ClusterRole(r) => r.rules.clone(),
                _ => None,
            })
            .unwrap_or_default()
    };
    let (now, before) = (rules(&objects), rules(&base));
    assert!(now.len() < before.len(), "fewer grants than the base");
    assert_eq!(now[..], before[..now.len()], "the base's own first rules");
}
