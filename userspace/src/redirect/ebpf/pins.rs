//! Pinned maps left by another release. aya adopts whatever is pinned
//! under a map's name without comparing it with the object's definition,
//! and the kernel only notices when a program reads past the end of a value
//! (a verifier log) — a value that shrank would be read wrongly without any
//! error, a map that grew in a new release would silently keep the old
//! bound. So before loading, every pin is compared with this release's
//! definition of the map (type, key and value sizes, `max_entries`, flags,
//! read from the embedded object):
//!
//! - equal: the pin is reused as it is;
//! - same type, key and value sizes, other `max_entries` or flags: the map
//!   is **migrated** — the old pin is removed (its fd kept), the loader
//!   creates and pins the new map, and every entry is copied over
//!   ([`Migration::complete`]; entries beyond a smaller new bound are
//!   counted as dropped);
//! - another key or value size: the map is **recreated** empty, but only
//!   where nothing is lost that matters: the agent rebuilds the entries from
//!   its own state (enrolment, tables, policy), or the map holds
//!   kernel-written records or counters that start over ([`on_new_layout`]
//!   says which, per map); `SHUNT_ENROLLED` and `SHUNT_POD_RECORDS`, on which
//!   adoption rests, cannot be, and an agent refuses to start on them;
//! - another map type: refused.
//!
//! Nothing is touched until every map's plan is known (no half-applied
//! migration on a refusal). Programs still attached that use an old map
//! are replaced by the upgrade (`upgrade.rs`), whatever their tag, since
//! the kernel's tag leaves map references out.

use std::{
    collections::HashMap,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    maps::{MapData, MapType},
    util::nr_cpus,
};
use serde::Serialize;
use shunt_common::maps;
use tracing::{info, warn};

use super::{LoadError, sys};

/// A pinned map this release cannot migrate.
#[derive(Debug, thiserror::Error)]
#[error(
    "pinned map {path} cannot be migrated to this release's definition ({differs}): {why}. Unenrol the node's pods with the release that pinned it (or remove {dir} and restart, which leaves the pods unredirected until this agent enrols them again)"
)]
pub struct IncompatiblePin {
    pub path: PathBuf,
    pub dir: PathBuf,
    /// What differs, pinned → this release.
    pub differs: String,
    pub why: &'static str,
}

/// A map's definition: as pinned, or as this release's object defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Definition {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    flags: u32,
}

impl Definition {
    /// What differs from `new`, e.g. `max_entries 2048 → 4096`.
    fn differences(&self, new: &Definition) -> String {
        let mut out = Vec::new();
        if self.map_type != new.map_type {
            out.push(format!(
                "type {} → {}",
                type_name(self.map_type),
                type_name(new.map_type)
            ));
        }
        for (what, old, new) in [
            ("key size", self.key_size, new.key_size),
            ("value size", self.value_size, new.value_size),
            ("max_entries", self.max_entries, new.max_entries),
            ("flags", self.flags, new.flags),
        ] {
            if old != new {
                out.push(format!("{what} {old} → {new}"));
            }
        }
        out.join(", ")
    }
}

fn map_type(raw: u32) -> Option<MapType> {
    let generated = aya_obj::generated::bpf_map_type::try_from(raw).ok()?;
    MapType::try_from(generated).ok()
}

fn type_name(raw: u32) -> String {
    map_type(raw).map_or_else(|| format!("type {raw}"), |t| format!("{t:?}"))
}

/// What becomes of a map's entries in a new layout (other key or value
/// size), or `None` if the map cannot be recreated without breaking the
/// adoption of the node's pods.
pub fn on_new_layout(name: &str) -> Option<&'static str> {
    Some(match name {
        maps::ENROLLED | maps::POD_RECORDS => return None,
        maps::POD_CONFIG | maps::POD_ADDRS => {
            "rewritten from the agent's state as each listed pod is enrolled"
        }
        maps::CONFIG | maps::HOST_PROBE_NODE => "written by the agent at load",
        maps::PROBE_TARGETS => "rewritten from the agent's state as each listed pod is enrolled",
        maps::POLICY_VERDICTS
        | maps::FAST_PATH_DESTS
        | maps::FAST_PATH_RANGES
        | maps::FAST_PATH_STATE
        | maps::MESH_LOCAL_DESTS
        | maps::MESH_LOCAL_SOURCES
        | maps::MESH_LOCAL_STATE
        | maps::MESH_LOCAL_SERVICES => "rebuilt by the reconciler from its tables and policies",
        maps::POD_COUNTERS
        | maps::POLICY_DENIALS
        | maps::FAST_PATH_STATS
        | maps::MESH_LOCAL_STATS
        | maps::HOST_PROBE_STATS => "kernel counters: they start again at zero",
        _ => "kernel-written records: lost (connections in flight lose theirs)",
    })
}

/// What the upgrade did with one pinned map (`/debug/bpf`'s `upgrade`).
#[derive(Clone, Debug, Serialize)]
pub struct MapChange {
    pub map: String,
    /// `reused`, `migrated` (entries copied) or `recreated` (empty).
    pub action: &'static str,
    /// Pinned → this release, e.g. `max_entries 2048 → 4096`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub differs: Option<String>,
    pub copied: u64,
    pub dropped: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
}

/// A map being migrated: the old map (its pin removed, its fd held until
/// its entries are copied).
pub struct Migration {
    name: &'static str,
    path: PathBuf,
    old: MapData,
    old_definition: Definition,
    differs: String,
    /// `None`: entries copied; else why they are not.
    not_copied: Option<&'static str>,
}

/// This release's definitions of the pinned maps, from `object`.
fn definitions(object: &[u8]) -> Result<HashMap<String, Definition>, LoadError> {
    let parsed = aya_obj::Object::parse(object).map_err(|e| LoadError::Map {
        name: "(object)",
        detail: format!("parsing the embedded eBPF object: {e}"),
    })?;
    Ok(parsed
        .maps
        .iter()
        .map(|(name, map)| {
            let ring =
                map.map_type() == aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32;
            let definition = Definition {
                map_type: map.map_type(),
                // A ring buffer has neither keys nor values (aya creates
                // it with both at 0, whatever the object says).
                key_size: if ring { 0 } else { map.key_size() },
                value_size: if ring { 0 } else { map.value_size() },
                max_entries: map.max_entries(),
                flags: map.map_flags(),
            };
            (name.clone(), definition)
        })
        .collect())
}

/// Compares every pinned map with this release's definition in `object`,
/// then removes the pins of those to migrate (so that the loader creates
/// them anew). Returns the maps reused as they are, and the migrations to
/// [`Migration::complete`] once the object is loaded. Nothing is unpinned
/// unless every map can be kept or migrated.
pub fn prepare(
    pin_dir: &Path,
    object: &[u8],
) -> Result<(Vec<MapChange>, Vec<Migration>), LoadError> {
    let wanted = definitions(object)?;
    let mut reused = Vec::new();
    let mut migrations = Vec::new();
    for name in maps::ALL {
        let path = pin_dir.join(name);
        // Not pinned yet: created. A pin that cannot be opened is left to
        // the loader, which reports it.
        let Ok(old) = MapData::from_pin(&path) else {
            continue;
        };
        let Ok(info) = old.info() else {
            continue;
        };
        let Some(&new) = wanted.get(name) else {
            return Err(LoadError::Map {
                name,
                detail: "missing from the object".into(),
            });
        };
        let pinned = Definition {
            map_type: info.map_type().map_or(u32::MAX, |t| t as u32),
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
            flags: info.map_flags(),
        };
        if pinned == new {
            reused.push(MapChange {
                map: name.to_string(),
                action: "reused",
                differs: None,
                copied: 0,
                dropped: 0,
                note: None,
            });
            continue;
        }
        let differs = pinned.differences(&new);
        let refuse = |why| {
            LoadError::IncompatiblePin(Box::new(IncompatiblePin {
                path: path.clone(),
                dir: pin_dir.to_path_buf(),
                differs: differs.clone(),
                why,
            }))
        };
        if pinned.map_type != new.map_type {
            return Err(refuse("a map's type never changes under its name"));
        }
        let not_copied = if pinned.key_size != new.key_size || pinned.value_size != new.value_size {
            Some(on_new_layout(name).ok_or_else(|| {
                refuse("the node's enrolments live in it and a new layout cannot be filled from the old")
            })?)
        } else if copyable(pinned.map_type) {
            None
        } else {
            Some("holds kernel objects, which cannot be copied: its entries are lost")
        };
        migrations.push(Migration {
            name,
            path,
            old,
            old_definition: pinned,
            differs,
            not_copied,
        });
    }
    for migration in &migrations {
        std::fs::remove_file(&migration.path).map_err(|e| LoadError::Map {
            name: migration.name,
            detail: format!(
                "removing the old pin {} to migrate it: {e}",
                migration.path.display()
            ),
        })?;
    }
    Ok((reused, migrations))
}

/// Whether entries of this map type can be copied from userspace.
fn copyable(raw: u32) -> bool {
    matches!(
        map_type(raw),
        Some(
            MapType::Hash
                | MapType::Array
                | MapType::LruHash
                | MapType::PerCpuHash
                | MapType::PerCpuArray
                | MapType::LruPerCpuHash
        )
    )
}

fn per_cpu(raw: u32) -> bool {
    matches!(
        map_type(raw),
        Some(MapType::PerCpuHash | MapType::PerCpuArray | MapType::LruPerCpuHash)
    )
}

impl Migration {
    /// Copies the old map's entries into the new one the loader pinned in
    /// its place (now that the object is loaded) and reports it. The old
    /// map lives on only as long as programs still attached use it.
    pub fn complete(self) -> Result<MapChange, LoadError> {
        let Migration {
            name,
            path,
            old,
            old_definition,
            differs,
            not_copied,
        } = self;
        let (mut copied, mut dropped) = (0, 0);
        if not_copied.is_none() {
            let new = MapData::from_pin(&path).map_err(|e| LoadError::Map {
                name,
                detail: format!("opening the migrated map at {}: {e}", path.display()),
            })?;
            (copied, dropped) =
                copy_entries(&old, &new, &old_definition).map_err(|e| LoadError::Map {
                    name,
                    detail: format!("copying its entries into the new map: {e}"),
                })?;
            info!(map = name, %differs, copied, dropped, "pinned map migrated to this release's definition; entries copied");
        } else if let Some(note) = not_copied {
            warn!(map = name, %differs, what_becomes_of_the_entries = note, "pinned map recreated in this release's layout");
        }
        Ok(MapChange {
            map: name.to_string(),
            action: if not_copied.is_none() {
                "migrated"
            } else {
                "recreated"
            },
            differs: Some(differs),
            copied,
            dropped,
            note: not_copied,
        })
    }
}

/// Copies every entry of `old` into `new` (same key and value sizes): the
/// number copied, and the number the new map refused (a smaller bound).
fn copy_entries(
    old: &MapData,
    new: &MapData,
    definition: &Definition,
) -> std::io::Result<(u64, u64)> {
    let (old, new) = (old.fd().as_fd(), new.fd().as_fd());
    let value_len = if per_cpu(definition.map_type) {
        // One value per possible CPU, each 8-byte aligned.
        let cpus = nr_cpus().map_err(|(_, e)| e)? as usize;
        (definition.value_size as usize).next_multiple_of(8) * cpus
    } else {
        definition.value_size as usize
    };
    let key_len = definition.key_size as usize;
    let mut key = vec![0u8; key_len];
    let mut next = vec![0u8; key_len];
    let mut value = vec![0u8; value_len];
    let (mut copied, mut dropped) = (0, 0);
    let mut first = true;
    // Bounded: a hash map whose current key is deleted meanwhile restarts
    // from its first key.
    for _ in 0..u64::from(definition.max_entries) * 2 + 1 {
        let more = sys::next_key(old, (!first).then_some(key.as_slice()), &mut next)?;
        if !more {
            break;
        }
        first = false;
        key.copy_from_slice(&next);
        if !sys::lookup(old, &key, &mut value)? {
            continue;
        }
        match sys::update(new, &key, &value) {
            Ok(()) => copied += 1,
            Err(e) if matches!(e.raw_os_error(), Some(libc::E2BIG) | Some(libc::ENOMEM)) => {
                dropped += 1
            }
            Err(e) => return Err(e),
        }
    }
    Ok((copied, dropped))
}

/// Key and value sizes of each map this agent pins, as its userspace types
/// define them: the object must agree (a unit test).
#[cfg(test)]
fn layout(name: &str) -> Option<(usize, usize)> {
    use core::mem::size_of;

    use shunt_common::{
        FastPathDest, FastPathSock, FastPathState, FastPathStats, GlobalConfig, HostProbe,
        HostProbeKey, HostProbeNode, HostProbeStats, MeshFlow, MeshFlowKey, MeshLocalDest,
        MeshLocalStats, MeshService, MeshServiceKey, MeshServiceSock, OriginalDst, PodAddrs,
        PodConfig, PodCounters, PodRecord, PodSlot, PolicyDenialKey, PolicyVerdict,
        PolicyVerdictKey, SockKey, SpliceFlow, SpliceKey,
    };
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
        // A ring buffer has neither keys nor values.
        maps::POLICY_REFUSALS => (0, 0),
        maps::FAST_PATH_DESTS => (size_of::<FastPathDest>(), size_of::<u32>()),
        // The trie's key: a 32-bit prefix length, then the address.
        maps::FAST_PATH_RANGES => (
            size_of::<u32>() + size_of::<FastPathDest>(),
            size_of::<u32>(),
        ),
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
        maps::MESH_LOCAL_SERVICES => (size_of::<MeshServiceKey>(), size_of::<MeshService>()),
        maps::MESH_LOCAL_SERVICE_SOCKS => (size_of::<u64>(), size_of::<MeshServiceSock>()),
        maps::DNS_SERVERS => (size_of::<u64>(), size_of::<OriginalDst>()),
        maps::HOST_PROBE_NODE => (size_of::<u32>(), size_of::<HostProbeNode>()),
        maps::PROBE_TARGETS => (size_of::<u32>(), size_of::<u32>()),
        maps::HOST_PROBES => (size_of::<HostProbeKey>(), size_of::<HostProbe>()),
        maps::HOST_PROBE_STATS => (size_of::<u32>(), size_of::<HostProbeStats>()),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_defines_every_map_as_userspace_reads_it() {
        let wanted = definitions(super::super::EBPF_OBJECT).expect("object parses");
        for name in maps::ALL {
            let (key, value) = layout(name).unwrap_or_else(|| panic!("{name} has no layout"));
            let definition = wanted
                .get(name)
                .unwrap_or_else(|| panic!("{name} is not in the object"));
            assert_eq!(
                (definition.key_size as usize, definition.value_size as usize),
                (key, value),
                "{name}"
            );
        }
    }

    #[test]
    fn only_the_adoption_maps_refuse_a_new_layout() {
        for name in maps::ALL {
            let refused = on_new_layout(name).is_none();
            assert_eq!(
                refused,
                name == maps::ENROLLED || name == maps::POD_RECORDS,
                "{name}"
            );
        }
    }

    #[test]
    fn differences_name_what_changed() {
        let old = Definition {
            map_type: 1,
            key_size: 8,
            value_size: 4,
            max_entries: 2048,
            flags: 0,
        };
        let new = Definition {
            max_entries: 4096,
            ..old
        };
        assert_eq!(old.differences(&new), "max_entries 2048 → 4096");
    }
}
