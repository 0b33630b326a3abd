//! The demo's traffic: an echo server in each destination pod and one
//! client thread per flow, each connection's echo checked byte for byte,
//! totals kept per flow.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use shunt_testbed::Pod;

use super::{CLIENT, OUTSIDER, Pods, SERVER};

const ECHO_PORT: u16 = 8080;
/// One new connection per flow this often.
pub(super) const CONNECT_EVERY: Duration = Duration::from_millis(100);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Read/write timeout of every traffic socket, so no thread blocks for long.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes an echo handler serves on one connection before hanging up.
const MAX_ECHO_BYTES: usize = 1 << 20;
/// Concurrent connections an echo server handles; more are refused.
const MAX_HANDLERS: usize = 16;
/// Traffic threads stop at the latest this long after the requested duration.
const TRAFFIC_GRACE: Duration = Duration::from_secs(5);

pub(super) struct FlowSpec {
    pub(super) name: String,
    pub(super) kind: &'static str,
    from: Pod,
    to: SocketAddr,
}

pub(super) fn flow_specs(pods: &Pods) -> Vec<FlowSpec> {
    let to = |pod: &Pod| SocketAddr::from((pod.ip(), ECHO_PORT));
    vec![
        FlowSpec {
            name: format!("{CLIENT} -> {SERVER}"),
            kind: "mesh -> mesh: connect4 -> proxy :15001 -> HBONE (mTLS, HTTP/2 CONNECT) -> :15008 -> app",
            from: pods.client.clone(),
            to: to(&pods.server),
        },
        FlowSpec {
            name: format!("{OUTSIDER} -> {SERVER}"),
            kind: "outside the mesh -> mesh: TC sk_assign -> proxy :15006 -> app",
            from: pods.outsider.clone(),
            to: to(&pods.server),
        },
        FlowSpec {
            name: format!("{CLIENT} -> {OUTSIDER}"),
            kind: "mesh -> outside the mesh: connect4 -> proxy :15001 -> plain TCP from the pod's IP",
            from: pods.client.clone(),
            to: to(&pods.outsider),
        },
    ]
}

/// Totals of one flow, updated by its thread.
#[derive(Default)]
pub(super) struct FlowStats {
    pub(super) name: String,
    pub(super) ok: AtomicU64,
    pub(super) failed: AtomicU64,
    /// Echoes that came back different from what was sent.
    pub(super) wrong: AtomicU64,
    pub(super) bytes: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl FlowStats {
    pub(super) fn line(&self) -> String {
        let mut line = format!(
            "  {:<20} {:>4} ok  {:>3} failed  {:>3} wrong  {:>7.1} KiB echoed",
            self.name,
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.wrong.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed) as f64 / 1024.0
        );
        if let Some(e) = self.last_error.lock().ok().and_then(|e| e.clone()) {
            line.push_str(&format!("  (last error: {e})"));
        }
        line
    }

    fn fail(&self, error: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(error);
        }
    }
}

pub(super) struct Traffic {
    stop: Arc<AtomicBool>,
    servers: Vec<JoinHandle<()>>,
    clients: Vec<JoinHandle<()>>,
    pub(super) flows: Vec<Arc<FlowStats>>,
}

impl Traffic {
    /// Echo servers in `server` and `outsider`, then one client thread per flow.
    pub(super) fn start(pods: &Pods, duration: Duration) -> anyhow::Result<Traffic> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut traffic = Traffic {
            stop: stop.clone(),
            servers: Vec::new(),
            clients: Vec::new(),
            flows: Vec::new(),
        };
        // On an error below, whatever started is stopped before returning.
        let result = (|| -> anyhow::Result<()> {
            for pod in [&pods.server, &pods.outsider] {
                let addr = SocketAddr::from((pod.ip(), ECHO_PORT));
                let listener = pod
                    .listen_tcp(addr)
                    .with_context(|| format!("echo server in {}", pod.name()))?;
                listener
                    .set_nonblocking(true)
                    .context("making the echo listener non-blocking")?;
                let stop = stop.clone();
                let handle = thread::Builder::new()
                    .name(format!("echo-{}", pod.name()))
                    .spawn(move || echo_server(listener, &stop))
                    .context("cannot start an echo server thread")?;
                traffic.servers.push(handle);
            }
            // Hard bound on the client loops, even if nobody sets `stop`.
            let deadline = Instant::now() + duration + TRAFFIC_GRACE;
            let max_conns = (duration + TRAFFIC_GRACE).as_millis() / CONNECT_EVERY.as_millis() + 1;
            for (index, spec) in flow_specs(pods).into_iter().enumerate() {
                let stats = Arc::new(FlowStats {
                    name: spec.name.clone(),
                    ..FlowStats::default()
                });
                traffic.flows.push(stats.clone());
                let stop = stop.clone();
                let handle = thread::Builder::new()
                    .name(format!("flow-{index}"))
                    .spawn(move || {
                        client_loop(
                            &spec,
                            index as u64,
                            &stats,
                            &stop,
                            deadline,
                            max_conns as u64,
                        );
                    })
                    .context("cannot start a traffic thread")?;
                traffic.clients.push(handle);
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(traffic),
            Err(e) => {
                traffic.stop();
                Err(e)
            }
        }
    }

    /// Stops every thread (each is bounded by timeouts) and returns the totals.
    pub(super) fn stop(self) -> Vec<Arc<FlowStats>> {
        self.stop.store(true, Ordering::SeqCst);
        for handle in self.clients.into_iter().chain(self.servers) {
            let _ = handle.join();
        }
        self.flows
    }
}

/// The bytes sent on connection `n` of flow `flow`: 2-5 KiB, content unique
/// enough that a mixed-up or shifted echo is caught.
fn payload(flow: u64, n: u64) -> Vec<u8> {
    let len = 2048 + (n % 4) as usize * 1024;
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(n * 7 + flow * 101) % 251) as u8)
        .collect()
}

fn client_loop(
    spec: &FlowSpec,
    flow: u64,
    stats: &FlowStats,
    stop: &AtomicBool,
    deadline: Instant,
    max_conns: u64,
) {
    for n in 0..max_conns {
        if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
            break;
        }
        let started = Instant::now();
        let sent = payload(flow, n);
        match exchange(spec, &sent) {
            Ok(back) if back == sent => {
                stats.ok.fetch_add(1, Ordering::Relaxed);
                stats.bytes.fetch_add(back.len() as u64, Ordering::Relaxed);
            }
            Ok(back) => {
                stats.wrong.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut last) = stats.last_error.lock() {
                    *last = Some(format!(
                        "connection {n}: sent {} bytes, got back {} different ones",
                        sent.len(),
                        back.len()
                    ));
                }
            }
            Err(e) => stats.fail(format!("connection {n}: {e:#}")),
        }
        if let Some(rest) = CONNECT_EVERY.checked_sub(started.elapsed()) {
            thread::sleep(rest);
        }
    }
}

/// One connection: send `sent`, half-close, read the echo until EOF.
fn exchange(spec: &FlowSpec, sent: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut stream = spec.from.connect_tcp(spec.to, CONNECT_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(sent).context("sending")?;
    stream.shutdown(Shutdown::Write).context("half-closing")?;
    let mut back = Vec::with_capacity(sent.len());
    // One byte more than sent, so an over-long echo shows as wrong.
    (&mut stream)
        .take(sent.len() as u64 + 1)
        .read_to_end(&mut back)
        .context("reading the echo")?;
    Ok(back)
}

/// Accepts until `stop`, one bounded handler thread per connection, at most
/// [`MAX_HANDLERS`] at once; joins them all before returning.
fn echo_server(listener: TcpListener, stop: &AtomicBool) {
    let active = Arc::new(AtomicUsize::new(0));
    let mut handlers: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((conn, _peer)) => {
                handlers.retain(|h| !h.is_finished());
                if active.load(Ordering::SeqCst) >= MAX_HANDLERS {
                    drop(conn);
                    continue;
                }
                active.fetch_add(1, Ordering::SeqCst);
                let active_in = active.clone();
                let spawned = thread::Builder::new()
                    .name("echo-conn".into())
                    .spawn(move || {
                        echo_one(conn);
                        active_in.fetch_sub(1, Ordering::SeqCst);
                    });
                match spawned {
                    Ok(handle) => handlers.push(handle),
                    Err(_) => {
                        active.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
    for handle in handlers {
        let _ = handle.join();
    }
}

/// Echoes until EOF, an error, [`MAX_ECHO_BYTES`] or [`IO_TIMEOUT`] of silence.
fn echo_one(mut conn: TcpStream) {
    if conn.set_nonblocking(false).is_err()
        || conn.set_read_timeout(Some(IO_TIMEOUT)).is_err()
        || conn.set_write_timeout(Some(IO_TIMEOUT)).is_err()
    {
        return;
    }
    let mut buf = [0u8; 16 * 1024];
    let mut total = 0;
    while total < MAX_ECHO_BYTES {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if conn.write_all(&buf[..n]).is_err() {
                    break;
                }
                total += n;
            }
        }
    }
}
