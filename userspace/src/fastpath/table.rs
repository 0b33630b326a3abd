//! The destination table's one writer: derives from the workload store
//! which destinations the proxy must see and keeps the kernel's table equal
//! to that set (see the module docs of [`super`]).

use std::{
    collections::BTreeSet,
    net::IpAddr,
    sync::{Arc, RwLock},
};

use tokio::sync::watch;
use tracing::{error, info};

use crate::{
    metrics::FastPathMetrics,
    redirect::ebpf::{DestinationTable, ProxyDestinations},
    store::WorkloadStore,
};

/// Every destination the proxy must see, as the proxy's outbound path
/// decides (`proxy/outbound.rs`): the addresses of mesh workloads (any
/// node; those the proxy reaches over HBONE) and of any workload bound to
/// a waypoint (the proxy sends it there, `proxy/waypoint.rs`), every
/// service VIP (the proxy resolves them to an endpoint or their waypoint,
/// mesh or not), and every service's address range (a ServiceEntry's
/// CIDR: a connect into it is that service's), both families. A
/// waypoint-bound destination never goes direct.
///
/// A range is sent to the proxy whole, whatever its ports and even where
/// a workload owns an address in it (the proxy then carries that connect
/// as passthrough, as it would without the fast path): the kernel's table
/// is keyed by address alone, and the proxy's answer is never wrong.
pub fn destinations(store: &WorkloadStore) -> ProxyDestinations {
    let workloads = store
        .iter()
        .filter(|w| w.wants_mesh() || w.waypoint.is_some())
        .flat_map(|w| w.ips.iter().copied());
    let vips = store.services().iter().flat_map(|s| s.vips.iter().copied());
    let addresses: BTreeSet<IpAddr> = workloads.chain(vips).map(|ip| ip.to_canonical()).collect();
    let ranges = store
        .services()
        .iter()
        .flat_map(|s| s.vip_ranges.iter())
        .map(|r| (r.addr, r.prefix))
        .collect();
    ProxyDestinations { addresses, ranges }
}

/// Writes the table after each cluster view the store owner applied
/// (`applied` carries the view's number; 0: none yet, and the table stays
/// off until the first), until `applied` closes.
pub async fn write_table(
    mut table: DestinationTable,
    store: Arc<RwLock<WorkloadStore>>,
    mut applied: watch::Receiver<u64>,
    metrics: FastPathMetrics,
) {
    metrics.table_valid.set(0);
    let mut written: Option<ProxyDestinations> = None;
    loop {
        let view = *applied.borrow_and_update();
        if view > 0 {
            let wanted = {
                let store = store.read().unwrap_or_else(|p| p.into_inner());
                destinations(&store)
            };
            if written.as_ref() != Some(&wanted) || !table.is_valid() {
                match table.sync(&wanted) {
                    Ok(report) => {
                        metrics.table_valid.set(1);
                        metrics.destinations.set(report.entries as i64);
                        metrics.ranges.set(report.ranges as i64);
                        info!(
                            view,
                            destinations = report.entries,
                            ranges = report.ranges,
                            added = report.added,
                            removed = report.removed,
                            "fast-path table written and in use: connects to any other destination go direct"
                        );
                        written = Some(wanted);
                    }
                    Err(e) => {
                        metrics.invalidated(e.reason());
                        error!(view, error = %e, "fast-path table turned off: every connect of an enrolled pod goes through the proxy");
                        written = None;
                    }
                }
            }
        }
        if applied.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{DataplaneMode, Service, Workload};

    fn workload(name: &str, ips: &[&str], mode: DataplaneMode) -> Workload {
        Workload {
            name: name.into(),
            namespace: "default".into(),
            service_account: "sa".into(),
            ips: ips.iter().map(|ip| ip.parse().expect("ip")).collect(),
            node: "other-node".into(),
            dataplane_mode: mode,
            ..Default::default()
        }
    }

    #[test]
    fn the_proxy_must_see_mesh_workloads_and_every_service_vip() {
        let mut store = WorkloadStore::new();
        store.replace_all([
            workload("mesh", &["198.18.2.10", "fd00::10"], DataplaneMode::Ambient),
            workload("plain", &["198.18.2.11"], DataplaneMode::None),
        ]);
        store.replace_services([Service {
            name: "web".into(),
            namespace: "default".into(),
            vips: vec![
                "198.18.100.1".parse().expect("ip"),
                "::ffff:198.18.100.2".parse().expect("ip"),
            ],
            ..Default::default()
        }]);
        let set: Vec<String> = destinations(&store)
            .addresses
            .iter()
            .map(|ip| ip.to_string())
            .collect();
        assert_eq!(
            set,
            ["198.18.2.10", "198.18.100.1", "198.18.100.2", "fd00::10"],
            "mesh workloads (both families) and VIPs, not the plain pod"
        );
    }

    #[test]
    fn a_workload_bound_to_a_waypoint_never_goes_direct() {
        let mut bound = workload("bound", &["198.18.2.12"], DataplaneMode::None);
        bound.waypoint = Some(crate::state::GatewayAddress {
            destination: crate::state::GatewayDestination::Address {
                network: String::new(),
                ip: "198.18.3.10".parse().expect("ip"),
            },
            hbone_mtls_port: 15008,
        });
        let mut store = WorkloadStore::new();
        store.replace_all([bound]);
        let set: Vec<String> = destinations(&store)
            .addresses
            .iter()
            .map(|ip| ip.to_string())
            .collect();
        assert_eq!(set, ["198.18.2.12"]);
    }

    #[test]
    fn every_service_range_goes_to_the_proxy_whole() {
        use crate::state::VipRange;
        let range = |ip: &str, prefix| {
            VipRange::new(ip.parse().expect("ip"), prefix, String::new()).expect("range")
        };
        let mut store = WorkloadStore::new();
        store.replace_services([
            Service {
                name: "egress".into(),
                namespace: "default".into(),
                vips: vec!["198.18.100.3".parse().expect("ip")],
                vip_ranges: vec![range("198.19.7.77", 24), range("fd00:7::1", 64)],
                ..Default::default()
            },
            Service {
                name: "other".into(),
                namespace: "other".into(),
                vip_ranges: vec![range("198.19.7.0", 24), range("10.0.0.0", 0)],
                ..Default::default()
            },
        ]);
        let wanted = destinations(&store);
        let ranges: Vec<String> = wanted
            .ranges
            .iter()
            .map(|(ip, prefix)| format!("{ip}/{prefix}"))
            .collect();
        assert_eq!(
            ranges,
            ["0.0.0.0/0", "198.19.7.0/24", "fd00:7::/64"],
            "each range once, host bits cleared"
        );
        let addresses: Vec<String> = wanted.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(addresses, ["198.18.100.3"], "a ranged service's VIP too");
    }
}
