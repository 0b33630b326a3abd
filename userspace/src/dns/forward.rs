//! Forwarding what the mesh does not know to the upstream resolvers: UDP
//! first, TCP when the upstream truncates (or when the client itself came
//! over TCP), each exchange on a fresh socket with a fresh random id, the
//! whole bounded by one timeout. The upstream sockets are made in the
//! asking pod's network namespace when the caller gives the pod's
//! [`UpstreamSockets`] (the proxy does: a pod's forwarded query leaves from
//! the pod's own IP, as ztunnel's in-pod forwarder sends it, whatever netns
//! the agent runs in); otherwise in the calling thread's (the agent's).

use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    sync::Arc,
    time::Duration,
};

use futures::future::BoxFuture;
use socket2::{Domain, SockAddr, Socket};

use hickory_proto::op::{Message, MessageType};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpStream, UdpSocket},
    time::Instant,
};

use super::{DnsError, resolv_conf::ResolvConf};
use crate::timers::timeout_at;

/// How long an upstream has for an answer unless told otherwise (over all
/// upstreams and both transports).
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest UDP datagram an upstream may answer with.
const MAX_UDP_ANSWER: usize = 65_535;

/// Why an upstream gave no usable answer (the client gets SERVFAIL).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("no upstream resolver is configured")]
    NoUpstream,
    #[error("no answer from the upstream resolvers within {0:?}")]
    Timeout(Duration),
    #[error("upstream {upstream}: {source}")]
    Io {
        upstream: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("upstream {upstream}: {reason}")]
    BadAnswer {
        upstream: SocketAddr,
        reason: String,
    },
}

/// Where a forwarder's upstream sockets are created: a pod's network
/// namespace (the proxy's socket thread for the pod). Sockets come
/// non-blocking and marked as the proxy's (never captured by the pod's DNS
/// capture), neither bound nor connected.
pub trait UpstreamSockets: Send + Sync + std::fmt::Debug {
    /// A UDP socket of `domain`.
    fn udp(&self, domain: Domain) -> BoxFuture<'_, io::Result<Socket>>;
    /// A TCP socket of `domain`.
    fn tcp(&self, domain: Domain) -> BoxFuture<'_, io::Result<Socket>>;
}

/// The upstream resolvers and the time they have, shared by every pod's
/// server; [`Forwarder::in_pod`] gives one pod's server its copy.
#[derive(Clone, Debug)]
pub struct Forwarder {
    upstreams: Vec<SocketAddr>,
    timeout: Duration,
    /// Where the upstream sockets are made; `None`: the calling thread's
    /// netns.
    sockets: Option<Arc<dyn UpstreamSockets>>,
}

impl Forwarder {
    /// Forwards to `upstreams` in order (the next one when one fails or
    /// times out), all within `timeout`. No upstream: every forwarded query
    /// gets SERVFAIL.
    pub fn new(upstreams: Vec<SocketAddr>, timeout: Duration) -> Self {
        Self {
            upstreams,
            timeout,
            sockets: None,
        }
    }

    /// The same upstreams and timeout, with the upstream sockets made by
    /// `sockets` (a pod's netns).
    pub fn in_pod(&self, sockets: Arc<dyn UpstreamSockets>) -> Self {
        Self {
            sockets: Some(sockets),
            ..self.clone()
        }
    }

    /// The `nameserver`s of the resolv.conf at `path`.
    pub fn from_resolv_conf(path: &Path, timeout: Duration) -> Result<Self, DnsError> {
        Ok(Self::new(ResolvConf::load(path)?.nameservers, timeout))
    }

    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.upstreams
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The upstream's answer to `query`, carrying `query`'s id. `tcp`:
    /// ask over TCP at once (the client asked over TCP: a UDP answer would
    /// likely have been truncated).
    pub async fn forward(&self, query: &Message, tcp: bool) -> Result<Message, ForwardError> {
        if self.upstreams.is_empty() {
            return Err(ForwardError::NoUpstream);
        }
        let deadline = Instant::now() + self.timeout;
        let mut last = ForwardError::Timeout(self.timeout);
        for (i, upstream) in self.upstreams.iter().enumerate() {
            // Each remaining upstream gets an equal share of what is left.
            let left = deadline.saturating_duration_since(Instant::now());
            let share = left / (self.upstreams.len() - i) as u32;
            let attempt = Instant::now() + share;
            let exchanged = exchange(self.sockets.as_deref(), *upstream, query, tcp);
            match timeout_at(attempt, exchanged).await {
                Ok(Ok(mut answer)) => {
                    answer.metadata.id = query.metadata.id;
                    return Ok(answer);
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = ForwardError::Timeout(self.timeout),
            }
        }
        Err(last)
    }
}

/// One upstream, UDP then (truncated) TCP.
async fn exchange(
    sockets: Option<&dyn UpstreamSockets>,
    upstream: SocketAddr,
    query: &Message,
    tcp: bool,
) -> Result<Message, ForwardError> {
    let mut ask = query.clone();
    ask.metadata.id = random_id();
    let bytes = ask.to_vec().map_err(|e| ForwardError::BadAnswer {
        upstream,
        reason: format!("cannot encode the query: {e}"),
    })?;
    if !tcp {
        let answer = exchange_udp(sockets, upstream, &ask, &bytes).await?;
        if !answer.metadata.truncation {
            return Ok(answer);
        }
    }
    exchange_tcp(sockets, upstream, &ask, &bytes).await
}

async fn exchange_udp(
    sockets: Option<&dyn UpstreamSockets>,
    upstream: SocketAddr,
    ask: &Message,
    bytes: &[u8],
) -> Result<Message, ForwardError> {
    let io_err = |source| ForwardError::Io { upstream, source };
    let local: SocketAddr = match upstream {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = match sockets {
        Some(sockets) => {
            let socket = sockets
                .udp(Domain::for_address(upstream))
                .await
                .map_err(io_err)?;
            socket.bind(&SockAddr::from(local)).map_err(io_err)?;
            UdpSocket::from_std(socket.into()).map_err(io_err)?
        }
        None => UdpSocket::bind(local).await.map_err(io_err)?,
    };
    // Connected: the kernel drops datagrams from anyone but the upstream.
    socket.connect(upstream).await.map_err(io_err)?;
    socket.send(bytes).await.map_err(io_err)?;
    let mut buf = vec![0u8; MAX_UDP_ANSWER];
    loop {
        let n = socket.recv(&mut buf).await.map_err(io_err)?;
        // Anything that is not the answer to this query (a late answer to
        // an earlier one, garbage) is ignored, and the wait goes on.
        if let Some(answer) = matching_answer(&buf[..n], ask) {
            return Ok(answer);
        }
    }
}

async fn exchange_tcp(
    sockets: Option<&dyn UpstreamSockets>,
    upstream: SocketAddr,
    ask: &Message,
    bytes: &[u8],
) -> Result<Message, ForwardError> {
    let io_err = |source| ForwardError::Io { upstream, source };
    let len = u16::try_from(bytes.len()).map_err(|_| ForwardError::BadAnswer {
        upstream,
        reason: "query too large for TCP".into(),
    })?;
    let mut stream = match sockets {
        Some(sockets) => {
            let socket = sockets
                .tcp(Domain::for_address(upstream))
                .await
                .map_err(io_err)?;
            tokio::net::TcpSocket::from_std_stream(socket.into())
                .connect(upstream)
                .await
                .map_err(io_err)?
        }
        None => TcpStream::connect(upstream).await.map_err(io_err)?,
    };
    let mut framed = Vec::with_capacity(bytes.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(bytes);
    stream.write_all(&framed).await.map_err(io_err)?;
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await.map_err(io_err)?;
    let mut answer = vec![0u8; u16::from_be_bytes(len) as usize];
    stream.read_exact(&mut answer).await.map_err(io_err)?;
    matching_answer(&answer, ask).ok_or_else(|| ForwardError::BadAnswer {
        upstream,
        reason: "the TCP answer does not answer the query".into(),
    })
}

/// `bytes` decoded, if it is a response to `ask` (same id and question).
fn matching_answer(bytes: &[u8], ask: &Message) -> Option<Message> {
    let answer = Message::from_vec(bytes).ok()?;
    (answer.metadata.message_type == MessageType::Response
        && answer.metadata.id == ask.metadata.id
        && answer.queries == ask.queries)
        .then_some(answer)
}

/// A query id an off-path attacker cannot guess (with the random source
/// port, what a stub resolver relies on).
fn random_id() -> u16 {
    use ring::rand::{SecureRandom, SystemRandom};
    let mut id = [0u8; 2];
    // The system's random source failing leaves a zero id: the source port
    // is still random.
    let _ = SystemRandom::new().fill(&mut id);
    u16::from_be_bytes(id)
}
