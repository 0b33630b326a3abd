//! Building a topology and tearing it down: the fabric, nodes and pods as
//! network namespaces wired with veths and bridges (see the crate docs for
//! the picture). The nodes and pods tests hold are in `members.rs`, the
//! addresses and interface names in `net.rs`.

mod members;
mod net;
mod sandbox;

use std::{
    collections::BTreeSet,
    fmt,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::Mutex,
};

use shunt::netns::NetNs;

pub use self::{
    members::{Node, Pod},
    net::{BRIDGE, FABRIC_IF, FABRIC_NET, Ipv4Cidr, POD_IF, TEST_NET, is_allowed_destination},
};
use crate::{
    cgroup, cmd,
    error::{Result, TestbedError},
    names::{self, NETNS_DIR},
    require_root, sweep, warn,
};

/// Node indexes run 1..=254 so both `198.18.i.0/24` and `198.19.0.i` are valid.
const MAX_NODES: usize = 254;
/// Pods get host numbers from here up to 254 unless given an address.
const FIRST_POD_HOST: u8 = 10;
const FABRIC_ROLE: &str = "fabric";

/// `ip netns add` creates and bind-mounts `/var/run/netns` itself the first
/// time; two of those racing can stack mounts, so calls from this process are
/// serialized.
static NETNS_ADD: Mutex<()> = Mutex::new(());

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
        prepare_netns(name)
    }
}

/// What every netns here gets once created: the sysctls below and `lo` up.
fn prepare_netns(name: &str) -> Result<()> {
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
