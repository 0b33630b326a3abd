//! The in-test istiod both peers talk to: one TLS port on 127.0.0.1 of a
//! netns serving delta ADS (`envoy.service.discovery.v3`) and Istio's CA
//! (`istio.v1.auth.IstioCertificateService`), rooted in the [`Pki`].
//!
//! Every stream gets the same [`Snapshot`]: on a type's first request, one
//! response with all of that type's resources (an empty one when there are
//! none: both peers wait for every type before they are ready), and, once
//! the first address response is answered, a second one with
//! [`Snapshot::then_addresses`] if any (a NACKed first response leaves
//! ztunnel unready until a later one is ACKed, as istiod's next push would).
//! The server records each peer's answers (ACK, or NACK with its message).

use std::{
    net::{SocketAddr, TcpListener},
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{Stream, StreamExt as _, channel::mpsc};
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::{
    envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
        aggregated_discovery_service_server::{
            AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
        },
    },
    istio::ca::{
        IstioCertificateRequest, IstioCertificateResponse,
        istio_certificate_service_server::{
            IstioCertificateService, IstioCertificateServiceServer,
        },
    },
};
use tonic::{
    Request, Response, Status, Streaming,
    transport::{Server, ServerTlsConfig, server::TcpIncoming},
};

use super::pki::{Pki, TOKEN};
use crate::{Result, TestbedError};

/// What the server sends every stream, per type.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub addresses: Vec<Resource>,
    pub authorizations: Vec<Resource>,
    /// A second address response, sent after the first is answered.
    pub then_addresses: Vec<Resource>,
    /// Send nothing until [`Istiod::release`] (istiod unreachable at
    /// first: the peer has had no xDS update yet).
    pub hold: bool,
}

/// Which response an answer is to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    Addresses,
    Authorizations,
    ThenAddresses,
}

/// A peer's answer to one response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub to: Sent,
    pub type_url: String,
    /// `None` for an ACK; the NACK's message otherwise.
    pub error: Option<String>,
}

struct Shared {
    snapshot: Snapshot,
    answers: Mutex<Vec<Answer>>,
    streams: AtomicU64,
    /// False while the snapshot is held.
    released: tokio::sync::watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running in-test istiod; stops when dropped.
pub struct Istiod {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Istiod {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Istiod {
    /// Serves `snapshot` on `listener` (bound on loopback of the netns the
    /// peer runs in). Must run inside a tokio runtime.
    pub fn serve(pki: &Pki, listener: TcpListener, snapshot: Snapshot) -> Result<Istiod> {
        let invalid = |what: &str, e: &dyn std::fmt::Display| {
            TestbedError::Invalid(format!("in-test istiod: {what}: {e}"))
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| invalid("non-blocking listener", &e))?;
        let addr = listener.local_addr().map_err(|e| invalid("address", &e))?;
        let listener =
            tokio::net::TcpListener::from_std(listener).map_err(|e| invalid("listener", &e))?;
        let released = tokio::sync::watch::Sender::new(!snapshot.hold);
        let shared = Arc::new(Shared {
            snapshot,
            answers: Mutex::default(),
            streams: AtomicU64::default(),
            released,
        });
        let server = Server::builder()
            .tls_config(ServerTlsConfig::new().identity(pki.serving_identity()?))
            .map_err(|e| invalid("TLS", &e))?
            .add_service(AggregatedDiscoveryServiceServer::new(Ads(shared.clone())))
            .add_service(IstioCertificateServiceServer::new(Ca(pki.clone())));
        let task = tokio::spawn(async move {
            if let Err(e) = server
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
            {
                crate::warn(format_args!("in-test istiod stopped: {e}"));
            }
        });
        Ok(Istiod { addr, shared, task })
    }

    /// Sends what a held snapshot kept back.
    pub fn release(&self) {
        self.shared.released.send_replace(true);
    }

    /// The answers received so far, in order.
    pub fn answers(&self) -> Vec<Answer> {
        lock(&self.shared.answers).clone()
    }

    /// Streams opened with the right token.
    pub fn streams(&self) -> u64 {
        self.shared.streams.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until the peer answered every response sent:
    /// (addresses, authorizations, the second address response's).
    pub async fn wait_for_answers(
        &self,
        timeout: Duration,
    ) -> Result<(Answer, Answer, Option<Answer>)> {
        let deadline = tokio::time::Instant::now() + timeout;
        let then = !self.shared.snapshot.then_addresses.is_empty();
        loop {
            let answers = self.answers();
            let of = |to: Sent| answers.iter().find(|a| a.to == to).cloned();
            if let (Some(a), Some(p), t) = (
                of(Sent::Addresses),
                of(Sent::Authorizations),
                of(Sent::ThenAddresses),
            ) && (t.is_some() || !then)
            {
                return Ok((a, p, t));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(TestbedError::Invalid(format!(
                    "no answer to both xDS types within {timeout:?} ({} streams; answers {answers:?})",
                    self.streams()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

type Outgoing = mpsc::UnboundedSender<std::result::Result<DeltaDiscoveryResponse, Status>>;

struct Ads(Arc<Shared>);

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn Stream<Item = std::result::Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> std::result::Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        check_token(&request)?;
        let shared = self.0.clone();
        let stream = shared.streams.fetch_add(1, Ordering::SeqCst) + 1;
        let (tx, rx) = mpsc::unbounded();
        let mut incoming = request.into_inner();
        tokio::spawn(async move {
            let mut sent: Vec<String> = Vec::new();
            let mut released = shared.released.subscribe();
            while let Some(Ok(request)) = incoming.next().await {
                // Held: the requests wait here (the sender lives as long
                // as `shared`, so this returns once released).
                let _ = released.wait_for(|r| *r).await;
                let snapshot = &shared.snapshot;
                if !request.response_nonce.is_empty() {
                    let to = match request.response_nonce.rsplit('-').next() {
                        Some("then") => Sent::ThenAddresses,
                        _ if request.type_url == ADDRESS_TYPE_URL => Sent::Addresses,
                        _ => Sent::Authorizations,
                    };
                    lock(&shared.answers).push(Answer {
                        to,
                        type_url: request.type_url.clone(),
                        error: request.error_detail.map(|s| s.message),
                    });
                    if to == Sent::Addresses && !snapshot.then_addresses.is_empty() {
                        let nonce = format!("Address-{stream}-then");
                        send(&tx, ADDRESS_TYPE_URL, nonce, &snapshot.then_addresses);
                    }
                } else if !sent.contains(&request.type_url) {
                    sent.push(request.type_url.clone());
                    let resources = match request.type_url.as_str() {
                        ADDRESS_TYPE_URL => &snapshot.addresses,
                        AUTHORIZATION_TYPE_URL => &snapshot.authorizations,
                        _ => &Vec::new(),
                    };
                    let short = request.type_url.rsplit('.').next().unwrap_or_default();
                    let nonce = format!("{short}-{stream}");
                    send(&tx, &request.type_url, nonce, resources);
                }
            }
        });
        Ok(Response::new(Box::pin(rx)))
    }
}

fn send(tx: &Outgoing, type_url: &str, nonce: String, resources: &[Resource]) {
    let response = DeltaDiscoveryResponse {
        system_version_info: nonce.clone(),
        type_url: type_url.into(),
        nonce,
        resources: resources.to_vec(),
        ..Default::default()
    };
    let _ = tx.unbounded_send(Ok(response));
}

fn check_token<T>(request: &Request<T>) -> std::result::Result<(), Status> {
    let authorization = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    if authorization == Some(format!("Bearer {TOKEN}").as_str()) {
        Ok(())
    } else {
        Err(Status::unauthenticated("authentication failure"))
    }
}

/// Istio's CA: signs the CSR for the identity asked (the impersonated
/// identity when given, else the CSR's URI SAN), answering leaf first,
/// root last.
struct Ca(Pki);

#[tonic::async_trait]
impl IstioCertificateService for Ca {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> std::result::Result<Response<IstioCertificateResponse>, Status> {
        check_token(&request)?;
        let body = request.into_inner();
        let cert_chain = self
            .0
            .sign_csr(&body.csr, body.validity_duration)
            .map_err(Status::invalid_argument)?;
        Ok(Response::new(IstioCertificateResponse { cert_chain }))
    }
}
