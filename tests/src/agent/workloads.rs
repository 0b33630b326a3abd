//! The workloads file the testbed's agents run on (`--workloads`).

use std::path::PathBuf;

use crate::Pod;

/// One entry of a workloads file.
#[derive(Clone, Debug)]
pub struct WorkloadSpec {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub ip: std::net::Ipv4Addr,
    pub node: String,
    pub netns: Option<PathBuf>,
    pub ambient: bool,
    /// `splice:` (the `shunt.io/splice` annotation's counterpart), if any.
    pub splice: Option<bool>,
    /// `fastPath:` (the `shunt.io/fast-path` annotation's counterpart), if
    /// any.
    pub fast_path: Option<bool>,
    /// `dnsCapture:` (the `ambient.istio.io/dns-capture` annotation's
    /// counterpart), if any.
    pub dns_capture: Option<bool>,
}

impl WorkloadSpec {
    /// The pod as a workload of namespace `default`, its service account
    /// named after it, opting into the mesh or not.
    pub fn for_pod(pod: &Pod, ambient: bool) -> Self {
        Self {
            name: pod.name().to_string(),
            namespace: "default".into(),
            service_account: format!("sa-{}", pod.name()),
            ip: pod.ip(),
            node: pod.node().name().to_string(),
            netns: Some(pod.netns_path()),
            ambient,
            splice: None,
            fast_path: None,
            dns_capture: None,
        }
    }
}

/// The YAML of a workloads file listing `workloads`.
pub fn workloads_yaml(workloads: &[WorkloadSpec]) -> String {
    let mut yaml = String::from("trustDomain: cluster.local\nworkloads:\n");
    for w in workloads {
        yaml.push_str(&format!(
            "  - name: {}\n    namespace: {}\n    serviceAccount: {}\n    ips: [\"{}\"]\n    node: {}\n    dataplaneMode: {}\n",
            w.name,
            w.namespace,
            w.service_account,
            w.ip,
            w.node,
            if w.ambient { "ambient" } else { "none" }
        ));
        if let Some(netns) = &w.netns {
            yaml.push_str(&format!("    netns: {}\n", netns.display()));
        }
        if let Some(splice) = w.splice {
            yaml.push_str(&format!("    splice: {splice}\n"));
        }
        if let Some(fast_path) = w.fast_path {
            yaml.push_str(&format!("    fastPath: {fast_path}\n"));
        }
        if let Some(dns_capture) = w.dns_capture {
            yaml.push_str(&format!("    dnsCapture: {dns_capture}\n"));
        }
    }
    yaml
}

/// One entry of a workloads file's `services`: `vip:port` goes to each
/// endpoint's `target_port`.
#[derive(Clone, Debug)]
pub struct ServiceSpec {
    pub name: String,
    pub namespace: String,
    /// Assigned to no interface: connect4 (or iptables) captures it anyway.
    pub vip: std::net::Ipv4Addr,
    pub port: u16,
    pub target_port: u16,
    /// Pod names (of `namespace`) or IPs.
    pub endpoints: Vec<String>,
}

/// The YAML of a workloads file's `services` section, to append to
/// [`workloads_yaml`]'s.
pub fn services_yaml(services: &[ServiceSpec]) -> String {
    let mut yaml = String::from("services:\n");
    for s in services {
        let endpoints: Vec<String> = s.endpoints.iter().map(|e| format!("\"{e}\"")).collect();
        yaml.push_str(&format!(
            "  - name: {}\n    namespace: {}\n    clusterIPs: [\"{}\"]\n    ports: [{{port: {}, targetPort: {}}}]\n    endpoints: [{}]\n",
            s.name,
            s.namespace,
            s.vip,
            s.port,
            s.target_port,
            endpoints.join(", ")
        ));
    }
    yaml
}
