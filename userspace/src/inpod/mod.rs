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
//! acked its `AddWorkload` (its listeners are bound). Pods wanted while no
//! ztunnel is connected wait in the wanted set and go out in the next
//! connection's snapshot.

pub(crate) mod protocol;
mod server;
mod socket;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::sync::watch;

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

/// A pod as ztunnel is told about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZdsPod {
    /// The key of add/keep/del: the pod's UID, else `namespace/name`.
    pub uid: String,
    /// `WorkloadInfo`: how ztunnel matches the pod with istiod's workloads.
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// Opened when the pod is sent; the fd travels with the `AddWorkload`.
    pub netns: PathBuf,
    /// Which namespace `netns` named when the reconciler looked (`None`:
    /// it could not be read). A new namespace under the same path (the
    /// pod's sandbox recreated) makes the pod differ from what ztunnel was
    /// sent, so it is sent again (`DelWorkload`, then `AddWorkload` with
    /// the new namespace): ztunnel would otherwise keep serving the dead
    /// one, and enrolment waits for the new ack.
    pub netns_id: Option<NsId>,
}

impl ZdsPod {
    pub fn new(workload: &Workload, netns: &Path, netns_id: Option<NsId>) -> Self {
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
            netns_id,
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
    /// The pod could not be handed over; the text says why (ztunnel's
    /// error, or the netns that could not be opened).
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

    /// `workload` (its netns at `netns`) as ztunnel is to be told about it,
    /// with the identity of the namespace `netns` names now. A namespace
    /// that cannot be read now (its sandbox going away) keeps the identity
    /// ztunnel last answered for at that path: only a namespace known to be
    /// new is sent again (an unreadable one is kept, or fails to open when
    /// sent, as before).
    pub fn describe(&self, key: &WorkloadKey, workload: &Workload, netns: &Path) -> ZdsPod {
        let netns_id = NsId::of_path(netns)
            .ok()
            .or_else(|| match self.answers.borrow().get(key) {
                Some((sent, _)) if sent.netns == netns => sent.netns_id,
                _ => None,
            });
        ZdsPod::new(workload, netns, netns_id)
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
pub fn bind(path: &Path, ack_timeout: Duration) -> Result<(ZdsServer, ZtunnelLink), ZdsError> {
    let listener = socket::SeqpacketListener::bind(path)?;
    let (wanted, wanted_rx) = watch::channel(Wanted::new());
    let (answers, answers_rx) = watch::channel(Answers::new());
    let server = ZdsServer::new(listener, wanted_rx, Arc::new(answers), ack_timeout);
    Ok((
        server,
        ZtunnelLink {
            wanted,
            answers: answers_rx,
        },
    ))
}
