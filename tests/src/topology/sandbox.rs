//! A pod's sandbox recreated: what kubelet and the CNI do after a sandbox
//! dies, a node reboots or the CNI re-adds the pod — the same pod, its
//! address and its netns name, in a new network namespace.

use serde_json::Value;

use super::{NETNS_ADD, members::Pod, net::BRIDGE, net::POD_IF, prepare_netns};
use crate::{
    cmd,
    error::{Result, TestbedError},
};

impl Pod {
    /// What a CNI DEL then ADD does to the pod: its veth goes (both ends),
    /// its netns is deleted, and a new netns under the same name (so the
    /// same path) gets a new veth with the same address, route and MAC —
    /// the MAC so that the neighbours' ARP caches stay right, as a CNI that
    /// announces the address with a gratuitous ARP, or uses a fixed MAC,
    /// leaves them. Whoever holds the old namespace open keeps it (without
    /// its interface); the [`Topology`](super::Topology) deletes the new one
    /// as it would have the old.
    pub fn recreate_sandbox(&self) -> Result<()> {
        let node = self.node().netns_name().to_string();
        let name = self.netns_name().to_string();
        let mac = self.mac()?;
        cmd::ip(&["-n", &node, "link", "del", self.host_veth()])?;
        cmd::ip(&["netns", "del", &name])?;
        {
            let _serialized = NETNS_ADD
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            cmd::ip(&["netns", "add", &name])?;
        }
        prepare_netns(&name)?;
        cmd::ip(&[
            "-n",
            &node,
            "link",
            "add",
            self.host_veth(),
            "type",
            "veth",
            "peer",
            "name",
            POD_IF,
            "address",
            &mac,
            "netns",
            &name,
        ])?;
        cmd::ip(&[
            "-n",
            &node,
            "link",
            "set",
            self.host_veth(),
            "master",
            BRIDGE,
            "up",
        ])?;
        let addr = format!("{}/24", self.ip());
        let gateway = self.node().gateway().to_string();
        cmd::ip(&["-n", &name, "addr", "add", &addr, "dev", POD_IF])?;
        cmd::ip(&["-n", &name, "link", "set", POD_IF, "up"])?;
        cmd::ip(&[
            "-n", &name, "route", "add", "default", "via", &gateway, "dev", POD_IF,
        ])?;
        Ok(())
    }

    /// The MAC address of the pod's `eth0`.
    fn mac(&self) -> Result<String> {
        let out = cmd::ip(&["-n", self.netns_name(), "-j", "link", "show", POD_IF])?;
        let json: Value = serde_json::from_str(&out).map_err(|e| {
            TestbedError::Invalid(format!("`ip -j link show {POD_IF}` output: {e}"))
        })?;
        json[0]["address"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| {
                TestbedError::Invalid(format!(
                    "{}'s {POD_IF} has no MAC address in `ip -j link show`: {out}",
                    self.name()
                ))
            })
    }
}
