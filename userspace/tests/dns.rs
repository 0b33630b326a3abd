//! The DNS proxy's server on real loopback sockets: a DNS client built on
//! hickory-proto asks over UDP and TCP; an in-test upstream resolver (also
//! hickory-proto, on another loopback port) answers what the mesh does not
//! know. Capture and network namespaces are the kernel tests' business.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query, ResponseCode},
    rr::{Name, RData, Record, RecordType, rdata::A},
};
use shunt::dns::{DnsServerHandle, DnsSockets, Forwarder, MeshNames, PodDns, names_channel, serve};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, UdpSocket},
    sync::watch,
};

/// How long a test waits for any answer before it fails (an answer that
/// never comes; never a timing assertion).
const ANSWER_DEADLINE: Duration = Duration::from_secs(20);

const WEB_VIP: &str = "198.18.10.1";
const WEB_VIP6: &str = "fd00:198:18::10";
const DB_VIP: &str = "198.18.10.2";
const EXT_IP: &str = "198.18.0.77";
/// Records of the large answer: more than 512 bytes' worth.
const BIG_RECORDS: u8 = 60;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test ip")
}

/// `web` (dual stack) and `db` (v4 only) in `default`.
fn mesh_names() -> MeshNames {
    let mut names = MeshNames::new("cluster.local");
    names.insert_service(
        "web.default.svc.cluster.local",
        "default",
        vec![ip(WEB_VIP), ip(WEB_VIP6)],
    );
    names.insert_service("db.default.svc.cluster.local", "default", vec![ip(DB_VIP)]);
    names
}

struct Server {
    handle: DnsServerHandle,
    udp: SocketAddr,
    tcp: SocketAddr,
    metrics: shunt::metrics::Metrics,
    _names: watch::Sender<Arc<MeshNames>>,
}

/// A pod in `namespace` (canonical name `sleep`, revision `v1`) served on
/// fresh loopback ports, forwarding to `upstreams`.
fn start(namespace: &str, upstreams: Vec<SocketAddr>, timeout: Duration) -> Server {
    let (publish, names) = names_channel("cluster.local");
    publish.send_replace(Arc::new(mesh_names()));
    let metrics = shunt::metrics::Metrics::new();
    let sockets = DnsSockets::bind(&["127.0.0.1:0".parse().expect("addr")]).expect("bind");
    let handle = serve(
        sockets,
        PodDns::kubernetes(namespace, "cluster.local").with_canonical("sleep", "v1"),
        names,
        Arc::new(Forwarder::new(upstreams, timeout)),
        metrics.dns().clone(),
    )
    .expect("serve");
    Server {
        udp: handle.udp_addrs()[0],
        tcp: handle.tcp_addrs()[0],
        handle,
        metrics,
        _names: publish,
    }
}

fn query(name: &str, record_type: RecordType, edns: bool) -> Message {
    let mut q = Message::query();
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(
        Name::from_str(name).expect("name"),
        record_type,
    ));
    if edns {
        let mut e = Edns::new();
        e.set_max_payload(1232);
        q.set_edns(e);
    }
    q
}

async fn ask_udp(server: SocketAddr, q: &Message) -> Message {
    let socket = UdpSocket::bind("127.0.0.1:0").await.expect("client socket");
    socket.connect(server).await.expect("connect");
    socket
        .send(&q.to_vec().expect("encode"))
        .await
        .expect("send");
    let mut buf = vec![0u8; 65535];
    let n = tokio::time::timeout(ANSWER_DEADLINE, socket.recv(&mut buf))
        .await
        .expect("an answer arrives")
        .expect("recv");
    let answer = Message::from_vec(&buf[..n]).expect("answer decodes");
    assert_eq!(
        answer.metadata.id, q.metadata.id,
        "the answer carries the query's id"
    );
    answer
}

async fn ask_tcp(server: SocketAddr, q: &Message) -> Message {
    let mut stream = TcpStream::connect(server).await.expect("connect");
    let bytes = q.to_vec().expect("encode");
    let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    stream.write_all(&framed).await.expect("send");
    let read = async {
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await.expect("length");
        let mut body = vec![0u8; u16::from_be_bytes(len) as usize];
        stream.read_exact(&mut body).await.expect("body");
        body
    };
    let body = tokio::time::timeout(ANSWER_DEADLINE, read)
        .await
        .expect("an answer arrives");
    let answer = Message::from_vec(&body).expect("answer decodes");
    assert_eq!(answer.metadata.id, q.metadata.id);
    answer
}

fn a_records(m: &Message) -> Vec<IpAddr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            RData::AAAA(a) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect()
}

/// A UDP socket and a TCP listener on one free loopback port (non-blocking,
/// ready for tokio), as the server binds its own.
fn loopback_pair() -> (std::net::UdpSocket, std::net::TcpListener) {
    let mut sockets = DnsSockets::bind(&["127.0.0.1:0".parse().expect("addr")]).expect("bind");
    let (udp, tcp) = (sockets.udp.remove(0), sockets.tcp.remove(0));
    udp.set_nonblocking(true).expect("nonblocking");
    tcp.set_nonblocking(true).expect("nonblocking");
    (udp, tcp)
}

/// A small real resolver: `ext.example.org` → one A, `big.example.org` →
/// [`BIG_RECORDS`] A records (truncated over UDP past the client's size),
/// anything else NXDOMAIN. UDP and TCP on one loopback port.
async fn start_upstream() -> SocketAddr {
    let (udp, tcp) = loopback_pair();
    let addr = udp.local_addr().expect("addr");
    let udp = UdpSocket::from_std(udp).expect("upstream udp");
    let tcp = TcpListener::from_std(tcp).expect("upstream tcp");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65535];
        loop {
            let Ok((n, client)) = udp.recv_from(&mut buf).await else {
                return;
            };
            if let Some(answer) = upstream_answer(&buf[..n], true) {
                let _ = udp.send_to(&answer, client).await;
            }
        }
    });
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = tcp.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut len = [0u8; 2];
                while stream.read_exact(&mut len).await.is_ok() {
                    let mut body = vec![0u8; u16::from_be_bytes(len) as usize];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let Some(answer) = upstream_answer(&body, false) else {
                        return;
                    };
                    let mut framed = (answer.len() as u16).to_be_bytes().to_vec();
                    framed.extend_from_slice(&answer);
                    if stream.write_all(&framed).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn upstream_answer(bytes: &[u8], udp: bool) -> Option<Vec<u8>> {
    let q = Message::from_vec(bytes).ok()?;
    let question = q.queries.first()?.clone();
    let mut answer = Message::response(q.metadata.id, OpCode::Query);
    answer.metadata.recursion_desired = q.metadata.recursion_desired;
    answer.metadata.recursion_available = true;
    answer.add_query(question.clone());
    let name = question.name().to_ascii().to_ascii_lowercase();
    match name.as_str() {
        "ext.example.org." if question.query_type() == RecordType::A => {
            answer.add_answer(Record::from_rdata(
                question.name().clone(),
                60,
                RData::A(A(EXT_IP.parse().expect("ip"))),
            ));
        }
        "big.example.org." => {
            for i in 1..=BIG_RECORDS {
                answer.add_answer(Record::from_rdata(
                    question.name().clone(),
                    60,
                    RData::A(A(Ipv4Addr::new(198, 18, 1, i))),
                ));
            }
        }
        _ => answer.metadata.response_code = ResponseCode::NXDomain,
    }
    let encoded = answer.to_vec().ok()?;
    if udp && encoded.len() > q.max_payload() as usize {
        return answer.truncate().to_vec().ok();
    }
    Some(encoded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_name_in_every_form_is_answered_with_its_vip_without_any_upstream() {
    let server = start("default", Vec::new(), Duration::from_secs(5));
    for name in [
        // What a pod's resolver asks first for `web`, `web.default` and
        // `web.default.svc` (the kubelet's search list, ndots:5).
        "web.default.svc.cluster.local.",
        "WEB.Default.svc.cluster.local.",
        // Asked literally, without a search list.
        "web.",
        "web.default.",
        "web.default.svc.",
    ] {
        for edns in [false, true] {
            let answer = ask_udp(server.udp, &query(name, RecordType::A, edns)).await;
            assert_eq!(
                answer.metadata.response_code,
                ResponseCode::NoError,
                "{name}"
            );
            assert_eq!(a_records(&answer), vec![ip(WEB_VIP)], "{name}");
            assert!(answer.metadata.authoritative);
            assert_eq!(answer.answers[0].ttl, 30);
            assert_eq!(answer.answers[0].name, Name::from_str(name).expect("name"));
        }
    }
    let answer = ask_tcp(server.tcp, &query("web.", RecordType::A, false)).await;
    assert_eq!(a_records(&answer), vec![ip(WEB_VIP)]);
    server.handle.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ndots_expanded_first_query_of_another_namespace_hits_through_a_cname() {
    // A pod in `shop` asks for `web.default.svc.cluster.local` (4 dots,
    // ndots:5): its resolver first asks with `shop.svc.cluster.local`
    // appended.
    let server = start("shop", Vec::new(), Duration::from_secs(5));
    let name = "web.default.svc.cluster.local.shop.svc.cluster.local.";
    let answer = ask_udp(server.udp, &query(name, RecordType::A, false)).await;
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    let target = Name::from_str("web.default.svc.cluster.local.").expect("name");
    match &answer.answers[0].data {
        RData::CNAME(cname) => assert_eq!(cname.0, target),
        other => panic!("expected a CNAME first, got {other:?}"),
    }
    assert_eq!(answer.answers[0].name, Name::from_str(name).expect("name"));
    assert_eq!(a_records(&answer), vec![ip(WEB_VIP)]);
    assert_eq!(answer.answers[1].name, target);
    // `web` alone means the pod's own namespace, where there is none: the
    // upstream's (none here: SERVFAIL), not the mesh's.
    let answer = ask_udp(
        server.udp,
        &query("web.shop.svc.cluster.local.", RecordType::A, false),
    )
    .await;
    assert_eq!(answer.metadata.response_code, ResponseCode::ServFail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aaaa_for_a_v6_vip_and_no_error_without_answers_for_a_family_the_name_lacks() {
    let server = start("default", Vec::new(), Duration::from_secs(5));
    let answer = ask_udp(
        server.udp,
        &query("web.default.svc.cluster.local.", RecordType::AAAA, false),
    )
    .await;
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    assert_eq!(a_records(&answer), vec![ip(WEB_VIP6)]);
    // `db` has no v6 VIP: the name exists, so NOERROR with no answer (not
    // NXDOMAIN, not forwarded: there is no upstream to fail).
    let answer = ask_udp(server.udp, &query("db.", RecordType::AAAA, false)).await;
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    assert!(answer.answers.is_empty(), "{:?}", answer.answers);
    assert!(answer.metadata.authoritative);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_name_is_forwarded_and_answered_and_the_metrics_count_it() {
    let upstream = start_upstream().await;
    let server = start("default", vec![upstream], Duration::from_secs(5));
    let answer = ask_udp(server.udp, &query("ext.example.org.", RecordType::A, false)).await;
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    assert_eq!(a_records(&answer), vec![ip(EXT_IP)]);
    assert!(!answer.metadata.authoritative);
    let answer = ask_tcp(
        server.tcp,
        &query("nothing.example.org.", RecordType::AAAA, false),
    )
    .await;
    assert_eq!(answer.metadata.response_code, ResponseCode::NXDomain);
    // A mesh name: counted as a request, not as an upstream request.
    ask_udp(server.udp, &query("web.", RecordType::A, false)).await;

    let scrape = server.metrics.encode(None);
    let labels = |t: &str, p: &str| {
        format!(
            "{{request_query_type=\"{t}\",request_protocol=\"{p}\",source_canonical_service=\"sleep\",source_canonical_revision=\"v1\"}}"
        )
    };
    for line in [
        format!("istio_dns_requests_total{} 2", labels("a", "udp")),
        format!("istio_dns_requests_total{} 1", labels("aaaa", "tcp")),
        format!("istio_dns_upstream_requests_total{} 1", labels("a", "udp")),
        format!(
            "istio_dns_upstream_requests_total{} 1",
            labels("aaaa", "tcp")
        ),
    ] {
        assert!(scrape.contains(&line), "{line} missing in\n{scrape}");
    }
    assert!(
        !scrape.contains("istio_dns_upstream_failures_total{"),
        "no failure yet:\n{scrape}"
    );
    assert!(scrape.contains("istio_dns_upstream_request_duration_seconds_count{request_query_type=\"a\",request_protocol=\"udp\""), "{scrape}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_never_answers_gives_servfail_and_counts_a_failure() {
    // Bound, never read: UDP queries vanish, TCP connects but hears nothing.
    let (silent_udp, _silent_tcp) = loopback_pair();
    let silent = silent_udp.local_addr().expect("addr");
    let server = start("default", vec![silent], Duration::from_millis(300));
    let answer = ask_udp(server.udp, &query("ext.example.org.", RecordType::A, false)).await;
    assert_eq!(answer.metadata.response_code, ResponseCode::ServFail);
    let answer = ask_tcp(server.tcp, &query("ext.example.org.", RecordType::A, false)).await;
    assert_eq!(answer.metadata.response_code, ResponseCode::ServFail);
    let scrape = server.metrics.encode(None);
    assert!(
        scrape.contains("istio_dns_upstream_failures_total{request_query_type=\"a\",request_protocol=\"udp\",source_canonical_service=\"sleep\",source_canonical_revision=\"v1\"} 1"),
        "{scrape}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_query_gets_formerr_and_harms_nothing() {
    let server = start("default", Vec::new(), Duration::from_secs(5));
    let client = UdpSocket::bind("127.0.0.1:0").await.expect("client");
    client.connect(server.udp).await.expect("connect");
    // A header claiming one question, then garbage.
    let mut garbage = vec![
        0xab, 0xcd, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    garbage.extend_from_slice(&[0xff; 9]);
    client.send(&garbage).await.expect("send");
    let mut buf = vec![0u8; 512];
    let n = tokio::time::timeout(ANSWER_DEADLINE, client.recv(&mut buf))
        .await
        .expect("an answer arrives")
        .expect("recv");
    let answer = Message::from_vec(&buf[..n]).expect("FORMERR decodes");
    assert_eq!(answer.metadata.id, 0xabcd);
    assert_eq!(answer.metadata.message_type, MessageType::Response);
    assert_eq!(answer.metadata.response_code, ResponseCode::FormErr);
    // Too short to be refused: dropped; a two-question query: FORMERR.
    client.send(&[1, 2, 3]).await.expect("send");
    let mut two = query("web.", RecordType::A, false);
    two.add_query(Query::query(
        Name::from_str("db.").expect("name"),
        RecordType::A,
    ));
    let answer = ask_udp(server.udp, &two).await;
    assert_eq!(answer.metadata.response_code, ResponseCode::FormErr);
    // Garbage over TCP, then the server still answers.
    let mut stream = TcpStream::connect(server.tcp).await.expect("connect");
    let mut framed = (garbage.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&garbage);
    stream.write_all(&framed).await.expect("send");
    let mut len = [0u8; 2];
    tokio::time::timeout(ANSWER_DEADLINE, stream.read_exact(&mut len))
        .await
        .expect("an answer arrives")
        .expect("FORMERR over TCP");
    for _ in 0..2 {
        let answer = ask_udp(server.udp, &query("web.", RecordType::A, false)).await;
        assert_eq!(a_records(&answer), vec![ip(WEB_VIP)]);
    }
    let answer = ask_tcp(server.tcp, &query("web.", RecordType::A, false)).await;
    assert_eq!(a_records(&answer), vec![ip(WEB_VIP)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_is_truncated_over_udp_and_whole_over_tcp() {
    let upstream = start_upstream().await;
    let server = start("default", vec![upstream], Duration::from_secs(5));
    // No EDNS: 512 bytes. The upstream truncates over UDP, the proxy asks
    // it again over TCP, and the whole answer is still too big for the
    // client's UDP: TC, so the client asks over TCP.
    let over_udp = ask_udp(server.udp, &query("big.example.org.", RecordType::A, false)).await;
    assert!(over_udp.metadata.truncation, "TC set over UDP");
    assert!(over_udp.to_vec().expect("encode").len() <= 512);
    let over_tcp = ask_tcp(server.tcp, &query("big.example.org.", RecordType::A, false)).await;
    assert!(!over_tcp.metadata.truncation);
    assert_eq!(over_tcp.answers.len(), usize::from(BIG_RECORDS));
    // With EDNS 1232 the whole answer fits in one datagram.
    let with_edns = ask_udp(server.udp, &query("big.example.org.", RecordType::A, true)).await;
    assert!(!with_edns.metadata.truncation);
    assert_eq!(with_edns.answers.len(), usize::from(BIG_RECORDS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_published_later_are_answered_and_shutdown_closes_the_sockets() {
    let (publish, names) = names_channel("cluster.local");
    let sockets = DnsSockets::bind(&["127.0.0.1:0".parse().expect("addr")]).expect("bind");
    let handle = serve(
        sockets,
        PodDns::kubernetes("default", "cluster.local"),
        names,
        Arc::new(Forwarder::new(Vec::new(), Duration::from_secs(5))),
        Arc::new(shunt::dns::DnsMetrics::default()),
    )
    .expect("serve");
    let (udp, tcp) = (handle.udp_addrs()[0], handle.tcp_addrs()[0]);
    let before = ask_udp(udp, &query("web.", RecordType::A, false)).await;
    assert_eq!(
        before.metadata.response_code,
        ResponseCode::ServFail,
        "not a mesh name yet; no upstream"
    );
    publish.send_replace(Arc::new(mesh_names()));
    let after = ask_udp(udp, &query("web.", RecordType::A, false)).await;
    assert_eq!(a_records(&after), vec![ip(WEB_VIP)]);
    handle.shutdown().await;
    std::net::UdpSocket::bind(udp).expect("the UDP port is free again");
    std::net::TcpListener::bind(tcp).expect("the TCP port is free again");
}

/// Names built from the store, as the agent publishes them: a pod of a
/// headless service answers to `<hostname>.<subdomain>.<ns>.svc.<domain>`,
/// and the asking pod's metrics carry its canonical service from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_subdomain_record_and_the_askers_canonical_names_come_from_the_store() {
    use shunt::state::{Endpoint, Service, Workload};
    let mut store = shunt::store::WorkloadStore::new();
    store.replace_services([Service {
        name: "db".into(),
        namespace: "default".into(),
        endpoints: vec![Endpoint::new(ip("198.18.20.1"), None)],
        ..Default::default()
    }]);
    let mut asker = Workload {
        name: "sleep-7f9-x2".into(),
        namespace: "default".into(),
        ips: vec![ip("198.18.20.9")],
        ..Default::default()
    };
    asker.labels.insert("app".into(), "sleeper".into());
    asker.labels.insert("version".into(), "v3".into());
    store.replace_all([
        Workload {
            name: "db-0".into(),
            namespace: "default".into(),
            ips: vec![ip("198.18.20.1")],
            pod_hostname: "db-0".into(),
            pod_subdomain: "db".into(),
            ..Default::default()
        },
        asker,
    ]);
    let (publish, names) = names_channel("cluster.local");
    publish.send_replace(Arc::new(MeshNames::build(&store, "cluster.local")));
    let metrics = shunt::metrics::Metrics::new();
    let sockets = DnsSockets::bind(&["127.0.0.1:0".parse().expect("addr")]).expect("bind");
    let handle = serve(
        sockets,
        PodDns::kubernetes("default", "cluster.local").for_pod("sleep-7f9-x2"),
        names,
        Arc::new(Forwarder::new(Vec::new(), Duration::from_secs(5))),
        metrics.dns().clone(),
    )
    .expect("serve");
    let answer = ask_udp(
        handle.udp_addrs()[0],
        &query("db-0.db.default.svc.cluster.local.", RecordType::A, false),
    )
    .await;
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    assert_eq!(a_records(&answer), vec![ip("198.18.20.1")]);
    let scrape = metrics.encode(None);
    let line = "istio_dns_requests_total{request_query_type=\"a\",request_protocol=\"udp\",source_canonical_service=\"sleeper\",source_canonical_revision=\"v3\"} 1";
    assert!(scrape.contains(line), "{line} missing in\n{scrape}");
    handle.shutdown().await;
}

/// The upstreams come from a resolv.conf: a `nameserver` on a loopback
/// address of its own, port 53 (resolv.conf cannot say another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstreams_from_a_resolv_conf() {
    // A loopback address no one else uses (the whole 127/8 is on lo).
    let pid = std::process::id();
    let mut bound = None;
    for attempt in 0..20u32 {
        let candidate = Ipv4Addr::new(
            127,
            53,
            ((pid >> 8) % 250) as u8,
            ((pid + attempt) % 250 + 2) as u8,
        );
        if let Ok(udp) = UdpSocket::bind((candidate, 53)).await
            && let Ok(tcp) = TcpListener::bind((candidate, 53)).await
        {
            bound = Some((udp, tcp));
            break;
        }
    }
    let (udp, _tcp) = bound.expect("a free 127.53.x.y:53 (the tests run as root)");
    let upstream = udp.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65535];
        while let Ok((n, client)) = udp.recv_from(&mut buf).await {
            if let Some(answer) = upstream_answer(&buf[..n], true) {
                let _ = udp.send_to(&answer, client).await;
            }
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("resolv.conf");
    std::fs::write(
        &path,
        format!(
            "search default.svc.cluster.local\nnameserver {}\noptions ndots:5\n",
            upstream.ip()
        ),
    )
    .expect("write resolv.conf");
    let forwarder =
        Forwarder::from_resolv_conf(&path, Duration::from_secs(5)).expect("resolv.conf");
    assert_eq!(forwarder.upstreams(), [upstream]);
    let (_publish, names) = names_channel("cluster.local");
    let handle = serve(
        DnsSockets::bind(&["127.0.0.1:0".parse().expect("addr")]).expect("bind"),
        PodDns::kubernetes("default", "cluster.local"),
        names,
        Arc::new(forwarder),
        Arc::new(shunt::dns::DnsMetrics::default()),
    )
    .expect("serve");
    let answer = ask_udp(
        handle.udp_addrs()[0],
        &query("ext.example.org.", RecordType::A, false),
    )
    .await;
    assert_eq!(a_records(&answer), vec![ip(EXT_IP)]);
}

/// hickory's stub resolver, configured as a pod in `default` is (the
/// kubelet's search list, ndots:5), asking the proxy: mesh names in every
/// form on the first try, other names through the upstream, the large
/// answer over TCP after TC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stub_resolver_configured_as_a_pod_resolves_through_the_proxy() {
    use hickory_resolver::{
        Resolver,
        config::{
            ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig,
            ResolverOpts,
        },
        net::runtime::TokioRuntimeProvider,
    };
    let upstream = start_upstream().await;
    let server = start("default", vec![upstream], Duration::from_secs(5));
    assert_eq!(server.udp.port(), server.tcp.port());
    let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
        .into_iter()
        .map(|mut c| {
            c.port = server.udp.port();
            c
        })
        .collect();
    let search = [
        "default.svc.cluster.local.",
        "svc.cluster.local.",
        "cluster.local.",
    ]
    .iter()
    .map(|d| Name::from_str(d).expect("search domain"))
    .collect();
    let config = ResolverConfig::from_parts(
        None,
        search,
        vec![NameServerConfig::new(server.udp.ip(), true, connections)],
    );
    let mut options = ResolverOpts::default();
    options.ndots = 5;
    options.cache_size = 0;
    options.use_hosts_file = ResolveHosts::Never;
    options.ip_strategy = LookupIpStrategy::Ipv4Only;
    options.timeout = ANSWER_DEADLINE;
    let resolver = Resolver::builder_with_config(config, TokioRuntimeProvider::default())
        .with_options(options)
        .build()
        .expect("resolver");
    let lookup = |name: &'static str| {
        let resolver = &resolver;
        async move {
            let found = resolver
                .lookup_ip(name)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            found.iter().collect::<Vec<IpAddr>>()
        }
    };
    for name in [
        "web",
        "web.default",
        "web.default.svc",
        "web.default.svc.cluster.local",
    ] {
        assert_eq!(lookup(name).await, vec![ip(WEB_VIP)], "{name}");
    }
    // Mesh names never reached the upstream: only the forwarded ones below
    // count as upstream requests.
    assert!(
        !server
            .metrics
            .encode(None)
            .contains("istio_dns_upstream_requests_total{"),
        "a mesh name was forwarded"
    );
    assert_eq!(lookup("ext.example.org").await, vec![ip(EXT_IP)]);
    assert_eq!(
        lookup("big.example.org").await.len(),
        usize::from(BIG_RECORDS)
    );
}
