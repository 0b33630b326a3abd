//! Feature probe: which of the kernel hooks shunt's eBPF mode needs are
//! available here. Run at start so a missing feature is named up front, not
//! discovered as a verifier error on the first pod.

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};
use serde::Serialize;

/// Test seam: an environment variable naming features (comma-separated,
/// substrings of [`Feature::name`]) the probe reports missing, so the
/// iptables fallback of `--redirect auto` can be exercised on a kernel that
/// has everything. Compiled only with the `test-seams` cargo feature, which
/// the kernel tests enable (`cargo xtask test` builds the agent with it);
/// release builds never read it.
#[cfg(feature = "test-seams")]
pub const PRETEND_MISSING_ENV: &str = "SHUNT_PROBE_PRETEND_MISSING";

/// The features the test seam says to report missing (none without it).
#[cfg(feature = "test-seams")]
fn pretend_missing() -> Vec<String> {
    let names: Vec<String> = std::env::var(PRETEND_MISSING_ENV)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect();
    if !names.is_empty() {
        tracing::warn!(
            ?names,
            "test seam {PRETEND_MISSING_ENV}: the probe reports these features missing"
        );
    }
    names
}

#[cfg(not(feature = "test-seams"))]
fn pretend_missing() -> Vec<String> {
    Vec::new()
}

/// One kernel feature and whether this kernel has it.
#[derive(Clone, Debug, Serialize)]
pub struct Feature {
    pub name: &'static str,
    pub available: bool,
    /// Why it could not be determined, when probing itself failed.
    pub error: Option<String>,
}

/// The result of probing the kernel.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    pub features: Vec<Feature>,
}

impl Probe {
    /// Probes every program type, helper and map type the eBPF mode uses.
    pub fn run() -> Probe {
        let pretend_missing = pretend_missing();
        let mut features = Vec::new();
        let mut check = |name: &'static str, result: Result<bool, String>| {
            let result = match pretend_missing.iter().any(|m| name.contains(m.as_str())) {
                true => Ok(false),
                false => result,
            };
            features.push(match result {
                Ok(available) => Feature {
                    name,
                    available,
                    error: None,
                },
                Err(error) => Feature {
                    name,
                    available: false,
                    error: Some(error),
                },
            })
        };
        let program = |t: ProgramType| is_program_supported(t).map_err(|e| e.to_string());
        let helper =
            |t: ProgramType, h: BpfHelper| is_helper_supported(t, h).map_err(|e| e.to_string());
        let map = |t: MapType| is_map_supported(t).map_err(|e| e.to_string());
        let sock_addr = ProgramType::CgroupSockAddr;
        check(
            "program type sched_cls (TC)",
            program(ProgramType::SchedClassifier),
        );
        check(
            "program type cgroup_sock_addr (connect4/6)",
            program(sock_addr),
        );
        check("program type sock_ops", program(ProgramType::SockOps));
        check(
            "helper bpf_skc_lookup_tcp in TC",
            helper(
                ProgramType::SchedClassifier,
                BpfHelper::BPF_FUNC_skc_lookup_tcp,
            ),
        );
        check(
            "helper bpf_sk_assign in TC",
            helper(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_sk_assign),
        );
        check(
            "helper bpf_sk_lookup_tcp in cgroup_sock_addr",
            helper(sock_addr, BpfHelper::BPF_FUNC_sk_lookup_tcp),
        );
        check(
            "helper bpf_get_netns_cookie in cgroup_sock_addr",
            helper(sock_addr, BpfHelper::BPF_FUNC_get_netns_cookie),
        );
        check(
            "helper bpf_get_socket_cookie in cgroup_sock_addr",
            helper(sock_addr, BpfHelper::BPF_FUNC_get_socket_cookie),
        );
        check(
            "helper bpf_get_netns_cookie in sock_ops",
            helper(ProgramType::SockOps, BpfHelper::BPF_FUNC_get_netns_cookie),
        );
        check("map type hash", map(MapType::Hash));
        check("map type lru_hash", map(MapType::LruHash));
        check("map type array", map(MapType::Array));
        check("map type percpu_array", map(MapType::PerCpuArray));
        check("map type ringbuf (aya-log)", map(MapType::RingBuf));
        Probe { features }
    }

    /// The features that are missing (or could not be probed).
    pub fn missing(&self) -> impl Iterator<Item = &Feature> {
        self.features.iter().filter(|f| !f.available)
    }

    /// `Ok` when everything is available, else one line naming each gap.
    pub fn require_all(&self) -> Result<(), MissingFeatures> {
        let missing: Vec<String> = self
            .missing()
            .map(|f| match &f.error {
                Some(e) => format!("{} (probe failed: {e})", f.name),
                None => f.name.to_string(),
            })
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(MissingFeatures(missing))
        }
    }
}

/// The kernel lacks features the eBPF mode needs.
#[derive(Debug, thiserror::Error)]
#[error(
    "this kernel lacks what the eBPF redirection mode needs: {}; use a kernel with these features (Linux 6.6 or newer with BTF), or --redirect iptables",
    .0.join(", ")
)]
pub struct MissingFeatures(pub Vec<String>);
