//! Flow 2 of the fast path (same node, mesh to mesh, carried in the
//! kernel): the eligible destinations, the authorised 4-tuples, the
//! service VIPs with their endpoints, and the counters.

use crate::{MAX_FAST_PATH_SOCKETS, MAX_PODS};
// Only the documentation links to these.
#[cfg(doc)]
use crate::{FastPathDest, maps};

/// Same-node mesh destinations the kernel may carry to (flow 2 of the fast
/// path: enrolled pods' addresses): [`maps::MESH_LOCAL_DESTS`]. Two
/// addresses (IPv4 and IPv6) for every pod slot.
pub const MAX_MESH_LOCAL_DESTS: u32 = 2 * MAX_PODS;

/// Same-node mesh connections between their connect() and their close
/// ([`maps::MESH_LOCAL_FLOWS`]); as many as the fast path's connection
/// records, which each of them also holds.
pub const MAX_MESH_LOCAL_FLOWS: u32 = MAX_FAST_PATH_SOCKETS;

/// Service ports (VIP and port) flow 2 may carry to a same-node endpoint
/// ([`maps::MESH_LOCAL_SERVICES`]): two VIPs (one per family) of up to
/// 4,096 service ports whose every ready endpoint is an eligible pod of
/// this node. At about 420 bytes an entry, allocated as used: 3.4 MiB at
/// most. A service port beyond it is left to the proxy.
pub const MAX_MESH_LOCAL_SERVICES: u32 = 8192;

/// Most ready endpoints of one service port that flow 2 carries through
/// its VIP ([`MeshService::endpoints`]); a service port with more goes
/// through the proxy.
pub const MAX_MESH_SERVICE_ENDPOINTS: usize = 16;

/// Same-node mesh connections made through a service VIP, between their
/// connect() and their close ([`maps::MESH_LOCAL_SERVICE_SOCKS`]); as many
/// as the fast path's connection records, which each of them also holds.
pub const MAX_MESH_SERVICE_SOCKETS: u32 = MAX_FAST_PATH_SOCKETS;

/// Value of [`maps::MESH_LOCAL_DESTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalDest {
    /// The destination pod's slot.
    pub slot: u32,
    /// Reserved (zero).
    pub flags: u32,
}

/// Key of [`maps::MESH_LOCAL_FLOWS`]: a connection as the destination's TC
/// ingress sees its SYN. Addresses and ports in network order (IPv4 in
/// `[0]`, the rest zero).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MeshFlowKey {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
}

/// Value of [`maps::MESH_LOCAL_FLOWS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshFlow {
    pub src_slot: u32,
    /// Only the TC instance of this slot lets the SYN through.
    pub dst_slot: u32,
}

/// Key of [`maps::MESH_LOCAL_SERVICES`]: a service VIP (network order,
/// IPv4 mapped into IPv6 as [`FastPathDest`]) and port (host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MeshServiceKey {
    pub addr: [u32; 4],
    pub port: u32,
}

/// One endpoint of a [`MeshService`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshServiceEndpoint {
    /// The endpoint's address (network order, IPv4 mapped into IPv6 as
    /// [`FastPathDest`]).
    pub addr: [u32; 4],
    /// Its target port for the service port (host order).
    pub port: u32,
    /// Its share of connections (the workload's capacity; at least 1).
    pub weight: u32,
}

/// Value of [`maps::MESH_LOCAL_SERVICES`]: every ready endpoint of the
/// service port (all eligible flow-2 destinations of this node).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshService {
    /// Endpoints used, `1..=MAX_MESH_SERVICE_ENDPOINTS`.
    pub count: u32,
    /// The sum of their weights (non-zero).
    pub total_weight: u32,
    pub endpoints: [MeshServiceEndpoint; MAX_MESH_SERVICE_ENDPOINTS],
}

/// Value of [`maps::MESH_LOCAL_SERVICE_SOCKS`]: the VIP and port a flow-2
/// connection was dialled to, as the application gave it (network-order
/// address, IPv4 in `[0]`; port in host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshServiceSock {
    pub addr: [u32; 4],
    pub port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
}

/// Flow 2's kernel counters (one entry, per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalStats {
    /// Same-node mesh connects carried in the kernel.
    pub carried: u64,
    /// Same-node mesh connects sent to the proxy because flow 2 was off
    /// (verdicts incomplete, or not compiled yet).
    pub off: u64,
    /// Same-node mesh connects sent to the proxy because their record
    /// could not be kept.
    pub untracked: u64,
    /// SYNs whose flow entry could not be written (a full map): the
    /// destination's proxy gets them as inbound plaintext.
    pub flows_unrecorded: u64,
}

impl MeshLocalStats {
    pub fn add(&mut self, other: &MeshLocalStats) {
        self.carried += other.carried;
        self.off += other.off;
        self.untracked += other.untracked;
        self.flows_unrecorded += other.flows_unrecorded;
    }
}
