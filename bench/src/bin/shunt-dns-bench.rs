//! What the DNS proxy's server answers per second, and its tail latency,
//! for a mesh name (answered from `MeshNames`) and for a forwarded name
//! (through an in-process upstream on another loopback port). The server is
//! `shunt::dns::serve` on 127.0.0.1, as a pod's would be in its netns; no
//! kernel, no root:
//!
//! `cargo run --release -p shunt-bench --bin shunt-dns-bench [-- --clients 8 --seconds 2]`
//!
//! Each client asks over UDP, one query at a time, for `--seconds` per
//! name. Prints queries/s and p50/p99 latency per name. On a loaded machine
//! the numbers say little: run it on a quiet one.

use std::{
    net::{Ipv4Addr, SocketAddr},
    str::FromStr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use hickory_proto::{
    op::{Message, OpCode, Query},
    rr::{Name, RData, Record, RecordType, rdata::A},
};
use shunt::dns::{DnsMetrics, DnsSockets, Forwarder, MeshNames, PodDns, names_channel, serve};
use tokio::net::UdpSocket;

#[derive(Parser)]
struct Args {
    /// Clients asking at once.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Time spent on each name.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let upstream = start_upstream().await?;
    let (publish, names) = names_channel("cluster.local");
    let mut mesh = MeshNames::new("cluster.local");
    mesh.insert_service(
        "web.default.svc.cluster.local",
        "default",
        vec!["198.18.10.1".parse()?],
    );
    publish.send_replace(Arc::new(mesh));
    let server = serve(
        DnsSockets::bind(&["127.0.0.1:0".parse()?])?,
        PodDns::kubernetes("default", "cluster.local"),
        names,
        Arc::new(Forwarder::new(vec![upstream], Duration::from_secs(5))),
        Arc::new(DnsMetrics::default()),
    )?;
    let addr = server.udp_addrs()[0];
    println!("name                             queries/s      p50 µs      p99 µs");
    for (label, name) in [
        (
            "mesh (web.default.svc...)",
            "web.default.svc.cluster.local.",
        ),
        ("forwarded (ext.example.org)", "ext.example.org."),
    ] {
        let (count, histogram, took) = run(addr, name, &args).await?;
        println!(
            "{label:<30} {:>11.0} {:>11} {:>11}",
            count as f64 / took.as_secs_f64(),
            histogram.value_at_quantile(0.5),
            histogram.value_at_quantile(0.99),
        );
    }
    server.shutdown().await;
    Ok(())
}

/// `args.clients` clients ask for `name` until the time is up.
async fn run(
    addr: SocketAddr,
    name: &str,
    args: &Args,
) -> anyhow::Result<(u64, Histogram<u64>, Duration)> {
    let until = Instant::now() + Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..args.clients {
        let name = name.to_string();
        clients.spawn(async move { client(addr, &name, until).await });
    }
    let mut total = Histogram::<u64>::new(3)?;
    let mut count = 0;
    while let Some(done) = clients.join_next().await {
        let (n, histogram) = done??;
        count += n;
        total.add(histogram)?;
    }
    Ok((count, total, started.elapsed()))
}

async fn client(
    addr: SocketAddr,
    name: &str,
    until: Instant,
) -> anyhow::Result<(u64, Histogram<u64>)> {
    let socket = UdpSocket::bind("127.0.0.1:0").await?;
    socket.connect(addr).await?;
    let mut query = Message::query();
    query.add_query(Query::query(Name::from_str(name)?, RecordType::A));
    let mut histogram = Histogram::<u64>::new(3)?;
    let mut buf = vec![0u8; 4096];
    let mut count = 0;
    while Instant::now() < until {
        query.metadata.id = query.metadata.id.wrapping_add(1);
        let bytes = query.to_vec()?;
        let sent = Instant::now();
        socket.send(&bytes).await?;
        loop {
            let n = tokio::time::timeout(Duration::from_secs(10), socket.recv(&mut buf))
                .await
                .context("no answer within 10 s")??;
            if Message::from_vec(&buf[..n])?.metadata.id == query.metadata.id {
                break;
            }
        }
        histogram.record(sent.elapsed().as_micros() as u64)?;
        count += 1;
    }
    Ok((count, histogram))
}

/// Answers every A query with one record.
async fn start_upstream() -> anyhow::Result<SocketAddr> {
    let socket = UdpSocket::bind("127.0.0.1:0").await?;
    let addr = socket.local_addr()?;
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65535];
        while let Ok((n, client)) = socket.recv_from(&mut buf).await {
            let Ok(query) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut answer = Message::response(query.metadata.id, OpCode::Query);
            answer.add_queries(query.queries.iter().cloned());
            if let Some(q) = query.queries.first() {
                answer.add_answer(Record::from_rdata(
                    q.name().clone(),
                    60,
                    RData::A(A(Ipv4Addr::new(198, 18, 0, 77))),
                ));
            }
            if let Ok(bytes) = answer.to_vec() {
                let _ = socket.send_to(&bytes, client).await;
            }
        }
    });
    Ok(addr)
}
