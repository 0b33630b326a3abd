//! The kernel side of flow 2 of the fast path — same node, mesh to mesh,
//! carried in the kernel (`ebpf/src/mesh_local.rs` explains the datapath):
//! the eligible destinations (`SHUNT_FP_MESH_DESTS`), the sources whose
//! verdicts are compiled (`SHUNT_FP_MESH_SRCS`), the service VIPs whose
//! endpoints all are eligible destinations (`SHUNT_FP_MESH_VIPS`) and the
//! on/off switch (`SHUNT_FP_MESH_STATE`). Written here only; the reconciler drives it
//! right after it wrote the authorization verdicts, since flow 2 is only
//! as good as they are.
//!
//! Order: the switch goes off before anything that could leave the kernel
//! with a verdict table it cannot trust, and on only after a complete
//! write; VIPs, sources and destinations are written removals first (a pod
//! that left, or got a waypoint, stops being carried before anything is
//! added; a VIP goes before the destinations it names). On load the maps
//! are emptied and the switch is off: a previous
//! agent's slots and verdicts are not this agent's.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use shunt_common::{
    FastPathDest, FastPathState, MAX_MESH_SERVICE_ENDPOINTS, MeshLocalDest, MeshService,
    MeshServiceEndpoint, MeshServiceKey, maps,
};

use super::{LoadError, fastpath::key_of, load};
use crate::redirect::{MeshLocalTable, MeshLocalWritten};

pub(super) struct MeshLocalMaps {
    dests: BpfHashMap<MapData, FastPathDest, MeshLocalDest>,
    sources: BpfHashMap<MapData, u32, u32>,
    state: Array<MapData, FastPathState>,
    services: BpfHashMap<MapData, MeshServiceKey, MeshService>,
    /// What this agent wrote (the base of each diff).
    written_dests: BTreeMap<FastPathDest, MeshLocalDest>,
    written_sources: BTreeSet<u32>,
    written_services: BTreeMap<MeshServiceKey, MeshService>,
    generation: u32,
    /// `--fast-path`: off, flow 2 is never turned on.
    enabled: bool,
}

impl MeshLocalMaps {
    /// Takes the maps from the loaded object, empties them, turns flow 2
    /// off.
    pub(super) fn open(ebpf: &mut aya::Ebpf, enabled: bool) -> Result<Self, LoadError> {
        let mut maps_ = Self {
            dests: load::take_map(ebpf, maps::MESH_LOCAL_DESTS)?,
            sources: load::take_map(ebpf, maps::MESH_LOCAL_SOURCES)?,
            state: load::take_map(ebpf, maps::MESH_LOCAL_STATE)?,
            services: load::take_map(ebpf, maps::MESH_LOCAL_SERVICES)?,
            written_dests: BTreeMap::new(),
            written_sources: BTreeSet::new(),
            written_services: BTreeMap::new(),
            generation: 0,
            enabled,
        };
        maps_.off().map_err(|detail| LoadError::Map {
            name: maps::MESH_LOCAL_STATE,
            detail,
        })?;
        let dests: Vec<FastPathDest> = maps_.dests.keys().filter_map(Result::ok).collect();
        for key in &dests {
            let _ = maps_.dests.remove(key);
        }
        let sources: Vec<u32> = maps_.sources.keys().filter_map(Result::ok).collect();
        for slot in &sources {
            let _ = maps_.sources.remove(slot);
        }
        let services: Vec<MeshServiceKey> = maps_.services.keys().filter_map(Result::ok).collect();
        for key in &services {
            let _ = maps_.services.remove(key);
        }
        Ok(maps_)
    }

    /// Turns flow 2 off: every same-node mesh connect goes to the proxy.
    pub(super) fn off(&mut self) -> Result<(), String> {
        self.state
            .set(
                0,
                FastPathState {
                    flags: 0,
                    generation: self.generation,
                },
                0,
            )
            .map_err(|e| format!("{}: {e}", maps::MESH_LOCAL_STATE))
    }

    /// `None`: off. `Some`: makes the maps hold exactly `table`, then on
    /// (with `--fast-path off`, the maps are kept and the switch stays
    /// off). A failed write leaves it off.
    pub(super) fn write(&mut self, table: Option<&MeshLocalTable>) -> MeshLocalWritten {
        let mut report = MeshLocalWritten::default();
        let Some(table) = table.filter(|_| self.enabled) else {
            report.error = self.off().err();
            return report;
        };
        let wanted_dests: BTreeMap<FastPathDest, MeshLocalDest> = table
            .destinations
            .iter()
            .map(|(ip, slot)| {
                (
                    key_of(*ip),
                    MeshLocalDest {
                        slot: *slot,
                        flags: 0,
                    },
                )
            })
            .collect();
        let wanted_services: BTreeMap<MeshServiceKey, MeshService> = table
            .services
            .iter()
            .map(|(vip, endpoints)| service_entry(*vip, endpoints))
            .collect();
        // Removals first: a VIP before the destinations it names.
        let stale_services: Vec<MeshServiceKey> = self
            .written_services
            .keys()
            .filter(|k| !wanted_services.contains_key(*k))
            .copied()
            .collect();
        for key in stale_services {
            if let Err(e) = self.services.remove(&key) {
                return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_SERVICES));
            }
            self.written_services.remove(&key);
        }
        let stale_dests: Vec<FastPathDest> = self
            .written_dests
            .iter()
            .filter(|(k, v)| wanted_dests.get(*k) != Some(*v))
            .map(|(k, _)| *k)
            .collect();
        for key in stale_dests {
            if let Err(e) = self.dests.remove(&key) {
                return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_DESTS));
            }
            self.written_dests.remove(&key);
        }
        let stale_sources: Vec<u32> = self
            .written_sources
            .difference(&table.sources)
            .copied()
            .collect();
        for slot in stale_sources {
            if let Err(e) = self.sources.remove(&slot) {
                return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_SOURCES));
            }
            self.written_sources.remove(&slot);
        }
        for (key, value) in &wanted_dests {
            if self.written_dests.get(key) == Some(value) {
                continue;
            }
            if let Err(e) = self.dests.insert(key, value, 0) {
                return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_DESTS));
            }
            self.written_dests.insert(*key, *value);
        }
        for slot in &table.sources {
            if self.written_sources.contains(slot) {
                continue;
            }
            if let Err(e) = self.sources.insert(slot, 0, 0) {
                return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_SOURCES));
            }
            self.written_sources.insert(*slot);
        }
        // A VIP's endpoints change in place (an element is replaced whole
        // for its readers). One that cannot be written is left out (its
        // connects go to the proxy); only one that cannot be taken out
        // either leaves flow 2 off.
        for (key, value) in &wanted_services {
            if self.written_services.get(key) == Some(value) {
                continue;
            }
            if let Err(e) = self.services.insert(key, value, 0) {
                if let Err(e) = self.services.remove(key)
                    && self.written_services.contains_key(key)
                {
                    return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_SERVICES));
                }
                self.written_services.remove(key);
                report.services_left_out += 1;
                tracing::warn!(error = %e, "a service VIP could not be written for the same-node mesh fast path; its connections go through the proxy");
                continue;
            }
            self.written_services.insert(*key, *value);
        }
        report.services_left_out += table.services_left_out;
        self.generation = self.generation.wrapping_add(1);
        let on = FastPathState {
            flags: FastPathState::VALID,
            generation: self.generation,
        };
        if let Err(e) = self.state.set(0, on, 0) {
            return self.failed(report, format!("{}: {e}", maps::MESH_LOCAL_STATE));
        }
        report.on = true;
        report.destinations = self.written_dests.len();
        report.sources = self.written_sources.len();
        report.services = self.written_services.len();
        report
    }

    fn failed(&mut self, mut report: MeshLocalWritten, error: String) -> MeshLocalWritten {
        let _ = self.off();
        report.error = Some(error);
        report
    }

    /// A pod left its slot: neither a source nor a destination any more
    /// (the slot may be given to another pod before the next write).
    pub(super) fn forget_slot(&mut self, slot: u32) {
        if self.written_sources.remove(&slot) {
            let _ = self.sources.remove(&slot);
        }
        let gone: Vec<FastPathDest> = self
            .written_dests
            .iter()
            .filter(|(_, v)| v.slot == slot)
            .map(|(k, _)| *k)
            .collect();
        // Its VIPs first (connect4 would find the endpoint gone anyway).
        let vips: Vec<MeshServiceKey> = self
            .written_services
            .iter()
            .filter(|(_, v)| {
                v.endpoints
                    .iter()
                    .take(v.count as usize)
                    .any(|e| gone.iter().any(|g| g.addr == e.addr))
            })
            .map(|(k, _)| *k)
            .collect();
        for key in vips {
            let _ = self.services.remove(&key);
            self.written_services.remove(&key);
        }
        for key in gone {
            let _ = self.dests.remove(&key);
            self.written_dests.remove(&key);
        }
    }
}

/// A VIP's entry: its key and its endpoints (at most
/// `MAX_MESH_SERVICE_ENDPOINTS`, as `MeshLocalTable::add_services` keeps
/// them), each address keyed as the destination map keys it.
fn service_entry(
    vip: SocketAddr,
    endpoints: &[(SocketAddr, u32)],
) -> (MeshServiceKey, MeshService) {
    let key = MeshServiceKey {
        addr: key_of(vip.ip()).addr,
        port: u32::from(vip.port()),
    };
    let mut value = MeshService::default();
    for (slot, (to, weight)) in value
        .endpoints
        .iter_mut()
        .zip(endpoints.iter().take(MAX_MESH_SERVICE_ENDPOINTS))
    {
        *slot = MeshServiceEndpoint {
            addr: key_of(to.ip()).addr,
            port: u32::from(to.port()),
            weight: *weight,
        };
        value.count += 1;
        value.total_weight = value.total_weight.saturating_add(*weight);
    }
    (key, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vip_entry_holds_its_endpoints_as_connect4_reads_them() {
        let vip: SocketAddr = "198.19.100.1:80".parse().expect("addr");
        let endpoints = [
            ("198.18.1.10:8080".parse().expect("addr"), 1),
            ("198.18.1.11:9090".parse().expect("addr"), 3),
        ];
        let (key, value) = service_entry(vip, &endpoints);
        // connect4 keys the VIP as `FastPathDest::v4(user_ip4)`, port in
        // host order; it connects to `addr[3]` (network order).
        assert_eq!(
            key.addr,
            FastPathDest::v4(u32::from_ne_bytes([198, 19, 100, 1])).addr
        );
        assert_eq!(key.port, 80);
        assert_eq!((value.count, value.total_weight), (2, 4));
        assert_eq!(
            value.endpoints[1].addr[3],
            u32::from_ne_bytes([198, 18, 1, 11])
        );
        assert_eq!(
            (value.endpoints[1].port, value.endpoints[1].weight),
            (9090, 3)
        );
        assert_eq!(value.endpoints[2], MeshServiceEndpoint::default());
    }
}
