//! Waypoint `Gateway`s (`gateway.networking.k8s.io/v1`, class
//! `istio-waypoint`) from the Kubernetes API, for cluster discovery's
//! waypoint decisions ([`super::waypoints`]).
//!
//! A cluster-wide kube-rs watcher (list, then watch; the backoff, relist
//! and last-complete-view rules of the other watches) feeds a cache of
//! each Gateway's name, namespace and `istio.io/waypoint-for`; Gateways of
//! another class are kept as `None` (they are not waypoints).
//!
//! The Gateway API may not be installed: while the API server answers 404
//! (the CRD is not served) the agent runs without waypoints, says so once,
//! and kube-rs keeps retrying the list with its backoff; a 403 (a
//! ClusterRole without `gateways`) is said once likewise. Neither holds
//! back readiness or discovery (as `AuthorizationPolicy`, see
//! [`super::policy`]).

use std::{borrow::Cow, sync::Arc};

use ::kube::{Client, Resource};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use tracing::warn;

use super::{
    SourceStats,
    optional_crd::{OptionalCrd, OptionalCrdWatch},
};
use crate::control::waypoint::{
    WAYPOINT_FOR_LABEL, WAYPOINT_GATEWAY_CLASS, WaypointFor, WaypointGateway,
};

/// The API group, version and resource (plural) watched. The manifest test
/// (`xtask/tests/deploy_manifests.rs`) reads `GROUP` and `PLURAL` to check
/// the ClusterRole grants them.
pub const GROUP: &str = "gateway.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const PLURAL: &str = "gateways";
pub const KIND: &str = "Gateway";

/// A `Gateway` as far as waypoints need it: its metadata (name, namespace,
/// labels; the watcher's resource versions) and its class. Other fields
/// are ignored.
#[derive(Clone, Debug, Deserialize)]
pub struct GatewayObject {
    metadata: ObjectMeta,
    #[serde(default)]
    spec: GatewaySpec,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GatewaySpec {
    #[serde(default)]
    gateway_class_name: String,
}

impl Resource for GatewayObject {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Why a Gateway was skipped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("it has no {0}")]
pub struct MissingField(&'static str);

/// The waypoint a Gateway is, if its class is `istio-waypoint`. An
/// unknown `istio.io/waypoint-for` is logged and read as the default
/// (`service`), as istiod does.
pub(crate) fn waypoint_of(
    gateway: &GatewayObject,
) -> Result<Option<WaypointGateway>, MissingField> {
    let meta = &gateway.metadata;
    let name = meta.name.clone().ok_or(MissingField("name"))?;
    let namespace = meta.namespace.clone().ok_or(MissingField("namespace"))?;
    if gateway.spec.gateway_class_name != WAYPOINT_GATEWAY_CLASS {
        return Ok(None);
    }
    let label = meta.labels.as_ref().and_then(|l| l.get(WAYPOINT_FOR_LABEL));
    let waypoint_for = match label.map(|value| value.parse::<WaypointFor>()) {
        None => WaypointFor::default(),
        Some(Ok(value)) => value,
        Some(Err(e)) => {
            warn!(gateway = %format!("{namespace}/{name}"), label = WAYPOINT_FOR_LABEL, "{e}; read as service");
            WaypointFor::default()
        }
    };
    Ok(Some(WaypointGateway {
        namespace,
        name,
        waypoint_for,
    }))
}

/// The Gateway API's `Gateway` CRD, for [`OptionalCrdWatch`].
static CRD: OptionalCrd = OptionalCrd {
    resource: "gateways.gateway.networking.k8s.io",
    crd: "Gateway API CRD (gateway.networking.k8s.io/v1 Gateway)",
    without: "waypoints from Kubernetes",
    served: "waypoint Gateways apply",
    watch: "gateways",
    cache: "gateway",
};

/// The `Gateway` watch of cluster discovery.
pub(crate) type GatewayWatch = OptionalCrdWatch<GatewayObject, WaypointGateway, MissingField>;

impl GatewayWatch {
    pub(crate) fn new(client: &Client, stats: Arc<SourceStats>) -> Self {
        Self::watch(&CRD, client, stats, waypoint_of)
    }

    /// The waypoint Gateways: none while the CRD is not served.
    pub(crate) fn waypoints(&self) -> Vec<WaypointGateway> {
        self.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gateway(class: &str, labels: serde_json::Value) -> GatewayObject {
        serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "wp", "namespace": "shop", "labels": labels},
            "spec": {"gatewayClassName": class,
                     "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
        }))
        .expect("a Gateway")
    }

    #[test]
    fn the_crd_is_named_as_rbac_grants_it() {
        assert_eq!(CRD.resource, format!("{PLURAL}.{GROUP}"));
        assert_eq!(
            CRD.crd,
            format!("Gateway API CRD ({GROUP}/{VERSION} {KIND})")
        );
    }

    #[test]
    fn only_istio_waypoint_gateways_are_waypoints() {
        let got = waypoint_of(&gateway("istio-waypoint", json!(null))).expect("usable");
        assert_eq!(
            got,
            Some(WaypointGateway {
                namespace: "shop".into(),
                name: "wp".into(),
                waypoint_for: WaypointFor::Service,
            })
        );
        let all = waypoint_of(&gateway(
            "istio-waypoint",
            json!({"istio.io/waypoint-for": "all"}),
        ));
        assert_eq!(
            all.ok().flatten().map(|w| w.waypoint_for),
            Some(WaypointFor::All)
        );
        let odd = waypoint_of(&gateway(
            "istio-waypoint",
            json!({"istio.io/waypoint-for": "everything"}),
        ));
        assert_eq!(
            odd.ok().flatten().map(|w| w.waypoint_for),
            Some(WaypointFor::Service),
            "an unknown value reads as the default"
        );
        assert_eq!(waypoint_of(&gateway("istio", json!(null))), Ok(None));
        assert_eq!(
            GatewayObject::url_path(&(), None),
            "/apis/gateway.networking.k8s.io/v1/gateways"
        );
    }
}
