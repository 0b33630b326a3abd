//! ztunnel's L4 authorization as a table of plain data: each [`Case`] is a
//! set of `istio.security.Authorization` resources (as istiod sends them)
//! and probes (source identity or plaintext, source IP, destination port →
//! allowed or not) against one destination workload.
//!
//! The table is the contract, not a test of one implementation: the unit
//! tests (`conformance_tests.rs`) run it through shunt's xDS translation
//! and engine, and [`Case::resources`] builds the very protobufs, so that a
//! harness can feed the same rows to a stock ztunnel and compare.
//!
//! The destination is [`DST_NAMESPACE`]/`server` at [`DST_IP`]; every
//! [`Scope::WorkloadSelector`] policy of a case is bound to it (listed in
//! its `authorization_policies`, as istiod binds them). Sources:
//! [`SLEEP`], [`CURL`] (another namespace), [`SLEEP_OTHER_TD`] (sleep's
//! account in another trust domain) or plaintext (`None`), from
//! [`CLIENT_IP`] unless a row says [`OTHER_IP`].

use shunt_proto::istio::security as pb;

/// The destination's namespace (and that of the cases' policies).
pub const DST_NAMESPACE: &str = "default";
pub const DST_NAME: &str = "server";
pub const DST_IP: &str = "198.18.2.3";
pub const CLIENT_IP: &str = "198.18.1.2";
pub const OTHER_IP: &str = "198.18.1.9";
/// The mesh's root namespace (global policies).
pub const ROOT_NAMESPACE: &str = "istio-system";

pub const SLEEP: Option<&str> = Some("spiffe://cluster.local/ns/default/sa/sleep");
pub const CURL: Option<&str> = Some("spiffe://cluster.local/ns/other/sa/curl");
pub const SLEEP_OTHER_TD: Option<&str> = Some("spiffe://example.org/ns/default/sa/sleep");
pub const PLAINTEXT: Option<&str> = None;

/// One case: policies and what each probe must see.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub name: &'static str,
    pub policies: &'static [PolicyRow],
    pub probes: &'static [Probe],
}

/// One `istio.security.Authorization`.
#[derive(Clone, Copy, Debug)]
pub struct PolicyRow {
    pub name: &'static str,
    pub namespace: &'static str,
    pub scope: pb::Scope,
    pub action: pb::Action,
    pub dry_run: bool,
    /// rules (OR) → clauses (AND) → matches (OR).
    pub rules: &'static [&'static [&'static [MatchRow]]],
}

impl PolicyRow {
    /// An ALLOW policy bound to the destination, named `name`.
    pub const ALLOW: Self = Self {
        name: "allow",
        namespace: DST_NAMESPACE,
        scope: pb::Scope::WorkloadSelector,
        action: pb::Action::Allow,
        dry_run: false,
        rules: &[],
    };
    /// A DENY policy bound to the destination.
    pub const DENY: Self = Self {
        name: "deny",
        action: pb::Action::Deny,
        ..Self::ALLOW
    };
}

/// One `istio.security.Match`; [`MatchRow::EMPTY`] sets nothing.
#[derive(Clone, Copy, Debug)]
pub struct MatchRow {
    pub namespaces: &'static [Str],
    pub not_namespaces: &'static [Str],
    /// (namespace, service account)
    pub service_accounts: &'static [(&'static str, &'static str)],
    pub not_service_accounts: &'static [(&'static str, &'static str)],
    pub principals: &'static [Str],
    pub not_principals: &'static [Str],
    /// `198.18.1.0/24` or a bare address.
    pub source_ips: &'static [&'static str],
    pub not_source_ips: &'static [&'static str],
    pub destination_ips: &'static [&'static str],
    pub not_destination_ips: &'static [&'static str],
    pub destination_ports: &'static [u32],
    pub not_destination_ports: &'static [u32],
}

impl MatchRow {
    pub const EMPTY: Self = Self {
        namespaces: &[],
        not_namespaces: &[],
        service_accounts: &[],
        not_service_accounts: &[],
        principals: &[],
        not_principals: &[],
        source_ips: &[],
        not_source_ips: &[],
        destination_ips: &[],
        not_destination_ips: &[],
        destination_ports: &[],
        not_destination_ports: &[],
    };
}

/// `istio.security.StringMatch`.
#[derive(Clone, Copy, Debug)]
pub enum Str {
    Exact(&'static str),
    Prefix(&'static str),
    Suffix(&'static str),
    Presence,
}

/// A connection to the destination and the verdict it must get.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// The peer's SPIFFE id; `None`: plaintext.
    pub identity: Option<&'static str>,
    pub src_ip: &'static str,
    pub port: u16,
    pub allowed: bool,
}

const fn allow(identity: Option<&'static str>, port: u16) -> Probe {
    Probe {
        identity,
        src_ip: CLIENT_IP,
        port,
        allowed: true,
    }
}

const fn deny(identity: Option<&'static str>, port: u16) -> Probe {
    Probe {
        identity,
        src_ip: CLIENT_IP,
        port,
        allowed: false,
    }
}

const fn from_other_ip(probe: Probe) -> Probe {
    Probe {
        src_ip: OTHER_IP,
        ..probe
    }
}

impl Case {
    /// The protobufs istiod would send for this case.
    pub fn resources(&self) -> Vec<pb::Authorization> {
        self.policies.iter().map(PolicyRow::resource).collect()
    }

    /// The `namespace/name` of every policy bound to the destination (what
    /// its `Workload::authorization_policies` lists).
    pub fn bound(&self) -> Vec<String> {
        self.policies
            .iter()
            .filter(|p| p.scope == pb::Scope::WorkloadSelector)
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect()
    }
}

impl PolicyRow {
    pub fn resource(&self) -> pb::Authorization {
        pb::Authorization {
            name: self.name.into(),
            namespace: self.namespace.into(),
            scope: self.scope as i32,
            action: self.action as i32,
            dry_run: self.dry_run,
            rules: self
                .rules
                .iter()
                .map(|clauses| pb::Rule {
                    clauses: clauses
                        .iter()
                        .map(|matches| pb::Clause {
                            matches: matches.iter().map(MatchRow::resource).collect(),
                        })
                        .collect(),
                })
                .collect(),
            ..Default::default()
        }
    }
}

impl MatchRow {
    pub fn resource(&self) -> pb::Match {
        let strings = |v: &[Str]| v.iter().map(Str::resource).collect();
        let accounts = |v: &[(&str, &str)]| {
            v.iter()
                .map(|(ns, sa)| pb::ServiceAccountMatch {
                    namespace: (*ns).into(),
                    service_account: (*sa).into(),
                })
                .collect()
        };
        let cidrs = |v: &[&str]| v.iter().map(|c| address(c)).collect();
        pb::Match {
            namespaces: strings(self.namespaces),
            not_namespaces: strings(self.not_namespaces),
            service_accounts: accounts(self.service_accounts),
            not_service_accounts: accounts(self.not_service_accounts),
            principals: strings(self.principals),
            not_principals: strings(self.not_principals),
            source_ips: cidrs(self.source_ips),
            not_source_ips: cidrs(self.not_source_ips),
            destination_ips: cidrs(self.destination_ips),
            not_destination_ips: cidrs(self.not_destination_ips),
            destination_ports: self.destination_ports.to_vec(),
            not_destination_ports: self.not_destination_ports.to_vec(),
            ..Default::default()
        }
    }
}

impl Str {
    fn resource(&self) -> pb::StringMatch {
        use pb::string_match::MatchType;
        let match_type = match *self {
            Self::Exact(s) => MatchType::Exact(s.into()),
            Self::Prefix(s) => MatchType::Prefix(s.into()),
            Self::Suffix(s) => MatchType::Suffix(s.into()),
            Self::Presence => MatchType::Presence(()),
        };
        pb::StringMatch {
            match_type: Some(match_type),
        }
    }
}

/// A table CIDR as `istio.security.Address`. The table's own constants are
/// valid; an invalid one becomes an empty address (which the translation
/// rejects, naming it), never a panic.
fn address(cidr: &str) -> pb::Address {
    let (ip, len) = cidr.split_once('/').unwrap_or((cidr, ""));
    match ip.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(v4)) => pb::Address {
            address: v4.octets().to_vec(),
            length: len.parse().unwrap_or(32),
        },
        Ok(std::net::IpAddr::V6(v6)) => pb::Address {
            address: v6.octets().to_vec(),
            length: len.parse().unwrap_or(128),
        },
        Err(_) => pb::Address::default(),
    }
}

const SLEEP_SA: MatchRow = MatchRow {
    service_accounts: &[("default", "sleep")],
    ..MatchRow::EMPTY
};
const NOT_SLEEP_SA: MatchRow = MatchRow {
    not_service_accounts: &[("default", "sleep")],
    ..MatchRow::EMPTY
};
const PORT_9090: MatchRow = MatchRow {
    destination_ports: &[9090],
    ..MatchRow::EMPTY
};

/// Every case. Ports: 8080 and 9090 on the destination.
pub const CASES: &[Case] = &[
    Case {
        name: "no policy: everything allowed",
        policies: &[],
        probes: &[
            allow(SLEEP, 8080),
            allow(CURL, 9090),
            allow(PLAINTEXT, 8080),
        ],
    },
    // source.serviceAccounts (istiod's Match fields 11 and 12)
    Case {
        name: "ALLOW serviceAccounts: only that account, any trust domain, never plaintext",
        policies: &[PolicyRow {
            rules: &[&[&[SLEEP_SA]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[
            allow(SLEEP, 8080),
            allow(SLEEP_OTHER_TD, 8080),
            deny(CURL, 8080),
            deny(PLAINTEXT, 8080),
        ],
    },
    Case {
        name: "DENY serviceAccounts: only that account is refused",
        policies: &[PolicyRow {
            rules: &[&[&[SLEEP_SA]]],
            ..PolicyRow::DENY
        }],
        probes: &[
            deny(SLEEP, 8080),
            deny(SLEEP_OTHER_TD, 9090),
            allow(CURL, 8080),
            allow(PLAINTEXT, 8080),
        ],
    },
    Case {
        name: "ALLOW notServiceAccounts: all but that account, plaintext included",
        policies: &[PolicyRow {
            rules: &[&[&[NOT_SLEEP_SA]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[deny(SLEEP, 8080), allow(CURL, 8080), allow(PLAINTEXT, 8080)],
    },
    Case {
        name: "DENY notServiceAccounts: all but that account refused, plaintext included",
        policies: &[PolicyRow {
            rules: &[&[&[NOT_SLEEP_SA]]],
            ..PolicyRow::DENY
        }],
        probes: &[allow(SLEEP, 8080), deny(CURL, 8080), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "serviceAccounts AND ports in one match",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                service_accounts: &[("default", "sleep")],
                destination_ports: &[8080],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(SLEEP, 8080), deny(SLEEP, 9090), deny(CURL, 8080)],
    },
    // Empty parts
    Case {
        name: "ALLOW with a match {}: matches nothing",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow::EMPTY]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[deny(SLEEP, 8080), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "DENY with a match {} (istiod's L7-only `to`): denies nothing",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow::EMPTY]]],
            ..PolicyRow::DENY
        }],
        probes: &[
            allow(SLEEP, 8080),
            allow(CURL, 9090),
            allow(PLAINTEXT, 8080),
        ],
    },
    Case {
        name: "DENY [ports 9090] AND [{}]: denies nothing",
        policies: &[PolicyRow {
            rules: &[&[&[PORT_9090], &[MatchRow::EMPTY]]],
            ..PolicyRow::DENY
        }],
        probes: &[allow(SLEEP, 9090), allow(PLAINTEXT, 9090)],
    },
    Case {
        name: "DENY [{} OR ports 9090]: the {} is skipped, 9090 denied",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow::EMPTY, PORT_9090]]],
            ..PolicyRow::DENY
        }],
        probes: &[deny(SLEEP, 9090), allow(SLEEP, 8080)],
    },
    Case {
        name: "ALLOW with a rule of no clause: everything",
        policies: &[PolicyRow {
            rules: &[&[]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(SLEEP, 8080), allow(PLAINTEXT, 9090)],
    },
    Case {
        name: "ALLOW with a clause of no match: imposes nothing",
        policies: &[PolicyRow {
            rules: &[&[&[], &[PORT_9090]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(SLEEP, 9090), deny(SLEEP, 8080)],
    },
    Case {
        name: "ALLOW with no rule: allows nothing",
        policies: &[PolicyRow::ALLOW],
        probes: &[deny(SLEEP, 8080), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "DENY with no rule: denies nothing",
        policies: &[PolicyRow::DENY],
        probes: &[allow(SLEEP, 8080), allow(PLAINTEXT, 8080)],
    },
    Case {
        name: "DENY of everything (a rule of no clause)",
        policies: &[PolicyRow {
            rules: &[&[]],
            ..PolicyRow::DENY
        }],
        probes: &[deny(SLEEP, 8080), deny(PLAINTEXT, 8080)],
    },
    // Principals and namespaces
    Case {
        name: "ALLOW principals exact: that identity, not plaintext",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                principals: &[Str::Exact("cluster.local/ns/default/sa/sleep")],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[
            allow(SLEEP, 8080),
            deny(SLEEP_OTHER_TD, 8080),
            deny(CURL, 8080),
            deny(PLAINTEXT, 8080),
        ],
    },
    Case {
        name: "ALLOW principals prefix and suffix",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                principals: &[
                    Str::Prefix("cluster.local/ns/other/"),
                    Str::Suffix("/sa/sleep"),
                ],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[
            allow(CURL, 8080),
            allow(SLEEP_OTHER_TD, 8080),
            deny(PLAINTEXT, 8080),
        ],
    },
    Case {
        name: "DENY notPrincipals presence (istiod's STRICT): plaintext refused",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                not_principals: &[Str::Presence],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::DENY
        }],
        probes: &[allow(SLEEP, 8080), allow(CURL, 9090), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "ALLOW principals presence: any identity, not plaintext",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                principals: &[Str::Presence],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(CURL, 8080), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "ALLOW namespaces: that namespace, not plaintext",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                namespaces: &[Str::Exact("default")],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(SLEEP, 8080), deny(CURL, 8080), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "DENY notNamespaces: other namespaces and plaintext refused",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                not_namespaces: &[Str::Exact("default")],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::DENY
        }],
        probes: &[allow(SLEEP, 8080), deny(CURL, 8080), deny(PLAINTEXT, 8080)],
    },
    Case {
        name: "ALLOW namespaces presence and suffix",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                namespaces: &[Str::Suffix("ther")],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(CURL, 8080), deny(SLEEP, 8080), deny(PLAINTEXT, 8080)],
    },
    // Addresses and ports
    Case {
        name: "ALLOW ipBlocks: by source address, plaintext included",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                source_ips: &["198.18.1.0/30"],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[
            allow(PLAINTEXT, 8080),
            allow(CURL, 8080),
            from_other_ip(deny(SLEEP, 8080)),
        ],
    },
    Case {
        name: "ALLOW notIpBlocks",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                not_source_ips: &[OTHER_IP],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(PLAINTEXT, 8080), from_other_ip(deny(PLAINTEXT, 8080))],
    },
    Case {
        name: "ALLOW destination ports, and destination IPs",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                destination_ports: &[8080],
                destination_ips: &[DST_IP],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(PLAINTEXT, 8080), deny(SLEEP, 9090)],
    },
    Case {
        name: "ALLOW notPorts",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                not_destination_ports: &[9090],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[allow(SLEEP, 8080), deny(SLEEP, 9090)],
    },
    Case {
        name: "ALLOW notDestinationIps of the destination: nothing",
        policies: &[PolicyRow {
            rules: &[&[&[MatchRow {
                not_destination_ips: &["198.18.2.0/24"],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[deny(SLEEP, 8080)],
    },
    // Logic and order
    Case {
        name: "fields of one match AND'd, matches of one clause OR'd",
        policies: &[PolicyRow {
            rules: &[&[&[
                MatchRow {
                    namespaces: &[Str::Exact("default")],
                    destination_ports: &[8080],
                    ..MatchRow::EMPTY
                },
                MatchRow {
                    namespaces: &[Str::Exact("other")],
                    destination_ports: &[9090],
                    ..MatchRow::EMPTY
                },
            ]]],
            ..PolicyRow::ALLOW
        }],
        probes: &[
            allow(SLEEP, 8080),
            deny(SLEEP, 9090),
            allow(CURL, 9090),
            deny(CURL, 8080),
        ],
    },
    Case {
        name: "DENY before ALLOW",
        policies: &[
            PolicyRow {
                rules: &[&[]],
                ..PolicyRow::ALLOW
            },
            PolicyRow {
                rules: &[&[&[PORT_9090]]],
                ..PolicyRow::DENY
            },
        ],
        probes: &[allow(SLEEP, 8080), deny(SLEEP, 9090), deny(PLAINTEXT, 9090)],
    },
    Case {
        name: "ALLOW policies OR'd",
        policies: &[
            PolicyRow {
                rules: &[&[&[SLEEP_SA]]],
                ..PolicyRow::ALLOW
            },
            PolicyRow {
                name: "allow-9090",
                rules: &[&[&[PORT_9090]]],
                ..PolicyRow::ALLOW
            },
        ],
        probes: &[allow(SLEEP, 8080), allow(CURL, 9090), deny(CURL, 8080)],
    },
    Case {
        name: "dry-run DENY and dry-run ALLOW are not enforced",
        policies: &[
            PolicyRow {
                dry_run: true,
                rules: &[&[]],
                ..PolicyRow::DENY
            },
            PolicyRow {
                dry_run: true,
                rules: &[&[&[SLEEP_SA]]],
                ..PolicyRow::ALLOW
            },
        ],
        probes: &[
            allow(SLEEP, 8080),
            allow(CURL, 8080),
            allow(PLAINTEXT, 8080),
        ],
    },
    // Scopes
    Case {
        name: "namespace scope: this namespace's applies, another's does not",
        policies: &[
            PolicyRow {
                name: "ns-allow-sleep",
                scope: pb::Scope::Namespace,
                rules: &[&[&[SLEEP_SA]]],
                ..PolicyRow::ALLOW
            },
            PolicyRow {
                name: "elsewhere-deny-all",
                namespace: "other",
                scope: pb::Scope::Namespace,
                rules: &[&[]],
                ..PolicyRow::DENY
            },
        ],
        probes: &[allow(SLEEP, 8080), deny(CURL, 8080)],
    },
    Case {
        name: "global scope applies to every workload",
        policies: &[PolicyRow {
            name: "mesh-strict",
            namespace: ROOT_NAMESPACE,
            scope: pb::Scope::Global,
            rules: &[&[&[MatchRow {
                not_principals: &[Str::Presence],
                ..MatchRow::EMPTY
            }]]],
            ..PolicyRow::DENY
        }],
        probes: &[allow(SLEEP, 8080), deny(PLAINTEXT, 8080)],
    },
];
