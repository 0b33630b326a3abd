//! `/config_dump` held against ztunnel's: what `istioctl ztunnel-config`
//! and Kiali read (the workloads, services and policies), from the same
//! xDS. ztunnel's answer for a case is recorded in
//! `tests/src/reference/expected/config_dump/` (made by
//! [`normalise`] from the real binary, `SHUNT_RECORD_DUMPS=1`); shunt's
//! must carry every key it has, with the same values. shunt's own extras
//! are allowed (its `shunt` keys, an endpoint's `address` and `service`,
//! `ipFamilies` from the VIPs); a key ztunnel has and shunt lacks, or a
//! different value, is a mismatch. With the binary at hand, ztunnel's
//! live answer must still equal the record.

use std::path::PathBuf;

use serde_json::{Map, Value};

/// Where a case's record lives.
pub fn record_path(case: &str) -> PathBuf {
    let slug: String = case
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/reference/expected/config_dump")
        .join(format!("{}.json", slug.trim_matches('-')))
}

/// The part of a dump the tools read, in an order that does not depend
/// on the peer: workloads by uid, services by namespace/hostname,
/// policies by namespace/name; a service's endpoints as a list by workload
/// uid (their map keys differ between ztunnel versions and shunt); a
/// workload's services sorted.
pub fn normalise(dump: &Value) -> Value {
    let sorted = |key: &str, by: &[&str]| -> Value {
        let mut items: Vec<Value> = dump[key].as_array().cloned().unwrap_or_default();
        for item in &mut items {
            tidy(item);
        }
        items.sort_by_key(|item| {
            by.iter()
                .map(|k| item[*k].as_str().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
        });
        Value::Array(items)
    };
    let mut out = Map::new();
    out.insert("workloads".into(), sorted("workloads", &["uid"]));
    out.insert(
        "services".into(),
        sorted("services", &["namespace", "hostname"]),
    );
    out.insert(
        "policies".into(),
        sorted("policies", &["namespace", "name"]),
    );
    Value::Object(out)
}

fn tidy(item: &mut Value) {
    if let Some(services) = item.get_mut("services").and_then(Value::as_array_mut) {
        services.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
    }
    let endpoints = item.get("endpoints").and_then(Value::as_object).map(|e| {
        let mut list: Vec<Value> = e.values().cloned().collect();
        list.sort_by(|a, b| a["workloadUid"].as_str().cmp(&b["workloadUid"].as_str()));
        list
    });
    if let Some(list) = endpoints {
        item["endpoints"] = Value::Array(list);
    }
}

/// Where shunt's normalised dump `got` lacks or differs from ztunnel's
/// recorded `want` (keys only `got` has are shunt's own and pass).
pub fn mismatches(want: &Value, got: &Value) -> Vec<String> {
    let mut out = Vec::new();
    compare("", want, got, &mut out);
    out
}

fn compare(at: &str, want: &Value, got: &Value, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (key, wanted) in w {
                let path = format!("{at}.{key}");
                match g.get(key) {
                    Some(seen) => compare(&path, wanted, seen, out),
                    None => out.push(format!("{path}: missing (ztunnel: {wanted})")),
                }
            }
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => {
            for (i, (wanted, seen)) in w.iter().zip(g).enumerate() {
                compare(&format!("{at}[{i}]"), wanted, seen, out);
            }
        }
        (Value::Array(w), Value::Array(g)) => out.push(format!(
            "{at}: {} entries, ztunnel has {}: {got} against {want}",
            g.len(),
            w.len()
        )),
        _ if want == got => {}
        _ => out.push(format!("{at}: {got}, ztunnel: {want}")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn extras_pass_and_a_missing_key_or_value_does_not() {
        let want =
            json!({"workloads": [{"uid": "a", "networkMode": "Standard", "services": ["x"]}]});
        let got = json!({"workloads": [{"uid": "a", "networkMode": "Standard", "services": ["x"], "shunt": {}}]});
        assert!(mismatches(&want, &got).is_empty());
        let got = json!({"workloads": [{"uid": "a", "services": {"x": {"80": 8080}}}]});
        assert_eq!(
            mismatches(&want, &got),
            [
                ".workloads[0].networkMode: missing (ztunnel: \"Standard\")",
                ".workloads[0].services: {\"x\":{\"80\":8080}}, ztunnel: [\"x\"]",
            ]
        );
    }

    #[test]
    fn the_order_and_endpoint_keys_of_either_peer_do_not_matter() {
        let a = json!({"services": [
            {"namespace": "n", "hostname": "b", "endpoints": {"k1": {"workloadUid": "u2"}, "k2": {"workloadUid": "u1"}}},
            {"namespace": "n", "hostname": "a", "endpoints": {}},
        ]});
        let b = json!({"services": [
            {"namespace": "n", "hostname": "a", "endpoints": {}},
            {"namespace": "n", "hostname": "b", "endpoints": {"u1": {"workloadUid": "u1"}, "u2": {"workloadUid": "u2"}}},
        ]});
        assert_eq!(normalise(&a), normalise(&b));
    }
}
