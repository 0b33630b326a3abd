//! Which service an inbound connection is counted for (its metrics'
//! `destination_service`, its access line's `dst.service`), as ztunnel's
//! inbound guesses it (`guess_inbound_service`): the service the source's
//! proxy named in the CONNECT's `forwarded` `host=`, when the target
//! backs it; else the first of the target's services whose target port
//! (the service's, or the target's own for it) is the port connected to.
//!
//! Limitation: a workload's services are known only from istiod (xDS
//! `services`); from the Kubernetes source or the workloads file the guess
//! finds none, and the inbound side says `unknown` as before.

use crate::{
    state::{Workload, WorkloadKey},
    store::WorkloadStore,
};

/// The `host=` of a `forwarded` header's value (RFC 7239; quotes
/// dropped), as ztunnel reads it: ASCII only, not empty.
pub(super) fn forwarded_host(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::FORWARDED)?.to_str().ok()?;
    value
        .split(';')
        .find_map(|part| part.trim().strip_prefix("host="))
        .map(|h| h.strip_prefix('"').unwrap_or(h))
        .map(|h| h.strip_suffix('"').unwrap_or(h))
        .filter(|h| !h.is_empty())
}

/// The service (by id, `namespace/hostname`) a connection to `target`'s
/// `port` is counted for, given the `forwarded` host.
pub(crate) fn guess(
    store: &WorkloadStore,
    target: &Workload,
    forwarded_host: Option<&str>,
    port: u16,
) -> Option<WorkloadKey> {
    // The target's services the store knows, in the workload's order (a
    // sorted map; ztunnel's is a hash map's, so with several that match,
    // which it takes varies).
    let services = || {
        target.services.iter().filter_map(|(key, own_ports)| {
            let (namespace, hostname) = key.split_once('/')?;
            store
                .services()
                .by_hostname(namespace, hostname)
                .map(|service| (service, own_ports))
        })
    };
    if let Some(host) = forwarded_host
        && let Some((service, _)) = services().find(|(s, _)| s.hostname == host)
    {
        return Some(service.id());
    }
    services()
        .find(|(service, own_ports)| {
            service
                .ports
                .iter()
                .any(|p| p.target_port == Some(port) || own_ports.get(&p.port) == Some(&port))
        })
        .map(|(service, _)| service.id())
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, sync::Arc};

    use super::*;
    use crate::state::{Service, ServicePort, tests::workload};

    fn service(name: &str, host: &str, target: Option<u16>) -> Service {
        Service {
            name: name.into(),
            namespace: "default".into(),
            hostname: host.into(),
            vips: vec!["198.19.100.9".parse().expect("ip")],
            ports: vec![ServicePort {
                port: 80,
                target_port: target,
            }],
            ..Default::default()
        }
    }

    fn bed() -> (WorkloadStore, Workload) {
        let mut server = workload("default", "server", "198.18.2.10", "node-b");
        for (host, own) in [
            ("default/a.ext.example.com", 0),
            ("default/b.ext.example.com", 0),
            ("default/named.default.svc.cluster.local", 9090),
        ] {
            server
                .services
                .insert(host.into(), BTreeMap::from([(80, own)]));
        }
        let mut store = WorkloadStore::new();
        store.insert(Arc::new(server.clone()));
        store.replace_services([
            service("ext", "a.ext.example.com", Some(8080)),
            service("ext", "b.ext.example.com", Some(8080)),
            // A named target port: the workload's own mapping counts.
            service("named", "named.default.svc.cluster.local", None),
        ]);
        (store, server)
    }

    #[test]
    fn the_forwarded_host_wins_then_the_first_service_on_the_port() {
        let (store, server) = bed();
        let id = |host: &str| Some(WorkloadKey::new("default", host));
        assert_eq!(
            guess(&store, &server, Some("b.ext.example.com"), 8080),
            id("b.ext.example.com")
        );
        assert_eq!(guess(&store, &server, None, 8080), id("a.ext.example.com"));
        assert_eq!(
            guess(&store, &server, None, 9090),
            id("named.default.svc.cluster.local")
        );
        // A host the target does not back is no reason to name it.
        assert_eq!(
            guess(&store, &server, Some("web.default.svc.cluster.local"), 8080),
            id("a.ext.example.com")
        );
        assert_eq!(guess(&store, &server, None, 7070), None);
    }

    #[test]
    fn the_forwarded_host_is_read_as_ztunnel_reads_it() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(forwarded_host(&headers), None);
        headers.insert(
            http::header::FORWARDED,
            http::HeaderValue::from_static(
                "for=\"198.18.1.10:4000\";host=web.default.svc.cluster.local",
            ),
        );
        assert_eq!(
            forwarded_host(&headers),
            Some("web.default.svc.cluster.local")
        );
        headers.insert(
            http::header::FORWARDED,
            http::HeaderValue::from_static("for=\"198.18.1.10:4000\";host=\"quoted.example\""),
        );
        assert_eq!(forwarded_host(&headers), Some("quoted.example"));
        headers.insert(
            http::header::FORWARDED,
            http::HeaderValue::from_static("host="),
        );
        assert_eq!(forwarded_host(&headers), None);
    }
}
