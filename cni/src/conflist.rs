//! shunt-cni's entry in the node's primary CNI configuration, as
//! istio-cni's installer keeps its own: the primary is the first
//! `*.conflist` of the configuration directory in name order (the one the
//! runtime uses); the entry is appended to its `plugins`, so it runs after
//! the network plugins and sees their result; the file is replaced
//! atomically (written beside it, then renamed), so the runtime never
//! reads half of it. Removal takes out every entry of type `shunt-cni` and
//! nothing else.
//!
//! Limitation: a primary that is a single-plugin `*.conf` is refused (istio-cni
//! rewrites it as a list; not done here).

use std::{
    fs,
    io::Write as _,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use serde_json::{Map, Value};

use crate::PLUGIN_TYPE;

/// What went wrong installing or removing the entry or the binary.
#[derive(Debug, thiserror::Error)]
pub enum ConflistError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a CNI configuration list: {problem}")]
    Invalid { path: PathBuf, problem: String },
    #[error(
        "{path}: the primary CNI configuration is a single-plugin .conf; shunt-cni chains only into a .conflist"
    )]
    NotAList { path: PathBuf },
    #[error("{dir}: no CNI configuration (*.conflist) yet")]
    NoPrimary { dir: PathBuf },
}

/// How the agent configures its plugin (the entry's fields besides `type`).
#[derive(Clone, Debug, Default)]
pub struct Entry {
    pub agent_socket: PathBuf,
    pub timeout_seconds: u64,
    pub exclude_namespaces: Vec<String>,
    pub agent_namespace: Option<String>,
    pub agent_pod_prefix: Option<String>,
}

impl Entry {
    fn to_json(&self) -> Value {
        let mut entry = Map::new();
        entry.insert("type".into(), PLUGIN_TYPE.into());
        entry.insert(
            "agent_socket".into(),
            self.agent_socket.display().to_string().into(),
        );
        entry.insert("timeout_seconds".into(), self.timeout_seconds.into());
        entry.insert(
            "exclude_namespaces".into(),
            self.exclude_namespaces.clone().into(),
        );
        if let Some(ns) = &self.agent_namespace {
            entry.insert("agent_namespace".into(), ns.clone().into());
        }
        if let Some(prefix) = &self.agent_pod_prefix {
            entry.insert("agent_pod_prefix".into(), prefix.clone().into());
        }
        Value::Object(entry)
    }
}

/// The primary configuration of `dir`: its first `.conflist` or `.conf`
/// (`.json` too, as libcni) in name order.
pub fn primary(dir: &Path) -> Result<PathBuf, ConflistError> {
    let io = |source| ConflistError::Io {
        path: dir.to_owned(),
        source,
    };
    let mut names: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("conflist" | "conf" | "json")
                )
        })
        .collect();
    names.sort();
    let first = names.into_iter().next().ok_or(ConflistError::NoPrimary {
        dir: dir.to_owned(),
    })?;
    if first.extension().and_then(|e| e.to_str()) != Some("conflist") {
        return Err(ConflistError::NotAList { path: first });
    }
    Ok(first)
}

/// `list` (a conflist's text) with shunt-cni's entry last, replacing any
/// earlier one.
pub fn with_entry(list: &str, entry: &Entry, path: &Path) -> Result<String, ConflistError> {
    let mut value = parse(list, path)?;
    let plugins = plugins(&mut value, path)?;
    plugins.retain(|p| !is_ours(p));
    plugins.push(entry.to_json());
    Ok(pretty(&value))
}

/// `list` without shunt-cni's entries; `None` when it had none.
pub fn without_entry(list: &str, path: &Path) -> Result<Option<String>, ConflistError> {
    let mut value = parse(list, path)?;
    let plugins = plugins(&mut value, path)?;
    let before = plugins.len();
    plugins.retain(|p| !is_ours(p));
    if plugins.len() == before {
        return Ok(None);
    }
    Ok(Some(pretty(&value)))
}

/// Adds (or refreshes) the entry in `dir`'s primary configuration. Returns
/// the file changed.
pub fn install(dir: &Path, entry: &Entry) -> Result<PathBuf, ConflistError> {
    let path = primary(dir)?;
    let text = read(&path)?;
    let updated = with_entry(&text, entry, &path)?;
    if updated != text {
        write_atomically(&path, updated.as_bytes(), None)?;
    }
    Ok(path)
}

/// Takes the entry out of every configuration list of `dir` that has one
/// (the primary may have changed since it was installed). Returns the
/// files changed.
pub fn uninstall(dir: &Path) -> Result<Vec<PathBuf>, ConflistError> {
    let io = |source| ConflistError::Io {
        path: dir.to_owned(),
        source,
    };
    let mut changed = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("conflist") {
            continue;
        }
        let text = read(&path)?;
        if let Some(updated) = without_entry(&text, &path)? {
            write_atomically(&path, updated.as_bytes(), None)?;
            changed.push(path);
        }
    }
    Ok(changed)
}

/// Copies the plugin binary `from` into `bin_dir` as `shunt-cni`
/// (replaced atomically: a runtime running the old one is not disturbed).
pub fn install_binary(from: &Path, bin_dir: &Path) -> Result<PathBuf, ConflistError> {
    let bytes = fs::read(from).map_err(|source| ConflistError::Io {
        path: from.to_owned(),
        source,
    })?;
    let to = bin_dir.join(PLUGIN_TYPE);
    write_atomically(&to, &bytes, Some(0o755))?;
    Ok(to)
}

fn read(path: &Path) -> Result<String, ConflistError> {
    fs::read_to_string(path).map_err(|source| ConflistError::Io {
        path: path.to_owned(),
        source,
    })
}

fn parse(list: &str, path: &Path) -> Result<Value, ConflistError> {
    serde_json::from_str(list).map_err(|e| ConflistError::Invalid {
        path: path.to_owned(),
        problem: e.to_string(),
    })
}

fn plugins<'a>(value: &'a mut Value, path: &Path) -> Result<&'a mut Vec<Value>, ConflistError> {
    value
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| ConflistError::Invalid {
            path: path.to_owned(),
            problem: "no \"plugins\" array".into(),
        })
}

fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

fn pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    text.push('\n');
    text
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over
/// `path`.
fn write_atomically(path: &Path, bytes: &[u8], mode: Option<u32>) -> Result<(), ConflistError> {
    let io = |source| ConflistError::Io {
        path: path.to_owned(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(".{name}.shunt-tmp"));
    let mut file = fs::File::create(&temp).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    if let Some(mode) = mode {
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(io)?;
    }
    file.sync_all().map_err(io)?;
    drop(file);
    fs::rename(&temp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BRIDGE: &str = r#"{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"bridge","bridge":"cni0"},{"type":"portmap","capabilities":{"portMappings":true}}]}"#;

    fn entry() -> Entry {
        Entry {
            agent_socket: "/var/run/shunt/cni.sock".into(),
            timeout_seconds: 30,
            ..Entry::default()
        }
    }

    #[test]
    fn entry_goes_last_once_and_comes_out_alone() {
        let path = Path::new("10-pods.conflist");
        let once = with_entry(BRIDGE, &entry(), path).unwrap();
        let twice = with_entry(&once, &entry(), path).unwrap();
        assert_eq!(once, twice, "installing again changes nothing");
        let value: Value = serde_json::from_str(&once).unwrap();
        let types: Vec<&str> = value["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["bridge", "portmap", "shunt-cni"]);
        let removed = without_entry(&once, path).unwrap().unwrap();
        let original: Value = serde_json::from_str(BRIDGE).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&removed).unwrap(), original);
        assert_eq!(without_entry(BRIDGE, path).unwrap(), None);
    }

    #[test]
    fn primary_is_the_first_list_and_a_conf_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("20-b.conflist"), BRIDGE).unwrap();
        fs::write(dir.path().join("10-a.conflist"), BRIDGE).unwrap();
        assert_eq!(
            primary(dir.path()).unwrap(),
            dir.path().join("10-a.conflist")
        );
        install(dir.path(), &entry()).unwrap();
        assert!(
            read(&dir.path().join("10-a.conflist"))
                .unwrap()
                .contains("shunt-cni")
        );
        assert!(
            !read(&dir.path().join("20-b.conflist"))
                .unwrap()
                .contains("shunt-cni")
        );
        assert_eq!(
            uninstall(dir.path()).unwrap(),
            vec![dir.path().join("10-a.conflist")]
        );
        fs::write(dir.path().join("05-a.conf"), r#"{"type":"bridge"}"#).unwrap();
        assert!(matches!(
            install(dir.path(), &entry()),
            Err(ConflistError::NotAList { .. })
        ));
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            primary(empty.path()),
            Err(ConflistError::NoPrimary { .. })
        ));
    }

    #[test]
    fn a_broken_list_is_named() {
        let error = with_entry("{\"plugins\": 3}", &entry(), Path::new("x.conflist")).unwrap_err();
        assert!(error.to_string().contains("x.conflist"), "{error}");
    }
}
