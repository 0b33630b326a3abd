//! The bed both authorization test files share (`authz.rs`, the proxy's
//! enforcement point; `authz_kernel.rs`, the kernel's): one node; `client`
//! and `server` (namespace default, the server labelled `app: server`) and
//! `intruder` (namespace other, its own service account) in the mesh,
//! `outsider` not; policies in the workloads file.

use serde_json::Value;

use crate::{
    Cgroup, Pod, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::TestApp,
    require_root,
};

const ENROLMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct AuthzBed {
    pub agent: Agent,
    pub client: Pod,
    pub intruder: Pod,
    pub server: Pod,
    pub outsider: Pod,
    pub apps: Cgroup,
    /// `env!("CARGO_BIN_EXE_shunt-testapp")` of the calling test.
    testapp: &'static str,
    // Last: the namespaces go after everything in them.
    _topology: Topology,
}

/// The workloads file: the four pods of `pods` (client, intruder, server,
/// outsider) and `policies` (YAML list items, indented as under
/// `authorizationPolicies:`).
pub fn policy_file(pods: [&Pod; 4], policies: &str) -> String {
    let [client, intruder, server, outsider] = pods;
    let mut intruder = WorkloadSpec::for_pod(intruder, true);
    intruder.namespace = "other".into();
    let mut yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        intruder,
        WorkloadSpec::for_pod(server, true),
        WorkloadSpec::for_pod(outsider, false),
    ]);
    // Labels for the server: right after its `- name:` line.
    let server_entry = format!("  - name: {}\n", server.name());
    let at = yaml.find(&server_entry).expect("server entry");
    yaml.insert_str(at + server_entry.len(), "    labels: {app: server}\n");
    if !policies.is_empty() {
        yaml.push_str("authorizationPolicies:\n");
        yaml.push_str(policies);
    }
    yaml
}

impl AuthzBed {
    /// The topology, and an agent started with `args` on a file holding
    /// `policies`; returns once the mesh pods are enrolled.
    pub fn start(test: &str, testapp: &'static str, policies: &str, args: &[&str]) -> AuthzBed {
        require_root().expect("kernel tests need root");
        let (topology, pods) =
            Topology::single_node(test, &["client", "intruder", "server", "outsider"])
                .expect("topology");
        let [client, intruder, server, outsider] = [0, 1, 2, 3].map(|i| pods[i].clone());
        let apps = Cgroup::create(&topology, "apps").expect("cgroup");
        let yaml = policy_file([&client, &intruder, &server, &outsider], policies);
        let node = client.node().clone();
        let mut agent = Agent::start(&topology, &node, &yaml, args).expect("agent");
        agent
            .wait_for(
                "the mesh pods enrolled",
                ENROLMENT_TIMEOUT,
                mesh_pods_enrolled,
            )
            .expect("enrolled");
        AuthzBed {
            agent,
            client,
            intruder,
            server,
            outsider,
            apps,
            testapp,
            _topology: topology,
        }
    }

    pub fn pods(&self) -> [&Pod; 4] {
        [&self.client, &self.intruder, &self.server, &self.outsider]
    }

    /// Connects from `from` to the server's `port`, sends 4 KiB and reports
    /// what happened (the test app's JSON line).
    pub fn connect(&self, from: &Pod, port: u16) -> Value {
        let apps = TestApp::new(self.testapp, &self.apps);
        let to = format!("{}:{port}", self.server.ip());
        apps.run(
            from,
            &["connect", &to, "--send", "4096", "--timeout-ms", "5000"],
        )
    }
}
