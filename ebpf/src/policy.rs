//! The kernel's authorization point: Istio `AuthorizationPolicy` verdicts
//! compiled by the agent (`userspace/src/authz/kernel.rs`) into
//! `SHUNT_POLICY_VERDICTS`, checked before a connect is handed to the proxy.
//!
//! Hook: none of its own; `cgroup/connect4` and `cgroup/connect6`
//! (`connect.rs`) call [`denied`] / [`denied_v6`] for a TCP connect from an
//! enrolled pod that they are about to redirect. Matches: an entry for
//! (the pod's slot, destination address, destination port), else the
//! pod's entry for that address and "any other port" (port 0). Does: a
//! DENY entry makes the connect fail with EPERM (the caller returns 0),
//! counts it in `SHUNT_POLICY_DENIALS` by (slot, policy) and sends a
//! record of it to the agent's access log through `SHUNT_POLICY_REFUSALS`
//! (a full ring drops the record, never the refusal). Miss path
//! (no entry, or an ALLOW entry): `false`, the connect goes to the proxy
//! as before, and the proxy, which stays authoritative, decides.
//!
//! Only destinations that are enrolled pods of this node have entries: a
//! Service VIP or another node's pod is unknown here and left to the
//! destination's proxy.

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    macros::map,
    maps::{HashMap, PerCpuHashMap, RingBuf},
};
use shunt_common::{
    MAX_POLICY_DENIAL_COUNTERS, MAX_POLICY_VERDICTS, POLICY_REFUSALS_BYTES, PolicyDenialKey,
    PolicyRefusal, PolicyVerdict, PolicyVerdictKey,
};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// (source slot, destination, port) → verdict; written by the agent's
/// reconciler only. Allocated as used: most pairs have no entry.
#[map(name = "SHUNT_POLICY_VERDICTS")]
pub static POLICY_VERDICTS: HashMap<PolicyVerdictKey, PolicyVerdict> =
    HashMap::with_max_entries(MAX_POLICY_VERDICTS, BPF_F_NO_PREALLOC);

/// (source slot, policy) → connects refused, per CPU (no atomics needed).
#[map(name = "SHUNT_POLICY_DENIALS")]
pub static POLICY_DENIALS: PerCpuHashMap<PolicyDenialKey, u64> =
    PerCpuHashMap::with_max_entries(MAX_POLICY_DENIAL_COUNTERS, 0);

/// Each refused connect, for the agent's access log (read as it comes).
#[map(name = "SHUNT_POLICY_REFUSALS")]
pub static POLICY_REFUSALS: RingBuf = RingBuf::with_byte_size(POLICY_REFUSALS_BYTES, 0);

/// Whether the IPv4 connect from `slot` to `addr_be`:`port` is denied by a
/// compiled verdict (counted when it is).
#[inline(always)]
pub fn denied(slot: u32, addr_be: u32, port: u16) -> bool {
    check(PolicyVerdictKey {
        slot,
        port,
        family: AF_INET,
        addr: [addr_be, 0, 0, 0],
    })
}

/// As [`denied`] for an IPv6 socket's destination (network order); a
/// v4-mapped one is looked up as the IPv4 address it carries.
#[inline(always)]
pub fn denied_v6(slot: u32, addr_be: [u32; 4], port: u16) -> bool {
    let v4_mapped = addr_be[0] == 0 && addr_be[1] == 0 && u32::from_be(addr_be[2]) == 0xffff;
    if v4_mapped {
        return denied(slot, addr_be[3], port);
    }
    check(PolicyVerdictKey {
        slot,
        port,
        family: AF_INET6,
        addr: addr_be,
    })
}

#[inline(always)]
fn check(mut key: PolicyVerdictKey) -> bool {
    let port = key.port;
    // SAFETY: plain values copied out of the map.
    let verdict = match unsafe { POLICY_VERDICTS.get(&key) } {
        Some(verdict) => *verdict,
        None => {
            key.port = PolicyVerdictKey::ANY_OTHER_PORT;
            // SAFETY: as above.
            match unsafe { POLICY_VERDICTS.get(&key) } {
                Some(verdict) => *verdict,
                None => return false,
            }
        }
    };
    if verdict.action != PolicyVerdict::DENY {
        return false;
    }
    count(PolicyDenialKey {
        slot: key.slot,
        policy: verdict.policy,
    });
    // A full ring loses the log line only: the refusal is counted above.
    let _ = POLICY_REFUSALS.output::<PolicyRefusal>(
        &PolicyRefusal {
            slot: key.slot,
            policy: verdict.policy,
            port,
            family: key.family,
            addr: key.addr,
        },
        0,
    );
    true
}

/// Adds one to the counter of `key` on this CPU, creating it at 1. A full
/// counter map loses the count, never the refusal.
#[inline(always)]
fn count(key: PolicyDenialKey) {
    if let Some(counter) = POLICY_DENIALS.get_ptr_mut(&key) {
        // SAFETY: per-CPU value; only this CPU writes it while the program
        // runs.
        unsafe { *counter += 1 };
        return;
    }
    if POLICY_DENIALS
        .insert(&key, &1u64, BPF_NOEXIST as u64)
        .is_err()
    {
        // Another program on this CPU cannot have raced us, but a
        // concurrent insert from another CPU creates the entry (this CPU's
        // value zero): count into it.
        if let Some(counter) = POLICY_DENIALS.get_ptr_mut(&key) {
            // SAFETY: as above.
            unsafe { *counter += 1 };
        }
    }
}
