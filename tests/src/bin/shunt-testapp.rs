//! A stand-in application for kernel tests: run inside a pod's netns and a
//! cgroup below the agent's cgroup root (so the socket programs see it), it
//! connects somewhere, sends a pattern, reads the echo back and prints one
//! JSON line describing what happened.
//!
//! `shunt-testapp connect ADDR [--send N] [--mark M] [--bind LOCAL] [--timeout-ms T] [--slow-read-ms D] [--poll]`
//! (`--bind`: the local address and port, with SO_REUSEADDR)
//! (the echo is checked as it arrives; `--slow-read-ms` pauses D ms after
//! each MiB read, a reader that falls behind; the report includes the
//! socket's `tcp_info` byte counts, which stay 0 for spliced payload;
//! `--poll` runs the transfer on one thread with a non-blocking socket
//! instead of blocking reader and writer threads; `--retry-eagain` takes the
//! read timeout off the blocking socket, so that a read can only return
//! EAGAIN spuriously, and counts such returns (`"eagain"`) and reads on
//! instead of failing)
//! `shunt-testapp hold ADDR --seconds S` (one connection, a 1 KiB echo every
//! 50 ms for S seconds: a long-lived flow across agent restarts)
//! `shunt-testapp churn ADDR --stop-file PATH [--seconds S] [--workers W]
//! [--interval-ms I] [--send N]` (W threads each opening a NEW connection
//! every I ms, sending N bytes and checking the echo, until PATH exists or S
//! seconds passed: connection churn across an agent handover; `"ok"` only
//! when every connection worked)
//!
//! `shunt-testapp many ADDR --count N [--workers W] [--send S]` (W threads
//! making N connections in all, one after another each: send S bytes, read
//! S bytes back, then close with a reset (`SO_LINGER` 0) so that no
//! TIME_WAIT holds the port; reports how many worked: many short
//! connections without running out of ports)
//!
//! `shunt-testapp serve ADDR --conns N [--timeout-ms T]` (an echo server:
//! prints `{"listening":ADDR}` once bound, echoes N connections one after
//! another on non-blocking sockets, then reports their `tcp_info` byte
//! counts summed)
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

/// `error`, saying where it happened.
fn at(error: std::io::Error, what: &str) -> std::io::Error {
    std::io::Error::new(error.kind(), format!("{what}: {error}"))
}

fn bad(message: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, message.to_string())
}

fn run(args: &[String]) -> std::io::Result<String> {
    let mode = args
        .first()
        .ok_or_else(|| bad("usage: connect|hold|churn|many|serve ADDR ..."))?;
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
    if mode == "churn" {
        return churn(args, addr, timeout);
    }
    if mode == "serve" {
        return serve(args, addr, timeout);
    }
    if mode == "many" {
        return many(args, addr, timeout);
    }
    let mark = option(args, "--mark")
        .map(|m| u32::from_str_radix(m.trim_start_matches("0x"), 16).unwrap_or(0));
    let bind = option(args, "--bind")
        .map(|b| {
            b.parse::<SocketAddr>()
                .map_err(|_| bad("bad --bind address"))
        })
        .transpose()?;
    let mut stream = connect(addr, mark, bind, timeout)?;
    // Without a read timeout a blocking read that returns EAGAIN does so
    // spuriously (the caller bounds the run instead).
    let retry_eagain = args.iter().any(|a| a == "--retry-eagain");
    stream.set_read_timeout((!retry_eagain).then_some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let local = stream.local_addr()?;
    let peer = stream.peer_addr()?;
    match mode.as_str() {
        "connect" => {
            let kernel_peer = kernel_peer(&stream)?;
            let n: usize = option(args, "--send")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1024);
            let slow_read = option(args, "--slow-read-ms")
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis);
            let (received, intact, eagain) = if args.iter().any(|a| a == "--poll") {
                let (received, intact) = transfer_polling(&stream, n, slow_read)?;
                (received, intact, 0)
            } else {
                transfer_threaded(&stream, n, slow_read, retry_eagain)?
            };
            let intact = intact && received == n;
            let (bytes_sent, bytes_received) = tcp_bytes(&stream)?;
            Ok(format!(
                "{{\"ok\":true,\"local\":\"{local}\",\"peer\":\"{peer}\",\"kernel_peer\":\"{kernel_peer}\",\"sent\":{n},\"received\":{received},\"intact\":{intact},\"tcp_bytes_sent\":{bytes_sent},\"tcp_bytes_received\":{bytes_received},\"eagain\":{eagain}}}"
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

/// The byte at `offset` of the pattern every transfer sends.
fn pattern(offset: usize) -> u8 {
    (offset % 251) as u8
}

/// Checks arriving echo bytes against the pattern, pausing once per MiB
/// if the reader is to be slow.
struct EchoCheck {
    received: usize,
    intact: bool,
    slow_read: Option<Duration>,
    next_pause: usize,
}

impl EchoCheck {
    fn new(slow_read: Option<Duration>) -> Self {
        Self {
            received: 0,
            intact: true,
            slow_read,
            next_pause: 1 << 20,
        }
    }

    fn arrived(&mut self, bytes: &[u8]) {
        let at = self.received;
        self.intact &= bytes.iter().enumerate().all(|(i, b)| *b == pattern(at + i));
        self.received += bytes.len();
        if let Some(pause) = self.slow_read
            && self.received >= self.next_pause
        {
            std::thread::sleep(pause);
            self.next_pause += 1 << 20;
        }
    }
}

/// Fills `chunk` with the pattern from `offset`; returns how much of it to send.
fn fill(chunk: &mut [u8], offset: usize, total: usize) -> usize {
    let len = chunk.len().min(total - offset);
    for (i, b) in chunk[..len].iter_mut().enumerate() {
        *b = pattern(offset + i);
    }
    len
}

/// Most spurious EAGAINs a run reads on after (bounded).
const MAX_EAGAIN: u64 = 10_000;

/// Blocking sockets, a writer thread and a reader: how simple clients work.
/// With `retry_eagain`, a read returning EAGAIN is counted and retried.
fn transfer_threaded(
    stream: &TcpStream,
    n: usize,
    slow_read: Option<Duration>,
    retry_eagain: bool,
) -> std::io::Result<(usize, bool, u64)> {
    let mut writer = stream.try_clone()?;
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        // 64 KiB pieces: a 1 GiB payload need not be in memory at once.
        let mut chunk = vec![0u8; 65536];
        let mut offset = 0usize;
        while offset < n {
            let len = fill(&mut chunk, offset, n);
            writer
                .write_all(&chunk[..len])
                .map_err(|e| at(e, &format!("write at byte {offset}")))?;
            offset += len;
        }
        writer.shutdown(std::net::Shutdown::Write)
    });
    let mut reader = stream;
    let mut buf = vec![0u8; 65536];
    let mut check = EchoCheck::new(slow_read);
    let mut eagain = 0u64;
    loop {
        let got = match reader.read(&mut buf) {
            Err(e)
                if retry_eagain
                    && e.kind() == std::io::ErrorKind::WouldBlock
                    && eagain < MAX_EAGAIN =>
            {
                eagain += 1;
                continue;
            }
            other => other.map_err(|e| at(e, &format!("read at byte {}", check.received)))?,
        };
        if got == 0 {
            break;
        }
        check.arrived(&buf[..got]);
    }
    sender.join().map_err(|_| bad("sender panicked"))??;
    Ok((check.received, check.intact, eagain))
}

/// One thread, a non-blocking socket and poll(2): how event-loop servers
/// and runtimes (Go, tokio, Netty, nginx, Envoy) work.
fn transfer_polling(
    stream: &TcpStream,
    n: usize,
    slow_read: Option<Duration>,
) -> std::io::Result<(usize, bool)> {
    stream.set_nonblocking(true)?;
    let mut chunk = vec![0u8; 65536];
    let mut pending = 0..0;
    let mut offset = 0usize;
    let mut shut = false;
    let mut buf = vec![0u8; 65536];
    let mut check = EchoCheck::new(slow_read);
    let mut io = stream;
    loop {
        let mut events = libc::POLLIN;
        if !shut {
            events |= libc::POLLOUT;
        }
        let mut fd = libc::pollfd {
            fd: stream.as_raw_fd(),
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut fd, 1, 60_000) };
        if ready < 0 {
            return Err(at(std::io::Error::last_os_error(), "poll"));
        }
        if ready == 0 {
            return Err(at(std::io::ErrorKind::TimedOut.into(), "poll"));
        }
        if !shut && fd.revents & libc::POLLOUT != 0 {
            if pending.is_empty() && offset < n {
                pending = 0..fill(&mut chunk, offset, n);
            }
            if !pending.is_empty() {
                match io.write(&chunk[pending.clone()]) {
                    Ok(written) => {
                        pending.start += written;
                        offset += written;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(at(e, &format!("write at byte {offset}"))),
                }
            }
            if offset == n && pending.is_empty() {
                stream.shutdown(std::net::Shutdown::Write)?;
                shut = true;
            }
        }
        if fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            match io.read(&mut buf) {
                Ok(0) => break,
                Ok(got) => check.arrived(&buf[..got]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(at(e, &format!("read at byte {}", check.received))),
            }
        }
    }
    Ok((check.received, check.intact))
}

/// `tcpi_bytes_sent` and `tcpi_bytes_received` of the socket: what went
/// through the TCP stack (payload moved by sk_msg is in neither).
/// Where the kernel connected the socket, read from the netns's
/// `/proc/net/tcp{,6}` by the socket's inode: `getpeername` may answer the
/// address the application dialled instead (shunt's getpeername hooks).
fn kernel_peer(stream: &TcpStream) -> std::io::Result<SocketAddr> {
    use std::os::unix::fs::MetadataExt as _;
    let inode = std::fs::metadata(format!("/proc/self/fd/{}", stream.as_raw_fd()))?.ino();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table)?;
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(9).and_then(|f| f.parse::<u64>().ok()) == Some(inode) {
                return fields
                    .get(2)
                    .and_then(|f| proc_net_addr(f))
                    .ok_or_else(|| bad(&format!("bad {table} line {line:?}")));
            }
        }
    }
    Err(bad("the socket is in neither /proc/net/tcp nor tcp6"))
}

/// `ADDR:PORT` as `/proc/net/tcp{,6}` writes it: the address as 32-bit
/// words in the machine's order, the port in hex.
fn proc_net_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<[u8; 4]> = (0..addr.len() / 8)
        .map(|i| u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16).map(u32::to_ne_bytes))
        .collect::<Result<_, _>>()
        .ok()?;
    let ip: std::net::IpAddr = match words.as_slice() {
        [v4] => std::net::Ipv4Addr::from(*v4).into(),
        [a, b, c, d] => {
            let mut octets = [0u8; 16];
            for (chunk, word) in octets.chunks_exact_mut(4).zip([a, b, c, d]) {
                chunk.copy_from_slice(word);
            }
            std::net::Ipv6Addr::from(octets).into()
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn tcp_bytes(stream: &TcpStream) -> std::io::Result<(u64, u64)> {
    // Offsets in `struct tcp_info` (linux/tcp.h), stable since Linux 4.19.
    const BYTES_RECEIVED: usize = 128;
    const BYTES_SENT: usize = 200;
    let mut info = [0u8; 256];
    let mut len = info.len() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `info`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (len as usize) < BYTES_SENT + 8 {
        return Err(bad(
            "tcp_info too short for tcpi_bytes_sent (kernel < 4.19)",
        ));
    }
    let read = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&info[at..at + 8]);
        u64::from_ne_bytes(bytes)
    };
    Ok((read(BYTES_SENT), read(BYTES_RECEIVED)))
}

/// One connection of the churn: connect, send `payload`, half-close, read
/// the echo to EOF and compare.
fn exchange(addr: SocketAddr, payload: &[u8], timeout: Duration) -> std::io::Result<()> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // Small payloads fit the socket buffers: no sender thread needed.
    stream.write_all(payload)?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut back = Vec::with_capacity(payload.len());
    stream.read_to_end(&mut back)?;
    if back != payload {
        return Err(bad(&format!(
            "echo differs: sent {} bytes, got {}",
            payload.len(),
            back.len()
        )));
    }
    Ok(())
}

fn churn(args: &[String], addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let stop_file = option(args, "--stop-file").ok_or_else(|| bad("missing --stop-file"))?;
    let number = |name: &str, default: u64| {
        option(args, name)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(default)
    };
    let seconds = number("--seconds", 60);
    let workers = number("--workers", 2).clamp(1, 16);
    let interval = Duration::from_millis(number("--interval-ms", 5));
    let size = number("--send", 512).min(64 * 1024) as usize;
    let payload: std::sync::Arc<Vec<u8>> =
        std::sync::Arc::new((0..size).map(|i| (i % 251) as u8).collect());
    let start = Instant::now();
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            let (stop_file, payload) = (stop_file.clone(), payload.clone());
            std::thread::spawn(move || {
                let (mut ok, mut failed, mut errors) = (0u64, 0u64, Vec::<String>::new());
                // Bounded by time, by count, and by the stop file.
                while start.elapsed() < Duration::from_secs(seconds)
                    && ok + failed < 1_000_000
                    && !std::path::Path::new(&stop_file).exists()
                {
                    match exchange(addr, &payload, timeout) {
                        Ok(()) => ok += 1,
                        Err(e) => {
                            failed += 1;
                            if errors.len() < 5 {
                                errors.push(format!(
                                    "after {:?}: {e} ({:?})",
                                    start.elapsed(),
                                    e.kind()
                                ));
                            }
                        }
                    }
                    std::thread::sleep(interval);
                }
                (ok, failed, errors)
            })
        })
        .collect();
    let (mut ok, mut failed, mut errors) = (0u64, 0u64, Vec::new());
    for thread in threads {
        let (o, f, e) = thread.join().map_err(|_| bad("worker panicked"))?;
        ok += o;
        failed += f;
        errors.extend(e);
    }
    let errors: Vec<String> = errors.iter().map(|e| format!("{e:?}")).collect();
    Ok(format!(
        "{{\"ok\":{},\"succeeded\":{ok},\"failed\":{failed},\"seconds\":{:.1},\"errors\":[{}]}}",
        failed == 0 && ok > 0,
        start.elapsed().as_secs_f64(),
        errors.join(",")
    ))
}

fn many(args: &[String], addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let number = |name: &str, default: u64| {
        option(args, name)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(default)
    };
    let count = number("--count", 1000).min(1_000_000);
    let workers = number("--workers", 4).clamp(1, 32);
    let size = number("--send", 64).min(64 * 1024) as usize;
    let payload: std::sync::Arc<Vec<u8>> =
        std::sync::Arc::new((0..size).map(|i| (i % 251) as u8).collect());
    let start = Instant::now();
    let threads: Vec<_> = (0..workers)
        .map(|w| {
            let payload = payload.clone();
            // The first workers take the remainder.
            let mine = count / workers + u64::from(w < count % workers);
            std::thread::spawn(move || {
                let (mut ok, mut failed, mut errors) = (0u64, 0u64, Vec::<String>::new());
                for _ in 0..mine {
                    match exchange_and_reset(addr, &payload, timeout) {
                        Ok(()) => ok += 1,
                        Err(e) => {
                            failed += 1;
                            if errors.len() < 5 {
                                errors.push(format!("{e} ({:?})", e.kind()));
                            }
                        }
                    }
                }
                (ok, failed, errors)
            })
        })
        .collect();
    let (mut ok, mut failed, mut errors) = (0u64, 0u64, Vec::new());
    for thread in threads {
        let (o, f, e) = thread.join().map_err(|_| bad("worker panicked"))?;
        ok += o;
        failed += f;
        errors.extend(e);
    }
    let errors: Vec<String> = errors.iter().map(|e| format!("{e:?}")).collect();
    Ok(format!(
        "{{\"ok\":{},\"succeeded\":{ok},\"failed\":{failed},\"seconds\":{:.1},\"errors\":[{}]}}",
        failed == 0 && ok == count,
        start.elapsed().as_secs_f64(),
        errors.join(",")
    ))
}

/// One short connection of `many`: the payload out, as much back, then a
/// reset.
fn exchange_and_reset(addr: SocketAddr, payload: &[u8], timeout: Duration) -> std::io::Result<()> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(payload)?;
    let mut back = vec![0u8; payload.len()];
    stream.read_exact(&mut back)?;
    if back != payload {
        return Err(bad("echo differs"));
    }
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a value of the size given.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Echoes `--conns` connections, one at a time, each on a non-blocking
/// socket driven by poll(2) until the client closes its side.
fn serve(args: &[String], addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let conns: usize = option(args, "--conns")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let listener = std::net::TcpListener::bind(addr)?;
    println!("{{\"listening\":\"{}\"}}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let (mut echoed, mut tcp_sent, mut tcp_received) = (0u64, 0u64, 0u64);
    for n in 0..conns {
        let (stream, _) = listener.accept()?;
        echoed += echo_polling(&stream, timeout).map_err(|e| at(e, &format!("connection {n}")))?;
        let (sent, received) = tcp_bytes(&stream)?;
        tcp_sent += sent;
        tcp_received += received;
    }
    Ok(format!(
        "{{\"ok\":true,\"served\":{conns},\"echoed\":{echoed},\"tcp_bytes_sent\":{tcp_sent},\"tcp_bytes_received\":{tcp_received}}}"
    ))
}

/// Echoes `stream` until the peer closes its side; returns the bytes echoed.
fn echo_polling(stream: &TcpStream, timeout: Duration) -> std::io::Result<u64> {
    stream.set_nonblocking(true)?;
    let mut stream = stream;
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 65536];
    let (mut echoed, mut eof) = (0u64, false);
    // Bounded: every round waits at most `timeout` for progress.
    while !eof || !pending.is_empty() {
        let mut fd = libc::pollfd {
            fd: stream.as_raw_fd(),
            events: if pending.is_empty() {
                libc::POLLIN
            } else {
                libc::POLLOUT
            },
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut fd, 1, timeout.as_millis() as i32) };
        if ready < 0 {
            return Err(at(std::io::Error::last_os_error(), "poll"));
        }
        if ready == 0 {
            return Err(at(std::io::ErrorKind::TimedOut.into(), "poll"));
        }
        if pending.is_empty() {
            match stream.read(&mut buf) {
                Ok(0) => eof = true,
                Ok(got) => pending.extend_from_slice(&buf[..got]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(at(e, "read")),
            }
        } else {
            match stream.write(&pending) {
                Ok(written) => {
                    pending.drain(..written);
                    echoed += written as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(at(e, "write")),
            }
        }
    }
    stream.shutdown(std::net::Shutdown::Write)?;
    Ok(echoed)
}

fn connect(
    addr: SocketAddr,
    mark: Option<u32>,
    bind: Option<SocketAddr>,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    if mark.is_none() && bind.is_none() {
        return TcpStream::connect_timeout(&addr, timeout);
    }
    // SO_MARK and bind() must come before connect(): create, mark, bind,
    // connect by hand.
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
        let set = |name: i32, value: u32| {
            let rc = libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                (&value as *const u32).cast(),
                std::mem::size_of::<u32>() as libc::socklen_t,
            );
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        if let Some(mark) = mark {
            set(libc::SO_MARK, mark)?;
        }
        if let Some(local) = bind {
            set(libc::SO_REUSEADDR, 1)?;
            let (storage, len) = sockaddr(local);
            if libc::bind(
                stream.as_raw_fd(),
                (&storage as *const libc::sockaddr_storage).cast(),
                len,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
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
