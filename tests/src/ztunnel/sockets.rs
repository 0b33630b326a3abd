//! The sockets a ztunnel makes, as it makes them: in its pod's netns (a
//! thread that entered it), in its pod's cgroup, with its mark; and the
//! original destination of a connection it accepted, read as it reads it.

use std::{
    mem::{size_of, zeroed},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, OwnedFd},
    path::Path,
    sync::{Arc, Mutex},
    thread,
};

use nix::{
    sched::{CloneFlags, setns},
    sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket,
        sockopt::{IpTransparent, Mark, ReuseAddr, SendTimeout},
    },
    sys::time::TimeVal,
};

use super::{TIMEOUT, ZTUNNEL_MARK};

/// Runs `f` on a thread that entered `netns` (sockets it creates stay in
/// that netns).
pub(super) fn in_netns<T: Send + 'static>(
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
    let _window = super::lock(&CGROUP_WINDOW);
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

/// A TCP socket of `addr`'s family with ztunnel's mark, created with this
/// process in `cgroup` (see [`in_cgroup`]).
fn marked_socket(addr: SocketAddr, cgroup: Option<&Path>) -> std::io::Result<OwnedFd> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = in_cgroup(cgroup, || {
        socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
    })??;
    setsockopt(&fd, Mark, &ZTUNNEL_MARK)?;
    Ok(fd)
}

/// A listener on `addr` with ztunnel's mark (and `IP_TRANSPARENT` when
/// `transparent`), non-blocking, in the calling thread's netns.
pub(super) fn listen(
    addr: SocketAddr,
    transparent: bool,
    cgroup: Option<&Path>,
) -> std::io::Result<TcpListener> {
    let fd = marked_socket(addr, cgroup)?;
    setsockopt(&fd, ReuseAddr, &true)?;
    if transparent {
        setsockopt(&fd, IpTransparent, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    nix::sys::socket::listen(&fd, nix::sys::socket::Backlog::new(128)?)?;
    let listener = TcpListener::from(fd);
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// A TCP connection to `to` with ztunnel's mark, from `from` (any port)
/// with IP_TRANSPARENT when given, in the calling thread's netns.
pub(super) fn connect_marked(
    to: SocketAddr,
    from: Option<IpAddr>,
    cgroup: Option<&Path>,
) -> std::io::Result<TcpStream> {
    let fd = marked_socket(to, cgroup)?;
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
