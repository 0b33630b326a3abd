//! The ports a transparent delivery can leave from, on the real kernel: never
//! 15008, which the pod's TC egress takes for HBONE and lets out without
//! looking for a transparent socket (`ebpf/src/tc_pod.rs`,
//! `may_reply_to_proxy`).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    os::fd::{AsFd, AsRawFd},
    path::PathBuf,
    time::Duration,
};

use nix::sched::CloneFlags;
use shunt_common::PORT_HBONE;

use super::socket::{PodSockets, SourceError, SourcePort};
use crate::netns::NetNs;

/// The application's listener; the client's address is another of `lo`'s.
const APP: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);
const CLIENT: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const TIMEOUT: Duration = Duration::from_secs(5);

/// A new network namespace with `lo` up, the port range 15008–15009, and
/// the HBONE listener's port and the application's bound as the proxy and
/// the application bind them (on one address, not the wildcard); `None`
/// without the privilege to make one. The listeners live as long as the
/// namespace handle.
fn pod_netns() -> Option<(NetNs, Vec<std::net::TcpListener>)> {
    let netns = std::thread::spawn(|| match nix::sched::unshare(CloneFlags::CLONE_NEWNET) {
        Ok(()) => Some(NetNs::current().expect("open the new netns")),
        Err(nix::errno::Errno::EPERM) => None,
        Err(e) => panic!("unshare: {e}"),
    })
    .join()
    .expect("unshare thread")?;
    let listeners = netns
        .run(|| {
            let up = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .expect("run ip");
            assert!(up.success(), "ip link set lo up");
            std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "15008 15009")
                .expect("narrow the port range");
            [
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), PORT_HBONE),
                APP,
            ]
            .into_iter()
            .map(|addr| std::net::TcpListener::bind(addr).expect("listen"))
            .collect::<Vec<_>>()
        })
        .expect("enter the netns");
    Some((netns, listeners))
}

/// The pod's socket thread, with the namespace and its listeners to keep
/// alive; `None` without the privilege to make a namespace.
async fn pod_sockets() -> Option<(PodSockets, NetNs, Vec<std::net::TcpListener>)> {
    let Some((netns, listeners)) = pod_netns() else {
        eprintln!("SKIPPED: making a network namespace needs CAP_SYS_ADMIN");
        return None;
    };
    // A path any thread of this process can open.
    let path = PathBuf::from(format!("/proc/self/fd/{}", netns.as_fd().as_raw_fd()));
    let sockets = PodSockets::start(&path).await.expect("pod sockets");
    Some((sockets, netns, listeners))
}

fn port_of(stream: &tokio::net::TcpStream) -> u16 {
    stream.local_addr().expect("local address").port()
}

#[tokio::test]
async fn a_delivery_bound_at_bind_never_takes_the_hbone_port() {
    let Some((sockets, _netns, _listeners)) = pod_sockets().await else {
        return;
    };
    // Avoiding the client's port 15009 leaves only 15008: refused, so no
    // port for the client's address (the caller falls back to the pod's).
    let only_hbone_left = sockets
        .connect_transparent(APP, CLIENT, SourcePort::Except(15009), TIMEOUT)
        .await;
    assert!(
        matches!(only_hbone_left, Err(SourceError::Bind(_))),
        "{:?}",
        only_hbone_left.map(|s| port_of(&s))
    );
    let stream = sockets
        .connect_transparent(APP, CLIENT, SourcePort::Except(1), TIMEOUT)
        .await
        .expect("a port other than 15008");
    assert_eq!(port_of(&stream), 15009);
}

#[tokio::test]
async fn a_delivery_bound_at_connect_never_takes_the_hbone_port() {
    let Some((sockets, _netns, _listeners)) = pod_sockets().await else {
        return;
    };
    let first = sockets
        .connect_transparent(APP, CLIENT, SourcePort::AtConnect, TIMEOUT)
        .await
        .expect("the range's other port");
    assert_eq!(port_of(&first), 15009);
    // 15009 is taken for this destination and `connect` skips 15008, which
    // the HBONE listener bound: no port, not the HBONE one.
    let second = sockets
        .connect_transparent(APP, CLIENT, SourcePort::AtConnect, TIMEOUT)
        .await;
    assert!(
        matches!(second, Err(SourceError::Bind(_))),
        "{:?}",
        second.map(|s| port_of(&s))
    );
}
