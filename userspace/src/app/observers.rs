//! The observers' endpoints: the admin API, `/metrics` and
//! `/healthz/ready`, bound and served from the reconciler's snapshots.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, RwLock},
};

use tracing::{Instrument as _, info_span};

use super::AgentError;
use crate::{snapshot::SnapshotReader, store::WorkloadStore};

/// Where the observers listen.
#[derive(Clone, Copy, Debug)]
pub struct ObserverAddrs {
    /// The admin API (`--admin-addr`).
    pub admin: SocketAddr,
    /// `/metrics` (`--metrics-addr`).
    pub metrics: SocketAddr,
    /// `/healthz/ready` (`--readiness-addr`).
    pub readiness: SocketAddr,
}

/// What the admin API, `/metrics` and `/healthz/ready` read: the
/// reconciler's snapshots, the workload store, the metrics registry, the pin
/// dir. Nothing here reaches the reconciler.
pub struct Observers {
    pub reader: SnapshotReader,
    /// Every workload the proxy knows (absent without the builtin proxy).
    pub store: Option<Arc<RwLock<WorkloadStore>>>,
    pub metrics: crate::metrics::Metrics,
    pub bpf_pin_dir: PathBuf,
}

impl Observers {
    /// Binds the three endpoints and serves them in the background; returns
    /// the addresses bound (port 0 picks a free one).
    pub async fn serve(self, addrs: ObserverAddrs) -> Result<ObserverAddrs, AgentError> {
        let listener = tokio::net::TcpListener::bind(addrs.admin)
            .await
            .map_err(|source| AgentError::Admin {
                addr: addrs.admin,
                source,
            })?;
        let admin = local_addr(&listener, "admin", addrs.admin)?;
        let admin_state = crate::admin::AdminState {
            reader: self.reader.clone(),
            store: self.store,
            bpf_pin_dir: self.bpf_pin_dir,
            fast_path: self.metrics.fast_path().clone(),
        };
        tokio::spawn(crate::admin::serve(listener, admin_state).instrument(info_span!("admin")));

        let listener = bind("metrics", addrs.metrics).await?;
        let metrics = local_addr(&listener, "metrics", addrs.metrics)?;
        let serve = crate::metrics::serve(listener, self.reader.clone(), self.metrics);
        tokio::spawn(serve.instrument(info_span!("metrics")));

        let listener = bind("readiness", addrs.readiness).await?;
        let readiness = local_addr(&listener, "readiness", addrs.readiness)?;
        tokio::spawn(
            crate::health::serve(listener, self.reader).instrument(info_span!("readiness")),
        );
        Ok(ObserverAddrs {
            admin,
            metrics,
            readiness,
        })
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, AgentError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AgentError::Serve { what, addr, source })
}

fn local_addr(
    listener: &tokio::net::TcpListener,
    what: &'static str,
    addr: SocketAddr,
) -> Result<SocketAddr, AgentError> {
    listener
        .local_addr()
        .map_err(|source| AgentError::Serve { what, addr, source })
}
