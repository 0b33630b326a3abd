//! A short synchronous job inside another network namespace, on the
//! calling thread: `setns` in, the job, `setns` back. For the per-connection
//! socket of a pod (`proxy/socket.rs`): two `setns` calls cost far less than
//! handing the job to another thread and waiting for its answer (a wake-up
//! and two context switches each way, the proxy's largest per-connection
//! cost before). ztunnel creates its in-pod sockets the same way
//! (`InpodNetns::run`).
//!
//! The job must not block or yield: nothing else runs on this thread while
//! it is away from home, so a runtime worker may call this between polls.
//!
//! Home is the agent's own namespace, read once per process from the first
//! caller's thread: the runtime threads that call this all live there (every
//! call returns there), so it is never a pod's. One descriptor for the
//! process, not one per thread.

use std::{fs::File, path::Path, sync::OnceLock};

use nix::sched::{CloneFlags, setns};

use super::NetNsError;

/// The calling thread's own namespace.
const THREAD_HOME: &str = "/proc/thread-self/ns/net";

/// The agent's namespace, opened by the first job.
static HOME: OnceLock<File> = OnceLock::new();

/// Runs `f` on the calling thread inside the namespace `netns` (opened
/// from `path`) and returns the thread home afterwards, also if `f`
/// unwinds. An error means the namespace could not be entered and `f`
/// never ran.
pub(super) fn run_here<T>(
    netns: &File,
    path: &Path,
    f: impl FnOnce() -> T,
) -> Result<T, NetNsError> {
    let home = match HOME.get() {
        Some(file) => file,
        None => {
            let file = File::open(THREAD_HOME).map_err(|source| NetNsError::Open {
                path: THREAD_HOME.into(),
                source,
            })?;
            // Two first callers race: both opened the same namespace, one
            // copy is kept.
            HOME.get_or_init(|| file)
        }
    };
    setns(netns, CloneFlags::CLONE_NEWNET).map_err(|source| NetNsError::Enter {
        path: path.to_path_buf(),
        source,
    })?;
    let _back = GoHome(home);
    Ok(f())
}

/// Returns the thread to its home namespace when dropped.
struct GoHome<'a>(&'a File);

impl Drop for GoHome<'_> {
    fn drop(&mut self) {
        if let Err(e) = setns(self.0, CloneFlags::CLONE_NEWNET) {
            // A runtime thread left in a pod's namespace would create the
            // agent's own sockets there from now on, unseen: nothing this
            // process does after that can be trusted, so it stops (the
            // supervisor restarts it). `setns` to a namespace this thread
            // was in, through a handle it holds, has no known way to fail.
            tracing::error!(error = %e, "cannot return a thread to the agent's own network namespace after creating a socket in a pod's: stopping");
            crate::logging::flush();
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netns::{NetNs, NsId};

    fn own_netns() -> NsId {
        NsId::of_path(Path::new(THREAD_HOME)).expect("own netns")
    }

    #[test]
    fn a_job_runs_in_the_namespace_and_the_thread_returns_home() {
        let home = own_netns();
        // A namespace of our own, held open by a thread that made it.
        let made = std::thread::spawn(|| {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).ok()?;
            NetNs::current().ok()
        })
        .join()
        .expect("join");
        let Some(pod) = made else {
            eprintln!("skipped: cannot create a network namespace (not root?)");
            return;
        };
        let inside = run_here(&pod.file, pod.path(), own_netns).expect("run_here");
        assert_eq!(inside, pod.id().expect("pod netns id"));
        assert_ne!(inside, home);
        assert_eq!(own_netns(), home, "the thread is home again");
    }

    #[test]
    fn a_namespace_that_cannot_be_entered_is_an_error_and_the_job_never_runs() {
        let home = own_netns();
        // Not a namespace file: setns fails with EINVAL.
        let not_ns = File::open("/proc/self/status").expect("open");
        let mut ran = false;
        let result = run_here(&not_ns, Path::new("/proc/self/status"), || ran = true);
        assert!(
            matches!(result, Err(NetNsError::Enter { .. })),
            "{result:?}"
        );
        assert!(!ran);
        assert_eq!(own_netns(), home);
    }
}
