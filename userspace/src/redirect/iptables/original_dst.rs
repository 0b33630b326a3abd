//! The original destination of a REDIRECTed connection: conntrack keeps the
//! tuple before NAT, and `getsockopt(SO_ORIGINAL_DST)` (IPv4) or
//! `IP6T_SO_ORIGINAL_DST` (IPv6) on the accepted socket reads it back.
//!
//! This serves both listeners in iptables mode: outbound (15001) and inbound
//! plaintext (15006). For inbound, REDIRECT rewrites the destination to the
//! pod's own address on port 15006, so the accepted socket's local address
//! is `podIP:15006`, not the original `podIP:port` (unlike the eBPF mode's
//! `sk_assign`, which keeps it): the proxy must ask this resolver there too.

use std::{
    io,
    mem::{size_of, zeroed},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream},
    os::fd::AsRawFd,
};

use crate::redirect::{OriginalDst, OriginalDstError};

/// [`OriginalDst`] through conntrack (`SO_ORIGINAL_DST`).
#[derive(Clone, Copy, Debug, Default)]
pub struct SoOriginalDst;

impl OriginalDst for SoOriginalDst {
    fn original_dst(&self, accepted: &TcpStream) -> Result<SocketAddr, OriginalDstError> {
        original_dst(accepted)
    }
}

/// Where the peer of `accepted` originally connected to.
///
/// A connection that was not NATed has no different original destination:
/// conntrack then answers with the socket's own local address (or ENOENT
/// when it did not track the connection at all); both are reported as
/// [`OriginalDstError::NotRedirected`], so a client that connects straight to
/// the proxy's port cannot make the proxy connect to itself.
pub fn original_dst(accepted: &TcpStream) -> Result<SocketAddr, OriginalDstError> {
    let local = accepted.local_addr()?;
    let peer = accepted.peer_addr()?;
    let not_redirected = || OriginalDstError::NotRedirected { peer };
    let found = match local {
        SocketAddr::V4(_) => v4(accepted),
        // A v4 client on a dual-stack listener: conntrack tracked it as IPv4.
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => v4(accepted),
        SocketAddr::V6(_) => v6(accepted),
    };
    let original = match found {
        Ok(original) => original,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(not_redirected()),
        Err(e) => return Err(e.into()),
    };
    if same_endpoint(original, local) {
        return Err(not_redirected());
    }
    Ok(original)
}

fn same_endpoint(a: SocketAddr, b: SocketAddr) -> bool {
    let canonical = |s: SocketAddr| (s.ip().to_canonical(), s.port());
    canonical(a) == canonical(b)
}

fn v4(stream: &TcpStream) -> io::Result<SocketAddr> {
    // SAFETY: sockaddr_in is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { zeroed() };
    getsockopt(stream, libc::SOL_IP, libc::SO_ORIGINAL_DST, &mut addr)?;
    Ok(SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    )))
}

fn v6(stream: &TcpStream) -> io::Result<SocketAddr> {
    // SAFETY: sockaddr_in6 is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_in6 = unsafe { zeroed() };
    getsockopt(
        stream,
        libc::SOL_IPV6,
        libc::IP6T_SO_ORIGINAL_DST,
        &mut addr,
    )?;
    Ok(SocketAddr::V6(SocketAddrV6::new(
        Ipv6Addr::from(addr.sin6_addr.s6_addr),
        u16::from_be(addr.sin6_port),
        addr.sin6_flowinfo,
        addr.sin6_scope_id,
    )))
}

fn getsockopt<T>(stream: &TcpStream, level: i32, name: i32, value: &mut T) -> io::Result<()> {
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: the fd is a live socket owned by `stream`; `value` points to a
    // writable `T` of `len` bytes for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (value as *mut T).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
