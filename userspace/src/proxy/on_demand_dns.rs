//! Outbound to a service endpoint istiod names by DNS name (a
//! `resolution: DNS` ServiceEntry's): the name is resolved by the agent's
//! resolver (`dns/on_demand.rs`) when the connection picks it, counted as
//! ztunnel counts it (`istio_on_demand_dns_total`), and the connection
//! goes to an address of the dialled family at the endpoint's port.

use std::net::SocketAddr;

use crate::state::HostnameTarget;

use super::{AccessLog, PodState, Shared};

/// Where the connection `dialled` (a service VIP and port) goes for the
/// hostname endpoint `target`, or `None` when its name does not resolve
/// (the log says why; the caller refuses the connection).
pub(super) async fn resolve(
    shared: &Shared,
    pod: &PodState,
    target: &HostnameTarget,
    dialled: SocketAddr,
    log: &mut AccessLog<'_>,
) -> Option<SocketAddr> {
    // The connection's destination is the workload, not whoever owns the
    // address (metrics labels and the access line name it, as ztunnel's).
    log.dst_workload = Some(target.workload.clone());
    // Counted before the lookup, as ztunnel counts it: a lookup that fails
    // was still asked for.
    if let Some(observer) = shared.observer.get() {
        observer.resolved_on_demand(&pod.key, pod.identity.as_str(), &target.hostname);
    }
    let resolved = match shared.dns.get() {
        Some(dns) => dns
            .on_demand
            .resolve(&target.hostname, dialled)
            .await
            .map_err(|e| e.to_string()),
        None => Err(format!("cannot resolve {}: no resolver", target.hostname)),
    };
    match resolved {
        Ok(ip) => {
            let to = SocketAddr::new(ip, target.port);
            tracing::debug!(hostname = %target.hostname, workload = %target.workload, %to, "hostname endpoint resolved");
            Some(to)
        }
        Err(why) => {
            tracing::warn!(workload = %target.workload, vip = %dialled, "service endpoint {why}; connection refused");
            log.dst_addr = dialled;
            log.early = true;
            log.reason = Some(why);
            None
        }
    }
}
