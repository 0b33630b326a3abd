//! The socket-level programs (`connect4`, `connect6`, `sockops`,
//! `getsockopt`, `getpeername4/6`, and DNS capture's `sendmsg4/6`, `recvmsg4/6`), attached
//! once per agent to its cgroup root through BPF links pinned under
//! `<pin dir>/links/`. A pinned link outlives the agent, so a restart (even
//! after `kill -9`) never leaves a moment without outbound capture; a new
//! agent finds the pins and keeps them, switching a link to its own program
//! in place when the release's program differs (`upgrade.rs`).

use std::{
    fs::File,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSockAddr, CgroupSockopt, SockOps,
        links::{FdLink, PinnedLink},
    },
};
use shunt_common::programs;
use tracing::info;

use super::{
    LoadError,
    upgrade::{Decision, Upgrade},
};

/// The socket programs, by name. The DNS capture's four come last (see
/// [`DNS_PROGRAMS`]): they are `CgroupSockAddr` programs like connect4/6,
/// attached and adopted the same way (an agent that finds their links
/// missing, e.g. after an older version, attaches them).
pub const PROGRAMS: [&str; 10] = [
    programs::CONNECT4,
    programs::CONNECT6,
    programs::SOCKOPS,
    programs::GETSOCKOPT,
    // Flow 2 through a service VIP: the VIP back to the application.
    programs::GETPEERNAME4,
    programs::GETPEERNAME6,
    programs::DNS_SENDMSG4,
    programs::DNS_SENDMSG6,
    programs::DNS_RECVMSG4,
    programs::DNS_RECVMSG6,
];

/// The socket programs of DNS capture (`ebpf/src/dns.rs`): shown among a
/// pod's hooks only when its DNS is captured.
pub const DNS_PROGRAMS: [&str; 4] = [
    programs::DNS_SENDMSG4,
    programs::DNS_SENDMSG6,
    programs::DNS_RECVMSG4,
    programs::DNS_RECVMSG6,
];

/// Where the links are pinned.
pub fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

/// Attaches each socket program to `cgroup_root`, or, where a previous
/// agent's pinned link is already there, keeps it when it runs this
/// release's program and otherwise switches the link to this release's
/// program in place (`BPF_LINK_UPDATE` with `BPF_F_REPLACE`: atomic, the
/// hook never runs without a program; `upgrade.rs` decides).
pub fn attach_or_adopt(
    ebpf: &mut Ebpf,
    cgroup_root: &Path,
    pin_dir: &Path,
    upgrade: &mut Upgrade,
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
        let program = ebpf.program_mut(name).ok_or(LoadError::Program {
            name,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?;
        let program_error = |source| LoadError::Program { name, source };
        // Loaded (verified) in any case: its tag is what an adopted link's
        // program is compared with.
        match name {
            programs::GETSOCKOPT => {
                let program: &mut CgroupSockopt = program.try_into().map_err(program_error)?;
                program.load().map_err(program_error)?;
            }
            programs::SOCKOPS => {
                let program: &mut SockOps = program.try_into().map_err(program_error)?;
                program.load().map_err(program_error)?;
            }
            _ => {
                let program: &mut CgroupSockAddr = program.try_into().map_err(program_error)?;
                program.load().map_err(program_error)?;
            }
        }
        let new_info = ebpf
            .program(name)
            .ok_or(LoadError::Program {
                name,
                source: aya::programs::ProgramError::UnexpectedProgramType,
            })?
            .info()
            .map_err(program_error)?;
        if let Ok(pinned) = PinnedLink::from_pin(&pin) {
            adopt(ebpf, name, &pin, pinned, &new_info, upgrade)?;
            continue;
        }
        // A pin that no longer opens as a link is garbage.
        let _ = std::fs::remove_file(&pin);
        let program = ebpf.program_mut(name).ok_or(LoadError::Program {
            name,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?;
        // A BPF link always attaches in multi-program mode (other agents and
        // tools keep theirs); the kernel refuses link_create with any attach
        // flag, so "Single" (no flag) is the one that works here.
        let mode = CgroupAttachMode::Single;
        if name == programs::GETSOCKOPT {
            let program: &mut CgroupSockopt = program.try_into().map_err(program_error)?;
            let fd = program.fd().map_err(program_error)?;
            link_and_pin(fd.as_fd(), &cgroup, BPF_CGROUP_GETSOCKOPT, &pin)
                .map_err(|detail| LoadError::Link { name, detail })?;
        } else {
            let link: FdLink = if name == programs::SOCKOPS {
                let program: &mut SockOps = program.try_into().map_err(program_error)?;
                let id = program.attach(&cgroup, mode).map_err(program_error)?;
                let link = program.take_link(id).map_err(program_error)?;
                FdLink::try_from(link).map_err(|e| LoadError::Link {
                    name,
                    detail: e.to_string(),
                })?
            } else {
                let program: &mut CgroupSockAddr = program.try_into().map_err(program_error)?;
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
        }
        upgrade.record("cgroup".into(), None, name, None, &new_info, None);
        info!(program = name, cgroup = %cgroup_root.display(), pin = %pin.display(), "socket program attached");
    }
    Ok(())
}

/// A previous agent's link of `name` at `pin`: kept, or switched to this
/// release's (loaded) program.
fn adopt(
    ebpf: &Ebpf,
    name: &'static str,
    pin: &Path,
    pinned: PinnedLink,
    new_info: &aya::programs::ProgramInfo,
    upgrade: &mut Upgrade,
) -> Result<(), LoadError> {
    let link_error = |detail: String| LoadError::Link { name, detail };
    let old_id = FdLink::from(pinned)
        .info()
        .map_err(|e| link_error(format!("reading the pinned link {}: {e}", pin.display())))?
        .program_id();
    let decision = upgrade.decide(old_id, new_info);
    if let Decision::Replace(_) = decision {
        let link = super::sys::obj_get(pin)
            .map_err(|e| link_error(format!("opening {}: {e}", pin.display())))?;
        let old = upgrade
            .adopted_fd(old_id)
            .ok_or_else(|| link_error(format!("the adopted program {old_id} is gone")))?;
        let new = ebpf
            .program(name)
            .ok_or_else(|| link_error("not in the object".into()))?
            .fd()
            .map_err(|e| link_error(e.to_string()))?;
        super::sys::link_update(link.as_fd(), new.as_fd(), old.as_fd())
            .map_err(|e| link_error(format!("BPF_LINK_UPDATE of {}: {e}", pin.display())))?;
    } else {
        info!(program = name, pin = %pin.display(), "socket program attached by a previous agent is this release's; keeping it");
    }
    upgrade.record(
        "cgroup".into(),
        None,
        name,
        Some(old_id),
        new_info,
        Some(decision),
    );
    Ok(())
}

/// `BPF_CGROUP_GETSOCKOPT` in the kernel's `enum bpf_attach_type`.
const BPF_CGROUP_GETSOCKOPT: u32 = 21;

/// Creates a BPF link of `program` on `cgroup` and pins it at `pin`, with
/// the raw `bpf(2)` commands: aya 0.14 cannot turn a `CgroupSockopt` link
/// into an `FdLink` to pin. The link fd is closed once pinned (the pin
/// holds the link).
fn link_and_pin(
    program: std::os::fd::BorrowedFd<'_>,
    cgroup: &File,
    attach_type: u32,
    pin: &Path,
) -> Result<(), String> {
    use std::os::fd::{FromRawFd, OwnedFd};
    const BPF_OBJ_PIN: libc::c_long = 6;
    const BPF_LINK_CREATE: libc::c_long = 28;
    /// `union bpf_attr` for `BPF_LINK_CREATE` (the fields used; the rest
    /// must be zero).
    #[repr(C)]
    struct LinkCreate {
        prog_fd: u32,
        target_fd: u32,
        attach_type: u32,
        flags: u32,
        rest: [u64; 6],
    }
    /// `union bpf_attr` for `BPF_OBJ_PIN`.
    #[repr(C)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        pad: u32,
    }
    let attr = LinkCreate {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: cgroup.as_raw_fd() as u32,
        attach_type,
        flags: 0,
        rest: [0; 6],
    };
    // SAFETY: `attr` is a valid, zero-padded `bpf_attr` prefix of the size
    // passed; the kernel only reads it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &attr as *const LinkCreate,
            std::mem::size_of::<LinkCreate>(),
        )
    };
    if fd < 0 {
        return Err(format!(
            "BPF_LINK_CREATE: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: the kernel just returned this descriptor; we own it.
    let link = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("pin path {} contains a NUL byte", pin.display()))?;
    let attr = ObjPin {
        pathname: path.as_ptr() as u64,
        bpf_fd: link.as_raw_fd() as u32,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    // SAFETY: as above; `path` outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_PIN,
            &attr as *const ObjPin,
            std::mem::size_of::<ObjPin>(),
        )
    };
    if rc < 0 {
        // Dropping the fd detaches the link again.
        return Err(format!(
            "pinning at {}: {}",
            pin.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Which socket programs are attached (their pinned links open).
pub fn present(pin_dir: &Path) -> [bool; PROGRAMS.len()] {
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
