//! The probes a comparison row runs from a client pod against the server
//! workload, and what a user would see of each: the bytes echoed back
//! (allowed) or not (refused, and how).

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    time::Duration,
};

use bytes::Bytes;

use super::pki::Pki;
use crate::{Pod, hbone};

/// Who calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// HBONE (mutual TLS) with the identity of this namespace and service
    /// account.
    Mesh {
        namespace: &'static str,
        service_account: &'static str,
    },
    /// Plain TCP, no identity.
    Plaintext,
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Caller::Mesh {
                namespace,
                service_account,
            } => write!(f, "{namespace}/{service_account}"),
            Caller::Plaintext => f.write_str("plaintext"),
        }
    }
}

/// What a probe saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The server's bytes came back.
    Allowed,
    /// No echo: refused at CONNECT, reset, closed or timed out.
    Refused,
}

/// An outcome and what was seen.
#[derive(Clone, Debug)]
pub struct Observed {
    pub outcome: Outcome,
    pub detail: String,
    /// The `baggage` of the 200 an HBONE probe got (the server's proxy
    /// naming the server workload), if any.
    pub answer_baggage: Option<String>,
}

impl Observed {
    fn refused(detail: impl Into<String>) -> Self {
        Observed {
            outcome: Outcome::Refused,
            detail: detail.into(),
            answer_baggage: None,
        }
    }

    fn allowed(detail: impl Into<String>) -> Self {
        Observed {
            outcome: Outcome::Allowed,
            detail: detail.into(),
            answer_baggage: None,
        }
    }
}

/// Asks 127.0.0.1:15053 in `client`'s netns for `name`'s A records: the
/// addresses answered (empty: none), or what went wrong.
pub fn dns_a(client: &Pod, name: &str) -> std::result::Result<Vec<std::net::Ipv4Addr>, String> {
    let name = name.to_string();
    client
        .run(
            move || -> std::result::Result<Vec<std::net::Ipv4Addr>, String> {
                let socket = std::net::UdpSocket::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
                socket
                    .set_read_timeout(Some(STEP))
                    .map_err(|e| e.to_string())?;
                let query = crate::dns::query(4242, &name, hickory_proto::rr::RecordType::A)?
                    .to_vec()
                    .map_err(|e| e.to_string())?;
                socket
                    .send_to(&query, "127.0.0.1:15053")
                    .map_err(|e| format!("send: {e}"))?;
                let mut buf = [0u8; 4096];
                let n = socket
                    .recv(&mut buf)
                    .map_err(|e| format!("no answer: {e}"))?;
                let answer = hickory_proto::op::Message::from_vec(&buf[..n])
                    .map_err(|e| format!("malformed answer: {e}"))?;
                Ok(answer
                    .answers
                    .iter()
                    .filter_map(|r| match &r.data {
                        hickory_proto::rr::RData::A(a) => Some(a.0),
                        _ => None,
                    })
                    .collect())
            },
        )
        .map_err(|e| e.to_string())?
}

const PAYLOAD: &[u8] = b"reference probe\n";
const STEP: Duration = Duration::from_secs(10);

/// `caller` connects from `client` to `server`:`port` (HBONE to the
/// server's 15008 expecting the server identity `server_sa` of namespace
/// `default`, its CONNECT naming `host:port` when `host` is given; or
/// plain TCP), sends a line and waits for its echo.
pub async fn probe(
    pki: &Pki,
    client: &Pod,
    server: &Pod,
    server_sa: &str,
    caller: Caller,
    host: Option<&str>,
    port: u16,
) -> Observed {
    let target = SocketAddr::from((server.ip(), port));
    let authority = match host {
        Some(host) => format!("{host}:{port}"),
        None => target.to_string(),
    };
    match caller {
        Caller::Plaintext => {
            let client = client.clone();
            tokio::task::spawn_blocking(move || plaintext(&client, target))
                .await
                .unwrap_or_else(|e| Observed::refused(format!("probe task: {e}")))
        }
        Caller::Mesh {
            namespace,
            service_account,
        } => match mesh(
            pki,
            client,
            server,
            server_sa,
            namespace,
            service_account,
            &authority,
        )
        .await
        {
            Ok(observed) => observed,
            Err(detail) => Observed::refused(detail),
        },
    }
}

fn plaintext(client: &Pod, target: SocketAddr) -> Observed {
    let mut stream = match client.connect_tcp(target, STEP) {
        Ok(s) => s,
        Err(e) => return Observed::refused(format!("connect: {e}")),
    };
    let _ = stream.set_read_timeout(Some(STEP));
    if let Err(e) = stream.write_all(PAYLOAD) {
        return Observed::refused(format!("write: {e}"));
    }
    let mut got = vec![0u8; PAYLOAD.len()];
    match stream.read_exact(&mut got) {
        Ok(()) if got == PAYLOAD => Observed::allowed("echoed"),
        Ok(()) => Observed::refused(format!("wrong bytes {got:?}")),
        Err(e) => Observed::refused(format!("read: {e}")),
    }
}

async fn mesh(
    pki: &Pki,
    client: &Pod,
    server: &Pod,
    server_sa: &str,
    namespace: &str,
    service_account: &str,
    authority: &str,
) -> Result<Observed, String> {
    let creds = pki
        .credentials(namespace, service_account)
        .map_err(|e| format!("probe certificate: {e}"))?;
    let server_id = pki
        .credentials("default", server_sa)
        .map_err(|e| e.to_string())?
        .identity()
        .clone();
    let tcp = client
        .connect_tcp(SocketAddr::from((server.ip(), 15008)), STEP)
        .map_err(|e| format!("connect 15008: {e}"))?;
    tcp.set_nonblocking(true).map_err(|e| e.to_string())?;
    let tcp = tokio::net::TcpStream::from_std(tcp).map_err(|e| e.to_string())?;
    let (mut send, mut recv, answer) =
        hbone::connect_answered(tcp, &creds.cert, &creds.roots, &server_id, authority, &[]).await?;
    let answer_baggage = answer
        .get("baggage")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    send.send_data(Bytes::from_static(PAYLOAD), false)
        .map_err(|e| format!("send: {e}"))?;
    let mut got = Vec::new();
    let read = async {
        while got.len() < PAYLOAD.len() {
            match recv.data().await {
                Some(Ok(chunk)) => {
                    let _ = recv.flow_control().release_capacity(chunk.len());
                    got.extend_from_slice(&chunk);
                }
                Some(Err(e)) => return Err(format!("stream: {e}")),
                None => return Err("stream ended before the echo".to_string()),
            }
        }
        Ok(())
    };
    tokio::time::timeout(STEP, read)
        .await
        .map_err(|_| "no echo in time".to_string())??;
    if got == PAYLOAD {
        Ok(Observed {
            answer_baggage,
            ..Observed::allowed("echoed")
        })
    } else {
        Ok(Observed::refused(format!("wrong bytes {got:?}")))
    }
}
