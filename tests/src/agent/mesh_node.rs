//! The bed of tests that send both mesh and plaintext traffic into a mesh
//! pod: one node, its pods, and an agent that has enrolled them.

use std::time::Duration;

use super::{Agent, AgentNetns, WorkloadSpec, mesh_pods_enrolled, workloads_yaml};
use crate::{Cgroup, Pod, Result, Topology};

/// One node whose pods `client` and `server` are in the mesh and
/// `outsider` is not, a cgroup for their applications (below the agent's
/// cgroup root), and an agent started with `args` that has enrolled the mesh
/// pods: the bed of tests that send both mesh and plaintext traffic into a
/// mesh pod.
pub struct MeshNode {
    pub agent: Agent,
    pub client: Pod,
    pub server: Pod,
    pub outsider: Pod,
    pub apps: Cgroup,
    // Last: the namespaces go after everything in them.
    pub topology: Topology,
}

impl MeshNode {
    /// The agent in the node's netns (the `hostNetwork` layout).
    pub fn start(test: &str, args: &[&str]) -> Result<MeshNode> {
        Self::start_in(test, args, None)
    }

    /// The agent in a pod netns of its own named `agent_pod` (the
    /// DaemonSet's layout), on the node's bridge beside the other pods.
    pub fn start_in_agent_pod(test: &str, agent_pod: &str, args: &[&str]) -> Result<MeshNode> {
        Self::start_in(test, args, Some(agent_pod))
    }

    fn start_in(test: &str, args: &[&str], agent_pod: Option<&str>) -> Result<MeshNode> {
        let (mut topology, pods) = Topology::single_node(test, &["client", "server", "outsider"])?;
        let [client, server, outsider] = [pods[0].clone(), pods[1].clone(), pods[2].clone()];
        let apps = Cgroup::create(&topology, "apps")?;
        let yaml = workloads_yaml(&[
            WorkloadSpec::for_pod(&client, true),
            WorkloadSpec::for_pod(&server, true),
            WorkloadSpec::for_pod(&outsider, false),
        ]);
        let node = client.node().clone();
        let netns = match agent_pod {
            Some(name) => AgentNetns::Pod(topology.add_pod(node.name(), name)?),
            None => AgentNetns::Node,
        };
        let mut agent = Agent::start_in(&topology, &node, netns, &yaml, args, &[])?;
        agent.wait_for(
            "the mesh pods enrolled",
            Duration::from_secs(30),
            mesh_pods_enrolled,
        )?;
        Ok(MeshNode {
            agent,
            client,
            server,
            outsider,
            apps,
            topology,
        })
    }
}
