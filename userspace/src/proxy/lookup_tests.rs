//! A CONNECT to `host:port` at a local pod: which port it reaches, as
//! ztunnel's inbound resolves it (`find_inbound_upstream`). Rows are plain
//! data (services as istiod would send them, the probe, the outcome) so a
//! harness running the real ztunnel can reuse them.

use std::{collections::BTreeMap, net::IpAddr};

use super::hostname_port;
use crate::{
    state::{Endpoint, Service, ServicePort, Visibility, WorkloadKey},
    store::WorkloadStore,
};

/// One service: (namespace, name, hostname, [`Kind`], service port →
/// target port (0: named, resolved per endpoint), endpoints as (IP, pod
/// name in the service's namespace, service port → target port)).
type ServiceRow = (
    &'static str,
    &'static str,
    &'static str,
    Kind,
    &'static [(u16, u16)],
    &'static [(&'static str, &'static str, &'static [(u16, u16)])],
);

/// (what, services, arrival pod (namespace, name, IP), CONNECT host, port,
/// expected target port; `None`: 503).
type Row = (
    &'static str,
    &'static [ServiceRow],
    (&'static str, &'static str, &'static str),
    &'static str,
    u16,
    Option<u16>,
);

/// How a service is marked.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Plain,
    /// xDS `canonical`.
    Canonical,
    /// Visibility `NAMESPACE`.
    NamespaceOnly,
}
use Kind::*;

const WEB: &str = "web.default.svc.cluster.local";
const SERVER: (&str, &str, &str) = ("default", "server", "198.18.1.11");

pub const HOSTNAME_ROWS: &[Row] = &[
    (
        "the endpoint's own target port",
        &[(
            "default",
            "web",
            WEB,
            Plain,
            &[(80, 0)],
            &[("198.18.1.11", "server", &[(80, 8081)])],
        )],
        SERVER,
        WEB,
        80,
        Some(8081),
    ),
    (
        "the service's numeric target port when the pod is no endpoint",
        &[("default", "web", WEB, Plain, &[(80, 8080)], &[])],
        SERVER,
        WEB,
        80,
        Some(8080),
    ),
    (
        "a named target port the pod does not resolve: 503",
        &[(
            "default",
            "web",
            WEB,
            Plain,
            &[(80, 0)],
            &[("198.18.1.12", "other", &[(80, 9000)])],
        )],
        SERVER,
        WEB,
        80,
        None,
    ),
    (
        "a port the service does not have: 503",
        &[("default", "web", WEB, Plain, &[(80, 8080)], &[])],
        SERVER,
        WEB,
        81,
        None,
    ),
    (
        "no service of that hostname: 503",
        &[("default", "web", WEB, Plain, &[(80, 8080)], &[])],
        SERVER,
        "db.default.svc.cluster.local",
        80,
        None,
    ),
    (
        "a NAMESPACE-visible service of another namespace is not seen: 503",
        &[(
            "a",
            "ext",
            "ext.example.com",
            NamespaceOnly,
            &[(80, 1111)],
            &[],
        )],
        SERVER,
        "ext.example.com",
        80,
        None,
    ),
    (
        "the service in the pod's namespace wins",
        &[
            ("a", "ext", "ext.example.com", Canonical, &[(80, 1111)], &[]),
            (
                "default",
                "ext",
                "ext.example.com",
                Plain,
                &[(80, 2222)],
                &[],
            ),
        ],
        SERVER,
        "ext.example.com",
        80,
        Some(2222),
    ),
    (
        "else the canonical one",
        &[
            ("a", "ext", "ext.example.com", Plain, &[(80, 1111)], &[]),
            ("b", "ext", "ext.example.com", Canonical, &[(80, 2222)], &[]),
        ],
        SERVER,
        "ext.example.com",
        80,
        Some(2222),
    ),
    (
        "else the first",
        &[
            ("a", "ext", "ext.example.com", Plain, &[(80, 1111)], &[]),
            ("b", "ext", "ext.example.com", Plain, &[(80, 2222)], &[]),
        ],
        SERVER,
        "ext.example.com",
        80,
        Some(1111),
    ),
];

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

fn service(row: &ServiceRow) -> Service {
    let (namespace, name, hostname, kind, ports, endpoints) = *row;
    Service {
        name: name.into(),
        namespace: namespace.into(),
        vips: vec![ip("198.19.0.1")],
        hostname: hostname.into(),
        canonical: matches!(kind, Canonical),
        visibility: match kind {
            NamespaceOnly => Visibility::Namespace,
            Plain | Canonical => Visibility::Public,
        },
        ports: ports
            .iter()
            .map(|&(port, target)| ServicePort {
                port,
                target_port: (target != 0).then_some(target),
            })
            .collect(),
        endpoints: endpoints
            .iter()
            .map(|&(addr, pod, ports)| Endpoint {
                ports: ports.iter().copied().collect::<BTreeMap<_, _>>(),
                ..Endpoint::new(ip(addr), Some(WorkloadKey::new(namespace, pod)))
            })
            .collect(),
        ..Default::default()
    }
}

#[test]
fn a_hostname_connect_reaches_the_arrival_pod_at_its_target_port() {
    for (what, services, (namespace, name, addr), host, port, expected) in HOSTNAME_ROWS {
        let mut store = WorkloadStore::new();
        store.replace_services(services.iter().map(service));
        let got = hostname_port(
            &store,
            &WorkloadKey::new(*namespace, *name),
            ip(addr),
            host,
            *port,
        );
        assert_eq!(got.as_ref().ok().copied(), *expected, "{what}: {got:?}");
    }
}

/// A service whose endpoints are known by DNS name (a `resolution: DNS`
/// ServiceEntry's) gives the name to resolve and the target port; an
/// addressed ready endpoint, when there is one, is taken first.
#[test]
fn a_service_known_by_name_is_resolved_only_without_a_ready_address() {
    use super::{Target, WorkloadLookup};
    use crate::state::{HostnameEndpoint, HostnameTarget, TrustDomain};
    let vip: std::net::SocketAddr = "198.19.200.1:80".parse().expect("vip");
    let mut api = Service {
        name: "api".into(),
        namespace: "default".into(),
        hostname: "api.example.test".into(),
        vips: vec![vip.ip()],
        ports: vec![ServicePort {
            port: 80,
            target_port: Some(8080),
        }],
        hostname_endpoints: vec![HostnameEndpoint {
            workload: WorkloadKey::new("default", "api-ext"),
            hostname: "api.example.test".into(),
            ready: true,
            capacity: 1,
            ports: BTreeMap::new(),
        }],
        ..Default::default()
    };
    let lookup = std::sync::RwLock::new(WorkloadStore::new());
    let td = TrustDomain::default();
    let client: IpAddr = "198.18.1.10".parse().expect("ip");
    assert_eq!(
        lookup.pick_endpoint(&td, &api, client, vip, 0),
        Ok(Target::Resolve(Box::new(HostnameTarget {
            workload: WorkloadKey::new("default", "api-ext"),
            hostname: "api.example.test".into(),
            port: 8080,
        })))
    );
    api.endpoints
        .push(Endpoint::new("198.18.1.20".parse().expect("ip"), None));
    assert_eq!(
        lookup.pick_endpoint(&td, &api, client, vip, 0),
        Ok(Target::Direct("198.18.1.20:8080".parse().expect("addr")))
    );
}
