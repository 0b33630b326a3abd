//! deploy/ztunnel/: the agent beside a stock Istio ztunnel
//! (`--proxy ztunnel`), as `kustomize build deploy/ztunnel/` builds it.
//! Everything the base's DaemonSet is checked for holds here too (same
//! checks, on these objects); on top, the ZDS socket where ztunnel looks
//! for it, in the host directory ztunnel's chart shares.

use super::{
    Object, agent_container, check_agent_needs, check_args, check_rbac, check_rolling_update,
    daemonset_in, effective_agent_args, host_mount, kustomize, pod_spec,
};

/// ztunnel's INPOD_UDS default, and the host directory holding it.
const ZDS_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
const SOCKET_DIR: &str = "/var/run/ztunnel";

fn overlay() -> Vec<Object> {
    kustomize::build(super::ZTUNNEL_OVERLAY)
}

#[test]
fn ztunnel_overlay_keeps_everything_the_agent_needs() {
    let objects = overlay();
    check_args(&objects);
    check_agent_needs(&objects);
    check_rolling_update(&objects);
    check_rbac(&objects);
}

#[test]
fn ztunnel_overlay_serves_zds_where_ztunnel_connects() {
    let objects = overlay();
    let spec = pod_spec(&daemonset_in(&objects));
    let agent = agent_container(&spec);
    let args = effective_agent_args(&agent);
    assert_eq!(args["--proxy"], "ztunnel");
    assert_eq!(args["--zds-socket"], ZDS_SOCKET);
    let mount = host_mount(&spec, &agent, SOCKET_DIR);
    assert_eq!(mount.mount_path, SOCKET_DIR, "the socket at the same path");
    assert_ne!(mount.read_only, Some(true), "the agent creates the socket");
}
