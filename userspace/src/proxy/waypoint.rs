//! Waypoints: which outbound connections go to a waypoint (the L7 proxy a
//! service or workload is bound to), and the headers every outbound
//! CONNECT carries.
//!
//! ztunnel's behaviour is the contract (see `docs/WAYPOINTS.md`):
//!
//! - a connection to a service's `VIP:port` whose service has a waypoint
//!   goes over HBONE to one healthy waypoint endpoint's
//!   `IP:hbone_mtls_port`, with the CONNECT `:authority` the original
//!   `VIP:port` (the waypoint picks the endpoint), accepting the waypoint
//!   workload's identity or one of the waypoint service's SANs
//!   ("ToServiceWaypoint");
//! - a connection to a pod IP whose workload has a waypoint goes the same
//!   way with `:authority` `podIP:port` ("ToWorkloadWaypoint"); a service
//!   without a waypoint goes to its endpoint directly, whatever the
//!   endpoint's own waypoint (ztunnel does not traverse a workload waypoint
//!   for traffic addressed to a service);
//! - a source that is the waypoint itself (one of its endpoint workloads,
//!   or the address it is named by) is routed as if there were no waypoint:
//!   no loop;
//! - a waypoint that cannot be resolved, or has no healthy endpoint, fails
//!   the connection: the waypoint is never bypassed.
//!
//! [`route`] is a pure function of the store; the proxy calls it through
//! [`super::WorkloadLookup::waypoint_plan`] under one read of the store.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::Mutex,
};

use http::{HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};

use crate::{
    state::{
        GatewayAddress, GatewayDestination, Service, SpiffeId, TrustDomain, Workload, WorkloadKey,
        WorkloadStatus, weighted_pick,
    },
    store::WorkloadStore,
};

/// Where an outbound connection goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// No waypoint applies: the proxy resolves a service to an endpoint and
    /// goes there, as without waypoints.
    Direct,
    /// Over HBONE to a waypoint.
    ViaWaypoint(WaypointHop),
    /// To a service whose waypoint is on another network: through that
    /// network's gateway (double HBONE).
    ThroughGateway(Box<super::network_gateway::GatewayHop>),
    /// The destination has a waypoint that cannot be used: refuse.
    Fail(WaypointFailure),
}

/// Whether the waypoint serves a service or a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// The destination was a service's `VIP:port`.
    Service,
    /// The destination was a workload's IP.
    Workload,
}

impl Bound {
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Service => "service",
            Bound::Workload => "workload",
        }
    }
}

/// The HBONE hop to a waypoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaypointHop {
    pub bound: Bound,
    /// The service or workload the client addressed (whose waypoint it is).
    pub target: WorkloadKey,
    /// The chosen waypoint endpoint's `IP:hbone_mtls_port`.
    pub gateway: SocketAddr,
    /// The CONNECT `:authority`: the original destination, untranslated.
    pub authority: SocketAddr,
    /// The chosen waypoint workload.
    pub waypoint: WorkloadKey,
    /// Its identity: what its certificate must carry...
    pub identity: SpiffeId,
    /// ...or one of these (the waypoint service's `subject_alt_names`, as
    /// `spiffe://` URIs).
    pub also_accept: Vec<String>,
}

/// Why a connection to a waypoint-bound destination was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureReason {
    /// The waypoint names no known service or workload.
    Unresolved,
    /// The waypoint is known but none of its endpoints is healthy.
    NoHealthyEndpoint,
    /// The chosen waypoint endpoint could not be reached (connect, TLS,
    /// HTTP/2, or it refused the CONNECT).
    Unreachable,
    /// Every healthy endpoint of the waypoint is on another network and
    /// cannot be reached through its gateway (a workload's waypoint; no
    /// gateway, or one that cannot be resolved).
    OtherNetwork,
}

impl FailureReason {
    /// The `reason` label of `shunt_waypoint_failures_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Unresolved => "unresolved",
            FailureReason::NoHealthyEndpoint => "no_healthy_endpoint",
            FailureReason::Unreachable => "unreachable",
            FailureReason::OtherNetwork => "other_network",
        }
    }
}

/// A refused connection to a waypoint-bound destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaypointFailure {
    pub bound: Bound,
    /// The service or workload whose waypoint failed.
    pub target: WorkloadKey,
    pub reason: FailureReason,
    /// What was wrong, for the log.
    pub detail: String,
}

impl std::fmt::Display for WaypointFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "waypoint of {} {}: {}",
            self.bound.as_str(),
            self.target,
            self.detail
        )
    }
}

/// What the proxy needs to know about an outbound connection, read under
/// one lock of the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub route: Route,
    /// The `baggage` header describing the source workload (absent when
    /// the store does not know the source).
    pub baggage: Option<String>,
}

/// [`route`] and the source's `baggage`, for the connection of the local
/// pod `source` (found by key, else by `client`'s IP) to `dst`.
pub fn plan(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    source: &WorkloadKey,
    client: IpAddr,
    dst: SocketAddr,
    pick: usize,
) -> Plan {
    let source = store.get(source).or_else(|| store.by_ip(client));
    Plan {
        route: route(store, trust_domain, source, dst, pick),
        baggage: source.map(baggage),
    }
}

/// Where a connection from `source` to the original destination `dst`
/// goes. `pick` chooses among several healthy waypoint endpoints (a
/// counter of connections: weighted round robin by each replica's
/// capacity, plain round robin when they are equal).
pub fn route(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    source: Option<&Workload>,
    dst: SocketAddr,
    pick: usize,
) -> Route {
    if let Some(service) = store.service_for(dst, source.map(|s| s.namespace.as_str())) {
        // Addressed to a service: only the service's waypoint counts, or
        // one of its weighted set, chosen per connection.
        let Some((gateway, replica_pick)) = service.waypoint_for(pick) else {
            return Route::Direct;
        };
        // Any waypoint of the set sending to the service it serves goes
        // direct, whichever one this connection would have taken (`via`
        // checks the chosen one).
        if !service.weighted_waypoints.is_empty()
            && let Some(source) = source
            && service
                .waypoints()
                .filter(|g| *g != gateway)
                .any(|g| resolve(store, &g.destination).is_ok_and(|r| is_member(&r, source)))
        {
            return Route::Direct;
        }
        return via(
            store,
            trust_domain,
            source,
            gateway,
            (Bound::Service, service.key()),
            dst,
            replica_pick,
        );
    }
    match store.by_ip(dst.ip()) {
        Some(workload) => match &workload.waypoint {
            Some(gateway) => via(
                store,
                trust_domain,
                source,
                gateway,
                (Bound::Workload, workload.key()),
                dst,
                pick,
            ),
            None => Route::Direct,
        },
        None => Route::Direct,
    }
}

/// A waypoint resolved to its endpoints.
struct Resolved<'a> {
    /// How it is named, for messages.
    name: String,
    /// Every endpoint, healthy or not: `(IP, the workload behind it, ready)`.
    members: Vec<(IpAddr, Option<&'a Workload>, bool)>,
    /// Its service's `subject_alt_names`, when it is a service.
    sans: Vec<String>,
    /// Its service's health policy lets unhealthy replicas serve.
    allow_unhealthy: bool,
    /// The network an `Address` destination names (empty: ours).
    network: &'a str,
}

/// Whether `network` (a workload's or an address's; empty: the local one)
/// is another network than `local` (the source pod's, which is the node's).
fn other_network(network: &str, local: &str) -> bool {
    !network.is_empty() && network != local
}

fn via(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    source: Option<&Workload>,
    gateway: &GatewayAddress,
    (bound, target): (Bound, WorkloadKey),
    dst: SocketAddr,
    pick: usize,
) -> Route {
    let fail = |reason, detail: String| {
        Route::Fail(WaypointFailure {
            bound,
            target: target.clone(),
            reason,
            detail,
        })
    };
    let resolved = match resolve(store, &gateway.destination) {
        Ok(r) => r,
        Err(detail) => return fail(FailureReason::Unresolved, detail),
    };
    // The waypoint's own traffic to what it serves must not come back to
    // it (ztunnel's from-waypoint check).
    if source.is_some_and(|source| is_member(&resolved, source)) {
        return Route::Direct;
    }
    // An address on another network is reached only through that
    // network's gateway, never dialled directly: a service's waypoint goes
    // through it (ztunnel), a workload's fails as an unreachable one.
    let local_network = source.map_or("", |s| s.network.as_str());
    let remote = |network: &str, elsewhere: &[&Workload]| {
        let detail = if bound == Bound::Service {
            match super::network_gateway::to_waypoint(
                store,
                trust_domain,
                elsewhere,
                &target,
                &resolved.sans,
                dst,
                pick,
            ) {
                Ok(hop) => return Route::ThroughGateway(Box::new(hop)),
                Err(why) => why,
            }
        } else {
            "a workload's waypoint is not reached through network gateways".into()
        };
        fail(
            FailureReason::OtherNetwork,
            format!(
                "waypoint {} is on network {network}: {detail}",
                resolved.name
            ),
        )
    };
    let healthy: Vec<(IpAddr, &Workload)> = resolved
        .members
        .iter()
        .filter(|(_, _, ready)| *ready)
        .filter_map(|(ip, w, _)| Some((*ip, (*w)?)))
        .filter(|(_, w)| resolved.allow_unhealthy || w.status == WorkloadStatus::Healthy)
        .collect();
    let (healthy, elsewhere): (Vec<_>, Vec<_>) = healthy
        .into_iter()
        .partition(|(_, w)| !other_network(&w.network, local_network));
    let elsewhere: Vec<&Workload> = elsewhere.iter().map(|(_, w)| *w).collect();
    if other_network(resolved.network, local_network) {
        return remote(resolved.network, &elsewhere);
    }
    if let (true, Some(w)) = (healthy.is_empty(), elsewhere.first()) {
        return remote(&w.network, &elsewhere);
    }
    // The client's family first: the HBONE connection leaves from the
    // client pod.
    let same_family: Vec<(IpAddr, &Workload)> = healthy
        .iter()
        .copied()
        .filter(|(ip, _)| ip.is_ipv4() == dst.is_ipv4())
        .collect();
    let candidates = if same_family.is_empty() {
        healthy
    } else {
        same_family
    };
    let Some(&(ip, waypoint)) = weighted_pick(&candidates, |(_, w)| w.capacity, pick) else {
        return fail(
            FailureReason::NoHealthyEndpoint,
            format!("waypoint {} has no healthy endpoint", resolved.name),
        );
    };
    Route::ViaWaypoint(WaypointHop {
        bound,
        target,
        gateway: SocketAddr::new(ip, gateway.hbone_mtls_port),
        authority: dst,
        waypoint: waypoint.key(),
        identity: waypoint.identity(trust_domain),
        also_accept: resolved.sans,
    })
}

/// Whether `workload` is one of the resolved waypoint's endpoints: the
/// workload behind an endpoint (name and network: two networks may reuse
/// both a name and an address), or by address where the endpoint's
/// workload is unknown.
fn is_member(resolved: &Resolved<'_>, workload: &Workload) -> bool {
    resolved.members.iter().any(|(ip, w, _)| match w {
        Some(w) => w.key() == workload.key() && w.network == workload.network,
        None => workload.ips.contains(ip),
    })
}

/// Inbound at an enrolled waypoint: the port of the local workload
/// `waypoint` a CONNECT for `authority` goes to, when `authority` (a
/// service's `VIP:port`, or a workload's `IP:port`) is bound to a waypoint
/// `waypoint` is an endpoint of; `None` otherwise (the CONNECT is refused
/// as any whose authority is not the arrival address). As ztunnel's
/// inbound without an application tunnel: a service port goes to its
/// target port (the port itself when the target port is named), a
/// workload's port as is.
pub fn inbound_port(
    store: &WorkloadStore,
    waypoint: &WorkloadKey,
    authority: SocketAddr,
) -> Option<u16> {
    let waypoint = store.get(waypoint)?;
    let (gateway, port) = match store.service_for(authority, None) {
        Some(service) => {
            let port = service
                .ports
                .iter()
                .find(|p| p.port == authority.port())
                .and_then(|p| p.target_port)
                .unwrap_or(authority.port());
            // The primary only, as ztunnel's inbound checks `svc.waypoint`:
            // a canary of a weighted set is an Envoy that serves 15008
            // itself, never an enrolled pod.
            (service.waypoint.as_ref()?, port)
        }
        None => (
            store.by_ip(authority.ip())?.waypoint.as_ref()?,
            authority.port(),
        ),
    };
    let resolved = resolve(store, &gateway.destination).ok()?;
    is_member(&resolved, waypoint).then_some(port)
}

fn resolve<'a>(
    store: &'a WorkloadStore,
    destination: &'a GatewayDestination,
) -> Result<Resolved<'a>, String> {
    match destination {
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => match find_service(store, namespace, hostname) {
            Some(service) => Ok(members_of(store, service, "")),
            None => Err(format!(
                "waypoint service {namespace}/{hostname} is not known"
            )),
        },
        // An address may be the waypoint service's VIP (ztunnel looks up
        // services and workloads alike) or one waypoint pod.
        GatewayDestination::Address { ip, network } => {
            if let Some(service) = store.services().iter().find(|s| s.vips.contains(ip)) {
                return Ok(members_of(store, service, network));
            }
            match store.by_ip_on(network, *ip) {
                Some(w) => Ok(Resolved {
                    name: format!("{} ({ip})", w.key()),
                    members: vec![(*ip, Some(w), true)],
                    sans: Vec::new(),
                    allow_unhealthy: false,
                    network,
                }),
                None => Err(format!(
                    "waypoint address {ip} is neither a known workload nor a service"
                )),
            }
        }
    }
}

/// The service a waypoint `Hostname` names: by its fully qualified name
/// (`waypoint.ns.svc.cluster.local`, as istiod sends it; the store's
/// hostname index), or by its plain name where the source gives no
/// hostname (the workloads file). Two map lookups at most, whatever the
/// number of services.
fn find_service<'a>(
    store: &'a WorkloadStore,
    namespace: &str,
    hostname: &str,
) -> Option<&'a Service> {
    if let Some(service) = store.services().by_hostname(namespace, hostname) {
        return Some(service);
    }
    let first_label = hostname.split('.').next().unwrap_or(hostname);
    store
        .services()
        .get(&WorkloadKey::new(namespace, first_label))
        .map(|s| s.as_ref())
        .filter(|s| s.hostname.is_empty())
}

fn members_of<'a>(
    store: &'a WorkloadStore,
    service: &'a Service,
    network: &'a str,
) -> Resolved<'a> {
    Resolved {
        name: service.key().to_string(),
        members: service
            .endpoints
            .iter()
            .map(|e| (e.ip, store.by_ip_on(&e.network, e.ip), e.ready))
            .collect(),
        sans: service.san_uris(),
        allow_unhealthy: service.allows_unhealthy(),
        network,
    }
}

// Headers ztunnel sends on every outbound CONNECT.

/// `baggage` (W3C) describing the source workload, as ztunnel writes it:
/// cluster, namespace, the workload's owner as `k8s.<type>.name`
/// (`k8s.deployment.name=ratings-v1`; `k8s.pod.name=<pod>` for a bare pod
/// or a source that names no owner), canonical service name and revision,
/// and its region and zone when it has them (`cloud.region`,
/// `cloud.availability_zone`).
pub fn baggage(source: &Workload) -> String {
    use std::fmt::Write as _;
    let cluster = if source.cluster_id.is_empty() {
        crate::state::DEFAULT_CLUSTER_ID
    } else {
        &source.cluster_id
    };
    let (owner_type, owner_name) = source.owner();
    let (service, version) = source.canonical_service();
    let mut out = format!(
        "k8s.cluster.name={cluster},k8s.namespace.name={},k8s.{owner_type}.name={owner_name},service.name={service},service.version={version}",
        source.namespace
    );
    if let Some(locality) = &source.locality {
        // Writing into a String cannot fail.
        if !locality.region.is_empty() {
            let _ = write!(out, ",cloud.region={}", locality.region);
        }
        if !locality.zone.is_empty() {
            let _ = write!(out, ",cloud.availability_zone={}", locality.zone);
        }
    }
    out
}

/// `forwarded` (RFC 7239) as ztunnel writes it: the original client's
/// address and port, quoted (`for="198.18.1.10:40162"`,
/// `for="[2001:db8::1]:40162"`), and for a connection addressed to a
/// service, `;host=<its hostname>`.
pub fn forwarded(client: SocketAddr, service_host: Option<&str>) -> String {
    let client = SocketAddr::new(client.ip().to_canonical(), client.port());
    match service_host.filter(|h| !h.is_empty()) {
        Some(host) => format!("for=\"{client}\";host={host}"),
        None => format!("for=\"{client}\""),
    }
}

/// A W3C `traceparent` (version 00, flags 00: not sampled, as ztunnel
/// sends it, so a waypoint does not trace every connection) from 24
/// random bytes: 16 for the trace id, 8 for the span id. An all-zero id
/// is invalid in the spec, so one is never produced.
pub fn traceparent(random: [u8; 24]) -> String {
    let (mut trace, mut span) = ([0u8; 16], [0u8; 8]);
    trace.copy_from_slice(&random[..16]);
    span.copy_from_slice(&random[16..]);
    if trace.iter().all(|b| *b == 0) {
        trace[15] = 1;
    }
    if span.iter().all(|b| *b == 0) {
        span[7] = 1;
    }
    let mut out = String::with_capacity(55);
    out.push_str("00-");
    push_hex(&mut out, &trace);
    out.push('-');
    push_hex(&mut out, &span);
    out.push_str("-00");
    out
}

/// Appends `bytes` in lowercase hex (no allocation per byte).
fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

/// Bytes of randomness per `traceparent`.
const TRACE_RANDOM: usize = 24;

/// A block of the system's randomness, taken [`TRACE_RANDOM`] bytes at a
/// time: one `getrandom` call per 42 connections rather than per
/// connection (ztunnel draws its ids from a userspace generator).
const TRACE_RANDOM_BLOCK: usize = 42 * TRACE_RANDOM;

thread_local! {
    /// This thread's block and how much of it is used (all, at first).
    static TRACE_RANDOMNESS: std::cell::RefCell<([u8; TRACE_RANDOM_BLOCK], usize)> =
        const { std::cell::RefCell::new(([0; TRACE_RANDOM_BLOCK], TRACE_RANDOM_BLOCK)) };
}

/// Fresh random bytes for one `traceparent`, never handed out twice;
/// `None` when the system's generator fails.
fn trace_random() -> Option<[u8; TRACE_RANDOM]> {
    use ring::rand::SecureRandom;
    TRACE_RANDOMNESS.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (block, used) = &mut *guard;
        if *used + TRACE_RANDOM > block.len() {
            ring::rand::SystemRandom::new().fill(block).ok()?;
            *used = 0;
        }
        let mut out = [0u8; TRACE_RANDOM];
        out.copy_from_slice(&block[*used..*used + TRACE_RANDOM]);
        *used += TRACE_RANDOM;
        Some(out)
    })
}

/// The headers of one outbound CONNECT: `baggage` (when the source is
/// known), `forwarded` for the client (and the service it addressed, if
/// any), a fresh `traceparent`. A value that is not a valid header (never
/// expected from validated names) is left out, never a panic.
pub fn connect_headers(
    baggage: Option<&str>,
    client: SocketAddr,
    service_host: Option<&str>,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(value) = baggage.and_then(|b| HeaderValue::from_str(b).ok()) {
        headers.insert("baggage", value);
    }
    if let Ok(value) = HeaderValue::from_str(&forwarded(client, service_host)) {
        headers.insert("forwarded", value);
    }
    if let Some(random) = trace_random()
        && let Ok(value) = HeaderValue::from_str(&traceparent(random))
    {
        headers.insert("traceparent", value);
    }
    headers
}

// The failure counter (`shunt_waypoint_failures_total`).

/// Refused waypoint connections by (namespace, name, reason). A mutex, not
/// atomics: the label set is open, and failures are rare.
#[derive(Debug, Default)]
pub(crate) struct WaypointFailures(Mutex<BTreeMap<(WorkloadKey, FailureReason), u64>>);

impl WaypointFailures {
    pub fn count(&self, failure: &WaypointFailure) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((failure.target.clone(), failure.reason))
            .or_default() += 1;
    }

    pub fn snapshot(&self) -> Vec<WaypointFailureCount> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|((key, reason), count)| WaypointFailureCount {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
                reason: reason.as_str().to_owned(),
                count: *count,
            })
            .collect()
    }
}

/// One series of `shunt_waypoint_failures_total`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaypointFailureCount {
    /// The service's (or workload's) namespace and name.
    pub namespace: String,
    pub name: String,
    pub reason: String,
    pub count: u64,
}

#[cfg(test)]
mod tests;
