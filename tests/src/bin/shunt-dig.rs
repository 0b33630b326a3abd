//! A DNS client for kernel tests, run as a pod's application (inside its
//! netns and a cgroup below the agent's cgroup root, so the socket programs
//! see it): asks one server one question, as a stub resolver does, and
//! prints one JSON line with the answer and where it came from.
//!
//! `shunt-dig SERVER:PORT NAME [--aaaa] [--tcp] [--connected] [--timeout-ms T]`
//!
//! - UDP by default, unconnected (`sendto`/`recvfrom`, as musl does);
//!   `--connected` connects the UDP socket first (as glibc does) and still
//!   reads the sender's address (`recvfrom`); `--tcp` asks over TCP.
//! - A truncated UDP answer (TC) is asked again over TCP, as resolvers do
//!   (`"transport":"tcp"` then).
//! - Output: `{"ok":true,"rcode":"NoError","answers":["198.19.100.1"],
//!   "from":"198.18.1.9:53","transport":"udp","truncated_udp":false}`;
//!   `from` is the sender of the UDP answer as the socket reported it (a
//!   resolver drops answers from any other address than the one it asked),
//!   or the TCP peer. Exit 1 with `"ok":false` and the error on a timeout
//!   or a malformed answer.

use std::{
    net::{SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use hickory_proto::{
    op::Message,
    rr::{RData, RecordType},
};
use shunt_testbed::dns::{query, read_framed, write_framed};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(json) => println!("{json}"),
        Err(error) => {
            println!("{}", serde_json::json!({"ok": false, "error": error}));
            std::process::exit(1);
        }
    }
}

fn run(args: &[String]) -> Result<serde_json::Value, String> {
    let server: SocketAddr = args
        .first()
        .ok_or("usage: shunt-dig SERVER:PORT NAME [--aaaa] [--tcp] [--connected] [--timeout-ms T]")?
        .parse()
        .map_err(|e| format!("bad server address: {e}"))?;
    let name = args.get(1).ok_or("missing name")?;
    let flag = |f: &str| args.iter().any(|a| a == f);
    let timeout = args
        .iter()
        .position(|a| a == "--timeout-ms")
        .and_then(|i| args.get(i + 1))
        .map(|t| t.parse::<u64>().map_err(|e| format!("bad timeout: {e}")))
        .transpose()?
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(10));
    let kind = if flag("--aaaa") {
        RecordType::AAAA
    } else {
        RecordType::A
    };
    let id = (std::process::id() & 0xffff) as u16;
    let question = query(id, name, kind)?
        .to_vec()
        .map_err(|e| format!("encoding the query: {e}"))?;

    let (answer, from, transport, truncated_udp) = if flag("--tcp") {
        let (answer, peer) = ask_tcp(server, &question, timeout)?;
        (answer, peer, "tcp", false)
    } else {
        let (answer, from) = ask_udp(server, &question, timeout, flag("--connected"))?;
        if answer.metadata.truncation {
            let (answer, peer) = ask_tcp(server, &question, timeout)?;
            (answer, peer, "tcp", true)
        } else {
            (answer, from, "udp", false)
        }
    };
    if answer.metadata.id != id {
        return Err(format!(
            "answer id {} is not the query's {id}",
            answer.metadata.id
        ));
    }
    let answers: Vec<String> = answer
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0.to_string()),
            RData::AAAA(a) => Some(a.0.to_string()),
            _ => None,
        })
        .collect();
    Ok(serde_json::json!({
        "ok": true,
        "rcode": format!("{:?}", answer.metadata.response_code),
        "answers": answers,
        "from": from.to_string(),
        "transport": transport,
        "truncated_udp": truncated_udp,
    }))
}

fn ask_udp(
    server: SocketAddr,
    question: &[u8],
    timeout: Duration,
    connected: bool,
) -> Result<(Message, SocketAddr), String> {
    let local: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().map_err(|_| "local address")?
    } else {
        "[::]:0".parse().map_err(|_| "local address")?
    };
    let socket = UdpSocket::bind(local).map_err(|e| format!("bind: {e}"))?;
    socket
        .set_read_timeout(Some(timeout))
        .map_err(|e| format!("timeout: {e}"))?;
    if connected {
        socket
            .connect(server)
            .map_err(|e| format!("connect {server}: {e}"))?;
        socket.send(question).map_err(|e| format!("send: {e}"))?;
    } else {
        socket
            .send_to(question, server)
            .map_err(|e| format!("sendto {server}: {e}"))?;
    }
    let mut buf = vec![0u8; 65535];
    let (n, from) = socket
        .recv_from(&mut buf)
        .map_err(|e| format!("no UDP answer from {server}: {e}"))?;
    let answer = Message::from_vec(&buf[..n]).map_err(|e| format!("malformed answer: {e}"))?;
    Ok((answer, from))
}

fn ask_tcp(
    server: SocketAddr,
    question: &[u8],
    timeout: Duration,
) -> Result<(Message, SocketAddr), String> {
    let mut stream = TcpStream::connect_timeout(&server, timeout)
        .map_err(|e| format!("TCP connect {server}: {e}"))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| format!("timeout: {e}"))?;
    let peer = stream.peer_addr().map_err(|e| format!("peer: {e}"))?;
    write_framed(&mut stream, question).map_err(|e| format!("TCP send: {e}"))?;
    let bytes = read_framed(&mut stream).ok_or_else(|| format!("no TCP answer from {server}"))?;
    let answer = Message::from_vec(&bytes).map_err(|e| format!("malformed answer: {e}"))?;
    Ok((answer, peer))
}
