//! A real agent under attack: the `shunt` binary serving one mesh pod
//! (`server`, an echo application on 8080) on node-a, and two pods outside
//! the mesh on node-b: `flood` (the attacker, one source IP) and `good` (a
//! well-behaved client from another source). The good client speaks HBONE
//! with a certificate of the agent's own CA (read from its `--ca-dir`), or
//! plaintext to 8080 (captured on 15006).
#![allow(dead_code)]

use std::{
    net::{SocketAddr, TcpStream as StdTcpStream},
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use rustls_pki_types::ServerName;
use shunt::{
    identity::{CertificateAuthority, WorkloadCert, ca::BuiltinCa},
    state::{PodState, SpiffeId, TrustDomain},
    tls::{TrustRoots, client_config},
};
use shunt_testbed::{
    Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const APP_PORT: u16 = 8080;

pub struct Bed {
    pub topo: Topology,
    pub agent: Agent,
    pub server: Pod,
    pub flood: Pod,
    pub good: Pod,
}

/// Runs blocking testbed calls off the runtime's threads.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

impl Bed {
    /// The topology and the agent (iptables redirection, `extra_args`), the
    /// server pod enrolled and its echo application serving.
    pub async fn start(name: &str, extra_args: &[&str]) -> Bed {
        shunt_testbed::require_root().expect("root");
        let mut topo = Topology::new(name).expect("topology");
        topo.add_node("node-a").expect("node");
        topo.add_node("node-b").expect("node");
        let server = topo.add_pod("node-a", "server").expect("pod");
        let flood = topo.add_pod("node-b", "flood").expect("pod");
        let good = topo.add_pod("node-b", "good").expect("pod");
        let yaml = workloads_yaml(&[
            WorkloadSpec::for_pod(&server, true),
            WorkloadSpec::for_pod(&flood, false),
            WorkloadSpec::for_pod(&good, false),
        ]);
        let mut args = vec!["--redirect", "iptables"];
        args.extend_from_slice(extra_args);
        let node = topo.node("node-a").expect("node").clone();
        let mut agent = Agent::start(&topo, &node, &yaml, &args).expect("agent");
        agent
            .wait_for("the server pod enrolled", Duration::from_secs(30), |s| {
                s.pods
                    .iter()
                    .any(|p| p.name == "server" && p.state == PodState::Enrolled)
            })
            .expect("enrolled");
        echo_app(&server);
        Bed {
            topo,
            agent,
            server,
            flood,
            good,
        }
    }

    /// Waits until the server pod is enrolled again (after a restart).
    pub fn wait_enrolled(&mut self) {
        self.agent
            .wait_for("the server pod enrolled", Duration::from_secs(30), |s| {
                s.pods
                    .iter()
                    .any(|p| p.name == "server" && p.state == PodState::Enrolled)
            })
            .expect("enrolled");
    }

    pub fn hbone(&self) -> SocketAddr {
        SocketAddr::from((self.server.ip(), 15008))
    }

    pub fn app(&self) -> SocketAddr {
        SocketAddr::from((self.server.ip(), APP_PORT))
    }

    /// The agent's CA, as it keeps it in its `--ca-dir`.
    pub fn ca(&self) -> BuiltinCa {
        let dir = std::env::temp_dir().join(format!("{}-ca", self.topo.prefix()));
        BuiltinCa::load(&dir)
            .expect("the agent's CA dir")
            .expect("the agent wrote its CA")
    }

    /// Open fds of the agent process.
    pub fn agent_fds(&self) -> usize {
        let pid = self.agent.pid().expect("agent running");
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// The agent's refusal count for `reason`, from its admin API.
    pub fn refusals(&self, reason: &str) -> u64 {
        self.agent
            .status()
            .ok()
            .and_then(|s| s.proxy)
            .and_then(|p| p.refusals.get(reason).copied())
            .unwrap_or(0)
    }
}

/// An echo application on `pod`:8080 (tokio: many idle connections cost no
/// thread each).
fn echo_app(pod: &Pod) {
    let listener = pod
        .listen_tcp(SocketAddr::from((pod.ip(), APP_PORT)))
        .expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
}

/// A TCP connection from inside `pod` (blocking connect, bounded).
pub fn connect_from(pod: &Pod, dst: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let std = pod
        .run(move || -> std::io::Result<StdTcpStream> {
            let s = StdTcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .map_err(|e| std::io::Error::other(e.to_string()))??;
    tokio::net::TcpStream::from_std(std)
}

/// A well-behaved HBONE client from `from`: TLS with a certificate of the
/// agent's CA, CONNECT to the application, "ping" echoed. The error says
/// which step failed.
pub async fn hbone_echo(bed: &Bed, ca: &BuiltinCa, from: &Pod) -> Result<(), String> {
    let roots = TrustRoots::new(&CertificateAuthority::roots(ca)).map_err(|e| e.to_string())?;
    let server = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sa-server");
    let me = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sa-good");
    let key =
        rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| e.to_string())?;
    let leaf = ca
        .issue(&me, &key, Duration::from_secs(3600))
        .map_err(|e| e.to_string())?;
    let mut chain = vec![leaf];
    chain.extend(ca.chain().iter().cloned());
    let cert = WorkloadCert::new(me, chain, key.serialize_der()).map_err(|e| e.to_string())?;
    let config: Arc<rustls::ClientConfig> =
        client_config(&cert, &roots, &server).map_err(|e| e.to_string())?;
    let target = bed.hbone();
    let tcp = connect_from(from, target).map_err(|e| format!("TCP connect: {e}"))?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::IpAddress(target.ip().into()), tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let (send, conn) = h2::client::handshake(tls)
        .await
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
    let driver = tokio::spawn(conn);
    let result = async {
        let mut send = send.ready().await.map_err(|e| format!("ready: {e}"))?;
        let request = Request::builder()
            .method(Method::CONNECT)
            .uri(bed.app().to_string())
            .body(())
            .map_err(|e| e.to_string())?;
        let (response, mut body) = send
            .send_request(request, false)
            .map_err(|e| format!("CONNECT: {e}"))?;
        let response = response.await.map_err(|e| format!("CONNECT answer: {e}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!("CONNECT answered {}", response.status()));
        }
        body.send_data(Bytes::from_static(b"ping"), true)
            .map_err(|e| e.to_string())?;
        let mut recv = response.into_body();
        let mut got = Vec::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.map_err(|e| format!("echo: {e}"))?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            got.extend_from_slice(&chunk);
        }
        match got == b"ping" {
            true => Ok(()),
            false => Err(format!("echo mismatch: {got:?}")),
        }
    }
    .await;
    driver.abort();
    result
}

/// A well-behaved plaintext client from `from`: to the application's port
/// (captured on 15006), "ping" echoed.
pub async fn plaintext_echo(bed: &Bed, from: &Pod) -> Result<(), String> {
    let mut s = connect_from(from, bed.app()).map_err(|e| format!("TCP connect: {e}"))?;
    s.write_all(b"ping")
        .await
        .map_err(|e| format!("write: {e}"))?;
    s.shutdown().await.map_err(|e| format!("shutdown: {e}"))?;
    let mut got = Vec::new();
    s.read_to_end(&mut got)
        .await
        .map_err(|e| format!("read: {e}"))?;
    match got == b"ping" {
        true => Ok(()),
        false => Err(format!("echo mismatch: {got:?}")),
    }
}

/// Polls `cond` every 100 ms until it holds or `within` passes.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Raises this process's soft open-files limit to its hard one (the tests
/// hold thousands of client sockets).
pub fn raise_own_nofile() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
