//! DNS for kernel tests: a small real DNS server ([`DnsResponder`], built
//! on hickory-proto's messages over std sockets) that a test binds inside
//! a pod's netns — as the upstream resolver of the mesh, or standing in
//! for the DNS proxy on 127.0.0.1:15053 — and that records every query it
//! received. The client side is the `shunt-dig` binary (tests/src/bin),
//! run as a pod's application.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Message, MessageType, OpCode, ResponseCode},
    rr::{Name, RData, Record, RecordType, rdata::A, rdata::AAAA},
};

use crate::{Pod, Result, TestbedError};

/// The largest UDP answer a client without EDNS takes (RFC 1035): a longer
/// one is sent truncated (TC) and the client asks again over TCP.
const UDP_LIMIT: usize = 512;
/// How long the responder serves at most (a test that forgets it ends).
const LIFETIME: Duration = Duration::from_secs(300);

/// How a query arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

/// One query a [`DnsResponder`] received.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The name asked, lower case, with its final dot.
    pub name: String,
    pub transport: Transport,
    /// Who sent it (as the responder's socket saw it).
    pub from: SocketAddr,
    /// Where it was received (the responder's address).
    pub to: SocketAddr,
}

/// A DNS server on one address (UDP and TCP), answering A and AAAA
/// queries for the names it was given (any other: NXDOMAIN), or — when
/// silent — never answering. Stops on drop.
pub struct DnsResponder {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

/// Names → addresses a responder answers with.
pub type Zone = BTreeMap<String, Vec<IpAddr>>;

impl DnsResponder {
    /// Binds `addr` (UDP and TCP) inside `pod`'s netns and serves `zone`;
    /// `silent`: records queries and never answers.
    pub fn start(pod: &Pod, addr: SocketAddr, zone: Zone, silent: bool) -> Result<DnsResponder> {
        let (udp, tcp) = pod
            .run(move || -> std::io::Result<(UdpSocket, TcpListener)> {
                Ok((UdpSocket::bind(addr)?, TcpListener::bind(addr)?))
            })?
            .map_err(|e| {
                TestbedError::io(format!("cannot bind DNS on {addr} in {}", pod.name()), e)
            })?;
        let zone: Arc<BTreeMap<String, Vec<IpAddr>>> = Arc::new(
            zone.into_iter()
                .map(|(name, ips)| (fqdn(&name), ips))
                .collect(),
        );
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        udp.set_read_timeout(Some(Duration::from_millis(50)))
            .map_err(|e| TestbedError::io("udp timeout", e))?;
        tcp.set_nonblocking(true)
            .map_err(|e| TestbedError::io("tcp nonblocking", e))?;
        let udp_thread = {
            let (zone, seen, stop) = (zone.clone(), seen.clone(), stop.clone());
            thread::spawn(move || serve_udp(udp, addr, &zone, &seen, &stop, silent))
        };
        let tcp_thread = {
            let (zone, seen, stop) = (zone.clone(), seen.clone(), stop.clone());
            thread::spawn(move || serve_tcp(tcp, addr, &zone, &seen, &stop, silent))
        };
        Ok(DnsResponder {
            addr,
            seen,
            stop,
            threads: vec![udp_thread, tcp_thread],
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every query received so far.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.seen).clone()
    }

    /// The queries received for `name` (any case, with or without the
    /// final dot).
    pub fn seen_for(&self, name: &str) -> Vec<Seen> {
        let name = fqdn(name);
        self.seen().into_iter().filter(|s| s.name == name).collect()
    }
}

impl Drop for DnsResponder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// `name` lower case with a final dot.
fn fqdn(name: &str) -> String {
    let name = name.to_ascii_lowercase();
    if name.ends_with('.') {
        name
    } else {
        format!("{name}.")
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The answer to `query` from `zone` (`None`: not a query worth answering).
fn answer(query: &Message, zone: &BTreeMap<String, Vec<IpAddr>>) -> Option<Message> {
    let question = query.queries.first()?;
    let mut response = Message::response(query.metadata.id, OpCode::Query);
    response.metadata.recursion_desired = query.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    response.add_query(question.clone());
    let name = fqdn(&question.name().to_ascii());
    match zone.get(&name) {
        None => response.metadata.response_code = ResponseCode::NXDomain,
        Some(ips) => {
            for ip in ips {
                let data = match (ip, question.query_type()) {
                    (IpAddr::V4(v4), RecordType::A) => RData::A(A(*v4)),
                    (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(*v6)),
                    _ => continue,
                };
                response.add_answer(Record::from_rdata(question.name().clone(), 30, data));
            }
        }
    }
    Some(response)
}

fn record(
    seen: &Mutex<Vec<Seen>>,
    query: &Message,
    transport: Transport,
    from: SocketAddr,
    to: SocketAddr,
) {
    let name = query
        .queries
        .first()
        .map(|q| fqdn(&q.name().to_ascii()))
        .unwrap_or_default();
    lock(seen).push(Seen {
        name,
        transport,
        from,
        to,
    });
}

fn serve_udp(
    socket: UdpSocket,
    addr: SocketAddr,
    zone: &BTreeMap<String, Vec<IpAddr>>,
    seen: &Mutex<Vec<Seen>>,
    stop: &AtomicBool,
    silent: bool,
) {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) && start.elapsed() < LIFETIME {
        let Ok((n, from)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let Ok(query) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        record(seen, &query, Transport::Udp, from, addr);
        if silent {
            continue;
        }
        let Some(response) = answer(&query, zone) else {
            continue;
        };
        let Ok(mut bytes) = response.to_vec() else {
            continue;
        };
        let limit = query
            .edns
            .as_ref()
            .map(|e| usize::from(e.max_payload()))
            .unwrap_or(UDP_LIMIT)
            .max(UDP_LIMIT);
        if bytes.len() > limit {
            match response.truncate().to_vec() {
                Ok(truncated) => bytes = truncated,
                Err(_) => continue,
            }
        }
        let _ = socket.send_to(&bytes, from);
    }
}

fn serve_tcp(
    listener: TcpListener,
    addr: SocketAddr,
    zone: &BTreeMap<String, Vec<IpAddr>>,
    seen: &Mutex<Vec<Seen>>,
    stop: &AtomicBool,
    silent: bool,
) {
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < LIFETIME {
        let Ok((mut stream, from)) = listener.accept() else {
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        // One query per connection is all the tests send.
        let Some(query) = read_framed(&mut stream) else {
            continue;
        };
        let Ok(query) = Message::from_vec(&query) else {
            continue;
        };
        record(seen, &query, Transport::Tcp, from, addr);
        if silent {
            continue;
        }
        if let Some(bytes) = answer(&query, zone).and_then(|r| r.to_vec().ok()) {
            let _ = write_framed(&mut stream, &bytes);
        }
    }
}

/// Reads one DNS message framed by its two-byte length (RFC 1035 4.2.2).
pub fn read_framed(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).ok()?;
    let mut message = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut message).ok()?;
    Some(message)
}

/// Writes one DNS message framed by its two-byte length.
pub fn write_framed(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<()> {
    let len = u16::try_from(message.len())
        .map_err(|_| std::io::Error::other("DNS message over 64 KiB"))?;
    stream.write_all(&len.to_be_bytes())?;
    stream.write_all(message)
}

/// A query for `name` and `kind` (`MessageType::Query`, recursion desired).
pub fn query(id: u16, name: &str, kind: RecordType) -> std::result::Result<Message, String> {
    let name = Name::from_ascii(name).map_err(|e| format!("bad name {name}: {e}"))?;
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = true;
    message.add_query(hickory_proto::op::Query::query(name, kind));
    Ok(message)
}
