//! HBONE between real network namespaces: two testbed nodes with pods, one
//! proxy per node, real TCP, real TLS, real bytes.
//!
//! Until the eBPF redirection lands, the tests play the redirector: the
//! application connects to 127.0.0.1:15001 inside its pod after recording
//! the original destination in the node proxy's map (see support/mesh.rs).

#[path = "support/mesh.rs"]
mod mesh;

use std::time::{Duration, Instant};

use mesh::{Mesh, echo_roundtrip, pod};
use shunt::{identity::IdentityConfig, proxy::ProxyConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn specs() -> Vec<mesh::PodSpec> {
    vec![
        pod("node-a", "client", "sleep", true),
        pod("node-a", "server-a", "httpbin", true),
        pod("node-b", "server-b", "httpbin", true),
        pod("node-b", "plain", "legacy", false),
    ]
}

async fn mesh(test: &str) -> Mesh {
    Mesh::new(
        test,
        specs(),
        ProxyConfig::default(),
        IdentityConfig::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_node_and_same_node_streams_carry_bytes() {
    let m = mesh("hbone-basic").await;
    m.echo_server("server-a", 8080);
    m.echo_server("server-b", 8080);

    let mut cross = m
        .connect_via_proxy("client", m.addr("server-b", 8080))
        .await;
    echo_roundtrip(&mut cross, b"hello across nodes").await;
    let mut same = m
        .connect_via_proxy("client", m.addr("server-a", 8080))
        .await;
    echo_roundtrip(&mut same, b"hello on this node").await;
    // Half-close: our FIN reaches the echo server, whose FIN comes back.
    for s in [&mut cross, &mut same] {
        s.shutdown().await.expect("shutdown");
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
            .await
            .expect("EOF in time")
            .expect("read");
        assert!(rest.is_empty());
    }
    drop((cross, same));
    m.wait_for_stats("both streams counted", |s| {
        s["node-a"].outbound_hbone >= 2
            && s["node-a"].inbound_hbone + s["node-b"].inbound_hbone >= 2
    })
    .await;
    let a = m.nodes["node-a"].proxy.stats();
    let b = m.nodes["node-b"].proxy.stats();
    assert_eq!(a.outbound_hbone, 2, "{a:?}");
    // Same-node traffic went through node A's own inbound checks.
    assert_eq!(a.inbound_hbone, 1, "{a:?}");
    assert_eq!(b.inbound_hbone, 1, "{b:?}");
    assert_eq!(a.refused + a.failed + b.refused + b.failed, 0);
    assert_eq!(a.bytes_out, 36);
    assert_eq!(a.bytes_in, 36);
}

/// 1 GiB through two proxies, hashed on arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfer_arrives_intact() {
    const TOTAL: usize = 1024 * 1024 * 1024;
    let m = mesh("hbone-large").await;
    m.hash_server("server-b", 9000);
    let mut s = m
        .connect_via_proxy("client", m.addr("server-b", 9000))
        .await;
    let started = Instant::now();
    let mut expected = ring::digest::Context::new(&ring::digest::SHA256);
    // Pseudo-random content, so a dropped or duplicated chunk changes the hash.
    let mut chunk = vec![0u8; 1024 * 1024];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut sent = 0;
    while sent < TOTAL {
        for word in chunk.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes());
        }
        expected.update(&chunk);
        tokio::time::timeout(Duration::from_secs(60), s.write_all(&chunk))
            .await
            .expect("write in time")
            .expect("write");
        sent += chunk.len();
    }
    s.shutdown().await.expect("half-close");
    let mut digest = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut digest))
        .await
        .expect("digest in time")
        .expect("read digest");
    let elapsed = started.elapsed();
    assert_eq!(
        digest,
        expected.finish().as_ref(),
        "hash matches on arrival"
    );
    eprintln!(
        "1 GiB through two proxies in {elapsed:?} ({:.0} MiB/s, debug build)",
        1024.0 / elapsed.as_secs_f64()
    );
    m.wait_for_stats("the stream counted", |s| s["node-a"].outbound_hbone >= 1)
        .await;
    let a = m.nodes["node-a"].proxy.stats();
    assert_eq!(a.bytes_out, TOTAL as u64);
}

/// 1000 concurrent streams share a handful of pooled connections (≤100
/// streams each), every stream's bytes intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_streams_share_pooled_connections() {
    const STREAMS: usize = 1000;
    let m = mesh("hbone-many").await;
    m.echo_server("server-b", 8080);
    let dst = m.addr("server-b", 8080);
    // Open every stream first so they are all alive at once.
    let mut conns = Vec::with_capacity(STREAMS);
    for i in 0..STREAMS {
        let mut s = m.connect_via_proxy("client", dst).await;
        echo_roundtrip(&mut s, format!("stream {i} opening").as_bytes()).await;
        conns.push(s);
    }
    let pooled = m.nodes["node-a"].proxy.stats().pooled_connections;
    assert!(
        (STREAMS / 100..=STREAMS / 100 + 2).contains(&pooled),
        "{pooled} pooled connections for {STREAMS} concurrent streams"
    );
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            tokio::spawn(async move {
                let payload = vec![(i % 251) as u8; 16 * 1024];
                echo_roundtrip(&mut s, &payload).await;
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("stream task");
    }
    let a = m.nodes["node-a"].proxy.stats();
    assert_eq!(a.failed + a.refused, 0, "{a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_and_inbound_plaintext() {
    let m = mesh("hbone-plain").await;
    m.echo_server("plain", 8080);
    m.echo_server("server-b", 8080);
    // A mesh pod to a non-mesh destination: plain TCP.
    let mut s = m.connect_via_proxy("client", m.addr("plain", 8080)).await;
    echo_roundtrip(&mut s, b"not in the mesh").await;
    drop(s);
    // A non-mesh pod to a mesh pod's inbound plaintext listener (what the TC
    // program or REDIRECT would deliver), recorded as going to :8080.
    let dst = m.addr("server-b", 8080);
    let mut s = m
        .connect_recorded("plain", m.addr("server-b", 15006), "server-b", dst)
        .await;
    echo_roundtrip(&mut s, b"plaintext into the mesh").await;
    drop(s);
    m.wait_for_stats("both connections counted", |s| {
        s["node-a"].outbound_passthrough >= 1 && s["node-b"].inbound_plaintext >= 1
    })
    .await;
    let a = m.nodes["node-a"].proxy.stats();
    let b = m.nodes["node-b"].proxy.stats();
    assert_eq!((a.outbound_passthrough, a.outbound_hbone), (1, 0), "{a:?}");
    assert_eq!(b.inbound_plaintext, 1, "{b:?}");
    assert_eq!(b.refused + b.failed, 0, "{b:?}");
}

/// The client checks the server's identity against the destination's: a
/// server speaking with another identity is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_server_identity_is_refused() {
    let m = mesh("hbone-wrongid").await;
    m.echo_server("server-b", 8080);
    // The store now says server-b runs as "other"; its proxy still presents
    // httpbin's certificate.
    {
        let mut store = m.store.write().expect("store");
        let mut all: Vec<_> = store.iter().cloned().collect();
        for w in &mut all {
            if w.name == "server-b" {
                w.service_account = "other".into();
            }
        }
        store.replace_all(all);
    }
    let mut s = m
        .connect_via_proxy("client", m.addr("server-b", 8080))
        .await;
    let _ = s.write_all(b"secret").await;
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("answer in time");
    assert!(matches!(r, Ok(0) | Err(_)), "refused, got {r:?}");
    m.wait_for_stats("the failure counted", |s| s["node-a"].failed >= 1)
        .await;
    let a = m.nodes["node-a"].proxy.stats();
    assert_eq!(a.failed, 1, "{a:?}");
    let server = &m.nodes["node-b"].proxy;
    assert!(
        mesh::eventually(Duration::from_secs(5), || server.stats().refused == 1).await,
        "server saw a refused handshake: {:?}",
        server.stats()
    );
}

/// Listeners come and go with the pod; certificates rotate under live
/// streams without breaking them; drain lets streams finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrolment_rotation_and_drain() {
    let identity = IdentityConfig {
        cert_ttl: Duration::from_secs(4),
        ..IdentityConfig::default()
    };
    let m = Mesh::new("hbone-life", specs(), ProxyConfig::default(), identity).await;
    m.echo_server("server-b", 8080);
    let dst = m.addr("server-b", 8080);
    let node_b = &m.nodes["node-b"];
    let b_cert = node_b
        .identities
        .certificate(&m.identity("server-b"))
        .await
        .expect("server-b certificate");

    // A stream that lives across several rotations (TTL 4 s, renewed ~every 2 s).
    let mut long = m.connect_via_proxy("client", dst).await;
    let until = Instant::now() + Duration::from_secs(6);
    let mut i = 0u32;
    while Instant::now() < until {
        echo_roundtrip(&mut long, format!("tick {i}").as_bytes()).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rotated = node_b.identities.current(&m.identity("server-b"));
    assert!(
        rotated.is_some_and(|new| b_cert.chain()[0] != new.chain()[0]),
        "server certificate rotated during the stream"
    );
    // New streams after rotation work too.
    let mut fresh = m.connect_via_proxy("client", dst).await;
    echo_roundtrip(&mut fresh, b"after rotation").await;
    drop(fresh);

    // Listeners follow enrolment.
    let key = shunt::state::WorkloadKey::new("default", "server-b");
    assert!(node_b.proxy.remove_pod(&key));
    let hbone = m.addr("server-b", 15008);
    assert!(
        m.wait_listening("plain", hbone, false).await,
        "15008 closed after removal"
    );
    assert!(
        node_b.identities.identities().is_empty(),
        "identity dropped with its last pod"
    );
    node_b
        .proxy
        .add_pod(shunt::proxy::PodNet {
            key: key.clone(),
            netns: m.pod("server-b").netns_path(),
            ips: vec![dst.ip()],
            identity: m.identity("server-b"),
            dns: false,
        })
        .await
        .expect("re-add");
    assert!(
        m.wait_listening("plain", hbone, true).await,
        "15008 back after re-adding"
    );
    // The long stream survived all of it (its connection was accepted
    // before the listener went away).
    echo_roundtrip(&mut long, b"still here").await;

    // Drain: listeners close at once, the open stream may finish.
    let proxy = node_b.proxy.clone();
    let drain = tokio::spawn(async move { proxy.drain(Duration::from_secs(10)).await });
    assert!(
        m.wait_listening("plain", hbone, false).await,
        "no new connections while draining"
    );
    echo_roundtrip(&mut long, b"draining").await;
    long.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), long.read_to_end(&mut rest)).await;
    let left = tokio::time::timeout(Duration::from_secs(15), drain)
        .await
        .expect("drain ends")
        .expect("drain task");
    assert_eq!(left, 0, "every stream finished within the grace period");
}
