//! Builds `GET /config_dump` ([`ConfigDump`], ztunnel's shape) from what
//! observers may read: the reconciler's published snapshot, the workload
//! store (workloads, services, policies), the identity manager's
//! certificates and istiod's connection status. A pure function of its
//! inputs, so a fixed snapshot gives a fixed document (tested below).

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use rustls::pki_types::CertificateDer;

use crate::{
    api::{
        XdsStatus,
        config_dump::{
            ApplicationTunnelDump, CertDump, CertsDump, CidrDump, ConfigDump, EndpointDump,
            EnrolledDump, GatewayDump, LoadBalancerDump, LocalityDump, MatchDump, NodeDump, Origin,
            PolicyDump, PolicyExtra, ServiceAccountDump, ServiceDump, SourcesDump, StringMatchDump,
            WeightedWaypointDump, WorkloadDump, WorkloadExtra, WorkloadInfoDump, WorkloadStateDump,
        },
    },
    authz::{Action, Match, Policy, PolicySet, Scope, StringMatch},
    identity::WorkloadCert,
    redirect::EnrolledPod,
    snapshot::NodeSnapshot,
    state::{
        ApplicationTunnelProtocol, GatewayAddress, GatewayDestination, HealthPolicy,
        LoadBalancingMode, LoadBalancingScope, PodState, Service, SpiffeId, TrustDomain,
        TunnelProtocol, Visibility, Workload, WorkloadStatus,
    },
    store::WorkloadStore,
};

/// The source name of the cluster view when istiod sends it.
pub const ISTIOD: &str = "istiod";

/// Everything the dump is made of.
pub struct DumpInputs<'a> {
    pub node: &'a NodeSnapshot,
    /// The builtin proxy's store; without one, only this node's pods are
    /// known (from the snapshot).
    pub store: Option<&'a WorkloadStore>,
    /// Identities registered with the identity manager whose first
    /// certificate is still being issued.
    pub pending_identities: &'a [SpiffeId],
    /// The mesh's roots, appended to each chain as ztunnel does.
    pub roots: &'a [CertificateDer<'static>],
    pub proxied: Vec<String>,
    pub log_filter: Option<String>,
    pub xds: Option<XdsStatus>,
    /// Where this node's pods come from (`workloads-file`, `kubernetes`).
    pub pod_source: &'a str,
}

/// The whole document, from `inputs` alone.
pub fn build(inputs: &DumpInputs<'_>) -> ConfigDump {
    let node = inputs.node;
    let td = &node.trust_domain;
    let cluster_source = match &inputs.xds {
        Some(_) => ISTIOD,
        None => inputs.pod_source,
    };
    let versions: HashMap<(&str, &str), &str> = inputs
        .xds
        .iter()
        .flat_map(|x| &x.resources)
        .map(|r| ((r.kind.as_str(), r.name.as_str()), r.version.as_str()))
        .collect();
    let origin = |kind: &str, name: &str| Origin {
        source: cluster_source.to_owned(),
        version: versions.get(&(kind, name)).map(|v| (*v).to_owned()),
    };
    let states: BTreeMap<_, _> = node
        .pods
        .iter()
        .map(|p| (p.workload.key(), &p.state))
        .collect();
    let policies = inputs.store.map(|s| s.policies().as_ref());

    let mut workloads: Vec<WorkloadDump> = match inputs.store {
        Some(store) => store
            .iter()
            .map(|w| workload(w, td, states.get(&w.key()).copied(), policies, &origin))
            .collect(),
        None => node
            .pods
            .iter()
            .map(|p| workload(&p.workload, td, Some(&p.state), policies, &origin))
            .collect(),
    };
    workloads.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));

    let services = inputs
        .store
        .map(|store| {
            store
                .services()
                .iter()
                .map(|s| service(s, store, &origin))
                .collect()
        })
        .unwrap_or_default();

    let policies = policies
        .map(|set| set.iter().map(|p| policy(p, &origin)).collect())
        .unwrap_or_default();

    let certificates = node
        .certificates
        .iter()
        .map(|(id, cert)| CertsDump {
            identity: id.to_string(),
            state: "Available".into(),
            cert_chain: cert_chain(cert, inputs.roots),
        })
        .chain(
            inputs
                .pending_identities
                .iter()
                .filter(|id| !node.certificates.contains_key(id))
                .map(|id| CertsDump {
                    identity: id.to_string(),
                    state: "Initializing".into(),
                    cert_chain: Vec::new(),
                }),
        )
        .collect();

    let workload_state = node
        .pods
        .iter()
        .filter(|p| p.workload.captured() && p.state != PodState::NotInMesh)
        .map(|p| {
            let w = &p.workload;
            let state = match &p.state {
                PodState::Enrolled => "Up",
                PodState::Pending(_) | PodState::NotInMesh => "Pending",
                PodState::Error(_) => "Error",
            };
            let info = WorkloadInfoDump {
                name: w.name.clone(),
                namespace: w.namespace.clone(),
                trust_domain: w.trust_domain.as_ref().unwrap_or(td).to_string(),
                service_account: w.service_account.clone(),
            };
            let dump = WorkloadStateDump {
                state: state.into(),
                info,
            };
            // The uid the workloads list shows: the cluster view's (e.g.
            // istiod's) when it knows the pod, else the pod source's.
            let known = inputs.store.and_then(|s| s.get(&w.key())).unwrap_or(w);
            (uid(known), dump)
        })
        .collect();

    ConfigDump {
        workloads,
        services,
        policies,
        certificates,
        workload_state,
        shunt: NodeDump {
            node: node.node.clone(),
            mode: node.mode.to_string(),
            trust_domain: td.to_string(),
            synced: node.synced,
            log_filter: inputs.log_filter.clone(),
            sources: SourcesDump {
                pods: inputs.pod_source.to_owned(),
                cluster: cluster_source.to_owned(),
            },
            enrolled: node.enrolled().map(enrolled_dump).collect(),
            proxied: inputs.proxied.clone(),
            xds: inputs.xds.clone(),
        },
    }
}

/// The workload's uid; for a source without one (the workloads file),
/// ztunnel's form for a pod: `<cluster>//Pod/<namespace>/<name>`.
fn uid(w: &Workload) -> String {
    if !w.uid.is_empty() {
        return w.uid.clone();
    }
    let cluster = if w.cluster_id.is_empty() {
        "Kubernetes"
    } else {
        &w.cluster_id
    };
    format!("{cluster}//Pod/{}/{}", w.namespace, w.name)
}

fn workload(
    w: &Workload,
    td: &TrustDomain,
    state: Option<&PodState>,
    policies: Option<&PolicySet>,
    origin: &dyn Fn(&str, &str) -> Origin,
) -> WorkloadDump {
    WorkloadDump {
        uid: uid(w),
        workload_ips: w.ips.clone(),
        waypoint: w.waypoint.as_ref().map(gateway),
        network_gateway: w.network_gateway.as_ref().map(gateway),
        protocol: match w.tunnel {
            TunnelProtocol::Hbone => "HBONE",
            TunnelProtocol::None => "TCP",
        }
        .into(),
        network_mode: if w.host_network {
            "HostNetwork"
        } else {
            "Standard"
        }
        .into(),
        name: w.name.clone(),
        namespace: w.namespace.clone(),
        service_account: w.service_account.clone(),
        workload_name: w.owner().1.to_string(),
        workload_type: w.owner().0.as_str().to_string(),
        canonical_name: w.canonical_name.clone(),
        canonical_revision: w.canonical_revision.clone(),
        cluster_id: w.cluster_id.clone(),
        trust_domain: w
            .trust_domain
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        locality: w.locality.as_ref().map(|l| LocalityDump {
            region: l.region.clone(),
            zone: l.zone.clone(),
            subzone: l.subzone.clone(),
        }),
        node: w.node.clone(),
        network: w.network.clone(),
        status: health(w.status == WorkloadStatus::Healthy),
        hostname: w.hostname.clone(),
        authorization_policies: w.authorization_policies.clone(),
        native_tunnel: w.native_tunnel,
        application_tunnel: w.application_tunnel.map(|t| ApplicationTunnelDump {
            protocol: match t.protocol {
                ApplicationTunnelProtocol::None => "NONE",
                ApplicationTunnelProtocol::Proxy => "PROXY",
            }
            .into(),
            port: (t.port != 0).then_some(t.port),
        }),
        capacity: w.capacity,
        services: w.services.keys().cloned().collect(),
        shunt: WorkloadExtra {
            identity: w.identity(td).to_string(),
            dataplane_mode: w.dataplane_mode.to_string(),
            netns: w.netns.clone(),
            state: state.cloned(),
            policies: policies
                .map(|set| set.applicable_names(w))
                .unwrap_or_default(),
            service_ports: w.services.clone(),
            origin: origin("workload", &w.uid),
        },
    }
}

fn health(healthy: bool) -> String {
    if healthy { "Healthy" } else { "Unhealthy" }.into()
}

/// `network/ip` (`/ip` on the local network), as ztunnel writes addresses.
fn network_address(network: &str, ip: IpAddr) -> String {
    format!("{network}/{ip}")
}

fn gateway(g: &GatewayAddress) -> GatewayDump {
    GatewayDump {
        destination: match &g.destination {
            GatewayDestination::Address { network, ip } => network_address(network, *ip),
            GatewayDestination::Hostname {
                namespace,
                hostname,
            } => format!("{namespace}/{hostname}"),
        },
        hbone_mtls_port: g.hbone_mtls_port,
    }
}

fn service(
    s: &Service,
    store: &WorkloadStore,
    origin: &dyn Fn(&str, &str) -> Origin,
) -> ServiceDump {
    let name = format!("{}/{}", s.namespace, s.hostname);
    let vip_network = |ip: &IpAddr| s.vip_networks.get(ip).map(String::as_str).unwrap_or("");
    let endpoints = s
        .endpoints
        .iter()
        .map(|e| {
            let workload = store.by_ip_on(&e.network, e.ip);
            let network = workload.map(|w| w.network.as_str()).unwrap_or("");
            let workload_uid = match (workload, &e.pod) {
                (Some(w), _) => uid(w),
                (None, Some(pod)) => format!("Kubernetes//Pod/{}/{}", pod.namespace, pod.name),
                (None, None) => String::new(),
            };
            let address = network_address(network, e.ip);
            let port = s
                .ports
                .iter()
                .map(|p| (p.port, s.target_port(e, p.port).unwrap_or(0)))
                .collect();
            let dump = EndpointDump {
                workload_uid: workload_uid.clone(),
                service: name.clone(),
                address: Some(address.clone()),
                port,
                status: health(e.ready),
            };
            (format!("{workload_uid}:{address}"), dump)
        })
        .collect();
    let (v4, v6) = (
        s.vips.iter().any(IpAddr::is_ipv4),
        s.vips.iter().any(IpAddr::is_ipv6),
    );
    ServiceDump {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        hostname: s.hostname.clone(),
        vips: s
            .vips
            .iter()
            .map(|ip| network_address(vip_network(ip), *ip))
            .collect(),
        cidr_vips: s
            .vip_ranges
            .iter()
            .map(|r| CidrDump {
                network: r.network.clone(),
                cidr: r.to_string(),
            })
            .collect(),
        ports: s
            .ports
            .iter()
            .map(|p| (p.port, p.target_port.unwrap_or(0)))
            .collect(),
        load_balancer: s.load_balancing.as_ref().map(|lb| LoadBalancerDump {
            mode: match lb.mode {
                LoadBalancingMode::Unspecified => "Standard",
                LoadBalancingMode::Strict => "Strict",
                LoadBalancingMode::Failover => "Failover",
                LoadBalancingMode::Passthrough => "Passthrough",
            }
            .into(),
            routing_preferences: lb
                .routing_preference
                .iter()
                .map(|scope| {
                    match scope {
                        LoadBalancingScope::Region => "Region",
                        LoadBalancingScope::Zone => "Zone",
                        LoadBalancingScope::Subzone => "Subzone",
                        LoadBalancingScope::Node => "Node",
                        LoadBalancingScope::Cluster => "Cluster",
                        LoadBalancingScope::Network => "Network",
                    }
                    .to_owned()
                })
                .collect(),
            health_policy: match lb.health_policy {
                HealthPolicy::OnlyHealthy => "OnlyHealthy",
                HealthPolicy::AllowAll => "AllowAll",
            }
            .into(),
        }),
        waypoint: s.waypoint.as_ref().map(gateway),
        weighted_waypoints: s
            .weighted_waypoints
            .iter()
            .map(|w| WeightedWaypointDump {
                destination: gateway(&w.destination),
                weight: w.weight,
            })
            .collect(),
        endpoints,
        subject_alt_names: s.subject_alt_names.clone(),
        ip_families: match (v4, v6) {
            (true, true) => Some("Dual".into()),
            (true, false) => Some("IPv4".into()),
            (false, true) => Some("IPv6".into()),
            (false, false) => None,
        },
        canonical: s.canonical,
        visibility: match s.visibility {
            Visibility::Public => "Public",
            Visibility::Namespace => "Namespace",
        }
        .into(),
        shunt: origin("service", &name),
    }
}

fn policy(p: &Policy, origin: &dyn Fn(&str, &str) -> Origin) -> PolicyDump {
    PolicyDump {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        scope: match p.scope {
            Scope::Global => "Global",
            Scope::Namespace => "Namespace",
            Scope::WorkloadSelector => "WorkloadSelector",
        }
        .into(),
        action: match p.action {
            Action::Allow => "Allow",
            Action::Deny => "Deny",
        }
        .into(),
        rules: p
            .rules
            .iter()
            .map(|rule| {
                rule.clauses
                    .iter()
                    .map(|clause| clause.matches.iter().map(match_dump).collect())
                    .collect()
            })
            .collect(),
        dry_run: p.dry_run,
        shunt: PolicyExtra {
            selector: p.selector.clone(),
            origin: origin("authorization", &p.key().to_string()),
        },
    }
}

fn match_dump(m: &Match) -> MatchDump {
    let strings = |v: &[StringMatch]| v.iter().map(string_match).collect();
    let accounts = |v: &[crate::authz::ServiceAccount]| {
        v.iter()
            .map(|a| ServiceAccountDump {
                namespace: a.namespace.clone(),
                service_account: a.name.clone(),
            })
            .collect()
    };
    let cidrs = |v: &[crate::authz::Cidr]| v.iter().map(ToString::to_string).collect();
    MatchDump {
        namespaces: strings(&m.namespaces),
        not_namespaces: strings(&m.not_namespaces),
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: strings(&m.principals),
        not_principals: strings(&m.not_principals),
        source_ips: cidrs(&m.source_ips),
        not_source_ips: cidrs(&m.not_source_ips),
        destination_ips: cidrs(&m.destination_ips),
        not_destination_ips: cidrs(&m.not_destination_ips),
        destination_ports: m.destination_ports.clone(),
        not_destination_ports: m.not_destination_ports.clone(),
    }
}

fn string_match(m: &StringMatch) -> StringMatchDump {
    match m {
        StringMatch::Exact(s) => StringMatchDump::Exact(s.clone()),
        StringMatch::Prefix(s) => StringMatchDump::Prefix(s.clone()),
        StringMatch::Suffix(s) => StringMatchDump::Suffix(s.clone()),
        StringMatch::Presence => StringMatchDump::Presence {},
    }
}

pub fn enrolled_dump(p: &EnrolledPod) -> EnrolledDump {
    EnrolledDump {
        namespace: p.key.namespace.clone(),
        name: p.key.name.clone(),
        netns: p.netns.clone(),
        netns_cookie: p.netns_cookie,
        mode: p.mode.to_string(),
        hooks: p.hooks.clone(),
    }
}

/// The certificate's chain, leaf first, then the roots it does not
/// already carry; a certificate that does not parse is shown with its
/// PEM and empty fields rather than dropped.
fn cert_chain(cert: &WorkloadCert, roots: &[CertificateDer<'static>]) -> Vec<CertDump> {
    let chain = cert.chain();
    chain
        .iter()
        .chain(roots.iter().filter(|r| !chain.contains(r)))
        .map(cert_dump)
        .collect()
}

pub(crate) fn cert_dump(der: &CertificateDer<'_>) -> CertDump {
    let pem = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
    match x509_parser::parse_x509_certificate(der) {
        Ok((_, parsed)) => CertDump {
            pem,
            serial_number: parsed.tbs_certificate.serial.to_string(),
            valid_from: rfc3339(parsed.validity().not_before.timestamp()),
            expiration_time: rfc3339(parsed.validity().not_after.timestamp()),
        },
        Err(_) => CertDump {
            pem,
            ..Default::default()
        },
    }
}

/// `2023-03-21T13:02:57Z` for seconds since the epoch (UTC; proleptic
/// Gregorian, Howard Hinnant's days-to-civil).
pub(crate) fn rfc3339(unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
#[path = "config_dump_tests.rs"]
mod tests;
