//! What istiod has sent, held per resource type with versions, and the
//! record of the exchange (ACKs, NACKs, connection) that `/config_dump` and
//! `shunt status` show.
//!
//! A response is applied whole or not at all: every resource is decoded and
//! translated first, and only when all of them are valid (and no two claim
//! one address) does the held state change. A rejected response leaves the
//! last good state untouched.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    time::SystemTime,
};

use prost::Message as _;
use shunt_proto::{
    envoy::service::discovery::v3::DeltaDiscoveryResponse,
    istio::{security as security_pb, workload as workload_pb},
};

use super::{
    ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, FieldError, ResourceError, ResourceType,
    authorization, service, workload,
};
pub use crate::api::{
    AckRecord, NackRecord, ResourceStatus, TypeStatus, XdsStatus, XdsStatusHandle, XdsSummary,
};
use crate::{
    authz::Policy,
    control::ClusterView,
    state::{Service, Workload},
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

/// One resource of the Address type.
#[derive(Clone, Debug, PartialEq)]
enum AddressEntry {
    Workload(Box<Workload>),
    Service(Box<Service>),
}

#[derive(Clone, Debug)]
struct Held<T> {
    version: String,
    value: T,
}

/// What a response did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    pub resource_type: ResourceType,
    /// Whether the view changed (a new or different resource, a removal of a
    /// held one). A version bump alone does not count.
    pub changed: bool,
    pub updated: usize,
    pub removed: usize,
}

/// Why a response was not applied (the NACK's message).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error(
        "unknown type URL {0:?}: shunt subscribes to {ADDRESS_TYPE_URL} and {AUTHORIZATION_TYPE_URL}"
    )]
    UnknownType(String),
    #[error("{}", list_errors(.0))]
    Resources(Vec<ResourceError>),
}

fn list_errors(errors: &[ResourceError]) -> String {
    let mut out = format!("{} resource error(s), nothing applied: ", errors.len());
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
    addresses: BTreeMap<String, Held<AddressEntry>>,
    policies: BTreeMap<String, Held<Policy>>,
    types: BTreeMap<String, TypeStatus>,
    connected_since: Option<SystemTime>,
    connections: u64,
    last_error: Option<String>,
    warnings: Vec<String>,
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

    /// Applies one response whole, or returns why not (and changes nothing).
    pub fn apply(&mut self, response: &DeltaDiscoveryResponse) -> Result<Applied, Rejected> {
        let ty = ResourceType::from_type_url(&response.type_url)
            .ok_or_else(|| Rejected::UnknownType(response.type_url.clone()))?;
        let mut errors = Vec::new();
        let mut names = HashSet::with_capacity(response.resources.len());
        let mut decoded = Vec::with_capacity(response.resources.len());
        for (i, resource) in response.resources.iter().enumerate() {
            let name = if resource.name.is_empty() {
                errors
                    .push(FieldError::new("name", "empty").in_resource(&format!("resources[{i}]")));
                continue;
            } else {
                resource.name.as_str()
            };
            if !names.insert(name) {
                errors.push(
                    FieldError::new("name", "listed twice in one response").in_resource(name),
                );
                continue;
            }
            match decode(ty, name, resource.resource.as_ref()) {
                Ok(entry) => decoded.push((name, resource.version.as_str(), entry)),
                Err(e) => errors.push(e.in_resource(name)),
            }
        }
        for name in &response.removed_resources {
            if names.contains(name.as_str()) {
                errors.push(
                    FieldError::new(
                        "removed_resources",
                        "also sent as a resource in the same response",
                    )
                    .in_resource(name),
                );
            }
        }
        if ty == ResourceType::Address {
            errors.extend(duplicate_addresses(&decoded));
        }
        if !errors.is_empty() {
            return Err(Rejected::Resources(errors));
        }

        // Valid: commit.
        let mut changed = false;
        let updated = decoded.len();
        for (name, version, entry) in decoded {
            let version = version.to_owned();
            match entry {
                Decoded::Address(value) => {
                    changed |= self
                        .addresses
                        .get(name)
                        .is_none_or(|old| old.value != value);
                    self.addresses
                        .insert(name.to_owned(), Held { version, value });
                }
                Decoded::Policy(value) => {
                    changed |= self.policies.get(name).is_none_or(|old| old.value != value);
                    self.policies
                        .insert(name.to_owned(), Held { version, value });
                }
            }
        }
        let mut removed = 0;
        for name in &response.removed_resources {
            let gone = match ty {
                ResourceType::Address => self.addresses.remove(name).is_some(),
                ResourceType::Authorization => self.policies.remove(name).is_some(),
            };
            if gone {
                removed += 1;
                changed = true;
            }
        }
        Ok(Applied {
            resource_type: ty,
            changed,
            updated,
            removed,
        })
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

    /// The complete cluster view from what is held, with endpoints resolved.
    /// Keeps what could not be resolved as the status' warnings and returns
    /// those that are new (to be logged once).
    pub fn view(&mut self) -> (ClusterView, Vec<String>) {
        let mut workloads = Vec::new();
        let mut services = Vec::new();
        for held in self.addresses.values() {
            match &held.value {
                AddressEntry::Workload(w) => workloads.push(w.as_ref().clone()),
                AddressEntry::Service(s) => services.push(s.as_ref().clone()),
            }
        }
        let mut warnings = service::attach_endpoints(&mut services, workloads.iter());
        warnings.extend(shared_addresses(&workloads));
        let policies: Vec<Policy> = self.policies.values().map(|h| h.value.clone()).collect();
        let known: HashSet<String> = self.policies.keys().cloned().collect();
        for w in &workloads {
            for p in w
                .authorization_policies
                .iter()
                .filter(|p| !known.contains(*p))
            {
                warnings.push(format!(
                    "workload {} ({}) names policy {p}, which istiod has not sent",
                    w.key(),
                    w.uid
                ));
            }
        }
        let before: HashSet<&String> = self.warnings.iter().collect();
        let new = warnings
            .iter()
            .filter(|w| !before.contains(w))
            .cloned()
            .collect();
        self.warnings = warnings;
        let view = ClusterView {
            workloads,
            services,
            policies,
        };
        (view, new)
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
        let mut resources = Vec::with_capacity(self.addresses.len() + self.policies.len());
        for (name, held) in &self.addresses {
            let kind = match held.value {
                AddressEntry::Workload(_) => "workload",
                AddressEntry::Service(_) => "service",
            };
            resources.push(ResourceStatus {
                kind: kind.into(),
                name: name.clone(),
                version: held.version.clone(),
            });
        }
        for (name, held) in &self.policies {
            resources.push(ResourceStatus {
                kind: "authorization".into(),
                name: name.clone(),
                version: held.version.clone(),
            });
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
            warnings: self.warnings.clone(),
            resources,
        }
    }
}

/// One resource, decoded and translated.
enum Decoded {
    Address(AddressEntry),
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
                    .map(|w| Decoded::Address(AddressEntry::Workload(Box::new(w))))
                    .map_err(|e| e.under("workload")),
                Some(workload_pb::address::Type::Service(s)) => service::translate(s)
                    .map(|s| Decoded::Address(AddressEntry::Service(Box::new(s))))
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

/// Two workloads of one response claiming one address on one network:
/// refused, because which one a peer IP means would be a guess.
fn duplicate_addresses(decoded: &[(&str, &str, Decoded)]) -> Vec<ResourceError> {
    let mut owners: HashMap<(&str, IpAddr), &str> = HashMap::new();
    let mut errors = Vec::new();
    for (name, _, entry) in decoded {
        let Decoded::Address(entry) = entry else {
            continue;
        };
        let AddressEntry::Workload(w) = entry else {
            continue;
        };
        for (i, ip) in w.ips.iter().enumerate() {
            if let Some(first) = owners.insert((w.network.as_str(), *ip), name) {
                errors.push(
                    FieldError::new(
                        format!("workload.addresses[{i}]"),
                        format!("{ip} (network {:?}) is also claimed by resource {first:?} in this response", w.network),
                    )
                    .in_resource(name),
                );
            }
        }
    }
    errors
}

/// Addresses claimed by two held workloads (sent in different responses,
/// e.g. an IP reused before istiod removed its last owner): kept, and named.
fn shared_addresses(workloads: &[Workload]) -> Vec<String> {
    let mut owners: HashMap<(&str, IpAddr), &Workload> = HashMap::with_capacity(workloads.len());
    let mut warnings = Vec::new();
    for w in workloads {
        for ip in &w.ips {
            if let Some(first) = owners.insert((w.network.as_str(), *ip), w) {
                warnings.push(format!(
                    "address {ip} (network {:?}) is claimed by workloads {} ({}) and {} ({})",
                    w.network,
                    first.key(),
                    first.uid,
                    w.key(),
                    w.uid
                ));
            }
        }
    }
    warnings
}

#[cfg(test)]
mod tests {
    use shunt_proto::envoy::service::discovery::v3::Resource;

    use super::*;

    fn workload_resource(name: &str, ip: [u8; 4]) -> Resource {
        let address = workload_pb::Address {
            r#type: Some(workload_pb::address::Type::Workload(
                workload_pb::Workload {
                    uid: name.into(),
                    name: name.into(),
                    namespace: "default".into(),
                    addresses: vec![ip.to_vec()],
                    tunnel_protocol: workload_pb::TunnelProtocol::Hbone as i32,
                    ..Default::default()
                },
            )),
        };
        Resource {
            name: name.into(),
            version: "1".into(),
            resource: Some(prost_types::Any {
                type_url: ADDRESS_TYPE_URL.into(),
                value: address.encode_to_vec(),
            }),
            ..Default::default()
        }
    }

    fn response(resources: Vec<Resource>, removed: &[&str]) -> DeltaDiscoveryResponse {
        DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE_URL.into(),
            resources,
            removed_resources: removed.iter().map(|s| s.to_string()).collect(),
            nonce: "n".into(),
            ..Default::default()
        }
    }

    #[test]
    fn applies_whole_or_not_at_all() {
        let mut state = XdsState::new("a", "n");
        let applied = state
            .apply(&response(
                vec![workload_resource("a", [198, 18, 0, 1])],
                &[],
            ))
            .expect("valid");
        assert!(applied.changed);
        let mut bad = workload_resource("c", [198, 18, 0, 3]);
        if let Some(any) = bad.resource.as_mut() {
            any.value = vec![0xff, 0xff];
        }
        let err = state
            .apply(&response(
                vec![workload_resource("b", [198, 18, 0, 2]), bad],
                &["a"],
            ))
            .expect_err("undecodable");
        assert!(
            err.to_string()
                .contains("resource \"c\": resource.value: does not decode"),
            "{err}"
        );
        let (view, _) = state.view();
        let names: Vec<&str> = view.workloads.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["a"], "nothing of the rejected response applied");

        let err = state
            .apply(&response(
                vec![
                    workload_resource("b", [198, 18, 0, 2]),
                    workload_resource("c", [198, 18, 0, 2]),
                ],
                &[],
            ))
            .expect_err("duplicate address");
        assert!(
            err.to_string().contains("also claimed by resource \"b\""),
            "{err}"
        );

        let applied = state
            .apply(&response(vec![], &["a", "never-held"]))
            .expect("removal");
        assert_eq!((applied.changed, applied.removed), (true, 1));
        assert!(state.view().0.workloads.is_empty());
    }

    #[test]
    fn unknown_type_and_versions() {
        let mut state = XdsState::new("a", "n");
        let mut r = response(vec![], &[]);
        r.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
        assert!(matches!(state.apply(&r), Err(Rejected::UnknownType(_))));
        state
            .apply(&response(
                vec![workload_resource("a", [198, 18, 0, 1])],
                &[],
            ))
            .expect("valid");
        assert_eq!(
            state.versions(ResourceType::Address),
            HashMap::from([("a".into(), "1".into())])
        );
        assert!(!state.synced());
        state.record_ack(ADDRESS_TYPE_URL, "n1", "v");
        state.record_ack(AUTHORIZATION_TYPE_URL, "n2", "v");
        assert!(state.synced());
        let status = state.status();
        assert_eq!(status.resources.len(), 1);
        assert_eq!(status.types.len(), 2);
    }
}
