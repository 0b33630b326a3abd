//! Enrolling, verifying, listing and unenrolling pods: the [`Redirector`]
//! side of the eBPF mode (the steps are in the module docs of [`super`]).

use super::{
    reply::{self, reply_path},
    settings::{pod_addrs, pod_config},
    *,
};
use crate::{
    authz::{PolicyKey, kernel::VerdictTable},
    netns::{NetNsError, netns_cookie_of_current_thread},
    redirect::VerdictsWritten,
};

impl EbpfRedirector {
    /// The lowest slot no enrolment entry uses (kept in memory: walking
    /// the map made each enrolment O(pods), see `slots.rs`).
    fn free_slot(&self) -> Option<u32> {
        self.slots.lowest_free()
    }

    fn reset_counters(&mut self, pod: &WorkloadKey, slot: u32) -> Result<(), RedirectError> {
        let zeros = nr_cpus()
            .map_err(|(_, e)| kernel(pod, "counting CPUs", e))
            .and_then(|n| {
                PerCpuValues::try_from(vec![PodCounters::default(); n])
                    .map_err(|e| kernel(pod, "sizing counters", e))
            })?;
        self.counters_map
            .set(slot, zeros, 0)
            .map_err(|e| kernel(pod, "resetting the pod's counters", e))
    }

    fn read_counters(&self, slot: u32) -> PodCounters {
        let mut total = PodCounters::default();
        if let Ok(per_cpu) = self.counters_map.get(&slot, 0) {
            for cpu in per_cpu.iter() {
                total.add(cpu);
            }
        }
        total
    }

    /// One enrolled pod's hooks (its TC filters read in its netns; the
    /// socket programs' and splice's presence passed in, read once per
    /// listing) and counters (from the pinned map).
    fn enrolled_pod(
        &self,
        key: &WorkloadKey,
        enrolment: &Enrolment,
        sockets: [bool; cgroup::PROGRAMS.len()],
        splice_present: bool,
    ) -> EnrolledPod {
        let present = enrolment
            .netns
            .run(tc::present)
            .ok()
            .and_then(Result::ok)
            .unwrap_or([false; 2]);
        let mut hooks: Vec<Hook> = tc::programs()
            .into_iter()
            .zip(present)
            .map(|((name, attach_type), present)| Hook {
                name: format!("tc {}", tc::direction(attach_type)),
                attachment: format!(
                    "{name}: netlink clsact filter on eth0, priority {TC_PRIORITY}, handle 0:1"
                ),
                present,
            })
            .collect();
        if enrolment.config.flags & PodConfig::REDIRECT_OUTBOUND != 0 {
            hooks.extend(
                cgroup::PROGRAMS
                    .into_iter()
                    .zip(sockets)
                    .filter(|(name, _)| {
                        enrolment.config.flags & PodConfig::DNS_CAPTURE != 0
                            || !cgroup::DNS_PROGRAMS.contains(name)
                    })
                    .map(|(name, present)| Hook {
                        name: name.trim_start_matches("shunt_").to_string(),
                        attachment: format!(
                            "{name}: BPF link on cgroup {}",
                            self.cgroup_root.display()
                        ),
                        present,
                    }),
            );
        }
        // Only pods whose connections are spliced (see `--splice`
        // and the pod's `shunt.io/splice`) show the hook.
        if self.splice() && enrolment.config.flags & PodConfig::NO_SPLICE == 0 {
            hooks.push(Hook {
                name: "splice".to_string(),
                attachment: format!(
                    "{}: sk_msg on map {}; {}: raw tracepoint {}",
                    shunt_common::programs::SPLICE_MSG,
                    maps::SPLICE_SOCKS,
                    shunt_common::programs::SPLICE_RECV,
                    shunt_common::programs::SPLICE_RECV_TARGET
                ),
                present: splice_present,
            });
        }
        EnrolledPod {
            key: key.clone(),
            netns: enrolment.netns.path().to_path_buf(),
            netns_cookie: enrolment.cookie,
            mode: RedirectMode::Ebpf,
            hooks,
            counters: self.read_counters(enrolment.slot),
        }
    }

    /// Attaches the agent's TC programs inside the pod's netns, with the
    /// pod's slot in the filters' classid.
    fn attach_tc(
        &mut self,
        pod: &WorkloadKey,
        netns: &NetNs,
        slot: u32,
    ) -> Result<(), RedirectError> {
        let netns_path = netns.path().to_path_buf();
        let ebpf = &mut self.ebpf;
        netns.run(|| tc::attach(pod, ebpf, slot, &netns_path))?
    }

    /// Writes the record that lets a later agent clean up after this pod.
    fn write_record(&mut self, pod: &WorkloadKey, cookie: u64, netns: &Path) {
        let mut record = PodRecord::default();
        copy_cut(&mut record.pod, pod.to_string().as_bytes());
        copy_cut(&mut record.netns, netns.as_os_str().as_encoded_bytes());
        if let Err(e) = self.records_map.insert(cookie, record, 0) {
            warn!(%pod, error = %e, "cannot record the pod; a later agent could not clean up after it");
        }
    }

    /// The pod name and netns path recorded for `cookie`.
    fn read_record(&self, cookie: u64) -> Option<(String, PathBuf)> {
        let record = self.records_map.get(&cookie, 0).ok()?;
        let text = |bytes: &[u8]| {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            String::from_utf8_lossy(&bytes[..end]).into_owned()
        };
        Some((text(&record.pod), PathBuf::from(text(&record.netns))))
    }

    /// Re-attaches whatever is missing for an enrolled pod.
    fn repair(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let Verification::Missing(missing) = self.verify(pod)? else {
            return Ok(());
        };
        warn!(%pod, ?missing, "enrolled pod was not fully redirected; repairing");
        let Some(enrolment) = self.pods.get_mut(pod) else {
            return Err(RedirectError::NotEnrolled(pod.clone()));
        };
        if missing.iter().any(|m| m == reply::FWMARK_ACCEPT_OFF) {
            // Sockets accepted while it was off carry no mark: their
            // replies are only found by looking up every packet, for good.
            warn!(%pod, "tcp_fwmark_accept was turned off in the pod's network namespace: TC egress looks up every packet it sends again");
            enrolment.config.flags &= !PodConfig::REPLY_BY_MARK;
        }
        let (cookie, slot, config, addrs) = (
            enrolment.cookie,
            enrolment.slot,
            enrolment.config,
            enrolment.addrs,
        );
        let netns = NetNs::open(enrolment.netns.path())?;
        self.write_settings(pod, slot, config, addrs)?;
        self.enrolled_map
            .insert(cookie, PodSlot { slot, flags: 0 }, 0)
            .map_err(|e| kernel(pod, "recording the enrolment", e))?;
        self.slots.take(slot);
        self.attach_tc(pod, &netns, slot)?;
        reply_path(pod, &netns, config)
    }

    /// Writes a pod's settings and addresses into its slot.
    fn write_settings(
        &mut self,
        pod: &WorkloadKey,
        slot: u32,
        config: PodConfig,
        addrs: PodAddrs,
    ) -> Result<(), RedirectError> {
        self.config_map
            .set(slot, config, 0)
            .map_err(|e| kernel(pod, "writing the pod's settings", e))?;
        let old = self.addrs_map.get(&slot, 0).map_or(0, |a| a.ipv4);
        self.addrs_map
            .set(slot, addrs, 0)
            .map_err(|e| kernel(pod, "writing the pod's addresses", e))?;
        self.host_probes.pod_addr_changed(slot, old, addrs.ipv4);
        Ok(())
    }

    /// Forgets a pod whose network namespace was replaced (its sandbox
    /// recreated): its entries under the old netns cookie and its slot go
    /// first, so nothing is keyed by a namespace no source names; then its
    /// filters and policy route in the old namespace, best effort (that
    /// namespace is going away; usually its `eth0` is already gone).
    fn leave_old_netns(&mut self, pod: &WorkloadKey, new_path: &Path) {
        let Some(old) = self.pods.remove(pod) else {
            return;
        };
        self.forget(old.cookie, old.slot);
        info!(%pod, old_netns = %old.netns.path().display(), old_cookie = old.cookie, new_netns = %new_path.display(), "the pod's network namespace changed (its sandbox was recreated): forgot the old one, enrolling the new one");
        let detached = old
            .netns
            .run(|| tc::detach(pod))
            .map_err(RedirectError::from)
            .and_then(|r| r);
        if let Err(e) = detached {
            warn!(%pod, error = %e, "cannot detach the TC programs in the pod's old network namespace");
        }
        if old.config.flags & PodConfig::REPLY_TO_PROXY != 0 {
            match old.netns.run(reply::remove_reply_path) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    warn!(%pod, error = %e, "cannot delete the policy route in the pod's old network namespace")
                }
                Err(e) => {
                    warn!(%pod, error = %e, "cannot delete the policy route in the pod's old network namespace")
                }
            }
        }
    }

    /// Takes a pod out of the maps (and its record off disk).
    fn forget(&mut self, cookie: u64, slot: u32) {
        let _ = self.enrolled_map.remove(&cookie);
        let _ = self.config_map.set(slot, PodConfig::default(), 0);
        let old = self.addrs_map.get(&slot, 0).map_or(0, |a| a.ipv4);
        self.host_probes.pod_addr_changed(slot, old, 0);
        let _ = self.addrs_map.set(slot, PodAddrs::default(), 0);
        let _ = self.records_map.remove(&cookie);
        self.slots.free(slot);
        self.policy.forget_slot(slot);
        self.mesh_local.forget_slot(slot);
    }
}

impl Redirector for EbpfRedirector {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Ebpf
    }

    fn before_serving(&self, pod: &WorkloadKey, netns: &Path) -> Result<(), RedirectError> {
        self.fwmark_accept_before_serving(pod, netns)
    }

    fn enrol(&mut self, target: &PodTarget) -> Result<(), RedirectError> {
        let pod = &target.key;
        let mut config = pod_config(target, self.splice, self.preserve_source, self.fast_path)?;
        let preserve = config.flags & PodConfig::REPLY_TO_PROXY != 0;
        let addrs = pod_addrs(&target.ips);
        if let Some(existing) = self.pods.get_mut(pod) {
            // By identity, not path: a recreated sandbox may reuse the path.
            if existing.netns.is_at(&target.netns) {
                if existing.netns.path() != target.netns {
                    // Another name for the same namespace: keep the one the
                    // source gives (a later agent's record must open it).
                    if let Ok(renamed) = NetNs::open(&target.netns)
                        && renamed.same_as(&existing.netns)
                    {
                        existing.netns = renamed;
                        let cookie = existing.cookie;
                        self.write_record(pod, cookie, &target.netns);
                    }
                }
                let Some(existing) = self.pods.get_mut(pod) else {
                    return Err(RedirectError::NotEnrolled(pod.clone()));
                };
                // Decided at the pod's enrolment; only a repair drops it.
                if preserve {
                    config.flags |= existing.config.flags & PodConfig::REPLY_BY_MARK;
                }
                if (existing.config, existing.addrs) != (config, addrs) {
                    existing.config = config;
                    existing.addrs = addrs;
                    let slot = existing.slot;
                    self.write_settings(pod, slot, config, addrs)?;
                    info!(%pod, ?target.capture, ips = ?target.ips, "capture settings changed");
                }
                return self.repair(pod);
            }
            // The pod's netns changed (its sandbox was recreated): start over.
            self.leave_old_netns(pod, &target.netns);
        }
        let netns = NetNs::open(&target.netns)?;
        // `tcp_fwmark_accept` goes on first, in the same trip into the netns
        // as reading its cookie: before anything below steers the pod's
        // inbound to the proxy, so that the application accepts the
        // proxy's connections marked (see `reply::reply_by_mark`). It is
        // normally on already: `before_serving` turned it on before the
        // proxy bound the pod's listeners, and `fwmark_was_on` answers
        // what it was before that.
        let (cookie, fwmark_accept) = netns.run(move || {
            (
                netns_cookie_of_current_thread(),
                preserve.then(reply::enable_fwmark_accept),
            )
        })?;
        let cookie = cookie.map_err(|source| NetNsError::Cookie {
            path: netns.path().to_path_buf(),
            source,
        })?;
        let fwmark_accept = fwmark_accept.map(|now| self.fwmark_was_on(&netns, now));
        if let Some((other, _)) = self.pods.iter().find(|(_, e)| e.cookie == cookie) {
            return Err(RedirectError::NetNsTaken {
                pod: pod.clone(),
                netns: target.netns.clone(),
                other: other.clone(),
            });
        }
        // A previous agent's entry for this netns is adopted with its slot:
        // counters and filters carry on without a gap.
        let (slot, earlier) = match self.enrolled_map.get(&cookie, 0) {
            // Unreadable settings count as an earlier release's.
            Ok(existing) => (
                existing.slot,
                Some(self.config_map.get(&existing.slot, 0).unwrap_or_default()),
            ),
            Err(_) => {
                let slot = self.free_slot().ok_or(RedirectError::Full {
                    pod: pod.clone(),
                    max: MAX_PODS,
                })?;
                self.reset_counters(pod, slot)?;
                (slot, None)
            }
        };
        if let Some(fwmark_accept) = &fwmark_accept {
            if reply::reply_by_mark(earlier.as_ref(), fwmark_accept) {
                config.flags |= PodConfig::REPLY_BY_MARK;
            } else if let Err(e) = fwmark_accept {
                warn!(%pod, error = %e, "cannot enable net.ipv4.tcp_fwmark_accept in the pod's network namespace: TC egress looks up every packet the pod sends");
            } else {
                info!(%pod, "adopted pod: its application may hold connections from the proxy accepted without a mark, so TC egress looks up every packet it sends until its network namespace changes");
            }
        }
        self.write_settings(pod, slot, config, addrs)?;
        self.enrolled_map
            .insert(cookie, PodSlot { slot, flags: 0 }, 0)
            .map_err(|e| kernel(pod, "recording the enrolment", e))?;
        self.slots.take(slot);
        let attached = self
            .attach_tc(pod, &netns, slot)
            .and_then(|()| reply_path(pod, &netns, config));
        if let Err(error) = attached {
            // Leave nothing half-done behind.
            let _ = netns.run(|| tc::detach(pod));
            let _ = netns.run(reply::remove_reply_path);
            self.forget(cookie, slot);
            return Err(error);
        }
        self.write_record(pod, cookie, &target.netns);
        let spliced = config.flags & PodConfig::NO_SPLICE == 0 && self.splice();
        info!(%pod, netns = %target.netns.display(), cookie, slot, outbound = target.capture.outbound, inbound = target.capture.inbound, spliced, "pod enrolled: TC ingress+egress on eth0, socket programs gated on its netns");
        self.pods.insert(
            pod.clone(),
            Enrolment {
                netns,
                cookie,
                slot,
                config,
                addrs,
            },
        );
        Ok(())
    }

    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let enrolment = self
            .pods
            .remove(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        // Outbound capture stops first (the entry gates it), then inbound.
        self.forget(enrolment.cookie, enrolment.slot);
        enrolment.netns.run(|| tc::detach(pod))??;
        if enrolment.config.flags & PodConfig::REPLY_TO_PROXY != 0 {
            enrolment
                .netns
                .run(reply::remove_reply_path)?
                .map_err(|e| kernel(pod, "deleting the policy route", e))?;
        }
        info!(%pod, "pod unenrolled: TC programs detached, enrolment entry removed");
        Ok(())
    }

    fn verify(&self, pod: &WorkloadKey) -> Result<Verification, RedirectError> {
        let enrolment = self
            .pods
            .get(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        let mut missing = Vec::new();
        match self.enrolled_map.get(&enrolment.cookie, 0) {
            Ok(entry) if entry.slot == enrolment.slot => {}
            _ => missing.push(format!("{} entry", maps::ENROLLED)),
        }
        if self.config_map.get(&enrolment.slot, 0).ok() != Some(enrolment.config) {
            missing.push(format!("{} settings", maps::POD_CONFIG));
        }
        if self.addrs_map.get(&enrolment.slot, 0).ok() != Some(enrolment.addrs) {
            missing.push(format!("{} addresses", maps::POD_ADDRS));
        }
        let present = enrolment
            .netns
            .run(tc::present)?
            .map_err(|e| kernel(pod, "listing TC filters", e))?;
        for ((name, _), present) in tc::programs().into_iter().zip(present) {
            if !present {
                missing.push(format!("TC filter {name} on eth0"));
            }
        }
        if enrolment.config.flags & PodConfig::REPLY_TO_PROXY != 0 {
            let by_mark = enrolment.config.flags & PodConfig::REPLY_BY_MARK != 0;
            let (routes, fwmark_accept) = enrolment
                .netns
                .run(|| -> std::io::Result<_> {
                    let routes = route::families()
                        .into_iter()
                        .map(|family| route::present(family).map(|p| (family, p)))
                        .collect::<std::io::Result<Vec<_>>>()?;
                    Ok((routes, !by_mark || reply::fwmark_accept_on()?))
                })?
                .map_err(|e| kernel(pod, "reading the policy route", e))?;
            if !fwmark_accept {
                missing.push(reply::FWMARK_ACCEPT_OFF.to_string());
            }
            for (family, present) in routes {
                if !(present.rule && present.route) {
                    missing.push(format!(
                        "{} policy route ({})",
                        family.label(),
                        route::describe(family)
                    ));
                }
            }
        }
        for (name, present) in cgroup::PROGRAMS
            .into_iter()
            .zip(cgroup::present(&self.pin_dir))
        {
            if !present {
                missing.push(format!("socket program {name}"));
            }
        }
        Ok(if missing.is_empty() {
            Verification::Redirected
        } else {
            Verification::Missing(missing)
        })
    }

    fn list(&self) -> Vec<EnrolledPod> {
        let sockets = cgroup::present(&self.pin_dir);
        let splice_present = self.splice() && splice::present(&self.pin_dir);
        self.pods
            .iter()
            .map(|(key, enrolment)| self.enrolled_pod(key, enrolment, sockets, splice_present))
            .collect()
    }

    fn inspect(&self, pod: &WorkloadKey) -> Option<EnrolledPod> {
        let (key, enrolment) = self.pods.get_key_value(pod)?;
        let sockets = cgroup::present(&self.pin_dir);
        let splice_present = self.splice() && splice::present(&self.pin_dir);
        Some(self.enrolled_pod(key, enrolment, sockets, splice_present))
    }

    fn is_enrolled(&self, pod: &WorkloadKey) -> bool {
        self.pods.contains_key(pod)
    }

    fn remove_node_state(&mut self) -> Result<(), crate::redirect::NodeCleanupError> {
        uninstall::remove_pins(&self.pin_dir).map(|_| ())
    }

    fn remove_stale(&mut self) -> usize {
        let owned: HashSet<u64> = self.pods.values().map(|e| e.cookie).collect();
        let stale: Vec<(u64, u32)> = self
            .enrolled_map
            .iter()
            .filter_map(Result::ok)
            .filter(|(cookie, _)| !owned.contains(cookie))
            .map(|(cookie, pod)| (cookie, pod.slot))
            .collect();
        for &(cookie, slot) in &stale {
            let (name, netns_path) = match self.read_record(cookie) {
                Some((name, path)) => (name, Some(path)),
                None => ("unknown pod".to_string(), None),
            };
            // The pod's netns may still exist (the pod left the mesh while no
            // agent ran): then its filters must go too. Same cookie, or it is
            // a different namespace now at that path.
            if let Some(path) = netns_path
                && let Ok(netns) = NetNs::open(&path)
                && netns.cookie().ok() == Some(cookie)
            {
                let key = WorkloadKey::new("stale", name.clone());
                if let Err(e) = netns
                    .run(|| tc::detach(&key))
                    .map_err(RedirectError::from)
                    .and_then(|r| r)
                {
                    warn!(pod = %name, error = %e, "cannot detach a stale pod's TC programs");
                }
                // Whether the previous agent preserved sources is unknown:
                // deleting an absent route is no error.
                match netns.run(reply::remove_reply_path) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        warn!(pod = %name, error = %e, "cannot delete a stale pod's policy route")
                    }
                    Err(e) => {
                        warn!(pod = %name, error = %e, "cannot delete a stale pod's policy route")
                    }
                }
            }
            self.forget(cookie, slot);
            info!(pod = %name, cookie, "removed what a previous agent left for a pod that is no longer enrolled");
        }
        stale.len()
    }

    fn original_dst_resolver(&self) -> Arc<dyn OriginalDst> {
        self.original_dst.clone()
    }

    fn slot(&self, pod: &WorkloadKey) -> Option<u32> {
        self.pods.get(pod).map(|e| e.slot)
    }

    fn write_verdicts(&mut self, table: &VerdictTable) -> Option<VerdictsWritten> {
        Some(self.policy.write(table))
    }

    fn write_mesh_local(
        &mut self,
        table: Option<&crate::redirect::MeshLocalTable>,
    ) -> Option<crate::redirect::MeshLocalWritten> {
        Some(self.mesh_local.write(table))
    }

    fn policy_denials(&self) -> BTreeMap<WorkloadKey, Vec<(PolicyKey, u64)>> {
        let mut by_slot = self.policy.denials();
        self.pods
            .iter()
            .filter_map(|(key, e)| Some((key.clone(), by_slot.remove(&e.slot)?)))
            .collect()
    }

    fn kernel_refusals_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.policy.refusals_fd())
    }

    fn kernel_refusals(&mut self) -> Vec<crate::redirect::KernelRefusal> {
        let refusals = self.policy.refusals();
        if refusals.is_empty() {
            return Vec::new();
        }
        let by_slot: BTreeMap<u32, &WorkloadKey> =
            self.pods.iter().map(|(key, e)| (e.slot, key)).collect();
        refusals
            .into_iter()
            // A pod gone since (its slot freed) is no longer named.
            .filter_map(|(slot, policy, dst)| {
                Some(crate::redirect::KernelRefusal {
                    pod: (*by_slot.get(&slot)?).clone(),
                    dst,
                    policy,
                })
            })
            .collect()
    }
}

/// Copies as much of `from` as fits, leaving the rest NUL.
fn copy_cut(into: &mut [u8], from: &[u8]) {
    let n = from.len().min(into.len());
    into[..n].copy_from_slice(&from[..n]);
}
