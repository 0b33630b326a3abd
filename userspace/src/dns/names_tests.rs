//! Tests of `names.rs` (`super`).

use super::*;
use crate::state::{Endpoint, Service, Workload};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn pod(ns: &str) -> PodDns {
    PodDns::kubernetes(ns, "cluster.local")
}

fn names() -> MeshNames {
    let mut n = MeshNames::new("cluster.local.");
    n.insert_service(
        "web.default.svc.cluster.local",
        "default",
        vec![ip("10.96.0.10")],
    );
    n.insert_service(
        "api.other.svc.cluster.local",
        "other",
        vec![ip("10.96.0.20")],
    );
    n.insert_service("*.example.com", "default", vec![ip("240.240.0.1")]);
    n.insert_service("db.example.com", "default", vec![ip("240.240.0.2")]);
    n.insert_service("db.example.com", "other", vec![ip("240.240.0.3")]);
    n.insert_workload("vm1.example.org", "default", vec![ip("10.0.0.7")]);
    n
}

fn resolved(n: &MeshNames, q: &str, ns: &str) -> Option<(Vec<IpAddr>, Option<String>)> {
    n.resolve(q, &pod(ns))
        .map(|m| (m.host.addrs.clone(), m.stripped))
}

#[test]
fn short_and_long_forms_of_a_service_in_the_pods_namespace() {
    let n = names();
    let vip = vec![ip("10.96.0.10")];
    for q in [
        "web",
        "web.default",
        "web.default.svc",
        "web.default.svc.cluster.local",
        "WEB.Default.svc.cluster.local.",
    ] {
        assert_eq!(resolved(&n, q, "default"), Some((vip.clone(), None)), "{q}");
    }
    // From another namespace only the qualified forms mean it.
    assert_eq!(resolved(&n, "web", "other"), None);
    assert_eq!(resolved(&n, "web.default", "other").map(|r| r.0), Some(vip));
}

#[test]
fn the_ndots_expanded_queries_hit_on_the_first_try() {
    let n = names();
    // `web.default.svc.cluster.local` asked from `other` with ndots:5:
    // the stub resolver first appends `other.svc.cluster.local`.
    assert_eq!(
        resolved(
            &n,
            "web.default.svc.cluster.local.other.svc.cluster.local",
            "other"
        ),
        Some((
            vec![ip("10.96.0.10")],
            Some("web.default.svc.cluster.local".into())
        ))
    );
    // `api.other` asked from `default`: `api.other.default.svc.cluster.local`.
    assert_eq!(
        resolved(&n, "api.other.default.svc.cluster.local", "default"),
        Some((vec![ip("10.96.0.20")], Some("api.other".into())))
    );
    // A ServiceEntry host asked with ndots:5: `db.example.com.default.svc.cluster.local`.
    assert_eq!(
        resolved(&n, "db.example.com.default.svc.cluster.local", "default"),
        Some((vec![ip("240.240.0.2")], Some("db.example.com".into())))
    );
    // Not a mesh name under any search domain: forwarded.
    assert_eq!(
        resolved(&n, "www.google.com.default.svc.cluster.local", "default"),
        None
    );
    assert_eq!(resolved(&n, "www.google.com", "default"), None);
}

#[test]
fn service_entry_hosts_prefer_the_pods_namespace_and_wildcards_match_below() {
    let n = names();
    assert_eq!(
        resolved(&n, "db.example.com", "other").map(|r| r.0),
        Some(vec![ip("240.240.0.3")])
    );
    assert_eq!(
        resolved(&n, "db.example.com", "third").map(|r| r.0),
        Some(vec![ip("240.240.0.2")])
    );
    let m = n
        .resolve("a.b.example.com", &pod("default"))
        .expect("wildcard");
    assert!(m.wildcard);
    assert_eq!(m.host.addrs, vec![ip("240.240.0.1")]);
    assert_eq!(resolved(&n, "example.com", "default"), None);
}

#[test]
fn workloads_with_a_hostname() {
    let n = names();
    assert_eq!(
        resolved(&n, "vm1.example.org", "x").map(|r| r.0),
        Some(vec![ip("10.0.0.7")])
    );
}

fn service(name: &str, vips: &[&str], endpoints: &[(&str, bool)], hostname: &str) -> Service {
    Service {
        name: name.into(),
        namespace: "default".into(),
        vips: vips.iter().map(|v| ip(v)).collect(),
        endpoints: endpoints
            .iter()
            .map(|(e, ready)| Endpoint {
                ready: *ready,
                ..Endpoint::new(ip(e), None)
            })
            .collect(),
        hostname: hostname.into(),
        ..Default::default()
    }
}

#[test]
fn built_from_the_store() {
    let mut store = WorkloadStore::new();
    let mut remote = service("remote", &["10.96.0.30", "10.96.0.31"], &[], "");
    remote
        .vip_networks
        .insert(ip("10.96.0.31"), "network-2".into());
    store.replace_services([
        service("web", &["10.96.0.10", "fd00::10"], &[], ""),
        service(
            "headless",
            &[],
            &[("10.1.0.2", true), ("10.1.0.1", true), ("10.1.0.3", false)],
            "",
        ),
        service("se", &[], &[("10.1.0.9", true)], "no-vip.example.com"),
        remote,
    ]);
    let vm = Workload {
        name: "vm1".into(),
        namespace: "default".into(),
        hostname: "vm1.example.org".into(),
        ips: vec![ip("10.0.0.7")],
        ..Default::default()
    };
    store.replace_all([vm]);
    let n = MeshNames::build(&store, "cluster.local");
    let p = pod("default");
    // A client on the default network.
    let addrs = |q: &str| {
        n.resolve(q, &p)
            .map(|m| m.host.addrs_for("").copied().collect::<Vec<_>>())
    };
    assert_eq!(addrs("web"), Some(vec![ip("10.96.0.10"), ip("fd00::10")]));
    assert_eq!(
        addrs("headless"),
        Some(vec![ip("10.1.0.1"), ip("10.1.0.2")])
    );
    // A non-Kubernetes host without a VIP is the upstream's to answer.
    assert_eq!(addrs("no-vip.example.com"), None);
    // Only VIPs on the client's network.
    assert_eq!(addrs("remote"), Some(vec![ip("10.96.0.30")]));
    assert_eq!(addrs("vm1.example.org"), Some(vec![ip("10.0.0.7")]));
}

#[test]
fn pods_of_a_headless_service_answer_to_hostname_dot_subdomain() {
    let mut store = WorkloadStore::new();
    store.replace_services([
        service("db", &[], &[("10.1.0.1", true), ("10.1.0.2", false)], ""),
        service("web", &["10.96.0.10"], &[("10.1.0.3", true)], ""),
    ]);
    let pod_of = |name: &str, ip_: &str, hostname: &str, subdomain: &str| Workload {
        name: name.into(),
        namespace: "default".into(),
        ips: vec![ip(ip_)],
        pod_hostname: hostname.into(),
        pod_subdomain: subdomain.into(),
        ..Default::default()
    };
    store.replace_all([
        pod_of("db-0", "10.1.0.1", "db-0", "db"),
        // Not ready: no record yet (Kubernetes publishes ready ones).
        pod_of("db-1", "10.1.0.2", "db-1", "db"),
        // The subdomain is a service with a VIP: no pod record.
        pod_of("web-0", "10.1.0.3", "web-0", "web"),
        // No such service.
        pod_of("lone", "10.1.0.4", "lone", "nothing"),
    ]);
    let n = MeshNames::build(&store, "example.internal");
    let p = PodDns::kubernetes("default", "example.internal");
    // A client on the default network.
    let addrs = |q: &str| {
        n.resolve(q, &p)
            .map(|m| m.host.addrs_for("").copied().collect::<Vec<_>>())
    };
    assert_eq!(
        addrs("db-0.db.default.svc.example.internal"),
        Some(vec![ip("10.1.0.1")])
    );
    assert_eq!(
        addrs("DB-0.db.default.svc.example.internal."),
        Some(vec![ip("10.1.0.1")]),
        "any case, trailing dot"
    );
    assert_eq!(addrs("db-1.db.default.svc.example.internal"), None);
    assert_eq!(addrs("web-0.web.default.svc.example.internal"), None);
    assert_eq!(addrs("lone.nothing.default.svc.example.internal"), None);
    // The headless service itself still answers with its ready pods.
    assert_eq!(addrs("db"), Some(vec![ip("10.1.0.1")]));
}

#[test]
fn canonical_names_of_the_stores_workloads() {
    let mut store = WorkloadStore::new();
    let mut labelled = Workload {
        name: "ratings-v1-5d8-x2".into(),
        namespace: "default".into(),
        ..Default::default()
    };
    labelled.labels.insert("app".into(), "ratings".into());
    labelled.labels.insert("version".into(), "v1".into());
    store.replace_all([labelled]);
    let n = MeshNames::build(&store, "cluster.local");
    assert_eq!(
        n.canonical("default", "ratings-v1-5d8-x2"),
        Some(("ratings", "v1"))
    );
    assert_eq!(n.canonical("default", "other"), None);
    assert_eq!(n.canonical("other", "ratings-v1-5d8-x2"), None);
}

#[test]
fn the_feed_publishes_after_each_applied_view() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let store = Arc::new(RwLock::new(WorkloadStore::new()));
        let (applied_tx, applied) = watch::channel(0u64);
        let (tx, mut rx) = names_channel("cluster.local");
        let task = tokio::spawn(publish_names(
            store.clone(),
            applied,
            "cluster.local".into(),
            tx,
        ));
        store
            .write()
            .expect("store")
            .replace_services([service("web", &["10.96.0.10"], &[], "")]);
        applied_tx.send(1).expect("applied");
        rx.changed().await.expect("published");
        assert!(rx.borrow().resolve("web", &pod("default")).is_some());
        drop(applied_tx);
        task.await.expect("feed ends when the store owner does");
    });
}

/// (what, VIPs as (address, network), headless endpoints, ip_families,
/// visibility NAMESPACE, client's namespace, client's network, query
/// name, expected addresses; `None`: not a mesh name, forwarded upstream).
/// The service is `svc` in namespace `ns1`. ztunnel's DNS server answers
/// these the same way (`dns/server.rs`: VIPs of the client's network,
/// `service_family_allowed`, `visible_to`).
type DnsRow = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static [&'static str],
    crate::state::IpFamilies,
    bool,
    &'static str,
    &'static str,
    &'static str,
    Option<&'static [&'static str]>,
);

pub const DNS_ROWS: &[DnsRow] = &[
    (
        "a VIP on the client's network is answered",
        &[("198.19.100.41", "network1")],
        &[],
        crate::state::IpFamilies::Any,
        false,
        "ns1",
        "network1",
        "svc.ns1.svc.cluster.local",
        Some(&["198.19.100.41"]),
    ),
    (
        "a VIP on the default network is not answered to a client on network1",
        &[("198.19.100.42", "")],
        &[],
        crate::state::IpFamilies::Any,
        false,
        "ns1",
        "network1",
        "svc.ns1.svc.cluster.local",
        Some(&[]),
    ),
    (
        "a VIP on network1 is not answered to a client on the default network",
        &[("198.19.100.41", "network1")],
        &[],
        crate::state::IpFamilies::Any,
        false,
        "ns1",
        "",
        "svc.ns1.svc.cluster.local",
        Some(&[]),
    ),
    (
        "both networks: only the client's",
        &[("198.19.100.41", "network1"), ("198.19.100.43", "network2")],
        &[],
        crate::state::IpFamilies::Any,
        false,
        "ns1",
        "network2",
        "svc.ns1.svc.cluster.local",
        Some(&["198.19.100.43"]),
    ),
    (
        "a v4-only headless service answers no AAAA of its dual-stack pods",
        &[],
        &["198.18.1.5", "fd00::5"],
        crate::state::IpFamilies::V4Only,
        false,
        "ns1",
        "",
        "svc.ns1.svc.cluster.local",
        Some(&["198.18.1.5"]),
    ),
    (
        "a v6-only headless service answers no A",
        &[],
        &["198.18.1.5", "fd00::5"],
        crate::state::IpFamilies::V6Only,
        false,
        "ns1",
        "",
        "svc.ns1.svc.cluster.local",
        Some(&["fd00::5"]),
    ),
    (
        "a NAMESPACE-visible service from another namespace: forwarded",
        &[("198.19.100.44", "")],
        &[],
        crate::state::IpFamilies::Any,
        true,
        "ns2",
        "",
        "svc.ns1.svc.cluster.local",
        None,
    ),
    (
        "a NAMESPACE-visible service from its own namespace",
        &[("198.19.100.44", "")],
        &[],
        crate::state::IpFamilies::Any,
        true,
        "ns1",
        "",
        "svc",
        Some(&["198.19.100.44"]),
    ),
];

#[test]
fn networks_families_and_visibility_as_ztunnel_answers() {
    for (what, vips, endpoints, families, namespace_only, client_ns, network, query, expected) in
        DNS_ROWS
    {
        let mut svc = Service {
            name: "svc".into(),
            namespace: "ns1".into(),
            vips: vips.iter().map(|(v, _)| ip(v)).collect(),
            endpoints: endpoints
                .iter()
                .map(|e| Endpoint::new(ip(e), None))
                .collect(),
            ip_families: *families,
            visibility: if *namespace_only {
                crate::state::Visibility::Namespace
            } else {
                crate::state::Visibility::Public
            },
            ..Default::default()
        };
        for (v, net) in vips.iter().filter(|(_, net)| !net.is_empty()) {
            svc.vip_networks.insert(ip(v), net.to_string());
        }
        let client = Workload {
            name: "client".into(),
            namespace: client_ns.to_string(),
            ips: vec![ip("198.18.1.100")],
            network: network.to_string(),
            ..Default::default()
        };
        let mut store = WorkloadStore::new();
        store.replace_services([svc]);
        store.replace_all([client]);
        let n = MeshNames::build(&store, "cluster.local");
        let mut p = pod(client_ns);
        p.name = "client".into();
        let got = n.resolve(query, &p).map(|m| {
            let mut addrs: Vec<IpAddr> = m
                .host
                .addrs_for(n.network(&p.namespace, &p.name))
                .copied()
                .collect();
            addrs.sort();
            addrs
        });
        let expected = expected.map(|e| e.iter().map(|a| ip(a)).collect::<Vec<_>>());
        assert_eq!(got, expected, "{what}");
    }
}
