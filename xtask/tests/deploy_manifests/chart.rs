//! deploy/helm/shunt: rendered (helm.rs) with its default values it is
//! deploy/ (`kustomize build deploy/`), with its Istio values it is
//! deploy/istio/, object for object as the typed structs see them; its
//! values are named like Istio's ztunnel chart's and each does what it says.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use serde_json::Value;

use super::{
    HELM_CHART, Object, agent_container, check_args, check_rbac, check_rolling_update,
    config_maps_in, daemonset_in, effective_agent_args, helm, istio, kustomize, pod_spec, read,
    root,
};

fn chart_dir() -> PathBuf {
    root().join("deploy").join(HELM_CHART)
}

/// `helm template shunt deploy/helm/shunt -n NAMESPACE -f FILE… --set …`,
/// parsed strictly into the typed objects.
fn render(namespace: &str, value_files: &[&str], sets: &[&str]) -> Vec<Object> {
    let files: Vec<PathBuf> = value_files.iter().map(|f| chart_dir().join(f)).collect();
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let rendered = helm::template(&chart_dir(), "shunt", namespace, &files, sets)
        .unwrap_or_else(|e| panic!("rendering deploy/{HELM_CHART}: {e}"));
    rendered
        .iter()
        .flat_map(|r| {
            kustomize::parse_stream(&r.text, &format!("deploy/{HELM_CHART}/{}", r.template))
        })
        .collect()
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
    let args = effective_agent_args(&agent, &config_maps_in(&objects));
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

// ------------------------------------------------- the renderer itself

fn render_text(template: &str, values: &str, sets: &[&str]) -> Result<String, String> {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("shunt-chart-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("templates")).expect("temp chart");
    std::fs::write(dir.join("values.yaml"), values).expect("values");
    std::fs::write(dir.join("templates/t.yaml"), template).expect("template");
    std::fs::write(
        dir.join("templates/_h.tpl"),
        "{{- define \"h.name\" -}}\n{{ .Values.name | default \"none\" }}\n{{- end }}\n",
    )
    .expect("helpers");
    let result = helm::template(&dir, "r", "ns", &[], sets).map(|mut r| {
        assert_eq!(r.len(), 1, "_h.tpl renders nothing");
        r.remove(0).text
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[test]
fn the_renderer_follows_helm_for_the_subset_the_chart_uses() {
    let ok = |t: &str, v: &str| render_text(t, v, &[]).unwrap_or_else(|e| panic!("{t}: {e}"));
    // Values, release, trimming, comments.
    assert_eq!(
        ok("a: {{ .Values.x }}\nb: {{ .Release.Namespace }}", "x: 1"),
        "a: 1\nb: ns"
    );
    assert_eq!(ok("a:\n  {{- /* c */ -}}\n  b", ""), "a:b");
    assert_eq!(ok("a: {{ .Values.missing }}.", "{}"), "a: .");
    // if / else if / else with Go's truth.
    let branch = "{{ if .Values.a }}A{{ else if .Values.b }}B{{ else }}C{{ end }}";
    assert_eq!(ok(branch, "a: x\nb: true"), "A");
    assert_eq!(ok(branch, "a: \"\"\nb: true"), "B");
    assert_eq!(ok(branch, "a: 0\nb: {}"), "C");
    assert_eq!(ok("{{ if not .Values.a }}n{{ end }}", "a: []"), "n");
    // Functions and pipelines.
    assert_eq!(ok("{{ .Values.s | quote }}", "s: \"on\""), "\"on\"");
    assert_eq!(ok("{{ .Values.s | default \"d\" }}", "s: \"\""), "d");
    assert_eq!(ok("{{ contains \"/\" .Values.s }}", "s: a/b"), "true");
    assert_eq!(
        ok("x:{{ toYaml .Values.m | nindent 2 }}", "m: {b: 1, a: [x]}"),
        "x:\n  a:\n  - x\n  b: 1"
    );
    assert_eq!(ok("{{ include \"h.name\" . }}|", "name: n"), "n|");
    assert_eq!(
        ok(
            "{{ range $k, $v := .Values.m }}{{ $k }}={{ $v }};{{ end }}",
            "m: {b: 2, a: 1}"
        ),
        "a=1;b=2;"
    );
    // Value files and --set.
    assert_eq!(
        render_text(
            "{{ .Values.a.b }}{{ .Values.c }}",
            "a: {b: 1}\nc: x",
            &["a.b=true", "c=7"]
        )
        .expect("set"),
        "true7"
    );
    // Outside the subset, or wrong: an error naming it, never other output.
    for (template, needle) in [
        ("{{ with .Values.a }}x{{ end }}", "with"),
        ("{{ tpl .Values.a . }}", "tpl"),
        ("{{ .Values.a.b.c }}", "nil pointer"),
        ("{{ .Values.m }}", "toYaml"),
        ("{{ if .Values.a }}", "without"),
        ("{{ end }}", "without"),
        ("{{ .Values.a", "unclosed"),
    ] {
        let err = render_text(template, "a: {}\nm: {k: v}", &[]).expect_err(template);
        assert!(
            err.contains(needle) && err.contains("templates/t.yaml"),
            "{template}: {err}"
        );
    }
}
