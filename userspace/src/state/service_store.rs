//! [`ServiceStore`]: every known service, indexed for the proxy's lookups,
//! kept current one service at a time ([`ServiceStore::upsert`],
//! [`ServiceStore::remove`]) or replaced whole.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::SocketAddr,
    sync::Arc,
};

use super::{Service, WorkloadKey};

/// Every known service, by id, by name, by `VIP:port` and by hostname.
///
/// Owned by the `WorkloadStore` (`store.rs`): one owner for what discovery knows.
/// Services are identified as xDS names them, by namespace/hostname (one
/// ServiceEntry with two hosts is two services of one name), or by
/// namespace/name when the source gives no hostname ([`Service::id`]).
/// Services are behind `Arc` so that a lookup per connection is a clone of a
/// pointer, not of an endpoint list.
#[derive(Clone, Debug, Default)]
pub struct ServiceStore {
    by_id: BTreeMap<WorkloadKey, Arc<Service>>,
    /// namespace/name → ids (a headless service's pods are published by
    /// its name).
    by_name: HashMap<WorkloadKey, Vec<WorkloadKey>>,
    /// `VIP:port` → every service claiming it, ids ascending (ServiceEntries
    /// of two namespaces may share an address).
    by_addr: HashMap<SocketAddr, Vec<WorkloadKey>>,
    /// hostname → namespace → service, for services that have a hostname
    /// (how waypoints are named). Nested so a lookup borrows its `&str`s.
    by_hostname: HashMap<String, HashMap<String, WorkloadKey>>,
    /// The services that have address ranges (few: ServiceEntries with a
    /// CIDR), so a range lookup scans only them.
    ranged: BTreeSet<WorkloadKey>,
}

impl ServiceStore {
    /// Makes `services` the whole content (a full resync). Returns whether
    /// anything changed.
    ///
    /// As with workload IPs, a `VIP:port` claimed by two services (a brief
    /// state of a watch) stays with the greater id, with a warning, so a
    /// lookup is the same whatever the order of a relist.
    pub fn replace_all<S: Into<Arc<Service>>>(
        &mut self,
        services: impl IntoIterator<Item = S>,
    ) -> bool {
        let next = Self::from_services(services);
        if self.same_as(&next) {
            return false;
        }
        *self = next;
        true
    }

    /// Whether `other` holds the same services (shared entries compare by
    /// pointer first).
    pub fn same_as(&self, other: &ServiceStore) -> bool {
        self.by_id.len() == other.by_id.len()
            && self
                .by_id
                .iter()
                .zip(&other.by_id)
                .all(|((a, x), (b, y))| a == b && (Arc::ptr_eq(x, y) || x == y))
    }

    /// A store holding `services`, indexed. Built apart from the store it
    /// replaces, so its owner can build it without holding a lock.
    pub fn from_services<S: Into<Arc<Service>>>(services: impl IntoIterator<Item = S>) -> Self {
        let mut next = BTreeMap::new();
        for s in services {
            let s: Arc<Service> = s.into();
            if let Some(old) = next.insert(s.id(), s) {
                tracing::warn!(service = %old.id(), "service listed twice; keeping the last");
            }
        }
        let mut by_addr: HashMap<SocketAddr, Vec<WorkloadKey>> = HashMap::new();
        let mut by_name: HashMap<WorkloadKey, Vec<WorkloadKey>> = HashMap::new();
        // In id order: each claimant list comes out ascending.
        for (id, s) in &next {
            by_name.entry(s.key()).or_default().push(id.clone());
            for addr in addrs(s) {
                by_addr.entry(addr).or_default().push(id.clone());
            }
        }
        // One entry per namespace and hostname: that is the id.
        let mut by_hostname: HashMap<String, HashMap<String, WorkloadKey>> = HashMap::new();
        for (id, s) in next.iter().filter(|(_, s)| !s.hostname.is_empty()) {
            by_hostname
                .entry(s.hostname.clone())
                .or_default()
                .insert(s.namespace.clone(), id.clone());
        }
        let ranged = next
            .iter()
            .filter(|(_, s)| !s.vip_ranges.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        Self {
            by_id: next,
            by_name,
            by_addr,
            by_hostname,
            ranged,
        }
    }

    /// Adds or replaces the service stored under its [`Service::id`], the
    /// indexes touched only where its names or addresses moved. Returns
    /// whether anything changed.
    pub fn upsert(&mut self, service: Arc<Service>) -> bool {
        let id = service.id();
        if let Some(old) = self.by_id.get(&id) {
            if Arc::ptr_eq(old, &service) || **old == *service {
                return false;
            }
            if indexed_alike(old, &service) {
                // Endpoints or settings changed: one pointer to swap.
                self.by_id.insert(id, service);
                return true;
            }
            self.remove(&id);
        }
        self.index(&id, &service);
        self.by_id.insert(id, service);
        true
    }

    /// Removes the service stored under `id`; a `VIP:port` it held goes to
    /// the next claimant, as [`ServiceStore::from_services`] would give it.
    pub fn remove(&mut self, id: &WorkloadKey) -> Option<Arc<Service>> {
        let old = self.by_id.remove(id)?;
        self.ranged.remove(id);
        let key = old.key();
        if let Some(ids) = self.by_name.get_mut(&key) {
            ids.retain(|other| other != id);
            if ids.is_empty() {
                self.by_name.remove(&key);
            }
        }
        for addr in addrs(&old) {
            if let Some(ids) = self.by_addr.get_mut(&addr) {
                ids.retain(|other| other != id);
                if ids.is_empty() {
                    self.by_addr.remove(&addr);
                }
            }
        }
        if let Some(in_namespaces) = self.by_hostname.get_mut(&old.hostname)
            && in_namespaces.get(&old.namespace) == Some(id)
        {
            in_namespaces.remove(&old.namespace);
            if in_namespaces.is_empty() {
                self.by_hostname.remove(&old.hostname);
            }
        }
        Some(old)
    }

    /// Adds `service`'s names and addresses to the indexes (not to `by_id`).
    fn index(&mut self, id: &WorkloadKey, service: &Service) {
        if !service.vip_ranges.is_empty() {
            self.ranged.insert(id.clone());
        }
        let names = self.by_name.entry(service.key()).or_default();
        if !names.contains(id) {
            names.push(id.clone());
        }
        for addr in addrs(service) {
            let ids = self.by_addr.entry(addr).or_default();
            if let Err(at) = ids.binary_search(id) {
                ids.insert(at, id.clone());
            }
        }
        if !service.hostname.is_empty() {
            self.by_hostname
                .entry(service.hostname.clone())
                .or_default()
                .insert(service.namespace.clone(), id.clone());
        }
    }

    /// The service named `hostname` in `namespace` (one map lookup).
    pub fn by_hostname(&self, namespace: &str, hostname: &str) -> Option<&Arc<Service>> {
        self.by_hostname
            .get(hostname)
            .and_then(|in_namespaces| in_namespaces.get(namespace))
            .and_then(|id| self.by_id.get(id))
    }

    /// The service whose VIP and port `dst` is.
    pub fn by_addr(&self, dst: SocketAddr) -> Option<&Arc<Service>> {
        self.by_addr
            .get(&dst)
            .and_then(|ids| ids.last())
            .and_then(|id| self.by_id.get(id))
    }

    /// [`ServiceStore::by_addr`] as a client in namespace `client_ns` finds
    /// it, as ztunnel chooses among services sharing an address: only
    /// those visible to it, then one of its own namespace, then the one
    /// istiod marks `canonical`, then the greatest id. `None` namespace: no
    /// visibility filter (an inbound lookup).
    pub fn by_addr_from(&self, dst: SocketAddr, client_ns: Option<&str>) -> Option<&Arc<Service>> {
        let ids = self.by_addr.get(&dst)?;
        if let [only] = ids.as_slice() {
            // The common case: one service, no ranking.
            return self
                .by_id
                .get(only)
                .filter(|s| client_ns.is_none_or(|ns| s.visible_to(ns)));
        }
        ids.iter()
            .filter_map(|id| self.by_id.get(id).map(|s| (id, s)))
            .filter(|(_, s)| client_ns.is_none_or(|ns| s.visible_to(ns)))
            .max_by_key(|(id, s)| (Some(s.namespace.as_str()) == client_ns, s.canonical, *id))
            .map(|(_, s)| s)
    }

    /// The service whose address range holds `dst`'s address and that
    /// serves its port, for a destination no workload owns and no VIP
    /// names ([`ServiceStore::by_addr_from`] first), as ztunnel ranks
    /// them: visible to the client, then of its namespace, the longest
    /// prefix, the one istiod marks `canonical`, the greatest id.
    pub fn by_range(&self, dst: SocketAddr, client_ns: Option<&str>) -> Option<&Arc<Service>> {
        self.ranged
            .iter()
            .filter_map(|id| self.by_id.get(id).map(|s| (id, s)))
            .filter(|(_, s)| s.ports.iter().any(|p| p.port == dst.port()))
            .filter(|(_, s)| client_ns.is_none_or(|ns| s.visible_to(ns)))
            .filter_map(|(id, s)| {
                let longest = s
                    .vip_ranges
                    .iter()
                    .filter(|r| r.contains(dst.ip()))
                    .map(|r| r.prefix)
                    .max()?;
                let own = Some(s.namespace.as_str()) == client_ns;
                Some(((own, longest, s.canonical, id), s))
            })
            .max_by(|(a, _), (b, _)| a.cmp(b))
            .map(|(_, s)| s)
    }

    /// Whether any service has an address range.
    pub fn has_ranges(&self) -> bool {
        !self.ranged.is_empty()
    }

    /// A service named `key` (namespace/name); of several of one name (a
    /// ServiceEntry's hosts), the one with the greatest id.
    pub fn get(&self, key: &WorkloadKey) -> Option<&Arc<Service>> {
        self.by_name
            .get(key)
            .and_then(|ids| ids.iter().max())
            .and_then(|id| self.by_id.get(id))
    }

    /// The service stored under `id` ([`Service::id`]).
    pub fn by_id(&self, id: &WorkloadKey) -> Option<&Arc<Service>> {
        self.by_id.get(id)
    }

    /// All services, in id order.
    pub fn iter(&self) -> impl Iterator<Item = &Service> {
        self.by_id.values().map(Arc::as_ref)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// Every `VIP:port` a service answers on.
fn addrs(service: &Service) -> impl Iterator<Item = SocketAddr> + '_ {
    service.vips.iter().flat_map(move |vip| {
        service
            .ports
            .iter()
            .map(move |port| SocketAddr::new(*vip, port.port))
    })
}

/// Whether two copies of a service sit in the same index entries (only
/// their endpoints or settings differ).
fn indexed_alike(a: &Service, b: &Service) -> bool {
    a.key() == b.key()
        && a.hostname == b.hostname
        && a.vips == b.vips
        && a.vip_ranges.is_empty() == b.vip_ranges.is_empty()
        && a.ports.len() == b.ports.len()
        && a.ports.iter().zip(&b.ports).all(|(x, y)| x.port == y.port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Endpoint, ServicePort};

    fn service(ns: &str, host: &str, vip: &str, port: u16) -> Arc<Service> {
        Arc::new(Service {
            name: host.split('.').next().unwrap_or(host).into(),
            namespace: ns.into(),
            hostname: host.into(),
            vips: vec![vip.parse().expect("test IP")],
            ports: vec![ServicePort {
                port,
                target_port: Some(8080),
            }],
            ..Default::default()
        })
    }

    /// Every lookup the proxy makes, for comparing two stores.
    fn lookups(store: &ServiceStore, probes: &[(&str, &str, &str)]) -> Vec<String> {
        let mut out = Vec::new();
        for (ns, host, addr) in probes {
            let by_addr = store
                .by_addr(addr.parse().expect("test address"))
                .map(|s| s.id().to_string());
            let by_host = store.by_hostname(ns, host).map(|s| s.id().to_string());
            let name = host.split('.').next().unwrap_or(host);
            let by_name = store
                .get(&WorkloadKey::new(*ns, name))
                .map(|s| s.id().to_string());
            out.push(format!("{addr}: {by_addr:?} {by_host:?} {by_name:?}"));
        }
        out.push(format!("{} services", store.len()));
        out
    }

    #[test]
    fn one_service_at_a_time_ends_as_a_whole_rebuild_would() {
        let a = service("ns", "a.ext.example.com", "198.19.0.1", 80);
        // Another host of the same ServiceEntry name, on the same VIP:port.
        let b = service("ns", "a.other.example.com", "198.19.0.1", 80);
        let c = service("ns", "c.ns.svc.cluster.local", "198.19.0.3", 443);
        let mut c_moved = Service::clone(&c);
        c_moved.vips = vec!["198.19.0.4".parse().expect("test IP")];
        let c_moved = Arc::new(c_moved);
        let mut a_with_endpoint = Service::clone(&a);
        a_with_endpoint.endpoints = vec![Endpoint::new("198.18.0.9".parse().expect("ip"), None)];
        let a_with_endpoint = Arc::new(a_with_endpoint);

        let probes = [
            ("ns", "a.ext.example.com", "198.19.0.1:80"),
            ("ns", "a.other.example.com", "198.19.0.1:80"),
            ("ns", "c.ns.svc.cluster.local", "198.19.0.3:443"),
            ("ns", "c.ns.svc.cluster.local", "198.19.0.4:443"),
        ];
        let mut store = ServiceStore::default();
        assert!(store.upsert(b.clone()));
        assert!(store.upsert(a.clone()));
        assert!(store.upsert(c.clone()));
        assert!(
            !store.upsert(c.clone()),
            "the same service again changes nothing"
        );
        assert_eq!(
            lookups(&store, &probes),
            lookups(
                &ServiceStore::from_services([a.clone(), b.clone(), c.clone()]),
                &probes
            )
        );
        assert!(store.upsert(a_with_endpoint.clone()));
        assert_eq!(
            store
                .by_hostname("ns", "a.ext.example.com")
                .map(|s| s.endpoints.len()),
            Some(1)
        );
        assert!(store.upsert(c_moved.clone()), "a VIP moved");
        assert!(store.remove(&b.id()).is_some());
        assert_eq!(
            lookups(&store, &probes),
            lookups(
                &ServiceStore::from_services([a_with_endpoint.clone(), c_moved.clone()]),
                &probes
            )
        );
        // The VIP:port b held goes back to a; c's old VIP is gone.
        assert_eq!(
            store
                .by_addr("198.19.0.1:80".parse().expect("addr"))
                .map(|s| s.id()),
            Some(a.id())
        );
        assert!(
            store
                .by_addr("198.19.0.3:443".parse().expect("addr"))
                .is_none()
        );
        assert!(store.remove(&a.id()).is_some());
        assert!(store.remove(&c.id()).is_some());
        assert!(store.is_empty());
        assert_eq!(
            lookups(&store, &probes),
            lookups(&ServiceStore::default(), &probes)
        );
    }
}
