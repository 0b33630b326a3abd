//! The data path on shards (`shunt::shards`): each node proxy serves its
//! pods on two single-threaded runtimes of its own, as the agent does (one
//! per CPU), and HBONE carries bytes between pods served on different
//! shards of both nodes.

#[path = "support/mesh.rs"]
mod mesh;

use mesh::{Mesh, echo_roundtrip, pod};
use shunt::{identity::IdentityConfig, proxy::ProxyConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_served_on_every_shard() {
    let m = Mesh::with_shards(
        "shards-spread",
        vec![
            pod("node-a", "client-1", "sleep", true),
            pod("node-a", "client-2", "curl", true),
            pod("node-b", "server-1", "httpbin", true),
            pod("node-b", "server-2", "echo", true),
        ],
        ProxyConfig::default(),
        IdentityConfig::default(),
        2,
    )
    .await;
    m.echo_server("server-1", 8080);
    m.echo_server("server-2", 8080);

    // Two connections from the first client (one pooled HBONE connection),
    // one from the second.
    let mut first = m
        .connect_via_proxy("client-1", m.addr("server-1", 8080))
        .await;
    echo_roundtrip(&mut first, b"client 1 to server 1").await;
    let mut again = m
        .connect_via_proxy("client-1", m.addr("server-1", 8080))
        .await;
    echo_roundtrip(&mut again, b"client 1 to server 1, pooled").await;
    let mut second = m
        .connect_via_proxy("client-2", m.addr("server-2", 8080))
        .await;
    echo_roundtrip(&mut second, b"client 2 to server 2").await;
    echo_roundtrip(&mut first, b"still open").await;
    drop((first, again, second));

    // Counted when they end.
    m.wait_for_stats("the connections counted", |s| {
        s["node-a"].outbound_hbone >= 3
    })
    .await;
    let a = m.nodes["node-a"].proxy.stats();
    let b = m.nodes["node-b"].proxy.stats();
    // Each pod is on a shard of its own: the clients' outbound
    // connections (2 and 1) on node A, the servers' inbound HBONE
    // connections (one each) on node B, counted on the shard that
    // accepted them.
    let mut on_a = a.accepted_by_shard.clone();
    on_a.sort_unstable();
    assert_eq!(on_a, vec![1, 2], "node A, by shard: {a:?}");
    assert_eq!(b.accepted_by_shard, vec![1, 1], "node B, by shard: {b:?}");
    assert_eq!(a.outbound_hbone, 3, "{a:?}");
    assert_eq!(a.refused + a.failed + b.refused + b.failed, 0);
}
