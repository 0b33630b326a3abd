//! A stand-in for a stock ztunnel's in-pod side, for kernel tests of
//! `--proxy ztunnel`. It uses only what ztunnel uses:
//!
//! - [`ZdsClient`]: ZDS as ztunnel's `inpod/` speaks it — a SEQPACKET unix
//!   socket, `ZdsHello{V1}`, each request read with its SCM_RIGHTS fds, an
//!   `Ack` per request;
//! - [`InPodProxy`]: the listeners bound inside the pod's netns received
//!   over ZDS (`127.0.0.1:15001`, or `[::]:15001` dual stack as ztunnel
//!   binds it with IPv6 on; `0.0.0.0:15006` and `0.0.0.0:15008` with
//!   `IP_TRANSPARENT`), the original destination of an outbound connection
//!   from `getsockopt(SO_ORIGINAL_DST)` (then `IP6T_SO_ORIGINAL_DST`), that
//!   of an inbound one from the same call or else the accepted socket's
//!   local address (ztunnel's `orig_dst_addr_or_default`), and every
//!   connection it opens created in the pod's netns with `SO_MARK` 0x539 —
//!   to the application with `IP_TRANSPARENT`, from the client's address.
//!
//! Given a [`Mesh`] (what a ztunnel learns from istiod and its CA: its
//! pod's certificate, the mesh workloads' identities by IP), it speaks
//! HBONE between stand-ins as ztunnel does ([`crate::hbone`]): an outbound
//! connection to a mesh workload goes as TLS + HTTP/2 `CONNECT` with
//! `:authority` the original destination to that workload's IP:15008,
//! from a socket made in the client pod's netns with mark 0x539; the
//! 15008 listener terminates it, answers 400 for an authority whose IP is
//! not the one the connection arrived on, 503 for one of the proxy's own
//! ports, and otherwise delivers to the authority with `IP_TRANSPARENT`
//! from the HBONE client's address. Without a [`Mesh`] every outbound
//! connection goes as plaintext TCP to its original destination (the
//! server's capture takes it to its 15006) and 15008 accepts and closes.

mod hbone_hop;
mod sockets;
mod zds;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::OwnedFd,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use shunt::state::SpiffeId;

use self::sockets::{connect_marked, in_netns, listen};
pub use self::{sockets::original_dst, zds::ZdsClient};
use crate::hbone::Credentials;

/// The mark ztunnel puts on its own sockets (1337).
pub const ZTUNNEL_MARK: u32 = 0x539;
/// ztunnel's own ports: it never delivers to them (503 over HBONE).
const OWN_PORTS: [u16; 3] = [15001, 15006, 15008];
/// How long any step of the stand-in may take.
const TIMEOUT: Duration = Duration::from_secs(20);
/// The stand-in's whole life (its threads end by then at the latest).
const LIFETIME: Duration = Duration::from_secs(300);

/// A connection the stand-in accepted on its outbound listener (15001).
#[derive(Clone, Debug)]
pub struct Outbound {
    pub peer: SocketAddr,
    /// `getsockopt(SO_ORIGINAL_DST)` (then `IP6T_SO_ORIGINAL_DST`): the
    /// address, or the errno of the last attempt.
    pub original: Result<SocketAddr, i32>,
    /// `None`: relayed as plaintext TCP (or not at all); else HBONE to the
    /// destination's 15008: `Ok` once the CONNECT was answered 200, or
    /// what failed.
    pub hbone: Option<Result<(), String>>,
}

/// A connection the stand-in accepted on 15006, or a CONNECT stream it
/// accepted on 15008.
#[derive(Clone, Debug)]
pub struct Inbound {
    pub listener_port: u16,
    /// The accepted TCP connection's local and peer addresses.
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// HBONE: the CONNECT's `:authority`.
    pub authority: Option<String>,
    /// HBONE: the client's SPIFFE id, from its certificate.
    pub peer_identity: Option<String>,
    /// Where it was delivered: on 15006 ztunnel's
    /// `orig_dst_addr_or_default`, on 15008 the authority.
    pub destination: SocketAddr,
    /// The delivery socket's local address (the client's IP when the
    /// transparent bind worked), or why it failed.
    pub delivered_from: Result<SocketAddr, String>,
}

/// What a ztunnel knows to speak HBONE: its pod's certificate (from its
/// CA) and which destinations are mesh workloads, with their identities
/// (from istiod).
#[derive(Clone)]
pub struct Mesh {
    pub credentials: Credentials,
    pub workloads: BTreeMap<IpAddr, SpiffeId>,
}

/// How a stand-in serves its pod.
#[derive(Clone)]
pub struct Options {
    /// The cgroup v2 directory every socket of the stand-in is created in
    /// (see [`InPodProxy::start`]).
    pub cgroup: Option<PathBuf>,
    /// Where the outbound listener binds: `127.0.0.1:15001`, or `[::]:15001`
    /// (dual stack) as ztunnel binds it with IPv6 on.
    pub outbound: SocketAddr,
    /// HBONE between stand-ins; `None`: plaintext.
    pub mesh: Option<Mesh>,
}

impl Options {
    pub fn new(cgroup: Option<PathBuf>) -> Options {
        Options {
            cgroup,
            outbound: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 15001),
            mesh: None,
        }
    }
}

#[derive(Default)]
struct Seen {
    outbound: Mutex<Vec<Outbound>>,
    inbound: Mutex<Vec<Inbound>>,
}

/// ztunnel's in-pod proxy for one pod: its listeners in the pod's netns and
/// a thread per connection. Stops accepting on drop.
pub struct InPodProxy {
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl InPodProxy {
    /// Binds the listeners inside `netns` (as received over ZDS) and starts
    /// serving them. Returns once every listener is bound: ack after this.
    ///
    /// `cgroup`: the cgroup v2 directory every socket of the stand-in is
    /// created in, as a real ztunnel's sockets belong to its pod's cgroup
    /// below the node's root, where the agent's socket programs are
    /// attached (a socket's cgroup is its creator's at `socket()`; accepted
    /// sockets inherit the listener's).
    pub fn start(netns: OwnedFd, cgroup: Option<PathBuf>) -> std::io::Result<InPodProxy> {
        InPodProxy::start_with(netns, Options::new(cgroup))
    }

    /// [`InPodProxy::start`] with every option.
    pub fn start_with(netns: OwnedFd, options: Options) -> std::io::Result<InPodProxy> {
        let netns = Arc::new(netns);
        let cgroup = Arc::new(options.cgroup);
        let mesh = Arc::new(options.mesh);
        let outbound = options.outbound;
        let listeners = {
            let cgroup = cgroup.clone();
            in_netns(
                &netns,
                move || -> std::io::Result<Vec<(u16, TcpListener)>> {
                    let cgroup = cgroup.as_deref();
                    Ok(vec![
                        (15001, listen(outbound, false, cgroup)?),
                        (
                            15006,
                            listen("0.0.0.0:15006".parse().expect("addr"), true, cgroup)?,
                        ),
                        (
                            15008,
                            listen("0.0.0.0:15008".parse().expect("addr"), true, cgroup)?,
                        ),
                    ])
                },
            )??
        };
        let seen = Arc::new(Seen::default());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = listeners
            .into_iter()
            .map(|(port, listener)| {
                let stand_in = StandIn {
                    netns: netns.clone(),
                    cgroup: cgroup.clone(),
                    mesh: mesh.clone(),
                    seen: seen.clone(),
                };
                let stop = stop.clone();
                thread::spawn(move || serve(port, listener, stand_in, stop))
            })
            .collect();
        Ok(InPodProxy {
            seen,
            stop,
            threads,
        })
    }

    pub fn outbound(&self) -> Vec<Outbound> {
        lock(&self.seen.outbound).clone()
    }

    pub fn inbound(&self) -> Vec<Inbound> {
        lock(&self.seen.inbound).clone()
    }
}

impl Drop for InPodProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// What every connection thread of one stand-in shares.
#[derive(Clone)]
struct StandIn {
    netns: Arc<OwnedFd>,
    cgroup: Arc<Option<PathBuf>>,
    mesh: Arc<Option<Mesh>>,
    seen: Arc<Seen>,
}

impl StandIn {
    /// A TCP connection to `to` made in the pod's netns (see
    /// [`connect_marked`]).
    fn connect(&self, to: SocketAddr, from: Option<IpAddr>) -> std::io::Result<TcpStream> {
        let cgroup = self.cgroup.clone();
        in_netns(&self.netns, move || {
            connect_marked(to, from, cgroup.as_deref())
        })?
    }
}

fn serve(port: u16, listener: TcpListener, stand_in: StandIn, stop: Arc<AtomicBool>) {
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < LIFETIME {
        let (stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(_) => {
                thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let stand_in = stand_in.clone();
        thread::spawn(move || match port {
            15001 => outbound(stream, peer, &stand_in),
            15006 => inbound(port, stream, peer, &stand_in),
            _ if stand_in.mesh.is_some() => hbone_hop::inbound(stream, peer, &stand_in),
            // No HBONE without a mesh: see the module docs.
            _ => drop(stream),
        });
    }
}

fn outbound(app: TcpStream, peer: SocketAddr, stand_in: &StandIn) {
    let original = original_dst(&app);
    let record = |hbone| {
        lock(&stand_in.seen.outbound).push(Outbound {
            peer,
            original,
            hbone,
        })
    };
    let Ok(destination) = original else {
        return record(None);
    };
    // As ztunnel: never connect to its own listener (a connection made
    // straight to 15001, which conntrack answers with its own address).
    if app.local_addr().is_ok_and(|local| same(local, destination)) {
        return record(None);
    }
    let to_mesh = (*stand_in.mesh)
        .as_ref()
        .and_then(|m| Some((m, m.workloads.get(&destination.ip())?)));
    if let Some((mesh, identity)) = to_mesh {
        return hbone_hop::outbound(app, destination, mesh, identity, stand_in, record);
    }
    record(None);
    if let Ok(upstream) = stand_in.connect(destination, None) {
        relay(app, upstream);
    }
}

/// Whether two addresses are the same, a v4-mapped IPv6 one equal to its
/// IPv4 (what a dual-stack listener's socket reports).
fn same(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && a.ip().to_canonical() == b.ip().to_canonical()
}

fn inbound(port: u16, client: TcpStream, peer: SocketAddr, stand_in: &StandIn) {
    let Ok(local) = client.local_addr() else {
        return;
    };
    let destination = original_dst(&client).unwrap_or(local);
    let upstream = if OWN_PORTS.contains(&destination.port()) {
        Err(std::io::Error::other(format!(
            "refused: {destination} is one of the proxy's own ports"
        )))
    } else {
        stand_in.connect(destination, Some(peer.ip()))
    };
    let delivered_from = match &upstream {
        Ok(stream) => stream.local_addr().map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    lock(&stand_in.seen.inbound).push(Inbound {
        listener_port: port,
        local,
        peer,
        authority: None,
        peer_identity: None,
        destination,
        delivered_from,
    });
    if let Ok(upstream) = upstream {
        relay(client, upstream);
    }
}

/// Copies both ways until each side ends, half-closing as ztunnel does.
fn relay(a: TcpStream, b: TcpStream) {
    let _ = a.set_read_timeout(Some(TIMEOUT));
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    let forward = thread::spawn(move || copy(a, b));
    copy(b2, a2);
    let _ = forward.join();
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}
