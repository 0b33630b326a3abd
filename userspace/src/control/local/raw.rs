//! The YAML model of the workloads file, as serde reads it: strings rather
//! than parsed types, so the checks (`entries.rs`, `waypoints.rs`,
//! `policies.rs`) can report every bad value with its entry.

use std::path::PathBuf;

use serde::Deserialize;

use super::waypoints;

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a mapping with `workloads` and optionally `trustDomain`, `services`, `authorizationPolicies`, `namespaces` and `waypoints`"
)]
pub(super) struct RawFile {
    pub(super) trust_domain: Option<String>,
    pub(super) workloads: Vec<RawWorkload>,
    #[serde(default)]
    pub(super) services: Vec<RawService>,
    /// Kept untyped here: each is checked on its own ([`policies`]), so
    /// one bad policy does not reject the file.
    #[serde(default)]
    pub(super) authorization_policies: Vec<serde_yaml::Value>,
    #[serde(default)]
    pub(super) namespaces: Vec<waypoints::RawNamespace>,
    #[serde(default)]
    pub(super) waypoints: Vec<waypoints::RawWaypoint>,
}

/// Strings rather than parsed types, so that [`check_entries`](super::entries::check_entries) can report
/// every bad value with its entry instead of serde stopping at the first.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a workload (a mapping)"
)]
pub(super) struct RawWorkload {
    pub(super) name: String,
    pub(super) namespace: String,
    pub(super) service_account: String,
    pub(super) ips: Vec<String>,
    pub(super) node: String,
    pub(super) netns: Option<PathBuf>,
    pub(super) dataplane_mode: Option<String>,
    /// Whether to splice this pod's connections (default: as `--splice`).
    pub(super) splice: Option<bool>,
    /// `false` keeps this pod's connections on the proxy path (default: as
    /// `--fast-path`).
    pub(super) fast_path: Option<bool>,
    /// DNS capture for this pod (default: as `--dns-capture`).
    pub(super) dns_capture: Option<bool>,
    #[serde(default)]
    pub(super) labels: std::collections::BTreeMap<String, String>,
    /// The pod's owner, as istiod names it (`workload_name`): what the
    /// `baggage` header and the metrics call the workload (default: the
    /// pod itself).
    pub(super) workload_name: Option<String>,
    /// The owner's kind: `deployment`, `cronjob`, `job` or `pod`.
    pub(super) workload_type: Option<String>,
    /// The pod's `spec.hostname` and `spec.subdomain` (DNS pod records).
    pub(super) hostname: Option<String>,
    pub(super) subdomain: Option<String>,
    /// Its share of new connections among a service's endpoints (xDS
    /// `capacity`; default 1, 0: none while another has capacity).
    pub(super) capacity: Option<u32>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a service (a mapping)"
)]
pub(super) struct RawService {
    pub(super) name: String,
    pub(super) namespace: String,
    // Kubernetes' spelling, which `camelCase` would not produce.
    #[serde(rename = "clusterIPs")]
    pub(super) cluster_ips: Vec<String>,
    pub(super) ports: Vec<RawServicePort>,
    #[serde(default)]
    pub(super) endpoints: Vec<String>,
    /// Read by the waypoint rules only (`istio.io/use-waypoint`).
    #[serde(default)]
    pub(super) labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a service port (a mapping with `port` and optionally `targetPort`)"
)]
pub(super) struct RawServicePort {
    pub(super) port: u16,
    pub(super) target_port: Option<u16>,
}
