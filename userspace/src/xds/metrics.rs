//! The xDS stream's metrics, under ztunnel's names and labels (Istio's
//! ztunnel dashboard and alerts read them): `istio_xds_message_total` and
//! `istio_xds_message_bytes_total` by `url` (the response's type URL; the
//! bytes are its resources' encoded sizes), and
//! `istio_xds_connection_terminations_total` by `reason`, classified as
//! ztunnel classifies a stream's end ([`Termination::of_status`]).

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue},
    metrics::{counter::Counter, family::Family},
    registry::{Registry, Unit},
};
use shunt_proto::envoy::service::discovery::v3::DeltaDiscoveryResponse;

/// Why a stream to istiod ended (ztunnel's `ConnectionTerminationReason`,
/// spelled as its label values).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Termination {
    /// istiod could not be reached (or the stream not opened).
    ConnectionError,
    /// A gRPC status that is not a routine reconnect.
    Error,
    /// istiod (or its proxy) ended the stream as a restart or a max
    /// connection age does.
    Reconnect,
    /// istiod closed the stream cleanly.
    Complete,
}

impl Termination {
    /// As ztunnel reads a gRPC status the stream ended with: `Unknown`,
    /// `Cancelled`, `DeadlineExceeded`, and `Unavailable` saying the
    /// transport is closing or a GOAWAY came first, are routine.
    pub fn of_status(status: &tonic::Status) -> Self {
        use tonic::Code;
        let routine = match status.code() {
            Code::Unknown | Code::Cancelled | Code::DeadlineExceeded => true,
            Code::Unavailable => {
                status.message().contains("transport is closing")
                    || status.message().contains("received prior goaway")
            }
            _ => false,
        };
        if routine {
            Termination::Reconnect
        } else {
            Termination::Error
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: Termination,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UrlLabel {
    url: String,
}

/// Cheap to share (`Arc`); the families synchronise themselves.
#[derive(Debug, Default)]
pub struct XdsMetrics {
    terminations: Family<ReasonLabel, Counter>,
    messages: Family<UrlLabel, Counter>,
    message_bytes: Family<UrlLabel, Counter>,
}

impl XdsMetrics {
    /// Registers them in `istio` (the registry with Istio's prefix).
    pub fn register(&self, istio: &mut Registry) {
        istio.register(
            "xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            self.terminations.clone(),
        );
        istio.register(
            "xds_message",
            "Total number of messages received (unstable)",
            self.messages.clone(),
        );
        istio.register_with_unit(
            "xds_message",
            "Total number of bytes received (unstable)",
            Unit::Bytes,
            self.message_bytes.clone(),
        );
    }

    /// A stream ended.
    pub fn terminated(&self, reason: Termination) {
        self.terminations
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A response arrived (counted before it is applied, as ztunnel does).
    pub fn received(&self, response: &DeltaDiscoveryResponse) {
        let url = UrlLabel {
            url: response.type_url.clone(),
        };
        self.messages.get_or_create(&url).inc();
        let bytes: usize = response
            .resources
            .iter()
            .filter_map(|r| r.resource.as_ref())
            .map(|any| any.value.len())
            .sum();
        self.message_bytes.get_or_create(&url).inc_by(bytes as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ends_are_classified_as_ztunnel_classifies_them() {
        let cases = [
            (tonic::Status::unknown("x"), Termination::Reconnect),
            (tonic::Status::cancelled("x"), Termination::Reconnect),
            (
                tonic::Status::deadline_exceeded("x"),
                Termination::Reconnect,
            ),
            (
                tonic::Status::unavailable("error reading: transport is closing"),
                Termination::Reconnect,
            ),
            (
                tonic::Status::unavailable("received prior goaway: code: NO_ERROR"),
                Termination::Reconnect,
            ),
            (
                tonic::Status::unavailable("istiod is restarting"),
                Termination::Error,
            ),
            (tonic::Status::unauthenticated("x"), Termination::Error),
            (tonic::Status::internal("x"), Termination::Error),
        ];
        for (status, expected) in cases {
            assert_eq!(Termination::of_status(&status), expected, "{status:?}");
        }
    }

    #[test]
    fn the_exposition_uses_ztunnels_names() {
        use prost_types::Any;
        let metrics = XdsMetrics::default();
        let mut registry = Registry::default();
        metrics.register(registry.sub_registry_with_prefix("istio"));
        metrics.terminated(Termination::Error);
        metrics.received(&DeltaDiscoveryResponse {
            type_url: "type.googleapis.com/istio.workload.Address".into(),
            resources: vec![shunt_proto::envoy::service::discovery::v3::Resource {
                resource: Some(Any {
                    type_url: String::new(),
                    value: vec![0; 12],
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "istio_xds_connection_terminations_total{reason=\"Error\"} 1",
            "istio_xds_message_total{url=\"type.googleapis.com/istio.workload.Address\"} 1",
            "istio_xds_message_bytes_total{url=\"type.googleapis.com/istio.workload.Address\"} 12",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
