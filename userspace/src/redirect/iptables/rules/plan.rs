//! From what a netns holds ([`Saved`]) to what shunt wants ([`RuleSet`]):
//! the `iptables-restore` input that applies or removes our rules, the
//! drift between the two, and the counters of our redirect rules.

use std::collections::BTreeSet;

use super::{ChainSpec, Counts, RuleSet, Saved, saved::SavedRule};

impl RuleSet {
    fn tables(&self) -> BTreeSet<&'static str> {
        self.chains.iter().map(|c| c.table).collect()
    }

    /// The restore input that turns `saved` into this rule set, touching
    /// nothing else; `None` when everything is already in place (so an
    /// agent restart changes nothing, not even counters).
    ///
    /// A chain whose rules differ at all is rewritten whole (`:CHAIN`
    /// declares it, or flushes it if it exists) inside the table's
    /// transaction, so the pod never sees half a chain. Jumps are inserted
    /// first in their built-in chain so that no earlier rule can let
    /// traffic bypass the proxy; duplicate or foreign-owner jumps to our
    /// chains are replaced by exactly one of ours.
    pub fn plan_apply(&self, saved: &Saved) -> Option<String> {
        let mut script = String::new();
        for table in self.tables() {
            let current = saved.tables.get(table);
            let mut lines = Vec::new();
            for chain in self.chains.iter().filter(|c| c.table == table) {
                let wanted: Vec<&str> = chain.rules.iter().map(|r| r.spec.as_str()).collect();
                let declared = current.is_some_and(|t| t.chains.contains(chain.chain));
                let have: Vec<&str> = current
                    .map(|t| t.rules_of(chain.chain).map(|r| r.spec.as_str()).collect())
                    .unwrap_or_default();
                if !declared || have != wanted {
                    lines.push(format!(":{} - [0:0]", chain.chain));
                    lines.extend(
                        wanted
                            .iter()
                            .map(|spec| format!("-A {} {spec}", chain.chain)),
                    );
                }
            }
            for chain in self.chains.iter().filter(|c| c.table == table) {
                let jump = self.jump(chain);
                let jumps: Vec<&SavedRule> = current
                    .map(|t| {
                        t.rules_of(chain.builtin)
                            .filter(|r| r.targets(chain.chain))
                            .collect()
                    })
                    .unwrap_or_default();
                if jumps.len() == 1 && jumps[0].spec == jump {
                    continue;
                }
                for existing in jumps {
                    lines.push(format!("-D {} {}", chain.builtin, existing.spec));
                }
                lines.push(format!("-I {} 1 {jump}", chain.builtin));
            }
            if !lines.is_empty() {
                script.push_str(&format!("*{table}\n"));
                for line in lines {
                    script.push_str(&line);
                    script.push('\n');
                }
                script.push_str("COMMIT\n");
            }
        }
        (!script.is_empty()).then_some(script)
    }

    /// What is missing or wrong in `saved`, one human-readable line each;
    /// empty when the rule set is fully in place.
    pub fn drift(&self, saved: &Saved) -> Vec<String> {
        let family = self.family.label();
        let mut drift = Vec::new();
        for chain in &self.chains {
            let (table, name) = (chain.table, chain.chain);
            let current = saved.tables.get(table);
            if !current.is_some_and(|t| t.chains.contains(name)) {
                drift.push(format!("{family} {table} chain {name}"));
            } else if let Some(current) = current {
                let have: Vec<&str> = current.rules_of(name).map(|r| r.spec.as_str()).collect();
                let before = drift.len();
                for rule in &chain.rules {
                    if !have.contains(&rule.spec.as_str()) {
                        drift.push(format!("{family} {table} rule -A {name} {}", rule.spec));
                    }
                }
                for spec in &have {
                    if !chain.rules.iter().any(|r| r.spec == *spec) {
                        drift.push(format!("{family} {table} unexpected rule -A {name} {spec}"));
                    }
                }
                let wanted: Vec<&str> = chain.rules.iter().map(|r| r.spec.as_str()).collect();
                if drift.len() == before && have != wanted {
                    drift.push(format!("{family} {table} {name} rules out of order"));
                }
            }
            let jumps = current
                .map(|t| {
                    t.rules_of(chain.builtin)
                        .filter(|r| r.targets(name))
                        .count()
                })
                .unwrap_or(0);
            match jumps {
                0 => drift.push(format!("{family} {table} jump {} -> {name}", chain.builtin)),
                1 => {}
                n => drift.push(format!(
                    "{family} {table} {n} jumps {} -> {name} (want one)",
                    chain.builtin
                )),
            }
        }
        drift
    }

    /// Sum of the packet and byte counters of the rules that count `counts`.
    pub fn counters(&self, saved: &Saved, counts: Counts) -> (u64, u64) {
        let mut total = (0, 0);
        for chain in &self.chains {
            let Some(table) = saved.tables.get(chain.table) else {
                continue;
            };
            for rule in chain.rules.iter().filter(|r| r.counts == Some(counts)) {
                if let Some(found) = table.rules_of(chain.chain).find(|r| r.spec == rule.spec) {
                    total.0 += found.packets;
                    total.1 += found.bytes;
                }
            }
        }
        total
    }

    /// Whether `chain`'s rules and its jump are all in place in `saved`.
    pub fn chain_present(&self, saved: &Saved, chain: &ChainSpec) -> bool {
        let Some(table) = saved.tables.get(chain.table) else {
            return false;
        };
        let have: Vec<&str> = table
            .rules_of(chain.chain)
            .map(|r| r.spec.as_str())
            .collect();
        let wanted: Vec<&str> = chain.rules.iter().map(|r| r.spec.as_str()).collect();
        table.chains.contains(chain.chain)
            && have == wanted
            && table
                .rules_of(chain.builtin)
                .filter(|r| r.targets(chain.chain))
                .count()
                == 1
    }
}

/// The restore input that removes every trace of shunt from `saved`: every
/// rule anywhere that jumps to one of our chains (whoever's comment it
/// carries), then our chains, flushed and deleted, in one transaction per
/// table. `None` when there is nothing of ours.
/// `ours`: the rule set's [`RuleSet::chain_names`].
pub fn plan_remove(saved: &Saved, ours: &[&str]) -> Option<String> {
    let mut script = String::new();
    for (name, table) in &saved.tables {
        let chains: Vec<&str> = ours
            .iter()
            .copied()
            .filter(|c| table.chains.contains(*c))
            .collect();
        let jumps: Vec<&SavedRule> = table
            .rules
            .iter()
            .filter(|r| !ours.contains(&r.chain.as_str()) && ours.iter().any(|c| r.targets(c)))
            .collect();
        if chains.is_empty() && jumps.is_empty() {
            continue;
        }
        script.push_str(&format!("*{name}\n"));
        for jump in jumps {
            script.push_str(&format!("-D {} {}\n", jump.chain, jump.spec));
        }
        // Flush all before deleting any: our chains never jump to each
        // other today, but a chain still referenced cannot be deleted.
        for chain in &chains {
            script.push_str(&format!("-F {chain}\n"));
        }
        for chain in &chains {
            script.push_str(&format!("-X {chain}\n"));
        }
        script.push_str("COMMIT\n");
    }
    (!script.is_empty()).then_some(script)
}

/// Whether `saved` holds a jump to our chains carrying `comment` (a netns
/// enrolled by the agent that owns that comment).
pub fn has_owner_jump(saved: &Saved, comment: &str, chains: &[&str]) -> bool {
    let needle = format!("--comment \"{comment}\"");
    saved.tables.values().any(|t| {
        t.rules
            .iter()
            .any(|r| r.spec.contains(&needle) && chains.iter().any(|c| r.targets(c)))
    })
}
