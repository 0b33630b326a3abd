//! Kubelet's probes, on the node side (iptables mode), as istio-cni does
//! them (cni/pkg/iptables: `ISTIO_POSTRT` with `-m owner --socket-exists`
//! and the `istio-inpod-probes` ipset): in the node's network namespace
//! (`--node-netns`, where kubelet runs), TCP that a local socket sends to an
//! enrolled pod's IPv4 address is SNATed to the probe source
//! (169.254.7.127), which the pods' rules let through to the application.
//! `--socket-exists` leaves forwarded traffic (another node's, a NodePort's
//! kube-proxy SNAT) alone: only what the node itself originates is a probe.
//!
//! One rule per enrolled pod in the chain `SHUNT_PROBE_SNAT` of the node's
//! nat table, jumped to first from `POSTROUTING`: rewritten whole (one
//! `iptables-restore --noflush`) when the set of pod addresses changes,
//! bounded by the agent's pods; its counters are the probes rewritten
//! (`iptables -t nat -L SHUNT_PROBE_SNAT -v`). Limitation: a chain of rules
//! where istio-cni has an ipset (a lookup per locally sent packet to a pod,
//! linear in the node's pods); IPv4 only.

use std::{collections::BTreeSet, net::Ipv4Addr, path::Path};

use tracing::info;

use super::{IptablesError, Tools};
use crate::netns::NetNs;

/// The node's chain.
pub const CHAIN_PROBE_SNAT: &str = "SHUNT_PROBE_SNAT";

/// The node side of probes: the node's netns and what is installed there.
pub(super) struct HostProbeSnat {
    netns: NetNs,
    probe_source: Ipv4Addr,
    /// The pod addresses the chain holds now (`None`: not written yet).
    installed: Option<BTreeSet<Ipv4Addr>>,
}

impl HostProbeSnat {
    pub(super) fn open(
        node_netns: &Path,
        probe_source: Ipv4Addr,
    ) -> Result<Self, crate::netns::NetNsError> {
        Ok(Self {
            netns: NetNs::open(node_netns)?,
            probe_source,
            installed: None,
        })
    }

    /// Makes the chain SNAT exactly `pods` (enrolled pods' IPv4 addresses).
    pub(super) fn sync(
        &mut self,
        tools: &Tools,
        pods: &BTreeSet<Ipv4Addr>,
    ) -> Result<(), IptablesError> {
        if self.installed.as_ref() == Some(pods) {
            return Ok(());
        }
        let saved = tools.run_in(&self.netns, &tools.v4.save, &["-t", "nat"], None)?;
        let jump = format!("-A POSTROUTING -j {CHAIN_PROBE_SNAT}");
        let mut input = format!("*nat\n:{CHAIN_PROBE_SNAT} - [0:0]\n");
        for ip in pods {
            input.push_str(&format!(
                "-A {CHAIN_PROBE_SNAT} -d {ip}/32 -p tcp -m owner --socket-exists -j SNAT --to-source {}\n",
                self.probe_source
            ));
        }
        if !saved.lines().any(|line| line.trim() == jump) {
            input.push_str(&format!("-I POSTROUTING 1 -j {CHAIN_PROBE_SNAT}\n"));
        }
        input.push_str("COMMIT\n");
        tools.run_in(
            &self.netns,
            &tools.v4.restore,
            tools.restore_args(),
            Some(&input),
        )?;
        info!(node_netns = %self.netns.path().display(), pods = pods.len(), probe_source = %self.probe_source, "node rules: kubelet's probes to enrolled pods SNATed to the probe source");
        self.installed = Some(pods.clone());
        Ok(())
    }

    /// Uninstall: the jump and the chain leave the node's nat table.
    pub(super) fn remove(&mut self, tools: &Tools) -> Result<(), IptablesError> {
        let saved = tools.run_in(&self.netns, &tools.v4.save, &["-t", "nat"], None)?;
        let jump = format!("-A POSTROUTING -j {CHAIN_PROBE_SNAT}");
        let mut input = String::from("*nat\n");
        if saved.lines().any(|line| line.trim() == jump) {
            input.push_str(&format!("-D POSTROUTING -j {CHAIN_PROBE_SNAT}\n"));
        }
        if saved
            .lines()
            .any(|line| line.starts_with(&format!(":{CHAIN_PROBE_SNAT} ")))
        {
            input.push_str(&format!("-F {CHAIN_PROBE_SNAT}\n-X {CHAIN_PROBE_SNAT}\n"));
        }
        input.push_str("COMMIT\n");
        tools.run_in(
            &self.netns,
            &tools.v4.restore,
            tools.restore_args(),
            Some(&input),
        )?;
        info!(node_netns = %self.netns.path().display(), "node rules for kubelet's probes removed");
        self.installed = None;
        Ok(())
    }
}
