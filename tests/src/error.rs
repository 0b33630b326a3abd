//! The one error type of the testbed.

use std::{io, net::SocketAddr, path::PathBuf, time::Duration};

use shunt::netns::NetNsError;

/// Everything that can go wrong while building, using or tearing down a
/// topology. Command failures carry the full command line and its stderr so a
/// failing kernel test says exactly which `ip` invocation the kernel refused.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    #[error(
        "kernel tests need root: they create network namespaces and load eBPF programs; \
         run `sudo cargo xtask test` (effective uid is {euid})"
    )]
    NotRoot { euid: u32 },

    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        /// Program and arguments, space separated.
        command: String,
        status: String,
        stderr: String,
    },

    #[error("cannot run `{command}`: {source}")]
    Spawn { command: String, source: io::Error },

    #[error("`{command}` did not finish within {timeout:?} and was killed")]
    CommandTimeout { command: String, timeout: Duration },

    #[error(transparent)]
    NetNs(#[from] NetNsError),

    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },

    #[error("refusing to send traffic to {addr}: tests may only use 198.18.0.0/15 and loopback")]
    ForbiddenAddress { addr: SocketAddr },

    #[error("invalid topology request: {0}")]
    Invalid(String),

    #[error("no cgroup2 mount found in /proc/self/mounts")]
    NoCgroup2,

    #[error("cgroup {path} still exists after {attempts} attempts over {elapsed:?} to remove it")]
    CgroupBusy {
        path: PathBuf,
        attempts: u32,
        elapsed: Duration,
    },
}

impl TestbedError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

/// Shorthand used across the crate.
pub type Result<T, E = TestbedError> = std::result::Result<T, E>;
