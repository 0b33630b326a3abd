//! `helm template`, for the part of Helm's template language that
//! deploy/helm/shunt uses. No Helm binary installs here (none in Debian's
//! archive; no PyPI package ships one for Linux), so the test owns this renderer; the chart
//! keeps to what it knows (deploy/helm/shunt/README.md lists it), and
//! anything else is an error naming the template and the construct, never a
//! silently different output.
//!
//! What it knows, with Go template and Helm semantics:
//! - text and `{{ pipeline }}`, `{{-`/`-}}` trimming, `{{/* comments */}}`;
//! - `if`/`else if`/`else`/`end` (Go's truth: false, 0, nil and empty
//!   strings, lists and maps are false), `range $key, $value := MAP` (keys in
//!   sorted order, as Go ranges over maps), `define "name"` in any template
//!   and `include "name" .`;
//! - operands `.Values.a.b`, `.Release.Namespace`, `.Release.Name`, `.`,
//!   `$variable`, "strings", integers; a missing last field is nil (printed
//!   as nothing, as Helm does), a missing map on the way is an error (Helm's
//!   nil pointer error);
//! - functions `toYaml`, `nindent N`, `indent N`, `quote`, `default D`,
//!   `not`, `contains SUBSTR`, each usable in a pipeline (the piped value
//!   is the last argument).
//!
//! Values: the chart's values.yaml, deep-merged with `-f` files in order,
//! then `--set a.b=v` (v a bool, an integer or a string, as Helm parses it).

use std::{collections::BTreeMap, fs, path::Path};

use serde::Deserialize;
use serde_json::{Map, Value};

/// One rendered manifest file of the chart (its path under the chart) and
/// its text.
pub struct Rendered {
    pub template: String,
    pub text: String,
}

/// `helm template RELEASE CHART -n NAMESPACE -f FILE... --set A=B...`.
pub fn template(
    chart: &Path,
    release: &str,
    namespace: &str,
    value_files: &[&Path],
    sets: &[&str],
) -> Result<Vec<Rendered>, String> {
    let mut values = load_yaml(&chart.join("values.yaml"))?;
    for file in value_files {
        merge(&mut values, load_yaml(file)?);
    }
    for set in sets {
        apply_set(&mut values, set)?;
    }
    let root = serde_json::json!({
        "Values": values,
        "Release": { "Name": release, "Namespace": namespace, "Service": "Helm" },
    });

    let dir = chart.join("templates");
    let mut files: Vec<_> = fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .map(|e| e.map(|e| e.path()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    files.sort();
    let mut defines = BTreeMap::new();
    let mut manifests = Vec::new();
    for path in files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("{}: not a UTF-8 name", path.display()))?
            .to_string();
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let nodes = parse(&text).map_err(|e| format!("templates/{name}: {e}"))?;
        let mut body = Vec::new();
        for node in nodes {
            match node {
                Node::Define(define, nodes) => {
                    if defines.insert(define.clone(), nodes).is_some() {
                        return Err(format!("templates/{name}: `{define}` defined twice"));
                    }
                }
                other => body.push(other),
            }
        }
        // As Helm: files named _* hold definitions only; NOTES.txt is text
        // for the user.
        if !name.starts_with('_') && name != "NOTES.txt" {
            manifests.push((name, body));
        }
    }
    let renderer = Renderer { root, defines };
    manifests
        .into_iter()
        .map(|(name, body)| {
            let mut out = String::new();
            let mut vars = BTreeMap::new();
            renderer
                .render(&body, &mut vars, &mut out)
                .map_err(|e| format!("templates/{name}: {e}"))?;
            Ok(Rendered {
                template: format!("templates/{name}"),
                text: out,
            })
        })
        .collect()
}

// ----------------------------------------------------------------- values

fn load_yaml(path: &Path) -> Result<Value, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let value = Value::deserialize(serde_yaml::Deserializer::from_str(&text))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    match value {
        Value::Null => Ok(Value::Object(Map::new())),
        Value::Object(_) => Ok(value),
        _ => Err(format!("{}: values must be a map", path.display())),
    }
}

/// Helm's coalescing of values: maps merge key by key, anything else in
/// `over` replaces what is in `base`.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (key, value) in over {
                match base.get_mut(&key) {
                    Some(existing) if existing.is_object() && value.is_object() => {
                        merge(existing, value)
                    }
                    _ => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, over) => *base = over,
    }
}

/// `--set a.b=value`: dotted keys only (no list indices or escapes).
fn apply_set(values: &mut Value, set: &str) -> Result<(), String> {
    let (path, raw) = set
        .split_once('=')
        .ok_or_else(|| format!("--set {set}: no `=`"))?;
    if path.contains(['[', '\\', ',']) || raw.contains(',') {
        return Err(format!("--set {set}: only a.b=value is supported here"));
    }
    let value = match raw {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => match raw.parse::<i64>() {
            Ok(n) => Value::from(n),
            Err(_) => Value::String(raw.to_string()),
        },
    };
    let mut tree = value;
    for key in path.rsplit('.') {
        let mut map = Map::new();
        map.insert(key.to_string(), tree);
        tree = Value::Object(map);
    }
    merge(values, tree);
    Ok(())
}

// ----------------------------------------------------------------- parsing

#[derive(Debug, Clone)]
enum Node {
    Text(String),
    Output(Pipeline),
    If {
        branches: Vec<(Pipeline, Vec<Node>)>,
        otherwise: Vec<Node>,
    },
    Range {
        key: String,
        value: String,
        over: Pipeline,
        body: Vec<Node>,
    },
    Define(String, Vec<Node>),
}

/// Commands separated by `|`; each a list of words.
type Pipeline = Vec<Vec<Word>>;

#[derive(Debug, Clone, PartialEq)]
enum Word {
    /// `.` or `.A.B`: a path from the root (empty for `.`).
    Field(Vec<String>),
    Variable(String),
    Str(String),
    Int(i64),
    Ident(String),
}

enum Token {
    Text(String),
    Action(String),
}

/// Splits a template into text and actions, applying `{{-` and `-}}`.
fn tokenize(text: &str) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let mut rest = text;
    let mut trim_next = false;
    while let Some(open) = rest.find("{{") {
        let mut before = &rest[..open];
        if trim_next {
            before = before.trim_start();
        }
        let after = &rest[open + 2..];
        let close = after
            .find("}}")
            .ok_or_else(|| format!("unclosed `{{{{` at `{}`", excerpt(&rest[open..])))?;
        let mut inner = &after[..close];
        if let Some(trimmed) = inner.strip_prefix("- ") {
            before = before.trim_end();
            inner = trimmed;
        } else if inner.starts_with('-') {
            return Err(format!(
                "`{{{{-` needs a space after it: `{}`",
                excerpt(inner)
            ));
        }
        trim_next = false;
        if let Some(trimmed) = inner.strip_suffix(" -") {
            trim_next = true;
            inner = trimmed;
        }
        tokens.push(Token::Text(before.to_string()));
        let inner = inner.trim();
        if !(inner.starts_with("/*") && inner.ends_with("*/")) {
            tokens.push(Token::Action(inner.to_string()));
        }
        rest = &after[close + 2..];
    }
    tokens.push(Token::Text(if trim_next {
        rest.trim_start().to_string()
    } else {
        rest.to_string()
    }));
    Ok(tokens)
}

fn excerpt(text: &str) -> String {
    text.chars().take(40).collect()
}

fn parse(text: &str) -> Result<Vec<Node>, String> {
    let tokens = tokenize(text)?;
    let mut at = 0;
    let (nodes, end) = parse_list(&tokens, &mut at)?;
    match end {
        None => Ok(nodes),
        Some(action) => Err(format!("`{{{{ {action} }}}}` without a matching block")),
    }
}

/// Nodes up to an `end`/`else…` action (returned) or the end of input.
fn parse_list(tokens: &[Token], at: &mut usize) -> Result<(Vec<Node>, Option<String>), String> {
    let mut nodes = Vec::new();
    while let Some(token) = tokens.get(*at) {
        *at += 1;
        let action = match token {
            Token::Text(text) => {
                if !text.is_empty() {
                    nodes.push(Node::Text(text.clone()));
                }
                continue;
            }
            Token::Action(action) => action.as_str(),
        };
        let (keyword, rest) = action.split_once(' ').unwrap_or((action, ""));
        match keyword {
            "end" | "else" => return Ok((nodes, Some(action.to_string()))),
            "if" => nodes.push(parse_if(rest, tokens, at)?),
            "range" => {
                let (vars, over) = rest
                    .split_once(":=")
                    .ok_or_else(|| format!("`range {rest}`: only `range $k, $v := MAP`"))?;
                let (key, value) = vars
                    .split_once(',')
                    .ok_or_else(|| format!("`range {rest}`: only `range $k, $v := MAP`"))?;
                let variable = |v: &str| {
                    v.trim()
                        .strip_prefix('$')
                        .map(str::to_string)
                        .ok_or_else(|| format!("`range {rest}`: `{v}` is not a $variable"))
                };
                let over = parse_pipeline(over)?;
                let (body, end) = parse_list(tokens, at)?;
                if end.as_deref() != Some("end") {
                    return Err(format!("`range {rest}` without its `end` (found {end:?})"));
                }
                nodes.push(Node::Range {
                    key: variable(key)?,
                    value: variable(value)?,
                    over,
                    body,
                });
            }
            "define" => {
                let name = parse_string(rest.trim())?;
                let (body, end) = parse_list(tokens, at)?;
                if end.as_deref() != Some("end") {
                    return Err(format!("`define {rest}` without its `end` (found {end:?})"));
                }
                nodes.push(Node::Define(name, body));
            }
            "with" | "template" | "block" | "break" | "continue" => {
                return Err(format!(
                    "`{{{{ {action} }}}}`: `{keyword}` is outside the subset this renderer knows"
                ));
            }
            _ => nodes.push(Node::Output(parse_pipeline(action)?)),
        }
    }
    Ok((nodes, None))
}

/// After `if COND`: the branches up to the matching `end`.
fn parse_if(condition: &str, tokens: &[Token], at: &mut usize) -> Result<Node, String> {
    let mut branches = vec![];
    let mut condition = parse_pipeline(condition)?;
    loop {
        let (body, end) = parse_list(tokens, at)?;
        branches.push((condition, body));
        match end.as_deref() {
            Some("end") => {
                return Ok(Node::If {
                    branches,
                    otherwise: vec![],
                });
            }
            Some("else") => {
                let (otherwise, end) = parse_list(tokens, at)?;
                if end.as_deref() != Some("end") {
                    return Err(format!("`else` without its `end` (found {end:?})"));
                }
                return Ok(Node::If {
                    branches,
                    otherwise,
                });
            }
            Some(other) if other.starts_with("else if ") => {
                condition = parse_pipeline(&other["else if ".len()..])?;
            }
            other => return Err(format!("`if` without its `end` (found {other:?})")),
        }
    }
}

fn parse_string(word: &str) -> Result<String, String> {
    serde_json::from_str::<String>(word).map_err(|_| format!("`{word}` is not a \"string\""))
}

/// Words separated by spaces (outside strings); commands by `|`.
fn parse_pipeline(text: &str) -> Result<Pipeline, String> {
    let mut commands = vec![vec![]];
    let mut chars = text.trim().char_indices().peekable();
    let text = text.trim();
    while let Some((start, c)) = chars.next() {
        if c.is_whitespace() {
            continue;
        }
        if c == '|' {
            commands.push(vec![]);
            continue;
        }
        let mut end = start + c.len_utf8();
        if c == '"' {
            let mut escaped = false;
            loop {
                let (i, c) = chars
                    .next()
                    .ok_or_else(|| format!("unclosed string in `{text}`"))?;
                end = i + c.len_utf8();
                match c {
                    '\\' if !escaped => escaped = true,
                    '"' if !escaped => break,
                    _ => escaped = false,
                }
            }
        } else {
            while let Some(&(i, c)) = chars.peek() {
                if c.is_whitespace() || c == '|' {
                    break;
                }
                end = i + c.len_utf8();
                chars.next();
            }
        }
        let word = &text[start..end];
        let parsed = if word.starts_with('"') {
            Word::Str(parse_string(word)?)
        } else if word == "." {
            Word::Field(vec![])
        } else if let Some(path) = word.strip_prefix('.') {
            Word::Field(path.split('.').map(str::to_string).collect())
        } else if let Some(name) = word.strip_prefix('$') {
            if name.is_empty() || name.contains('.') {
                return Err(format!("`{word}`: only plain $variables are supported"));
            }
            Word::Variable(name.to_string())
        } else if let Ok(n) = word.parse::<i64>() {
            Word::Int(n)
        } else if word.chars().all(|c| c.is_ascii_alphanumeric()) {
            Word::Ident(word.to_string())
        } else {
            return Err(format!(
                "`{word}` in `{text}` is outside the supported subset"
            ));
        };
        commands
            .last_mut()
            .expect("one command at least")
            .push(parsed);
    }
    if commands.iter().any(Vec::is_empty) {
        return Err(format!("empty command in `{text}`"));
    }
    Ok(commands)
}

// --------------------------------------------------------------- rendering

struct Renderer {
    root: Value,
    defines: BTreeMap<String, Vec<Node>>,
}

type Vars = BTreeMap<String, Value>;

impl Renderer {
    fn render(&self, nodes: &[Node], vars: &mut Vars, out: &mut String) -> Result<(), String> {
        for node in nodes {
            match node {
                Node::Text(text) => out.push_str(text),
                Node::Output(pipeline) => {
                    let value = self.eval(pipeline, vars)?;
                    out.push_str(&print(&value)?);
                }
                Node::If {
                    branches,
                    otherwise,
                } => {
                    let mut taken = None;
                    for (condition, body) in branches {
                        if truthy(&self.eval(condition, vars)?) {
                            taken = Some(body);
                            break;
                        }
                    }
                    self.render(taken.unwrap_or(otherwise), vars, out)?;
                }
                Node::Range {
                    key,
                    value,
                    over,
                    body,
                } => match self.eval(over, vars)? {
                    Value::Null => {}
                    // Go ranges over a map in key order.
                    Value::Object(map) => {
                        let mut entries: Vec<_> = map.into_iter().collect();
                        entries.sort_by(|a, b| a.0.cmp(&b.0));
                        for (k, v) in entries {
                            vars.insert(key.clone(), Value::String(k));
                            vars.insert(value.clone(), v);
                            self.render(body, vars, out)?;
                        }
                    }
                    other => return Err(format!("range over {other}: only maps are supported")),
                },
                Node::Define(name, _) => {
                    return Err(format!("`define {name:?}` inside a block"));
                }
            }
        }
        Ok(())
    }

    fn eval(&self, pipeline: &Pipeline, vars: &Vars) -> Result<Value, String> {
        let mut piped: Option<Value> = None;
        for command in pipeline {
            let (head, args) = command.split_first().expect("commands are not empty");
            let mut args: Vec<Value> = args
                .iter()
                .map(|w| self.operand(w, vars))
                .collect::<Result<_, _>>()?;
            let result = match head {
                Word::Ident(function) => {
                    args.extend(piped.take());
                    self.call(function, args)?
                }
                operand => {
                    if !args.is_empty() || piped.is_some() {
                        return Err(format!("{operand:?} is not a function"));
                    }
                    self.operand(operand, vars)?
                }
            };
            piped = Some(result);
        }
        Ok(piped.unwrap_or(Value::Null))
    }

    fn operand(&self, word: &Word, vars: &Vars) -> Result<Value, String> {
        Ok(match word {
            Word::Str(s) => Value::String(s.clone()),
            Word::Int(n) => Value::from(*n),
            Word::Variable(name) => vars
                .get(name)
                .cloned()
                .ok_or_else(|| format!("${name} is not defined"))?,
            Word::Field(path) => {
                let mut value = &self.root;
                for (i, key) in path.iter().enumerate() {
                    match value {
                        Value::Object(map) => match map.get(key) {
                            Some(next) => value = next,
                            None if i + 1 == path.len() => return Ok(Value::Null),
                            None => {
                                return Err(format!(
                                    ".{}: nil pointer evaluating .{key} (no such value)",
                                    path.join(".")
                                ));
                            }
                        },
                        _ => {
                            return Err(format!(
                                ".{}: .{} is not a map",
                                path.join("."),
                                path[..i].join(".")
                            ));
                        }
                    }
                }
                value.clone()
            }
            Word::Ident(name) => self.call(name, vec![])?,
        })
    }

    fn call(&self, function: &str, args: Vec<Value>) -> Result<Value, String> {
        let arity = |n: usize| {
            if args.len() == n {
                Ok(())
            } else {
                Err(format!(
                    "{function} takes {n} arguments, given {}",
                    args.len()
                ))
            }
        };
        let int = |v: &Value| {
            v.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{function}: {v} is not a count"))
        };
        Ok(match function {
            "toYaml" => {
                arity(1)?;
                let yaml = serde_yaml::to_string(&sorted(&args[0])).map_err(|e| e.to_string())?;
                Value::String(yaml.trim_end_matches('\n').to_string())
            }
            "nindent" | "indent" => {
                arity(2)?;
                let pad = " ".repeat(int(&args[0])?);
                let text = print(&args[1])?;
                let indented: Vec<String> = text.lines().map(|l| format!("{pad}{l}")).collect();
                let indented = indented.join("\n");
                Value::String(if function == "nindent" {
                    format!("\n{indented}")
                } else {
                    indented
                })
            }
            "quote" => {
                arity(1)?;
                Value::String(serde_json::to_string(&print(&args[0])?).map_err(|e| e.to_string())?)
            }
            "default" => {
                arity(2)?;
                let mut args = args;
                let given = args.pop().expect("two");
                if truthy(&given) {
                    given
                } else {
                    args.pop().expect("one")
                }
            }
            "not" => {
                arity(1)?;
                Value::Bool(!truthy(&args[0]))
            }
            "contains" => {
                arity(2)?;
                Value::Bool(print(&args[1])?.contains(&print(&args[0])?))
            }
            "include" => {
                arity(2)?;
                let name = args[0]
                    .as_str()
                    .ok_or_else(|| "include: the template name is a string".to_string())?;
                if args[1] != self.root {
                    return Err(format!("include {name:?}: only `.` as the context"));
                }
                let body = self
                    .defines
                    .get(name)
                    .ok_or_else(|| format!("include {name:?}: no such define"))?;
                let mut out = String::new();
                self.render(body, &mut Vars::new(), &mut out)?;
                Value::String(out)
            }
            other => {
                return Err(format!(
                    "function `{other}` is outside the subset this renderer knows"
                ));
            }
        })
    }
}

/// `value` with every map's keys in order, as Helm's toYaml writes them.
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// Go's truth for `if`: false, 0, nil and empty things are false.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A value as `{{ }}` prints it (nil prints nothing, as Helm's output).
fn print(value: &Value) -> Result<String, String> {
    match value {
        Value::Null => Ok(String::new()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) => Ok(n.to_string()),
        Value::String(s) => Ok(s.clone()),
        other => Err(format!(
            "{other} printed as it is: Go would print a map or list in its own syntax; use toYaml"
        )),
    }
}
