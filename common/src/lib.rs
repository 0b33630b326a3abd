//! Types and constants shared by the eBPF programs (`shunt-ebpf`) and the
//! userspace agent (`shunt`). Everything here is `#[repr(C)]` plain old data
//! without padding: the same bytes are read by the kernel and by userspace.
//!
//! One module per concern, every item re-exported here (`shunt_common::X`):
//! `ports` (ports and marks), `config` (the agent-wide settings), `pod`
//! (a pod's enrolment, config and counters), `original_dst` (where a
//! captured connection was going), `splice`, `policy` (the kernel's
//! authorization table), `fast_path` (flow 1 and the events), `mesh_local`
//! (flow 2); the names the loader uses are in [`maps`], [`programs`] and
//! [`globals`]. The layouts are checked below and, against the built
//! object, by the agent's `pins` tests.
#![no_std]

mod config;
mod fast_path;
pub mod globals;
mod host_probe;
pub mod maps;
mod mesh_local;
mod original_dst;
mod pod;
mod policy;
mod ports;
pub mod programs;
mod splice;

pub use config::*;
pub use fast_path::*;
pub use host_probe::*;
pub use maps::LOG_MAP;
pub use mesh_local::*;
pub use original_dst::*;
pub use pod::*;
pub use policy::*;
pub use ports::*;
pub use splice::*;

#[cfg(feature = "user")]
mod user {
    // SAFETY: each type is `#[repr(C)]`, contains only integers (or arrays
    // and structs of them) laid out without padding, so any bit pattern is a
    // valid value.
    unsafe impl aya::Pod for super::PodSlot {}
    unsafe impl aya::Pod for super::PodCounters {}
    unsafe impl aya::Pod for super::PodConfig {}
    unsafe impl aya::Pod for super::PodAddrs {}
    unsafe impl aya::Pod for super::Cidr4 {}
    unsafe impl aya::Pod for super::GlobalConfig {}
    unsafe impl aya::Pod for super::OriginalDst {}
    unsafe impl aya::Pod for super::SockKey {}
    unsafe impl aya::Pod for super::PodRecord {}
    unsafe impl aya::Pod for super::SpliceKey {}
    unsafe impl aya::Pod for super::SpliceFlow {}
    unsafe impl aya::Pod for super::PolicyVerdictKey {}
    unsafe impl aya::Pod for super::PolicyVerdict {}
    unsafe impl aya::Pod for super::PolicyDenialKey {}
    unsafe impl aya::Pod for super::FastPathDest {}
    unsafe impl aya::Pod for super::FastPathState {}
    unsafe impl aya::Pod for super::FastPathSock {}
    unsafe impl aya::Pod for super::FastPathEvent {}
    unsafe impl aya::Pod for super::FastPathStats {}
    unsafe impl aya::Pod for super::MeshLocalDest {}
    unsafe impl aya::Pod for super::MeshFlowKey {}
    unsafe impl aya::Pod for super::MeshFlow {}
    unsafe impl aya::Pod for super::MeshLocalStats {}
    unsafe impl aya::Pod for super::MeshServiceKey {}
    unsafe impl aya::Pod for super::MeshServiceEndpoint {}
    unsafe impl aya::Pod for super::MeshService {}
    unsafe impl aya::Pod for super::MeshServiceSock {}
    unsafe impl aya::Pod for super::HostProbeKey {}
    unsafe impl aya::Pod for super::HostProbe {}
    unsafe impl aya::Pod for super::HostProbeNode {}
    unsafe impl aya::Pod for super::HostProbeStats {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(core::mem::size_of::<PodSlot>(), 8);
        assert_eq!(core::mem::size_of::<PodCounters>(), 10 * 8);
        assert_eq!(core::mem::size_of::<GlobalConfig>(), 16);
        assert_eq!(core::mem::size_of::<SpliceKey>(), 56);
        assert_eq!(core::mem::size_of::<SpliceFlow>(), 24);
        assert_eq!(core::mem::size_of::<Cidr4>(), 8);
        assert_eq!(
            core::mem::size_of::<PodConfig>(),
            8 + 2 * 2 * MAX_EXCLUDED_PORTS + 8 * MAX_EXCLUDED_CIDRS
        );
        assert_eq!(core::mem::size_of::<OriginalDst>(), 20);
        assert_eq!(core::mem::size_of::<PodAddrs>(), 20);
        assert_eq!(core::mem::size_of::<SockKey>(), 32);
        assert_eq!(core::mem::size_of::<PolicyVerdictKey>(), 24);
        assert_eq!(core::mem::size_of::<PolicyVerdict>(), 8);
        assert_eq!(core::mem::size_of::<PolicyDenialKey>(), 8);
        assert_eq!(core::mem::size_of::<FastPathDest>(), 16);
        assert_eq!(core::mem::size_of::<FastPathState>(), 8);
        assert_eq!(core::mem::size_of::<FastPathSock>(), 48);
        assert_eq!(core::mem::size_of::<FastPathEvent>(), 120);
        assert_eq!(core::mem::size_of::<FastPathStats>(), 32);
        assert_eq!(core::mem::size_of::<MeshLocalDest>(), 8);
        assert_eq!(core::mem::size_of::<MeshFlowKey>(), 40);
        assert_eq!(core::mem::size_of::<MeshFlow>(), 8);
        assert_eq!(core::mem::size_of::<MeshLocalStats>(), 32);
        assert_eq!(core::mem::size_of::<MeshServiceKey>(), 20);
        assert_eq!(core::mem::size_of::<MeshServiceEndpoint>(), 24);
        assert_eq!(
            core::mem::size_of::<MeshService>(),
            8 + 24 * MAX_MESH_SERVICE_ENDPOINTS
        );
        assert_eq!(core::mem::size_of::<MeshServiceSock>(), 24);
        assert_eq!(core::mem::size_of::<HostProbeKey>(), 8);
        assert_eq!(core::mem::size_of::<HostProbe>(), 8);
        assert_eq!(core::mem::size_of::<HostProbeNode>(), 8);
        assert_eq!(core::mem::size_of::<HostProbeStats>(), 16);
    }

    #[test]
    fn cidr_matches_by_prefix() {
        let net = Cidr4 {
            addr: u32::from_be_bytes([198, 18, 0, 0]).to_be(),
            mask: u32::from_be_bytes([255, 254, 0, 0]).to_be(),
        };
        assert!(net.contains(u32::from_be_bytes([198, 19, 3, 4]).to_be()));
        assert!(!net.contains(u32::from_be_bytes([198, 20, 0, 1]).to_be()));
    }
}
