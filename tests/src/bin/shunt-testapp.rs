//! A stand-in application for kernel tests: run inside a pod's netns and a
//! cgroup below the agent's cgroup root (so the socket programs see it), it
//! connects somewhere, sends a pattern, reads the echo back and prints one
//! JSON line describing what happened.
//!
//! `shunt-testapp connect ADDR [--send N] [--mark M] [--timeout-ms T]`
//! `shunt-testapp hold ADDR --seconds S` (one connection, a 1 KiB echo every
//! 50 ms for S seconds: a long-lived flow across agent restarts)
//!
//! Exit 0 with `"ok":true`, or 1 with `"ok":false` and the error.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = run(&args);
    match result {
        Ok(json) => println!("{json}"),
        Err(error) => {
            println!(
                "{{\"ok\":false,\"error\":{:?},\"kind\":{:?},\"errno\":{}}}",
                error.to_string(),
                format!("{:?}", error.kind()),
                error.raw_os_error().unwrap_or(0)
            );
            std::process::exit(1);
        }
    }
}

fn option(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn bad(message: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, message.to_string())
}

fn run(args: &[String]) -> std::io::Result<String> {
    let mode = args
        .first()
        .ok_or_else(|| bad("usage: connect|hold ADDR ..."))?;
    let addr: SocketAddr = args
        .get(1)
        .ok_or_else(|| bad("missing address"))?
        .parse()
        .map_err(|_| bad("bad address"))?;
    let timeout = Duration::from_millis(
        option(args, "--timeout-ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(5000),
    );
    let mark = option(args, "--mark")
        .map(|m| u32::from_str_radix(m.trim_start_matches("0x"), 16).unwrap_or(0));
    let mut stream = connect(addr, mark, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let local = stream.local_addr()?;
    let peer = stream.peer_addr()?;
    match mode.as_str() {
        "connect" => {
            let n: usize = option(args, "--send")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1024);
            let payload: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            let mut writer = stream.try_clone()?;
            let sender = std::thread::spawn(move || -> std::io::Result<()> {
                writer.write_all(&payload)?;
                writer.shutdown(std::net::Shutdown::Write)
            });
            let mut back = Vec::new();
            stream.read_to_end(&mut back)?;
            sender.join().map_err(|_| bad("sender panicked"))??;
            let intact =
                back.len() == n && back.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8);
            Ok(format!(
                "{{\"ok\":true,\"local\":\"{local}\",\"peer\":\"{peer}\",\"sent\":{n},\"received\":{},\"intact\":{intact}}}",
                back.len()
            ))
        }
        "hold" => {
            let seconds: u64 = option(args, "--seconds")
                .and_then(|v| v.parse().ok())
                .unwrap_or(3);
            let start = Instant::now();
            let chunk = [7u8; 1024];
            let mut rounds = 0u64;
            let mut buf = [0u8; 1024];
            // Bounded by time and by count.
            while start.elapsed() < Duration::from_secs(seconds) && rounds < 100_000 {
                stream.write_all(&chunk)?;
                stream.read_exact(&mut buf)?;
                if buf != chunk {
                    return Err(bad("echo differs"));
                }
                rounds += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(format!(
                "{{\"ok\":true,\"local\":\"{local}\",\"peer\":\"{peer}\",\"rounds\":{rounds}}}"
            ))
        }
        other => Err(bad(&format!("unknown mode {other}"))),
    }
}

fn connect(addr: SocketAddr, mark: Option<u32>, timeout: Duration) -> std::io::Result<TcpStream> {
    let Some(mark) = mark else {
        return TcpStream::connect_timeout(&addr, timeout);
    };
    // SO_MARK must be set before connect(): create, mark, connect by hand.
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket syscalls on a fd this function owns.
    unsafe {
        let fd = libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let rc = libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MARK,
            (&mark as *const u32).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        );
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // A blocking connect() gives up after SO_SNDTIMEO.
        stream.set_write_timeout(Some(timeout))?;
        let (storage, len) = sockaddr(addr);
        if libc::connect(
            stream.as_raw_fd(),
            (&storage as *const libc::sockaddr_storage).cast(),
            len,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: zeroed sockaddr_storage is valid; the family-specific view
    // written fits inside it.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        match addr {
            SocketAddr::V4(v4) => {
                let sin =
                    &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = v4.port().to_be();
                sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
                (
                    storage,
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            }
            SocketAddr::V6(v6) => {
                let sin6 = &mut *(&mut storage as *mut libc::sockaddr_storage)
                    .cast::<libc::sockaddr_in6>();
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = v6.port().to_be();
                sin6.sin6_addr.s6_addr = v6.ip().octets();
                (
                    storage,
                    std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                )
            }
        }
    }
}
