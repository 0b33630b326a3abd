//! One ztunnel connection: ztunnel's hello, then the snapshot (an
//! `AddWorkload` per wanted pod, its held netns as the packet's one fd,
//! each acked before the next; `SnapshotSent`), then, while it is the
//! newest connection, adds and dels as the wanted set changes and adds
//! sent again, with back-off, for pods ztunnel refused. An older
//! connection only gets the dels for pods it has. Anything ztunnel sends
//! that is not what the protocol expects ends the connection with an
//! error naming what was wrong; a request left unacknowledged past the
//! timeout does too (the pod stays pending; ztunnel reconnects and gets a
//! fresh snapshot).

use std::{collections::BTreeMap, os::fd::BorrowedFd, sync::Arc, time::Duration};

use tokio::{sync::watch, time::Instant};
use tracing::{info, warn};

use super::{
    Answer, Answers, Wanted, ZdsConfig, ZdsPod,
    protocol::{self, ProtocolError, Request},
    socket::{SeqpacketConn, SocketError},
};
use crate::state::WorkloadKey;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub(super) enum SessionError {
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

/// Forgets the answers for pods no longer wanted (as they are), so that a
/// pod coming back is added (and acked) afresh.
pub(super) fn forget_unwanted(answers: &watch::Sender<Answers>, wanted: &Wanted) {
    answers.send_if_modified(|answers| {
        let before = answers.len();
        answers.retain(|key, (pod, _)| wanted.get(key) == Some(pod));
        answers.len() != before
    });
}

/// Serves connection number `id` until it ends; returns why (with `id`).
pub(super) async fn serve(
    id: u64,
    conn: SeqpacketConn,
    wanted: watch::Receiver<Wanted>,
    latest: watch::Receiver<u64>,
    answers: Arc<watch::Sender<Answers>>,
    config: ZdsConfig,
) -> (u64, SessionError) {
    let mut session = Session {
        id,
        conn,
        wanted,
        latest,
        answers,
        config,
        sent: Wanted::new(),
        said: Answers::new(),
        refused: BTreeMap::new(),
    };
    match session.run().await {
        Ok(never) => match never {},
        Err(e) => (id, e),
    }
}

/// A pod ztunnel refused: how often, and when it is sent again.
struct Retry {
    attempts: u32,
    due: Instant,
}

struct Session {
    id: u64,
    conn: SeqpacketConn,
    wanted: watch::Receiver<Wanted>,
    /// Which connection is served (the newest open one).
    latest: watch::Receiver<u64>,
    answers: Arc<watch::Sender<Answers>>,
    config: ZdsConfig,
    /// What this ztunnel has (added, kept, or refused and pending in it),
    /// as sent.
    sent: Wanted,
    /// What this ztunnel answered, per pod (published while served).
    said: Answers,
    refused: BTreeMap<WorkloadKey, Retry>,
}

impl Session {
    fn is_latest(&self) -> bool {
        *self.latest.borrow() == self.id
    }

    async fn run(&mut self) -> Result<std::convert::Infallible, SessionError> {
        let hello = match tokio::time::timeout(self.config.ack_timeout, self.conn.recv()).await {
            Err(_) => return Err(SessionError::NoHello(self.config.ack_timeout)),
            Ok(received) => received?.ok_or(SessionError::Closed)?,
        };
        protocol::check_hello(&hello)?;
        let wanted = self.wanted.borrow_and_update().clone();
        if self.is_latest() {
            forget_unwanted(&self.answers, &wanted);
        }
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
        let mut served = self.is_latest();
        self.latest.borrow_and_update();
        if served {
            // The wanted set may have changed during the snapshot.
            let wanted = self.wanted.borrow_and_update().clone();
            self.converge(&wanted).await?;
        }
        loop {
            let next_retry = self
                .refused
                .values()
                .map(|r| r.due)
                .min()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                changed = self.wanted.changed() => {
                    if changed.is_err() {
                        return Err(SessionError::Stopping);
                    }
                    let wanted = self.wanted.borrow_and_update().clone();
                    self.converge(&wanted).await?;
                }
                changed = self.latest.changed() => {
                    if changed.is_err() {
                        return Err(SessionError::Stopping);
                    }
                    self.latest.borrow_and_update();
                    let now = self.is_latest();
                    if now && !served {
                        info!("served again (the newer connection closed): catching up");
                        self.take_over().await?;
                    }
                    served = now;
                }
                () = tokio::time::sleep_until(next_retry), if served && !self.refused.is_empty() => {
                    self.retry_due().await?;
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

    /// This connection is served again: its own answers become ztunnel's
    /// word, then it is brought up to date.
    async fn take_over(&mut self) -> Result<(), SessionError> {
        let wanted = self.wanted.borrow_and_update().clone();
        let said = &self.said;
        self.answers.send_if_modified(|answers| {
            let mut changed = false;
            for (key, entry) in said {
                if wanted.get(key) == Some(&entry.0) && answers.get(key) != Some(entry) {
                    answers.insert(key.clone(), entry.clone());
                    changed = true;
                }
            }
            changed
        });
        self.converge(&wanted).await
    }

    /// Tells ztunnel what changed: dels for the pods it has that are no
    /// longer wanted (or wanted in another form); then, if this connection
    /// is served, adds for the wanted pods it does not have.
    async fn converge(&mut self, wanted: &Wanted) -> Result<(), SessionError> {
        let served = self.is_latest();
        let stale: Vec<(WorkloadKey, ZdsPod)> = self
            .sent
            .iter()
            .filter(|(key, pod)| wanted.get(*key) != Some(*pod))
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect();
        for (key, pod) in stale {
            self.sent.remove(&key);
            self.said.remove(&key);
            self.refused.remove(&key);
            if served {
                self.answers.send_if_modified(|a| a.remove(&key).is_some());
            }
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
        if !served {
            return Ok(());
        }
        forget_unwanted(&self.answers, wanted);
        for (key, pod) in wanted {
            if !self.sent.contains_key(key) {
                self.hand_over(key, pod, false).await?;
            }
        }
        Ok(())
    }

    /// Sends again the refused pods whose wait is over (as they are wanted
    /// now; a pod that changed meanwhile is the next converge's).
    async fn retry_due(&mut self) -> Result<(), SessionError> {
        let now = Instant::now();
        let due: Vec<WorkloadKey> = self
            .refused
            .iter()
            .filter(|(_, retry)| retry.due <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            let pod = self.wanted.borrow().get(&key).cloned();
            let Some(pod) = pod.filter(|pod| self.sent.get(&key) == Some(pod)) else {
                continue;
            };
            self.config.metrics.retried();
            info!(pod = %key, uid = %pod.uid, "sending AddWorkload again after ztunnel refused the pod");
            self.hand_over(&key, &pod, false).await?;
        }
        Ok(())
    }

    /// Sends the pod: an `AddWorkload` with the namespace held since its
    /// capture. A pod with no namespace to send gets, in a snapshot, a
    /// `KeepWorkload` (ztunnel keeps it if it still serves it, as
    /// istio-cni does for a pod whose netns it could not open).
    async fn hand_over(
        &mut self,
        key: &WorkloadKey,
        pod: &ZdsPod,
        in_snapshot: bool,
    ) -> Result<(), SessionError> {
        let Some(held) = pod.held.clone() else {
            let text = format!(
                "cannot open the pod's network namespace {} to hand it to ztunnel",
                pod.netns.display()
            );
            warn!(pod = %key, "{text}");
            if in_snapshot {
                match self
                    .request(Request::Keep(&pod.uid), None, &key.to_string())
                    .await?
                {
                    Ok(()) => info!(pod = %key, "ztunnel acknowledged KeepWorkload"),
                    Err(e) => warn!(pod = %key, error = %e, "ztunnel refused KeepWorkload"),
                }
                self.sent.insert(key.clone(), pod.clone());
            }
            self.set_answer(key, pod, Answer::Failed(text));
            return Ok(());
        };
        let fd = match held.checked_fd() {
            Ok(fd) => fd,
            Err(text) => {
                let text =
                    format!("the pod's network namespace cannot be handed to ztunnel: {text}");
                warn!(pod = %key, "{text}");
                self.set_answer(key, pod, Answer::Failed(text));
                return Ok(());
            }
        };
        let answer = self
            .request(Request::Add(pod), Some(fd), &key.to_string())
            .await?;
        self.record(key, pod, answer);
        Ok(())
    }

    /// Records ztunnel's answer to an `AddWorkload`; a refusal is sent
    /// again after a wait that doubles each time (bounded).
    fn record(&mut self, key: &WorkloadKey, pod: &ZdsPod, answer: Result<(), String>) {
        self.sent.insert(key.clone(), pod.clone());
        match answer {
            Ok(()) => {
                self.refused.remove(key);
                info!(pod = %key, uid = %pod.uid, "ztunnel acknowledged AddWorkload: it serves the pod");
                self.set_answer(key, pod, Answer::Acked);
            }
            Err(text) => {
                self.config.metrics.refused();
                let attempts = self.refused.get(key).map_or(1, |r| r.attempts + 1);
                let wait = self.config.backoff(attempts);
                self.refused.insert(
                    key.clone(),
                    Retry {
                        attempts,
                        due: Instant::now() + wait,
                    },
                );
                let text = format!(
                    "ztunnel refused the pod: {text} (attempt {attempts}; sent again in {wait:?}; its traffic fails closed meanwhile)"
                );
                warn!(pod = %key, "{text}");
                self.set_answer(key, pod, Answer::Refused(text));
            }
        }
    }

    /// Records what this ztunnel said; published if it is served.
    fn set_answer(&mut self, key: &WorkloadKey, pod: &ZdsPod, answer: Answer) {
        let entry = (pod.clone(), answer);
        self.said.insert(key.clone(), entry.clone());
        if !self.is_latest() {
            return;
        }
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
        netns: Option<BorrowedFd<'_>>,
        pod: &str,
    ) -> Result<Result<(), String>, SessionError> {
        self.conn.send(&request.encode(), netns).await?;
        let packet = match tokio::time::timeout(self.config.ack_timeout, self.conn.recv()).await {
            Err(_) => {
                return Err(SessionError::NoAck {
                    request: request.name(),
                    pod: pod.to_owned(),
                    timeout: self.config.ack_timeout,
                });
            }
            Ok(received) => received?.ok_or(SessionError::Closed)?,
        };
        Ok(protocol::read_ack(&packet)?)
    }
}
