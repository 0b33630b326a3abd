//! The access lines against ztunnel's for the same case: for each line,
//! who talked to whom as ztunnel's line names them (`src.workload`,
//! `src.namespace`, `src.identity`, `src.cluster`, `dst.service` and the
//! other `dst.` ones, each left out when unknown) and whether it carries ztunnel's `bytes_sent`, `bytes_recv`
//! and `duration="Nms"`. Addresses, ports, byte counts and durations are
//! left out: they differ from run to run. A record holds ztunnel's side
//! ([`normalise`]), so shunt is held to it without the binary.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

/// The names compared, in the line's order.
const NAMES: &[&str] = &[
    "src.workload",
    "src.namespace",
    "src.identity",
    "src.cluster",
    "dst.service",
    "dst.workload",
    "dst.namespace",
    "dst.identity",
    "dst.cluster",
];

/// Where the record of case `name` lives (in the source tree).
pub fn record_path(name: &str) -> PathBuf {
    super::record_file("access", name, ".txt")
}

/// The compared part of every access line of `logs` (either proxy's
/// text log), one line each, sorted.
pub fn normalise(logs: &str) -> Result<BTreeSet<String>, String> {
    let mut lines = BTreeSet::new();
    for line in logs.lines() {
        let Some((_, fields)) = line.split_once("connection complete") else {
            continue;
        };
        // shunt's kernel-side refusals are `connection refused`; its
        // other lines carry the target (ztunnel's: `access`).
        if !(line.contains("shunt::access") || line.contains("\taccess\t")) {
            continue;
        }
        let fields = parse_fields(fields).map_err(|e| format!("{e}: {line:?}"))?;
        // shunt names plaintext inbound and passthrough apart; ztunnel's
        // are `inbound` and `outbound`.
        let direction = match fields.get("direction").map(String::as_str) {
            Some("inbound" | "inbound_plaintext") => "inbound",
            Some("outbound" | "passthrough") => "outbound",
            other => return Err(format!("direction {other:?}: {line:?}")),
        };
        let mut out = format!("direction={direction}");
        for name in NAMES {
            if let Some(value) = fields.get(*name) {
                out.push_str(&format!(" {name}={value:?}"));
            }
        }
        for key in ["bytes_sent", "bytes_recv"] {
            if fields.get(key).is_none_or(|v| v.parse::<u64>().is_err()) {
                out.push_str(&format!(" no-{key}"));
            }
        }
        let duration = fields.get("duration");
        if !duration.is_some_and(|d| {
            d.strip_suffix("ms")
                .is_some_and(|n| n.parse::<u64>().is_ok())
        }) {
            out.push_str(" no-duration-ms");
        }
        lines.insert(out);
    }
    Ok(lines)
}

/// `key=value` fields separated by spaces or tabs; a value is bare or
/// quoted (with `\"` and `\\` escaped).
fn parse_fields(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut fields = BTreeMap::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once('=')
            .ok_or_else(|| format!("a field without a value at {rest:?}"))?;
        let (value, after) = if let Some(quoted) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let end = loop {
                match chars.next() {
                    Some((i, '"')) => break i + 1,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, c)) => value.push(c),
                        None => return Err("an unfinished escape".into()),
                    },
                    Some((_, c)) => value.push(c),
                    None => return Err("an unterminated value".into()),
                }
            };
            (value, &quoted[end..])
        } else {
            let end = after.find([' ', '\t']).unwrap_or(after.len());
            (after[..end].to_owned(), &after[end..])
        };
        fields.insert(key.trim().to_owned(), value);
        rest = after.trim_start();
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_proxies_lines_give_the_same_names() {
        let ztunnel = "2026-12-05T02:33:31Z\tinfo\taccess\tconnection complete\t\
            src.addr=198.18.1.10:42944 src.workload=\"client\" src.namespace=\"default\" \
            src.identity=\"spiffe://cluster.local/ns/default/sa/sa-client\" src.cluster=\"Kubernetes\" \
            dst.addr=198.18.2.10:15008 dst.service=\"anywhere.default.svc.cluster.local\" \
            dst.workload=\"server\" direction=\"outbound\" \
            bytes_sent=4096 bytes_recv=4096 duration=\"10ms\"\n";
        let shunt = "2026-12-05T02:33:32Z  INFO outbound{pod=default/client}: shunt::access: \
            connection complete direction=\"outbound\" pod=default/client \
            src.addr=198.18.1.10:39392 src.workload=\"client\" src.namespace=\"default\" \
            src.identity=\"spiffe://cluster.local/ns/default/sa/sa-client\" \
            src.cluster=\"Kubernetes\" dst.addr=198.18.2.10:8080 \
            dst.service=\"anywhere.default.svc.cluster.local\" \
            dst.workload=\"server\" bytes_sent=4096 bytes_recv=4096 duration=\"10ms\" reason=\"\"\n";
        let expected = "direction=outbound src.workload=\"client\" src.namespace=\"default\" \
            src.identity=\"spiffe://cluster.local/ns/default/sa/sa-client\" \
            src.cluster=\"Kubernetes\" dst.service=\"anywhere.default.svc.cluster.local\" \
            dst.workload=\"server\"";
        assert_eq!(
            normalise(ztunnel).expect("parses"),
            BTreeSet::from([expected.to_owned()])
        );
        assert_eq!(
            normalise(shunt).expect("parses"),
            BTreeSet::from([expected.to_owned()])
        );
        // Without ztunnel's byte and duration fields, it shows.
        let old = shunt
            .replace("bytes_recv", "bytes_received")
            .replace("duration=\"10ms\"", "duration_ms=10");
        let got = normalise(&old).expect("parses");
        assert_eq!(
            got,
            BTreeSet::from([format!("{expected} no-bytes_recv no-duration-ms")])
        );
    }

    #[test]
    fn records_are_found_by_their_case_name() {
        let case = "DENY serviceAccounts [default/sleep]";
        assert!(
            record_path(case).exists(),
            "{}",
            record_path(case).display()
        );
        let server =
            crate::reference::metrics::record_path(case, crate::reference::metrics::Side::Server);
        assert!(server.exists(), "{}", server.display());
        let client = crate::reference::metrics::record_path(
            "no load balancing: the endpoint on the other node",
            crate::reference::metrics::Side::Client,
        );
        assert!(client.exists(), "{}", client.display());
    }

    #[test]
    fn a_broken_line_is_named() {
        let err = normalise("x shunt::access: connection complete direction=\"outbound")
            .expect_err("broken");
        assert!(err.contains("unterminated"), "{err}");
    }
}
