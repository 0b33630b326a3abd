//! `/config_dump` from a fixed snapshot, compared with the document
//! istioctl would read; and certificates as ztunnel dumps them.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, SystemTime},
};

use serde_json::{Value, json};

use super::*;
use crate::{
    api::{ResourceStatus, XdsStatus},
    authz::{Cidr, Clause, Rule},
    identity::{CertificateAuthority, ca::BuiltinCa},
    redirect::{Hook, RedirectMode},
    snapshot::PodSnapshot,
    state::{
        ApplicationTunnel, ApplicationTunnelProtocol, DataplaneMode, Endpoint, HealthPolicy,
        LoadBalancing, Locality, ServicePort, WorkloadKey, WorkloadType,
    },
};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

fn client() -> Workload {
    Workload {
        name: "client".into(),
        namespace: "default".into(),
        service_account: "sleep".into(),
        ips: vec![ip("198.18.1.2")],
        node: "node-a".into(),
        netns: Some("/var/run/netns/client".into()),
        dataplane_mode: DataplaneMode::Ambient,
        ..Default::default()
    }
}

fn outsider() -> Workload {
    Workload {
        name: "outsider".into(),
        namespace: "default".into(),
        service_account: "default".into(),
        ips: vec![ip("198.18.1.3")],
        node: "node-a".into(),
        ..Default::default()
    }
}

fn server(name: &str, addr: &str, status: WorkloadStatus) -> Workload {
    Workload {
        name: name.into(),
        namespace: "default".into(),
        service_account: "web".into(),
        ips: vec![ip(addr)],
        node: "node-b".into(),
        dataplane_mode: DataplaneMode::Ambient,
        uid: format!("Kubernetes//Pod/default/{name}"),
        canonical_name: "web".into(),
        canonical_revision: "v1".into(),
        cluster_id: "Kubernetes".into(),
        workload_name: "web".into(),
        workload_type: WorkloadType::Deployment,
        native_tunnel: name == "web-0",
        capacity: 2,
        application_tunnel: (name == "web-0").then_some(ApplicationTunnel {
            protocol: ApplicationTunnelProtocol::Proxy,
            port: 0,
        }),
        status,
        waypoint: Some(GatewayAddress {
            destination: GatewayDestination::Hostname {
                namespace: "default".into(),
                hostname: "waypoint.default.svc.cluster.local".into(),
            },
            hbone_mtls_port: 15008,
        }),
        authorization_policies: vec!["default/allow-client".into()],
        services: BTreeMap::from([(
            "default/web.default.svc.cluster.local".into(),
            BTreeMap::from([(80, 8080)]),
        )]),
        locality: Some(Locality {
            region: "r1".into(),
            zone: "z1".into(),
            subzone: String::new(),
        }),
        ..Default::default()
    }
}

fn web() -> Service {
    Service {
        name: "web".into(),
        namespace: "default".into(),
        vips: vec![ip("198.18.100.10")],
        ports: vec![ServicePort {
            port: 80,
            target_port: Some(8080),
        }],
        endpoints: vec![
            Endpoint::new(ip("198.18.2.2"), Some(WorkloadKey::new("default", "web-0"))),
            Endpoint {
                ready: false,
                ..Endpoint::new(ip("198.18.2.3"), Some(WorkloadKey::new("default", "web-1")))
            },
        ],
        hostname: "web.default.svc.cluster.local".into(),
        subject_alt_names: vec!["cluster.local/ns/default/sa/web".into()],
        load_balancing: Some(LoadBalancing {
            routing_preference: vec![LoadBalancingScope::Zone],
            mode: LoadBalancingMode::Failover,
            health_policy: HealthPolicy::AllowAll,
        }),
        ..Default::default()
    }
}

fn allow_client() -> Policy {
    Policy {
        name: "allow-client".into(),
        namespace: "default".into(),
        scope: Scope::WorkloadSelector,
        action: Action::Allow,
        rules: vec![Rule {
            clauses: vec![Clause {
                matches: vec![Match {
                    principals: vec![StringMatch::Exact(
                        "cluster.local/ns/default/sa/sleep".into(),
                    )],
                    not_namespaces: vec![StringMatch::Presence],
                    not_service_accounts: vec![crate::authz::ServiceAccount::new(
                        "default", "curl",
                    )],
                    source_ips: vec![Cidr::new(ip("198.18.0.0"), 15).expect("cidr")],
                    destination_ports: vec![8080],
                    ..Default::default()
                }],
            }],
        }],
        dry_run: false,
        selector: None,
    }
}

fn snapshot() -> NodeSnapshot {
    let mut node = NodeSnapshot::empty("node-a", RedirectMode::Ebpf, TrustDomain::default());
    node.synced = true;
    node.pods = Arc::from(vec![
        PodSnapshot {
            workload: client(),
            state: PodState::Enrolled,
            kernel: Some(EnrolledPod {
                key: client().key(),
                netns: "/var/run/netns/client".into(),
                netns_cookie: 4097,
                mode: RedirectMode::Ebpf,
                hooks: vec![Hook {
                    name: "tc ingress".into(),
                    attachment: "eth0".into(),
                    present: true,
                }],
                counters: Default::default(),
            }),
            kernel_denials: Vec::new(),
        },
        PodSnapshot {
            workload: outsider(),
            state: PodState::NotInMesh,
            kernel: None,
            kernel_denials: Vec::new(),
        },
    ]);
    node
}

fn store() -> WorkloadStore {
    let mut store = WorkloadStore::new();
    store.replace_all([
        client(),
        outsider(),
        server("web-0", "198.18.2.2", WorkloadStatus::Healthy),
        server("web-1", "198.18.2.3", WorkloadStatus::Unhealthy),
    ]);
    store.replace_services([web()]);
    store.replace_policies([allow_client()]);
    store
}

fn xds() -> XdsStatus {
    let resource = |kind: &str, name: &str, version: &str| ResourceStatus {
        kind: kind.into(),
        name: name.into(),
        version: version.into(),
    };
    XdsStatus {
        address: "istiod:15012".into(),
        connected: true,
        synced: true,
        resources: vec![
            resource("workload", "Kubernetes//Pod/default/web-0", "7"),
            resource("service", "default/web.default.svc.cluster.local", "3"),
            resource("authorization", "default/allow-client", "2"),
        ]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

#[test]
fn a_fixed_snapshot_dumps_as_ztunnel_does() {
    let node = snapshot();
    let store = store();
    let pending = [SpiffeId::for_service_account(
        &TrustDomain::default(),
        "default",
        "sleep",
    )];
    let dump = build(&DumpInputs {
        node: &node,
        store: Some(&store),
        pending_identities: &pending,
        roots: &[],
        proxied: vec!["default/client".into()],
        log_filter: Some("info".into()),
        xds: Some(xds()),
        pod_source: "workloads-file",
    });
    let got = serde_json::to_value(&dump).expect("serialises");
    let server = |name: &str, status: &str, version: Option<&str>| {
        let mut origin = json!({"source": "istiod"});
        if let Some(v) = version {
            origin["version"] = json!(v);
        }
        let mut shunt = json!({
            "identity": "spiffe://cluster.local/ns/default/sa/web",
            "dataplaneMode": "ambient",
            "policies": ["default/allow-client"],
            "servicePorts": {"default/web.default.svc.cluster.local": {"80": 8080}},
        });
        for (k, v) in origin.as_object().expect("object") {
            shunt[k] = v.clone();
        }
        let mut dump = json!({
            "uid": format!("Kubernetes//Pod/default/{name}"),
            "workloadIps": [if name == "web-0" { "198.18.2.2" } else { "198.18.2.3" }],
            "waypoint": {"destination": "default/waypoint.default.svc.cluster.local", "hboneMtlsPort": 15008},
            "protocol": "HBONE",
            "networkMode": "Standard",
            "name": name,
            "namespace": "default",
            "serviceAccount": "web",
            "workloadName": "web",
            "workloadType": "deployment",
            "canonicalName": "web",
            "canonicalRevision": "v1",
            "clusterId": "Kubernetes",
            "locality": {"region": "r1", "zone": "z1", "subzone": ""},
            "node": "node-b",
            "status": status,
            "authorizationPolicies": ["default/allow-client"],
            "nativeTunnel": true,
            "applicationTunnel": if name == "web-0" { json!({"protocol": "PROXY"}) } else { Value::Null },
            "capacity": 2,
            // A list, as ztunnel's (and Kiali's reader) has it.
            "services": ["default/web.default.svc.cluster.local"],
            "shunt": shunt,
        });
        if name != "web-0" {
            // Absent, not null or false, when istiod sent none (ztunnel
            // skips them).
            let fields = dump.as_object_mut().expect("object");
            fields.remove("applicationTunnel");
            fields.remove("nativeTunnel");
        }
        dump
    };
    let want = json!({
        "workloads": [
            {
                "uid": "Kubernetes//Pod/default/client",
                "workloadIps": ["198.18.1.2"],
                "protocol": "HBONE",
                "networkMode": "Standard",
                "name": "client",
                "namespace": "default",
                "serviceAccount": "sleep",
                "workloadName": "client",
                "workloadType": "pod",
                "canonicalName": "",
                "canonicalRevision": "",
                "clusterId": "",
                "node": "node-a",
                "status": "Healthy",
                "capacity": 1,
                "shunt": {
                    "identity": "spiffe://cluster.local/ns/default/sa/sleep",
                    "dataplaneMode": "ambient",
                    "netns": "/var/run/netns/client",
                    "state": {"state": "enrolled"},
                    "policies": [],
                    "source": "istiod",
                },
            },
            {
                "uid": "Kubernetes//Pod/default/outsider",
                "workloadIps": ["198.18.1.3"],
                "protocol": "HBONE",
                "networkMode": "Standard",
                "name": "outsider",
                "namespace": "default",
                "serviceAccount": "default",
                "workloadName": "outsider",
                "workloadType": "pod",
                "canonicalName": "",
                "canonicalRevision": "",
                "clusterId": "",
                "node": "node-a",
                "status": "Healthy",
                "capacity": 1,
                "shunt": {
                    "identity": "spiffe://cluster.local/ns/default/sa/default",
                    "dataplaneMode": "none",
                    "state": {"state": "not-in-mesh"},
                    "policies": [],
                    "source": "istiod",
                },
            },
            server("web-0", "Healthy", Some("7")),
            server("web-1", "Unhealthy", None),
        ],
        "services": [{
            "name": "web",
            "namespace": "default",
            "hostname": "web.default.svc.cluster.local",
            "vips": ["/198.18.100.10"],
            "ports": {"80": 8080},
            "loadBalancer": {
                "mode": "Failover",
                "routingPreferences": ["Zone"],
                "healthPolicy": "AllowAll",
            },
            "endpoints": {
                "Kubernetes//Pod/default/web-0:/198.18.2.2": {
                    "workloadUid": "Kubernetes//Pod/default/web-0",
                    "service": "default/web.default.svc.cluster.local",
                    "address": "/198.18.2.2",
                    "port": {"80": 8080},
                    "status": "Healthy",
                },
                "Kubernetes//Pod/default/web-1:/198.18.2.3": {
                    "workloadUid": "Kubernetes//Pod/default/web-1",
                    "service": "default/web.default.svc.cluster.local",
                    "address": "/198.18.2.3",
                    "port": {"80": 8080},
                    "status": "Unhealthy",
                },
            },
            "subjectAltNames": ["cluster.local/ns/default/sa/web"],
            "ipFamilies": "IPv4",
            "canonical": false,
            "visibility": "Public",
            "shunt": {"source": "istiod", "version": "3"},
        }],
        "policies": [{
            "name": "allow-client",
            "namespace": "default",
            "scope": "WorkloadSelector",
            "action": "Allow",
            "rules": [[[{
                "notNamespaces": [{"Presence": {}}],
                "notServiceAccounts": [{"namespace": "default", "serviceAccount": "curl"}],
                "principals": [{"Exact": "cluster.local/ns/default/sa/sleep"}],
                "sourceIps": ["198.18.0.0/15"],
                "destinationPorts": [8080],
            }]]],
            "dryRun": false,
            "shunt": {"source": "istiod", "version": "2"},
        }],
        "certificates": [{
            "identity": "spiffe://cluster.local/ns/default/sa/sleep",
            "state": "Initializing",
            "certChain": [],
        }],
        "workloadState": {
            "Kubernetes//Pod/default/client": {
                "state": "Up",
                "info": {
                    "name": "client",
                    "namespace": "default",
                    "trustDomain": "cluster.local",
                    "serviceAccount": "sleep",
                },
            },
        },
        "shunt": {
            "node": "node-a",
            "mode": "ebpf",
            "trustDomain": "cluster.local",
            "synced": true,
            "logFilter": "info",
            "sources": {"pods": "workloads-file", "cluster": "istiod"},
            "enrolled": [{
                "namespace": "default",
                "name": "client",
                "netns": "/var/run/netns/client",
                "netnsCookie": 4097,
                "mode": "ebpf",
                "hooks": [{"name": "tc ingress", "attachment": "eth0", "present": true}],
            }],
            "proxied": ["default/client"],
            "xds": serde_json::to_value(xds()).expect("xds"),
        },
    });
    assert_eq!(
        got,
        want,
        "got:\n{}",
        serde_json::to_string_pretty(&got).unwrap_or_default()
    );
    // And it reads back (what `shunt status` and the tests do).
    let back: ConfigDump = serde_json::from_value(got).expect("reads back");
    assert_eq!(back, dump);
}

#[test]
fn without_the_proxy_only_this_nodes_pods_are_dumped() {
    let node = snapshot();
    let dump = build(&DumpInputs {
        node: &node,
        store: None,
        pending_identities: &[],
        roots: &[],
        proxied: Vec::new(),
        log_filter: None,
        xds: None,
        pod_source: "kubernetes",
    });
    let names: Vec<_> = dump.workloads.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["client", "outsider"]);
    assert!(dump.services.is_empty() && dump.policies.is_empty());
    assert_eq!(dump.workloads[0].shunt.origin.source, "kubernetes");
    assert_eq!(dump.shunt.sources.cluster, "kubernetes");
    let json = serde_json::to_value(&dump).expect("serialises");
    assert!(json["shunt"].get("xds").is_none(), "{json}");
}

#[test]
fn certificates_dump_their_chain_with_serials_and_dates() {
    let td = TrustDomain::default();
    let (ca, _) = BuiltinCa::generate(&td).expect("CA");
    let id = SpiffeId::for_service_account(&td, "default", "sleep");
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let from = SystemTime::UNIX_EPOCH + Duration::from_secs(1_679_403_777);
    let mut params =
        crate::identity::ca::leaf_params(&id, from, from + Duration::from_secs(86_400))
            .expect("params");
    params.serial_number = Some(rcgen::SerialNumber::from_slice(&[0x01, 0x00]));
    let leaf = ca.sign_params(&params, &key).expect("leaf");
    let mut chain = vec![leaf];
    chain.extend(ca.chain().iter().cloned());
    let cert = WorkloadCert::new(id.clone(), chain.clone(), key.serialize_der()).expect("cert");
    let roots = ca.roots();

    let mut node = snapshot();
    node.certificates.insert(id.clone(), Arc::new(cert));
    let dump = build(&DumpInputs {
        node: &node,
        store: None,
        pending_identities: std::slice::from_ref(&id),
        roots: &roots,
        proxied: Vec::new(),
        log_filter: None,
        xds: None,
        pod_source: "workloads-file",
    });
    assert_eq!(dump.certificates.len(), 1, "issued, so not also pending");
    let certs = &dump.certificates[0];
    assert_eq!(certs.identity, "spiffe://cluster.local/ns/default/sa/sleep");
    assert_eq!(certs.state, "Available");
    let leaf = &certs.cert_chain[0];
    assert_eq!(leaf.serial_number, "256");
    assert_eq!(leaf.valid_from, "2023-03-21T13:02:57Z");
    assert_eq!(leaf.expiration_time, "2023-03-22T13:02:57Z");
    assert!(
        leaf.pem.starts_with("-----BEGIN CERTIFICATE-----"),
        "{}",
        leaf.pem
    );
    // Leaf, the CA's chain, then the roots it did not already carry.
    let mut want = chain.clone();
    want.extend(roots.iter().filter(|r| !chain.contains(r)).cloned());
    let pems: Vec<_> = want.iter().map(|d| cert_dump(d).pem).collect();
    let got: Vec<_> = certs.cert_chain.iter().map(|c| c.pem.clone()).collect();
    assert_eq!(got, pems);
    assert!(certs.cert_chain.len() >= 2, "the root is listed");
    let json: Value = serde_json::to_value(certs).expect("json");
    assert!(json["certChain"][0]["serialNumber"].is_string(), "{json}");
}

#[test]
fn rfc3339_formats_utc() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
    assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
}

#[test]
fn an_endpoint_names_the_workload_on_its_own_network() {
    // Two networks reuse 198.18.5.5; the service's endpoint is net-b's.
    let at = |name: &str, network: &str| Workload {
        name: name.into(),
        namespace: "default".into(),
        uid: format!("Kubernetes//Pod/default/{name}"),
        ips: vec![ip("198.18.5.5")],
        network: network.into(),
        ..Default::default()
    };
    let mut store = WorkloadStore::on_network("net-a");
    store.replace_all(vec![at("here", "net-a"), at("there", "net-b")]);
    let mut endpoint = Endpoint::new(ip("198.18.5.5"), None);
    endpoint.network = "net-b".into();
    let web = Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        endpoints: vec![endpoint],
        ..Default::default()
    };
    let origin = |_: &str, _: &str| Origin {
        source: "istiod".into(),
        version: None,
    };
    let dumped = service(&web, &store, &origin);
    let keys: Vec<_> = dumped.endpoints.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["Kubernetes//Pod/default/there:net-b/198.18.5.5"],
        "{dumped:?}"
    );
}

#[test]
fn a_weighted_set_of_waypoints_dumps_as_ztunnels() {
    let by_host = |host: &str| GatewayAddress {
        destination: GatewayDestination::Hostname {
            namespace: "default".into(),
            hostname: host.into(),
        },
        hbone_mtls_port: 15008,
    };
    let mut svc = web();
    svc.waypoint = Some(by_host("primary.default.svc.cluster.local"));
    svc.weighted_waypoints = vec![
        crate::state::WeightedWaypoint {
            destination: by_host("primary.default.svc.cluster.local"),
            weight: 90,
        },
        crate::state::WeightedWaypoint {
            destination: by_host("canary.default.svc.cluster.local"),
            weight: 10,
        },
    ];
    let origin = |_: &str, _: &str| Origin {
        source: "istiod".into(),
        version: None,
    };
    let dumped =
        serde_json::to_value(service(&svc, &WorkloadStore::new(), &origin)).expect("serialises");
    assert_eq!(
        dumped["weightedWaypoints"],
        json!([
            {"destination": {"destination": "default/primary.default.svc.cluster.local", "hboneMtlsPort": 15008}, "weight": 90},
            {"destination": {"destination": "default/canary.default.svc.cluster.local", "hboneMtlsPort": 15008}, "weight": 10},
        ])
    );
    // None: no key (ztunnel skips an empty set).
    let plain =
        serde_json::to_value(service(&web(), &WorkloadStore::new(), &origin)).expect("serialises");
    assert!(plain.get("weightedWaypoints").is_none(), "{plain}");
}
