//! The kernel's authorization table: `SHUNT_POLICY_VERDICTS`, written here
//! only (the reconciler drives it: it alone knows both the slots and, from
//! the store, the policies), and its denial counters
//! `SHUNT_POLICY_DENIALS`, which the connect programs write and the verify
//! pass reads, and the ring `SHUNT_POLICY_REFUSALS` of each refused connect,
//! which the reconcile thread reads as records arrive (the access log).
//!
//! A new table is written as a diff against what this agent wrote, in an
//! order that never shows a connect a verdict that is neither its old nor
//! its new one: first every changed port entry, then the "any other port"
//! entries (written or deleted), last the port entries that went stale.
//! When the map cannot take an entry (full), that (source, destination)
//! pair is emptied: its connects fall back to the proxy, which decides
//! anyway. The policy numbers in the map are this agent's: on load both
//! maps are emptied (a previous agent numbered differently), and the
//! first compile fills the table again.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd as _, RawFd},
};

use aya::maps::{PerCpuHashMap, RingBuf};
use shunt_common::{PolicyDenialKey, PolicyRefusal, PolicyVerdict, PolicyVerdictKey};

use super::*;
use crate::{
    authz::{
        PolicyKey,
        kernel::{ANY_OTHER_PORT, KernelVerdict, VerdictTable},
    },
    redirect::VerdictsWritten,
};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// (slot, family, address): the entries of one source and one destination.
type Pair = (u32, u16, [u32; 4]);

fn pair(key: &PolicyVerdictKey) -> Pair {
    (key.slot, key.family, key.addr)
}

pub(super) struct PolicyMaps {
    verdicts: BpfHashMap<MapData, PolicyVerdictKey, PolicyVerdict>,
    denials: PerCpuHashMap<MapData, PolicyDenialKey, u64>,
    refusals: RingBuf<MapData>,
    /// What this agent has in the verdict map (the base of each diff).
    written: BTreeMap<PolicyVerdictKey, PolicyVerdict>,
    /// Policy numbers: a policy keeps its number for the agent's life, so
    /// its counters stay its own. `names[n - 1]` is policy `n`.
    numbers: std::collections::HashMap<PolicyKey, u32>,
    names: Vec<PolicyKey>,
}

impl PolicyMaps {
    /// Takes the maps from the loaded object and empties them.
    pub(super) fn open(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        let mut verdicts: BpfHashMap<MapData, PolicyVerdictKey, PolicyVerdict> =
            load::take_map(ebpf, maps::POLICY_VERDICTS)?;
        let mut denials: PerCpuHashMap<MapData, PolicyDenialKey, u64> =
            load::take_map(ebpf, maps::POLICY_DENIALS)?;
        let stale: Vec<PolicyVerdictKey> = verdicts.keys().filter_map(Result::ok).collect();
        for key in &stale {
            let _ = verdicts.remove(key);
        }
        let counters: Vec<PolicyDenialKey> = denials.keys().filter_map(Result::ok).collect();
        for key in &counters {
            let _ = denials.remove(key);
        }
        let mut refusals: RingBuf<MapData> = load::take_map(ebpf, maps::POLICY_REFUSALS)?;
        // Records left by a previous agent name its own policy numbers.
        while refusals.next().is_some() {}
        if !stale.is_empty() {
            info!(
                entries = stale.len(),
                "emptied the authorization verdicts a previous agent compiled; they are compiled again"
            );
        }
        Ok(Self {
            verdicts,
            denials,
            refusals,
            written: BTreeMap::new(),
            numbers: Default::default(),
            names: Vec::new(),
        })
    }

    fn number(&mut self, policy: &PolicyKey) -> u32 {
        if let Some(&n) = self.numbers.get(policy) {
            return n;
        }
        self.names.push(policy.clone());
        let n = self.names.len() as u32;
        self.numbers.insert(policy.clone(), n);
        n
    }

    /// Makes `table` the verdict map's content (see the module docs).
    pub(super) fn write(&mut self, table: &VerdictTable) -> VerdictsWritten {
        let mut desired = BTreeMap::new();
        for (key, verdict) in &table.entries {
            let (family, addr) = kernel_addr(key.dst);
            let value = match verdict {
                KernelVerdict::Allow => PolicyVerdict {
                    action: PolicyVerdict::ALLOW,
                    policy: 0,
                },
                KernelVerdict::Deny(policy) => PolicyVerdict {
                    action: PolicyVerdict::DENY,
                    policy: self.number(policy),
                },
            };
            let key = PolicyVerdictKey {
                slot: key.slot,
                port: key.port,
                family,
                addr,
            };
            desired.insert(key, value);
        }
        let is_port = |key: &PolicyVerdictKey| key.port != ANY_OTHER_PORT;
        let upserts = |ports: bool| -> Vec<(PolicyVerdictKey, PolicyVerdict)> {
            desired
                .iter()
                .filter(|(k, v)| is_port(k) == ports && self.written.get(*k) != Some(*v))
                .map(|(k, v)| (*k, *v))
                .collect()
        };
        let stale = |ports: bool| -> Vec<PolicyVerdictKey> {
            self.written
                .keys()
                .filter(|k| is_port(k) == ports && !desired.contains_key(*k))
                .copied()
                .collect()
        };
        let (port_upserts, other_upserts) = (upserts(true), upserts(false));
        let (stale_ports, stale_others) = (stale(true), stale(false));
        let mut report = VerdictsWritten::default();
        let mut failed: BTreeSet<Pair> = BTreeSet::new();
        for (key, value) in port_upserts.into_iter().chain(other_upserts) {
            if failed.contains(&pair(&key)) {
                continue;
            }
            match self.verdicts.insert(key, value, 0) {
                Ok(()) => {
                    self.written.insert(key, value);
                    report.inserted += 1;
                }
                Err(e) => {
                    report.error.get_or_insert_with(|| e.to_string());
                    failed.insert(pair(&key));
                }
            }
        }
        for key in stale_others.into_iter().chain(stale_ports) {
            if failed.contains(&pair(&key)) {
                continue;
            }
            self.remove(&key);
            report.deleted += 1;
        }
        // A pair the map could not hold goes to the proxy whole.
        for failed_pair in &failed {
            let keys: Vec<PolicyVerdictKey> = self
                .written
                .keys()
                .filter(|k| pair(k) == *failed_pair)
                .copied()
                .collect();
            for key in keys {
                self.remove(&key);
            }
        }
        report.failed_pairs = failed.len();
        report.entries = self.written.len();
        report
    }

    fn remove(&mut self, key: &PolicyVerdictKey) {
        // Absent already is fine: the entry is gone either way.
        let _ = self.verdicts.remove(key);
        self.written.remove(key);
    }

    /// Takes a slot's entries and counters out (its pod left; the slot
    /// may be given to another pod before the next compile).
    pub(super) fn forget_slot(&mut self, slot: u32) {
        let keys: Vec<PolicyVerdictKey> = self
            .written
            .keys()
            .filter(|k| k.slot == slot)
            .copied()
            .collect();
        for key in keys {
            self.remove(&key);
        }
        let counters: Vec<PolicyDenialKey> = self
            .denials
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.slot == slot)
            .collect();
        for key in counters {
            let _ = self.denials.remove(&key);
        }
    }

    /// Connects refused per slot and policy, summed over CPUs.
    pub(super) fn denials(&self) -> BTreeMap<u32, Vec<(PolicyKey, u64)>> {
        let mut by_slot: BTreeMap<u32, Vec<(PolicyKey, u64)>> = BTreeMap::new();
        for (key, per_cpu) in self.denials.iter().filter_map(Result::ok) {
            let Some(policy) = (key.policy as usize)
                .checked_sub(1)
                .and_then(|i| self.names.get(i))
            else {
                continue;
            };
            let count: u64 = per_cpu.iter().sum();
            by_slot
                .entry(key.slot)
                .or_default()
                .push((policy.clone(), count));
        }
        for counts in by_slot.values_mut() {
            counts.sort();
        }
        by_slot
    }
}

impl PolicyMaps {
    /// The ring's fd: readable when refusals wait.
    pub(super) fn refusals_fd(&self) -> RawFd {
        self.refusals.as_raw_fd()
    }

    /// The connects refused since the last call, as (slot, deciding
    /// policy, destination). Records of another size (another release's
    /// programs) or of a policy this agent did not number are skipped.
    pub(super) fn refusals(&mut self) -> Vec<(u32, PolicyKey, SocketAddr)> {
        let mut out = Vec::new();
        while let Some(item) = self.refusals.next() {
            if item.len() != std::mem::size_of::<PolicyRefusal>() {
                continue;
            }
            // SAFETY: `PolicyRefusal` is plain old data of exactly this
            // size; the read is unaligned-safe.
            let refusal: PolicyRefusal = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            let Some(policy) = (refusal.policy as usize)
                .checked_sub(1)
                .and_then(|i| self.names.get(i))
            else {
                continue;
            };
            let dst = SocketAddr::new(socket_ip(refusal.family, refusal.addr), refusal.port);
            out.push((refusal.slot, policy.clone(), dst));
        }
        out
    }
}

/// The address a record names (the inverse of [`kernel_addr`]).
fn socket_ip(family: u16, addr: [u32; 4]) -> IpAddr {
    if family == AF_INET {
        return IpAddr::V4(Ipv4Addr::from(addr[0].to_ne_bytes()));
    }
    let mut octets = [0u8; 16];
    for (chunk, word) in octets.chunks_exact_mut(4).zip(addr) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    IpAddr::V6(Ipv6Addr::from(octets))
}

/// An address as the connect programs key it: network order, IPv4 in the
/// first word (a v4-mapped IPv6 address as the IPv4 one).
fn kernel_addr(ip: IpAddr) -> (u16, [u32; 4]) {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => (AF_INET, [u32::from_ne_bytes(v4.octets()), 0, 0, 0]),
        IpAddr::V6(v6) => {
            let mut addr = [0u32; 4];
            for (word, chunk) in addr.iter_mut().zip(v6.octets().chunks_exact(4)) {
                *word = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            }
            (AF_INET6, addr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_keyed_as_the_programs_see_them() {
        let (family, addr) = kernel_addr("198.18.1.4".parse().expect("ip"));
        assert_eq!(family, AF_INET);
        assert_eq!(addr[0].to_ne_bytes(), [198, 18, 1, 4]);
        assert_eq!(
            kernel_addr("::ffff:198.18.1.4".parse().expect("ip")),
            (family, addr),
            "v4-mapped is keyed as IPv4"
        );
        let (family, addr) = kernel_addr("2001:db8::1".parse().expect("ip"));
        assert_eq!(family, AF_INET6);
        assert_eq!(addr[0].to_ne_bytes(), [0x20, 0x01, 0x0d, 0xb8]);
        assert_eq!(addr[3].to_ne_bytes(), [0, 0, 0, 1]);
        for ip in ["198.18.1.4", "2001:db8::1"] {
            let ip: IpAddr = ip.parse().expect("ip");
            let (family, addr) = kernel_addr(ip);
            assert_eq!(socket_ip(family, addr), ip, "a record's address read back");
        }
    }
}
