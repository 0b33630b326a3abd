//! The istiod discovery source (`--xds-address`): workloads, services and
//! authorization policies from istiod over delta xDS, the way ztunnel gets
//! them.
//!
//! - [`client`]: the `DeltaAggregatedResources` stream over TLS (token,
//!   node identity, ACK/NACK, reconnects with `initial_resource_versions`,
//!   back-off);
//! - [`state`]: the resources held per type, applied resource by resource
//!   (a bad one is NACKed by name and keeps its last good copy; the rest
//!   applies), and the status `/config_dump` shows;
//! - `derived`: what the held resources imply (each service's endpoints,
//!   the warnings), updated only where a response changed something;
//! - [`workload`], [`service`], [`authorization`]: istiod's resources
//!   translated into the agent's own model (`state::Workload`,
//!   `state::Service`, `authz::Policy`), each refusal naming the field.
//!
//! The source publishes a complete [`crate::control::ClusterView`] through
//! [`crate::control::SourceSink::cluster`] after every response that changed
//! something, and `synced("xds")` once both types were received. While
//! istiod is away nothing is published, so nothing known is dropped.

pub mod authorization;
pub mod client;
mod derived;
pub mod metrics;
pub mod service;
pub mod state;
pub mod workload;

use std::{fmt, net::IpAddr, path::PathBuf, time::Duration};

pub use client::{XdsError, XdsSource};
pub use metrics::{Termination, XdsMetrics};
pub use state::{XdsState, XdsStatus, XdsStatusHandle, XdsSummary};

/// `istio.workload.Address`: workloads and services.
pub const ADDRESS_TYPE_URL: &str = "type.googleapis.com/istio.workload.Address";
/// `istio.security.Authorization`: L4 policies.
pub const AUTHORIZATION_TYPE_URL: &str = "type.googleapis.com/istio.security.Authorization";

/// The name this source reports readiness under.
pub const SOURCE_NAME: &str = "xds";

/// The resource types the source subscribes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceType {
    Address,
    Authorization,
}

impl ResourceType {
    pub const ALL: [Self; 2] = [Self::Address, Self::Authorization];

    pub fn type_url(self) -> &'static str {
        match self {
            Self::Address => ADDRESS_TYPE_URL,
            Self::Authorization => AUTHORIZATION_TYPE_URL,
        }
    }

    pub fn from_type_url(url: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.type_url() == url)
    }
}

impl fmt::Display for ResourceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.type_url())
    }
}

/// Who this agent is to istiod: a ztunnel-type node proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdsNode {
    /// The agent pod's IP (`INSTANCE_IP`).
    pub ip: IpAddr,
    /// The agent pod's name and namespace (`POD_NAME`, `POD_NAMESPACE`).
    pub pod_name: String,
    pub pod_namespace: String,
    /// The Kubernetes node it serves (`NODE_NAME`).
    pub node_name: String,
    /// Istio's cluster id (`Kubernetes` unless multi-cluster).
    pub cluster_id: String,
}

impl XdsNode {
    /// `ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local`: istiod reads the
    /// proxy type from the first part and the pod from the rest.
    pub fn id(&self) -> String {
        let Self {
            ip,
            pod_name,
            pod_namespace: ns,
            ..
        } = self;
        format!("ztunnel~{ip}~{pod_name}.{ns}~{ns}.svc.cluster.local")
    }
}

/// Where and how to reach istiod.
#[derive(Clone, Debug)]
pub struct XdsConfig {
    /// `host:port` or `https://host:port`; the host is what istiod's serving
    /// certificate is checked against.
    pub address: String,
    /// PEM root(s) istiod's serving certificate must chain to.
    pub root_cert: PathBuf,
    /// The bearer token file (audience `istio-ca`), re-read on every
    /// (re)connect because projected tokens rotate on disk.
    pub token_file: PathBuf,
    pub node: XdsNode,
    /// Limit for the TCP+TLS connection.
    pub connect_timeout: Duration,
    /// First and longest wait between reconnects (doubling, with jitter).
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// The largest response accepted; a larger one ends the stream with an
    /// error naming the limit (it cannot be NACKed: it was never read).
    pub max_message_bytes: usize,
}

impl XdsConfig {
    /// The defaults for everything but the three settings and the node.
    pub fn new(
        address: impl Into<String>,
        root_cert: PathBuf,
        token_file: PathBuf,
        node: XdsNode,
    ) -> Self {
        Self {
            address: address.into(),
            root_cert,
            token_file,
            node,
            connect_timeout: Duration::from_secs(5),
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            // Large meshes send every workload in the first response.
            max_message_bytes: 64 << 20,
        }
    }
}

/// What is wrong with one resource, and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("resource {resource:?}: {field}: {reason}")]
pub struct ResourceError {
    /// The xDS resource name (or `resources[i]` when it has none).
    pub resource: String,
    /// The field inside it, as a path (`addresses[0]`, `rules[1].clauses[0]`).
    pub field: String,
    pub reason: String,
}

/// A problem with one field, before the resource's name is attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FieldError {
    pub field: String,
    pub reason: String,
}

impl FieldError {
    pub(crate) fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn in_resource(self, resource: &str) -> ResourceError {
        ResourceError {
            resource: resource.to_owned(),
            field: self.field,
            reason: self.reason,
        }
    }

    /// Prefixes the field path (`waypoint` + `.address` …).
    pub(crate) fn under(mut self, parent: &str) -> Self {
        self.field = format!("{parent}.{}", self.field);
        self
    }
}

/// An IP address from its 4 or 16 network-order bytes.
pub(crate) fn ip_from_bytes(bytes: &[u8], field: impl Into<String>) -> Result<IpAddr, FieldError> {
    match bytes.len() {
        4 => Ok(IpAddr::from(<[u8; 4]>::try_from(bytes).unwrap_or_default())),
        16 => Ok(IpAddr::from(
            <[u8; 16]>::try_from(bytes).unwrap_or_default(),
        )),
        n => Err(FieldError::new(
            field,
            format!("{n} bytes; an IP address has 4 (IPv4) or 16 (IPv6)"),
        )),
    }
}

/// A port number that must fit 16 bits (and, unless `zero_ok`, not be 0).
pub(crate) fn port(value: u32, zero_ok: bool, field: impl Into<String>) -> Result<u16, FieldError> {
    match u16::try_from(value) {
        Ok(0) if !zero_ok => Err(FieldError::new(field, "port 0")),
        Ok(port) => Ok(port),
        Err(_) => Err(FieldError::new(
            field,
            format!("{value} is not a port (1-65535)"),
        )),
    }
}

/// The `Struct` metadata and `Node` istiod expects of a ztunnel.
pub(crate) fn node_message(node: &XdsNode) -> shunt_proto::envoy::config::core::v3::Node {
    use prost_types::{Struct, Value, value::Kind};
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    let fields = [
        ("NAME", node.pod_name.as_str()),
        ("NAMESPACE", node.pod_namespace.as_str()),
        ("INSTANCE_IPS", &node.ip.to_string()),
        ("NODE_NAME", node.node_name.as_str()),
        ("CLUSTER_ID", node.cluster_id.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), string(v)))
    .collect();
    shunt_proto::envoy::config::core::v3::Node {
        id: node.id(),
        cluster: String::new(),
        metadata: Some(Struct { fields }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_is_ztunnels() {
        let node = XdsNode {
            ip: "198.18.0.5".parse().expect("ip"),
            pod_name: "shunt-abcde".into(),
            pod_namespace: "istio-system".into(),
            node_name: "node-a".into(),
            cluster_id: "Kubernetes".into(),
        };
        assert_eq!(
            node.id(),
            "ztunnel~198.18.0.5~shunt-abcde.istio-system~istio-system.svc.cluster.local"
        );
        let message = node_message(&node);
        let metadata = message.metadata.expect("metadata");
        let names: Vec<&str> = metadata.fields.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "CLUSTER_ID",
                "INSTANCE_IPS",
                "NAME",
                "NAMESPACE",
                "NODE_NAME"
            ]
        );
    }

    #[test]
    fn addresses_and_ports_are_checked() {
        assert_eq!(
            ip_from_bytes(&[198, 18, 0, 1], "a").map(|ip| ip.to_string()),
            Ok("198.18.0.1".into())
        );
        assert!(ip_from_bytes(&[0; 16], "a").is_ok_and(|ip| ip.is_ipv6()));
        let err = ip_from_bytes(&[1, 2, 3, 4, 5], "addresses[0]").expect_err("5 bytes");
        assert_eq!(err.field, "addresses[0]");
        assert!(err.reason.starts_with("5 bytes"), "{}", err.reason);
        assert_eq!(port(80, false, "p"), Ok(80));
        assert_eq!(port(0, true, "p"), Ok(0));
        assert!(port(0, false, "p").is_err());
        assert!(port(70000, true, "p").is_err());
        assert_eq!(
            ResourceType::from_type_url(ADDRESS_TYPE_URL),
            Some(ResourceType::Address)
        );
        assert_eq!(ResourceType::from_type_url("type.googleapis.com/x"), None);
    }
}
