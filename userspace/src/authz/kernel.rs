//! Compiling the engine's verdicts for the kernel's enforcement point.
//!
//! The connect programs see only the source pod (its enrolment slot), the
//! destination address and the destination port. For every pair (enrolled
//! source pod of this node, enrolled destination pod of this node) this
//! module asks the one engine ([`PolicySet::check`]) about a synthetic
//! connection carrying what the destination's proxy would see: the
//! source's SPIFFE identity (hence its principal, namespace and service
//! account), the source's IP and the destination's IP and port. It does so for every
//! port an applicable policy names (`ports` or `notPorts`) and for one
//! port no policy names: every unnamed port evaluates identically, so that
//! one answer is the verdict of "any other port" and the table is exact.
//!
//! The table keeps only what differs from "allowed" (a kernel miss sends
//! the connect to the proxy, which decides anyway): an "any other port"
//! entry when unnamed ports are denied, and a port's own entry when its
//! verdict differs from that. Dry-run policies are never compiled. A pair
//! whose verdict the kernel cannot know exactly (the source has several
//! addresses of the destination's family and they disagree, or none; the
//! destination sits behind a waypoint or is not reached over HBONE) gets
//! no entry: the proxy decides it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use super::{
    engine::{Connection, Destination, PolicySet, Verdict},
    model::{Policy, PolicyKey},
};
use crate::state::{TunnelProtocol, Workload};

/// The port of an entry that holds every port without an entry of its own
/// (`shunt_common::PolicyVerdictKey::ANY_OTHER_PORT`).
pub const ANY_OTHER_PORT: u16 = 0;

/// An enrolled pod of this node as a connect's source.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource<'a> {
    /// Its enrolment slot (what the connect programs know it by).
    pub slot: u32,
    /// The SPIFFE identity its proxy presents (with `spiffe://`).
    pub identity: &'a str,
    pub ips: &'a [IpAddr],
}

/// A connect from the pod in `slot` to `dst`:`port` ([`ANY_OTHER_PORT`]:
/// every port without an entry of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VerdictKey {
    pub slot: u32,
    pub dst: IpAddr,
    pub port: u16,
}

/// What the kernel does with such a connect.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelVerdict {
    /// On to the proxy (an allowed port under a denying "any other port").
    Allow,
    /// EPERM, counted against this policy (the matching DENY, or the first
    /// ALLOW policy when none matched, as the proxy's log names it).
    Deny(PolicyKey),
}

impl KernelVerdict {
    fn of(verdict: &Verdict) -> Self {
        match verdict {
            Verdict::AllowedWithoutPolicy | Verdict::Allowed(_) => Self::Allow,
            Verdict::Denied(key) | Verdict::NotAllowed { first: key, .. } => {
                Self::Deny(key.clone())
            }
        }
    }
}

/// The compiled verdicts of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerdictTable {
    pub entries: BTreeMap<VerdictKey, KernelVerdict>,
    /// The policies compiled (every non-dry-run policy known), by key.
    pub policies: Vec<PolicyKey>,
    /// (source, destination address) pairs left to the proxy because the
    /// kernel could not know their verdict exactly.
    pub left_to_proxy: usize,
    /// The destination addresses of those pairs: a missing entry does not
    /// mean "allowed" for them, so the fast path never carries a connect
    /// to them in the kernel.
    pub inexact: BTreeSet<IpAddr>,
}

impl VerdictTable {
    /// What the connect programs decide for `slot` → `dst`:`port`: the
    /// port's entry, else the "any other port" entry, else allowed.
    pub fn lookup(&self, slot: u32, dst: IpAddr, port: u16) -> &KernelVerdict {
        let key = |port| VerdictKey { slot, dst, port };
        self.entries
            .get(&key(port))
            .or_else(|| self.entries.get(&key(ANY_OTHER_PORT)))
            .unwrap_or(&KernelVerdict::Allow)
    }
}

/// Compiles the verdicts of connects from each of `sources` to each of
/// `destinations` (this node's enrolled pods, as the store knows them).
pub fn compile(
    policies: &PolicySet,
    sources: &[KernelSource<'_>],
    destinations: &[&Workload],
) -> VerdictTable {
    // Dry-run policies are only ever logged (by the proxy), never enforced
    // here; leaving them out also keeps the engine from logging each
    // synthetic check.
    let enforced = PolicySet::new(policies.iter().filter(|p| !p.dry_run).cloned());
    let mut table = VerdictTable {
        policies: enforced.iter().map(Policy::key).collect(),
        ..VerdictTable::default()
    };
    for dst in destinations {
        let destination = Destination::of(dst);
        let applicable: Vec<&Policy> = enforced.applicable(destination).collect();
        if applicable.is_empty() {
            // Allowed from anywhere: nothing to refuse early.
            continue;
        }
        if dst.waypoint.is_some() || dst.tunnel != TunnelProtocol::Hbone {
            // Its proxy sees another source (the waypoint) or plaintext.
            table.left_to_proxy += sources.len() * dst.ips.len();
            table.inexact.extend(&dst.ips);
            continue;
        }
        let ports = named_ports(&applicable);
        let Some(other) = (1..=u16::MAX).find(|p| !ports.contains(p)) else {
            table.left_to_proxy += sources.len() * dst.ips.len();
            table.inexact.extend(&dst.ips);
            continue;
        };
        for source in sources {
            for &dst_ip in &dst.ips {
                let pair = Pair {
                    policies: &enforced,
                    destination,
                    source,
                    dst_ip,
                };
                match pair.entries(&ports, other) {
                    Some(entries) => table.entries.extend(entries),
                    None => {
                        table.left_to_proxy += 1;
                        table.inexact.insert(dst_ip);
                    }
                }
            }
        }
    }
    table
}

/// Every destination port the policies name, positively or negatively.
fn named_ports(policies: &[&Policy]) -> BTreeSet<u16> {
    policies
        .iter()
        .flat_map(|p| &p.rules)
        .flat_map(|r| &r.clauses)
        .flat_map(|c| &c.matches)
        .flat_map(|m| m.destination_ports.iter().chain(&m.not_destination_ports))
        .copied()
        .filter(|&p| p != ANY_OTHER_PORT)
        .collect()
}

/// One source pod and one destination address.
struct Pair<'a> {
    policies: &'a PolicySet,
    destination: Destination<'a>,
    source: &'a KernelSource<'a>,
    dst_ip: IpAddr,
}

impl Pair<'_> {
    /// The entries of this pair, or `None` when its verdict is not known
    /// exactly.
    fn entries(
        &self,
        ports: &BTreeSet<u16>,
        other: u16,
    ) -> Option<Vec<(VerdictKey, KernelVerdict)>> {
        let key = |port| VerdictKey {
            slot: self.source.slot,
            dst: self.dst_ip,
            port,
        };
        let any_other = self.verdict(other)?;
        let mut entries = Vec::new();
        for &port in ports {
            let verdict = self.verdict(port)?;
            if verdict != any_other {
                entries.push((key(port), verdict));
            }
        }
        if any_other != KernelVerdict::Allow {
            entries.push((key(ANY_OTHER_PORT), any_other));
        }
        Some(entries)
    }

    /// The verdict at `port`, if every address the source may connect
    /// from (of the destination's family) gets the same one.
    fn verdict(&self, port: u16) -> Option<KernelVerdict> {
        let mut verdicts = self
            .source
            .ips
            .iter()
            .filter(|ip| ip.is_ipv4() == self.dst_ip.is_ipv4())
            .map(|&src_ip| {
                let connection = Connection {
                    src_ip,
                    src_identity: Some(self.source.identity),
                    dst: SocketAddr::new(self.dst_ip, port),
                };
                KernelVerdict::of(&self.policies.check(&connection, self.destination))
            });
        let first = verdicts.next()?;
        verdicts.all(|v| v == first).then_some(first)
    }
}

#[cfg(test)]
#[path = "kernel_tests.rs"]
mod tests;
