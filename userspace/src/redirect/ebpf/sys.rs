//! The few `bpf(2)` commands the upgrade needs that aya 0.14 keeps
//! crate-private (`bpf_link_update`) or only offers through typed maps (a
//! generic copy of any map's entries, whatever its key and value types).
//! Each `union bpf_attr` is spelled out with the fields used; the kernel
//! requires the bytes after them to be zero, which the `rest` arrays are.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;
/// `BPF_F_REPLACE`: the link is switched only while it still runs
/// `old_prog_fd`'s program (another agent cannot be overwritten unseen).
const BPF_F_REPLACE: u32 = 1 << 2;

/// `union bpf_attr` for the element commands.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    /// `value` or `next_key`.
    value: u64,
    flags: u64,
    rest: [u64; 4],
}

/// `union bpf_attr` for `BPF_LINK_DETACH`.
#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
    _pad: u32,
    rest: [u64; 4],
}

/// `union bpf_attr` for `BPF_LINK_UPDATE`.
#[repr(C)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
    rest: [u64; 4],
}

fn bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<()> {
    // SAFETY: `attr` is one of the `bpf_attr` prefixes above, zero-padded,
    // of the size passed; the pointers inside it point to buffers that
    // outlive the call and are as large as the map's key/value sizes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const T,
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Detaches the BPF link `link` from its hook now (`BPF_LINK_DETACH`),
/// whoever else holds it (its pin, another agent's descriptor): the
/// uninstall must not wait for the last reference to go.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    bpf(
        BPF_LINK_DETACH,
        &LinkDetachAttr {
            link_fd: link.as_raw_fd() as u32,
            _pad: 0,
            rest: [0; 4],
        },
    )
}

/// Switches the program of the BPF link `link` to `new` atomically
/// (`BPF_LINK_UPDATE`), provided it still runs `old`: the attach point never
/// runs without a program, and never both.
pub fn link_update(
    link: BorrowedFd<'_>,
    new: BorrowedFd<'_>,
    old: BorrowedFd<'_>,
) -> io::Result<()> {
    bpf(
        BPF_LINK_UPDATE,
        &LinkUpdateAttr {
            link_fd: link.as_raw_fd() as u32,
            new_prog_fd: new.as_raw_fd() as u32,
            flags: BPF_F_REPLACE,
            old_prog_fd: old.as_raw_fd() as u32,
            rest: [0; 4],
        },
    )
}

/// The key after `key` (the first key for `None`), or `None` at the end.
pub fn next_key(map: BorrowedFd<'_>, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let attr = ElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: key.map_or(0, |k| k.as_ptr() as u64),
        value: next.as_mut_ptr() as u64,
        flags: 0,
        rest: [0; 4],
    };
    match bpf(BPF_MAP_GET_NEXT_KEY, &attr) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The value under `key` (for per-CPU maps, one slot per possible CPU, each
/// rounded up to 8 bytes); `false` when the key is gone.
pub fn lookup(map: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let attr = ElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
        rest: [0; 4],
    };
    match bpf(BPF_MAP_LOOKUP_ELEM, &attr) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `value` under `key` (`BPF_ANY`).
pub fn update(map: BorrowedFd<'_>, key: &[u8], value: &[u8]) -> io::Result<()> {
    bpf(
        BPF_MAP_UPDATE_ELEM,
        &ElemAttr {
            map_fd: map.as_raw_fd() as u32,
            _pad: 0,
            key: key.as_ptr() as u64,
            value: value.as_ptr() as u64,
            flags: 0,
            rest: [0; 4],
        },
    )
}

/// Opens a pinned object (`BPF_OBJ_GET`): a link's fd, which aya 0.14's
/// `FdLink` does not hand out, or any pin whose kind is not known yet
/// (`pin_report`).
pub fn obj_get(pin: &std::path::Path) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::{fd::FromRawFd as _, unix::ffi::OsStrExt as _};
    const BPF_OBJ_GET: libc::c_long = 7;
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        _pad: 0,
    };
    // SAFETY: `attr` names a NUL-terminated path that outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &attr as *const ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us; we own it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}
