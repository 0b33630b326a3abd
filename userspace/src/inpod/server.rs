//! The ZDS server: one ztunnel connection at a time (a new one replaces the
//! old and gets a fresh snapshot). Per connection: ztunnel's hello, then
//! the snapshot (an `AddWorkload` per wanted pod, its netns as the packet's
//! one fd, each acked before the next; `SnapshotSent`), then adds and dels
//! as the wanted set changes. Anything ztunnel sends that is not what the
//! protocol expects ends the connection with an error naming what was
//! wrong; a request left unacknowledged past the timeout does too (the pod
//! stays pending; ztunnel reconnects and gets a fresh snapshot).

use std::{fs::File, future::Future, os::fd::AsFd, pin::Pin, sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::{Instrument as _, error, info, info_span, warn};

use super::{
    Answer, Answers, Wanted, ZdsPod,
    protocol::{self, ProtocolError, Request},
    socket::{SeqpacketConn, SeqpacketListener, SocketError},
};
use crate::state::WorkloadKey;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("ztunnel closed the connection")]
    Closed,
    #[error("ztunnel sent no hello within {0:?}")]
    NoHello(Duration),
    #[error(
        "ztunnel did not acknowledge {request} for {pod} within {timeout:?}; the pod stays pending"
    )]
    NoAck {
        request: &'static str,
        pod: String,
        timeout: Duration,
    },
    #[error("protocol error from ztunnel: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("protocol error from ztunnel: a message while no request was outstanding")]
    Unsolicited,
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error("the agent is stopping")]
    Stopping,
}

type Session = Pin<Box<dyn Future<Output = SessionError> + Send>>;

/// Serves ZDS on its socket until dropped.
pub struct ZdsServer {
    listener: SeqpacketListener,
    wanted: watch::Receiver<Wanted>,
    answers: Arc<watch::Sender<Answers>>,
    ack_timeout: Duration,
}

enum Event {
    Accepted(Result<SeqpacketConn, SocketError>),
    Ended(SessionError),
    WantedChanged(bool),
}

impl ZdsServer {
    pub(super) fn new(
        listener: SeqpacketListener,
        wanted: watch::Receiver<Wanted>,
        answers: Arc<watch::Sender<Answers>>,
        ack_timeout: Duration,
    ) -> Self {
        Self {
            listener,
            wanted,
            answers,
            ack_timeout,
        }
    }

    pub async fn run(mut self) {
        info!(socket = %self.listener.path().display(), "serving ZDS: waiting for ztunnel to connect");
        let mut current: Option<Session> = None;
        let mut connections = 0u64;
        loop {
            let connected = current.is_some();
            let event = tokio::select! {
                accepted = self.listener.accept() => Event::Accepted(accepted),
                ended = async {
                    match current.as_mut() {
                        Some(session) => session.await,
                        None => std::future::pending().await,
                    }
                } => Event::Ended(ended),
                changed = self.wanted.changed(), if !connected => {
                    Event::WantedChanged(changed.is_ok())
                }
            };
            match event {
                Event::Accepted(Ok(conn)) => {
                    if current.take().is_some() {
                        info!("a new ztunnel connection replaces the previous one");
                    }
                    connections += 1;
                    let session = serve(
                        conn,
                        self.wanted.clone(),
                        self.answers.clone(),
                        self.ack_timeout,
                    )
                    .instrument(info_span!("ztunnel", connection = connections));
                    current = Some(Box::pin(session));
                }
                Event::Accepted(Err(e)) => {
                    error!(error = %e, "cannot accept a ZDS connection");
                    // A persistent accept error must not spin.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Event::Ended(SessionError::Stopping) => return,
                Event::Ended(SessionError::Closed) => {
                    current = None;
                    warn!(
                        "ztunnel disconnected; pods wanted meanwhile wait for its next connection"
                    );
                }
                Event::Ended(e) => {
                    current = None;
                    error!(error = %e, "ZDS connection closed; ztunnel gets a fresh snapshot when it reconnects");
                }
                Event::WantedChanged(false) => return,
                Event::WantedChanged(true) => {
                    // Nobody to tell: forget answers for pods that left, so
                    // that a pod coming back is added (and acked) afresh.
                    let wanted = self.wanted.borrow_and_update().clone();
                    forget_unwanted(&self.answers, &wanted);
                }
            }
        }
    }
}

fn forget_unwanted(answers: &watch::Sender<Answers>, wanted: &Wanted) {
    answers.send_if_modified(|answers| {
        let before = answers.len();
        answers.retain(|key, (pod, _)| wanted.get(key) == Some(pod));
        answers.len() != before
    });
}

/// One connection, until it ends (returned: why).
async fn serve(
    conn: SeqpacketConn,
    wanted: watch::Receiver<Wanted>,
    answers: Arc<watch::Sender<Answers>>,
    ack_timeout: Duration,
) -> SessionError {
    let mut session = Connection {
        conn,
        wanted,
        answers,
        ack_timeout,
        sent: Wanted::new(),
    };
    match session.run().await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

struct Connection {
    conn: SeqpacketConn,
    wanted: watch::Receiver<Wanted>,
    answers: Arc<watch::Sender<Answers>>,
    ack_timeout: Duration,
    /// What this ztunnel has (added or kept), as sent.
    sent: Wanted,
}

impl Connection {
    async fn run(&mut self) -> Result<std::convert::Infallible, SessionError> {
        let hello = match tokio::time::timeout(self.ack_timeout, self.conn.recv()).await {
            Err(_) => return Err(SessionError::NoHello(self.ack_timeout)),
            Ok(received) => received?.ok_or(SessionError::Closed)?,
        };
        protocol::check_hello(&hello)?;
        let wanted = self.wanted.borrow_and_update().clone();
        forget_unwanted(&self.answers, &wanted);
        info!(
            pods = wanted.len(),
            "ztunnel connected (ZDS V1); sending the snapshot"
        );
        for (key, pod) in &wanted {
            self.hand_over(key, pod, true).await?;
        }
        if let Err(text) = self
            .request(Request::SnapshotSent, None, "the snapshot")
            .await?
        {
            warn!(error = %text, "ztunnel answered SnapshotSent with an error");
        }
        info!(pods = self.sent.len(), "snapshot sent and acknowledged");
        loop {
            tokio::select! {
                changed = self.wanted.changed() => {
                    if changed.is_err() {
                        return Err(SessionError::Stopping);
                    }
                    let wanted = self.wanted.borrow_and_update().clone();
                    self.converge(&wanted).await?;
                }
                packet = self.conn.recv() => {
                    return Err(match packet? {
                        None => SessionError::Closed,
                        Some(_) => SessionError::Unsolicited,
                    });
                }
            }
        }
    }

    /// Tells ztunnel what changed: dels for pods no longer wanted (or
    /// wanted in another form), then adds.
    async fn converge(&mut self, wanted: &Wanted) -> Result<(), SessionError> {
        let stale: Vec<(WorkloadKey, ZdsPod)> = self
            .sent
            .iter()
            .filter(|(key, pod)| wanted.get(*key) != Some(*pod))
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect();
        for (key, pod) in stale {
            self.sent.remove(&key);
            self.answers.send_if_modified(|a| a.remove(&key).is_some());
            match self
                .request(Request::Del(&pod.uid), None, &key.to_string())
                .await?
            {
                Ok(()) => info!(pod = %key, uid = %pod.uid, "ztunnel no longer serves the pod"),
                Err(text) => {
                    warn!(pod = %key, error = %text, "ztunnel answered DelWorkload with an error")
                }
            }
        }
        forget_unwanted(&self.answers, wanted);
        for (key, pod) in wanted {
            if !self.sent.contains_key(key) {
                self.hand_over(key, pod, false).await?;
            }
        }
        Ok(())
    }

    /// Sends the pod: an `AddWorkload` with its netns; in a snapshot, a pod
    /// whose netns cannot be opened any more but that ztunnel acked before
    /// gets a `KeepWorkload` (ztunnel keeps it if it still serves it).
    async fn hand_over(
        &mut self,
        key: &WorkloadKey,
        pod: &ZdsPod,
        in_snapshot: bool,
    ) -> Result<(), SessionError> {
        let netns = match File::open(&pod.netns) {
            Ok(netns) => netns,
            Err(e) => {
                let acked_before = matches!(
                    self.answers.borrow().get(key),
                    Some((sent, Answer::Acked)) if sent == pod
                );
                if in_snapshot && acked_before {
                    let answer = self
                        .request(Request::Keep(&pod.uid), None, &key.to_string())
                        .await?;
                    self.record(key, pod, answer, "KeepWorkload");
                } else {
                    let text = format!(
                        "cannot open the pod's network namespace {} to hand it to ztunnel: {e}",
                        pod.netns.display()
                    );
                    warn!(pod = %key, "{text}");
                    self.set_answer(key, pod, Answer::Failed(text));
                }
                return Ok(());
            }
        };
        let answer = self
            .request(Request::Add(pod), Some(&netns), &key.to_string())
            .await?;
        self.record(key, pod, answer, "AddWorkload");
        Ok(())
    }

    fn record(
        &mut self,
        key: &WorkloadKey,
        pod: &ZdsPod,
        answer: Result<(), String>,
        request: &str,
    ) {
        self.sent.insert(key.clone(), pod.clone());
        match answer {
            Ok(()) => {
                info!(pod = %key, uid = %pod.uid, "ztunnel acknowledged {request}: it serves the pod");
                self.set_answer(key, pod, Answer::Acked);
            }
            Err(text) => {
                warn!(pod = %key, error = %text, "ztunnel refused {request}; the pod stays pending");
                self.set_answer(
                    key,
                    pod,
                    Answer::Failed(format!("ztunnel refused the pod: {text}")),
                );
            }
        }
    }

    fn set_answer(&self, key: &WorkloadKey, pod: &ZdsPod, answer: Answer) {
        let entry = (pod.clone(), answer);
        self.answers.send_if_modified(|answers| {
            if answers.get(key) == Some(&entry) {
                return false;
            }
            answers.insert(key.clone(), entry);
            true
        });
    }

    /// Sends one request and waits (bounded) for ztunnel's ack.
    async fn request(
        &self,
        request: Request<'_>,
        netns: Option<&File>,
        pod: &str,
    ) -> Result<Result<(), String>, SessionError> {
        self.conn
            .send(&request.encode(), netns.map(|f| f.as_fd()))
            .await?;
        let packet = match tokio::time::timeout(self.ack_timeout, self.conn.recv()).await {
            Err(_) => {
                return Err(SessionError::NoAck {
                    request: request.name(),
                    pod: pod.to_owned(),
                    timeout: self.ack_timeout,
                });
            }
            Ok(received) => received?.ok_or(SessionError::Closed)?,
        };
        Ok(protocol::read_ack(&packet)?)
    }
}
