//! What istiod has sent, held per resource type with versions, and the
//! record of the exchange (ACKs, NACKs, connection) that `/config_dump` and
//! `shunt status` show.
//!
//! A response is applied resource by resource, as ztunnel applies it:
//! every resource that decodes and translates replaces the held copy (or
//! is added), every removal is applied, and each bad resource is rejected
//! alone, named with its field and reason in the NACK. A rejected
//! resource keeps its last good copy (and only that copy's version is
//! reported as held on reconnect, so istiod sends the resource again).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
    time::SystemTime,
};

use prost::Message as _;
use shunt_proto::{
    envoy::service::discovery::v3::DeltaDiscoveryResponse,
    istio::{security as security_pb, workload as workload_pb},
};

use super::{
    ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, FieldError, ResourceError, ResourceType,
    authorization,
    derived::{Change, Derived, Entry},
    service, workload,
};
pub use crate::api::{
    AckRecord, NackRecord, ResourceList, ResourceStatus, TypeStatus, XdsStatus, XdsStatusHandle,
    XdsSummary,
};
use crate::{
    authz::Policy,
    control::{ClusterDelta, ClusterView},
    state::WorkloadKey,
    store::workload_id,
};

/// Seconds since the epoch (negative before it).
fn unix_seconds(t: SystemTime) -> i64 {
    match t.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// At most this many resource errors are listed in one NACK (the count is
/// always given): istiod logs the message, and one bad field repeated over
/// 10,000 workloads must not make it megabytes long.
const MAX_ERRORS_LISTED: usize = 10;

#[derive(Clone, Debug)]
struct Held<T> {
    version: String,
    value: T,
}

/// What a response did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub resource_type: ResourceType,
    /// Whether the view changed (a new or different resource, a removal of a
    /// held one). A version bump alone does not count.
    pub changed: bool,
    /// Resources added or replaced.
    pub updated: usize,
    pub removed: usize,
    /// The resources refused (each keeps its last good copy, if any): the
    /// response is NACKed naming them, the rest is applied.
    pub rejected: Vec<ResourceError>,
}

impl Applied {
    /// The NACK's message, when something was refused.
    pub fn nack_reason(&self) -> Option<String> {
        (!self.rejected.is_empty()).then(|| list_errors(&self.rejected))
    }
}

/// Why a response was not applied at all (the NACK's message).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error(
        "unknown type URL {0:?}: shunt subscribes to {ADDRESS_TYPE_URL} and {AUTHORIZATION_TYPE_URL}"
    )]
    UnknownType(String),
}

fn list_errors(errors: &[ResourceError]) -> String {
    let mut out = format!("{} resource(s) rejected, the rest applied: ", errors.len());
    let shown: Vec<String> = errors
        .iter()
        .take(MAX_ERRORS_LISTED)
        .map(ToString::to_string)
        .collect();
    out.push_str(&shown.join("; "));
    if errors.len() > MAX_ERRORS_LISTED {
        out.push_str(&format!("; and {} more", errors.len() - MAX_ERRORS_LISTED));
    }
    out
}

/// Everything held from istiod, and the record of the exchange.
#[derive(Debug, Default)]
pub struct XdsState {
    address: String,
    node_id: String,
    addresses: BTreeMap<String, Held<Entry>>,
    /// The same entries without versions, for [`Derived`].
    entries: BTreeMap<String, Entry>,
    policies: BTreeMap<String, Held<Policy>>,
    /// Both maps' names and versions as `/config_dump` lists them, kept
    /// beside them so that the status shares it instead of rebuilding it.
    listed: ResourceList,
    derived: Derived,
    /// Workload id ([`workload_id`]) → the resources holding one by that
    /// id (normally one), and the same for service ids
    /// ([`crate::state::Service::id`]):
    /// which resource a delta's id stands for.
    workload_names: HashMap<String, BTreeSet<String>>,
    service_names: HashMap<WorkloadKey, BTreeSet<String>>,
    /// Changed since the last view or delta was taken.
    touched_workloads: HashSet<String>,
    touched_services: HashSet<WorkloadKey>,
    touched_policies: bool,
    /// Warnings new since the last [`XdsState::view`].
    new_warnings: Vec<String>,
    types: BTreeMap<String, TypeStatus>,
    connected_since: Option<SystemTime>,
    connections: u64,
    last_error: Option<String>,
}

impl XdsState {
    pub fn new(address: impl Into<String>, node_id: impl Into<String>) -> Self {
        let mut state = Self {
            address: address.into(),
            node_id: node_id.into(),
            ..Default::default()
        };
        for ty in ResourceType::ALL {
            state.type_record(ty.type_url());
        }
        state
    }

    fn type_record(&mut self, type_url: &str) -> &mut TypeStatus {
        self.types
            .entry(type_url.to_owned())
            .or_insert_with(|| TypeStatus {
                type_url: type_url.to_owned(),
                ..Default::default()
            })
    }

    /// Applies one response: every good resource and every removal; each
    /// bad resource is refused alone and listed in [`Applied::rejected`].
    /// Only a response of a type not subscribed to is refused whole.
    pub fn apply(&mut self, response: &DeltaDiscoveryResponse) -> Result<Applied, Rejected> {
        let ty = ResourceType::from_type_url(&response.type_url)
            .ok_or_else(|| Rejected::UnknownType(response.type_url.clone()))?;
        let mut rejected = Vec::new();
        let mut names = HashSet::with_capacity(response.resources.len());
        let removed_names: HashSet<&str> = response
            .removed_resources
            .iter()
            .map(String::as_str)
            .collect();
        let mut decoded = Vec::with_capacity(response.resources.len());
        for (i, resource) in response.resources.iter().enumerate() {
            let name = resource.name.as_str();
            if name.is_empty() {
                rejected
                    .push(FieldError::new("name", "empty").in_resource(&format!("resources[{i}]")));
                continue;
            }
            if !names.insert(name) {
                rejected.push(
                    FieldError::new("name", "listed twice in one response; the first applied")
                        .in_resource(name),
                );
                continue;
            }
            if removed_names.contains(name) {
                rejected.push(
                    FieldError::new(
                        "removed_resources",
                        "also sent as a resource in the same response; neither applied",
                    )
                    .in_resource(name),
                );
                continue;
            }
            match decode(ty, name, resource.resource.as_ref()) {
                Ok(entry) => decoded.push((name, resource.version.as_str(), entry)),
                Err(e) => rejected.push(e.in_resource(name)),
            }
        }

        let mut changed = false;
        let updated = decoded.len();
        let mut removed = 0;
        match ty {
            ResourceType::Address => {
                let mut changes = Vec::new();
                for name in response
                    .removed_resources
                    .iter()
                    .filter(|n| !names.contains(n.as_str()))
                {
                    if let Some(old) = self.addresses.remove(name) {
                        self.entries.remove(name);
                        self.listed.remove(address_kind(&old.value), name);
                        removed += 1;
                        changes.push(Change {
                            name: name.clone(),
                            old: Some(old.value),
                            new: None,
                        });
                    }
                }
                for (name, version, entry) in decoded {
                    let Decoded::Address(value) = entry else {
                        continue;
                    };
                    let old = self.addresses.insert(
                        name.to_owned(),
                        Held {
                            version: version.to_owned(),
                            value: value.clone(),
                        },
                    );
                    let kind = address_kind(&value);
                    if old
                        .as_ref()
                        .is_none_or(|o| o.version != version || address_kind(&o.value) != kind)
                    {
                        self.listed.set(ResourceStatus {
                            kind: kind.into(),
                            name: name.to_owned(),
                            version: version.to_owned(),
                        });
                    }
                    if old.as_ref().is_some_and(|o| o.value == value) {
                        continue;
                    }
                    self.entries.insert(name.to_owned(), value.clone());
                    changes.push(Change {
                        name: name.to_owned(),
                        old: old.map(|o| o.value),
                        new: Some(value),
                    });
                }
                changed = !changes.is_empty();
                if changed {
                    for change in &changes {
                        self.index(&change.name, change.old.as_ref(), change.new.as_ref());
                    }
                    self.update_derived(changes, false);
                }
            }
            ResourceType::Authorization => {
                let known_before = self.policies.len();
                for name in response
                    .removed_resources
                    .iter()
                    .filter(|n| !names.contains(n.as_str()))
                {
                    if self.policies.remove(name).is_some() {
                        self.listed.remove(ResourceStatus::AUTHORIZATION, name);
                        removed += 1;
                        changed = true;
                    }
                }
                for (name, version, entry) in decoded {
                    let Decoded::Policy(value) = entry else {
                        continue;
                    };
                    let held = self.policies.get(name);
                    changed |= held.is_none_or(|old| old.value != value);
                    if held.is_none_or(|old| old.version != version) {
                        self.listed.set(ResourceStatus {
                            kind: ResourceStatus::AUTHORIZATION.into(),
                            name: name.to_owned(),
                            version: version.to_owned(),
                        });
                    }
                    self.policies.insert(
                        name.to_owned(),
                        Held {
                            version: version.to_owned(),
                            value,
                        },
                    );
                }
                self.touched_policies |= changed;
                let names_moved = removed > 0 || self.policies.len() != known_before;
                if names_moved {
                    self.update_derived(Vec::new(), true);
                }
            }
        }
        Ok(Applied {
            resource_type: ty,
            changed,
            updated,
            removed,
            rejected,
        })
    }

    /// Keeps the id → resource indexes current and records the ids a
    /// delta must carry.
    fn index(&mut self, name: &str, old: Option<&Entry>, new: Option<&Entry>) {
        for (entry, present) in [(old, false), (new, true)] {
            match entry {
                Some(Entry::Workload(w)) => {
                    let id = workload_id(w).into_owned();
                    set_member(&mut self.workload_names, &id, name, present);
                    self.touched_workloads.insert(id);
                }
                Some(Entry::Service(s)) => {
                    let id = s.id();
                    set_member(&mut self.service_names, &id, name, present);
                    self.touched_services.insert(id);
                }
                None => {}
            }
        }
    }

    fn update_derived(&mut self, changes: Vec<Change>, policies_changed: bool) {
        let policies = &self.policies;
        let known = |name: &str| policies.contains_key(name);
        let new = self
            .derived
            .update(&self.entries, &known, changes, policies_changed);
        self.new_warnings.extend(new);
    }

    /// Records the ACK sent for a response.
    pub fn record_ack(&mut self, type_url: &str, nonce: &str, system_version_info: &str) {
        let record = self.type_record(type_url);
        record.received = true;
        record.last_ack = Some(AckRecord {
            nonce: nonce.to_owned(),
            system_version_info: system_version_info.to_owned(),
            at: unix_seconds(SystemTime::now()),
        });
    }

    /// Records that a response of `type_url` was applied (in part: a NACK
    /// follows) without an ACK.
    pub fn record_received(&mut self, type_url: &str) {
        self.type_record(type_url).received = true;
    }

    /// Records the NACK sent for a response.
    pub fn record_nack(&mut self, type_url: &str, nonce: &str, reason: &str) {
        self.type_record(type_url).last_nack = Some(NackRecord {
            nonce: nonce.to_owned(),
            reason: reason.to_owned(),
            at: unix_seconds(SystemTime::now()),
        });
    }

    pub fn record_connected(&mut self) {
        self.connected_since = Some(SystemTime::now());
        self.connections += 1;
        self.last_error = None;
    }

    pub fn record_disconnected(&mut self, error: String) {
        self.connected_since = None;
        self.last_error = Some(error);
    }

    /// Whether a response of `type_url` was applied since the start.
    pub fn received(&self, type_url: &str) -> bool {
        self.types.get(type_url).is_some_and(|t| t.received)
    }

    /// Whether every type was received at least once.
    pub fn synced(&self) -> bool {
        ResourceType::ALL
            .iter()
            .all(|ty| self.received(ty.type_url()))
    }

    /// What is held of `ty`, by name → version: what a new stream sends as
    /// `initial_resource_versions`.
    pub fn versions(&self, ty: ResourceType) -> HashMap<String, String> {
        match ty {
            ResourceType::Address => self
                .addresses
                .iter()
                .map(|(n, h)| (n.clone(), h.version.clone()))
                .collect(),
            ResourceType::Authorization => self
                .policies
                .iter()
                .map(|(n, h)| (n.clone(), h.version.clone()))
                .collect(),
        }
    }

    /// The complete cluster view from what is held, with endpoints
    /// resolved: shared entries, so building it copies pointers, not
    /// workloads. Returns the warnings new since the last call (to be
    /// logged once); all current ones are in the status.
    pub fn view(&mut self) -> (ClusterView, Vec<String>) {
        let workloads = self
            .entries
            .values()
            .filter_map(|e| match e {
                Entry::Workload(w) => Some(w.clone()),
                Entry::Service(_) => None,
            })
            .collect();
        let services = self.derived.services().cloned().collect();
        let policies: Vec<Policy> = self.policies.values().map(|h| h.value.clone()).collect();
        let view = ClusterView {
            workloads,
            services,
            policies,
        };
        // The view holds every change so far; deltas start from it.
        self.touched_workloads.clear();
        self.touched_services.clear();
        self.touched_policies = false;
        self.derived.take_touched();
        (view, std::mem::take(&mut self.new_warnings))
    }

    /// What changed since the last [`XdsState::view`] or delta, by store
    /// id: only the entries a response touched (and the services whose
    /// endpoints moved with them), so handing a one-workload change to the
    /// store does not walk the mesh. The same held copies as a view.
    pub fn delta(&mut self) -> (ClusterDelta, Vec<String>) {
        let mut delta = ClusterDelta::default();
        for id in std::mem::take(&mut self.touched_workloads) {
            // Of two resources with one id, the last by name, as a view.
            let current = self.workload_names.get(&id).and_then(|names| {
                names.iter().rev().find_map(|n| match self.entries.get(n) {
                    Some(Entry::Workload(w)) => Some(w.clone()),
                    _ => None,
                })
            });
            delta.workloads.insert(id, current);
        }
        let mut service_ids = std::mem::take(&mut self.touched_services);
        for name in self.derived.take_touched() {
            if let Some(Entry::Service(s)) = self.entries.get(&name) {
                service_ids.insert(s.id());
            }
        }
        for id in service_ids {
            let current = self
                .service_names
                .get(&id)
                .and_then(|names| names.iter().rev().find_map(|n| self.derived.service(n)));
            delta.services.insert(id, current.cloned());
        }
        if std::mem::take(&mut self.touched_policies) {
            delta.policies = Some(self.policies.values().map(|h| h.value.clone()).collect());
        }
        (delta, std::mem::take(&mut self.new_warnings))
    }

    /// The status as `/config_dump` shows it.
    pub fn status(&self) -> XdsStatus {
        let mut types: Vec<TypeStatus> = self.types.values().cloned().collect();
        for t in &mut types {
            t.resources = match ResourceType::from_type_url(&t.type_url) {
                Some(ResourceType::Address) => self.addresses.len(),
                Some(ResourceType::Authorization) => self.policies.len(),
                None => 0,
            };
        }
        XdsStatus {
            address: self.address.clone(),
            node_id: self.node_id.clone(),
            connected: self.connected_since.is_some(),
            connected_since: self.connected_since.map(unix_seconds),
            connections: self.connections,
            last_error: self.last_error.clone(),
            synced: self.synced(),
            types,
            warnings: self.derived.warnings().cloned().collect(),
            resources: self.listed.clone(),
        }
    }
}

/// The `/config_dump` kind of an address resource.
fn address_kind(entry: &Entry) -> &'static str {
    match entry {
        Entry::Workload(_) => ResourceStatus::WORKLOAD,
        Entry::Service(_) => ResourceStatus::SERVICE,
    }
}

/// Adds `name` to (or removes it from) the set under `id`.
fn set_member<K: std::hash::Hash + Eq + Clone>(
    index: &mut HashMap<K, BTreeSet<String>>,
    id: &K,
    name: &str,
    present: bool,
) {
    if present {
        index.entry(id.clone()).or_default().insert(name.to_owned());
    } else if let Some(names) = index.get_mut(id) {
        names.remove(name);
        if names.is_empty() {
            index.remove(id);
        }
    }
}

/// One resource, decoded and translated.
enum Decoded {
    Address(Entry),
    Policy(Policy),
}

fn decode(
    ty: ResourceType,
    name: &str,
    any: Option<&prost_types::Any>,
) -> Result<Decoded, FieldError> {
    let any = any.ok_or_else(|| FieldError::new("resource", "missing"))?;
    if any.type_url != ty.type_url() {
        return Err(FieldError::new(
            "resource.type_url",
            format!("{:?} in a response of type {}", any.type_url, ty.type_url()),
        ));
    }
    let undecodable = |e: prost::DecodeError| {
        FieldError::new(
            "resource.value",
            format!("does not decode as {}: {e}", ty.type_url()),
        )
    };
    match ty {
        ResourceType::Address => {
            let address =
                workload_pb::Address::decode(any.value.as_slice()).map_err(undecodable)?;
            match address.r#type {
                Some(workload_pb::address::Type::Workload(w)) => workload::translate(w, name)
                    .map(|w| Decoded::Address(Entry::Workload(Arc::new(w))))
                    .map_err(|e| e.under("workload")),
                Some(workload_pb::address::Type::Service(s)) => service::translate(s)
                    .map(|s| Decoded::Address(Entry::Service(Arc::new(s))))
                    .map_err(|e| e.under("service")),
                None => Err(FieldError::new("type", "neither workload nor service")),
            }
        }
        ResourceType::Authorization => {
            let policy =
                security_pb::Authorization::decode(any.value.as_slice()).map_err(undecodable)?;
            authorization::translate(policy).map(Decoded::Policy)
        }
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "state_delta_tests.rs"]
mod delta_tests;
