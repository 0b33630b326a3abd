//! The ZDS socket: a unix socket of type `SOCK_SEQPACKET` (one message per
//! packet, boundaries kept by the kernel), non-blocking under tokio's
//! `AsyncFd`. The agent listens; ztunnel connects.

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
};

use nix::{
    errno::Errno,
    sys::socket::{
        AddressFamily, Backlog, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, accept4,
        bind, listen, recvmsg, sendmsg, socket,
    },
};
use tokio::io::unix::AsyncFd;

/// The largest packet read from ztunnel (a hello or an ack with its error
/// text); a longer one is refused as malformed rather than cut.
const MAX_PACKET: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("cannot listen on the ZDS socket {path}: {step}: {source}")]
    Listen {
        path: PathBuf,
        step: &'static str,
        source: std::io::Error,
    },
    #[error("ZDS socket {path}: something that is not a socket is in the way")]
    NotASocket { path: PathBuf },
    #[error("ZDS connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("ZDS connection: a packet longer than {MAX_PACKET} bytes")]
    Truncated,
}

/// Hands `fd` to the runtime's reactor.
fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the OwnedFd, which keeps the descriptor open
    // and unchanged until both are dropped together.
    unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
}

/// The listening socket.
pub struct SeqpacketListener {
    fd: AsyncFd<OwnedFd>,
    path: PathBuf,
}

impl SeqpacketListener {
    /// Listens at `path`, replacing a socket a previous agent left there
    /// (never anything else), creating its directory if needed.
    pub fn bind(path: &Path) -> Result<Self, SocketError> {
        let fail = |step: &'static str| {
            let path = path.to_path_buf();
            move |source: std::io::Error| SocketError::Listen { path, step, source }
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(fail("creating its directory"))?;
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                std::fs::remove_file(path).map_err(fail("removing the previous socket"))?
            }
            Ok(_) => {
                return Err(SocketError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
            Err(_) => {}
        }
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| fail("socket")(e.into()))?;
        let addr = UnixAddr::new(path).map_err(|e| fail("address")(e.into()))?;
        bind(fd.as_raw_fd(), &addr).map_err(|e| fail("bind")(e.into()))?;
        listen(&fd, Backlog::new(16).unwrap_or(Backlog::MAXCONN))
            .map_err(|e| fail("listen")(e.into()))?;
        let fd = register(fd).map_err(fail("registering with the runtime"))?;
        Ok(Self {
            fd,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for the next connection.
    pub async fn accept(&self) -> Result<SeqpacketConn, SocketError> {
        loop {
            let mut guard = self.fd.readable().await?;
            match accept4(
                self.fd.get_ref().as_raw_fd(),
                SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            ) {
                Ok(raw) => {
                    // SAFETY: accept4 returned a new descriptor we own.
                    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                    return Ok(SeqpacketConn {
                        fd: register(owned)?,
                    });
                }
                Err(Errno::EAGAIN) => guard.clear_ready(),
                Err(Errno::EINTR | Errno::ECONNABORTED) => continue,
                Err(e) => return Err(SocketError::Io(e.into())),
            }
        }
    }
}

impl Drop for SeqpacketListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One ztunnel connection.
pub struct SeqpacketConn {
    fd: AsyncFd<OwnedFd>,
}

impl SeqpacketConn {
    /// Sends `bytes` as one packet, with `fd` (if any) as its one
    /// SCM_RIGHTS descriptor.
    pub async fn send(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), SocketError> {
        let fds: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
        let rights = [ControlMessage::ScmRights(&fds)];
        let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
        loop {
            let mut guard = self.fd.writable().await?;
            let iov = [IoSlice::new(bytes)];
            match sendmsg::<UnixAddr>(
                self.fd.get_ref().as_raw_fd(),
                &iov,
                cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::EAGAIN) => guard.clear_ready(),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(SocketError::Io(e.into())),
            }
        }
    }

    /// The next packet; `None` once ztunnel closed the connection (a
    /// zero-length read: no ZDS message ztunnel sends is empty).
    pub async fn recv(&self) -> Result<Option<Vec<u8>>, SocketError> {
        let mut buf = vec![0u8; MAX_PACKET];
        loop {
            let mut guard = self.fd.readable().await?;
            let received = {
                let mut iov = [IoSliceMut::new(&mut buf)];
                // No control-message space: descriptors ztunnel might send
                // are discarded (closed) by the kernel.
                recvmsg::<UnixAddr>(
                    self.fd.get_ref().as_raw_fd(),
                    &mut iov,
                    None,
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
                .map(|msg| (msg.bytes, msg.flags))
            };
            match received {
                Ok((_, flags)) if flags.contains(MsgFlags::MSG_TRUNC) => {
                    return Err(SocketError::Truncated);
                }
                Ok((0, _)) => return Ok(None),
                Ok((len, _)) => {
                    buf.truncate(len);
                    return Ok(Some(buf));
                }
                Err(Errno::EAGAIN) => guard.clear_ready(),
                Err(Errno::EINTR) => continue,
                Err(Errno::ECONNRESET) => return Ok(None),
                Err(e) => return Err(SocketError::Io(e.into())),
            }
        }
    }
}
