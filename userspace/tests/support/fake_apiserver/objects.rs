//! Objects as the API server would store them, for tests to `apply`: pods,
//! namespaces, services and their EndpointSlices, Istio's
//! `AuthorizationPolicy` and Gateway API `Gateway`s.

use serde_json::{Value, json};

/// A pod as the API server would serve it, on `node`, with `ip` (None: not
/// assigned yet) and `labels`.
pub fn pod(namespace: &str, name: &str, node: &str, ip: Option<&str>, labels: Value) -> Value {
    let mut pod = json!({
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "serviceAccountName": "sleep",
                 "containers": [{"name": "app", "image": "registry.invalid/app"}]},
        "status": {"phase": if ip.is_some() { "Running" } else { "Pending" }}
    });
    if let Some(ip) = ip {
        pod["status"]["podIP"] = json!(ip);
        pod["status"]["podIPs"] = json!([{"ip": ip}]);
    }
    pod
}

/// An `AuthorizationPolicy` with `spec`, as `kubectl apply` would store it.
pub fn authorization_policy(namespace: &str, name: &str, spec: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace, "generation": 1,
                     "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": spec
    })
}

/// A `Gateway` of class `class` with `labels` (a waypoint when the class
/// is `istio-waypoint`), as Istio's `istioctl waypoint apply` makes it.
pub fn gateway(namespace: &str, name: &str, class: &str, labels: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "generation": 1, "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {"gatewayClassName": class,
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}
    })
}

/// A namespace with `labels`.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({"metadata": {"name": name, "labels": labels}})
}

/// A `ClusterIP` service with `vip`, whose port 80 goes to the endpoints'
/// port named `http` (resolved by the EndpointSlice).
pub fn service(namespace: &str, name: &str, vip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip],
                 "ports": [{"name": "web", "port": 80, "protocol": "TCP", "targetPort": "http"}]}
    })
}

/// An EndpointSlice of `service`: each `(ip, ready, pod)` is one endpoint
/// listening on `port` for the service port `web`.
pub fn endpoint_slice(
    namespace: &str,
    name: &str,
    service: &str,
    port: u16,
    endpoints: &[(&str, bool, &str)],
) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready, pod)| {
            json!({"addresses": [ip], "conditions": {"ready": ready},
                   "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod}})
        })
        .collect();
    json!({
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "web", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}
