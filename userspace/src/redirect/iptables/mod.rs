//! The iptables redirection mode: netfilter rules inside each enrolled pod's
//! netns, equivalent to Istio's in-pod (ztunnel) rules, for kernels without
//! the eBPF hooks and as the baseline the benchmarks compare against.
//!
//! Enrolling a pod, for IPv4 and (when the kernel has it) IPv6:
//!
//! 1. reads the pod netns's tables with `iptables-save` (via `nsenter`);
//! 2. plans the `iptables-restore --noflush` input that makes our chains
//!    (`SHUNT_PRERT`, `SHUNT_OUTPUT` in `nat` and `mangle`, see
//!    [`rules::RuleSet::inpod`]) and their jumps exactly what we want,
//!    touching nothing else, and applies it atomically per table — or
//!    nothing at all when everything is already in place (an agent restart
//!    adopts what the previous agent installed, counters and all);
//! 3. adds the policy route for the proxy's transparent inbound connections
//!    through rtnetlink ([`route`]).
//!
//! Unenrolling deletes our jumps, flushes and deletes our chains, and deletes
//! the route and rule: `iptables-save` and `ip rule`/`ip route show table
//! all` read the same as before enrolment. (A table that did not exist
//! before — e.g. `nat` in a pod that never had a rule — stays, empty, with
//! its built-in chains and ACCEPT policies: iptables has no command to drop
//! a table, and Istio leaves it the same way. It holds no rule and no chain
//! of ours.)
//!
//! Rules are kernel state owned by the netns, not by this process: a killed
//! agent leaves redirection working, and the next one adopts it. Our jumps
//! carry the comment `shunt:<node>@<agent netns inode>`, which is how
//! [`Redirector::remove_stale`] recognises what a previous agent of the same
//! node left in namespaces it is no longer told about.
//!
//! Counters ([`PodCounters`]) mean something different here than in the eBPF
//! mode: nat rules only see the first packet of each connection, so
//! `packets_out`/`bytes_out` are the packet and byte counters of the nat
//! `OUTPUT` REDIRECT-to-15001 rule (connections redirected outbound and the
//! bytes of their SYNs), and `packets_in`/`bytes_in` those of the nat
//! `PREROUTING` REDIRECT-to-15006 rule (inbound plaintext connections
//! redirected). IPv4 and IPv6 are summed. Rewriting a drifted chain resets
//! its counters.
//!
//! With `--proxy ztunnel` the rule set is Istio's own instead
//! ([`InpodRules::Istio`], `istio.rs`): `ISTIO_PRERT`/`ISTIO_OUTPUT`,
//! TPROXY for inbound, the policy route in table 100 — what a stock ztunnel
//! finds under istio-cni. Enrolment, verify, repair and removal work the
//! same on either set.
//!
//! The proxy reads the original destination with `SO_ORIGINAL_DST`
//! ([`SoOriginalDst`]), on both listeners: REDIRECT also rewrites the local
//! address of inbound connections (to `podIP:15006`).

mod backend;
mod host_probes;
mod istio;
mod original_dst;
mod redirector;
mod rules;

use std::{
    collections::BTreeMap,
    io,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::redirect::route;
pub use crate::redirect::route::{ROUTE_TABLE, RULE_PRIORITY};
pub use backend::Backend;
pub use host_probes::CHAIN_PROBE_SNAT;
pub use istio::{CHAIN_ISTIO_OUTPUT, CHAIN_ISTIO_PRERT};
pub use original_dst::{SoOriginalDst, original_dst};
pub use rules::{CHAIN_OUTPUT, CHAIN_PREROUTING, CONN_MARK, MARK_MASK, PROBE_SOURCE_V6};
use shunt_common::PodCounters;
use tracing::{debug, info, info_span, warn};

use self::{
    backend::{FamilyTools, Tools},
    rules::{Counts, Family, RuleSet, Saved, Settings},
};
use super::{
    Capture, EnrolledPod, Hook, OriginalDst, PodTarget, RedirectError, RedirectMode, Redirector,
    Verification,
};
use crate::{netns::NetNs, state::WorkloadKey};

/// Where named network namespaces live (`ip netns`, containerd's CNI
/// namespaces, and the workloads file's `netns:` paths): what
/// `remove_stale` scans.
const NETNS_DIR: &str = "/var/run/netns";

/// Errors of the iptables tooling (wrapped with the pod's name into
/// [`RedirectError::Kernel`] when they concern a pod).
#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error(
        "{binary} not found (searched {searched}); install the Debian package `{package}` (apt-get install {package})"
    )]
    MissingBinary {
        binary: &'static str,
        package: &'static str,
        searched: String,
    },
    #[error("{binary} is not the {expected} backend: `--version` says {version:?}")]
    WrongBackend {
        binary: PathBuf,
        version: String,
        expected: Backend,
    },
    #[error("cannot run `{command}`: {source}")]
    Spawn { command: String, source: io::Error },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("`{command}` did not finish within {timeout:?} and was killed")]
    Timeout {
        command: String,
        timeout: std::time::Duration,
    },
    #[error("cannot parse the output of `{command}`: {detail}")]
    Unparsable { command: String, detail: String },
    #[error("--node-netns {}: {detail}", path.display())]
    NodeNetns { path: PathBuf, detail: String },
}

/// A pod this redirector enrolled. The open netns keeps the namespace
/// reachable for unenrolment even if its path is unmounted first.
struct Enrolment {
    netns: NetNs,
    cookie: u64,
    capture: Capture,
    /// The pod's IPv4 addresses (the node's probe rules name them).
    ipv4: Vec<Ipv4Addr>,
    /// How many times drift was found and repaired.
    repairs: u64,
}

/// Which rules a pod gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InpodRules {
    /// shunt's own (`SHUNT_PRERT`/`SHUNT_OUTPUT`, REDIRECT inbound, policy
    /// route in table 1337): for its builtin proxy.
    #[default]
    Shunt,
    /// Istio's in-pod rules as istio-cni installs them (`ISTIO_PRERT`/
    /// `ISTIO_OUTPUT`, TPROXY inbound, policy route in table 100): for a
    /// stock ztunnel (`--proxy ztunnel`). See `istio.rs`.
    Istio,
}

/// How to build an [`IptablesRedirector`].
#[derive(Clone, Debug)]
pub struct IptablesOptions {
    /// Whose jumps these are: the agent's node name (see
    /// [`IptablesRedirector::owner_comment`]).
    pub owner: String,
    /// Force a backend; `None`: nft when installed, else legacy.
    pub backend: Option<Backend>,
    /// Health-probe source address whose inbound traffic is never
    /// redirected (Istio's 169.254.7.127 by default).
    pub probe_source: Ipv4Addr,
    /// shunt's rules or Istio's.
    pub rules: InpodRules,
    /// The node's network namespace, where kubelet's probes to enrolled
    /// pods are SNATed to `probe_source` (`host_probes.rs`); `None`: not
    /// rewritten.
    pub node_netns: Option<PathBuf>,
}

impl IptablesOptions {
    pub fn new(owner: impl Into<String>) -> Self {
        Self {
            owner: owner.into(),
            backend: None,
            probe_source: shunt_common::DEFAULT_PROBE_SOURCE_V4.into(),
            rules: InpodRules::Shunt,
            node_netns: None,
        }
    }
}

/// The iptables redirector. See the module docs.
pub struct IptablesRedirector {
    /// The comment on our jumps: `shunt:<owner>@<netns inode>`, see
    /// [`IptablesRedirector::owner_comment`].
    owner_comment: String,
    probe_source: Ipv4Addr,
    rules: InpodRules,
    tools: Tools,
    pods: BTreeMap<WorkloadKey, Enrolment>,
    resolver: Arc<SoOriginalDst>,
    /// The node side of kubelet's probes (`--node-netns`).
    host_probes: Option<host_probes::HostProbeSnat>,
}

impl IptablesRedirector {
    /// Finds the iptables binaries (a missing one is an error naming it and
    /// the package to install).
    pub fn new(options: IptablesOptions) -> Result<Self, IptablesError> {
        // With `ipv6.disable=1` there is no IPv6 netfilter to program.
        let ipv6 = Path::new("/proc/sys/net/ipv6").exists();
        let tools = Tools::detect(options.backend, ipv6)?;
        info!(
            backend = %tools.backend,
            restore = %tools.v4.restore.display(),
            ipv6 = tools.v6.is_some(),
            owner = %options.owner,
            "iptables tools found"
        );
        let netns_inode = std::fs::metadata("/proc/thread-self/ns/net")
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap_or(0);
        let host_probes = match &options.node_netns {
            Some(path) => Some(
                host_probes::HostProbeSnat::open(path, options.probe_source).map_err(|e| {
                    IptablesError::NodeNetns {
                        path: path.clone(),
                        detail: e.to_string(),
                    }
                })?,
            ),
            None => None,
        };
        Ok(Self {
            host_probes,
            owner_comment: rules::owner_comment(&format!("{}@{netns_inode}", options.owner)),
            probe_source: options.probe_source,
            rules: options.rules,
            tools,
            pods: BTreeMap::new(),
            resolver: Arc::new(SoOriginalDst),
        })
    }

    /// The comment on every jump this redirector installs:
    /// `shunt:<owner>@<inode of the agent's netns>`. `remove_stale` only
    /// removes jumps carrying it, so agents of different nodes — and agents
    /// given the same node name but running in different namespaces, as the
    /// test topologies' nodes do — never remove each other's rules, while a
    /// restarted agent (same node, same netns) recognises its predecessor's.
    pub fn owner_comment(&self) -> &str {
        &self.owner_comment
    }

    /// The backend whose binaries this redirector runs.
    pub fn backend(&self) -> Backend {
        self.tools.backend
    }

    /// Brings the node's probe rules to the enrolled pods' addresses;
    /// a failure is logged (the pods stay enrolled; their probes meet the
    /// proxy's policy until the next change retries).
    fn sync_host_probes(&mut self) {
        let Some(host) = self.host_probes.as_mut() else {
            return;
        };
        let pods: std::collections::BTreeSet<Ipv4Addr> = self
            .pods
            .values()
            .flat_map(|e| e.ipv4.iter().copied())
            .collect();
        if let Err(e) = host.sync(&self.tools, &pods) {
            warn!(error = %e, "cannot write the node's probe rules; kubelet's probes meet the pods' policy");
        }
    }

    /// How many times `enrol` found the pod's redirection drifted and
    /// repaired it; `None` if the pod is not enrolled.
    pub fn repairs(&self, pod: &WorkloadKey) -> Option<u64> {
        self.pods.get(pod).map(|e| e.repairs)
    }

    /// The rule sets (for `capture`) and binaries of every family this
    /// kernel has.
    fn families(&self, capture: &Capture) -> Vec<(RuleSet, &FamilyTools)> {
        let settings = Settings {
            capture: capture.clone(),
            probe_source_v4: self.probe_source,
        };
        let build = |family| match self.rules {
            InpodRules::Shunt => RuleSet::inpod(family, &self.owner_comment, &settings),
            InpodRules::Istio => RuleSet::istio(family, &self.owner_comment, &settings),
        };
        let mut families = vec![(build(Family::V4), &self.tools.v4)];
        if let Some(v6) = &self.tools.v6 {
            families.push((build(Family::V6), v6));
        }
        families
    }

    /// The table of the policy route: shunt's, or Istio's 100 with Istio's
    /// rules.
    fn route_table(&self) -> u32 {
        match self.rules {
            InpodRules::Shunt => ROUTE_TABLE,
            InpodRules::Istio => route::ISTIO_ROUTE_TABLE,
        }
    }

    /// Families that need the policy route in the calling thread's netns.
    fn route_families(&self) -> Vec<Family> {
        let mut families = vec![Family::V4];
        if self.tools.v6.is_some() && route::ipv6_on_lo() {
            families.push(Family::V6);
        }
        families
    }

    fn save(
        &self,
        pod: &WorkloadKey,
        netns: &NetNs,
        family: Family,
        tools: &FamilyTools,
    ) -> Result<Saved, RedirectError> {
        let out = self
            .tools
            .run_in(netns, &tools.save, &["-c"], None)
            .map_err(|e| kernel(pod, read_what(family), e))?;
        Saved::parse(&out).map_err(|detail| {
            kernel(
                pod,
                read_what(family),
                IptablesError::Unparsable {
                    command: format!("{} -c", tools.save.display()),
                    detail,
                },
            )
        })
    }

    fn restore(
        &self,
        pod: &WorkloadKey,
        netns: &NetNs,
        family: Family,
        tools: &FamilyTools,
        script: &str,
    ) -> Result<(), RedirectError> {
        debug!(family = family.label(), input = %script, "iptables-restore");
        self.tools
            .run_in(netns, &tools.restore, self.tools.restore_args(), Some(script))
            .map(drop)
            .map_err(|e| {
                // The error names the failing line number; the input says
                // which rule that was.
                warn!(family = family.label(), input = %script, "iptables-restore refused this input");
                kernel(pod, write_what(family), e)
            })
    }

    /// Brings the pod's netns to the wanted state. Returns whether anything
    /// had to change.
    fn apply(
        &self,
        pod: &WorkloadKey,
        netns: &NetNs,
        capture: &Capture,
    ) -> Result<bool, RedirectError> {
        let mut changed = false;
        for (rules, tools) in self.families(capture) {
            let saved = self.save(pod, netns, rules.family, tools)?;
            if let Some(script) = rules.plan_apply(&saved) {
                self.restore(pod, netns, rules.family, tools, &script)?;
                changed = true;
            }
        }
        let table = self.route_table();
        let routed = netns
            .run(|| -> io::Result<bool> {
                let mut changed = false;
                for family in self.route_families() {
                    let present = route::present_in(family, table)?;
                    if !(present.rule && present.route) {
                        route::add_to(family, table)?;
                        changed = true;
                    }
                }
                Ok(changed)
            })?
            .map_err(|e| kernel(pod, "adding the policy route for transparent inbound", e))?;
        Ok(changed || routed)
    }

    /// Removes every rule, chain, route and rule of ours from the netns.
    fn remove(&self, pod: &WorkloadKey, netns: &NetNs) -> Result<(), RedirectError> {
        // Removal does not depend on the capture settings: every jump to our
        // chains and the chains themselves go.
        for (rules, tools) in self.families(&Capture::default()) {
            let saved = self.save(pod, netns, rules.family, tools)?;
            if let Some(script) = rules::plan_remove(&saved, &rules.chain_names()) {
                self.restore(pod, netns, rules.family, tools, &script)?;
            }
        }
        let ipv6 = self.tools.v6.is_some();
        let table = self.route_table();
        netns
            .run(|| -> io::Result<()> {
                route::delete_from(Family::V4, table)?;
                if ipv6 {
                    match route::delete_from(Family::V6, table) {
                        // IPv6 switched off in this netns: nothing to delete.
                        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {}
                        other => other?,
                    }
                }
                Ok(())
            })?
            .map_err(|e| kernel(pod, "deleting the policy route", e))
    }

    /// What is missing or wrong in the pod's netns (empty: all in place).
    fn drift(
        &self,
        pod: &WorkloadKey,
        netns: &NetNs,
        capture: &Capture,
    ) -> Result<Vec<String>, RedirectError> {
        let mut drift = Vec::new();
        for (rules, tools) in self.families(capture) {
            let saved = self.save(pod, netns, rules.family, tools)?;
            drift.extend(rules.drift(&saved));
        }
        let table = self.route_table();
        let routes = netns
            .run(|| -> io::Result<Vec<String>> {
                let mut missing = Vec::new();
                for family in self.route_families() {
                    let present = route::present_in(family, table)?;
                    if !present.rule {
                        missing.push(format!(
                            "{} ip rule pref {RULE_PRIORITY} fwmark 0x{CONN_MARK:x}/0x{MARK_MASK:x} lookup {table}",
                            family.label()
                        ));
                    }
                    if !present.route {
                        missing.push(format!(
                            "{} local default route dev lo in table {table}",
                            family.label()
                        ));
                    }
                }
                Ok(missing)
            })?
            .map_err(|e| kernel(pod, "reading the policy route", e))?;
        drift.extend(routes);
        Ok(drift)
    }

    /// Re-applies an enrolled pod's redirection if its capture settings
    /// changed or it drifted.
    fn repair(&mut self, pod: &WorkloadKey, capture: &Capture) -> Result<(), RedirectError> {
        let enrolment = self
            .pods
            .get(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        if enrolment.capture != *capture {
            info!(
                ?capture,
                "capture settings changed; rewriting the pod's chains"
            );
            self.apply(pod, &enrolment.netns, capture)?;
            if let Some(enrolment) = self.pods.get_mut(pod) {
                enrolment.capture = capture.clone();
            }
            return Ok(());
        }
        let drift = self.drift(pod, &enrolment.netns, capture)?;
        if drift.is_empty() {
            debug!("pod already redirected; nothing to do");
            return Ok(());
        }
        warn!(
            ?drift,
            "pod's redirection drifted (removed or changed by someone else); repairing"
        );
        self.apply(pod, &enrolment.netns, capture)?;
        let repairs = match self.pods.get_mut(pod) {
            Some(enrolment) => {
                enrolment.repairs += 1;
                enrolment.repairs
            }
            None => 0,
        };
        info!(repairs, "pod's redirection repaired");
        Ok(())
    }

    fn enrolled_pod(&self, key: &WorkloadKey, enrolment: &Enrolment) -> EnrolledPod {
        let (hooks, counters) = self.read_pod(key, enrolment);
        EnrolledPod {
            key: key.clone(),
            netns: enrolment.netns.path().to_path_buf(),
            netns_cookie: enrolment.cookie,
            mode: RedirectMode::Iptables,
            hooks,
            counters,
        }
    }

    /// Hooks and counters of one enrolled pod, read from its netns.
    fn read_pod(&self, pod: &WorkloadKey, enrolment: &Enrolment) -> (Vec<Hook>, PodCounters) {
        let mut hooks = Vec::new();
        let mut counters = PodCounters::default();
        for (rules, tools) in self.families(&enrolment.capture) {
            let saved = match self.save(pod, &enrolment.netns, rules.family, tools) {
                Ok(saved) => Some(saved),
                Err(error) => {
                    warn!(%pod, %error, "cannot read the pod's rules");
                    None
                }
            };
            for chain in &rules.chains {
                hooks.push(Hook {
                    name: format!("{} {} {}", rules.family.label(), chain.table, chain.builtin),
                    attachment: format!(
                        "-j {} ({} rules, iptables-{}): {}",
                        chain.chain,
                        chain.rules.len(),
                        self.tools.backend,
                        chain.purpose
                    ),
                    present: saved
                        .as_ref()
                        .is_some_and(|s| rules.chain_present(s, chain)),
                });
            }
            if let Some(saved) = &saved {
                let (packets, bytes) = rules.counters(saved, Counts::Outbound);
                counters.packets_out += packets;
                counters.bytes_out += bytes;
                let (packets, bytes) = rules.counters(saved, Counts::Inbound);
                counters.packets_in += packets;
                counters.bytes_in += bytes;
            }
        }
        let table = self.route_table();
        let routes = enrolment.netns.run(|| {
            self.route_families()
                .into_iter()
                .map(|family| (family, route::present_in(family, table).ok()))
                .collect::<Vec<_>>()
        });
        for (family, present) in routes.unwrap_or_default() {
            hooks.push(Hook {
                name: format!("{} policy route", family.label()),
                attachment: route::describe_table(family, table),
                present: present.is_some_and(|p| p.rule && p.route),
            });
        }
        (hooks, counters)
    }
}

fn read_what(family: Family) -> &'static str {
    match family {
        Family::V4 => "reading the pod's IPv4 rules (iptables-save)",
        Family::V6 => "reading the pod's IPv6 rules (ip6tables-save)",
    }
}

fn write_what(family: Family) -> &'static str {
    match family {
        Family::V4 => "applying the pod's IPv4 rules (iptables-restore)",
        Family::V6 => "applying the pod's IPv6 rules (ip6tables-restore)",
    }
}

fn kernel(
    pod: &WorkloadKey,
    what: &'static str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> RedirectError {
    RedirectError::Kernel {
        pod: pod.clone(),
        what,
        source: Box::new(source),
    }
}
