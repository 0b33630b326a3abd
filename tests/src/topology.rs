//! Nodes, pods and the fabric joining them (see the crate docs for the picture).

use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::Duration,
};

use shunt::netns::NetNs;

use crate::{
    cgroup, cmd,
    error::{Result, TestbedError},
    names::{self, NETNS_DIR},
    require_root, sweep, warn,
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

/// Node indexes run 1..=254 so both `198.18.i.0/24` and `198.19.0.i` are valid.
const MAX_NODES: usize = 254;
/// Pods get host numbers from here up to 254 unless given an address.
const FIRST_POD_HOST: u8 = 10;
const FABRIC_ROLE: &str = "fabric";

/// `ip netns add` creates and bind-mounts `/var/run/netns` itself the first
/// time; two of those racing can stack mounts, so calls from this process are
/// serialized.
static NETNS_ADD: Mutex<()> = Mutex::new(());

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

/// A "node": a netns with a bridge that is its pods' gateway, routing to the
/// other nodes over the fabric. Cheap to clone; the [`Topology`] owns the
/// namespace.
#[derive(Debug, Clone)]
pub struct Node {
    name: String,
    index: u8,
    netns_name: String,
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
    name: String,
    node: Node,
    ip: Ipv4Addr,
    netns_name: String,
    host_veth: String,
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

struct NodeState {
    node: Node,
    used_hosts: BTreeSet<u8>,
    next_veth: u32,
}

/// A set of nodes and pods for one test. Dropping it deletes every netns and
/// cgroup it made, also while unwinding from a panic.
pub struct Topology {
    test_name: String,
    id: u64,
    prefix: String,
    /// Every netns created, in order, so drop can undo even a half-built node.
    created: Vec<String>,
    fabric: Option<String>,
    nodes: Vec<NodeState>,
    pods: Vec<Pod>,
}

impl fmt::Debug for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Topology")
            .field("test_name", &self.test_name)
            .field("prefix", &self.prefix)
            .field("netns", &self.created)
            .finish()
    }
}

impl Topology {
    /// An empty topology with a fresh `shunt-t<pid>-<n>` prefix. First checks
    /// for root and sweeps what killed runs left behind ([`sweep::sweep_stale`]).
    pub fn new(test_name: &str) -> Result<Topology> {
        require_root()?;
        // Allocate first: the sweep must see this topology as live.
        let (id, prefix) = names::allocate();
        let topology = Topology {
            test_name: test_name.to_string(),
            id,
            prefix,
            created: Vec::new(),
            fabric: None,
            nodes: Vec::new(),
            pods: Vec::new(),
        };
        sweep::sweep_stale()?;
        Ok(topology)
    }

    /// The name given to [`Topology::new`], for diagnostics only.
    pub fn test_name(&self) -> &str {
        &self.test_name
    }

    /// `shunt-t<pid>-<n>`: every netns name and the cgroup root start with it.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Names of every netns made so far (fabric, nodes, pods).
    pub fn netns_names(&self) -> &[String] {
        &self.created
    }

    /// The fabric netns, once the first node exists.
    pub fn fabric_netns_name(&self) -> Option<&str> {
        self.fabric.as_deref()
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes
            .iter()
            .map(|state| &state.node)
            .find(|node| node.name == name)
    }

    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().map(|state| &state.node)
    }

    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|pod| pod.name == name)
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.iter()
    }

    /// `<cgroup2>/shunt-test/<prefix>`, created on first use and removed (with
    /// everything below it) on drop. Give it to agents as `--cgroup-root`;
    /// create workload cgroups below it with [`crate::Cgroup::create`].
    pub fn cgroup_root(&self) -> Result<PathBuf> {
        let dir = own_cgroup_root(&self.prefix)?;
        cgroup::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// A topology with one node, `node-a`, and `pods` on it, in order.
    pub fn single_node(test_name: &str, pods: &[&str]) -> Result<(Topology, Vec<Pod>)> {
        let mut topology = Topology::new(test_name)?;
        topology.add_node("node-a")?;
        let pods = pods
            .iter()
            .map(|name| topology.add_pod("node-a", name))
            .collect::<Result<Vec<_>>>()?;
        Ok((topology, pods))
    }

    /// Adds node number `nodes().count() + 1`, wires it to the fabric, and
    /// routes between it and every existing node.
    pub fn add_node(&mut self, name: &str) -> Result<Node> {
        self.check_new_name("node", name)?;
        if self.nodes.len() >= MAX_NODES {
            return Err(TestbedError::Invalid(format!(
                "at most {MAX_NODES} nodes per topology"
            )));
        }
        let index = u8::try_from(self.nodes.len() + 1)
            .map_err(|_| TestbedError::Invalid("too many nodes".into()))?;
        let fabric = self.ensure_fabric()?;
        let node = Node {
            name: name.to_string(),
            index,
            netns_name: self.netns_name(name),
        };
        let ns = node.netns_name.clone();
        self.add_netns(&ns)?;
        write_sysctls(
            &node.netns_path(),
            &[
                ("net/ipv4/ip_forward", "1"),
                ("net/ipv4/conf/all/forwarding", "1"),
            ],
        )?;

        let gateway = format!("{}/24", node.gateway());
        cmd::ip(&["-n", &ns, "link", "add", BRIDGE, "type", "bridge"])?;
        cmd::ip(&["-n", &ns, "addr", "add", &gateway, "dev", BRIDGE])?;
        cmd::ip(&["-n", &ns, "link", "set", BRIDGE, "up"])?;

        // Created from the node's side with the peer placed straight into the
        // fabric, so no interface name ever exists in the root netns where
        // parallel tests could collide.
        let fabric_port = format!("n{index}");
        cmd::ip(&[
            "-n",
            &ns,
            "link",
            "add",
            FABRIC_IF,
            "type",
            "veth",
            "peer",
            "name",
            &fabric_port,
            "netns",
            &fabric,
        ])?;
        cmd::ip(&[
            "-n",
            &fabric,
            "link",
            "set",
            &fabric_port,
            "master",
            BRIDGE,
            "up",
        ])?;
        let fabric_addr = format!("{}/{}", node.ip(), FABRIC_NET.prefix_len);
        cmd::ip(&["-n", &ns, "addr", "add", &fabric_addr, "dev", FABRIC_IF])?;
        cmd::ip(&["-n", &ns, "link", "set", FABRIC_IF, "up"])?;

        for other in self.nodes.iter().map(|state| &state.node) {
            route_pods(&node, other)?;
            route_pods(other, &node)?;
        }
        self.nodes.push(NodeState {
            node: node.clone(),
            used_hosts: BTreeSet::new(),
            next_veth: 0,
        });
        Ok(node)
    }

    /// Adds a pod on `node_name` with the next free address, from
    /// `198.18.<node>.10` up.
    pub fn add_pod(&mut self, node_name: &str, pod_name: &str) -> Result<Pod> {
        let state = self.node_state(node_name)?;
        let host = (FIRST_POD_HOST..=254)
            .find(|host| !state.used_hosts.contains(host))
            .ok_or_else(|| {
                TestbedError::Invalid(format!("node {node_name} has no free pod address"))
            })?;
        let ip = Ipv4Addr::new(198, 18, state.node.index, host);
        self.add_pod_with_ip(node_name, pod_name, ip)
    }

    /// Adds a pod with a chosen address, which must be a free host address in
    /// the node's pod subnet (not `.0`, the gateway `.1`, or `.255`).
    pub fn add_pod_with_ip(
        &mut self,
        node_name: &str,
        pod_name: &str,
        ip: Ipv4Addr,
    ) -> Result<Pod> {
        self.check_new_name("pod", pod_name)?;
        let netns_name = self.netns_name(pod_name);
        let state = self.node_state(node_name)?;
        let node = state.node.clone();
        let host = ip.octets()[3];
        if !node.pod_cidr().contains(ip) || host < 2 || host == 255 {
            return Err(TestbedError::Invalid(format!(
                "pod address {ip} is not a pod host address in node {node_name}'s {}",
                node.pod_cidr()
            )));
        }
        if state.used_hosts.contains(&host) {
            return Err(TestbedError::Invalid(format!("pod address {ip} is taken")));
        }
        let host_veth = format!("vp{}", state.next_veth);

        self.add_netns(&netns_name)?;
        // Reserve before wiring: a failure below leaves the veth behind in the
        // netns, and reusing its name or address would fail confusingly.
        if let Ok(state) = self.node_state_mut(node_name) {
            state.used_hosts.insert(host);
            state.next_veth += 1;
        }
        let node_ns = node.netns_name();
        cmd::ip(&[
            "-n",
            node_ns,
            "link",
            "add",
            &host_veth,
            "type",
            "veth",
            "peer",
            "name",
            POD_IF,
            "netns",
            &netns_name,
        ])?;
        cmd::ip(&[
            "-n", node_ns, "link", "set", &host_veth, "master", BRIDGE, "up",
        ])?;
        let addr = format!("{ip}/24");
        let gateway = node.gateway().to_string();
        cmd::ip(&["-n", &netns_name, "addr", "add", &addr, "dev", POD_IF])?;
        cmd::ip(&["-n", &netns_name, "link", "set", POD_IF, "up"])?;
        cmd::ip(&[
            "-n",
            &netns_name,
            "route",
            "add",
            "default",
            "via",
            &gateway,
            "dev",
            POD_IF,
        ])?;

        let pod = Pod {
            name: pod_name.to_string(),
            node,
            ip,
            netns_name,
            host_veth,
        };
        self.pods.push(pod.clone());
        Ok(pod)
    }

    fn netns_name(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    fn node_state(&self, name: &str) -> Result<&NodeState> {
        self.nodes
            .iter()
            .find(|state| state.node.name == name)
            .ok_or_else(|| TestbedError::Invalid(format!("no node named {name:?}")))
    }

    fn node_state_mut(&mut self, name: &str) -> Result<&mut NodeState> {
        self.nodes
            .iter_mut()
            .find(|state| state.node.name == name)
            .ok_or_else(|| TestbedError::Invalid(format!("no node named {name:?}")))
    }

    /// Node and pod names share one namespace because both become netns names.
    fn check_new_name(&self, what: &str, name: &str) -> Result<()> {
        cgroup::check_component(&format!("{what} name"), name)?;
        if name.len() > 32 {
            return Err(TestbedError::Invalid(format!(
                "{what} name {name:?} is longer than 32 characters"
            )));
        }
        let taken = name == FABRIC_ROLE
            || self.nodes.iter().any(|state| state.node.name == name)
            || self.pods.iter().any(|pod| pod.name == name);
        if taken {
            return Err(TestbedError::Invalid(format!(
                "{what} name {name:?} is already used in this topology (or reserved)"
            )));
        }
        Ok(())
    }

    fn ensure_fabric(&mut self) -> Result<String> {
        if let Some(fabric) = &self.fabric {
            return Ok(fabric.clone());
        }
        let fabric = self.netns_name(FABRIC_ROLE);
        self.add_netns(&fabric)?;
        self.fabric = Some(fabric.clone());
        cmd::ip(&["-n", &fabric, "link", "add", BRIDGE, "type", "bridge"])?;
        cmd::ip(&["-n", &fabric, "link", "set", BRIDGE, "up"])?;
        Ok(fabric)
    }

    /// Creates a netns, records it for cleanup, and sets the defaults every
    /// netns here gets.
    fn add_netns(&mut self, name: &str) -> Result<()> {
        {
            let _serialized = NETNS_ADD
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            cmd::ip(&["netns", "add", name])?;
        }
        self.created.push(name.to_string());
        let path = Path::new(NETNS_DIR).join(name);
        write_sysctls(
            &path,
            &[
                // IPv6 would send router solicitations and DAD probes to
                // multicast addresses outside the test range.
                ("net/ipv6/conf/all/disable_ipv6", "1"),
                ("net/ipv6/conf/default/disable_ipv6", "1"),
                // New netns inherit IPv4 settings from the host, which may
                // have strict reverse-path filtering; make behaviour identical
                // on every machine.
                ("net/ipv4/conf/all/rp_filter", "0"),
                ("net/ipv4/conf/default/rp_filter", "0"),
            ],
        )?;
        cmd::ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    }
}

/// In `from`, routes `to`'s pod subnet via `to`'s fabric address.
fn route_pods(from: &Node, to: &Node) -> Result<()> {
    let cidr = to.pod_cidr().to_string();
    let via = to.ip().to_string();
    cmd::ip(&[
        "-n",
        from.netns_name(),
        "route",
        "add",
        &cidr,
        "via",
        &via,
        "dev",
        FABRIC_IF,
    ])?;
    Ok(())
}

/// Writes `/proc/sys/<key>` as seen from inside the netns: `/proc/sys/net` is
/// resolved against the writing thread's netns, so a thread that entered it
/// suffices. Keys under a missing subsystem (IPv6 compiled out) are skipped.
fn write_sysctls(netns_path: &Path, settings: &[(&str, &str)]) -> Result<()> {
    let results = NetNs::open(netns_path)?.run(|| {
        settings
            .iter()
            .map(|(key, value)| {
                let file = Path::new("/proc/sys").join(key);
                match std::fs::write(&file, value) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound && key.contains("ipv6") => {
                        Ok(())
                    }
                    other => other.map_err(|e| (file, e)),
                }
            })
            .collect::<Vec<_>>()
    })?;
    for result in results {
        result.map_err(|(file, e)| {
            TestbedError::io(
                format!(
                    "cannot write {} in netns {}",
                    file.display(),
                    netns_path.display()
                ),
                e,
            )
        })?;
    }
    Ok(())
}

fn own_cgroup_root(prefix: &str) -> Result<PathBuf> {
    Ok(cgroup::cgroup2_mount()?
        .join(cgroup::CGROUP_PARENT)
        .join(prefix))
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Pods before nodes before the fabric: the reverse of creation.
        for name in self.created.iter().rev() {
            if let Err(e) = cmd::ip(&["netns", "delete", name]) {
                warn(format_args!(
                    "topology {} ({}): cannot delete netns {name}: {e}",
                    self.prefix, self.test_name
                ));
            }
        }
        if let Ok(mount) = cgroup::cgroup2_mount() {
            let root = mount.join(cgroup::CGROUP_PARENT).join(&self.prefix);
            if let Err(e) = cgroup::remove_tree(&root, &mount) {
                warn(format_args!(
                    "topology {} ({}): cgroup cleanup: {e}",
                    self.prefix, self.test_name
                ));
            }
        }
        names::release(self.id);
    }
}
