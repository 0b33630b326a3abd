//! A new release's programs take effect on what a previous agent left
//! attached. At load, every adopted attachment (each socket program's
//! cgroup link, each enrolled pod's TC filters, the splice receive hook) is
//! compared with this release's program by the kernel's tag
//! (`bpf_prog_info.tag`, a hash of the instructions):
//!
//! - same tag, and the adopted program uses only maps pinned now: kept (a
//!   plain restart replaces nothing);
//! - another tag, or the adopted program still uses a map that the
//!   upgrade migrated (`pins.rs`; the tag leaves map references out):
//!   replaced without a gap — a cgroup link is switched in place
//!   (`BPF_LINK_UPDATE` with `BPF_F_REPLACE`), a TC filter is replaced at
//!   its priority and handle with the same classid (`tc.rs`), the receive
//!   hook gets its new link before the old one goes (`splice.rs`).
//!
//! One log line per replaced attachment (old tag → new tag); the whole
//! outcome is published for `/debug/bpf` ([`published`]).

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::Mutex,
};

use aya::{
    maps::{MapData, MapInfo},
    programs::{ProgramFd, ProgramInfo, loaded_programs},
};
use serde::Serialize;
use shunt_common::maps;
use tracing::info;

pub use super::pins::MapChange;

/// What an agent's load did with what it found pinned.
#[derive(Clone, Debug, Default, Serialize)]
pub struct UpgradeReport {
    pub maps: Vec<MapChange>,
    pub programs: Vec<ProgramChange>,
}

/// One attachment's program.
#[derive(Clone, Debug, Serialize)]
pub struct ProgramChange {
    /// Which attachment: `cgroup`, `tc ingress`, `tc egress`, `tracepoint`.
    pub attachment: String,
    /// The pod whose `eth0` holds it (TC filters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    pub program: &'static str,
    /// `attached` (nothing was there), `kept` (same program), `replaced`.
    pub action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_tag: Option<String>,
    pub new_tag: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_id: Option<u32>,
    /// The program running there now (the adopted one when kept).
    pub id: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
}

/// Test seam (`test-seams` builds only): `SHUNT_TEST_EBPF_OBJECT=previous-release-fixture`
/// makes the agent load the upgrade test's "older release"
/// (`ebpf/src/fixture.rs`, built by `build.rs`).
#[cfg(feature = "test-seams")]
pub const OBJECT_ENV: &str = "SHUNT_TEST_EBPF_OBJECT";

#[cfg(feature = "test-seams")]
static PREVIOUS_RELEASE_FIXTURE: &[u8] = aya::include_bytes_aligned!(concat!(
    env!("OUT_DIR"),
    "/shunt-ebpf-previous-release-fixture"
));

/// The eBPF object this agent loads: this release's.
pub fn object() -> &'static [u8] {
    #[cfg(feature = "test-seams")]
    if std::env::var(OBJECT_ENV).as_deref() == Ok("previous-release-fixture") {
        tracing::warn!(
            "{OBJECT_ENV}: loading the upgrade test's previous-release fixture instead of this release's programs"
        );
        return PREVIOUS_RELEASE_FIXTURE;
    }
    super::EBPF_OBJECT
}

static PUBLISHED: Mutex<Option<UpgradeReport>> = Mutex::new(None);

/// The last load's report (`None` before the first load).
pub fn published() -> Option<UpgradeReport> {
    PUBLISHED.lock().ok().and_then(|r| r.clone())
}

/// Whether an adopted program stays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Keep,
    Replace(&'static str),
}

/// An adopted program, as the kernel describes it.
#[derive(Clone, Copy)]
struct Adopted {
    tag: u64,
    /// It references a map that is no longer pinned (migrated).
    uses_old_map: bool,
}

/// The upgrade in progress during one load.
pub struct Upgrade {
    /// Ids of every map pinned now (after the migrations).
    pinned_maps: HashSet<u32>,
    adopted: HashMap<u32, Option<Adopted>>,
    report: UpgradeReport,
}

pub fn tag_hex(tag: u64) -> String {
    format!("{tag:016x}")
}

impl Upgrade {
    /// Starts from the maps' outcome, once the object is loaded (its maps
    /// pinned).
    pub fn new(pin_dir: &Path, maps: Vec<MapChange>) -> Self {
        let pinned_maps = maps::ALL
            .into_iter()
            .chain([shunt_common::LOG_MAP])
            .filter_map(|name| MapData::from_pin(pin_dir.join(name)).ok())
            .filter_map(|map| map.info().ok())
            .map(|info| info.id())
            .collect();
        Self {
            pinned_maps,
            adopted: HashMap::new(),
            report: UpgradeReport {
                maps,
                programs: Vec::new(),
            },
        }
    }

    fn adopted(&mut self, id: u32) -> Option<Adopted> {
        if let Some(known) = self.adopted.get(&id) {
            return *known;
        }
        let found = loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .map(|program| Adopted {
                tag: program.tag(),
                uses_old_map: program
                    .map_ids()
                    .ok()
                    .flatten()
                    .unwrap_or_default()
                    .into_iter()
                    .any(|map| !self.pinned_maps.contains(&map) && !is_data_map(map)),
            });
        self.adopted.insert(id, found);
        found
    }

    /// Whether the adopted program `old_id` gives way to `new`.
    pub fn decide(&mut self, old_id: u32, new: &ProgramInfo) -> Decision {
        match self.adopted(old_id) {
            None => Decision::Replace("the adopted program cannot be read"),
            Some(old) if old.tag != new.tag() => Decision::Replace("another release's program"),
            Some(old) if old.uses_old_map => {
                Decision::Replace("it uses a map this release migrated")
            }
            Some(_) => Decision::Keep,
        }
    }

    /// A descriptor of the adopted program `id` (for `BPF_F_REPLACE`).
    pub fn adopted_fd(&self, id: u32) -> Option<ProgramFd> {
        loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .and_then(|p| p.fd().ok())
    }

    /// Records what happened at one attachment; logs replacements.
    pub fn record(
        &mut self,
        attachment: String,
        pod: Option<String>,
        program: &'static str,
        old_id: Option<u32>,
        new: &ProgramInfo,
        decision: Option<Decision>,
    ) {
        let old_tag = old_id
            .and_then(|id| self.adopted(id))
            .map(|a| tag_hex(a.tag));
        let (action, reason) = match decision {
            None => ("attached", None),
            Some(Decision::Keep) => ("kept", None),
            Some(Decision::Replace(reason)) => ("replaced", Some(reason)),
        };
        let new_tag = tag_hex(new.tag());
        if action == "replaced" {
            info!(
                %attachment,
                pod = pod.as_deref().unwrap_or(""),
                program,
                old_tag = old_tag.as_deref().unwrap_or("?"),
                %new_tag,
                reason = reason.unwrap_or(""),
                "program replaced by this release's"
            );
        }
        self.report.programs.push(ProgramChange {
            attachment,
            pod,
            program,
            action,
            old_tag,
            new_tag,
            old_id,
            // A kept attachment still runs the adopted program.
            id: match (action, old_id) {
                ("kept", Some(old)) => old,
                _ => new.id(),
            },
            reason,
        });
    }

    /// Publishes the report and says in one line what the upgrade did.
    pub fn publish(self) {
        let count = |action| {
            self.report
                .programs
                .iter()
                .filter(|p| p.action == action)
                .count()
        };
        let maps_changed = self
            .report
            .maps
            .iter()
            .filter(|m| m.action != "reused")
            .count();
        info!(
            replaced = count("replaced"),
            kept = count("kept"),
            attached = count("attached"),
            maps_migrated = maps_changed,
            "programs and pinned maps checked against this release"
        );
        if let Ok(mut published) = PUBLISHED.lock() {
            *published = Some(self.report);
        }
    }
}

/// A program's own global data (`.rodata`, `.bss`, `.data`): created per
/// load, never pinned, so no sign of an old map.
fn is_data_map(id: u32) -> bool {
    MapInfo::from_id(id)
        .ok()
        .and_then(|info| info.name_as_str().map(|name| name.contains('.')))
        .unwrap_or(false)
}
