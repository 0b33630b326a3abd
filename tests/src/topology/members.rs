//! A topology's nodes and pods as tests hold them: where each one's netns
//! is, its addresses, and running code, sockets and programs inside it.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use shunt::netns::NetNs;

#[cfg(doc)]
use super::Topology;
use super::{
    net::{Ipv4Cidr, POD_IF, is_allowed_destination},
    write_sysctls,
};
use crate::{
    cmd,
    error::{Result, TestbedError},
    names::NETNS_DIR,
};

/// A "node": a netns with a bridge that is its pods' gateway, routing to the
/// other nodes over the fabric. Cheap to clone; the [`Topology`] owns the
/// namespace.
#[derive(Debug, Clone)]
pub struct Node {
    pub(super) name: String,
    pub(super) index: u8,
    pub(super) netns_name: String,
}

impl Node {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// 1-based, in the order nodes were added; the third octet of its pods.
    pub fn index(&self) -> u8 {
        self.index
    }

    pub fn netns_name(&self) -> &str {
        &self.netns_name
    }

    /// `/var/run/netns/<netns_name>`.
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns_name)
    }

    /// The node's address on the fabric (its "InternalIP"): `198.19.0.<index>`.
    pub fn ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, 0, self.index)
    }

    /// The pods' gateway, on the node's bridge: `198.18.<index>.1`.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.index, 1)
    }

    /// The node's pod subnet: `198.18.<index>.0/24`.
    pub fn pod_cidr(&self) -> Ipv4Cidr {
        Ipv4Cidr::new(Ipv4Addr::new(198, 18, self.index, 0), 24)
    }

    pub fn netns(&self) -> Result<NetNs> {
        Ok(NetNs::open(self.netns_path())?)
    }

    /// Runs `f` on a thread inside the node's netns.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        Ok(self.netns()?.run(f)?)
    }

    /// A listener bound inside the node's netns; usable from any thread.
    pub fn listen_tcp(&self, addr: SocketAddr) -> Result<TcpListener> {
        listen_tcp(&self.netns_path(), &self.netns_name, addr)
    }

    /// A connection made from inside the node's netns; usable from any thread.
    pub fn connect_tcp(&self, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
        connect_tcp(&self.netns_path(), &self.netns_name, addr, timeout)
    }

    /// `nsenter --net=<netns_path> -- program`: unlike `ip netns exec`, it
    /// leaves /sys alone, so bpffs and the cgroup2 mount stay visible.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        nsenter(&self.netns_path(), program)
    }
}

/// A "pod": a netns with `lo` and `eth0`, a veth whose peer sits on its node's
/// bridge. Cheap to clone; the [`Topology`] owns the namespace.
#[derive(Debug, Clone)]
pub struct Pod {
    pub(super) name: String,
    pub(super) node: Node,
    pub(super) ip: Ipv4Addr,
    pub(super) netns_name: String,
    pub(super) host_veth: String,
}

impl Pod {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node the pod runs on.
    pub fn node(&self) -> &Node {
        &self.node
    }

    pub fn netns_name(&self) -> &str {
        &self.netns_name
    }

    /// `/var/run/netns/<netns_name>`.
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns_name)
    }

    /// The pod's address on `eth0` (a /24 in its node's pod subnet).
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The pod's address in the well-known NAT64 prefix `64:ff9b::/96`
    /// (RFC 6052): an IPv6 destination that is still a 198.18/15 address.
    /// Tests use it where an IPv6 destination is needed, and make sure no
    /// packet is ever sent to it outside the pod (see
    /// [`Pod::enable_ipv6_loopback`]).
    pub fn nat64_ip(&self) -> std::net::Ipv6Addr {
        let [a, b, c, d] = self.ip.octets();
        std::net::Ipv6Addr::new(
            0x64,
            0xff9b,
            0,
            0,
            0,
            0,
            u16::from_be_bytes([a, b]),
            u16::from_be_bytes([c, d]),
        )
    }

    /// Gives the pod's `lo` IPv6 (`::1`), for native IPv6 on loopback.
    /// Every other interface keeps IPv6 off (see `add_netns`): the pod still
    /// has no IPv6 route anywhere else, so nothing can leave it over IPv6.
    pub fn enable_ipv6_loopback(&self) -> Result<()> {
        write_sysctls(
            &self.netns_path(),
            &[("net/ipv6/conf/lo/disable_ipv6", "0")],
        )
    }

    /// Makes the IPv6 `prefix` local to the pod (a `local` route on `lo`):
    /// connects to it are delivered inside the pod's own netns, over `lo`.
    pub fn make_ipv6_prefix_local(&self, prefix: &str) -> Result<()> {
        cmd::ip(&[
            "-n",
            &self.netns_name,
            "-6",
            "route",
            "add",
            "local",
            prefix,
            "dev",
            "lo",
        ])?;
        Ok(())
    }

    /// The pod's interface name ([`POD_IF`]).
    pub fn interface(&self) -> &str {
        POD_IF
    }

    /// The node-side end of the pod's veth, in the node's netns (where a CNI
    /// would attach TC programs), e.g. `vp0`.
    pub fn host_veth(&self) -> &str {
        &self.host_veth
    }

    pub fn netns(&self) -> Result<NetNs> {
        Ok(NetNs::open(self.netns_path())?)
    }

    /// Runs `f` on a thread inside the pod's netns.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        Ok(self.netns()?.run(f)?)
    }

    /// A listener bound inside the pod's netns; usable from any thread.
    pub fn listen_tcp(&self, addr: SocketAddr) -> Result<TcpListener> {
        listen_tcp(&self.netns_path(), &self.netns_name, addr)
    }

    /// A connection made from inside the pod's netns; usable from any thread.
    pub fn connect_tcp(&self, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
        connect_tcp(&self.netns_path(), &self.netns_name, addr, timeout)
    }

    /// `nsenter --net=<netns_path> -- program`: unlike `ip netns exec`, it
    /// leaves /sys alone, so bpffs and the cgroup2 mount stay visible.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        nsenter(&self.netns_path(), program)
    }
}

fn nsenter(netns_path: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut net = std::ffi::OsString::from("--net=");
    net.push(netns_path);
    let mut cmd = Command::new("nsenter");
    cmd.arg(net).arg("--").arg(program);
    cmd
}

fn listen_tcp(path: &Path, netns_name: &str, addr: SocketAddr) -> Result<TcpListener> {
    NetNs::open(path)?
        .run(|| TcpListener::bind(addr))?
        .map_err(|e| TestbedError::io(format!("cannot listen on {addr} in netns {netns_name}"), e))
}

fn connect_tcp(
    path: &Path,
    netns_name: &str,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream> {
    if !is_allowed_destination(addr.ip()) {
        return Err(TestbedError::ForbiddenAddress { addr });
    }
    NetNs::open(path)?
        .run(|| TcpStream::connect_timeout(&addr, timeout))?
        .map_err(|e| {
            TestbedError::io(
                format!("cannot connect to {addr} from netns {netns_name}"),
                e,
            )
        })
}
