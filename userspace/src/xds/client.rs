//! The delta ADS stream to istiod, as ztunnel opens it.
//!
//! One gRPC stream (`envoy.service.discovery.v3.AggregatedDiscoveryService/
//! DeltaAggregatedResources`) over TLS verified against the mesh root, with
//! the node proxy's token as `authorization: Bearer …` (read from its file
//! on every connect: projected tokens rotate). The first request per type
//! carries the node (ztunnel's id and metadata) and a wildcard subscription
//! (no names: istiod treats the ztunnel types as wildcard, and would take a
//! literal `*` as a name to look up on demand), plus, after a reconnect,
//! `initial_resource_versions` so istiod sends only the difference.
//!
//! Each response is applied resource by resource ([`XdsState::apply`]) and
//! ACKed by nonce, or, when some resources were refused, NACKed with an
//! `error_detail` naming each refused resource
//! and field (the rest is applied; a refused resource keeps its last good
//! copy). When the stream ends the source
//! keeps everything it holds, waits (doubling, with jitter) and reconnects.

use std::{path::Path, sync::Arc, time::Duration};

use futures::channel::mpsc::UnboundedSender;
use shunt_proto::{
    envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse,
        aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
    },
    google::rpc::Status as RpcStatus,
};
use tonic::{
    metadata::AsciiMetadataValue,
    transport::{Certificate, ClientTlsConfig, Endpoint},
};
use tracing::{debug, info, warn};

use super::{
    ResourceType, SOURCE_NAME, XdsConfig,
    metrics::{Termination, XdsMetrics},
    node_message,
    state::{XdsState, XdsStatusHandle},
};
use crate::{control::SourceSink, identity::istio::error_chain};

/// google.rpc.Code INVALID_ARGUMENT, the code of every NACK.
const INVALID_ARGUMENT: i32 = 3;

/// Why the source cannot start (a setting that can never work).
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error("--xds-address {address:?}: {reason}")]
    Address { address: String, reason: String },
    #[error("--xds-root-cert {path}: {reason}")]
    RootCert {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("xDS TLS setup for {address}: {reason}")]
    Tls { address: String, reason: String },
}

/// The istiod discovery source. [`XdsSource::run`] never returns: istiod
/// being away is a state to wait out, not an error.
pub struct XdsSource {
    config: XdsConfig,
    address: String,
    endpoint: Endpoint,
    status: XdsStatusHandle,
    metrics: Arc<XdsMetrics>,
}

/// The channel's endpoint: TLS to `address` trusting only the roots in
/// `config.root_cert` as the file is now.
fn endpoint(config: &XdsConfig, address: &str) -> Result<Endpoint, XdsError> {
    let root_err = |reason: String| XdsError::RootCert {
        path: config.root_cert.clone(),
        reason,
    };
    let root_pem = std::fs::read(&config.root_cert).map_err(|e| root_err(e.to_string()))?;
    let blocks = pem::parse_many(&root_pem).map_err(|e| root_err(format!("not PEM: {e}")))?;
    if !blocks.iter().any(|b| b.tag() == "CERTIFICATE") {
        return Err(root_err("holds no CERTIFICATE block".into()));
    }
    // Only the mesh root: istiod's certificate is never a public one.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&root_pem))
        .timeout(config.connect_timeout);
    Ok(Endpoint::from_shared(address.to_owned())
        .map_err(|e| XdsError::Address {
            address: config.address.clone(),
            reason: error_chain(&e),
        })?
        .tls_config(tls)
        .map_err(|e| XdsError::Tls {
            address: address.to_owned(),
            reason: error_chain(&e),
        })?
        .connect_timeout(config.connect_timeout)
        // No request timeout: the stream lives as long as istiod keeps it.
        // Keep-alives notice a silently dead peer instead.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true))
}

impl XdsSource {
    /// Checks the address and root file and prepares the TLS channel; does
    /// not connect (the agent must start before istiod is reachable).
    pub fn new(config: XdsConfig) -> Result<Self, XdsError> {
        let address = normalize_address(&config.address)?;
        let endpoint = endpoint(&config, &address)?;
        let status = XdsStatusHandle::default();
        status.set(XdsState::new(&address, config.node.id()).status());
        Ok(Self {
            config,
            address,
            endpoint,
            status,
            metrics: Arc::default(),
        })
    }

    /// Records the stream's messages and ends in `metrics` (the agent's
    /// registry holds them) instead of a set of its own.
    pub fn with_metrics(self, metrics: Arc<XdsMetrics>) -> Self {
        Self { metrics, ..self }
    }

    /// The connection's and resources' status, kept current while running.
    pub fn status(&self) -> XdsStatusHandle {
        self.status.clone()
    }

    /// Streams from istiod forever, publishing to `sink`.
    pub async fn run(self, sink: Arc<dyn SourceSink>) {
        let mut state = XdsState::new(&self.address, self.config.node.id());
        let mut backoff = Backoff::new(self.config.backoff_initial, self.config.backoff_max);
        let mut synced_reported = false;
        loop {
            let end = self
                .stream_once(&mut state, sink.as_ref(), &mut synced_reported)
                .await;
            if end.progressed {
                backoff.reset();
            }
            let wait = backoff.next();
            self.metrics.terminated(end.reason);
            warn!(address = %self.address, error = %end.error, retry_in = ?wait,
                "xDS stream to istiod ended; everything received is kept until it is back");
            state.record_disconnected(end.error);
            self.status.set(state.status());
            tokio::time::sleep(wait).await;
        }
    }

    async fn stream_once(
        &self,
        state: &mut XdsState,
        sink: &dyn SourceSink,
        synced_reported: &mut bool,
    ) -> StreamEnd {
        let bearer = match read_bearer(&self.config.token_file) {
            Ok(bearer) => bearer,
            Err(error) => return StreamEnd::failed(error, Termination::Error),
        };
        // The root file as it is now (a root rotation reaches the next
        // connection, as the token does); the one read at start if it went
        // bad.
        let endpoint = endpoint(&self.config, &self.address).unwrap_or_else(|e| {
            warn!(error = %e, "the root file read at start is used for this connection");
            self.endpoint.clone()
        });
        let channel = match endpoint.connect().await {
            Ok(channel) => channel,
            Err(e) => {
                return StreamEnd::failed(
                    format!(
                        "cannot connect to istiod at {}: {}",
                        self.address,
                        error_chain(&e)
                    ),
                    Termination::ConnectionError,
                );
            }
        };
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(self.config.max_message_bytes);
        let (requests, outgoing) = futures::channel::mpsc::unbounded();
        let node = node_message(&self.config.node);
        for ty in ResourceType::ALL {
            let initial = DeltaDiscoveryRequest {
                node: Some(node.clone()),
                type_url: ty.type_url().to_owned(),
                initial_resource_versions: state.versions(ty),
                ..Default::default()
            };
            debug!(
                type_url = ty.type_url(),
                held = initial.initial_resource_versions.len(),
                "subscribing"
            );
            // The receiver is alive: it was just made.
            let _ = requests.unbounded_send(initial);
        }
        let mut request = tonic::Request::new(outgoing);
        request.metadata_mut().insert("authorization", bearer);
        let mut stream = match client.delta_aggregated_resources(request).await {
            Ok(response) => response.into_inner(),
            // As ztunnel (whose channel connects on this call): a stream
            // that does not open is a connection error, whatever its status.
            Err(status) => {
                return StreamEnd::failed(describe(&status), Termination::ConnectionError);
            }
        };
        state.record_connected();
        self.status.set(state.status());
        info!(address = %self.address, node = %self.config.node.id(), "xDS stream to istiod open");
        let mut progressed = false;
        loop {
            match stream.message().await {
                Ok(Some(response)) => {
                    progressed = true;
                    self.metrics.received(&response);
                    self.handle(response, state, sink, synced_reported, &requests);
                }
                Ok(None) => {
                    return StreamEnd {
                        error: "istiod closed the stream".into(),
                        progressed,
                        reason: Termination::Complete,
                    };
                }
                Err(status) => {
                    return StreamEnd {
                        error: describe(&status),
                        progressed,
                        reason: Termination::of_status(&status),
                    };
                }
            }
        }
    }

    /// Applies one response and answers it (ACK or NACK by its nonce).
    fn handle(
        &self,
        response: DeltaDiscoveryResponse,
        state: &mut XdsState,
        sink: &dyn SourceSink,
        synced_reported: &mut bool,
        requests: &UnboundedSender<DeltaDiscoveryRequest>,
    ) {
        let nonce = response.nonce.as_str();
        let type_url = response.type_url.as_str();
        let was_synced = state.synced();
        let nack = |state: &mut XdsState, reason: String| {
            state.record_nack(type_url, nonce, &reason);
            DeltaDiscoveryRequest {
                type_url: type_url.to_owned(),
                response_nonce: nonce.to_owned(),
                error_detail: Some(RpcStatus {
                    code: INVALID_ARGUMENT,
                    message: reason,
                    details: Vec::new(),
                }),
                ..Default::default()
            }
        };
        let answer = match state.apply(&response) {
            Ok(applied) => {
                // The type counts as received even when some resources
                // were refused: the rest is applied and serving.
                let reason = applied.nack_reason();
                match &reason {
                    None => state.record_ack(type_url, nonce, &response.system_version_info),
                    Some(_) => state.record_received(type_url),
                }
                debug!(
                    type_url,
                    nonce,
                    resources = applied.updated,
                    removed = applied.removed,
                    rejected = applied.rejected.len(),
                    changed = applied.changed,
                    "applied"
                );
                // Only complete views (both types received once): a view
                // of workloads without policies would serve inbound with
                // no policy (the proxy fails closed until the first one).
                // The first complete view whole, then only what changed.
                if state.synced() && !was_synced {
                    let (view, new_warnings) = state.view();
                    log_warnings(new_warnings);
                    sink.cluster(view);
                } else if state.synced() && applied.changed {
                    let (delta, new_warnings) = state.delta();
                    log_warnings(new_warnings);
                    if !delta.is_empty() {
                        sink.cluster_delta(delta);
                    }
                }
                if !*synced_reported && state.synced() {
                    *synced_reported = true;
                    info!("xDS synced: workloads, services and policies received from istiod");
                    sink.synced(SOURCE_NAME);
                }
                match reason {
                    None => DeltaDiscoveryRequest {
                        type_url: type_url.to_owned(),
                        response_nonce: nonce.to_owned(),
                        ..Default::default()
                    },
                    Some(reason) => {
                        warn!(type_url, nonce, %reason, "NACK: resources refused (each keeps its last good copy); the rest applied");
                        nack(state, reason)
                    }
                }
            }
            Err(rejected) => {
                let reason = rejected.to_string();
                warn!(type_url, nonce, %reason, "NACK: istiod's response not applied");
                nack(state, reason)
            }
        };
        // A closed request stream means the response stream ends too; the
        // loop sees that next.
        let _ = requests.unbounded_send(answer);
        self.status.set(state.status());
    }
}

/// How a stream ended, and whether it got anywhere (resets the back-off).
struct StreamEnd {
    error: String,
    progressed: bool,
    /// `istio_xds_connection_terminations_total`'s reason.
    reason: Termination,
}

impl StreamEnd {
    fn failed(error: String, reason: Termination) -> Self {
        Self {
            error,
            progressed: false,
            reason,
        }
    }
}

/// A gRPC status on one line, with its transport cause if any.
fn describe(status: &tonic::Status) -> String {
    match std::error::Error::source(status) {
        Some(cause) => format!(
            "{:?}: {}: {}",
            status.code(),
            status.message(),
            error_chain(cause)
        ),
        None => format!("{:?}: {}", status.code(), status.message()),
    }
}

/// `Bearer <token>` from the file as it is now. The token is a credential:
/// never logged, never in an error.
fn read_bearer(path: &Path) -> Result<AsciiMetadataValue, String> {
    let raw = std::fs::read(path).map_err(|e| format!("--xds-token {}: {e}", path.display()))?;
    let invalid = |reason: &str| format!("--xds-token {}: {reason}", path.display());
    let token = std::str::from_utf8(&raw)
        .map_err(|_| invalid("not UTF-8 text"))?
        .trim();
    if token.is_empty() {
        return Err(invalid("empty"));
    }
    AsciiMetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| invalid("contains characters not allowed in a header"))
}

/// `https://host:port` from `host:port` or a URL. Plain http is refused:
/// the token would cross the network in the clear.
fn normalize_address(address: &str) -> Result<String, XdsError> {
    let err = |reason: String| XdsError::Address {
        address: address.to_owned(),
        reason,
    };
    let trimmed = address.trim();
    if trimmed.is_empty() {
        return Err(err("empty".into()));
    }
    let url = if trimmed.contains("://") {
        trimmed.to_owned()
    } else {
        format!("https://{trimmed}")
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| err(e.to_string()))?;
    if uri.scheme_str() != Some("https") {
        return Err(err(
            "only https is supported (the token must not travel in the clear)".into(),
        ));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(err("no host".into()));
    }
    if uri.port_u16().is_none() {
        return Err(err("no port (istiod serves xDS on 15012)".into()));
    }
    Ok(url)
}

/// Doubling waits between reconnects, each drawn from [½, 1] of the current
/// step so that a fleet of agents does not reconnect in lockstep after an
/// istiod restart.
struct Backoff {
    initial: Duration,
    max: Duration,
    step: Duration,
    random: ring::rand::SystemRandom,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            step: initial,
            random: ring::rand::SystemRandom::new(),
        }
    }

    fn reset(&mut self) {
        self.step = self.initial;
    }

    fn next(&mut self) -> Duration {
        use ring::rand::SecureRandom as _;
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let mut bytes = [0u8; 2];
        // Without randomness the wait is the full step: still bounded.
        let fraction = match self.random.fill(&mut bytes) {
            Ok(()) => f64::from(u16::from_le_bytes(bytes)) / f64::from(u16::MAX),
            Err(_) => 1.0,
        };
        step.mul_f64(0.5 + fraction / 2.0)
    }
}

fn log_warnings(warnings: Vec<String>) {
    for warning in warnings {
        warn!(%warning, "xDS resources refer to something istiod has not sent");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            normalize_address("istiod.istio-system.svc:15012").expect("bare"),
            "https://istiod.istio-system.svc:15012"
        );
        for bad in ["", "http://istiod:15010", "istiod", "https://:15012"] {
            assert!(normalize_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_max() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let waits: Vec<Duration> = (0..5).map(|_| b.next()).collect();
        let steps = [100, 200, 400, 400, 400];
        for (wait, step) in waits.iter().zip(steps) {
            let step = Duration::from_millis(step);
            assert!(
                *wait >= step / 2 && *wait <= step,
                "{wait:?} not in [{:?}, {step:?}]",
                step / 2
            );
        }
        b.reset();
        assert!(b.next() <= Duration::from_millis(100));
    }
}
