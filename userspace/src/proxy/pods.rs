//! A pod's listeners: [`Proxy::add_pod`] binds them inside the pod's
//! netns and starts their accept loops, [`Proxy::remove_pod`] stops them,
//! and the queries of which pods are served.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use shunt_common::{PORT_HBONE, PORT_INBOUND_PLAINTEXT, PORT_OUTBOUND};

use super::{
    PodNet, PodState, Proxy, ProxyError, Shared,
    accept::{Listener, accept_loop},
    dns_sockets, pool, socket,
};
use crate::{
    netns::NsId,
    state::{SpiffeId, TrustDomain, WorkloadKey},
};

/// How the proxy serves a pod ([`Proxy::served`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedPod {
    /// The namespace its listeners were bound in.
    pub netns: NsId,
    /// The identity it is served with (its certificate, and the trust
    /// domain its inbound clients must be of).
    pub identity: SpiffeId,
    /// Whether its DNS proxy runs.
    pub dns: bool,
}

impl Proxy {
    /// Starts serving `pod`: binds 127.0.0.1:15001, 0.0.0.0:15006 and
    /// podIP:15008 inside its netns — and [::1]:15001 and [::]:15006 where
    /// the netns has IPv6 — and registers its identity. Adding a pod that is
    /// already served replaces it (new listeners first, then the old ones
    /// stop).
    pub async fn add_pod(&self, pod: PodNet) -> Result<(), ProxyError> {
        if self.shared.draining.is_cancelled() {
            return Err(ProxyError::Draining);
        }
        if pod.ips.is_empty() {
            return Err(ProxyError::NoIp { pod: pod.key });
        }
        {
            let by_ip = self
                .shared
                .pods_by_ip
                .read()
                .unwrap_or_else(|p| p.into_inner());
            for ip in &pod.ips {
                if let Some(other) = by_ip.get(ip).filter(|o| o.key != pod.key) {
                    return Err(ProxyError::IpTaken {
                        pod: pod.key.clone(),
                        ip: *ip,
                        other: other.key.clone(),
                    });
                }
            }
        }
        // Read before the socket thread enters it: should the path be
        // replaced in between, the id is the older one and the next
        // reconcile serves the pod again (never the other way round).
        let netns = NsId::of_path(&pod.netns).map_err(|e| ProxyError::NetNs {
            pod: pod.key.clone(),
            netns: pod.netns.clone(),
            source: std::io::Error::other(e),
        })?;
        let sockets = socket::PodSockets::start(&pod.netns)
            .await
            .map_err(|source| ProxyError::NetNs {
                pod: pod.key.clone(),
                netns: pod.netns.clone(),
                source,
            })?;
        let spec = |kind, ip: IpAddr, port, transparent| {
            let addr = SocketAddr::new(ip, port);
            (kind, socket::ListenSpec { addr, transparent })
        };
        let mut specs = vec![
            spec(
                Listener::Outbound,
                Ipv4Addr::LOCALHOST.into(),
                PORT_OUTBOUND,
                false,
            ),
            spec(
                Listener::InboundPlaintext,
                Ipv4Addr::UNSPECIFIED.into(),
                PORT_INBOUND_PLAINTEXT,
                true,
            ),
        ];
        let ipv6 = [
            spec(
                Listener::Outbound,
                Ipv6Addr::LOCALHOST.into(),
                PORT_OUTBOUND,
                false,
            ),
            spec(
                Listener::InboundPlaintext,
                Ipv6Addr::UNSPECIFIED.into(),
                PORT_INBOUND_PLAINTEXT,
                true,
            ),
        ];
        for ip in &pod.ips {
            specs.push(spec(Listener::Hbone, *ip, PORT_HBONE, false));
        }
        let mut listeners = Vec::with_capacity(specs.len());
        for (kind, spec) in specs {
            let listener = sockets
                .listen(spec)
                .await
                .map_err(|source| ProxyError::Listen {
                    pod: pod.key.clone(),
                    addr: spec.addr,
                    source,
                })?;
            listeners.push((kind, listener));
        }
        // Native IPv6 connects are redirected to [::1]:15001 (connect6,
        // ip6tables); without these listeners they would be failed closed.
        // A netns without IPv6 (disabled, or no ::1 on lo) has no such
        // traffic to catch.
        for (kind, spec) in ipv6 {
            match sockets.listen(spec).await {
                Ok(listener) => listeners.push((kind, listener)),
                Err(e) if no_ipv6(&e) => {
                    tracing::info!(pod = %pod.key, addr = %spec.addr, error = %e, "no IPv6 in the pod's netns; serving IPv4 only");
                    break;
                }
                Err(source) => {
                    return Err(ProxyError::Listen {
                        pod: pod.key.clone(),
                        addr: spec.addr,
                        source,
                    });
                }
            }
        }

        // Bound before the redirector sends the pod's DNS here; stopped
        // with the pod's listeners.
        let listeners_token = self.shared.draining.child_token();
        if pod.dns {
            dns_sockets::start(
                self.shared.dns.get(),
                &sockets,
                &pod.key,
                listeners_token.clone(),
            )
            .await?;
        }
        self.shared.identities.register(&pod.identity);
        let state = Arc::new(PodState {
            key: pod.key.clone(),
            identity: pod.identity.clone(),
            ips: pod.ips.clone(),
            sockets,
            pool: pool::Pool::new(),
            listeners: listeners_token,
            source_warned: Default::default(),
            dns: pod.dns,
            netns,
        });
        // The pod's shard: its listeners' connections, and the HBONE pool
        // they share, run there (`shards.rs`).
        let shard = self.shared.shards.get().and_then(|s| s.pick());
        for (kind, listener) in listeners {
            let accepting = accept_loop(self.shared.clone(), state.clone(), kind, listener);
            drop(crate::shards::spawn_on(shard.as_ref(), accepting));
        }
        self.shared
            .counters
            .proxies_started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let old = {
            let mut pods = self.shared.pods.write().unwrap_or_else(|p| p.into_inner());
            let mut by_ip = self
                .shared
                .pods_by_ip
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let old = pods.insert(pod.key.clone(), state.clone());
            if let Some(old) = &old {
                for ip in &old.ips {
                    by_ip.remove(ip);
                }
            }
            for ip in &pod.ips {
                by_ip.insert(*ip, state.clone());
            }
            old
        };
        if let Some(old) = old {
            retire(&self.shared, &old);
            if old.netns != netns {
                tracing::info!(pod = %pod.key, netns = %pod.netns.display(), "proxy re-served the pod in its new network namespace; the old namespace's listeners are closed");
            }
        }
        tracing::info!(pod = %pod.key, identity = %pod.identity, ips = ?pod.ips, "proxy serving pod");
        Ok(())
    }

    /// Stops serving the pod: its listeners close; streams in flight finish.
    /// Returns whether the pod was served.
    pub fn remove_pod(&self, key: &WorkloadKey) -> bool {
        let removed = {
            let mut pods = self.shared.pods.write().unwrap_or_else(|p| p.into_inner());
            let mut by_ip = self
                .shared
                .pods_by_ip
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let removed = pods.remove(key);
            if let Some(pod) = &removed {
                for ip in &pod.ips {
                    if by_ip.get(ip).is_some_and(|p| Arc::ptr_eq(p, pod)) {
                        by_ip.remove(ip);
                    }
                }
            }
            removed
        };
        match removed {
            Some(pod) => {
                retire(&self.shared, &pod);
                tracing::info!(pod = %key, "proxy stopped serving pod");
                true
            }
            None => false,
        }
    }

    /// Whether the proxy serves `key`.
    pub fn serves(&self, key: &WorkloadKey) -> bool {
        self.shared
            .pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(key)
    }

    /// How `key` is served: the namespace its sockets live in and whether
    /// with its DNS proxy (`None` when not served).
    pub fn served(&self, key: &WorkloadKey) -> Option<ServedPod> {
        self.shared
            .pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .map(|pod| ServedPod {
                netns: pod.netns,
                identity: pod.identity.clone(),
                dns: pod.dns,
            })
    }

    /// The trust domain the cluster view gives the workload at one of
    /// `ips` named `key` (istiod's per-workload `trust_domain`, as ztunnel
    /// takes it), if the view has one.
    pub fn cluster_trust_domain(&self, key: &WorkloadKey, ips: &[IpAddr]) -> Option<TrustDomain> {
        ips.iter().find_map(|ip| {
            self.shared
                .workloads
                .workload_by_ip(*ip)
                .filter(|w| w.key() == *key)
                .and_then(|w| w.trust_domain.clone())
        })
    }

    /// The pods being served, sorted.
    pub fn pods(&self) -> Vec<WorkloadKey> {
        let mut keys: Vec<_> = self
            .shared
            .pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    }
}

/// Stops a replaced or removed pod's listeners and releases its identity.
fn retire(shared: &Shared, pod: &PodState) {
    pod.listeners.cancel();
    shared.identities.unregister(&pod.identity);
    shared
        .counters
        .proxies_stopped
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The errors binding an IPv6 address gives where the netns (or the
/// kernel) has no IPv6.
pub(super) fn no_ipv6(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT) | Some(libc::EADDRNOTAVAIL)
    )
}
