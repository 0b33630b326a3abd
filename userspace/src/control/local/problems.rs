//! What is wrong with a workloads file, and where: [`Problem`] (entry,
//! field, message, line), and the translation of serde_yaml's structure
//! errors into problems.

use std::{
    fmt, io,
    path::{Path, PathBuf},
};

/// Why a workloads file cannot be used. Displays one line per problem, each
/// starting with the file's path.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadsFileError {
    #[error("{}: cannot read the workloads file: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}", show_problems(path, problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<Problem>,
    },
}

/// One thing wrong in a workloads file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The entry of `workloads` or `services` concerned, if any.
    pub entry: Option<Entry>,
    /// The field concerned as written in the file (`ips`, `ips[1]`,
    /// `ports[0].port`, `trustDomain`), if known.
    pub field: Option<String>,
    pub message: String,
    /// 1-based line and column, when the YAML parser knows them.
    pub location: Option<(usize, usize)>,
}

/// An entry of `workloads` or `services`: the list, its index, and
/// `namespace/name` when the entry has both (valid or not: it is there to
/// find the entry in the file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// `workloads` or `services`.
    pub list: &'static str,
    pub index: usize,
    pub label: Option<String>,
}

/// The file's lists of entries.
const LISTS: [&str; 4] = ["workloads", "services", "namespaces", "waypoints"];

impl Entry {
    pub(super) fn new(
        list: &'static str,
        index: usize,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Self {
        let label = match (namespace, name) {
            (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => {
                Some(format!("{ns}/{name}"))
            }
            _ => None,
        };
        Self { list, index, label }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.list, self.index)?;
        match &self.label {
            Some(label) => write!(f, " ({label})"),
            None => Ok(()),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(entry) = &self.entry {
            write!(f, "{entry}: ")?;
        }
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)?;
        if let Some((line, column)) = self.location {
            write!(f, " (line {line}, column {column})")?;
        }
        Ok(())
    }
}

fn show_problems(path: &Path, problems: &[Problem]) -> String {
    let lines: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {p}", path.display()))
        .collect();
    lines.join("\n")
}

/// Turns the error of parsing `text` as a [`RawFile`](super::raw::RawFile) into a problem naming
/// the entry and field.
///
/// serde_yaml exposes the location but not the path (`workloads[1].ips`)
/// except in its message, `PATH: MESSAGE at line L column C`; serde_yaml 0.9
/// is frozen, so that format is stable (and pinned by the tests).
pub(super) fn structure_problem(typed_error: &serde_yaml::Error, text: &str) -> Problem {
    // Text that is not valid YAML (bad syntax, duplicate keys) gets the YAML
    // parser's own error: the typed parse may stop earlier on a misleading
    // one (a field "missing" because it was misindented).
    let yaml_error;
    let (err, doc) = match serde_yaml::from_str::<serde_yaml::Value>(text) {
        Ok(doc) => (typed_error, Some(doc)),
        Err(e) => {
            yaml_error = e;
            (&yaml_error, None)
        }
    };
    let location = err.location().map(|l| (l.line(), l.column()));
    let mut message = err.to_string();
    if let Some((line, column)) = location {
        message = message.replacen(&format!(" at line {line} column {column}"), "", 1);
    }
    let (path, message) = match message.split_once(": ") {
        Some((path, rest)) if is_path(path) => (path, rest),
        _ => ("", message.as_str()),
    };
    let in_list = LISTS.iter().find_map(|list| {
        let (index, rest) = path
            .strip_prefix(list)?
            .strip_prefix('[')?
            .split_once(']')?;
        Some((*list, index.parse::<usize>().ok()?, rest))
    });
    let (index, mut field) = match in_list {
        Some((list, index, rest)) => (
            Some((list, index)),
            rest.strip_prefix('.').map(str::to_owned),
        ),
        None => (None, Some(path.to_owned()).filter(|p| !p.is_empty())),
    };
    if path.is_empty() && doc.is_none() {
        return Problem {
            entry: None,
            field: None,
            message: format!("invalid YAML: {message}"),
            location,
        };
    }
    let entry = index.map(|(list, index)| {
        let item = doc
            .as_ref()
            .and_then(|d| d.get(list))
            .and_then(|w| w.get(index));
        let get = |key| item.and_then(|i| i.get(key)).and_then(|v| v.as_str());
        Entry::new(list, index, get("namespace"), get("name"))
    });

    // Lift the field out of serde's own wording so every message has the
    // same shape: `field `x`: what is wrong`.
    let message = if let Some((name, rest)) = quoted_after(message, "unknown field ") {
        field = Some(join_field(field, name));
        format!("unknown field; {}", rest.trim_start_matches(", "))
    } else if let Some((name, _)) = quoted_after(message, "missing field ") {
        field = Some(join_field(field, name));
        "required, but missing".to_owned()
    } else if let Some(key) = message.strip_prefix("duplicate entry with key ") {
        field = Some(join_field(field, key.trim_matches('"')));
        "given twice".to_owned()
    } else {
        message.to_owned()
    };
    Problem {
        entry,
        field,
        message,
        location,
    }
}

/// Whether `s` looks like a serde_yaml path (`workloads[1].ips`), as opposed
/// to the start of a message such as `invalid type`.
fn is_path(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '[' | ']' | '_' | '-' | '?'))
}

/// For a message `PREFIX`name`REST`, returns `(name, REST)`.
fn quoted_after<'a>(message: &'a str, prefix: &str) -> Option<(&'a str, &'a str)> {
    message
        .strip_prefix(prefix)?
        .strip_prefix('`')?
        .split_once('`')
}

fn join_field(parent: Option<String>, name: &str) -> String {
    match parent {
        Some(parent) => format!("{parent}.{name}"),
        None => name.to_owned(),
    }
}
