//! A topology's addresses and interface names: the only range tests may
//! use, the fabric's, and the names every node and pod netns has.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr},
};

/// The benchmarking range (RFC 2544): the only non-loopback addresses any test
/// may use.
pub const TEST_NET: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(198, 18, 0, 0), 15);

/// Node addresses on the fabric: node `i` is `198.19.0.i`.
pub const FABRIC_NET: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(198, 19, 0, 0), 24);

/// Name of the pod gateway bridge inside each node netns (and of the fabric
/// bridge inside the fabric netns).
pub const BRIDGE: &str = "br0";
/// A node's interface on the fabric.
pub const FABRIC_IF: &str = "fab0";
/// A pod's interface.
pub const POD_IF: &str = "eth0";

/// An IPv4 prefix such as `198.18.1.0/24`; `Display` gives that form, ready to
/// pass as a command-line argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Cidr {
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

impl Ipv4Cidr {
    pub const fn new(addr: Ipv4Addr, prefix_len: u8) -> Self {
        Self { addr, prefix_len }
    }

    fn mask(&self) -> u32 {
        match self.prefix_len {
            0 => 0,
            n => u32::MAX << (32 - u32::from(n.min(32))),
        }
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.addr) & self.mask()
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// True for addresses tests may talk to: 198.18.0.0/15 and loopback.
pub fn is_allowed_destination(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || TEST_NET.contains(v4),
        IpAddr::V6(v6) => v6.is_loopback(),
    }
}
