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
    sync::mpsc,
};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use tokio::sync::oneshot;

use crate::netns::NetNs;

/// Mark carried by every socket of the proxy, so redirection never captures
/// the proxy's own traffic (DESIGN: 0x539).
pub use shunt_common::PROXY_MARK;

/// Listen backlog: bursts of new connections must not be refused.
const BACKLOG: i32 = 1024;

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
    /// Starts the pod's socket thread inside the netns at `path`.
    pub fn start(path: &Path) -> io::Result<Self> {
        let netns = NetNs::open(path).map_err(io::Error::other)?;
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::channel::<io::Result<()>>();
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
            // If the receiver is gone the caller has already given up.
            let _ = ready_tx.send(entered);
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
        ready_rx
            .recv()
            .map_err(|_| io::Error::other("netns socket thread died"))??;
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
