//! Sockets inside a pod's network namespace.
//!
//! A socket belongs to the netns it was created in, whichever thread uses it
//! later. Each pod gets one long-lived thread that has entered its netns and
//! creates sockets on request (`socket()` + options, and `bind`/`listen` for
//! listeners); connecting and I/O then happen on the runtime like any other
//! socket. One thread per pod instead of one per connection: `setns` and a
//! thread spawn per connection would cost far more than the socket call.

use std::{
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
};

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
    Socket(Domain, oneshot::Sender<io::Result<Socket>>),
}

/// Creates sockets inside one pod's netns. Dropping it ends the thread.
pub(crate) struct PodSockets {
    netns: PathBuf,
    tx: mpsc::Sender<Request>,
}

impl std::fmt::Debug for PodSockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodSockets")
            .field("netns", &self.netns)
            .finish()
    }
}

impl PodSockets {
    /// Starts the pod's socket thread inside the netns at `path`, and
    /// enables `tcp_migrate_req` there (see [`enable_request_migration`]).
    pub fn start(path: &Path) -> io::Result<Self> {
        let netns = NetNs::open(path).map_err(io::Error::other)?;
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::channel::<io::Result<io::Result<()>>>();
        let name = format!(
            "shunt-ns-{}",
            path.file_name()
                .map(|n| n.to_string_lossy().chars().take(6).collect::<String>())
                .unwrap_or_default()
        );
        std::thread::Builder::new().name(name).spawn(move || {
            let entered = nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)
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
                    Request::Socket(domain, reply) => {
                        let _ = reply.send(stream_socket(domain));
                    }
                }
            }
        })?;
        let migration = ready_rx
            .recv()
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
        Ok(Self {
            netns: path.to_path_buf(),
            tx,
        })
    }

    /// A marked, non-blocking listener bound inside the pod's netns.
    pub async fn listen(&self, spec: ListenSpec) -> io::Result<tokio::net::TcpListener> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request::Listen(spec, reply))
            .map_err(|_| gone())?;
        let std = rx.await.map_err(|_| gone())??;
        tokio::net::TcpListener::from_std(std)
    }

    /// Connects from inside the pod's netns (marked, so never redirected back
    /// to the proxy), with a timeout.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        timeout: std::time::Duration,
    ) -> io::Result<tokio::net::TcpStream> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request::Socket(Domain::for_address(addr), reply))
            .map_err(|_| gone())?;
        let socket = rx.await.map_err(|_| gone())??;
        let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
        let stream = tokio::time::timeout(timeout, socket.connect(addr))
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

fn listen(spec: ListenSpec) -> io::Result<std::net::TcpListener> {
    let socket = stream_socket(Domain::for_address(spec.addr))?;
    socket.set_reuse_address(true)?;
    // A new agent binds the same ports while the old one drains.
    socket.set_reuse_port(true)?;
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
