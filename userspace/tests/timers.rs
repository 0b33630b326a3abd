//! The data path's timers live off its runtime (`shunt::timers`): a worker
//! of a runtime whose only pending timer was made there sleeps in
//! `epoll_wait` without a timeout, where a `tokio::time` timer would give
//! it one. Read from the kernel: `/proc/self/task/<tid>/syscall` names the
//! syscall a blocked thread is in and its arguments.
//!
//! Its own test binary: `install` is for the whole process, and the library's
//! unit tests drive their timers with tokio's paused clock.

use std::{future::Future, time::Duration};

use shunt::timers;

/// x86_64's `epoll_wait` and `epoll_pwait`, aarch64's `epoll_pwait`: the
/// timeout is the fourth argument of each.
const EPOLL_WAITS: &[u64] = if cfg!(target_arch = "x86_64") {
    &[232, 281]
} else {
    &[22]
};

/// The timeout (ms) the runtime's one worker sleeps with while `pending`,
/// spawned on it, waits on a timer it made.
fn worker_sleep_timeout<F>(pending: F) -> i32
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    runtime.spawn(async move {
        let _ = tid_tx.send(nix::unistd::gettid().as_raw());
        pending.await;
    });
    let tid = tid_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the worker ran the task");
    let path = format!("/proc/self/task/{tid}/syscall");
    // The worker reaches its sleep within microseconds once the task has
    // parked.
    let timeout =
        shunt_testbed::poll::until(Duration::from_secs(10), Duration::from_millis(5), || {
            let line = std::fs::read_to_string(&path).expect("the worker's syscall");
            let fields: Vec<&str> = line.split_whitespace().collect();
            let nr = fields.first().and_then(|f| f.parse::<u64>().ok())?;
            if !EPOLL_WAITS.contains(&nr) {
                return None;
            }
            let timeout = fields
                .get(4)
                .and_then(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok())
                .expect("epoll_wait's timeout argument");
            // An `int` argument: the register's low 32 bits. A zero timeout is
            // tokio's passing look for events, not a sleep.
            Some(timeout as u32 as i32).filter(|&t| t != 0)
        })
        .expect("the worker slept in epoll_wait");
    runtime.shutdown_background();
    timeout
}

#[test]
fn data_path_workers_sleep_without_a_timeout_while_its_timers_wait() {
    // The measurement tells the two apart: a timer on the worker's own
    // runtime sets the sleep's timeout.
    let own = worker_sleep_timeout(async {
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    assert!(
        (1..=60_000).contains(&own),
        "a tokio::time timer 60 s away gives the worker a timeout (got {own} ms)"
    );

    timers::install().expect("the timer thread");
    let moved = worker_sleep_timeout(async {
        let _ = timers::timeout(Duration::from_secs(60), std::future::pending::<()>()).await;
    });
    assert_eq!(
        moved, -1,
        "with the data path's timers on the timer thread, the worker sleeps until woken"
    );
    let moved = worker_sleep_timeout(async {
        timers::sleep(Duration::from_secs(60)).await;
    });
    assert_eq!(moved, -1);
}

#[test]
fn timers_fire_on_a_runtime_without_a_time_driver() {
    timers::install().expect("the timer thread");
    // No `enable_time`: a `tokio::time` timer made here would panic.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        timers::sleep(Duration::from_millis(10)).await;
        let started = tokio::time::Instant::now();
        timers::sleep_until(started + Duration::from_millis(10)).await;
        assert!(started.elapsed() >= Duration::from_millis(10));
        let expired = timers::timeout(Duration::from_millis(10), std::future::pending::<()>());
        assert!(expired.await.is_err(), "the timeout fires");
        let done = timers::timeout_at(
            tokio::time::Instant::now() + Duration::from_secs(60),
            async { 7 },
        );
        assert_eq!(done.await.ok(), Some(7));
    });
}

/// The proxy asks for a pod's certificate on every connection it serves,
/// on a data-path shard, which has no time driver (`shards.rs`): the
/// wait for a certificate still being issued must not need one.
#[test]
fn a_certificate_is_looked_up_on_a_runtime_without_a_time_driver() {
    use shunt::{
        identity::{IdentityConfig, IdentityManager, ca::BuiltinCa},
        state::{SpiffeId, TrustDomain},
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = BuiltinCa::load_or_generate(&dir.path().join("ca"), &TrustDomain::default())
        .expect("generate");
    let control = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("control runtime");
    let manager = control.block_on(async {
        IdentityManager::new(std::sync::Arc::new(ca), IdentityConfig::default())
    });
    let identity = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sleep");
    let data_path = shunt::shards::DataPath::start(1).expect("a shard");
    let shard = data_path.shards().pick().expect("the shard");
    // On the shard, as the proxy's `add_pod` and connections are: a panic
    // would end the task.
    let asked = shard.spawn(async move {
        manager.register(&identity);
        manager.certificate(&identity).await.is_ok()
    });
    let cert = control.block_on(asked);
    data_path.stop();
    assert_eq!(
        cert.ok(),
        Some(true),
        "the certificate is issued and handed over on the data path's runtime"
    );
}
