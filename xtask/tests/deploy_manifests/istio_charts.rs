//! The swap from Istio's ztunnel and istio-cni charts to shunt and back
//! (docs/ISTIO.md), checked against what those charts render.
//!
//! Istio's charts are not vendored (their text is Istio's, and the tests
//! may not download): what shunt's objects must match is recorded below as
//! facts, read off `helm template` of istio/istio's
//! manifests/charts/{ztunnel,istio-cni} (commit 86c9f01f, August 2026;
//! `helm template ztunnel manifests/charts/ztunnel -n istio-system` and
//! `helm template istio-cni manifests/charts/istio-cni -n istio-system
//! --set profile=ambient`): names, labels, namespaces, ports, service
//! accounts, the ZDS socket directory, istio-cni's enrolment defaults and
//! its ClusterRoles. With `ISTIO_CHARTS_DIR` pointing at a checkout's
//! manifests/charts, `istios_charts_still_render_the_recorded_facts`
//! renders them with the pinned Helm and checks the facts still hold
//! (otherwise it says why it skips).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use serde::Deserialize;
use serde_json::Value;

use super::{
    HELM_CHART, Object, agent_container, daemonset_in, effective_agent_args, helm, kustomize,
    pod_spec, read, root, schemas,
};

/// The namespace both of Istio's charts install into.
const ISTIO_NAMESPACE: &str = "istio-system";

/// ztunnel's chart: its DaemonSet, the label `kubectl wait` selects its
/// pods by, its service account, ports and the host directory of its ZDS
/// socket (ztunnel's INPOD_UDS default is `ztunnel.sock` in it).
const ZTUNNEL_DAEMONSET: &str = "ztunnel";
const ZTUNNEL_POD_LABEL: (&str, &str) = ("app", "ztunnel");
const ZTUNNEL_SERVICE_ACCOUNT: &str = "ztunnel";
const ZTUNNEL_METRICS_PORT: i32 = 15020;
const ZTUNNEL_READINESS: (i32, &str) = (15021, "/healthz/ready");
const ZDS_SOCKET_DIR: &str = "/var/run/ztunnel";
/// Where ztunnel's chart mounts istiod's root and the istio-ca token.
const ISTIOD_ROOT_DIR: &str = "/var/run/secrets/istio";
const ISTIO_TOKEN_DIR: &str = "/var/run/secrets/tokens";

/// istio-cni's chart: its DaemonSet and pod label, and the enrolment
/// defaults of its ConfigMap (EXCLUDE_NAMESPACES,
/// AMBIENT_ENABLEMENT_SELECTOR).
const CNI_DAEMONSET: &str = "istio-cni-node";
const CNI_POD_LABEL: (&str, &str) = ("k8s-app", "istio-cni-node");
const CNI_EXCLUDED_NAMESPACES: &str = "kube-system";
const CNI_ENABLEMENT_SELECTORS: &str = r#"[
  {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
  {"podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
   "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
]"#;
/// Every (group, resource, verb) istio-cni's ClusterRoles (istio-cni,
/// istio-cni-repair-role, istio-cni-ambient) grant, resourceNames aside.
const CNI_GRANTS: &[(&str, &str, &[&str])] = &[
    ("", "pods", &["get", "list", "watch"]),
    ("", "nodes", &["get", "list", "watch"]),
    ("", "namespaces", &["get", "list", "watch"]),
    ("", "events", &["create", "patch"]),
    ("", "pods/status", &["patch", "update"]),
    ("apps", "daemonsets", &["get"]),
];

/// Labels both charts put on their pods so that Istio never meshes them.
const NEVER_MESHED: &[(&str, &str)] = &[
    ("sidecar.istio.io/inject", "false"),
    ("istio.io/dataplane-mode", "none"),
];
/// Both charts' pods' priority class.
const PRIORITY_CLASS: &str = "system-node-critical";

fn chart_dir() -> PathBuf {
    root().join("deploy").join(HELM_CHART)
}

/// shunt's chart as docs/ISTIO.md installs it in place of both.
fn shunt_istio(sets: &[&str]) -> Vec<Object> {
    let istio = chart_dir().join("values-istio.yaml");
    let rendered = helm::template(&chart_dir(), "shunt", ISTIO_NAMESPACE, &[&istio], sets)
        .unwrap_or_else(|e| panic!("helm template shunt: {e}"));
    let text: String = rendered.iter().map(|r| r.text.as_str()).collect();
    schemas::assert_valid(&text, "shunt's chart with values-istio.yaml");
    kustomize::parse_stream(&text, "shunt's chart with values-istio.yaml")
}

fn pod_labels(objects: &[Object]) -> BTreeMap<String, String> {
    daemonset_in(objects)
        .spec
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.labels)
        .unwrap_or_default()
}

/// (group, resource, verb) the ClusterRoles among `objects` grant.
fn grants(objects: &[Object]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for object in objects {
        let Object::ClusterRole(role) = object else {
            continue;
        };
        for rule in role.rules.iter().flatten() {
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    for verb in &rule.verbs {
                        out.insert((group.clone(), resource.clone(), verb.clone()));
                    }
                }
            }
        }
    }
    out
}

fn cni_grants() -> BTreeSet<(String, String, String)> {
    CNI_GRANTS
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(|v| (g.to_string(), r.to_string(), v.to_string()))
        })
        .collect()
}

#[test]
fn shunt_in_istio_mode_stands_where_ztunnel_and_istio_cni_stood() {
    let objects = shunt_istio(&[]);
    let ds = daemonset_in(&objects);
    let spec = pod_spec(&ds);
    let agent = agent_container(&spec);
    let args = effective_agent_args(&agent);

    // In their namespace, as the account istiod trusts (ztunnel's).
    for object in &objects {
        let (kind, namespace, name) = kustomize::key(object);
        if !kind.starts_with("Cluster") {
            assert_eq!(namespace, ISTIO_NAMESPACE, "{kind} {name}");
        }
    }
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some(ZTUNNEL_SERVICE_ACCOUNT)
    );
    assert_eq!(spec.priority_class_name.as_deref(), Some(PRIORITY_CLASS));
    let labels = pod_labels(&objects);
    for (key, value) in NEVER_MESHED {
        assert_eq!(labels.get(*key).map(String::as_str), Some(*value), "{key}");
    }
    // Not selected by the `kubectl wait -l` of ztunnel's or istio-cni's
    // pods in docs/ISTIO.md (nor by dashboards selecting them).
    for (key, value) in [ZTUNNEL_POD_LABEL, CNI_POD_LABEL] {
        assert_ne!(labels.get(key).map(String::as_str), Some(value), "{key}");
    }
    // ztunnel's ports, on the pod IP.
    let ports: BTreeSet<i32> = agent
        .ports
        .iter()
        .flatten()
        .map(|p| p.container_port)
        .collect();
    assert!(ports.contains(&ZTUNNEL_METRICS_PORT), "{ports:?}");
    let probe = agent
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.clone())
        .expect("an HTTP readiness probe");
    assert_eq!(
        (
            probe.port,
            probe.path.as_deref().unwrap_or_default().to_string()
        ),
        (
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(ZTUNNEL_READINESS.0),
            ZTUNNEL_READINESS.1.to_string()
        )
    );
    // istiod's root and token where ztunnel has them.
    let mounts: BTreeSet<&str> = agent
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    for dir in [ISTIOD_ROOT_DIR, ISTIO_TOKEN_DIR] {
        assert!(mounts.contains(dir), "{dir} not mounted: {mounts:?}");
    }

    // Enrolment: istio-cni's defaults, word for word.
    assert_eq!(args["--exclude-namespaces"], CNI_EXCLUDED_NAMESPACES);
    let theirs: Value = serde_json::from_str(CNI_ENABLEMENT_SELECTORS).expect("JSON");
    let ours: Value = serde_json::from_str(&args["--enablement-selectors"]).expect("JSON");
    assert_eq!(ours, theirs);

    // RBAC no wider than istio-cni's for the same job.
    let ours = grants(&objects);
    let wider: Vec<_> = ours.difference(&cni_grants()).cloned().collect();
    assert!(wider.is_empty(), "grants istio-cni has not: {wider:?}");
}

/// shunt's chart as docs/ZTUNNEL.md installs it beside a stock ztunnel.
fn shunt_beside_ztunnel() -> Vec<Object> {
    let rendered = helm::template(
        &chart_dir(),
        "shunt",
        "shunt-system",
        &[],
        &["proxy=ztunnel"],
    )
    .unwrap_or_else(|e| panic!("helm template shunt: {e}"));
    let text: String = rendered.iter().map(|r| r.text.as_str()).collect();
    schemas::assert_valid(&text, "shunt's chart with proxy=ztunnel");
    kustomize::parse_stream(&text, "shunt's chart with proxy=ztunnel")
}

#[test]
fn shunt_beside_ztunnel_serves_zds_where_ztunnels_chart_looks() {
    // As docs/ZTUNNEL.md installs it, and in istio-system with the Istio
    // values: neither takes an object of ztunnel's chart.
    for objects in [shunt_beside_ztunnel(), shunt_istio(&["proxy=ztunnel"])] {
        check_beside_ztunnel(&objects);
    }
}

fn check_beside_ztunnel(objects: &[Object]) {
    let objects = objects.to_vec();
    let spec = pod_spec(&daemonset_in(&objects));
    let agent = agent_container(&spec);
    let args = effective_agent_args(&agent);
    assert_eq!(args["--proxy"], "ztunnel");
    assert_eq!(
        args["--zds-socket"],
        format!("{ZDS_SOCKET_DIR}/ztunnel.sock")
    );
    let mount = super::host_mount(&spec, &agent, ZDS_SOCKET_DIR);
    assert_eq!(mount.mount_path, ZDS_SOCKET_DIR);
    // Beside ztunnel, so never its account or its names.
    assert_ne!(
        spec.service_account_name.as_deref(),
        Some(ZTUNNEL_SERVICE_ACCOUNT),
        "ztunnel's chart owns that account in this mode"
    );
    for object in &objects {
        let (kind, _, name) = kustomize::key(object);
        assert!(
            ![ZTUNNEL_DAEMONSET, ZTUNNEL_SERVICE_ACCOUNT, CNI_DAEMONSET].contains(&name.as_str()),
            "{kind} {name} collides with Istio's"
        );
    }
    let wider: Vec<_> = grants(&objects)
        .difference(&cni_grants())
        .cloned()
        .collect();
    assert!(wider.is_empty(), "grants istio-cni has not: {wider:?}");
}

#[test]
fn documented_helm_installs_and_waits_are_the_ones_tested() {
    // Every `helm install` of shunt's chart in the docs renders (as
    // `helm template`, placeholders filled) and validates, and every
    // `kubectl wait -l` selects the pods of the chart it waits on.
    for (file, at_least) in [
        ("docs/ISTIO.md", 2),
        ("docs/ZTUNNEL.md", 1),
        ("deploy/helm/shunt/README.md", 2),
    ] {
        let commands = shunt_installs(&read(file));
        assert!(
            commands.len() >= at_least,
            "{file} installs shunt with Helm: {commands:?}"
        );
        for command in commands {
            let command = command
                .replace("REGISTRY", "registry.example")
                .replace("TAG", "1.2.3");
            let words: Vec<&str> = command.split_whitespace().collect();
            let mut cmd = helm::helm();
            cmd.current_dir(root()).arg("template").args(&words[2..]);
            let output = cmd.output().expect("helm");
            assert!(
                output.status.success(),
                "{file}: `{command}`: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let text = String::from_utf8_lossy(&output.stdout);
            schemas::assert_valid(&text, &command);
        }
    }
    let doc = read("docs/ISTIO.md");

    let shunt_labels = pod_labels(&shunt_istio(&[]));
    for (key, value) in [ZTUNNEL_POD_LABEL, CNI_POD_LABEL] {
        let selector = format!("-l {key}={value}");
        assert!(
            doc.contains(&selector),
            "docs/ISTIO.md waits on Istio's pods with `{selector}`"
        );
    }
    let (key, value) = ("app.kubernetes.io/name", "shunt");
    assert!(doc.contains(&format!("-l {key}={value}")));
    assert_eq!(shunt_labels.get(key).map(String::as_str), Some(value));
}

#[test]
fn istio_md_reinstalls_istios_charts_as_they_install() {
    // The way back: docs/ISTIO.md's `helm install` of istio-cni and ztunnel
    // names Istio's charts, release names and namespace; rendered with
    // Istio's charts (ISTIO_CHARTS_DIR), the values files `helm get values`
    // saved standing empty, and holding the DaemonSets the swap removed.
    let doc = read("docs/ISTIO.md");
    let mut reinstalls = BTreeMap::new();
    for line in doc.lines() {
        let Some(at) = line.find("helm install ") else {
            continue;
        };
        let words: Vec<&str> = line[at..].split_whitespace().collect();
        let Some(chart) = words.get(3).and_then(|c| c.strip_prefix("istio/")) else {
            continue;
        };
        let flag = |name: &str| {
            words
                .iter()
                .position(|w| *w == name)
                .and_then(|i| words.get(i + 1).copied())
        };
        assert_eq!(flag("-n"), Some(ISTIO_NAMESPACE), "`{line}`");
        assert!(flag("-f").is_some(), "`{line}` restores the saved values");
        reinstalls.insert(words[2].to_string(), chart.to_string());
    }
    assert_eq!(
        reinstalls,
        BTreeMap::from([
            ("istio-cni".to_string(), "cni".to_string()),
            ("ztunnel".to_string(), "ztunnel".to_string()),
        ]),
        "docs/ISTIO.md reinstalls istio-cni and ztunnel under their own release names"
    );
    // The Helm repository's chart `cni` is manifests/charts/istio-cni.
    for (release, chart_dir, daemonset) in [
        ("istio-cni", "istio-cni", CNI_DAEMONSET),
        ("ztunnel", "ztunnel", ZTUNNEL_DAEMONSET),
    ] {
        let Some(objects) = render_istio(chart_dir, release, &[]) else {
            return;
        };
        the_kind(&objects, "DaemonSet", daemonset);
    }
}

#[test]
fn documented_kustomize_overlays_name_the_image() {
    // docs/ISTIO.md's kustomize install, as written: the overlay file its
    // heredoc writes beside deploy/, then `kubectl kustomize` of it.
    let doc = read("docs/ISTIO.md");
    let opening = "cat > shunt-overlay/kustomization.yaml <<'EOF'";
    let start = doc
        .find(opening)
        .expect("docs/ISTIO.md writes shunt-overlay/kustomization.yaml")
        + opening.len();
    let end = start
        + doc[start..]
            .find("\n   EOF")
            .expect("the heredoc ends with EOF");
    let overlay: String = doc[start..end]
        .lines()
        .map(|line| line.trim_start())
        .filter(|line| !line.is_empty())
        .map(|line| format!("{line}\n"))
        .collect::<String>()
        .replace("REGISTRY", "registry.example")
        .replace("TAG", "1.2.3");
    assert!(
        doc[end..].contains("kubectl apply -k shunt-overlay/"),
        "docs/ISTIO.md applies the overlay it wrote"
    );

    let spec = pod_spec(&daemonset_in(&build_overlay(&overlay, "docs/ISTIO.md")));
    assert_eq!(
        images(&spec),
        BTreeSet::from(["registry.example/shunt:1.2.3".to_string()]),
        "every container of the overlay runs the operator's image"
    );
    // The rest is the Istio overlay's.
    let args = effective_agent_args(&agent_container(&spec));
    assert_eq!(args.get("--ca").map(String::as_str), Some("istio"));

    // deploy/README.md's standalone install: the same overlay over deploy/.
    let readme = read("deploy/README.md");
    for line in [
        "`resources: [../deploy]`",
        "`images: [{name: shunt, newName: REGISTRY/shunt, newTag: TAG}]`",
    ] {
        assert!(readme.contains(line), "deploy/README.md: {line}");
    }
    let standalone = overlay.replace("[../deploy/istio]", "[../deploy]");
    let spec = pod_spec(&daemonset_in(&build_overlay(
        &standalone,
        "deploy/README.md",
    )));
    assert_eq!(
        images(&spec),
        BTreeSet::from(["registry.example/shunt:1.2.3".to_string()])
    );
    let args = effective_agent_args(&agent_container(&spec));
    assert_eq!(args.get("--ca").map(String::as_str), Some("builtin"));
}

/// `kubectl kustomize` of an operator's overlay (`kustomization`) written
/// beside deploy/, in a scratch directory standing for their checkout:
/// its objects, each valid against the schemas.
fn build_overlay(kustomization: &str, what: &str) -> Vec<Object> {
    let scratch = std::env::temp_dir().join(format!(
        "shunt-overlay-test-{}-{}",
        std::process::id(),
        what.replace('/', "_")
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(scratch.join("shunt-overlay")).expect("scratch dir");
    std::os::unix::fs::symlink(root().join("deploy"), scratch.join("deploy")).expect("link");
    std::fs::write(
        scratch.join("shunt-overlay/kustomization.yaml"),
        kustomization,
    )
    .expect("write");
    let built = kustomize::try_build(&scratch.join("shunt-overlay"));
    let _ = std::fs::remove_dir_all(&scratch);
    let text = built.unwrap_or_else(|e| panic!("{what}'s overlay:\n{kustomization}\n{e}"));
    let what = format!("{what}'s kustomize overlay");
    schemas::assert_valid(&text, &what);
    kustomize::parse_stream(&text, &what)
}

/// Every image a pod spec runs.
fn images(spec: &k8s_openapi::api::core::v1::PodSpec) -> BTreeSet<String> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.image.clone())
        .collect()
}

/// The `helm install shunt ...` commands of a Markdown file: a line of a
/// fenced block (with its `\` continuations), or an inline code span, which
/// prose may wrap over lines.
fn shunt_installs(doc: &str) -> Vec<String> {
    const INSTALL: &str = "helm install shunt ";
    let mut found = Vec::new();
    let mut prose = String::new();
    let mut fenced = false;
    for line in doc.replace("\\\n", " ").lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            prose.push(' ');
            continue;
        }
        if fenced {
            if let Some(at) = line.find(INSTALL) {
                found.push(line[at..].trim().to_string());
            }
        } else {
            prose.push_str(line.trim());
            prose.push(' ');
        }
    }
    for span in prose.split('`').skip(1).step_by(2) {
        if let Some(at) = span.find(INSTALL) {
            found.push(span[at..].trim().to_string());
        }
    }
    found
}

fn render_istio(chart: &str, release: &str, sets: &[&str]) -> Option<Vec<Value>> {
    let Some(dir) = std::env::var_os("ISTIO_CHARTS_DIR").map(PathBuf::from) else {
        eprintln!(
            "skipped: ISTIO_CHARTS_DIR is not set (a checkout of istio/istio's manifests/charts); \
             the recorded facts are checked against shunt's chart only"
        );
        return None;
    };
    let path = dir.join(chart);
    if !path.join("Chart.yaml").is_file() {
        eprintln!(
            "skipped: {} has no Chart.yaml (ISTIO_CHARTS_DIR must be istio/istio's manifests/charts)",
            path.display()
        );
        return None;
    }
    let rendered = helm::template(&path, release, ISTIO_NAMESPACE, &[], sets)
        .unwrap_or_else(|e| panic!("helm template {}: {e}", path.display()));
    let text: String = rendered.iter().map(|r| r.text.as_str()).collect();
    Some(
        serde_yaml::Deserializer::from_str(&text)
            .filter_map(|d| Value::deserialize(d).ok())
            .filter(|v| !v.is_null())
            .collect(),
    )
}

fn the_kind<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("Istio's chart renders no {kind} {name}"))
}

#[test]
fn istios_charts_still_render_the_recorded_facts() {
    let (Some(ztunnel), Some(cni)) = (
        render_istio("ztunnel", "ztunnel", &[]),
        render_istio("istio-cni", "istio-cni", &["profile=ambient"]),
    ) else {
        return;
    };
    // ztunnel.
    let ds = the_kind(&ztunnel, "DaemonSet", ZTUNNEL_DAEMONSET);
    assert_eq!(ds["metadata"]["namespace"], ISTIO_NAMESPACE);
    let template = &ds["spec"]["template"];
    assert_eq!(
        template["metadata"]["labels"][ZTUNNEL_POD_LABEL.0],
        ZTUNNEL_POD_LABEL.1
    );
    for (key, value) in NEVER_MESHED {
        assert_eq!(template["metadata"]["labels"][*key], *value, "{key}");
    }
    let spec = &template["spec"];
    assert_eq!(spec["serviceAccountName"], ZTUNNEL_SERVICE_ACCOUNT);
    assert_eq!(spec["priorityClassName"], PRIORITY_CLASS);
    let container = &spec["containers"][0];
    assert!(
        container["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["containerPort"] == ZTUNNEL_METRICS_PORT)
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"]["port"],
        ZTUNNEL_READINESS.0
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"],
        ZTUNNEL_READINESS.1
    );
    let mounts: BTreeSet<String> = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["mountPath"].as_str().map(str::to_owned))
        .collect();
    for dir in [ISTIOD_ROOT_DIR, ISTIO_TOKEN_DIR, ZDS_SOCKET_DIR] {
        assert!(mounts.contains(dir), "ztunnel mounts {dir}: {mounts:?}");
    }
    the_kind(&ztunnel, "ServiceAccount", ZTUNNEL_SERVICE_ACCOUNT);

    // istio-cni.
    let ds = the_kind(&cni, "DaemonSet", CNI_DAEMONSET);
    assert_eq!(ds["metadata"]["namespace"], ISTIO_NAMESPACE);
    let template = &ds["spec"]["template"];
    assert_eq!(
        template["metadata"]["labels"][CNI_POD_LABEL.0],
        CNI_POD_LABEL.1
    );
    let host_paths: BTreeSet<String> = template["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["hostPath"]["path"].as_str().map(str::to_owned))
        .collect();
    assert!(host_paths.contains(ZDS_SOCKET_DIR), "{host_paths:?}");
    let config = cni
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .expect("istio-cni's ConfigMap");
    assert_eq!(
        config["data"]["EXCLUDE_NAMESPACES"],
        CNI_EXCLUDED_NAMESPACES
    );
    let selectors: Value = serde_yaml::from_str(
        config["data"]["AMBIENT_ENABLEMENT_SELECTOR"]
            .as_str()
            .expect("a YAML string"),
    )
    .expect("YAML");
    let recorded: Value = serde_json::from_str(CNI_ENABLEMENT_SELECTORS).expect("JSON");
    assert_eq!(selectors, recorded);
    let mut granted = BTreeSet::new();
    for role in cni.iter().filter(|o| o["kind"] == "ClusterRole") {
        for rule in role["rules"].as_array().into_iter().flatten() {
            for group in rule["apiGroups"].as_array().into_iter().flatten() {
                for resource in rule["resources"].as_array().into_iter().flatten() {
                    for verb in rule["verbs"].as_array().into_iter().flatten() {
                        granted.insert((
                            group.as_str().unwrap_or_default().to_string(),
                            resource.as_str().unwrap_or_default().to_string(),
                            verb.as_str().unwrap_or_default().to_string(),
                        ));
                    }
                }
            }
        }
    }
    assert_eq!(granted, cni_grants(), "istio-cni's ClusterRoles");

    // shunt's Istio-mode objects never take a name of theirs, but the
    // service account istiod trusts (which is why docs/ISTIO.md uninstalls
    // ztunnel's chart first: Helm will not adopt another release's object).
    let theirs: BTreeSet<(String, String, String)> = ztunnel
        .iter()
        .chain(&cni)
        .map(|o| {
            (
                o["kind"].as_str().unwrap_or_default().to_string(),
                o["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect();
    let shared: Vec<_> = shunt_istio(&[])
        .iter()
        .map(kustomize::key)
        .filter(|k| theirs.contains(k))
        .collect();
    assert_eq!(
        shared,
        [(
            "ServiceAccount".to_string(),
            ISTIO_NAMESPACE.to_string(),
            ZTUNNEL_SERVICE_ACCOUNT.to_string()
        )]
    );
}
