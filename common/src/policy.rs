//! The kernel's authorization table: the verdicts compiled for connects
//! between enrolled pods (checked by connect4/6) and the denial counters.

// Only the documentation links to the map names.
#[cfg(doc)]
use crate::maps;

/// Compiled authorization verdicts the connect programs can hold (hash,
/// allocated as used). An entry is one (source pod, destination pod IP,
/// port or "any other port") whose verdict differs from "allow"; 131,072
/// cover every pair of 110 pods (the kubelet's default maximum per node)
/// with ten named ports each. A full map only loses the early refusal:
/// the proxy still enforces (see `docs/authz.md`).
pub const MAX_POLICY_VERDICTS: u32 = 131072;

/// (source pod, policy) pairs whose kernel denials are counted at once.
pub const MAX_POLICY_DENIAL_COUNTERS: u32 = 16384;

/// Size of [`maps::POLICY_REFUSALS`]: 64 KiB, about 1,800 refusals (36
/// bytes each with the ring's header) waiting for the agent before new
/// ones go unlogged (they are still refused and counted).
pub const POLICY_REFUSALS_BYTES: u32 = 64 * 1024;

/// Key of [`maps::POLICY_VERDICTS`]: a connect from the pod in `slot` to
/// `addr`:`port`. Addresses in network order (IPv4 in `addr[0]`, the rest
/// zero; a v4-mapped IPv6 destination is keyed as IPv4), port in host
/// order; port [`PolicyVerdictKey::ANY_OTHER_PORT`] holds the verdict of
/// every port no entry of its own names.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyVerdictKey {
    pub slot: u32,
    pub port: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
    pub addr: [u32; 4],
}

impl PolicyVerdictKey {
    /// The port of the entry that holds "every other port" (no connect
    /// goes to port 0).
    pub const ANY_OTHER_PORT: u16 = 0;
}

/// Value of [`maps::POLICY_VERDICTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyVerdict {
    /// [`PolicyVerdict::ALLOW`] or [`PolicyVerdict::DENY`].
    pub action: u32,
    /// The deciding policy's number (the agent's own numbering; 0: none),
    /// the key of the denial counter.
    pub policy: u32,
}

impl PolicyVerdict {
    /// The connect goes on to the proxy as without an entry (an allowed
    /// port under a denying "any other port").
    pub const ALLOW: u32 = 0;
    /// connect() fails with EPERM, counted in [`maps::POLICY_DENIALS`].
    pub const DENY: u32 = 1;
}

/// Key of [`maps::POLICY_DENIALS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyDenialKey {
    pub slot: u32,
    pub policy: u32,
}

/// A record of [`maps::POLICY_REFUSALS`]: one connect the kernel refused,
/// from the pod in `slot` to `addr`:`port` (as in [`PolicyVerdictKey`]),
/// on the verdict of policy number `policy`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyRefusal {
    pub slot: u32,
    pub policy: u32,
    pub port: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
    pub addr: [u32; 4],
}
