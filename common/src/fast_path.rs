//! The passthrough fast path (flow 1): the destination table and its
//! switch, the records of connects that went direct, the events sockops
//! reports them with (flow 2's too), and its counters.

// Only the documentation links to the map names.
#[cfg(doc)]
use crate::maps;

/// Destinations the proxy must see, at most (mesh workload IPs and service
/// VIPs, both families): the size of [`maps::FAST_PATH_DESTS`]. A view with
/// more turns the fast path off (every flow back through the proxy).
pub const MAX_FAST_PATH_DESTINATIONS: u32 = 65536;

/// Address ranges the proxy must see, at most (ServiceEntry CIDRs, both
/// families): the size of [`maps::FAST_PATH_RANGES`]. A view with more
/// turns the fast path off.
pub const MAX_FAST_PATH_RANGES: u32 = 4096;

/// Fast-path connections tracked at once, from connect() to close (LRU: an
/// entry left by a connect that never reached the SYN is evicted, never
/// leaks; see `ebpf/src/passthrough.rs`).
pub const MAX_FAST_PATH_SOCKETS: u32 = 65536;

/// Size of the fast path's event ring buffer: 256 KiB, about 2,000 events
/// (128 bytes each with the ring's header) in flight before new ones are
/// dropped (and counted).
pub const FAST_PATH_EVENTS_BYTES: u32 = 256 * 1024;

/// A key of [`maps::FAST_PATH_DESTS`]: an address in network order, IPv4 as
/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`), as connect6 sees a dual-stack
/// socket's IPv4 destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FastPathDest {
    pub addr: [u32; 4],
}

impl FastPathDest {
    /// The key of an IPv4 address given in network order.
    pub fn v4(addr_be: u32) -> Self {
        Self {
            addr: [0, 0, 0xffffu32.to_be(), addr_be],
        }
    }
}

/// The one entry of [`maps::FAST_PATH_STATE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathState {
    /// [`FastPathState::VALID`], [`FastPathState::RANGES`].
    pub flags: u32,
    /// How many times the table was made valid (for logs and tests).
    pub generation: u32,
}

impl FastPathState {
    /// The destination table holds every destination the proxy must see:
    /// a destination missing from it may go direct. Off, every connect of
    /// an enrolled pod goes to the proxy as without the fast path.
    pub const VALID: u32 = 1;
    /// [`maps::FAST_PATH_RANGES`] holds at least one range: a connect whose
    /// destination misses the address table is looked up there too (a
    /// range holding it goes to the proxy). Off, the lookup is skipped.
    pub const RANGES: u32 = 2;
}

/// What connect() left for sockops about a connect that went direct
/// (value of [`maps::FAST_PATH_SOCKS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathSock {
    pub netns_cookie: u64,
    /// `bytes_acked` and `bytes_received` when the connection became
    /// established (the SYN's sequence number, if the kernel counts it).
    pub acked_base: u64,
    pub received_base: u64,
    /// `bpf_ktime_get_ns` at connect.
    pub started_ns: u64,
    pub slot: u32,
    /// `FastPathSock::*` state bits.
    pub flags: u32,
    /// `rcv_nxt` when the socket entered FIN_WAIT2 (to tell a peer's FIN
    /// from a local close at the move to CLOSE).
    pub rcv_nxt_fin_wait2: u32,
    /// With [`FastPathSock::MESH_LOCAL`]: the destination pod's slot;
    /// otherwise zero.
    pub peer_slot: u32,
}

impl FastPathSock {
    /// The connection was established (an opened event was sent).
    pub const ESTABLISHED: u32 = 1;
    /// The peer's FIN was received (it counts one in `bytes_received`).
    pub const PEER_FIN: u32 = 2;
    /// Our FIN was acknowledged (it counts one in `bytes_acked`).
    pub const FIN_ACKED: u32 = 4;
    /// The application closed the socket while in FIN_WAIT2.
    pub const CLOSED_IN_FIN_WAIT2: u32 = 8;
    /// A same-node mesh connection carried in the kernel (flow 2): its
    /// 4-tuple is in [`maps::MESH_LOCAL_FLOWS`] from the SYN to the close.
    pub const MESH_LOCAL: u32 = 16;
    /// Flow 2 through a service VIP: the VIP dialled is in
    /// [`maps::MESH_LOCAL_SERVICE_SOCKS`] under the socket's cookie.
    pub const VIA_SERVICE: u32 = 32;
}

/// One event of [`maps::FAST_PATH_EVENTS`]: a fast-path connection opened
/// or closed. Addresses in network order (IPv4 in `[0]`), ports in host
/// order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathEvent {
    /// [`FastPathEvent::OPENED`] or [`FastPathEvent::CLOSED`].
    pub kind: u32,
    pub slot: u32,
    pub netns_cookie: u64,
    pub socket_cookie: u64,
    pub src_addr: [u32; 4],
    pub dst_addr: [u32; 4],
    pub src_port: u32,
    pub dst_port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
    /// [`FastPathEvent::FAILED`] on a close.
    pub flags: u32,
    /// Payload bytes the pod's socket sent and the peer acknowledged.
    pub bytes_sent: u64,
    /// Payload bytes the pod's socket received.
    pub bytes_received: u64,
    /// From connect() to this event.
    pub duration_ns: u64,
    /// The service VIP the application dialled (flow 2 through a VIP;
    /// `dst_addr` is then the endpoint chosen), as `dst_addr`; zero
    /// otherwise.
    pub service_addr: [u32; 4],
    /// The service port dialled (host order); zero without a service.
    pub service_port: u32,
    /// `AF_INET` or `AF_INET6` with a service; zero without.
    pub service_family: u32,
}

impl FastPathEvent {
    pub const OPENED: u32 = 1;
    pub const CLOSED: u32 = 2;
    /// The connection never became established (refused, timed out).
    pub const FAILED: u32 = 1;
    /// A same-node mesh connection (flow 2): the destination is an
    /// enrolled mesh pod of this node, reported by both ends.
    pub const MESH_LOCAL: u32 = 2;
}

/// The fast path's kernel counters (one entry, per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathStats {
    /// Connects of enrolled pods that went direct.
    pub direct: u64,
    /// Connects that went to the proxy because the table was not valid.
    pub table_invalid: u64,
    /// Connects that went to the proxy because their record could not be
    /// kept.
    pub untracked: u64,
    /// Events lost because the ring buffer was full.
    pub events_dropped: u64,
}

impl FastPathStats {
    pub fn add(&mut self, other: &FastPathStats) {
        self.direct += other.direct;
        self.table_invalid += other.table_invalid;
        self.untracked += other.untracked;
        self.events_dropped += other.events_dropped;
    }
}
