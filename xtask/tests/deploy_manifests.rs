//! deploy/ checked without a cluster (no API server or container engine runs
//! here): every manifest parses into the typed Kubernetes objects with
//! unknown fields rejected, and the DaemonSet, RBAC, ConfigMap, samples,
//! Dockerfile and kind config agree with what the agent's code needs and
//! does. The expectations are read from the code where they live (flags from
//! userspace/src/cli.rs, ports from common/src/ports.rs, API calls from
//! userspace/src/control/kube/, names from xtask/src/run.rs), so a change
//! there that deploy/ does not follow fails here.
//!
//! deploy/base/ is checked file by file (below) and as `kubectl kustomize`
//! builds it; the Istio overlay deploy/istio/ as kubectl kustomize builds it
//! (deploy_manifests/istio.rs); the Helm chart deploy/helm/shunt rendered by
//! the real Helm and compared object by object with both
//! (deploy_manifests/chart.rs). Everything built or rendered is validated
//! against the Kubernetes schemas of every supported release
//! (deploy_manifests/schemas.rs). The tools are the pinned ones `cargo xtask
//! setup` links under .tools/.

// This file is the test crate's root, so its modules are named by path.
#[path = "deploy_manifests/chart.rs"]
mod chart;
#[path = "deploy_manifests/helm.rs"]
mod helm;
#[path = "deploy_manifests/istio.rs"]
mod istio;
#[path = "deploy_manifests/istio_charts.rs"]
mod istio_charts;
#[path = "deploy_manifests/kustomize.rs"]
mod kustomize;
#[path = "deploy_manifests/schemas.rs"]
mod schemas;
#[path = "deploy_manifests/ztunnel.rs"]
mod ztunnel;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
};

use k8s_openapi::{
    Resource,
    api::{
        apps::v1::{DaemonSet, Deployment},
        core::v1::{
            ConfigMap, Container, Namespace, PodSpec, ResourceQuota, Service, ServiceAccount,
            Volume, VolumeMount,
        },
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;

// ------------------------------------------------------------------ files

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn read(relative: &str) -> String {
    let path = root().join(relative);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every `.rs` file under `dir` (relative to the workspace), with its text.
fn rust_sources(dir: &str) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut todo = vec![root().join(dir)];
    while let Some(dir) = todo.pop() {
        for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = fs::read_to_string(&path).expect("read source");
                out.push((path, text));
            }
        }
    }
    out.sort();
    out
}

/// Every YAML file under deploy/, relative to deploy/.
fn deploy_yaml_files() -> Vec<PathBuf> {
    let base = root().join("deploy");
    let mut out = Vec::new();
    let mut todo = vec![base.clone()];
    while let Some(dir) = todo.pop() {
        for entry in fs::read_dir(&dir).expect("read deploy/") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(
                    path.strip_prefix(&base)
                        .expect("under deploy")
                        .to_path_buf(),
                );
            }
        }
    }
    out.sort();
    out
}

/// The value of `const NAME: T = value;` in a Rust source, unquoted.
fn rust_const(source: &str, name: &str) -> String {
    let needle = format!("const {name}:");
    let at = source
        .find(&needle)
        .unwrap_or_else(|| panic!("no `const {name}` in the source"));
    let rest = &source[at..];
    let value =
        rest[rest.find('=').expect("const value") + 1..rest.find(';').expect("const end")].trim();
    value.trim_matches('"').to_string()
}

/// The value of `const NAME: &str = r#"value"#;` in a Rust source.
fn rust_const_raw(source: &str, name: &str) -> String {
    let value = rust_const(source, name);
    value
        .strip_prefix("r#\"")
        .and_then(|v| v.strip_suffix("\"#"))
        .unwrap_or_else(|| panic!("`const {name}` is not a r#\"...\"# string"))
        .to_string()
}

/// The string literals of `const NAME: &[&str] = &[...];` in `source`.
fn rust_str_array(source: &str, name: &str) -> Vec<String> {
    let needle = format!("const {name}:");
    let at = source
        .find(&needle)
        .unwrap_or_else(|| panic!("no `const {name}` in the source"));
    let rest = &source[at..];
    let start = rest.find('=').expect("array value");
    let body = &rest[start..rest.find("];").expect("array end")];
    body.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

// ------------------------------------------------------- strict parsing

/// Paths present in `original` but missing or different in `typed` (the
/// object the typed struct re-serialises): fields the type does not know
/// (k8s-openapi ignores them when deserialising) or values it changed.
fn dropped_fields(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                let here = format!("{path}.{key}");
                match b.get(key) {
                    Some(other) => dropped_fields(value, other, &here, out),
                    None => out.push(format!("{here} (unknown field)")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                dropped_fields(x, y, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: written {a}, understood as {b}")),
    }
}

/// Deserialises `value` as `T`, rejecting anything `T` does not carry.
fn strict<T: DeserializeOwned + Serialize>(value: &Value) -> Result<T, String> {
    let typed: T = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut problems = Vec::new();
    dropped_fields(value, &back, "", &mut problems);
    if problems.is_empty() {
        Ok(typed)
    } else {
        Err(problems.join("; "))
    }
}

/// The Kubernetes objects deploy/ may contain.
#[derive(Clone, Debug, PartialEq)]
enum Object {
    Namespace(Namespace),
    ServiceAccount(ServiceAccount),
    ConfigMap(ConfigMap),
    Service(Service),
    DaemonSet(DaemonSet),
    Deployment(Deployment),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
    ResourceQuota(ResourceQuota),
}

fn is<T: Resource>(api_version: &str, kind: &str) -> bool {
    api_version == T::API_VERSION && kind == T::KIND
}

fn parse_object(value: &Value) -> Result<Object, String> {
    let api_version = value["apiVersion"].as_str().unwrap_or_default();
    let kind = value["kind"].as_str().unwrap_or_default();
    let (v, k) = (api_version, kind);
    Ok(if is::<Namespace>(v, k) {
        Object::Namespace(strict(value)?)
    } else if is::<ServiceAccount>(v, k) {
        Object::ServiceAccount(strict(value)?)
    } else if is::<ConfigMap>(v, k) {
        Object::ConfigMap(strict(value)?)
    } else if is::<Service>(v, k) {
        Object::Service(strict(value)?)
    } else if is::<DaemonSet>(v, k) {
        Object::DaemonSet(strict(value)?)
    } else if is::<Deployment>(v, k) {
        Object::Deployment(strict(value)?)
    } else if is::<ClusterRole>(v, k) {
        Object::ClusterRole(strict(value)?)
    } else if is::<ClusterRoleBinding>(v, k) {
        Object::ClusterRoleBinding(strict(value)?)
    } else if is::<ResourceQuota>(v, k) {
        Object::ResourceQuota(strict(value)?)
    } else {
        return Err(format!(
            "{api_version}/{kind} is not a kind this test knows; add it to `Object`"
        ));
    })
}

/// The YAML documents of a file, as JSON values (empty documents skipped).
fn yaml_documents(relative: &Path) -> Vec<Value> {
    let text = read(&format!("deploy/{}", relative.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("deploy/{}: not YAML: {e}", relative.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn is_kustomization(relative: &Path) -> bool {
    relative
        .file_name()
        .is_some_and(|n| n == "kustomization.yaml")
}

const KIND_CONFIG: &str = "kind/cluster.yaml";
/// The Istio overlay: a kustomization and its patches (checked as kustomize
/// builds it, in deploy_manifests/istio.rs).
const ISTIO_OVERLAY: &str = "istio";
/// The overlay beside a stock ztunnel (deploy_manifests/ztunnel.rs).
const ZTUNNEL_OVERLAY: &str = "ztunnel";
/// The Helm chart: templates, not manifests (deploy_manifests/chart.rs).
const HELM_CHART: &str = "helm/shunt";

/// Whether a YAML file of deploy/ holds Kubernetes objects as they are
/// applied (not a kustomization, a patch, a chart file or the kind config).
fn is_manifest(relative: &Path) -> bool {
    !is_kustomization(relative)
        && relative != Path::new(KIND_CONFIG)
        && !relative.starts_with(ISTIO_OVERLAY)
        && !relative.starts_with(ZTUNNEL_OVERLAY)
        && !relative.starts_with("helm")
}

/// Every Kubernetes object in deploy/'s manifests, by file. Panics naming
/// every file that does not parse strictly.
fn objects() -> BTreeMap<PathBuf, Vec<Object>> {
    let mut out = BTreeMap::new();
    let mut problems = Vec::new();
    for file in deploy_yaml_files() {
        if !is_manifest(&file) {
            continue;
        }
        let mut objects = Vec::new();
        for (i, doc) in yaml_documents(&file).iter().enumerate() {
            match parse_object(doc) {
                Ok(object) => objects.push(object),
                Err(e) => problems.push(format!("deploy/{} document {i}: {e}", file.display())),
            }
        }
        out.insert(file, objects);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    out
}

/// The objects of the agent's own manifests (deploy/base/; not the
/// samples).
fn all_objects() -> Vec<Object> {
    objects()
        .into_iter()
        .filter(|(file, _)| file.starts_with("base"))
        .flat_map(|(_, o)| o)
        .collect()
}

fn the_one<T>(what: &str, found: Vec<T>) -> T {
    assert_eq!(found.len(), 1, "expected exactly one {what} in deploy/");
    found.into_iter().next().expect("one")
}

fn daemonset_in(objects: &[Object]) -> DaemonSet {
    the_one(
        "DaemonSet",
        objects
            .iter()
            .filter_map(|o| match o {
                Object::DaemonSet(d) => Some(d.clone()),
                _ => None,
            })
            .collect(),
    )
}

fn pod_spec(ds: &DaemonSet) -> PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .expect("the DaemonSet has a pod spec")
}

fn agent_container(spec: &PodSpec) -> Container {
    spec.containers
        .iter()
        .find(|c| c.name == "agent")
        .cloned()
        .expect("a container named `agent`")
}

// ------------------------------------------------- YAML 1.1 ambiguities

/// Plain scalars that YAML 1.2 (serde_yaml, this test) and YAML 1.1
/// (kubectl's parser) read differently: `on`/`off`/`yes`/`no`/`y`/`n` are
/// strings to one and booleans to the other, `0400` is decimal to one and
/// octal to the other. Such a value must be quoted (or written in decimal).
fn yaml11_pitfalls(text: &str) -> Vec<String> {
    const BOOLEANISH: &[&str] = &["y", "yes", "n", "no", "on", "off"];
    let mut out = Vec::new();
    let mut block_indent: Option<usize> = None;
    for (n, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        if let Some(block) = block_indent {
            if line.trim().is_empty() || indent > block {
                continue; // inside a literal block scalar
            }
            block_indent = None;
        }
        let content = line.trim();
        if content.starts_with('#') {
            continue;
        }
        let content = content.split(" #").next().unwrap_or_default().trim_end();
        if content.ends_with('|')
            || content.ends_with('>')
            || content.ends_with("|-")
            || content.ends_with(">-")
        {
            block_indent = Some(indent);
            continue;
        }
        let value = match content.split_once(": ") {
            Some((_, v)) => v,
            None => content.strip_prefix("- ").unwrap_or_default(),
        };
        let value = value.trim().trim_start_matches('[').trim_end_matches(']');
        for token in value.split(',').map(str::trim) {
            let plain = !token.starts_with('"') && !token.starts_with('\'');
            let boolean = BOOLEANISH.contains(&token.to_ascii_lowercase().as_str());
            let octal = token.len() > 1
                && token.starts_with('0')
                && token.chars().all(|c| c.is_ascii_digit());
            if plain && (boolean || octal) {
                out.push(format!("line {}: {token}", n + 1));
            }
        }
    }
    out
}

// ================================================================== tests

#[test]
fn every_manifest_parses_strictly_into_typed_objects() {
    let files = deploy_yaml_files();
    assert!(!files.is_empty(), "deploy/ has no manifests");
    let objects = objects();
    for (file, found) in &objects {
        assert!(
            !found.is_empty(),
            "deploy/{} holds no object",
            file.display()
        );
    }
    // Each kustomization as kubectl reads it (kustomize refuses a field it
    // does not know), its output valid against the Kubernetes schemas and
    // parsed strictly (kustomize.rs).
    for file in files.iter().filter(|f| is_kustomization(f)) {
        let dir = file.parent().expect("in a directory");
        let built = kustomize::build(dir.to_str().expect("UTF-8 path"));
        assert!(
            !built.is_empty(),
            "deploy/{} builds nothing",
            file.display()
        );
    }
    // The chart's Chart.yaml and values files are YAML maps; its templates
    // are YAML only once rendered (chart.rs).
    let templates = Path::new(HELM_CHART).join("templates");
    for file in files
        .iter()
        .filter(|f| f.starts_with(HELM_CHART) && !f.starts_with(&templates))
    {
        let doc = the_one("document", yaml_documents(file));
        assert!(doc.is_object(), "deploy/{}: a map", file.display());
    }

    // What kubectl (YAML 1.1) would read differently from this test.
    let mut pitfalls = Vec::new();
    for file in &files {
        for p in yaml11_pitfalls(&read(&format!("deploy/{}", file.display()))) {
            pitfalls.push(format!("deploy/{}: {p}", file.display()));
        }
    }
    assert!(
        pitfalls.is_empty(),
        "quote these (YAML 1.1 reads them as booleans or octal):\n{}",
        pitfalls.join("\n")
    );
}

#[test]
fn the_strict_parser_catches_unknown_fields_and_yaml11_pitfalls() {
    let file = Path::new("base/daemonset.yaml");
    let mut doc = the_one("document", yaml_documents(file));
    strict::<DaemonSet>(&doc).expect("the real DaemonSet parses");
    doc["spec"]["template"]["spec"]["hostPid"] = Value::Bool(true);
    let err = strict::<DaemonSet>(&doc).expect_err("a misspelt field is rejected");
    assert!(err.contains(".spec.template.spec.hostPid"), "{err}");
    // kubectl's kustomize refuses a kustomization field it does not know.
    let dir = std::env::temp_dir().join(format!("shunt-kustomization-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("temp dir");
    fs::write(
        dir.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\ncommonLabel: {}\n",
    )
    .expect("write");
    let err = kustomize::try_build(&dir).expect_err("an unknown field");
    let _ = fs::remove_dir_all(&dir);
    assert!(err.contains("commonLabel"), "{err}");
    assert_eq!(
        yaml11_pitfalls("a: on\nb: \"off\"\nc: 0400\nd: 256\ne: [yes, \"no\"]\nf: |\n  on\n"),
        vec!["line 1: on", "line 3: 0400", "line 5: yes"]
    );
}

/// `a/../b` as `b` (kustomize resolves resources relative to the
/// kustomization's directory).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                assert!(out.pop(), "{} leaves deploy/", path.display());
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn kustomizations_list_exactly_their_manifests() {
    let files = deploy_yaml_files();
    let objects = objects();
    for kustomization in files.iter().filter(|f| is_kustomization(f)) {
        let dir = kustomization.parent().expect("parent").to_path_buf();
        // kubectl checks its fields (every_manifest_parses_strictly...);
        // this reads the lists it names.
        let k = the_one("document", yaml_documents(kustomization));
        assert_eq!(k["kind"], "Kustomization");
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        };
        let resources = strings(&k["resources"]);
        let patches: Vec<String> = k["patches"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["path"].as_str().map(str::to_owned))
            .collect();
        // Each resource is a file beside the kustomization or a directory
        // with its own; each patch a file beside it; and every YAML file
        // beside it is one of them (nothing written there is left out).
        let mut listed = BTreeSet::new();
        for resource in &resources {
            let path = normalize(&dir.join(resource));
            if root().join("deploy").join(&path).is_dir() {
                assert!(
                    files.contains(&path.join("kustomization.yaml")),
                    "deploy/{}: resource {resource} is a directory without a kustomization",
                    kustomization.display()
                );
            } else {
                listed.insert(path);
            }
        }
        for patch in &patches {
            listed.insert(normalize(&dir.join(patch)));
        }
        let present: BTreeSet<PathBuf> = files
            .iter()
            .filter(|f| {
                f.parent() == Some(dir.as_path())
                    && !is_kustomization(f)
                    && f.as_path() != Path::new(KIND_CONFIG)
            })
            .cloned()
            .collect();
        assert_eq!(
            listed,
            present,
            "deploy/{}: resources and patches must be exactly the files beside it",
            kustomization.display()
        );
        // A kustomization of manifests puts every object in its namespace,
        // which one of its manifests creates. (The Istio overlay creates
        // none: istio.rs.)
        let manifests: Vec<&PathBuf> = listed.iter().filter(|f| is_manifest(f)).collect();
        if manifests.is_empty() {
            continue;
        }
        let namespace = k["namespace"]
            .as_str()
            .expect("the kustomization sets a namespace")
            .to_owned();
        let mut created = false;
        for file in manifests {
            for object in &objects[file] {
                let (meta, namespaced) = match object {
                    Object::Namespace(n) => {
                        created |= n.metadata.name.as_deref() == Some(namespace.as_str());
                        (&n.metadata, false)
                    }
                    Object::ClusterRole(r) => (&r.metadata, false),
                    Object::ClusterRoleBinding(b) => (&b.metadata, false),
                    Object::ServiceAccount(o) => (&o.metadata, true),
                    Object::ConfigMap(o) => (&o.metadata, true),
                    Object::Service(o) => (&o.metadata, true),
                    Object::DaemonSet(o) => (&o.metadata, true),
                    Object::Deployment(o) => (&o.metadata, true),
                    Object::ResourceQuota(o) => (&o.metadata, true),
                };
                if namespaced {
                    assert_eq!(
                        meta.namespace.as_deref(),
                        Some(namespace.as_str()),
                        "{:?} in deploy/{}: the kustomization's namespace, written out so \
                         that `kubectl apply -f` of the file alone agrees",
                        meta.name,
                        file.display()
                    );
                }
            }
        }
        assert!(
            created,
            "no manifest beside deploy/{} creates namespace {namespace}",
            kustomization.display()
        );
    }
}

// ------------------------------------------------ the agent's command line

/// One flag of `shunt agent`, read from the clap derive in cli.rs.
#[derive(Clone, Debug)]
struct Flag {
    /// Type name without path or `Option<>`.
    ty: String,
    env: Option<String>,
    default: Option<String>,
    optional: bool,
}

/// `CamelCase` (a field or variant) in clap's kebab-case.
fn kebab(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else if c == '_' {
            out.push('-');
        } else {
            out.push(c);
        }
    }
    out
}

/// The text of `key = "value"` in an attribute, if any.
fn attr_value(attr: &str, key: &str) -> Option<String> {
    let at = attr.find(&format!("{key} ="))?;
    let rest = &attr[at..];
    let rest = rest[rest.find('=')? + 1..].trim_start();
    if let Some(quoted) = rest.strip_prefix('"') {
        return Some(quoted[..quoted.find('"')?].to_string());
    }
    let end = rest.find([',', ')']).unwrap_or(rest.len());
    Some(rest[..end].trim().to_string())
}

/// The fields of `pub struct NAME { ... }` in `source`, with their
/// attributes: (attributes, field name, type).
fn struct_fields(source: &str, name: &str) -> Vec<(String, String, String)> {
    let start = source
        .find(&format!("pub struct {name} {{"))
        .unwrap_or_else(|| panic!("no `pub struct {name}` in cli.rs"));
    let body = &source[start..];
    let body = &body[body.find('{').expect("{") + 1..body.find("\n}").expect("}")];
    let mut out = Vec::new();
    let mut attrs = String::new();
    let mut depth = 0i32;
    for line in body.lines().map(str::trim) {
        if depth > 0 || line.starts_with("#[") {
            attrs.push_str(line);
            attrs.push(' ');
            depth += line.matches('(').count() as i32 - line.matches(')').count() as i32;
            continue;
        }
        if let Some(field) = line.strip_prefix("pub ") {
            let (field, ty) = field.split_once(':').expect("field: type");
            out.push((
                std::mem::take(&mut attrs),
                field.trim().to_string(),
                ty.trim().trim_end_matches(',').to_string(),
            ));
        }
    }
    out
}

/// Every flag of `shunt agent`, by `--name`.
fn agent_flags() -> BTreeMap<String, Flag> {
    let cli = read("userspace/src/cli.rs");
    let mut out = BTreeMap::new();
    let mut structs = vec!["AgentArgs".to_string()];
    while let Some(name) = structs.pop() {
        for (attrs, field, ty) in struct_fields(&cli, &name) {
            if attrs.contains("flatten") {
                structs.push(ty);
                continue;
            }
            if !attrs.contains("#[arg(") || !attrs.contains("long") {
                panic!("cli.rs {name}.{field}: not a --long flag; teach this test about it");
            }
            let long = attr_value(&attrs, "long").unwrap_or_else(|| kebab(&field));
            let optional = ty.starts_with("Option<");
            let bare = ty
                .strip_prefix("Option<")
                .and_then(|t| t.strip_suffix('>'))
                .unwrap_or(&ty);
            let bare = bare.rsplit("::").next().unwrap_or(bare).to_string();
            let default = attr_value(&attrs, "default_value")
                .or_else(|| attr_value(&attrs, "default_value_t"));
            out.insert(
                format!("--{long}"),
                Flag {
                    ty: bare,
                    env: attr_value(&attrs, "env"),
                    default,
                    optional,
                },
            );
        }
    }
    out
}

/// The values clap accepts for a `ValueEnum` named `name` (its variants in
/// kebab-case), if the agent's sources define such an enum.
fn enum_values(name: &str) -> Option<Vec<String>> {
    for (_, source) in rust_sources("userspace/src") {
        let Some(start) = source.find(&format!("pub enum {name} {{")) else {
            continue;
        };
        let body = &source[start..];
        let body = &body[body.find('{')? + 1..body.find('}')?];
        let mut values = Vec::new();
        let mut renamed = None;
        for line in body.lines().map(str::trim) {
            if line.starts_with("#[value(") {
                renamed = attr_value(line, "name");
            }
            if line.is_empty() || line.starts_with("//") || line.starts_with('#') {
                continue;
            }
            let ident: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !ident.is_empty() {
                values.push(renamed.take().unwrap_or_else(|| kebab(&ident)));
            }
        }
        return Some(values);
    }
    None
}

/// Whether clap would accept `value` for a flag of type `ty`.
fn check_value(flag: &str, ty: &str, value: &str) -> Result<(), String> {
    let ok = match ty {
        "String" => !value.is_empty(),
        // A comma-separated list (`value_delimiter = ','`); empty: none.
        "Vec<String>" => true,
        // state::TrustDomain: a DNS-like name.
        "TrustDomain" => {
            !value.is_empty()
                && value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
        }
        "PathBuf" => value.starts_with('/'),
        "Ipv4Addr" => value.parse::<Ipv4Addr>().is_ok(),
        "SocketAddr" => value.parse::<SocketAddr>().is_ok(),
        "u64" | "u32" | "u16" | "usize" => value.parse::<u64>().is_ok(),
        "bool" => matches!(value, "true" | "false"),
        other => match enum_values(other) {
            Some(values) => {
                if !values.iter().any(|v| v == value) {
                    return Err(format!("{flag}={value}: not one of {}", values.join(", ")));
                }
                true
            }
            None => return Err(format!("{flag}: type {other} is unknown to this test")),
        },
    };
    if ok {
        Ok(())
    } else {
        Err(format!("{flag}={value}: not a valid {ty}"))
    }
}

/// The agent's flags as the DaemonSet sets them (every setting is a literal
/// argument: no `$(VAR)` for the kubelet to expand), each checked against
/// the CLI; then the defaults of the rest. Returns the effective value of
/// every flag that has one.
fn effective_agent_args(container: &Container) -> BTreeMap<String, String> {
    let flags = agent_flags();
    let env = container.env.clone().unwrap_or_default();
    assert!(
        container.command.is_none(),
        "the image's entrypoint (the shunt binary, deploy/Dockerfile) runs the agent; args only"
    );
    let args = container
        .args
        .clone()
        .expect("the agent container has args");
    assert_eq!(
        args.first().map(String::as_str),
        Some("agent"),
        "`shunt agent`"
    );
    let mut problems = Vec::new();
    let mut given = BTreeMap::new();
    let mut i = 1;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let (name, value) = match arg.split_once('=') {
            Some((name, value)) => (name.to_string(), Some(value.to_string())),
            None => (arg.clone(), None),
        };
        let Some(flag) = flags.get(&name) else {
            problems.push(format!(
                "{name}: `shunt agent` has no such flag (userspace/src/cli.rs)"
            ));
            continue;
        };
        let value = match value {
            Some(v) => v,
            None if flag.ty == "bool" => "true".to_string(),
            None => {
                i += 1;
                args.get(i - 1).cloned().unwrap_or_default()
            }
        };
        if value.contains("$(") {
            problems.push(format!(
                "{name}={value}: a setting is written out, not a $(VAR) for the kubelet"
            ));
        }
        if let Err(e) = check_value(&name, &flag.ty, &value) {
            problems.push(e);
        }
        if given.insert(name.clone(), value).is_some() {
            problems.push(format!("{name} given twice"));
        }
    }
    // Flags not given: from their env var, else their default; a flag with
    // neither that is not optional would make clap refuse to start.
    for (name, flag) in &flags {
        if given.contains_key(name) {
            continue;
        }
        if let Some(var) = &flag.env
            && env.iter().any(|e| &e.name == var)
        {
            continue; // checked by the env test
        }
        match &flag.default {
            Some(default) if !default.contains("::") => {
                given.insert(name.clone(), default.clone());
            }
            Some(_) => {} // an enum default: valid by construction
            None if flag.optional || flag.ty == "bool" => {}
            None => problems.push(format!(
                "{name} is required by `shunt agent` and the DaemonSet sets it neither as a flag nor through {}",
                flag.env.as_deref().unwrap_or("an env var")
            )),
        }
    }
    assert!(problems.is_empty(), "agent args:\n{}", problems.join("\n"));
    given
}

#[test]
fn daemonset_args_are_flags_the_agent_accepts_with_valid_values() {
    check_args(&all_objects());
}

/// The DaemonSet's flags are the agent's,
/// with valid values; the ports those flags open are the contract's.
fn check_args(objects: &[Object]) {
    let ds = daemonset_in(objects);
    let spec = pod_spec(&ds);
    let args = effective_agent_args(&agent_container(&spec));
    // The contract's loopback-only admin API, and metrics/readiness on
    // every address of the agent's own pod netns (its pod IP: the kubelet
    // and Prometheus come from outside).
    let admin: SocketAddr = args["--admin-addr"].parse().expect("admin addr");
    assert!(
        admin.ip().is_loopback(),
        "the admin API stays on loopback: {admin}"
    );
    for (flag, port) in [
        ("--metrics-addr", "PORT_METRICS"),
        ("--readiness-addr", "PORT_READINESS"),
    ] {
        let Some(addr) = args.get(flag) else {
            continue; // the agent has no such flag: ports are checked below
        };
        let addr: SocketAddr = addr.parse().expect("addr");
        assert!(
            addr.ip().is_unspecified(),
            "{flag} must listen on every address: {addr}"
        );
        assert_eq!(addr.port(), contract_port(port), "{flag}");
    }
}

/// A port constant of the contract, from common/src/ports.rs.
fn contract_port(name: &str) -> u16 {
    rust_const(&read("common/src/ports.rs"), name)
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

// ------------------------------------------------- what the agent needs

fn volume<'a>(spec: &'a PodSpec, name: &str) -> &'a Volume {
    spec.volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("volume {name} is mounted but not defined"))
}

fn host_path(spec: &PodSpec, mount: &VolumeMount) -> Option<String> {
    volume(spec, &mount.name)
        .host_path
        .as_ref()
        .map(|h| h.path.clone())
}

/// The container's mount of the host path `path`.
fn host_mount(spec: &PodSpec, container: &Container, path: &str) -> VolumeMount {
    container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| host_path(spec, m).as_deref() == Some(path))
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "container {} does not mount the host's {path}",
                container.name
            )
        })
}

/// Capabilities the agent container gets, and why (the DaemonSet's comments
/// say the same): BPF (programs, maps, pins), PERFMON (the verifier's full
/// mode with BPF), NET_ADMIN (TC filters, cgroup/sockops attach, iptables,
/// SO_MARK, IP_TRANSPARENT), SYS_ADMIN (setns into pods' netns, BPF object
/// IDs, mounting bpffs), SYS_PTRACE (/proc/PID/ns/net of other
/// containers), NET_RAW (iptables-legacy).
const AGENT_CAPABILITIES: &[&str] = &[
    "BPF",
    "PERFMON",
    "NET_ADMIN",
    "SYS_ADMIN",
    "SYS_PTRACE",
    "NET_RAW",
];

#[test]
fn daemonset_gives_the_agent_what_it_needs() {
    check_agent_needs(&all_objects());
}

/// Host namespaces, capabilities, mounts, CA, env, ports, probes and
/// scheduling of the DaemonSet among `objects`, checked against the code.
fn check_agent_needs(objects: &[Object]) {
    let ds = daemonset_in(objects);
    let spec = pod_spec(&ds);
    let agent = agent_container(&spec);
    let args = effective_agent_args(&agent);

    // Host namespaces: the host's PIDs for /proc scanning for pods' netns;
    // not the host's network (the agent's ports are its pod's, see
    // check_rolling_update), so the pod's own cluster DNS policy.
    assert_eq!(
        spec.host_pid,
        Some(true),
        "hostPID: netns discovery scans /proc"
    );
    assert_ne!(
        spec.host_network,
        Some(true),
        "no hostNetwork: the agent runs in its own pod netns"
    );
    assert!(
        spec.dns_policy
            .as_deref()
            .is_none_or(|p| p == "ClusterFirst"),
        "a pod-network pod resolves cluster names with ClusterFirst: {:?}",
        spec.dns_policy
    );
    // An ordinary pod now: it must never be captured as a mesh workload.
    let template_labels = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    assert_eq!(
        template_labels
            .get("istio.io/dataplane-mode")
            .map(String::as_str),
        Some("none"),
        "the agent pod opts out of the mesh"
    );
    assert!(
        rust_sources("userspace/src/control/kube")
            .iter()
            .any(|(_, s)| s.contains("/ns/net")),
        "the kube source finds netns through /proc/PID/ns/net (why hostPID)"
    );

    // Privileges: explicit capabilities, not privileged.
    let sc = agent
        .security_context
        .clone()
        .expect("agent securityContext");
    assert_ne!(
        sc.privileged,
        Some(true),
        "the agent gets capabilities, not privileged"
    );
    assert_ne!(
        sc.allow_privilege_escalation,
        Some(false),
        "the API rejects allowPrivilegeEscalation=false with CAP_SYS_ADMIN"
    );
    assert!(
        matches!(sc.run_as_user, None | Some(0)),
        "root: the capabilities are root's"
    );
    let caps = sc.capabilities.clone().expect("capabilities");
    assert_eq!(
        caps.drop,
        Some(vec!["ALL".to_string()]),
        "drop everything else"
    );
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(added, AGENT_CAPABILITIES.iter().copied().collect());

    // bpffs: the node's, so pins outlive the agent; the pin dir under it.
    let bpffs = host_mount(&spec, &agent, "/sys/fs/bpf");
    assert_eq!(
        bpffs.mount_path, "/sys/fs/bpf",
        "the agent's bpffs fallback expects /sys/fs/bpf"
    );
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("HostToContainer"));
    assert_ne!(bpffs.read_only, Some(true), "pins are written");
    assert!(
        Path::new(&args["--bpf-pin-dir"]).starts_with(&bpffs.mount_path),
        "--bpf-pin-dir {} lies on the node's bpffs",
        args["--bpf-pin-dir"]
    );
    // ... which the privileged init container mounts on the node if missing.
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "mount-bpffs")
        .expect("an init container mounting bpffs");
    let init_mount = host_mount(&spec, init, "/sys/fs/bpf");
    assert_eq!(
        init_mount.mount_propagation.as_deref(),
        Some("Bidirectional")
    );
    assert!(
        init.args
            .iter()
            .flatten()
            .any(|a| a.contains("mount -t bpf bpf /sys/fs/bpf")),
        "the init container mounts bpffs"
    );

    // The node's cgroup v2 root is where the socket programs attach.
    let cgroup = host_mount(&spec, &agent, "/sys/fs/cgroup");
    assert_eq!(
        args.get("--cgroup-root"),
        Some(&cgroup.mount_path),
        "--cgroup-root must name the node's cgroup mount (the agent's own default is the container's)"
    );

    // The container runtime's named netns, with later mounts propagated.
    let netns = host_mount(&spec, &agent, "/var/run/netns");
    assert_eq!(netns.mount_propagation.as_deref(), Some("HostToContainer"));

    // The runtime sockets the agent auto-detects (no --cri-socket given)
    // are where the host has them: each one's directory mounted at its own
    // path, as a directory (a restarted runtime makes a new socket file).
    assert!(
        !args.contains_key("--cri-socket"),
        "the agent auto-detects containerd or CRI-O"
    );
    let cri = read("userspace/src/control/kube/cri.rs");
    let sockets = rust_str_array(&cri, "DEFAULT_SOCKETS");
    assert!(
        sockets.iter().any(|s| s.contains("containerd"))
            && sockets.iter().any(|s| s.contains("crio")),
        "{sockets:?}"
    );
    for socket in &sockets {
        let dir = Path::new(socket)
            .parent()
            .and_then(Path::to_str)
            .expect("socket directory");
        let mount = host_mount(&spec, &agent, dir);
        assert_eq!(mount.mount_path, dir, "{socket} seen at its own path");
        assert_eq!(mount.read_only, Some(true), "{socket}: read-only is enough");
        assert_eq!(
            volume(&spec, &mount.name)
                .host_path
                .as_ref()
                .and_then(|h| h.type_.as_deref()),
            Some("DirectoryOrCreate"),
            "{socket}: a node without this runtime still starts the agent"
        );
    }

    // The mesh's CA: the same Secret on every node (the one `cargo xtask
    // run` creates), at --ca-dir; none beside ztunnel, which gets its
    // certificates from istiod (shunt's CA is never built in that mode, and a
    // Secret nobody creates would keep the pods ContainerCreating).
    if args.get("--proxy").is_some_and(|p| p == "ztunnel") {
        let secrets: Vec<&str> = spec
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.secret.as_ref())
            .filter_map(|s| s.secret_name.as_deref())
            .collect();
        assert!(
            secrets.is_empty(),
            "--proxy ztunnel mounts no Secret: {secrets:?}"
        );
    } else if args["--ca"] == "builtin" {
        let ca_dir = &args["--ca-dir"];
        let mount = agent
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| &m.mount_path == ca_dir)
            .unwrap_or_else(|| panic!("nothing mounted at --ca-dir {ca_dir}"));
        let secret = volume(&spec, &mount.name)
            .secret
            .as_ref()
            .expect("--ca-dir is a Secret, shared by every node's agent");
        assert_eq!(
            secret.secret_name.as_deref(),
            Some(rust_const(&read("xtask/src/run.rs"), "CA_SECRET").as_str())
        );
        assert_ne!(secret.optional, Some(true));
        assert_eq!(mount.read_only, Some(true));
    } else {
        // istiod's CA (and its xDS): the mesh root and the token where the
        // flags say.
        assert_eq!(args["--ca"], "istio", "--ca builtin or istio");
        istio::check_istiod_files(&spec, &agent, &args);
    }

    // A read-only root filesystem, so iptables-legacy's lock goes to a
    // writable mount.
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let env = agent.env.clone().unwrap_or_default();
    let lock = env
        .iter()
        .find(|e| e.name == "XTABLES_LOCKFILE")
        .and_then(|e| e.value.clone())
        .expect("XTABLES_LOCKFILE");
    assert!(
        agent.volume_mounts.iter().flatten().any(|m| {
            Path::new(&lock).starts_with(&m.mount_path)
                && m.read_only != Some(true)
                && volume(&spec, &m.name).empty_dir.is_some()
        }),
        "XTABLES_LOCKFILE {lock} is on a writable emptyDir"
    );

    // Every mount has its volume and every volume is mounted; Bidirectional
    // only where the API allows it (privileged containers).
    let containers: Vec<&Container> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .collect();
    let mut mounted = BTreeSet::new();
    for c in &containers {
        let privileged = c
            .security_context
            .as_ref()
            .and_then(|s| s.privileged)
            .unwrap_or(false);
        for m in c.volume_mounts.iter().flatten() {
            volume(&spec, &m.name);
            mounted.insert(m.name.clone());
            if m.mount_propagation.as_deref() == Some("Bidirectional") {
                assert!(
                    privileged,
                    "{}: Bidirectional needs a privileged container",
                    c.name
                );
            }
        }
        let requests = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.clone())
            .unwrap_or_default();
        assert!(
            requests.contains_key("cpu") && requests.contains_key("memory"),
            "{}: cpu and memory requests",
            c.name
        );
        assert_eq!(c.image, agent.image, "{}: the agent's image", c.name);
        assert_eq!(
            c.image_pull_policy.as_deref(),
            Some("IfNotPresent"),
            "{}: kind-loaded images must not be pulled",
            c.name
        );
    }
    for v in spec.volumes.iter().flatten() {
        assert!(
            mounted.contains(&v.name),
            "volume {} is never mounted",
            v.name
        );
    }
    assert_eq!(
        agent.image.as_deref(),
        Some(rust_const(&read("xtask/src/run.rs"), "IMAGE").as_str()),
        "the image `cargo xtask run` builds and loads"
    );

    // NODE_NAME from the downward API, where clap reads --node-name.
    let flags = agent_flags();
    let node_var = flags["--node-name"]
        .env
        .clone()
        .expect("--node-name has an env var");
    let node = env
        .iter()
        .find(|e| e.name == node_var)
        .unwrap_or_else(|| panic!("{node_var} is not set"));
    assert_eq!(
        node.value_from
            .as_ref()
            .and_then(|f| f.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );

    // Ports of the contract: metrics and readiness declared on the pod IP
    // (no host port); the readiness probe on its path; Prometheus told
    // where to scrape.
    let metrics = contract_port("PORT_METRICS");
    let readiness = contract_port("PORT_READINESS");
    let ports: BTreeMap<i32, Option<i32>> = agent
        .ports
        .iter()
        .flatten()
        .map(|p| (p.container_port, p.host_port))
        .collect();
    for port in [metrics, readiness] {
        let host_port = ports
            .get(&i32::from(port))
            .unwrap_or_else(|| panic!("port {port} is not declared"));
        assert!(
            host_port.is_none(),
            "port {port}: the pod IP's, not a host port ({host_port:?})"
        );
    }
    assert!(
        !ports.contains_key(&i32::from(contract_port("PORT_ADMIN"))),
        "the admin port is loopback-only: not declared"
    );
    let sources = rust_sources("userspace/src");
    let serves = |route: &str| {
        sources
            .iter()
            .any(|(_, s)| s.contains(&format!(".route(\"{route}\"")))
    };
    let probe = agent
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.clone())
        .expect("an HTTP readiness probe");
    assert_eq!(probe.path.as_deref(), Some("/healthz/ready"));
    assert!(serves("/healthz/ready"), "the agent serves /healthz/ready");
    let probe_port = match &probe.port {
        IntOrString::Int(p) => *p,
        IntOrString::String(name) => agent
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .map(|p| p.container_port)
            .expect("named probe port"),
    };
    assert_eq!(probe_port, i32::from(readiness));
    assert!(
        agent.liveness_probe.is_none(),
        "a liveness restart unenrols the node's pods"
    );
    let annotations = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.clone())
        .and_then(|m| m.annotations)
        .unwrap_or_default();
    assert_eq!(
        annotations.get("prometheus.io/scrape").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        annotations.get("prometheus.io/port"),
        Some(&metrics.to_string())
    );
    assert_eq!(
        annotations.get("prometheus.io/path").map(String::as_str),
        Some("/metrics")
    );
    assert!(serves("/metrics"), "the agent serves /metrics");

    // Every node: tolerate every taint; schedule as node-critical.
    assert!(
        spec.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "a toleration of every taint"
    );
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    // SIGTERM: unenrol, then drain for --drain-seconds, inside the grace period.
    let drain: i64 = args["--drain-seconds"].parse().expect("drain seconds");
    assert!(
        spec.termination_grace_period_seconds.unwrap_or(30) > drain + 5,
        "the grace period leaves room for --drain-seconds"
    );

    // The selector matches the template, and the service account exists.
    let ds_spec = ds.spec.as_ref().expect("spec");
    let labels = ds_spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    for (k, v) in ds_spec.selector.match_labels.iter().flatten() {
        assert_eq!(
            labels.get(k),
            Some(v),
            "selector {k}={v} matches the template"
        );
    }
    let accounts: Vec<String> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ServiceAccount(sa) => sa.metadata.name.clone(),
            _ => None,
        })
        .collect();
    assert!(
        accounts.contains(
            spec.service_account_name
                .as_ref()
                .expect("serviceAccountName")
        )
    );
}

#[test]
fn rolling_update_is_a_surge_without_host_network_or_host_ports() {
    check_rolling_update(&all_objects());
}

fn check_rolling_update(objects: &[Object]) {
    let ds = daemonset_in(objects);
    let spec = pod_spec(&ds);
    let strategy = ds
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.clone())
        .expect("an update strategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.expect("rollingUpdate");
    // A surge, one node at a time: the new agent pod starts beside the old
    // one and is ready before the old one is stopped (maxSurge 1,
    // maxUnavailable 0), so a node never lacks a proxy during an update
    // (tests/tests/handover.rs runs that sequence in the pod layout).
    assert_eq!(
        rolling.max_surge,
        Some(IntOrString::Int(1)),
        "maxSurge: 1 (a surge pod per node, one node at a time)"
    );
    assert_eq!(
        rolling.max_unavailable,
        Some(IntOrString::Int(0)),
        "maxUnavailable: 0 (the old agent stays until the new one is ready)"
    );
    // The surge pod runs beside the old one on the same node: a host port
    // (every container port under hostNetwork) would keep it from being
    // scheduled and the rollout would never finish
    // (kubernetes/kubernetes#106417).
    assert_ne!(
        spec.host_network,
        Some(true),
        "hostNetwork makes every container port a host port: the surge pod could never be scheduled"
    );
    let host_ports: Vec<String> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| {
            c.ports
                .iter()
                .flatten()
                .filter(|p| p.host_port.is_some())
                .map(move |p| format!("{}: {:?}", c.name, p.host_port))
        })
        .collect();
    assert!(
        host_ports.is_empty(),
        "host ports keep the surge pod from being scheduled: {host_ports:?}"
    );
}

// ------------------------------------------------------------------ RBAC

/// Every Kubernetes API call the agent makes, as RBAC sees it: (API group,
/// resource, verbs). Where they are in the code:
///
/// - userspace/src/control/kube/mod.rs, `Watches::new`: kube-rs `watcher`s
///   (list, then watch) on pods (`Api::all`, with fieldSelector
///   spec.nodeName=NODE for `KubeSource`; without one for cluster.rs's
///   `ClusterWorkloads`) and on namespaces (`Api::all`);
/// - userspace/src/control/kube/service.rs, `ServiceWatches::new`: kube-rs
///   `watcher`s on services and on discovery.k8s.io endpointslices
///   (`Api::all`), for service discovery;
/// - userspace/src/control/kube/annotate.rs, `patch`: a JSON merge patch of
///   the `ambient.istio.io/redirection` annotation, sent to the pod's status
///   subresource as istio-cni sends it (`Api::<Pod>::namespaced(..)
///   .patch_status`): `patch` on `pods/status`, never on `pods`;
/// - userspace/src/control/kube/policy.rs, `PolicyWatch::new`: a kube-rs
///   `watcher` on Istio's security.istio.io authorizationpolicies
///   (`Api::all`), a resource of the file's own (`impl Resource for`, with
///   `const GROUP` and `const PLURAL`).
/// - userspace/src/control/kube/gateway.rs, `GatewayWatch::new`: a kube-rs
///   `watcher` on gateway.networking.k8s.io gateways (`Api::all`), the
///   waypoint Gateways, a resource of the file's own likewise.
/// - userspace/src/control/kube/exit.rs, `ask`: at SIGTERM with
///   `--on-exit auto`, the agent's own apps DaemonSet and its Node
///   (`Api::get_opt`).
///
/// `rbac_rules_cover_exactly_the_agents_api_calls` checks this list against
/// the code as well as against deploy/rbac.yaml.
///
/// Every mode makes NODE_API_CALLS (this node's pods, namespaces, the
/// annotation, the DaemonSet and Node `--on-exit auto` reads); only the builtin proxy without istiod adds
/// DISCOVERY_API_CALLS (cluster.rs and the watches it runs), so the Istio
/// and ztunnel modes' roles grant the first list alone.
const NODE_API_CALLS: &[(&str, &str, &[&str])] = &[
    ("", "pods", &["get", "list", "watch"]),
    ("", "pods/status", &["patch"]),
    ("", "namespaces", &["get", "list", "watch"]),
    ("apps", "daemonsets", &["get"]),
    ("", "nodes", &["get"]),
];
const DISCOVERY_API_CALLS: &[(&str, &str, &[&str])] = &[
    ("", "services", &["list", "watch"]),
    ("discovery.k8s.io", "endpointslices", &["list", "watch"]),
    (
        "security.istio.io",
        "authorizationpolicies",
        &["list", "watch"],
    ),
    ("gateway.networking.k8s.io", "gateways", &["list", "watch"]),
];
/// The sources of the builtin proxy's cluster-wide discovery
/// (`ClusterWorkloads`, run only with `--proxy builtin` and no
/// `--xds-address`: userspace/src/app/mod.rs).
const DISCOVERY_SOURCES: &[&str] = &["cluster.rs", "service.rs", "policy.rs", "gateway.rs"];

/// (group, resource) of a k8s-openapi type named in the agent's code.
fn api_resource(module: &str, name: &str) -> (String, String) {
    fn of<T: Resource>() -> (String, String) {
        (T::GROUP.to_string(), T::URL_PATH_SEGMENT.to_string())
    }
    use k8s_openapi::api::{apps::v1 as apps, core::v1 as core, discovery::v1 as discovery};
    match (module, name) {
        ("core::v1", "Pod") => of::<core::Pod>(),
        ("core::v1", "Namespace") => of::<core::Namespace>(),
        ("core::v1", "Service") => of::<core::Service>(),
        ("core::v1", "Node") => of::<core::Node>(),
        ("core::v1", "Endpoints") => of::<core::Endpoints>(),
        ("core::v1", "ConfigMap") => of::<core::ConfigMap>(),
        ("core::v1", "Secret") => of::<core::Secret>(),
        ("core::v1", "Event") => of::<core::Event>(),
        ("discovery::v1", "EndpointSlice") => of::<discovery::EndpointSlice>(),
        ("apps::v1", "DaemonSet") => of::<apps::DaemonSet>(),
        _ => panic!("k8s_openapi::api::{module}::{name}: teach api_resource about it"),
    }
}

/// The k8s-openapi resource types a source names
/// (`k8s_openapi::api::core::v1::{Namespace, Pod}` and the like), and a
/// resource the source defines itself (`impl Resource for`, named by its
/// `const GROUP` and `const PLURAL`).
fn api_types(source: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if source.contains("impl Resource for ") {
        out.push((rust_const(source, "GROUP"), rust_const(source, "PLURAL")));
    }
    for (at, _) in source.match_indices("k8s_openapi::api::") {
        let rest = &source[at + "k8s_openapi::api::".len()..];
        let mut parts = rest.splitn(3, "::");
        let (Some(group), Some(version), Some(tail)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let module = format!("{group}::{version}");
        let names: Vec<&str> = if let Some(list) = tail.strip_prefix('{') {
            list[..list.find('}').unwrap_or(0)]
                .split(',')
                .map(str::trim)
                .collect()
        } else {
            vec![
                tail.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or_default(),
            ]
        };
        for name in names.into_iter().filter(|n| !n.is_empty()) {
            out.push(api_resource(&module, name));
        }
    }
    out
}

/// The RBAC verbs a source's kube-rs calls need, by the call's shape, each
/// with the subresource it is on (`""` for the resource itself,
/// `"/status"`). Calls this cannot classify fail the test, to be taught here.
fn api_verbs(source: &str) -> BTreeSet<(&'static str, &'static str)> {
    let mut verbs = BTreeSet::new();
    let has = |s: &str| source.contains(s);
    let mut on_resource = |v: &'static str| {
        verbs.insert(("", v));
    };
    if has("watcher(") || has("reflector(") || has("metadata_watcher(") {
        on_resource("list");
        on_resource("watch");
    }
    // A user of the generic optional-CRD watch (`control/kube/optional_crd.rs`)
    // lists and watches the type it names.
    if has("OptionalCrdWatch<") {
        on_resource("list");
        on_resource("watch");
    }
    if has(".list(") && has("ListParams") {
        on_resource("list");
    }
    if has("WatchParams") {
        on_resource("watch");
    }
    if has(".patch(") && has("PatchParams") {
        on_resource("patch");
    }
    if has("PostParams") {
        on_resource("create");
        on_resource("update");
    }
    if has("DeleteParams") {
        on_resource("delete");
    }
    if has(".get_opt(") || has("GetParams") || has(".get_metadata(") {
        on_resource("get");
    }
    if has(".patch_status(") {
        verbs.insert(("/status", "patch"));
    }
    for raw in [
        ".request::<",
        ".request_text(",
        "Discovery::",
        ".replace_status(",
        ".get_status(",
        ".patch_subresource(",
    ] {
        assert!(
            !has(raw),
            "a raw, subresource or discovery API call ({raw}): teach api_verbs what it needs"
        );
    }
    verbs
}

/// The calls found in the agent's sources (test modules left out); with
/// `discovery` false, those outside DISCOVERY_SOURCES only.
fn api_calls_in_code(discovery: bool) -> BTreeSet<(String, String, String)> {
    let mut found = BTreeSet::new();
    for (path, source) in rust_sources("userspace/src") {
        // The property tests (`fuzz/`) are compiled only
        // under `cfg(test)`: they parse objects, they call no API.
        let test_only = path.components().any(|c| c.as_os_str() == "fuzz")
            || path.file_stem().is_some_and(|stem| stem == "fuzz");
        let in_discovery = path.parent().is_some_and(|d| d.ends_with("control/kube"))
            && path
                .file_name()
                .is_some_and(|n| DISCOVERY_SOURCES.iter().any(|d| n == *d));
        if test_only || (in_discovery && !discovery) {
            continue;
        }
        // The file's test module (always last) makes no calls of the agent.
        let code = source
            .find("#[cfg(test)]\nmod ")
            .map_or(source.as_str(), |at| &source[..at]);
        if !code.contains("kube::") && !code.contains("Api::") && !code.contains("Api<") {
            continue;
        }
        // The generic optional-CRD watch names no type: its users do, and
        // are counted with its verbs (see `api_verbs`).
        if code.contains("struct OptionalCrdWatch<") {
            continue;
        }
        let verbs = api_verbs(code);
        let types = api_types(code);
        if !verbs.is_empty() {
            assert!(
                !types.is_empty(),
                "{}: API calls on types this test cannot see; name them with k8s_openapi::api paths",
                path.display()
            );
        }
        for (group, resource) in &types {
            for (subresource, verb) in &verbs {
                found.insert((
                    group.clone(),
                    format!("{resource}{subresource}"),
                    verb.to_string(),
                ));
            }
        }
    }
    found
}

fn calls(lists: &[&[(&str, &str, &[&str])]]) -> BTreeSet<(String, String, String)> {
    lists
        .iter()
        .flat_map(|list| list.iter())
        .flat_map(|(group, resource, verbs)| {
            verbs
                .iter()
                .map(|v| (group.to_string(), resource.to_string(), v.to_string()))
        })
        .collect()
}

/// The calls of the mode the DaemonSet's arguments select: the builtin
/// proxy without istiod discovers the cluster itself; with `--xds-address`
/// (istiod tells it) or `--proxy ztunnel` (no proxy of shunt's) it does not.
fn expected_calls(args: &BTreeMap<String, String>) -> BTreeSet<(String, String, String)> {
    let discovers =
        args.get("--proxy").is_none_or(|p| p == "builtin") && !args.contains_key("--xds-address");
    if discovers {
        calls(&[NODE_API_CALLS, DISCOVERY_API_CALLS])
    } else {
        calls(&[NODE_API_CALLS])
    }
}

#[test]
fn rbac_rules_cover_exactly_the_agents_api_calls() {
    // The expectation lists agree with the code: every call, and the calls
    // every mode makes...
    assert_eq!(
        api_calls_in_code(true),
        calls(&[NODE_API_CALLS, DISCOVERY_API_CALLS]),
        "the agent's API calls (left: found in userspace/src) differ from NODE_API_CALLS + \
         DISCOVERY_API_CALLS (right): update the lists and deploy/base/rbac.yaml together"
    );
    assert_eq!(
        api_calls_in_code(false),
        calls(&[NODE_API_CALLS]),
        "the calls outside the builtin proxy's discovery (left) differ from NODE_API_CALLS \
         (right): the Istio and ztunnel modes' roles would not cover them"
    );

    // ... and the ClusterRole grants exactly it.
    check_rbac(&all_objects());
}

/// The ClusterRole grants exactly the agent's API calls, to the
/// DaemonSet's service account.
fn check_rbac(objects: &[Object]) {
    let role = the_one(
        "ClusterRole",
        objects
            .iter()
            .filter_map(|o| match o {
                Object::ClusterRole(r) => Some(r.clone()),
                _ => None,
            })
            .collect(),
    );
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(
            rule.resource_names.is_none(),
            "no resourceNames: pods are many"
        );
        assert!(
            rule.non_resource_urls.is_none(),
            "the agent calls no non-resource URL"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    for item in [group, resource, verb] {
                        assert!(!item.contains('*'), "no wildcards in RBAC: {item}");
                    }
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let ds = daemonset_in(objects);
    let args = effective_agent_args(&agent_container(&pod_spec(&ds)));
    assert_eq!(
        granted,
        expected_calls(&args),
        "the ClusterRole grants (left) vs the agent's calls in this mode (right)"
    );

    // Bound to the agent's service account, in its namespace.
    let binding = the_one(
        "ClusterRoleBinding",
        objects
            .iter()
            .filter_map(|o| match o {
                Object::ClusterRoleBinding(b) => Some(b.clone()),
                _ => None,
            })
            .collect(),
    );
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subjects = binding.subjects.clone().unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(
        Some(&subjects[0].name),
        pod_spec(&ds).service_account_name.as_ref()
    );
    assert_eq!(subjects[0].namespace, ds.metadata.namespace);
    assert_ne!(
        pod_spec(&ds).automount_service_account_token,
        Some(false),
        "the agent needs its service account token"
    );
}

#[test]
fn the_code_scan_sees_calls_and_types() {
    let source = "use k8s_openapi::api::core::v1::{Namespace, Pod};\n\
                  use k8s_openapi::api::discovery::v1::EndpointSlice;\n\
                  watcher(Api::all(c), cfg); api.patch(n, &PatchParams::default(), &p);";
    let types = api_types(source);
    assert!(types.contains(&(String::new(), "pods".into())));
    assert!(types.contains(&(String::new(), "namespaces".into())));
    assert!(types.contains(&("discovery.k8s.io".into(), "endpointslices".into())));
    let own = "pub const GROUP: &str = \"security.istio.io\";\n\
               pub const PLURAL: &str = \"authorizationpolicies\";\n\
               impl Resource for AuthorizationPolicyObject {}";
    assert_eq!(
        api_types(own),
        [(
            "security.istio.io".to_string(),
            "authorizationpolicies".to_string()
        )]
    );
    assert_eq!(
        api_verbs(source),
        [("", "list"), ("", "patch"), ("", "watch")]
            .into_iter()
            .collect()
    );
    assert_eq!(
        api_verbs("api.patch_status(n, &PatchParams::default(), &p);"),
        [("/status", "patch")].into_iter().collect()
    );
}

// --------------------------------------------------------------- samples

#[test]
fn samples_join_the_mesh_and_match_what_xtask_run_expects() {
    let pod_rs = read("userspace/src/control/kube/pod.rs");
    let label = rust_const(&pod_rs, "DATAPLANE_MODE_LABEL");
    let run_rs = read("xtask/src/run.rs");
    let demo_namespace = rust_const(&run_rs, "DEMO_NAMESPACE");
    let server_port: i32 = rust_const(&run_rs, "SERVER_PORT").parse().expect("port");

    let objects: Vec<Object> = objects()
        .into_iter()
        .filter(|(file, _)| file.starts_with("samples"))
        .flat_map(|(_, o)| o)
        .collect();
    let namespace = the_one(
        "sample Namespace",
        objects
            .iter()
            .filter_map(|o| match o {
                Object::Namespace(n) => Some(n.clone()),
                _ => None,
            })
            .collect(),
    );
    assert_eq!(
        namespace.metadata.name.as_deref(),
        Some(demo_namespace.as_str())
    );
    assert_eq!(
        namespace
            .metadata
            .labels
            .unwrap_or_default()
            .get(&label)
            .map(String::as_str),
        Some("ambient"),
        "the sample namespace opts into the mesh"
    );
    let deployments: BTreeMap<String, Deployment> = objects
        .iter()
        .filter_map(|o| match o {
            Object::Deployment(d) => Some((d.metadata.name.clone().unwrap_or_default(), d.clone())),
            _ => None,
        })
        .collect();
    let spec_of = |name: &str| {
        let d = deployments
            .get(name)
            .unwrap_or_else(|| panic!("a `{name}` Deployment (xtask run looks for app={name})"));
        let template = d.spec.as_ref().expect("spec").template.clone();
        let labels = template.metadata.and_then(|m| m.labels).unwrap_or_default();
        assert_eq!(
            labels.get("app").map(String::as_str),
            Some(name),
            "label app={name}"
        );
        assert_ne!(
            labels.get(&label).map(String::as_str),
            Some("none"),
            "{name} does not opt out"
        );
        let spec = template.spec.expect("pod spec");
        assert_ne!(
            spec.host_network,
            Some(true),
            "host-network pods are never enrolled"
        );
        assert!(
            spec.service_account_name.is_some(),
            "{name}: its own identity"
        );
        spec
    };
    let server = spec_of("server");
    assert!(
        server.containers[0]
            .ports
            .iter()
            .flatten()
            .any(|p| p.container_port == server_port),
        "the server listens on the port xtask run curls"
    );
    let client = spec_of("client");
    assert_eq!(
        client.containers[0].name, "client",
        "xtask run execs into container `client`"
    );
    assert!(
        client.containers[0]
            .image
            .as_deref()
            .is_some_and(|i| i.contains("agnhost")),
        "the client image has curl (agnhost)"
    );
    // Until the agent learns other nodes' pods, HBONE is only used towards
    // pods of the same node: the client must run beside the server.
    let discovery_wired = read("userspace/src/app/mod.rs").contains("ClusterWorkloads");
    if !discovery_wired {
        let affinity = client
            .affinity
            .and_then(|a| a.pod_affinity)
            .and_then(|a| a.required_during_scheduling_ignored_during_execution)
            .unwrap_or_default();
        assert!(
            affinity
                .iter()
                .any(|t| t.topology_key == "kubernetes.io/hostname"
                    && t.label_selector
                        .as_ref()
                        .and_then(|s| s.match_labels.as_ref())
                        .and_then(|l| l.get("app"))
                        .is_some_and(|v| v == "server")),
            "the client must be scheduled on the server's node"
        );
    }
}

// ------------------------------------------------- image and kind config

#[test]
fn dockerfile_builds_like_xtask_setup_and_ships_what_the_agent_runs() {
    let dockerfile = read("deploy/Dockerfile");
    let arg = |name: &str| {
        dockerfile
            .lines()
            .find_map(|l| l.strip_prefix(&format!("ARG {name}=")))
            .unwrap_or_else(|| panic!("ARG {name}=… in deploy/Dockerfile"))
            .trim()
            .to_string()
    };
    assert_eq!(
        arg("BPF_LINKER_VERSION"),
        rust_const(&read("xtask/src/setup.rs"), "BPF_LINKER_VERSION"),
        "bpf-linker as `cargo xtask setup` builds it"
    );
    let workspace = read("Cargo.toml");
    let rust_version = workspace
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .expect("workspace rust-version")
        .trim_matches('"');
    assert_eq!(
        arg("RUST_VERSION"),
        rust_version,
        "the workspace's rust-version"
    );
    for needle in [
        "rust-src",
        "--no-default-features",
        "no-llvm-linking",
        "llvm-$major",
        ".tools/bpf-linker",
        "--locked -p shunt",
    ] {
        assert!(dockerfile.contains(needle), "deploy/Dockerfile: {needle}");
    }
    let stages: Vec<&str> = dockerfile
        .lines()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert!(stages.len() >= 2, "multi-stage");
    assert_eq!(stages.last().copied(), Some("FROM debian:bookworm-slim"));
    let runtime = &dockerfile[dockerfile.rfind("FROM ").expect("FROM")..];
    // What the agent runs at runtime (iptables mode: backend.rs names the
    // packages), what the init container runs, and `ip`/`tc`.
    let backend = read("userspace/src/redirect/iptables/backend.rs");
    for package in [
        rust_const(&backend, "IPTABLES_PACKAGE"),
        rust_const(&backend, "NSENTER_PACKAGE"),
        "iproute2".to_string(),
        "mount".to_string(),
    ] {
        assert!(
            runtime.split_whitespace().any(|w| w == package),
            "the runtime image installs {package}"
        );
    }
    assert!(runtime.contains("ENTRYPOINT [\"/usr/local/bin/shunt\"]"));
    let ignore = read("deploy/Dockerfile.dockerignore");
    for path in ["target", ".tools"] {
        assert!(
            ignore.lines().any(|l| l.trim() == path),
            "{path} stays out of the context"
        );
    }
}

#[test]
fn kind_config_is_the_cluster_xtask_run_uses() {
    // kind's own schema is not installed here; these are the fields
    // `cargo xtask run` relies on.
    let config = the_one("kind config", yaml_documents(Path::new(KIND_CONFIG)));
    assert_eq!(config["kind"], "Cluster");
    assert_eq!(config["apiVersion"], "kind.x-k8s.io/v1alpha4");
    assert_eq!(
        config["name"].as_str(),
        Some(rust_const(&read("xtask/src/run.rs"), "CLUSTER").as_str())
    );
    let roles: Vec<&str> = config["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| n["role"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(roles.iter().filter(|r| **r == "control-plane").count(), 1);
    assert!(
        roles.contains(&"worker"),
        "workers, so that the DaemonSet spans nodes"
    );
    assert!(
        roles
            .iter()
            .all(|r| ["control-plane", "worker"].contains(r))
    );
}
