use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::Duration,
};

use super::*;

/// Where a task spawned on `handle` runs: the shard index its thread
/// reports.
fn shard_of(handle: &Handle) -> Option<usize> {
    let (tx, rx) = mpsc::channel();
    handle.spawn(async move {
        let _ = tx.send(current());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the shard ran the task")
}

#[test]
fn pods_take_the_shards_in_turn() {
    let data_path = DataPath::start(3).expect("shards");
    let shards = data_path.shards();
    assert_eq!(shards.len(), 3);
    let picked: Vec<Option<usize>> = (0..6)
        .map(|_| shard_of(&shards.pick().expect("a shard")))
        .collect();
    assert_eq!(
        picked,
        [0, 1, 2, 0, 1, 2].map(Some),
        "each shard in turn, each on its own thread"
    );
    assert_eq!(shard_of(&shards.first().expect("first")), Some(0));
    assert_eq!(current(), None, "the test's thread is no shard's");
    data_path.stop();
}

#[test]
fn a_shard_drives_its_own_io() {
    // Nothing but the shard's own thread drives its runtime: a listener
    // registered there accepts and echoes.
    let data_path = DataPath::start(1).expect("shards");
    let shard = data_path.shards().pick().expect("a shard");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    shard.spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::from_std(listener).expect("register");
        if let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 5];
            if s.read_exact(&mut buf).await.is_ok() {
                let _ = s.write_all(&buf).await;
            }
        }
    });
    let mut client = std::net::TcpStream::connect(addr).expect("connect");
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    use std::io::{Read, Write};
    client.write_all(b"shard").expect("write");
    let mut back = [0u8; 5];
    client.read_exact(&mut back).expect("echo");
    assert_eq!(&back, b"shard");
    data_path.stop();
}

#[test]
fn stopping_cancels_what_runs_on_the_shards() {
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let data_path = DataPath::start(2).expect("shards");
    let shards = data_path.shards();
    let dropped: Vec<Arc<AtomicBool>> = (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
    for flag in &dropped {
        let guard = SetOnDrop(flag.clone());
        shards.pick().expect("a shard").spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
    }
    data_path.stop();
    assert!(
        dropped.iter().all(|d| d.load(Ordering::SeqCst)),
        "every shard's pending task was dropped when the shards stopped"
    );
}

#[test]
fn without_shards_nothing_is_picked() {
    let none = Shards::none();
    assert!(none.is_empty());
    assert!(none.pick().is_none());
    assert!(none.first().is_none());
}
