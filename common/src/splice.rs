//! The splice of app ⇄ proxy loopback connections (sk_msg): the key of
//! each connection end and the backlog state of each direction.

/// Connection ends tracked for splicing at once (LRU: an evicted flow
/// simply stops splicing, see `SpliceFlow`).
pub const MAX_SPLICE_SOCKETS: u32 = 65536;

/// One end of an app ⇄ proxy connection inside a pod's netns: the key of
/// the splice maps. Addresses in network order (IPv4 in `[0]`; a
/// v4-mapped IPv6 address is keyed as IPv4, as its peer sees it), ports in
/// host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SpliceKey {
    pub netns_cookie: u64,
    pub local_addr: [u32; 4],
    pub remote_addr: [u32; 4],
    pub local_port: u32,
    pub remote_port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
    /// Reserved (zero), so the key has no padding.
    pub reserved: u32,
}

impl SpliceKey {
    /// The key of the other end of the same connection.
    pub fn peer(&self) -> SpliceKey {
        SpliceKey {
            netns_cookie: self.netns_cookie,
            local_addr: self.remote_addr,
            remote_addr: self.local_addr,
            local_port: self.remote_port,
            remote_port: self.local_port,
            family: self.family,
            reserved: 0,
        }
    }
}

/// The splice state of one direction of a connection, kept for its
/// receiving end. `spliced` is written only by the sender's sk_msg program
/// (under the sender's socket lock) and `consumed` only by the receive hook
/// (under the receiver's), so neither needs atomics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpliceFlow {
    /// Bytes redirected into the receiver's queue.
    pub spliced: u64,
    /// Bytes the receiver has read from that queue.
    pub consumed: u64,
    /// The pod's slot (for its counters).
    pub slot: u32,
    /// Non-zero once this direction fell back to the TCP stack. Never
    /// cleared: after bytes took the TCP path, splicing again could let
    /// later bytes overtake them.
    pub fallen_back: u32,
}
