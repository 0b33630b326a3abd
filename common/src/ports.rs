//! The ports and packet marks the programs, the proxy and the node agree
//! on: where captured traffic is sent, and which sockets and packets are
//! the mesh's own.

/// Proxy listener for traffic a pod sends out (cgroup connect redirects here).
pub const PORT_OUTBOUND: u16 = 15001;
/// Transparent listener for plaintext traffic arriving at a pod.
pub const PORT_INBOUND_PLAINTEXT: u16 = 15006;
/// HBONE (HTTP/2 CONNECT over mTLS) listener on the pod's IP.
pub const PORT_HBONE: u16 = 15008;
/// Admin API (loopback only, in the agent's netns).
pub const PORT_ADMIN: u16 = 15000;
/// Prometheus metrics.
pub const PORT_METRICS: u16 = 15020;
/// Readiness (`/healthz/ready`).
pub const PORT_READINESS: u16 = 15021;
/// The DNS proxy inside each pod's netns (127.0.0.1 and ::1, UDP and TCP),
/// where DNS capture sends the pod's queries (Istio's 15053).
pub const PORT_DNS_PROXY: u16 = 15053;
/// The DNS port a pod's queries are captured on.
pub const PORT_DNS: u16 = 53;

/// `SO_MARK` carried by every socket the proxy opens; such sockets are never
/// captured.
pub const PROXY_MARK: u32 = 0x539;

/// Only the low 12 bits of the packet mark are the mesh's to match and set
/// (as Istio's), leaving the rest to the CNI and other software in the pod.
pub const MARK_MASK: u32 = 0xfff;

/// Mark of the application's replies to the proxy's transparent inbound
/// connections (Istio's 0x111): the pod's policy route sends packets with it
/// to `lo`, where the proxy's socket bound to the client's address gets them.
pub const REPLY_MARK: u32 = 0x111;
