//! Kubernetes objects as the watch delivers them: JSON, each object parsed
//! on its own ([`Lenient`]), then read for what the agent needs (pods,
//! namespaces, services, endpoint slices); and AuthorizationPolicy objects
//! as the CRD translator reads them.

use k8s_openapi::api::{
    core::v1::{Namespace, Pod, Service},
    discovery::v1::EndpointSlice,
};
use proptest::prelude::*;

use super::{edits, mutate};
use crate::{
    authz::crd,
    control::kube::{
        Lenient,
        pod::{NamespaceFacts, PodFacts},
        service::{ServiceFacts, SliceFacts},
    },
};

const POD: &str = r#"{"apiVersion":"v1","kind":"Pod",
 "metadata":{"name":"web-0","namespace":"prod","uid":"1111-2222","resourceVersion":"7",
  "labels":{"istio.io/dataplane-mode":"ambient","app":"web"},
  "annotations":{"shunt.io/splice":"on","ambient.istio.io/redirection":"enabled"}},
 "spec":{"nodeName":"node-a","serviceAccountName":"web","hostNetwork":false,
  "containers":[{"name":"app","image":"web"}]},
 "status":{"phase":"Running","podIP":"198.18.1.2","podIPs":[{"ip":"198.18.1.2"},{"ip":"fd00::2"}]}}"#;

const NAMESPACE: &str = r#"{"apiVersion":"v1","kind":"Namespace",
 "metadata":{"name":"prod","labels":{"istio.io/dataplane-mode":"ambient"}}}"#;

const SERVICE: &str = r#"{"apiVersion":"v1","kind":"Service",
 "metadata":{"name":"web","namespace":"prod","uid":"3333"},
 "spec":{"type":"ClusterIP","clusterIP":"198.19.100.1","clusterIPs":["198.19.100.1","fd00::100:1"],
  "ports":[{"name":"http","port":80,"targetPort":8080,"protocol":"TCP"},
           {"name":"grpc","port":9090,"targetPort":"grpc","protocol":"TCP"}]}}"#;

const SLICE: &str = r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
 "metadata":{"name":"web-abc","namespace":"prod","labels":{"kubernetes.io/service-name":"web"}},
 "addressType":"IPv4",
 "ports":[{"name":"http","port":8080,"protocol":"TCP"}],
 "endpoints":[{"addresses":["198.18.1.2"],"conditions":{"ready":true},
   "targetRef":{"kind":"Pod","name":"web-0","namespace":"prod"}},
  {"addresses":["198.18.1.3"],"conditions":{"ready":false}}]}"#;

const POLICY: &str = r#"apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: allow-sleep
  namespace: prod
spec:
  selector:
    matchLabels:
      app: web
  action: DENY
  rules:
    - from:
        - source:
            principals: ["cluster.local/ns/default/sa/sleep"]
            notIpBlocks: ["198.18.0.0/16", "fd00::/8"]
            namespaces: ["default"]
      to:
        - operation:
            ports: ["8080", "9090"]
      when:
        - key: source.ip
          values: ["198.18.1.0/24"]
"#;

#[test]
fn the_seeds_are_valid() {
    let pod: Lenient<Pod> = serde_json::from_str(POD).expect("pod");
    PodFacts::from_pod(pod.parsed().expect("parsed")).expect("facts");
    let ns: Lenient<Namespace> = serde_json::from_str(NAMESPACE).expect("namespace");
    NamespaceFacts::from_namespace(ns.parsed().expect("parsed")).expect("facts");
    let service: Lenient<Service> = serde_json::from_str(SERVICE).expect("service");
    assert!(
        ServiceFacts::from_service(service.parsed().expect("parsed"))
            .expect("facts")
            .is_some()
    );
    let slice: Lenient<EndpointSlice> = serde_json::from_str(SLICE).expect("slice");
    assert!(
        SliceFacts::from_slice(slice.parsed().expect("parsed"))
            .expect("facts")
            .is_some()
    );
    let policy: serde_yaml::Value = serde_yaml::from_str(POLICY).expect("policy");
    crd::translate(&policy, "default").expect("translates");
}

/// What the watch does with one object's bytes: broken JSON fails the
/// event (kube-rs retries the watch); anything else is an object, parsed
/// or kept as malformed with whatever names it.
fn watched<K>(bytes: &[u8]) -> Option<Result<K, String>>
where
    K: ::kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned + Clone,
{
    let lenient: Lenient<K> = serde_json::from_slice(bytes).ok()?;
    Some(match lenient.parsed() {
        Ok(k) => Ok(k.clone()),
        Err(malformed) => Err(malformed.to_string()),
    })
}

proptest! {
    #[test]
    fn a_mutated_pod_is_read_or_refused_by_name(edits in edits()) {
        let bytes = mutate(POD.as_bytes(), &edits);
        match watched::<Pod>(&bytes) {
            None => {}
            Some(Err(malformed)) => prop_assert!(!malformed.is_empty()),
            Some(Ok(pod)) => if let Err(e) = PodFacts::from_pod(&pod) {
                prop_assert!(e.to_string().starts_with("it has no "), "{e}");
            },
        }
    }

    #[test]
    fn a_mutated_namespace_is_read_or_refused_by_name(edits in edits()) {
        let bytes = mutate(NAMESPACE.as_bytes(), &edits);
        if let Some(Ok(ns)) = watched::<Namespace>(&bytes)
            && let Err(e) = NamespaceFacts::from_namespace(&ns)
        {
            prop_assert!(e.to_string().contains("name"), "{e}");
        }
    }

    #[test]
    fn a_mutated_service_is_read_or_refused_by_field(edits in edits()) {
        let bytes = mutate(SERVICE.as_bytes(), &edits);
        if let Some(Ok(service)) = watched::<Service>(&bytes)
            && let Err(e) = ServiceFacts::from_service(&service)
        {
            let text = e.to_string();
            prop_assert!(text.contains("spec.") || text.contains("ports") || text.contains("cluster"), "{text}");
        }
    }

    #[test]
    fn a_mutated_endpoint_slice_is_read_or_refused_by_field(edits in edits()) {
        let bytes = mutate(SLICE.as_bytes(), &edits);
        if let Some(Ok(slice)) = watched::<EndpointSlice>(&bytes)
            && let Err(e) = SliceFacts::from_slice(&slice)
        {
            let text = e.to_string();
            prop_assert!(text.contains("endpoints.") || text.contains("ports."), "{text}");
        }
    }

    /// A policy that does not translate names itself and the field, and
    /// says what stands in for it (fail closed), never half of it.
    #[test]
    fn a_mutated_policy_translates_or_is_refused_by_field(edits in edits()) {
        let bytes = mutate(POLICY.as_bytes(), &edits);
        let Ok(value) = serde_yaml::from_slice::<serde_yaml::Value>(&bytes) else { return Ok(()) };
        if let Err(e) = crd::translate(&value, "default") {
            prop_assert!(!e.policy.is_empty(), "unnamed policy: {e}");
            prop_assert!(!e.message.is_empty(), "no message: {e}");
        }
    }
}
