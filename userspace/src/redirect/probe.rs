//! Feature probe: which of the kernel hooks shunt's eBPF mode needs are
//! available here. Run at start so a missing feature is named up front, not
//! discovered as a verifier error on the first pod.

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};
use serde::Serialize;

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
    /// Probes every feature the eBPF mode uses today.
    pub fn run() -> Probe {
        let mut features = Vec::new();
        let mut check = |name, result: Result<bool, String>| {
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
        check(
            "program type sched_cls (TC classifier)",
            is_program_supported(ProgramType::SchedClassifier).map_err(|e| e.to_string()),
        );
        check(
            "helper bpf_get_netns_cookie in TC programs",
            is_helper_supported(
                ProgramType::SchedClassifier,
                BpfHelper::BPF_FUNC_get_netns_cookie,
            )
            .map_err(|e| e.to_string()),
        );
        check(
            "map type hash",
            is_map_supported(MapType::Hash).map_err(|e| e.to_string()),
        );
        check(
            "map type percpu_array",
            is_map_supported(MapType::PerCpuArray).map_err(|e| e.to_string()),
        );
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
