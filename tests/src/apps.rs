//! Applications for kernel tests: an echo server that records what it
//! accepted, and `shunt-testapp` runs as pod processes in a cgroup (so the
//! socket programs see them as they see a pod's containers).

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::redirect::OriginalDst;

use crate::{Cgroup, Pod};

/// How long an echo connection may sit idle, and the server's whole life.
const IDLE: Duration = Duration::from_secs(30);
const LIFETIME: Duration = Duration::from_secs(300);

/// What an [`EchoServer`] accepted.
#[derive(Clone, Debug)]
pub struct Accepted {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// The connection's original destination, when the server was given a
    /// resolver (as the proxy has one).
    pub original: Option<SocketAddr>,
}

/// A listener that echoes every connection (a thread each) and records it.
/// Stops on drop.
pub struct EchoServer {
    accepted: Arc<Mutex<Vec<Accepted>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl EchoServer {
    /// Serves `listener` (bind it inside a pod with [`Pod::listen_tcp`]).
    pub fn start(listener: TcpListener, resolver: Option<Arc<dyn OriginalDst>>) -> EchoServer {
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        // A non-blocking accept loop notices `stop` without a wake-up
        // connection.
        let nonblocking = listener.set_nonblocking(true).is_ok();
        let thread = {
            let (accepted, stop) = (accepted.clone(), stop.clone());
            thread::spawn(move || {
                let start = Instant::now();
                while nonblocking && !stop.load(Ordering::Relaxed) && start.elapsed() < LIFETIME {
                    match listener.accept() {
                        Ok((stream, peer)) => {
                            let original =
                                resolver.as_ref().and_then(|r| r.original_dst(&stream).ok());
                            if let Ok(local) = stream.local_addr() {
                                lock(&accepted).push(Accepted {
                                    local,
                                    peer,
                                    original,
                                });
                            }
                            thread::spawn(move || echo(stream));
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        EchoServer {
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    /// An echo server on `pod`'s IP and `port`.
    pub fn on(pod: &Pod, port: u16) -> crate::Result<EchoServer> {
        let listener = pod.listen_tcp(SocketAddr::from((pod.ip(), port)))?;
        Ok(Self::start(listener, None))
    }

    pub fn accepted(&self) -> Vec<Accepted> {
        lock(&self.accepted).clone()
    }

    pub fn peers(&self) -> Vec<SocketAddr> {
        self.accepted().into_iter().map(|a| a.peer).collect()
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn echo(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(IDLE));
    let mut buf = [0u8; 64 * 1024];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 || stream.write_all(&buf[..n]).is_err() {
            break;
        }
    }
}

/// `shunt-testapp` (tests/src/bin) run as a pod's application: inside the
/// pod's netns and in `cgroup`.
pub struct TestApp<'a> {
    binary: PathBuf,
    cgroup: &'a Cgroup,
}

impl<'a> TestApp<'a> {
    /// `binary` is `env!("CARGO_BIN_EXE_shunt-testapp")` in this crate's
    /// tests.
    pub fn new(binary: impl Into<PathBuf>, cgroup: &'a Cgroup) -> Self {
        Self {
            binary: binary.into(),
            cgroup,
        }
    }

    /// Runs `shunt-testapp ARGS` in `pod` and returns its JSON report (a
    /// report with `"ok": false` when it could not even start).
    pub fn run(&self, pod: &Pod, args: &[&str]) -> Value {
        let mut cmd = pod.command(&self.binary);
        cmd.args(args);
        self.cgroup.place(&mut cmd);
        let out = match cmd.output() {
            Ok(out) => out,
            Err(e) => return serde_json::json!({"ok": false, "error": e.to_string()}),
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| {
            serde_json::json!({"ok": false, "error": format!("testapp printed {stdout:?}: {e}")})
        })
    }

    /// A `std::process::Command` for a long-running testapp (e.g. `hold`).
    pub fn command(&self, pod: &Pod, args: &[&str]) -> std::process::Command {
        let mut cmd = pod.command(&self.binary);
        cmd.args(args);
        self.cgroup.place(&mut cmd);
        cmd
    }
}

/// True when a testapp report says the exchange worked and the echo matched.
pub fn ok(report: &Value) -> bool {
    report["ok"] == Value::Bool(true) && report["intact"] != Value::Bool(false)
}

/// A `shunt-testapp churn` running in the background (four workers, a new
/// 512-byte echo connection each every millisecond); killed
/// (by its PID) if the test ends before it does.
pub struct Churn {
    child: Option<Child>,
    stop_file: PathBuf,
}

impl Churn {
    pub fn start(apps: &TestApp<'_>, pod: &Pod, to: &str, stop_file: PathBuf) -> Churn {
        Churn::start_for(apps, pod, to, stop_file, Duration::from_secs(120))
    }

    /// As [`Churn::start`], running at most `max` (whole seconds).
    pub fn start_for(
        apps: &TestApp<'_>,
        pod: &Pod,
        to: &str,
        stop_file: PathBuf,
        max: Duration,
    ) -> Churn {
        let _ = std::fs::remove_file(&stop_file);
        let stop = stop_file.display().to_string();
        let seconds = max.as_secs().max(1).to_string();
        let child = apps
            .command(
                pod,
                &[
                    "churn",
                    to,
                    "--stop-file",
                    &stop,
                    "--seconds",
                    &seconds,
                    "--workers",
                    "4",
                    "--interval-ms",
                    "1",
                    "--send",
                    "512",
                ],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn churn");
        Churn {
            child: Some(child),
            stop_file,
        }
    }

    /// Signals the loop to stop (through its stop file) and returns its
    /// report.
    pub fn finish(mut self) -> Value {
        std::fs::write(&self.stop_file, b"stop").expect("stop file");
        let child = self.child.take().expect("running");
        let out = child.wait_with_output().expect("churn output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| {
            panic!(
                "churn printed {stdout:?} ({e}); stderr {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.stop_file, b"stop");
        if let Some(mut child) = self.child.take() {
            // Our own child, by PID.
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.stop_file);
    }
}

/// A server that reads a connection to its end and answers with only the
/// first half of what it read, then closes: the two directions move
/// different byte counts, so a report that swapped them would show.
pub struct HalfEcho {
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    _thread: thread::JoinHandle<()>,
}

impl HalfEcho {
    /// On `port` of the pod's IPv4 address.
    pub fn on(pod: &Pod, port: u16) -> HalfEcho {
        HalfEcho::on_addr(pod, SocketAddr::from((pod.ip(), port)))
    }

    /// On `addr` inside the pod (e.g. its IPv6 address).
    pub fn on_addr(pod: &Pod, addr: SocketAddr) -> HalfEcho {
        let listener = pod.listen_tcp(addr).expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        let peers = Arc::new(Mutex::new(Vec::new()));
        let seen = peers.clone();
        let thread = thread::spawn(move || {
            let start = Instant::now();
            // Bounded: a test's whole life at most.
            while start.elapsed() < LIFETIME {
                let Ok((mut stream, peer)) = listener.accept() else {
                    thread::sleep(Duration::from_millis(5));
                    continue;
                };
                seen.lock().expect("peers").push(peer);
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(IDLE));
                let mut all = Vec::new();
                if stream.read_to_end(&mut all).is_ok() {
                    let _ = stream.write_all(&all[..all.len() / 2]);
                }
            }
        });
        HalfEcho {
            peers,
            _thread: thread,
        }
    }

    /// The client addresses it accepted, in order.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers").clone()
    }
}

/// The client's own address in a testapp report (`"local"`).
pub fn local_of(report: &Value) -> SocketAddr {
    report["local"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no local address in {report}"))
}

/// Whether the application's socket in a testapp report is connected to
/// the proxy's outbound listener (its `"kernel_peer"`, from
/// `/proc/net/tcp`, is loopback port 15001): redirected. Neither its local
/// address (the connect hook binds a redirected socket to the pod's own)
/// nor getpeername (answered with the original destination) says so.
pub fn via_the_proxy(report: &Value) -> bool {
    let peer: SocketAddr = report["kernel_peer"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no kernel_peer address in {report}"));
    peer.port() == 15001 && peer.ip().to_canonical().is_loopback()
}
