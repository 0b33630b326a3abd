//! Settings of the whole agent that the programs read (the one entry of
//! `SHUNT_CONFIG`) and their defaults.

// Only the documentation links to the map names.
#[cfg(doc)]
use crate::maps;

/// Istio's kubelet health-probe source address: probes from it reach the
/// application directly. 169.254.7.127.
pub const DEFAULT_PROBE_SOURCE_V4: [u8; 4] = [169, 254, 7, 127];

/// Settings of the whole agent (one entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalConfig {
    /// Health-probe source whose traffic is never steered (network order).
    pub probe_source_v4: u32,
    /// [`GlobalConfig::SPLICE`].
    pub flags: u32,
    /// Most bytes spliced into a socket and not yet read by it before that
    /// direction of the connection falls back to the TCP stack for good.
    pub splice_backlog: u32,
    /// Reserved (zero).
    pub reserved: u32,
}

impl GlobalConfig {
    /// New app ⇄ proxy connections are spliced (sockops joins them to
    /// [`maps::SPLICE_SOCKS`]).
    pub const SPLICE: u32 = 1;
}

/// Default of [`GlobalConfig::splice_backlog`]: 1 MiB, about what the TCP
/// stack itself lets a loopback connection buffer before the sender blocks.
pub const DEFAULT_SPLICE_BACKLOG: u32 = 1 << 20;
