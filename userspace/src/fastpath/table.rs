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

use crate::{metrics::FastPathMetrics, redirect::ebpf::DestinationTable, store::WorkloadStore};

/// Every destination the proxy must see, as the proxy's outbound path
/// decides (`proxy/outbound.rs`): the addresses of mesh workloads (any
/// node; those the proxy reaches over HBONE) and of any workload bound to
/// a waypoint (the proxy sends it there, `proxy/waypoint.rs`), and every
/// service VIP (the proxy resolves them to an endpoint or their waypoint,
/// mesh or not), both families. A waypoint-bound destination never goes
/// direct.
pub fn destinations(store: &WorkloadStore) -> BTreeSet<IpAddr> {
    let workloads = store
        .iter()
        .filter(|w| w.wants_mesh() || w.waypoint.is_some())
        .flat_map(|w| w.ips.iter().copied());
    let vips = store.services().iter().flat_map(|s| s.vips.iter().copied());
    workloads.chain(vips).map(|ip| ip.to_canonical()).collect()
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
    let mut written: Option<BTreeSet<IpAddr>> = None;
    let mut off_for_ranges = false;
    loop {
        let view = *applied.borrow_and_update();
        let wanted = (view > 0).then(|| {
            let store = store.read().unwrap_or_else(|p| p.into_inner());
            // The table holds single addresses: a service reached by a
            // range (a ServiceEntry's CIDR) cannot be listed, and a
            // missing entry would send its connects around the proxy
            // (and its waypoint). Off while any is known.
            (!store.services().has_ranges()).then(|| destinations(&store))
        });
        if let Some(None) = wanted {
            if !off_for_ranges || table.is_valid() {
                written = None;
                match table.invalidate() {
                    Ok(()) => {
                        metrics.invalidated("address_ranges");
                        info!(
                            view,
                            "fast-path table off: a service is addressed by a range (a CIDR), which the kernel's table cannot hold; every connect of an enrolled pod goes through the proxy"
                        );
                        off_for_ranges = true;
                    }
                    Err(e) => error!(view, error = %e, "cannot turn the fast-path table off"),
                }
            }
        } else if let Some(Some(wanted)) = wanted {
            off_for_ranges = false;
            if written.as_ref() != Some(&wanted) || !table.is_valid() {
                match table.sync(&wanted) {
                    Ok(report) => {
                        metrics.table_valid.set(1);
                        metrics.destinations.set(report.entries as i64);
                        info!(
                            view,
                            destinations = report.entries,
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
            .iter()
            .map(|ip| ip.to_string())
            .collect();
        assert_eq!(set, ["198.18.2.12"]);
    }
}
