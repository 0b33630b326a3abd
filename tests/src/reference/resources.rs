//! xDS resources as istiod encodes and names them (workloads by uid,
//! services `namespace/hostname`, policies `namespace/name`), and the
//! pieces the tables build policies from.

use prost::Message as _;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::{
    envoy::service::discovery::v3::Resource,
    istio::{security as sec, workload as wl},
};

pub fn any_resource(name: &str, type_url: &str, value: Vec<u8>) -> Resource {
    Resource {
        name: name.into(),
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value,
        }),
        ..Default::default()
    }
}

/// A workload, named by its uid.
pub fn workload(w: wl::Workload) -> Resource {
    let name = w.uid.clone();
    let address = wl::Address {
        r#type: Some(wl::address::Type::Workload(w)),
    };
    any_resource(&name, ADDRESS_TYPE_URL, address.encode_to_vec())
}

/// A policy, named `namespace/name`.
pub fn policy(p: sec::Authorization) -> Resource {
    let name = format!("{}/{}", p.namespace, p.name);
    any_resource(&name, AUTHORIZATION_TYPE_URL, p.encode_to_vec())
}

/// A pod of namespace `default` on `node`, HBONE, as istiod sends it.
pub fn pod(name: &str, service_account: &str, ip: std::net::Ipv4Addr, node: &str) -> wl::Workload {
    wl::Workload {
        uid: format!("Kubernetes//Pod/default/{name}"),
        name: name.into(),
        namespace: "default".into(),
        addresses: vec![ip.octets().to_vec()],
        tunnel_protocol: wl::TunnelProtocol::Hbone as i32,
        trust_domain: "cluster.local".into(),
        service_account: service_account.into(),
        node: node.into(),
        cluster_id: "Kubernetes".into(),
        workload_type: wl::WorkloadType::Pod as i32,
        canonical_name: name.into(),
        canonical_revision: "latest".into(),
        workload_name: name.into(),
        ..Default::default()
    }
}

/// A policy of namespace `default` with `scope`, `action` and `rules`.
pub fn authorization(
    name: &str,
    scope: sec::Scope,
    action: sec::Action,
    rules: Vec<sec::Rule>,
) -> sec::Authorization {
    sec::Authorization {
        name: name.into(),
        namespace: "default".into(),
        scope: scope as i32,
        action: action as i32,
        rules,
        ..Default::default()
    }
}

/// A namespace-scoped policy in `default`.
pub fn ns_policy(name: &str, action: sec::Action, rules: Vec<sec::Rule>) -> sec::Authorization {
    authorization(name, sec::Scope::Namespace, action, rules)
}

/// A rule whose clauses are each a list of matches (AND of clauses, OR of
/// a clause's matches).
pub fn rule(clauses: Vec<Vec<sec::Match>>) -> sec::Rule {
    sec::Rule {
        clauses: clauses
            .into_iter()
            .map(|matches| sec::Clause { matches })
            .collect(),
    }
}

pub fn service_account(namespace: &str, sa: &str) -> sec::ServiceAccountMatch {
    sec::ServiceAccountMatch {
        namespace: namespace.into(),
        service_account: sa.into(),
    }
}

pub fn exact(value: &str) -> sec::StringMatch {
    sec::StringMatch {
        match_type: Some(sec::string_match::MatchType::Exact(value.into())),
    }
}

/// An address resource named as istiod names it.
pub fn encode(address: wl::Address) -> Resource {
    let name = match &address.r#type {
        Some(wl::address::Type::Workload(w)) => w.uid.clone(),
        Some(wl::address::Type::Service(s)) => format!("{}/{}", s.namespace, s.hostname),
        None => String::new(),
    };
    any_resource(&name, ADDRESS_TYPE_URL, address.encode_to_vec())
}

/// A Service `default/<name>` for `host` at `vip`, port 80 to 8080 (one
/// per ServiceEntry host, as istiod sends them).
pub fn service(name: &str, host: &str, vip: [u8; 4]) -> wl::Address {
    wl::Address {
        r#type: Some(wl::address::Type::Service(wl::Service {
            name: name.into(),
            namespace: "default".into(),
            hostname: host.into(),
            addresses: vec![wl::NetworkAddress {
                address: vip.to_vec(),
                ..Default::default()
            }],
            ports: vec![wl::Port {
                service_port: 80,
                target_port: 8080,
                ..Default::default()
            }],
            ..Default::default()
        })),
    }
}

/// A DNS-resolved ServiceEntry's endpoint as istiod sends it for the
/// ServiceEntry host `host` (`<entry>.<domain>`, the entry named by its
/// first label): a workload of `default` known by `name` (its
/// `hostname`, no address, no tunnel), named, typed and canonical after
/// the ServiceEntry (a "pod"), an endpoint of the host's service on port
/// 80 to 8080.
pub fn named_endpoint(host: &str, name: &str) -> wl::Address {
    let entry = host.split('.').next().unwrap_or(host);
    let port = wl::Port {
        service_port: 80,
        target_port: 8080,
        ..Default::default()
    };
    wl::Address {
        r#type: Some(wl::address::Type::Workload(wl::Workload {
            uid: format!("Kubernetes/networking.istio.io/ServiceEntry/default/{entry}/{name}"),
            name: entry.into(),
            namespace: "default".into(),
            hostname: name.into(),
            services: [(
                format!("default/{host}"),
                wl::PortList { ports: vec![port] },
            )]
            .into(),
            cluster_id: "Kubernetes".into(),
            trust_domain: "cluster.local".into(),
            workload_name: entry.into(),
            workload_type: wl::WorkloadType::Pod as i32,
            canonical_name: entry.into(),
            canonical_revision: "latest".into(),
            ..Default::default()
        })),
    }
}
