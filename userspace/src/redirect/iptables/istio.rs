//! Istio's own in-pod rules (as istio-cni installs them for ztunnel), the
//! rule set of the iptables mode with `--proxy ztunnel`: a stock ztunnel
//! then finds exactly what it finds under istio-cni — outbound REDIRECTed
//! to 15001 (its original destination from conntrack, `SO_ORIGINAL_DST`),
//! inbound TPROXYed to 15006 and 15008 (the accepted socket's local address
//! is the original destination), and its transparent connections to the
//! application answered through CONNMARK 0x111 and the policy route in
//! table 100.
//!
//! Differences from istio-cni's, both needed by shunt's own bookkeeping and
//! invisible to ztunnel: each jump into `ISTIO_PRERT`/`ISTIO_OUTPUT` carries
//! the agent's owner comment (how a later agent finds what it left, see
//! `remove_stale`), and a pod's excluded ports and CIDRs (shunt's capture
//! settings) become ACCEPT rules just before the final TPROXY/REDIRECT.

use std::net::Ipv4Addr;

use shunt_common::{PORT_HBONE, PORT_INBOUND_PLAINTEXT, PORT_OUTBOUND, PROXY_MARK};

use super::rules::{
    CONN_MARK, ChainSpec, Counts, Family, MARK_MASK, PROBE_SOURCE_V6, Rule, RuleSet, Settings,
    dns_rules,
};

/// Istio's chain for arriving traffic (mangle `PREROUTING`).
pub const CHAIN_ISTIO_PRERT: &str = "ISTIO_PRERT";
/// Istio's chain for locally generated traffic (mangle and nat `OUTPUT`).
pub const CHAIN_ISTIO_OUTPUT: &str = "ISTIO_OUTPUT";

impl RuleSet {
    /// Istio's in-pod rules (istio-cni's, for ztunnel), as `iptables-save`
    /// prints them, with every direction captured and nothing excluded:
    ///
    /// ```text
    /// mangle ISTIO_PRERT  (from PREROUTING)
    ///   mark 0x539/0xfff                    -> CONNMARK set 0x111/0xfff
    ///   tcp from probe source               -> ACCEPT
    ///   tcp in lo, not to loopback          -> ACCEPT
    ///   tcp dport 15008, not mark 0x539     -> TPROXY 15008 mark 0x111/0xfff
    ///   tcp RELATED,ESTABLISHED             -> ACCEPT
    ///   tcp not to loopback, not mark 0x539 -> TPROXY 15006 mark 0x111/0xfff
    /// mangle ISTIO_OUTPUT (from OUTPUT)
    ///   connmark 0x111/0xfff                -> CONNMARK restore-mark
    /// nat ISTIO_OUTPUT    (from OUTPUT)
    ///   tcp to probe source                 -> ACCEPT
    ///   tcp mark 0x111/0xfff                -> ACCEPT
    ///   out lo, not to loopback             -> ACCEPT
    ///   tcp not to loopback, not mark 0x539 -> REDIRECT 15001
    /// ```
    ///
    /// With the pod's DNS captured, istio-cni's DNS rules join: in nat
    /// `ISTIO_OUTPUT` after the probe rule, UDP to port 53 not out of `lo`
    /// and TCP to port 53 not to loopback, not mark 0x539, REDIRECT to
    /// 15053; raw `ISTIO_OUTPUT` (from OUTPUT) puts the proxy's own DNS in
    /// conntrack zone 1, raw `ISTIO_PRERT` (from PREROUTING) every answer
    /// from port 53 not marked 0x539.
    ///
    /// With a direction not captured its last rule ends in RETURN instead
    /// (counted, not redirected), as in [`RuleSet::inpod`].
    pub fn istio(family: Family, owner_comment: &str, settings: &Settings) -> RuleSet {
        let capture = &settings.capture;
        let mark = format!("0x{PROXY_MARK:x}/0x{MARK_MASK:x}");
        let conn_mark = format!("0x{CONN_MARK:x}/0x{MARK_MASK:x}");
        let (lo, any, probe) = match family {
            Family::V4 => (
                "127.0.0.1/32",
                "0.0.0.0",
                format!("{}/32", settings.probe_source_v4),
            ),
            Family::V6 => ("::1/128", "::", format!("{PROBE_SOURCE_V6}/128")),
        };
        let rule = |spec: String| Rule { spec, counts: None };
        let tproxy = |port: u16| {
            format!("-j TPROXY --on-port {port} --on-ip {any} --tproxy-mark {conn_mark}")
        };
        let accept_ports = |ports: &[u16]| -> Vec<Rule> {
            let mut ports = ports.to_vec();
            ports.sort_unstable();
            ports.dedup();
            ports
                .into_iter()
                .map(|port| rule(format!("-p tcp -m tcp --dport {port} -j ACCEPT")))
                .collect()
        };

        let mut prerouting = vec![
            // The proxy's own connections into the pod: their replies must
            // come back to it (restored in OUTPUT, routed by table 100).
            rule(format!(
                "-m mark --mark {mark} -j CONNMARK --set-xmark {conn_mark}"
            )),
            // Kubelet probes reach the application.
            rule(format!("-s {probe} -p tcp -m tcp -j ACCEPT")),
            // Loopback traffic to the pod's own address.
            rule(format!("! -d {lo} -i lo -p tcp -j ACCEPT")),
            rule(format!(
                "-p tcp -m tcp --dport {PORT_HBONE} -m mark ! --mark {mark} {}",
                tproxy(PORT_HBONE)
            )),
            rule("-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT".to_string()),
        ];
        prerouting.extend(accept_ports(&capture.excluded_inbound_ports));
        prerouting.push(Rule {
            spec: if capture.inbound {
                format!(
                    "! -d {lo} -p tcp -m mark ! --mark {mark} {}",
                    tproxy(PORT_INBOUND_PLAINTEXT)
                )
            } else {
                format!("! -d {lo} -p tcp -m mark ! --mark {mark} -j RETURN")
            },
            counts: Some(Counts::Inbound),
        });

        let mut nat_output = vec![rule(format!("-d {probe} -p tcp -m tcp -j ACCEPT"))];
        if capture.dns {
            nat_output.extend(dns_rules(family, Some(&mark)).nat);
        }
        nat_output.extend([
            rule(format!("-p tcp -m mark --mark {conn_mark} -j ACCEPT")),
            rule(format!("! -d {lo} -o lo -j ACCEPT")),
        ]);
        nat_output.extend(accept_ports(&capture.excluded_outbound_ports));
        if family == Family::V4 {
            for (addr, prefix) in &capture.excluded_outbound_cidrs {
                let prefix = (*prefix).min(32);
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                let network = Ipv4Addr::from(u32::from(*addr) & mask);
                nat_output.push(rule(format!("-d {network}/{prefix} -j ACCEPT")));
            }
        }
        nat_output.push(Rule {
            spec: if capture.outbound {
                format!("! -d {lo} -p tcp -m mark ! --mark {mark} -j REDIRECT --to-ports {PORT_OUTBOUND}")
            } else {
                format!("! -d {lo} -p tcp -m mark ! --mark {mark} -j RETURN")
            },
            counts: Some(Counts::Outbound),
        });

        let mut chains = vec![
            ChainSpec {
                table: "mangle",
                builtin: "PREROUTING",
                chain: CHAIN_ISTIO_PRERT,
                purpose: if capture.inbound {
                    "Istio: TPROXY inbound to 15006/15008, connmark the proxy's connections"
                } else {
                    "Istio: inbound counted, not redirected (capture off)"
                },
                rules: prerouting,
            },
            ChainSpec {
                table: "mangle",
                builtin: "OUTPUT",
                chain: CHAIN_ISTIO_OUTPUT,
                purpose: "Istio: restore the connmark on replies to the proxy",
                rules: vec![rule(format!(
                    "-m connmark --mark {conn_mark} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"
                ))],
            },
            ChainSpec {
                table: "nat",
                builtin: "OUTPUT",
                chain: CHAIN_ISTIO_OUTPUT,
                purpose: if capture.outbound {
                    "Istio: outbound TCP to 15001"
                } else {
                    "Istio: outbound counted, not redirected (capture off)"
                },
                rules: nat_output,
            },
        ];
        if capture.dns {
            chains.extend(
                dns_rules(family, Some(&mark)).raw_chains(CHAIN_ISTIO_OUTPUT, CHAIN_ISTIO_PRERT),
            );
        }
        RuleSet {
            family,
            owner_comment: owner_comment.to_string(),
            chains,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::{
        Capture,
        iptables::rules::{Saved, plan_remove},
    };

    fn all() -> Settings {
        Settings {
            capture: Capture::all(),
            probe_source_v4: Ipv4Addr::new(169, 254, 7, 127),
        }
    }

    /// What `iptables-nft-save` printed after applying istio-cni's rules by
    /// hand in a scratch netns (iptables v1.8.9, nf_tables) — the canonical
    /// form the drift check compares against.
    const ISTIO_SAVED_V4: [&str; 11] = [
        "-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
        "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
        "-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_PRERT ! -d 127.0.0.1/32 -i lo -p tcp -j ACCEPT",
        "-A ISTIO_PRERT -p tcp -m tcp --dport 15008 -m mark ! --mark 0x539/0xfff -j TPROXY --on-port 15008 --on-ip 0.0.0.0 --tproxy-mark 0x111/0xfff",
        "-A ISTIO_PRERT -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x111/0xfff",
        "-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
    ];

    #[test]
    fn the_rules_are_istios_as_iptables_save_prints_them() {
        let rules = RuleSet::istio(Family::V4, "shunt:n", &all());
        let ours: Vec<String> = rules
            .chains
            .iter()
            .flat_map(|c| {
                c.rules
                    .iter()
                    .map(move |r| format!("-A {} {}", c.chain, r.spec))
            })
            .collect();
        for line in ISTIO_SAVED_V4 {
            assert!(ours.iter().any(|l| l == line), "missing {line}: {ours:#?}");
        }
        assert_eq!(ours.len(), ISTIO_SAVED_V4.len(), "{ours:#?}");
    }

    /// istio-cni's DNS rules (its golden file for ambient in-pod DNS
    /// capture), as `iptables-save` prints them (checked with
    /// iptables-nft and iptables-legacy 1.8.9: `--to-port` is saved as
    /// `--to-ports`, `-p tcp --dport` gains `-m tcp`).
    const ISTIO_DNS_SAVED_V4: [&str; 4] = [
        "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-ports 15053",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053",
        "-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1",
        "-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1",
    ];

    fn lines(rules: &RuleSet) -> Vec<String> {
        rules
            .chains
            .iter()
            .flat_map(|c| {
                c.rules
                    .iter()
                    .map(move |r| format!("-A {} {}", c.chain, r.spec))
            })
            .collect()
    }

    #[test]
    fn dns_capture_adds_istios_dns_rules_before_the_0x111_accept() {
        let off = lines(&RuleSet::istio(Family::V4, "shunt:n", &all()));
        for line in ISTIO_DNS_SAVED_V4 {
            assert!(!off.contains(&line.to_string()), "{line} with DNS off");
        }
        let mut settings = all();
        settings.capture.dns = true;
        let rules = RuleSet::istio(Family::V4, "shunt:n", &settings);
        let on = lines(&rules);
        for line in ISTIO_SAVED_V4.iter().chain(&ISTIO_DNS_SAVED_V4) {
            assert!(on.iter().any(|l| l == line), "missing {line}: {on:#?}");
        }
        assert_eq!(on.len(), ISTIO_SAVED_V4.len() + ISTIO_DNS_SAVED_V4.len());
        let nat = &rules.chains[2];
        assert_eq!((nat.table, nat.chain), ("nat", CHAIN_ISTIO_OUTPUT));
        let position = |needle: &str| {
            nat.rules
                .iter()
                .position(|r| r.spec.contains(needle))
                .expect(needle)
        };
        assert!(position("--dport 53") < position("--mark 0x111/0xfff -j ACCEPT"));
        assert_eq!(position("-d 169.254.7.127/32"), 0);
        let raw: Vec<(&str, &str, &str)> = rules
            .chains
            .iter()
            .filter(|c| c.table == "raw")
            .map(|c| (c.builtin, c.chain, c.rules[0].spec.as_str()))
            .collect();
        assert_eq!(raw.len(), 2);
        assert_eq!(raw[0].0, "OUTPUT");
        assert_eq!(raw[0].1, CHAIN_ISTIO_OUTPUT);
        assert_eq!(raw[1].0, "PREROUTING");
        assert_eq!(raw[1].1, CHAIN_ISTIO_PRERT);
        let v6 = lines(&RuleSet::istio(Family::V6, "shunt:n", &settings));
        assert!(v6.iter().any(|l| l == "-A ISTIO_OUTPUT ! -d ::1/128 -p tcp -m tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053"), "{v6:#?}");
    }

    #[test]
    fn plan_apply_then_remove_touches_only_istio_chains() {
        let rules = RuleSet::istio(Family::V4, "shunt:n", &all());
        let script = rules.plan_apply(&Saved::default()).expect("a plan");
        assert!(
            script.contains("*mangle\n:ISTIO_PRERT - [0:0]\n"),
            "{script}"
        );
        assert!(
            script.contains("-I PREROUTING 1 -m comment --comment \"shunt:n\" -j ISTIO_PRERT\n"),
            "{script}"
        );
        assert!(
            script.contains("-I OUTPUT 1 -m comment --comment \"shunt:n\" -j ISTIO_OUTPUT\n"),
            "{script}"
        );
        assert!(!script.contains("SHUNT_"), "{script}");
        assert_eq!(rules.chain_names(), ["ISTIO_OUTPUT", "ISTIO_PRERT"]);
        let saved = Saved::parse(
            "*mangle\n:PREROUTING ACCEPT [0:0]\n:ISTIO_PRERT - [0:0]\n-A PREROUTING -m comment --comment \"shunt:n\" -j ISTIO_PRERT\n-A PREROUTING -p udp -j ACCEPT\n-A ISTIO_PRERT -p tcp -j ACCEPT\nCOMMIT\n",
        )
        .expect("parse");
        let removal = plan_remove(&saved, &rules.chain_names()).expect("a plan");
        assert!(removal.contains("-D PREROUTING -m comment"), "{removal}");
        assert!(removal.contains("-X ISTIO_PRERT"), "{removal}");
        assert!(!removal.contains("udp"), "{removal}");
    }

    #[test]
    fn ipv6_uses_ipv6_loopback_probe_and_tproxy_address() {
        let rules = RuleSet::istio(Family::V6, "shunt:n", &all());
        let prert = &rules.chains[0].rules;
        assert_eq!(
            prert[1].spec,
            "-s fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 -p tcp -m tcp -j ACCEPT"
        );
        assert_eq!(
            prert.last().expect("rule").spec,
            "! -d ::1/128 -p tcp -m mark ! --mark 0x539/0xfff -j TPROXY --on-port 15006 --on-ip :: --tproxy-mark 0x111/0xfff"
        );
    }

    #[test]
    fn exclusions_accept_before_the_last_rule_and_capture_off_returns() {
        let mut settings = all();
        settings.capture.excluded_inbound_ports = vec![9000];
        settings.capture.excluded_outbound_cidrs = vec![(Ipv4Addr::new(198, 18, 7, 9), 24)];
        settings.capture.outbound = false;
        let rules = RuleSet::istio(Family::V4, "shunt:n", &settings);
        let prert: Vec<&str> = rules.chains[0]
            .rules
            .iter()
            .map(|r| r.spec.as_str())
            .collect();
        assert_eq!(
            prert[prert.len() - 2],
            "-p tcp -m tcp --dport 9000 -j ACCEPT"
        );
        let nat: Vec<&str> = rules.chains[2]
            .rules
            .iter()
            .map(|r| r.spec.as_str())
            .collect();
        assert_eq!(
            &nat[nat.len() - 2..],
            [
                "-d 198.18.7.0/24 -j ACCEPT",
                "! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j RETURN"
            ]
        );
    }
}
