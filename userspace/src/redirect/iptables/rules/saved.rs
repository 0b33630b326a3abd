//! `iptables-save [-c]` output, parsed: what a pod's netns holds now.

use std::collections::{BTreeMap, BTreeSet};

/// One rule line of `iptables-save -c`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    /// Everything after `-A CHAIN `.
    pub spec: String,
    pub packets: u64,
    pub bytes: u64,
}

impl SavedRule {
    /// Whether the rule jumps (`-j`) or goes (`-g`) to `chain`.
    pub(super) fn targets(&self, chain: &str) -> bool {
        let tokens: Vec<&str> = self.spec.split_whitespace().collect();
        tokens
            .windows(2)
            .any(|w| matches!(w[0], "-j" | "-g") && w[1] == chain)
    }
}

/// One table of `iptables-save`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    /// Every chain declared, built-in or not.
    pub chains: BTreeSet<String>,
    /// Rules in file order (which is evaluation order within a chain).
    pub rules: Vec<SavedRule>,
}

impl SavedTable {
    pub(super) fn rules_of<'a>(
        &'a self,
        chain: &'a str,
    ) -> impl Iterator<Item = &'a SavedRule> + 'a {
        self.rules.iter().filter(move |r| r.chain == chain)
    }
}

/// The parsed output of `iptables-save [-c]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pub tables: BTreeMap<String, SavedTable>,
}

impl Saved {
    /// Parses `iptables-save` output, with or without `-c` counters.
    pub fn parse(text: &str) -> Result<Saved, String> {
        let mut saved = Saved::default();
        let mut table: Option<String> = None;
        for (number, raw) in text.lines().enumerate() {
            let line = raw.trim();
            let bad = |why: &str| format!("line {}: {why}: {line}", number + 1);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('*') {
                saved.tables.entry(name.to_string()).or_default();
                table = Some(name.to_string());
                continue;
            }
            if line == "COMMIT" {
                table = None;
                continue;
            }
            let current = table
                .as_ref()
                .and_then(|t| saved.tables.get_mut(t))
                .ok_or_else(|| bad("outside a table"))?;
            if let Some(declaration) = line.strip_prefix(':') {
                let name = declaration
                    .split_whitespace()
                    .next()
                    .ok_or_else(|| bad("empty chain declaration"))?;
                current.chains.insert(name.to_string());
                continue;
            }
            let (counters, rest) = match line.strip_prefix('[') {
                Some(after) => {
                    let (counters, rest) = after
                        .split_once(']')
                        .ok_or_else(|| bad("unterminated counters"))?;
                    (Some(counters), rest.trim_start())
                }
                None => (None, line),
            };
            let (packets, bytes) = match counters {
                Some(counters) => {
                    let (p, b) = counters
                        .split_once(':')
                        .ok_or_else(|| bad("malformed counters"))?;
                    (
                        p.parse().map_err(|_| bad("malformed packet counter"))?,
                        b.parse().map_err(|_| bad("malformed byte counter"))?,
                    )
                }
                None => (0, 0),
            };
            let rule = rest.strip_prefix("-A ").ok_or_else(|| bad("not a rule"))?;
            let (chain, spec) = rule.split_once(' ').unwrap_or((rule, ""));
            current.rules.push(SavedRule {
                chain: chain.to_string(),
                spec: spec.trim().to_string(),
                packets,
                bytes,
            });
        }
        Ok(saved)
    }
}
