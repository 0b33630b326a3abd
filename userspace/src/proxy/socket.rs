//! Sockets inside a pod's network namespace.
//!
//! A socket belongs to the netns it was created in, whichever thread uses it
//! later. A connection's socket (`socket()` + options) is created by the
//! runtime thread that needs it, which enters the pod's netns for that call
//! and comes back (`NetNs::run_here`: two `setns`, as ztunnel does); asking
//! another thread cost a wake-up and two context switches each way per
//! connection. Connecting and I/O then happen on the runtime like any other
//! socket. The rarer jobs — listeners, the DNS proxy's sockets, enabling
//! `tcp_migrate_req` — run on one long-lived thread per pod that has entered
//! its netns (blocking file I/O and `bind` stay off the runtime).

use std::{
    io,
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
};

use shunt_common::PORT_HBONE;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use tokio::sync::oneshot;

use crate::netns::NetNs;

/// Mark carried by every socket of the proxy, so redirection never captures
/// the proxy's own traffic (DESIGN: 0x539).
pub use shunt_common::PROXY_MARK;

/// Listen backlog: bursts of new connections must not be refused.
const BACKLOG: i32 = 1024;

/// The per-netns sysctl that makes a closing listener hand its queued
/// connections (handshakes in progress and accepted-but-not-yet-accepted
/// ones) to another listener of its `SO_REUSEPORT` group instead of
/// resetting them (Linux 5.14+).
const TCP_MIGRATE_REQ: &str = "/proc/sys/net/ipv4/tcp_migrate_req";

/// Whether the "cannot migrate queued connections" warning was logged: it
/// says the same for every pod, so once per agent is enough.
static MIGRATE_WARNED: AtomicBool = AtomicBool::new(false);

/// What kind of listener to open.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ListenSpec {
    pub addr: SocketAddr,
    /// `IP_TRANSPARENT`, for the inbound plaintext listener that receives
    /// connections addressed to other ports (`bpf_sk_assign`, TPROXY).
    pub transparent: bool,
}

enum Request {
    Listen(
        ListenSpec,
        oneshot::Sender<io::Result<std::net::TcpListener>>,
    ),
    /// A marked, non-blocking UDP socket (the DNS proxy's upstream queries).
    Udp(Domain, oneshot::Sender<io::Result<Socket>>),
    /// The DNS proxy's UDP socket and TCP listener on one address.
    Dns(SocketAddr, oneshot::Sender<io::Result<DnsPair>>),
}

/// A UDP socket and a TCP listener bound on the same address (the DNS
/// proxy's 127.0.0.1:15053 or [::1]:15053), non-blocking.
pub(crate) type DnsPair = (std::net::UdpSocket, std::net::TcpListener);

/// Creates sockets inside one pod's netns. The thread ends when it and
/// every clone are dropped.
#[derive(Clone)]
pub(crate) struct PodSockets {
    netns: Arc<NetNs>,
    tx: mpsc::Sender<Request>,
}

impl std::fmt::Debug for PodSockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodSockets")
            .field("netns", &self.netns.path())
            .finish()
    }
}

impl PodSockets {
    /// Starts the pod's socket thread inside the netns at `path`, and
    /// enables `tcp_migrate_req` there (see [`enable_request_migration`]).
    /// Awaits the thread's start without blocking the caller's thread, so
    /// that many pods are started at once (`agent/serve.rs`).
    pub async fn start(path: &Path) -> io::Result<Self> {
        let netns = Arc::new(NetNs::open(path).map_err(io::Error::other)?);
        let thread_netns = Arc::clone(&netns);
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = oneshot::channel::<io::Result<io::Result<()>>>();
        let name = format!(
            "shunt-ns-{}",
            path.file_name()
                .map(|n| n.to_string_lossy().chars().take(6).collect::<String>())
                .unwrap_or_default()
        );
        std::thread::Builder::new().name(name).spawn(move || {
            let entered = nix::sched::setns(&*thread_netns, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(io::Error::from);
            let ok = entered.is_ok();
            // Before any listener exists, so that none of this agent's
            // listeners can ever reset queued connections when it closes.
            let started = entered.map(|()| enable_request_migration());
            // If the receiver is gone the caller has already given up.
            let _ = ready_tx.send(started);
            if !ok {
                return;
            }
            // Ends when every sender (the PodSockets) is dropped.
            while let Ok(request) = rx.recv() {
                match request {
                    Request::Listen(spec, reply) => {
                        let _ = reply.send(listen(spec));
                    }
                    Request::Udp(domain, reply) => {
                        let _ = reply.send(datagram_socket(domain));
                    }
                    Request::Dns(addr, reply) => {
                        let _ = reply.send(dns_pair(addr));
                    }
                }
            }
        })?;
        let migration = ready_rx
            .await
            .map_err(|_| io::Error::other("netns socket thread died"))??;
        match migration {
            Ok(()) => {
                tracing::debug!(netns = %path.display(), "tcp_migrate_req on: a closing listener hands its queued connections to the other agent's")
            }
            Err(e) if !MIGRATE_WARNED.swap(true, Ordering::Relaxed) => tracing::warn!(
                netns = %path.display(),
                error = %e,
                "cannot enable net.ipv4.tcp_migrate_req in pod network namespaces: during an agent handover, connections still queued on the old agent's listeners are reset when it stops (logged once)"
            ),
            Err(e) => {
                tracing::debug!(netns = %path.display(), error = %e, "cannot enable net.ipv4.tcp_migrate_req")
            }
        }
        Ok(Self { netns, tx })
    }

    /// A marked, non-blocking listener bound inside the pod's netns.
    /// Not yet registered with a runtime: its accept loop does that on the
    /// pod's shard.
    pub async fn listen(&self, spec: ListenSpec) -> io::Result<std::net::TcpListener> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request::Listen(spec, reply))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// The DNS proxy's sockets on `addr` inside the pod's netns: a UDP
    /// socket and a TCP listener, both marked, with `SO_REUSEADDR` and
    /// `SO_REUSEPORT` (a new agent binds the same address while the old
    /// one still serves: the handover, see `proxy/dns_sockets.rs`).
    pub async fn dns(&self, addr: SocketAddr) -> io::Result<DnsPair> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request::Dns(addr, reply))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Connects from inside the pod's netns (marked, so never redirected back
    /// to the proxy), with a timeout.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        timeout: std::time::Duration,
    ) -> io::Result<tokio::net::TcpStream> {
        let socket = self.socket(Domain::for_address(addr))?;
        finish_connect(socket, addr, timeout).await
    }

    /// Connects to the application at `addr` from the client's address
    /// `source` (`IP_TRANSPARENT`, a port as `port` says), so that the
    /// application sees who the client is. The application's replies to
    /// that foreign address reach this socket only through the pod's reply
    /// path (the policy route for mark 0x111, fed by the mangle rules in
    /// iptables mode or by the TC egress program in eBPF mode).
    ///
    /// [`SourceError::Bind`] means the address could not be taken (no
    /// `CAP_NET_ADMIN`, family mismatch, no port of the pod's range left
    /// for this destination...): the caller may connect from the pod's own
    /// address instead. Anything else is the connection's failure.
    pub async fn connect_transparent(
        &self,
        addr: SocketAddr,
        source: IpAddr,
        port: SourcePort,
        timeout: std::time::Duration,
    ) -> Result<tokio::net::TcpStream, SourceError> {
        let domain = Domain::for_address(addr);
        if Domain::for_address(SocketAddr::new(source, 0)) != domain {
            return Err(SourceError::Bind(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("client address {source} is not of the family of {addr}"),
            )));
        }
        let socket = match port {
            SourcePort::AtConnect => {
                let socket = self.socket(domain).map_err(SourceError::Connect)?;
                bind_transparent(&socket, source, true).map_err(SourceError::Bind)?;
                socket
            }
            SourcePort::Except(avoid_port) => self.bind_except(domain, source, avoid_port)?,
        };
        finish_connect(socket, addr, timeout)
            .await
            .map_err(|e| match e.raw_os_error() {
                // Every port of the pod's range is taken for this
                // destination (connections from this client, open or in
                // TIME_WAIT): the pod's own address has ports of its own.
                Some(libc::EADDRNOTAVAIL) => SourceError::Bind(e),
                _ => SourceError::Connect(e),
            })
    }

    /// A transparent socket bound to `source` and an ephemeral port other
    /// than `avoid_port` (see [`SourcePort::Except`]).
    fn bind_except(
        &self,
        domain: Domain,
        source: IpAddr,
        avoid_port: u16,
    ) -> Result<Socket, SourceError> {
        // Never 15008 either: the pod's TC egress takes a packet to that port
        // for an HBONE record, not a reply to this socket (`ebpf/src/tc_pod.rs`,
        // `may_reply_to_proxy`); `bind` can pick it when the node's port range
        // holds it, as the HBONE listener holds only the pod's own address.
        // Three tries at most: a refused socket stays bound until the next is,
        // so each try gets a port the ones before did not.
        // Empty (no allocation) unless a port is refused, which is rare.
        let mut refused = Vec::new();
        for _ in 0..3 {
            let socket = self.socket(domain).map_err(SourceError::Connect)?;
            bind_transparent(&socket, source, false).map_err(SourceError::Bind)?;
            let port = socket
                .local_addr()
                .ok()
                .and_then(|a| a.as_socket())
                .map(|a| a.port());
            if port.is_some_and(|p| p != avoid_port && p != PORT_HBONE) {
                return Ok(socket);
            }
            refused.push(socket);
        }
        Err(SourceError::Bind(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("no free port on {source}"),
        )))
    }

    /// A marked, non-blocking TCP socket of the pod's netns, created on
    /// the calling thread (see the module's comment).
    fn socket(&self, domain: Domain) -> io::Result<Socket> {
        self.netns
            .run_here(|| stream_socket(domain))
            .map_err(io::Error::other)?
    }
}

/// The DNS proxy's upstream queries leave from the pod's netns (its IP),
/// as ztunnel's in-pod forwarder sends them (`dns/forward.rs`).
impl crate::dns::UpstreamSockets for PodSockets {
    fn udp(&self, domain: Domain) -> futures::future::BoxFuture<'_, io::Result<Socket>> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.tx
                .send(Request::Udp(domain, reply))
                .map_err(|_| gone())?;
            rx.await.map_err(|_| gone())?
        })
    }

    fn tcp(&self, domain: Domain) -> futures::future::BoxFuture<'_, io::Result<Socket>> {
        Box::pin(std::future::ready(self.socket(domain)))
    }
}

/// Why a transparent connect failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SourceError {
    /// The client's address could not be bound, or has no port left for
    /// this destination: connecting from the pod's own address still can
    /// work.
    #[error("taking the client's address: {0}")]
    Bind(#[source] io::Error),
    /// The connection itself failed.
    #[error(transparent)]
    Connect(io::Error),
}

/// Which port the proxy's connection to the application leaves from (the
/// address is the client's).
#[derive(Clone, Copy, Debug)]
pub(crate) enum SourcePort {
    /// Any the kernel finds free at `connect` for this destination
    /// (`IP_BIND_ADDRESS_NO_PORT`): a tunnelled client (HBONE), whose own
    /// sockets live in another netns (here only the HBONE connection's,
    /// on port 15008, never the application's). Never 15008 itself:
    /// `connect` skips every port something in the netns bound (the HBONE
    /// listener), which TC egress relies on (`may_reply_to_proxy`).
    AtConnect,
    /// Any but the client's own port, chosen at `bind`: the client's
    /// connection ended in this netns (inbound plaintext), and the proxy's
    /// accepted socket holds podIP:appPort ⇄ client:port. The application's
    /// side of our connection would be that same 4-tuple, and `connect`'s
    /// own check cannot see the clash (it looks for our orientation of the
    /// tuple), so the kernel would deliver our SYN to the accepted socket.
    /// Not left to `connect` either: tried, `userspace/tests/connection_flood.rs`
    /// went red — likely because for a client on this node, whose ports the
    /// same kernel chose by the same hash of these addresses and port,
    /// `connect` picks the ports of the client's other open connections; `bind`
    /// picks among ports not bound here at random. Limitations: that can
    /// still be another open connection's port (odds: the client's open
    /// connections to this port over the range), and `bind` walks every
    /// port the client's address holds, so a client keeping thousands of
    /// connections in TIME_WAIT here makes each new one slower (what
    /// `AtConnect` avoids).
    Except(u16),
}

/// `IP_TRANSPARENT` and a bind to `source`. With `port_at_connect` the port
/// is left to `connect`, which picks one free for the destination: a port
/// in TIME_WAIT with another destination stays usable, and the choice is a
/// lookup per port tried. `bind` with port 0 instead reserves a port for
/// every destination at once, walking each candidate's owners — with tens
/// of thousands of connections from one client in TIME_WAIT, milliseconds
/// per connection (docs/BENCHMARKS.md, "Port choice for the client's
/// address"), then no port at all. (ztunnel binds port 0.)
fn bind_transparent(socket: &Socket, source: IpAddr, port_at_connect: bool) -> io::Result<()> {
    match source {
        IpAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
        IpAddr::V6(_) => socket.set_ip_transparent_v6(true)?,
    }
    if port_at_connect {
        // An IP-level option that IPv6 sockets honour too.
        nix::sys::socket::setsockopt(
            socket,
            nix::sys::socket::sockopt::IpBindAddressNoPort,
            &true,
        )
        .map_err(io::Error::from)?;
    }
    socket.bind(&SockAddr::from(SocketAddr::new(source, 0)))
}

async fn finish_connect(
    socket: Socket,
    addr: SocketAddr,
    timeout: std::time::Duration,
) -> io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
    let stream = crate::timers::timeout(timeout, socket.connect(addr))
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect to {addr} timed out"),
            )
        })??;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Sets `net.ipv4.tcp_migrate_req=1` in the calling thread's netns: net
/// sysctls under /proc/sys act on the netns of the task that opens them, so
/// this must run on the thread that entered the pod's netns.
///
/// Why: two agents' listeners share each port during a handover
/// (`SO_REUSEPORT`), and the kernel spreads new connections over both. When
/// the old agent closes its listeners, connections that completed the
/// handshake but were not yet accepted (and handshakes in progress) would
/// be reset; with this sysctl the kernel moves them to the new agent's
/// listener instead.
fn enable_request_migration() -> io::Result<()> {
    if std::fs::read_to_string(TCP_MIGRATE_REQ)?.trim() == "1" {
        return Ok(());
    }
    std::fs::write(TCP_MIGRATE_REQ, "1")
}

fn gone() -> io::Error {
    io::Error::other("the pod's netns socket thread has stopped")
}

fn stream_socket(domain: Domain) -> io::Result<Socket> {
    let socket = Socket::new(
        domain,
        Type::STREAM.nonblocking().cloexec(),
        Some(Protocol::TCP),
    )?;
    socket.set_mark(PROXY_MARK)?;
    Ok(socket)
}

fn datagram_socket(domain: Domain) -> io::Result<Socket> {
    let socket = Socket::new(
        domain,
        Type::DGRAM.nonblocking().cloexec(),
        Some(Protocol::UDP),
    )?;
    socket.set_mark(PROXY_MARK)?;
    Ok(socket)
}

fn dns_pair(addr: SocketAddr) -> io::Result<DnsPair> {
    let udp = Socket::new(
        Domain::for_address(addr),
        Type::DGRAM.nonblocking().cloexec(),
        Some(Protocol::UDP),
    )?;
    udp.set_mark(PROXY_MARK)?;
    udp.set_reuse_address(true)?;
    udp.set_reuse_port(true)?;
    if addr.is_ipv6() {
        udp.set_only_v6(true)?;
    }
    udp.bind(&SockAddr::from(addr))?;
    let tcp = listen(ListenSpec {
        addr,
        transparent: false,
    })?;
    Ok((udp.into(), tcp))
}

fn listen(spec: ListenSpec) -> io::Result<std::net::TcpListener> {
    let socket = stream_socket(Domain::for_address(spec.addr))?;
    socket.set_reuse_address(true)?;
    // A new agent binds the same ports while the old one drains.
    socket.set_reuse_port(true)?;
    if spec.addr.is_ipv6() {
        // Beside the IPv4 listener on the same port, not instead of it
        // (and IPv4 connections keep arriving as IPv4).
        socket.set_only_v6(true)?;
    }
    if spec.transparent {
        match spec.addr {
            SocketAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
            SocketAddr::V6(_) => socket.set_ip_transparent_v6(true)?,
        }
    }
    socket.bind(&SockAddr::from(spec.addr))?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}
