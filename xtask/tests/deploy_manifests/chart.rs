//! deploy/helm/shunt, rendered by the real Helm (helm.rs): with its default
//! values it is deploy/ (`kubectl kustomize deploy/`), with its Istio values
//! it is deploy/istio/, object for object as the typed structs see them;
//! every rendering validates against the Kubernetes schemas
//! (schemas.rs); its values are named like Istio's ztunnel chart's, each
//! does what it says, and values.schema.json refuses the rest.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use serde_json::Value;

use super::{
    HELM_CHART, Object, agent_container, check_args, check_rbac, check_rolling_update,
    daemonset_in, effective_agent_args, helm, istio, kustomize, pod_spec, read, root, schemas,
};

fn chart_dir() -> PathBuf {
    root().join("deploy").join(HELM_CHART)
}

/// `helm template shunt deploy/helm/shunt -n NAMESPACE -f FILE… --set …`,
/// validated against the supported releases' schemas and parsed strictly
/// into the typed objects.
fn render(namespace: &str, value_files: &[&str], sets: &[&str]) -> Vec<Object> {
    let files: Vec<PathBuf> = value_files.iter().map(|f| chart_dir().join(f)).collect();
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let rendered = helm::template(&chart_dir(), "shunt", namespace, &files, sets)
        .unwrap_or_else(|e| panic!("rendering deploy/{HELM_CHART}: {e}"));
    let all: String = rendered.iter().map(|r| r.text.as_str()).collect();
    schemas::assert_valid(
        &all,
        &format!("helm template deploy/{HELM_CHART} {value_files:?} {sets:?}"),
    );
    rendered
        .iter()
        .flat_map(|r| {
            kustomize::parse_stream(&r.text, &format!("deploy/{HELM_CHART}/{}", r.template))
        })
        .collect()
}

/// The DaemonSet's pod template, as the API server compares it: a change
/// in it is what rolls the DaemonSet.
fn pod_template(objects: &[Object]) -> Value {
    let ds = daemonset_in(objects);
    serde_json::to_value(ds.spec.map(|s| s.template)).expect("json")
}

/// Where two objects differ, as JSON paths with both values.
pub fn diff(expected: &Object, found: &Object) -> String {
    fn json(o: &Object) -> Value {
        match o {
            Object::Namespace(o) => serde_json::to_value(o),
            Object::ServiceAccount(o) => serde_json::to_value(o),
            Object::ConfigMap(o) => serde_json::to_value(o),
            Object::Service(o) => serde_json::to_value(o),
            Object::DaemonSet(o) => serde_json::to_value(o),
            Object::Deployment(o) => serde_json::to_value(o),
            Object::ClusterRole(o) => serde_json::to_value(o),
            Object::ClusterRoleBinding(o) => serde_json::to_value(o),
            Object::ResourceQuota(o) => serde_json::to_value(o),
        }
        .expect("objects serialise")
    }
    fn walk(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let (l, r) = (
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                    );
                    walk(l, r, &format!("{path}.{k}"), out);
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (l, r)) in x.iter().zip(y).enumerate() {
                    walk(l, r, &format!("{path}[{i}]"), out);
                }
            }
            (l, r) if l == r => {}
            (l, r) => out.push(format!("  {path}: expected {l}, found {r}")),
        }
    }
    let mut out = Vec::new();
    walk(&json(expected), &json(found), "", &mut out);
    out.join("\n")
}

/// Asserts that the chart's objects are kustomize's, less its Namespace:
/// a chart does not create the namespace it is installed into (helm
/// stores the release there first), so README.md and the chart's README
/// say how to create and label it.
fn assert_same_objects(kustomized: Vec<Object>, charted: Vec<Object>, what: &str) {
    let expected: BTreeMap<_, _> = kustomized
        .into_iter()
        .filter(|o| !matches!(o, Object::Namespace(_)))
        .map(|o| (kustomize::key(&o), o))
        .collect();
    let found: BTreeMap<_, _> = charted
        .into_iter()
        .map(|o| (kustomize::key(&o), o))
        .collect();
    assert_eq!(
        expected.keys().collect::<Vec<_>>(),
        found.keys().collect::<Vec<_>>(),
        "{what}: the same objects (left kustomize, right the chart)"
    );
    let mut problems = Vec::new();
    for (key, object) in &expected {
        if object != &found[key] {
            problems.push(format!("{key:?}:\n{}", diff(object, &found[key])));
        }
    }
    assert!(
        problems.is_empty(),
        "{what}: the chart differs from kustomize:\n{}",
        problems.join("\n")
    );
}

#[test]
fn chart_with_default_values_renders_the_kustomize_base() {
    let charted = render("shunt-system", &[], &[]);
    // The surge strategy, no hostNetwork, no host port, checked on the
    // rendered chart itself (not only through its equality with deploy/).
    check_rolling_update(&charted);
    assert_same_objects(kustomize::build(""), charted, "default values vs deploy/");
}

#[test]
fn chart_with_istio_values_renders_the_istio_overlay() {
    let overlay = istio::overlay();
    assert_same_objects(
        overlay.clone(),
        render("istio-system", &["values-istio.yaml"], &[]),
        "values-istio.yaml vs deploy/istio/",
    );
    assert_same_objects(
        overlay,
        render("istio-system", &[], &["istio.enabled=true"]),
        "--set istio.enabled=true vs deploy/istio/",
    );
}

#[test]
fn chart_with_proxy_ztunnel_renders_the_ztunnel_overlay() {
    assert_same_objects(
        kustomize::build(super::ZTUNNEL_OVERLAY),
        render("shunt-system", &[], &["proxy=ztunnel"]),
        "--set proxy=ztunnel vs deploy/ztunnel/",
    );
}

#[test]
fn chart_readme_says_how_to_create_the_namespace_it_does_not_render() {
    let readme = read(&format!("deploy/{HELM_CHART}/README.md"));
    assert!(readme.contains("pod-security.kubernetes.io/enforce=privileged"));
    assert!(readme.contains("helm install"));
}

/// Every `.Values.x.y` a template names.
fn referenced_values() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir(chart_dir().join("templates")).expect("templates") {
        let text = std::fs::read_to_string(entry.expect("entry").path()).expect("template");
        for (at, _) in text.match_indices(".Values.") {
            let path: String = text[at + ".Values.".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.')
                .collect();
            out.insert(path);
        }
    }
    out
}

/// The paths of values.yaml down to its leaves (maps that are values
/// themselves, like nodeSelector, are leaves when empty or named by a
/// template).
fn value_paths(
    value: &Value,
    prefix: &str,
    referenced: &BTreeSet<String>,
    out: &mut BTreeSet<String>,
) {
    match value {
        Value::Object(map) if !map.is_empty() && !referenced.contains(prefix) => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                value_paths(v, &path, referenced, out);
            }
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

/// ztunnel chart values this chart has too, with the same meaning.
const ZTUNNEL_VALUES: &[&str] = &[
    "hub",
    "tag",
    "image",
    "imagePullPolicy",
    "resources",
    "nodeSelector",
    "tolerations",
    "podAnnotations",
    "podLabels",
    "env",
    "logLevel",
    "logAsJson",
    "terminationGracePeriodSeconds",
    "revision",
    "istioNamespace",
    "caAddress",
    "xdsAddress",
    "multiCluster.clusterName",
    "network",
];

#[test]
fn chart_values_are_all_used_and_named_like_ztunnels() {
    let referenced = referenced_values();
    let values: Value = serde_yaml::from_str(&read(&format!("deploy/{HELM_CHART}/values.yaml")))
        .expect("values.yaml");
    let mut defined = BTreeSet::new();
    value_paths(&values, "", &referenced, &mut defined);
    assert_eq!(
        defined, referenced,
        "values.yaml (left) and the values the templates use (right) differ: a dead value or a typo"
    );
    for name in ZTUNNEL_VALUES {
        assert!(
            defined.contains(*name),
            "values.yaml has no `{name}` (as ztunnel's chart)"
        );
    }
}

#[test]
fn chart_values_do_what_they_say() {
    let objects = render(
        "mesh",
        &["values-istio.yaml"],
        &[
            "hub=registry.example/mesh",
            "tag=1.2.3",
            "imagePullPolicy=Always",
            "logLevel=debug",
            "logAsJson=true",
            "nodeSelector.pool=mesh",
            "podLabels.team=net",
            "env.EXTRA=x",
            "revision=canary",
            "istioNamespace=mesh",
            "xdsAddress=xds.example:15012",
            "multiCluster.clusterName=east",
            "network=network1",
            "trustDomain=example.org",
            "resources.requests.cpu=250m",
            "serviceAccountName=shunt-node",
        ],
    );
    // Still an agent that starts (check_agent_needs would refuse the other
    // image and pull policy, which `cargo xtask run` cannot load).
    check_args(&objects);
    check_rolling_update(&objects);
    check_rbac(&objects);
    let ds = daemonset_in(&objects);
    let spec = pod_spec(&ds);
    let agent = agent_container(&spec);
    let args = effective_agent_args(&agent);
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        assert_eq!(
            c.image.as_deref(),
            Some("registry.example/mesh/shunt:1.2.3"),
            "{}",
            c.name
        );
        assert_eq!(c.image_pull_policy.as_deref(), Some("Always"), "{}", c.name);
    }
    assert_eq!(args["--log-level"], "debug");
    assert_eq!(args["--log-format"], "json");
    assert_eq!(args["--trust-domain"], "example.org");
    // revision and istioNamespace find istiod when no address is given, as
    // in ztunnel's chart; xdsAddress wins when given.
    assert_eq!(args["--ca-address"], "istiod-canary.mesh.svc:15012");
    assert_eq!(args["--xds-address"], "xds.example:15012");
    // istiod's CRL ConfigMap, optional (no plugged-in CA list: no file), at
    // the directory --crl-path names, as Istio's sidecars mount it.
    assert_eq!(args["--crl-path"], "/var/run/secrets/istio/crl/ca-crl.pem");
    let crl_volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "istio-ca-crl")
        .and_then(|v| v.config_map.clone())
        .expect("a ConfigMap volume istio-ca-crl");
    assert_eq!(crl_volume.name, "istio-ca-crl");
    assert_eq!(crl_volume.optional, Some(true));
    let crl_mount = agent
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "istio-ca-crl")
        .map(|m| m.mount_path.clone());
    assert_eq!(crl_mount.as_deref(), Some("/var/run/secrets/istio/crl"));
    let selector = spec.node_selector.clone().unwrap_or_default();
    assert_eq!(selector.get("pool").map(String::as_str), Some("mesh"));
    assert_eq!(
        selector.get("kubernetes.io/os").map(String::as_str),
        Some("linux")
    );
    let labels = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("net"));
    let env = |name: &str| {
        agent
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(env("EXTRA").as_deref(), Some("x"));
    assert_eq!(env("CLUSTER_ID").as_deref(), Some("east"));
    assert_eq!(env("NETWORK").as_deref(), Some("network1"));
    let cpu = agent
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("cpu"))
        .map(|q| q.0.clone());
    assert_eq!(cpu.as_deref(), Some("250m"));
    assert_eq!(spec.service_account_name.as_deref(), Some("shunt-node"));
    for object in &objects {
        let (kind, namespace, name) = kustomize::key(object);
        if !kind.starts_with("Cluster") {
            assert_eq!(namespace, "mesh", "{kind} {name}: the release namespace");
        }
    }
}

// ------------------------------------------- what real Helm makes of it

#[test]
fn chart_lints_strictly() {
    let istio = chart_dir().join("values-istio.yaml");
    for files in [vec![], vec![istio.as_path()]] {
        helm::lint(&chart_dir(), &files).unwrap_or_else(|e| panic!("helm lint {files:?}: {e}"));
    }
}

/// A values file in the chart's directory's temp sibling, as an operator
/// writes one.
fn values_file(name: &str, text: &str) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("shunt-values-{}-{name}.yaml", std::process::id()));
    std::fs::write(&path, text).expect("writing a values file");
    path
}

fn render_error(files: &[&Path], sets: &[&str]) -> String {
    match helm::template(&chart_dir(), "shunt", "shunt-system", files, sets) {
        Ok(_) => panic!("helm template {files:?} {sets:?} rendered; it must fail"),
        Err(e) => e,
    }
}

#[test]
fn a_values_typo_or_a_wrong_type_fails_helm_template() {
    // Unknown keys: a typo, values of other charts' shapes.
    for (set, key) in [
        ("istio.enable=true", "enable"),
        ("proxy=sidecar", "proxy"),
        ("logLevl=debug", "logLevl"),
        ("multiCluster.name=east", "name"),
    ] {
        let err = render_error(&[], &[set]);
        assert!(err.contains(key), "--set {set}: {err}");
    }
    // Wrong types and values, as a values file says them (YAML 1.1).
    for (text, needle) in [
        ("tag: 1.10\n", "/tag"),
        ("redirect: bpf\n", "/redirect"),
        ("logAsJson: \"yes\"\n", "/logAsJson"),
        ("imagePullPolicy: always\n", "/imagePullPolicy"),
        ("extraArgs: [\"dns-capture=on\"]\n", "/extraArgs"),
    ] {
        let file = values_file("bad", text);
        let err = render_error(&[file.as_path()], &[]);
        let _ = std::fs::remove_file(&file);
        assert!(err.contains(needle), "{text:?}: {err}");
    }
}

#[test]
fn bare_on_off_in_a_values_file_render_as_the_words_the_agent_takes() {
    // YAML 1.1: Helm reads `off` as false and `on` as true.
    let file = values_file("onoff", "capture: off\nsplice: on\n");
    let objects = render("shunt-system", &[file.to_str().expect("utf-8 path")], &[]);
    let _ = std::fs::remove_file(&file);
    let args = effective_agent_args(&agent_container(&pod_spec(&daemonset_in(&objects))));
    assert_eq!(args["--capture"], "off");
    assert_eq!(args["--splice"], "on");
}

#[test]
fn a_settings_change_rolls_the_daemonset() {
    // Settings are the agent's arguments, in the pod template: a changed
    // setting is a changed template, which the DaemonSet rolls out.
    let base = pod_template(&render("shunt-system", &[], &[]));
    assert_eq!(
        base,
        pod_template(&render("shunt-system", &[], &[])),
        "the same values, the same pods"
    );
    for set in [
        "logLevel=debug",
        "redirect=iptables",
        "splice=on",
        "capture=off",
        "probeSource=169.254.7.128",
        "excludeNamespaces={kube-system,infra}",
        "ambient.enablementSelectors[0].podSelector.matchLabels.mesh=yes",
    ] {
        assert_ne!(
            base,
            pod_template(&render("shunt-system", &[], &[set])),
            "--set {set} must change the pod template (or nothing rolls)"
        );
    }
}

#[test]
fn excluded_namespaces_and_enablement_selectors_reach_the_agent() {
    // Istio's defaults, as istio-cni's chart has them.
    let args = |sets: &[&str]| {
        effective_agent_args(&agent_container(&pod_spec(&daemonset_in(&render(
            "shunt-system",
            &[],
            sets,
        )))))
    };
    let defaults = args(&[]);
    assert_eq!(defaults["--exclude-namespaces"], "kube-system");
    let selectors: Value =
        serde_json::from_str(&defaults["--enablement-selectors"]).expect("JSON selectors");
    assert_eq!(
        selectors,
        serde_json::json!([
            {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
            {"podSelector": {"matchExpressions": [
                {"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
             "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
        ]),
        "istio-cni's default ambient.enablementSelectors"
    );
    // The same words as the agent's own defaults (cli.rs), so a chart
    // without these arguments would enrol the same pods.
    let agent_selectors: Value = serde_json::from_str(&super::rust_const_raw(
        &read("userspace/src/control/kube/enablement.rs"),
        "ISTIO_DEFAULT_SELECTORS",
    ))
    .expect("the agent's default parses");
    assert_eq!(selectors, agent_selectors);

    let custom = args(&[
        "excludeNamespaces={kube-system,infra}",
        "ambient.enablementSelectors[0].podSelector.matchLabels.mesh=yes",
    ]);
    assert_eq!(custom["--exclude-namespaces"], "kube-system,infra");
    let selectors: Value =
        serde_json::from_str(&custom["--enablement-selectors"]).expect("JSON selectors");
    assert_eq!(
        selectors,
        serde_json::json!([{"podSelector": {"matchLabels": {"mesh": "yes"}}}])
    );
    // A selector of the wrong shape fails the install, not the agents.
    for set in [
        "ambient.enablementSelectors[0].podSelector.matchLabel.a=b",
        "ambient.enablementSelectors[0].podSelector.matchExpressions[0].operator=Near",
        "excludeNamespaces[0]=Kube_System",
    ] {
        let err = render_error(&[], &[set]);
        assert!(
            err.contains("enablementSelectors") || err.contains("excludeNamespaces"),
            "--set {set}: {err}"
        );
    }
}

#[test]
fn operator_values_reach_the_pods() {
    let objects = render(
        "shunt-system",
        &[],
        &[
            "imagePullSecrets[0].name=regcred",
            "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=mesh",
            "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
            "extraArgs[0]=--dns-capture=on",
            "tag=",
            "global.hub=registry.example",
            "global.tag=1.10",
        ],
    );
    let spec = pod_spec(&daemonset_in(&objects));
    let secrets: Vec<String> = spec
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.clone())
        .collect();
    assert_eq!(secrets, ["regcred"]);
    assert!(
        spec.affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .is_some(),
        "affinity rendered"
    );
    let agent = agent_container(&spec);
    assert!(
        agent.args.iter().flatten().any(|a| a == "--dns-capture=on"),
        "{:?}",
        agent.args
    );
    assert_eq!(agent.image.as_deref(), Some("registry.example/shunt:1.10"));
}

#[test]
fn the_gke_quota_admits_the_agents_priority_class() {
    let without = render("istio-system", &["values-istio.yaml"], &[]);
    assert!(
        !without
            .iter()
            .any(|o| matches!(o, Object::ResourceQuota(_))),
        "no quota unless asked"
    );
    let objects = render(
        "istio-system",
        &["values-istio.yaml"],
        &["resourceQuotas.enabled=true"],
    );
    let quota = objects
        .iter()
        .find_map(|o| match o {
            Object::ResourceQuota(q) => Some(q.clone()),
            _ => None,
        })
        .expect("resourceQuotas.enabled renders a ResourceQuota");
    let spec = quota.spec.expect("spec");
    let scope = spec
        .scope_selector
        .and_then(|s| s.match_expressions)
        .unwrap_or_default();
    let priority = pod_spec(&daemonset_in(&objects)).priority_class_name;
    assert_eq!(scope.len(), 1);
    assert_eq!(scope[0].scope_name, "PriorityClass");
    assert_eq!(
        scope[0].values.clone().unwrap_or_default(),
        [priority.unwrap_or_default()]
    );
    assert_eq!(quota.metadata.namespace.as_deref(), Some("istio-system"));
}
