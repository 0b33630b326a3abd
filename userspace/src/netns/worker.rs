//! The threads that run code inside other network namespaces.
//!
//! `setns(CLONE_NEWNET)` moves only the calling thread, so a job in a pod's
//! netns runs on another thread. A fresh thread per job was about half of
//! a cold start's reconcile CPU (creating and ending threads: four per
//! enrolment, see docs/BENCHMARKS.md), so the threads live on instead: a
//! worker enters the job's namespace, runs the job, and returns to its
//! home — the agent's own namespace (the process's main thread's, which
//! the agent never changes), held open for the whole process. Idle
//! workers wait in a small pool; a caller takes one (or starts one when
//! none is idle: concurrent callers never wait for each other) and puts
//! it back after its job.
//!
//! Never a job in the wrong namespace: a job runs only after `setns` into
//! its own namespace succeeded; if that fails the job is dropped unrun and
//! the caller gets the error (the worker, still home, is reused). A worker
//! that cannot return home after a job is never given another: it reports
//! so, ends, and the next job gets a new thread.

use std::{
    fs::File,
    panic::AssertUnwindSafe,
    path::Path,
    sync::{Mutex, OnceLock, mpsc},
};

use nix::sched::{CloneFlags, setns};
use tracing::error;

use super::NetNsError;

/// Idle workers kept for the next job. The reconcile thread is the only
/// steady caller (one job at a time); a few more cover the rare
/// concurrent caller without keeping threads nobody uses.
const MAX_IDLE: usize = 4;

/// The agent's own namespace, where every worker starts and returns.
const HOME: &str = "/proc/self/ns/net";

static IDLE: Mutex<Vec<Worker>> = Mutex::new(Vec::new());

/// The handle on [`HOME`], opened once (by the first job).
fn home() -> Result<&'static File, NetNsError> {
    static HOME_NS: OnceLock<File> = OnceLock::new();
    if let Some(file) = HOME_NS.get() {
        return Ok(file);
    }
    let file = File::open(HOME).map_err(|source| NetNsError::Open {
        path: HOME.into(),
        source,
    })?;
    Ok(HOME_NS.get_or_init(|| file))
}

/// A job as a worker sees it: the namespace to enter (a duplicate of the
/// caller's handle) and the work, type-erased. Fields drop in order: if
/// the request is ever dropped whole, the work goes before `finished`
/// tells the caller it may return.
struct Request {
    work: Option<Box<dyn FnOnce() + Send + 'static>>,
    finished: mpsc::SyncSender<Finished>,
    netns: File,
}

/// What a worker reports once the job's work is gone (run or dropped).
struct Finished {
    /// `Err` if it could not enter the namespace (the work was not run).
    entered: Result<(), nix::Error>,
    /// Whether the worker is back home and may take another job.
    home: bool,
}

/// A worker thread, as its callers hold it: the end of its queue.
struct Worker {
    requests: mpsc::Sender<Request>,
}

impl Worker {
    /// Starts a worker and waits until it is home (it inherits the
    /// namespace of whichever thread starts it, maybe a pod's).
    fn start(home: &'static File) -> std::io::Result<Worker> {
        let (requests, queue) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<nix::Result<()>>(1);
        std::thread::Builder::new()
            .name("shunt-netns".into())
            .spawn(move || {
                let at_home = setns(home, CloneFlags::CLONE_NEWNET);
                let ok = at_home.is_ok();
                let _ = ready_tx.send(at_home);
                if ok {
                    serve(home, queue);
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("the netns worker ended before it started"))?
            .map_err(std::io::Error::from)?;
        Ok(Worker { requests })
    }
}

/// A worker's life, from home: one job after another until it cannot
/// return home or nobody holds its queue.
fn serve(home: &File, queue: mpsc::Receiver<Request>) {
    while let Ok(mut request) = queue.recv() {
        let entered = setns(&request.netns, CloneFlags::CLONE_NEWNET);
        let work = request.work.take();
        match (&entered, work) {
            (Ok(()), Some(work)) => {
                // A panic is the caller's to report (its result never
                // arrives); the worker itself goes on.
                let _ = std::panic::catch_unwind(AssertUnwindSafe(work));
            }
            // Not entered: dropped unrun (before `finished` is sent).
            (_, work) => drop(work),
        }
        let home = match entered {
            Err(_) => true,
            Ok(()) => match setns(home, CloneFlags::CLONE_NEWNET) {
                Ok(()) => true,
                Err(e) => {
                    error!(error = %e, "a netns worker cannot return to the agent's own network namespace; ending it");
                    false
                }
            },
        };
        let _ = request.finished.send(Finished { entered, home });
        if !home {
            return;
        }
    }
}

/// Runs `f` inside the namespace `netns` (named `path` in errors) on a
/// worker and returns its result once it is done.
pub(super) fn run_in<T, F>(netns: &File, path: &Path, f: F) -> Result<T, NetNsError>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    let worker_error = |source| NetNsError::Worker {
        path: path.to_path_buf(),
        source,
    };
    let home = home()?;
    let netns = netns.try_clone().map_err(worker_error)?;
    let (result_tx, result_rx) = mpsc::sync_channel::<T>(1);
    let (finished_tx, finished_rx) = mpsc::sync_channel::<Finished>(1);
    let work: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
        let _ = result_tx.send(f());
    });
    // SAFETY: only the lifetime is erased (same layout). The work borrows
    // from the caller's frame, and this function does not return before
    // the work is gone: it waits below until the worker reports that the
    // work ran or was dropped (`finished`, sent only after that), or, if
    // the worker vanished without a report, gets the request back from
    // the failed send (and drops it here) — the work is never left with a
    // thread that outlives this call.
    let work = unsafe {
        std::mem::transmute::<Box<dyn FnOnce() + Send + '_>, Box<dyn FnOnce() + Send + 'static>>(
            work,
        )
    };
    let mut request = Request {
        work: Some(work),
        finished: finished_tx,
        netns,
    };
    let (worker, finished) = loop {
        let idle = IDLE.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let worker = match idle {
            Some(worker) => worker,
            None => Worker::start(home).map_err(worker_error)?,
        };
        match worker.requests.send(request) {
            Ok(()) => {}
            // That worker has ended (it could not return home; it is
            // never put back, so this is defensive): another one.
            Err(mpsc::SendError(back)) => {
                request = back;
                continue;
            }
        }
        match finished_rx.recv() {
            Ok(finished) => break (worker, finished),
            // `serve` always reports before it lets a request go; if the
            // thread vanished anyway, the request and its work were
            // dropped with it (work first: field order).
            Err(mpsc::RecvError) => {
                return Err(NetNsError::ThreadPanicked {
                    path: path.to_path_buf(),
                });
            }
        }
    };
    if finished.home {
        let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(worker);
        }
    }
    finished.entered.map_err(|source| NetNsError::Enter {
        path: path.to_path_buf(),
        source,
    })?;
    result_rx
        .try_recv()
        .map_err(|_| NetNsError::ThreadPanicked {
            path: path.to_path_buf(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netns::{NetNs, NsId};

    fn own_netns() -> NsId {
        NsId::of_path(Path::new("/proc/thread-self/ns/net")).expect("own netns")
    }

    /// A new, empty network namespace, held open (made on a thread of
    /// its own, which ends), or `None` without the privilege to make one.
    fn fresh_netns() -> Option<NetNs> {
        std::thread::spawn(|| match nix::sched::unshare(CloneFlags::CLONE_NEWNET) {
            Ok(()) => Some(NetNs::current().expect("open the new netns")),
            Err(nix::errno::Errno::EPERM) => None,
            Err(e) => panic!("unshare: {e}"),
        })
        .join()
        .expect("unshare thread")
    }

    #[test]
    fn a_job_runs_in_the_namespace_it_names_and_the_caller_stays_home() {
        let home = own_netns();
        let Some(pod) = fresh_netns() else {
            eprintln!("SKIPPED: making a network namespace needs CAP_SYS_ADMIN");
            return;
        };
        let pod_id = pod.id().expect("id");
        assert_ne!(pod_id, home);
        for _ in 0..3 {
            let local = String::from("borrowed from the caller");
            let (seen, borrowed) = pod.run(|| (own_netns(), local.len())).expect("run");
            assert_eq!(seen, pod_id, "the job ran in the pod's namespace");
            assert_eq!(borrowed, local.len());
            // The worker went home: a job in the caller's own namespace
            // sees it.
            let current = NetNs::current().expect("current");
            assert_eq!(current.run(own_netns).expect("run"), home);
            assert_eq!(own_netns(), home, "the caller never moves");
        }
    }

    #[test]
    fn a_namespace_that_cannot_be_entered_is_an_error_and_the_job_never_runs() {
        // Not a namespace file: setns fails with EINVAL.
        let not_ns = NetNs::open("/proc/self/stat").expect("open");
        let ran = std::sync::atomic::AtomicBool::new(false);
        let outcome = not_ns.run(|| ran.store(true, std::sync::atomic::Ordering::SeqCst));
        assert!(
            matches!(outcome, Err(NetNsError::Enter { .. })),
            "{outcome:?}"
        );
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
        // And the next job still runs.
        let ns = NetNs::current().expect("current");
        assert_eq!(ns.run(|| 7).expect("run"), 7);
    }

    #[test]
    fn a_panicking_job_is_reported_and_the_workers_go_on() {
        let ns = NetNs::current().expect("current");
        let outcome = ns.run(|| -> u32 { panic!("job panics on purpose") });
        assert!(
            matches!(outcome, Err(NetNsError::ThreadPanicked { .. })),
            "{outcome:?}"
        );
        assert_eq!(ns.run(|| 3).expect("run"), 3);
    }

    #[test]
    fn a_worker_that_cannot_return_home_runs_its_job_then_ends() {
        let target = NetNs::current().expect("current");
        // Not a namespace file: returning there fails.
        let bogus_home = File::open("/proc/self/stat").expect("open");
        let (requests, queue) = mpsc::channel::<Request>();
        let thread = std::thread::spawn(move || serve(&bogus_home, queue));
        let (result_tx, result_rx) = mpsc::sync_channel(1);
        let (finished_tx, finished_rx) = mpsc::sync_channel(1);
        requests
            .send(Request {
                work: Some(Box::new(move || {
                    let _ = result_tx.send(own_netns());
                })),
                finished: finished_tx,
                netns: target.file.try_clone().expect("dup"),
            })
            .expect("send");
        let finished = finished_rx.recv().expect("finished");
        assert!(finished.entered.is_ok());
        assert!(!finished.home, "the worker knows it is not home");
        assert_eq!(result_rx.recv().expect("result"), own_netns());
        // It ended by itself: nothing more can be sent to it.
        thread.join().expect("worker thread");
        let (finished_tx, _) = mpsc::sync_channel(1);
        let refused = requests.send(Request {
            work: None,
            finished: finished_tx,
            netns: target.file.try_clone().expect("dup"),
        });
        assert!(refused.is_err());
    }

    #[test]
    fn jobs_reuse_threads() {
        let ns = NetNs::current().expect("current");
        let first = ns.run(|| std::thread::current().id()).expect("run");
        let ids: Vec<_> = (0..20)
            .map(|_| ns.run(|| std::thread::current().id()).expect("run"))
            .collect();
        // Other tests share the pool, so the same thread is not promised
        // every time; but twenty jobs in a row never need twenty threads.
        let distinct: std::collections::BTreeSet<String> = std::iter::once(first)
            .chain(ids)
            .map(|id| format!("{id:?}"))
            .collect();
        assert!(distinct.len() <= MAX_IDLE + 1, "{distinct:?}");
    }
}
