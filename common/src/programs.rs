//! Names of the programs in the ELF object.

/// TC ingress classifier on a pod's `eth0`.
pub const TC_POD_INGRESS: &str = "shunt_tc_ingress";
/// TC egress classifier on a pod's `eth0`.
pub const TC_POD_EGRESS: &str = "shunt_tc_egress";
/// `cgroup/connect4` on the cgroup root.
pub const CONNECT4: &str = "shunt_connect4";
/// `cgroup/connect6` on the cgroup root.
pub const CONNECT6: &str = "shunt_connect6";
/// `sockops` on the cgroup root.
pub const SOCKOPS: &str = "shunt_sockops";
/// `cgroup/getsockopt` on the cgroup root: answers `SO_ORIGINAL_DST`.
pub const GETSOCKOPT: &str = "shunt_getsockopt";
/// `cgroup/getpeername4` on the cgroup root: the service VIP a flow-2
/// connection was dialled to (`ebpf/src/mesh_service.rs`).
pub const GETPEERNAME4: &str = "shunt_getpeername4";
/// `cgroup/getpeername6` on the cgroup root (as [`GETPEERNAME4`]).
pub const GETPEERNAME6: &str = "shunt_getpeername6";
/// `sk_msg` verdict on [`super::maps::SPLICE_SOCKS`].
pub const SPLICE_MSG: &str = "shunt_splice_msg";
/// Raw tracepoint on `sock_recv_length`: counts bytes read by spliced
/// sockets.
pub const SPLICE_RECV: &str = "shunt_splice_recv";
/// `cgroup/sendmsg4` on the cgroup root: a pod's UDP DNS query to the
/// DNS proxy (`ebpf/src/dns.rs`).
pub const DNS_SENDMSG4: &str = "shunt_dns_sendmsg4";
/// `cgroup/sendmsg6` on the cgroup root.
pub const DNS_SENDMSG6: &str = "shunt_dns_sendmsg6";
/// `cgroup/recvmsg4` on the cgroup root: the answer's source back to
/// the server the pod asked.
pub const DNS_RECVMSG4: &str = "shunt_dns_recvmsg4";
/// `cgroup/recvmsg6` on the cgroup root.
pub const DNS_RECVMSG6: &str = "shunt_dns_recvmsg6";
/// The tracepoint [`SPLICE_RECV`] attaches to (Linux 6.3+).
pub const SPLICE_RECV_TARGET: &str = "sock_recv_length";
