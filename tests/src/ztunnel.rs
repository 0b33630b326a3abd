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

use std::{
    collections::BTreeMap,
    io::{IoSlice, IoSliceMut},
    mem::{size_of, zeroed},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use crate::hbone::Credentials;
use nix::{
    sched::{CloneFlags, setns},
    sys::socket::{
        AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, SockaddrStorage,
        UnixAddr, bind, connect, recvmsg, sendmsg, setsockopt, socket,
        sockopt::{IpTransparent, Mark, ReceiveTimeout, ReuseAddr, SendTimeout},
    },
    sys::time::TimeVal,
};
use prost::Message as _;
use shunt::state::SpiffeId;
use shunt_proto::istio::zds::{
    Ack, Version, WorkloadRequest, WorkloadResponse, ZdsHello, workload_request::Payload,
    workload_response,
};

/// The mark ztunnel puts on its own sockets (1337).
pub const ZTUNNEL_MARK: u32 = 0x539;
/// ztunnel's own ports: it never delivers to them (503 over HBONE).
const OWN_PORTS: [u16; 3] = [15001, 15006, 15008];
/// How long any step of the stand-in may take.
const TIMEOUT: Duration = Duration::from_secs(20);
/// The stand-in's whole life (its threads end by then at the latest).
const LIFETIME: Duration = Duration::from_secs(300);

/// ztunnel's end of a ZDS connection.
pub struct ZdsClient {
    fd: OwnedFd,
}

impl ZdsClient {
    /// Connects to the agent's socket, waiting (bounded) for it to exist.
    pub fn connect(path: &Path) -> std::io::Result<ZdsClient> {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        let addr = UnixAddr::new(path)?;
        let deadline = Instant::now() + TIMEOUT;
        while let Err(e) = connect(fd.as_raw_fd(), &addr) {
            if Instant::now() >= deadline {
                return Err(e.into());
            }
            thread::sleep(Duration::from_millis(20));
        }
        setsockopt(
            &fd,
            ReceiveTimeout,
            &TimeVal::new(TIMEOUT.as_secs() as i64, 0),
        )?;
        Ok(ZdsClient { fd })
    }

    pub fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        sendmsg::<UnixAddr>(
            self.fd.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &[],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )?;
        Ok(())
    }

    pub fn hello(&self) -> std::io::Result<()> {
        self.send(
            &ZdsHello {
                version: Version::V1 as i32,
            }
            .encode_to_vec(),
        )
    }

    pub fn ack(&self) -> std::io::Result<()> {
        self.send(
            &WorkloadResponse {
                payload: Some(workload_response::Payload::Ack(Ack::default())),
            }
            .encode_to_vec(),
        )
    }

    /// The next request with the descriptors it carried (within the
    /// receive timeout); an error when the agent closed the connection.
    pub fn recv(&self) -> std::io::Result<(Payload, Vec<OwnedFd>)> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let (len, fds) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<UnixAddr>(
                self.fd.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )?;
            let mut fds = Vec::new();
            for cmsg in msg.cmsgs()? {
                if let ControlMessageOwned::ScmRights(raw) = cmsg {
                    // SAFETY: SCM_RIGHTS installed these descriptors for us.
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            (msg.bytes, fds)
        };
        if len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the agent closed the ZDS connection",
            ));
        }
        let request = WorkloadRequest::decode(&buf[..len])
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let payload = request.payload.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "a request without payload")
        })?;
        Ok((payload, fds))
    }
}

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

/// Runs `f` on a thread that entered `netns` (sockets it creates stay in
/// that netns).
fn in_netns<T: Send + 'static>(
    netns: &Arc<OwnedFd>,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    let netns = netns.clone();
    thread::spawn(move || -> std::io::Result<T> {
        setns(&*netns, CloneFlags::CLONE_NEWNET)?;
        Ok(f())
    })
    .join()
    .map_err(|_| std::io::Error::other("netns thread panicked"))?
}

/// Serialises moving this process into a cgroup and back (see
/// [`in_cgroup`]).
static CGROUP_WINDOW: Mutex<()> = Mutex::new(());

/// Runs `f` (which creates a socket) with this process in `cgroup`, then
/// moves it back where it was. cgroup v2 moves whole processes: other
/// threads' sockets created meanwhile land there too, which only matters to
/// programs gated on an enrolled netns.
fn in_cgroup<T>(cgroup: Option<&Path>, f: impl FnOnce() -> T) -> std::io::Result<T> {
    let Some(dir) = cgroup else {
        return Ok(f());
    };
    let _window = lock(&CGROUP_WINDOW);
    let mount = crate::cgroup2_mount().map_err(std::io::Error::other)?;
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let original = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| mount.join(p.trim_start_matches('/')))
        .ok_or_else(|| std::io::Error::other("no cgroup v2 line in /proc/self/cgroup"))?;
    let pid = std::process::id().to_string();
    std::fs::write(dir.join("cgroup.procs"), &pid)?;
    let out = f();
    std::fs::write(original.join("cgroup.procs"), &pid)?;
    Ok(out)
}

fn listen(
    addr: SocketAddr,
    transparent: bool,
    cgroup: Option<&Path>,
) -> std::io::Result<TcpListener> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = in_cgroup(cgroup, || {
        socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
    })??;
    setsockopt(&fd, ReuseAddr, &true)?;
    setsockopt(&fd, Mark, &ZTUNNEL_MARK)?;
    if transparent {
        setsockopt(&fd, IpTransparent, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    nix::sys::socket::listen(&fd, nix::sys::socket::Backlog::new(128)?)?;
    let listener = TcpListener::from(fd);
    listener.set_nonblocking(true)?;
    Ok(listener)
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

/// A TCP connection to `to` with ztunnel's mark, from `from` (any port)
/// with IP_TRANSPARENT when given, in the calling thread's netns.
fn connect_marked(
    to: SocketAddr,
    from: Option<IpAddr>,
    cgroup: Option<&Path>,
) -> std::io::Result<TcpStream> {
    let family = if to.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = in_cgroup(cgroup, || {
        socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
    })??;
    setsockopt(&fd, Mark, &ZTUNNEL_MARK)?;
    // A blocking connect gives up after SO_SNDTIMEO.
    setsockopt(&fd, SendTimeout, &TimeVal::new(TIMEOUT.as_secs() as i64, 0))?;
    if let Some(ip) = from {
        setsockopt(&fd, IpTransparent, &true)?;
        bind(
            fd.as_raw_fd(),
            &SockaddrStorage::from(SocketAddr::new(ip, 0)),
        )?;
    }
    connect(fd.as_raw_fd(), &SockaddrStorage::from(to))?;
    let stream = TcpStream::from(fd);
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    Ok(stream)
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

/// `getsockopt(SOL_IP, SO_ORIGINAL_DST)`, then `(SOL_IPV6,
/// IP6T_SO_ORIGINAL_DST)`, into a `sockaddr_storage` as socket2 (and so
/// ztunnel) asks: the address, or the errno of the attempt at the socket's
/// own family (the other one's is always EOPNOTSUPP or the like).
pub fn original_dst(stream: &TcpStream) -> Result<SocketAddr, i32> {
    let v4 = match getsockopt_addr(stream, libc::SOL_IP, libc::SO_ORIGINAL_DST) {
        Ok(addr) => return Ok(addr),
        Err(e) => e,
    };
    getsockopt_addr(stream, libc::SOL_IPV6, libc::IP6T_SO_ORIGINAL_DST).map_err(|v6| {
        if stream.local_addr().is_ok_and(|a| a.is_ipv4()) {
            v4
        } else {
            v6
        }
    })
}

fn getsockopt_addr(stream: &TcpStream, level: i32, name: i32) -> Result<SocketAddr, i32> {
    // SAFETY: sockaddr_storage is plain old data; all zeroes is valid.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: the fd is a live socket; `storage` is writable for `len`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&mut storage as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    match i32::from(storage.ss_family) {
        libc::AF_INET if len as usize >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the kernel wrote a sockaddr_in (family says so).
            let sin: libc::sockaddr_in =
                unsafe { *(&storage as *const libc::sockaddr_storage).cast() };
            Ok(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                u16::from_be(sin.sin_port),
            ))
        }
        libc::AF_INET6 if len as usize >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: the kernel wrote a sockaddr_in6 (family says so).
            let sin6: libc::sockaddr_in6 =
                unsafe { *(&storage as *const libc::sockaddr_storage).cast() };
            Ok(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                u16::from_be(sin6.sin6_port),
            ))
        }
        // An answer that is no address: as good as none.
        _ => Err(libc::EINVAL),
    }
}
