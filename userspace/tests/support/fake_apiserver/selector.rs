//! Field selectors (`a.b=v`, `a.b!=v`, comma-separated) as lists and
//! watches honour them, and how a change looks to a watch under one: an
//! object that stops (starts) matching is a DELETED (ADDED).

use serde_json::Value;

/// The event a watch under `selector` sees for a change (None: nothing).
pub(super) fn translate(
    selector: &[FieldRequirement],
    event: &'static str,
    before: Option<&Value>,
    after: &Value,
) -> Option<&'static str> {
    let was = before.is_some_and(|b| matches(selector, b));
    let is = matches(selector, after);
    match event {
        "DELETED" => was.then_some("DELETED"),
        _ => match (was, is) {
            (true, true) => Some("MODIFIED"),
            (false, true) => Some("ADDED"),
            (true, false) => Some("DELETED"),
            (false, false) => None,
        },
    }
}

#[derive(Clone, Debug)]
pub(super) struct FieldRequirement {
    pointer: String,
    value: String,
    equal: bool,
}

pub(super) fn parse_selector(selector: &str) -> Vec<FieldRequirement> {
    selector
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|term| {
            let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else {
                let (f, v) = term.split_once('=').expect("field selector term has =");
                (f, v, true)
            };
            FieldRequirement {
                pointer: format!("/{}", field.replace('.', "/")),
                value: value.to_owned(),
                equal,
            }
        })
        .collect()
}

pub(super) fn matches(selector: &[FieldRequirement], object: &Value) -> bool {
    selector.iter().all(|r| {
        let actual = object
            .pointer(&r.pointer)
            .and_then(Value::as_str)
            .unwrap_or("");
        (actual == r.value) == r.equal
    })
}
