//! Where a captured connection or DNS query was going before the program
//! rewrote it, and how the proxy finds that again from the socket it
//! accepted; with the bounds of the maps that keep them.

// Only the documentation links to the map names.
#[cfg(doc)]
use crate::maps;

/// Original destinations remembered at once (LRU: the proxy reads an entry
/// right after accept; old ones are evicted, never leak).
pub const MAX_ORIGINAL_DSTS: u32 = 65536;

/// Sockets whose DNS server is remembered at once (LRU, by socket cookie;
/// see [`maps::DNS_SERVERS`]). An entry is needed only from the query to
/// its answer (a resolver's timeout, 5 s by default); the sendmsg hook
/// writes it again on every query. 65,536 entries keep that window for
/// more than 13,000 new resolver sockets per second on a node.
pub const MAX_DNS_SOCKETS: u32 = 65536;

/// Where an application's connection was going before connect() was
/// rewritten. Addresses in network order (IPv4 in `addr[0]`), port in host
/// order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OriginalDst {
    pub addr: [u32; 4],
    pub port: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
}

/// A socket's local end inside a netns: how the proxy finds the original
/// destination of a connection it accepted (the peer of the accepted socket
/// is the application's local end).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockKey {
    pub netns_cookie: u64,
    /// Network order; IPv4 in `addr[0]`, the rest zero.
    pub addr: [u32; 4],
    /// Host order.
    pub port: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
}
