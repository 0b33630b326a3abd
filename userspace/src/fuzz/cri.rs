//! The container runtime's answers (CRI `PodSandboxStatus`, verbose): the
//! protobuf response, and the runtime's `info` JSON inside it, which names
//! the sandbox's network namespace.

use std::collections::HashMap;

use proptest::prelude::*;
use prost::Message as _;
use shunt_proto::cri::{
    LinuxPodSandboxStatus, Namespace, NamespaceMode, NamespaceOption, PodSandboxState,
    PodSandboxStatus, PodSandboxStatusResponse,
};

use super::{edits, mutate};
use crate::{
    control::kube::cri::{CriError, SandboxNetns, netns_from_status},
    state::WorkloadKey,
};

const INFO: &str = r#"{"pid": 1, "netNamespaceClosed": false, "runtimeSpec": {"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/proc/self/ns/net"}]}}}"#;

fn response(info: &str) -> PodSandboxStatusResponse {
    PodSandboxStatusResponse {
        status: Some(PodSandboxStatus {
            id: "sb".into(),
            state: PodSandboxState::SandboxReady as i32,
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network: NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                }),
            }),
            ..Default::default()
        }),
        info: HashMap::from([("info".to_owned(), info.to_owned())]),
    }
}

fn read(response: &PodSandboxStatusResponse) -> Result<SandboxNetns, CriError> {
    netns_from_status(&WorkloadKey::new("shop", "web"), "sb", response)
}

/// A refusal names the sandbox and the pod.
fn named(e: &CriError) -> bool {
    e.to_string().contains("sandbox sb of pod shop/web")
}

#[test]
fn the_seed_is_valid() {
    assert!(matches!(read(&response(INFO)), Ok(SandboxNetns::Path(_))));
}

proptest! {
    #[test]
    fn a_mutated_info_document_names_the_sandbox_when_refused(edits in edits()) {
        let bytes = mutate(INFO.as_bytes(), &edits);
        // A protobuf string is UTF-8: anything else never decodes.
        let Ok(info) = String::from_utf8(bytes) else { return Ok(()) };
        if let Err(e) = read(&response(&info)) {
            prop_assert!(named(&e), "{e}");
        }
    }

    #[test]
    fn a_mutated_status_response_is_read_or_refused_by_name(edits in edits()) {
        let bytes = mutate(&response(INFO).encode_to_vec(), &edits);
        let Ok(decoded) = PodSandboxStatusResponse::decode(bytes.as_slice()) else { return Ok(()) };
        if let Err(e) = read(&decoded) {
            prop_assert!(named(&e), "{e}");
        }
    }
}
