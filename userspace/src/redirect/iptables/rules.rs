//! The rules shunt installs in a pod's netns, and the pure logic around them:
//! parsing `iptables-save`, planning the `iptables-restore` input that brings
//! a netns to the wanted state (or removes ours), and naming drift.
//!
//! Everything here works on text, so it is unit-tested without a kernel; the
//! rule specs are written exactly in the canonical form `iptables-save`
//! prints them (checked against both backends), so that "what is installed"
//! and "what we want" compare as strings.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use shunt_common::{
    PORT_DNS, PORT_DNS_PROXY, PORT_HBONE, PORT_INBOUND_PLAINTEXT, PORT_OUTBOUND, PROXY_MARK,
};

use crate::redirect::Capture;

/// Our chain for locally generated traffic (nat and mangle `OUTPUT`).
pub const CHAIN_OUTPUT: &str = "SHUNT_OUTPUT";
/// Our chain for arriving traffic (nat and mangle `PREROUTING`).
pub const CHAIN_PREROUTING: &str = "SHUNT_PRERT";

/// Only the low 12 bits of the packet mark are ours (see [`MARK_MASK`]).
/// [`CONN_MARK`] is the connection mark given to connections the proxy
/// opened into the pod (transparent inbound), restored as the packet mark on
/// the pod's replies so that the policy route sends them back to the proxy
/// over `lo`.
pub use shunt_common::{MARK_MASK, REPLY_MARK as CONN_MARK};

/// Istio's IPv6 health-probe source address: the node SNATs kubelet probes
/// to it, and they are never captured (probes must reach the app directly).
/// The IPv4 one is configurable (`--probe-source`, default 169.254.7.127).
pub const PROBE_SOURCE_V6: &str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff";

pub use crate::redirect::route::Family;

impl Family {
    fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.1/32",
            Family::V6 => "::1/128",
        }
    }
}

/// Which way a rule's packet counter counts redirected connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counts {
    /// nat `OUTPUT` REDIRECT to 15001.
    Outbound,
    /// nat `PREROUTING` REDIRECT to 15006.
    Inbound,
}

/// One rule of one of our chains.
#[derive(Clone, Debug)]
pub struct Rule {
    /// The rule as `iptables-save` prints it, after `-A CHAIN `.
    pub spec: String,
    /// Whether its counters are the pod's redirected-connection counters.
    pub counts: Option<Counts>,
}

/// One of our chains, the built-in chain that jumps to it, and its rules.
#[derive(Clone, Debug)]
pub struct ChainSpec {
    pub table: &'static str,
    pub builtin: &'static str,
    pub chain: &'static str,
    /// What it is for, for hooks and logs.
    pub purpose: &'static str,
    pub rules: Vec<Rule>,
}

/// Everything shunt wants in one family's tables of one pod.
#[derive(Clone, Debug)]
pub struct RuleSet {
    pub family: Family,
    /// The comment on our jumps ([`owner_comment`]); it marks the jumps as
    /// ours and says which agent installed them (see `remove_stale`).
    pub owner_comment: String,
    pub chains: Vec<ChainSpec>,
}

/// `shunt:<owner>`, with anything but `[A-Za-z0-9@._-]` replaced, so it can
/// never break the quoting of the restore input.
pub fn owner_comment(owner: &str) -> String {
    let clean: String = owner
        .chars()
        .take(200)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '@' | '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("shunt:{clean}")
}

/// Istio's in-pod DNS rules (istio-cni's, as `iptables-save` prints them),
/// for a pod whose DNS is captured.
pub struct DnsRules {
    /// nat OUTPUT: the application's DNS to the DNS proxy on 15053.
    pub nat: Vec<Rule>,
    /// raw OUTPUT: the proxy's own DNS to port 53 in conntrack zone 1.
    pub raw_output: Rule,
    /// raw PREROUTING: answers from port 53 (not the proxy's) in zone 1.
    pub raw_prerouting: Rule,
}

impl DnsRules {
    /// The raw table's two chains (named `output` and `prerouting`), each
    /// with its one rule.
    pub fn raw_chains(self, output: &'static str, prerouting: &'static str) -> [ChainSpec; 2] {
        [
            ChainSpec {
                table: "raw",
                builtin: "OUTPUT",
                chain: output,
                purpose: "DNS: the proxy's own queries in conntrack zone 1",
                rules: vec![self.raw_output],
            },
            ChainSpec {
                table: "raw",
                builtin: "PREROUTING",
                chain: prerouting,
                purpose: "DNS: answers from port 53 in conntrack zone 1",
                rules: vec![self.raw_prerouting],
            },
        ]
    }
}

/// Istio's DNS rules: UDP to port 53 not leaving through `lo`, and TCP to
/// port 53 not to loopback, REDIRECTed to 15053 (the DNS proxy), unless
/// marked by the proxy; the proxy's queries and every answer from port 53
/// in conntrack zone 1, so that the proxy's upstream query and an
/// application's NATed query with the same ports never share an entry.
/// `not_marked`: Istio's nat rules carry `! --mark 0x539/0xfff` themselves
/// (`Some(mark)`); shunt's chain has already RETURNed marked packets
/// (`None`).
pub fn dns_rules(family: Family, not_marked: Option<&str>) -> DnsRules {
    let lo = family.loopback();
    let mark = format!("0x{PROXY_MARK:x}/0x{MARK_MASK:x}");
    let unmarked = not_marked
        .map(|mark| format!(" -m mark ! --mark {mark}"))
        .unwrap_or_default();
    let rule = |spec: String| Rule { spec, counts: None };
    DnsRules {
        nat: vec![
            rule(format!(
                "! -o lo -p udp{unmarked} -m udp --dport {PORT_DNS} -j REDIRECT --to-ports {PORT_DNS_PROXY}"
            )),
            rule(format!(
                "! -d {lo} -p tcp -m tcp --dport {PORT_DNS}{unmarked} -j REDIRECT --to-ports {PORT_DNS_PROXY}"
            )),
        ],
        raw_output: rule(format!(
            "-p udp -m mark --mark {mark} -m udp --dport {PORT_DNS} -j CT --zone 1"
        )),
        raw_prerouting: rule(format!(
            "-p udp -m mark ! --mark {mark} -m udp --sport {PORT_DNS} -j CT --zone 1"
        )),
    }
}

/// What a pod's rules capture: the pod's [`Capture`] settings and the
/// agent's probe source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub capture: Capture,
    pub probe_source_v4: Ipv4Addr,
}

impl RuleSet {
    /// The in-pod rules, equivalent to Istio's in-pod (ztunnel) rules with
    /// REDIRECT for inbound (with every direction captured and nothing
    /// excluded):
    ///
    /// ```text
    /// mangle SHUNT_PRERT  (from PREROUTING)
    ///   mark 0x539/0xfff          -> CONNMARK set 0x111/0xfff
    /// mangle SHUNT_OUTPUT (from OUTPUT)
    ///   connmark 0x111/0xfff      -> CONNMARK restore-mark
    /// nat SHUNT_PRERT     (from PREROUTING)
    ///   tcp from probe source     -> RETURN
    ///   tcp dport 15008           -> RETURN
    ///   mark 0x539/0xfff          -> RETURN
    ///   [tcp dport EXCLUDED       -> RETURN]   per excluded inbound port
    ///   tcp not to loopback       -> REDIRECT 15006
    /// nat SHUNT_OUTPUT    (from OUTPUT)
    ///   tcp to probe source       -> RETURN
    ///   tcp mark 0x111/0xfff      -> RETURN
    ///   mark 0x539/0xfff          -> RETURN
    ///   out lo, not to loopback   -> RETURN
    ///   [tcp dport EXCLUDED       -> RETURN]   per excluded outbound port
    ///   [to EXCLUDED CIDR         -> RETURN]   per excluded CIDR (IPv4)
    ///   tcp not to loopback       -> REDIRECT 15001
    /// ```
    ///
    /// With the pod's DNS captured ([`Capture::dns`]), Istio's DNS rules
    /// join, as [`dns_rules`] builds them: in nat `SHUNT_OUTPUT`, right
    /// after the proxy's own mark returns, UDP to port 53 not out of `lo`
    /// and TCP to port 53 not to loopback are REDIRECTed to the DNS proxy's
    /// 15053; raw `SHUNT_OUTPUT`/`SHUNT_PRERT` put the proxy's own DNS
    /// (mark 0x539, to port 53) and every answer from port 53 in conntrack
    /// zone 1, apart from the application's NATed queries.
    ///
    /// The mangle pair and the policy route (`route.rs`) serve the proxy's
    /// transparent inbound connections: the proxy connects to the app from
    /// the original client's address (`IP_TRANSPARENT`) with its mark; the
    /// connection gets connmark 0x111 as it arrives over `lo`; the app's
    /// replies get it back as their packet mark, and `ip rule fwmark 0x111`
    /// routes them to `lo` instead of out of `eth0` towards the real client.
    ///
    /// Where Istio ACCEPTs, we RETURN: the verdict is then left to whatever
    /// else is in the built-in chain, so rules others put in the pod see
    /// every packet we do not redirect exactly as if we were not there.
    ///
    /// A direction that is not captured (`--capture off`) keeps its chain
    /// but ends in RETURN instead of REDIRECT: the pod is enrolled and its
    /// new connections counted, none redirected (what the eBPF mode does
    /// with capture off).
    pub fn inpod(family: Family, owner_comment: &str, settings: &Settings) -> RuleSet {
        let capture = &settings.capture;
        let mark = format!("0x{PROXY_MARK:x}/0x{MARK_MASK:x}");
        let conn_mark = format!("0x{CONN_MARK:x}/0x{MARK_MASK:x}");
        let lo = family.loopback();
        let probe = match family {
            Family::V4 => format!("{}/32", settings.probe_source_v4),
            Family::V6 => format!("{PROBE_SOURCE_V6}/128"),
        };
        let rule = |spec: String| Rule { spec, counts: None };
        let port_rules = |ports: &[u16]| -> Vec<Rule> {
            let mut ports = ports.to_vec();
            ports.sort_unstable();
            ports.dedup();
            ports
                .into_iter()
                .map(|port| rule(format!("-p tcp -m tcp --dport {port} -j RETURN")))
                .collect()
        };
        let last = |captured: bool, to_port: u16, counts: Counts| Rule {
            spec: if captured {
                format!("! -d {lo} -p tcp -j REDIRECT --to-ports {to_port}")
            } else {
                format!("! -d {lo} -p tcp -j RETURN")
            },
            counts: Some(counts),
        };

        let mut inbound = vec![
            // Kubelet probes must reach the app, not the proxy.
            rule(format!("-s {probe} -p tcp -j RETURN")),
            // HBONE: the proxy listens on podIP:15008 itself.
            rule(format!("-p tcp -m tcp --dport {PORT_HBONE} -j RETURN")),
            rule(format!("-m mark --mark {mark} -j RETURN")),
        ];
        inbound.extend(port_rules(&capture.excluded_inbound_ports));
        inbound.push(last(
            capture.inbound,
            PORT_INBOUND_PLAINTEXT,
            Counts::Inbound,
        ));

        let mut outbound = vec![
            // Replies to the probe source.
            rule(format!("-d {probe} -p tcp -j RETURN")),
            // Connections the proxy opened into the pod (connmark restored
            // by the mangle rules).
            rule(format!("-p tcp -m mark --mark {conn_mark} -j RETURN")),
            // The proxy's own sockets.
            rule(format!("-m mark --mark {mark} -j RETURN")),
        ];
        if capture.dns {
            outbound.extend(dns_rules(family, None).nat);
        }
        // The app talking to its own pod IP (routed over lo).
        outbound.push(rule(format!("! -d {lo} -o lo -j RETURN")));
        outbound.extend(port_rules(&capture.excluded_outbound_ports));
        if family == Family::V4 {
            for (addr, prefix) in &capture.excluded_outbound_cidrs {
                // iptables-save prints the network address: mask it the same
                // way so that installed and wanted rules compare equal.
                let prefix = (*prefix).min(32);
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                let network = Ipv4Addr::from(u32::from(*addr) & mask);
                outbound.push(rule(format!("-d {network}/{prefix} -j RETURN")));
            }
        }
        outbound.push(last(capture.outbound, PORT_OUTBOUND, Counts::Outbound));

        let mut chains = vec![
            ChainSpec {
                table: "mangle",
                builtin: "PREROUTING",
                chain: CHAIN_PREROUTING,
                purpose: "connmark the proxy's transparent inbound connections",
                rules: vec![rule(format!(
                    "-m mark --mark {mark} -j CONNMARK --set-xmark {conn_mark}"
                ))],
            },
            ChainSpec {
                table: "mangle",
                builtin: "OUTPUT",
                chain: CHAIN_OUTPUT,
                purpose: "restore the connmark on replies to the proxy",
                rules: vec![rule(format!(
                    "-m connmark --mark {conn_mark} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"
                ))],
            },
            ChainSpec {
                table: "nat",
                builtin: "PREROUTING",
                chain: CHAIN_PREROUTING,
                purpose: if capture.inbound {
                    "inbound plaintext TCP to 15006"
                } else {
                    "inbound TCP counted, not redirected (capture off)"
                },
                rules: inbound,
            },
            ChainSpec {
                table: "nat",
                builtin: "OUTPUT",
                chain: CHAIN_OUTPUT,
                purpose: if capture.outbound {
                    "outbound TCP to 15001"
                } else {
                    "outbound TCP counted, not redirected (capture off)"
                },
                rules: outbound,
            },
        ];
        if capture.dns {
            chains.extend(dns_rules(family, None).raw_chains(CHAIN_OUTPUT, CHAIN_PREROUTING));
        }
        RuleSet {
            family,
            owner_comment: owner_comment.to_string(),
            chains,
        }
    }

    /// The names of this set's chains (each once).
    pub fn chain_names(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = self.chains.iter().map(|c| c.chain).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// The rule in `builtin` that jumps to `chain`.
    pub fn jump(&self, chain: &ChainSpec) -> String {
        format!(
            "-m comment --comment \"{}\" -j {}",
            self.owner_comment, chain.chain
        )
    }

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
    fn targets(&self, chain: &str) -> bool {
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
    fn rules_of<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a SavedRule> + 'a {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Settings {
        Settings {
            capture: Capture::all(),
            probe_source_v4: Ipv4Addr::new(169, 254, 7, 127),
        }
    }

    /// What `iptables-nft-save -c` printed in a netns after the restore input
    /// of `plan_apply` (captured on this project's dev machine).
    fn installed_v4() -> String {
        let rules = RuleSet::inpod(Family::V4, "shunt:node-a", &all());
        let mut text = String::from("# Generated by iptables-nft-save v1.8.9 (nf_tables)\n");
        for table in ["mangle", "nat"] {
            text.push_str(&format!(
                "*{table}\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
            ));
            for chain in rules.chains.iter().filter(|c| c.table == table) {
                text.push_str(&format!(":{} - [0:0]\n", chain.chain));
            }
            for chain in rules.chains.iter().filter(|c| c.table == table) {
                text.push_str(&format!(
                    "[0:0] -A {} {}\n",
                    chain.builtin,
                    rules.jump(chain)
                ));
            }
            for chain in rules.chains.iter().filter(|c| c.table == table) {
                for (i, rule) in chain.rules.iter().enumerate() {
                    text.push_str(&format!(
                        "[{i}:{}] -A {} {}\n",
                        i * 60,
                        chain.chain,
                        rule.spec
                    ));
                }
            }
            text.push_str("COMMIT\n");
        }
        text
    }

    #[test]
    fn an_empty_netns_gets_every_chain_and_jump_in_one_transaction_per_table() {
        let rules = RuleSet::inpod(Family::V4, "shunt:node-a", &all());
        let script = rules.plan_apply(&Saved::default()).expect("a plan");
        assert_eq!(script.matches("COMMIT").count(), 2, "{script}");
        assert!(
            script.contains(
                "*nat\n:SHUNT_PRERT - [0:0]\n-A SHUNT_PRERT -s 169.254.7.127/32 -p tcp -j RETURN\n"
            ),
            "{script}"
        );
        assert!(
            script.contains(
                "-A SHUNT_OUTPUT ! -d 127.0.0.1/32 -p tcp -j REDIRECT --to-ports 15001\n"
            )
        );
        assert!(
            script
                .contains("-A SHUNT_PRERT ! -d 127.0.0.1/32 -p tcp -j REDIRECT --to-ports 15006\n")
        );
        assert!(script.contains("-A SHUNT_PRERT -p tcp -m tcp --dport 15008 -j RETURN\n"));
        assert!(script.contains("-A SHUNT_OUTPUT -m mark --mark 0x539/0xfff -j RETURN\n"));
        assert!(
            script.contains("-I OUTPUT 1 -m comment --comment \"shunt:node-a\" -j SHUNT_OUTPUT\n")
        );
        assert!(!script.contains("-D "), "{script}");
        assert_eq!(
            rules.drift(&Saved::default()).len(),
            8,
            "4 chains + 4 jumps"
        );
    }

    #[test]
    fn a_complete_install_plans_nothing_and_reports_no_drift() {
        let rules = RuleSet::inpod(Family::V4, "shunt:node-a", &all());
        let saved = Saved::parse(&installed_v4()).expect("parse");
        assert_eq!(rules.plan_apply(&saved), None);
        assert!(rules.drift(&saved).is_empty(), "{:?}", rules.drift(&saved));
        // The REDIRECT rules are the last of their chains: counters [4:240]
        // and [3:180] in `installed_v4`.
        assert_eq!(rules.counters(&saved, Counts::Outbound), (4, 240));
        assert_eq!(rules.counters(&saved, Counts::Inbound), (3, 180));
    }

    #[test]
    fn a_deleted_rule_is_drift_and_its_chain_is_rewritten_alone() {
        let rules = RuleSet::inpod(Family::V4, "shunt:node-a", &all());
        let text: String = installed_v4()
            .lines()
            .filter(|l| {
                !l.ends_with(
                    "-A SHUNT_OUTPUT ! -d 127.0.0.1/32 -p tcp -j REDIRECT --to-ports 15001",
                )
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let saved = Saved::parse(&text).expect("parse");
        let drift = rules.drift(&saved);
        assert_eq!(drift.len(), 1, "{drift:?}");
        assert!(drift[0].contains("REDIRECT --to-ports 15001"), "{drift:?}");
        let script = rules.plan_apply(&saved).expect("a plan");
        assert_eq!(script.matches(":SHUNT_OUTPUT").count(), 1, "{script}");
        assert!(!script.contains(":SHUNT_PRERT"), "{script}");
        assert!(!script.contains("-I "), "jumps are fine: {script}");
    }

    #[test]
    fn duplicate_and_foreign_jumps_are_replaced_by_exactly_one_of_ours() {
        let rules = RuleSet::inpod(Family::V4, "shunt:node-b", &all());
        let saved = Saved::parse(&installed_v4()).expect("parse");
        // Same chains, but the jumps carry node-a's comment.
        let script = rules.plan_apply(&saved).expect("a plan");
        assert_eq!(script.matches("-D ").count(), 4, "{script}");
        assert_eq!(script.matches("-I ").count(), 4, "{script}");
        assert!(
            script.contains("-D OUTPUT -m comment --comment \"shunt:node-a\" -j SHUNT_OUTPUT\n")
        );
        let ours = rules.chain_names();
        assert!(has_owner_jump(&saved, "shunt:node-a", &ours));
        assert!(!has_owner_jump(&saved, "shunt:node-b", &ours));
    }

    #[test]
    fn removal_deletes_jumps_then_flushes_then_deletes_and_keeps_the_rest() {
        let text = installed_v4().replace("COMMIT\n", "[9:9] -A OUTPUT -p udp -j RETURN\nCOMMIT\n");
        let saved = Saved::parse(&text).expect("parse");
        let script = plan_remove(&saved, &[CHAIN_OUTPUT, CHAIN_PREROUTING]).expect("a plan");
        assert!(
            !script.contains("udp"),
            "someone else's rule is kept: {script}"
        );
        let nat = script.split("*nat\n").nth(1).expect("nat section");
        let first_flush = nat.find("-F ").expect("flush");
        let last_delete = nat.rfind("-D ").expect("delete");
        let first_x = nat.find("-X ").expect("chain delete");
        assert!(last_delete < first_flush && first_flush < first_x, "{nat}");
        assert_eq!(
            plan_remove(&Saved::default(), &[CHAIN_OUTPUT, CHAIN_PREROUTING]),
            None
        );
    }

    #[test]
    fn owner_comments_cannot_break_quoting() {
        assert_eq!(owner_comment("node-a.example"), "shunt:node-a.example");
        assert_eq!(owner_comment("a\"b c@1"), "shunt:a_b_c@1");
    }

    #[test]
    fn parse_reads_counters_chains_and_rules() {
        let saved = Saved::parse(
            "*nat\n:OUTPUT ACCEPT [1:2]\n:X - [0:0]\n[5:300] -A OUTPUT -j X\n-A X -p tcp -j RETURN\nCOMMIT\n",
        )
        .expect("parse");
        let nat = &saved.tables["nat"];
        assert!(nat.chains.contains("X") && nat.chains.contains("OUTPUT"));
        assert_eq!(nat.rules[0].packets, 5);
        assert_eq!(nat.rules[0].bytes, 300);
        assert_eq!(nat.rules[1].spec, "-p tcp -j RETURN");
        assert!(Saved::parse("-A X -j Y\n").is_err());
    }

    #[test]
    fn ipv6_rules_use_ipv6_loopback_and_probe_addresses() {
        let rules = RuleSet::inpod(Family::V6, "shunt:n", &all());
        let script = rules.plan_apply(&Saved::default()).expect("plan");
        assert!(script.contains("! -d ::1/128 -p tcp -j REDIRECT --to-ports 15001"));
        assert!(script.contains("-s fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 -p tcp -j RETURN"));
        assert!(!script.contains("127.0.0.1"));
    }

    #[test]
    fn exclusions_come_before_the_redirect_and_capture_off_only_counts() {
        let mut settings = all();
        settings.capture.excluded_outbound_ports = vec![9000, 22, 9000];
        settings.capture.excluded_inbound_ports = vec![8081];
        settings.capture.excluded_outbound_cidrs = vec![(Ipv4Addr::new(198, 18, 7, 9), 24)];
        let rules = RuleSet::inpod(Family::V4, "shunt:n", &settings);
        let nat_out = &rules.chains[3];
        let specs: Vec<&str> = nat_out.rules.iter().map(|r| r.spec.as_str()).collect();
        let tail = &specs[specs.len() - 4..];
        assert_eq!(
            tail,
            [
                "-p tcp -m tcp --dport 22 -j RETURN",
                "-p tcp -m tcp --dport 9000 -j RETURN",
                "-d 198.18.7.0/24 -j RETURN",
                "! -d 127.0.0.1/32 -p tcp -j REDIRECT --to-ports 15001",
            ]
        );
        assert!(
            rules.chains[2]
                .rules
                .iter()
                .any(|r| r.spec.contains("--dport 8081 -j RETURN"))
        );
        // No CIDR rule for IPv6.
        let v6 = RuleSet::inpod(Family::V6, "shunt:n", &settings);
        assert!(!v6.chains[3].rules.iter().any(|r| r.spec.contains("198.18")));

        settings.capture.outbound = false;
        let counting = RuleSet::inpod(Family::V4, "shunt:n", &settings);
        let last = counting.chains[3].rules.last().expect("a last rule");
        assert_eq!(last.spec, "! -d 127.0.0.1/32 -p tcp -j RETURN");
        assert_eq!(last.counts, Some(Counts::Outbound));
        assert!(
            counting.chains[2]
                .rules
                .last()
                .expect("rule")
                .spec
                .contains("REDIRECT")
        );
    }

    #[test]
    fn dns_capture_adds_istios_dns_rules_and_raw_zones_only_when_on() {
        let off = RuleSet::inpod(Family::V4, "shunt:n", &all());
        assert!(
            !off.chains
                .iter()
                .any(|c| c.table == "raw" || c.rules.iter().any(|r| r.spec.contains("15053"))),
            "{off:#?}"
        );
        let mut settings = all();
        settings.capture.dns = true;
        let on = RuleSet::inpod(Family::V4, "shunt:n", &settings);
        let nat_out: Vec<&str> = on.chains[3].rules.iter().map(|r| r.spec.as_str()).collect();
        // After the proxy's own mark returns, before the lo rule and the
        // TCP redirect to 15001.
        let mark = nat_out
            .iter()
            .position(|r| *r == "-m mark --mark 0x539/0xfff -j RETURN")
            .expect("mark rule");
        assert_eq!(
            &nat_out[mark + 1..mark + 4],
            [
                "! -o lo -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053",
                "! -d 127.0.0.1/32 -p tcp -m tcp --dport 53 -j REDIRECT --to-ports 15053",
                "! -d 127.0.0.1/32 -o lo -j RETURN",
            ]
        );
        let raw: Vec<String> = on
            .chains
            .iter()
            .filter(|c| c.table == "raw")
            .flat_map(|c| {
                c.rules
                    .iter()
                    .map(move |r| format!("{} -> -A {} {}", c.builtin, c.chain, r.spec))
            })
            .collect();
        assert_eq!(
            raw,
            [
                "OUTPUT -> -A SHUNT_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1",
                "PREROUTING -> -A SHUNT_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1",
            ]
        );
        let script = on.plan_apply(&Saved::default()).expect("a plan");
        assert!(script.contains("*raw\n:SHUNT_OUTPUT - [0:0]\n"), "{script}");
        let v6 = RuleSet::inpod(Family::V6, "shunt:n", &settings);
        assert!(
            v6.chains[3]
                .rules
                .iter()
                .any(|r| r.spec
                    == "! -d ::1/128 -p tcp -m tcp --dport 53 -j REDIRECT --to-ports 15053"),
            "{v6:#?}"
        );
        // Removal finds the raw chains by name like the others.
        assert_eq!(on.chain_names(), ["SHUNT_OUTPUT", "SHUNT_PRERT"]);
    }

    #[test]
    fn the_probe_source_is_configurable() {
        let mut settings = all();
        settings.probe_source_v4 = Ipv4Addr::new(198, 18, 250, 1);
        let rules = RuleSet::inpod(Family::V4, "shunt:n", &settings);
        assert_eq!(
            rules.chains[2].rules[0].spec,
            "-s 198.18.250.1/32 -p tcp -j RETURN"
        );
        assert_eq!(
            rules.chains[3].rules[0].spec,
            "-d 198.18.250.1/32 -p tcp -j RETURN"
        );
    }
}
