//! Unique names for topologies, and telling live ones from leftovers.
//!
//! A topology's prefix is `shunt-t<pid>-<n>`: the PID keeps concurrent test
//! processes apart, the per-process counter keeps parallel tests inside one
//! process apart. Every netns name (`<prefix>-<role>`) and the topology's
//! cgroup dir (`<cgroup2>/shunt-test/<prefix>`) starts with it, so a later run
//! can tell whether the owner is still alive and sweep what a killed run left.

use std::{
    collections::BTreeSet,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
};

use nix::{errno::Errno, sys::signal::kill, unistd::Pid};

/// Where `ip netns add` bind-mounts namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";

/// Every name this library creates starts with this.
pub const NAME_PREFIX: &str = "shunt-t";

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Counters of this process's topologies that are alive. A name carrying our
/// own PID but a counter not in here was left by an earlier process that had
/// the same PID, so it is as stale as one whose PID is dead.
static LIVE: Mutex<BTreeSet<u64>> = Mutex::new(BTreeSet::new());

fn live() -> MutexGuard<'static, BTreeSet<u64>> {
    // A panic elsewhere while holding the lock leaves the set intact.
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reserves a new counter and returns it with the prefix built from it.
pub(crate) fn allocate() -> (u64, String) {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    live().insert(n);
    (n, format!("{NAME_PREFIX}{}-{n}", std::process::id()))
}

/// Marks a topology's counter as finished: anything still carrying it is stale.
pub(crate) fn release(n: u64) {
    live().remove(&n);
}

/// Parses `shunt-t<pid>-<n>` or `shunt-t<pid>-<n>-<anything>`.
pub(crate) fn parse(name: &str) -> Option<(u32, u64)> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let (pid, rest) = rest.split_once('-')?;
    let n = rest.split('-').next()?;
    if pid.is_empty() || n.is_empty() {
        return None;
    }
    Some((pid.parse().ok()?, n.parse().ok()?))
}

/// True if `name` was made by this library for a process that no longer runs
/// (or for a finished topology of this process).
pub(crate) fn is_stale(name: &str) -> bool {
    let Some((pid, n)) = parse(name) else {
        return false;
    };
    if pid == std::process::id() {
        return !live().contains(&n);
    }
    !pid_alive(pid)
}

pub(crate) fn pid_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if raw <= 0 {
        return false;
    }
    // EPERM means the process exists but belongs to someone else.
    !matches!(kill(Pid::from_raw(raw), None), Err(Errno::ESRCH))
}
