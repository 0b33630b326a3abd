//! The `baggage` header of an inbound CONNECT: what the source's proxy
//! says about the source workload, parsed exactly as ztunnel's inbound
//! does (its `baggage.rs`). The destination's Istio metrics take their
//! source labels from it when the source is not known by its address (a
//! client behind a gateway or on another network, a waypoint not in the
//! store); a workload known by the connection's source IP overrides it
//! (ztunnel: "source is more reliable"). See `metrics::istio_tcp`.

use http::{HeaderMap, HeaderValue};

/// The header's name.
pub const BAGGAGE: &str = "baggage";

/// What a `baggage` header says (every value optional: absent, or given
/// empty).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Baggage {
    /// `k8s.cluster.name`
    pub cluster_id: Option<String>,
    /// `k8s.namespace.name`
    pub namespace: Option<String>,
    /// `k8s.deployment.name`, `k8s.cronjob.name`, `k8s.pod.name` or
    /// `k8s.job.name` (the last one given wins).
    pub workload_name: Option<String>,
    /// `service.name`: the canonical service (the `app` of the metrics).
    pub service_name: Option<String>,
    /// `service.version`: the canonical revision.
    pub revision: Option<String>,
    /// `cloud.region`
    pub region: Option<String>,
    /// `cloud.availability_zone`
    pub zone: Option<String>,
}

impl Baggage {
    /// Every `baggage` value of `headers`, as ztunnel reads them: each
    /// value split on `,`, each item on `=`; unknown keys ignored; an empty
    /// value is absent. A value that is not visible ASCII makes the whole
    /// baggage empty (never an error for the connection).
    pub fn from_headers(headers: &HeaderMap) -> Self {
        Self::parse(headers.get_all(BAGGAGE).iter()).unwrap_or_default()
    }

    fn parse<'a>(values: impl Iterator<Item = &'a HeaderValue>) -> Option<Self> {
        let mut baggage = Baggage::default();
        for value in values {
            let value = value.to_str().ok()?;
            for item in value.split(',') {
                let mut parts = item.split('=');
                let (Some(key), Some(value)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let value = Some(value).filter(|v| !v.is_empty()).map(str::to_owned);
                match key {
                    "k8s.cluster.name" => baggage.cluster_id = value,
                    "k8s.namespace.name" => baggage.namespace = value,
                    "k8s.deployment.name"
                    | "k8s.cronjob.name"
                    | "k8s.pod.name"
                    | "k8s.job.name" => baggage.workload_name = value,
                    "service.name" => baggage.service_name = value,
                    "service.version" => baggage.revision = value,
                    "cloud.region" => baggage.region = value,
                    "cloud.availability_zone" => baggage.zone = value,
                    _ => {}
                }
            }
        }
        Some(baggage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for v in values {
            map.append(BAGGAGE, HeaderValue::from_bytes(v).expect("test header"));
        }
        map
    }

    fn full() -> Baggage {
        Baggage {
            cluster_id: Some("K1".into()),
            namespace: Some("NS1".into()),
            workload_name: Some("N1".into()),
            service_name: Some("N2".into()),
            revision: Some("V1".into()),
            region: None,
            zone: None,
        }
    }

    #[test]
    fn every_key_ztunnel_reads_is_read() {
        let got = Baggage::from_headers(&headers(&[
            b"k8s.cluster.name=K1,k8s.namespace.name=NS1,k8s.deployment.name=N1,service.name=N2,service.version=V1",
        ]));
        assert_eq!(got, full());
        let got = Baggage::from_headers(&headers(&[
            b"k8s.pod.name=p,cloud.region=r1,cloud.availability_zone=z1,unknown.key=x,novalue",
        ]));
        assert_eq!(
            got,
            Baggage {
                workload_name: Some("p".into()),
                region: Some("r1".into()),
                zone: Some("z1".into()),
                ..Baggage::default()
            }
        );
        for key in ["k8s.cronjob.name", "k8s.job.name"] {
            let value = format!("{key}=w");
            let got = Baggage::from_headers(&headers(&[value.as_bytes()]));
            assert_eq!(got.workload_name.as_deref(), Some("w"), "{key}");
        }
    }

    #[test]
    fn empty_values_are_absent() {
        let got = Baggage::from_headers(&headers(&[
            b"k8s.cluster.name=,k8s.namespace.name=,k8s.deployment.name=,service.name=,service.version=",
        ]));
        assert_eq!(got, Baggage::default());
    }

    #[test]
    fn several_header_lines_are_read_together() {
        let got = Baggage::from_headers(&headers(&[
            b"k8s.cluster.name=K1,k8s.namespace.name=NS1",
            b"k8s.deployment.name=N1,service.name=N2,service.version=V1",
        ]));
        assert_eq!(got, full());
    }

    #[test]
    fn no_header_is_an_empty_baggage() {
        assert_eq!(Baggage::from_headers(&HeaderMap::new()), Baggage::default());
    }

    #[test]
    fn a_value_that_is_not_visible_ascii_empties_the_baggage() {
        let got = Baggage::from_headers(&headers(&[
            b"k8s.cluster.name=K1",
            b"k8s.namespace.name=caf\xc3\xa9",
        ]));
        assert_eq!(got, Baggage::default());
    }
}
