//! The ZDS server: every ztunnel connection is kept, as istio-cni keeps
//! them, and the newest is served. A second ztunnel (a surge or revisioned
//! upgrade) gets its snapshot while the first keeps its own untouched: no
//! connection is closed because another came, so neither reconnects to
//! evict the other. The newest connection gets the adds and alone writes
//! ztunnel's answers; dels go to every connection that has the pod (as
//! istio-cni broadcasts them). When the newest closes, the newest left
//! takes over and is brought up to date (`session.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::Duration,
};

use tokio::{sync::watch, task::JoinSet};
use tracing::{Instrument as _, error, info, info_span, warn};

use super::{
    Answers, Wanted, ZdsConfig,
    session::{self, SessionError},
    socket::{SeqpacketConn, SeqpacketListener, SocketError},
};

/// Serves ZDS on its socket until dropped.
pub struct ZdsServer {
    listener: SeqpacketListener,
    wanted: watch::Receiver<Wanted>,
    answers: Arc<watch::Sender<Answers>>,
    config: ZdsConfig,
}

/// A session task's end: its task, its connection and why.
type SessionEnd = Result<(tokio::task::Id, (u64, SessionError)), tokio::task::JoinError>;

enum Event {
    Accepted(Result<SeqpacketConn, SocketError>),
    Ended(Option<SessionEnd>),
    WantedChanged(bool),
}

impl ZdsServer {
    pub(super) fn new(
        listener: SeqpacketListener,
        wanted: watch::Receiver<Wanted>,
        answers: Arc<watch::Sender<Answers>>,
        config: ZdsConfig,
    ) -> Self {
        Self {
            listener,
            wanted,
            answers,
            config,
        }
    }

    pub async fn run(mut self) {
        info!(socket = %self.listener.path().display(), "serving ZDS: waiting for ztunnel to connect");
        // Each connection's session runs as a task (dropped with the
        // server); `latest` names the connection served (0: none).
        let mut sessions: JoinSet<(u64, SessionError)> = JoinSet::new();
        let mut by_task: BTreeMap<tokio::task::Id, u64> = BTreeMap::new();
        let mut open: BTreeSet<u64> = BTreeSet::new();
        let (latest, _) = watch::channel(0u64);
        let mut connections = 0u64;
        loop {
            let event = tokio::select! {
                accepted = self.listener.accept() => Event::Accepted(accepted),
                ended = sessions.join_next_with_id(), if !sessions.is_empty() => Event::Ended(ended),
                changed = self.wanted.changed(), if open.is_empty() => {
                    Event::WantedChanged(changed.is_ok())
                }
            };
            let ended = match event {
                Event::Accepted(Ok(conn)) => {
                    connections += 1;
                    open.insert(connections);
                    latest.send_replace(connections);
                    self.config.metrics.set_connections(open.len());
                    if open.len() > 1 {
                        info!(
                            connection = connections,
                            open = open.len(),
                            "another ztunnel connected: the newest connection gets the snapshot and the pods from now on; the older keep theirs until they close"
                        );
                    }
                    let session = session::serve(
                        connections,
                        conn,
                        self.wanted.clone(),
                        latest.subscribe(),
                        self.answers.clone(),
                        self.config.clone(),
                    )
                    .instrument(info_span!("ztunnel", connection = connections));
                    let task = sessions.spawn(session);
                    by_task.insert(task.id(), connections);
                    continue;
                }
                Event::Accepted(Err(e)) => {
                    error!(error = %e, "cannot accept a ZDS connection");
                    // A persistent accept error must not spin.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Event::Ended(None) => continue,
                Event::Ended(Some(Ok((task, (connection, why))))) => {
                    by_task.remove(&task);
                    match why {
                        SessionError::Stopping => return,
                        SessionError::Closed => warn!(connection, "ztunnel disconnected"),
                        e => error!(connection, error = %e, "ZDS connection closed"),
                    }
                    connection
                }
                Event::Ended(Some(Err(e))) => {
                    // A session that panicked: its connection is gone.
                    let Some(connection) = by_task.remove(&e.id()) else {
                        continue;
                    };
                    error!(connection, error = %e, "ZDS connection ended abnormally");
                    connection
                }
                Event::WantedChanged(false) => return,
                Event::WantedChanged(true) => {
                    // Nobody to tell: forget answers for pods that left, so
                    // that a pod coming back is added (and acked) afresh.
                    let wanted = self.wanted.borrow_and_update().clone();
                    session::forget_unwanted(&self.answers, &wanted);
                    continue;
                }
            };
            open.remove(&ended);
            self.config.metrics.set_connections(open.len());
            if *latest.borrow() == ended {
                let next = open.last().copied().unwrap_or(0);
                latest.send_replace(next);
                if next == 0 {
                    warn!(
                        "no ztunnel connected; pods wanted meanwhile wait for its next connection (a fresh snapshot)"
                    );
                } else {
                    info!(
                        connection = next,
                        "the newest open ztunnel connection is served from now on"
                    );
                }
            }
        }
    }
}
