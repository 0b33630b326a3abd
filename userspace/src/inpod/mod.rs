//! `--proxy ztunnel`: shunt as the node agent a stock Istio ztunnel talks
//! to (ztunnel calls its side `inpod/`; istio-cni plays this role in
//! Istio). shunt redirects with its own eBPF programs; ztunnel binds its
//! listeners (15001, 15006, 15008) inside each pod's network namespace,
//! which it receives from us over ZDS.
//!
//! ```text
//!  reconciler ──(wanted pods: watch)──> ZdsServer ──SEQPACKET──> ztunnel
//!      ^                                   │   <── ZdsHello, Acks ──
//!      └──────(ztunnel's answers: watch)───┘
//! ```
//!
//! One owner per state: the reconciler alone writes which pods ztunnel
//! should serve ([`Wanted`], published after it has unenrolled the pods that
//! left, so a `DelWorkload` never precedes the unenrolment); the
//! [`ZdsServer`] alone writes ztunnel's [`Answers`], which the reconciler
//! reads to gate enrolment: a pod is redirected only once ztunnel has
//! acked its `AddWorkload` (its listeners are bound), or refused it (then
//! its traffic fails closed while the add is sent again with back-off).
//! Pods wanted while no ztunnel is connected wait in the wanted set and go
//! out in the next connection's snapshot. Every ztunnel connection is kept
//! (`server.rs`): the newest gets the snapshot, the adds, and alone writes
//! the answers; older ones keep what they have until they close.
//! Each pod's namespace is held open from its capture (`held.rs`).

mod held;
mod metrics;
pub(crate) mod protocol;
mod server;
mod session;
mod socket;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::sync::watch;

pub use held::HeldNetns;
pub use metrics::ZdsMetrics;
pub use protocol::ProtocolError;
pub use server::ZdsServer;
pub use socket::SocketError;

use crate::{
    netns::NsId,
    state::{Workload, WorkloadKey},
};

/// Where ztunnel's `INPOD_UDS` points by default.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// How long ztunnel may take to answer one request (it acks an add once
/// its listeners are bound in the pod's netns: milliseconds).
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ZdsConfig {
    /// How long ztunnel may take to answer one request.
    pub ack_timeout: Duration,
    /// A refused pod is sent again after this, then after twice as long
    /// each time, up to `retry_max` (istio-cni retries a failed add through
    /// its rate-limited queue; ztunnel itself retries a proxy that failed to
    /// start every 5 s, and answers a repeated add for a pod it serves with
    /// a plain ack).
    pub retry_initial: Duration,
    pub retry_max: Duration,
    pub metrics: ZdsMetrics,
}

impl Default for ZdsConfig {
    fn default() -> Self {
        Self {
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            retry_initial: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            metrics: ZdsMetrics::default(),
        }
    }
}

impl ZdsConfig {
    /// The wait before retry number `attempt` (1 for the first).
    fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(16);
        self.retry_initial
            .saturating_mul(factor)
            .min(self.retry_max)
    }
}

/// A pod as ztunnel is told about it.
#[derive(Clone, Debug)]
pub struct ZdsPod {
    /// The key of add/keep/del: the pod's UID, else `namespace/name`.
    pub uid: String,
    /// `WorkloadInfo`: how ztunnel matches the pod with istiod's workloads.
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// Where the pod's netns was found (logs; the fd sent is `held`).
    pub netns: PathBuf,
    /// Which namespace was captured (`None`: it could not be opened). A
    /// new namespace under the same path (the pod's sandbox recreated)
    /// makes the pod differ from what ztunnel was sent, so it is sent
    /// again (`DelWorkload`, then `AddWorkload` with the new namespace):
    /// ztunnel would otherwise keep serving the dead one, and enrolment
    /// waits for the new ack.
    pub netns_id: Option<NsId>,
    /// The namespace itself, held open since it was captured: what every
    /// `AddWorkload` for this pod carries.
    pub held: Option<Arc<HeldNetns>>,
}

/// Two descriptions are the same pod if all but the handle agree (the
/// handle is the namespace `netns_id` names).
impl PartialEq for ZdsPod {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.uid,
            &self.name,
            &self.namespace,
            &self.service_account,
            &self.netns,
            self.netns_id,
        ) == (
            &other.uid,
            &other.name,
            &other.namespace,
            &other.service_account,
            &other.netns,
            other.netns_id,
        )
    }
}

impl Eq for ZdsPod {}

impl ZdsPod {
    pub fn new(workload: &Workload, netns: &Path, held: Option<Arc<HeldNetns>>) -> Self {
        let uid = if workload.uid.is_empty() {
            format!("{}/{}", workload.namespace, workload.name)
        } else {
            workload.uid.clone()
        };
        Self {
            uid,
            name: workload.name.clone(),
            namespace: workload.namespace.clone(),
            service_account: workload.service_account.clone(),
            netns: netns.to_path_buf(),
            netns_id: held.as_ref().map(|h| h.id()),
            held,
        }
    }
}

/// The pods ztunnel should serve (written by the reconciler only).
pub type Wanted = BTreeMap<WorkloadKey, ZdsPod>;

/// ztunnel's last word on a pod (written by the [`ZdsServer`] only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// ztunnel acked the `AddWorkload` (or, in a later snapshot, the
    /// `KeepWorkload`): its listeners are bound in the pod's netns.
    Acked,
    /// ztunnel answered the `AddWorkload` with an error: the pod is
    /// redirected all the same (its traffic fails closed at listeners that
    /// are not there, as with istio-cni, whose rules precede the add) and
    /// sent again with back-off; the text says why and when.
    Refused(String),
    /// The pod could not be handed over (no network namespace to send);
    /// the text says why.
    Failed(String),
}
/// The answer for each pod, with the pod as it was sent (a pod whose
/// netns changed since must be sent again).
pub type Answers = BTreeMap<WorkloadKey, (ZdsPod, Answer)>;

/// The reconciler's end of the link to the [`ZdsServer`].
pub struct ZtunnelLink {
    wanted: watch::Sender<Wanted>,
    answers: watch::Receiver<Answers>,
}

impl ZtunnelLink {
    /// Publishes the complete set of pods ztunnel should serve (no wake-up
    /// when nothing changed).
    pub fn publish(&self, wanted: Wanted) {
        self.wanted.send_if_modified(|current| {
            if *current == wanted {
                return false;
            }
            *current = wanted;
            true
        });
    }

    /// `workload` (its netns at `netns`) as ztunnel is to be told about it.
    /// The namespace is held from the first time the pod is described (its
    /// capture): while `netns` names the same namespace, or cannot be read
    /// (its sandbox going away), the held one is kept; a namespace known
    /// to be new under that path (the sandbox recreated) is opened and
    /// held instead, which sends the pod again.
    pub fn describe(&self, key: &WorkloadKey, workload: &Workload, netns: &Path) -> ZdsPod {
        let held = self.held(key, netns);
        let held = match HeldNetns::open(netns) {
            Ok(now) => match held {
                Some(before) if before.id() == now.id() => Some(before),
                _ => Some(Arc::new(now)),
            },
            Err(_) => held,
        };
        ZdsPod::new(workload, netns, held)
    }

    /// The namespace held for `key` at `netns`: in the set published, else
    /// in what ztunnel last answered for.
    fn held(&self, key: &WorkloadKey, netns: &Path) -> Option<Arc<HeldNetns>> {
        let at_path = |pod: &ZdsPod| pod.held.clone().filter(|_| pod.netns == netns);
        if let Some(held) = self.wanted.borrow().get(key).and_then(at_path) {
            return Some(held);
        }
        self.answers
            .borrow()
            .get(key)
            .and_then(|(sent, _)| at_path(sent))
    }

    /// ztunnel's answer for `pod` as it is now (`None`: not answered yet,
    /// or answered for an older version of the pod).
    pub fn answer(&self, key: &WorkloadKey, pod: &ZdsPod) -> Option<Answer> {
        match self.answers.borrow().get(key) {
            Some((sent, answer)) if sent == pod => Some(answer.clone()),
            _ => None,
        }
    }

    /// Changes whenever ztunnel answers (the reconciler wakes on it).
    pub fn answers(&self) -> watch::Receiver<Answers> {
        self.answers.clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error(transparent)]
    Socket(#[from] SocketError),
}

/// Listens on `path`; returns the server (run it with [`ZdsServer::run`])
/// and the reconciler's end of the link.
pub fn bind(path: &Path, config: ZdsConfig) -> Result<(ZdsServer, ZtunnelLink), ZdsError> {
    let listener = socket::SeqpacketListener::bind(path)?;
    let (wanted, wanted_rx) = watch::channel(Wanted::new());
    let (answers, answers_rx) = watch::channel(Answers::new());
    let server = ZdsServer::new(listener, wanted_rx, Arc::new(answers), config);
    Ok((
        server,
        ZtunnelLink {
            wanted,
            answers: answers_rx,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_bound() {
        let config = ZdsConfig {
            retry_initial: Duration::from_millis(500),
            retry_max: Duration::from_secs(4),
            ..ZdsConfig::default()
        };
        let waits: Vec<u128> = (1..=6).map(|n| config.backoff(n).as_millis()).collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 4000, 4000]);
        assert_eq!(config.backoff(u32::MAX), Duration::from_secs(4));
    }
}
