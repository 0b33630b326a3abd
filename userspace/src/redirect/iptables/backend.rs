//! Finding the iptables binaries and running them inside a pod's netns.
//!
//! iptables comes in two backends that program different kernel subsystems:
//! `nf_tables` (iptables-nft, the default of current distributions) and the
//! legacy x_tables. Both can be installed side by side; rules written by one
//! are invisible to the other's `-save`, so one redirector uses exactly one
//! backend for every pod and every command.

use std::{
    ffi::OsString,
    fmt,
    io::{Read, Write},
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use super::IptablesError;
use crate::netns::NetNs;

/// The Debian package that ships every iptables binary used here.
const IPTABLES_PACKAGE: &str = "iptables";
/// The Debian package that ships `nsenter`.
const NSENTER_PACKAGE: &str = "util-linux";

/// iptables-restore and -save finish in milliseconds; anything near this
/// means the machine is wedged (or the legacy lock is held by someone stuck),
/// and the pod should fail rather than the agent hang.
pub(super) const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the legacy backend waits for the machine-wide xtables lock
/// (`--wait`); nft ignores it.
const LOCK_WAIT_SECONDS: &str = "10";

/// Where binaries are looked for besides `$PATH`: an agent started from a
/// minimal environment often has no sbin directory on its path.
const EXTRA_DIRS: &[&str] = &["/usr/sbin", "/sbin", "/usr/local/sbin", "/usr/bin", "/bin"];

/// The kernel side iptables programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `iptables-nft`: nf_tables through the iptables syntax.
    Nft,
    /// `iptables-legacy`: the x_tables kernel API.
    Legacy,
}

impl Backend {
    fn suffix(self) -> &'static str {
        match self {
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        }
    }

    /// What `--version` prints in parentheses for this backend.
    fn version_tag(self) -> &'static str {
        match self {
            Backend::Nft => "(nf_tables)",
            Backend::Legacy => "(legacy)",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suffix())
    }
}

/// `iptables-restore` and `iptables-save` of one address family.
#[derive(Clone, Debug)]
pub(super) struct FamilyTools {
    pub restore: PathBuf,
    pub save: PathBuf,
}

/// Every binary the redirector runs, resolved once at start.
#[derive(Clone, Debug)]
pub(super) struct Tools {
    pub backend: Backend,
    pub nsenter: PathBuf,
    pub v4: FamilyTools,
    /// `None` when the kernel has no IPv6 at all (`ipv6.disable=1`).
    pub v6: Option<FamilyTools>,
}

impl Tools {
    /// Finds the binaries. With `prefer`, only that backend is accepted;
    /// without, the nft binaries win when both are installed (what current
    /// distributions default to), then whatever plain `iptables-restore` is.
    pub fn detect(prefer: Option<Backend>, ipv6: bool) -> Result<Tools, IptablesError> {
        let nsenter = find("nsenter").ok_or_else(|| missing("nsenter", NSENTER_PACKAGE))?;
        let (backend, v4) = match prefer {
            Some(backend) => (backend, family_tools("iptables", backend)?),
            None => [Backend::Nft, Backend::Legacy]
                .into_iter()
                .find_map(|backend| {
                    family_tools("iptables", backend)
                        .ok()
                        .map(|tools| (backend, tools))
                })
                .ok_or_else(|| missing("iptables-restore", IPTABLES_PACKAGE))?,
        };
        let v6 = if ipv6 {
            Some(family_tools("ip6tables", backend)?)
        } else {
            None
        };
        Ok(Tools {
            backend,
            nsenter,
            v4,
            v6,
        })
    }

    /// Runs `binary args…` inside `netns` via nsenter, feeding it `stdin`,
    /// and returns its stdout.
    ///
    /// nsenter enters the namespace through our own open descriptor
    /// (`/proc/<pid>/fd/<n>`), which stays valid while we hold it even if
    /// the namespace's bind mount is removed first; errors name the path the
    /// operator knows.
    pub fn run_in(
        &self,
        netns: &NetNs,
        binary: &Path,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, IptablesError> {
        let mut net = OsString::from("--net=");
        net.push(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            netns.as_fd().as_raw_fd()
        ));
        let mut command = Command::new(&self.nsenter);
        command.arg(net).arg("--").arg(binary).args(args);
        let line = format!(
            "nsenter --net={} -- {} {}",
            netns.path().display(),
            binary.display(),
            args.join(" ")
        );
        run(command, &line, stdin)
    }

    /// Extra arguments every `-restore` gets: keep what is not ours, and wait
    /// for the legacy lock instead of failing when another writer holds it.
    pub fn restore_args(&self) -> &'static [&'static str] {
        &["--noflush", "--wait", LOCK_WAIT_SECONDS]
    }
}

/// The `-restore`/`-save` pair of `program` (`iptables` or `ip6tables`) for
/// `backend`: the suffixed binaries (`iptables-nft-restore`), else the plain
/// ones if their `--version` says they are that backend.
fn family_tools(program: &'static str, backend: Backend) -> Result<FamilyTools, IptablesError> {
    let suffixed = |tool: &str| format!("{program}-{}-{tool}", backend.suffix());
    let plain = |tool: &str| format!("{program}-{tool}");
    let candidates = [
        (find(&suffixed("restore")), find(&suffixed("save"))),
        (find(&plain("restore")), find(&plain("save"))),
    ];
    let mut wrong_backend = None;
    for (restore, save) in candidates {
        let (Some(restore), Some(save)) = (restore, save) else {
            continue;
        };
        let version = version_of(&restore)?;
        if version.contains(backend.version_tag()) {
            return Ok(FamilyTools { restore, save });
        }
        wrong_backend = Some((restore, version));
    }
    Err(match wrong_backend {
        Some((binary, version)) => IptablesError::WrongBackend {
            binary,
            version,
            expected: backend,
        },
        None => missing(
            match program {
                "ip6tables" => "ip6tables-restore",
                _ => "iptables-restore",
            },
            IPTABLES_PACKAGE,
        ),
    })
}

fn version_of(binary: &Path) -> Result<String, IptablesError> {
    let mut command = Command::new(binary);
    command.arg("--version");
    let line = format!("{} --version", binary.display());
    run(command, &line, None).map(|out| out.trim().to_string())
}

fn missing(binary: &'static str, package: &'static str) -> IptablesError {
    IptablesError::MissingBinary {
        binary,
        package,
        searched: search_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(":"),
    }
}

fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect())
        .unwrap_or_default();
    for extra in EXTRA_DIRS {
        let extra = PathBuf::from(extra);
        if !dirs.contains(&extra) {
            dirs.push(extra);
        }
    }
    dirs
}

/// The first executable file named `name` in the search directories.
fn find(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    search_dirs().into_iter().map(|d| d.join(name)).find(|p| {
        std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// Runs `command` to completion, bounded by [`COMMAND_TIMEOUT`]; a non-zero
/// exit is an error carrying the command line and its stderr.
fn run(mut command: Command, line: &str, stdin: Option<&str>) -> Result<String, IptablesError> {
    let mut child = command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| IptablesError::Spawn {
            command: line.to_string(),
            source,
        })?;
    let input = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    // Every pipe on its own thread: a child blocked writing a full stderr
    // pipe must not deadlock against us writing its stdin.
    let (status, out, err) = thread::scope(|scope| {
        let writer = scope.spawn(move || {
            if let (Some(mut pipe), Some(data)) = (input, stdin) {
                // A child that exits early closes the pipe; its exit status
                // and stderr then say why, so the write error adds nothing.
                let _ = pipe.write_all(data.as_bytes());
            }
        });
        let out = scope.spawn(move || read_all(stdout));
        let err = scope.spawn(move || read_all(stderr));
        let status = wait_bounded(&mut child);
        if status.is_none() {
            // Our own child, by its handle.
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = writer.join();
        (
            status,
            out.join().unwrap_or_default(),
            err.join().unwrap_or_default(),
        )
    });
    match status {
        None => Err(IptablesError::Timeout {
            command: line.to_string(),
            timeout: COMMAND_TIMEOUT,
        }),
        Some(Err(source)) => Err(IptablesError::Spawn {
            command: line.to_string(),
            source,
        }),
        Some(Ok(status)) if status.success() => Ok(out),
        Some(Ok(status)) => Err(IptablesError::Failed {
            command: line.to_string(),
            status: status.to_string(),
            stderr: err.trim().to_string(),
        }),
    }
}

fn read_all(pipe: Option<impl Read>) -> String {
    let mut bytes = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Polls with a growing nap: these commands usually exit within a few
/// milliseconds, so short first naps keep enrolment fast.
fn wait_bounded(child: &mut std::process::Child) -> Option<std::io::Result<ExitStatus>> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(200);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(Ok(status)),
            Ok(None) => {}
            Err(e) => return Some(Err(e)),
        }
        if start.elapsed() >= COMMAND_TIMEOUT {
            return None;
        }
        thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(20));
    }
}
