//! Cgroup v2 dirs for test processes.
//!
//! The agent's sock_ops and connect programs attach to a cgroup and see only
//! sockets created by processes inside it, and a socket's cgroup is fixed when
//! it is created. So test workloads are started *already inside* their cgroup
//! ([`Cgroup::command`] / [`Cgroup::place`]) rather than moved in later.
//!
//! Cleanup never kills what it did not start. When a cgroup is removed, each
//! process still in it is handled by how it got there:
//! - moved in with [`Cgroup::add_pid`]: moved back to the cgroup it came from;
//! - a descendant of this process (started via [`Cgroup::command`], or forked
//!   by something we started): killed with SIGKILL;
//! - anything else: moved to the cgroup2 root, with a warning on stderr.

use std::{
    collections::HashMap,
    ffi::CString,
    fs, io,
    os::unix::{ffi::OsStrExt, fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard},
    thread,
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::{
    Topology,
    error::{Result, TestbedError},
    warn,
};

/// Dir below the cgroup2 mount holding one dir per topology (or prefix).
pub const CGROUP_PARENT: &str = "shunt-test";

/// Bounds for removing a cgroup: killed processes take a moment to exit.
const RMDIR_ATTEMPTS: u32 = 200;
const RMDIR_TIME: Duration = Duration::from_secs(5);
/// Agents may nest cgroups below the topology's root; deeper than this is a bug.
const MAX_DEPTH: usize = 32;

/// Processes moved in by [`Cgroup::add_pid`], keyed by (pid, start time) so a
/// recycled PID is not mistaken for the process we moved, with the cgroup dir
/// to move them back to.
static MOVED_IN: Mutex<Option<HashMap<(u32, u64), PathBuf>>> = Mutex::new(None);

fn moved_in() -> MutexGuard<'static, Option<HashMap<(u32, u64), PathBuf>>> {
    MOVED_IN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The cgroup v2 mount point, from `/proc/self/mounts` (`/sys/fs/cgroup` on
/// most nodes; `/sys/fs/cgroup/unified` on hybrid-hierarchy machines).
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")
        .map_err(|e| TestbedError::io("cannot read /proc/self/mounts", e))?;
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let _source = fields.next()?;
            let target = fields.next()?;
            let fstype = fields.next()?;
            (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(target)))
        })
        .next()
        .ok_or(TestbedError::NoCgroup2)
}

/// `/proc/self/mounts` escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && let Some(digits) = field.get(i + 1..i + 4)
            && let Ok(value) = u8::from_str_radix(digits, 8)
        {
            out.push(value);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Something a [`Cgroup`] can be created below: a [`Topology`] (its
/// [`Topology::cgroup_root`]) or a bare prefix string, giving
/// `<cgroup2>/shunt-test/<prefix>/`. Dirs for a prefix are removed by the
/// stale sweep only if the prefix follows the `shunt-t<pid>-<n>` pattern.
pub trait CgroupParent {
    /// Creates (if needed) and returns the parent dir.
    fn cgroup_parent_dir(&self) -> Result<PathBuf>;
}

impl CgroupParent for Topology {
    fn cgroup_parent_dir(&self) -> Result<PathBuf> {
        self.cgroup_root()
    }
}

impl CgroupParent for str {
    fn cgroup_parent_dir(&self) -> Result<PathBuf> {
        check_component("cgroup prefix", self)?;
        let dir = cgroup2_mount()?.join(CGROUP_PARENT).join(self);
        create_dir_all(&dir)?;
        Ok(dir)
    }
}

/// An existing cgroup directory (e.g. an agent's `--cgroup-root`).
impl CgroupParent for Path {
    fn cgroup_parent_dir(&self) -> Result<PathBuf> {
        Ok(self.to_path_buf())
    }
}

impl CgroupParent for String {
    fn cgroup_parent_dir(&self) -> Result<PathBuf> {
        self.as_str().cgroup_parent_dir()
    }
}

pub(crate) fn create_dir_all(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)
        .map_err(|e| TestbedError::io(format!("cannot create cgroup dir {}", dir.display()), e))
}

pub(crate) fn check_component(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(TestbedError::Invalid(format!(
            "{what} {name:?} must be 1-64 characters of [A-Za-z0-9._-]"
        )))
    }
}

/// A cgroup v2 dir made for a test; removed (see the module docs for what
/// happens to processes still inside) when dropped.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
    mount: PathBuf,
    /// `<path>/cgroup.procs`, prepared before any fork: the pre-exec hook may
    /// not allocate.
    procs_file: CString,
}

impl Cgroup {
    /// Creates `name` below `parent` (a [`Topology`] or a prefix `str`). Fails
    /// if it already exists: removing it later would destroy someone else's.
    pub fn create<P: CgroupParent + ?Sized>(parent: &P, name: &str) -> Result<Cgroup> {
        check_component("cgroup name", name)?;
        let mount = cgroup2_mount()?;
        let path = parent.cgroup_parent_dir()?.join(name);
        fs::create_dir(&path)
            .map_err(|e| TestbedError::io(format!("cannot create cgroup {}", path.display()), e))?;
        let procs_file = CString::new(path.join("cgroup.procs").as_os_str().as_bytes())
            .map_err(|_| TestbedError::Invalid(format!("NUL byte in {}", path.display())))?;
        Ok(Cgroup {
            path,
            mount,
            procs_file,
        })
    }

    /// The cgroup's dir, e.g. `/sys/fs/cgroup/shunt-test/shunt-t42-0/app`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path as `/proc/PID/cgroup` shows it (relative to the cgroup2 root),
    /// e.g. `/shunt-test/shunt-t42-0/app`.
    pub fn hierarchy_path(&self) -> String {
        let relative = self.path.strip_prefix(&self.mount).unwrap_or(&self.path);
        format!("/{}", relative.display())
    }

    /// The cgroup id, as `bpf_get_current_cgroup_id()` and
    /// `bpf_skb_cgroup_id()` report it (the dir's inode number on cgroup2).
    pub fn id(&self) -> Result<u64> {
        fs::metadata(&self.path)
            .map(|m| m.ino())
            .map_err(|e| TestbedError::io(format!("cannot stat {}", self.path.display()), e))
    }

    /// PIDs currently in the cgroup.
    pub fn pids(&self) -> Result<Vec<u32>> {
        read_procs(&self.path)
    }

    /// Moves a running process (all its threads) into the cgroup. Only sockets
    /// it creates afterwards belong to the cgroup. It is moved back to where it
    /// came from when the cgroup is removed.
    pub fn add_pid(&self, pid: u32) -> Result<()> {
        let origin = current_cgroup_dir(pid, &self.mount);
        let start = start_time(pid);
        write_pid(&self.path, pid)?;
        if let (Some(origin), Some(start)) = (origin, start) {
            // Keep the first origin: moving between two of our cgroups must
            // still return the process to where it lived before the test.
            moved_in()
                .get_or_insert_with(HashMap::new)
                .entry((pid, start))
                .or_insert(origin);
        }
        Ok(())
    }

    /// Makes `cmd` join this cgroup in the child, between fork and exec, so
    /// every socket the program opens is charged to the cgroup. Combine with
    /// [`crate::Pod::command`] to run a program in a pod's netns *and* in
    /// this cgroup.
    pub fn place<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        let procs_file = self.procs_file.clone();
        // SAFETY: the hook only calls async-signal-safe functions (open,
        // write, close, errno read) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs_file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" means the writing process itself.
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let result = if written == 1 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                };
                libc::close(fd);
                result
            })
        }
    }

    /// A [`Command`] for `program` that starts inside this cgroup.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        self.place(&mut cmd);
        cmd
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.path, &self.mount) {
            warn(format_args!("cgroup cleanup: {e}"));
        }
    }
}

fn read_procs(dir: &Path) -> Result<Vec<u32>> {
    let file = dir.join("cgroup.procs");
    let text = fs::read_to_string(&file)
        .map_err(|e| TestbedError::io(format!("cannot read {}", file.display()), e))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

fn write_pid(dir: &Path, pid: u32) -> Result<()> {
    let file = dir.join("cgroup.procs");
    fs::write(&file, pid.to_string())
        .map_err(|e| TestbedError::io(format!("cannot move pid {pid} into {}", file.display()), e))
}

/// The cgroup2 dir a process is in, from its `0::/path` line.
fn current_cgroup_dir(pid: u32, mount: &Path) -> Option<PathBuf> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let relative = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(mount.join(relative.trim_start_matches('/')))
}

/// Field 2 (ppid) and 22 (start time) of `/proc/PID/stat`, counted after the
/// command name, which may itself contain spaces and parentheses.
fn stat_fields(pid: u32) -> Option<(u32, u64)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // after_comm starts at field 3 (state).
    let ppid = fields.get(1)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((ppid, start))
}

fn start_time(pid: u32) -> Option<u64> {
    stat_fields(pid).map(|(_, start)| start)
}

/// True if `pid` is a child, grandchild, ... of this process.
fn is_our_descendant(pid: u32) -> bool {
    let me = std::process::id();
    let mut current = pid;
    // Process trees are shallow; the bound guards against a corrupt read loop.
    for _ in 0..256 {
        let Some((ppid, _)) = stat_fields(current) else {
            return false;
        };
        if ppid == me {
            return true;
        }
        if ppid <= 1 {
            return false;
        }
        current = ppid;
    }
    false
}

/// Empties `dir` of processes according to the policy in the module docs.
fn evacuate(dir: &Path, mount: &Path) -> Result<()> {
    for pid in read_procs(dir)? {
        let Some(start) = start_time(pid) else {
            continue; // already gone
        };
        let origin = moved_in()
            .as_mut()
            .and_then(|map| map.remove(&(pid, start)));
        if let Some(origin) = origin {
            if write_pid(&origin, pid).is_err() {
                write_pid(mount, pid)?;
            }
        } else if pid != std::process::id() && is_our_descendant(pid) {
            match kill(Pid::from_raw(pid as i32), Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => {
                    return Err(TestbedError::io(
                        format!("cannot kill pid {pid} in {}", dir.display()),
                        e.into(),
                    ));
                }
            }
        } else {
            warn(format_args!(
                "pid {pid} was left in {} and is not ours to kill; moving it to the cgroup2 root",
                dir.display()
            ));
            write_pid(mount, pid)?;
        }
    }
    Ok(())
}

/// Removes `dir` and every cgroup below it, deepest first, evacuating
/// processes as it goes. Missing dirs are fine (a concurrent sweep).
pub(crate) fn remove_tree(dir: &Path, mount: &Path) -> Result<()> {
    remove_tree_at(dir, mount, 0)
}

fn remove_tree_at(dir: &Path, mount: &Path, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(TestbedError::Invalid(format!(
            "cgroup tree at {} is deeper than {MAX_DEPTH}",
            dir.display()
        )));
    }
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(TestbedError::io(
                format!("cannot list {}", dir.display()),
                e,
            ));
        }
    };
    for entry in entries.flatten() {
        // Cgroup control files are plain files; only dirs are child cgroups.
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree_at(&entry.path(), mount, depth + 1)?;
        }
    }
    rmdir_bounded(dir, mount)
}

fn rmdir_bounded(dir: &Path, mount: &Path) -> Result<()> {
    let start = Instant::now();
    let mut nap = Duration::from_millis(1);
    let mut attempts = 0;
    while attempts < RMDIR_ATTEMPTS && start.elapsed() < RMDIR_TIME {
        attempts += 1;
        match evacuate(dir, mount) {
            Ok(()) => {}
            Err(TestbedError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            // EBUSY: killed processes have not finished exiting yet.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => {
                return Err(TestbedError::io(
                    format!("cannot remove cgroup {}", dir.display()),
                    e,
                ));
            }
        }
        thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(50));
    }
    Err(TestbedError::CgroupBusy {
        path: dir.to_path_buf(),
        attempts,
        elapsed: start.elapsed(),
    })
}
