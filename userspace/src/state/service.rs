//! Kubernetes Services: a virtual IP and port that the proxy load-balances
//! over the service's endpoints (ztunnel's `state/service.rs` is the model).
//!
//! A connection to `VIP:port` is sent to one ready endpoint's
//! `IP:targetPort`; whether that hop is HBONE or plain TCP depends on the
//! endpoint (a mesh workload or not), which the proxy decides from the
//! workloads, not from here.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use super::{GatewayAddress, Place, WorkloadKey, weighted_pick, weighted_pick_counted};

/// A service with at least one cluster IP.
///
/// The fields after `endpoints` come from istiod (`istio.workload.Service`);
/// the other sources leave their defaults.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    /// The cluster IPs (one per address family); assigned to no interface.
    pub vips: Vec<IpAddr>,
    /// TCP ports only (the proxy carries nothing else).
    pub ports: Vec<ServicePort>,
    pub endpoints: Vec<Endpoint>,
    /// The fully qualified name (`web.default.svc.cluster.local`); empty
    /// when the source does not say.
    pub hostname: String,
    /// The network of each VIP that is not on the local network (the
    /// local one, empty in xDS, is the default and not listed).
    pub vip_networks: BTreeMap<IpAddr, String>,
    /// Ranges of addresses that reach it (a ServiceEntry's CIDR, which
    /// istiod sends as an address with a shorter `length`): a destination
    /// in one that no workload owns and no VIP names is this service
    /// ([`ServiceStore::by_range`](super::ServiceStore::by_range)).
    pub vip_ranges: Vec<VipRange>,
    /// Identities the endpoints may present besides their own (SPIFFE URIs
    /// without the scheme, as istiod sends them).
    pub subject_alt_names: Vec<String>,
    /// The waypoint that serves the service (L7), if any.
    pub waypoint: Option<GatewayAddress>,
    /// A weighted set of waypoints (xDS `weighted_waypoints`: a canary
    /// between two waypoints). Each connection takes one in proportion to
    /// its weight ([`Service::waypoint_for`]); empty, or every weight 0:
    /// `waypoint` alone (istiod keeps the primary there).
    pub weighted_waypoints: Vec<WeightedWaypoint>,
    /// How endpoints are preferred; `None`: any ready endpoint.
    pub load_balancing: Option<LoadBalancing>,
    /// The one service that owns its hostname when several share it (xDS
    /// `canonical`): it wins the hostname index.
    pub canonical: bool,
    /// The address families it serves (xDS `ip_families`): a single-family
    /// headless service answers no DNS records of the other family.
    pub ip_families: IpFamilies,
    /// Who may resolve it by name (xDS `visibility`).
    pub visibility: Visibility,
    /// Endpoints without an address, reachable only through their
    /// network's gateway (a WorkloadEntry of another network istiod sends
    /// with no address): never dialled, never in DNS or the kernel's
    /// tables; only `proxy/network_gateway.rs` looks at them.
    pub gateway_only: Vec<GatewayOnlyEndpoint>,
    /// Endpoints known by DNS name (a `resolution: DNS` ServiceEntry's):
    /// resolved by the proxy when a connection picks one, taken only when
    /// no addressed endpoint on the client's network is ready
    /// (`hostname_endpoint.rs`).
    pub hostname_endpoints: Vec<super::HostnameEndpoint>,
}

/// A range of addresses (`addr/prefix`, host bits zero) and the network
/// istiod names for it (empty: the local one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipRange {
    pub addr: IpAddr,
    pub prefix: u8,
    pub network: String,
}

impl VipRange {
    /// `addr/prefix` with the host bits cleared; `None` when `prefix` is
    /// longer than the family's address.
    pub fn new(addr: IpAddr, prefix: u8, network: String) -> Option<Self> {
        let masked = match addr {
            IpAddr::V4(v4) if prefix <= 32 => {
                // A shift by the whole width (prefix 0) is no bits at all.
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                IpAddr::from((u32::from(v4) & mask).to_be_bytes())
            }
            IpAddr::V6(v6) if prefix <= 128 => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                IpAddr::from((u128::from(v6) & mask).to_be_bytes())
            }
            _ => return None,
        };
        Some(Self {
            addr: masked,
            prefix,
            network,
        })
    }

    /// Whether `ip` is in the range (same family only).
    pub fn contains(&self, ip: IpAddr) -> bool {
        VipRange::new(ip, self.prefix, String::new()).is_some_and(|r| r.addr == self.addr)
    }
}

impl std::fmt::Display for VipRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One waypoint of a service's weighted set and its share of
/// connections (`weight / sum of weights`; 0: described, sent nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightedWaypoint {
    pub destination: GatewayAddress,
    pub weight: u32,
}

/// A backend of a service that has no address: only its network's
/// gateway reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayOnlyEndpoint {
    pub ready: bool,
    pub network: String,
    pub gateway: GatewayAddress,
    pub capacity: u32,
    /// Service port → target port, where the workload resolves it.
    pub ports: BTreeMap<u16, u16>,
}

/// The families a service serves (`istio.workload.IPFamilies`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum IpFamilies {
    /// `AUTOMATIC` or `DUAL`: whatever its addresses are.
    #[default]
    Any,
    V4Only,
    V6Only,
}

impl IpFamilies {
    /// Whether `ip`'s family is one the service serves.
    pub fn allows(self, ip: &IpAddr) -> bool {
        match self {
            IpFamilies::Any => true,
            IpFamilies::V4Only => ip.is_ipv4(),
            IpFamilies::V6Only => ip.is_ipv6(),
        }
    }
}

/// Who may find a service by name (`istio.workload.Service.Visibility`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Visibility {
    /// Every namespace.
    #[default]
    Public,
    /// Only its own namespace (`exportTo: .`).
    Namespace,
}

/// Locality-aware endpoint choice (`istio.workload.LoadBalancing`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadBalancing {
    /// Scopes an endpoint should share with the client, most important
    /// first.
    pub routing_preference: Vec<LoadBalancingScope>,
    pub mode: LoadBalancingMode,
    pub health_policy: HealthPolicy,
}

/// Whether unhealthy workloads count as endpoints
/// (`istio.workload.LoadBalancing.HealthPolicy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HealthPolicy {
    /// Only healthy workloads (the default).
    #[default]
    OnlyHealthy,
    /// Every workload, healthy or not.
    AllowAll,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadBalancingScope {
    Region,
    Zone,
    Subzone,
    Node,
    Cluster,
    Network,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LoadBalancingMode {
    /// Not given (istiod's `UNSPECIFIED_MODE`): ztunnel's "standard", any
    /// ready endpoint, whatever the routing preferences.
    #[default]
    Unspecified,
    /// Only endpoints that match every scope.
    Strict,
    /// The best-matching endpoints first, the others when none is ready.
    Failover,
    /// No endpoint choice: the connection keeps the address the client
    /// dialled.
    Passthrough,
}

/// One port of a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub port: u16,
    /// The endpoints' port, when the service gives it as a number. `None` for
    /// a named `targetPort`: each endpoint may resolve it differently, so it
    /// is then taken from [`Endpoint::ports`].
    pub target_port: Option<u16>,
}

/// One backend of a service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    /// Only ready endpoints get connections.
    pub ready: bool,
    /// The pod behind the address, when the source names it (for logs; the
    /// proxy finds the workload by IP either way).
    pub pod: Option<WorkloadKey>,
    /// Service port → this endpoint's target port, where the source resolved
    /// it per endpoint (EndpointSlice ports); wins over
    /// [`ServicePort::target_port`].
    pub ports: BTreeMap<u16, u16>,
    /// Its weight among the service's endpoints (the workload's
    /// capacity; 1 where the source has no notion of it).
    pub capacity: u32,
    /// The network of the workload behind it (xDS `Workload.network`;
    /// empty where the source has none). A client is sent to endpoints on
    /// its own network first; another network's are reached only through
    /// that network's gateway (`proxy/network_gateway.rs`), never dialled:
    /// their addresses may belong to other pods here.
    pub network: String,
}

impl Endpoint {
    /// A ready endpoint that uses the service's own target ports.
    pub fn new(ip: IpAddr, pod: Option<WorkloadKey>) -> Self {
        Self {
            ip,
            ready: true,
            pod,
            ports: BTreeMap::new(),
            capacity: 1,
            network: String::new(),
        }
    }
}

impl Service {
    pub fn key(&self) -> WorkloadKey {
        WorkloadKey::new(&self.namespace, &self.name)
    }

    /// Whether a client in `namespace` may find it (by name or address):
    /// every namespace, unless its visibility is its own namespace only.
    pub fn visible_to(&self, namespace: &str) -> bool {
        self.visibility != Visibility::Namespace || self.namespace == namespace
    }

    /// Whether a waypoint serves it: its own, or a weighted set.
    pub fn has_waypoint(&self) -> bool {
        self.waypoint.is_some() || !self.weighted_waypoints.is_empty()
    }

    /// Every waypoint that may serve it: the weighted set's, then its own.
    pub fn waypoints(&self) -> impl Iterator<Item = &GatewayAddress> {
        self.weighted_waypoints
            .iter()
            .map(|w| &w.destination)
            .chain(&self.waypoint)
    }

    /// The waypoints named by hostname (its own and the weighted set's),
    /// as `namespace/hostname`, each once: what must be a known service.
    pub fn waypoint_hostnames(&self) -> std::collections::BTreeSet<String> {
        self.waypoints()
            .filter_map(|g| match &g.destination {
                super::GatewayDestination::Hostname {
                    namespace,
                    hostname,
                } => Some(format!("{namespace}/{hostname}")),
                super::GatewayDestination::Address { .. } => None,
            })
            .collect()
    }

    /// The waypoint connection number `n` goes to, and a counter of its own
    /// for choosing among that waypoint's replicas: from the weighted set
    /// in proportion to the weights (interleaved weighted round robin;
    /// ztunnel samples at random), else, with no set or every weight 0,
    /// the service's own waypoint.
    pub fn waypoint_for(&self, n: usize) -> Option<(&GatewayAddress, usize)> {
        let positive: Vec<&WeightedWaypoint> = self
            .weighted_waypoints
            .iter()
            .filter(|w| w.weight > 0)
            .collect();
        match weighted_pick_counted(&positive, |w| w.weight, n) {
            Some((chosen, taken)) => Some((&chosen.destination, taken)),
            None => self.waypoint.as_ref().map(|w| (w, n)),
        }
    }

    /// Its `subject_alt_names` as `spiffe://` URIs (istiod may send them
    /// without the scheme): what a certificate presented for the service
    /// may carry.
    pub fn san_uris(&self) -> Vec<String> {
        self.subject_alt_names
            .iter()
            .map(|san| {
                if san.starts_with("spiffe://") {
                    san.clone()
                } else {
                    format!("spiffe://{san}")
                }
            })
            .collect()
    }

    /// Where `endpoint` takes connections to the service's `port`, if it
    /// does.
    pub fn target_port(&self, endpoint: &Endpoint, port: u16) -> Option<u16> {
        self.target_port_with(&endpoint.ports, port)
    }

    /// Where a backend whose own mapping is `own` (service port → target
    /// port) takes the service's `port`: its own, else the service's.
    pub(super) fn target_port_with(&self, own: &BTreeMap<u16, u16>, port: u16) -> Option<u16> {
        if let Some(target) = own.get(&port) {
            return Some(*target);
        }
        self.ports
            .iter()
            .find(|p| p.port == port)
            .and_then(|p| p.target_port)
    }

    /// The addresses a connection to `dst` (one of this service's VIPs and
    /// ports) may go to now: ready endpoints of the VIP's address family
    /// that serve the port, in the service's order.
    pub fn ready_targets(&self, dst: SocketAddr) -> Vec<(&Endpoint, SocketAddr)> {
        self.endpoints
            .iter()
            .filter(|e| e.ready && e.ip.is_ipv4() == dst.is_ipv4())
            .filter_map(|e| {
                let port = self.target_port(e, dst.port())?;
                Some((e, SocketAddr::new(e.ip, port)))
            })
            .collect()
    }

    /// The ready target for connection number `n` from a client on
    /// `network`: weighted round robin by endpoint capacity
    /// ([`weighted_pick`]; plain round robin when the capacities are
    /// equal) over the ready endpoints on that network; `None` when none
    /// is ready there ([`Service::only_on_other_networks`] tells why).
    pub fn pick(
        &self,
        dst: SocketAddr,
        network: &str,
        n: usize,
    ) -> Option<(&Endpoint, SocketAddr)> {
        let targets = self.targets_on(dst, network);
        weighted_pick(&targets, |(e, _)| e.capacity, n).copied()
    }

    /// [`Service::pick`] for a client at `client`, by the service's
    /// locality load balancing ([`LoadBalancing::rank`]): `STRICT` keeps
    /// only the endpoints that share every preference with the client,
    /// `FAILOVER` the best-ranked; then by capacity among those. Only
    /// endpoints on the client's network are candidates. `place_of`
    /// says where an endpoint runs; one it cannot place (no workload known
    /// at that address) is never chosen under a locality policy, as with
    /// ztunnel. `None`: no endpoint may take it ("no healthy upstream").
    pub fn pick_for<'p>(
        &self,
        dst: SocketAddr,
        n: usize,
        client: &Place<'_>,
        place_of: impl Fn(&Endpoint) -> Option<Place<'p>>,
    ) -> Option<(&Endpoint, SocketAddr)> {
        let Some(lb) = self
            .load_balancing
            .as_ref()
            .filter(|lb| lb.ranks_by_locality())
        else {
            return self.pick(dst, client.network, n);
        };
        let ranked: Vec<(usize, (&Endpoint, SocketAddr))> = self
            .targets_on(dst, client.network)
            .into_iter()
            .filter_map(|target| Some((lb.rank(client, &place_of(target.0)?)?, target)))
            .collect();
        let best = ranked.iter().map(|(rank, _)| *rank).max()?;
        let chosen: Vec<(&Endpoint, SocketAddr)> = ranked
            .into_iter()
            .filter(|(rank, _)| *rank == best)
            .map(|(_, target)| target)
            .collect();
        weighted_pick(&chosen, |(e, _)| e.capacity, n).copied()
    }

    /// [`Service::ready_targets`] on `network` (compared as ztunnel
    /// compares a workload's network with its client's: exactly).
    fn targets_on(&self, dst: SocketAddr, network: &str) -> Vec<(&Endpoint, SocketAddr)> {
        let mut targets = self.ready_targets(dst);
        targets.retain(|(e, _)| e.network == network);
        targets
    }

    /// Whether `dst` has ready endpoints but none on `network`: what a
    /// client there cannot reach without a network gateway.
    pub fn only_on_other_networks(&self, dst: SocketAddr, network: &str) -> bool {
        let targets = self.ready_targets(dst);
        !targets.is_empty() && targets.iter().all(|(e, _)| e.network != network)
    }

    /// Whether the endpoint choice depends on the client's locality
    /// (`STRICT` or `FAILOVER`): the kernel's per-VIP choice cannot follow
    /// it.
    pub fn ranks_by_locality(&self) -> bool {
        self.load_balancing
            .as_ref()
            .is_some_and(LoadBalancing::ranks_by_locality)
    }

    /// Whether connections keep the address the client dialled instead of
    /// going to a chosen endpoint (load-balancing mode `PASSTHROUGH`).
    pub fn is_passthrough(&self) -> bool {
        self.load_balancing
            .as_ref()
            .is_some_and(|lb| lb.mode == LoadBalancingMode::Passthrough)
    }

    /// Whether unhealthy workloads are endpoints too (health policy
    /// `ALLOW_ALL`).
    pub fn allows_unhealthy(&self) -> bool {
        self.load_balancing
            .as_ref()
            .is_some_and(|lb| lb.health_policy == HealthPolicy::AllowAll)
    }
}

impl Service {
    /// The id the store keeps it under: namespace/hostname, or
    /// namespace/name when it has no hostname.
    pub fn id(&self) -> WorkloadKey {
        let host = if self.hostname.is_empty() {
            &self.name
        } else {
            &self.hostname
        };
        WorkloadKey::new(&self.namespace, host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ServiceStore;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("test address")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    fn service(ns: &str, name: &str, vip: &str, port: u16, target: u16) -> Service {
        Service {
            name: name.into(),
            namespace: ns.into(),
            vips: vec![ip(vip)],
            ports: vec![ServicePort {
                port,
                target_port: Some(target),
            }],
            endpoints: Vec::new(),
            ..Default::default()
        }
    }

    #[test]
    fn a_range_holds_the_addresses_under_its_prefix() {
        let r = VipRange::new(ip("198.19.200.77"), 24, String::new()).expect("valid");
        assert_eq!(r.to_string(), "198.19.200.0/24", "host bits cleared");
        assert!(r.contains(ip("198.19.200.0")) && r.contains(ip("198.19.200.255")));
        assert!(!r.contains(ip("198.19.201.1")));
        assert!(!r.contains(ip("::ffff:198.19.200.1")), "another family");
        let everything = VipRange::new(ip("10.1.2.3"), 0, String::new()).expect("valid");
        assert!(everything.contains(ip("192.0.2.1")));
        let v6 = VipRange::new(ip("fd00::1:2"), 112, String::new()).expect("valid");
        assert_eq!(v6.to_string(), "fd00::1:0/112");
        assert!(v6.contains(ip("fd00::1:ffff")) && !v6.contains(ip("fd00::2:0")));
        assert_eq!(VipRange::new(ip("10.0.0.0"), 33, String::new()), None);
        assert_eq!(VipRange::new(ip("fd00::"), 129, String::new()), None);
    }

    #[test]
    fn a_range_lookup_takes_the_longest_prefix_then_the_canonical_service() {
        let ranged = |name: &str, cidr: (&str, u8), canonical: bool| Service {
            name: name.into(),
            namespace: "default".into(),
            hostname: format!("{name}.example.com"),
            ports: vec![ServicePort {
                port: 80,
                target_port: Some(80),
            }],
            vip_ranges: vec![VipRange::new(ip(cidr.0), cidr.1, String::new()).expect("valid")],
            canonical,
            ..Default::default()
        };
        let mut store = ServiceStore::default();
        store.replace_all(vec![
            ranged("wide", ("198.19.0.0", 16), false),
            ranged("narrow", ("198.19.200.0", 24), false),
            ranged("narrow-canonical", ("198.19.200.0", 24), true),
        ]);
        let at =
            |store: &ServiceStore, a: &str| store.by_range(addr(a), None).map(|s| s.name.clone());
        assert_eq!(
            at(&store, "198.19.200.7:80").as_deref(),
            Some("narrow-canonical")
        );
        assert_eq!(at(&store, "198.19.7.7:80").as_deref(), Some("wide"));
        assert_eq!(
            at(&store, "198.19.200.7:81"),
            None,
            "a port it does not serve"
        );
        assert_eq!(at(&store, "198.20.0.1:80"), None);
        assert!(store.by_addr(addr("198.19.200.7:80")).is_none(), "no VIP");
        // Removed one at a time, the index follows.
        let canonical = store
            .by_range(addr("198.19.200.7:80"), None)
            .expect("one")
            .id();
        store.remove(&canonical);
        assert_eq!(at(&store, "198.19.200.7:80").as_deref(), Some("narrow"));
        assert!(store.has_ranges());
        store.replace_all(Vec::<Service>::new());
        assert!(!store.has_ranges() && at(&store, "198.19.7.7:80").is_none());
    }

    #[test]
    fn a_shared_vip_is_the_clients_namespaces_then_the_visible_one() {
        let at = |ns: &str, visibility: Visibility, canonical: bool| Service {
            name: "overlap".into(),
            namespace: ns.into(),
            hostname: "overlap.example.com".into(),
            vips: vec![ip("198.19.100.60")],
            ports: vec![ServicePort {
                port: 80,
                target_port: Some(80),
            }],
            visibility,
            canonical,
            ..Default::default()
        };
        let vip = addr("198.19.100.60:80");
        let mut store = ServiceStore::default();
        store.replace_all(vec![
            at("alpha", Visibility::Public, false),
            at("beta", Visibility::Namespace, false),
        ]);
        let from = |store: &ServiceStore, ns: Option<&str>| {
            store.by_addr_from(vip, ns).map(|s| s.namespace.clone())
        };
        assert_eq!(from(&store, Some("alpha")).as_deref(), Some("alpha"));
        assert_eq!(
            from(&store, Some("beta")).as_deref(),
            Some("beta"),
            "its own"
        );
        assert_eq!(
            from(&store, Some("gamma")).as_deref(),
            Some("alpha"),
            "beta's is not visible to gamma"
        );
        assert_eq!(from(&store, None).as_deref(), Some("beta"), "greatest id");
        // A canonical one wins over a greater id outside the client's
        // namespace.
        store.replace_all(vec![
            at("alpha", Visibility::Public, true),
            at("beta", Visibility::Public, false),
        ]);
        assert_eq!(from(&store, Some("gamma")).as_deref(), Some("alpha"));
        assert_eq!(from(&store, Some("beta")).as_deref(), Some("beta"));
        // One alone, not visible: none.
        store.remove(&at("alpha", Visibility::Public, true).id());
        store.upsert(std::sync::Arc::new(at(
            "beta",
            Visibility::Namespace,
            false,
        )));
        assert_eq!(from(&store, Some("gamma")), None);
        assert_eq!(from(&store, Some("beta")).as_deref(), Some("beta"));
    }

    #[test]
    fn lookup_by_vip_and_port() {
        let mut store = ServiceStore::default();
        assert!(store.replace_all(vec![
            service("default", "web", "198.19.100.1", 80, 8080),
            service("shop", "db", "198.19.100.2", 5432, 5432),
        ]));
        let web = store.by_addr(addr("198.19.100.1:80")).expect("web");
        assert_eq!(web.key(), WorkloadKey::new("default", "web"));
        assert!(
            store.by_addr(addr("198.19.100.1:81")).is_none(),
            "port not served"
        );
        assert!(store.by_addr(addr("198.19.100.9:80")).is_none());
        assert_eq!(store.len(), 2);
        let same: Vec<Service> = store.iter().cloned().collect();
        assert!(!store.replace_all(same), "same content is no change");
        assert!(store.replace_all(Vec::<Service>::new()));
        assert!(store.is_empty() && store.by_addr(addr("198.19.100.1:80")).is_none());
    }

    #[test]
    fn a_vip_claimed_twice_stays_with_the_greater_key() {
        let mut store = ServiceStore::default();
        store.replace_all(vec![
            service("default", "b", "198.19.100.1", 80, 8080),
            service("default", "a", "198.19.100.1", 80, 9090),
        ]);
        let owner = store.by_addr(addr("198.19.100.1:80")).map(|s| s.key());
        assert_eq!(owner, Some(WorkloadKey::new("default", "b")));
    }

    #[test]
    fn picks_ready_endpoints_round_robin_with_per_endpoint_ports() {
        let mut web = service("default", "web", "198.19.100.1", 80, 8080);
        web.ports.push(ServicePort {
            port: 443,
            target_port: None,
        });
        let mut named = Endpoint::new(ip("198.18.2.10"), None);
        named.ports.insert(443, 8443);
        let mut not_ready = Endpoint::new(ip("198.18.2.11"), None);
        not_ready.ready = false;
        web.endpoints = vec![
            named,
            not_ready,
            Endpoint::new(ip("198.18.2.12"), None),
            Endpoint::new(ip("2001:db8::1"), None),
        ];
        let dst = addr("198.19.100.1:80");
        let picks: Vec<SocketAddr> = (0..4)
            .filter_map(|n| web.pick(dst, "", n).map(|(_, a)| a))
            .collect();
        assert_eq!(
            picks,
            [
                addr("198.18.2.10:8080"),
                addr("198.18.2.12:8080"),
                addr("198.18.2.10:8080"),
                addr("198.18.2.12:8080"),
            ],
            "ready IPv4 endpoints only, in turn"
        );
        // The named target port is known for one endpoint only.
        let tls = addr("198.19.100.1:443");
        assert_eq!(web.ready_targets(tls).len(), 1);
        assert_eq!(
            web.pick(tls, "", 7).map(|(_, a)| a),
            Some(addr("198.18.2.10:8443"))
        );

        web.endpoints.iter_mut().for_each(|e| e.ready = false);
        assert_eq!(web.pick(dst, "", 0), None);
    }

    #[test]
    fn a_client_is_sent_only_to_endpoints_on_its_network() {
        let mut web = service("default", "web", "198.19.100.1", 80, 8080);
        let mut remote = Endpoint::new(ip("198.18.2.10"), None);
        remote.network = "network2".into();
        web.endpoints = vec![remote, Endpoint::new(ip("198.18.2.11"), None)];
        let dst = addr("198.19.100.1:80");
        let picks = |network: &str| -> Vec<SocketAddr> {
            (0..3)
                .filter_map(|n| web.pick(dst, network, n).map(|(_, a)| a))
                .collect()
        };
        assert_eq!(picks(""), [addr("198.18.2.11:8080"); 3]);
        assert_eq!(picks("network2"), [addr("198.18.2.10:8080"); 3]);
        assert_eq!(picks("network3"), []);
        assert!(web.only_on_other_networks(dst, "network3"));
        assert!(!web.only_on_other_networks(dst, ""));
        web.endpoints.iter_mut().for_each(|e| e.ready = false);
        assert!(
            !web.only_on_other_networks(dst, "network3"),
            "no ready endpoint anywhere is another reason"
        );
    }

    #[test]
    fn endpoints_are_picked_by_capacity() {
        let mut web = service("default", "web", "198.19.100.1", 80, 8080);
        let mut heavy = Endpoint::new(ip("198.18.2.10"), None);
        heavy.capacity = 2;
        let mut drained = Endpoint::new(ip("198.18.2.12"), None);
        drained.capacity = 0;
        web.endpoints = vec![heavy, Endpoint::new(ip("198.18.2.11"), None), drained];
        let dst = addr("198.19.100.1:80");
        let picks: Vec<SocketAddr> = (0..6)
            .filter_map(|n| web.pick(dst, "", n).map(|(_, a)| a))
            .collect();
        let (a, b) = (addr("198.18.2.10:8080"), addr("198.18.2.11:8080"));
        assert_eq!(picks, [a, b, a, a, b, a], "2:1, capacity 0 never");
    }

    /// What xDS sends for a ServiceEntry `default/ext` with two hosts:
    /// two services of one name, both served (keyed by hostname).
    #[test]
    fn services_are_keyed_by_namespace_and_hostname() {
        let mut a = service("default", "ext", "198.19.100.1", 80, 80);
        a.hostname = "a.ext.example.com".into();
        let mut b = service("default", "ext", "198.19.100.2", 80, 80);
        b.hostname = "b.ext.example.com".into();
        let mut other_ns = service("shop", "ext", "198.19.100.3", 80, 80);
        other_ns.hostname = "a.ext.example.com".into();
        let mut store = ServiceStore::default();
        store.replace_all(vec![a.clone(), b.clone(), other_ns]);
        assert_eq!(store.len(), 3);
        let at = |s: &ServiceStore, a: &str| s.by_addr(addr(a)).map(|s| s.hostname.clone());
        assert_eq!(
            at(&store, "198.19.100.1:80"),
            Some("a.ext.example.com".into())
        );
        assert_eq!(
            at(&store, "198.19.100.2:80"),
            Some("b.ext.example.com".into())
        );
        let host =
            |s: &ServiceStore, ns: &str, h: &str| s.by_hostname(ns, h).map(|s| s.vips.clone());
        assert_eq!(
            host(&store, "default", "a.ext.example.com"),
            Some(vec![ip("198.19.100.1")])
        );
        assert_eq!(
            host(&store, "default", "b.ext.example.com"),
            Some(vec![ip("198.19.100.2")])
        );
        assert_eq!(
            host(&store, "shop", "a.ext.example.com"),
            Some(vec![ip("198.19.100.3")])
        );
        assert!(store.by_hostname("default", "other.example.org").is_none());
        assert_eq!(
            store
                .get(&WorkloadKey::new("default", "ext"))
                .map(|s| s.hostname.clone()),
            Some("b.ext.example.com".into()),
            "by name: the greatest id"
        );
        assert!(store.replace_all(vec![a]), "b removed");
        assert_eq!(at(&store, "198.19.100.2:80"), None);
        assert!(store.by_hostname("shop", "a.ext.example.com").is_none());
    }
}
