//! The kernel side of flow 2 of the fast path — same node, mesh to mesh,
//! carried in the kernel (`ebpf/src/mesh_local.rs` explains the datapath):
//! the eligible destinations (`SHUNT_FP_MESH_DESTS`), the sources whose
//! verdicts are compiled (`SHUNT_FP_MESH_SRCS`) and the on/off switch
//! (`SHUNT_FP_MESH_STATE`). Written here only; the reconciler drives it
//! right after it wrote the authorization verdicts, since flow 2 is only
//! as good as they are.
//!
//! Order: the switch goes off before anything that could leave the kernel
//! with a verdict table it cannot trust, and on only after a complete
//! write; sources and destinations are written removals first (a pod that
//! left, or got a waypoint, stops being carried before anything is
//! added). On load both maps are emptied and the switch is off: a previous
//! agent's slots and verdicts are not this agent's.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use shunt_common::{FastPathDest, FastPathState, MeshLocalDest, maps};

use super::{LoadError, fastpath::key_of, load};
use crate::redirect::{MeshLocalTable, MeshLocalWritten};

pub(super) struct MeshLocalMaps {
    dests: BpfHashMap<MapData, FastPathDest, MeshLocalDest>,
    sources: BpfHashMap<MapData, u32, u32>,
    state: Array<MapData, FastPathState>,
    /// What this agent wrote (the base of each diff).
    written_dests: BTreeMap<FastPathDest, MeshLocalDest>,
    written_sources: BTreeSet<u32>,
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
            written_dests: BTreeMap::new(),
            written_sources: BTreeSet::new(),
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
        // Removals first.
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
        for key in gone {
            let _ = self.dests.remove(&key);
            self.written_dests.remove(&key);
        }
    }
}
