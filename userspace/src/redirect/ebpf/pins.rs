//! Pinned maps left by another version of shunt. aya adopts whatever is
//! pinned under a map's name without comparing it with the object's
//! definition, and the kernel only notices when a program reads past the
//! end of a value (a verifier log) — a value that shrank would be read
//! wrongly without any error. So before loading, every pin is compared with
//! the layout this agent's programs and userspace use, and a mismatch stops
//! the agent with the map, both layouts and what to do.

use std::path::{Path, PathBuf};

use aya::maps::MapData;
use shunt_common::{
    FastPathDest, FastPathSock, FastPathState, FastPathStats, GlobalConfig, MeshFlow, MeshFlowKey,
    MeshLocalDest, MeshLocalStats, OriginalDst, PodAddrs, PodConfig, PodCounters, PodRecord,
    PodSlot, PolicyDenialKey, PolicyVerdict, PolicyVerdictKey, SockKey, SpliceFlow, SpliceKey,
    maps,
};

/// A pinned map whose key or value size is not what this agent uses.
#[derive(Debug, thiserror::Error)]
#[error(
    "pinned map {path} has {found_key}-byte keys and {found_value}-byte values, this agent's programs use {expected_key} and {expected_value}: it was pinned by another version of shunt. Unenrol the node's pods with that version (or remove {dir} and restart, which leaves the pods unredirected until this agent enrols them again)"
)]
pub struct IncompatiblePin {
    pub path: PathBuf,
    pub dir: PathBuf,
    pub found_key: u32,
    pub found_value: u32,
    pub expected_key: u32,
    pub expected_value: u32,
}

/// Key and value sizes of each map this agent pins, as its programs define
/// them (`ebpf/src/maps.rs`).
fn layout(name: &str) -> Option<(usize, usize)> {
    use core::mem::size_of;
    Some(match name {
        maps::ENROLLED => (size_of::<u64>(), size_of::<PodSlot>()),
        maps::POD_COUNTERS => (size_of::<u32>(), size_of::<PodCounters>()),
        maps::POD_CONFIG => (size_of::<u32>(), size_of::<PodConfig>()),
        maps::CONFIG => (size_of::<u32>(), size_of::<GlobalConfig>()),
        maps::POD_ADDRS => (size_of::<u32>(), size_of::<PodAddrs>()),
        maps::ORIGINAL_DST_BY_COOKIE => (size_of::<u64>(), size_of::<OriginalDst>()),
        maps::ORIGINAL_DST => (size_of::<SockKey>(), size_of::<OriginalDst>()),
        maps::POD_RECORDS => (size_of::<u64>(), size_of::<PodRecord>()),
        // The value is the socket, as the kernel takes it from userspace.
        maps::SPLICE_SOCKS => (size_of::<SpliceKey>(), size_of::<u32>()),
        maps::SPLICE_FLOWS => (size_of::<SpliceKey>(), size_of::<SpliceFlow>()),
        maps::SPLICE_KEYS => (size_of::<u64>(), size_of::<SpliceKey>()),
        maps::POLICY_VERDICTS => (size_of::<PolicyVerdictKey>(), size_of::<PolicyVerdict>()),
        maps::POLICY_DENIALS => (size_of::<PolicyDenialKey>(), size_of::<u64>()),
        maps::FAST_PATH_DESTS => (size_of::<FastPathDest>(), size_of::<u32>()),
        maps::FAST_PATH_STATE => (size_of::<u32>(), size_of::<FastPathState>()),
        maps::FAST_PATH_SOCKS => (size_of::<u64>(), size_of::<FastPathSock>()),
        // A ring buffer has neither keys nor values.
        maps::FAST_PATH_EVENTS => (0, 0),
        maps::FAST_PATH_STATS => (size_of::<u32>(), size_of::<FastPathStats>()),
        maps::MESH_LOCAL_DESTS => (size_of::<FastPathDest>(), size_of::<MeshLocalDest>()),
        maps::MESH_LOCAL_SOURCES => (size_of::<u32>(), size_of::<u32>()),
        maps::MESH_LOCAL_STATE => (size_of::<u32>(), size_of::<FastPathState>()),
        maps::MESH_LOCAL_FLOWS => (size_of::<MeshFlowKey>(), size_of::<MeshFlow>()),
        maps::MESH_LOCAL_STATS => (size_of::<u32>(), size_of::<MeshLocalStats>()),
        maps::DNS_SERVERS => (size_of::<u64>(), size_of::<OriginalDst>()),
        _ => return None,
    })
}

/// Compares every pinned map under `pin_dir` with [`layout`]. Maps not
/// pinned yet are fine (they are created); a pin that cannot be opened is
/// left to the loader, which reports it.
pub fn check(pin_dir: &Path) -> Result<(), Box<IncompatiblePin>> {
    for name in maps::ALL {
        let path = pin_dir.join(name);
        let Some((key, value)) = layout(name) else {
            continue;
        };
        let Ok(info) = MapData::from_pin(&path).and_then(|map| map.info()) else {
            continue;
        };
        let (expected_key, expected_value) = (key as u32, value as u32);
        if info.key_size() != expected_key || info.value_size() != expected_value {
            return Err(Box::new(IncompatiblePin {
                path,
                dir: pin_dir.to_path_buf(),
                found_key: info.key_size(),
                found_value: info.value_size(),
                expected_key,
                expected_value,
            }));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pinned_map_has_a_layout() {
        for name in maps::ALL {
            assert!(layout(name).is_some(), "{name} has no layout to check");
        }
    }
}
