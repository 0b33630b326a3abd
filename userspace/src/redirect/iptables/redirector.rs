//! The [`Redirector`] face of [`IptablesRedirector`]: enrol, unenrol,
//! verify, list and the stale-rule sweep, on top of the save/restore
//! helpers in `mod.rs`.

use super::*;

impl Redirector for IptablesRedirector {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Iptables
    }

    fn enrol(&mut self, target: &PodTarget) -> Result<(), RedirectError> {
        let pod = &target.key;
        let _span = info_span!("iptables", pod = %pod).entered();
        if let Some(existing) = self.pods.get(pod) {
            // By identity: a recreated sandbox may reuse the path.
            if existing.netns.is_at(&target.netns) {
                return self.repair(pod, &target.capture);
            }
            info!(netns = %target.netns.display(), "the pod's network namespace changed (its sandbox was recreated): enrolling it in the new one");
            // The pod's netns changed (sandbox recreated): start over.
            self.unenrol(pod)?;
        }
        validate(pod, &target.capture)?;
        let netns = NetNs::open(&target.netns)?;
        let cookie = netns.cookie()?;
        if let Some((other, _)) = self.pods.iter().find(|(_, e)| e.cookie == cookie) {
            return Err(RedirectError::NetNsTaken {
                pod: pod.clone(),
                netns: target.netns.clone(),
                other: other.clone(),
            });
        }
        match self.apply(pod, &netns, &target.capture) {
            Ok(true) => {
                info!(netns = %target.netns.display(), backend = %self.tools.backend, outbound = target.capture.outbound, inbound = target.capture.inbound, "pod enrolled: iptables rules and policy route installed")
            }
            Ok(false) => {
                info!(netns = %target.netns.display(), "pod enrolled: adopted the rules already in place (left by a previous agent)")
            }
            Err(error) => {
                // Leave nothing half-done behind.
                if let Err(cleanup) = self.remove(pod, &netns) {
                    warn!(%cleanup, "cleaning up after a failed enrolment failed too");
                }
                return Err(error);
            }
        }
        self.pods.insert(
            pod.clone(),
            Enrolment {
                netns,
                cookie,
                capture: target.capture.clone(),
                ipv4: target
                    .ips
                    .iter()
                    .filter_map(|ip| match ip {
                        std::net::IpAddr::V4(v4) => Some(*v4),
                        std::net::IpAddr::V6(_) => None,
                    })
                    .collect(),
                repairs: 0,
            },
        );
        self.sync_host_probes();
        Ok(())
    }

    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let _span = info_span!("iptables", pod = %pod).entered();
        let enrolment = self
            .pods
            .remove(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        self.remove(pod, &enrolment.netns)?;
        info!("pod unenrolled: iptables rules, chains and policy route removed");
        self.sync_host_probes();
        Ok(())
    }

    fn verify(&self, pod: &WorkloadKey) -> Result<Verification, RedirectError> {
        let _span = info_span!("iptables", pod = %pod).entered();
        let enrolment = self
            .pods
            .get(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        let drift = self.drift(pod, &enrolment.netns, &enrolment.capture)?;
        Ok(if drift.is_empty() {
            Verification::Redirected
        } else {
            warn!(?drift, "pod's redirection drifted");
            Verification::Missing(drift)
        })
    }

    fn is_enrolled(&self, pod: &WorkloadKey) -> bool {
        self.pods.contains_key(pod)
    }

    fn list(&self) -> Vec<EnrolledPod> {
        self.pods
            .iter()
            .map(|(key, enrolment)| self.enrolled_pod(key, enrolment))
            .collect()
    }

    fn inspect(&self, pod: &WorkloadKey) -> Option<EnrolledPod> {
        let (key, enrolment) = self.pods.get_key_value(pod)?;
        Some(self.enrolled_pod(key, enrolment))
    }

    /// Scans the named namespaces (`/var/run/netns`) for jumps tagged with
    /// this agent's owner comment in namespaces it has not enrolled, and
    /// removes everything of ours there. Only our own owner's: agents of
    /// other nodes on the same kernel (tests, the demo) are left alone (see
    /// [`IptablesRedirector::owner_comment`]).
    fn remove_node_state(&mut self) -> Result<(), crate::redirect::NodeCleanupError> {
        match self.host_probes.as_mut() {
            Some(host) => {
                host.remove(&self.tools)
                    .map_err(|e| crate::redirect::NodeCleanupError::Command {
                        what: "removing the node's probe rules",
                        detail: e.to_string(),
                    })
            }
            None => Ok(()),
        }
    }

    fn remove_stale(&mut self) -> usize {
        let comment = self.owner_comment.clone();
        let entries = match std::fs::read_dir(NETNS_DIR) {
            Ok(entries) => entries,
            Err(error) => {
                debug!(dir = NETNS_DIR, %error, "no named network namespaces to scan");
                return 0;
            }
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            // Namespaces come and go while we scan; one that vanished has
            // nothing left to clean.
            let Ok(netns) = NetNs::open(&path) else {
                continue;
            };
            if self.pods.values().any(|e| e.netns.same_as(&netns)) {
                continue;
            }
            let key = WorkloadKey::new("(stale)", path.display().to_string());
            let ours = self
                .families(&Capture::default())
                .iter()
                .any(|(rules, tools)| {
                    self.save(&key, &netns, rules.family, tools)
                        .is_ok_and(|saved| {
                            rules::has_owner_jump(&saved, &comment, &rules.chain_names())
                        })
                });
            if !ours {
                continue;
            }
            let _span = info_span!("iptables", netns = %path.display()).entered();
            match self.remove(&key, &netns) {
                Ok(()) => {
                    info!(
                        "removed redirection a previous agent left in a namespace no pod of this node uses"
                    );
                    removed += 1;
                }
                Err(error) => warn!(%error, "cannot remove stale redirection"),
            }
        }
        removed
    }

    fn original_dst_resolver(&self) -> Arc<dyn OriginalDst> {
        self.resolver.clone()
    }
}

/// Refuses settings iptables cannot express.
fn validate(pod: &WorkloadKey, capture: &Capture) -> Result<(), RedirectError> {
    for (addr, prefix) in &capture.excluded_outbound_cidrs {
        if *prefix > 32 {
            return Err(RedirectError::InvalidCapture {
                pod: pod.clone(),
                problem: format!("excluded CIDR {addr}/{prefix}: prefix longer than 32"),
            });
        }
    }
    if capture.excluded_outbound_ports.contains(&0) || capture.excluded_inbound_ports.contains(&0) {
        return Err(RedirectError::InvalidCapture {
            pod: pod.clone(),
            problem: "excluded port 0".into(),
        });
    }
    Ok(())
}
