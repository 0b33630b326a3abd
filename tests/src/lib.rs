//! Test topologies for shunt: "nodes" and "pods" as network namespaces joined
//! by veth pairs, built the way a cluster wires them, for kernel tests,
//! benchmarks and `cargo xtask demo`.
//!
//! ```text
//!                      fabric netns  <prefix>-fabric
//!                    ┌───────────────── br0 ─────────────────┐
//!                    │ n1                                  n2 │
//!                    └─┼────────────────────────────────────┼─┘
//!   node netns         │ fab0 198.19.0.1/24       fab0 198.19.0.2/24
//!   <prefix>-<node> ┌──┴───────────────────┐   ┌───────────┴──────────┐
//!                   │ 198.18.2.0/24 via    │   │ 198.18.1.0/24 via    │
//!                   │   198.19.0.2         │   │   198.19.0.1         │
//!                   │ br0 198.18.1.1/24    │   │ br0 198.18.2.1/24    │
//!                   │  vp0        vp1      │   │  vp0        vp1      │
//!                   └───┼──────────┼───────┘   └───┼──────────┼───────┘
//!   pod netns          eth0       eth0            eth0       eth0
//!   <prefix>-<pod>  198.18.1.10 198.18.1.11     198.18.2.10 198.18.2.11
//!                   default via 198.18.1.1      default via 198.18.2.1
//! ```
//!
//! - Node `i` (1-based, in the order added) owns pod subnet `198.18.i.0/24`;
//!   its bridge `br0` holds the gateway `198.18.i.1`, and it forwards IPv4.
//! - Same-node pod traffic is bridged in the node netns; cross-node traffic is
//!   routed node → fabric → node.
//! - Only 198.18.0.0/15 and loopback are ever used, there is no link to the
//!   root netns, and IPv6 is disabled in every namespace, so no test traffic
//!   can leave the topology.
//! - Names: every netns is `shunt-t<pid>-<n>-<role>` (`<role>` is the node or
//!   pod name, or `fabric`). Interface names are fixed and short (`br0`,
//!   `fab0`, `n<i>`, `vp<k>`, `eth0`): each lives in its own netns, and veths
//!   are created with their peer placed straight into the target netns, so
//!   nothing is ever named in the root netns.
//! - Cleanup: dropping the [`Topology`] (also during a panic) deletes its
//!   namespaces and its cgroup dir `<cgroup2>/shunt-test/<prefix>`;
//!   [`Topology::new`] first sweeps what killed runs left ([`sweep_stale`]).
//!
//! Code runs inside a namespace through [`shunt::netns::NetNs`] (a thread that
//! entered it); sockets keep their netns, so [`Pod::listen_tcp`] and
//! [`Pod::connect_tcp`] return std sockets usable anywhere. External programs
//! run via [`Pod::command`] (`nsenter`, which unlike `ip netns exec` keeps
//! /sys, bpffs and cgroup2 visible); [`Cgroup::place`] additionally starts
//! them inside a cgroup.

pub mod access_log;
pub mod agent;
pub mod apps;
pub mod authz_bed;
mod cgroup;
mod cmd;
pub mod dns;
mod error;
pub mod fast_path;
pub mod hbone;
pub mod inspect;
pub mod mount;
mod names;
pub mod poll;
pub mod reference;
pub mod scrape;
mod sweep;
mod topology;
pub mod waypoint;
pub mod ztunnel;

pub use cgroup::{CGROUP_PARENT, Cgroup, CgroupParent, cgroup2_mount};
pub use error::{Result, TestbedError};
pub use names::{NAME_PREFIX, NETNS_DIR};
pub use sweep::{SweepReport, sweep_stale};
pub use topology::{
    BRIDGE, FABRIC_IF, FABRIC_NET, Ipv4Cidr, Node, POD_IF, Pod, TEST_NET, Topology,
    is_allowed_destination,
};

/// Fails unless running as root, with a message that says how to run the
/// tests. Kernel tests must fail loudly without root, never skip silently.
pub fn require_root() -> Result<()> {
    let euid = nix::unistd::geteuid();
    if euid.is_root() {
        Ok(())
    } else {
        Err(TestbedError::NotRoot {
            euid: euid.as_raw(),
        })
    }
}

/// Reports a cleanup problem without ever panicking (`eprintln!` panics if
/// stderr is gone, and this runs inside `Drop`).
pub(crate) fn warn(message: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "shunt-testbed: {message}");
}
