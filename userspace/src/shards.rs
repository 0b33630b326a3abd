//! The data path's threads: one single-threaded tokio runtime per worker
//! (`shunt-proxy`), each on a thread of its own — a shard. The proxy puts
//! each pod on a shard, round robin ([`Shards::pick`]): the pod's
//! listeners, every connection they accept, its outbound HBONE pool and
//! the streams on it run there, so a connection's tasks wake each other on
//! one thread. The kernel spreads the shards' threads over the CPUs.
//!
//! Why not one multi-threaded runtime: its workers read the clock four
//! times and update a floating-point average around every batch of tasks
//! (tokio's scheduler statistics, not optional), and take locks and atomics
//! a single-threaded scheduler does without. A proxied 1-byte
//! request/response is two such batches per agent; measured, the shards
//! spend ≈ 1,070 fewer instructions per transaction per agent
//! (docs/BENCHMARKS.md, "The data path on shards"). What is given up: work
//! stealing. One pod's proxying runs on one CPU at a time; many pods use
//! every shard.
//!
//! The runtimes have no time driver: the data path's timers are on the
//! timer thread (`timers.rs`).
//!
//! Without [`DataPath::start`] (unit tests, the library used in-process)
//! [`Shards::none`] leaves everything on the current runtime.

use std::{
    cell::Cell,
    io,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    thread::JoinHandle,
};

use tokio::{runtime::Handle, sync::oneshot};

thread_local! {
    /// The shard this thread runs, if it is a shard's.
    static HERE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The shards' threads, owned by `main`: started before the agent runs,
/// stopped after its proxy drained.
pub struct DataPath {
    threads: Vec<(oneshot::Sender<()>, JoinHandle<()>)>,
    shards: Shards,
}

impl DataPath {
    /// Starts `count` shards (at least one), each a current-thread runtime
    /// with I/O only, running on a thread named `shunt-proxy` until
    /// [`DataPath::stop`], and the timer thread (`timers::install`) if it
    /// is not running yet.
    pub fn start(count: usize) -> io::Result<DataPath> {
        // The shards keep no time: their timers are the timer thread's.
        crate::timers::install()?;
        let count = count.max(1);
        let mut threads = Vec::with_capacity(count);
        let mut handles = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name("shunt-proxy".into())
                .spawn(move || {
                    HERE.with(|here| here.set(Some(index)));
                    // Drives the shard's tasks and I/O until told to stop
                    // (or `stop` is dropped); its tasks are then dropped here,
                    // on their own thread.
                    let _ = runtime.block_on(stopped);
                })?;
            threads.push((stop, thread));
        }
        Ok(DataPath {
            threads,
            shards: Shards {
                inner: Some(Arc::new(Inner {
                    handles,
                    next: AtomicUsize::new(0),
                })),
            },
        })
    }

    /// The shards, to spawn on.
    pub fn shards(&self) -> Shards {
        self.shards.clone()
    }

    /// Stops every shard (what is left of its tasks is cancelled) and waits
    /// for its thread.
    pub fn stop(self) {
        for (stop, thread) in self.threads {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}

/// Handles to the shards, cheap to clone; [`Shards::none`] when the data
/// path runs on the caller's runtime.
#[derive(Clone, Default)]
pub struct Shards {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    handles: Vec<Handle>,
    /// Round robin over `handles`.
    next: AtomicUsize,
}

impl Shards {
    /// No shards: everything is spawned on the current runtime.
    pub fn none() -> Shards {
        Shards::default()
    }

    /// How many shards there are (0 for [`Shards::none`]).
    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |inner| inner.handles.len())
    }

    /// Whether this is [`Shards::none`].
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first shard's handle: where the reconcile thread runs the
    /// proxy's calls (`agent::ProxyHandle`). None without shards.
    pub fn first(&self) -> Option<Handle> {
        self.inner.as_ref()?.handles.first().cloned()
    }

    /// The next shard in turn: where a new pod is served. None without
    /// shards.
    pub fn pick(&self) -> Option<Handle> {
        let inner = self.inner.as_ref()?;
        let index = inner.next.fetch_add(1, Ordering::Relaxed) % inner.handles.len();
        Some(inner.handles[index].clone())
    }
}

/// Spawns `task` on `runtime`, or on the current runtime without one: for
/// what must run on the runtime its owner was made on (a pod's shard, the
/// control runtime), wherever it is started from.
pub fn spawn_on<F>(runtime: Option<&Handle>, task: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    match runtime {
        Some(runtime) => runtime.spawn(task),
        None => tokio::spawn(task),
    }
}

/// The shard the calling thread runs, if it is a shard's thread.
pub fn current() -> Option<usize> {
    HERE.with(Cell::get)
}

#[cfg(test)]
#[path = "shards_tests.rs"]
mod tests;
