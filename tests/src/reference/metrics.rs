//! `/metrics` against ztunnel's for the same case: the families Istio's
//! dashboards and alerts read from a node proxy ([`FAMILIES`]), each
//! with its type and every series' labels, names and values, as the real
//! ztunnel exposes them after the same rows. Sample values (counts,
//! bytes) are left out: when a connection's close is counted races the
//! scrape. A record holds ztunnel's side ([`normalise`]), so shunt is held
//! to it without the binary.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

/// The families compared, by the name their samples carry.
pub const FAMILIES: &[&str] = &[
    "istio_build",
    "istio_tcp_connections_opened_total",
    "istio_tcp_connections_closed_total",
    "istio_tcp_connections_failed_total",
    "istio_tcp_received_bytes_total",
    "istio_tcp_sent_bytes_total",
    "istio_tcp_sockets_open",
    "istio_xds_message_total",
    "istio_xds_message_bytes_total",
    "istio_xds_connection_terminations_total",
    "istio_dns_requests_total",
    "istio_on_demand_dns_total",
];

/// Labels whose value differs by design: compared by name only.
const ANY_VALUE: &[(&str, &str)] = &[
    // The version of the implementation.
    ("istio_build", "tag"),
];

/// Which proxy of a case a record is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The server's (`reporter="destination"`).
    Server,
    /// The client's, for cases with outbound rows (`reporter="source"`).
    Client,
}

/// Where the record of case `name`'s `side` lives (in the source tree).
pub fn record_path(name: &str, side: Side) -> PathBuf {
    let suffix = match side {
        Side::Server => ".txt",
        Side::Client => ".client.txt",
    };
    super::record_file("metrics", name, suffix)
}

/// The compared part of an exposition, one line each, sorted: `# TYPE`
/// lines of the compared families, then each series as
/// `name{label="value",...}` with its labels sorted and no value.
pub fn normalise(text: &str) -> Result<BTreeSet<String>, String> {
    let mut lines = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest
                .split_once(' ')
                .ok_or_else(|| format!("a TYPE line without a type: {line:?}"))?;
            if FAMILIES.iter().any(|f| sample_of(f, family)) {
                lines.insert(format!("# TYPE {family} {kind}"));
            }
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, labels) = parse_series(line)?;
        if !FAMILIES.contains(&name) {
            continue;
        }
        let labels: Vec<String> = labels
            .into_iter()
            .map(|(k, v)| {
                if ANY_VALUE.contains(&(name, k.as_str())) {
                    format!("{k}=*")
                } else {
                    format!("{k}={v:?}")
                }
            })
            .collect();
        lines.insert(format!("{name}{{{}}}", labels.join(",")));
    }
    Ok(lines)
}

/// Whether `sample` is a sample name of `family` (a counter's samples add
/// `_total` to its family name).
fn sample_of(sample: &str, family: &str) -> bool {
    sample == family || sample.strip_suffix("_total") == Some(family)
}

/// What differs between the record (ztunnel) and `got` (shunt): lines
/// missing from shunt and lines only shunt has, each named.
pub fn mismatches(recorded: &BTreeSet<String>, got: &BTreeSet<String>) -> Vec<String> {
    let missing = recorded
        .difference(got)
        .map(|l| format!("ztunnel has, shunt lacks: {l}"));
    let extra = got
        .difference(recorded)
        .map(|l| format!("shunt has, ztunnel lacks: {l}"));
    missing.chain(extra).collect()
}

/// A sample line's name and labels (sorted by name).
fn parse_series(line: &str) -> Result<(&str, BTreeMap<String, String>), String> {
    let bad = |why: &str| format!("{why}: {line:?}");
    let name_end = line
        .find(['{', ' '])
        .ok_or_else(|| bad("a sample without a value"))?;
    let name = &line[..name_end];
    let mut labels = BTreeMap::new();
    if line[name_end..].starts_with('{') {
        let mut rest = &line[name_end + 1..];
        loop {
            if let Some(after) = rest.strip_prefix('}') {
                if !after.starts_with(' ') {
                    return Err(bad("no value after the labels"));
                }
                break;
            }
            let (key, after) = rest
                .split_once("=\"")
                .ok_or_else(|| bad("a label without a value"))?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next() {
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err(bad("an unfinished escape")),
                    },
                    Some((_, c)) => value.push(c),
                    None => return Err(bad("an unterminated label value")),
                }
            };
            labels.insert(key.trim_start_matches(',').to_owned(), value);
            rest = &after[end + 1..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
    }
    Ok((name, labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_named_with_sorted_labels_and_no_value() {
        let text = "# HELP istio_tcp_connections_opened The total.\n\
            # TYPE istio_tcp_connections_opened counter\n\
            istio_tcp_connections_opened_total{reporter=\"destination\",a=\"x\\\"y\"} 3\n\
            # TYPE shunt_pods gauge\n\
            shunt_pods{state=\"enrolled\"} 1\n\
            istio_build{component=\"ztunnel\",tag=\"1.28\"} 1\n\
            # EOF\n";
        let lines: Vec<String> = normalise(text).expect("parses").into_iter().collect();
        assert_eq!(
            lines,
            [
                "# TYPE istio_tcp_connections_opened counter",
                "istio_build{component=\"ztunnel\",tag=*}",
                "istio_tcp_connections_opened_total{a=\"x\\\"y\",reporter=\"destination\"}",
            ]
        );
    }

    #[test]
    fn a_broken_line_is_named() {
        let err = normalise("istio_build{component=\"ztunnel} 1\n").expect_err("broken");
        assert!(err.contains("unterminated"), "{err}");
    }
}
