//! The rules shunt installs in a pod's netns, and the pure logic around them:
//! parsing `iptables-save`, planning the `iptables-restore` input that brings
//! a netns to the wanted state (or removes ours), and naming drift.
//!
//! Everything here works on text, so it is unit-tested without a kernel; the
//! rule specs are written exactly in the canonical form `iptables-save`
//! prints them (checked against both backends), so that "what is installed"
//! and "what we want" compare as strings.

use std::net::Ipv4Addr;

use shunt_common::{
    PORT_DNS, PORT_DNS_PROXY, PORT_HBONE, PORT_INBOUND_PLAINTEXT, PORT_OUTBOUND, PROXY_MARK,
};

pub use plan::{has_owner_jump, plan_remove};
pub use saved::Saved;

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
    pub(super) fn loopback(self) -> &'static str {
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
}

mod plan;
mod saved;
#[cfg(test)]
mod tests;
