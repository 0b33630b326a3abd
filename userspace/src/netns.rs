//! Network namespaces: open one by path, run code inside it, read its cookie,
//! tell two apart.
//!
//! Entering a namespace is per thread (`setns(CLONE_NEWNET)`), so work that
//! must happen inside a pod's netns runs on a worker thread that enters it
//! for that job and returns to the agent's own namespace afterwards
//! (`worker.rs`), or, for a short job such as creating a socket, the
//! calling thread enters it and comes back (`here.rs`). A socket keeps the
//! namespace it was created in, so the usual pattern is to create (bind,
//! connect, open netlink) inside and use the result anywhere.

mod here;
mod worker;

use std::{
    fs::File,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

/// How many times [`NetNs::run`] entered a namespace in this process.
static ENTERED: AtomicU64 = AtomicU64::new(0);

/// How many times this process has run code inside a network namespace
/// through [`NetNs::run`] (the cost the reconciler pays per pod; observers
/// must never add to it).
pub fn entries() -> u64 {
    ENTERED.load(Ordering::Relaxed)
}

/// Errors from opening or entering a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetNsError {
    #[error("cannot open network namespace {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot enter network namespace {path}: {source}")]
    Enter { path: PathBuf, source: nix::Error },
    #[error("the thread that entered network namespace {path} panicked")]
    ThreadPanicked { path: PathBuf },
    #[error("cannot start a thread to enter network namespace {path}: {source}")]
    Worker {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the identity of network namespace {path}: {source}")]
    Identity {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the cookie of network namespace {path}: {source}")]
    Cookie {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// An open handle on a network namespace (e.g. `/var/run/netns/NAME` or
/// `/proc/PID/ns/net`). Holding it keeps the namespace alive.
#[derive(Debug)]
pub struct NetNs {
    path: PathBuf,
    file: File,
}

impl NetNs {
    /// Opens the namespace at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NetNsError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| NetNsError::Open {
            path: path.clone(),
            source,
        })?;
        Ok(Self { path, file })
    }

    /// The namespace of the calling thread.
    pub fn current() -> Result<Self, NetNsError> {
        Self::open("/proc/thread-self/ns/net")
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on a thread that has entered this namespace and returns its
    /// result. The calling thread's namespace is never changed. The thread
    /// is one of a few long-lived workers (`worker.rs`): it enters this
    /// namespace for the job and returns to the agent's own afterwards.
    pub fn run<T, F>(&self, f: F) -> Result<T, NetNsError>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        ENTERED.fetch_add(1, Ordering::Relaxed);
        worker::run_in(&self.file, &self.path, f)
    }

    /// Runs `f` inside this namespace on the calling thread, which returns
    /// to its own namespace afterwards (`here.rs`). Only for short jobs
    /// that neither block nor yield, such as creating a socket; not counted
    /// in [`entries`].
    pub fn run_here<T>(&self, f: impl FnOnce() -> T) -> Result<T, NetNsError> {
        here::run_here(&self.file, &self.path, f)
    }

    /// The kernel's cookie for this namespace (`SO_NETNS_COOKIE`): a stable
    /// 64-bit id, the same value `bpf_get_netns_cookie()` returns to the
    /// programs. Read from a socket created inside the namespace.
    pub fn cookie(&self) -> Result<u64, NetNsError> {
        let cookie_err = |source| NetNsError::Cookie {
            path: self.path.clone(),
            source,
        };
        self.run(netns_cookie_of_current_thread)?
            .map_err(cookie_err)
    }

    /// True if `self` and `other` are the same namespace (same inode).
    pub fn same_as(&self, other: &NetNs) -> bool {
        matches!((self.id(), other.id()), (Ok(a), Ok(b)) if a == b)
    }

    /// Whether `path` names this namespace now (by identity: the same
    /// path may name a new namespace, two paths one). A path that cannot
    /// be read counts as this namespace only if this handle was opened
    /// from it: the namespace there is going away, and there is no other
    /// to move to yet.
    pub fn is_at(&self, path: &Path) -> bool {
        match NsId::of_path(path) {
            Ok(id) => self.id().is_ok_and(|own| own == id),
            Err(_) => self.path == path,
        }
    }

    /// This namespace's identity, checked to be a namespace file (see
    /// [`NsId::of_path`]).
    pub fn checked_id(&self) -> Result<NsId, NetNsError> {
        NsId::of_file(&self.file, &self.path)
    }

    /// This namespace's identity (see [`NsId`]).
    pub fn id(&self) -> Result<NsId, NetNsError> {
        self.file
            .metadata()
            .map(|meta| NsId::from(&meta))
            .map_err(|source| NetNsError::Identity {
                path: self.path.clone(),
                source,
            })
    }
}

/// Which namespace a path or handle names: the device and inode of its
/// nsfs file, the same for every path and handle of one namespace and
/// different for a new namespace at an old path (a pod sandbox recreated
/// under the same `/var/run/netns/NAME`, or a bind mount made again).
/// An inode number can be reused only once its namespace is gone, so two
/// ids compare safely while a handle keeps one of them alive — as the
/// redirector's enrolment and the proxy's socket thread do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NsId {
    dev: u64,
    ino: u64,
}

impl NsId {
    /// The identity of the namespace `path` names now (following
    /// `/proc/PID/ns/net`'s link, as opening it would). Anything but a
    /// namespace file is an error, not an identity: a bind-mount point
    /// whose mount is gone is an empty regular file for a moment, and
    /// reading its inode as a "new namespace" would send a pod to be
    /// served again in a namespace that does not exist.
    pub fn of_path(path: &Path) -> Result<Self, NetNsError> {
        let identity = |source| NetNsError::Identity {
            path: path.to_path_buf(),
            source,
        };
        // One open file for both questions: the path cannot change between.
        let file = File::open(path).map_err(identity)?;
        Self::of_file(&file, path)
    }

    /// The identity of the namespace the open `file` (opened from `path`,
    /// named in errors) is; anything but a namespace file is an error.
    pub fn of_file(file: &File, path: &Path) -> Result<Self, NetNsError> {
        let identity = |source| NetNsError::Identity {
            path: path.to_path_buf(),
            source,
        };
        let fs = nix::sys::statfs::fstatfs(file).map_err(|e| identity(e.into()))?;
        if fs.filesystem_type() != nix::sys::statfs::NSFS_MAGIC {
            return Err(identity(std::io::Error::other(
                "not a namespace file (its file system is not nsfs)",
            )));
        }
        file.metadata()
            .map(|meta| NsId::from(&meta))
            .map_err(identity)
    }
}

impl From<&std::fs::Metadata> for NsId {
    fn from(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        NsId {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

impl AsFd for NetNs {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// Cookie of the calling thread's network namespace.
pub fn netns_cookie_of_current_thread() -> std::io::Result<u64> {
    // An unbound socket is enough (and works before `lo` is up).
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(std::io::Error::from)?;
    socket_netns_cookie(socket.as_fd())
}

/// Cookie of the network namespace a socket lives in (`SO_NETNS_COOKIE`).
pub fn socket_netns_cookie(socket: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the fd is a live socket; `cookie` and `len` are valid for the
    // duration of the call and sized as the kernel expects.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_namespace_file_has_a_namespace_identity() {
        let own = Path::new("/proc/thread-self/ns/net");
        assert_eq!(
            NsId::of_path(own).expect("this thread's netns"),
            NsId::of_path(own).expect("the same again"),
            "one namespace, one identity"
        );
        // What a bind-mount point is once its mount is gone.
        let plain = tempfile::NamedTempFile::new().expect("temp file");
        match NsId::of_path(plain.path()) {
            Err(NetNsError::Identity { source, .. }) => {
                assert!(source.to_string().contains("nsfs"), "{source}")
            }
            other => panic!("a regular file has no namespace identity: {other:?}"),
        }
    }
}
