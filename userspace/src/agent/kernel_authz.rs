//! The kernel's authorization table, compiled by the reconciler (its only
//! writer) from the store's policies and this node's enrolled pods, the
//! access-log lines of the connects it refused, and flow 2 of the fast
//! path, which trusts that table.

use tracing::{info, warn};

use super::{NodeAgent, PodEntry};
use crate::{
    api::KernelAuthzStatus,
    authz::kernel::{KernelSource, compile},
    proxy::access_log,
    redirect::MeshLocalTable,
    state::{PodState, Workload, WorkloadKey},
};

/// Access lines of kernel refusals a second (an application retrying a
/// denied connect in a loop would write one per try); the rest are counted
/// in `shunt_pod_policy_denials_total` anyway, and the next line written
/// says how many were left out.
pub(super) const REFUSAL_LINES_PER_SECOND: u32 = 20;

impl NodeAgent {
    /// The fd that turns readable when the kernel has refused connects
    /// ([`NodeAgent::log_kernel_refusals`] takes them).
    pub fn kernel_refusals_fd(&self) -> Option<std::os::fd::RawFd> {
        self.redirector.kernel_refusals_fd()
    }

    /// Writes an access-log line for each connect the kernel refused since
    /// the last call: as the proxy's line for a denied connection, with
    /// the client pod, its identity, the destination and the policy.
    pub fn log_kernel_refusals(&mut self) {
        for refusal in self.redirector.kernel_refusals() {
            let Some(left_out) = self.refusal_lines.allow() else {
                continue;
            };
            let identity = self
                .pods
                .get(&refusal.pod)
                .map(|e| {
                    self.with_trust_domain(&refusal.pod, &e.workload)
                        .identity(&self.trust_domain)
                        .to_string()
                })
                .unwrap_or_else(|| "-".into());
            let reason = match left_out {
                0 => "refused in the kernel at connect (EPERM)".to_owned(),
                n => format!(
                    "refused in the kernel at connect (EPERM) ({n} similar lines left out in the last second)"
                ),
            };
            warn!(
                target: access_log::TARGET,
                direction = "outbound",
                pod = %refusal.pod,
                src.identity = identity,
                dst.addr = %refusal.dst,
                result = "denied",
                policy = %refusal.policy,
                reason,
                "connection refused"
            );
        }
    }

    /// Compiles the verdicts of connects between this node's enrolled pods
    /// with the one engine and writes them into the kernel (a diff against
    /// what is there). The reconciler is the table's only writer: it alone
    /// knows the slots, and reads the policies and workloads from the
    /// store.
    pub(super) fn compile_verdicts(&mut self) {
        let Some(store) = &self.kernel_authz else {
            return;
        };
        let enrolled: Vec<(&WorkloadKey, &PodEntry, u32)> = self
            .pods
            .iter()
            .filter(|(_, e)| e.state == PodState::Enrolled)
            .filter_map(|(key, e)| Some((key, e, self.redirector.slot(key)?)))
            .collect();
        // The source speaks with the identity its proxy presents; the
        // destination is judged as the proxy judges it: by the store's
        // workload, and only for addresses the store gives it (any other
        // destination is not a mesh peer to the proxy).
        let identities: Vec<String> = enrolled
            .iter()
            .map(|(key, e, _)| {
                self.with_trust_domain(key, &e.workload)
                    .identity(&self.trust_domain)
                    .to_string()
            })
            .collect();
        let (policies, slotted) = {
            let store = store.read().unwrap_or_else(|p| p.into_inner());
            let slotted: Vec<(u32, Workload)> = enrolled
                .iter()
                .filter_map(|(key, _, slot)| Some((*slot, store.get(key)?.clone())))
                .filter(|(_, w)| w.wants_mesh())
                .collect();
            (store.policies().clone(), slotted)
        };
        let destinations: Vec<Workload> = slotted.iter().map(|(_, w)| w.clone()).collect();
        let sources: Vec<KernelSource<'_>> = enrolled
            .iter()
            .zip(&identities)
            .map(|((_, e, slot), identity)| KernelSource {
                slot: *slot,
                identity,
                ips: &e.workload.ips,
            })
            .collect();
        let destinations: Vec<&Workload> = destinations.iter().collect();
        let table = compile(&policies, &sources, &destinations);
        // Flow 2 of the fast path trusts this table (a missing entry means
        // "allowed"): off before it changes, on again only once it was
        // written whole (`redirect::mesh_local`).
        let verdicts_changed = self.last_verdicts.as_ref() != Some(&table.entries);
        if verdicts_changed {
            self.redirector.write_mesh_local(None);
        }
        let Some(written) = self.redirector.write_verdicts(&table) else {
            info!(
                mode = %self.redirector.mode(),
                "this redirection mode has no kernel enforcement point: the proxy alone enforces authorization"
            );
            self.kernel_authz = None;
            return;
        };
        let status = KernelAuthzStatus {
            policies: table.policies.iter().map(ToString::to_string).collect(),
            entries: written.entries,
            left_to_proxy: table.left_to_proxy + written.failed_pairs,
            error: written.error.clone(),
        };
        if let Some(error) = &written.error {
            warn!(
                %error,
                failed_pairs = written.failed_pairs,
                "the kernel's authorization table could not take every verdict; those pod pairs are left to the proxy, which enforces them"
            );
        }
        if written.inserted + written.deleted > 0
            || self.kernel_authz_status.as_ref() != Some(&status)
        {
            info!(
                entries = written.entries,
                inserted = written.inserted,
                deleted = written.deleted,
                policies = table.policies.len(),
                sources = sources.len(),
                left_to_proxy = status.left_to_proxy,
                "authorization verdicts compiled into the kernel"
            );
        }
        self.kernel_authz_status = Some(status);
        let complete = written.error.is_none();
        self.last_verdicts = complete.then(|| table.entries.clone());
        let mesh_local = complete.then(|| {
            let enrolled: Vec<(u32, &Workload)> =
                slotted.iter().map(|(slot, w)| (*slot, w)).collect();
            let mut mesh_local = MeshLocalTable::derive(&enrolled, &table.inexact);
            // Every enrolled pod was compiled as a source, including those
            // the store does not know yet (never destinations then).
            mesh_local.sources.extend(sources.iter().map(|s| s.slot));
            // The VIPs whose endpoints all are those destinations (vip).
            let store = store.read().unwrap_or_else(|p| p.into_inner());
            mesh_local.add_services(store.services().iter());
            mesh_local
        });
        if let Some(result) = self.redirector.write_mesh_local(mesh_local.as_ref())
            && self.mesh_local_status.as_ref() != Some(&result)
        {
            match &result.error {
                Some(error) => warn!(
                    %error,
                    "same-node mesh fast path left off: those connections go through the proxy"
                ),
                None if result.on => info!(
                    sources = result.sources,
                    destinations = result.destinations,
                    services = result.services,
                    services_left_out = result.services_left_out,
                    "same-node mesh fast path on"
                ),
                None => info!(
                    "same-node mesh fast path off (the authorization table is incomplete, or --fast-path off)"
                ),
            }
            self.mesh_local_status = Some(result);
        }
    }

    /// Every enrolled pod with its slot (what the kernel's verdicts are
    /// keyed by).
    pub(super) fn enrolled_slots(&self) -> Vec<(WorkloadKey, u32)> {
        self.pods
            .iter()
            .filter(|(_, e)| e.state == PodState::Enrolled)
            .filter_map(|(key, _)| Some((key.clone(), self.redirector.slot(key)?)))
            .collect()
    }
}
