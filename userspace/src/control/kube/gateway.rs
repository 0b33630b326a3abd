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

use ::kube::{
    Api, Client, Resource,
    runtime::{WatchStreamExt as _, watcher},
};
use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use tracing::{debug, info, warn};

use super::{SourceStats, Step, apply_event, cache::ObjectCache, lenient::Lenient, policy};
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

/// The `Gateway` watch of cluster discovery.
pub(crate) struct GatewayWatch {
    events: BoxStream<'static, Result<watcher::Event<Lenient<GatewayObject>>, watcher::Error>>,
    gateways: ObjectCache<Option<WaypointGateway>>,
    /// The API server answers 404: the CRD is not installed.
    absent: bool,
    /// The API server answered 403 (said once).
    forbidden: bool,
    /// The watch failed at least once: discovery does not wait for it.
    failed: bool,
    stats: Arc<SourceStats>,
}

impl GatewayWatch {
    pub(crate) fn new(client: &Client, stats: Arc<SourceStats>) -> Self {
        Self {
            events: watcher(Api::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .boxed(),
            gateways: ObjectCache::new("gateway"),
            absent: false,
            forbidden: false,
            failed: false,
            stats,
        }
    }

    /// Whether the first cluster view may go out: the Gateways are listed,
    /// or known not to come (see `PolicyWatch::settled`).
    pub(crate) fn settled(&self) -> bool {
        self.gateways.listed() || self.absent || self.forbidden || self.failed
    }

    /// The waypoint Gateways: none while the CRD is not served.
    pub(crate) fn waypoints(&self) -> Vec<WaypointGateway> {
        if self.absent {
            return Vec::new();
        }
        self.gateways.values().flatten().cloned().collect()
    }

    /// Waits for the next event of the watch and applies it.
    /// Cancel-safe: an event is applied as soon as it is received.
    pub(crate) async fn step(&mut self) -> Step {
        let event = self.events.next().await;
        let before = self.settled();
        let mut revived = false;
        match &event {
            Some(Err(error)) => {
                self.failed = true;
                match policy::api_code(error) {
                    Some(404) => return self.not_served(before),
                    Some(403) if !self.forbidden => {
                        self.forbidden = true;
                        warn!(
                            "the agent may not list {PLURAL}.{GROUP} (403): running without \
                             waypoints from Kubernetes; grant list and watch on them \
                             (deploy/base/rbac.yaml)"
                        );
                        return Step::Changed;
                    }
                    _ => {}
                }
            }
            Some(Ok(watcher::Event::InitDone)) if self.absent || self.forbidden => {
                info!("{PLURAL}.{GROUP} is served now: waypoint Gateways apply");
                self.absent = false;
                self.forbidden = false;
                revived = true;
            }
            _ => {}
        }
        let step = apply_event(
            "gateways",
            event,
            &mut self.gateways,
            waypoint_of,
            &self.stats,
        );
        match step {
            Step::Unchanged if revived || (!before && self.settled()) => Step::Changed,
            step => step,
        }
    }

    /// A 404: the Gateway API is not installed (or was removed, with its
    /// objects).
    fn not_served(&mut self, was_settled: bool) -> Step {
        if self.absent {
            debug!("{PLURAL}.{GROUP} still not served; retrying after a backoff");
            return Step::Unchanged;
        }
        let had = !self.waypoints().is_empty();
        self.absent = true;
        info!(
            "the Gateway API CRD ({GROUP}/{VERSION} {KIND}) is not installed: running without \
             waypoints from Kubernetes; retrying the list with a backoff (up to 30 s)"
        );
        if had || !was_settled {
            Step::Changed
        } else {
            Step::Unchanged
        }
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
