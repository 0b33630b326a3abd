//! The reconcile thread: it owns the [`NodeAgent`], waits on its inputs
//! (new pods, the store's applied views, ztunnel's answers, the verify
//! timer, the kernel's refusals, stop) and publishes a [`NodeSnapshot`]
//! after each reconcile.

use std::{
    os::fd::{AsRawFd, RawFd},
    sync::Arc,
    time::Duration,
};

use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::{oneshot, watch},
};
use tracing::{error, info, warn};

use super::NodeAgent;
use crate::{control::NodePods, snapshot::NodeSnapshot};

/// This node's pods as a source pushed them, with how many cluster views
/// had been pushed before: the reconciler lets the workload store catch up
/// with those first, so that a pod enrolled now finds the services and
/// peers its source announced with it.
#[derive(Clone, Debug)]
pub struct PodsUpdate {
    pub pods: NodePods,
    pub after_cluster_views: u64,
}

/// What the reconciler thread listens to.
pub struct ReconcilerInputs {
    /// The latest list of this node's pods (`None` until a source pushed).
    pub pods: watch::Receiver<Option<PodsUpdate>>,
    /// How many cluster views the workload store has applied (absent when
    /// nothing keeps a store: no proxy).
    pub store_applied: Option<watch::Receiver<u64>>,
    /// How often every pod is verified (and repaired), and its hooks and
    /// counters read.
    pub verify_every: Duration,
}

/// What the reconciler does to the node as it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopAction {
    /// Leaves every pod enrolled for the next agent (an upgrade).
    Keep,
    /// Unenrols every pod; the node-wide programs and pins stay.
    Unenrol,
    /// Unenrols every pod, then removes every node-wide part
    /// ([`NodeAgent::uninstall`]).
    Uninstall,
}

/// The running reconciler: a thread that owns the [`NodeAgent`].
pub struct Reconciler {
    snapshots: watch::Receiver<Arc<NodeSnapshot>>,
    stop: Option<oneshot::Sender<StopAction>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How long a reconcile waits for the workload store to apply the cluster
/// views pushed before its pods (applying one takes milliseconds).
const STORE_CATCH_UP: Duration = Duration::from_secs(2);

impl Reconciler {
    /// Starts the reconciler thread; it publishes a snapshot at once (empty,
    /// not synced), then after every reconcile and verify pass.
    pub fn spawn(
        agent: NodeAgent,
        inputs: ReconcilerInputs,
        runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Self> {
        let (publish, snapshots) = watch::channel(Arc::new(agent.snapshot()));
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("reconcile".into())
            .spawn(move || reconcile_loop(agent, inputs, publish, stopped, runtime))?;
        Ok(Self {
            snapshots,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The published snapshots.
    pub fn snapshots(&self) -> watch::Receiver<Arc<NodeSnapshot>> {
        self.snapshots.clone()
    }

    /// Stops the thread once it is done with what it is doing; with
    /// `unenrol`, it unenrols every pod first.
    pub async fn stop(self, unenrol: bool) {
        self.stop_with(if unenrol {
            StopAction::Unenrol
        } else {
            StopAction::Keep
        })
        .await
    }

    /// Stops the thread once it is done with what it is doing, after doing
    /// `action` to the node.
    pub async fn stop_with(mut self, action: StopAction) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(action);
        }
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                error!("the reconcile thread panicked");
            }
        }
    }
}

impl Drop for Reconciler {
    /// Dropped without [`Reconciler::stop`]: the thread stops after what it
    /// is doing, leaving every pod as it is.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(StopAction::Keep);
        }
    }
}

enum Wake {
    Pods,
    KernelRefusals,
    StoreChanged,
    StoreGone,
    ZtunnelAnswered,
    ZtunnelGone,
    SourcesGone,
    Verify,
    Stop(StopAction),
}

fn reconcile_loop(
    mut agent: NodeAgent,
    mut inputs: ReconcilerInputs,
    publish: watch::Sender<Arc<NodeSnapshot>>,
    mut stop: oneshot::Receiver<StopAction>,
    runtime: tokio::runtime::Handle,
) {
    let verify_every = inputs.verify_every.max(Duration::from_millis(100));
    let mut next_verify = tokio::time::Instant::now() + verify_every;
    let mut sources_open = true;
    let mut ztunnel_answers = agent.ztunnel_answers();
    // The kernel's verdicts follow every view the store owner applies
    // (a receiver of its own: the catch-up wait below marks views seen).
    let mut store_changes = inputs
        .store_applied
        .clone()
        .filter(|_| agent.follows_store());
    // The connects the kernel refused, logged as they come. (Dropped
    // before `agent`, which owns the fd.)
    let refusals = agent.kernel_refusals_fd().and_then(|fd| {
        let _runtime = runtime.enter();
        // SAFETY: the redirector keeps the ring's fd open, with the same
        // value, for as long as `agent` lives, which outlives this AsyncFd.
        unsafe { AsyncFd::register_with_interest(OwnedElsewhere(fd), Interest::READABLE) }
            .inspect_err(|e| {
                warn!(error = %e, "cannot watch the kernel's refusals: they are counted, not logged");
            })
            .ok()
    });
    loop {
        let wake = runtime.block_on(async {
            tokio::select! {
                biased;
                action = &mut stop => Wake::Stop(action.unwrap_or(StopAction::Keep)),
                changed = inputs.pods.changed(), if sources_open => match changed {
                    Ok(()) => Wake::Pods,
                    Err(_) => Wake::SourcesGone,
                },
                changed = async {
                    match ztunnel_answers.as_mut() {
                        Some(answers) => answers.changed().await,
                        None => std::future::pending().await,
                    }
                } => match changed {
                    Ok(()) => Wake::ZtunnelAnswered,
                    Err(_) => Wake::ZtunnelGone,
                },
                changed = async {
                    match store_changes.as_mut() {
                        Some(applied) => applied.changed().await,
                        None => std::future::pending().await,
                    }
                } => match changed {
                    Ok(()) => Wake::StoreChanged,
                    Err(_) => Wake::StoreGone,
                },
                () = async {
                    match refusals.as_ref().map(AsyncFd::readable) {
                        Some(readable) => match readable.await {
                            // Cleared before the read: a record that comes
                            // during it wakes the loop again.
                            Ok(mut ready) => ready.clear_ready(),
                            Err(_) => std::future::pending().await,
                        },
                        None => std::future::pending().await,
                    }
                } => Wake::KernelRefusals,
                _ = tokio::time::sleep_until(next_verify) => Wake::Verify,
            }
        });
        match wake {
            Wake::Pods => {
                let update = inputs.pods.borrow_and_update().clone();
                let Some(update) = update else { continue };
                if let Some(applied) = inputs.store_applied.as_mut() {
                    let wanted = update.after_cluster_views;
                    // (The timer must be made inside the runtime's context.)
                    let caught_up = runtime.block_on(async {
                        let applied = applied.wait_for(|n| *n >= wanted);
                        matches!(
                            tokio::time::timeout(STORE_CATCH_UP, applied).await,
                            Ok(Ok(_))
                        )
                    });
                    if !caught_up {
                        warn!(
                            "the workload store has not applied the cluster view pushed before these pods; reconciling anyway"
                        );
                    }
                }
                agent.apply(update.pods);
            }
            Wake::KernelRefusals => {
                agent.log_kernel_refusals();
                // Nothing a snapshot shows changed.
                continue;
            }
            // (`changed` marked the answers seen.)
            Wake::ZtunnelAnswered => agent.reconverge(),
            Wake::StoreChanged => agent.store_changed(),
            Wake::StoreGone => {
                store_changes = None;
                continue;
            }
            Wake::ZtunnelGone => {
                ztunnel_answers = None;
                continue;
            }
            Wake::SourcesGone => {
                sources_open = false;
                continue;
            }
            Wake::Verify => {
                agent.verify();
                next_verify = tokio::time::Instant::now() + verify_every;
            }
            Wake::Stop(action) => {
                match action {
                    StopAction::Keep => return,
                    StopAction::Unenrol => {
                        info!("unenrolling every pod");
                        agent.unenrol_all();
                    }
                    StopAction::Uninstall => {
                        info!(
                            "uninstalling: unenrolling every pod, removing the node's programs, pins and rules"
                        );
                        agent.uninstall();
                    }
                }
                publish.send_replace(Arc::new(agent.snapshot()));
                return;
            }
        }
        publish.send_replace(Arc::new(agent.snapshot()));
    }
}

/// An fd the [`NodeAgent`]'s redirector owns and keeps open for the
/// reconcile thread's life, watched here without taking it.
struct OwnedElsewhere(RawFd);

impl AsRawFd for OwnedElsewhere {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}
