//! The socket-level programs (`connect4`, `connect6`, `sockops`), attached
//! once per agent to its cgroup root through BPF links pinned under
//! `<pin dir>/links/`. A pinned link outlives the agent, so a restart (even
//! after `kill -9`) never leaves a moment without outbound capture; a new
//! agent finds the pins and keeps them.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSockAddr, SockOps,
        links::{FdLink, PinnedLink},
    },
};
use shunt_common::programs;
use tracing::info;

use super::LoadError;

/// The socket programs, by name.
pub const PROGRAMS: [&str; 3] = [programs::CONNECT4, programs::CONNECT6, programs::SOCKOPS];

/// Where the links are pinned.
pub fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

/// Attaches each socket program to `cgroup_root` unless a pinned link from a
/// previous agent is already there (then that link is kept as it is).
pub fn attach_or_adopt(
    ebpf: &mut Ebpf,
    cgroup_root: &Path,
    pin_dir: &Path,
) -> Result<(), LoadError> {
    let dir = links_dir(pin_dir);
    std::fs::create_dir_all(&dir).map_err(|source| LoadError::PinDir {
        dir: dir.clone(),
        source,
    })?;
    let cgroup = File::open(cgroup_root).map_err(|source| LoadError::CgroupRoot {
        path: cgroup_root.to_path_buf(),
        source,
    })?;
    for name in PROGRAMS {
        let pin = dir.join(name);
        if PinnedLink::from_pin(&pin).is_ok() {
            info!(program = name, pin = %pin.display(), "socket program already attached by a previous agent; keeping it");
            continue;
        }
        // A pin that no longer opens as a link is garbage.
        let _ = std::fs::remove_file(&pin);
        let program = ebpf.program_mut(name).ok_or(LoadError::Program {
            name,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?;
        let program_error = |source| LoadError::Program { name, source };
        // A BPF link always attaches in multi-program mode (other agents and
        // tools keep theirs); the kernel refuses link_create with any attach
        // flag, so "Single" (no flag) is the one that works here.
        let mode = CgroupAttachMode::Single;
        let link: FdLink = if name == programs::SOCKOPS {
            let program: &mut SockOps = program.try_into().map_err(program_error)?;
            program.load().map_err(program_error)?;
            let id = program.attach(&cgroup, mode).map_err(program_error)?;
            let link = program.take_link(id).map_err(program_error)?;
            FdLink::try_from(link).map_err(|e| LoadError::Link {
                name,
                detail: e.to_string(),
            })?
        } else {
            let program: &mut CgroupSockAddr = program.try_into().map_err(program_error)?;
            program.load().map_err(program_error)?;
            let id = program.attach(&cgroup, mode).map_err(program_error)?;
            let link = program.take_link(id).map_err(program_error)?;
            FdLink::try_from(link).map_err(|e| LoadError::Link {
                name,
                detail: e.to_string(),
            })?
        };
        link.pin(&pin).map_err(|e| LoadError::Link {
            name,
            detail: format!("pinning at {}: {e}", pin.display()),
        })?;
        info!(program = name, cgroup = %cgroup_root.display(), pin = %pin.display(), "socket program attached");
    }
    Ok(())
}

/// Which socket programs are attached (their pinned links open).
pub fn present(pin_dir: &Path) -> [bool; 3] {
    let dir = links_dir(pin_dir);
    PROGRAMS.map(|name| PinnedLink::from_pin(dir.join(name)).is_ok())
}

/// The cgroup v2 mount point, from /proc/self/mounts.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .find(|line| line.split_whitespace().nth(2) == Some("cgroup2"))
        .and_then(|line| line.split_whitespace().nth(1))
        .map(PathBuf::from)
}
