//! ztunnel's end of ZDS as its `inpod/` speaks it: a SEQPACKET unix
//! socket, `ZdsHello{V1}`, each request read with its SCM_RIGHTS fds, an
//! `Ack` per request.

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::Path,
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::socket::{
        AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr, connect,
        recvmsg, sendmsg, setsockopt, socket, sockopt::ReceiveTimeout,
    },
    sys::time::TimeVal,
};
use prost::Message as _;
use shunt_proto::istio::zds::{
    Ack, Version, WorkloadRequest, WorkloadResponse, ZdsHello, workload_request::Payload,
    workload_response,
};

use super::TIMEOUT;

/// ztunnel's end of a ZDS connection.
pub struct ZdsClient {
    fd: OwnedFd,
}

impl ZdsClient {
    /// Connects to the agent's socket, waiting (bounded) for it to exist.
    pub fn connect(path: &Path) -> std::io::Result<ZdsClient> {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        let addr = UnixAddr::new(path)?;
        let deadline = Instant::now() + TIMEOUT;
        while let Err(e) = connect(fd.as_raw_fd(), &addr) {
            if Instant::now() >= deadline {
                return Err(e.into());
            }
            thread::sleep(Duration::from_millis(20));
        }
        setsockopt(
            &fd,
            ReceiveTimeout,
            &TimeVal::new(TIMEOUT.as_secs() as i64, 0),
        )?;
        Ok(ZdsClient { fd })
    }

    pub fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        sendmsg::<UnixAddr>(
            self.fd.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &[],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )?;
        Ok(())
    }

    pub fn hello(&self) -> std::io::Result<()> {
        self.send(
            &ZdsHello {
                version: Version::V1 as i32,
            }
            .encode_to_vec(),
        )
    }

    pub fn ack(&self) -> std::io::Result<()> {
        self.send(
            &WorkloadResponse {
                payload: Some(workload_response::Payload::Ack(Ack::default())),
            }
            .encode_to_vec(),
        )
    }

    /// The next request with the descriptors it carried (within the
    /// receive timeout); an error when the agent closed the connection.
    pub fn recv(&self) -> std::io::Result<(Payload, Vec<OwnedFd>)> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let (len, fds) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<UnixAddr>(
                self.fd.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )?;
            let mut fds = Vec::new();
            for cmsg in msg.cmsgs()? {
                if let ControlMessageOwned::ScmRights(raw) = cmsg {
                    // SAFETY: SCM_RIGHTS installed these descriptors for us.
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            (msg.bytes, fds)
        };
        if len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the agent closed the ZDS connection",
            ));
        }
        let request = WorkloadRequest::decode(&buf[..len])
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let payload = request.payload.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "a request without payload")
        })?;
        Ok((payload, fds))
    }
}
