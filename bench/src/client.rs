//! The load generator, run as a process in the client pod's netns and in the
//! apps cgroup (so the agent's connect hooks see its sockets). It runs one
//! workload against one address, checks every byte that comes back, measures
//! the machine's CPU over exactly its load window, samples kernel TCP memory,
//! and prints one JSON line ([`ClientReport`]).
//!
//! One thread (tokio current-thread runtime), the same on every path.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

mod cost;

pub use cost::Cost;
use cost::{
    TcpMemSampler, Watch, agents_context_switches, agents_rss_kib, context_switches_between,
};

use crate::{
    pattern::{Pattern, request_offset},
    sys,
};

/// No workload may run more than this many transactions (a bound besides
/// the deadline).
const MAX_TXNS: u64 = 100_000_000;
/// Bulk stream write size.
const STREAM_CHUNK: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Request/response on one persistent connection, one in flight.
    Rr,
    /// A new connection per request: connect, request, response, close.
    Crr,
    /// Bulk stream towards the sink port.
    Stream,
    /// Fixed request rate over several persistent connections (open loop).
    Rate,
    /// `conns` connections, one exchange each, then all held idle: the
    /// agents' memory per idle connection.
    Idle,
}

#[derive(Clone, Debug)]
pub struct ClientArgs {
    pub workload: WorkloadKind,
    pub addr: SocketAddr,
    pub seconds: f64,
    pub warmup: f64,
    pub size: usize,
    pub conns: usize,
    pub rate: f64,
    /// Pin this process to these CPUs (None: leave the affinity alone).
    pub cpus: Option<Vec<usize>>,
    /// The cgroup of the load generator and servers (its CPU is measured).
    pub apps_cgroup: Option<PathBuf>,
    /// The cgroup holding the path's agents.
    pub agents_cgroup: Option<PathBuf>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub ok: bool,
    pub error: Option<String>,
    pub workload: Option<WorkloadKind>,
    /// Transactions (requests answered, connections completed, or for the
    /// stream the bytes acknowledged).
    pub txns: u64,
    pub connections: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Every byte that came back (or that the sink saw) matched.
    pub intact: bool,
    /// Length of the measured window, seconds.
    pub elapsed: f64,
    /// The rate asked for (fixed-rate workload only).
    pub target_rate: Option<f64>,
    /// Latency histogram in nanoseconds: (value, count) of each non-empty
    /// bucket, so runs can be pooled.
    pub histogram: Vec<(u64, u64)>,
    pub cost: Cost,
    /// Kernel TCP memory (pages) when the load started, and the highest seen
    /// while it ran.
    pub tcp_mem_base_pages: u64,
    pub tcp_mem_peak_pages: u64,
    /// Idle workload: the agents' summed VmRSS (KiB) before the
    /// connections were opened, and while they were all held open.
    #[serde(default)]
    pub agents_rss_before_kib: u64,
    #[serde(default)]
    pub agents_rss_held_kib: u64,
    /// Idle workload: the agents' context switches (all threads, both
    /// agents) counted over `agents_wakeups_window_s` while the connections
    /// were held idle — how often the agents woke with nothing to do.
    #[serde(default)]
    pub agents_wakeups: u64,
    #[serde(default)]
    pub agents_wakeups_window_s: f64,
}

pub fn new_histogram() -> Histogram<u64> {
    // 1 ns .. 100 s, 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// What a workload measured.
struct Measured {
    txns: u64,
    connections: u64,
    bytes_sent: u64,
    bytes_received: u64,
    intact: bool,
    elapsed: Duration,
    histogram: Option<Histogram<u64>>,
    cost: Cost,
    /// Idle workload: agents' RSS before and while held (KiB).
    agents_rss_kib: Option<(u64, u64)>,
    /// Idle workload: agents' context switches while held, and over how
    /// long they were counted.
    agents_wakeups: Option<(u64, Duration)>,
}

/// Runs the workload and returns the report (errors become `ok: false`).
pub fn run(args: ClientArgs) -> ClientReport {
    if let Some(cpus) = &args.cpus
        && let Err(e) = sys::set_affinity(0, cpus)
    {
        return ClientReport {
            error: Some(format!("cannot set CPU affinity {cpus:?}: {e}")),
            ..Default::default()
        };
    }
    let tcp_base = sys::tcp_mem_pages().unwrap_or(0);
    let sampler = TcpMemSampler::start();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return ClientReport {
                error: Some(format!("tokio runtime: {e}")),
                ..Default::default()
            };
        }
    };
    // Whatever happens, the run ends: the workload's own deadline plus a
    // generous margin for connecting and draining.
    let bound = Duration::from_secs_f64(args.seconds + args.warmup + 30.0);
    let result = runtime.block_on(async {
        match tokio::time::timeout(bound, workload(&args)).await {
            Ok(result) => result,
            Err(_) => bail!("the workload did not finish within {bound:?}"),
        }
    });
    let tcp_peak = sampler.finish();
    let mut report = ClientReport {
        workload: Some(args.workload),
        tcp_mem_base_pages: tcp_base,
        tcp_mem_peak_pages: tcp_peak.max(tcp_base),
        target_rate: (args.workload == WorkloadKind::Rate).then_some(args.rate),
        ..Default::default()
    };
    match result {
        Ok(m) => {
            report.ok = m.intact && m.txns > 0;
            if !m.intact {
                report.error = Some("the bytes that came back differ from those sent".into());
            } else if m.txns == 0 {
                report.error = Some("no transaction completed".into());
            }
            report.txns = m.txns;
            report.connections = m.connections;
            report.bytes_sent = m.bytes_sent;
            report.bytes_received = m.bytes_received;
            report.intact = m.intact;
            report.elapsed = m.elapsed.as_secs_f64();
            report.histogram = m
                .histogram
                .map(|h| {
                    h.iter_recorded()
                        .map(|v| (v.value_iterated_to(), v.count_at_value()))
                        .collect()
                })
                .unwrap_or_default();
            report.cost = m.cost;
            if let Some((before, held)) = m.agents_rss_kib {
                report.agents_rss_before_kib = before;
                report.agents_rss_held_kib = held;
            }
            if let Some((wakeups, window)) = m.agents_wakeups {
                report.agents_wakeups = wakeups;
                report.agents_wakeups_window_s = window.as_secs_f64();
            }
        }
        Err(e) => report.error = Some(format!("{e:#}")),
    }
    report
}

async fn workload(args: &ClientArgs) -> anyhow::Result<Measured> {
    match args.workload {
        WorkloadKind::Rr => request_response(args).await,
        WorkloadKind::Crr => connect_request_response(args).await,
        WorkloadKind::Stream => stream(args).await,
        WorkloadKind::Rate => fixed_rate(args).await,
        WorkloadKind::Idle => idle(args).await,
    }
}

async fn connect(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// One request of `size` bytes (pattern offset from `k`), its echo read and
/// checked. Returns false if the echo differs.
async fn exchange(
    stream: &mut TcpStream,
    pattern: &Pattern,
    k: u64,
    size: usize,
    buf: &mut [u8],
) -> anyhow::Result<bool> {
    let request = pattern.at(request_offset(k), size);
    stream
        .write_all(request)
        .await
        .context("sending a request")?;
    stream
        .read_exact(&mut buf[..size])
        .await
        .context("reading a response")?;
    Ok(&buf[..size] == request)
}

async fn request_response(args: &ClientArgs) -> anyhow::Result<Measured> {
    let pattern = Pattern::new();
    let size = args.size.clamp(1, crate::pattern::MAX_SLICE);
    let mut buf = vec![0u8; size];
    let mut stream = connect(args.addr).await?;
    let mut k = 0u64;
    let warm_end = Instant::now() + Duration::from_secs_f64(args.warmup);
    while Instant::now() < warm_end && k < MAX_TXNS {
        if !exchange(&mut stream, &pattern, k, size, &mut buf).await? {
            bail!("echo differs during warm-up");
        }
        k += 1;
    }
    let mut hist = new_histogram();
    let mut intact = true;
    let mut txns = 0u64;
    let watch = Watch::new(args);
    let before = watch.snapshot();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut now = start;
    while now < end && txns < MAX_TXNS {
        let ok = exchange(&mut stream, &pattern, k, size, &mut buf).await?;
        let done = Instant::now();
        let _ = hist.record((done - now).as_nanos() as u64);
        now = done;
        k += 1;
        txns += 1;
        if !ok {
            intact = false;
            break;
        }
    }
    let elapsed = start.elapsed();
    let after = watch.snapshot();
    Ok(Measured {
        txns,
        connections: 1,
        bytes_sent: k * size as u64,
        bytes_received: k * size as u64,
        intact,
        elapsed,
        histogram: Some(hist),
        cost: after.cost_since(&before),
        agents_rss_kib: None,
        agents_wakeups: None,
    })
}

/// connect, request, response, half-close, wait for the server's close.
async fn one_connection(
    addr: SocketAddr,
    pattern: &Pattern,
    k: u64,
    size: usize,
    buf: &mut [u8],
) -> anyhow::Result<bool> {
    let mut stream = connect(addr).await?;
    let ok = exchange(&mut stream, pattern, k, size, buf).await?;
    stream.shutdown().await.context("half-closing")?;
    let mut rest = [0u8; 1];
    let n = stream
        .read(&mut rest)
        .await
        .context("waiting for the server to close")?;
    Ok(ok && n == 0)
}

async fn connect_request_response(args: &ClientArgs) -> anyhow::Result<Measured> {
    let pattern = Pattern::new();
    let size = args.size.clamp(1, crate::pattern::MAX_SLICE);
    let mut buf = vec![0u8; size];
    let mut k = 0u64;
    let warm_end = Instant::now() + Duration::from_secs_f64(args.warmup);
    while Instant::now() < warm_end && k < MAX_TXNS {
        if !one_connection(args.addr, &pattern, k, size, &mut buf).await? {
            bail!("echo differs during warm-up");
        }
        k += 1;
    }
    let mut hist = new_histogram();
    let mut intact = true;
    let mut txns = 0u64;
    let watch = Watch::new(args);
    let before = watch.snapshot();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut now = start;
    while now < end && txns < MAX_TXNS {
        let ok = one_connection(args.addr, &pattern, k, size, &mut buf)
            .await
            .with_context(|| format!("connection {txns} of the run"))?;
        let done = Instant::now();
        let _ = hist.record((done - now).as_nanos() as u64);
        now = done;
        k += 1;
        txns += 1;
        if !ok {
            intact = false;
            break;
        }
    }
    let elapsed = start.elapsed();
    let after = watch.snapshot();
    Ok(Measured {
        txns,
        connections: k,
        bytes_sent: k * size as u64,
        bytes_received: k * size as u64,
        intact,
        elapsed,
        histogram: Some(hist),
        cost: after.cost_since(&before),
        agents_rss_kib: None,
        agents_wakeups: None,
    })
}

/// Opens `conns` connections one after another, one checked exchange of
/// `size` bytes on each (so each reached the server through the proxies),
/// holds them all open and idle for `seconds` — counting the agents'
/// wake-ups over the hold after its first fifth (at most 1 s, for the
/// agents to settle) —, reads the agents' memory, then closes them in
/// order (half-close, wait for the server's close).
async fn idle(args: &ClientArgs) -> anyhow::Result<Measured> {
    let pattern = Pattern::new();
    let size = args.size.clamp(1, crate::pattern::MAX_SLICE);
    let mut buf = vec![0u8; size];
    let rss_before = agents_rss_kib(args.agents_cgroup.as_deref())?;
    let mut hist = new_histogram();
    let mut intact = true;
    let watch = Watch::new(args);
    let before = watch.snapshot();
    let start = Instant::now();
    let mut open = Vec::with_capacity(args.conns);
    for k in 0..args.conns as u64 {
        let began = Instant::now();
        let mut stream = connect(args.addr)
            .await
            .with_context(|| format!("opening idle connection {k}"))?;
        intact &= exchange(&mut stream, &pattern, k, size, &mut buf).await?;
        let _ = hist.record(began.elapsed().as_nanos() as u64);
        open.push(stream);
    }
    // The workload's duration is how long they stay idle.
    let hold = Duration::from_secs_f64(args.seconds);
    let settle = (hold / 5).min(Duration::from_secs(1));
    tokio::time::sleep(settle).await;
    let switches_before = agents_context_switches(args.agents_cgroup.as_deref())?;
    let counted_from = Instant::now();
    tokio::time::sleep(hold - settle).await;
    let switches_after = agents_context_switches(args.agents_cgroup.as_deref())?;
    let window = counted_from.elapsed();
    let wakeups = context_switches_between(&switches_before, &switches_after);
    let rss_held = agents_rss_kib(args.agents_cgroup.as_deref())?;
    let elapsed = start.elapsed();
    let after = watch.snapshot();
    for stream in &mut open {
        stream.shutdown().await.context("half-closing")?;
    }
    for stream in &mut open {
        let mut rest = [0u8; 1];
        let n = stream
            .read(&mut rest)
            .await
            .context("waiting for the server to close")?;
        intact &= n == 0;
    }
    let n = open.len() as u64;
    Ok(Measured {
        txns: n,
        connections: n,
        bytes_sent: n * size as u64,
        bytes_received: n * size as u64,
        intact,
        elapsed,
        histogram: Some(hist),
        cost: after.cost_since(&before),
        agents_rss_kib: Some((rss_before, rss_held)),
        agents_wakeups: Some((wakeups, window)),
    })
}

async fn stream(args: &ClientArgs) -> anyhow::Result<Measured> {
    let pattern = Pattern::new();
    let mut stream = connect(args.addr).await?;
    let watch = Watch::new(args);
    let before = watch.snapshot();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut sent = 0u64;
    // Bounded by the deadline and by a byte count no run can reach.
    while Instant::now() < end && sent < (1u64 << 46) {
        let n = stream
            .write(pattern.at(sent, STREAM_CHUNK))
            .await
            .with_context(|| format!("writing after {sent} bytes"))?;
        if n == 0 {
            bail!("write returned 0 after {sent} bytes");
        }
        sent += n as u64;
    }
    stream.shutdown().await.context("half-closing the stream")?;
    let mut reply = [0u8; 9];
    stream
        .read_exact(&mut reply)
        .await
        .context("reading the sink's count")?;
    let elapsed = start.elapsed();
    let after = watch.snapshot();
    let mut count = [0u8; 8];
    count.copy_from_slice(&reply[..8]);
    let received = u64::from_le_bytes(count);
    let intact = received == sent && reply[8] == 1;
    Ok(Measured {
        txns: received,
        connections: 1,
        bytes_sent: sent,
        // What came back: the sink's 9-byte answer.
        bytes_received: reply.len() as u64,
        intact,
        elapsed,
        histogram: None,
        cost: after.cost_since(&before),
        agents_rss_kib: None,
        agents_wakeups: None,
    })
}

async fn fixed_rate(args: &ClientArgs) -> anyhow::Result<Measured> {
    let conns = args.conns.max(1);
    let rate = if args.rate > 0.0 { args.rate } else { 1000.0 };
    let size = args.size.clamp(1, crate::pattern::MAX_SLICE);
    let period = Duration::from_secs_f64(conns as f64 / rate);
    let mut streams = Vec::with_capacity(conns);
    for _ in 0..conns {
        streams.push(connect(args.addr).await?);
    }
    // Warm every connection with a few exchanges.
    let pattern = Arc::new(Pattern::new());
    let mut buf = vec![0u8; size];
    for (i, stream) in streams.iter_mut().enumerate() {
        for j in 0..3u64 {
            if !exchange(stream, &pattern, (i as u64) << 32 | j, size, &mut buf).await? {
                bail!("echo differs during warm-up");
            }
        }
    }
    let watch = Watch::new(args);
    let before = watch.snapshot();
    let start = tokio::time::Instant::now() + Duration::from_millis(5);
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::with_capacity(conns);
    for (i, mut stream) in streams.into_iter().enumerate() {
        let pattern = pattern.clone();
        // Connections take turns: connection i sends at start + i/rate + n·period.
        let first = start + Duration::from_secs_f64(i as f64 / rate);
        tasks.push(tokio::spawn(async move {
            let mut hist = new_histogram();
            let mut buf = vec![0u8; size];
            let mut next = first;
            let mut k = 0u64;
            let mut intact = true;
            let period_ns = period.as_nanos() as u64;
            while next < end && k < MAX_TXNS {
                tokio::time::sleep_until(next).await;
                let sent_at = Instant::now();
                let ok = exchange(
                    &mut stream,
                    &pattern,
                    (i as u64) << 32 | (k + 3),
                    size,
                    &mut buf,
                )
                .await?;
                let latency = sent_at.elapsed().as_nanos() as u64;
                // Open loop: a response slower than the send interval held up
                // the requests behind it; record those as the load would
                // have seen them (HdrHistogram's coordinated-omission fix).
                let _ = hist.record_correct(latency, period_ns);
                k += 1;
                if !ok {
                    intact = false;
                    break;
                }
                next += period;
            }
            anyhow::Ok((k, intact, hist))
        }));
    }
    let mut hist = new_histogram();
    let mut txns = 0u64;
    let mut intact = true;
    for task in tasks {
        let (k, ok, h) = task.await.context("a connection task panicked")??;
        txns += k;
        intact &= ok;
        let _ = hist.add(&h);
    }
    let elapsed = start.elapsed();
    let after = watch.snapshot();
    let bytes = (txns + 3 * conns as u64) * size as u64;
    Ok(Measured {
        txns,
        connections: conns as u64,
        bytes_sent: bytes,
        bytes_received: bytes,
        intact,
        elapsed,
        histogram: Some(hist),
        cost: after.cost_since(&before),
        agents_rss_kib: None,
        agents_wakeups: None,
    })
}
