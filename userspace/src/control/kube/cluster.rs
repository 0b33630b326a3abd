//! Cluster-wide workload discovery: every pod's IPs, identity and node, for
//! the proxy (which must know who a peer IP is and where it runs), every
//! service's VIPs and endpoints (see [`super::service`]), and Istio's
//! `AuthorizationPolicy` objects (see [`super::policy`]), and each service's
//! and pod's waypoint (see [`super::waypoints`]) from the waypoint
//! `Gateway`s (see [`super::gateway`]) and the labels already watched.
//!
//! A pod watch without a field selector plus a namespace watch (for the
//! dataplane-mode label), reduced to facts like the node source's, and
//! debounced into complete [`ClusterView`]s pushed through the
//! [`SourceSink`] (the workload store's owner applies them). Pods without
//! an IP yet are left out (there is nothing to route to). Services join the
//! view once their two watches have listed, independently of the pods: a
//! cluster where the agent may not list services (an older RBAC) still gets
//! pod discovery. Policies join the same way, and never hold discovery back
//! for long: the first view waits for the policy list only until it is
//! listed, known absent (no CRD: 404), refused or failing, and at most
//! [`POLICY_LIST_WAIT`], so that a pod is not served without its policies
//! merely because one list answered before another; the Gateway list is
//! waited for likewise, so a service bound to a waypoint is not served
//! without it for that reason. Kept separate from the
//! node source on purpose: the node source must keep its narrow
//! field-selected watch (what this node enrols must not wait on a
//! cluster-sized list), and a consumer that does not need discovery (no
//! proxy) does not pay for it.

use std::{sync::Arc, time::Duration};

use ::kube::Client;
use tokio::time::Instant;
use tracing::{debug, info};

use super::{
    Enablement, SourceStats, Step, Watches, gateway::GatewayWatch, policy::PolicyWatch,
    service::ServiceWatches, sleep_until, waypoints,
};
use crate::{
    control::{
        ClusterView, SourceSink,
        waypoint::{DEFAULT_CLUSTER_DOMAIN, UnknownGatewayLog, Waypoints},
        waypoint_allow,
    },
    state::{TrustDomain, Workload},
};

/// Name of this source in readiness and logs.
pub const SOURCE: &str = "kubernetes-cluster";

/// How long the first cluster view may wait for the `AuthorizationPolicy`
/// and `Gateway` lists (see the module docs); after that it goes without,
/// and the policies and waypoints join when they come.
pub const POLICY_LIST_WAIT: Duration = Duration::from_secs(5);

/// Discovers every pod and service of the cluster.
pub struct ClusterWorkloads {
    client: Client,
    debounce: Duration,
    stats: Arc<SourceStats>,
    /// `--cluster-domain`: service and waypoint hostnames end in it.
    cluster_domain: String,
    /// `--auto-allow-waypoint-policy on`: the mesh's trust domain, for
    /// istiod's implicit allow-from-waypoint policies.
    waypoint_allow: Option<TrustDomain>,
    /// Which pods are in the mesh (the same rule every node's agent
    /// enrols by).
    enablement: Arc<Enablement>,
}

impl ClusterWorkloads {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            debounce: Duration::from_millis(100),
            stats: Arc::default(),
            cluster_domain: DEFAULT_CLUSTER_DOMAIN.into(),
            waypoint_allow: None,
            enablement: Arc::default(),
        }
    }

    /// Adds istiod's implicit allow-from-waypoint policies
    /// ([`crate::control::waypoint_allow`]), naming identities in
    /// `trust_domain`; `None`: not (istiod's default).
    pub fn with_waypoint_allow(mut self, trust_domain: Option<TrustDomain>) -> Self {
        self.waypoint_allow = trust_domain;
        self
    }

    /// `--enablement-selectors` and `--exclude-namespaces`: a pod they leave
    /// out is no mesh workload for the proxy either.
    pub fn with_enablement(mut self, enablement: Arc<Enablement>) -> Self {
        self.enablement = enablement;
        self
    }

    /// The cluster's DNS domain (`--cluster-domain`): services are named
    /// `<name>.<namespace>.svc.<domain>`, waypoints too.
    pub fn with_cluster_domain(mut self, cluster_domain: &str) -> Self {
        self.cluster_domain = cluster_domain.to_owned();
        self
    }

    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// Watches and pushes until the future is dropped.
    pub async fn run(self, sink: Arc<dyn SourceSink>) {
        let mut watch = Watches::new(&self.client, None, self.stats.clone());
        let mut services = ServiceWatches::new(&self.client, self.stats.clone());
        let mut policies = PolicyWatch::new(&self.client, self.stats.clone());
        let mut gateways = GatewayWatch::new(&self.client, self.stats.clone());
        let mut unknown_gateways = UnknownGatewayLog::default();
        let started = Instant::now();
        let mut last: Option<ClusterView> = None;
        let mut deadline: Option<Instant> = None;
        loop {
            let armed = deadline;
            tokio::select! {
                step = watch.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                step = services.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                step = policies.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                step = gateways.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                _ = sleep_until(armed), if armed.is_some() => {
                    deadline = None;
                    if !watch.view.listed() && !services.listed() {
                        continue;
                    }
                    let settled = policies.settled() && gateways.settled();
                    if !settled && started.elapsed() < POLICY_LIST_WAIT {
                        // Look again shortly: bounded by POLICY_LIST_WAIT.
                        deadline = Some(Instant::now() + self.debounce);
                        continue;
                    }
                    let view = &watch.view;
                    let mut workloads: Vec<Workload> = if view.listed() {
                        view.pods
                            .values()
                            .filter(|facts| !facts.ips.is_empty())
                            .map(|facts| facts.to_workload(view.namespaces.get(&facts.key.namespace), &self.enablement))
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let mut listed_services = if services.listed() { services.services(&self.cluster_domain) } else { Vec::new() };
                    let known = Waypoints::new(gateways.waypoints(), &self.cluster_domain);
                    let inputs = waypoints::Inputs {
                        waypoints: &known,
                        namespaces: &view.namespaces,
                        service_labels: &services.waypoint_labels(),
                    };
                    waypoints::assign(&inputs, &mut workloads, &mut listed_services, &mut unknown_gateways);
                    let mut all_policies = policies.policies();
                    if let Some(trust_domain) = &self.waypoint_allow {
                        all_policies.extend(waypoint_allow::allow_from_waypoints(&mut workloads, &listed_services, trust_domain));
                    }
                    let next = ClusterView {
                        workloads: workloads.into_iter().map(Into::into).collect(),
                        services: listed_services.into_iter().map(Into::into).collect(),
                        policies: all_policies,
                    };
                    if last.as_ref() == Some(&next) {
                        continue;
                    }
                    debug!(workloads = next.workloads.len(), services = next.services.len(), "cluster view changed");
                    if last.is_none() {
                        info!(workloads = next.workloads.len(), services = next.services.len(), policies = next.policies.len(), "cluster workloads listed");
                        sink.synced(SOURCE);
                    }
                    last = Some(next.clone());
                    sink.cluster(next);
                }
            }
        }
    }
}
